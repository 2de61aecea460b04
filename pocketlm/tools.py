"""Tool calling: functions offered to the model, its calls constrained to their schemas.

Two formats, chosen by the model's chat template:

- **native**, for templates that render ``tools`` themselves (Qwen2.5's): the template lists
  the functions, and the model answers ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`` (one or more). Tool results go back as ``tool`` messages, which the template
  renders in its own way.
- **generic**, for every other template: a system message lists the functions (name,
  description, JSON Schema of the arguments) and asks for a call as one JSON object
  ``{"name": ..., "arguments": {...}}``; earlier calls are shown to the model in that form and
  tool results as user turns ("Result of NAME: ...").

``tool_choice`` decides the constraint (:func:`call_constraint`): ``"required"`` or a named
function holds the whole answer to a call of the allowed functions, their arguments to each
function's parameter schema; ``"auto"`` lets the model answer freely unless its answer begins
with a call (``<tool_call>``, or ``{`` in the generic format), which is then held to the
schemas (:class:`~pocketlm.structured.Triggered`); ``"none"`` offers no functions at all.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import GrammarError
from .structured import JSON_LAYOUT, Grammar, Triggered, compile_grammar, parse_grammar

NATIVE_TRIGGER = "<tool_call>"
GENERIC_TRIGGER = "{"
_SPACE = re.compile(r"\s*")
_NATIVE_END = "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the arguments' JSON Schema

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def check_tools(tools: list[Tool], param: str = "tools") -> None:
    """Each tool's parameter schema compiles (a :class:`GrammarError` naming the field)."""
    for i, t in enumerate(tools):
        try:
            parse_grammar(json_schema=t.parameters)
        except GrammarError as e:
            raise GrammarError(f"{param}[{i}].function.parameters ({t.name}): {e}",
                               param=f"{param}[{i}].function.parameters") from None


def is_native(chat_template: str | None) -> bool:
    """True when the template renders ``tools`` and ``<tool_call>`` itself."""
    return bool(chat_template) and "tools" in chat_template and NATIVE_TRIGGER in chat_template


def _arguments(value: Any) -> Any:
    """A call's arguments as an object (OpenAI sends them as JSON text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
            return value
    return value


def render_messages(messages: list[dict], tools: list[Tool], *, native: bool
                    ) -> tuple[list[dict], dict]:
    """``(messages, template arguments)`` that show ``tools`` (may be empty) and the
    conversation's earlier calls and results to a template of the given kind."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        return out, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    out = []
    called: dict[Any, str] = {}  # call id -> the function it called
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            called.update((c["id"], c["function"]["name"]) for c in m["tool_calls"]
                          if isinstance(c.get("id"), str))
            calls = [json.dumps({"name": c["function"]["name"],
                                 "arguments": _arguments(c["function"]["arguments"])},
                                ensure_ascii=False) for c in m["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            # an OpenAI tool message names its call, not the function: the model was shown
            # the call without its id
            name = (m.get("name") or called.get(m.get("tool_call_id"))
                    or m.get("tool_call_id") or "the function")
            out.append({"role": "user", "content": f"Result of {name}:\n{content}"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                        "parameters": t.parameters}, ensure_ascii=False)
                            for t in tools)
        text = ("You can call these functions (each with a JSON Schema of its arguments):\n"
                f"{listing}\n\nTo call one, reply with only a JSON object: "
                '{"name": <function name>, "arguments": <arguments object>}. '
                "Otherwise answer normally.")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that does not say
    otherwise: a call's arguments are the properties its function declares (as in OpenAI's
    strict function calling), not whatever else a small model invents."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties"):
            out[k] = {name: closed(s) for name, s in v.items()} if isinstance(v, dict) else v
        elif k in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties"):
            out[k] = closed(v)
        else:
            out[k] = v
    if "additionalProperties" not in out and (
            out.get("type") == "object" or "properties" in out):
        out["additionalProperties"] = False
    return out


