"""The OpenAI request and response shapes the server speaks, and their checks.

Request bodies are checked field by field before anything runs: unknown fields, wrong types,
out-of-range values and unsupported options each give a 400 naming the field (the error
object of OpenAI's API: ``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

MAX_INT_DIGITS = 100  # no field takes more than 19; longer integers are refused while parsing
INT64_MAX = 2**63 - 1


class APIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or {401: "authentication_error", 403: "permission_error",
                             404: "not_found_error",
                             429: "rate_limit_error", 503: "server_error",
                             500: "server_error"}.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def shown(text: str, limit: int = 80) -> str:
    """``text`` as an error message quotes it: cut to ``limit`` characters, lone surrogates
    written as ``\\udXXX`` (so that the message is always encodable)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


# -- the body's JSON ------------------------------------------------------------------------
def _bad_json(message: str) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {message}", code="invalid_json")


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _bad_json(f"an integer of {len(digits.lstrip('-'))} digits; integers here have "
                        f"at most {MAX_INT_DIGITS}")
    return int(digits)


def _json_constant(name: str):
    raise _bad_json(f"{name} is not a JSON value; send a finite number")


def decode_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400 saying what is wrong with it: not UTF-8, not JSON,
    NaN/Infinity, an integer too long to read, nesting too deep for the parser."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 text (byte {e.start} is "
                       f"0x{raw[e.start]:02x})", code="invalid_json") from None
    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except json.JSONDecodeError as e:
        raise _bad_json(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply for this "
                       "server", code="invalid_json") from None
    except ValueError as e:  # what the parser itself refuses beyond the checks above
        raise _bad_json(str(e)) from None


