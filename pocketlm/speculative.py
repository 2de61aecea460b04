"""Speculative decoding: several tokens per pass over the weights, the same tokens.

Decoding one token streams every weight once; checking k drafted tokens
(:meth:`Runtime.verify`) streams them once too, and each of its rows computes bit for bit what
a one-token decode at that position computes. So a draft that the model would have produced
anyway costs almost nothing, and one it would not is simply dropped.

**Drafters** propose tokens that are likely to come next:

* :class:`PromptLookup` (``speculative="lookup"``): the tokens that followed the most recent
  earlier occurrence of the text's last n-gram, in the prompt or in what was generated so far.
  Free to compute, and right often on tasks grounded in their input (extract, summarize,
  rewrite, fix, answer from a passage), where the answer copies spans of the prompt.
* :class:`DraftModel` (``speculative={"draft": MODEL}``): a smaller model of the same
  vocabulary (a trimmed or distilled pocket model drafting for its teacher) proposes its greedy
  continuation.

**Verification keeps the target's distribution exactly.** Drafts are deterministic (a lookup,
or a draft model's greedy choice): the proposal q is a point mass on the draft d, and
speculative sampling's rule (accept with min(1, p(d)/q(d)) = p(d), else draw from the residual
p without d, renormalized) is the same as drawing from p as plain decoding does and keeping the
draft when the draw equals it. That is what :func:`run_speculative` does, position by position
with the sequence's own sampler (temperature, top-k, top-p, min-p, repetition penalty), so for
a given seed it draws the same tokens as plain decoding, not just the same distribution; with
temperature 0, the same greedy answers.

**The draft length adapts** (:class:`DraftLength`): the number of drafts with the most expected
tokens per unit of time, from the recent acceptance and the measured cost of a verification
row; none while drafting does not pay (then each step is a plain one-token decode), with a
probe every few steps to notice when it pays again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelNotFoundError, PocketError
from .generate import Sequence
from .runtime import KVCache, Runtime
from .sampling import is_integer

__all__ = ["DraftLength", "DraftModel", "PromptLookup", "SpeculativeStats", "StepCost",
           "make_drafter", "run_speculative"]

MAX_DRAFT = 16  # the most tokens one verification may check beyond the sampled one
# Defaults of prompt lookup and of the draft length, chosen by replaying the grounded tasks of
# benchmarks/speculative.py (benchmarks/speculative_policy.py; docs/speculative.md)
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 8, 2
DEFAULT_MAX_DRAFT = 8


@dataclass
class SpeculativeStats:
    """What speculation did in one generation: ``steps`` (passes over the weights after the
    prompt), ``drafted`` and ``accepted`` draft tokens, ``tokens`` generated."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each pass after the prompt gave (the first token comes from the prompt's
        pass, which ``steps`` does not count)."""
        return (self.tokens - 1) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "tokens": self.tokens, "acceptance": round(self.acceptance, 4),
                "tokens_per_step": round(self.tokens_per_step, 4)}


class PromptLookup:
    """Drafts by n-gram lookup in the text so far (prompt and generated tokens).

    For n from ``max_ngram`` down to ``min_ngram`` (8 and 2 by default), the last n tokens are
    looked up among the earlier ones (the most recent occurrence wins); the tokens that followed
    it are the draft. The longest match comes first: the more context an earlier occurrence
    shares, the more likely its continuation is the one being written; a single token matches
    too often on free text, and its drafts are mostly wrong.
    The index is updated incrementally: each new token costs O(max_ngram)."""

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM,
                 min_ngram: int = LOOKUP_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram <= 8:
            raise PocketError("prompt lookup n-gram sizes must satisfy 1 <= min_ngram <= "
                              f"max_ngram <= 8, got min_ngram {min_ngram} (default "
                              f"{LOOKUP_MIN_NGRAM}) and max_ngram {max_ngram} (default "
                              f"{LOOKUP_MAX_NGRAM})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._prev: dict[tuple[int, ...], int] = {}  # ... and of the one before

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self._last, self._prev = [], {}, {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    key = tuple(self.tokens[end - n:end])
                    if key in self._last:
                        self._prev[key] = self._last[key]
                    self._last[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n-gram."""
        toks, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            key = tuple(toks[end - n:end])
            at = self._last.get(key)
            if at == end:  # the n-gram itself: look at the occurrence before it
                at = self._prev.get(key)
            if at is not None and at < end:
                return toks[at:at + k]
        return []


