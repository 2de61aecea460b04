"""The pocket-zh-en recipe: its prompts (deterministic, nothing the capability suite measures),
the teacher-answer filter, batched generation, the whole pipeline on tiny models (resumable,
the same file from the same seed), and the registry entry that builds it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_gguf

from pocketlm.errors import ContextLengthError, ModelNotFoundError, PocketError

SMALL_COUNTS = {"sharegpt": 6, "news": 8, "idiom_gold": 6, "idiom_teacher": 2,
                "character": 3, "poem_gold": 3, "poem_teacher": 2, "review": 4}


@pytest.fixture(scope="module")
def prompts():
    from pocketlm.recipes.prompts import build_prompts

    return build_prompts(0, SMALL_COUNTS)


def test_prompts_are_deterministic_and_keep_out_what_the_suite_measures(prompts):
    from pocketlm.evaluate.instructions import validate_instruction
    from pocketlm.recipes.prompts import build_prompts, held_in, held_out_items

    assert build_prompts(0, SMALL_COUNTS) == prompts
    assert build_prompts(1, SMALL_COUNTS) != prompts  # the seed picks other items
    assert len({p["id"] for p in prompts}) == len(prompts) == sum(SMALL_COUNTS.values())
    held = held_out_items()
    for p in prompts:
        assert p["lang"] in ("en", "zh") and p["prompt"].strip()
        for c in p["checks"] or []:
            validate_instruction(c)
        if p["source"] == "idioms":
            word = p["prompt"].split("“")[1].split("”")[0]
            assert word not in held["idioms"]
            # nor a task's meaning or idiom inside the answer (a variant's gloss named both)
            assert not held_in(p["gold"] or "", held)
        if p["source"] == "sentiment":
            assert p["prompt"].split("\n\n", 1)[1] not in held["reviews"]
            assert p["gold"] in ("正面", "负面")
        if p["source"] == "chinese-poetry":
            assert not any(h in p["prompt"] for h in held["poem_lines"])
    # every source is present; gold answers only where the corpus holds them
    assert {p["source"] for p in prompts} == {"sharegpt", "peoples-daily", "idioms",
                                              "xinhua-dictionary", "chinese-poetry",
                                              "sentiment"}
    assert all(p["gold"] is None for p in prompts if p["source"] in ("sharegpt",
                                                                      "peoples-daily"))


def test_a_held_out_meaning_or_idiom_inside_an_answer_is_found():
    from pocketlm.recipes.prompts import held_in

    held = {"idioms": {"遂迷不寤"}, "meanings": {"执迷不悟；坚持错误而不觉悟。", "短"}}
    assert held_in("…执迷不悟；坚持错误而不觉悟。同遂迷忘反。", held)  # the meaning inside
    assert held_in("义同遂迷不寤。", held)  # the idiom named
    assert not held_in("坚持错误。短而精。", held)  # a short meaning is matched whole only


def test_verifiable_instructions_are_appended_in_the_prompts_language():
    import random

    from pocketlm.evaluate.instructions import CHECKERS
    from pocketlm.recipes.prompts import add_checks

    rng = random.Random(0)
    for _ in range(200):
        text, checks = add_checks("请介绍一下长城。", "zh", rng)
        assert text.startswith("请介绍一下长城。\n") and 1 <= len(checks) <= 2
        assert len({c["check"] for c in checks}) == len(checks)
        assert all(c["check"] in CHECKERS for c in checks)
        if any(c["check"] == "language_en" for c in checks):
            assert len(checks) == 1  # a language switch never comes with another instruction


@pytest.mark.parametrize("prompt, answer, why", [
    ({"lang": "en", "kind": "chat"}, {"answer": "Paris.", "finish_reason": "stop"}, None),
    ({"lang": "en", "kind": "chat"}, {"answer": "Paris, and", "finish_reason": "length"},
     "cut at the token limit"),
    ({"lang": "en", "kind": "chat"}, {"answer": "  ", "finish_reason": "stop"}, "empty"),
    ({"lang": "en", "kind": "chat"}, {"answer": "I am Qwen, made by Alibaba.",
                                      "finish_reason": "stop"}, "names a model or vendor"),
    ({"lang": "en", "kind": "chat"}, {"answer": "the same words again " * 8,
                                      "finish_reason": "stop"}, "repeats itself"),
    ({"lang": "zh", "kind": "summary"}, {"answer": "This is English.", "finish_reason": "stop"},
     "not in the asked language"),
    ({"lang": "en", "kind": "chat"}, {"answer": "这是中文。", "finish_reason": "stop"},
     "not in the asked language"),
    ({"lang": "zh", "kind": "translate"}, {"answer": "Good news.", "finish_reason": "stop"},
     None),
    ({"lang": "zh", "kind": "summary", "checks": [{"check": "language_en", "args": {}}]},
     {"answer": "A short summary.", "finish_reason": "stop"}, None),
    ({"lang": "en", "kind": "chat", "checks": [{"check": "words_at_most", "args": {"n": 3}}]},
     {"answer": "Paris is the capital.", "finish_reason": "stop"}, "fails its instructions"),
    ({"lang": "en", "kind": "chat", "checks": [{"check": "lowercase", "args": {}}]},
     {"answer": "paris is the capital.", "finish_reason": "stop"}, None),
    ({"lang": "zh", "kind": "json"}, {"answer": '{"people": ["张三"], "places": ["北京"]}',
                                      "finish_reason": "stop"}, None),
    ({"lang": "zh", "kind": "json"}, {"answer": '人物：张三', "finish_reason": "stop"},
     "fails its instructions"),
    ({"lang": "zh", "kind": "json"}, {"answer": "", "finish_reason": "prompt too long"},
     "prompt too long for the teacher"),
])
def test_teacher_answers_are_judged(prompt, answer, why):
    from pocketlm.recipes.pocket_zh_en import judge

    assert judge(prompt, answer) == why


# -- batched generation --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with tiny_gguf.loaded_tiny_model(tmp_path_factory, "recipe-tiny", seed=5,
                                     max_context=256) as env:
        yield env


def test_chat_batch_gives_each_conversation_what_chat_gives(tiny):
    model = tiny["model"]
    convs = [[{"role": "user", "content": f"question {i} " + "x" * i}] for i in range(7)]
    lengths = [3, 9, 1, 12, 5, 0, 7]
    want = [model.chat(c, max_tokens=n, temperature=0) for c, n in zip(convs, lengths)]
    for max_batch in (1, 3, 16):
        got = {}
        for n, conv in zip(lengths, convs):  # one call per length: max_tokens is per call
            for _, text, state in model.chat_batch([conv], max_tokens=n, temperature=0,
                                                   max_batch=max_batch):
                got[len(got)] = (text, state)
        assert [got[i][0] for i in range(7)] == want
        assert all(len(got[i][1].generated) <= lengths[i] for i in range(7))
    # many at once: yielded as they end, each with its own index
    out = {i: (text, st) for i, text, st in model.chat_batch(convs, max_tokens=9,
                                                             temperature=0, max_batch=3)}
    assert sorted(out) == list(range(7))
    assert [out[i][0] for i in range(7)] == [model.chat(c, max_tokens=9, temperature=0)
                                             for c in convs]
    assert {out[i][1].finish_reason for i in range(7)} <= {"stop", "length"}


def test_chat_batch_refuses_bad_arguments(tiny):
    model = tiny["model"]
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="max_batch"):
        list(model.chat_batch([conv], max_tokens=2, max_batch=0))
    with pytest.raises(PocketError):
        list(model.chat_batch([conv], max_tokens=-1))
    assert list(model.chat_batch([], max_tokens=2)) == []


def test_chat_batch_last_state_is_the_conversation_that_ended(tiny):
    """last_state was set to the last conversation's state when the batch started (before
    any had run), so it read an empty state while others were being yielded."""
    model = tiny["model"]
    model.chat([{"role": "user", "content": "before"}], max_tokens=2, temperature=0)
    before = model.last_state
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    batch = model.chat_batch(convs, max_tokens=4, temperature=0, max_batch=1)
    assert model.last_state is before  # nothing has run yet
    for _, _, state in batch:
        assert model.last_state is state and state.finish_reason in ("stop", "length")


@pytest.mark.parametrize("bad, error, said", [
    ([{"role": "user"}], PocketError, "conversations[2]: messages[0].content must be"),
    ([{"role": "user", "content": "x " * 400}], ContextLengthError, "conversations[2]: "),
])
@pytest.mark.parametrize("max_batch", [1, 16])
def test_chat_batch_refuses_a_bad_conversation_before_any_runs(tiny, monkeypatch, bad, error,
                                                               said, max_batch):
    """One conversation that cannot run (a malformed message, a prompt past the context)
    ended the batch after the ones before it had run, their replies lost (with max_batch 16
    nothing came back at all): it is refused by index before any runs."""
    import pocketlm.api as api

    model = tiny["model"]
    good = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]]
    ran = []
    real = api.run_batch
    monkeypatch.setattr(api, "run_batch", lambda *a, **k: ran.append(1) or real(*a, **k))
    with pytest.raises(error) as info:
        list(model.chat_batch([*good, bad], max_tokens=3, temperature=0, max_batch=max_batch))
    assert str(info.value).startswith(said) and not ran
    got = {i: text for i, text, _ in model.chat_batch(good, max_tokens=3, temperature=0)}
    assert [got[0], got[1]] == [model.chat(c, max_tokens=3, temperature=0) for c in good]


# -- the whole recipe on tiny models --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """A Recipe whose base is a tiny Gemma 3 file without a chat template (as the registry's
    gemma3-270m is) and whose teacher is a tiny llama file with ChatML."""
    from pocketlm.recipes.pocket_zh_en import Recipe

    root = tmp_path_factory.mktemp("recipe-models")
    base, teacher = root / "base.gguf", root / "teacher.gguf"
    tiny_gguf.write_tiny_gguf(base, "gemma3", seed=1, weight_type="F32", chat_template=None,
                              max_context=512)
    tiny_gguf.write_tiny_gguf(teacher, "llama", seed=2, weight_type="Q8_0", max_context=512)
    # sft_seq_len: most tiny chats' answers start at token 97, after the BOS the template
    # writes (SFT renders it as the runtime does)
    return Recipe(base=str(base), teacher=str(teacher), teacher_max_tokens=6, teacher_batch=4,
                  sft_steps=3, sft_batch=2, sft_seq_len=128, sft_warmup=1, qat_steps=2,
                  qat_rank=2, counts=SMALL_COUNTS)


def _run(out: Path, recipe, **kw):
    from pocketlm.recipes.pocket_zh_en import run

    return run(out, recipe=recipe, progress=False, threads=1, **kw)


def test_the_recipe_runs_resumes_and_gives_the_same_file_from_the_same_seed(tiny_recipe,
                                                                          tmp_path):
    from pocketlm.chat import GEMMA_TEMPLATE
    from pocketlm.data.download import sha256_file
    from pocketlm.formats.pocketfile import PocketFile

    a = tmp_path / "a"
    path = _run(a, tiny_recipe)
    assert path == a / "pocket-zh-en.pocket" and path.is_file()
    report = json.loads((a / "recipe_report.json").read_text())
    assert set(report["stages"]) == {"prompts", "teacher", "data", "sft", "qat", "export"}
    assert report["deploy_file"]["sha256"] == sha256_file(path)
    data = json.loads((a / "data_report.json").read_text())
    gold = sum(SMALL_COUNTS[k] for k in ("idiom_gold", "character", "poem_gold", "review"))
    assert data["chats"] >= gold and sum(data["kept"].values()) == data["chats"]
    teacher = [json.loads(x) for x in (a / "teacher.jsonl").read_text().splitlines()]
    assert len(teacher) == sum(SMALL_COUNTS.values()) - gold
    # the base has no template: the model is trained on, and ships, Gemma 3's turn format
    assert PocketFile(path).metadata["chat_template"] == GEMMA_TEMPLATE

    # a run stopped after its SFT stage, its teacher file cut mid-line, then resumed
    b = tmp_path / "b"
    b.mkdir()
    for name in ("prompts.jsonl", "prompts.meta.json"):
        shutil.copy(a / name, b / name)  # the same prompts (built from the corpora once)
    # then cut short: a prompts file that is not the one its record describes was used as it
    # was (a prompt edited, lines dropped); it is built again from the seed
    (b / "prompts.jsonl").write_bytes((a / "prompts.jsonl").read_bytes()[:-40])
    lines = (a / "teacher.jsonl").read_text().splitlines(keepends=True)
    (b / "teacher.jsonl").write_text("".join(lines[:3]) + lines[3][:10])
    assert _run(b, tiny_recipe, until="sft") is None
    assert not (b / "qat").exists()
    assert (b / "prompts.jsonl").read_bytes() == (a / "prompts.jsonl").read_bytes()
    assert sha256_file(_run(b, tiny_recipe)) == sha256_file(path)

    # a finished file is kept unless --force, which writes the same bytes again
    before = path.stat().st_mtime_ns
    assert _run(a, tiny_recipe) == path and path.stat().st_mtime_ns == before
    assert sha256_file(_run(a, tiny_recipe, force=True)) == report["deploy_file"]["sha256"]

    # another version of the recipe is refused in the same folder
    other = dataclasses.replace(tiny_recipe, sft_steps=4)
    with pytest.raises(PocketError, match="another version of the recipe .*sft_steps 3 -> 4"):
        _run(a, other)
    # --force moves that run aside, whole, and reuses its teacher answers (same prompts, same
    # teacher): the new version starts at its data stage
    teacher_answers = (a / "teacher.jsonl").read_bytes()
    assert _run(a, other, force=True, until="data") is None
    aside = tmp_path / "a.previous-1"
    assert sha256_file(aside / "pocket-zh-en.pocket") == report["deploy_file"]["sha256"]
    assert (a / "teacher.jsonl").read_bytes() == teacher_answers
    assert json.loads((a / "recipe.json").read_text())["sft_steps"] == 4
    assert not (a / "sft").exists() and not (a / "pocket-zh-en.pocket").exists()
    assert json.loads((a / "recipe_report.json").read_text())["stages"]["teacher"]["seconds"] < 60


def test_the_recipe_refuses_missing_inputs_before_any_work(tiny_recipe, tmp_path):
    from pocketlm.recipes import pocket_zh_en

    missing = dataclasses.replace(tiny_recipe, teacher=str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError):
        _run(tmp_path / "r", missing)
    assert not (tmp_path / "r" / "prompts.jsonl").exists()
    with pytest.raises(PocketError, match="unknown stage"):
        _run(tmp_path / "r", tiny_recipe, until="nope")
    # a damaged record of the run's recipe is one line naming it, and the run is left as it is
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for text in ("{", "[1, 2]", "\udcff"):
        (damaged / "recipe.json").write_text(text, errors="surrogateescape")
        with pytest.raises(PocketError, match=r"recipe\.json is damaged .*--force moves"):
            _run(damaged, tiny_recipe)
        assert os.listdir(damaged) == ["recipe.json"]
    need = pocket_zh_en.disk_needed(142_000_000)
    assert 4e9 < need < 7e9  # gemma3-270m-zh-en's checkpoints: a few GB, said before training


def test_a_run_records_its_prompt_construction_and_refuses_another(tiny_recipe, tmp_path,
                                                                   monkeypatch):
    """recipe.json did not record the version of the prompt construction: a run resumed after
    it changed (new prompts.jsonl, the old teacher answers and checkpoints kept) trained on
    prompts of two versions without a word."""
    import re

    from pocketlm.recipes import prompts

    version = prompts.PROMPTS_VERSION
    out = tmp_path / "run"
    recipe_file = out / "recipe.json"
    assert _run(out, tiny_recipe, until="prompts") is None
    record = json.loads(recipe_file.read_text())
    assert record["prompts_version"] == version
    files = {p.name: p.read_bytes() for p in out.iterdir()}

    def refused(old, new):
        with pytest.raises(PocketError) as e:
            _run(out, tiny_recipe, until="prompts")
        assert re.fullmatch(rf"{re.escape(str(recipe_file))} records a run of another version "
                            rf"of the recipe \(prompts_version {old} -> {new}\); --force .*",
                            str(e.value))
        assert "\n" not in str(e.value)
        assert sorted(os.listdir(out)) == sorted(files)  # the run is left as it is

    monkeypatch.setattr(prompts, "PROMPTS_VERSION", version + 1)
    refused(version, version + 1)
    # a record made before the version was recorded was made at version 1
    recipe_file.write_text(json.dumps(tiny_recipe.to_dict(), indent=1))
    refused(1, version + 1)
    monkeypatch.setattr(prompts, "PROMPTS_VERSION", 1)
    assert _run(out, tiny_recipe, until="prompts") is None  # the prompts built at version 1
    assert json.loads((out / "prompts.meta.json").read_text())["key"]["version"] == 1
    # --force moves the run aside and builds the prompts again; the teacher's answers are not
    # reused (they answer the other version's prompts)
    (out / "teacher.jsonl").write_text("")
    monkeypatch.setattr(prompts, "PROMPTS_VERSION", 2)
    assert _run(out, tiny_recipe, until="prompts", force=True) is None
    assert (tmp_path / "run.previous-1" / "teacher.jsonl").is_file()
    assert not (out / "teacher.jsonl").exists()
    assert json.loads(recipe_file.read_text())["prompts_version"] == 2
    assert json.loads((out / "prompts.meta.json").read_text())["key"]["version"] == 2


# -- the registry entry -----------------------------------------------------------------------


def test_the_registry_lists_the_recipe_model_and_never_trains_implicitly(tmp_path,
                                                                        monkeypatch):
    from pocketlm import registry
    from pocketlm.recipes import pocket_zh_en

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    row = next(r for r in registry.list_models() if r["name"] == "pocket-zh-en")
    assert row["recipe"] == "pocket-zh-en" and row["state"] == "no"
    with pytest.raises(ModelNotFoundError, match="pocket pull pocket-zh-en"):
        registry.resolve("pocket-zh-en")

    # `pull` runs the recipe (here a stand-in that returns a built file) and installs it
    built = _made_by_recipe(tmp_path, pocket_zh_en.RECIPE.to_dict())
    calls = []

    def fake_run(out, **kw):
        calls.append((Path(out), kw))
        return built

    monkeypatch.setattr(pocket_zh_en, "run", fake_run)
    path = registry.pull("pocket-zh-en", quiet=True)
    assert path == registry.model_path("pocket-zh-en") and path.read_bytes() == built.read_bytes()
    assert calls[0][0] == tmp_path / "home" / "recipes" / "pocket-zh-en"
    assert registry.verification_state("pocket-zh-en") == "yes"
    assert registry.resolve("pocket-zh-en") == path
    registry.pull("pocket-zh-en", quiet=True)
    assert len(calls) == 1  # built already: not run again
    from pocketlm import cli

    assert cli.main(["pull", "pocket-zh-en", "--verify"]) == 0
    path.write_bytes(path.read_bytes()[:100])  # damaged after it was built
    assert registry.verification_state("pocket-zh-en") == "changed"
    with pytest.raises(PocketError):
        registry.verify("pocket-zh-en")


def _made_by_recipe(tmp_path, recipe: dict | None, name: str = "built.pocket") -> Path:
    """A tiny deploy file whose provenance names ``recipe`` as a recipe's export does (None:
    a file no recipe made)."""
    from pocketlm.formats import open_source
    from pocketlm.pack import pack

    gguf = tmp_path / "t.gguf"
    if not gguf.is_file():
        tiny_gguf.write_tiny_gguf(gguf, "llama", seed=4, weight_type="Q8_0")
    src = open_source(gguf)
    if recipe is not None:
        src.provenance = {"source": "pocketlm recipe pocket-zh-en", "recipe": recipe}
    pack(src, tmp_path / name, progress=False, reproducible=True)
    return tmp_path / name


def test_a_file_another_recipe_made_is_not_taken_for_the_registry_model(tmp_path, monkeypatch):
    """A deploy file put in the models folder by other means was hashed and listed as built
    whatever made it: a variant of the recipe (more data, other steps) or another model."""
    from pocketlm import registry
    from pocketlm.recipes import pocket_zh_en

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    target = registry.model_path("pocket-zh-en")
    target.parent.mkdir(parents=True)
    variant = dict(pocket_zh_en.RECIPE.to_dict(), sft_steps=1000,
                   counts={"news": 1600, "sharegpt": 2400})
    for recipe, match in ((variant, r"another version of its recipe \(counts .*sft_steps "
                                    r"1000 -> 600\): `pocket pull pocket-zh-en --force`"),
                          (None, "was not made by its recipe")):
        shutil.copyfile(_made_by_recipe(tmp_path, recipe, "f.pocket"), target)
        with pytest.raises(PocketError, match=match):
            registry.pull("pocket-zh-en", quiet=True)
        assert registry.verification_state("pocket-zh-en") == "unverified"
        with pytest.raises(PocketError, match=match):
            registry.resolve("pocket-zh-en")
    # the recipe's own file, a record made before some fields existed included
    older = {k: v for k, v in pocket_zh_en.RECIPE.to_dict().items()
             if k not in ("rft_steps", "rft_prompts", "data_version")}
    shutil.copyfile(_made_by_recipe(tmp_path, older, "g.pocket"), target)
    assert registry.pull("pocket-zh-en", quiet=True) == target
    assert registry.verification_state("pocket-zh-en") == "yes"


def test_missing_torch_and_room_for_downloads_are_refused_before_anything_is_fetched(
        tiny_recipe, tmp_path, monkeypatch):
    """PyTorch was checked after the teacher and base were fetched (1.4 GB for the registry's
    recipe), and the room for those downloads not at all; the estimate came after them."""
    import sys
    from collections import namedtuple

    from pocketlm import registry
    from pocketlm.recipes import pocket_zh_en

    fetched = []
    monkeypatch.setattr(registry, "resolve", lambda name, **kw: fetched.append(name))
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(PocketError, match="need PyTorch"):
        pocket_zh_en.check_inputs(tmp_path / "a", tiny_recipe, "export")
    # a whole run too: its time estimate reads the trainer's settings, whose module imports
    # PyTorch (a 32-line traceback ending in ImportError came before the check)
    monkeypatch.setitem(sys.modules, "pocketlm.train.trainer", None)
    with pytest.raises(PocketError, match="need PyTorch"):
        pocket_zh_en.run(tmp_path / "c", recipe=tiny_recipe, progress=False)
    assert fetched == []
    monkeypatch.undo()
    monkeypatch.setattr(registry, "resolve", lambda name, **kw: fetched.append(name))
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pocket_zh_en.shutil, "disk_usage",
                        lambda path: namedtuple("usage", "total used free")(1, 1, 2 * 10**9))
    recipe = dataclasses.replace(tiny_recipe, teacher="qwen2.5-1.5b", base="gemma3-270m-zh-en")
    need = pocket_zh_en.download_bytes((recipe.teacher, recipe.base))
    assert need == 2 * (registry.REGISTRY["qwen2.5-1.5b"].size
                        + registry.REGISTRY["gemma3-270m"].size)
    with pytest.raises(PocketError, match=r"2\.0 GB free; fetching qwen2\.5-1\.5b and "
                       r"gemma3-270m-zh-en needs about 2\.7 GB"):
        pocket_zh_en.check_inputs(tmp_path / "a", recipe, "teacher")
    assert fetched == []
    assert "it first fetches 1.4 GB of models" in pocket_zh_en.estimate(tmp_path / "a", recipe)
    # the estimate is said before any model is fetched
    said = []
    monkeypatch.setattr(pocket_zh_en, "_say", said.append)
    with pytest.raises(PocketError, match="GB free"):
        pocket_zh_en.run(tmp_path / "b", recipe=recipe, progress=False, until="teacher")
    assert said and said[0].startswith("stages left:") and fetched == []


def test_cli_recipe_errors(tmp_path):
    def pocket(*args):
        return subprocess.run([sys.executable, "-m", "pocketlm.cli", *args],
                              capture_output=True, text=True,
                              env={**__import__("os").environ,
                                   "POCKET_HOME": str(tmp_path / "home")})

    p = pocket("train", "--recipe", "nope", "--out", str(tmp_path / "x"))
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "unknown recipe" in p.stderr
    p = pocket("train", "--recipe", "pocket-zh-en", "--data", "x.txt", "--out", str(tmp_path))
    assert p.returncode == 1 and "drop --data" in p.stderr
    p = pocket("train", "--recipe", "pocket-zh-en", "--holdout", "0.1", "--distill-alpha", "0.3",
               "--out", str(tmp_path))  # the recipe fixes them: they used to be ignored
    assert p.returncode == 1 and "drop --distill-alpha, --holdout" in p.stderr
    p = pocket("train", "--recipe", "pocket-zh-en", "--steps", "100", "--lr", "1e-4",
               "--out", str(tmp_path))  # a shorter run was asked for, the whole one started
    assert p.returncode == 1 and "drop --steps, --lr" in p.stderr
    p = pocket("run", "-m", "pocket-zh-en", "hello")
    assert p.returncode == 1 and "pocket pull pocket-zh-en" in p.stderr
    assert p.stderr.count("\n") == 1
    p = pocket("list")
    assert p.returncode == 0 and "pocket-zh-en" in p.stdout and "recipe" in p.stdout


def test_run_files_with_unicode_line_separators_read_back_whole(tmp_path):
    """A prompt or answer holding U+2028 / U+2029 / U+0085 (JSON writes them unescaped) is one
    record when a resumed run reads its files back, not two malformed halves."""
    from pocketlm.evaluate.tasks import read_jsonl
    from pocketlm.recipes.pocket_zh_en import _read_jsonl

    rows = [{"id": i, "prompt": f"a{c}b"} for i, c in enumerate(("\u2028", "\u2029", "\x85"))]
    path = tmp_path / "prompts.jsonl"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8")
    assert _read_jsonl(path) == rows
    assert [v for _, v in read_jsonl(path, text, strict=True)[0]] == rows


def test_a_stage_is_done_when_its_checkpoint_is_at_its_last_step(tmp_path):
    """The metrics' last row is written before that step's checkpoint: a run stopped while
    saving it has the row and a checkpoint one save behind, and was taken as finished (the
    next stages built from the earlier weights)."""
    import torch

    from pocketlm.recipes.pocket_zh_en import _finished

    run = tmp_path / "sft"
    run.mkdir()
    (run / "train_config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    for step, done in ((2, False), (3, True)):
        torch.save({"format": "pocketlm-checkpoint", "step": step}, run / "checkpoint.pt")
        assert _finished(run, 3) is done
    (run / "checkpoint.pt").write_bytes(b"cut")  # a damaged one: not finished either
    assert _finished(run, 3) is False


def test_a_run_file_cut_inside_a_character_reads_back_its_whole_lines(tmp_path):
    # a traceback (UnicodeDecodeError) in pocket pull, pocket run -m pocket-zh-en and the
    # recipe, for what a hard stop leaves
    from pocketlm.recipes.pocket_zh_en import _read_jsonl

    path = tmp_path / "teacher.jsonl"
    whole = json.dumps({"id": 1, "answer": "好。"}, ensure_ascii=False) + "\n"
    path.write_bytes(whole.encode() + whole.encode()[:-5])
    assert _read_jsonl(path) == [{"id": 1, "answer": "好。"}]


def test_the_estimate_needs_no_pytorch(tmp_path, monkeypatch):
    # a runtime-only install asked "what is left" (pocket run -m pocket-zh-en): a traceback
    from pocketlm.recipes.pocket_zh_en import estimate

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.delitem(sys.modules, "pocketlm.train.trainer", raising=False)
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 300}) + "\n")
    assert "sft (50% done)" in estimate(tmp_path)


def test_the_estimate_follows_the_runs_own_recipe(tmp_path):
    """A run with twice the recorded SFT steps is half done at the recorded run's last step,
    and what is left is priced by its own steps (it said "sft done, 0.5 h left")."""
    from pocketlm.recipes.pocket_zh_en import REFERENCE_MINUTES, Recipe, estimate

    (tmp_path / "prompts.meta.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": 1, "gold": None}) + "\n")
    (tmp_path / "teacher.jsonl").write_text(json.dumps({"id": 1}) + "\n")
    (tmp_path / "data_report.json").write_text("{}")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 600}) + "\n")

    recorded = estimate(tmp_path)
    assert recorded.startswith("stages left: qat, export;")
    longer = estimate(tmp_path, Recipe(sft_steps=1200, qat_steps=400))
    assert longer.startswith("stages left: sft (50% done), qat, export;")
    hours = (0.5 * 2 * REFERENCE_MINUTES["sft"] + 2 * REFERENCE_MINUTES["qat"]
             + REFERENCE_MINUTES["export"]) / 60
    assert f"about {hours:.1f} h" in longer
    # the teacher's stage follows the prompts it answers and their length (a recipe of 18
    # short answers was priced at the recorded run's 101 minutes)
    (tmp_path / "teacher.jsonl").unlink()
    full = estimate(tmp_path)
    half = estimate(tmp_path, Recipe(teacher_max_tokens=128))
    minutes = {k: float(e.split("about ")[1].split(" h")[0]) * 60 for k, e in
               (("full", full), ("half", half))}
    assert abs(minutes["full"] - minutes["half"] - REFERENCE_MINUTES["teacher"] / 2) <= 6


def test_installing_the_built_file_survives_another_pulls_sweep(tmp_path, monkeypatch):
    """The copy into the models folder is a ``.partial`` file: another pull sweeping that
    folder meanwhile (``make_home_dir``) took it for a killed writer's and deleted it, and the
    hours-long build ended in "No such file"."""
    from pocketlm import registry
    from pocketlm.data.download import sweep_stale_temps
    from pocketlm.recipes import build_recipe, pocket_zh_en

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    built = tmp_path / "built.pocket"
    built.write_bytes(b"a deploy file" * 100)
    monkeypatch.setattr(pocket_zh_en, "run", lambda out, **kw: built)
    target = registry.model_path("pocket-zh-en")
    target.parent.mkdir(parents=True)
    real_copy = shutil.copyfile

    def copy_then_sweep(src, dst, **kw):
        real_copy(src, dst, **kw)
        assert sweep_stale_temps(Path(dst).parent) == []  # another process's make_home_dir
        return dst

    monkeypatch.setattr(shutil, "copyfile", copy_then_sweep)
    assert build_recipe(registry.RECIPES["pocket-zh-en"], target, quiet=True) == target
    assert target.read_bytes() == built.read_bytes()
    assert registry.verification_state("pocket-zh-en") == "yes"
    assert sorted(p.name for p in target.parent.iterdir()) == [
        target.name, target.name + ".built.json"]  # no temp file of the copy or the record


def test_a_built_file_swapped_with_its_mtime_restored_is_changed(tmp_path, monkeypatch):
    """The built record held the size and mtime only: another file of the same size put in
    place with the mtime restored (``cp -p``, ``touch -r``; builds elsewhere differ in their
    last bits, not their size) was listed as built and trusted."""
    import os
    import time

    from pocketlm import registry
    from pocketlm.recipes import _hash_and_record

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    target = registry.model_path("pocket-zh-en")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"A" * 1000)
    _hash_and_record(registry.RECIPES["pocket-zh-en"], target, quiet=True)
    assert registry.verification_state("pocket-zh-en") == "yes"
    st = target.stat()
    time.sleep(0.05)
    target.write_bytes(b"B" * 1000)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert registry.verification_state("pocket-zh-en") == "changed"
    # a record written before ctimes were recorded is still read (size and mtime)
    record = target.with_name(target.name + ".built.json")
    _hash_and_record(registry.RECIPES["pocket-zh-en"], target, quiet=True)
    old = json.loads(record.read_text())
    del old["ctime_ns"]
    record.write_text(json.dumps(old))
    assert registry.verification_state("pocket-zh-en") == "yes"


_TORCHRUN_SCRIPT = """
import json, os, sys
from pocketlm.recipes.pocket_zh_en import Recipe, run
path = run(sys.argv[2], recipe=Recipe(**json.loads(sys.argv[1])), progress=False, threads=1)
os.write(1, f"RESULT {path}\\n".encode())  # one write: the ranks' lines never interleave
"""


def test_the_recipe_scales_out_unchanged_under_torchrun(tiny_recipe, tmp_path):
    """The same call under torchrun: rank 0 runs the stages, every rank trains its share of
    the same global batch, and the run is the one-process run's (losses to float rounding)."""
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    one = _run(tmp_path / "one", tiny_recipe)
    script = tmp_path / "recipe_run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    two = tmp_path / "two"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29600 + os.getpid() % 1000), str(script),
                        json.dumps(tiny_recipe.to_dict()), str(two)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("RESULT") == 2 and f"RESULT {two / one.name}" in p.stdout
    assert "RESULT None" in p.stdout  # rank 1 trained, and returned nothing
    for stage in ("sft", "qat"):
        a = [json.loads(x) for x in (one.parent / stage / "metrics.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (two / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for x, y in zip(a, b):
            assert abs(x["loss"] - y["loss"]) <= 1e-3 * abs(x["loss"]), (stage, x, y)
        assert json.loads((two / stage / "train_config.json").read_text())["train"]["batch_size"] == \
            tiny_recipe.sft_batch // 2
    assert (two / one.name).is_file()
    # a batch that two processes cannot share evenly is refused before any work
    odd = dataclasses.replace(tiny_recipe, sft_batch=3)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29700 + os.getpid() % 1000), str(script),
                        json.dumps(odd.to_dict()), str(tmp_path / "odd")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0 and "cannot be shared evenly by 2 processes" in p.stderr
    assert not (tmp_path / "odd").exists()


def test_a_refused_force_keeps_the_finished_file(tiny_recipe, tmp_path, monkeypatch):
    """``--force`` deleted the run's finished deploy file before the inputs were checked: a
    refusal there (no teacher, no PyTorch, no room) left the run without its file."""
    from pocketlm.recipes import pocket_zh_en

    out = tmp_path / "run"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps(pocket_zh_en.run_record(tiny_recipe), indent=1))
    final = out / "pocket-zh-en.pocket"
    final.write_bytes(b"the finished deploy file")

    def refuse(*args):
        raise PocketError("qwen2.5-1.5b is not pulled")

    monkeypatch.setattr(pocket_zh_en, "check_inputs", refuse)
    with pytest.raises(PocketError, match="not pulled"):
        _run(out, tiny_recipe, force=True)
    assert final.read_bytes() == b"the finished deploy file"


