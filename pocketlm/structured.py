"""Structured output: generation constrained to a JSON Schema, a regular expression or a grammar.

The grammar engine is llguidance (Microsoft's Rust library behind llama.cpp's and vLLM's
``guidance`` backends): it compiles JSON Schema, regular expressions and Lark grammars lazily,
computes a next-token mask in tens of microseconds on 262k-piece vocabularies, needs neither
torch nor anything else, and is one 3 MB wheel. docs/structured.md compares it with xgrammar
(needs torch, transformers and triton) and outlines-core (regular expressions and JSON Schema
only, with an index built up front whose cost grows with the vocabulary).

How a constrained step works (:meth:`Constraint.sample`): for a greedy sampler the model's own
choice is taken when the grammar allows it (one cheap lexer step, no mask); otherwise, and for
every draw at a temperature, the full mask is computed and applied to the one copy of the
logits the sampler makes anyway. The result is exactly the masked distribution's choice, so a
constrained greedy answer is the same whichever way it was found. Sampling, stop strings,
streaming and speculative decoding are unchanged: each taken token is fed to the matcher, and
once the grammar can only end, generation stops there without another pass over the weights.

Grammars are compiled once per (tokenizer, grammar) and copied per request
(:func:`compile_grammar` keeps a small cache), so a server pays the compile only for the first
request with a schema.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np

from .errors import GrammarError
from .tokenizer import Tokenizer

KINDS = ("json_schema", "regex", "grammar")
# JSON output is written on one line with ", " and ": " (as json.dumps writes it): free
# whitespace lets a small model pad forever; a schema's "x-guidance" options override this
# (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a broken install: llguidance is a dependency
        raise GrammarError("structured output needs llguidance: pip install llguidance") from e
    return llguidance


class _TokenizerView:
    """What llguidance needs of a tokenizer: every id's bytes (control tokens marked with a
    leading 0xFF byte, so that no text can produce them), the special ids, and encoding."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        tok = tokenizer
        self.eos_token_id = tok.eos_ids[0] if tok.eos_ids else 0
        self.bos_token_id = tok.bos_id
        specials = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        special = set(specials)
        self.special_token_ids = specials
        self.tokens = [b"\xff" + tok.token_bytes(i) if i in special else tok.token_bytes(i)
                       for i in range(tok.vocab_size)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))  # padded rows of the output head
        # each id's length in bytes, control tokens 0 (what compile_grammar's probe ranks by)
        self.lengths = np.array([0 if i in special else len(t)
                                 for i, t in enumerate(self.tokens)], dtype=np.int32)
        # weak: the view is kept (in ll_tokenizer's cache) for as long as the tokenizer lives
        self._tok = weakref.ref(tok)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        tok = self._tok()
        if tok is None:
            raise GrammarError("the tokenizer of this grammar is gone (its model was closed)")
        return tok.encode(text, add_bos=False, special=False)


class _Vocab:
    """What grammars need of one tokenizer at one logits width: llguidance's view, each id's
    length in bytes (0 for control tokens and padded rows) and the grammars compiled against
    the view (the last 64, by kind and source). One object, stored in one assignment: an
    interrupt cannot leave half of it (a Ctrl-C between two caches broke every later
    grammar on the model)."""

    def __init__(self, ll, lengths: np.ndarray):
        self.ll, self.lengths = ll, lengths
        self.compiled: OrderedDict[tuple, _Compiled] = OrderedDict()


# tokenizer -> {n_vocab: _Vocab}: an entry, compiled grammars included (they hold the view),
# goes with its tokenizer (a process that loads model after model kept every vocabulary's
# view, hundreds of MB for large ones)
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def _vocab(tokenizer: Tokenizer, n_vocab: int | None = None) -> _Vocab:
    n_vocab = tokenizer.vocab_size if n_vocab is None else int(n_vocab)
    with _tokenizers_lock:
        views = _tokenizers.setdefault(tokenizer, {})
        vocab = views.get(n_vocab)
        if vocab is not None:
            return vocab
        llg = _llg()
        plain = _TokenizerView(tokenizer, n_vocab)
        view = llg.TokenizerWrapper(plain)
        eos = list(tokenizer.eos_ids) or [view.eos_token_id]
        ll = llg.LLTokenizer(view, n_vocab=n_vocab, eos_token=eos)
        vocab = views[n_vocab] = _Vocab(ll, plain.lengths)
        return vocab


