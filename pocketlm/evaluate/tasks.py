"""Engines, perplexity, task files and their scoring.

An *engine* is the small interface that evaluation needs from a model (:class:`Engine`):
``tokenize(text)``, ``logits(ids)`` (next-token logits at every position) and
``generate(ids, max_tokens)``. :class:`PocketEngine` runs a :class:`pocketlm.PocketModel`;
:class:`LlamaCppEngine` runs a GGUF through llama-cpp-python, so the same numbers can be
checked against an independent implementation.

A *task* (:class:`Task`) is a header (type, prompt template, few-shot settings) plus examples.
:func:`load_task` reads one from a YAML/JSON task file or from a JSONL file whose first line is
``{"task": {...header...}}``; :func:`evaluate_task` scores it:

* ``multiple_choice`` and ``classification``: the log-likelihood of each candidate
  continuation (a choice, a label) given the prompt; the best one is the prediction, so the
  model can only ever answer one of the candidates;
* ``generation``: greedy decoding, then an answer-extraction rule and exact match, or, when
  the header names a ``check`` (:data:`CHECKS`: ``humaneval`` runs the completion against
  its tests, ``instructions`` verifies the instructions in the prompt), that check's verdict.
"""

from __future__ import annotations

import decimal
import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PocketError
from ..progress import bar as progress_bar
from ..textfile import json_problem

TASK_TYPES = ("multiple_choice", "generation", "classification")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# The checks a generation task may name instead of exact match: ``check(output, example)``
# returns ``{"correct": bool, "prediction": ..., ...details}``. Imported on first use.
CHECKS = {
    "humaneval": "pocketlm.evaluate.humaneval:check_completion",
    "humaneval-script": "pocketlm.evaluate.humaneval:check_script",
    "instructions": "pocketlm.evaluate.instructions:check_response",
}


def get_check(name: str) -> Callable[[str, dict], dict]:
    """The check function named ``name`` (one of :data:`CHECKS`)."""
    import importlib

    if name not in CHECKS:
        raise PocketError(f"unknown check {name!r}; known: {', '.join(CHECKS)}")
    module, func = CHECKS[name].split(":")
    return getattr(importlib.import_module(module), func)


# -- engines ------------------------------------------------------------------------------------


class Engine:
    """What evaluation needs from a model. Subclasses set ``name``, ``max_context`` and
    ``bos_ids`` (``[bos]`` when the model's tokenizer adds a BOS token, else ``[]``)."""

    name = "engine"
    max_context = 0
    bos_ids: list[int] = []
    # tokens run through the model so far: prompt/context tokens and generated tokens
    prompt_tokens = 0
    generated_tokens = 0

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text`` without BOS (``special``: parse special-token text)."""
        raise NotImplementedError

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position of ``ids``: float ``[len(ids), vocab]``."""
        raise NotImplementedError

    def generate(self, ids: Sequence[int], max_tokens: int, stop: Sequence[str] = ()) -> str:
        """Greedy continuation of ``ids`` as text, cut before the first stop string."""
        raise NotImplementedError

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """``messages`` rendered with the model's chat template, ready for the reply."""
        raise PocketError(f"the {self.name} engine has no chat template")

    def continuation_logprobs(self, context: list[int],
                              continuations: list[list[int]]) -> list[float]:
        """Sum of log-probabilities of each continuation's tokens after ``context``."""
        out = []
        for cont in continuations:
            rows = self.logits(context + cont)[len(context) - 1: len(context) + len(cont) - 1]
            out.append(float(token_logprobs(rows, cont).sum()))
            self.prompt_tokens += len(context) + len(cont)
        return out


class PocketEngine(Engine):
    """A :class:`pocketlm.PocketModel` (the runtime's native engine)."""

    name = "pocketlm"

    def __init__(self, model):
        self.model = model
        tok = model.tokenizer
        self.bos_ids = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
        self.max_context = model.n_ctx  # the context it was loaded with

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self.model.tokenizer.encode(text, add_bos=False, special=special)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.model.logits(list(ids))

    def generate(self, ids: Sequence[int], max_tokens: int, stop: Sequence[str] = ()) -> str:
        from ..generate import stream_text

        self.prompt_tokens += len(ids)
        tokens = self.model.stream_ids(list(ids), max_tokens=max_tokens, temperature=0.0)
        # the answer goes on from the prompt's text, as llama.cpp's completion does
        return "".join(stream_text(self.model.tokenizer, self._counted(tokens), list(stop),
                                   continuation=True))

    def _counted(self, tokens):
        for t in tokens:
            self.generated_tokens += 1
            yield t

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.model.render_chat(messages)

    def continuation_logprobs(self, context: list[int],
                              continuations: list[list[int]]) -> list[float]:
        # the context runs once; each continuation reuses its keys and values
        rt = self.model.runtime
        cache = rt.new_cache(len(context) + max(len(c) for c in continuations))
        last = rt.forward(context, cache)[None, :]  # only the last position's logits
        self.prompt_tokens += len(context)
        out = []
        for cont in continuations:
            self.prompt_tokens += len(cont) - 1
            cache.truncate(len(context))
            rows = last if len(cont) == 1 else np.concatenate(
                [last, rt.forward(cont[:-1], cache, all_logits=True)])
            out.append(float(token_logprobs(rows, cont).sum()))
        return out


