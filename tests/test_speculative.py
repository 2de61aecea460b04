"""Speculative decoding: drafts verified in one pass give exactly the tokens plain decoding
gives (greedy and seeded sampling), on tiny models of every family and on smollm2-135m; the
drafters, the adaptive draft length, and bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_gguf

import pocketlm
from pocketlm.errors import PocketError
from pocketlm.speculative import DraftGate, DraftLength, PromptLookup, StepCost

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
REPEATS = "one two three four five six seven, one two three four five six seven, one two"


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    path = root / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, request.param, seed=7, weight_type="Q4_0",
                              max_context=512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_HOME", str(root / "home"))
        yield pocketlm.load(path)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookup(max_ngram=3, min_ngram=1)
    d.reset([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.propose(2) == [4, 5]  # "1 2 3" was followed by 4 5
    d.extend([7])
    assert d.propose(3) == []  # "7" never occurred before
    d.extend([1])
    # "3 7 1" and "7 1" are new; "1" last occurred before as the 7th token: 2 3 7 1 followed
    assert d.propose(4) == [2, 3, 7, 1]
    d.reset([5, 5, 5, 5])
    assert d.propose(2) == [5]  # the n-gram "5 5 5" occurred ending at 3: followed by one 5
    with pytest.raises(PocketError):
        PromptLookup(max_ngram=0)
    with pytest.raises(PocketError, match=r"got min_ngram 2 \(default 2\) and max_ngram 1 "
                                          r"\(default 8\)"):
        PromptLookup(max_ngram=1)  # only max given: the default min is named, not "2..1"


def test_prompt_lookup_prefers_the_occurrence_sharing_the_most_context():
    # "7 8" occurs twice; only the first occurrence shares "5 6 7 8" with the end of the text
    text = [5, 6, 7, 8, 1, 2, 9, 7, 8, 3, 4, 0, 5, 6, 7, 8]
    d = PromptLookup()  # default: up to 8 tokens of context
    d.reset(text)
    assert d.max_ngram == 8 and d.propose(2) == [1, 2]
    short = PromptLookup(max_ngram=2)
    short.reset(text)
    assert short.propose(2) == [3, 4]  # the most recent "7 8"


def test_draft_length_prior_sets_the_first_drafts():
    # before any draft is checked the acceptance is the prior; it decides how long to start
    assert DraftLength().acceptance == pytest.approx(2 / 3)
    assert DraftLength(prior=0.9).best() > DraftLength(prior=0.5).best()
    d = DraftLength()
    d.update(4, 0)  # the default prior weighs three drafts: one miss pulls it below 1/2
    assert d.acceptance < 0.5
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(PocketError, match="prior"):
            DraftLength(prior=bad)


def test_draft_length_follows_acceptance_and_cost_and_stops_when_it_does_not_pay():
    lengths = DraftLength(max_draft=8, probe_every=4, row_cost=0.25)
    for _ in range(30):
        lengths.update(8, 8)  # every draft kept: draft long
    assert lengths.acceptance > 0.95 and lengths.next() >= 6
    # a dear verification row: fewer drafts for the same acceptance
    dear = DraftLength(max_draft=8, row_cost=1.5)
    for _ in range(30):
        dear.update(8, 8)
    assert dear.next() < lengths.best()
    # in a batch of 16 rows an extra row is relatively dearer than alone
    assert lengths.best(batch=16) < lengths.best(batch=1)
    for _ in range(30):
        lengths.update(4, 0)  # nothing kept: stop drafting, probe now and then
    seen = [lengths.next() for _ in range(8)]
    assert seen.count(0) == 6 and seen.count(1) == 2
    # measured step times move the row cost: 1 ms a step, +1 ms a row -> r about 1
    timed = DraftLength(max_draft=8, row_cost=0.25)
    for k in (0, 4, 0, 8, 2, 6) * 10:
        timed.update(k, k, 0.001 * (1 + k))
    assert 0.7 < timed.row_cost < 1.3
    # one estimate shared by many sequences (the server's): steps timed with all their rows
    shared = StepCost(prior=0.25)
    a, b = DraftLength(cost=shared), DraftLength(cost=shared)
    for extra in (3, 0, 7, 1, 12, 5) * 10:
        shared.observe(extra, 0.02 * (1 + 0.6 * extra))
    assert 0.5 < a.row_cost == b.row_cost < 0.7
    for _ in range(30):
        a.update(8, 8)
    assert a.best(batch=4) < a.best(batch=1)
    for bad in (0, 17, 2.5, True):
        with pytest.raises(PocketError):
            DraftLength(max_draft=bad)


def _gate_run(gate, batch, steps, on_rate, off_rate):
    """``steps`` steps through ``gate`` where drafting gives ``on_rate`` tokens/s and plain
    steps ``off_rate``: which were allowed to draft."""
    allowed = []
    for _ in range(steps):
        a = gate.allow(batch)
        allowed.append(a)
        gate.observe(batch, a, batch * 2, batch * 2 / (on_rate if a else off_rate))
    return allowed


def test_draft_gate_drafts_in_batched_steps_only_where_drafting_measured_faster():
    gate = DraftGate(explore_every=8, warmup=4)
    # warm-up: the two ways alternate until each has 4 steps at this batch size
    assert _gate_run(gate, 4, 8, 45.0, 48.0) == [True, False] * 4
    # drafting slower at 4 requests: plain steps, drafting sampled 1 step in 8
    assert sum(_gate_run(gate, 4, 80, on_rate=45.0, off_rate=48.0)) == 10
    # faster at 2 requests (its own measurements): drafting, plain sampled 1 step in 8
    assert sum(_gate_run(gate, 2, 88, on_rate=60.0, off_rate=50.0)[8:]) == 70
    # a change is noticed: at 4 requests drafting becomes faster
    assert sum(_gate_run(gate, 4, 400, on_rate=60.0, off_rate=48.0)[-80:]) == 70
    # one request: always allowed (the draft length rule decides), nothing recorded
    assert all(gate.allow(1) for _ in range(20))
    gate.observe(1, True, 5, 0.01)
    summary = gate.summary()
    assert set(summary) == {"2", "4"}
    assert summary["4"]["drafting"] > summary["4"]["plain"]
    # larger batches share the largest bucket; a step of no measurable time is ignored
    gate.observe(30, False, 30, 0.0)
    assert "8" not in gate.summary()
    gate.observe(30, False, 30, 0.5)
    assert gate.summary()["8"] == {"plain": 60.0}


PROMPTS = [REPEATS, "a b c d e f g a b c d e f g a b c", "hello", "x " * 40]


def test_greedy_speculative_decoding_gives_plain_decodings_tokens(tiny):
    m = tiny
    drafted = 0
    for prompt in PROMPTS:
        for spec in ("lookup", {"method": "lookup", "max_draft": 3, "max_ngram": 2},
                     {"draft": m}):
            want = m.generate(prompt, max_tokens=40, temperature=0)
            plain_ids = list(m.last_state.generated)
            got = m.generate(prompt, max_tokens=40, temperature=0, speculative=spec)
            assert got == want and m.last_state.generated == plain_ids, (prompt, spec)
            st = m.last_speculative
            assert st.tokens == len(plain_ids) and st.accepted <= st.drafted
            drafted += st.drafted
    assert drafted > 0


def test_a_draft_model_that_is_the_target_is_always_right(tiny):
    m = tiny
    m.generate(REPEATS, max_tokens=30, temperature=0, speculative={"draft": m, "max_draft": 4})
    st = m.last_speculative
    # its greedy drafts are the target's (how many it drafts follows timings: not asserted)
    assert st.drafted > 0 and st.accepted == st.drafted and st.tokens_per_step > 1


class Oracle:
    """Drafts the plain answer's next tokens (every draft right), recording each length asked."""

    def __init__(self, answer):
        self.answer, self.done, self.asked = list(answer), 0, []

    def reset(self, prompt_ids):
        self.done = 0

    def extend(self, ids):
        self.done += len(ids)

    def propose(self, k):
        self.asked.append(k)
        return self.answer[self.done:self.done + k]


