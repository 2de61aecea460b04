"""Structured output: generation held to a JSON Schema, a regular expression or a grammar.

Random-weight models of every family are the hardest case (left free they never write JSON):
every constrained output must still parse and validate (jsonschema, an implementation we did
not write), greedy and sampled. Also: the greedy shortcut equals the full mask, speculative
decoding and batching are unchanged, bad grammars are refused with the field named, the CLI,
and the tool-calling formats."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import llguidance
import numpy as np
import pytest
import tiny_gguf

import pocketlm
from pocketlm.errors import GrammarError
from pocketlm.sampling import Sampler, SamplingParams
from pocketlm.structured import JSON_LAYOUT, Constraint, Grammar, compile_grammar, parse_grammar
from pocketlm.tools import Tool, call_constraint, call_grammar, closed, parse_calls, render_messages

FAMILIES = ["llama", "qwen2", "gemma3"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                 "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
        "note": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -1, "maximum": 1}]},
    },
    "required": ["name", "age", "role", "tags", "home"],
    "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "zip": {"const": "00000"}},
        "required": ["city", "zip"], "additionalProperties": False}},
}


def _nested(schema: dict, levels: int) -> dict:
    for _ in range(levels):
        schema = {"anyOf": [schema]}
    return schema


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"structured-{request.param}")
    path = root / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, request.param, seed=11, weight_type="Q4_0",
                              max_context=1024)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_HOME", str(root / "home"))
        yield pocketlm.load(path)


@pytest.mark.parametrize("kwargs, param, match", [
    (dict(json_schema={"type": "strin"}), "json_schema", "Invalid type"),
    (dict(json_schema={"type": "integer", "minimum": 3, "maximum": 1}), "json_schema",
     "Unsatisfiable"),
    (dict(json_schema={"not": {"type": "string"}}), "json_schema", "Unimplemented keys"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "json_schema", "does not exist"),
    (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema", "must be an object"),
    (dict(regex="(ab"), "regex", "unclosed group"),
    (dict(regex=""), "regex", "non-empty"),
    (dict(grammar="start: undefined_rule"), "grammar", "unknown name"),
    (dict(json_schema={}, regex="a"), "regex", "one of"),
    (dict(json_schema=_nested({"type": "string"}, 70)), "json_schema", "recursion limit"),
    # deeper than Python's own recursion limit: a raw RecursionError from json
    (dict(json_schema=_nested({"type": "string"}, 5000)), "json_schema", "too deeply"),
    (dict(json_schema="[" * 100_000 + "]" * 100_000), "json_schema", "too deeply"),
    # NaN was written as JSON that llguidance could not read ("expected value at column 31")
    (dict(json_schema={"type": "number", "minimum": float("nan")}), "json_schema",
     "cannot be written as JSON"),
    # an unpaired surrogate was a bare UnicodeEncodeError (a regex, a Lark grammar) or "Value
    # is not JSON serializable" (a schema)
    (dict(regex="a\ud800"), "regex", "not valid Unicode: .* surrogate at character 1"),
    (dict(grammar="start: /\ud800/"), "grammar", "not valid Unicode: .* surrogate"),
    (dict(grammar='root ::= "\udfff"'), "grammar", "not valid Unicode: .* surrogate"),
    (dict(json_schema={"enum": ["\ud800"]}), "json_schema", "not valid Unicode: .* surrogate"),
    # the schema false: "Unimplemented keys: ['not']", a key nobody wrote
    (dict(json_schema=False), "json_schema", "the JSON schema false allows no value"),
    (dict(json_schema="false"), "json_schema", "the JSON schema false allows no value"),
    # what the matcher accepts wrongly: a key written three times met minProperties 3
    # ({"x": 1, "x": 2, "x": 3}, one key once parsed), and bounds past 2^53 compared as
    # floats (9007199254740992 passed a minimum of 9007199254740993)
    (dict(json_schema={"type": "object", "additionalProperties": {"type": "integer"},
                       "minProperties": 3}), "json_schema", "minProperties 3 where keys"),
    (dict(json_schema={"type": "object", "properties": {"n": {
        "type": "integer", "minimum": 2 ** 53 + 1}}}), "json_schema", "beyond 2\\^53"),
])
def test_unusable_grammars_are_refused_with_the_field_named(kwargs, param, match):
    with pytest.raises(GrammarError, match=match) as e:
        parse_grammar(**kwargs)
    assert e.value.param == param
    assert "\n" not in str(e.value)


def test_a_grammar_that_cannot_start_is_refused_when_compiled_not_mid_generation(tiny):
    # llguidance compiles a schema that only refers to itself and fails at its first token;
    # parse_grammar refuses that one itself (below), so the compiled form is built here
    # directly: compile_grammar is the guard for whatever reaches it that way
    g = _unchecked({"$ref": "#"})
    with pytest.raises(GrammarError, match="not usable: it cannot start") as e:
        compile_grammar(g, tiny.tokenizer, tiny.config.vocab_size)
    assert e.value.param == "json_schema" and "\n" not in str(e.value)
    with pytest.raises(GrammarError, match="no finite value fits it"):
        tiny.generate("x", max_tokens=4, json_schema={"$ref": "#"})


_NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
         "required": ["next"]}


@pytest.mark.parametrize("schema, ref", [
    ({"$ref": "#"}, "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
    ({"type": "array", "prefixItems": [{"type": "null"}, {"$ref": "#"}], "minItems": 2}, "#"),
    ({"$defs": {"node": _NODE}, "$ref": "#/$defs/node"}, "#/$defs/node"),
    ({"$defs": {"node": _NODE}, "type": "object", "properties": {"head": {
        "$ref": "#/$defs/node"}}, "required": ["head"]}, "#/$defs/node"),
    # two definitions that need each other
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                      "required": ["b"]},
                "b": {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/a"}}},
      "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"anyOf": [{"$ref": "#"}, {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]},
     "#"),
])
def test_a_schema_no_finite_value_fits_is_refused_before_it_generates(schema, ref):
    # before, each compiled and started, and the answer nested "{"a": {"a": ... up to
    # max_tokens (or the parser's limit): never a valid value
    with pytest.raises(GrammarError, match="no finite value fits it") as e:
        parse_grammar(json_schema=schema)
    assert f'"{ref}"' in str(e.value) and e.value.param == "json_schema"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # "a" is optional
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
     "required": ["a"]},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    # no "type": null fits
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"tree": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}, "v": {"type": "integer"}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/tree"},
    {"$defs": {"a b": {"type": "string"}, "c/d": {"type": "integer"}}, "type": "object",
     "properties": {"x": {"$ref": "#/$defs/a%20b"}, "y": {"$ref": "#/$defs/c~1d"}},
     "required": ["x", "y"]},
    PERSON,
])
def test_recursive_schemas_a_finite_value_fits_are_kept(schema):
    assert parse_grammar(json_schema=schema).kind == "json_schema"


@pytest.mark.parametrize("grammar, rule, whole", [
    ('start: "a" start', "start", True),
    ('root ::= "hello " root', "root", True),  # GBNF, named as written
    ('root ::= x\nx ::= "{" x "}"', "x", True),
    ('root ::= my-list\nmy-list ::= "[" my-list ("," my-list)* "]"', "my-list", True),
    ('start: a\na: "x" b\nb: "y" a', "a", True),  # two rules that need each other
    ('start: (x | y)+\nx: "1" x\ny: "2" (x | y)', "x", True),
    # one branch of a choice never ends: an answer that takes it cannot finish
    ('root ::= "yes" | "no" x\nx ::= "a" x', "x", False),
    ('start: "a" [loop] "b"\nloop: "c" loop', "loop", False),
    ('start: "a" loop* | "b"\n?loop: "c" loop ("d")~2', "loop", False),
    ('start: "a" | t{1,3}\nt: "c" t // no way out\n', "t", False),
])
def test_a_grammar_with_a_rule_that_never_ends_is_refused_before_it_generates(
        grammar, rule, whole):
    # before, llguidance compiled these and the parser hit its item limit at the first token
    # inside the rule ("too complex to follow here"), after the answer had begun
    with pytest.raises(GrammarError, match=f'rule "{rule}" never ends') as e:
        parse_grammar(grammar=grammar)
    assert e.value.param == "grammar" and "\n" not in str(e.value)
    assert ("no finite text fits it" in str(e.value)) == whole


@pytest.mark.parametrize("grammar", [
    'start: "a" start | "b"',
    'start: x\nx: "(" x ")" | ""',
    'start: item+\nitem: "(" item* ")" | WORD\nWORD: /[a-z]+/',
    'start: "[" [value ("," value)*] "]"\nvalue: NUMBER | "[" [value ("," value)*] "]"\n'
    'NUMBER: /[0-9]+/',
    'start: a\na: b "x" | "y"\nb: a "z"',  # b needs a, a ends through "y"
    'start: e\ne: e "+" t | t\nt: "(" e ")" | /[0-9]/',  # left recursion
    'start: %json {"type": "object"} | "x" start',
    'start: loop~0..3 "end"\nloop: "c" loop | "d"',
    'start: "a"{,4} s\ns: "b" s{0,2} | "c"',
    'root ::= value\nvalue ::= object | array | "null"\nobject ::= "{" ( pair ("," pair)* )? "}"'
    '\npair ::= "\\"k\\":" value\narray ::= "[" ( value ("," value)* )? "]"',
    'root ::= expr\nexpr ::= term ([-+] term)*\nterm ::= [0-9]+ | "(" expr ")"',
])
def test_recursive_grammars_that_can_end_are_kept(grammar):
    assert parse_grammar(grammar=grammar).kind == "grammar"


def test_a_never_ending_grammar_is_refused_by_generate_before_any_token(tiny):
    with pytest.raises(GrammarError, match='rule "root" never ends'):
        tiny.generate("x", max_tokens=4, grammar='root ::= "a" root')


def _holds(schema, text: str) -> bool:
    """Whether the compiled schema lets ``text`` through, byte by byte."""
    byte = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(byte, parse_grammar(json_schema=schema).compiled, log_level=0)
    return bool(matcher.consume_tokens(byte.tokenize_bytes(text.encode()))) and \
        matcher.is_accepting()


@pytest.mark.parametrize("schema, text, valid", [
    ({"type": "string", "format": "date"}, '"2023-02-29"', False),  # was let through
    ({"type": "string", "format": "date"}, '"1900-02-29"', False),
    ({"type": "string", "format": "date"}, '"2024-02-29"', True),
    ({"type": "string", "format": "date"}, '"2000-02-29"', True),
    ({"type": "string", "format": "date"}, '"2023-04-31"', False),
    ({"type": "string", "format": "date"}, '"2023-12-31"', True),
    ({"type": "string", "format": "date-time"}, '"2023-02-29T10:00:00Z"', False),
    ({"type": "string", "format": "date-time"}, '"2024-02-29T23:59:59.25+05:30"', True),
    ({"type": "integer", "format": "int32"}, "99999999999", False),  # was let through
    ({"type": "integer", "format": "int32"}, "2147483648", False),
    ({"type": "integer", "format": "int32"}, "-2147483648", True),
    ({"type": "integer", "format": "int32", "maximum": 5}, "6", False),
    # a property named "format", and a const that holds a schema, are not formats
    ({"type": "object", "properties": {"format": {"type": "string"}}, "required": ["format"],
      "additionalProperties": False}, '{"format": "x"}', True),
    ({"const": {"format": "date"}}, '{"format": "date"}', True),
])
def test_formats_the_matcher_held_loosely_are_held_exactly(schema, text, valid):
    assert _holds(schema, text) is valid
    if valid:  # and the oracle agrees with what was let through
        jsonschema.validate(json.loads(text), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_gbnf_is_read_as_well_as_lark():
    assert parse_grammar(grammar='root ::= "yes" | "no"').kind == "grammar"
    assert parse_grammar(grammar='start: "yes" | "no"').kind == "grammar"


def test_the_sampler_draws_only_allowed_tokens_and_leaves_the_logits_alone():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32)
    before = logits.copy()
    allowed = np.zeros(64, dtype=bool)
    allowed[[3, 17, 40]] = True
    greedy = Sampler(SamplingParams())
    assert greedy(logits, [], allowed=allowed) == [3, 17, 40][int(np.argmax(logits[[3, 17, 40]]))]
    hot = Sampler(SamplingParams(temperature=1.5, top_p=0.9, seed=1, repetition_penalty=1.3))
    draws = {hot(logits, [3, 5], allowed=allowed) for _ in range(200)}
    assert draws <= {3, 17, 40} and len(draws) > 1
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                      dict(temperature=0.7, top_k=20, seed=5)])
def test_random_models_always_write_valid_json(tiny, sampling):
    for prompt in ["Describe a person.", "{", "名字"]:
        out = tiny.generate(prompt, max_tokens=400, json_schema=PERSON, **sampling)
        assert tiny.last_state.finish_reason == "stop", out
        jsonschema.validate(json.loads(out), PERSON)


def test_regex_and_grammar_outputs_match(tiny):
    out = tiny.generate("Date:", max_tokens=40, regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]",
                        temperature=1.0, seed=2)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", out)
    lark = 'start: "The answer is " ("yes" | "no") "."'
    out = tiny.generate("Q:", max_tokens=40, grammar=lark)
    assert out in ("The answer is yes.", "The answer is no.")
    assert tiny.last_state.finish_reason == "stop"


def test_the_greedy_shortcut_equals_the_full_mask(tiny, monkeypatch):
    want = tiny.generate("Hello", max_tokens=120, json_schema=PERSON)
    calls = []
    original = Constraint.sample

    def always_mask(self, draw, greedy):
        calls.append(1)
        return draw(allowed=self.allowed())

    monkeypatch.setattr(Constraint, "sample", always_mask)
    assert tiny.generate("Hello", max_tokens=120, json_schema=PERSON) == want
    assert calls
    monkeypatch.setattr(Constraint, "sample", original)


def test_max_tokens_ends_with_length_and_the_text_so_far(tiny):
    out = tiny.generate("x", max_tokens=5, json_schema=PERSON)
    assert tiny.last_state.finish_reason == "length"
    assert out.startswith("{") and len(tiny.last_state.generated) == 5


def test_a_state_where_nothing_is_allowed_ends_with_an_error(tiny, monkeypatch):
    c = tiny.constraint(json_schema=PERSON)

    class Nothing:
        def unsafe_compute_mask_ptr(self, ptr, size):
            import ctypes

            ctypes.memset(ptr, 0, size)

        def is_error(self):
            return False

    c.matcher = Nothing()
    with pytest.raises(GrammarError, match="allows no token"):
        c.allowed()


def _unchecked(schema: dict):
    """A compiled JSON-schema Grammar that parse_grammar's own checks did not see."""
    source = json.dumps(schema)
    return Grammar("json_schema", source,
                   llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT))