def test_an_export_again_needs_no_room_for_checkpoints(tiny_recipe, tmp_path, monkeypatch):
    """With both training runs finished, ``--force`` only exports again: it was refused for
    the gigabytes of checkpoints it would no longer write."""
    torch = pytest.importorskip("torch")
    from collections import namedtuple

    from pocketlm.recipes import pocket_zh_en

    out = tmp_path / "run"
    monkeypatch.setattr(pocket_zh_en.shutil, "disk_usage",
                        lambda path: namedtuple("usage", "total used free")(1, 1, 0))
    with pytest.raises(PocketError, match="checkpoints need"):
        pocket_zh_en.check_inputs(out, tiny_recipe, "export")
    for stage, steps in (("sft", tiny_recipe.sft_steps), ("qat", tiny_recipe.qat_steps)):
        (out / stage).mkdir()
        (out / stage / "train_config.json").write_text("{}")
        (out / stage / "metrics.jsonl").write_text(json.dumps({"step": steps}) + "\n")
        torch.save({"format": "pocketlm-checkpoint", "step": steps},
                   out / stage / "checkpoint.pt")
    pocket_zh_en.check_inputs(out, tiny_recipe, "export")


def test_the_rft_stage_trains_on_the_answers_that_pass_and_resumes_exactly(tiny_recipe, tmp_path,
                                                                          monkeypatch):
    from pocketlm.data.download import sha256_file
    from pocketlm.recipes import pocket_zh_en

    recipe = dataclasses.replace(tiny_recipe, rft_steps=2, rft_prompts=5, rft_max_tokens=6)
    assert "rft_steps" in recipe.to_dict() and "rft_steps" not in tiny_recipe.to_dict()
    # the tiny teacher's answers are all cut at its 6 tokens: no prompt to add instructions to
    with pytest.raises(PocketError, match="rft: no prompt to ask"):
        _run(tmp_path / "a", recipe)

    # the gold prompts stand in, each asking for at most 30 words
    def prompts(recipe, prompts, answers):
        gold = [p for p in prompts if p["gold"] is not None][:recipe.rft_prompts]
        return [{"id": p["id"], "prompt": p, "user": p["prompt"] + " At most 30 words.",
                 "checks": [{"check": "words_at_most", "args": {"n": 30}}]} for p in gold]

    monkeypatch.setattr(pocket_zh_en, "rft_prompts", prompts)
    # a tiny random model's answers pass nothing here: the stage says so, before any training
    monkeypatch.setattr(pocket_zh_en, "rft_judge", lambda *a: "fails its instructions")
    with pytest.raises(PocketError, match="rft: none of the QAT model's 5 answers .* passes"):
        _run(tmp_path / "a", recipe)
    assert not (tmp_path / "a" / "rft").exists()

    # answers judged on their length only: what passes is trained on, beside as many SFT chats
    def judge(prompt, answer, recipe):
        return None if len(answer["answer"]) % 2 == 0 else "odd"

    monkeypatch.setattr(pocket_zh_en, "rft_judge", judge)
    path = _run(tmp_path / "a", recipe)
    a = tmp_path / "a"
    samples = [json.loads(x) for x in (a / "rft-samples.jsonl").read_text().splitlines()]
    assert len(samples) == len({s["id"] for s in samples}) == 5
    report = json.loads((a / "recipe_report.json").read_text())
    got = report["rft"]["data"]
    kept = sum(len(s["answer"].strip()) % 2 == 0 for s in samples)
    assert got["kept"] == kept and got["prompts"] == len(samples)
    assert got["chats"] == len((a / "rft.jsonl").read_text().splitlines()) == 2 * kept
    assert report["rft"]["last"]["step"] == 2 and "rft" in report["stages"]
    assert json.loads((a / "rft" / "train_config.json").read_text())["train"]["base"] == \
        str(a / "qat")

    # stopped mid-sampling and resumed: the same answers, the same file
    b = tmp_path / "b"
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("rft", "pocket-zh-en.pocket",
                                                        "rft.jsonl"))
    lines = (a / "rft-samples.jsonl").read_text().splitlines(keepends=True)
    (b / "rft-samples.jsonl").write_text("".join(lines[:2]) + lines[2][:5])
    assert sha256_file(_run(b, recipe)) == sha256_file(path)
    assert (b / "rft-samples.jsonl").read_text() == (a / "rft-samples.jsonl").read_text()


