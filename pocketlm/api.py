"""The Python API: ``pocketlm.load()`` and the model object it returns.

    m = pocketlm.load("smollm2-135m")       # registry name, .pocket, .gguf or HF folder
    m.generate("The capital of France is", max_tokens=16)
    for piece in m.stream("Once upon a time"): print(piece, end="")
    m.chat([{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Set
from pathlib import Path
from typing import Any

import numpy as np

from .chat import (
    FAMILY_TEMPLATES,
    encode_rendered,
    mark_control_text,
    non_text_part,
    refuse_control_text,
    render,
)
from .config import GenerationDefaults, ModelConfig
from .errors import (
    ContextLengthError,
    FormatError,
    ModelNotFoundError,
    PocketError,
    SamplingError,
    TextError,
    TokenIdError,
)
from .formats import SourceModel, open_source, sniff
from .formats.pocketfile import PocketFile
from .generate import (
    GenerationState,
    Sequence,
    TextStream,
    run_batch,
    run_sequence,
    stream_sequence,
)
from .runtime import KVCache, Runtime
from .sampling import Sampler, SamplingParams, is_integer, shown
from .speculative import SpeculativeStats
from .tokenizer import Tokenizer, check_text, release_free_heap

DEFAULT_CONTEXT = 4096  # KV cache capacity when the caller does not ask for one


class PocketModel:
    """A loaded model: tokenizer, runtime and generation, ready to use."""

    def __init__(self, config: ModelConfig, weights: dict, tokenizer: Tokenizer, *,
                 chat_template: str | None = None, generation: GenerationDefaults | None = None,
                 path: Path | None = None, metadata: dict[str, Any] | None = None,
                 n_ctx: int | None = None, file_backed: bool = False):
        self.config = config
        self.tokenizer = tokenizer
        self.runtime = Runtime(config, weights, file_backed=file_backed)
        self.chat_template = chat_template or FAMILY_TEMPLATES.get(config.arch)
        self.generation_defaults = generation or GenerationDefaults()
        self.path = path
        self.metadata = metadata or {}
        self.n_ctx = min(_check_n_ctx(n_ctx) or DEFAULT_CONTEXT, config.max_context)
        self._last = threading.local()  # last_state / last_speculative: each thread's own
        self._draft_models: dict[str, PocketModel] = {}  # draft models named by the calls

    # -- what the last call did, in the calling thread ---------------------------------------
    @property
    def last_state(self) -> GenerationState | None:
        """The :class:`GenerationState` of the last generation this thread started on the model
        (its tokens, ``finish_reason``): kept per thread, so that threads sharing a model each
        read their own generation's."""
        return getattr(self._last, "state", None)

    @last_state.setter
    def last_state(self, state: GenerationState | None) -> None:
        self._last.state = state

    @property
    def last_speculative(self) -> SpeculativeStats | None:
        """The :class:`SpeculativeStats` of the last speculative generation this thread started
        on the model (plain generations leave it as it is), per thread as ``last_state``."""
        return getattr(self._last, "speculative", None)

    @last_speculative.setter
    def last_speculative(self, stats: SpeculativeStats | None) -> None:
        self._last.speculative = stats

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``, with a BOS token if the model adds one."""
        check_text(text)
        return self.tokenizer.encode(text, add_bos=_check_flag(add_bos, "add_bos", optional=True),
                                     special=_check_flag(special, "special"))

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids (invalid UTF-8 between tokens becomes U+FFFD)."""
        return self.tokenizer.decode(self._check_ids(ids, allow_empty=True))

    # -- logits ------------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> np.ndarray:
        """Next-token logits at every position: float32 ``[len(ids), vocab_size]``."""
        ids = self._check_ids(ids)
        if len(ids) > self.config.max_context:
            raise ContextLengthError(f"{len(ids)} tokens exceed the model's context of "
                                     f"{self.config.max_context}")
        need = len(ids) * self.config.vocab_size * 4
        free = _available_memory()
        if free is not None and need > free:  # refused, not left to the kernel's OOM killer
            raise PocketError(f"the logits of {len(ids):,} tokens over {self.config.vocab_size:,} "
                              f"pieces take {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB "
                              "of memory is available; ask for fewer tokens at a time")
        cache = self.runtime.new_cache(len(ids))
        return self.runtime.forward(ids, cache, all_logits=True)

    def _check_ids(self, ids, *, allow_empty: bool = False) -> list[int]:
        """``ids`` as a list of Python ints in the vocabulary; a :class:`TokenIdError` for
        anything else (floats, strings, bools, complex numbers, a bare number)."""
        from .runtime.model import check_token_ids

        if isinstance(ids, (Set, Mapping)):  # no order: the text would be any permutation
            raise TokenIdError(f"token ids must be a list of integers, got "
                               f"{type(ids).__name__}")
        if not isinstance(ids, (str, bytes, np.ndarray)) and hasattr(ids, "__iter__"):
            ids = list(ids)  # any iterable of ids
        try:
            out = check_token_ids(ids, self.config.vocab_size).tolist()
        except TokenIdError as e:
            if "out of range" in str(e):
                raise TokenIdError(f"{e}{self._trimmed_note()}") from None
            raise
        if not out and not allow_empty:
            raise TokenIdError("need at least one token")
        return out

    def _trimmed_note(self) -> str:
        """For a model with a trimmed vocabulary: what its ids are."""
        vocab = (getattr(self, "metadata", None) or {}).get("vocab")
        try:
            vocab = json.loads(vocab) if isinstance(vocab, str) else vocab
        except ValueError:
            vocab = None
        if not isinstance(vocab, dict):
            return ""
        source = vocab.get("source_vocab")
        source = f"{source:,}" if isinstance(source, int) else "more"
        return (f" (this model's vocabulary is trimmed to {self.config.vocab_size:,} of its "
                f"source's {source} pieces and renumbered: take ids from its own tokenizer)")

    # -- generation --------------------------------------------------------------------------
    def settings(self, builtin_max_tokens: int | None = None, **explicit: Any) -> dict[str, Any]:
        """The generation settings for a call: the arguments given, the model's generation
        defaults (from its deploy file) for those left None, the built-in ones for the rest
        (:meth:`GenerationDefaults.resolve`)."""
        return self.generation_defaults.resolve(builtin_max_tokens, **explicit)

    def sampling_params(self, temperature=None, top_k=None, top_p=None, min_p=None,
                        repetition_penalty=None, seed=None) -> SamplingParams:
        """Validated sampling parameters: the arguments given, the model's generation defaults
        (from its deploy file) for those left None."""
        s = self.settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty)
        return SamplingParams(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                              min_p=s["min_p"], repetition_penalty=s["repetition_penalty"],
                              seed=seed).validate()

    def _sequence(self, prompt_ids: list[int], builtin_max_tokens: int, max_tokens, sampling,
                  state: GenerationState | None, stop: list[str] | None, *,
                  make_cache: bool = True, constrain: dict[str, Any] | None = None,
                  continuation: bool = False,
                  record: bool = True) -> tuple[Sequence, KVCache | int | None]:
        """A checked sequence for ``prompt_ids`` and the KV cache it runs in (None when it asks
        for no tokens: nothing runs; with ``make_cache=False``, the cache's capacity). Its state
        becomes ``last_state`` unless ``record`` is false (a batch records each as it ends)."""
        prompt_ids = self._check_ids(prompt_ids)
        max_tokens = self.settings(builtin_max_tokens, max_tokens=max_tokens)["max_tokens"]
        if not is_integer(max_tokens) or max_tokens < 0:
            raise SamplingError(f"max_tokens must be a non-negative integer, got "
                                f"{shown(max_tokens)}")
        max_tokens = int(max_tokens)  # a numpy integer too, as seed and top_k take them
        sampler = Sampler(self.sampling_params(**sampling))
        constraint = self.constraint(**constrain) if constrain else None
        if len(prompt_ids) >= self.n_ctx:
            raise ContextLengthError(
                f"the prompt has {_count(len(prompt_ids), 'token')} but the context holds "
                f"{self.n_ctx}; "
                "shorten the prompt" + (" or load with a larger n_ctx"
                                        if self.n_ctx < self.config.max_context else ""))
        if state is not None and not isinstance(state, GenerationState):
            raise PocketError(f"state must be a GenerationState or None, got "
                              f"{type(state).__name__}")
        if state is not None and state != GenerationState():  # it would carry on from there
            raise PocketError("state must be a new GenerationState: this one already records "
                              f"a generation ({len(state.generated)} tokens, finish_reason="
                              f"{state.finish_reason!r})")
        state = state if state is not None else GenerationState()
        if record:
            self.last_state = state
        text = (TextStream(self.tokenizer, stop, continuation=continuation)
                if stop is not None else None)
        seq = Sequence(prompt_ids, max_tokens=max_tokens, sampler=sampler,
                       stop_ids=self.tokenizer.eos_ids, text=text, state=state,
                       constraint=constraint)
        if max_tokens == 0:
            return seq, None
        capacity = min(self.n_ctx, len(prompt_ids) + max_tokens)
        return seq, self.runtime.new_cache(capacity) if make_cache else capacity

    def constraint(self, json_schema: Any = None, regex: str | None = None,
                   grammar: str | None = None):
        """A fresh :class:`~pocketlm.structured.Constraint` for one of ``json_schema`` (a dict
        or its JSON text), ``regex`` or ``grammar`` (Lark, or GBNF), or None for none; a
        :class:`GrammarError` for one that cannot be used."""
        from .structured import constraint_for

        return constraint_for(self.tokenizer, self.config.vocab_size, json_schema=json_schema,
                              regex=regex, grammar=grammar)

    def stream_ids(self, prompt_ids: list[int], *, max_tokens: int | None = None,
                   temperature: float | None = None, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repetition_penalty: float | None = None, seed: int | None = None,
                   state: GenerationState | None = None) -> Iterator[int]:
        """Generated token ids after ``prompt_ids`` (EOS not included). Settings left None are
        the model's generation defaults, else the built-in ones (greedy, 128 tokens)."""
        seq, cache = self._sequence(
            prompt_ids, 128, max_tokens, dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                              min_p=min_p, repetition_penalty=repetition_penalty,
                                              seed=seed), state, None)
        if cache is None:
            return _nothing()
        return (token for token, _ in run_sequence(self.runtime, cache, seq))

    def _stream_text(self, prompt_ids: list[int], builtin_max_tokens: int, stop: list[str],
                     max_tokens, sampling, speculative=None, constrain=None,
                     continuation: bool = False) -> Iterator[str]:
        drafter = self._drafter(speculative)  # checked before anything runs
        seq, cache = self._sequence(prompt_ids, builtin_max_tokens, max_tokens, sampling, None,
                                    stop, constrain=constrain, continuation=continuation)
        if drafter is not None:  # this generation's statistics, even of nothing drafted
            self.last_speculative = SpeculativeStats()
        if cache is None:
            return _nothing()
        if drafter is None:
            return stream_sequence(self.runtime, cache, seq)
        from .speculative import run_speculative

        drafter, lengths = drafter
        steps = run_speculative(self.runtime, cache, seq, drafter, lengths,
                                self.last_speculative)
        return stream_sequence(self.runtime, cache, seq, steps)

    def _drafter(self, speculative):
        """``(drafter, draft lengths)`` for a ``speculative`` argument, or None."""
        if speculative is None or speculative is False:
            return None
        from .speculative import DEFAULT_MAX_DRAFT, DraftLength, make_drafter, speculative_spec

        speculative = speculative_spec(speculative)  # an unknown key before any value
        lengths = DraftLength(max_draft=speculative.get("max_draft", DEFAULT_MAX_DRAFT))
        return make_drafter(speculative, target_tokenizer=self.tokenizer,
                            capacity=self.n_ctx, loaded=self._draft_models), lengths

    def stream(self, prompt: str, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None,
               seed: int | None = None, stop: list[str] | str | None = None, *,
               top_k: int | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None,
               add_bos: bool | None = None, speculative=None, json_schema: Any = None,
               regex: str | None = None, grammar: str | None = None) -> Iterator[str]:
        """Text pieces of the continuation of ``prompt`` as they are generated. Settings left
        None are the model's generation defaults, else the built-in ones (greedy, 128 tokens).

        ``json_schema`` (a dict or its JSON text), ``regex`` or ``grammar`` (Lark, or GBNF)
        constrains the output: every token drawn is one the grammar allows, and generation
        ends once the grammar is complete (:mod:`pocketlm.structured`).

        ``speculative``: ``"lookup"`` (drafts from n-grams of the prompt and the text so far),
        ``{"draft": MODEL}`` or MODEL itself (a smaller model of the same vocabulary: a name, a
        path or a loaded model), or a dict of options (``max_draft``, ``max_ngram``,
        ``min_ngram``; ``{}`` is prompt lookup's defaults): several tokens per pass over the
        weights, the same tokens as without it (:mod:`pocketlm.speculative`);
        ``last_speculative`` then holds its statistics."""
        check_text(prompt, "prompt")
        stops = _check_stop(stop)
        ids = self.tokenize(prompt, add_bos=add_bos)
        if not ids:  # "need at least one token" would not say which argument
            raise TokenIdError("the prompt is empty and no BOS token is added: give at least "
                               "one character" + (" (or add_bos=True)"
                                                  if self.tokenizer.bos_id is not None else ""))
        return self._stream_text(ids, 128, stops, max_tokens, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, seed=seed), speculative,
            _constrain(json_schema, regex, grammar), continuation=True)

    def generate(self, prompt: str, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop: list[str] | str | None = None,
                 **kwargs: Any) -> str:
        """The continuation of ``prompt`` as one string (settings as in :meth:`stream`)."""
        return "".join(self.stream(prompt, max_tokens, temperature, top_p, seed, stop, **kwargs))

    # -- chat --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_args: Any) -> str:
        reserved = sorted(set(template_args) & {"bos_token", "eos_token", "template_name"})
        if reserved:  # the model's own: a template sees what the tokenizer has
            raise PocketError(f"template variable {reserved[0]!r} is the model's own (from its "
                              "tokenizer); it cannot be given")
        tok = self.tokenizer
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.id_to_token(tok.eos_ids[0]) if tok.eos_ids else ""
        name = f"the chat template of {self.path}" if self.path else "the model's chat template"
        return render(self.chat_template, messages, bos_token=bos or "", eos_token=eos or "",
                      add_generation_prompt=_check_flag(add_generation_prompt,
                                                        "add_generation_prompt"),
                      template_name=name,
                      **template_args)

    def chat_ids(self, messages: list[dict[str, Any]], **template_args: Any) -> list[int]:
        """The prompt's token ids: ``messages`` (``{"role": str, "content": str}`` dicts; a
        content may be OpenAI's text parts, ``[{"type": "text", "text": str}, ...]``) rendered
        with the chat template (extra template variables, such as ``tools``, in
        ``template_args``). The template's control tokens are tokens; a message's text is
        text, even where it spells one (a user who writes ``<|im_end|>`` cannot end their
        turn), as OpenAI's API treats it. Such text anywhere else the template renders (a
        role, a tool call, the tools offered) is refused."""
        if isinstance(messages, list) and not messages:  # a prompt of nothing but the header
            raise PocketError("messages is empty: give at least one {'role': str, "
                              "'content': str} message")
        messages = _chat_messages(messages)
        tok = self.tokenizer
        refuse_control_text(messages, template_args, tok, self.chat_template)
        marked = mark_control_text(messages, tok, self.chat_template)
        text = self.render_chat(marked.messages if marked else messages, **template_args)
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
        add_bos = tok.add_bos and tok.bos_id is not None and not (bos and text.startswith(bos))
        return [tok.bos_id] * add_bos + encode_rendered(tok, text, marked)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None,
             seed: int | None = None, stop: list[str] | str | None = None,
             stream: bool = False, *, top_k: int | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, speculative=None,
             json_schema: Any = None, regex: str | None = None, grammar: str | None = None):
        """The assistant's reply to ``messages`` (an iterator of pieces when ``stream``).
        Settings left None are the model's generation defaults, else the built-in ones
        (greedy, 256 tokens); ``speculative``, ``json_schema``, ``regex`` and ``grammar`` as
        in :meth:`stream`."""
        stops = _check_stop(stop)
        stream = _check_flag(stream, "stream")
        ids = self.chat_ids(messages)
        pieces = self._stream_text(ids, 256, stops, max_tokens, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, seed=seed), speculative,
            _constrain(json_schema, regex, grammar))
        return pieces if stream else "".join(pieces)

    def chat_batch(self, conversations: Iterable[list[dict[str, Any]]],
                   max_tokens: int | None = None, temperature: float | None = None,
                   top_p: float | None = None, seed: int | None = None,
                   stop: list[str] | str | None = None, *, top_k: int | None = None,
                   min_p: float | None = None, repetition_penalty: float | None = None,
                   max_batch: int = 16, json_schema: Any = None, regex: str | None = None,
                   grammar: str | None = None) -> Iterator[tuple[int, str, GenerationState]]:
        """Replies to many conversations, generated together (continuous batching: up to
        ``max_batch`` decode in one pass over the weights; the next starts as one ends).
        Yields ``(index, reply, state)`` as each one ends, in the order they end
        (``state.finish_reason``: "stop" or "length"; ``state.generated``: the token ids).
        Settings as in :meth:`chat` (one ``seed`` seeds every conversation's sampler); a reply
        does not depend on which conversations ran beside it. ``json_schema``, ``regex`` or
        ``grammar`` constrains every reply as in :meth:`stream`. Every conversation is
        rendered and checked before the first runs: one that cannot run is an error naming
        its index (``conversations[2]: ...``), and none has run. ``last_state`` is the state of
        the conversation that ended last (it changes as each one ends)."""
        stops = _check_stop(stop)
        if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations,
                                                                             Iterable):
            raise PocketError(f"conversations must be an iterable of message lists, got "
                              f"{type(conversations).__name__}")
        constrain = _constrain(json_schema, regex, grammar)
        if constrain:
            self.constraint(**constrain)  # checked before anything runs
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, seed=seed)
        # every conversation rendered and checked before any runs: one that cannot be (a
        # malformed message, a prompt too long) is refused naming its index, instead of
        # ending the batch after the others had run, their replies lost
        sequences: dict[int, Sequence] = {}
        jobs = []
        for i, messages in enumerate(conversations):
            try:
                seq, capacity = self._sequence(self.chat_ids(messages), 256, max_tokens,
                                               sampling, None, stops, make_cache=False,
                                               constrain=constrain, record=False)
            except PocketError as exc:
                raise type(exc)(f"conversations[{i}]: {exc}") from None
            sequences[i] = seq
            jobs.append((seq, capacity))

        for i, text in run_batch(self.runtime, iter(jobs), max_batch=max_batch):
            state = sequences.pop(i).state
            self.last_state = state  # the conversation that ended last, as it ends
            yield i, text, state

    def __repr__(self) -> str:
        c = self.config
        return (f"PocketModel({c.arch}, {c.n_params() / 1e6:.0f}M params, "
                f"vocab {c.vocab_size}, path={str(self.path)!r})")


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _chat_messages(messages: Any) -> Any:
    """``messages`` checked message by message, each error naming the message and its field
    (``messages[1].content``), with OpenAI's content parts (``[{"type": "text", "text":
    ...}]``, as the server takes them) joined into the text they hold, and an assistant's
    ``content`` None beside its ``tool_calls`` read as "". Not a list: as given (render says
    what it must be)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise PocketError(f"{where} must be a {{'role': str, 'content': str}} dict, got "
                              f"{type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise PocketError(f"{where}.role must be a string (such as 'user'), got "
                              f"{type(m.get('role')).__name__ if 'role' in m else 'none'}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            j = non_text_part(content)
            if j is not None:
                raise PocketError(f"{where}.content[{j}] must be a text part ({{'type': "
                                  "'text', 'text': str}); the model reads text only")
            m = {**m, "content": "".join(part["text"] for part in content)}
        elif content is None and m.get("tool_calls"):
            m = {**m, "content": ""}
        elif not isinstance(content, str):
            raise PocketError(f"{where}.content must be a string, got "
                              f"{type(content).__name__ if 'content' in m else 'none'}")
        check_text(m["content"], f"{where}.content")
        out.append(m)
    return out


def _constrain(json_schema, regex, grammar) -> dict[str, Any] | None:
    """The constraint arguments given, or None for none."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex),
                                ("grammar", grammar)) if v is not None}
    return given or None


