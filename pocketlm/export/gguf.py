"""Export a deploy file as a GGUF file that llama.cpp (and its phone bindings) load.

``pocket export SRC --to gguf -o model.gguf`` calls :func:`export_gguf`. The writer is the
inverse of the importer (:mod:`pocketlm.formats.gguf`), so ``pocket pack model.gguf`` gives the
deploy file's tensors back; the checks against llama.cpp itself are in
``tests/test_export_gguf.py``.

**Architecture.** Each family maps to the GGUF architecture whose graph computes it exactly:

=========  =======  ==============================================================
family     GGUF     notes
=========  =======  ==============================================================
llama      llama    q/k rows permuted back to ggml's interleaved RoPE pairs
qwen2      qwen2    q/k/v biases (zeros written when the model has none)
qwen3      qwen3    QK-norm, no biases
pocket     qwen3    pocketlm's own family is llama + QK-norm + tied head: qwen3's graph
gemma3     gemma3   norms as stored (the ``1 + w`` is already folded in); llama.cpp fixes
                    every 6th layer global, the local RoPE base 10000, the embedding
                    scale sqrt(d_model) and the attention scale: a config that differs
                    is refused
=========  =======  ==============================================================

Anything the GGUF graph would compute differently (a sliding window outside gemma3, another
activation, a custom attention or embedding scale, biases together with QK-norm) is refused in
one line before anything is written.

**Weights.** Every pocketlm layout is a ggml block type in disguise, so weights are copied, not
requantized: the same 4-, 5- or 8-bit integers and the same float16 scales, only interleaved
into ggml's 32-value blocks.

=====================================  ======  ==========================================
deploy file layout                     GGUF    block (bytes)
=====================================  ======  ==========================================
INT4, minimums ``-8 * scale``          Q4_0    f16 d, 16 nibble bytes (18)
INT4, asymmetric                       Q4_1    f16 d, f16 m, 16 nibble bytes (20)
INT5, minimums ``-16 * scale``         Q5_0    f16 d, 4 high-bit bytes, 16 nibble bytes (22)
INT5, asymmetric                       Q5_1    f16 d, f16 m, then as Q5_0 (24)
INT8                                   Q8_0    f16 d, 32 int8 (34)
float32 (norms, biases)                F32
=====================================  ======  ==========================================

pocketlm's nibble and high-bit order within a 32-value block is ggml's (see
:mod:`pocketlm.quant`), so a block is the group's scale (and minimum) followed by the packed
bytes unchanged. Groups of 64 or 128 become 2 or 4 blocks carrying the same scale and minimum:
still exact. A tensor is converted a slice of rows at a time and written straight to the file,
so memory holds one slice, never the model; the few rows of each tensor decoded back with the
``gguf`` library's own dequantizer must equal the deploy file's values, or the export stops.

**A head patch** (:mod:`pocketlm.head_patch`: INT8 rows computed over an INT4 head's) has no
place beside the head: a GGUF tensor has one type. The head is written as ``output.weight`` in
Q8_0, quantized (by the ``gguf`` library, bit for bit ggml's reference) from the patched head's
float values a slice of rows at a time: the patch's rows come out as its own INT8 blocks (a
group whose largest ``|q|`` is 127 requantizes to the same scale and integers), the INT4 rows
are rounded to Q8_0's grid (within 0.56 of its step ``max |w| / 127`` per weight of a 32-value
block, the float16 scale's rounding included). A tied head becomes untied, as for Hugging Face: ``token_embd.weight`` keeps the INT4
rows the lookups read, and llama.cpp's llama, qwen2, qwen3 and gemma3 loaders take an
``output.weight`` when the file has one.

**Tokenizer.** The deploy file's tokenizer becomes the ``tokenizer.ggml.*`` keys, checked on
probe texts against the tokenizer llama.cpp will build from them, in
:mod:`pocketlm.export.gguf_vocab`: a vocabulary no GGUF tokenizer reproduces is refused before
anything is written. BOS/EOS, the chat template and the generation defaults that have GGUF
keys (``general.sampling.*``) go along.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..chat import FAMILY_TEMPLATES
from ..config import GenerationDefaults, ModelConfig
from ..errors import PocketError, UnsupportedError
from ..formats.gguf import (
    GEMMA3_ROPE_LOCAL,
    GEMMA3_SWA_PATTERN,
    GLOBAL_NAMES,
    LAYER_NAMES,
    SAMPLING_KEYS,
)
from ..formats.pocketfile import PocketFile
from ..head_patch import PATCH, PATCH_IDS, PatchedHead, patched_head_for_export
from ..quant import BLOCK, QuantTensor, find_zero_point
from ..tokenizer import Tokenizer, release_free_heap
from . import atomic_file, refuse_adapters
from .gguf_vocab import PROBE_TEXTS, first_difference, probe_texts, tokenizer_fields

# PROBE_TEXTS and tokenizer_fields live in gguf_vocab (the tokenizer half); exported here too
__all__ = ["ExportReport", "PROBE_TEXTS", "TensorExport", "export_gguf", "ggml_blocks",
           "ggml_type", "gguf_architecture", "permute_rows", "tokenizer_fields"]

# pocketlm family -> GGUF architecture (module docstring)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "pocket": "qwen3",
                 "gemma3": "gemma3"}

# pocketlm name -> GGUF name: the importer's tables, inverted
_TO_GGUF_LAYER = {ours: theirs for theirs, ours in LAYER_NAMES.items()}
_TO_GGUF_GLOBAL = {ours: theirs for theirs, ours in GLOBAL_NAMES.items()}

# ggml block: bytes per 32 values
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
# the general.file_type of a file whose linear weights are mostly of a type
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}
_SLICE_BYTES = 8 << 20  # output bytes converted at a time

# -------------------------------------------------------------------------------- the report
@dataclass
class TensorExport:
    """How one tensor was written."""

    name: str  # GGUF name
    source: str  # the deploy file's layout: "int4 g32", "int5 g64 zp16", "f32", ...
    gguf_type: str  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F32
    nbytes: int
    # "copied" (same integers and scales) | "float" | "added" (zero biases) | "requantized"
    # (a patched head, quantized to Q8_0 from its float values)
    how: str
    rel_error: float = 0.0  # ||written - deploy file|| / ||deploy file||: 0 where lossless


@dataclass
class ExportReport:
    path: Path
    source: Path
    architecture: str
    file_bytes: int
    seconds: float
    peak_rss_bytes: int  # the process's peak resident set (getrusage), the export included
    tensors: list[TensorExport] = field(default_factory=list)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def type_counts(self) -> dict[str, int]:
        """GGUF type -> number of tensors written in it."""
        return dict(Counter(t.gguf_type for t in self.tensors).most_common())

    def summary(self) -> str:
        copied = sum(t.how == "copied" for t in self.tensors)
        floats = sum(t.how in ("float", "added") for t in self.tensors)
        requantized = sum(t.how == "requantized" for t in self.tensors)
        types = ", ".join(f"{k} x{v}" for k, v in self.type_counts().items())
        worst = max((t.rel_error for t in self.tensors), default=0.0)
        tok = self.tokenizer
        lines = [
            f"wrote {self.path} ({self.file_bytes / 1e6:.1f} MB, GGUF {self.architecture}) in "
            f"{self.seconds:.1f} s, peak memory {self.peak_rss_bytes / 1e6:.0f} MB",
            f"tensors: {len(self.tensors)} ({types}): {copied} quantized ones copied bit for "
            f"bit, {floats} in float"
            + (f", {requantized} requantized" if requantized else "")
            + f", largest relative error {worst:.3g}",
            f"tokenizer: {tok.get('model')} ({tok.get('kind')}), {tok.get('tokens')} tokens"
            + (f", pre-tokenizer {tok['pre']}" if tok.get("pre") else "")
            + f"; {tok.get('check')}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def table(self) -> str:
        """One line per tensor: GGUF name, deploy file layout, GGUF type, relative error."""
        lines = ["tensor  source -> gguf  relative-error"]
        lines += [f"{t.name}  {t.source} -> {t.gguf_type}  {t.rel_error:.3g}"
                  for t in self.tensors]
        return "\n".join(lines)


# -------------------------------------------------------------------------------- architecture
def gguf_architecture(config: ModelConfig) -> str:
    """The GGUF architecture that computes ``config`` exactly (module docstring), or an
    UnsupportedError naming what llama.cpp would compute differently."""
    arch = ARCHITECTURES.get(config.arch)
    if arch is None:
        raise UnsupportedError(f"family {config.arch!r} has no GGUF architecture; exportable: "
                               f"{', '.join(ARCHITECTURES)}")

    def refuse(what: str) -> UnsupportedError:
        return UnsupportedError(f"cannot export this {config.arch} model to GGUF: {what}, which "
                                f"llama.cpp's {arch} graph does not compute")

    default_scale = 1.0 / math.sqrt(config.head_dim)
    if arch == "gemma3":
        pattern = ["global" if i % GEMMA3_SWA_PATTERN == GEMMA3_SWA_PATTERN - 1 else "sliding"
                   for i in range(config.n_layers)]
        if config.layer_types != pattern:
            raise refuse(f"its global layers are {_layer_list(config.layer_types)}, not every "
                         f"{GEMMA3_SWA_PATTERN}th")
        # no local base of its own: the sliding layers rotate with the global one
        local = config.rope_theta_local if config.rope_theta_local is not None \
            else config.rope_theta
        if local != GEMMA3_ROPE_LOCAL:
            raise refuse(f"a local RoPE base of {local:g} (llama.cpp fixes "
                         f"{GEMMA3_ROPE_LOCAL:g})")
        if not math.isclose(config.embed_scale, math.sqrt(config.d_model), rel_tol=1e-6):
            raise refuse(f"an embedding scale of {config.embed_scale:g} (not sqrt(d_model))")
        # llama.cpp scales Gemma 3 27B's (62 layers) attention by 1 / sqrt(d_model / n_heads)
        want = 1.0 / math.sqrt(config.d_model / config.n_heads) if config.n_layers == 62 \
            else default_scale
        if not math.isclose(config.scale, want, rel_tol=1e-6):
            raise refuse(f"an attention scale of {config.scale:g} (llama.cpp uses {want:g})")
        for what, bad in (("no sandwich norms", not config.sandwich_norms),
                          ("no QK-norm", not config.qk_norm),
                          (f"activation {config.activation}", config.activation != "gelu_tanh"),
                          ("q/k/v biases", config.qkv_bias)):
            if bad:
                raise refuse(what)
        return arch
    if "sliding" in config.layer_types:
        raise refuse("sliding-window attention layers")
    if config.sandwich_norms:
        raise refuse("sandwich norms")
    if config.activation != "silu":
        raise refuse(f"activation {config.activation}")
    if config.embed_scale != 1.0:
        raise refuse(f"an embedding scale of {config.embed_scale:g}")
    if not math.isclose(config.scale, default_scale, rel_tol=1e-6):
        raise refuse(f"an attention scale of {config.scale:g} (not 1 / sqrt(head_dim))")
    if config.qk_norm and config.qkv_bias:
        raise refuse("QK-norm together with q/k/v biases")
    if config.qk_norm and arch != "qwen3":
        raise refuse("QK-norm")
    if arch == "qwen3" and not config.qk_norm:
        return "qwen2"  # the same graph without QK-norm: zero biases are added
    if arch == "qwen3" and config.qkv_bias:
        raise refuse("q/k/v biases")
    return arch


def _layer_list(layer_types: list[str]) -> str:
    found = [i for i, t in enumerate(layer_types) if t == "global"]
    return ", ".join(map(str, found[:8])) + (" ..." if len(found) > 8 else "") if found else "none"


def _architecture_fields(config: ModelConfig, arch: str) -> dict[str, tuple[str, Any]]:
    """``{key: (value type, value)}`` of the hyper-parameters, in the importer's keys."""
    p = f"{arch}."
    fields: dict[str, tuple[str, Any]] = {
        p + "vocab_size": ("u32", config.vocab_size),
        p + "context_length": ("u32", config.max_context),
        p + "embedding_length": ("u32", config.d_model),
        p + "block_count": ("u32", config.n_layers),
        p + "feed_forward_length": ("u32", config.d_ff),
        p + "attention.head_count": ("u32", config.n_heads),
        p + "attention.head_count_kv": ("u32", config.n_kv_heads),
        p + "attention.key_length": ("u32", config.head_dim),
        p + "attention.value_length": ("u32", config.head_dim),
        p + "rope.dimension_count": ("u32", config.head_dim),
        p + "rope.freq_base": ("f32", config.rope_theta),
        p + "attention.layer_norm_rms_epsilon": ("f32", config.norm_eps),
    }
    if arch == "gemma3":
        fields[p + "attention.sliding_window"] = ("u32", config.sliding_window)
    return fields


