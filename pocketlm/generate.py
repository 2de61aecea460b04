"""Generation: the token loop, stop conditions and streaming text.

``stream_tokens`` yields token ids until EOS, ``max_tokens`` or a full context;
``stream_text`` turns them into text pieces that never split a UTF-8 character and never show
any part of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .runtime import KVCache, Runtime
from .sampling import Sampler
from .tokenizer import StreamingDetokenizer, Tokenizer


@dataclass
class GenerationState:
    """What happened, filled in as generation runs (for callers that want stats)."""

    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"


def stream_tokens(runtime: Runtime, cache: KVCache, prompt_ids: list[int], *, max_tokens: int,
                  sampler: Sampler, stop_ids: Iterable[int],
                  state: GenerationState | None = None) -> Iterator[int]:
    state = state if state is not None else GenerationState()
    state.prompt_tokens = len(prompt_ids)
    stop = set(stop_ids)
    logits = runtime.forward(prompt_ids, cache)
    history = list(prompt_ids)
    for _ in range(max_tokens):
        token = sampler(logits, history)
        if token in stop:
            state.finish_reason = "stop"
            return
        state.generated.append(token)
        history.append(token)
        yield token
        if cache.length >= cache.capacity:
            break
        logits = runtime.forward([token], cache)
    state.finish_reason = "length"


class TextStream:
    """Tokens in, text out, one token at a time: pieces never split a UTF-8 character and never
    show any part of a stop string; after a stop string, ``stopped`` is set and nothing more
    comes out. (The push form of :func:`stream_text`, for a server that feeds many.)"""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self._detok = StreamingDetokenizer(tokenizer)
        self._stops = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The text that can be shown now that ``token`` came."""
        if self.stopped:
            return ""
        self._pending += self._detok.add(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, once no more tokens come."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self._pending
        if not self._stops:
            self._pending = ""
            return pending
        cut = _find_stop(pending, self._stops)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        # keep back a tail that could still become a stop string
        safe = len(pending) if final else _partial_stop_start(pending, self._stops, self._hold)
        self._pending = pending[safe:]
        return pending[:safe]


def stream_text(tokenizer: Tokenizer, tokens: Iterable[int], stop: list[str] | None = None,
                state: GenerationState | None = None) -> Iterator[str]:
    """Detokenize ``tokens`` incrementally, cutting the text before the first stop string."""
    text = TextStream(tokenizer, stop)
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