def test_a_parser_limit_is_named_as_such_not_as_a_token_that_does_not_fit(tiny):
    # an object that must hold itself (parse_grammar refuses it; compiled here directly, as
    # the one schema known to reach the limit): llguidance starts it, and its lexer reaches
    # its item limit on the first token (it was "token 39428 does not fit")
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    c = compile_grammar(_unchecked(endless), tiny.tokenizer, tiny.config.vocab_size)
    with pytest.raises(GrammarError, match="too complex to follow here .*limit") as e:
        for _ in range(64):
            c.consume(int(np.flatnonzero(c.allowed())[0]))
    assert e.value.param == "json_schema" and "\n" not in str(e.value)
    c = tiny.constraint(regex="[0-9]+")
    with pytest.raises(GrammarError, match="does not fit the regular expression"):
        c.consume(tiny.tokenizer.encode("x", add_bos=False)[0])


def test_speculative_and_batched_generation_are_unchanged(tiny):
    msgs = [[{"role": "user", "content": f"person {i}"}] for i in range(3)]
    want = [tiny.chat(m, max_tokens=150, json_schema=PERSON) for m in msgs]
    assert [tiny.chat(m, max_tokens=150, json_schema=PERSON, speculative="lookup")
            for m in msgs] == want
    got = {i: text for i, text, _ in tiny.chat_batch(msgs, max_tokens=150, json_schema=PERSON)}
    assert [got[i] for i in range(3)] == want


