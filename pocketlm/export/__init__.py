"""Export deploy files to the formats other engines read.

``pocket export SRC --to gguf -o model.gguf`` writes a GGUF file llama.cpp loads
(:mod:`pocketlm.export.gguf`); ``--to hf -o DIR`` a Hugging Face folder transformers loads
(:mod:`pocketlm.export.hf`). SRC is anything the runtime runs: a registry name, a .pocket file,
or a GGUF file, Hugging Face folder or training run (packed first, as ``pocket run`` would).
Outputs are written beside their final name and moved there only when complete, so a failed or
interrupted export leaves nothing half-written under that name; the temporary file or folder
(``.NAME.*.tmp``) of a killed export is removed by the next export to that name: at once when no
pocketlm writer holds the folder's writer lock (:func:`pocketlm.data.download.writer_lock`, held
by every export while its temporary exists), else once it is :data:`STALE_SECONDS` old.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..data.download import writer_lock
from ..errors import PocketError, refuse_empty

__all__ = ["STALE_SECONDS", "TARGETS", "atomic_file", "atomic_folder", "check_output",
           "remove_stale_temporaries"]

# what --to accepts: the deploy file itself (a training run packed), GGUF, a Hugging Face folder
TARGETS = ("pocket", "gguf", "hf")
# a temporary output untouched this long is a killed export's, not a running one's (the rule
# while another writer holds the folder's lock, or where the filesystem has no flock)
STALE_SECONDS = 3600


def refuse_adapters(pf, source) -> None:
    """Other engines' formats have no place for LoRA adapters kept beside the weights
    (``pocket export RUN --keep-lora``): such a deploy file is refused, not exported as its
    base model."""
    if any(name.endswith((".lora_a", ".lora_b")) for name in pf.infos):
        raise PocketError(f"{source} keeps LoRA adapters beside its weights, which GGUF and "
                          "Hugging Face folders cannot hold; export the training run instead "
                          "(its adapters are merged: pocket export RUN --to gguf|hf)")


def check_output(out: str | Path, *, force: bool, folder: bool = False,
                 inputs: tuple = (), replaces=None) -> Path:
    """``out`` as a Path, refused in one line before any work when it exists (without
    ``force``), is the wrong kind of thing, is one of ``inputs`` (files the work reads:
    ``--force`` would replace them), or its folder cannot be written. A folder output that
    is replaced whole (``replaces`` given) must not be the working folder or one above it,
    nor hold one of ``inputs``, and if it exists and holds anything it must pass
    ``replaces(folder)`` (the kind of folder the work writes): ``--force`` is no licence to
    remove an unrelated one."""
    refuse_empty("-o/--output", out)  # Path("") would be the working folder
    out = Path(out)
    if folder and replaces is not None:  # a folder replaced whole
        try:
            cwd, where = Path.cwd().resolve(), out.resolve()
            if where == cwd or where in cwd.parents:
                raise PocketError(f"cannot write the folder {out}: it is the working folder or "
                                  "one above it; name a new folder")
        except OSError:
            pass
    for source in inputs:
        try:
            same = source is not None and out.exists() and os.path.samefile(out, source)
        except OSError:
            same = False
        if same:
            raise PocketError(f"{out} is the input {source}; write the output elsewhere")
        if not folder and source is not None and out.exists() and _inside(out, Path(source)) \
                and not _written_kind(out):
            # a file the input folder is made of (a Hugging Face model's weights, a run's
            # checkpoint) replaced by --force; an earlier deploy file or GGUF there may be
            raise PocketError(f"{out} is one of the files of the input {source}; write the "
                              "output elsewhere")
        if folder and replaces is not None and source is not None and _inside(source, out):
            # the folder is replaced whole: the input in it would be deleted with it
            raise PocketError(f"{out} holds the input {source}; write the output elsewhere")
    if out.exists() or out.is_symlink():
        # the wrong kind of thing first: --force would not help ("pass --force", then "it is
        # a folder")
        if folder and out.exists() and not out.is_dir():
            raise PocketError(f"cannot write the folder {out}: a file of that name exists")
        if not folder and out.is_dir():
            raise PocketError(f"cannot write {out}: it is a folder")
        if not force:
            raise PocketError(f"{out} exists; pass --force to overwrite it")
        if folder and replaces is not None and any(out.iterdir()) and not replaces(out):
            raise PocketError(f"{out} is a folder holding other things; name a new folder "
                              "(with --force the whole folder would be replaced)")
        from ..formats.pocketfile import refuse_special

        refuse_special(out)  # a device or FIFO: the rename would replace the node itself
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PocketError(f"cannot write {out}: {parent} is not a folder")
            if not os.access(parent, os.W_OK | os.X_OK) or not _can_create_in(parent):
                raise PocketError(f"cannot write {out}: {parent} is not writable")
            break
    if folder and out.is_dir() and not _can_create_in(out):  # written into: a run resumed
        raise PocketError(f"cannot write into {out}: the folder is not writable")
    return out


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, tried (and removed at once): ``os.access`` says
    yes to root for /proc, /sys and read-only mounts, where the write would fail only at the
    end of the work."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".pocket-probe.", dir=folder)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def _written_kind(path: Path) -> bool:
    """Whether ``path`` is a file of the kinds the exports write (a deploy file or a GGUF)."""
    from ..formats.pocketfile import PocketFile

    try:
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return True
        PocketFile(path, verify=False)  # a deploy file's header, not any safetensors file
        return True
    except (PocketError, OSError):
        return False


def _inside(path, folder: Path) -> bool:
    """Whether the existing ``path`` lies under the existing folder ``folder`` (links
    resolved)."""
    try:
        where, path = folder.resolve(strict=True), Path(path).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # absent, a link loop, a NUL in the name
        return False
    return where.is_dir() and where in path.parents


def check_replaceable(out: str | Path, flag: str, what: str, looks_like) -> Path:
    """``out`` for an output that replaces an earlier one of its kind in place (no --force):
    refused like :func:`check_output`, and also when it names an existing file that is not
    of that kind (``looks_like(first_bytes)`` is False), a typo that would lose another file."""
    refuse_empty(flag, out)  # named by its own flag, not as -o/--output
    out = check_output(out, force=True)
    if out.is_file() and out.stat().st_size:
        try:
            with open(out, "rb") as f:
                head = f.read(4096)
        except OSError as e:
            raise PocketError(f"cannot read {out} ({e.strerror or e})") from None
        if not looks_like(head):
            raise PocketError(f"{flag} {out}: the file exists and is not {what}; name another "
                              "file (it would be replaced)")
    return out


@contextlib.contextmanager
def atomic_file(out: str | Path) -> Iterator[Path]:
    """A temporary path beside ``out``; when the block ends without an error it replaces
    ``out`` (one rename), otherwise it is removed. The folder's writer lock is held meanwhile."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PocketError(f"cannot write {out} ({e.strerror or e})") from None
    remove_stale_temporaries(out)
    with writer_lock(out.parent):
        try:
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
    is removed. The folder's writer lock is held meanwhile."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PocketError(f"cannot write {out} ({e.strerror or e})") from None
    remove_stale_temporaries(out)
    with writer_lock(out.parent):
        try:
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
            try:
                os.replace(tmp, out)
            except BaseException:
                if old is not None:  # the earlier folder goes back under its name, not lost
                    with contextlib.suppress(OSError):
                        os.replace(old, out)
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def remove_stale_temporaries(out: str | Path, *, older_than: float = STALE_SECONDS) -> list[Path]:
    """Remove the temporary files and folders beside ``out`` that :func:`atomic_file` and
    :func:`atomic_folder` name after it (``.NAME.XXXXXXXX.tmp``) and that were left by a
    killed export: all of them when no pocketlm writer holds the folder's writer lock (a killed
    process's lock went with it), else those nothing has touched for ``older_than`` seconds (a
    folder counts as touched when anything in it is). Best effort: what cannot be read or
    removed is left. Returns what was removed."""
    out = Path(out)
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[^.]+\.tmp")
    cutoff = time.time() - older_than
    removed = []
    try:
        candidates = [p for p in out.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return removed
    if not candidates:
        return removed
    with _no_live_writer(out.parent) as alone:
        for path in candidates:
            try:
                if path.is_dir() and not path.is_symlink():
                    if not alone and _latest_mtime(path) >= cutoff:
                        continue
                    shutil.rmtree(path)
                else:
                    if not alone and path.lstat().st_mtime >= cutoff:
                        continue
                    path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed


@contextlib.contextmanager
def _no_live_writer(folder: Path) -> Iterator[bool]:
    """Whether no writer holds ``folder``'s writer lock: the lock taken exclusively without
    waiting (and held for the block, so that no writer starts meanwhile). False where that
    cannot be told (no flock, an unreadable folder)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield False
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError:
            alone = False
        yield alone
    finally:
        os.close(fd)


def _latest_mtime(folder: Path) -> float:
    """The newest modification time of ``folder`` and everything under it."""
    latest = folder.lstat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                latest = max(latest, os.lstat(os.path.join(root, name)).st_mtime)
    return latest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
