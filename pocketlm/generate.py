"""Generation: the token loop, stop conditions and streaming text.

:class:`Sequence` is one sequence's decode step, the same for the Python API and the server:
given each sampled token it updates the sequence, decides whether generation ends (an EOS /
end-of-turn id, a stop string, ``max_tokens``, a full context) and says which text may be
shown. The drivers around it make the forward calls: :func:`stream_tokens` and
:func:`stream_sequence` one sequence at a time, the server's scheduler many rows in one batch.
``stream_text`` turns any token stream into text pieces that never split a UTF-8 character
and never show any part of a stop string; a character the last token left unfinished is
left out, not shown as U+FFFD.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import SamplingError
from .runtime import KVCache, Runtime
from .sampling import Sampler
from .sampling import logprobs as token_logprobs
from .structured import Constraint
from .tokenizer import StreamingDetokenizer, Tokenizer


@dataclass
class GenerationState:
    """What happened, filled in as generation runs (for callers that want stats)."""

    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    # with Sequence(logprobs=K): per generated token, (its log-probability, the K most likely
    # tokens as (id, log-probability))
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with logprobs: the stop id that ended the sequence and its entry. It is no part of the
    # text, yet scorers that ask for one token after a text (lm-evaluation-harness) count it
    stop_logprob: tuple[int, tuple[float, list[tuple[int, float]]]] | None = None
    # time.perf_counter() when the first token was taken (the end of prefill, for speeds)
    first_token_at: float | None = field(default=None, compare=False)


class Sequence:
    """One sequence's bookkeeping from one sampled token to the next.

    ``sample(logits)`` draws the next token with the sequence's sampler (whose repetition
    penalty sees the prompt and every token taken so far); ``add(token, cache_full=...)`` takes
    it. A ``constraint`` (:mod:`pocketlm.structured`) restricts every draw to what its grammar
    allows and ends the sequence ("stop") once the grammar is complete; ``logprobs=K`` records
    each taken token's log-probability and the K most likely (``state.logprobs``). An id in
    ``stop_ids`` (unless ``ignore_eos``) ends generation with "stop" and is not
    part of the output; a stop string in the text ends it with "stop", ``max_tokens`` tokens
    or a full KV cache (``cache_full``: the cache has no room for this token) with "length".
    ``finish()``, once it ended, gives the text still held back (a stop string found there
    makes the reason "stop"). ``text`` (a :class:`TextStream`) is None for a sequence of
    tokens only. ``state`` records it all (prompt tokens, tokens taken, finish reason).
    """

    def __init__(self, prompt_ids: list[int], *, max_tokens: int, sampler: Sampler,
                 stop_ids: Iterable[int], text: TextStream | None = None,
                 ignore_eos: bool = False, state: GenerationState | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None):
        self.state = state if state is not None else GenerationState()
        self.state.prompt_tokens = len(prompt_ids)
        self.prompt_ids = list(prompt_ids)
        self.history = list(prompt_ids)  # what the repetition penalty sees
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.stop_ids = frozenset(()) if ignore_eos else frozenset(stop_ids)
        self.text = text
        self.constraint = constraint
        self.logprobs = logprobs
        self._pending = None  # the log-probabilities of the token just sampled
        self._logprobs_sent = 0
        if logprobs is not None:
            self.state.logprobs = []
        if max_tokens == 0:
            self.state.finish_reason = "length"

    @property
    def finished(self) -> bool:
        return self.state.finish_reason is not None

    @property
    def screen(self) -> bool:
        """Whether this sequence takes the largest logit only (greedy, no penalty, bias,
        grammar or log-probabilities): the runtime may then screen the head
        (:meth:`Runtime.forward`'s ``screen``)."""
        return self.sampler.argmax_only and self.constraint is None and self.logprobs is None

    @property
    def generated(self) -> list[int]:
        return self.state.generated

    def sample(self, logits: np.ndarray) -> int:
        def draw(allowed=None):
            return self.sampler(logits, self.history, allowed=allowed,
                                generated=self.state.generated)

        token = (self.constraint.sample(draw, self.sampler.greedy)
                 if self.constraint is not None else draw())
        if self.logprobs is not None:
            self._pending = token_logprobs(logits, token, self.logprobs)
        return token

    def new_logprobs(self) -> list:
        """The log-probabilities of the tokens shown since the last call: a token whose text is
        still held back (it may begin a stop string) waits, and a stop string's tokens never
        come (as llama.cpp and OpenAI leave them out)."""
        if self.state.logprobs is None:
            return []
        shown = self._shown_tokens()
        out = self.state.logprobs[self._logprobs_sent:shown]
        self._logprobs_sent = shown
        return out

    def _shown_tokens(self) -> int:
        return self.text.shown_tokens if self.text is not None else len(self.state.generated)

    def _drop_unshown(self) -> None:
        """Once a stop string ended the text: forget the log-probabilities of its tokens."""
        if self.state.logprobs is not None:
            del self.state.logprobs[self._shown_tokens():]

    def add(self, token: int, cache_full: bool = False) -> str | None:
        """Take ``token``: the text that can be shown now ("" while it is held back), or None
        when the token ends the sequence without being part of it (a stop id)."""
        if token in self.stop_ids:
            self.state.finish_reason = "stop"
            if self.state.logprobs is not None and self._pending is not None:
                self.state.stop_logprob = (token, self._pending)
                self._pending = None
            return None
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.state.logprobs is not None and self._pending is not None:
            self.state.logprobs.append(self._pending)
            self._pending = None
        if not self.state.generated:
            self.state.first_token_at = time.perf_counter()
        self.state.generated.append(token)
        self.history.append(token)
        piece = self.text.add(token) if self.text is not None else ""
        if self.text is not None and self.text.stopped:
            self.state.finish_reason = "stop"
            self._drop_unshown()
        elif self.constraint is not None and self.constraint.done:
            self.state.finish_reason = "stop"  # the grammar can only end: no step needed
        elif len(self.state.generated) >= self.max_tokens or cache_full:
            self.state.finish_reason = "length"
        return piece

    def finish(self) -> str:
        """The text still held back, once no more tokens come."""
        if self.text is None:
            return ""
        tail = self.text.finish()
        if self.text.stopped:
            self.state.finish_reason = "stop"
            self._drop_unshown()
        return tail


def run_sequence(runtime: Runtime, cache: KVCache, seq: Sequence) -> Iterator[tuple[int, str]]:
    """Prefill ``seq``'s prompt into ``cache``, then one decode step per token until ``seq``
    ends: ``(token, text that can be shown now)`` for each token it takes."""
    screen = seq.screen
    logits = runtime.forward(seq.prompt_ids, cache, screen=screen)
    while not seq.finished:
        token = seq.sample(logits)
        # the last sampled token never runs through the model: it needs no room in the cache
        piece = seq.add(token, cache_full=cache.length >= cache.capacity)
        if piece is None:
            return
        yield token, piece
        if seq.finished:
            return
        logits = runtime.forward([token], cache, screen=screen)


def run_batch(runtime: Runtime, jobs: Iterable[tuple[Sequence, int]], *, max_batch: int = 16
              ) -> Iterator[tuple[int, str]]:
    """Run many sequences with continuous batching: ``jobs`` yields ``(sequence, capacity)``
    (each sequence's KV cache is made when it starts, with room for ``capacity`` positions, and
    dropped when it ends); up to ``max_batch`` decode together, one engine call per step, and a
    finished one makes room for the next. Yields ``(index in jobs, text)`` for each sequence as
    it ends, in the order they end (the text is "" for sequences without a :class:`TextStream`;
    ``sequence.state`` holds the tokens and the finish reason).

    Each row of a batched step computes bit for bit what it computes in any other batch, so a
    sequence's tokens do not depend on which others ran beside it, nor on ``max_batch``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SamplingError(f"max_batch must be an integer of at least 1, got {max_batch!r}")
    pending = iter(enumerate(jobs))
    active: list[tuple[int, Sequence, KVCache, int, list[str]]] = []

    def take(i: int, seq: Sequence, cache: KVCache, logits: np.ndarray, text: list[str]
             ) -> tuple[int, str] | None:
        """Sample and take the next token: ``(i, text)`` once the sequence has ended."""
        token = seq.sample(logits)
        piece = seq.add(token, cache_full=cache.length >= cache.capacity)
        if piece:
            text.append(piece)
        if piece is None or seq.finished:
            text.append(seq.finish())
            return i, "".join(text)
        active.append((i, seq, cache, token, text))
        return None

    exhausted = False
    while True:
        while not exhausted and len(active) < max_batch:
            job = next(pending, None)
            if job is None:
                exhausted = True
                break
            i, (seq, capacity) = job
            if seq.finished:  # max_tokens 0
                yield i, seq.finish()
                continue
            cache = runtime.new_cache(capacity)
            done = take(i, seq, cache,
                        runtime.forward(seq.prompt_ids, cache, screen=seq.screen), [])
            if done:
                yield done
        if not active:
            return
        rows, active[:] = list(active), []
        logits = runtime.forward_batch([r[3] for r in rows], [r[2] for r in rows],
                                       screen=[r[1].screen for r in rows])
        for (i, seq, cache, _, text), row in zip(rows, logits, strict=True):
            done = take(i, seq, cache, row, text)
            if done:
                yield done


def stream_tokens(runtime: Runtime, cache: KVCache, prompt_ids: list[int], *, max_tokens: int,
                  sampler: Sampler, stop_ids: Iterable[int],
                  state: GenerationState | None = None) -> Iterator[int]:
    """Token ids after ``prompt_ids`` until a stop id, ``max_tokens`` or a full ``cache``."""
    seq = Sequence(prompt_ids, max_tokens=max_tokens, sampler=sampler, stop_ids=stop_ids,
                   state=state)
    for token, _ in run_sequence(runtime, cache, seq):
        yield token


def stream_sequence(runtime: Runtime, cache: KVCache, seq: Sequence,
                    steps: Iterator[tuple[int, str]] | None = None) -> Iterator[str]:
    """The text pieces of ``seq`` (which has a :class:`TextStream`) as they are generated;
    ``steps``: the ``(token, piece)`` driver (default :func:`run_sequence`; speculative
    decoding passes its own)."""
    for _, piece in steps if steps is not None else run_sequence(runtime, cache, seq):
        if piece:
            yield piece
    tail = seq.finish()
    if tail:
        yield tail


class TextStream:
    """Tokens in, text out, one token at a time: pieces never split a UTF-8 character and never
    show any part of a stop string; after a stop string, ``stopped`` is set and nothing more
    comes out. (The push form of :func:`stream_text`, for a server that feeds many.)"""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, *,
                 continuation: bool = False):
        # a continuation of a prompt's text keeps the space a SentencePiece vocabulary writes
        # before its first word ("hello" + " world"); a chat reply starts a text of its own
        self._detok = StreamingDetokenizer(tokenizer,
                                           strip_leading_space=False if continuation else None)
        self._stops = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False
        self._starts: list[int] = []  # per token taken: where its text starts (characters)
        self._produced = 0  # characters the detokenizer has given
        self._shown = 0  # characters given out
        self._finished = False

    @property
    def shown_tokens(self) -> int:
        """How many of the tokens taken so far are part of the text given out: those whose
        text starts before its end (once finished without a stop string, all of them). The
        tokens of a stop string, and any after it, never are."""
        if self._finished and not self.stopped:
            return len(self._starts)
        return bisect.bisect_left(self._starts, self._shown)

    def add(self, token: int) -> str:
        """The text that can be shown now that ``token`` came."""
        if self.stopped:
            return ""
        self._starts.append(self._produced)
        return self._release(self._detok.add(token), final=False)

    def finish(self) -> str:
        """The text still held back, once no more tokens come (without the bytes of a
        character the last token left unfinished: a token limit can cut one in two)."""
        if self.stopped:
            return ""
        self._finished = True
        return self._release(self._detok.flush(drop_incomplete=True), final=True)

    def _release(self, text: str, final: bool) -> str:
        self._produced += len(text)
        pending = self._pending + text
        if not self._stops:
            self._pending = ""
            out = pending
        elif (cut := _find_stop(pending, self._stops)) is not None:
            self.stopped = True
            self._pending = ""
            out = pending[:cut]
        else:
            # keep back a tail that could still become a stop string
            safe = len(pending) if final else _partial_stop_start(pending, self._stops,
                                                                  self._hold)
            self._pending = pending[safe:]
            out = pending[:safe]
        self._shown += len(out)
        return out


def stream_text(tokenizer: Tokenizer, tokens: Iterable[int], stop: list[str] | None = None,
                state: GenerationState | None = None, *,
                continuation: bool = False) -> Iterator[str]:
    """Detokenize ``tokens`` incrementally, cutting the text before the first stop string
    (``continuation``: the tokens go on from a prompt's text, as in :class:`TextStream`)."""
    text = TextStream(tokenizer, stop, continuation=continuation)
    for token in tokens:
        piece = text.add(token)
        if piece:
            yield piece
        if text.stopped:
            break
    piece = text.finish()
    if piece:
        yield piece
    if text.stopped and state is not None:
        state.finish_reason = "stop"


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_start(text: str, stops: list[str], hold: int) -> int:
    """Where a tail of ``text`` that is the beginning of a stop string starts (else len)."""
    for start in range(max(0, len(text) - hold), len(text)):
        tail = text[start:]
        if any(s.startswith(tail) for s in stops):
            return start
    return len(text)