def test_closed_schemas_and_tool_call_formats():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "array", "items": {
                                                   "properties": {"c": {}}}}}}
    c = closed(schema)
    assert c["additionalProperties"] is False
    assert c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed({"type": "object", "additionalProperties": True})["additionalProperties"]
    native = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    calls = parse_calls(native, native=True)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse_calls(native + " and more text", native=True) is None
    assert parse_calls('{"name": "f", "arguments": {}}', native=False)[0]["function"]["name"] == "f"
    assert parse_calls("Hello", native=False) is None
    deep = "[" * 100_000  # past json's recursion limit: not a call, not an exception
    assert parse_calls(f"<tool_call>\n{deep}\n</tool_call>", native=True) is None
    assert parse_calls("{" + deep, native=False) is None
    tools = [Tool("f", "does f", {"type": "object", "properties": {"x": {"type": "integer"}}})]
    msgs, extra = render_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}], tools, native=False)
    assert extra == {} and msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '{"name": "f", "arguments": {"x": 1}}'}
    kept, _ = render_messages([  # arguments nested past json's limit stay the text they were
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]}],
        tools, native=False)
    assert json.loads(kept[2]["content"])["arguments"] == deep
    assert msgs[3]["role"] == "user" and msgs[3]["content"].endswith("2")
    # a result is labelled with the function its call named (the call's id is never shown)
    assert msgs[3]["content"] == "Result of f:\n2"
    # a string argument may hold the closing tag: the call is read as JSON, not up to it
    # (a forced call holding it came back as plain text)
    tricky = ('<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>b"}}\n</tool_call>'
              '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>\n')
    calls = parse_calls(tricky, native=True)
    assert [c["function"] for c in calls] == [
        {"name": "f", "arguments": '{"s": "a</tool_call>b"}'}, {"name": "g", "arguments": "{}"}]
    for broken in ('<tool_call>{"name": "f", "arguments": {}}', "<tool_call></tool_call>",
                   '<tool_call>{"name": "f", "arguments": {}} x</tool_call>',
                   '<tool_call>{"name": "f", "arguments": {}}</tool_call> then text'):
        assert parse_calls(broken, native=True) is None, broken
    _, extra = render_messages([{"role": "user", "content": "hi"}], tools, native=True)
    assert extra["tools"][0]["function"]["name"] == "f"
    assert call_grammar(tools, native=True).kind == "grammar"