def ll_tokenizer(tokenizer: Tokenizer, n_vocab: int | None = None):
    """llguidance's view of ``tokenizer`` for logits of ``n_vocab`` entries (built once per
    tokenizer: about 0.3 s for 49k pieces, 3 s for 262k). Its end tokens are the tokenizer's
    EOS / end-of-turn ids: the grammar lets the sequence end through any of them."""
    return _vocab(tokenizer, n_vocab).ll


@dataclass(frozen=True)
class Grammar:
    """A checked grammar: ``kind`` ("json_schema", "regex" or "grammar"), the source as the
    caller gave it (a schema as JSON text, its key order kept: it is the output order) and llguidance's compiled form."""

    kind: str
    source: str
    compiled: str

    def describe(self) -> str:
        return _DESCRIBED[self.kind]


_DESCRIBED = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}
_TOO_DEEP = "the JSON schema nests arrays or objects too deeply"


def parse_grammar(*, json_schema: Any = None, regex: str | None = None,
                  grammar: str | None = None) -> Grammar | None:
    """The one constraint among ``json_schema`` (a dict, or its JSON text), ``regex`` and
    ``grammar`` (Lark; a GBNF grammar, with ``::=`` rules, is converted), checked; None when
    none is given. Raises :class:`GrammarError` for two at once, or for one that does not
    compile, uses a keyword llguidance does not implement, or cannot be satisfied."""
    given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex),
                                 ("grammar", grammar)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError("give one of json_schema, regex and grammar, not "
                           + " and ".join(k for k, _ in given), param=given[1][0])
    kind, value = given[0]
    llg = _llg()
    if kind == "json_schema":
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}",
                                   param=kind) from None
            except RecursionError:
                raise GrammarError(_TOO_DEEP, param=kind) from None
        if value is False:  # JSON Schema's "nothing is valid" (llguidance named a "not" key)
            raise GrammarError("the JSON schema false allows no value at all; nothing could be "
                               "generated", param=kind)
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise GrammarError(f"a JSON schema must be an object, got "
                               f"{type(value).__name__}", param=kind)
        try:
            # key order is output order; NaN would be written as no JSON parser reads it
            source = json.dumps(value, ensure_ascii=False, allow_nan=False)
            held = json.dumps(_held_formats(value), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema cannot be written as JSON: {e}",
                               param=kind) from None
        except RecursionError:
            raise GrammarError(_TOO_DEEP, param=kind) from None
        _check_unicode(source, kind)
        try:
            compiled = llg.LLMatcher.grammar_from_json_schema(held, defaults=JSON_LAYOUT)
        except ValueError as e:  # e.g. "recursion limit exceeded" for a deeply nested schema
            raise GrammarError(f"the JSON schema cannot be used: {_first_line(e)}",
                               param=kind) from None
    else:
        if not isinstance(value, str) or not value.strip():
            raise GrammarError(f"{kind} must be a non-empty string", param=kind)
        source = value
        _check_unicode(source, kind)
        if kind == "regex":
            compiled = llg.LLMatcher.grammar_from_regex(value)
        elif "::=" in value:
            try:
                compiled = llg.grammar_from("gbnf", value)
            except ValueError as e:
                raise GrammarError(f"the grammar does not compile: {_first_line(e)}",
                                   param=kind) from None
        else:
            compiled = llg.LLMatcher.grammar_from_lark(value)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(compiled)
    if is_error:
        what = "the " + _DESCRIBED[kind]
        raise GrammarError(f"{what} is not usable: {_first_line(messages[0])}", param=kind)
    if kind == "json_schema":
        problem = _unenforced(value)
        if problem is not None:
            raise GrammarError(f"the JSON schema cannot be held exactly: {problem}",
                               param=kind)
        ref = _endless_ref(value)
        if ref is not None:
            raise GrammarError(f"the JSON schema is not usable: no finite value fits it (a value "
                               f"of \"{ref}\" must hold another without end)", param=kind)
    elif kind == "grammar":
        endless = _endless_rules(compiled if "::=" in value else value)
        if endless:
            rule = next((r for r in endless if r != "start"), "start")
            if "::=" in value:  # name it as the GBNF source does
                rule = _gbnf_names(value).get(rule, rule)
            what = (f"its rule \"{rule}\" never ends (every alternative needs it again or "
                    f"another rule that never ends)")
            raise GrammarError("the grammar is not usable: " + (
                f"no finite text fits it: {what}" if "start" in endless
                else f"{what}, so an answer that enters it cannot finish"), param=kind)
    return Grammar(kind, source, compiled)


