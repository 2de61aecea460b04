"""Export deploy files to the formats other engines read.

``pocket export SRC --to gguf -o model.gguf`` writes a GGUF file llama.cpp loads
(:mod:`pocketlm.export.gguf`); ``--to hf -o DIR`` a Hugging Face folder transformers loads
(:mod:`pocketlm.export.hf`). SRC is anything the runtime runs: a registry name, a .pocket file,
or a GGUF file, Hugging Face folder or training run (packed first, as ``pocket run`` would).
Outputs are written beside their final name and moved there only when complete, so a failed or
interrupted export leaves nothing half-written under that name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import PocketError

__all__ = ["TARGETS", "atomic_file", "atomic_folder", "check_output"]

# what --to accepts: the deploy file itself (a training run packed), GGUF, a Hugging Face folder
TARGETS = ("pocket", "gguf", "hf")


def check_output(out: str | Path, *, force: bool, folder: bool = False) -> Path:
    """``out`` as a Path, refused in one line before any work when it exists (without
    ``force``), is the wrong kind of thing, or its folder cannot be written."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not force:
            raise PocketError(f"{out} exists; pass --force to overwrite it")
        if folder and not out.is_dir():
            raise PocketError(f"cannot write the folder {out}: a file of that name exists")
        if not folder and out.is_dir():
            raise PocketError(f"cannot write {out}: it is a folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PocketError(f"cannot write {out}: {parent} is not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PocketError(f"cannot write {out}: {parent} is not writable")
            break
    return out


@contextlib.contextmanager
def atomic_file(out: str | Path) -> Iterator[Path]:
    """A temporary path beside ``out``; when the block ends without an error it replaces
    ``out`` (one rename), otherwise it is removed."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise PocketError(f"cannot write {out} ({e.strerror or e})") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``out``; when the block ends without an error it takes
    ``out``'s place (an existing ``out`` is moved aside first and removed after), otherwise it
    is removed."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise PocketError(f"cannot write {out} ({e.strerror or e})") from None
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
