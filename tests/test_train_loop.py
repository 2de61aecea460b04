"""Training end to end on the CPU: tokenizer -> shards -> pre-train -> SFT -> export -> run, exact
resume after a hard stop, the 2-process torchrun path, and the errors users meet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from train_data import TINY_TRAIN_ARGS, make_chats, make_corpus

from pocketlm.errors import PocketError

# an import held to a float reference at float32 rounding: float activations (conftest)
FLOAT_ACTIVATIONS = True


def pocket(*args: str, check: bool = True, env: dict | None = None, **kw):
    cmd = [sys.executable, "-m", "pocketlm.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def own_pocket_home(tmp_path_factory):
    """A POCKET_HOME of this module's own: runs loaded as models are packed into its cache, not
    into the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model pre-trained from a text file with the shortest command."""
    root = tmp_path_factory.mktemp("train")
    corpus = make_corpus(root / "corpus.txt")
    run = root / "run"
    pocket("train", "--data", str(corpus), "--out", str(run), "--steps", "60",
           "--eval-every", "20", "--save-every", "20", "--vocab-size", "600",
           "--holdout", "0.05", *TINY_TRAIN_ARGS)
    return root, run


def test_pretraining_lowers_the_held_out_loss(pretrained):
    _, run = pretrained
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 61))
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 0.5, val
    assert rows[-1]["loss"] < rows[0]["loss"] - 2.0
    assert (run / "loss.svg").read_text().startswith("<svg")
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    cfg = json.loads((run / "train_config.json").read_text())
    assert cfg["model"]["arch"] == "pocket" and cfg["train"]["steps"] == 60


def test_export_matches_the_torch_model_and_runs(pretrained):
    from pocketlm.api import from_source, load
    from pocketlm.train.export import checkpoint_source
    from pocketlm.train.trainer import load_checkpoint, model_from_checkpoint

    root, run = pretrained
    model, tok = model_from_checkpoint(load_checkpoint(run))
    ids = tok.encode("The cat sat on the mat. 小猫在山上玩。")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).double().numpy()[0]
    # float export: the runtime's float path on the checkpoint's weights
    got = from_source(checkpoint_source(run)).logits(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    # INT4 export through the packing path
    out = root / "tiny.pocket"
    p = pocket("export", str(run), "-o", str(out))
    assert "bits" in p.stdout or out.is_file()
    qlog = load(out).logits(ids)
    agree = float(np.mean(qlog.argmax(-1) == ref.argmax(-1)))
    assert agree >= 0.95, agree
    r = pocket("run", "-m", str(out), "--raw", "-n", "12", "The cat")
    assert r.stdout.strip(), r.stderr
    # a run folder is a model source too: packed on first use, or run in float
    r2 = pocket("run", "-m", str(run), "--raw", "-n", "12", "The cat")
    assert r2.stdout == r.stdout
    assert np.abs(load(run, precision="float").logits(ids) - got).max() == 0
    # exporting over an existing file needs --force
    again = pocket("export", str(run), "-o", str(out), check=False)
    assert again.returncode == 1 and "--force" in again.stderr


def test_sft_trains_on_assistant_tokens_only(pretrained):
    from pocketlm.train.trainer import SFTData, load_checkpoint, model_from_checkpoint

    root, run = pretrained
    chats = make_chats(root / "chats.jsonl")
    _, tok = model_from_checkpoint(load_checkpoint(run))
    data = SFTData(chats, tok, None, 64)
    _, tgt = data.batch(0, 4)
    for row_tgt in tgt:
        text = tok.decode([int(t) for t in row_tgt if t != -100])
        assert text.startswith("The ") and "mat." in text and "Where" not in text
        assert "<|im_end|>" in text  # the end of the turn is learned too
    sft = root / "sft"
    pocket("train", "--mode", "sft", "--init", str(run), "--data", str(chats), "--out",
           str(sft), "--steps", "20", "--eval-every", "10", "--save-every", "10", *TINY_TRAIN_ARGS)
    rows = metrics(sft)
    assert rows[-1]["val_loss"] < rows[9]["val_loss"] or rows[-1]["loss"] < rows[0]["loss"]


def _train_cmd(run: Path, shards: Path, tok_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "pocketlm.cli", "train", "--data", str(shards), "--tokenizer",
            str(tok_dir), "--out", str(run), "--steps", str(steps), "--eval-every", "5",
            "--save-every", "5", *TINY_TRAIN_ARGS]


def test_resume_after_a_hard_stop_continues_exactly(pretrained, tmp_path):
    root, run = pretrained
    shards, tok_dir = run / "data", run / "tokenizer"
    straight = tmp_path / "straight"
    subprocess.run(_train_cmd(straight, shards, tok_dir, 30), check=True, capture_output=True)
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(_train_cmd(stopped, shards, tok_dir, 30), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # stop it hard once a checkpoint is there and steps go on
        if (stopped / "metrics.jsonl").is_file() and len(metrics(stopped)) >= 13:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(metrics(stopped))
    assert 10 <= done < 30, done
    subprocess.run(_train_cmd(stopped, shards, tok_dir, 30), check=True, capture_output=True)
    a, b = metrics(straight), metrics(stopped)
    assert [r["step"] for r in b] == list(range(1, 31))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_with_torchrun_match_one(pretrained, tmp_path, sharding):
    root, run = pretrained
    shards, tok_dir = run / "data", run / "tokenizer"
    one = tmp_path / "one"
    args = ["--data", str(shards), "--tokenizer", str(tok_dir), "--steps", "6",
            "--eval-every", "6", "--save-every", "6", "--preset", "tiny", "--seq-len", "64",
            "--lr", "3e-3", "--warmup", "2", "--eval-batches", "2", "--threads", "1", "--quiet"]
    pocket("train", "--out", str(one), "--batch-size", "8", *args)
    two = tmp_path / "two"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29500 + os.getpid() % 1000), "-m", "pocketlm.cli",
                        "train", "--out", str(two), "--batch-size", "4", *args,
                        *(["--fsdp"] if sharding == "fsdp" else [])],
                       capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = metrics(one), metrics(two)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) < 1e-4 * abs(x["loss"]), (x, y)
    # the checkpoint holds the whole model either way: it exports like a one-process run
    from pocketlm.train.export import checkpoint_source

    assert set(checkpoint_source(two).tensors) == set(checkpoint_source(one).tensors)


def test_bad_input_is_refused_clearly(pretrained, tmp_path):
    root, run = pretrained
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    p = pocket("train", "--data", str(empty), "--out", str(tmp_path / "r1"), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "empty" in p.stderr.lower()
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    p = pocket("train", "--data", str(binary), "--out", str(tmp_path / "r2"), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    gbk = tmp_path / "gbk.txt"
    gbk.write_bytes("小猫在山上玩。\n\n小狗在河边。\n".encode("gbk"))
    p = pocket("train", "--data", str(gbk), "--out", str(tmp_path / "r3"), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "UTF-8" in p.stderr
    # a checkpoint whose weights do not fit its config (shapes edited)
    from pocketlm.train.trainer import load_checkpoint

    ck = load_checkpoint(run)
    ck["model_config"] = {**ck["model_config"], "d_ff": ck["model_config"]["d_ff"] + 32}
    broken = tmp_path / "broken"
    broken.mkdir()
    torch.save(ck, broken / "checkpoint.pt")
    p = pocket("export", str(broken), "-o", str(tmp_path / "b.pocket"), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "shape" in p.stderr
    p = pocket("train", "--data", str(run / "data"), "--out", str(broken), "--steps", "80",
               *TINY_TRAIN_ARGS, check=False)
    # (after the "[resuming ...]" status line) one error line, no traceback
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("pocket: error:") and "do not fit" in last
    assert "Traceback" not in p.stderr
    # a run folder holding another preset's run
    p = pocket("train", "--data", str(run / "data"), "--out", str(run), "--preset",
               "pocket-10m", "--steps", "70", check=False)
    assert p.returncode == 1 and "tiny" in p.stderr and "pocket-10m" in p.stderr
    # not a checkpoint
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    (bogus / "checkpoint.pt").write_bytes(b"not a checkpoint")
    p = pocket("export", str(bogus), "-o", str(tmp_path / "x.pocket"), check=False)
    assert p.returncode == 1 and "checkpoint" in p.stderr
    assert not (tmp_path / "x.pocket").exists()
    with pytest.raises(PocketError, match="unknown preset"):
        from pocketlm.train.model import preset_config
        preset_config("nope")


def _tiny_run(tmp_path: Path, capsys, *extra: str):
    from pocketlm.cli import main

    corpus = tmp_path / "corpus.txt"
    if not corpus.is_file():
        make_corpus(corpus, n_docs=120)
    code = main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--vocab-size",
                 "300", "--holdout", "0.1", "--seq-len", "32", "--batch-size", "2",
                 "--eval-batches", "1", "--warmup", "1", "--threads", "1", "--quiet", *extra])
    return code, capsys.readouterr()


def test_a_damaged_run_folder_resumes_or_says_why_not(tmp_path, capsys):
    run = tmp_path / "run"
    assert _tiny_run(tmp_path, capsys, "--steps", "2")[0] == 0
    # metrics.jsonl with bytes that are not UTF-8: a raw UnicodeDecodeError on resume
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe{\"step\": 9\n")
    code, out = _tiny_run(tmp_path, capsys, "--steps", "3")
    assert code == 0 and "Traceback" not in out.err
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]
    # --steps below the checkpoint's step: it did nothing and said nothing, exit 0
    code, out = _tiny_run(tmp_path, capsys, "--steps", "1")
    assert code == 1 and "at step 3, past --steps 1" in out.err.splitlines()[-1]
    code, out = _tiny_run(tmp_path, capsys, "--steps", "3")  # finished: it says where it is
    assert code == 0 and out.out.startswith("step 3: loss")
    # train_config.json edited into JSON without the preset: a KeyError / TypeError traceback;
    # the checkpoint's own record is read instead
    saved = (run / "train_config.json").read_text()
    for edited in ('{"train": {}}', '{"train": 5}', "[" * 100_000):
        (run / "train_config.json").write_text(edited)
        code, out = _tiny_run(tmp_path, capsys, "--steps", "3")
        assert code == 0 and out.out.startswith("step 3: loss"), out.err
    (run / "train_config.json").write_text(saved)
    # a checkpoint that loads but lacks what a run needs: raw KeyErrors
    torch.save({"format": "pocketlm-checkpoint", "step": 3}, run / "checkpoint.pt")
    (run / "train_config.json").unlink()
    code, out = _tiny_run(tmp_path, capsys, "--steps", "4")
    assert code == 1 and "damaged training checkpoint" in out.err and "Traceback" not in out.err
    p = pocket("export", str(run), "-o", str(tmp_path / "x.pocket"), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "model_config" in p.stderr


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 8192000000 bytes. Error code 12"),
    MemoryError(),
])
def test_a_batch_that_does_not_fit_in_memory_is_said_in_one_line(tmp_path, capsys, monkeypatch,
                                                                 error):
    """--batch-size 1000000 ended in a 42-line traceback from torch's allocator: one line
    naming the flags, and the checkpoint already written is kept; other errors pass through."""
    assert _tiny_run(tmp_path, capsys, "--steps", "2")[0] == 0
    ckpt = (tmp_path / "run" / "checkpoint.pt").read_bytes()

    def no_memory(*a, **k):
        raise error

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", no_memory)
    code, out = _tiny_run(tmp_path, capsys, "--steps", "4")
    last = out.err.splitlines()[-1]  # after the "[resuming ...]" line
    assert code == 1 and "Traceback" not in out.err, out.err
    assert last.startswith("pocket: error: out of memory at step 3: a batch of 2 x 32 tokens "
                           "does not fit; lower --batch-size (now 2)")
    assert last.endswith("the checkpoint of step 2 is kept")
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == ckpt
    monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _tiny_run(tmp_path, capsys, "--steps", "4")


def test_a_run_refused_after_its_text_was_cut_leaves_no_folder_behind(tmp_path, capsys):
    """A text too small for --seq-len is found once the tokenizer is trained and the text cut:
    the new run folder was left holding them, and its shards then refused the corrected rerun
    ("holds token shards cut from ..."). A folder the refused run made is removed; one that
    was there before is kept."""
    from pocketlm.cli import main

    small = tmp_path / "small.txt"
    small.write_text("A cat sat.\n\nA dog ran.\n", encoding="utf-8")
    run = tmp_path / "run"
    args = ["train", "--out", str(run), "--vocab-size", "300", "--holdout", "0.1", "--seq-len",
            "32", "--batch-size", "2", "--eval-batches", "1", "--warmup", "1", "--threads",
            "1", "--quiet", "--steps", "1"]
    assert main([*args, "--data", str(small)]) == 1
    assert "held-out split got none" in capsys.readouterr().err and not run.exists()
    assert _tiny_run(tmp_path, capsys, "--steps", "1")[0] == 0  # the corrected run
    assert (run / "checkpoint.pt").is_file()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine\n", encoding="utf-8")
    args[2] = str(tmp_path / "kept")
    assert main([*args, "--data", str(small)]) == 1
    assert (tmp_path / "kept" / "notes.txt").read_text(encoding="utf-8") == "mine\n"


def test_shards_of_another_text_are_not_trained_on(tmp_path, capsys):
    assert _tiny_run(tmp_path, capsys, "--steps", "1")[0] == 0
    assert _tiny_run(tmp_path, capsys, "--steps", "2")[0] == 0  # the same text: it resumes
    # the text changed (or another file given): its old shards must not be reused silently
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus.read_text(encoding="utf-8") + "\n\nA new paragraph.\n",
                      encoding="utf-8")
    code, out = _tiny_run(tmp_path, capsys, "--steps", "3")
    assert code == 1 and "Traceback" not in out.err
    assert "holds token shards cut from" in out.err.splitlines()[-1]


def test_a_diverging_run_stops_before_its_weights_are_not_finite(tmp_path, capsys):
    # --lr 1e30 is finite, so it passes the flag checks; the loss then overflows: the run
    # stops in one line, and the checkpoint it keeps holds finite weights
    code, out = _tiny_run(tmp_path, capsys, "--steps", "6", "--save-every", "1", "--lr",
                          "1e30")
    assert code == 1 and "Traceback" not in out.err
    line = out.err.splitlines()[-1]
    assert "training diverged at step" in line and "lower --lr (now 1e+30)" in line
    from pocketlm.train.trainer import load_checkpoint

    ck = load_checkpoint(tmp_path / "run")
    assert f"the checkpoint of step {ck['step']} is kept" in line
    assert all(torch.isfinite(t).all() for t in ck["model"].values())


def test_an_interrupted_checkpoint_write_leaves_no_temporary(tmp_path, monkeypatch):
    from pocketlm.train import trainer

    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"the previous checkpoint")

    def cut(obj, f):
        Path(f).write_bytes(b"half")
        raise SystemExit(143)  # SIGTERM, as pocket train turns it into

    monkeypatch.setattr(trainer.torch, "save", cut)
    with pytest.raises(SystemExit):
        trainer._atomic_save({"x": 1}, path)
    assert path.read_bytes() == b"the previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_sigterm_stops_training_cleanly_and_it_resumes(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt", n_docs=120)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "pocketlm.cli", "train", "--data", str(corpus), "--out",
           str(run), "--vocab-size", "300", "--holdout", "0.1", "--seq-len", "32",
           "--batch-size", "2", "--eval-batches", "1", "--eval-every", "1000", "--save-every",
           "1", "--warmup", "1", "--threads", "1", "--quiet"]
    proc = subprocess.Popen([*cmd, "--steps", "100000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoint.pt").is_file():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # SIGTERM killed it outright (-15), possibly mid-write: checkpoint.pt.tmp was left behind
    assert proc.returncode == 128 + signal.SIGTERM and b"Traceback" not in err
    assert not [p.name for p in run.rglob("*.tmp")]
    done = len(metrics(run))
    p = subprocess.run([*cmd, "--steps", str(done + 2)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in metrics(run)] == list(range(1, done + 3))


def test_distill_data_refuses_bad_input_before_the_teacher_answers(tmp_path, capsys):
    from pocketlm.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Where is the cat?\n", encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9?\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    cases = [
        # a raw UnicodeDecodeError; a read of a FIFO that blocked forever
        (["--prompts", str(latin), "-o", str(tmp_path / "a.jsonl")], "not UTF-8"),
        (["--prompts", str(fifo), "-o", str(tmp_path / "a.jsonl")], "not a regular file"),
        # refused only after every answer was generated (a .tmp file left), or the FIFO
        # replaced by a regular file, or a raw ValueError
        (["--prompts", str(prompts), "-o", str(tmp_path / "folder")], "it is a folder"),
        (["--prompts", str(prompts), "-o", str(fifo)], "not a regular file"),
        (["--prompts", str(prompts), "-o", ""], "-o/--output is empty"),
        (["--prompts", str(prompts), "-o", str(tmp_path / "a.jsonl"), "--max-tokens", "0"],
         "--max-tokens must be at least 1"),
        # an earlier run's answers (hours of a teacher), or the prompts themselves, replaced
        (["--prompts", str(prompts), "-o", str(latin)], "exists; pass --force"),
        (["--prompts", str(prompts), "-o", str(prompts), "--force"], "is the --prompts file"),
    ]
    for argv, words in cases:
        assert main(["distill-data", "--teacher", "no-such-teacher", *argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "latin.txt",
                                                          "prompts.txt"]
    assert not fifo.is_file()
    # an unset shell variable as the teacher was named only as '' ("neither an existing file
    # or directory nor a registry model")
    assert main(["distill-data", "--teacher", " ", "--prompts", str(prompts), "-o",
                 str(tmp_path / "a.jsonl")]) == 1
    assert capsys.readouterr().err == ("pocket: error: --teacher is empty (an unset shell "
                                       "variable?): give a registry name or a path\n")


def test_distill_data_writes_into_a_new_folder(tmp_path, capsys):
    # -o in a folder not made yet failed once the teacher was loaded ("d.jsonl.partial: No
    # such file or directory"); every other output's folder is made
    import tiny_gguf

    from pocketlm.cli import main

    teacher = tmp_path / "teacher.gguf"
    tiny_gguf.write_tiny_gguf(teacher, "llama", seed=1, max_context=256)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Where is the cat?\nA dog.\n", encoding="utf-8")
    out = tmp_path / "new" / "sub" / "d.jsonl"
    assert main(["distill-data", "--teacher", str(teacher), "--prompts", str(prompts), "-o",
                 str(out), "--max-tokens", "2"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == ["Where is the cat?", "A dog."]
    assert sorted(p.name for p in out.parent.iterdir()) == ["d.jsonl"]


def test_logit_distillation_from_a_teacher_with_the_same_vocabulary(pretrained, tmp_path):
    root, run = pretrained
    shards, tok_dir = run / "data", run / "tokenizer"
    student = tmp_path / "student"
    pocket("train", "--data", str(shards), "--tokenizer", str(tok_dir), "--out", str(student),
           "--steps", "8", "--eval-every", "8", "--save-every", "8", "--distill-from", str(run),
           "--distill-alpha", "0.7", "--distill-temperature", "2", *TINY_TRAIN_ARGS)
    rows = metrics(student)
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"]
    # a teacher with another vocabulary is refused, pointing to sequence-level distillation
    other = tmp_path / "other-tok"
    from pocketlm.train.tokenizer_train import train_tokenizer

    train_tokenizer([(root / "corpus.txt")], 500, other, progress=False)
    p = pocket("train", "--data", str(shards), "--tokenizer", str(other), "--out",
               str(tmp_path / "s2"), "--steps", "2", "--distill-from", str(run), *TINY_TRAIN_ARGS,
               check=False)
    assert p.returncode == 1 and "vocabulary" in p.stderr and "distill-data" in p.stderr


def exported_teacher(pretrained) -> Path:
    """The pretrained run as a deploy file (exported once for the module)."""
    root, run = pretrained
    teacher = root / "teacher.pocket"
    if not teacher.is_file():
        pocket("export", str(run), "-o", str(teacher))
    return teacher


def test_sequence_level_distillation_data(pretrained, tmp_path):
    teacher = exported_teacher(pretrained)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Where is the cat?\n\n小猫在哪里？\n", encoding="utf-8")
    out = tmp_path / "distill.jsonl"
    pocket("distill-data", "--teacher", str(teacher), "--prompts", str(prompts), "-o", str(out),
           "--max-tokens", "8")
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == ["Where is the cat?", "小猫在哪里？"]
    assert all(r["messages"][1]["role"] == "assistant" for r in rows)
    # answered together, each is what the teacher says alone
    import pocketlm

    t = pocketlm.load(teacher)
    assert [r["messages"][1]["content"] for r in rows] == [
        t.chat([{"role": "user", "content": q}], max_tokens=8, temperature=0.0)
        for q in ("Where is the cat?", "小猫在哪里？")]


def test_distill_data_stopped_and_started_again_asks_only_for_the_missing_answers(
        pretrained, tmp_path, monkeypatch, capsys):
    """The teacher's answers (hours, for a real teacher) are kept as they end: a stopped run
    started again asks for the rest, and writes what an uninterrupted run writes."""
    from pocketlm.api import PocketModel
    from pocketlm.cli import main

    teacher = exported_teacher(pretrained)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Where is the cat?\n小猫在哪里？\nA dog.\nThe sea.\n", encoding="utf-8")
    args = ["distill-data", "--teacher", str(teacher), "--prompts", str(prompts),
            "--max-tokens", "6"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "-o", str(whole)]) == 0
    real, asked = PocketModel.chat_batch, []

    def stopped_after_two(self, convs, **kw):
        convs = list(convs)
        asked.append(len(convs))
        for n, item in enumerate(real(self, convs, **kw)):
            if n == 2 and len(asked) == 1:
                raise KeyboardInterrupt  # Ctrl-C with two answers made
            yield item

    monkeypatch.setattr(PocketModel, "chat_batch", stopped_after_two)
    out = tmp_path / "d.jsonl"
    partial = tmp_path / "d.jsonl.partial"
    assert main([*args, "-o", str(out)]) == 130
    assert not out.exists() and partial.is_file()
    with partial.open("a", encoding="utf-8") as f:
        # a line nested past the recursion limit (a traceback), then one cut by a kill: the
        # answers from there on are asked again
        f.write("[" * 100_000 + "\n" + '{"i": 3, "answ')
    capsys.readouterr()
    assert main([*args, "-o", str(out)]) == 0
    assert "2 of 4 answers already made" in capsys.readouterr().err
    assert asked == [4, 2] and not partial.exists()
    assert out.read_text(encoding="utf-8") == whole.read_text(encoding="utf-8")
    # the answers of another run are not taken for this one's
    partial.write_text(json.dumps({"run": {"teacher": "another"}}) + "\n"
                       + json.dumps({"i": 0, "answer": "theirs"}) + "\n", encoding="utf-8")
    assert main([*args, "-o", str(tmp_path / "d.jsonl")]) == 1  # exists: refused first
    assert main([*args, "-o", str(tmp_path / "e.jsonl")]) == 0  # another output, its own file
    (tmp_path / "f.jsonl.partial").write_text(partial.read_text(), encoding="utf-8")
    assert main([*args, "-o", str(tmp_path / "f.jsonl")]) == 1
    assert "another distill-data run" in capsys.readouterr().err
    assert main([*args, "-o", str(tmp_path / "f.jsonl"), "--force"]) == 0


def test_distill_data_resumes_whole_records_whatever_the_text(tmp_path, monkeypatch,
                                                             capsys):
    """The kept answers are cut in bytes: a teacher path of non-ASCII characters cut the log
    short of its header (the next run refused, or glued an answer onto a cut line), an answer
    holding U+2028 was split in two and it and every later answer asked again, a prompt line
    holding one was two prompts, and a run refused before its first answer left a log that
    refused the corrected run."""
    import tiny_gguf

    from pocketlm.api import PocketModel
    from pocketlm.cli import main

    teacher = tmp_path / "教师模型.gguf"
    tiny_gguf.write_tiny_gguf(teacher, "llama", seed=1, max_context=256)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Where is the cat?\nA dog\u2028still the dog.\nThe sea.\nHello\n",
                       encoding="utf-8")
    args = ["distill-data", "--teacher", str(teacher), "--prompts", str(prompts),
            "--max-tokens", "3"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "-o", str(whole)]) == 0
    rows = [json.loads(line) for line in whole.read_text(encoding="utf-8").split("\n")[:-1]]
    assert [r["messages"][0]["content"] for r in rows] == [
        "Where is the cat?", "A dog\u2028still the dog.", "The sea.", "Hello"]
    real, stops = PocketModel.chat_batch, [0, 2, 1]

    def stopped(self, convs, **kw):
        stop = stops.pop(0) if stops else None
        for n, item in enumerate(real(self, list(convs), **kw)):
            if n == stop:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(PocketModel, "chat_batch", stopped)
    out, partial = tmp_path / "d.jsonl", tmp_path / "d.jsonl.partial"
    assert main([*args, "-o", str(out)]) == 130  # before any answer: no log
    assert not partial.exists()
    assert main([*args, "-o", str(out)]) == 130  # two answers kept
    lines = partial.read_text(encoding="utf-8").split("\n")
    first = json.loads(lines[1])
    lines[1] = json.dumps({"i": first["i"], "answer": "line\u2028two"}, ensure_ascii=False)
    partial.write_text("\n".join(lines), encoding="utf-8")
    capsys.readouterr()
    assert main([*args, "-o", str(out)]) == 130  # one more
    assert "2 of 4 answers already made" in capsys.readouterr().err
    assert main([*args, "-o", str(out)]) == 0
    assert "3 of 4 answers already made" in capsys.readouterr().err
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n")[:-1]]
    want = [r["messages"][1]["content"] for r in rows]
    want[first["i"]] = "line\u2028two"  # the kept answer is taken, not asked again
    assert [r["messages"][1]["content"] for r in got] == want
    # refused before any answer (a prompt longer than the context): nothing left to refuse
    # the corrected run with
    monkeypatch.setattr(PocketModel, "chat_batch", real)
    long = tmp_path / "long.txt"
    long.write_text("word " * 3000 + "\n", encoding="utf-8")
    bad = ["distill-data", "--teacher", str(teacher), "--prompts", str(long), "-o",
           str(tmp_path / "m.jsonl"), "--max-tokens", "2"]
    assert main(bad) == 1 and "shorten the prompt" in capsys.readouterr().err
    assert not (tmp_path / "m.jsonl.partial").exists()
    long.write_text("Short.\n", encoding="utf-8")
    assert main(bad) == 0, capsys.readouterr().err


def test_bf16_on_a_cpu_without_it_is_warned_about(monkeypatch, capsys):
    from pocketlm.train import trainer

    monkeypatch.setattr(trainer, "_cpu_has_bf16", lambda: False)
    cpu = torch.device("cpu")
    trainer._warn_slow_bf16(trainer.TrainConfig(out="o", data="d", dtype="bf16"), cpu)
    assert "--dtype auto picks float32" in capsys.readouterr().err
    for dtype in ("auto", "fp32"):
        trainer._warn_slow_bf16(trainer.TrainConfig(out="o", data="d", dtype=dtype), cpu)
    monkeypatch.setattr(trainer, "_cpu_has_bf16", lambda: True)
    trainer._warn_slow_bf16(trainer.TrainConfig(out="o", data="d", dtype="bf16"), cpu)
    assert capsys.readouterr().err == ""