# Formats the matcher holds loosely, written as what it holds exactly: its "date" allowed
# February 29 of every year (2023-02-29 fails any date parser) and it ignores "int32"/"int64"
# on integers (an int32 field got 99999999999; int64's bounds are beyond what the matcher
# compares exactly, see _unenforced).
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|"
              "[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_DATE = f"(?:[0-9]{{4}}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\\.[0-9]+)?"
         "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}
_INT_FORMATS = {"int32": 2 ** 31}
# keywords whose values are JSON data, not schemas: left as they are
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


def _held_formats(schema: Any) -> Any:
    """``schema`` with the formats the matcher holds loosely rewritten as what it holds
    exactly: "date" and "date-time" as patterns that know leap years (unless the node has its
    own pattern), "int32" on integers as bounds. The schema as given is what requests
    and errors name; only the matcher sees this one."""
    if isinstance(schema, list):
        return [_held_formats(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else _held_formats(v)) for k, v in schema.items()}
    fmt = schema.get("format")
    if not isinstance(fmt, str):  # e.g. a property named "format" in a "properties" object
        return out
    if fmt in _FORMAT_PATTERNS and "pattern" not in schema:
        del out["format"]
        out["pattern"] = _FORMAT_PATTERNS[fmt]
    elif fmt in _INT_FORMATS and schema.get("type") == "integer":
        del out["format"]
        half = _INT_FORMATS[fmt]
        low, high = schema.get("minimum"), schema.get("maximum")
        if not isinstance(low, (int, float)) or isinstance(low, bool) or low < -half:
            out["minimum"] = -half
        if not isinstance(high, (int, float)) or isinstance(high, bool) or high > half - 1:
            out["maximum"] = half - 1
    return out


_MAX_VISITS = 200_000
_UNKNOWN = object()


_EXACT_INT = 2 ** 53  # integers beyond are compared as the floats nearest to them


def _unenforced(schema: Any) -> str | None:
    """What in ``schema`` the matcher would accept a wrong value for, or None:
    ``minProperties`` above the required properties where keys beyond ``properties`` are
    allowed (such a key may be written twice, and a JSON parser keeps one: three keys
    written, one read), and an integer bound beyond 2^53 (the matcher compares numbers as
    64-bit floats: 9007199254740992 passed a minimum of 9007199254740993)."""
    stack = [schema]
    while stack:  # a stack, not recursion: schemas may nest deeply
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        least = node.get("minProperties")
        if isinstance(least, int) and not isinstance(least, bool):
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            named = len({k for k in required if k in props})
            if least > named and (node.get("additionalProperties", True) is not False
                                  or node.get("patternProperties")):
                return (f"minProperties {least} where keys beyond 'properties' are allowed "
                        f"(a key could be written twice and count twice; JSON parsers keep "
                        f"one): require {least} properties by name, or set "
                        f"additionalProperties to false")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            bound = node.get(key)
            if isinstance(bound, int) and not isinstance(bound, bool) and \
                    abs(bound) > _EXACT_INT:
                return (f"{key} {bound} is beyond 2^53, where numbers are compared as the "
                        f"floats nearest to them")
    return None