@pytest.mark.parametrize("max_tokens", [0, 1, 4, 9])
def test_drafts_stop_where_max_tokens_does_and_the_stats_count_the_passes(tiny, max_tokens):
    """max_tokens 0 gives no token (as plain decoding); a step gives its drafts + 1 tokens,
    so no step drafts past max_tokens - 1 (a row that would be thrown away); tokens per pass
    leaves out the token the prompt's pass gave."""
    from pocketlm.generate import run_sequence
    from pocketlm.speculative import SpeculativeStats, run_speculative

    m = tiny
    ids = m.tokenize(REPEATS)

    def sequence():
        sampling = dict(temperature=0, top_k=None, top_p=None, min_p=None,
                        repetition_penalty=None, seed=None)
        return m._sequence(ids, 128, max_tokens, sampling, None, [], make_cache=False)[0]

    plain = [t for t, _ in run_sequence(m.runtime, m.runtime.new_cache(100), sequence())]
    oracle, stats = Oracle(plain + [0] * 16), SpeculativeStats()
    got = [t for t, _ in run_speculative(m.runtime, m.runtime.new_cache(100), sequence(),
                                         oracle, DraftLength(max_draft=8), stats)]
    assert got == plain and len(plain) == max_tokens
    produced = 1
    for k in oracle.asked:
        assert k <= max_tokens - produced - 1
        produced += k + 1
    if stats.steps:
        assert stats.tokens_per_step == (len(plain) - 1) / stats.steps


