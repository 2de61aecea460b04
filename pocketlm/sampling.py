"""Sampling: turn next-token logits into a token, reproducibly.

Order of operations (Hugging Face's; llama.cpp's default chain applies temperature last, after
top-k, top-p and min-p): repetition penalty (over the prompt and the output), then greedy if
``temperature == 0``, else temperature, top-k, top-p (nucleus), min-p (relative to the most
likely token's probability after temperature), and a draw from the remaining distribution
with a seeded generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import SamplingError


def is_integer(value) -> bool:
    """Whether ``value`` is an integer, a numpy one included (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def shown(value) -> str:
    """``value`` as an error message quotes it: its repr, or for an integer too long to write
    out (Python refuses beyond 4,300 digits) its sign and number of digits."""
    if is_integer(value) and abs(int(value)) >= 10**40:
        v = int(value)
        return (f"{'a negative' if v < 0 else 'an'} integer of "
                f"{math.floor(math.log10(abs(v))) + 1} digits")
    return repr(value)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    # OpenAI's: subtracted from a token's logit once it was generated (presence) and per time
    # it was generated (frequency); the prompt does not count. 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def validate(self, names: dict[str, str] | None = None) -> SamplingParams:
        """Check every setting; ``names``: what the caller calls a parameter in errors (the
        command line's ``--top-p`` for ``top_p``), the parameter's own name otherwise."""
        def nm(param: str) -> str:
            return (names or {}).get(param, param)

        def finite(name: str, value) -> float:
            if isinstance(value, (bool, np.bool_, str, bytes)):  # float() would take "0.5", True
                raise SamplingError(f"{nm(name)} must be a number, got {value!r}")
            try:
                v = float(value)
            except OverflowError:  # an integer beyond float's range
                v = math.inf
            except (TypeError, ValueError):
                raise SamplingError(f"{nm(name)} must be a number, got {shown(value)}") from None
            if not math.isfinite(v):
                raise SamplingError(f"{nm(name)} must be a finite number, got {shown(value)}")
            return v

        t = finite("temperature", self.temperature)
        if t < 0:
            raise SamplingError(f"{nm('temperature')} must be >= 0 (0 = greedy), got {t}")
        p = finite("top_p", self.top_p)
        if not 0 <= p <= 1:
            raise SamplingError(f"{nm('top_p')} must be in [0, 1] (0: the most likely token "
                                f"only), got {p}")
        mp = finite("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise SamplingError(f"{nm('min_p')} must be in [0, 1], got {mp}")
        rp = finite("repetition_penalty", self.repetition_penalty)
        if rp <= 0:
            raise SamplingError(f"{nm('repetition_penalty')} must be > 0 (1 = off), got {rp}")
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            v = penalties[name] = finite(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingError(f"{nm(name)} must be in [-2, 2], got {v}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError("logit_bias must map token ids to numbers")
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or \
                        not 0 <= k < 2**63:  # past int64: no token, and no index either
                    raise SamplingError(f"logit_bias keys must be token ids, got {shown(k)}")
                if not -100 <= finite(f"logit_bias[{k}]", v) <= 100:
                    raise SamplingError(f"logit_bias[{k}] must be in [-100, 100], got {v}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise SamplingError(f"{nm('top_k')} must be a non-negative integer (0 = off), got "
                                f"{shown(self.top_k)}")
        if self.seed is not None and (not is_integer(self.seed) or self.seed < 0):
            raise SamplingError(f"{nm('seed')} must be a non-negative integer, got {shown(self.seed)}")
        # kept as the floats checked: a Decimal or a Fraction passed the check and then failed
        # at the first token (float / Decimal)
        self.temperature, self.top_p, self.min_p, self.repetition_penalty = t, p, mp, rp
        self.presence_penalty = penalties["presence_penalty"]
        self.frequency_penalty = penalties["frequency_penalty"]
        self.top_k = int(self.top_k)
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)
        bias = params.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def argmax_only(self) -> bool:
        """Whether every draw is the largest logit as it comes (greedy, no penalty, no bias):
        then only the best rows' logits need be exact (a screened head, docs/engine.md)."""
        p = self.params
        return (p.temperature == 0 and p.repetition_penalty == 1.0 and not self._bias.size
                and p.presence_penalty == 0 and p.frequency_penalty == 0)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None,
                 allowed: np.ndarray | None = None, generated: list[int] | None = None
                 ) -> int:
        """The next token. ``history`` (prompt and output) is what the repetition penalty
        sees, ``generated`` (the output) what the presence and frequency penalties see;
        ``allowed`` (a bool array over the vocabulary, from a grammar) removes every other
        token before anything else. The logits are copied at most once."""
        p = self.params
        plain = (p.repetition_penalty == 1.0 or not history) and not self._bias.size and (
            not generated or (p.presence_penalty == 0 and p.frequency_penalty == 0))
        if p.temperature == 0 and plain:
            if allowed is not None:
                return _greedy(np.where(allowed, logits, -np.inf))
            return _greedy(logits)  # greedy: no copy needed (the same first maximum)
        x = np.array(logits, dtype=np.float64)  # a copy: the caller's logits stay intact
        if allowed is not None:
            np.putmask(x, ~allowed, -np.inf)
        if self._bias.size:
            ok = self._bias_ids < x.size
            x[self._bias_ids[ok]] += self._bias[ok]
        if p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = x[seen]
            with np.errstate(over="ignore"):  # a tiny penalty may push a logit to +inf
                x[seen] = np.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty)
        if generated and (p.presence_penalty or p.frequency_penalty):
            ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            x[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if p.temperature == 0:
            return _greedy(x)
        x = _finite_scores(x)
        # Shift before scaling: every score is then <= 0 with the best exactly 0, so dividing
        # by any positive temperature (1e-308 included) gives values in [-inf, 0], exp() gives
        # [0, 1] with at least one 1, and the normalising sum is >= 1: no inf, no NaN.
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            x = (x - x.max()) / p.temperature
        # what is still in the draw: ``ids`` (increasing; None: every token) and their weights
        ids = None
        if p.top_k and p.top_k < x.size:
            ids = np.flatnonzero(x >= _kth_largest(x, p.top_k))  # ties with the k-th stay
            x = x[ids]
        w = np.exp(x)
        if p.top_p < 1.0:
            keep = _nucleus(w, p.top_p)
            ids, w = (keep if ids is None else ids[keep]), w[keep]
        if p.min_p > 0:
            keep = np.flatnonzero(w >= p.min_p * w.max())
            ids, w = (keep if ids is None else ids[keep]), w[keep]
        u = self.rng.random()  # one uniform draw a token, whatever the settings
        i = _draw(w, u)
        return i if ids is None else int(ids[i])


# The paths below give what the plain formulation gives (sort every token for top-k / top-p,
# then ``Generator.choice(p=...)``, which walks the cumulative sum in id order with one uniform
# double) but touch the whole vocabulary only in linear passes: a full sort of a 262,144-piece
# vocabulary costs 35 ms, a decode step of the whole model 4-15.

_CUTS = (-2.0, -4.0, -8.0, -16.0, -32.0, -64.0)  # scaled scores (the best is 0) tried as bounds


def _kth_largest(x: np.ndarray, k: int) -> float:
    """The ``k``-th largest of ``x`` (scores scaled so the best is 0), partitioned among the
    scores above a cut when at least ``k`` are: every score below it is smaller than those."""
    for cut in _CUTS:
        cand = x[x >= cut]
        if cand.size >= k:
            return float(np.partition(cand, -k)[-k])
    return float(np.partition(x, -k)[-k])


def _nucleus(w: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (increasing) of the smallest set of largest weights whose sum reaches ``top_p``
    of the total, ties taken in index order, as a stable sort of every weight would choose
    them. The weights at least a cut are ranked alone once their sum reaches the bound: every
    other weight is smaller than each of them, so it would rank after them and not be kept."""
    target = top_p * w.sum()
    for cut in (*(math.exp(c) for c in _CUTS), 0.0):
        cand = np.flatnonzero(w >= cut) if cut else np.arange(w.size)
        cw = w[cand]
        if cut and cw.sum() < target * (1 - 1e-9):
            continue  # short of the bound: no need to rank them
        order = np.lexsort((cand, -cw))  # largest first, ties by index
        cum = np.cumsum(cw[order])
        if cum[-1] >= target or not cut:
            keep = cum - cw[order] < target  # the smallest prefix reaching the bound
            keep[0] = True  # top_p 0: the most likely token alone
            return np.sort(cand[order[keep]])
    raise AssertionError("unreachable: the last cut takes every weight")


def _inverse_cdf(w: np.ndarray, u: float) -> int:
    """The first index at which the running sum of ``w`` (>= 0, not all 0) exceeds ``u``
    (in [0, 1)) times its total; never an index of weight 0."""
    cum = np.cumsum(w)
    i = min(int(np.searchsorted(cum, u * cum[-1], side="right")), w.size - 1)
    while w[i] == 0:  # only where rounding put the point at the very end
        i -= 1
    return i


_BLOCK = 1024


def _draw(w: np.ndarray, u: float) -> int:
    """:func:`_inverse_cdf` in two levels for a long ``w``: the block that holds the point,
    from the blocks' sums, then the index inside it (no running sum over every weight)."""
    n = w.size
    if n <= 4 * _BLOCK:
        return _inverse_cdf(w, u)
    full = n - n % _BLOCK
    sums = w[:full].reshape(-1, _BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, w[full:].sum())
    cum = np.cumsum(sums)
    point = u * cum[-1]
    b = min(int(np.searchsorted(cum, point, side="right")), sums.size - 1)
    while sums[b] == 0:
        b -= 1
    below = cum[b - 1] if b else 0.0
    share = min(max((point - below) / sums[b], 0.0), float(np.nextafter(1.0, 0.0)))
    start = b * _BLOCK
    return start + _inverse_cdf(w[start:start + _BLOCK], share)


def plain_draw(logits: np.ndarray, rng: np.random.Generator, temperature: float,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> int:
    """The same rules as :class:`Sampler` (temperature > 0, no penalties) written the plain
    way: every token sorted, then ``Generator.choice``. A reference for tests and
    ``benchmarks/sampling.py``; it draws the same tokens as the sampler from the same seed, at
    up to 35 ms a token on a 262,144-piece vocabulary."""
    x = np.array(logits, dtype=np.float64)
    x = (x - x.max()) / temperature
    if top_k and top_k < x.size:
        x[x < np.sort(x)[-top_k]] = -np.inf
    probs = np.exp(x)
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = np.zeros(probs.size, dtype=bool)
        keep[order[cum - probs[order] < top_p * cum[-1]]] = True
        keep[order[0]] = True  # top_p 0: the most likely token alone, as the sampler keeps
        probs = np.where(keep, probs, 0.0)
    if min_p > 0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return int(rng.choice(probs.size, p=probs / probs.sum()))


def _greedy(x: np.ndarray) -> int:
    """The first largest score, as ``np.argmax``; a NaN score (a broken model) is never the
    choice, as in sampling. np.argmax returns the first NaN when there is one, so looking at
    its choice alone costs nothing on finite scores."""
    best = int(np.argmax(x))
    if not np.isnan(x[best]) and x[best] != -np.inf:
        return best
    return int(np.argmax(_finite_scores(x)))  # every score NaN or -inf: an error


def _finite_scores(x: np.ndarray) -> np.ndarray:
    """Scores with no NaN and no +inf, so that sampling from them is well defined.

    NaN scores (a broken model) can never be drawn. +inf scores (a repetition penalty of 1e-300
    on a positive logit) are the most likely by definition: the draw is among them alone,
    uniformly.
    """
    if np.isfinite(x).all():
        return x
    best = np.isposinf(x)
    if best.any():
        return np.where(best, 0.0, -np.inf)
    x = np.where(np.isnan(x), -np.inf, x)
    if np.isneginf(x).all():
        raise SamplingError("every next-token score is NaN or -inf: the model produced no "
                            "usable logits (damaged weights? a deploy file's checksums, "
                            "load(..., verify=True), find which)")
    return x


def logprobs(logits: np.ndarray, token: int, top: int = 0
             ) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``logits`` (the model's own distribution: before
    temperature, penalties, bias or a grammar) and the ``top`` most likely tokens with
    theirs, most likely first."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    m = x[finite].max() if finite.any() else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        lse = m + np.log(np.sum(np.exp(np.where(finite, x - m, -np.inf))))
    lp = float(x[token] - lse) if np.isfinite(x[token]) else float("-inf")
    best: list[tuple[int, float]] = []
    if top > 0 and finite.any():
        # the k largest finite scores, ties (at the cut too) by id as greedy takes them: a
        # partition alone picks among ties at random, and named another token first than
        # the one greedy chose; NaN and -inf are never listed
        scores = np.where(finite, x, -np.inf)
        k = min(top, int(finite.sum()))
        kth = np.partition(scores, -k)[-k]
        above = np.flatnonzero(scores > kth)
        idx = np.concatenate([above, np.flatnonzero(scores == kth)[:k - above.size]])
        idx = idx[np.lexsort((idx, -scores[idx]))]
        best = [(int(i), float(x[i] - lse)) for i in idx]
    return lp, best