def _endless_ref(schema: Any) -> str | None:
    """The first ``$ref`` of ``schema`` that no finite JSON value fits (it must contain itself
    without end: a required property, a required item or every branch of a choice leads back to
    it), or None. llguidance finds what is unsatisfiable without recursion and compiles the
    rest; a schema like ``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required":
    ["a"]}`` would only show at generation, as an answer that never closes.

    The check may miss some (a reference it cannot resolve, a keyword it does not read counts
    as satisfiable) but never refuses a schema that a finite value fits: a node is called
    endless only when every way to build a value of it goes through a reference not yet shown
    to have a finite value (a least fixpoint over the references)."""
    targets: dict[str, Any] = {"#": schema}  # the schema itself is the reference "#"
    finite: set[str] = set()
    visits = 0

    def resolve(ref: str) -> Any:
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return _UNKNOWN
        node = schema
        for part in ref[2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _UNKNOWN
        return node

    def fits(node: Any, depth: int = 0) -> bool:
        nonlocal visits
        visits += 1
        if visits > _MAX_VISITS or depth > 256:
            raise OverflowError
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in targets:
                targets[ref] = resolve(ref)
            if targets[ref] is not _UNKNOWN and ref not in finite:
                return False
        if isinstance(node.get("allOf"), list):
            if not all(fits(s, depth + 1) for s in node["allOf"]):
                return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                if not any(fits(s, depth + 1) for s in node[key]):
                    return False
        if "const" in node or "enum" in node:
            return True
        if "type" not in node:
            return True  # null fits
        types = node["type"]
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list):
            return True
        return any(fits_type(node, t, depth) for t in types)

    def fits_type(node: dict, kind: Any, depth: int) -> bool:
        if kind == "object":
            props = node.get("properties")
            required = node.get("required")
            if isinstance(props, dict) and isinstance(required, list):
                return all(fits(props[r], depth + 1) for r in required
                           if isinstance(r, str) and r in props)
            return True
        if kind == "array":
            need = node.get("minItems", 0)
            need = need if isinstance(need, int) and not isinstance(need, bool) else 0
            items = node.get("items")
            prefix = node.get("prefixItems")
            if isinstance(items, list):  # the older tuple form
                prefix, items = items, node.get("additionalItems")
            prefix = prefix if isinstance(prefix, list) else []
            if not all(fits(s, depth + 1) for s in prefix[:need]):
                return False
            if need > len(prefix) and items is not None and not fits(items, depth + 1):
                return False
            if "contains" in node and node.get("minContains", 1) != 0:
                return fits(node["contains"], depth + 1)
            return True
        return True  # null, boolean, number, integer, string: a finite value, if any

    try:
        while "#" not in finite:
            before = (len(targets), len(finite))
            for ref, target in list(targets.items()):
                if target is not _UNKNOWN and ref not in finite and fits(target):
                    finite.add(ref)
            if (len(targets), len(finite)) == before:
                break
    except (OverflowError, RecursionError):
        return None
    if "#" in finite:
        return None
    endless = [ref for ref, t in targets.items() if t is not _UNKNOWN and ref not in finite]
    return next((ref for ref in endless if ref != "#"), "#")


# --- grammars whose rules never end -------------------------------------------------------
# A Lark (or converted GBNF) rule like ``x: "a" x`` has no finite text: llguidance compiles
# it, and the parser then grows without bound at the first token that enters it ("too many
# items"), or mid-answer when one branch of a choice leads there. _endless_rule finds such
# rules before generation. It reads the subset of llguidance's Lark it understands (rules,
# terminals, strings, regular expressions, special tokens, %json / %regex, groups, optional
# parts, repetition operators, aliases, rule attributes and priorities, directives) and gives
# up, refusing nothing, on anything else.

_LARK_PUNCT = ("->", "..", "(", ")", "[", "]", "{", "}", "|", "?", "*", "+", "~", ":", ",",
               "=", ".", "!", "@")


class _GiveUp(Exception):
    pass


