"""The output handling every export target shares (pocketlm/export/__init__.py): a killed
export's temporary file or folder beside the output is removed by the next export to that name,
at once when no writer holds the folder's lock, else once it is an hour old; fresh ones (an
export still running) and other outputs' are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pocketlm.data.download import writer_lock
from pocketlm.export import STALE_SECONDS, atomic_file, atomic_folder, remove_stale_temporaries

HOURS_AGO = time.time() - 2 * STALE_SECONDS


def _age(path: Path, when: float = HOURS_AGO) -> Path:
    os.utime(path, (when, when), follow_symlinks=False)
    return path


def _file(path: Path, *, stale: bool) -> Path:
    path.write_bytes(b"half a model")
    return _age(path) if stale else path


def _folder(path: Path, *, stale: bool) -> Path:
    path.mkdir()
    _file(path / "model.safetensors", stale=stale)
    return _age(path) if stale else path


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_a_killed_exports_temporary_file_goes_with_the_next_export(tmp_path):
    stale = _file(tmp_path / ".m.gguf.k1ll3d_a.tmp", stale=True)
    fresh = _file(tmp_path / ".m.gguf.running.tmp", stale=False)  # an export still writing
    other = _file(tmp_path / ".m.gguf.bak.abcd1234.tmp", stale=True)  # m.gguf.bak's
    unrelated = _file(tmp_path / ".m.gguf.notes", stale=True)
    with writer_lock(tmp_path), atomic_file(tmp_path / "m.gguf") as tmp:  # a writer is alive
        assert not stale.exists()
        tmp.write_bytes(b"GGUF")
    assert (tmp_path / "m.gguf").read_bytes() == b"GGUF"
    assert _names(tmp_path) == {"m.gguf", fresh.name, other.name, unrelated.name}


def test_a_killed_exports_temporary_folder_goes_with_the_next_export(tmp_path):
    stale = _folder(tmp_path / ".tiny-hf.k1ll3d_a.tmp", stale=True)
    # a folder whose mtime is old but whose file is still being written is not stale
    busy = _age(_folder(tmp_path / ".tiny-hf.running.tmp", stale=False))
    with writer_lock(tmp_path), atomic_folder(tmp_path / "tiny-hf") as tmp:
        (tmp / "config.json").write_text("{}")
    assert not stale.exists() and (busy / "model.safetensors").exists()
    assert _names(tmp_path) == {"tiny-hf", busy.name}
    assert _names(tmp_path / "tiny-hf") == {"config.json"}


@pytest.mark.parametrize("kind", ["atomic_file", "atomic_folder"])
def test_a_killed_exports_temporary_goes_with_the_next_export_at_once(tmp_path, kind):
    """SIGKILL (the OOM killer on a large export) mid-write: nothing cleans up, and the
    temporary, as large as the model, stayed beside the output when the export was run again
    at once (it was removed only by an export to that name an hour later, if one came)."""
    out = tmp_path / "m.gguf"
    script = f"""
import os, signal
from pathlib import Path
from pocketlm import export

with export.{kind}({str(out)!r}) as tmp:
    (tmp / "model.safetensors" if tmp.is_dir() else tmp).write_bytes(b"half a model")
    os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    left = _names(tmp_path)
    assert len(left) == 1 and left.pop().startswith(".m.gguf.")
    with {"atomic_file": atomic_file, "atomic_folder": atomic_folder}[kind](out) as tmp:
        (tmp / "config.json" if tmp.is_dir() else tmp).write_bytes(b"GGUF")
    assert _names(tmp_path) == {"m.gguf"}


def test_removal_is_best_effort(tmp_path, monkeypatch):
    stale = _file(tmp_path / ".m.gguf.k1ll3d_a.tmp", stale=True)

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert remove_stale_temporaries(tmp_path / "m.gguf") == []
    monkeypatch.undo()
    with atomic_file(tmp_path / "m.gguf") as tmp:  # and the export itself goes on
        tmp.write_bytes(b"GGUF")
    assert (tmp_path / "m.gguf").read_bytes() == b"GGUF" and not stale.exists()


@pytest.mark.parametrize("name", ["m[1].gguf", "a*b", ".hidden"])
def test_names_are_matched_literally(tmp_path, name):
    mine = _file(tmp_path / f".{name}.k1ll3d_a.tmp", stale=True)
    lookalike = _file(tmp_path / ".m1.gguf.k1ll3d_a.tmp", stale=True)
    assert remove_stale_temporaries(tmp_path / name) == [mine]
    assert lookalike.exists()


def test_a_folder_replaced_whole_must_not_hold_an_input(tmp_path):
    """``pocket export out/m.pocket --to hf -o out --force`` would delete m.pocket with the
    earlier export it replaces: refused before any work, like ``-o`` naming the input."""
    from pocketlm.errors import PocketError
    from pocketlm.export import check_output

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")  # an earlier export, which --force replaces
    for source in (out / "m.pocket", out / "sub" / "m.pocket"):
        source.write_bytes(b"a model")
        with pytest.raises(PocketError, match="holds the input") as info:
            check_output(out, force=True, folder=True, inputs=(str(source),),
                         replaces=lambda d: True)
        assert "\n" not in str(info.value)
    # a registry name, a file elsewhere, a new folder: written
    elsewhere = _file(tmp_path / "m.pocket", stale=False)
    for source in ("smollm2-135m", str(elsewhere)):
        assert check_output(out, force=True, folder=True, inputs=(source,),
                            replaces=lambda d: True) == out
    assert check_output(tmp_path / "new", force=False, folder=True,
                        inputs=(str(out / "m.pocket"),), replaces=lambda d: True)


def test_a_failed_rename_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "tiny-hf"
    out.mkdir()
    (out / "config.json").write_text("earlier")
    real = os.replace

    def failing(src, dst):
        if Path(dst) == out and Path(src).name.endswith(".tmp"):  # the new folder's rename
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(KeyboardInterrupt), atomic_folder(out) as tmp:
        (tmp / "config.json").write_text("new")
    monkeypatch.undo()
    assert (out / "config.json").read_text() == "earlier" and _names(tmp_path) == {"tiny-hf"}


@pytest.mark.parametrize("where", ["/proc", "/sys"])
def test_an_output_in_a_folder_nothing_can_be_made_in_is_refused_before_the_work(tmp_path,
                                                                                 where):
    # root may "access" /proc and /sys; the check makes (and removes) a file to be sure
    from pocketlm.errors import PocketError
    from pocketlm.export import check_output

    with pytest.raises(PocketError, match=f"{where} is not writable"):
        check_output(f"{where}/pocket-out.svg", force=False)
    assert check_output(tmp_path / "x.svg", force=False) == tmp_path / "x.svg"
    assert list(tmp_path.iterdir()) == []  # the probe is gone


def test_an_existing_output_folder_nothing_can_be_made_in_is_refused_before_the_work(
        tmp_path, monkeypatch):
    # a run folder on a read-only mount: refused only once the base and data were loaded
    # (train_config.json.tmp: Read-only file system)
    from pocketlm import export
    from pocketlm.errors import PocketError

    run = tmp_path / "run"
    run.mkdir()
    real = export._can_create_in
    monkeypatch.setattr(export, "_can_create_in", lambda folder: folder != run and real(folder))
    with pytest.raises(PocketError, match="cannot write into .*run: the folder is not writable"):
        export.check_output(run, force=True, folder=True)
    monkeypatch.setattr(export, "_can_create_in", real)
    assert export.check_output(run, force=True, folder=True) == run