def _check_flag(value, name: str, *, optional: bool = False):
    """A True/False switch as given (None too where ``optional``): ``stream="no"`` or
    ``add_bos=0.5`` is refused rather than read by its truthiness."""
    if isinstance(value, (bool, np.bool_)) or (optional and value is None):
        return None if value is None else bool(value)
    raise PocketError(f"{name} must be True or False{' (or None)' if optional else ''}, got "
                      f"{value!r}")


def _check_stop(stop) -> list[str]:
    """``stop`` (None, a string or a list of strings) as a list of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [check_text(stop, "stop")]
    if not isinstance(stop, (list, tuple)):
        raise SamplingError(f"stop must be a string or a list of strings, got "
                            f"{type(stop).__name__}")
    return [check_text(s, "each stop string") for s in stop]


# -- loading ---------------------------------------------------------------------------------
def check_context_flag(asked: int | None, flag: str = "--ctx") -> None:
    """A context flag's value checked before anything is loaded, naming the flag."""
    _check_n_ctx(asked, flag)


def context_note(model: PocketModel, asked: int | None, flag: str = "--ctx") -> str | None:
    """A line saying that a context larger than the model holds was cut to its own (``load``
    takes the smaller of the two), or None."""
    if asked is None or asked <= model.n_ctx:
        return None
    return (f"note: the model holds at most {model.n_ctx} tokens of context; {flag} {asked} "
            f"gives {model.n_ctx}")