def _balanced(text: str, i: int, open_: str, close: str) -> int:
    """The index after the ``close`` that balances the ``open_`` at ``text[i]`` (strings in
    double quotes skipped)."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _GiveUp


def _closing(text: str, i: int) -> int:
    """The index after the quote that closes the one at ``text[i]`` (backslash escapes
    skipped, on one line)."""
    j, n = i + 1, len(text)
    while j < n and text[j] != text[i]:
        if text[j] == "\n":
            raise _GiveUp
        j += 2 if text[j] == "\\" else 1
    if j >= n:
        raise _GiveUp
    return j + 1


def _lark_tokens(text: str) -> list[tuple[str, str]]:
    """(kind, value) pairs: "nl", "term" (a string, regular expression, special token or
    %json / %regex lexeme), "name", "num", "directive" (its whole line or braces) and the
    punctuation above as its own kind."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(("nl", c))
            i += 1
        elif c in " \t\r":
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif c in "\"/":  # a string (flag i) or a regular expression (flags imslux)
            j = _closing(text, i)
            while j < n and text[j] in ("i" if c == '"' else "imslux"):
                j += 1
            out.append(("term", text[i:j]))
            i = j
        elif c == "<":
            j = text.find(">", i)
            if j < 0 or "\n" in text[i:j]:
                raise _GiveUp
            out.append(("term", text[i:j + 1]))
            i = j + 1
        elif c == "%":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i + 1:j]
            k = j
            while k < n and text[k] in " \t":
                k += 1
            if word in ("json", "regex"):
                if k >= n or text[k] != "{":
                    raise _GiveUp
                j = _balanced(text, k, "{", "}")
                out.append(("term", text[i:j]))
            elif word == "llguidance":
                j = _balanced(text, k, "{", "}") if k < n and text[k] == "{" else k
                out.append(("directive", text[i:j]))
            elif word in ("ignore", "import", "declare", "override"):
                while j < n and text[j] != "\n":
                    j += 1
                out.append(("directive", text[i:j]))
            else:
                raise _GiveUp
            i = j
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            out.append(("name", text[i:j]))
            i = j
        elif c.isdigit():
            j = i
            while j < n and text[j].isdigit():
                j += 1
            out.append(("num", text[i:j]))
            i = j
        else:
            p = next((p for p in _LARK_PUNCT if text.startswith(p, i)), None)
            if p is None:
                raise _GiveUp
            out.append((p, p))
            i += len(p)
    return out


def _is_rule(name: str) -> bool:
    """Lark's naming: rules are lower case, terminals upper case (either may lead with _)."""
    head = name.lstrip("_")
    return bool(head) and head[0].islower()


def _lark_rules(text: str) -> dict[str, Any]:
    """Each rule's body as a tree: ("alt", [seq, ...]), ("seq", [item, ...]),
    ("opt", node) (may be empty), ("rep", node) (at least once), ("ref", name) or ("term",)."""
    toks = _lark_tokens(text) + [("nl", "\n"), ("eof", "")]
    # statements: a definition starts a line with [!?]name [attributes] [.priority] ":"
    heads: list[tuple[int, str, int]] = []  # (token index of the head, name, body start)
    pos = 0
    while pos < len(toks):
        if pos == 0 or toks[pos - 1][0] == "nl":
            j = pos
            if toks[j][0] in ("!", "?"):
                j += 1
            if toks[j][0] == "name":
                name, j = toks[j][1], j + 1
                if toks[j][0] == "[":  # rule attributes: [stop="...", max_tokens=...]
                    depth = 0
                    while toks[j][0] != "eof":
                        depth += {"[": 1, "]": -1}.get(toks[j][0], 0)
                        j += 1
                        if depth == 0:
                            break
                if toks[j][0] == "." and toks[j + 1][0] in ("num", "-"):
                    j += 2
                if toks[j][0] == ":":
                    heads.append((pos, name, j + 1))
            elif toks[j][0] == "directive":
                heads.append((pos, "", j + 1))
        pos += 1
    rules: dict[str, Any] = {}
    for k, (_, name, start) in enumerate(heads):
        end = heads[k + 1][0] if k + 1 < len(heads) else len(toks) - 1
        if not name:
            continue
        body = [t for t in toks[start:end] if t[0] != "nl"]
        if not _is_rule(name):
            continue  # a terminal: regular, so finite whatever it holds
        if name in rules:
            raise _GiveUp  # redefined: llguidance has refused it already, or %override
        tree, at = _lark_alt(body, 0)
        if at != len(body):
            raise _GiveUp
        rules[name] = tree
    return rules


def _lark_alt(toks: list, i: int) -> tuple[Any, int]:
    seqs = []
    while True:
        seq, i = _lark_seq(toks, i)
        if i < len(toks) and toks[i][0] == "->":
            if i + 1 >= len(toks) or toks[i + 1][0] != "name":
                raise _GiveUp
            i += 2
        seqs.append(seq)
        if i < len(toks) and toks[i][0] == "|":
            i += 1
            continue
        return ("alt", seqs), i