def test_tool_calls_of_a_random_model_always_parse(tiny):
    tools = [Tool("get_weather", "", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"]}), Tool("noop", "", {})]
    for native in (True, False):
        grammar = call_grammar(tools, native=native)
        for seed in range(3):
            out = tiny.generate("call", max_tokens=300, temperature=1.0, seed=seed,
                                grammar=grammar.source)
            calls = parse_calls(out, native=native)
            assert calls, out
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                if call["function"]["name"] == "get_weather":
                    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
                else:
                    assert args == {}


def test_a_named_function_or_parallel_tool_calls_false_is_one_call(tiny):
    """The native format allows call after call: a named tool_choice (and "required" with
    parallel_tool_calls false) let a greedy model repeat its call until max_tokens, and the
    answer came back cut, as text. One call, then the answer must end."""
    tools = [Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}), Tool("g", "", {})]
    one = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    two = one + "\n" + one

    def takes(constraint, text):
        for t in tiny.tokenize(text):
            if not constraint.allowed()[t]:
                return False
            constraint.consume(t)
        return constraint.allowed()[tiny.tokenizer.eos_ids[0]]

    def made(choice, parallel=True):
        return call_constraint(tools, choice, native=True, tokenizer=tiny.tokenizer,
                               n_vocab=tiny.config.vocab_size, parallel=parallel)

    assert takes(made("required"), two) and takes(made("required"), one)
    assert takes(made("required", parallel=False), one)
    assert not takes(made("required", parallel=False), two)
    named = {"type": "function", "function": {"name": "f"}}
    assert takes(made(named), one) and not takes(made(named), two)


