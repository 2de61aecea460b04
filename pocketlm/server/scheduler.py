"""Continuous batching: many requests share one model, one decode step at a time.

One scheduler thread owns the model. Each loop it

1. admits waiting requests (oldest first) while fewer than ``max_batch`` run and the KV cache
   each needs fits the memory budget (evicting cached prompt prefixes first);
2. prefills the prompts of admitted requests, at most ``prefill_chunk`` tokens per loop (a
   long prompt does not stall everyone else's decoding), reusing the longest cached prompt
   prefix (a fixed system prompt is computed once) and adding each prompt to that cache;
3. runs one decode step for every running request in one native call
   (:meth:`Runtime.forward_batch`: the weights are read once for all of them), samples each
   row with the request's own sampler, and hands the text to the request's event queue.

Finished and cancelled requests leave between steps; their caches are freed at once. A row's
result does not depend on the other rows of its batch, so an answer does not change with the
server's load. Events go to each request through ``loop.call_soon_threadsafe``; the HTTP
side never touches the model.

A failure belongs to the request that caused it: an exception in one request's prefill,
sampling, detokenizing or stop handling ends that request alone with a
:class:`GenerationError` (its cache freed) while the others go on. When the batched engine
call itself fails, its rows are run again one at a time, so that only a row that fails on its
own is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api import PocketModel
from ..generate import Sequence, TextStream
from ..runtime.kernels.native import AMX_MIN_TOKENS
from ..runtime.model import KVCache
from ..sampling import Sampler
from ..sampling import logprobs as token_logprobs
from ..speculative import (
    DEFAULT_MAX_DRAFT,
    LOOKUP_MAX_NGRAM,
    LOOKUP_MIN_NGRAM,
    DraftGate,
    DraftLength,
    PromptLookup,
    SpeculativeStats,
    StepCost,
)

MB = 1 << 20


class QueueFullError(Exception):
    """Every batch slot is taken and the waiting line is full: retry later (HTTP 429)."""

    def __init__(self, retry_after: int):
        super().__init__("the server is at capacity: every batch slot is busy and the waiting "
                         f"line is full; retry in {retry_after} s")
        self.retry_after = retry_after


class TooLargeError(Exception):
    """The request alone needs more KV cache than the memory budget has (HTTP 400)."""


class ShuttingDownError(Exception):
    """The server is stopping and takes no new requests (HTTP 503)."""


class GenerationError(Exception):
    """One request failed while it was generated (``stage``: prefill, decode step, sampling,
    detokenizing, finishing: the held-back text and stop strings at the end); ``cause`` is what
    was raised. Only that request ends."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


def _in_stage(stage: str, fn, *args):
    """``fn(*args)``, with an exception it raises labelled by ``stage``."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - re-raised with the stage that failed
        raise GenerationError(stage, e) from e


@dataclass(eq=False)
class Request:
    """One generation. Built by the HTTP side; the scheduler fills in the rest."""

    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False
    # a completion goes on from its prompt's text (the first word keeps a SentencePiece
    # vocabulary's space); a chat reply starts a text of its own
    continuation: bool = False
    # prompt-lookup drafting options (pocketlm.speculative), or None: one token per step
    speculative: dict | None = None
    # structured output (pocketlm.structured): a Constraint / Triggered, or None
    constraint: Any = None
    # log-probabilities: of each generated token with the top-k (None: off), and of each
    # prompt token (completions with echo); prompt_logprobs holds them once prefilled
    logprobs: int | None = None
    score_prompt: bool = False
    # prompt tokens the client did not send (the BOS a text prompt gets): no echoed text
    echo_from: int = 0
    prompt_logprobs: list = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # set by either side
    cancelled: bool = False
    # scheduler-side state
    cache: KVCache | None = None
    seq: Sequence | None = None  # the decode bookkeeping, from the first prefill on
    next_token: int | None = None  # sampled, not yet run through the model
    prefilled: int = 0  # prompt tokens in the cache so far
    reserved: int = 0  # bytes of KV cache held
    prefix_reused: int = 0  # prompt tokens taken from the prefix cache
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    drafter: PromptLookup | None = None
    lengths: DraftLength | None = None
    spec_stats: SpeculativeStats | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.seq.generated) if self.seq is not None else 0

    @property
    def capacity(self) -> int:
        # the last sampled token is never run through the model
        return len(self.prompt_ids) + max(self.max_tokens, 1) - 1 or 1

    def emit(self, *event) -> None:
        """Hand an event to the HTTP side: ("text", str), ("done", finish_reason) or
        ("error", exception)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(eq=False)