def check_same_vocabulary(draft_tokenizer, target_tokenizer, name) -> None:
    """A draft model's tokenizer must be the target's, piece for piece."""
    a, b = draft_tokenizer, target_tokenizer
    if a.vocab_size != b.vocab_size or any(
            a.id_to_token(i) != b.id_to_token(i) for i in range(a.vocab_size)):
        raise PocketError(f"the draft model {name} has another vocabulary ({a.vocab_size:,} "
                          f"pieces vs {b.vocab_size:,}); a draft model must share the "
                          "target's tokenizer")


class DraftModel:
    """Drafts with a smaller model of the same vocabulary: its greedy continuation, run on a
    KV cache of its own that follows the accepted text."""

    def __init__(self, model, target_tokenizer, capacity: int, name: str | None = None):
        from .api import PocketModel

        if not isinstance(model, PocketModel):
            raise PocketError("a draft model must be a loaded pocketlm model")
        check_same_vocabulary(model.tokenizer, target_tokenizer, name or model.path)
        self.model = model
        self.runtime = model.runtime
        self.cache = self.runtime.new_cache(min(capacity, model.n_ctx))
        self.tokens: list[int] = []

    def reset(self, tokens: list[int]) -> None:
        self.cache.reset()
        self.tokens = []
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        # bring the cache to all but the last token (what was accepted since last time),
        # then draft greedily from the last one
        common = self.cache.length
        want = len(self.tokens)
        if want - 1 > self.cache.capacity - k - 1 or k == 0:
            return []
        if common > want - 1:
            self.cache.truncate(want - 1)
            common = want - 1
        if common < want - 1:
            self.runtime.forward(self.tokens[common:want - 1], self.cache, screen=True)
        out = []
        tok = self.tokens[-1]
        for _ in range(k):  # greedy drafts: the draft's best rows are all that is read
            logits = self.runtime.forward([tok], self.cache, screen=True)
            tok = int(np.argmax(logits))
            out.append(tok)
        self.cache.truncate(want - 1)  # the drafts may be rejected: forget them
        return out


SPECULATIVE_OPTIONS = ("method", "max_ngram", "min_ngram", "draft", "max_draft")


def speculative_spec(spec) -> dict:
    """A user's ``speculative`` argument as a dict of options, checked for its type and its
    keys first (before any option's value): ``"lookup"``, a draft model given bare (a name, a
    path or a loaded model) or a dict; ``{}`` is prompt lookup with its defaults."""
    from . import api

    if isinstance(spec, str) and spec == "lookup":
        return {"method": "lookup"}
    if isinstance(spec, (str, os.PathLike, api.PocketModel)):
        return {"draft": spec}
    if not isinstance(spec, dict):
        raise PocketError(f"speculative must be 'lookup', a draft model (a name, a path or a "
                          f"loaded model), or a dict of options, got {type(spec).__name__}")
    unknown = set(spec) - set(SPECULATIVE_OPTIONS)
    if unknown:
        raise PocketError(f"unknown speculative option(s): {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(SPECULATIVE_OPTIONS)})")
    return spec


def _file_tokenizer(path):
    """The tokenizer of deploy file ``path``, read from its header alone."""
    from .api import file_config_and_tokenizer
    from .formats.pocketfile import PocketFile

    return file_config_and_tokenizer(PocketFile(path, verify=False))[1]