def _first_lone_surrogate(body: Any) -> tuple[str, str] | None:
    """(where, the string) of the first string in ``body`` (keys too) that is not valid
    Unicode: JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or
    UTF-8 encoder takes. Iterative, so a deep body cannot exhaust the stack."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            items: list[tuple[str, Any]] = []
            strings = [v]
        elif isinstance(v, dict):
            strings = list(v)
            items = [(f"{where}.{k}" if where else k, x) for k, x in v.items()]
        elif isinstance(v, list):
            strings = []
            items = [(f"{where}[{i}]", x) for i, x in enumerate(v)]
        else:
            continue
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body", s
        todo.extend(reversed(items))
    return None


def _check_unicode(body: Any) -> None:
    found = _first_lone_surrogate(body)
    if found is None:
        return
    where, s = found
    at = next(i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF)
    raise _bad(f"'{shown(where)}' holds a lone surrogate ({ord(s[at]):#06x} at character "
               f"{at}) and is not valid Unicode; send UTF-8 text (surrogate escapes only in "
               "pairs)", shown(where), "invalid_text")


# -- field checkers: (value, name) -> the value to use ------------------------------------------
def _type_name(v: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    def check(v, name):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad(f"'{name}' must be a number, got {_type_name(v)}", name, "invalid_type")
        try:
            v = float(v)
        except OverflowError:  # an integer beyond float's range
            v = math.copysign(math.inf, v)
        if not math.isfinite(v):
            raise _bad(f"'{name}' must be a finite number", name)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise _bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v:g}", name)
        if hi is not None and v > hi:
            raise _bad(f"'{name}' must be <= {hi}, got {v:g}", name)
        return v
    return check


def _integer(lo: int | None = None, hi: int = INT64_MAX):
    def check(v, name):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(f"'{name}' must be an integer, got {_type_name(v)}", name, "invalid_type")
        if lo is not None and v < lo:
            raise _bad(f"'{name}' must be >= {lo}, got {v}", name)
        if v > hi:
            raise _bad(f"'{name}' must be <= {hi}, got {v}", name)
        return v
    return check


_any_int64 = _integer(-INT64_MAX - 1)


def _seed(v, name):
    """OpenAI takes any int64 seed. -1 is "no seed" (a random draw each time), as llama.cpp's
    server reads it and as its clients send it; another negative seed is a seed like any
    other (taken modulo 2**64)."""
    v = _any_int64(v, name)
    if v == -1:
        return None
    return v % 2**64


def _boolean(v, name):
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {_type_name(v)}", name, "invalid_type")
    return v


def _string(v, name):
    if not isinstance(v, str):
        raise _bad(f"'{name}' must be a string, got {_type_name(v)}", name, "invalid_type")
    return v


# OpenAI takes 4; lm-evaluation-harness's code tasks send 4 of their own and the EOS text
MAX_STOP_STRINGS = 16


def _stop(v, name):
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > MAX_STOP_STRINGS:
            raise _bad(f"'{name}' takes at most {MAX_STOP_STRINGS} strings, got {len(v)}",
                       name)
        return [s for s in v if s]
    raise _bad(f"'{name}' must be a string or an array of strings", name, "invalid_type")


def _as_written(v: Any) -> str:
    """``v`` as the client wrote it (true, not True), cut short."""
    return shown(json.dumps(v, ensure_ascii=False))


def _only(value, what: str):
    def check(v, name):
        if type(v) is not type(value) or v != value:  # true and 1.0 equal 1, but are not
            raise _bad(f"'{name}' = {_as_written(v)} is not supported by this server ({what})",
                       name, "unsupported_value")
        return v
    return check


def _stream_options(v, name):
    if not isinstance(v, dict):
        raise _bad(f"'{name}' must be an object, got {_type_name(v)}", name, "invalid_type")
    unknown = set(v) - {"include_usage"}
    if unknown:
        raise _bad(f"unrecognized field '{name}.{shown(sorted(unknown)[0])}'", name,
                   "unknown_parameter")
    return {"include_usage": _boolean(v.get("include_usage", False), f"{name}.include_usage")}


def _messages(v, name):
    if not isinstance(v, list) or not v:
        raise _bad(f"'{name}' must be a non-empty array of messages", name,
                   "invalid_type" if not isinstance(v, list) else "invalid_value")
    out = []
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{where}' must be an object, got {_type_name(m)}", where,
                       "invalid_type")
        unknown = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id",
                            "refusal"}
        if unknown:
            raise _bad(f"unrecognized field '{where}.{shown(sorted(unknown)[0])}'", where,
                       "unknown_parameter")
        for key in ("name", "refusal"):  # typed as in OpenAI's API (a tool's name is rendered)
            if m.get(key) is not None and not isinstance(m[key], str):
                raise _bad(f"'{where}.{key}' must be a string, got {_type_name(m[key])}",
                           f"{where}.{key}", "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"'{where}.role' must be one of system, developer, user, assistant, "
                       f"tool; got {_as_written(role)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            from ..chat import non_text_part

            j = non_text_part(content)
            if j is not None:
                raise _bad(f"'{where}.content[{j}]' must be a text part "
                           '({"type": "text", "text": ...}); this model reads text only',
                           f"{where}.content")
            content = "".join(part["text"] for part in content)
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise _bad(f"'{where}.tool_calls' belongs to assistant messages only",
                           f"{where}.tool_calls")
            calls = _tool_calls(calls, f"{where}.tool_calls")
            if content is None:
                content = ""
        if not isinstance(content, str):
            raise _bad(f"'{where}.content' must be a string, got {_type_name(content)}",
                       f"{where}.content", "invalid_type")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"'{where}.tool_call_id' must be a string (the id of the call this "
                           "answers)", f"{where}.tool_call_id", "invalid_type")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_calls(v, name):
    """An assistant message's earlier calls: ``[{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}]``."""
    if not isinstance(v, list):
        raise _bad(f"'{name}' must be an array, got {_type_name(v)}", name, "invalid_type")
    out = []
    for i, c in enumerate(v):
        where = f"{name}[{i}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), (str, dict))):
            raise _bad(f"'{where}' must be an object {CALL_SHAPE}", where, "invalid_type")
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{i}",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": ...}}'
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tools(v, name):
    """``[{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}]`` as :class:`pocketlm.tools.Tool` objects (the schemas are compiled later)."""
    from ..tools import Tool

    if not isinstance(v, list) or not v:
        raise _bad(f"'{name}' must be a non-empty array of tools", name, "invalid_type")
    out, seen = [], set()
    for i, t in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}"
                       " (functions are the only tools)", where, "invalid_type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"'{where}.function' must be an object", f"{where}.function",
                       "invalid_type")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"unrecognized field '{where}.function.{shown(sorted(unknown)[0])}'",
                       f"{where}.function", "unknown_parameter")
        fname = fn.get("name")
        if not isinstance(fname, str) or not _FUNCTION_NAME.fullmatch(fname):
            raise _bad(f"'{where}.function.name' must be 1-64 letters, digits, _ or -; got "
                       f"{_as_written(fname)}", f"{where}.function.name")
        if fname in seen:
            raise _bad(f"'{where}.function.name': two tools are named {fname}",
                       f"{where}.function.name")
        seen.add(fname)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise _bad(f"'{where}.function.description' must be a string",
                       f"{where}.function.description", "invalid_type")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"'{where}.function.parameters' must be a JSON Schema object, got "
                       f"{_type_name(params)}", f"{where}.function.parameters", "invalid_type")
        if params.get("type", "object") != "object":
            # a call's arguments are a JSON object (clients read them as one)
            raise _bad(f"'{where}.function.parameters' must describe an object (a call's "
                       f"arguments are a JSON object); its type is "
                       f"{_as_written(params['type'])}", f"{where}.function.parameters",
                       "invalid_value")
        if "strict" in fn:
            _boolean(fn["strict"], f"{where}.function.strict")
        out.append(Tool(fname, desc, params))
    return out