class _Prefix:
    tokens: tuple[int, ...]
    cache: KVCache
    nbytes: int


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Runs requests on ``model`` from a background thread (see the module docstring).

    ``kv_budget``: bytes of KV cache (running requests + cached prefixes) allowed at once, or
    None for no limit beyond ``max_batch``. ``max_queue``: requests that may wait for a slot;
    one more gets :class:`QueueFullError`. ``prefix_cache_mb``: the most memory cached prompt
    prefixes may hold (they are evicted first when a request needs room)."""

    MIN_PREFIX = 8  # shorter common prefixes are recomputed, not copied
    SCORE_CHUNK = 32  # prompt tokens per prefill call when every position's logits are kept

    def __init__(self, model: PocketModel, *, max_batch: int = 16, max_queue: int = 64,
                 kv_budget: int | None = None, prefix_cache_mb: float = 64.0,
                 prefill_chunk: int = 256):
        self.model = model
        self.runtime = model.runtime
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.prefix_budget = int(prefix_cache_mb * MB)
        self.prefill_chunk = prefill_chunk
        # where a prompt's logits depend on how it is cut into prefill calls (AMX prefill: a
        # call of 16 tokens or more takes the tile unit's bfloat16 products, a shorter one the
        # int8 ones; the engine gives each row the same numbers wherever a prompt is cut into
        # calls of 16 or more), every prefill call holds at least min_call tokens (a shorter
        # prompt runs whole) and a cached prefix is reused only with min_call tokens left to
        # run, so that a seeded answer is the same alone, under load and after any request
        amx = bool(getattr(getattr(self.runtime, "native", None), "amx", False))
        self.min_call = AMX_MIN_TOKENS if amx else 1
        self.stop_ids = set(model.tokenizer.eos_ids)
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._prefixes: OrderedDict[int, _Prefix] = OrderedDict()  # LRU, oldest first
        self._ids = itertools.count()
        self._reserved = 0  # bytes: running caches + prefixes
        self._stopping = False
        self._step_cost = StepCost()  # shared by the requests that draft
        self._gate = DraftGate()  # whether a batched step may draft, by measured tokens/s
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0,
                      "rejected": 0,
                      "prefix_hits": 0, "prefix_tokens_reused": 0, "steps": 0,
                      "max_batch_seen": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      # speculative decoding: draft tokens proposed and accepted, all requests
                      "drafted": 0, "accepted": 0}
        self._thread = threading.Thread(target=self._run, name="pocket-scheduler", daemon=True)
        self._thread.start()

    # -- memory ------------------------------------------------------------------------------
    def kv_bytes(self, capacity: int) -> int:
        """Bytes of a KV cache of ``capacity`` positions (as the engine allocates it)."""
        return self.runtime.cache_nbytes(capacity)

    # -- the HTTP side -----------------------------------------------------------------------
    def submit(self, *reqs: Request) -> None:
        """Queue ``reqs`` (the choices of one HTTP request), all of them or none; raises
        :class:`QueueFullError`, :class:`TooLargeError` or :class:`ShuttingDownError` instead
        of accepting what cannot be served. A refusal counts once, as ``rejected``, and no
        choice of it is counted as a request (or, withdrawn, as cancelled)."""
        needs = [self.kv_bytes(req.capacity) for req in reqs]
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            for req, need in zip(reqs, needs, strict=True):
                if self.kv_budget is not None and need > self.kv_budget:
                    self.stats["rejected"] += 1
                    raise TooLargeError(
                        f"this request needs {need / MB:.1f} MB of KV cache "
                        f"({len(req.prompt_ids)} prompt tokens + max_tokens {req.max_tokens}) "
                        f"but the server's memory budget leaves {self.kv_budget / MB:.1f} MB "
                        "for KV caches; lower max_tokens or shorten the prompt")
            free = max(0, self.max_batch - len(self._running))  # about to be admitted
            if self.kv_budget is not None:
                free = self._admittable(free, needs)
            if len(self._waiting) + len(reqs) > self.max_queue + free:
                self.stats["rejected"] += 1
                alone = (len(reqs) if self.kv_budget is None
                         else self._admittable(self.max_batch, needs, idle=True))
                if len(reqs) - alone > self.max_queue:  # no retry could start it
                    raise TooLargeError(
                        f"the request's {len(reqs)} choices need {sum(needs) / MB:.1f} MB of KV "
                        f"cache at once, and the server's memory budget starts {alone} of them "
                        f"while at most {self.max_queue} may wait (--max-queue); lower n or "
                        "max_tokens")
                raise QueueFullError(self._retry_after())
            self.stats["requests"] += len(reqs)
            self._waiting.extend(reqs)
            self._lock.notify()

    def _admittable(self, slots: int, needs: list[int], *, idle: bool = False) -> int:
        """How many of the waiting requests and then ``needs``, oldest first, the memory
        budget can start now (at most ``slots``; cached prefixes give way): the rest wait, and
        count against ``max_queue``. ``idle``: of ``needs`` alone, on a server running and
        holding nothing. Under the lock."""
        if idle:
            room, queued = self.kv_budget, []
        else:
            room = (self.kv_budget - self._reserved
                    + sum(p.nbytes for p in self._prefixes.values()))
            queued = [self.kv_bytes(r.capacity) for r in self._waiting]
        fit = 0
        for need in queued + needs:
            if fit >= slots or need > room:
                break  # the oldest that does not fit waits, and nobody overtakes it
            room -= need
            fit += 1
        return fit

    def cancel(self, req: Request) -> None:
        """The client went away: drop ``req`` (its cache is freed at the next step)."""
        with self._lock:
            req.cancelled = True
            self._lock.notify()

    def _retry_after(self) -> int:
        return max(1, min(30, len(self._waiting) // max(1, self.max_batch) + 1))

    def snapshot(self) -> dict:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "kv_reserved_mb": round(self._reserved / MB, 1),
                    "kv_budget_mb": None if self.kv_budget is None
                    else round(self.kv_budget / MB, 1),
                    "cached_prefixes": len(self._prefixes),
                    # measured cost of one more row in a decode step, relative to a one-row
                    # step (what speculative requests' draft lengths are chosen by)
                    "row_cost": round(self._step_cost.row_cost, 3),
                    # decode tokens/s of batched steps with and without drafts, by requests
                    # per step (what decides whether such steps draft)
                    "draft_gate": self._gate.summary(),
                    **self.stats, "prefill_s": round(self.stats["prefill_s"], 3),
                    "decode_s": round(self.stats["decode_s"], 3)}

    @property
    def stopping(self) -> bool:
        """True once :meth:`close` was called (the server is shutting down)."""
        return self._stopping

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests; finish nothing more (pending ones get an error event)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    # -- the scheduler thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._running:
                    self._lock.wait()
                if self._stopping:
                    self._shut_down()
                    return
            try:
                self._loop_once()
            except Exception as e:  # noqa: BLE001 - a fault of no one request: the server goes on
                self._fail_all(GenerationError("scheduling", e))

    def _fail_all(self, error: GenerationError) -> None:
        """End every request in flight with ``error`` (so that a fault that would recur does
        not spin); new requests are served afresh."""
        with self._lock:
            for req in list(self._running):
                self._fail(req, error)
            for req in [r for r in self._waiting if not r.cancelled]:
                self._waiting.remove(req)
                req.emit("error", error)
                self.stats["failed"] += 1

    def _shut_down(self) -> None:
        """(Lock held.) Tell everyone still waiting or running, and free every cache."""
        for req in list(self._waiting) + self._running:
            req.emit("error", ShuttingDownError("the server is shutting down"))
        self._waiting.clear()
        for req in list(self._running):
            self._release(req)
        self._running.clear()

    def _loop_once(self) -> None:
        with self._lock:
            self._drop_cancelled()
            self._admit()
            prefilling = [r for r in self._running if r.seq is None or
                          r.prefilled < len(r.prompt_ids)]
        budget = self.prefill_chunk
        t0 = time.perf_counter()
        for req in prefilling:  # oldest first, up to prefill_chunk tokens this loop
            if budget <= 0:
                break
            try:
                budget -= self._prefill(req, budget)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                with self._lock:
                    self._fail(req, e if isinstance(e, GenerationError)
                               else GenerationError("prefill", e))
        t1 = time.perf_counter()
        self._decode_step()
        # where the engine's time goes (seconds of prompt chunks and of decode steps)
        self.stats["prefill_s"] += t1 - t0
        self.stats["decode_s"] += time.perf_counter() - t1

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self.stats["cancelled"] += 1
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self._release(req)
            self.stats["cancelled"] += 1

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting[0]
            need = self.kv_bytes(req.capacity)
            if not self._make_room(need):
                break  # the oldest waits for memory; nobody overtakes it
            self._waiting.popleft()
            req.reserved = need
            self._reserved += need
            self._running.append(req)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._running))

    def _make_room(self, need: int) -> bool:
        if self.kv_budget is None:
            return True
        while self._reserved + need > self.kv_budget and self._prefixes:
            _, p = self._prefixes.popitem(last=False)
            self._reserved -= p.nbytes
        return self._reserved + need <= self.kv_budget

    def _release(self, req: Request) -> None:
        req.cache = None  # the native cache is freed with its last reference
        self._reserved -= req.reserved
        req.reserved = 0

    def _fail(self, req: Request, error: GenerationError) -> None:
        """End ``req`` alone with ``error`` and free its cache (a cancelled request is left to
        :meth:`_drop_cancelled`, which counts it). Takes the lock (re-entrant)."""
        with self._lock:
            if req.cancelled:
                return
            req.emit("error", error)
            self.stats["failed"] += 1
            self._finish(req, None)

    def _finish(self, req: Request, reason: str | None) -> None:
        """Flush the held-back text, report, and free the cache. Takes the lock
        (re-entrant: the scheduler's condition holds an RLock)."""
        with self._lock:
            if reason is not None:
                tail = req.seq.finish() if req.seq is not None else ""
                rest = req.seq.new_logprobs() if req.seq is not None else []
                if tail or rest:
                    req.emit("text", tail, rest)
                if req.seq is not None:
                    reason = req.seq.state.finish_reason or reason
                req.emit("done", reason)
                self.stats["completed"] += 1
            if req in self._running:
                self._running.remove(req)
            self._release(req)

    # -- prefix cache ------------------------------------------------------------------------
    def _best_prefix(self, ids: list[int]) -> tuple[int | None, int]:
        """(key of the cached prefix sharing the most leading tokens with ``ids``, how many)."""
        best, best_n = None, 0
        for key, p in self._prefixes.items():
            n = common_prefix(p.tokens, ids)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def _remember_prefix(self, req: Request) -> None:
        """(Lock held.) Keep a copy of the prompt's KV for later requests that share it."""
        ids = req.prompt_ids
        if len(ids) < self.MIN_PREFIX:
            return
        if self.min_call > 1 and (req.score_prompt or len(ids) < self.min_call):
            return  # a prompt of one short call (int8 numbers), or scored (not prefilled)
        for key, p in self._prefixes.items():
            if common_prefix(p.tokens, ids) == len(ids):  # already covered
                self._prefixes.move_to_end(key)
                return
        nbytes = self.kv_bytes(len(ids))
        if nbytes > self.prefix_budget:
            return
        held = sum(p.nbytes for p in self._prefixes.values())
        while self._prefixes and held + nbytes > self.prefix_budget:
            _, old = self._prefixes.popitem(last=False)
            held -= old.nbytes
            self._reserved -= old.nbytes
        if self.kv_budget is not None and self._reserved + nbytes > self.kv_budget:
            return  # running requests come first
        try:
            cache = self.runtime.new_cache(len(ids))
            self.runtime.copy_prefix(cache, req.cache, len(ids))
        except Exception:  # noqa: BLE001 - a prefix that cannot be kept is not kept
            return
        self._prefixes[next(self._ids)] = _Prefix(tuple(ids), cache, nbytes)
        self._reserved += nbytes

    # -- work --------------------------------------------------------------------------------
    def _prefill(self, req: Request, budget: int) -> int:
        """Run up to ``budget`` more prompt tokens of ``req``; returns how many ran."""
        if req.cancelled:
            return 0
        ids = req.prompt_ids
        if req.seq is None:  # first visit: the cache, and a cached prefix if one fits
            req.cache = self.runtime.new_cache(req.capacity)
            req.seq = Sequence(ids, max_tokens=req.max_tokens, sampler=req.sampler,
                               stop_ids=self.stop_ids, ignore_eos=req.ignore_eos,
                               text=TextStream(self.model.tokenizer, req.stop,
                                               continuation=req.continuation),
                               constraint=req.constraint, logprobs=req.logprobs)
            if req.speculative:
                o = req.speculative
                req.drafter = PromptLookup(o.get("max_ngram", LOOKUP_MAX_NGRAM),
                                           o.get("min_ngram", LOOKUP_MIN_NGRAM))
                req.drafter.reset(ids)
                req.lengths = DraftLength(max_draft=o.get("max_draft", DEFAULT_MAX_DRAFT),
                                          cost=self._step_cost)
                req.spec_stats = SpeculativeStats()
            with self._lock:
                key, n = self._best_prefix(ids) if not req.score_prompt else (None, 0)
                # the last prompt token runs to give the first logits (min_call: the last
                # min_call ones, as one call of a fresh prefill would)
                n = min(n, len(ids) - self.min_call) if len(ids) >= self.min_call else 0
                if key is not None and n >= self.MIN_PREFIX:
                    self.runtime.copy_prefix(req.cache, self._prefixes[key].cache, n)
                    self._prefixes.move_to_end(key)
                    req.prefilled = req.prefix_reused = n
                    self.stats["prefix_hits"] += 1
                    self.stats["prefix_tokens_reused"] += n
        start = req.prefilled
        if req.score_prompt:  # every position's logits: in short chunks (n x vocab floats)
            budget = min(budget, self.SCORE_CHUNK)
        # at least min_call tokens a call, and never fewer left for the next one
        end = min(len(ids), start + max(budget, self.min_call))
        if len(ids) - end < self.min_call:
            end = len(ids)
        if req.score_prompt:
            rows = self.runtime.forward(ids[start:end], req.cache, all_logits=True)
            top = req.logprobs or 0
            for i, row in enumerate(rows):
                if start + i + 1 < len(ids):
                    req.prompt_logprobs.append(token_logprobs(row, ids[start + i + 1], top))
            logits = rows[-1]
        else:
            logits = self.runtime.forward(ids[start:end], req.cache,
                                          screen=req.seq is not None and req.seq.screen)
        req.prefilled = end
        if end == len(ids):
            with self._lock:
                self._remember_prefix(req)
            if not req.cancelled:  # sampled outside the lock, as in decode steps
                self._take(req, logits)
        return end - start

    def _decode_step(self) -> None:
        with self._lock:
            batch = [r for r in self._running if r.next_token is not None and not r.cancelled]
        if not batch:
            return
        t0 = time.perf_counter()
        gated = any(r.drafter is not None for r in batch)
        allow = not gated or self._gate.allow(len(batch))
        before = sum(len(r.seq.generated) for r in batch) if gated else 0
        drafts = [self._drafts(r, len(batch)) if allow else [] for r in batch]
        self.stats["steps"] += 1
        if not any(drafts):
            # sampled and detokenized outside the lock: the HTTP side (submit, cancel, the
            # health check) never waits on a batch's sampling; only this thread touches a
            # running request's sequence and cache, and ending one takes the lock
            for req, row in self._forward_rows(batch):
                req.next_token = None
                if not req.cancelled:
                    self._take(req, row)
        else:
            # speculative step: every request's next token and its drafts, verified in one
            # pass (rows compute what one-token decodes compute: the answers do not change)
            bases = {id(r): r.cache.length for r in batch}
            for req, rows, d in self._verify_rows(batch, drafts):
                req.next_token = None
                if not req.cancelled:
                    self._take_drafts(req, rows, d, bases[id(req)])
        # what a row costs, measured on the steps this server runs (plain ones too: their
        # batch sizes vary), so that drafting pays for the whole batch, not one request
        extra = len(batch) - 1 + sum(len(d) for d in drafts)
        seconds = time.perf_counter() - t0
        self._step_cost.observe(extra, seconds)
        if gated:
            self._gate.observe(len(batch), allow,
                               sum(len(r.seq.generated) for r in batch) - before, seconds)

    def _drafts(self, req: Request, batch: int) -> list[int]:
        """Up to the request's draft length of prompt-lookup drafts that fit its cache and
        its max_tokens ([] without speculation, or when drafting does not pay now)."""
        if req.drafter is None:
            return []
        try:
            room = req.cache.capacity - req.cache.length - 1
            # a step gives up to its drafts + 1 tokens: no draft beyond max_tokens - 1
            k = min(req.lengths.next(batch), room, req.max_tokens - len(req.seq.generated) - 1)
            return req.drafter.propose(k) if k > 0 else []
        except Exception:  # noqa: BLE001 - drafting is an optimization: decode plainly
            return []

    def _verify_rows(self, batch: list[Request], drafts: list[list[int]]):
        """One verification call for ``batch`` (each request's next token and its drafts):
        ``(request, rows, drafts)``; a failed call is handled as in :meth:`_batched`."""
        mine = {id(r): d for r, d in zip(batch, drafts, strict=True)}
        done = self._batched(batch, lambda reqs: self.runtime.verify_batch(
            [([r.next_token, *mine[id(r)]], r.cache) for r in reqs],
            screen=[r.seq.screen for r in reqs]))
        return [(req, rows, mine[id(req)]) for req, rows in done]

    def _take_drafts(self, req: Request, rows: np.ndarray, drafts: list[int], base: int
                     ) -> None:
        """Take tokens from ``rows`` as plain decoding would, one per row, while
        each equals the draft its row was computed after; the cache keeps the next token and
        the accepted drafts. Whatever goes wrong ends ``req`` alone."""
        accepted = 0
        try:
            for i, row in enumerate(rows):
                token = self._advance(req, row, cache_full=base + 1 + i >= req.cache.capacity)
                if token is None or req.next_token is None:  # finished
                    if token is not None and i < len(drafts) and token == drafts[i]:
                        accepted += 1
                    break
                if i < len(drafts) and token == drafts[i]:
                    accepted += 1
                    req.next_token = None  # it is in the cache already (the next row's input)
                    continue
                break  # the first token that is not a draft: the next step's input
            if req.drafter is not None:  # a plain request in a drafting step keeps no stats
                req.lengths.update(len(drafts), accepted)
                st = req.spec_stats
                st.steps += 1
                st.drafted += len(drafts)
                st.accepted += accepted
                self.stats["drafted"] += len(drafts)
                self.stats["accepted"] += accepted
            if req.cache is not None:
                req.cache.truncate(base + 1 + accepted)
        except Exception as e:  # noqa: BLE001 - this request alone fails
            self._fail(req, e if isinstance(e, GenerationError)
                       else GenerationError("token handling", e))

    def _forward_rows(self, batch: list[Request]) -> list[tuple[Request, np.ndarray]]:
        """One decode step for ``batch`` in one engine call: (request, logits) for each row."""
        return self._batched(batch, lambda reqs: self.runtime.forward_batch(
            [r.next_token for r in reqs], [r.cache for r in reqs],
            screen=[r.seq.screen for r in reqs]))

    def _batched(self, batch: list[Request], call) -> list[tuple[Request, np.ndarray]]:
        """``call(requests)`` (one engine call, one output per request) for ``batch``:
        (request, output) pairs. If the call fails, the requests run again one at a time (a
        batch of one computes what its row computes in any batch), and one that fails alone
        is ended."""
        lengths = [r.cache.length for r in batch]
        try:
            return list(zip(batch, call(batch), strict=True))
        except Exception as e:  # noqa: BLE001 - whose fault it is, the rows alone tell
            if len(batch) == 1:
                with self._lock:
                    self._fail(batch[0], GenerationError("decode step", e))
                return []
        for req, n in zip(batch, lengths, strict=True):
            req.cache.length = n  # what the failed call may have advanced, it did not compute
        done = []
        for req in batch:
            try:
                done.append((req, call([req])[0]))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                with self._lock:
                    self._fail(req, GenerationError("decode step", e))
        return done

    def _take(self, req: Request, logits: np.ndarray) -> None:
        """Sample the next token from ``logits`` and pass its text on (the scheduler thread,
        without the lock); whatever goes wrong in doing so ends ``req`` alone."""
        try:
            self._advance(req, logits)
        except Exception as e:  # noqa: BLE001 - this request alone fails
            self._fail(req, e if isinstance(e, GenerationError)
                       else GenerationError("token handling", e))

    def _advance(self, req: Request, logits: np.ndarray, cache_full: bool | None = None
                 ) -> int | None:
        """Sample and take the next token from ``logits``: sets ``req.next_token`` unless the
        request ended; returns the token (None when nothing was sampled)."""
        seq = req.seq
        if seq.finished:  # max_tokens 0
            self._finish(req, seq.state.finish_reason)
            return None
        token = _in_stage("sampling", seq.sample, logits)
        if req.first_token is None:
            req.first_token = time.perf_counter()
        # the last sampled token never runs through the model: it needs no room in the cache
        if cache_full is None:
            cache_full = req.cache.length >= req.cache.capacity
        piece = _in_stage("detokenizing", seq.add, token, cache_full)
        if req.drafter is not None:
            req.drafter.extend([token])
        if piece:
            req.emit("text", piece, seq.new_logprobs())
        if seq.finished:
            _in_stage("finishing", self._finish, req, seq.state.finish_reason)
        else:
            req.next_token = token
        return token