def test_a_draft_model_named_by_path_is_loaded_once(tiny, monkeypatch):
    from pocketlm import api

    loads = []
    real = api.load
    monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    m = pocketlm.load(tiny.path)
    loads.clear()
    want = m.generate(REPEATS, max_tokens=12, temperature=0)
    for _ in range(3):
        assert m.generate(REPEATS, max_tokens=12, temperature=0,
                          speculative={"draft": str(tiny.path)}) == want
    assert len(loads) == 1


def test_seeded_sampling_draws_the_same_tokens_and_distribution(tiny):
    m = tiny
    firsts_plain, firsts_spec = [], []
    for seed in range(60):
        kw = dict(max_tokens=12, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1,
                  seed=seed)
        a = m.generate(REPEATS, **kw)
        ids_a = list(m.last_state.generated)
        b = m.generate(REPEATS, speculative="lookup", **kw)
        assert b == a and m.last_state.generated == ids_a
        firsts_plain.append(tuple(ids_a[:3]))
        firsts_spec.append(tuple(m.last_state.generated[:3]))
    # the same draws seed by seed: the same distribution, and it is not degenerate
    assert firsts_plain == firsts_spec and len(set(firsts_plain)) > 5


def test_chat_stream_and_stop_strings_with_speculation(tiny):
    m = tiny
    msgs = [{"role": "user", "content": REPEATS}]
    want = m.chat(msgs, max_tokens=30, temperature=0, stop=["seven"])
    pieces = list(m.chat(msgs, max_tokens=30, temperature=0, stop=["seven"], stream=True,
                         speculative="lookup"))
    assert "".join(pieces) == want
    # a context just large enough: drafts never run past the cache
    small = pocketlm.load(m.path, n_ctx=24)
    ids = small.tokenize(REPEATS)[:20]
    text = small.tokenizer.decode(ids)
    assert small.generate(text, max_tokens=30, speculative="lookup") == \
        small.generate(text, max_tokens=30)
    assert small.last_state.finish_reason == "length"


def test_bad_speculative_arguments(tiny):
    m = tiny
    for bad, match in [("nope-model", "nope-model"), (42, "speculative must be"),
                       ("Lookup", "speculative draft model: 'Lookup'"),
                       ({"method": "medusa"}, "unknown speculative method"),
                       ({"max_drafts": 3}, "unknown speculative option"),
                       ({"method": "lookup", "max_draft": 0}, "max_draft"),
                       ({"method": "lookup", "max_ngram": 9}, "n-gram"),
                       # the unknown key is the one named (max_draft's range was, first)
                       ({"foo": 1, "max_draft": 99}, "unknown speculative option.*: foo")]:
        with pytest.raises(PocketError, match=match):
            m.generate("hi", max_tokens=3, speculative=bad)


def test_a_draft_model_given_bare_is_a_draft_model(tiny):
    """A loaded model or a path given as speculative= itself was refused, with a message that
    listed 'a draft model' as allowed; a name was taken. All three are {"draft": ...}; {} is
    prompt lookup with its defaults."""
    from pathlib import Path

    m = tiny
    want = m.generate(REPEATS, max_tokens=8)
    for spec in (m, Path(m.path), str(m.path), {}):
        assert m.generate(REPEATS, max_tokens=8, speculative=spec) == want
    assert m.last_speculative is not None