def _available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), or None
    where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_n_ctx(n_ctx, name: str = "n_ctx"):
    if n_ctx is None:
        return None
    if not is_integer(n_ctx) or n_ctx < 1:
        raise ContextLengthError(f"{name} must be a positive number of tokens, got "
                                 f"{shown(n_ctx)}")
    return int(n_ctx)  # a numpy integer too, as max_tokens takes it


def file_config_and_tokenizer(pf: PocketFile) -> tuple[ModelConfig, Tokenizer]:
    """A deploy file's model config and tokenizer (no weights read). The config is validated
    and checked against the file's tensor table first, so that nothing is sized from a header
    the file does not back."""
    config = pf.config()
    pf.check_model(config)
    try:
        tokenizer = Tokenizer.from_json(pf.tokenizer_json())
    except PocketError as exc:
        if str(pf.path) in str(exc):
            raise
        raise type(exc)(f"{pf.path}: tensor {pf.tokenizer_tensor!r}: {exc}") from None
    # the ids the tokenizer adds by itself must be rows of the model's embedding: one past it
    # loaded and failed at the first prompt, naming no file
    named = [("bos_id", tokenizer.bos_id)] + [("an EOS id", i) for i in tokenizer.eos_ids] + [
        (f"special token {t!r}", i) for t, i in tokenizer.special_tokens.items()]
    for what, tid in named:
        if tid is not None and not 0 <= tid < config.vocab_size:
            raise FormatError(f"{pf.path}: tensor {pf.tokenizer_tensor!r}: the tokenizer's "
                              f"{what} is {tid}, outside the model's vocabulary of "
                              f"{config.vocab_size}; the file is damaged")
    return config, tokenizer