def make_drafter(spec, *, target_tokenizer=None, capacity: int = 0,
                 loaded: dict | None = None):
    """A drafter from a user's ``speculative`` argument: ``"lookup"`` (or a dict with
    ``{"method": "lookup", "max_ngram": N, "min_ngram": M}``), or ``{"draft": MODEL}`` (a model
    name or path, or a loaded model) with the same vocabulary as the target. ``loaded`` keeps
    draft models loaded by name across calls (each call loaded its own otherwise)."""
    if spec is None or spec is False:
        return None
    spec = speculative_spec(spec)
    if "draft" in spec:
        from . import api

        lookup = set(spec) & {"method", "max_ngram", "min_ngram"}
        if lookup:  # prompt lookup's options: a draft model would ignore them
            raise PocketError(f"speculative option(s) {', '.join(sorted(lookup))} are prompt "
                              "lookup's; a draft model takes only max_draft")
        model = spec["draft"]
        if not isinstance(model, (str, os.PathLike, api.PocketModel)):  # str(None) is no name
            raise PocketError(f"speculative draft must be a model name, a path or a loaded "
                              f"model, got {type(model).__name__}")
        name = None if isinstance(model, api.PocketModel) else os.fspath(model)
        keys = [name]
        if name is not None:
            model = loaded.get(name) if loaded is not None else None
            if model is None:
                try:  # the file first: a name and a path to its file share one model
                    path = api.deploy_file(name)
                except ModelNotFoundError as e:  # say which argument named it
                    raise ModelNotFoundError(f"speculative draft model: {e} (prompt lookup is "
                                             "speculative='lookup')") from None
                keys.append(str(Path(path).resolve()))
                model = loaded.get(keys[1]) if loaded is not None else None
                if model is None:
                    if target_tokenizer is not None:  # from the header, before the weights load
                        check_same_vocabulary(_file_tokenizer(path), target_tokenizer, name)
                    model = api.load(path)
        drafter = DraftModel(model, target_tokenizer, capacity, name)
        if loaded is not None and name is not None:  # kept once it is known to fit the target
            loaded.update(dict.fromkeys(keys, model))
        return drafter
    if spec.get("method", "lookup") != "lookup":
        raise PocketError(f"unknown speculative method {spec.get('method')!r}; known: lookup, "
                          "or {'draft': MODEL}")
    sizes = []
    for key, default in (("max_ngram", LOOKUP_MAX_NGRAM), ("min_ngram", LOOKUP_MIN_NGRAM)):
        n = spec.get(key, default)
        if not is_integer(n):
            raise PocketError(f"speculative {key} must be an integer from 1 to 8, got {n!r}")
        sizes.append(int(n))
    return PromptLookup(*sizes)


class StepCost:
    """The measured cost of one more row in a decode step, relative to a one-row step.

    A step of ``1 + x`` rows takes about ``c0 + c1 x`` seconds (on two cores the first row is
    memory bandwidth, the rest compute); :attr:`row_cost` is ``c1 / c0``, from a least-squares
    line through the recent (x, seconds) points (decaying), with two prior points that put it
    at ``prior`` until steps are timed. One estimate may serve many sequences: the server keeps
    one for all its requests and times every step with the rows it really ran."""

    def __init__(self, prior: float = 0.25, decay: float = 0.97):
        self.decay = decay
        self._n, self._x, self._y, self._xx, self._xy = 0.0, 0.0, 0.0, 0.0, 0.0
        for x, y in ((0.0, 1.0), (4.0, 1.0 + 4 * prior)):
            self._add(x, y, 1.0)
        self._scale: float | None = None  # seconds of a one-row step, once a step was timed

    def _add(self, x: float, y: float, w: float) -> None:
        self._n += w
        self._x += w * x
        self._y += w * y
        self._xx += w * x * x
        self._xy += w * x * y

    @property
    def row_cost(self) -> float:
        n, x, y, xx, xy = self._n, self._x, self._y, self._xx, self._xy
        var = n * xx - x * x
        slope = (n * xy - x * y) / var if var > 1e-12 else 0.0
        base = (y - slope * x) / n
        return max(0.02, slope / base) if base > 0 else 1.0

    def observe(self, extra_rows: int, seconds: float) -> None:
        """A step of ``1 + extra_rows`` rows took ``seconds``."""
        if not seconds > 0:
            return
        if self._scale is None:  # the first timed step sets the unit: about one step
            self._scale = seconds / (1.0 + self.row_cost * extra_rows)
        d = self.decay
        self._n, self._x, self._y = d * self._n, d * self._x, d * self._y
        self._xx, self._xy = d * self._xx, d * self._xy
        self._add(float(extra_rows), seconds / self._scale, 1.0)