def _rerooted(params: Any, prefix: str, defs: dict) -> Any:
    """``params`` (a function's parameter schema) for a place inside a larger schema: its
    ``$defs`` / ``definitions`` move into ``defs`` under names starting with ``prefix`` and
    every local ``$ref`` is rewritten to match; a reference into the parameters themselves
    ("#", "#/properties/...") points at a copy of them in ``defs``. Pydantic and most
    libraries write function parameters with ``$defs``, which would otherwise resolve against
    the call's wrapper schema."""
    if not isinstance(params, dict):
        return params
    names = {"$defs": prefix, "definitions": prefix + "definitions_"}
    root_used = False

    def ref(pointer: str) -> str:
        nonlocal root_used
        parts = pointer[1:].split("/", 2)  # "", section, name/rest
        if len(parts) >= 3 and parts[0] == "" and parts[1] in names:
            return f"#/$defs/{names[parts[1]]}{parts[2]}"
        root_used = True
        return f"#/$defs/{prefix}root{pointer[1:]}".rstrip("/")

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: (ref(v) if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else walk(v)) for k, v in node.items()}

    body = {k: v for k, v in params.items() if k not in names}
    for section, name_prefix in names.items():
        if isinstance(params.get(section), dict):
            for name, schema in params[section].items():
                defs[name_prefix + name] = walk(schema)
    body = walk(body)
    if root_used:
        defs[prefix + "root"] = body
    return body


def call_grammar(tools: list[Tool], *, native: bool, parallel: bool = True) -> Grammar:
    """The grammar of an answer that is a call (native and ``parallel``: one or more) of one
    of ``tools``; the arguments are held to each function's parameters, :func:`closed` (their
    ``$ref``s resolved as in the parameters alone)."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {
                 "name": {"const": t.name},
                 "arguments": _rerooted(closed(t.parameters or {"type": "object"}),
                                        f"tool{i}_", defs)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, t in enumerate(tools)]
    top = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        top = {**top, "$defs": defs}
    # the layout of response_format's JSON: one space after ", " and ": ", no other
    # whitespace, so a small model cannot spend its tokens on blanks inside a call
    top = {**top, "x-guidance": JSON_LAYOUT}
    schema = json.dumps(top, ensure_ascii=False)
    if native:
        more = ' ("\\n" call)*' if parallel else ""
        lark = (f'start: WS call{more}\nWS: /[ \\t\\n]*/\n'
                f'call: "{NATIVE_TRIGGER}\\n" args "\\n</tool_call>"\nargs: %json {schema}\n')
    else:
        lark = f'start: WS args\nWS: /[ \\t\\n]*/\nargs: %json {schema}\n'
    return parse_grammar(grammar=lark)


def call_constraint(tools: list[Tool], choice: str | dict, *, native: bool, tokenizer,
                    n_vocab: int, parallel: bool = True):
    """The constraint of a request with ``tools`` and ``tool_choice`` ``choice`` ("auto",
    "required" or ``{"type": "function", "function": {"name": ...}}``), or None for
    "none". A named function is called once; otherwise ``parallel`` (OpenAI's
    ``parallel_tool_calls``) allows several calls in one answer (the native format's)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t.name == name]
        parallel = False
    grammar = call_grammar(tools, native=native, parallel=parallel)
    constraint = compile_grammar(grammar, tokenizer, n_vocab)
    if choice == "auto":
        # compiled now, with the request (the server does this off its event loop), not when
        # the answer turns out to be a call: by then the request decodes beside others
        return Triggered(lambda: constraint, tokenizer,
                         NATIVE_TRIGGER if native else GENERIC_TRIGGER)
    return constraint


def _native_bodies(text: str) -> list[Any] | None:
    """The JSON values of ``<tool_call> VALUE </tool_call>`` blocks that make up ``text``
    (whitespace around them aside), or None. Each value is read as JSON, not up to the next
    ``</tool_call>``: a string argument may hold that text (code, XML), and a forced call
    holding it came back as plain text."""
    decoder, found, pos = json.JSONDecoder(), [], _SPACE.match(text).end()
    while pos < len(text):
        if not text.startswith(NATIVE_TRIGGER, pos):
            return None
        pos = _SPACE.match(text, pos + len(NATIVE_TRIGGER)).end()
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # nested past the parser's limit: not a call
            return None
        pos = _SPACE.match(text, pos).end()
        if not text.startswith(_NATIVE_END, pos):
            return None
        pos = _SPACE.match(text, pos + len(_NATIVE_END)).end()
        found.append(value)
    return found or None


def parse_calls(text: str, *, native: bool) -> list[dict] | None:
    """The OpenAI ``tool_calls`` an answer makes, or None when it is not (wholly) calls."""
    found: list[Any] = []
    if native:
        if not text.lstrip().startswith(NATIVE_TRIGGER):
            return None
        bodies = _native_bodies(text)
        if bodies is None:
            return None
        found += bodies
    else:
        if not text.lstrip().startswith(GENERIC_TRIGGER):
            return None
        try:
            found.append(json.loads(text))
        except (ValueError, RecursionError):
            return None
    calls = []
    for c in found:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c):
            return None
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": c["name"],
                                   "arguments": json.dumps(c["arguments"],
                                                           ensure_ascii=False)}})
    return calls