def _tool_choice(v, name):
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(
            v.get("function"), dict) and isinstance(v["function"].get("name"), str):
        return {"type": "function", "function": {"name": v["function"]["name"]}}
    raise _bad(f"'{name}' must be 'auto', 'none', 'required' or {{\"type\": \"function\", "
               f"\"function\": {{\"name\": ...}}}}; got {_as_written(v)}", name)


def _response_format(v, name):
    """``{"type": "text"}`` (None), ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}`` as the JSON schema to hold
    the output to."""
    if not isinstance(v, dict):
        raise _bad(f"'{name}' must be an object, got {_type_name(v)}", name, "invalid_type")
    unknown = set(v) - {"type", "json_schema"}
    if unknown:
        raise _bad(f"unrecognized field '{name}.{shown(sorted(unknown)[0])}'", name,
                   "unknown_parameter")
    kind = v.get("type")
    if kind in ("text", "json_object") and v.get("json_schema") is not None:
        # a schema that would be ignored: the client believes its output is held to it
        raise _bad(f"'{name}.json_schema' goes with type 'json_schema', not "
                   f"{_as_written(kind)}", f"{name}.json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad(f"'{name}.type' must be 'text', 'json_object' or 'json_schema'; got "
                   f"{_as_written(kind)}", f"{name}.type")
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(f"'{name}.json_schema' must be an object with a 'schema'",
                   f"{name}.json_schema", "invalid_type")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise _bad(f"unrecognized field '{name}.json_schema.{shown(sorted(unknown)[0])}'",
                   f"{name}.json_schema", "unknown_parameter")
    for key, check in (("name", _string), ("description", _string), ("strict", _boolean)):
        if spec.get(key) is not None:
            check(spec[key], f"{name}.json_schema.{key}")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"'{name}.json_schema.schema' must be a JSON Schema object, got "
                   f"{_type_name(schema)}", f"{name}.json_schema.schema", "invalid_type")
    return schema


def _prompt(v, name):
    """A prompt, or several (one choice each): a string, an array of token ids, or an array of
    either; returned as a list of prompts (each a string or a list of ids)."""
    def one(p, where):
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in p):
            return p
        raise _bad(f"'{where}' must be a string or a non-empty array of token ids", name,
                   "invalid_type")

    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        return [v]
    if isinstance(v, list) and v:
        if len(v) > 16:
            raise _bad(f"'{name}' takes at most 16 prompts, got {len(v)}", name)
        return [one(p, f"{name}[{i}]") for i, p in enumerate(v)]
    raise _bad(f"'{name}' must be a string, an array of token ids, or an array of those",
               name, "invalid_type")