def load_pocket(path: str | Path, *, verify: bool = True, n_ctx: int | None = None,
                on_stage=None) -> PocketModel:
    """Load a deploy file. ``on_stage(name)`` is called after each step (the benchmark uses
    it to say where memory goes). The model's ``metadata`` is the file's, plus
    ``header_verified`` (False for a format version 1 file, whose header has no checksum)."""
    stage = on_stage or (lambda name: None)
    pf = PocketFile(path, verify=verify)
    stage("file mapped" + (" + checksums read" if verify else ""))
    config, tokenizer = file_config_and_tokenizer(pf)
    stage("tokenizer")
    try:
        generation = GenerationDefaults.from_dict(pf.json_object("generation", {}))
    except PocketError as exc:
        if str(pf.path) in str(exc):
            raise
        raise type(exc)(f"{pf.path}: metadata field 'generation': {exc}") from None
    try:
        model = PocketModel(
            config, pf.weights(), tokenizer,
            chat_template=pf.text("chat_template") or None, generation=generation,
            path=Path(path), metadata={**pf.metadata, "header_verified": pf.header_verified},
            n_ctx=n_ctx, file_backed=True,
        )
    except FormatError as exc:  # the runtime's checks of the file's tensors (its adapters)
        if str(pf.path) in str(exc):
            raise
        raise type(exc)(f"{pf.path}: {exc}") from None
    if model.runtime.native is not None:
        pf.drop_resident()  # the engine holds its own copy; mapped pages come back on demand
    release_free_heap()  # what loading freed goes back to the system, not to the heap
    stage("runtime (weights, native engine)")
    return model


