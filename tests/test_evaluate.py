"""``pocket eval``: perplexity against direct computation, task scoring with a fake engine whose
answers are known, answer extraction, task-file errors, recipes, and the CLI."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import tiny_gguf

import pocketlm
from pocketlm.errors import PocketError
from pocketlm.evaluate import (
    Engine,
    PocketEngine,
    Task,
    evaluate_task,
    last_number,
    load_task,
    make_extractor,
    normalize,
    perplexity,
)
from pocketlm.evaluate.recipes import RECIPES, parse_mmlu_prompts
from pocketlm.evaluate.tasks import (
    build_prompt,
    candidates,
    split_continuation,
    split_shots,
    token_logprobs,
)

TEXT = ("hello world, the cat sat on the mat and it was good. The world is a big place "
        "with many things in it; hello again to you and the rest of them at the end of it all")


# -- a tiny real model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # the windows' bookkeeping is checked against one pass per prefix, to 1e-6: that holds
    # where a block's length does not choose its products, which AMX prefill does (bfloat16
    # products for blocks of 16 tokens or more, the int8 ones below)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_AMX", "0")
        with tiny_gguf.loaded_tiny_model(tmp_path_factory, "eval", seed=4) as env:
            yield env


def _direct_nll(model, ids: list[int]) -> float:
    """NLL of ids[1:] from one forward pass over the whole sequence."""
    return -float(token_logprobs(model.logits(ids)[:-1], ids[1:]).sum())


@pytest.mark.parametrize("bos", [False, True])
def test_perplexity_whole_text_equals_direct_computation(tiny, bos):
    model = tiny["model"]
    engine = PocketEngine(model)
    engine.bos_ids = [model.tokenizer.bos_id] if bos else []
    body = model.tokenizer.encode(TEXT, add_bos=False)
    assert 40 < len(body) < 120
    r = perplexity(engine, TEXT, window=128, progress=False)
    nll = _direct_nll(model, engine.bos_ids + body)
    assert r["tokens"] == (len(body) if bos else len(body) - 1)  # BOS itself never scored
    assert r["nll"] == pytest.approx(nll, rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(nll / r["tokens"]), rel=1e-6)
    assert r["chars"] == len(TEXT)
    assert r["ppl_char"] == pytest.approx(math.exp(nll / len(TEXT)), rel=1e-6)
    assert r["bits_per_char"] == pytest.approx(nll / len(TEXT) / math.log(2), rel=1e-6)


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("window,stride", [(32, 16), (24, 5), (20, 20), (17, 9)])
def test_perplexity_sliding_window(tiny, bos, window, stride):
    """Each token is scored once, by the first window that holds it: window k covers text
    tokens [k*stride, k*stride + cap) behind the BOS (cap = window - BOS); from the second
    window on, each scored token sees at least window - stride tokens."""
    model = tiny["model"]
    engine = PocketEngine(model)
    prefix = [model.tokenizer.bos_id] if bos else []
    engine.bos_ids = prefix
    body = model.tokenizer.encode(TEXT, add_bos=False)
    cap = window - len(prefix)
    step = min(stride, cap if bos else cap - 1)
    expected, scored = 0.0, 0
    for j in range(0 if bos else 1, len(body)):
        k = max(0, math.ceil((j - cap + 1) / step))  # first window whose end is beyond j
        begin = k * step
        if k > 0:
            assert len(prefix) + j - begin >= window - stride
        ids = prefix + body[begin: j + 1]
        expected -= float(token_logprobs(model.logits(ids)[-2:-1], [body[j]])[0])
        scored += 1
    r = perplexity(engine, TEXT, window=window, stride=stride, progress=False)
    assert r["tokens"] == scored
    assert r["nll"] == pytest.approx(expected, rel=1e-6)


def test_perplexity_defaults_and_errors(tiny):
    model = tiny["model"]
    r = perplexity(model, TEXT, progress=False)  # a PocketModel works directly
    assert r["window"] == min(model.n_ctx, 1024) and r["stride"] == r["window"] // 2
    with pytest.raises(PocketError, match="nothing to score"):
        perplexity(model, "a", progress=False)
    with pytest.raises(PocketError, match=f"exceeds the {model.n_ctx} tokens of context"):
        perplexity(model, TEXT, window=100_000, progress=False)
    with pytest.raises(PocketError, match="stride"):
        perplexity(model, TEXT, window=32, stride=0, progress=False)
    with pytest.raises(PocketError, match="window"):
        perplexity(model, TEXT, window=1, progress=False)


def test_kv_cache_continuations_match_full_forward(tiny):
    engine = PocketEngine(tiny["model"])
    context = engine.tokenize("the cat sat on the")
    conts = [engine.tokenize(" mat"), engine.tokenize(" world and"), engine.tokenize(" a")]
    fast = engine.continuation_logprobs(context, conts)
    slow = Engine.continuation_logprobs(engine, context, conts)
    np.testing.assert_allclose(fast, slow, rtol=1e-5)


def test_llama_cpp_engine_agrees_with_pocketlm(tiny):
    pytest.importorskip("llama_cpp")
    from pocketlm.evaluate import LlamaCppEngine

    ours = PocketEngine(tiny["model"])
    theirs = LlamaCppEngine(tiny["gguf"], n_ctx=128)
    assert theirs.tokenize(TEXT) == ours.tokenize(TEXT)
    assert theirs.bos_ids == ours.bos_ids
    a = perplexity(ours, TEXT, window=64, stride=32, progress=False)
    b = perplexity(theirs, TEXT, window=64, stride=32, progress=False)
    assert a["tokens"] == b["tokens"]
    assert b["ppl"] == pytest.approx(a["ppl"], rel=2e-2)


# -- a fake engine with known preferences ---------------------------------------------------


class FakeEngine(Engine):
    """Greedy longest-match tokenizer over ``PIECES`` plus single characters.

    ``prefer`` maps a prompt to the continuation the model 'knows': after the prompt, each
    next token of that continuation gets +10. ``boost`` adds a constant to single characters
    everywhere. ``outputs`` maps a prompt suffix to the text that generate() returns.
    """

    name = "fake"
    PIECES = (" A", ": ", "正面", "####")

    def __init__(self, prefer=None, boost=None, outputs=None, bos=True, max_context=4096):
        self.prefer, self.boost, self.outputs = prefer or {}, boost or {}, outputs or {}
        self.vocab = ["<bos>", *self.PIECES]
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.bos_ids = [0] if bos else []
        self.max_context = max_context
        self.seen: list[str] = []  # every context scored or generated from
        self.seen_ids: list[list[int]] = []

    def _id(self, piece: str) -> int:
        if piece not in self.index:
            self.index[piece] = len(self.vocab)
            self.vocab.append(piece)
        return self.index[piece]

    def tokenize(self, text, *, special=False):
        ids, i = [], 0
        while i < len(text):
            piece = next((p for p in self.PIECES if text.startswith(p, i)), text[i])
            ids.append(self._id(piece))
            i += len(piece)
        return ids

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids if i != 0)

    def logits(self, ids):
        self.seen.append(self.decode(ids))
        self.seen_ids.append(list(ids))
        for ch in "xb 正负面":  # make sure the vocabulary holds the test's characters
            self._id(ch)
        out = np.zeros((len(ids), 64), dtype=np.float32)
        for ch, bonus in self.boost.items():
            out[:, self._id(ch)] += bonus
        for i in range(len(ids)):
            text = self.decode(ids[: i + 1])
            for prompt, answer in self.prefer.items():
                whole = prompt + answer
                if text.startswith(prompt) and whole.startswith(text) and len(whole) > len(text):
                    nxt = self.tokenize(whole[len(text):])[0]
                    out[i, nxt] += 10.0
        return out

    def generate(self, ids, max_tokens, stop=()):
        prompt = self.decode(ids)
        self.seen.append(prompt)
        text = next((o for k, o in self.outputs.items() if prompt.endswith(k)), "")
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text

    def render_chat(self, messages):
        return f"<user>{messages[0]['content']}</user>\n"


def _mc_task(**kw):
    examples = [
        {"question": "1+1", "choices": ["2", "3", "4"], "answer": 0},
        {"question": "2+2", "choices": ["3", "4", "5"], "answer": "4"},
        {"question": "3+3", "choices": ["5", "6", "7"], "answer": "B"},
    ]
    return Task(name="arith", type="multiple_choice", template="Q: {question}\nA:",
                examples=examples, **kw)


def test_multiple_choice_accuracy_is_exact():
    # the model knows the first two answers and is wrong on the third
    fake = FakeEngine(prefer={"Q: 1+1\nA:": " 2", "Q: 2+2\nA:": " 4", "Q: 3+3\nA:": " 7"})
    r = evaluate_task(fake, _mc_task(), progress=False)
    assert (r["n"], r["correct"], r["type"]) == (3, 2, "multiple_choice")
    assert r["accuracy"] == pytest.approx(2 / 3) and r["acc_norm"] == pytest.approx(2 / 3)
    assert r["examples_per_s"] > 0
    assert fake.seen_ids and all(ids[0] == 0 for ids in fake.seen_ids)  # BOS first


def test_choices_with_broken_log_likelihoods_are_an_error_not_choice_a():
    """np.argmax over NaN log-likelihoods is index 0: a model whose logits were NaN scored
    near chance (mmlu 23.8 %, sentiment-zh 54.3 %: every answer the first choice), silently."""
    class Broken(FakeEngine):
        def continuation_logprobs(self, context, conts):
            return [float("nan")] * len(conts)

    with pytest.raises(PocketError, match="arith: .* not finite .*logits are broken"):
        evaluate_task(Broken(), _mc_task(), progress=False)


def test_acc_norm_normalises_by_characters():
    # 'x' is likely everywhere: " xxxx" has the best log-likelihood per character but " b"
    # the best total, so accuracy and acc_norm disagree in a known way
    fake = FakeEngine(boost={"x": 3.0})
    task = Task(name="len", type="multiple_choice", template="pick:",
                examples=[{"choices": ["b", "xxxx"], "answer": 1}])
    r = evaluate_task(fake, task, progress=False)
    assert r["accuracy"] == 0.0 and r["acc_norm"] == 1.0


def test_letter_continuation_and_options_field():
    fake = FakeEngine(prefer={"Q: 3+3\nA. 5\nB. 6\nC. 7\nAnswer:": " B"})
    task = _mc_task(continuation="letter")
    task.template = "Q: {question}\n{options}\nAnswer:"
    r = evaluate_task(fake, task, limit=3, progress=False)
    # the third is known; the others tie, and a tie goes to the first letter: right once
    assert r["correct"] == 2
    assert "Q: 3+3\nA. 5\nB. 6\nC. 7\nAnswer: B" in fake.seen


def test_classification_is_constrained_to_labels_and_counts_predictions():
    examples = [{"text": "好", "label": "正面"}, {"text": "差", "label": "负面"},
                {"text": "一般", "label": "负面"}]
    task = Task(name="senti", type="classification", template="评论：{text}\n情感：",
                examples=examples, labels=["正面", "负面"], choice_prefix="")
    fake = FakeEngine(prefer={"评论：好\n情感：": "正面", "评论：差\n情感：": "负面",
                              "评论：一般\n情感：": "正面"})
    r = evaluate_task(fake, task, progress=False)
    assert r["correct"] == 2 and r["accuracy"] == pytest.approx(2 / 3)
    assert r["predicted"] == {"正面": 2, "负面": 1}


def test_chat_option_renders_the_prompt_as_a_user_message():
    task = Task(name="senti", type="classification", template="评论：{text}",
                examples=[{"text": "好", "label": "正面"}], labels=["正面", "负面"], chat=True)
    fake = FakeEngine(prefer={"<user>评论：好</user>\n": "正面"})
    r = evaluate_task(fake, task, progress=False)
    assert r["correct"] == 1
    assert any(s.startswith("<user>评论：好</user>\n") for s in fake.seen)


def test_generation_exact_match_with_gsm8k_answers():
    examples = [
        {"question": "q1", "answer": "16 - 3 - 4 = <<16-3-4=9>>9\n#### 18"},
        {"question": "q2", "answer": "so\n#### 1,200"},
        {"question": "q3", "answer": "#### 5"},
    ]
    task = Task(name="gsm", type="generation", template="Question: {question}\nAnswer:",
                examples=examples, extract="last_number")
    fake = FakeEngine(outputs={"q1\nAnswer:": " She makes 9 * 2 = $18.\n\nQuestion: 7 eggs",
                               "q2\nAnswer:": " It costs $1200.00",
                               "q3\nAnswer:": " 5 apples, 6 pears"})
    r = evaluate_task(fake, task, progress=False)
    assert r["correct"] == 2  # q3's last number is 6
    assert r["accuracy"] == pytest.approx(2 / 3)


def test_instruction_task_counts_each_kind_of_instruction():
    examples = [
        {"prompt": "p1", "instructions": [{"check": "words_at_most", "args": {"n": 3}},
                                          {"check": "ends_with", "args": {"phrase": "bye"}}]},
        {"prompt": "p2", "instructions": [{"check": "words_at_most", "args": {"n": 3}}]},
        {"prompt": "p3", "instructions": [{"check": "ends_with", "args": {"phrase": "bye"}}]},
    ]
    task = Task(name="if", type="generation", template="{prompt}", examples=examples,
                check="instructions")
    fake = FakeEngine(outputs={"p1": "ok then bye", "p2": "far too many words here",
                               "p3": "Sure!\nbye"})
    r = evaluate_task(fake, task, progress=False)
    assert r["correct"] == 2 and r["instruction_accuracy"] == pytest.approx(3 / 4)
    assert r["instructions_by_check"] == {"ends_with": {"passed": 2, "given": 2},
                                          "words_at_most": {"passed": 1, "given": 2}}
    # a resumed run counts its recorded results the same way
    done = {}
    evaluate_task(fake, task, progress=False, on_example=lambda i, ex, res: done.update({i: res}))
    again = evaluate_task(FakeEngine(), task, progress=False, done=done)
    assert again["instructions_by_check"] == r["instructions_by_check"] and again["resumed"] == 3


def test_normalize_compares_numbers_by_their_exact_decimal_value():
    """Numbers keep every digit (through float, 20-digit integers a unit apart were one
    number), and only plain decimal numerals are numbers (float() also read nan, inf,
    infinity, exponents and underscores)."""
    assert normalize("12345678901234567891") == "12345678901234567891"
    assert normalize("12345678901234567891") != normalize("12345678901234567890")
    assert normalize(last_number("so 12345678901234567891 in all")) != \
        normalize("12345678901234567890")
    assert normalize("0.1") != normalize("0.10000000000000001")
    assert normalize("$1,234.50") == "1234.5" and normalize("18.00") == normalize(" 18. ") == "18"
    assert normalize(".5") == normalize("0.50") == "0.5" and normalize(".5") != normalize("5")
    assert normalize("-.5") == "-0.5" and normalize("-0") == normalize("0.000") == "0"
    assert normalize("+7") == normalize("$7") == normalize("007") == "7"
    assert normalize("-$5") == normalize("$-5") == "-5"
    assert normalize("0.000001") == "0.000001" and normalize("1e-06") == "1e-06"
    for text in ("nan", "NaN", "inf", "-inf", "Infinity", "1e3", "1E3", "1_000", "0x10"):
        assert normalize(text) == text.casefold(), text
    assert normalize("1e3") != normalize("1000") and normalize("inf") != normalize("infinity")
    assert normalize("١٢") == "12"  # any script's decimal digits, as the extractors find them


def test_answer_extraction_rules():
    assert last_number("a\n#### 1,234") == "1,234"
    assert last_number("x 3 then #### 72 dollars 9") == "72"
    assert last_number("it is 3, then 4.5.") == "4.5"
    assert last_number("no digits") is None
    assert normalize("$1,234.00") == "1234" and normalize(" 18. ") == "18"
    assert normalize("Paris.") == normalize("paris")
    assert make_extractor("regex:answer is \\(([A-D])\\)")("so the answer is (C).") == "C"
    assert make_extractor("regex:[0-9]+")("abc 42 7") == "42"
    assert make_extractor("first_line")("\n  Paris  \nLyon") == "Paris"
    with pytest.raises(PocketError, match="extract"):
        make_extractor("nearest_number")
    with pytest.raises(PocketError, match="regular expression"):
        make_extractor("regex:(")


def test_token_boundary_merges_are_scored_as_the_model_writes_them():
    fake = FakeEngine()
    ctx = "Answer"
    # "Answer" + " A" keeps the context tokens as a prefix: the merged " A" token is scored
    assert split_continuation(fake, ctx, " A") == [fake.index[" A"]]
    # "Answer:" then " A": the whole text merges ": " across the boundary, so the
    # continuation is tokenized on its own
    got = split_continuation(fake, "Answer:", " A")
    assert got == fake.tokenize(" A") == [fake.index[" A"]]
    assert fake.tokenize("Answer: A")[-2:] == [fake.index[": "], fake.index["A"]]


def test_trailing_space_moves_into_the_continuation():
    fake = FakeEngine(prefer={"Q: 1+1\nA:": " 2"})
    task = _mc_task()
    task.template = "Q: {question}\nA: "  # trailing space
    task.choice_prefix = ""
    r = evaluate_task(fake, task, limit=1, progress=False)
    assert r["correct"] == 1


def test_few_shot_from_the_examples_and_from_a_pool():
    task = _mc_task()
    few, todo = split_shots(task, 1)
    assert few == task.examples[:1] and todo == task.examples[1:]
    prompt = build_prompt(task, todo[0], few)
    assert prompt == "Q: 1+1\nA: 2\n\nQ: 2+2\nA:"
    pool = [{"question": f"{i}+0", "choices": [str(i), "x"], "answer": 0} for i in range(10)]
    task.fewshot = pool
    a, todo = split_shots(task, 3, seed=7)
    assert a == split_shots(task, 3, seed=7)[0] and len(todo) == 3
    assert all(s in pool for s in a) and a != split_shots(task, 3, seed=8)[0]
    with pytest.raises(PocketError, match="pool"):
        split_shots(task, 11)
    task.fewshot = []
    with pytest.raises(PocketError, match="leave none"):
        split_shots(task, 3)
    fake = FakeEngine(prefer={"Q: 1+1\nA: 2\n\nQ: 2+2\nA:": " 4"})
    r = evaluate_task(fake, _mc_task(), shots=1, progress=False)
    assert (r["n"], r["shots"]) == (2, 1) and r["correct"] >= 1


def test_an_empty_prompt_without_bos_is_refused():
    # nothing to condition on: Engine.continuation_logprobs (the llama.cpp engine's) sliced
    # no logits and raised IndexError
    task = Task(name="e", type="classification", template="{text}", labels=["a", "b"],
                examples=[{"text": "", "label": "a"}])
    with pytest.raises(PocketError, match="prompt is empty and the model adds no BOS"):
        evaluate_task(FakeEngine(bos=False), task, progress=False)
    assert evaluate_task(FakeEngine(bos=True), task, progress=False)["n"] == 1


def test_max_tokens_beyond_the_context_names_max_tokens():
    # it said "the answer alone does not fit the model's context", which points at the data
    task = Task(name="g", type="generation", template="Q: {q}", examples=[{"q": "x",
                                                                          "answer": "1"}])
    with pytest.raises(PocketError, match="max_tokens 256 leaves no room for the prompt in "
                                          "the model's context of 200 tokens"):
        evaluate_task(FakeEngine(max_context=200), task, progress=False)


def test_perplexity_of_a_broken_model_is_inf_not_a_traceback():
    # per-token losses past 709 nats (overflowing logits of a bad pack) made math.exp raise
    # OverflowError
    r = perplexity(FakeEngine(boost={"x": 1e5}), "ab ab ab ab", progress=False)
    assert r["nll"] > 1e5 and r["ppl"] == math.inf and r["ppl_char"] == math.inf
    assert math.isfinite(r["bits_per_char"])


# -- task files and their errors ------------------------------------------------------------


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


HEADER = json.dumps({"task": {"type": "classification", "template": "{text} ->",
                              "labels": ["pos", "neg"]}})


def test_jsonl_task_file_and_malformed_lines(tmp_path):
    path = _write(tmp_path / "t.jsonl", [HEADER, json.dumps({"text": "good", "label": "pos"}),
                                         "{not json", json.dumps({"text": "bad",
                                                                  "label": "neg"}), "[1, 2]"])
    warnings = []
    task = load_task(path, warn=warnings.append)
    assert len(task.examples) == 2 and task.skipped == 2 and task.labels == ["pos", "neg"]
    assert "skipped 2" in warnings[0]
    with pytest.raises(PocketError, match=r"t\.jsonl:3: malformed line"):
        load_task(path, strict=True)


def test_yaml_task_file_with_data_and_fewshot_files(tmp_path):
    _write(tmp_path / "data.jsonl", [json.dumps({"q": "2+2", "answer": "#### 4"})])
    _write(tmp_path / "shots.jsonl", [json.dumps({"q": "1+1", "answer": "#### 2"})])
    (tmp_path / "t.yaml").write_text(
        "name: sums\ntype: generation\ntemplate: \"Q: {q}\\nA:\"\nextract: last_number\n"
        "data: data.jsonl\nfewshot: shots.jsonl\nshots: 1\n", encoding="utf-8")
    task = load_task(tmp_path / "t.yaml")
    assert task.name == "sums" and task.shots == 1 and len(task.fewshot) == 1
    fake = FakeEngine(outputs={"Q: 2+2\nA:": " 4"})
    r = evaluate_task(fake, task, progress=False)
    assert r["accuracy"] == 1.0 and r["shots"] == 1
    assert "Q: 1+1\nA: #### 2\n\nQ: 2+2\nA:" in fake.seen


@pytest.mark.parametrize("lines,match", [
    ([], "empty"),
    ([HEADER], "no examples"),
    ([json.dumps({"text": "x", "label": "pos"})], "header line"),
    ([HEADER, json.dumps({"text": "x", "label": "maybe"})], r":2: label 'maybe' is not in"),
    ([HEADER, json.dumps({"body": "x", "label": "pos"})], r":2: the template refers to \{text\}"),
    ([json.dumps({"task": {"type": "essay", "template": "x"}}), "{}"], "type must be one of"),
    ([json.dumps({"task": {"type": "classification", "template": "{text}", "labels": "pos"}}),
      json.dumps({"text": "x", "label": "p"})], "labels"),
    ([json.dumps({"task": {"type": "multiple_choice", "template": "{q}"}}),
      json.dumps({"q": "x", "choices": ["a", "b"], "answer": 5})], r":2: answer 5"),
    ([json.dumps({"task": {"type": "multiple_choice", "template": "{q}", "colour": 1}}),
      json.dumps({"q": "x", "choices": ["a", "b"], "answer": 0})], "unknown task key"),
    # a traceback (dict() of a list), and "chat": "false" read as true
    ([json.dumps({"task": {"type": "classification", "template": "{text}", "source": [1, 2],
                           "labels": ["pos", "neg"]}}),
      json.dumps({"text": "x", "label": "pos"})], "'source' must be a mapping"),
    ([json.dumps({"task": {"type": "classification", "template": "{text}", "chat": "false",
                           "labels": ["pos", "neg"]}}),
      json.dumps({"text": "x", "label": "pos"})], "'chat' must be true or false"),
    # a list as a group's value: a TypeError (unhashable) once scoring began
    ([json.dumps({"task": {"type": "generation", "template": "{q}", "fewshot_group": "g"}}),
      json.dumps({"q": "x", "answer": "1", "g": [1]})], r":2: fewshot_group field 'g'"),
    # what a check reads: a KeyError traceback mid-run, or an error naming no file or line
    ([json.dumps({"task": {"type": "generation", "template": "{prompt}",
                           "check": "humaneval"}}),
      json.dumps({"prompt": "def f():\n", "answer": "pass"})],
     r":2: a 'humaneval' example needs prompt, test, entry_point"),
    ([json.dumps({"task": {"type": "generation", "template": "{prompt}",
                           "check": "instructions"}}),
      json.dumps({"prompt": "hi", "answer": "pass", "instructions": [{"check": "rhymes"}]})],
     r":2: instruction 0: unknown checker 'rhymes'"),
    ([json.dumps({"task": {"type": "generation", "template": "{prompt}",
                           "check": "instructions"}}),
      json.dumps({"prompt": "hi", "answer": "pass"})], r":2: an 'instructions' example needs"),
])
def test_task_file_errors_are_one_line(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(PocketError, match=match) as info:
        load_task(path)
    assert "\n" not in str(info.value)


def test_yaml_examples_with_number_keys_get_a_one_line_error(tmp_path):
    # the message listed the example's fields with sorted(): str and int keys (YAML allows
    # `1: x`) raised TypeError while the error was being written
    (tmp_path / "t.yaml").write_text(
        'type: classification\ntemplate: "{text}"\nlabels: [a, b]\nexamples:\n'
        "  - {1: x, label: a}\n", encoding="utf-8")
    with pytest.raises(PocketError, match=r"no field 'text' \(it has 1, label\)"):
        load_task(tmp_path / "t.yaml")


def test_binary_and_non_utf8_files(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(PocketError, match="binary"):
        load_task(tmp_path / "b.jsonl")
    (tmp_path / "l.jsonl").write_bytes(HEADER.encode() + b"\n{\"text\": \"caf\xe9\"}\n")
    with pytest.raises(PocketError, match=r"l\.jsonl:2: not UTF-8"):
        load_task(tmp_path / "l.jsonl")
    with pytest.raises(PocketError, match="no such file"):
        load_task(tmp_path / "missing.jsonl")


def test_mmlu_prompt_parsing():
    text = ("The following are multiple choice questions (with answers) about maths.\n\n"
            "Q: What is 2+2?\n(A) 3 (B) 4 (C) 5 (D) 6\nA: Let's think step by step. "
            "Two and two. The answer is (B).\n\n"
            "Q: Broken block without choices\nA: The answer is (A).")
    examples, bad = parse_mmlu_prompts({"high_school_maths": text})
    assert examples == [{"subject": "high school maths", "question": "What is 2+2?",
                         "choices": ["3", "4", "5", "6"], "answer": "B"}]
    assert bad == 1


def test_mmlu_cloze_scores_the_answer_texts_without_lettered_options(monkeypatch, tmp_path):
    # the formulation of SmolLM2's reported "MMLU cloze" (lighteval): no options in the prompt
    from pocketlm.evaluate import recipes

    ex = {"subject": "high school maths", "question": "What is 2+2?",
          "choices": ["3", "4", "5", "6"], "answer": "B"}
    monkeypatch.setattr(recipes, "build_mmlu", lambda: (
        {"name": "mmlu", "type": "multiple_choice", "continuation": "letter",
         "template": "{question}\n{options}\nAnswer:", "source": {}}, [ex]))
    header, examples = recipes.build_mmlu_cloze()
    path = tmp_path / "cloze.jsonl"
    path.write_text(json.dumps({"task": header}) + "\n" + json.dumps(examples[0]) + "\n")
    task = load_task(path)
    assert build_prompt(task, ex, []) == ("The following are questions about high school "
                                          "maths.\nQuestion: What is 2+2?\nAnswer:")
    assert candidates(task, ex) == ["3", "4", "5", "6"] and task.choice_prefix == " "


# -- the command line -----------------------------------------------------------------------


def test_cli_ppl_window_sizes_the_context(tiny, tmp_path, capsys, monkeypatch):
    """A --window longer than the default context loads a context that holds it (it said the
    window exceeded "the model's context", naming the default, not the model's own)."""
    import pocketlm.api
    from pocketlm.cli import main

    monkeypatch.setattr(pocketlm.api, "DEFAULT_CONTEXT", 32)
    model_path = str(tiny["model"].path)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["eval", "-m", model_path, "--ppl", str(text), "--window", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["window"] == 64
    assert out["ppl"] == pytest.approx(perplexity(tiny["model"], TEXT, window=64,
                                                  progress=False)["ppl"], rel=1e-9)
    assert main(["eval", "-m", model_path, "--ppl", str(text), "--window", "1000000"]) == 1
    err = capsys.readouterr().err
    assert f"exceeds the {tiny['model'].config.max_context} tokens of context" in err


def test_cli_ppl_and_task_json(tiny, tmp_path, capsys):
    from pocketlm.cli import main

    model_path = str(tiny["model"].path)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["eval", "-m", model_path, "--ppl", str(text), "--window", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    direct = perplexity(tiny["model"], TEXT, window=32, progress=False)
    assert out["ppl"] == pytest.approx(direct["ppl"], rel=1e-9)
    assert {"ppl", "ppl_char", "tokens", "model", "engine"} <= set(out)

    task = _write(tmp_path / "t.jsonl", [HEADER, json.dumps({"text": "good", "label": "pos"}),
                                         json.dumps({"text": "bad", "label": "neg"})])
    preds = tmp_path / "p.jsonl"
    assert main(["eval", "-m", model_path, "--task", str(task), "--json",
                 "--predictions", str(preds)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 2 and out["task"] == "t" and out["examples_per_s"] > 0
    assert out["accuracy"] in (0.0, 0.5, 1.0)
    rows = [json.loads(line) for line in preds.read_text(encoding="utf-8").splitlines()]
    assert [r["prediction"] in ("pos", "neg") for r in rows] == [True, True]
    assert out["accuracy"] == sum(r["correct"] for r in rows) / 2
    # another file named by mistake was replaced by the predictions (a corpus lost)
    assert main(["eval", "-m", model_path, "--task", str(task), "--predictions", str(text)]) == 1
    assert "is not a predictions file" in capsys.readouterr().err
    assert text.read_text(encoding="utf-8") == TEXT
    # an earlier run's predictions are replaced, as before
    assert main(["eval", "-m", model_path, "--task", str(task), "--json",
                 "--predictions", str(preds)]) == 0
    assert len(preds.read_text(encoding="utf-8").splitlines()) == 2


def test_cli_task_predictions_are_not_half_written(tiny, tmp_path, capsys):
    """A run that failed mid-way left the first examples' lines in the file, in place of
    the earlier run's predictions."""
    from pocketlm.cli import main

    model_path = str(tiny["model"].path)
    assert not tiny["model"].tokenizer.add_bos  # an empty prompt fails at the 2nd example
    task = _write(tmp_path / "t.jsonl", [HEADER, json.dumps({"text": "good", "label": "pos"}),
                                         json.dumps({"text": "bad", "label": "neg"})])
    preds = tmp_path / "p.jsonl"
    assert main(["eval", "-m", model_path, "--task", str(task), "--json",
                 "--predictions", str(preds)]) == 0
    before = preds.read_bytes()
    capsys.readouterr()
    failing = _write(tmp_path / "f.jsonl", [
        json.dumps({"task": {"type": "classification", "template": "{text}",
                             "labels": ["pos", "neg"]}}),
        json.dumps({"text": "good", "label": "pos"}), json.dumps({"text": "", "label": "neg"})])
    for out in (preds, tmp_path / "new.jsonl"):
        assert main(["eval", "-m", model_path, "--task", str(failing),
                     "--predictions", str(out)]) == 1
        assert "prompt is empty" in capsys.readouterr().err
    assert preds.read_bytes() == before and not (tmp_path / "new.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.jsonl", "p.jsonl", "t.jsonl"]


def test_sigterm_during_a_task_run_leaves_no_temporary_predictions_file(tiny, tmp_path):
    """SIGTERM while examples are scored: exit status 143, no traceback, the earlier
    predictions file as it was and no temporary beside it (SIGTERM's default action ended the
    process at once, leaving the temporary there)."""
    import signal
    import subprocess

    task = _write(tmp_path / "t.jsonl", [HEADER, json.dumps({"text": "good", "label": "pos"}),
                                         json.dumps({"text": "bad", "label": "neg"})])
    preds = tmp_path / "p.jsonl"
    preds.write_text('{"example": {"text": "earlier"}}\n', encoding="utf-8")
    argv = ["eval", "-m", str(tiny["model"].path), "--task", str(task), "--predictions",
            str(preds)]
    script = f"""
import os, signal, sys
from pocketlm.cli import main
from pocketlm.evaluate import tasks

real = tasks.evaluate_task

def evaluate_task(*args, on_example, **kwargs):
    def stop_after_one(*a):
        on_example(*a)
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, on_example=stop_after_one, **kwargs)

tasks.evaluate_task = evaluate_task
sys.exit(main({argv!r}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in proc.stderr, \
        proc.stderr
    assert preds.read_text(encoding="utf-8") == '{"example": {"text": "earlier"}}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "t.jsonl"]


def test_cli_seed_without_a_fewshot_pool_is_refused(tmp_path, capsys):
    # the task's shots are its first examples: --seed changed nothing, silently
    from pocketlm.cli import main

    task = _write(tmp_path / "t.jsonl", [HEADER, json.dumps({"text": "good", "label": "pos"}),
                                         json.dumps({"text": "bad", "label": "neg"})])
    assert main(["eval", "-m", "no-such-model", "--task", str(task), "--shots", "1",
                 "--seed", "3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed draws few-shot examples from a task's 'fewshot' " \
        "pool; task t takes its shots from its first examples" in err


def test_cli_instruction_task_prints_each_kind(tiny, tmp_path, capsys):
    from pocketlm.cli import main

    header = json.dumps({"task": {"name": "if", "type": "generation", "template": "{prompt}",
                                  "check": "instructions", "max_tokens": 8}})
    rows = [json.dumps({"prompt": "Say hi.", "answer": "pass", "instructions": [
        {"check": "words_at_most", "args": {"n": 100}}]})]
    task = _write(tmp_path / "if.jsonl", [header, *rows])
    assert main(["eval", "-m", str(tiny["model"].path), "--task", str(task)]) == 0
    out = capsys.readouterr().out
    assert "by kind (passed/given): words_at_most 1/1" in out  # 8 tokens are under 100 words

def test_cli_ppl_reads_stdin_as_utf8(tiny, capsys, monkeypatch, tmp_path):
    import io

    from pocketlm.cli import main

    model_path = str(tiny["model"].path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TEXT.encode("utf-8"))))
    assert main(["eval", "-m", model_path, "--ppl", "-", "--window", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ppl"] == pytest.approx(perplexity(tiny["model"], TEXT, window=32,
                                                  progress=False)["ppl"], rel=1e-9)
    # Latin-1 bytes were read as lone surrogates and refused as "not valid Unicode" far
    # from their source; the error now names stdin and the byte
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n")))
    assert main(["eval", "-m", model_path, "--ppl", "-"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stdin:1: not UTF-8 text (invalid byte 0xe9 at byte " \
        "offset 3)" in err
    # piped in, a file is read as it is when named: the same text, so the same perplexity
    raw = b"\xef\xbb\xbf" + f"{TEXT}\r\n{TEXT}\r\n".encode()  # a BOM, CRLF
    named = tmp_path / "crlf.txt"
    named.write_bytes(raw)
    scores = []
    for source in (str(named), "-"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
        assert main(["eval", "-m", model_path, "--ppl", source, "--window", "32",
                     "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out)["ppl"])
    assert scores[0] == scores[1]
    # a context beyond the model's is cut to it, and said (as pocket run says it of --ctx)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    assert main(["eval", "-m", model_path, "--ppl", "-", "--window", "32", "--json",
                 "--n-ctx", "99999999"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["ppl"] == scores[0]
    assert "--n-ctx 99999999 gives" in got.err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"text\x00more\n")))
    assert main(["eval", "-m", model_path, "--ppl", "-"]) == 1
    assert "stdin: looks like a binary file (NUL byte at byte offset 4)" in \
        capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path, capsys):
    from pocketlm.cli import main

    assert main(["eval", "-m", "x"]) == 1
    assert "--ppl FILE, --task TASK" in capsys.readouterr().err
    empty = tmp_path / "e.txt"
    empty.write_text("  \n", encoding="utf-8")
    assert main(["eval", "-m", "x", "--ppl", str(empty)]) == 1
    assert "empty" in capsys.readouterr().err
    assert main(["eval", "-m", "x", "--task", "no-such-task"]) == 1
    err = capsys.readouterr().err
    assert "no such task file or recipe" in err and "sentiment-zh" in err
    assert main(["eval", "--list-tasks", "--json"]) == 0
    names = [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()]
    assert names == list(RECIPES)


@pytest.mark.parametrize("argv,words", [
    # task flags with --ppl were silently ignored (no predictions file was written)
    (["--ppl", "T", "--predictions", "p.jsonl"], "--predictions does not apply to --ppl"),
    (["--ppl", "T", "--shots", "2"], "--shots does not apply to --ppl"),
    (["--ppl", "T", "--chat"], "--chat does not apply to --ppl"),
    (["--task", "T", "--window", "8"], "--window and --stride apply to --ppl"),
    # an unset variable: no predictions written, silently
    (["--task", "T", "--predictions", ""], "--predictions is empty"),
    # an unset variable: the generic "needs --ppl FILE, --task TASK or --suite" named none
    (["--ppl", ""], "--ppl is empty"),
    (["--task", ""], "--task is empty"),
    (["--suite", ""], "--suite is empty"),
    # a FIFO: opening it for writing blocked forever (after the model loaded)
    (["--task", "T", "--predictions", "FIFO"], "not a regular file"),
    # a FIFO to read: the read blocked forever
    (["--ppl", "FIFO"], "not a regular file"),
    # llama.cpp runs the GGUF's weights: --precision float was ignored (and recorded)
    (["--ppl", "T", "--engine", "llama.cpp", "--precision", "float"],
     "--precision applies to --engine pocketlm"),
])
def test_cli_refuses_flags_that_do_not_apply_and_fifos(tmp_path, capsys, argv, words):
    from pocketlm.cli import main

    text = tmp_path / "t.txt"
    text.write_text("hello there\n", encoding="utf-8")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [{"T": str(text), "FIFO": str(fifo)}.get(a, a) for a in argv]
    assert main(["eval", "-m", "no-such-model", *argv]) == 1  # refused before the model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert fifo.exists() and not fifo.is_file()


# -- a real model (cached in POCKET_HOME) ---------------------------------------------------


@pytest.mark.real
def test_real_model_sentiment_and_perplexity():
    from pocketlm.evaluate import load_recipe, sentiment_split

    train, test = sentiment_split()
    assert not {e["text"] for e in train} & {e["text"] for e in test}
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15
    model = pocketlm.load("smollm2-135m")
    r = evaluate_task(model, load_recipe("sentiment-zh"), limit=5, progress=False)
    assert r["n"] == 5 and 0.0 <= r["accuracy"] <= 1.0
    assert sum(r["predicted"].values()) == 5
    p = perplexity(model, "The quick brown fox jumps over the lazy dog. " * 8, progress=False)
    assert 1.0 < p["ppl"] < 50.0  # a repeated sentence is easy for a real model
