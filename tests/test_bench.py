"""`pocket bench`: methodology plumbing on a tiny model (speed itself is measured in
benchmarks/, never asserted in tests)."""

from __future__ import annotations

import json

import pytest
import tiny_gguf

from pocketlm import cli
from pocketlm.bench import bench, format_table
from pocketlm.bench.prompt import benchmark_ids, ids_hash
from pocketlm.errors import PocketError

REQUIRED = {"model", "engine", "threads", "n_prompt", "n_gen", "prefill_tps", "decode_tps",
            "peak_rss_delta_mb", "file_mb", "load_s", "energy_j_est"}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", seed=2, weight_type="Q4_0", max_context=256)
    return path


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))


def test_prompt_is_deterministic_and_exact_length(gguf):
    import pocketlm

    tok = pocketlm.load(gguf).tokenizer
    a, b = benchmark_ids(tok, 100), benchmark_ids(tok, 100)
    assert a == b and len(a) == 100 and ids_hash(a) == ids_hash(b)
    assert benchmark_ids(tok, 2000)[:100] == a  # the text repeats; the start never changes


def test_bench_against_llama_cpp_alternating(gguf):
    seen = []
    results = bench(str(gguf), threads=1, n_prompt=32, n_gen=4, runs=2, vs=["llama.cpp"],
                    progress=lambda engine, run, sample: seen.append((engine, run)))
    assert [r.engine for r in results] == ["pocketlm", "llama.cpp"]
    assert seen == [("pocketlm", 0), ("llama.cpp", 0), ("llama.cpp", 1), ("pocketlm", 1)]
    for r in results:
        row = json.loads(r.to_json())
        assert REQUIRED <= set(row)
        assert row["n_prompt"] == 32 and row["n_gen"] == 4 and row["threads"] == 1
        assert 0 < r.prefill_tps_min <= r.prefill_tps <= r.prefill_tps_max
        assert 0 < r.decode_tps_min <= r.decode_tps <= r.decode_tps_max
        assert r.peak_rss_delta_mb > 0 and r.file_mb > 0 and r.energy_j_est > 0
        assert r.prompt_hash == results[0].prompt_hash
    table = format_table(results)
    assert "pocketlm / llama.cpp" in table and "budgets" in table
    # the kernels pocketlm ran on are stated, AMX prefill where in force
    machine = results[0].machine
    assert machine["kernel_level"] and f"kernels {machine['kernel_level']}" in table
    assert ("AMX-BF16 prefill" in table) == machine["amx_prefill"]
    assert ("mixed weights" in table) == machine["amx_prefill"]


def test_bench_states_the_amx_setting(monkeypatch):
    from pocketlm.bench import machine_info

    monkeypatch.setenv("POCKET_AMX", "0")
    assert machine_info()["amx_prefill"] is False
    monkeypatch.setenv("POCKET_AMX", "bogus")  # an invalid setting: reported off, not a crash
    assert machine_info()["amx_prefill"] is False
    monkeypatch.delenv("POCKET_AMX")
    info = machine_info()
    assert info["amx_weights"] == ("mixed" if info["amx_prefill"] else None)
    monkeypatch.setenv("POCKET_AMX_WEIGHTS", "two-term")
    info = machine_info()
    assert info["amx_weights"] == ("two-term" if info["amx_prefill"] else None)


def test_bench_states_the_kernels_the_engine_runs_on(monkeypatch):
    # the machine line is what the engine runs on here: the forced kernel level, its default
    # activations (f32 at the scalar level, q8 with SIMD int8 products), AMX only at avx512
    from pocketlm.bench import machine_info
    from pocketlm.runtime.kernels import native

    monkeypatch.delenv("POCKET_ACT", raising=False)
    monkeypatch.setenv("POCKET_CPU_LEVEL", "scalar")
    info = machine_info()
    assert (info["kernel_level"], info["activations"], info["amx_prefill"]) == \
        ("scalar", "f32", False)
    if "avx2" in native.cpu_features()["levels"]:
        monkeypatch.setenv("POCKET_CPU_LEVEL", "avx2")
        monkeypatch.setenv("POCKET_AVXVNNI", "0")
        info = machine_info()
        assert (info["kernel_level"], info["activations"], info["amx_prefill"]) == \
            ("avx2", "q8", False)
    monkeypatch.setenv("POCKET_CPU_LEVEL", "scalar")
    monkeypatch.setenv("POCKET_ACT", "q8")
    assert machine_info()["activations"] == "q8"
    assert machine_info()["kv_cache"] == "f16"  # the default with int8 activations
    monkeypatch.setenv("POCKET_KV", "q8")
    assert machine_info()["kv_cache"] == "q8"