def _logit_bias(v, name):
    """``{"token id": bias}`` with biases in [-100, 100] (ids checked against the vocabulary
    when the request is built)."""
    if not isinstance(v, dict):
        raise _bad(f"'{name}' must be an object mapping token ids to numbers", name,
                   "invalid_type")
    if len(v) > 1024:
        raise _bad(f"'{name}' takes at most 1024 tokens, got {len(v)}", name)
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9):
            raise _bad(f"'{name}' keys must be token ids, got {_as_written(k)}", name)
        out[int(k)] = _number(-100, 100)(b, f"{name}.{k}")
    return out


_SAMPLING = {
    "model": _string,
    "max_tokens": _integer(0),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),  # 0: the most likely token alone
    "n": _integer(1, 16),
    "stream": _boolean,
    "stream_options": _stream_options,
    "stop": _stop,
    "seed": _seed,
    "user": _string,
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "logit_bias": _logit_bias,
    # extensions, as in llama.cpp's and vLLM's servers
    "top_k": _integer(0),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, lo_open=True),
    "ignore_eos": _boolean,  # generate max_tokens whatever the model says (benchmarks)
    "speculative": lambda v, name: _speculative(v, name),  # pocketlm: prompt-lookup drafting
}


def _speculative(v, name):
    """``"lookup"``, ``false`` (off; null: the server's default) or ``{"method": "lookup",
    "max_draft": 1-16, "max_ngram": 1-8, "min_ngram": 1-8}``; the server drafts by prompt
    lookup only (a draft model would run beside the batch)."""
    if v is False:
        return False
    if v == "lookup":
        return {"method": "lookup"}
    if isinstance(v, str):
        raise _bad(f"'{name}' = {_as_written(v)} is not supported by this server: it drafts by "
                   "prompt lookup only ('lookup'); draft models run with the Python API and "
                   "the CLI", name, "unsupported_value")
    if not isinstance(v, dict):
        raise _bad(f"'{name}' must be 'lookup', false or an object, got {_type_name(v)}", name,
                   "invalid_type")
    if "draft" in v:  # the Python API's form for a draft model
        raise _bad(f"'{name}.draft' is not supported by this server: it drafts by prompt "
                   "lookup only ('lookup'); draft models run with the Python API and the CLI",
                   name, "unsupported_value")
    unknown = set(v) - {"method", "max_draft", "max_ngram", "min_ngram"}
    if unknown:
        raise _bad(f"'{name}' has an unknown field {shown(sorted(unknown)[0])} (known: method, "
                   "max_draft, max_ngram, min_ngram)", name, "unknown_parameter")
    if v.get("method", "lookup") != "lookup":
        raise _bad(f"'{name}.method' must be 'lookup', got {_as_written(v.get('method'))}",
                   name, "unsupported_value")
    out = {"method": "lookup"}
    for key, hi in (("max_draft", 16), ("max_ngram", 8), ("min_ngram", 8)):
        if key in v:
            out[key] = _integer(1, hi)(v[key], f"{name}.{key}")
    from ..speculative import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM

    if out.get("min_ngram", LOOKUP_MIN_NGRAM) > out.get("max_ngram", LOOKUP_MAX_NGRAM):
        raise _bad(f"'{name}.min_ngram' must be <= max_ngram", name)
    return out

CHAT_FIELDS = {**_SAMPLING, "messages": _messages, "max_completion_tokens": _integer(0),
               "logprobs": _boolean, "top_logprobs": _integer(0, 20),
               "response_format": _response_format, "tools": _tools,
               "tool_choice": _tool_choice, "parallel_tool_calls": _boolean}
COMPLETION_FIELDS = {**_SAMPLING, "prompt": _prompt, "echo": _boolean,
                     "response_format": _response_format,
                     "logprobs": _integer(0, 20),
                     "best_of": _only(1, "one candidate"),
                     "suffix": _only(None, "no insertion")}


