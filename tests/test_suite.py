"""The capability suite: its tasks, pooling, intervals, predictions files and resume; the new
recipes (cloze-zh, gsm8k-cot); and a small real run of smollm2-135m with fixed scores."""

from __future__ import annotations

import json

import pytest
from test_evaluate import FakeEngine

from pocketlm.errors import PocketError
from pocketlm.evaluate.suite import (
    SUITE_VERSION,
    SUITES,
    Predictions,
    SuiteTask,
    abilities,
    format_table,
    run_header,
    run_suite,
    suite_tasks,
)
from pocketlm.evaluate.tasks import (
    Task,
    answer_is,
    evaluate_task,
    group_shots,
    normalize,
    wilson_interval,
)

# -- intervals, extraction, grouped shots ----------------------------------------------------


def test_wilson_interval_known_values():
    # 8 of 10: the textbook Wilson interval (0.490, 0.943); 0 of n starts at 0
    lo, hi = wilson_interval(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.16 < hi < 0.17
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(1 - hi)


def test_answer_is_takes_the_closing_number():
    assert answer_is("3 + 4 = 7 apples. The answer is 12.") == "12"
    assert normalize(answer_is("the answer is: $1,250.")) == "1250"
    assert answer_is("first the answer is 3, then the answer is 5") == "5"
    assert answer_is("no closing phrase, 4 then 9") == "9"
    assert answer_is("reasoning ... #### 72") == "72"
    assert answer_is("nothing") is None


def _grouped():
    ex = [{"subject": s, "q": f"{s}{i}"} for s in "abc" for i in range(3)]
    return Task(name="g", type="generation", template="{q}", examples=ex,
                fewshot_group="subject")


def test_group_shots_leave_one_out_then_next_group():
    task = _grouped()
    assert [s["q"] for s in group_shots(task, 0, 3)] == ["a1", "a2", "b0"]
    assert [s["q"] for s in group_shots(task, 7, 4)] == ["c0", "c2", "a0", "a1"]
    assert all(s is not task.examples[4] for s in group_shots(task, 4, 8))
    with pytest.raises(PocketError, match="only 8 other"):
        group_shots(task, 0, 9)


def test_grouped_shots_are_drawn_per_example_and_every_example_is_scored():
    ex = [{"subject": s, "question": f"{s}{i}", "choices": ["x", "y"], "answer": 0}
          for s in "ab" for i in range(2)]
    task = Task(name="mc", type="multiple_choice", template="{question}:", examples=ex,
                fewshot_group="subject")
    fake = FakeEngine()
    r = evaluate_task(fake, task, shots=2, progress=False)
    assert r["n"] == 4 and r["shots"] == 2
    # the first example's prompt shows a1 and then b0, never a0 itself
    first = next(s for s in fake.seen if s.rstrip(" xy").endswith("a0:"))
    assert "a1: x" in first and "b0: x" in first and first.count("a0") == 1


# -- the suite's shape ---------------------------------------------------------------------


def test_pocket_suite_covers_the_six_abilities_with_known_recipes():
    from pocketlm.evaluate.recipes import RECIPES
    from pocketlm.evaluate.suite import ABILITIES

    tasks = SUITES["pocket"]
    assert {t.ability for t in tasks} == set(ABILITIES)
    assert all(t.recipe in RECIPES for t in tasks)
    assert len({t.key for t in tasks}) == len(tasks)
    published = SUITES["published"]  # the reports' formulations: known recipes too
    assert published and all(t.recipe in RECIPES for t in published)
    with pytest.raises(PocketError, match="no suite named 'x'"):
        suite_tasks("x")
    with pytest.raises(PocketError, match="has no task 'nope'"):
        suite_tasks("pocket", ["nope"])


def test_abilities_pool_headline_tasks():
    rows = [
        {"task": "a", "ability": "Code", "headline": True, "n": 10, "correct": 5,
         "seconds": 1.0, "tokens": 100},
        {"task": "b", "ability": "Code", "headline": True, "n": 30, "correct": 27,
         "seconds": 3.0, "tokens": 300},
        {"task": "c", "ability": "Code", "headline": False, "n": 100, "correct": 0,
         "seconds": 1.0, "tokens": 1},
    ]
    (row,) = abilities(rows)
    assert (row["n"], row["correct"], row["accuracy"]) == (40, 32, 0.8)
    assert row["ci95"] == list(wilson_interval(32, 40)) and row["tokens_per_s"] == 100.0


def _fake_suite(monkeypatch):
    """A two-task suite over in-memory tasks, so run_suite runs without downloads."""
    tasks = {
        "mc": Task(name="mc", type="multiple_choice", template="Q{question}:",
                   examples=[{"question": str(i), "choices": ["x", "y"], "answer": i % 2}
                             for i in range(6)]),
        "gen": Task(name="gen", type="generation", template="N{question}=",
                    examples=[{"question": str(i), "answer": str(i)} for i in range(4)]),
    }
    monkeypatch.setitem(SUITES, "fake", (
        SuiteTask("mc-task", "English knowledge", "mc", 4),
        SuiteTask("gen-task", "Mathematics", "gen", 0, order="hash"),
    ))
    import copy

    return lambda name: copy.deepcopy(tasks[name])


def test_run_suite_counts_and_table(monkeypatch):
    load = _fake_suite(monkeypatch)
    fake = FakeEngine(prefer={"Q1:": " y", "Q3:": " y"},
                      outputs={"N0=": "0", "N1=": "1", "N2=": "5"})
    r = run_suite(fake, "fake", load=load, progress=False)
    by = {t["task"]: t for t in r["tasks"]}
    assert by["mc-task"]["n"] == 4 and by["gen-task"]["n"] == 4
    assert by["gen-task"]["correct"] == 2  # N0, N1 right; N2 wrong; N3 no output
    assert [a["ability"] for a in r["abilities"]] == ["English knowledge", "Mathematics"]
    table = format_table(r)
    assert "Mathematics" in table and "gen-task" in table and "95% CI" in table
    assert f"acc_norm {100 * by['mc-task']['acc_norm']:.1f}" in table
    # --limit overrides every task's count; 0 is the whole set
    r = run_suite(fake, "fake", load=load, limit=0, progress=False)
    assert {t["task"]: t["n"] for t in r["tasks"]} == {"mc-task": 6, "gen-task": 4}
    with pytest.raises(PocketError, match="non-negative"):
        run_suite(fake, "fake", load=load, limit=-1, progress=False)


def test_predictions_resume_and_refuse_another_run(monkeypatch, tmp_path):
    load = _fake_suite(monkeypatch)
    path = tmp_path / "p.jsonl"
    head = run_header("fake-model", "int4", "fake", "fake")
    fake = FakeEngine(outputs={"N0=": "0", "N1=": "1"})
    preds = Predictions(path, head)
    first = run_suite(fake, "fake", load=load, limit=2, predictions=preds, progress=False)
    preds.close()
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1 + 4
    # a torn last line (killed while writing) is dropped; the rest resumes
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"task": "mc-task", "ind')
    fake2 = FakeEngine(outputs={"N0=": "0", "N1=": "1"})
    preds = Predictions(path, head)
    again = run_suite(fake2, "fake", load=load, limit=3, predictions=preds, progress=False)
    preds.close()
    assert [t["resumed"] for t in again["tasks"]] == [2, 2]
    # the resumed items are not scored again; the third of each task is
    assert not any(k in s for s in fake2.seen for k in ("Q0:", "Q1:"))
    assert any("Q2:" in s for s in fake2.seen)
    assert len([s for s in fake2.seen if s.startswith("N")]) == 1  # one generation, not three
    assert again["tasks"][1]["correct"] == first["tasks"][1]["correct"]
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 1 + 6 and all("result" in x for x in lines[1:])
    with pytest.raises(PocketError, match="another run .*model"):
        Predictions(path, run_header("other", "int4", "fake", "fake"))
    other = tmp_path / "not-ours.jsonl"
    other.write_text('{"task": {"name": "x"}}\n', encoding="utf-8")
    with pytest.raises(PocketError, match="not a predictions file"):
        Predictions(other, head)


def test_a_last_line_cut_before_its_newline_is_kept_and_the_next_starts_a_line(monkeypatch,
                                                                              tmp_path):
    """A run killed after the last record but before its newline: that record is whole and
    kept, and the resumed run's first record goes on a line of its own, not glued to it (a
    line that no later resume could read, losing it and everything after it)."""
    load = _fake_suite(monkeypatch)
    path = tmp_path / "p.jsonl"
    head = run_header("fake-model", "int4", "fake", "fake")
    preds = Predictions(path, head)
    run_suite(FakeEngine(outputs={"N0=": "0", "N1=": "1"}), "fake", load=load, limit=2,
              predictions=preds, progress=False)
    preds.close()
    path.write_bytes(path.read_bytes()[:-1])  # the last newline never written
    for limit, resumed in ((3, [2, 2]), (3, [3, 3])):
        fake = FakeEngine(outputs={"N0=": "0", "N1=": "1"})
        preds = Predictions(path, head)
        again = run_suite(fake, "fake", load=load, limit=limit, predictions=preds,
                          progress=False)
        preds.close()
        assert [t["resumed"] for t in again["tasks"]] == resumed
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 1 + 6 and all("result" in x for x in lines[1:])


def test_cli_suite_errors_are_one_line(capsys):
    from pocketlm.cli import main

    for argv, message in (
        (["--suite", "nope"], "no suite named 'nope'"),
        (["--suite", "pocket", "--tasks", "foo"], "has no task 'foo'"),
        (["--suite", "pocket", "--limit", "-2"], "--limit must be non-negative"),
        (["--task", "mmlu", "--tasks", "foo"], "use it with --suite"),
        (["--suite", "pocket", "--shots", "3"], "--shots does not apply to --suite"),
    ):
        assert main(["eval", "-m", "smollm2-135m", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


@pytest.mark.parametrize("argv,message", [
    # 0 is falsy: --shots 0 and --seed 0 were silently ignored
    (["--shots", "0"], "--shots does not apply to --suite"),
    (["--seed", "0"], "--seed does not apply to --suite"),
    # a text file named by mistake: its first line is not JSON, which read as "no header
    # yet", and the file was truncated
    (["--predictions", "NOTES"], "is not a predictions file of pocket eval --suite"),
])
def test_cli_suite_refuses_flags_and_files_before_the_model_loads(tmp_path, capsys, argv,
                                                                  message):
    from pocketlm.cli import main

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n", encoding="utf-8")
    argv = [str(notes) if a == "NOTES" else a for a in argv]
    assert main(["eval", "-m", "no-such-model", "--suite", "pocket", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert notes.read_text(encoding="utf-8") == "my notes\n"


def test_predictions_never_truncate_a_file_that_is_not_one(tmp_path):
    head = run_header("fake-model", "int4", "fake", "fake")
    for text in ("my notes\nmore\n", "\n\nnotes after blank lines\n"):
        other = tmp_path / "notes.txt"
        other.write_text(text, encoding="utf-8")
        with pytest.raises(PocketError, match="not a predictions file"):
            Predictions(other, head)
        assert other.read_text(encoding="utf-8") == text
    torn = tmp_path / "torn.jsonl"  # killed while writing its header: started afresh
    torn.write_text('{"run": {"suite": "fa', encoding="utf-8")
    Predictions(torn, head).close()
    assert json.loads(torn.read_text(encoding="utf-8"))["run"] == head


@pytest.mark.parametrize("tasks", ["", ",", " , "])
def test_an_empty_tasks_list_is_refused_not_the_whole_suite(tasks, capsys, monkeypatch):
    """``--tasks "$TASKS"`` with the variable unset named no task: it used to run every task
    of the suite (hours) instead of saying so."""
    from pocketlm.cli import main
    from pocketlm.evaluate import cli as eval_cli

    def no_engine(args):
        raise AssertionError("the suite must not start")

    monkeypatch.setattr(eval_cli, "_open_engine", no_engine)
    assert main(["eval", "-m", "smollm2-135m", "--suite", "pocket", "--tasks", tasks]) == 1
    err = capsys.readouterr().err
    assert "--tasks names no task" in err and "mmlu-0shot" in err and err.count("\n") == 1
    assert main(["eval", "-m", "smollm2-135m", "--task", "mmlu", "--tasks", tasks]) == 1
    assert "use it with --suite" in capsys.readouterr().err


# -- recipes ------------------------------------------------------------------------------


def test_gsm8k_solution_reads_as_a_chain_of_thought():
    from pocketlm.evaluate.recipes import gsm8k_solution

    ref = "She has 3 + 4 = <<3+4=7>>7 apples.\nThen 7 * 2 = <<7*2=14>>14.\n#### 14"
    assert gsm8k_solution(ref) == "She has 3 + 4 = 7 apples. Then 7 * 2 = 14. The answer is 14."


@pytest.mark.real
def test_cloze_zh_is_deterministic_and_well_formed():
    from pocketlm.evaluate.recipes import build_cloze

    header, examples = build_cloze()
    assert header["type"] == "multiple_choice" and len(examples) == 412
    assert build_cloze()[1] == examples  # the same every time
    for ex in examples:
        choices = ex["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4
        assert len({len(c) for c in choices}) == 1 and ex["context"].endswith("，")
        half = ex["context"].rsplit("\n", 1)[-1]
        assert len(half) == len(choices[ex["answer"]])  # "A，" and "B。": one length
    answers = [ex["answer"] for ex in examples]
    assert all(answers.count(k) > 60 for k in range(4))  # the right answer is spread out
    assert examples[0]["title"] == "清平調·雲想衣裳花想容"


@pytest.mark.real
def test_gsm8k_cot_keeps_its_worked_examples_out_of_the_scored_items():
    from pocketlm.evaluate.recipes import load_recipe

    task = load_recipe("gsm8k-cot")
    assert task.shots == 4 and len(task.fewshot) == 4 and len(task.examples) == 1315
    shown = {s["question"] for s in task.fewshot}
    assert not shown & {e["question"] for e in task.examples}
    assert all(s["answer"].endswith(".") and "The answer is" in s["answer"]
               for s in task.fewshot)


# -- a real model: the suite in CI size ------------------------------------------------------

# smollm2-135m's default deploy file on the first 3 items of every task (greedy, so fixed):
# a change here is a change in the runtime, the prompts or the scoring; say which.
SMOLLM2_LIMIT3 = {"mmlu-5shot": 2, "mmlu-0shot": 2, "idioms-zh": 0, "cloze-zh": 0,
                  "gsm8k-cot": 0, "humaneval": 0, "ifeval-pocket": 1, "sentiment-zh": 2}


@pytest.mark.real
def test_smollm2_suite_smoke_has_fixed_scores(tmp_path, capsys):
    from pocketlm.cli import main

    preds = tmp_path / "p.jsonl"
    argv = ["eval", "-m", "smollm2-135m", "--suite", "pocket", "--limit", "3", "--json",
            "--predictions", str(preds)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["suite_version"] == SUITE_VERSION and out["precision"] == "int4"
    assert {t["task"]: t["correct"] for t in out["tasks"]} == SMOLLM2_LIMIT3
    assert all(t["n"] == 3 and t["seconds"] > 0 and t["tokens"] > 0 for t in out["tasks"])
    humaneval = [json.loads(x) for x in preds.read_text(encoding="utf-8").splitlines()
                 if '"task": "humaneval"' in x]
    assert len(humaneval) == 3 and all(h["result"]["status"] in ("passed", "failed", "error",
                                                                  "timeout") for h in humaneval)
    # the same command again resumes everything and gives the same numbers
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert [t["resumed"] for t in again["tasks"]] == [3] * len(SMOLLM2_LIMIT3)
    assert [t["correct"] for t in again["tasks"]] == [t["correct"] for t in out["tasks"]]


@pytest.mark.real
def test_ctrl_c_keeps_the_predictions_and_the_same_command_resumes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    preds = tmp_path / "p.jsonl"
    limit = 40
    cmd = [sys.executable, "-m", "pocketlm.cli", "eval", "-m", "smollm2-135m", "--suite",
           "pocket", "--tasks", "mmlu-0shot", "--limit", str(limit), "--json", "--predictions",
           str(preds)]
    # a shell starts background jobs with SIGINT ignored, and Python then installs no Ctrl-C
    # handler: give the child the default disposition, as a terminal would
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and (not preds.exists()
                                      or len(preds.read_text(encoding="utf-8").splitlines()) < 4):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err
    kept = [json.loads(x) for x in preds.read_text(encoding="utf-8").splitlines()]
    assert "run" in kept[0] and 3 <= len(kept) - 1 < limit  # whole lines only
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (task,) = json.loads(done.stdout)["tasks"]
    assert task["n"] == limit and task["resumed"] == len(kept) - 1


@pytest.mark.real
def test_a_recipe_file_or_archive_that_fails_its_checksum_is_refused(tmp_path, monkeypatch,
                                                                       capsys):
    from pocketlm.cli import main
    from pocketlm.evaluate import recipes

    built = recipes.recipe_path("mmlu")
    home = tmp_path / "home"
    monkeypatch.setenv("POCKET_HOME", str(home))
    copy = recipes.eval_dir() / built.name
    copy.parent.mkdir(parents=True)
    lines = built.read_text(encoding="utf-8").split("\n")
    lines[5] = lines[5].replace('"answer": "', '"answer": "B", "x": "')  # one edited example
    copy.write_text("\n".join(lines), encoding="utf-8")
    assert main(["eval", "-m", "smollm2-135m", "--task", "mmlu", "--limit", "1"]) == 1
    err = capsys.readouterr().err
    assert "fails its checksum" in err and err.count("\n") == 1
    # a package file that is not the pinned one
    wheel = home / "eval" / "downloads" / "lm_eval-0.4.13-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"PK\x03\x04 not the lm-eval wheel")  # a damaged download
    copy.unlink()
    assert main(["eval", "-m", "smollm2-135m", "--task", "mmlu", "--limit", "1"]) == 1
    err = capsys.readouterr().err
    assert "fails its checksum" in err and "lm_eval-0.4.13" in err


@pytest.mark.real
def test_a_recipe_file_built_from_another_package_version_is_built_again(tmp_path, monkeypatch):
    from pocketlm.evaluate import recipes

    built = recipes.recipe_path("sentiment-zh")
    monkeypatch.setattr(recipes, "eval_dir", lambda: tmp_path)  # the package stays where it is
    copy = tmp_path / built.name
    head, _, rest = built.read_text(encoding="utf-8").partition("\n")
    header = json.loads(head)
    header["task"]["source"]["version"] = "0.0.1"  # what an older pin of the package built
    copy.write_text(json.dumps(header, ensure_ascii=False) + "\n" + rest, encoding="utf-8")
    assert recipes.recipe_path("sentiment-zh") == copy
    assert copy.read_text(encoding="utf-8") == built.read_text(encoding="utf-8")
    recipes.check_recipe_file(copy)
    # the same version is not built again (a file built here is used as it is)
    before = copy.stat().st_mtime_ns
    assert recipes.recipe_path("sentiment-zh") == copy and copy.stat().st_mtime_ns == before