def test_bench_cli_json_and_picture(gguf, capsys, tmp_path):
    svg = tmp_path / "bench.svg"
    assert cli.main(["bench", "-m", str(gguf), "--threads", "1", "--n-prompt", "16",
                     "--n-gen", "2", "--runs", "1", "--json", "--plot", str(svg)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 and REQUIRED <= set(rows[0]) and rows[0]["engine"] == "pocketlm"
    text = svg.read_text()
    assert text.startswith("<svg") and "decode tok/s" in text and "pocketlm" in text
    # the energy budget is drawn only for the call it is for, as the table judges it
    assert "budget 200" in text and "budget 300" in text and "budget 5" not in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(runs=0), "runs"),
    (dict(n_prompt=-1), "n-prompt"),
    (dict(n_prompt=300), "context"),
    (dict(vs=["mlc"]), "llama.cpp, mnn"),
    (dict(threads=0), "--threads must be a positive integer"),
    (dict(threads=99999), "--threads must be at most 1024, got 99999"),
    (dict(watts_per_core=-3.0), "--watts-per-core must be a positive number"),
    (dict(watts_per_core=float("nan")), "--watts-per-core must be a positive number"),
    (dict(watts_per_core=0), "--watts-per-core must be a positive number"),
    # a GGUF named without --vs llama.cpp was silently not benchmarked
    (dict(gguf="model.gguf"), "--gguf names the GGUF for --vs llama.cpp: add --vs llama.cpp"),
    # an empty --speculative was silently a benchmark without the speculative row
    (dict(speculative=""), "--speculative needs 'lookup' or a draft model"),
    (dict(speculative="  "), "--speculative needs 'lookup' or a draft model"),
    (dict(draft_max=4), "--draft-max applies with --speculative"),
    (dict(speculative="lookup", draft_max=0), "--draft-max must be from 1 to 16, got 0"),
    (dict(speculative="lookup", draft_max=17), "--draft-max must be from 1 to 16, got 17"),
    (dict(speculative="lookup", draft_max=True), "--draft-max must be from 1 to 16"),
    # an empty --gguf / --mnn (an unset shell variable) was taken for none given
    (dict(gguf="", vs=["llama.cpp"]), "--gguf is empty"),
    (dict(mnn=" ", vs=["mnn"]), "--mnn is empty"),
    (dict(gguf=""), "--gguf is empty"),
    # named only as '' ("neither an existing file or directory nor a registry model")
    (dict(compare=[""]), "--compare is empty"),
])
def test_bench_bad_arguments(gguf, kwargs, match):
    with pytest.raises(PocketError, match=match):
        bench(str(gguf), **{"n_gen": 2, "runs": 1, **kwargs})