@dataclass
class GenerationRequest:
    """A checked request: what the scheduler needs, whichever endpoint it came from."""

    model: str
    messages: list[dict] | None
    prompt: str | list[int] | None  # the first prompt (see prompts)
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    # speculative decoding: a prompt-lookup options dict, False (off), None (server default)
    speculative: dict | bool | None = None
    # the length when neither the request nor the model names one (None: the rest of the
    # context); max_tokens None leaves it to the model's generation defaults first
    builtin_max_tokens: int | None = None
    # structured output: the JSON schema of response_format; the tools offered and the choice
    json_schema: dict | bool | None = None
    tools: list | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True  # False: at most one call in an answer
    n: int = 1  # choices per prompt
    prompts: list | None = None  # completions: every prompt (a string or token ids)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # the top-k count of log-probabilities to return; None: off
    echo: bool = False  # completions: the prompt comes back before the answer


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_type_name(body)}", None,
                   "invalid_type")
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    _check_unicode(body)
    unknown = [k for k in body if k not in fields]
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {shown(unknown[0])}",
                   shown(unknown[0]), "unknown_parameter")
    required = "messages" if chat else "prompt"
    for name in ("model", required):
        if name not in body:
            raise _bad(f"missing required field '{name}'", name, "missing_required_parameter")
        if body[name] is None:
            raise _bad(f"'{name}' is required and cannot be null", name, "invalid_type")
    v = {k: (fields[k](x, k) if x is not None else None) for k, x in body.items()}
    max_tokens = v.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = v.get("max_tokens")
    # OpenAI's default for /v1/completions (an explicit null: the rest of the context)
    builtin = 16 if not chat and "max_tokens" not in body else None
    tools = v.get("tools")
    choice = v.get("tool_choice")
    if choice is not None and not tools:
        raise _bad("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in {t.name for t in tools}:
        raise _bad(f"'tool_choice' names the function {shown(choice['function']['name'])}, "
                   "which is not among 'tools'", "tool_choice")
    if tools and choice != "none" and v.get("response_format") is not None:
        raise _bad("'response_format' with 'tools' is not supported: a call is held to its "
                   "function's schema, a plain answer is free (use tool_choice 'none' for a "
                   "formatted answer)", "response_format", "unsupported_value")
    if v.get("stream_options") is not None and not v.get("stream"):
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if chat:
        if v.get("top_logprobs") is not None and not v.get("logprobs"):
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (v.get("top_logprobs") or 0) if v.get("logprobs") else None
    else:
        logprobs = v.get("logprobs")
    return GenerationRequest(
        model=v["model"], messages=v.get("messages") if chat else None,
        prompt=None if chat else v["prompt"][0], prompts=None if chat else v["prompt"],
        n=v.get("n") or 1, presence_penalty=v.get("presence_penalty"),
        frequency_penalty=v.get("frequency_penalty"), logit_bias=v.get("logit_bias"),
        logprobs=logprobs, echo=bool(v.get("echo")), max_tokens=max_tokens,
        temperature=v.get("temperature"), top_p=v.get("top_p"), top_k=v.get("top_k"),
        min_p=v.get("min_p"), repetition_penalty=v.get("repetition_penalty"),
        seed=v.get("seed"), stop=v.get("stop") or [], stream=bool(v.get("stream")),
        include_usage=bool((v.get("stream_options") or {}).get("include_usage")),
        ignore_eos=bool(v.get("ignore_eos")), speculative=v.get("speculative"),
        builtin_max_tokens=builtin, json_schema=v.get("response_format"), tools=tools,
        tool_choice=choice or "auto",
        parallel_tool_calls=v.get("parallel_tool_calls") is not False)


# -- responses ------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_body(index: int, text: str, finish: str, *, chat: bool,
                tool_calls: list[dict] | None = None, logprobs: dict | None = None) -> dict:
    """One choice of a whole answer; with ``tool_calls`` the message is those calls."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    message = ({"role": "assistant", "content": None, "tool_calls": tool_calls} if tool_calls
               else {"role": "assistant", "content": text})
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def completion_body(rid: str, model: str, choices: list[dict], use: dict, *,
                    chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def chunk_body(rid: str, model: str, *, chat: bool, text: str | None = None,
               role: bool = False, finish: str | None = None, use: dict | None = None,
               tool_calls: list[dict] | None = None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    """One streamed chunk: a role announcement, a piece of text, tool calls (each whole, with
    its ``index``), the finish reason, or (with ``use``) the usage chunk whose choices are
    empty."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else (
            {"content": text} if text is not None else {})
        if tool_calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
        choices = [{"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs,
                    "finish_reason": finish}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