class DraftLength:
    """How many tokens to draft next, by expected tokens per unit of time.

    A verification of k drafts costs ``1 + r k`` one-token steps (r: the cost of one more row,
    relative to a step; ~0.25 for a 135 M model on two cores, where the extra rows are compute
    and the step is memory bandwidth) and yields ``(1 - a^(k+1)) / (1 - a)`` tokens on average
    when each draft is accepted with probability a (given the ones before it were). ``next()``
    picks the k in ``0..max_draft`` with the most tokens per unit of time; a is estimated from
    the recent drafts (accepted / tried, decaying), r by a :class:`StepCost` (this sequence's
    own, fed by the step times :meth:`update` is given, with ``row_cost`` as its prior; or
    ``cost``, one shared with other sequences). k = 0 means a plain step; then one draft is
    probed every ``probe_every`` steps to notice when drafting pays again. ``batch``: rows
    already in the step (the server's other requests), which makes an extra row relatively
    dearer: it slows every row of the step, not only its own sequence's. ``prior``: the
    acceptance assumed before any draft was checked (2/3: it weighs as one rejected draft and
    two accepted ones, so the first misses pull it down fast)."""

    def __init__(self, max_draft: int = DEFAULT_MAX_DRAFT, probe_every: int = 8,
                 row_cost: float = 0.25, cost: StepCost | None = None, prior: float = 2 / 3):
        if not is_integer(max_draft) or not 1 <= max_draft <= MAX_DRAFT:
            raise PocketError(f"max_draft must be an integer from 1 to {MAX_DRAFT}, got "
                              f"{max_draft!r}")
        max_draft = int(max_draft)  # a numpy integer too, as max_tokens and top_k take them
        if not 0.0 < prior < 1.0:
            raise PocketError(f"prior acceptance must be between 0 and 1, got {prior!r}")
        self.max_draft, self.probe_every = max_draft, probe_every
        self.tried = 1.0 / (1.0 - prior)  # one rejected draft, prior / (1 - prior) accepted
        self.accepted = prior * self.tried
        self.cost = cost if cost is not None else StepCost(row_cost)
        self._idle = 0

    @property
    def acceptance(self) -> float:
        return min(0.99, self.accepted / self.tried)

    @property
    def row_cost(self) -> float:
        """The estimated cost of one more row, relative to a one-row step."""
        return self.cost.row_cost

    def best(self, batch: int = 1) -> int:
        a, r = self.acceptance, self.row_cost
        # the step's other rows gain nothing from this sequence's drafts but pay for them: the
        # batch's tokens per second rise only if this sequence's extra tokens outweigh that
        r = r * batch / (1.0 + r * (batch - 1))
        best_k, best_rate = 0, 1.0
        for k in range(1, self.max_draft + 1):
            rate = (1.0 - a ** (k + 1)) / (1.0 - a) / (1.0 + r * k)
            if rate > best_rate * 1.02:  # a draft must pay clearly, not by noise
                best_k, best_rate = k, rate
        return best_k

    def next(self, batch: int = 1) -> int:
        k = self.best(batch)
        if k:
            self._idle = 0
            return k
        self._idle += 1
        if self._idle < self.probe_every:
            return 0
        self._idle = 0
        return 1

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """After a step with ``drafted`` drafts of which the first ``accepted`` were kept
        (``seconds``: how long the step took, if it was this sequence's alone)."""
        if drafted:
            d = 0.8
            self.accepted = d * self.accepted + accepted
            self.tried = d * self.tried + accepted + (1 if accepted < drafted else 0)
        if seconds is not None:
            self.cost.observe(drafted, seconds)