class LlamaCppEngine(Engine):
    """A GGUF file run by llama-cpp-python (``logits_all=True`` for per-position logits)."""

    name = "llama.cpp"

    def __init__(self, path: str | Path, *, n_ctx: int | None = None, threads: int | None = None):
        from ..llamacpp import LlamaCpp, import_llama_cpp

        import_llama_cpp("--engine llama.cpp")
        path = Path(path)
        if path.suffix != ".gguf":
            raise PocketError(f"{path}: the llama.cpp engine needs a .gguf file")
        # logits_all keeps n_ctx x vocab float32 scores: a modest default context
        self.llm = LlamaCpp(path, n_ctx=n_ctx or 2048, n_batch=512, logits_all=True,
                            threads=threads, batch_threads=threads)
        self.max_context = self.llm.max_context()
        self.bos_ids = self.llm.bos_ids()
        self.chat_template = self.llm.metadata.get("tokenizer.chat_template")

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self.llm.tokenize(text, add_bos=False, special=special)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        if len(ids) > self.max_context:
            raise PocketError(f"{len(ids)} tokens exceed the llama.cpp context of "
                              f"{self.max_context}")
        return self.llm.logits(ids)

    def generate(self, ids: Sequence[int], max_tokens: int, stop: Sequence[str] = ()) -> str:
        text = self.llm.complete(ids, max_tokens, stop)
        self.prompt_tokens += len(ids)
        self.generated_tokens += len(self.tokenize(text)) if text else 0  # re-tokenized count
        return text

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        from ..chat import render

        bos = self.llm.token_text(self.bos_ids)
        eos = self.llm.token_text([self.llm.eos_id()])
        return render(self.chat_template, messages, bos_token=bos, eos_token=eos)


def token_logprobs(rows: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """float64 log-probability of ``targets[i]`` under the logits ``rows[i]``."""
    x = np.asarray(rows, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - top).sum(axis=-1)) + top[:, 0]
    return x[np.arange(len(targets)), np.asarray(targets)] - lse


# -- perplexity ---------------------------------------------------------------------------------


def perplexity(model, text: str, *, window: int | None = None, stride: int | None = None,
               progress: bool = True) -> dict:
    """Perplexity of ``text`` under ``model`` (a PocketModel or an :class:`Engine`).

    The token sequence is scored with a sliding window of ``window`` tokens (default the
    model's context, at most 1024) moved by ``stride`` tokens (default ``window // 2``). Every
    token is scored exactly once; after the first window each one sees at least
    ``window - stride`` tokens of context. A model whose tokenizer adds a BOS token gets it at
    the start of every window, and the BOS itself is never scored; without a BOS the first
    token of the text has no context and is not scored.

    Returns ``ppl`` (per token), ``ppl_char`` and ``bits_per_char`` (total NLL over the
    characters of ``text``, comparable across tokenizers), ``tokens`` (scored), ``chars`` and
    ``nll`` (total, in nats).
    """
    engine = as_engine(model)
    if not isinstance(text, str):
        raise PocketError(f"perplexity() takes a str, got {type(text).__name__}")
    prefix = list(engine.bos_ids)
    body = engine.tokenize(text)
    if len(body) < (1 if prefix else 2):
        raise PocketError(f"the text has {len(body)} token(s): nothing to score")
    window = min(engine.max_context, 1024) if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or window < len(prefix) + 2:
        raise PocketError(f"window must be an integer of at least {len(prefix) + 2} tokens, "
                          f"got {window!r}")
    if window > engine.max_context:
        raise PocketError(f"window {window} exceeds the {engine.max_context} tokens of "
                          "context the model was loaded with")
    cap = window - len(prefix)  # text tokens per window
    stride = window // 2 if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise PocketError(f"stride must be an integer in 1..{window}, got {stride!r}")
    # without a BOS a window's first token has no context, so windows must overlap by one
    stride = min(stride, cap if prefix else cap - 1)

    starts = [0]
    while starts[-1] + cap < len(body):
        starts.append(starts[-1] + stride)
    bar = progress_bar(len(starts), "perplexity", "window", enabled=progress and len(starts) > 1)
    nll, scored, done = 0.0, 0, 0
    for begin in starts:
        end = min(begin + cap, len(body))
        ids = prefix + body[begin:end]
        first = max(done, begin if prefix else begin + 1)  # first text index scored here
        pos = np.arange(first, end) - begin + len(prefix)  # positions of the scored tokens
        rows = engine.logits(ids)[pos - 1]
        nll -= float(token_logprobs(rows, [ids[p] for p in pos]).sum())
        scored += len(pos)
        done = end
        bar.update(1)
    bar.close()
    chars = len(text)
    return {"ppl": _exp(nll / scored), "ppl_char": _exp(nll / chars),
            "bits_per_char": nll / chars / math.log(2), "tokens": scored, "chars": chars,
            "nll": nll, "window": window, "stride": stride}