def _lark_seq(toks: list, i: int) -> tuple[Any, int]:
    items = []
    while i < len(toks) and toks[i][0] not in ("|", ")", "]", "->"):
        kind, value = toks[i]
        if kind == "(":
            node, i = _lark_alt(toks, i + 1)
            if i >= len(toks) or toks[i][0] != ")":
                raise _GiveUp
            i += 1
        elif kind == "[":
            node, i = _lark_alt(toks, i + 1)
            if i >= len(toks) or toks[i][0] != "]":
                raise _GiveUp
            node, i = ("opt", node), i + 1
        elif kind == "term":
            node, i = ("term",), i + 1
            if i + 1 < len(toks) and toks[i][0] == ".." and toks[i + 1][0] == "term":
                i += 2  # a character range "a".."z"
        elif kind == "name":
            node, i = (("ref", value) if _is_rule(value) else ("term",)), i + 1
        elif kind == "@":
            if i + 1 >= len(toks) or toks[i + 1][0] not in ("name", "num"):
                raise _GiveUp
            node, i = ("term",), i + 2  # another grammar: llguidance's own business
        else:
            raise _GiveUp
        node, i = _lark_op(node, toks, i)
        items.append(node)
    return ("seq", items), i


def _lark_op(node: Any, toks: list, i: int) -> tuple[Any, int]:
    """``node`` under the operator that follows it, if any."""
    if i >= len(toks):
        return node, i
    kind = toks[i][0]
    if kind in ("?", "*"):
        return ("opt", node), i + 1
    if kind == "+":
        return ("rep", node), i + 1
    if kind == "~" and i + 1 < len(toks) and toks[i + 1][0] == "num":
        low, i = int(toks[i + 1][1]), i + 2
        if i + 1 < len(toks) and toks[i][0] == ".." and toks[i + 1][0] == "num":
            i += 2
        return (("opt", node) if low == 0 else ("rep", node)), i
    if kind == "{":
        j = i + 1
        if j + 2 < len(toks) and [t[0] for t in toks[j:j + 3]] == [",", "num", "}"]:
            return ("opt", node), j + 3  # {,n}: none to n
        if j < len(toks) and toks[j][0] == "num":
            low = int(toks[j][1])
            j += 1
            if toks[j][0] == ",":
                j += 1
                if toks[j][0] == "num":
                    j += 1
            if j < len(toks) and toks[j][0] == "}":
                return (("opt", node) if low == 0 else ("rep", node)), j + 1
        raise _GiveUp
    return node, i


def _gbnf_names(source: str) -> dict[str, str]:
    """llguidance's Lark names for a GBNF grammar's rules, mapped back to the source's."""
    names = {"start": "root"}
    for m in re.finditer(r"^\s*([A-Za-z0-9_-]+)\s*::=", source, re.M):
        if m.group(1) != "root":
            names.setdefault(m.group(1).replace("-", "_"), m.group(1))
    return names


def _endless_rules(text: str) -> list[str]:
    """The rules reachable from ``start`` that derive no finite text (every way through one
    comes back to it, or to another such rule), in the order they are reached from
    ``start``; empty when there is none or the grammar uses what this reader does not know."""
    try:
        rules = _lark_rules(text)
    except (_GiveUp, RecursionError, ValueError):
        return []
    if "start" not in rules:
        return []
    finite: set[str] = set()

    def ends(node: Any) -> bool:
        kind = node[0]
        if kind == "alt":
            return any(ends(s) for s in node[1])
        if kind == "seq":
            return all(ends(s) for s in node[1])
        if kind == "opt" or kind == "term":
            return True
        if kind == "rep":
            return ends(node[1])
        return node[1] in finite or node[1] not in rules  # unknown: llguidance's to judge

    try:
        changed = True
        while changed:
            changed = False
            for name, body in rules.items():
                if name not in finite and ends(body):
                    finite.add(name)
                    changed = True
    except RecursionError:
        return []

    def refs(node: Any, out: list[str]) -> None:
        if node[0] == "ref":
            out.append(node[1])
        elif node[0] in ("alt", "seq"):
            for s in node[1]:
                refs(s, out)
        elif node[0] in ("opt", "rep"):
            refs(node[1], out)

    seen, todo = ["start"], ["start"]
    while todo:
        found: list[str] = []
        refs(rules[todo.pop()], found)
        for name in found:
            if name in rules and name not in seen:
                seen.append(name)
                todo.append(name)
    return [name for name in seen if name not in finite]


