"""`pocket bench --vs mnn`: the engine list, the one-line errors (MNN is not a test dependency),
and the worker's MNN engine driven against a stand-in MNN (tests/fake_mnn)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import tiny_gguf

from pocketlm import cli
from pocketlm.bench import bench, mnn_export
from pocketlm.errors import PocketError, UnsupportedError

FAKE_MNN = Path(__file__).parent / "fake_mnn"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", seed=2, weight_type="Q4_0", max_context=256)
    return path


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def export(tmp_path):
    folder = tmp_path / "mnn-export"
    folder.mkdir()
    (folder / "config.json").write_text('{"llm_model": "llm.mnn"}')
    (folder / "llm.mnn.weight").write_bytes(b"\0" * 1000)
    return folder


@pytest.fixture
def no_mnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "MNN", None)  # not importable, installed or not


@pytest.mark.parametrize("argv, engines", [
    (["--vs", "llama.cpp", "mnn"], ["llama.cpp", "mnn"]),
    (["--vs", "mnn", "--vs", "llama.cpp"], ["mnn", "llama.cpp"]),
    ([], None),
])
def test_vs_takes_several_engines(argv, engines):
    assert cli.build_parser().parse_args(["bench", *argv]).vs == engines


def test_vs_unknown_engine(capsys):
    with pytest.raises(SystemExit) as exc:  # a usage error
        cli.main(["bench", "--vs", "mlc"])
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert "invalid choice: 'mlc'" in err and "'mnn'" in err and err.count("\n") == 1
    with pytest.raises(UnsupportedError, match="llama.cpp, mnn"):
        bench("smollm2-135m", vs=["mlc"])


def test_vs_mnn_without_an_export_names_the_script(home, capsys):
    # fails before the model is pulled or packed: POCKET_HOME is empty
    assert cli.main(["bench", "-m", "smollm2-135m", "--vs", "mnn"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pocket: error: --vs mnn: no MNN export at ")
    assert str(home / "mnn" / "smollm2-135m") in err and "scripts/export-mnn smollm2-135m" in err
    assert err.count("\n") == 1 and not (home / "models").exists()


def test_vs_mnn_on_a_file_needs_the_export_named(gguf, capsys):
    assert cli.main(["bench", "-m", str(gguf), "--vs", "mnn"]) == 1
    assert "--mnn DIR" in capsys.readouterr().err


def test_mnn_without_vs_mnn(export, capsys):
    assert cli.main(["bench", "--mnn", str(export)]) == 1
    assert "add --vs mnn" in capsys.readouterr().err


def test_vs_mnn_without_mnn_installed(export, no_mnn, capsys):
    assert cli.main(["bench", "-m", "smollm2-135m", "--vs", "mnn", "--mnn", str(export)]) == 1
    err = capsys.readouterr().err
    assert "pip install MNN==3.6.1" in err and sys.executable in err and err.count("\n") == 1


def test_mnn_export_takes_the_folder_or_its_config(export, monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_MNN))
    assert mnn_export("smollm2-135m", str(export)) == export
    assert mnn_export("anything.gguf", str(export / "config.json")) == export
    with pytest.raises(PocketError, match="scripts/export-mnn qwen2.5-0.5b"):
        mnn_export("qwen2.5-0.5b", str(export / "missing"))


def test_bench_drives_mnn_greedily_from_a_fresh_cache(gguf, export, tmp_path, monkeypatch):
    log = tmp_path / "mnn.jsonl"
    monkeypatch.syspath_prepend(str(FAKE_MNN))
    monkeypatch.setenv("PYTHONPATH", str(FAKE_MNN), prepend=os.pathsep)  # the worker's MNN
    monkeypatch.setenv("FAKE_MNN_LOG", str(log))
    seen = []
    results = bench(str(gguf), threads=1, n_prompt=62, n_gen=4, runs=2, vs=["mnn", "mnn"],
                    mnn=str(export), progress=lambda engine, run, sample: seen.append(engine))
    assert [r.engine for r in results] == ["pocketlm", "mnn"]
    assert seen == ["pocketlm", "mnn", "mnn", "pocketlm"]
    mnn = results[1]
    assert mnn.file_mb == pytest.approx((1000 + len('{"llm_model": "llm.mnn"}')) / 1e6)
    assert 0 < mnn.prefill_tps_min <= mnn.prefill_tps and 0 < mnn.decode_tps_min <= mnn.decode_tps

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"load": str(export / "config.json"),
                        "settings": {"backend_type": "cpu", "precision": "low", "memory": "low",
                                     "attention_mode": 8, "thread_num": 1}}
    runs = calls[1:]
    assert len(runs) == 3 * 6  # warm-up + 2 runs: reset, prefill, 4 decode steps
    for i in range(0, len(runs), 6):
        reset, prefill, *steps = runs[i:i + 6]
        assert reset == {"reset": True} and len(prefill["ids"]) == 62
        # each step feeds the last logits' argmax, end-of-sequence (0, at position 64) included
        assert [s["ids"] for s in steps] == [[50], [57], [0], [7]]