def test_tool_parameters_with_defs_and_refs_hold_as_they_do_alone(tiny):
    """Function parameters as Pydantic writes them ($defs and $ref, and a reference to the
    parameters themselves) constrain the call's arguments as they would alone; they were
    refused ('/$defs/City' does not exist: the refs resolved against the call's wrapper)."""
    city = {"$defs": {"City": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "code": {"enum": ["A", "B"]}},
        "required": ["name", "code"]}},
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"]}
    chain = {"type": "object", "properties": {"n": {"type": "integer"},
                                              "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["n", "next"]}
    tools = [Tool("weather", "", city), Tool("chain", "", chain)]
    for native in (True, False):
        grammar = call_grammar(tools, native=native)
        assert tiny.constraint(grammar=grammar.source) is not None
    # the generic format (native ones allow call after call: a random model goes on)
    for seed in range(2):
        out = tiny.generate("call", max_tokens=300, temperature=1.0, seed=seed,
                            grammar=call_grammar(tools[:1], native=False).source)
        calls = parse_calls(out, native=False)
        assert calls, out
        # response_format's layout: no tab (JSON strings escape theirs), no line break inside
        assert "\t" not in out.strip() and "\n" not in out.strip(), out
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), city)


def test_an_auto_tool_choice_compiles_its_grammar_with_the_request(tiny, monkeypatch):
    """tool_choice "auto" compiled the call grammar when the output began with the trigger:
    on the server's decoding thread, stalling every request beside it."""
    from pocketlm import tools as tools_module

    compiled = []
    real = tools_module.compile_grammar
    monkeypatch.setattr(tools_module, "compile_grammar",
                        lambda *a, **k: compiled.append(a) or real(*a, **k))
    tools = [Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}})]
    auto = call_constraint(tools, "auto", native=False, tokenizer=tiny.tokenizer,
                           n_vocab=tiny.config.vocab_size)
    assert len(compiled) == 1 and not auto.active
    for t in tiny.tokenize('{"name": "f", "arguments": {"x": 1}}'):
        auto.consume(t)
    assert auto.active and len(compiled) == 1