def from_source(source: SourceModel, *, n_ctx: int | None = None) -> PocketModel:
    """A float32 model straight from a source's dequantized weights (the reference path).
    A weight holding NaN or infinity is refused, as packing refuses it (every logit was NaN)."""
    from .quant import check_finite

    weights = {}
    for name, t in source.tensors.items():
        weights[name] = t.to_float()
        check_finite(name, weights[name])
    return PocketModel(source.config, weights, source.tokenizer,
                       chat_template=source.chat_template, generation=source.generation,
                       n_ctx=n_ctx)


def deploy_file(model: str | os.PathLike | None = None, *, group_size: int = 32,
                embed_bits: int = 8, keep_precision: bool | None = None,
                quiet: bool = True) -> Path:
    """The deploy file :func:`load` runs for ``model`` (its arguments): a ``.pocket`` file as it
    is; a GGUF file, Hugging Face folder or training run packed into ``$POCKET_HOME/packed`` on
    first use (:func:`pocketlm.packcache.ensure_packed`)."""
    from .pack import check_pack_options
    from .packcache import ensure_packed
    from .registry import resolve

    check_pack_options(group_size, embed_bits, keep_precision)  # before a model is pulled
    quiet = _check_flag(quiet, "quiet")
    return ensure_packed(resolve(_model_name(model), quiet=quiet), group_size=group_size,
                         embed_bits=embed_bits, keep_precision=keep_precision, quiet=quiet)