def _check_unicode(source: str, kind: str) -> None:
    """A constraint's text must be valid Unicode: an unpaired surrogate (``"\\ud800"`` from
    JSON or Python) reached the grammar compiler as a bare UnicodeEncodeError."""
    try:
        source.encode("utf-8")
    except UnicodeEncodeError as e:
        what = "the " + _DESCRIBED[kind]
        where = "" if kind == "json_schema" else f" at character {e.start}"
        raise GrammarError(f"{what} is not valid Unicode: it holds an unpaired surrogate{where}",
                           param=kind) from None


def _first_line(message: Any) -> str:
    """llguidance's message in one line: its first line, plus the parser's own "error:" line
    (the source excerpt and the caret under it are dropped)."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    detail = [ln for ln in lines[1:] if ln.startswith("error:")]
    head = lines[0].rstrip(":")
    return f"{head}: {detail[0][6:].strip()}" if detail else head


class _Compiled:
    """A grammar compiled against one tokenizer: the pristine matcher each request copies."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.lock = threading.Lock()


_compiled_lock = threading.Lock()


def compile_grammar(grammar: Grammar, tokenizer: Tokenizer, n_vocab: int | None = None
                    ) -> Constraint:
    """A fresh :class:`Constraint` for ``grammar`` over ``tokenizer``'s vocabulary; the compiled
    grammar is cached with the vocabulary (the last 64), so the next request with it starts at
    once."""
    vocab = _vocab(tokenizer, n_vocab)
    ll, cache = vocab.ll, vocab.compiled
    key = (grammar.kind, grammar.source)
    with _compiled_lock:
        entry = cache.get(key)
        if entry is not None:
            cache.move_to_end(key)
    if entry is None:
        llg = _llg()
        matcher = llg.LLMatcher(ll, grammar.compiled, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.describe()} is not usable: "
                               f"{_first_line(matcher.get_error())}", param=grammar.kind)
        # llguidance compiles lazily: a grammar that fails at its first token (a schema that
        # only refers to itself) is refused now, before a request has started generating
        probe = Constraint(grammar, matcher.deep_copy(), ll.vocab_size)
        try:
            first = probe.allowed()
        except GrammarError as e:
            raise GrammarError(f"the {grammar.describe()} is not usable: it cannot start ("
                               f"{str(e).split(': ', 1)[-1]})", param=grammar.kind) from None
        _probe_longest(probe, first, vocab.lengths)
        entry = _Compiled(matcher)
        with _compiled_lock:
            cache[key] = entry
            while len(cache) > _CACHE_SIZE:
                cache.popitem(last=False)
    with entry.lock:
        matcher = entry.matcher.deep_copy()
    return Constraint(grammar, matcher, ll.vocab_size)


def _probe_longest(probe: Constraint, allowed: np.ndarray, lengths: np.ndarray,
                   steps: int = 3) -> None:
    """Take the allowed token of the most bytes, ``steps`` times, on a copy: llguidance's lexer
    unrolls a regular expression byte by byte as tokens arrive, and one whose repetitions unroll
    past its bounds (``a{300000}``, ``x|a{100000}``) fails at the first long tokens; such a
    grammar is refused now, before a request has started generating. Any other outcome refuses
    nothing."""
    try:
        for _ in range(steps):
            ids = np.flatnonzero(allowed)
            longest = lengths[ids]
            if not len(ids) or longest.max() <= 1:
                return
            probe.consume(int(ids[np.argmax(longest)]))
            if probe.done:
                return
            allowed = probe.allowed()
    except GrammarError:
        error = _first_line(probe.matcher.get_error())
        if "limit" in error or "too many" in error:
            raise GrammarError(f"the {probe.grammar.describe()} is too complex to follow (its "
                               f"parser reached a limit: {error}); simplify it, e.g. with fewer "
                               "repetitions", param=probe.grammar.kind) from None


