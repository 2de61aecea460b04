"""The sampler against the plain formulation of the same rules.

pocketlm's sampler ranks only the candidates that can matter and draws in two levels (linear
passes over the vocabulary); ``plain_draw`` sorts every token and draws with numpy's
``Generator.choice(p=...)``, as the rules are usually written. Both consume one uniform double
per token, so with the same seed they must draw the same tokens, not only the same
distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

from pocketlm.sampling import Sampler, SamplingParams, plain_draw

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, top_p=0.5),
    dict(temperature=0.8, top_p=0.999),
    dict(temperature=1.0, top_p=1e-6),
    dict(temperature=0.9, top_k=40),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02),
    dict(temperature=2.0, top_k=3000, top_p=0.95),
]


def _logits(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "peaked":  # a language model's shape: a few likely pieces, a long tail
        x = rng.standard_normal(vocab) * 2.0
        x[rng.choice(vocab, 5, replace=False)] += rng.uniform(6, 14, 5)
    elif kind == "flat":
        x = rng.standard_normal(vocab) * 0.3
    elif kind == "ties":  # few distinct values: the nucleus and the k-th score fall on ties
        x = rng.integers(0, 4, vocab).astype(np.float64)
    else:  # masked: most tokens impossible (a grammar, a bias of -inf)
        x = np.full(vocab, -np.inf)
        live = rng.choice(vocab, max(2, vocab // 50), replace=False)
        x[live] = rng.standard_normal(live.size) * 3
    return x.astype(np.float32)


@pytest.mark.parametrize("vocab", [7, 300, 4096, 5000, 70_001])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_the_sampler_draws_what_the_plain_rules_draw(vocab, kind):
    rng = np.random.default_rng(vocab)
    rows = [_logits(kind, vocab, rng) for _ in range(6)]
    for i, setting in enumerate(SETTINGS):
        seed = 100 * vocab + i
        sampler, ref = Sampler(SamplingParams(**setting, seed=seed)), np.random.default_rng(seed)
        got = [sampler(row) for _ in range(5) for row in rows]
        want = [plain_draw(row, ref, **setting) for _ in range(5) for row in rows]
        assert got == want, setting


def test_the_draws_follow_the_nucleus_distribution():
    # five tokens, top-p 0.8 keeps the three most likely (0.4 + 0.3 + 0.2 reaches 0.8): they
    # are drawn in proportion 4 : 3 : 2 and the other two never
    p = np.array([0.05, 0.3, 0.2, 0.05, 0.4])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=7))
    n = 30_000
    counts = np.bincount([sampler(np.log(p)) for _ in range(n)], minlength=5)
    assert counts[0] == counts[3] == 0
    want = np.array([0.3, 0.2, 0.4]) / 0.9 * n
    got = counts[[1, 2, 4]]
    assert np.all(np.abs(got - want) < 5 * np.sqrt(want))


def test_a_tie_at_the_nucleus_edge_is_broken_by_id_like_a_stable_sort():
    # four equally likely tokens, top-p 0.5: the first two ids are the nucleus
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {sampler(np.zeros(4, dtype=np.float32)) for _ in range(200)} == {0, 1}


def test_ties_with_the_kth_score_stay_in_the_draw():
    x = np.array([0.0, 5.0, 5.0, 5.0, 1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {sampler(x) for _ in range(300)} == {1, 2, 3}


def test_a_token_of_weight_zero_is_never_drawn_from_a_long_vocabulary():
    # one live token per block edge: the two-level draw must land on live tokens only
    x = np.full(262_144, -np.inf, dtype=np.float32)
    live = np.arange(1023, 262_144, 1024)
    x[live] = 0.0
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    drawn = {sampler(x) for _ in range(500)}
    assert drawn <= set(live.tolist()) and len(drawn) > 100


# -- edges an audit found --------------------------------------------------------------------


def test_decimal_and_fraction_settings_sample_as_their_floats():
    """Decimal and Fraction passed the check and then failed at the first token (float /
    Decimal): the checked floats are what the sampler uses."""
    from decimal import Decimal
    from fractions import Fraction

    logits = np.random.default_rng(3).normal(size=300).astype(np.float32)
    floats = dict(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, top_k=40)
    exact = [dict(temperature=Decimal("0.7"), top_p=Decimal("0.9"), min_p=Decimal("0.05"),
                  repetition_penalty=Decimal("1.1"), top_k=np.int64(40)),
             dict(temperature=Fraction(7, 10), top_p=Fraction(9, 10), min_p=Fraction(1, 20),
                  repetition_penalty=Fraction(11, 10), top_k=np.int32(40))]
    want = Sampler(SamplingParams(**floats, seed=5))
    draws = [want(logits, history=[1, 2]) for _ in range(8)]
    for kw in exact:
        s = Sampler(SamplingParams(**kw, seed=5))
        assert type(s.params.temperature) is float and type(s.params.top_k) is int
        assert [s(logits, history=[1, 2]) for _ in range(8)] == draws


def test_top_p_zero_keeps_the_most_likely_token_alone():
    """OpenAI's range for top_p includes 0 (it was refused): the most likely token alone,
    the first of tied ones, as greedy takes it."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=500).astype(np.float32)
        s = Sampler(SamplingParams(temperature=1.5, top_p=0.0, seed=int(rng.integers(1 << 30))))
        assert s(logits) == int(np.argmax(logits))
    tied = np.zeros(10, np.float32)
    tied[[3, 7]] = 2.0
    assert Sampler(SamplingParams(temperature=1.0, top_p=0.0, seed=1))(tied) == 3
    # and the plain reference draws what the sampler draws (it drew from no token at all)
    assert plain_draw(tied, np.random.default_rng(1), 1.0, top_p=0.0) == 3


def test_top_logprobs_rank_ties_by_id_and_list_no_nan():
    """A partition picked among tied scores at random: the first listed could be another
    token than the one greedy chose, and ids were out of order among equals. NaN scores were
    listed with a NaN log-probability (invalid JSON from the server)."""
    from pocketlm.sampling import logprobs

    x = np.zeros(1000, np.float32)
    x[[900, 500]] = 1.0
    _, top = logprobs(x, 500, 6)
    assert [i for i, _ in top] == [500, 900, 0, 1, 2, 3]
    y = np.array([np.nan, 1.0, 2.0, np.nan, -np.inf], np.float32)
    lp, top = logprobs(y, 1, 5)
    assert [i for i, _ in top] == [2, 1] and all(np.isfinite(v) for _, v in top)
    assert np.isfinite(lp)


def test_greedy_over_no_usable_score_is_an_error_not_token_zero():
    """Greedy on every score -inf (a grammar allowing only tokens the model rules out) took
    token 0, a token outside what was allowed; sampling said why it could not."""
    from pocketlm.errors import SamplingError

    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)):
        with pytest.raises(SamplingError, match="NaN or -inf"):
            Sampler(params)(np.full(4, -np.inf, np.float32))
    allowed = np.array([False, False, True, True])
    with pytest.raises(SamplingError, match="NaN or -inf"):
        Sampler(SamplingParams(temperature=0))(
            np.array([1.0, 2.0, -np.inf, -np.inf], np.float32), allowed=allowed)