def test_a_plot_that_cannot_be_written_fails_before_the_benchmark(gguf, tmp_path, capsys,
                                                                  monkeypatch):
    import pocketlm.bench

    def ran(*args, **kwargs):
        raise AssertionError("the benchmark ran before the --plot path was checked")

    monkeypatch.setattr(pocketlm.bench, "bench", ran)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for plot in (tmp_path, blocker / "bench.svg"):
        assert cli.main(["bench", "-m", str(gguf), "--plot", str(plot)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("pocket: error: cannot write") and err.count("\n") == 1, err
    # a typo naming another file (the JSON results) replaced it with the picture
    results = tmp_path / "results.jsonl"
    results.write_text('{"engine": "pocketlm"}\n')
    assert cli.main(["bench", "-m", str(gguf), "--plot", str(results)]) == 1
    err = capsys.readouterr().err
    assert "is not an SVG picture" in err and err.count("\n") == 1, err
    assert results.read_text() == '{"engine": "pocketlm"}\n'


def test_an_empty_plot_path_fails_before_the_benchmark(gguf, capsys, monkeypatch):
    # `--plot "$SVG"` with SVG unset ran the whole benchmark and drew no picture
    import pocketlm.bench

    def ran(*args, **kwargs):
        raise AssertionError("the benchmark ran before the --plot path was checked")

    monkeypatch.setattr(pocketlm.bench, "bench", ran)
    for plot in ("", " "):
        assert cli.main(["bench", "-m", str(gguf), "--plot", plot]) == 1
        err = capsys.readouterr().err
        assert err == "pocket: error: --plot is empty (an unset shell variable?): give a path\n"


def test_lengths_the_context_cannot_hold_are_one_line_before_the_prompt_is_built(
        gguf, tmp_path, capsys, monkeypatch):
    """n_prompt + n_gen equal to the context passed the check and failed in the worker (a
    traceback, then "ended unexpectedly"); a huge n_prompt was built whole (GBs) before the
    check; a --gguf of another vocabulary failed inside llama.cpp."""
    import pocketlm.bench

    def built(*args, **kwargs):
        raise AssertionError("the prompt was built before the lengths were checked")

    monkeypatch.setattr(pocketlm.bench, "benchmark_ids", built)
    for n_prompt, n_gen in (("254", "2"), ("100000000", "2")):
        assert cli.main(["bench", "-m", str(gguf), "--threads", "1", "--runs", "1",
                         "--n-prompt", n_prompt, "--n-gen", n_gen]) == 1
        err = capsys.readouterr().err.splitlines()[-1]  # after the first-use pack's lines
        assert err.startswith("pocket: error:") and "must be below the model's context of 256" \
            in err, err
    monkeypatch.setattr(pocketlm.bench, "benchmark_ids", benchmark_ids)
    # --compare of the model itself: two rows "pocketlm", a ratio "pocketlm / pocketlm"
    assert cli.main(["bench", "-m", str(gguf), "--compare", str(gguf), "--runs", "1",
                     "--n-prompt", "8", "--n-gen", "1"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert "is the model -m benchmarks already" in err, err
    other = tmp_path / "other.gguf"
    tiny_gguf.write_tiny_gguf(other, "llama", seed=2, weight_type="Q4_0", max_context=256,
                              vocab_size=300)
    assert cli.main(["bench", "-m", str(gguf), "--vs", "llama.cpp", "--gguf", str(other),
                     "--runs", "1", "--n-prompt", "8", "--n-gen", "1"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("pocket: error:") and "give the GGUF of the same model" in err, err


def test_an_error_in_a_worker_during_a_run_is_one_line(gguf, capsys, monkeypatch):
    # only loading reported its error as one line: a failure in a run was a traceback, then
    # "the pocketlm benchmark process ended unexpectedly"
    monkeypatch.setattr("pocketlm.bench._check_lengths", lambda *args: None)
    assert cli.main(["bench", "-m", str(gguf), "--threads", "1", "--runs", "1",
                     "--n-prompt", "250", "--n-gen", "6"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ended unexpectedly" not in err, err
    assert err.splitlines()[-1].startswith("pocket: error: pocketlm: ContextLengthError"), err


def test_vs_llama_cpp_needs_a_gguf(gguf, tmp_path, capsys):
    out = tmp_path / "m.pocket"
    assert cli.main(["pack", str(gguf), "-o", str(out)]) == 0
    code = cli.main(["bench", "-m", str(out), "--vs", "llama.cpp", "--runs", "1",
                     "--n-prompt", "8", "--n-gen", "1"])
    assert code == 1 and "GGUF" in capsys.readouterr().err


def test_budget_line_states_measurement_and_budget():
    from pocketlm.bench import EngineResult, budget_line

    r = EngineResult(model="m", engine="pocketlm", threads=2, n_prompt=512, n_gen=128, runs=5,
                     prefill_tps=900.0, prefill_tps_min=800.0, prefill_tps_max=1000.0,
                     decode_tps=99.4, decode_tps_min=90.0, decode_tps_max=110.0,
                     peak_rss_delta_mb=131.2, file_mb=98.6, load_s=0.4, energy_j_est=5.0,
                     energy_method="estimate", prompt_hash="0")
    assert budget_line(r) == ("decode: MISS (99.4 tok/s; budget > 200)  "
                              "memory: PASS (131.2 MiB = 137.6 MB; budget < 300 MB)  "
                              "energy: PASS (5.000 J; budget <= 5.004)")
    # judged as printed: 200.3 / 299.7 / 5.003 and 199.7 / 300.2 / 5.0049 both printed as
    # "200 / 300 / 5.00" with opposite verdicts. The peak is MiB, the budget MB: 300 MiB
    # (314.6 MB) passed a 300 MB budget
    r.decode_tps, r.peak_rss_delta_mb, r.energy_j_est = 200.04, 286.07, 5.0044
    assert budget_line(r) == ("decode: MISS (200.0 tok/s; budget > 200)  "
                              "memory: MISS (286.1 MiB = 300.0 MB; budget < 300 MB)  "
                              "energy: PASS (5.004 J; budget <= 5.004)")
    # the energy budget is for a 512 + 128-token call: a shorter one passed it by being short
    r.n_prompt, r.n_gen, r.energy_j_est = 64, 16, 0.71
    assert budget_line(r).endswith("energy: not judged (0.710 J for 64 + 16 tokens; the "
                                   "budget <= 5.004 J is for a 512 + 128-token call)")


def test_bench_refuses_a_draft_model_it_cannot_use_before_any_run(gguf, tmp_path):
    from pocketlm.errors import ModelNotFoundError, PocketError

    seen = []
    with pytest.raises(ModelNotFoundError, match="^--speculative: 'no-such-model' .* "
                       r"\(prompt lookup is --speculative lookup\)$"):
        bench(str(gguf), threads=1, n_prompt=40, n_gen=4, runs=1, speculative="no-such-model",
              progress=lambda *a: seen.append(a))
    other = tmp_path / "other.gguf"
    tiny_gguf.write_tiny_gguf(other, "llama", seed=3, weight_type="Q4_0", max_context=256,
                              vocab_size=300)
    with pytest.raises(PocketError, match="has another vocabulary"):
        bench(str(gguf), threads=1, n_prompt=40, n_gen=4, runs=1, speculative=str(other),
              progress=lambda *a: seen.append(a))
    assert seen == []


def test_bench_speculative_row_alternates_and_reports_its_drafting(gguf):
    seen = []
    results = bench(str(gguf), threads=1, n_prompt=40, n_gen=12, runs=2, speculative="lookup",
                    progress=lambda engine, run, sample: seen.append((engine, run)))
    assert [r.engine for r in results] == ["pocketlm", "pocketlm+lookup"]
    assert seen == [("pocketlm", 0), ("pocketlm+lookup", 0), ("pocketlm+lookup", 1),
                    ("pocketlm", 1)]
    sp = results[1].speculative
    assert results[0].speculative is None and sp["tokens"] == 13 and sp["steps"] >= 1
    assert 0 <= sp["accepted"] <= sp["drafted"]
    # the two rows' tokens are compared run by run, not assumed equal
    assert sp["same_tokens"] is True and sp["runs_differing"] == 0
    table = format_table(results)
    assert "pocketlm+lookup / pocketlm: prefill" in table and "drafts accepted" in table
    assert "the same greedy tokens as plain decoding in every run" in table
    results[1].speculative.update(same_tokens=False, runs_differing=1)
    assert "tokens DIFFER from plain decoding in 1 of 2 runs" in format_table(results)


def test_bench_speculative_draft_max_reaches_the_drafter(gguf):
    results = bench(str(gguf), threads=1, n_prompt=40, n_gen=12, runs=1, speculative="lookup",
                    draft_max=1)
    sp = results[1].speculative
    assert sp["max_draft"] == 1 and sp["same_tokens"] is True
    assert sp["drafted"] <= sp["steps"]  # at most one drafted token a pass


def test_the_pocketlm_worker_imports_its_library_before_the_baseline():
    # the baseline is read after each engine's library is imported: pocketlm's was imported
    # inside the timed load (8 MB and 0.07 s counted as the model's), llama.cpp's before it
    import subprocess
    import sys

    code = ("import sys\n"
            "from pocketlm.bench.worker import PocketEngine\n"
            "assert 'pocketlm.api' not in sys.modules\n"
            "PocketEngine('unused.pocket', 1, 8)\n"
            "print('pocketlm.api' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "True", p.stderr