def _exp(x: float) -> float:
    """``math.exp``, but inf past float range: a broken model (a bad pack, overflowing
    logits) has per-token losses in the thousands of nats, and is reported, not a traceback."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def as_engine(model) -> Engine:
    """``model`` itself if it is an :class:`Engine`, else a :class:`PocketEngine` over it."""
    return model if isinstance(model, Engine) else PocketEngine(model)


# -- answer extraction --------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# what normalize() takes for a number: the forms _NUMBER extracts, with a sign and a "$" either
# way round; its digits and fraction
_NUMERAL = re.compile(r"(?:[+-]\$?|\$[+-]?)?(\d[\d,]*(?:\.\d+)?|\.\d+)")
_EDGE = " .,:;!?。，：；！？\"'`"  # punctuation normalize() strips from either end


def normalize(text: str) -> str:
    """Exact-match normal form: casefolded, whitespace collapsed, edge punctuation stripped,
    and a number written canonically (``$1,234.50`` → ``1234.5``, ``18.00`` → ``18``,
    ``-0`` → ``0``, ``.5`` → ``0.5``).

    A number is a plain decimal numeral: an optional sign and ``$``, digits (``,`` among
    them ignored), an optional fraction. Its value is kept exactly (``decimal.Decimal``: no
    two numerals of different values are one form, however many digits they have). Anything
    else is text, compared as written: exponents (``1e3``), ``nan``, ``inf``, ``1_000``."""
    text = " ".join(str(text).casefold().split()).rstrip(_EDGE)
    start = len(text) - len(text.lstrip(_EDGE))
    if start and text[start - 1] == "." and text[start:start + 1].isdigit():
        start -= 1  # the point of ".5", not punctuation
    text = text[start:]
    numeral = _NUMERAL.fullmatch(text)
    if numeral is None:
        return text
    digits = numeral.group(1).replace(",", "")
    sign = "-" if "-" in text[:numeral.start(1)] else ""
    with decimal.localcontext() as ctx:
        ctx.prec = len(digits)  # normalize() rounds to the context's precision: never here
        value = decimal.Decimal(sign + digits).normalize()
    return format(value, "f") if value else "0"


def last_number(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K's answer marker) if there is one, else the
    last number in ``text``; None when it holds no number."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return found[0]
    found = _NUMBER.findall(text)
    return found[-1] if found else None


_ANSWER_IS = re.compile(r"answer is[:\s]*", re.I)


def answer_is(text: str) -> str | None:
    """The first number after the last "the answer is" (the chain-of-thought prompts' closing
    phrase), else :func:`last_number`."""
    marks = list(_ANSWER_IS.finditer(text))
    if marks:
        found = _NUMBER.findall(text[marks[-1].end():])
        if found:
            return found[0]
    return last_number(text)


def first_line(text: str) -> str:
    """The first non-blank line of ``text`` (empty if none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def make_extractor(rule: str) -> Callable[[str], str | None]:
    """The answer-extraction function of ``rule``: ``last_number``, ``first_line`` or
    ``regex:<pattern>`` (the first group of the first match, or the whole match)."""
    if rule == "last_number":
        return last_number
    if rule == "first_line":
        return first_line
    if rule == "answer_is":
        return answer_is
    if isinstance(rule, str) and rule.startswith("regex:"):
        try:
            pattern = re.compile(rule[len("regex:"):])
        except re.error as e:
            raise PocketError(f"extract {rule!r}: bad regular expression: {e}") from None

        def extract(text: str) -> str | None:
            m = pattern.search(text)
            if m is None:
                return None
            return next((g for g in m.groups() if g is not None), m.group(0))

        return extract
    raise PocketError(f"extract must be 'last_number', 'answer_is', 'first_line' or "
                      f"'regex:<pattern>', "
                      f"got {rule!r}")


# -- templates ----------------------------------------------------------------------------------

_FIELD = re.compile(r"\{\{|\}\}|\{(\w+)(?:\[(\d+)\])?\}")


def template_fields(template: str) -> set[str]:
    """The example fields that ``template`` refers to (``{name}`` or ``{name[i]}``)."""
    return {m.group(1) for m in _FIELD.finditer(template) if m.group(1)}


def render_template(template: str, example: dict, *, where: str = "") -> str:
    """``template`` with ``{field}`` and ``{field[i]}`` replaced from ``example``;
    ``{{`` and ``}}`` are literal braces."""

    def sub(m: re.Match) -> str:
        if m.group(1) is None:
            return m.group(0)[0]
        name, index = m.group(1), m.group(2)
        if name not in example:
            has = ", ".join(sorted(map(str, example)))  # YAML keys may be numbers
            raise PocketError(f"{where}template refers to unknown field {{{name}}}; the "
                              f"example has {has or 'no fields'}")
        value = example[name]
        if index is not None:
            if not isinstance(value, list) or int(index) >= len(value):
                raise PocketError(f"{where}template refers to {{{name}[{index}]}} but "
                                  f"{name!r} is not a list of more than {index} items")
            value = value[int(index)]
        return str(value)

    return _FIELD.sub(sub, template)


# -- tasks --------------------------------------------------------------------------------------


@dataclass
class Task:
    """A task header and its examples (each a dict of fields).

    ``fewshot`` holds the pool that ``shots`` examples are drawn from; when it is empty the
    first ``shots`` examples are used and excluded from scoring.
    """

    name: str
    type: str
    template: str
    examples: list[dict]
    fewshot: list[dict] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # classification
    extract: str = "last_number"  # generation
    choice_prefix: str = " "  # put between the prompt and each choice/label/answer
    continuation: str = "choice"  # multiple_choice: score the "choice" text or its "letter"
    fewshot_separator: str = "\n\n"
    shots: int = 0
    seed: int = 0
    # shots per example: the other examples whose field of this name has the same value, in
    # order, then those of the groups that follow; every example is scored
    fewshot_group: str | None = None
    chat: bool = False
    max_tokens: int = 256
    stop: list[str] | None = None  # generation; default "\n\n", or nothing with chat
    check: str | None = None  # generation: a CHECKS name scoring the output instead of exact match
    # chat: the text the assistant's turn starts with, written for the model (not in the output)
    response_prefix: str = ""
    source: dict = field(default_factory=dict)  # where the data came from, its licence
    skipped: int = 0  # malformed lines skipped while reading


_HEADER_KEYS = {"name", "type", "template", "labels", "extract", "choice_prefix", "continuation",
                "fewshot_separator", "shots", "seed", "chat", "max_tokens", "stop", "source",
                "examples", "data", "fewshot", "description", "check", "fewshot_group",
                "response_prefix"}


def load_task(path: str | Path, *, strict: bool = False, warn: Callable[[str], None] | None = None
              ) -> Task:
    """Read a task file: YAML or JSON (a header with ``examples`` or a ``data`` JSONL path,
    and optionally ``fewshot``), or JSONL whose first line is ``{"task": {...header...}}``.

    Malformed JSONL lines are skipped and counted in ``Task.skipped`` (``warn`` is told), or
    refused with ``strict``. Every example is checked against the header.
    """
    path = Path(path)
    text = _read_text(path)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise PocketError(f"{path}: reading YAML task files needs PyYAML: "
                              "pip install pyyaml") from None
        try:
            header = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PocketError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
        except (ValueError, RecursionError) as e:
            raise PocketError(f"{path}: not valid YAML: {json_problem(e)}") from None
        return _task_from_header(header, path, strict=strict, warn=warn)
    if path.suffix == ".json":
        try:
            header = json.loads(text)
        except json.JSONDecodeError as e:
            raise PocketError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        except (ValueError, RecursionError) as e:  # a 5,000-digit integer, deep nesting
            raise PocketError(f"{path}: not valid JSON: {json_problem(e)}") from None
        return _task_from_header(header, path, strict=strict, warn=warn)
    records, skipped = read_jsonl(path, text, strict=strict)
    if not records or not (isinstance(records[0][1], dict) and set(records[0][1]) == {"task"}):
        raise PocketError(f"{path}: a JSONL task file starts with a header line "
                          '{"task": {"type": ..., "template": ...}}')
    header = dict(records[0][1]["task"]) if isinstance(records[0][1]["task"], dict) else None
    if header is None:
        raise PocketError(f"{path}:{records[0][0]}: \"task\" must be an object")
    if "examples" in header or "data" in header:
        raise PocketError(f"{path}:{records[0][0]}: a JSONL task holds its examples as lines, "
                          "not in the header")
    lines = [(f"{path}:{no}", r) for no, r in records[1:]]
    return _task_from_header(header, path, strict=strict, warn=warn, skipped=skipped,
                             lines=lines)


def _read_text(path: Path) -> str:
    from ..textfile import read_text_file

    return read_text_file(path, what="task file")


def read_jsonl(path: Path, text: str, *, strict: bool = False
               ) -> tuple[list[tuple[int, Any]], int]:
    """``[(line number, value)]`` of the non-blank lines, and how many malformed lines were
    skipped (``strict`` raises on the first one instead)."""
    from ..textfile import jsonl_lines

    out, skipped = [], 0
    for no, line in enumerate(jsonl_lines(text), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        except (ValueError, RecursionError) as e:
            if strict:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else json_problem(e)
                raise PocketError(f"{path}:{no}: malformed line ({msg})") from None
            skipped += 1
            continue
        out.append((no, value))
    return out, skipped




def _check_unicode(value: Any, where: str) -> None:
    """Refuse strings that hold lone surrogates (a JSON "\\ud800"): no tokenizer encodes them."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PocketError(f"{where}: a string holds a lone surrogate "
                                  f"U+{ord(v[exc.start]):04X}, which is not text; use UTF-8 "
                                  "text") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _task_from_header(header: Any, path: Path, *, strict: bool, warn, skipped: int = 0,
                      lines: list | None = None) -> Task:
    if not isinstance(header, dict):
        raise PocketError(f"{path}: a task file is a mapping with 'type', 'template' and "
                          "'examples' (or 'data')")
    unknown = sorted(set(header) - _HEADER_KEYS)
    if unknown:
        raise PocketError(f"{path}: unknown task key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(_HEADER_KEYS))}")
    examples, fewshot = list(lines or []), []
    for key, out in (("examples", examples), ("fewshot", fewshot)):
        value = header.get(key)
        if key == "examples" and value is None and "data" in header:
            value = header["data"]
        if value is None:
            continue
        if isinstance(value, str):  # a JSONL file next to the task file
            data_path = (path.parent / value) if not Path(value).is_absolute() else Path(value)
            records, n_bad = read_jsonl(data_path, _read_text(data_path), strict=strict)
            skipped += n_bad
            out.extend((f"{data_path}:{no}", r) for no, r in records)
        elif isinstance(value, list):
            for i, r in enumerate(value):
                if not isinstance(r, dict):
                    raise PocketError(f"{path}: {key}[{i}] is not an object")
                out.append((f"{path}: {key}[{i}]", r))
        else:
            raise PocketError(f"{path}: {key!r} must be a list of examples or a JSONL path")
    _check_unicode({k: v for k, v in header.items() if k not in ("examples", "fewshot")},
                   str(path))
    for where, r in (*examples, *fewshot):
        _check_unicode(r, where)
    task = Task(
        name=str(header.get("name") or path.stem),
        type=header.get("type"),
        template=header.get("template"),
        examples=[r for _, r in examples],
        fewshot=[r for _, r in fewshot],
        labels=header.get("labels") or [],
        extract=header.get("extract", "last_number"),
        choice_prefix=header.get("choice_prefix", " "),
        continuation=header.get("continuation", "choice"),
        fewshot_separator=header.get("fewshot_separator", "\n\n"),
        shots=header.get("shots", 0),
        seed=header.get("seed", 0),
        chat=header.get("chat", False),
        max_tokens=header.get("max_tokens", 256),
        stop=[header["stop"]] if isinstance(header.get("stop"), str) else header.get("stop"),
        source=(dict(header["source"]) if isinstance(header.get("source"), dict)
                else header.get("source") or {}),
        check=header.get("check"),
        fewshot_group=header.get("fewshot_group"),
        response_prefix=header.get("response_prefix", ""),
        skipped=skipped,
    )
    check_task(task, where=str(path), located=[*examples, *fewshot])
    if skipped and warn is not None:
        warn(f"{path}: skipped {skipped} malformed line(s); --strict refuses them")
    return task


def check_task(task: Task, *, where: str = "task", located: list | None = None) -> None:
    """Raise :class:`PocketError` naming the file/line of the first problem of ``task``."""
    if task.type not in TASK_TYPES:
        raise PocketError(f"{where}: type must be one of {', '.join(TASK_TYPES)}, "
                          f"got {task.type!r}")
    if not isinstance(task.template, str) or not task.template:
        raise PocketError(f"{where}: 'template' must be a non-empty string such as "
                          "\"Question: {question}\\nAnswer:\"")
    for key in ("shots", "seed", "max_tokens"):
        value = getattr(task, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PocketError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    if not isinstance(task.choice_prefix, str) or not isinstance(task.fewshot_separator, str):
        raise PocketError(f"{where}: 'choice_prefix' and 'fewshot_separator' must be strings")
    # "chat": "false" was read as true (a non-empty string), and a list as "source" was a
    # traceback
    if not isinstance(task.chat, bool):
        raise PocketError(f"{where}: 'chat' must be true or false, got {task.chat!r}")
    if not isinstance(task.source, dict):
        raise PocketError(f"{where}: 'source' must be a mapping (free-form provenance), got "
                          f"{task.source!r}")
    if task.fewshot_group is not None and (not isinstance(task.fewshot_group, str)
                                           or not task.fewshot_group):
        raise PocketError(f"{where}: 'fewshot_group' must be a field name, got "
                          f"{task.fewshot_group!r}")
    if not isinstance(task.response_prefix, str) or (task.response_prefix and not task.chat):
        raise PocketError(f"{where}: 'response_prefix' must be a string, and is for chat tasks")
    if task.stop is not None and not (isinstance(task.stop, list)
                                      and all(isinstance(s, str) and s for s in task.stop)):
        raise PocketError(f"{where}: 'stop' must be a list of non-empty strings")
    if task.type == "classification":
        if not isinstance(task.labels, list) or len(task.labels) < 2 or not all(
                isinstance(x, str) and x for x in task.labels):
            raise PocketError(f"{where}: a classification task needs 'labels': a list of at "
                              "least two non-empty strings")
        if len(set(task.labels)) != len(task.labels):
            raise PocketError(f"{where}: 'labels' has duplicates")
    if task.check is not None and (task.type != "generation" or task.check not in CHECKS):
        raise PocketError(f"{where}: 'check' is for generation tasks and must be one of "
                          f"{', '.join(CHECKS)}, got {task.check!r}")
    if task.type == "generation":
        make_extractor(task.extract)
        if task.max_tokens < 1:
            raise PocketError(f"{where}: 'max_tokens' must be at least 1")
    if task.type == "multiple_choice" and task.continuation not in ("choice", "letter"):
        raise PocketError(f"{where}: 'continuation' must be 'choice' or 'letter', "
                          f"got {task.continuation!r}")
    if not task.examples:
        raise PocketError(f"{where}: the task has no examples")
    located = located or [(f"{where}: example {i}", r) for i, r in enumerate(task.examples)]
    for loc, example in located:
        _check_example(task, example, str(loc))


def _check_example(task: Task, ex: dict, loc: str) -> None:
    fields = set(ex) | ({"options"} if task.type == "multiple_choice" else set())
    for name in template_fields(task.template):
        if name not in fields:
            has = ", ".join(sorted(map(str, ex)))  # YAML keys may be numbers
            raise PocketError(f"{loc}: the template refers to {{{name}}} but the example has "
                              f"no field {name!r} (it has {has or 'none'})")
    if task.type == "multiple_choice":
        choices = ex.get("choices")
        if not isinstance(choices, list) or len(choices) < 2 or not all(
                isinstance(c, str) and c for c in choices):
            raise PocketError(f"{loc}: 'choices' must be a list of at least two non-empty "
                              "strings")
        answer_index(ex, loc)
    elif task.type == "classification":
        if ex.get("label") not in task.labels:
            raise PocketError(f"{loc}: label {ex.get('label')!r} is not in the label set "
                              f"{task.labels}")
    else:
        if not isinstance(ex.get("answer"), str | int | float) or isinstance(ex.get("answer"),
                                                                             bool):
            raise PocketError(f"{loc}: a generation example needs an 'answer' string")
        _check_fields_of_check(task.check, ex, loc)
    if task.fewshot_group is not None:
        value = ex.get(task.fewshot_group)
        # group_shots keys a dict by it: a list or mapping was a TypeError mid-run
        if value is not None and not isinstance(value, str | int | float | bool):
            raise PocketError(f"{loc}: fewshot_group field {task.fewshot_group!r} must be a "
                              f"string or number, got {value!r}")


def _check_fields_of_check(check: str | None, ex: dict, loc: str) -> None:
    """Refuse an example that lacks what its task's ``check`` reads, before the model loads:
    found while scoring, a missing ``test`` was a KeyError traceback, and a malformed
    instruction an error naming no file or line, after the examples before it had run."""
    if check in ("humaneval", "humaneval-script"):
        needs = ("prompt", "test", "entry_point") if check == "humaneval" else ("test",
                                                                               "entry_point")
        for key in needs:
            if not isinstance(ex.get(key), str) or not ex[key]:
                raise PocketError(f"{loc}: a '{check}' example needs {', '.join(needs)} as "
                                  f"non-empty strings; {key!r} is {ex.get(key)!r}")
        if not ex["entry_point"].isidentifier():
            raise PocketError(f"{loc}: entry_point {ex['entry_point']!r} is not a Python name")
    elif check == "instructions":
        from .instructions import validate_instruction

        instructions = ex.get("instructions")
        if not isinstance(instructions, list) or not instructions:
            raise PocketError(f"{loc}: an 'instructions' example needs a non-empty "
                              "'instructions' list")
        for i, ins in enumerate(instructions):
            validate_instruction(ins, f"{loc}: instruction {i}")


def answer_index(ex: dict, loc: str = "example") -> int:
    """The index of the correct choice: ``answer`` as an index, the choice text, or a letter."""
    choices, answer = ex["choices"], ex.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if 0 <= answer < len(choices):
            return answer
    elif isinstance(answer, str):
        if answer in choices:
            return choices.index(answer)
        if len(answer) == 1 and answer.upper() in LETTERS[: len(choices)]:
            return LETTERS.index(answer.upper())
    raise PocketError(f"{loc}: answer {answer!r} is neither an index 0..{len(choices) - 1}, "
                      "a choice's text nor a choice letter")


# -- prompts ------------------------------------------------------------------------------------


def _fields(task: Task, ex: dict) -> dict:
    if task.type != "multiple_choice":
        return ex
    options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(ex["choices"]))
    return {"options": options, **ex}


def candidates(task: Task, ex: dict) -> list[str]:
    """The continuations that are scored for ``ex`` (choices, their letters, or labels)."""
    if task.type == "classification":
        return list(task.labels)
    if task.continuation == "letter":
        return list(LETTERS[: len(ex["choices"])])
    return list(ex["choices"])


def target(task: Task, ex: dict) -> str:
    """The correct continuation of ``ex`` (what a few-shot example shows as its answer)."""
    if task.type == "classification":
        return ex["label"]
    if task.type == "multiple_choice":
        return candidates(task, ex)[answer_index(ex)]
    return str(ex["answer"])


def split_shots(task: Task, shots: int | None = None, seed: int | None = None
                ) -> tuple[list[dict], list[dict]]:
    """``(few-shot examples, examples to score)``: ``shots`` drawn from the ``fewshot`` pool
    with ``seed`` (the same for every example), or else the first ``shots`` examples."""
    k = task.shots if shots is None else shots
    seed = task.seed if seed is None else seed
    if k < 0:
        raise PocketError(f"shots must be non-negative, got {k}")
    if task.fewshot_group is not None:
        return [], list(task.examples)  # drawn per example by group_shots
    if task.fewshot:
        if k > len(task.fewshot):
            raise PocketError(f"task {task.name}: {k} shots asked but the few-shot pool has "
                              f"{len(task.fewshot)} examples")
        return random.Random(seed).sample(task.fewshot, k), list(task.examples)
    if k >= len(task.examples):
        raise PocketError(f"task {task.name}: {k} shots leave none of its "
                          f"{len(task.examples)} examples to score")
    return list(task.examples[:k]), list(task.examples[k:])


def group_shots(task: Task, index: int, k: int) -> list[dict]:
    """``k`` shots for ``task.examples[index]`` by ``task.fewshot_group``: the other examples
    of its group in file order, then the groups that follow it (in order of first appearance,
    wrapping around), never the example itself."""
    field_name = task.fewshot_group
    groups: dict[Any, list[int]] = {}
    for i, ex in enumerate(task.examples):
        groups.setdefault(ex.get(field_name), []).append(i)
    keys = list(groups)
    start = keys.index(task.examples[index].get(field_name))
    order = [i for key in keys[start:] + keys[:start] for i in groups[key] if i != index]
    if k > len(order):
        raise PocketError(f"task {task.name}: {k} shots asked but only {len(order)} other "
                          "examples")
    return [task.examples[i] for i in order[:k]]


def build_prompt(task: Task, ex: dict, shots: list[dict]) -> str:
    """The text before the answer: the few-shot examples with their answers, then ``ex``."""
    where = f"task {task.name}: "
    parts = [render_template(task.template, _fields(task, s), where=where)
             + task.choice_prefix + target(task, s) for s in shots]
    parts.append(render_template(task.template, _fields(task, ex), where=where))
    return task.fewshot_separator.join(parts)


def encode_prompt(engine: Engine, task: Task, prompt: str) -> tuple[list[int], list[int], str]:
    """``(BOS ids, text ids, text)`` of the prompt: the chat template applied when
    ``task.chat``; the engine's BOS unless the rendered template already starts with it."""
    text = prompt
    if task.chat:
        text = engine.render_chat([{"role": "user", "content": prompt}]) + task.response_prefix
    ids = engine.tokenize(text, special=task.chat)
    bos = list(engine.bos_ids)
    if not bos or ids[: len(bos)] == bos:
        bos = []
    return bos, ids, text


def split_continuation(engine: Engine, context: str, continuation: str, *,
                       special: bool = False, context_ids: list[int] | None = None
                       ) -> list[int]:
    """Token ids of ``continuation`` after ``context`` (without BOS; ``context_ids`` are the
    context's own tokens, computed when not given).

    The whole text is tokenized and the tokens beyond the context's are taken when the context
    tokens are its prefix (so a merge across the boundary is scored as the model writes it);
    otherwise the continuation is tokenized on its own and appended.
    """
    if context_ids is None:
        context_ids = engine.tokenize(context, special=special)
    full = engine.tokenize(context + continuation, special=special)
    if full[: len(context_ids)] == context_ids and len(full) > len(context_ids):
        return full[len(context_ids):]
    own = engine.tokenize(continuation, special=special)
    if not own:
        raise PocketError(f"continuation {continuation!r} has no tokens")
    return own


def _fit(bos: list[int], ids: list[int], room: int, task: Task) -> list[int]:
    """``bos + ids`` cut from the left so that ``room`` tokens remain in the context."""
    keep = room - len(bos)
    if keep < 1:
        raise PocketError(f"task {task.name}: the answer alone does not fit the model's "
                          "context")
    if not bos and not ids:
        # an empty prompt and no BOS: nothing to condition on (Engine.continuation_logprobs,
        # the llama.cpp engine's, took an empty slice of logits: an IndexError traceback)
        raise PocketError(f"task {task.name}: an example's prompt is empty and the model adds "
                          "no BOS token: there is nothing to score the answer after")
    return bos + ids[-keep:]


# -- evaluation ---------------------------------------------------------------------------------


def score_example(engine: Engine, task: Task, ex: dict, shots: list[dict]) -> dict:
    """Score one example; returns ``{"prediction", "target", "correct", ...}``."""
    prompt = build_prompt(task, ex, shots)
    if task.type == "generation":
        bos, ids, _ = encode_prompt(engine, task, prompt)
        if engine.max_context - task.max_tokens - len(bos) < 1:  # not "the answer alone..."
            raise PocketError(f"task {task.name}: max_tokens {task.max_tokens} leaves no room "
                              f"for the prompt in the model's context of {engine.max_context} "
                              "tokens; lower max_tokens or load the model with a larger "
                              "context (--n-ctx)")
        ids = _fit(bos, ids, engine.max_context - task.max_tokens, task)
        stop = task.stop if task.stop is not None else ([] if task.chat else ["\n\n"])
        output = engine.generate(ids, task.max_tokens, stop)
        if task.check is not None:
            verdict = get_check(task.check)(output, ex)
            return {**verdict, "correct": bool(verdict["correct"]), "output": output}
        extract = make_extractor(task.extract)
        got, want = extract(output), extract(str(ex["answer"]))
        want = str(ex["answer"]) if want is None else want
        correct = got is not None and normalize(got) == normalize(want)
        return {"prediction": got, "target": want, "correct": correct, "output": output}
    lead = ""
    if not task.chat:  # the prompt's trailing spaces go to the continuation: " Paris", one token
        stripped = prompt.rstrip(" \t")
        lead = prompt[len(stripped):] + task.choice_prefix
        prompt = stripped
    bos, ids, text = encode_prompt(engine, task, prompt)
    cands = candidates(task, ex)
    conts = [split_continuation(engine, text, lead + c, special=task.chat, context_ids=ids)
             for c in cands]
    context = _fit(bos, ids, engine.max_context - max(len(c) for c in conts), task)
    logprobs = engine.continuation_logprobs(context, conts)
    if not np.isfinite(logprobs).all():  # argmax would take the first choice: a plausible score
        raise PocketError(f"{task.name}: the model's log-likelihoods of the choices of example "
                          f"{ex.get('id', '?') if isinstance(ex, dict) else '?'} are not finite "
                          f"({logprobs}): its logits are broken (NaN or inf)")
    best = int(np.argmax(logprobs))
    per_char = [lp / len(lead + c) for lp, c in zip(logprobs, cands, strict=True)]
    best_norm = int(np.argmax(per_char))
    gold = cands.index(target(task, ex))
    return {"prediction": cands[best], "target": cands[gold], "correct": best == gold,
            "correct_norm": best_norm == gold, "logprobs": logprobs}


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of an accuracy of ``correct`` out of ``n`` (``(0, 1)``
    when ``n`` is 0): honest near 0 and 1, where the normal approximation is not."""
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_task(model, task: Task, *, limit: int | None = None, shots: int | None = None,
                  seed: int | None = None, progress: bool = True,
                  on_example: Callable[[int, dict, dict], None] | None = None,
                  done: dict[int, dict] | None = None) -> dict:
    """Score ``task`` with ``model`` (a PocketModel or an :class:`Engine`).

    ``limit``: score the first ``limit`` examples (``0`` or None: all). Returns ``{"task",
    "type", "n", "accuracy", "ci95", "correct", "shots", "seconds", "examples_per_s",
    "tokens", "tokens_per_s", "generated_tokens"}``, plus ``acc_norm`` (the choice with the
    best log-likelihood per character) for multiple choice and the count of each predicted
    label for classification. ``on_example(index, example, result)`` sees every example scored
    now (its result holds the ``seconds`` and ``tokens`` it took); ``done`` maps the index of
    an example scored before (an interrupted run) to its result, which is counted instead of
    scoring it again, its recorded time and tokens included.
    """
    engine = as_engine(model)
    few, todo = split_shots(task, shots, seed)
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise PocketError(f"limit must be a non-negative integer (0: all), got {limit!r}")
        todo = todo[:limit] if limit else todo
    k = task.shots if shots is None else shots
    offset = len(task.examples) - len(todo) if task.fewshot_group is None else 0
    done = done or {}
    correct = correct_norm = loose = 0
    by_check: dict[str, list[int]] = {}  # instruction tasks: check name -> [passed, given]
    predicted: dict[str, int] = {}
    seconds = prompt_tokens = generated = 0.0
    bar = progress_bar(len(todo), task.name, "ex", enabled=progress and len(todo) > 1)
    for i, ex in enumerate(todo):
        if i in done:
            result = done[i]
        else:
            few_i = few if task.fewshot_group is None else group_shots(task, i + offset, k)
            before = (time.perf_counter(), engine.prompt_tokens, engine.generated_tokens)
            result = score_example(engine, task, ex, few_i)
            result["seconds"] = time.perf_counter() - before[0]
            result["tokens"] = engine.prompt_tokens - before[1] + engine.generated_tokens \
                - before[2]
            result["generated_tokens"] = engine.generated_tokens - before[2]
            if on_example is not None:
                on_example(i, ex, result)
        seconds += result.get("seconds", 0.0)
        prompt_tokens += result.get("tokens", 0) - result.get("generated_tokens", 0)
        generated += result.get("generated_tokens", 0)
        correct += bool(result["correct"])
        correct_norm += bool(result.get("correct_norm"))
        loose += bool(result.get("correct_loose"))
        if task.check == "instructions" and isinstance(result.get("passed"), list):
            for ins, ok in zip(ex.get("instructions", ()), result["passed"]):
                tally = by_check.setdefault(str(ins.get("check")), [0, 0])
                tally[0] += bool(ok)
                tally[1] += 1
        if task.type == "classification":
            predicted[result["prediction"]] = predicted.get(result["prediction"], 0) + 1
        bar.update(1)
        bar.set_postfix(acc=f"{correct / (i + 1):.3f}", refresh=False)
    bar.close()
    n = len(todo)
    fresh = n - sum(1 for i in range(n) if i in done)
    prompt_tokens, generated = int(prompt_tokens), int(generated)
    low, high = wilson_interval(correct, n)
    out = {"task": task.name, "type": task.type, "n": n, "accuracy": correct / n if n else 0.0,
           "ci95": [low, high], "correct": correct,
           "shots": k if task.fewshot_group is not None else len(few),
           "seconds": seconds, "examples_per_s": n / seconds if seconds > 0 else None,
           "tokens": prompt_tokens + generated, "generated_tokens": generated,
           "tokens_per_s": (prompt_tokens + generated) / seconds if seconds > 0 else None,
           "resumed": n - fresh}
    if task.type == "generation":
        out["generated_tokens_per_s"] = generated / seconds if seconds > 0 else None
    if task.check == "instructions" and n:
        out["accuracy_loose"] = loose / n  # every instruction passes after loose edits
        passed, given = (sum(t[i] for t in by_check.values()) for i in (0, 1))
        out["instruction_accuracy"] = passed / given if given else 0.0
        # where a model fails: each kind of instruction, passed / given (strict)
        out["instructions_by_check"] = {name: {"passed": ok, "given": given}
                                        for name, (ok, given) in sorted(by_check.items())}
    if task.type == "multiple_choice":
        out["acc_norm"] = correct_norm / n if n else 0.0
    if task.type == "classification":
        out["predicted"] = {label: predicted.get(label, 0) for label in task.labels}
    return out