def test_speculative_options_of_the_wrong_kind_are_refused_by_name(tiny):
    """Lookup sizes that are not integers, a draft that is no name, path or model, and lookup
    options beside a draft model (which ignores them) are refused, not coerced by int() or
    str(); numpy integers are taken as the other lengths are."""
    m = tiny
    want = m.generate(REPEATS, max_tokens=6)
    for bad, match in [({"max_ngram": "abc"}, "max_ngram must be an integer"),
                       ({"max_ngram": None}, "max_ngram must be an integer"),
                       ({"min_ngram": 1.9}, "min_ngram must be an integer"),
                       ({"max_ngram": True, "min_ngram": True}, "must be an integer"),
                       ({"draft": None}, "draft must be a model name"),
                       ({"draft": 3}, "draft must be a model name"),
                       ({"draft": m, "max_ngram": 3}, "max_ngram are prompt lookup's"),
                       ({"draft": m, "method": "lookup"}, "method are prompt lookup's")]:
        with pytest.raises(PocketError, match=match):
            m.generate(REPEATS, max_tokens=6, speculative=bad)
    assert m.generate(REPEATS, max_tokens=6) == want
    spec = {"max_draft": np.int64(3), "max_ngram": np.int64(4), "min_ngram": np.int32(2)}
    assert m.generate(REPEATS, max_tokens=6, speculative=spec) == want


def test_a_draft_model_with_another_vocabulary_is_refused(tiny, tmp_path, monkeypatch):
    from pocketlm import api

    other = tmp_path / "other.gguf"
    tiny_gguf.write_tiny_gguf(other, "llama", seed=8, weight_type="Q4_0", vocab_size=300)
    loads = []
    real_load = api.load
    monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    for _ in range(2):
        with pytest.raises(PocketError, match="another vocabulary"):
            tiny.generate("hi", max_tokens=3, speculative={"draft": str(other)})
    assert loads == []  # refused from its header: its weights were never loaded
    # a refused model is not kept (it stayed loaded for the life of the target: +300 MB for
    # a gemma draft of a smollm2 target)
    assert not any(d.path and Path(d.path).name.startswith("other")
                   for d in tiny._draft_models.values())


def test_a_draft_model_named_by_name_and_by_its_file_is_loaded_once(tiny, monkeypatch):
    from pocketlm import api

    m = pocketlm.load(tiny.path)
    want = m.generate(REPEATS, max_tokens=12, temperature=0)
    loads = []
    real = api.load
    monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    source = Path(os.environ["POCKET_HOME"]).parent / "tiny.gguf"  # packed into tiny.path
    for draft in (str(source), str(tiny.path), str(source)):
        assert m.generate(REPEATS, max_tokens=12, temperature=0,
                          speculative={"draft": draft}) == want
    assert len(loads) == 1 and len({id(d) for d in m._draft_models.values()}) == 1


@pytest.mark.real
def test_smollm2_greedy_answers_are_identical_with_lookup():
    m = pocketlm.load("smollm2-135m")
    text = ("The city council met on Tuesday to discuss the new budget. Mayor Linda Park said "
            "the budget would add 12 new buses and repair the Main Street bridge. The vote is "
            "scheduled for March 3.")
    asks = [f"Rewrite this text, keeping every sentence:\n\n{text}",
            f"List every person named in this text:\n\n{text}",
            "Write a short poem about the sea."]
    accepted = 0
    for ask in asks:
        msgs = [{"role": "user", "content": ask}]
        want = m.chat(msgs, max_tokens=96, temperature=0)
        assert m.chat(msgs, max_tokens=96, temperature=0, speculative="lookup") == want
        accepted += m.last_speculative.accepted
    assert accepted > 50  # the grounded answers copy their input


def test_cli_speculative(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", seed=7, weight_type="Q4_0")
    env = {**__import__("os").environ, "POCKET_HOME": str(tmp_path / "home")}

    def pocket(*args):
        return subprocess.run([sys.executable, "-m", "pocketlm.cli", *args], env=env,
                              capture_output=True, text=True)

    plain = pocket("run", "-m", str(path), "--raw", "-n", "20", REPEATS)
    spec = pocket("run", "-m", str(path), "--raw", "-n", "20", "--speculative", "lookup", "-v",
                  REPEATS)
    assert plain.returncode == spec.returncode == 0
    assert plain.stdout == spec.stdout
    assert "drafts accepted" in spec.stderr
    for args, match in [(["--speculative", "lookup", "--draft-max", "0"], "--draft-max"),
                        # named as the flag, with the CLI's spelling of prompt lookup
                        (["--speculative", "nope"], "error: --speculative: 'nope' is neither"),
                        (["--speculative", "nope"], "(prompt lookup is --speculative lookup)"),
                        (["--draft-max", "4"], "--draft-max applies with --speculative")]:
        p = pocket("run", "-m", str(path), *args, "hi")
        assert p.returncode == 1 and match in p.stderr and p.stderr.count("\n") == 1