class DraftGate:
    """Whether a batched decode step may draft at all, chosen by what the steps measure.

    With several requests in a step, whether drafting pays depends on how the step's time
    grows with its rows, which :class:`StepCost`'s straight line only approximates: measured on
    smollm2-135m with four clients on two cores, the speculative server lost 2-5 % of the plain
    server's tokens/s while each request's :class:`DraftLength` expected a gain. The gate
    compares directly: per number of requests in the step (1..``max_batch``, larger ones
    counted with ``max_batch``), the tokens per second of the steps that were allowed to draft
    against those that were not (decaying sums of tokens and seconds), and allows drafting
    where it measured faster; the other way keeps being sampled once every ``explore_every``
    steps, so that a change is noticed. Until both ways have ``warmup`` steps at a batch size
    they alternate. Steps of fewer than ``min_batch`` requests always may draft: there a step
    is memory bandwidth and the draft length rule's cost model holds."""

    def __init__(self, explore_every: int = 8, warmup: int = 4, decay: float = 0.95,
                 min_batch: int = 2, max_batch: int = 8):
        self.explore_every, self.warmup, self.decay = explore_every, warmup, decay
        self.min_batch, self.max_batch = min_batch, max_batch
        self._sums: dict[tuple[int, bool], list[float]] = {}  # tokens, seconds, steps
        self._steps = 0

    def _rate(self, batch: int, allowed: bool) -> tuple[float, int]:
        t, sec, n = self._sums.get((batch, allowed), (0.0, 0.0, 0))
        return (t / sec if sec > 0 else 0.0), int(n)

    def allow(self, batch: int) -> bool:
        """Whether the next step, of ``batch`` requests, may draft."""
        if batch < self.min_batch:
            return True
        b = min(batch, self.max_batch)
        (on, n_on), (off, n_off) = self._rate(b, True), self._rate(b, False)
        if n_on < self.warmup or n_off < self.warmup:
            return n_on <= n_off
        self._steps += 1
        better = on >= off
        return (not better) if self._steps % self.explore_every == 0 else better

    def observe(self, batch: int, allowed: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch`` requests, ``allowed`` to draft or not, gave ``tokens`` tokens
        in ``seconds``."""
        if batch < self.min_batch or not seconds > 0:
            return
        s = self._sums.setdefault((min(batch, self.max_batch), bool(allowed)), [0.0, 0.0, 0])
        s[0] = self.decay * s[0] + tokens
        s[1] = self.decay * s[1] + seconds
        s[2] += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Measured tokens/s with and without drafting, by batch size (for ``/health``)."""
        out: dict[str, dict[str, float]] = {}
        for (b, allowed), _ in sorted(self._sums.items()):
            out.setdefault(str(b), {})["drafting" if allowed else "plain"] = round(
                self._rate(b, allowed)[0], 1)
        return out


def run_speculative(runtime: Runtime, cache: KVCache, seq: Sequence, drafter,
                    lengths: DraftLength | None = None, stats: SpeculativeStats | None = None
                    ) -> Iterator[tuple[int, str]]:
    """Prefill ``seq``'s prompt into ``cache``, then decode with drafts verified in one pass:
    ``(token, text that can be shown now)`` for each token it takes, exactly the tokens
    :func:`~pocketlm.generate.run_sequence` takes (see the module docstring)."""
    lengths = lengths or DraftLength()
    stats = stats if stats is not None else SpeculativeStats()
    drafter.reset(seq.prompt_ids)
    screen = seq.screen  # as run_sequence screens, so that the tokens are the same
    logits = runtime.forward(seq.prompt_ids, cache, screen=screen)
    if seq.finished:  # max_tokens 0: no token, as run_sequence
        return
    # the next token: sampled, taken, not yet run through the model
    token = seq.sample(logits)
    piece = seq.add(token, cache_full=cache.length >= cache.capacity)
    if piece is None:
        return
    stats.tokens += 1
    yield token, piece
    drafter.extend([token])
    while not seq.finished:
        base = cache.length  # positions in the cache; `token` goes at `base`
        room = cache.capacity - base - 1  # drafts that fit after it
        # a step gives up to its drafts + 1 tokens: no draft beyond max_tokens - 1
        k = min(lengths.next(), room, seq.max_tokens - len(seq.generated) - 1)
        t0 = time.perf_counter()  # drafting counts: a draft model's passes are a cost too
        drafts = drafter.propose(k) if k > 0 else []
        stats.steps += 1
        if drafts:
            rows = runtime.verify([token, *drafts], cache, screen=screen)
        else:
            rows = runtime.forward([token], cache, screen=screen)[None]
        seconds = time.perf_counter() - t0
        accepted = 0
        nxt = None
        for i, row in enumerate(rows):
            t = seq.sample(row)
            # this token would run at position base + 1 + i: is there room for it?
            piece = seq.add(t, cache_full=base + 1 + i >= cache.capacity)
            if piece is None:  # a stop id
                break
            stats.tokens += 1
            yield t, piece
            drafter.extend([t])
            if i < len(drafts) and t == drafts[i]:
                accepted += 1
                if seq.finished:
                    break
                continue
            nxt = t
            break
        stats.drafted += len(drafts)
        stats.accepted += accepted
        lengths.update(len(drafts), accepted, seconds)
        cache.truncate(base + 1 + accepted)  # `token` and the accepted drafts
        if nxt is None or seq.finished:
            return
        token = nxt
