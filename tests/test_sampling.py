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