def test_cli_constraints(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", seed=7, weight_type="Q4_0", max_context=1024)
    env = {**__import__("os").environ, "POCKET_HOME": str(tmp_path / "home")}
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    lark = tmp_path / "yn.lark"
    lark.write_text('start: "yes" | "no"\n')

    def pocket(*args):
        return subprocess.run([sys.executable, "-m", "pocketlm.cli", "run", "-m", str(path),
                               "--raw", "-n", "300", *args], env=env, capture_output=True,
                              text=True)

    p = pocket("--json-schema", str(schema), "hi")
    assert p.returncode == 0, p.stderr
    jsonschema.validate(json.loads(p.stdout), PERSON)
    p = pocket("--json-schema", '{"type": "array", "items": {"type": "integer"}, '
               '"minItems": 2, "maxItems": 2}', "hi")
    assert p.returncode == 0 and len(json.loads(p.stdout)) == 2
    p = pocket("--regex", "[0-9]{3}", "hi")
    assert p.returncode == 0 and re.fullmatch(r"[0-9]{3}\n", p.stdout)
    p = pocket("--grammar", str(lark), "hi")
    assert p.returncode == 0 and p.stdout in ("yes\n", "no\n")
    for args, match in [(["--json-schema", '{"type": "strin"}'], "Invalid type"),
                        (["--json-schema", str(tmp_path / "missing.json")], "not a file"),
                        (["--json-schema", "{oops"], "not valid JSON"),
                        (["--json-schema", "[" * 5000], "nested too deeply"),
                        (["--regex", "(ab"], "unclosed group"),
                        (["--grammar", str(schema)], "grammar is not usable"),
                        (["--grammar", str(tmp_path)], "not a file")]:
        p = pocket(*args, "hi")
        assert p.returncode == 1, (args, p.stdout)
        assert match in p.stderr and p.stderr.count("\n") == 1, p.stderr
        assert p.stdout == ""


def test_an_interrupt_while_the_vocabulary_is_stored_leaves_nothing_half_made(tiny,
                                                                              monkeypatch):
    """The view and its byte lengths were two caches: a Ctrl-C between the two writes made
    every later grammar on the model fail with a KeyError."""
    from pocketlm import structured

    other = pocketlm.load(tiny.path)
    real = structured._Vocab

    def interrupted(*args):
        monkeypatch.setattr(structured, "_Vocab", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(structured, "_Vocab", interrupted)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with pytest.raises(KeyboardInterrupt):
        other.generate("x", max_tokens=8, json_schema=schema)
    out = other.generate("x", max_tokens=40, json_schema=schema, seed=1, temperature=1.0)
    assert out == tiny.generate("x", max_tokens=40, json_schema=schema, seed=1,
                                temperature=1.0)


def test_a_closed_models_vocabulary_view_is_not_kept(tiny):
    """llguidance's view of a tokenizer (every piece's bytes) was cached forever, keyed by
    the tokenizer's id: a process that loads model after model kept them all. It now goes
    with its tokenizer."""
    import gc
    import weakref

    from pocketlm import structured

    other = pocketlm.load(tiny.path)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = other.generate("x", max_tokens=40, json_schema=schema, seed=1, temperature=1.0)
    assert out == tiny.generate("x", max_tokens=40, json_schema=schema, seed=1,
                                temperature=1.0)
    gone = weakref.ref(other.tokenizer)
    assert other.tokenizer in structured._tokenizers

    def views():  # llguidance's views alive: each holds its _TokenizerView
        return sum(type(o) is structured._TokenizerView for o in gc.get_objects())

    before = views()
    del other
    gc.collect()
    assert gone() is None
    assert tiny.tokenizer in structured._tokenizers  # the live one keeps its view
    # the compiled grammar went too: it held the view (the global grammar cache kept 64)
    assert views() == before - 1


@pytest.mark.real
def test_a_regex_that_unrolls_past_the_lexer_s_bounds_is_refused_before_it_generates():
    # llguidance unrolls a repetition byte by byte as tokens arrive: these failed at the
    # model's first long token ("stopped matching: ... too many expressions constructed"),
    # after the answer had begun (smollm2-135m: a real vocabulary, with pieces of many a's)
    import pocketlm

    m = pocketlm.load("smollm2-135m")
    for regex in ["a{1000000}", "x|a{100000}", "(ab){200000}"]:
        with pytest.raises(GrammarError, match="too complex to follow .*limit.*fewer "
                           "repetitions") as e:
            m.constraint(regex=regex)
        assert e.value.param == "regex" and "\n" not in str(e.value)
    for regex in ["[a-z]{1000000}", "a{2000}", "(yes|no)", "[0-9]{3}"]:  # these it can follow
        c = m.constraint(regex=regex)
        for _ in range(4):
            ids = np.flatnonzero(c.allowed())
            c.consume(int(ids[np.argmax([len(m.tokenizer.token_bytes(int(i))) for i in ids])]))
            if c.done:
                break