# -------------------------------------------------------------------------------- weights
def permute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """pocketlm's rotate-half row order of each q/k head -> ggml's interleaved pairs (the
    inverse of the importer's ``unpermute_rows``): head rows ``[x0..x(d/2-1) | y0..]`` become
    ``[x0 y0 x1 y1 ...]``. Whole rows move, so this is exact for any layout."""
    rows = a.shape[0]
    head = rows // n_heads
    return a.reshape(n_heads, 2, head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def ggml_type(qt: QuantTensor) -> str:
    """The ggml type that holds ``qt``'s values exactly: INT8 -> Q8_0; INT4 -> Q4_0 when every
    minimum is ``-8 * scale`` (stored without minimums, or found so), else Q4_1; INT5 -> Q5_0
    (``-16 * scale``) or Q5_1."""
    if qt.kind == "int8":
        return "Q8_0"
    if qt.kind not in ("int4", "int5"):
        raise UnsupportedError(f"quantized layout {qt.kind!r} has no GGUF type")
    zp = qt.zero_point if qt.zero_point is not None else find_zero_point(qt)
    if qt.kind == "int4":
        return "Q4_0" if zp == 8 else "Q4_1"
    return "Q5_0" if zp == 16 else "Q5_1"


def ggml_blocks(qt: QuantTensor, type_name: str, rows: slice = slice(None)) -> np.ndarray:
    """The selected rows of ``qt`` as ggml blocks of ``type_name``: uint8
    ``[rows, cols // 32 * block bytes]``, each 32-value block its group's float16 scale (and
    minimum, for Q4_1/Q5_1) followed by the packed values exactly as pocketlm stores them."""
    ncols = qt.shape[1]
    nb = ncols // BLOCK
    rep = qt.group_size // BLOCK  # blocks per group: they share its scale and minimum
    qweight = np.asarray(qt.qweight[rows])
    n = qweight.shape[0]
    out = np.empty((n, nb, BLOCK_BYTES[type_name]), dtype=np.uint8)

    def put(at: int, halves: np.ndarray) -> None:  # float16 [n, groups] -> 2 bytes a block
        h = np.ascontiguousarray(np.repeat(np.asarray(halves, dtype=np.float16), rep, axis=1))
        out[:, :, at:at + 2] = h.view(np.uint8).reshape(n, nb, 2)

    put(0, qt.scales[rows])
    head = 2
    if type_name in ("Q4_1", "Q5_1"):
        put(2, qt.mins[rows])
        head = 4
    if type_name == "Q8_0":
        out[:, :, head:] = qweight.view(np.uint8).reshape(n, nb, BLOCK)
    else:  # INT4: 16 nibble bytes a block; INT5: 4 high-bit bytes + 16 nibble bytes
        out[:, :, head:] = qweight.reshape(n, nb, BLOCK_BYTES[type_name] - head)
    return out.reshape(n, nb * BLOCK_BYTES[type_name])


@dataclass
class _Planned:
    """One tensor to write: its GGUF name, ggml type, element shape and a producer of its
    bytes in row slices."""

    name: str
    source: str
    type_name: str
    shape: tuple[int, ...]
    nbytes: int
    how: str
    slices: Callable[[], Iterator[np.ndarray]]
    check: Callable[[], float] = lambda: 0.0
    pages: list[str] = field(default_factory=list)  # deploy file tensors to drop after
    release: Callable[[], None] = lambda: None  # drops what was decoded to write it


def _layout_name(qt: QuantTensor) -> str:
    zp = f" zp{qt.zero_point}" if qt.zero_point is not None else ""
    return f"{qt.kind} g{qt.group_size}{zp}"


def _gguf_name(name: str) -> str | None:
    if name in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[name]
    if name.startswith("layers."):
        i, _, rest = name[len("layers."):].partition(".")
        if rest in _TO_GGUF_LAYER:
            return f"blk.{i}.{_TO_GGUF_LAYER[rest]}"
    return None


def _plan(config: ModelConfig, arch: str, weights: dict, origin: str) -> list[_Planned]:
    """Every tensor of the GGUF file, in order; an UnsupportedError for a tensor the GGUF
    architecture has no name for."""
    unmapped = [n for n in weights if _gguf_name(n) is None]
    if unmapped:
        raise UnsupportedError(f"{origin}: tensors with no GGUF name: {unmapped[:5]}"
                               f"{' ...' if len(unmapped) > 5 else ''}")
    order = list(config.tensor_shapes())
    extra = sorted(set(weights) - set(order))
    if extra:
        raise UnsupportedError(f"{origin}: tensors the config does not call for: {extra[:5]}")
    plan = []
    for name in order:
        value = weights[name]
        heads = None
        if arch == "llama" and name.endswith(("attn.w_q.weight", "attn.w_q.bias")):
            heads = config.n_heads
        elif arch == "llama" and name.endswith(("attn.w_k.weight", "attn.w_k.bias")):
            heads = config.n_kv_heads
        if isinstance(value, PatchedHead):  # read from the tied embedding's rows, or its own
            source = "embed.weight" if value.head is weights.get("embed.weight") else name
            plan.append(_patched_head_plan(_gguf_name(name), source, value))
            continue
        plan.append(_plan_tensor(_gguf_name(name), name, value, heads))
    if arch == "qwen2" and not config.qkv_bias:  # qwen2's graph reads biases: zeros are exact
        for i in range(config.n_layers):
            for proj, rows in (("q", config.q_dim), ("k", config.kv_dim), ("v", config.kv_dim)):
                plan.append(_float_plan(f"blk.{i}.attn_{proj}.bias", "none",
                                        np.zeros(rows, np.float32), "added"))
    return plan


def _plan_tensor(gname: str, name: str, value, heads: int | None) -> _Planned:
    if not isinstance(value, QuantTensor):
        a = np.asarray(value)
        if a.dtype != np.float32:
            raise UnsupportedError(f"tensor {name}: dtype {a.dtype} has no GGUF export")
        if heads is not None:
            a = permute_rows(a, heads)
        return _float_plan(gname, "f32", a, "float", pages=[name])
    qt = value
    if heads is not None:
        qt = QuantTensor(qt.kind, qt.shape, qt.group_size, permute_rows(qt.qweight, heads),
                         permute_rows(qt.scales, heads),
                         None if qt.mins is None else permute_rows(qt.mins, heads),
                         qt.zero_point)
    type_name = ggml_type(qt)
    # a tensor in a source encoding (Q4_K, Q6_K, int4_c8) keeps the layout it decoded to until
    # released: decoded again when it is written, so that the model's are never all resident
    release = getattr(value, "release", lambda: None)
    release()
    rows, cols = qt.shape
    row_bytes = cols // BLOCK * BLOCK_BYTES[type_name]
    step = max(1, _SLICE_BYTES // row_bytes)

    def slices() -> Iterator[np.ndarray]:
        for r0 in range(0, rows, step):
            yield ggml_blocks(qt, type_name, slice(r0, r0 + step))

    def check() -> float:
        """The first, middle and last rows decoded by gguf's own dequantizer: 0 when they are
        the deploy file's values exactly."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        sel = np.unique([0, rows // 2, rows - 1])
        got = dequantize(ggml_blocks(qt, type_name, sel), GGMLQuantizationType[type_name])
        want = qt.dequantize(sel)
        if np.array_equal(np.asarray(got, np.float32).reshape(want.shape), want):
            return 0.0
        diff = np.linalg.norm(np.asarray(got, np.float64).reshape(want.shape) - want)
        return float(diff / max(np.linalg.norm(want.astype(np.float64)), 1e-30))

    stored = (".scales", ".mins", *getattr(value, "stored", ()))  # a source encoding's arrays
    return _Planned(gname, _layout_name(value), type_name, (rows, cols), rows * row_bytes,
                    "copied", slices, check,
                    pages=list(dict.fromkeys(name + suffix for suffix in ("", *stored))),
                    release=release)


def _patched_head_plan(gname: str, name: str, head: PatchedHead) -> _Planned:
    """The patched head ``head`` (read from the deploy file's ``name`` and the patch) as Q8_0,
    quantized from its float values a slice of rows at a time (module docstring); its check
    is the relative error of the whole tensor, measured as it is written."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8_0 = GGMLQuantizationType.Q8_0
    rows, cols = head.shape
    step = max(1, _SLICE_BYTES // (cols * 4))  # float32 values in a slice
    squares = [0.0, 0.0]  # sums of (written - patched)^2 and of patched^2, over the tensor

    def slices() -> Iterator[np.ndarray]:
        squares[:] = [0.0, 0.0]
        for r0 in range(0, rows, step):
            values = head[r0:r0 + step]
            blocks = quantize(values, q8_0)
            back = dequantize(blocks, q8_0).reshape(values.shape)
            squares[0] += float(np.square(back - values, dtype=np.float64).sum())
            squares[1] += float(np.square(values, dtype=np.float64).sum())
            yield blocks

    def check() -> float:
        return math.sqrt(squares[0] / max(squares[1], 1e-30))

    source = f"{_layout_name(head.head)} + patch of {len(head.ids)} int8 rows"
    stored = (".scales", ".mins", *getattr(head.head, "stored", ()))
    pages = [name + suffix for suffix in ("", *stored)] + [PATCH, PATCH + ".scales", PATCH_IDS]
    return _Planned(gname, source, "Q8_0", (rows, cols),
                    rows * (cols // BLOCK) * BLOCK_BYTES["Q8_0"], "requantized", slices, check,
                    pages=list(dict.fromkeys(pages)),
                    release=getattr(head.head, "release", lambda: None))


def _float_plan(gname: str, source: str, a: np.ndarray, how: str,
                pages: list[str] | None = None) -> _Planned:
    def slices() -> Iterator[np.ndarray]:
        yield np.ascontiguousarray(a, dtype=np.float32)

    return _Planned(gname, source, "F32", tuple(a.shape), a.size * 4, how, slices,
                    pages=pages or [])


# -------------------------------------------------------------------------------- writing
def _peak_rss() -> int:
    try:
        import resource
    except ImportError:  # not on this platform
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _general_fields(pf: PocketFile, source: Path, plan: list[_Planned]) -> dict[str, tuple]:
    from gguf import GGML_QUANT_VERSION

    prov = pf.json_object("provenance", {})
    name = prov.get("source_name") if isinstance(prov.get("source_name"), str) else None
    linear = Counter(p.type_name for p in plan if len(p.shape) == 2 and
                     not p.name.startswith(("token_embd", "output.")))
    main = linear.most_common(1)[0][0] if linear else "F32"
    fields: dict[str, tuple] = {
        "general.name": ("str", name or source.stem),
        "general.file_type": ("u32", _FILE_TYPES[main]),
        "general.quantization_version": ("u32", GGML_QUANT_VERSION),
        "general.quantized_by": ("str", "pocketlm"),
    }
    license_ = prov.get("source_license")
    if isinstance(license_, str) and license_:
        fields["general.license"] = ("str", license_)
    return fields


def _sampling_fields(generation: GenerationDefaults) -> tuple[dict[str, tuple], list[str]]:
    """The generation defaults in the importer's ``general.sampling.*`` keys when the model
    sets any (none when all are the built-in ones); a note for what GGUF has no key for.

    All of them, not only those that differ: llama.cpp takes each key it finds and its own
    default for each one missing (top-k 40, top-p 0.95, min-p 0.05), so a model that samples
    with those filters off would be sampled with them on."""
    builtin = GenerationDefaults()
    fields: dict[str, tuple] = {}
    if any(getattr(generation, name) != getattr(builtin, name)
           for name in SAMPLING_KEYS.values()):
        for key, name in SAMPLING_KEYS.items():
            value = getattr(generation, name)
            fields[key] = ("i32", int(value)) if name == "top_k" else ("f32", float(value))
    notes = []
    if generation.max_tokens is not None:
        notes.append(f"the default length ({generation.max_tokens} tokens) has no GGUF key: "
                     "pass -n to llama.cpp")
    return fields, notes


def _write_fields(writer, typed: dict[str, tuple[str, Any]]) -> None:
    add = {"u32": writer.add_uint32, "i32": writer.add_int32, "f32": writer.add_float32,
           "str": writer.add_string, "bool": writer.add_bool}
    for key, (kind, value) in typed.items():
        add[kind](key, value)


def _write_tokenizer(writer, fields: dict[str, Any]) -> None:
    for key, value in fields.items():
        if key == "tokenizer.ggml.tokens":
            writer.add_token_list(value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        elif key == "tokenizer.ggml.scores":
            writer.add_token_scores(value)
        elif key == "tokenizer.ggml.merges":
            writer.add_token_merges(value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)


def _write_tensors(f, align: int, plan: list[_Planned], pf: PocketFile,
                   progress: bool) -> list[TensorExport]:
    """The tensor data, in plan order, each at a multiple of ``align`` (after the header the
    GGUF writer wrote to ``f``); each tensor's deploy file pages are dropped once written."""
    from ..data.download import byte_progress

    tensors = []
    with byte_progress(sum(p.nbytes for p in plan), "writing GGUF", quiet=not progress) as bar:
        for p in plan:
            f.write(b"\0" * (-f.tell() % align))
            written = 0
            for chunk in p.slices():
                f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
                bar.update(chunk.nbytes)
            if written != p.nbytes:
                raise PocketError(f"{p.name}: wrote {written} bytes, planned {p.nbytes}")
            err = p.check()
            if p.how == "copied" and err != 0.0:
                raise PocketError(f"{p.name}: the {p.type_name} blocks written do not decode to "
                                  f"the deploy file's values (relative error {err:.3g}); this "
                                  "is a bug: please report it")
            tensors.append(TensorExport(p.name, p.source, p.type_name, p.nbytes, p.how, err))
            p.release()
            for name in p.pages:
                info = pf.infos.get(name)
                if info is not None:
                    pf.drop_resident(info.start, info.end)
        f.write(b"\0" * (-f.tell() % align))
    return tensors


def export_gguf(source: str | Path, out: str | Path, *, progress: bool = True) -> ExportReport:
    """Write the deploy file ``source`` as the GGUF file ``out`` (replaced only once complete).

    Everything that could refuse the model (architecture, tensor names, the tokenizer and its
    probe check) is checked before the file is created."""
    import gguf

    t0 = time.perf_counter()
    source, out = Path(source), Path(out)
    pf = PocketFile(source)
    refuse_adapters(pf, source)
    config = pf.config()
    pf.check_model(config)
    arch = gguf_architecture(config)

    tok = Tokenizer.from_json(pf.tokenizer_json())
    tok_fields, tok_info = tokenizer_fields(tok, config.vocab_size)
    difference = first_difference(tok, tok_fields)
    if difference is not None:
        raise UnsupportedError(f"{source}: llama.cpp would tokenize differently with the "
                               f"exported vocabulary ({difference}); not written")
    n_probes = len(probe_texts(tok))
    del tok
    release_free_heap()  # the tokenizers built for the check: gone before the weights come
    weights = pf.weights()
    # a GGUF tensor has one type: a patched head goes out as Q8_0 from its patched values
    tied = config.tie_embeddings
    config = patched_head_for_export(weights, config)
    patched = isinstance(weights.get("lm_head.weight"), PatchedHead)
    plan = _plan(config, arch, weights, str(source))
    tok_info["check"] = (f"tokenizes {n_probes} probe texts exactly as the deploy file"
                         + ("" if tok_info["exact"] else
                            " (no llama.cpp pre-tokenizer is the vocabulary's own: this is the "
                            "nearest, identical on the probes, not by construction)"))
    # what pocketlm chats with: the file's template, else its family's (as the runtime does)
    template = pf.text("chat_template") or FAMILY_TEMPLATES.get(config.arch)
    sampling, notes = _sampling_fields(GenerationDefaults.from_dict(
        pf.json_object("generation", {})))
    if "vocab" in pf.metadata:
        notes.append("trimmed vocabulary: token ids are the deploy file's, not the original "
                     "model's")

    with atomic_file(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        try:
            _write_fields(writer, _general_fields(pf, source, plan))
            _write_fields(writer, _architecture_fields(config, arch))
            _write_tokenizer(writer, tok_fields)
            if template:
                writer.add_chat_template(template)
            _write_fields(writer, sampling)
            for p in plan:
                ggml = gguf.GGMLQuantizationType[p.type_name]
                if p.type_name == "F32":
                    writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes)
                else:
                    byte_shape = (p.shape[0], p.nbytes // p.shape[0])
                    writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes,
                                           raw_dtype=ggml)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            tensors = _write_tensors(writer.fout[0], writer.data_alignment, plan, pf,
                                     progress)
        finally:
            writer.close()
    if patched:
        t = next(t for t in tensors if t.how == "requantized")
        notes.append(f"{t.name}: the head and its head patch ({t.source}) written as Q8_0 from "
                     f"the patched values, relative error {t.rel_error:.3g}: a GGUF tensor has "
                     "one type, and Q8_0 is the type of the patch's INT8 rows"
                     + (f"; the head was tied: token_embd.weight keeps the "
                        f"{weights['embed.weight'].kind.upper()} rows the lookups read"
                        if tied else ""))
    return ExportReport(path=out, source=source, architecture=arch,
                        file_bytes=out.stat().st_size, seconds=time.perf_counter() - t0,
                        peak_rss_bytes=_peak_rss(), tensors=tensors, tokenizer=tok_info,
                        notes=notes)