def _intact(path) -> bool:
    """Whether the deploy file at ``path`` has a verified header and every tensor's checksum."""
    try:
        return PocketFile(path, verify=True).header_verified
    except (FormatError, OSError):
        return False


def _nothing() -> Iterator:
    """The stream of a generation of no tokens: a generator like every other stream (with
    ``close`` and ``throw``), whose arguments were checked when it was made."""
    return
    yield


def _model_name(model) -> str:
    """``model`` (a name, a path or None for the default) as the string ``resolve`` takes."""
    from .registry import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise ModelNotFoundError(f"model must be a registry name or a path, got "
                                 f"{type(model).__name__}")
    text = os.fspath(model) if not isinstance(model, str) else model
    try:
        return check_text(text, "model")
    except TextError as e:
        try:  # a path whose bytes are not UTF-8 (the OS hands them over as surrogate escapes)
            raw = os.fsencode(text)
        except UnicodeEncodeError:
            raise e from None
        if not os.path.lexists(text):
            raise ModelNotFoundError(f"{raw!r} is neither an existing file or directory nor a "
                                     "registry model") from None
        raise ModelNotFoundError(f"{raw!r}: the path is not UTF-8 text, which pocketlm needs to "
                                 "record where a model came from; rename it") from None


def load(model: str | os.PathLike | None = None, *, precision: str = "int4",
         group_size: int = 32, embed_bits: int = 8, keep_precision: bool | None = None,
         n_ctx: int | None = None, verify: bool = True, quiet: bool = True) -> PocketModel:
    """Load a model by registry name, ``.pocket`` file, ``.gguf`` file or Hugging Face folder.

    GGUF files, Hugging Face folders and training runs are packed on first use (INT4, with the
    tensors a GGUF holds quantized above 4 bits kept at their precision) and the deploy file is
    cached under ``$POCKET_HOME/packed`` (:func:`deploy_file`). ``precision="float"`` instead
    runs the source's dequantized float32 weights (the reference path, for checking an import).
    ``group_size``, ``embed_bits`` and ``keep_precision`` (``False``: every linear weight in
    INT4) are the packing options of :func:`pocketlm.pack.pack`.
    """
    from .registry import resolve

    _check_n_ctx(n_ctx)
    if precision not in ("int4", "float"):
        raise PocketError(f"precision must be 'int4' or 'float', got {precision!r}")
    verify, quiet = _check_flag(verify, "verify"), _check_flag(quiet, "quiet")
    if precision == "float":
        path = resolve(_model_name(model), quiet=quiet)
        if sniff(path) == "pocket":
            raise PocketError(f"{path}: a deploy file is already quantized; "
                              "precision='float' needs the GGUF or Hugging Face source")
        return from_source(open_source(path), n_ctx=n_ctx)
    options = dict(group_size=group_size, embed_bits=embed_bits, keep_precision=keep_precision,
                   quiet=quiet)
    path = deploy_file(model, **options)
    try:
        loaded = load_pocket(path, verify=verify, n_ctx=n_ctx)
    except FormatError as e:
        if Path(path).resolve() == resolve(_model_name(model), quiet=True).resolve():
            raise  # the deploy file the caller named, not a cache entry
        # a cache entry is derived from its source: one that no longer reads (truncated, a
        # changed byte, an interrupted copy, an older packer's mistake) is packed again instead
        # of failing every load. One whose checksums all match is set aside meanwhile: if the
        # new pack fails too, what fails is reading here (an older library), and the entry is
        # put back for the environments that read it (it was deleted, leaving none)
        path = Path(path)
        aside = path.with_name(path.name + ".unread") if _intact(path) else None
        if not quiet:
            print(f"pocketlm: the cached deploy file {path} does not load ({e}); packing it "
                  "again", file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            if aside is not None:
                os.replace(path, aside)
            else:
                path.unlink()
        try:
            again = load_pocket(deploy_file(model, **options), verify=verify, n_ctx=n_ctx)
        except BaseException as again_error:
            if aside is not None and aside.exists():
                os.replace(aside, path)
                if isinstance(again_error, FormatError):
                    raise FormatError(f"{e} (the file's checksums match, and packing it again "
                                      "failed too: this environment cannot read it; check "
                                      "`pip check` and the versions pocketlm requires)"
                                      ) from None
            raise
        if aside is not None:
            with contextlib.suppress(FileNotFoundError):
                aside.unlink()
        return again
    # an entry set aside by a process killed before it could remove it (the entry packed again
    # loads): a whole deploy file's bytes, otherwise kept for good (stat only when none)
    stale = Path(path).with_name(Path(path).name + ".unread")
    if stale.exists() and (Path(path).resolve()
                           != resolve(_model_name(model), quiet=True).resolve()):
        with contextlib.suppress(OSError):
            stale.unlink()
    return loaded