def test_rft_prompts_add_instructions_to_the_prompts_whose_teacher_answer_is_kept():
    from pocketlm.evaluate.instructions import CHECKERS
    from pocketlm.recipes.pocket_zh_en import Recipe, rft_prompts

    answer = ("Gardening is a rewarding hobby for many people. Plants need water, light and "
              "patience. Many gardeners start with herbs, because herbs grow quickly and "
              "forgive mistakes. Gardening also gets people outside.")
    prompts = [{"id": f"p{i}", "gold": None, "checks": None, "lang": "en",
                "source": "sharegpt", "kind": "chat",
                "prompt": f"Tell me about gardening as a hobby ({i})."} for i in range(8)]
    prompts[0]["gold"] = "a gold answer"  # gold, and its own instructions: never taken
    prompts[1]["checks"] = [{"check": "lowercase", "args": {}}]
    answers = [{"id": p["id"], "answer": answer, "finish_reason": "stop", "tokens": 40}
               for p in prompts]
    answers[2]["finish_reason"] = "length"  # dropped by the data stage: not taken either
    recipe = Recipe(rft_prompts=6)
    got = rft_prompts(recipe, prompts, answers)
    assert got == rft_prompts(recipe, prompts, answers) and len(got) == 6
    assert len({c["id"] for c in got}) == 6
    assert not {c["prompt"]["id"] for c in got} & {"p0", "p1", "p2"}
    for c in got:
        assert c["prompt"]["prompt"] in c["user"] and c["user"] != c["prompt"]["prompt"]
        assert c["checks"] and all(k["check"] in CHECKERS for k in c["checks"])
    assert len(rft_prompts(Recipe(rft_prompts=2), prompts, answers)) == 2
