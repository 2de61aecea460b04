"""Model sources: GGUF files, Hugging Face folders and pocketlm deploy files.

Every importer produces a :class:`SourceModel`: the config, the tokenizer, the chat template and
the tensors under pocketlm's names (see :mod:`pocketlm.config`). Name and key translations are
tables at this boundary; an importer that ends with a tensor it did not map raises.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import GenerationDefaults, ModelConfig
from ..data.download import sha256_of
from ..errors import FormatError, ModelNotFoundError, PocketError, UnsupportedError
from ..quant import QuantTensor
from .pocketfile import open_regular, os_error


@dataclass
class SourceTensor:
    """One tensor of a source model, loaded lazily.

    ``to_float`` gives float32 values; ``to_quant(bits, group_size)`` gives the tensor in a
    pocketlm layout without requantizing when the source's grid allows it (else None).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # source type name (F32, F16, BF16, Q4_1, Q4_K, ...)
    to_float: Callable[[], np.ndarray]
    to_quant: Callable[[int, int], QuantTensor | None] = lambda bits, gs: None
    # the source's own bytes, rows in the model's order (a GGUF's blocks), or None: a pack may
    # store a tensor in them when they decode to its layout (pocketlm.quant.encode_as_source)
    raw: Callable[[], np.ndarray] | None = None


@dataclass
class SourceModel:
    config: ModelConfig
    tokenizer: Any  # pocketlm.tokenizer.Tokenizer
    chat_template: str | None
    tensors: dict[str, SourceTensor]
    provenance: dict[str, Any] = field(default_factory=dict)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    # a trimmed vocabulary (pocketlm.vocab): how it was chosen, and each kept piece's source id
    vocab: dict[str, Any] | None = None
    vocab_source_ids: np.ndarray | None = None
    # LoRA adapters kept beside the weights (pocketlm.runtime.adapters): {stem: (A float32
    # [rank, in], B float32 [out, rank], the scale folded in)}, and how they were made
    adapters: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    adapter: dict[str, Any] | None = None

    def check_tensors(self, origin: str) -> None:
        """The tensors must be exactly the ones the config calls for, with the right shapes."""
        expected = self.config.tensor_shapes()
        missing = sorted(set(expected) - set(self.tensors))
        extra = sorted(set(self.tensors) - set(expected))
        if missing:
            raise FormatError(f"{origin}: missing tensors {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
        if extra:
            raise UnsupportedError(f"{origin}: tensors that pocketlm does not know how to use: "
                                   f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
        for name, shape in expected.items():
            if tuple(self.tensors[name].shape) != tuple(shape):
                raise FormatError(f"{origin}: tensor {name} has shape "
                                  f"{tuple(self.tensors[name].shape)}, expected {tuple(shape)}")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    with open_regular(path, missing=ModelNotFoundError) as f:
        try:
            return sha256_of(f, chunk=chunk)
        except OSError as e:
            raise os_error(Path(path), e) from None


def sniff(path: str | Path) -> str:
    """'gguf', 'hf', 'pocket', 'run' (a pocketlm training run), 'trimmed' (a trimmed registry
    model's ``.trim.json``) or raise: which importer handles this path."""
    p = Path(path)
    try:
        is_dir = p.is_dir()
        if is_dir:
            if (p / "config.json").is_file():
                return "hf"
            if (p / "checkpoint.pt").is_file():
                return "run"
        elif not p.exists():
            raise ModelNotFoundError(f"{p}: no such file or folder")
    except OSError as e:  # a folder on the way that this process may not search
        raise os_error(p, e) from None
    if is_dir:
        raise FormatError(f"{p}: a folder without config.json is not a Hugging Face model "
                          "folder (nor a training run: no checkpoint.pt)")
    with open_regular(p, missing=ModelNotFoundError) as f:
        try:
            head = f.read(16)
        except OSError as e:
            raise os_error(p, e) from None
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:1] == b"{" and p.name.endswith(".trim.json"):
        return "trimmed"
    if len(head) >= 9 and head[8:9] == b"{":
        return "pocket"
    raise FormatError(f"{p}: not a model file pocketlm reads (expected a .pocket deploy file, a "
                      f"GGUF file or a Hugging Face folder; found bytes {head[:8]!r})")


def run_checkpoint(run: str | Path) -> Path:
    """The checkpoint file a training run folder stands for: ``best.pt`` (the early-stopping
    best weights) when the run kept one, else ``checkpoint.pt`` (the latest)."""
    run = Path(run)
    return run / "best.pt" if (run / "best.pt").is_file() else run / "checkpoint.pt"


# Openers of the source kinds that live in higher layers (a training run: the training package,
# which imports torch), by kind. They are registered as entry points of this group in
# pyproject.toml, so that this layer names none of them in an import; the defaults below stand
# where the installed package's metadata predates an entry point (an older editable install) or
# the package is run from a source tree without being installed.
SOURCE_GROUP = "pocketlm.sources"
DEFAULT_OPENERS = {"run": "pocketlm.train.export:checkpoint_source"}


def source_opener(kind: str) -> Callable[[str | Path], SourceModel]:
    """The function registered (entry point group :data:`SOURCE_GROUP`) to open a source of
    ``kind``, loaded on first use."""
    found = importlib.metadata.entry_points(group=SOURCE_GROUP).select(name=kind)
    point = next(iter(found), None)
    if point is None:
        if kind not in DEFAULT_OPENERS:
            raise UnsupportedError(f"no reader registered for {kind!r} sources")
        point = importlib.metadata.EntryPoint(kind, DEFAULT_OPENERS[kind], SOURCE_GROUP)
    return point.load()


def open_source(path: str | Path) -> SourceModel:
    """Read a GGUF file, a Hugging Face folder or a training run (its best weights under early
    stopping, else the latest checkpoint; not a deploy file: those load directly)."""
    kind = sniff(path)
    if kind == "gguf":
        from .gguf import read_gguf

        return read_gguf(path)
    if kind == "hf":
        from .hf import read_hf

        return read_hf(path)
    if kind == "trimmed":
        from ..vocab import open_trimmed

        return open_trimmed(path)
    if kind == "run":
        if importlib.util.find_spec("torch") is None:  # the training package imports it
            raise PocketError(f"{path}: reading a training run needs PyTorch: install the "
                              "train extra (pip install '.[train]' in pocketlm's folder, or "
                              "pip install torch)")
        return source_opener("run")(path)
    raise FormatError(f"{path}: is already a pocketlm deploy file; nothing to import")