class Constraint:
    """One sequence's position in its grammar.

    :meth:`sample` picks the next token among those the grammar allows; :meth:`consume` moves
    past a taken token; :attr:`done` says the grammar can only end now. A state where no token
    can follow (a grammar that allows nothing) raises :class:`GrammarError` instead of looping.
    """

    def __init__(self, grammar: Grammar, matcher, n_vocab: int):
        self.grammar = grammar
        self.matcher = matcher
        self.n_vocab = n_vocab
        self._words = np.empty((n_vocab + 31) // 32, dtype=np.int32)
        self.masks = 0  # full masks computed (the rest were the model's own choice)

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: True where the grammar allows the token."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self.masks += 1
        if m.is_error():
            raise GrammarError(f"the {self.grammar.describe()} stopped matching: "
                               f"{_first_line(m.get_error())}", param=self.grammar.kind)
        mask = np.unpackbits(self._words.view(np.uint8), count=self.n_vocab,
                             bitorder="little").view(bool)
        if not mask.any():
            raise GrammarError(f"the {self.grammar.describe()} allows no token here: "
                               "nothing can be generated", param=self.grammar.kind)
        return mask

    def sample(self, draw, greedy: bool) -> int:
        """The token ``draw(allowed=None)`` draws among those the grammar allows (``draw``
        samples from this step's logits; ``greedy``: it takes the best one)."""
        if greedy:
            token = draw()
            if token < self.n_vocab and self.matcher.validate_tokens([token]) == 1:
                return token
        return draw(allowed=self.allowed())

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            error = _first_line(self.matcher.get_error())
            if ("limit" in error or "too many" in error) and "satisfy" not in error:
                # the parser's own bounds (items, lexemes), not the token: a schema that
                # recurses without end, or one too large to follow token by token
                raise GrammarError(f"the {self.grammar.describe()} is too complex to follow "
                                   f"here (the parser reached a limit: {error}); simplify it",
                                   param=self.grammar.kind)
            raise GrammarError(f"token {token} does not fit the {self.grammar.describe()}: "
                               f"{error}", param=self.grammar.kind)

    @property
    def done(self) -> bool:
        """True once nothing but the end of the sequence can follow."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """True when the text so far is a whole match (the sequence may end here)."""
        return self.matcher.is_accepting()


def constraint_for(tokenizer: Tokenizer, n_vocab: int, *, json_schema: Any = None,
                   regex: str | None = None, grammar: str | None = None) -> Constraint | None:
    """A fresh :class:`Constraint` from the keyword arguments of :func:`parse_grammar`, or
    None when none is given."""
    g = parse_grammar(json_schema=json_schema, regex=regex, grammar=grammar)
    return None if g is None else compile_grammar(g, tokenizer, n_vocab)


class Triggered:
    """A grammar that takes over once the output begins with ``trigger`` (leading whitespace
    aside): until then generation is free, and an output that can no longer begin with it
    stays free to the end. A tool call in "auto" mode is one: the model chooses between a
    plain answer and a call, and a call it starts is held to the tool's schema.

    ``make()`` gives the grammar's fresh :class:`Constraint`; that grammar matches the whole
    output from its start (leading whitespace included), the trigger first."""

    def __init__(self, make, tokenizer: Tokenizer, trigger: str):
        self._make = make
        self._tokenizer = tokenizer
        self.trigger = trigger
        self.inner: Constraint | None = None
        self.free = False
        self._tokens: list[int] = []

    @property
    def active(self) -> bool:
        return self.inner is not None

    def sample(self, draw, greedy: bool) -> int:
        if self.inner is not None:
            return self.inner.sample(draw, greedy)
        return draw()

    def consume(self, token: int) -> None:
        if self.inner is not None:
            self.inner.consume(token)
            return
        if self.free:
            return
        self._tokens.append(int(token))
        text = self._tokenizer.decode(self._tokens).lstrip()
        if text.startswith(self.trigger):
            inner = self._make()
            if inner.matcher.consume_tokens(self._tokens):
                self.inner = inner
            else:  # the tokens so far do not fit the grammar's start: leave the output free
                self.free = True
        elif not self.trigger.startswith(text):
            self.free = True

    @property
    def done(self) -> bool:
        return self.inner is not None and self.inner.done
