"""Chat templates: render a conversation with the model's own Jinja template.

Templates run in a sandboxed Jinja environment with the helpers Hugging Face templates expect
(``raise_exception``, ``strftime_now``, ``tojson``), and with a budget per render of loop
iterations and calls and of the text they may build, the text of a list or a dict they print,
join, format or serialize included. Models whose file carries no template get their family's
published format when pocketlm knows it.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from .errors import PocketError, UnsupportedError

# Gemma 3's turn format (user/model turns; a system message is folded into the first user turn).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] + '\n\n' -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if loop.first %}{{ system }}{% endif -%}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)

FAMILY_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}


def _raise(message: str):
    raise PocketError(f"chat template: {message}")


# what a template's `*` may build (characters or items) and the bits a `**` may reach: the
# template is code from the model file, and "{{ messages[0].content * 10**9 }}" took the memory
# of the machine (Jinja's sandbox limits range() to 100,000 items, not these)
MAX_REPEAT = 1 << 20
MAX_POWER_BITS = 1 << 16
# the work of one render: loop iterations and calls together (two nested range() loops ran
# 10**10 iterations, a macro that calls itself twice 2**depth; the shipped templates take about
# one per message, and a render that goes over fails in a second or two), and the characters
# (or items) that a `+`, a `~` or a text a template writes (its output, a macro's, a set
# block's) may hold: far more than any context window's text, far less than the machine's memory.
# A container turned into text (printed, joined, formatted, serialized) counts too, before its
# text is built: "{{ [[s] * 1000] * 1000 }}" holds two lists and a string, and its text is a
# million copies of s
MAX_STEPS = 1 << 17
MAX_TEXT = 1 << 24

# the numbers in a printf conversion ("%-*.3f", "%(name)10s"): a width or precision there is
# the size of what it builds, allocated before anything sees it
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.)", re.S)


# the characters of a string that its repr() or its JSON may escape, each into at most six
# (ASCII controls, quotes, backslashes, the <>& an HTML-safe JSON escapes, all of non-ASCII),
# and those escaped into twelve (beyond the BMP: a JSON surrogate pair)
_ESCAPED = re.compile(r"""[\x00-\x1f\x7f-\U0010ffff"'\\<>&]""")
_ASTRAL = re.compile(r"[\U00010000-\U0010ffff]")
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# the filter that counts a value turned into text (a name no template can write)
_COUNTED = "counted text"


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's ``tojson`` (its arguments too: templates written for it pass them)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _str_size(s: str) -> int:
    """An upper bound on the characters of ``repr(s)`` and of ``s`` in JSON."""
    n = len(s)
    size = n + 2 + 5 * (n - len(_ESCAPED.sub("", s)))
    return size if s.isascii() else size + 6 * (n - len(_ASTRAL.sub("", s)))


def _text_sizer():
    """A function giving an upper bound on the characters of ``str(value)``, ``repr(value)``
    and ``value`` in JSON, with how deep its containers nest and how far pprint may indent a
    line within it: ``(characters, depth, indent)``.

    Each object is counted once however often it recurs, in all the values the function is
    given ("[[s] * 1000] * 1000" takes two thousand steps, not a million); a container stops
    counting once it is past MAX_TEXT, and one that holds itself (a namespace set into itself)
    is refused: counted so, its text has no bound."""
    from jinja2.sandbox import SecurityError
    from jinja2.utils import Namespace

    known: dict[int, tuple[int, int, int]] = {}
    open_: set[int] = set()

    def bound(x) -> tuple[int, int, int]:
        key = id(x)
        if key in known:
            return known[key]
        kind = type(x)
        if isinstance(x, str):
            size = (_str_size(x) + (0 if kind is str else len(kind.__name__) + 2), 0, 0)
        elif isinstance(x, (bool, float)) or x is None:
            size = (24, 0, 0)
        elif isinstance(x, int):
            size = (x.bit_length() * 31 // 100 + 2, 0, 0)  # its digits (log10(2) < 0.31)
        elif isinstance(x, (bytes, bytearray)):
            size = (4 * len(x) + len(kind.__name__) + 3, 0, 0)
        elif isinstance(x, (list, tuple, set, frozenset, dict, Namespace, *_VIEWS)):
            if key in open_:
                raise SecurityError(f"it turned into text a {kind.__name__} that holds itself")
            open_.add(key)
            size = container(x, kind)
            open_.discard(key)
        else:  # an object a template cannot fill (a macro, a loop, undefined): its own text
            size = (len(repr(x)), 0, 0)
        known[key] = size
        return size

    def container(x, kind) -> tuple[int, int, int]:
        prefix = len(kind.__name__) + 4  # "frozenset({", "dict_items([", "])"
        chars, depth, reach = prefix, 0, 0
        if isinstance(x, Namespace):
            chars, depth, reach = bound(object.__getattribute__(x, "_Namespace__attrs"))
            return chars + prefix, depth, reach
        if isinstance(x, (dict, _VIEWS[2])):  # per entry "key: value, " or "(key, value), "
            for k, v in (x.items() if isinstance(x, dict) else x.mapping.items()):
                key_chars = (known.get(id(k)) or bound(k))[0]
                c, d, r = known.get(id(v)) or bound(v)
                chars += key_chars + c + 6  # 6: JSON quotes a key that is not a string
                depth, reach = max(depth, d), max(reach, key_chars + 2 + r)
                if chars > MAX_TEXT:
                    break
        else:
            if isinstance(x, tuple):  # a named tuple's "name=" for each field
                chars += sum(len(f) + 1 for f in getattr(kind, "_fields", ()))
            for item in x:
                c, d, r = known.get(id(item)) or bound(item)
                chars += c + 2
                depth, reach = max(depth, d), max(reach, r)
                if chars > MAX_TEXT:
                    break
        return chars, depth + 1, reach + prefix

    return bound


def _text_bound(value) -> tuple[int, int, int]:
    """See :func:`_text_sizer`."""
    return _text_sizer()(value)


def _text_size(value) -> int:
    """An upper bound on the characters of ``str(value)`` (see :func:`_text_bound`)."""
    return _text_bound(value)[0]


def _json_bound(value, indent=None, separators=None) -> int:
    """An upper bound on the characters of ``value`` in JSON (non-ASCII escaped or not), each
    line indented by ``indent`` per level (a line holds at least one character of the compact
    text), with ``separators`` (a pair of strings) in place of ", " and ": "."""
    chars, depth, _ = _text_bound(value)
    if isinstance(separators, (list, tuple)):  # at most one of each per character
        chars *= 1 + sum(len(x) for x in separators if isinstance(x, str))
    if indent is None:
        return chars
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    return chars * (2 + max(width, 0) * depth)


def _pprint_bound(value) -> int:
    """An upper bound on the characters of ``pprint.pformat(value)``: a line holds at least
    one character of the compact text, and is indented by at most the prefixes and keys it
    is nested in (a long string is split into a line for each of its words)."""
    chars, _, reach = _text_bound(value)
    return chars * (6 + reach)


def _join_bound(sep: int, items) -> int | None:
    """An upper bound on the characters of ``items`` joined with a separator of ``sep``
    characters: each string item's own, any other's text."""
    if isinstance(items, str):
        return len(items) * (sep + 1)
    if not isinstance(items, (list, tuple)):
        return None
    others = [i for i in items if not isinstance(i, str)]
    return (sum(len(i) for i in items if isinstance(i, str)) + len(items) * sep
            + (_text_size(others) if others else 0))


def _sum_bound(items, start) -> int | None:
    """The items a ``sum`` of sequences copies: each partial sum is a new one, so a sum of n
    one-item lists copies n * n / 2 items (None: numbers)."""
    if not isinstance(start, (list, tuple, str)) or not isinstance(items, (list, tuple)):
        return None
    running = copied = len(start)
    for item in items:
        running += len(item) if isinstance(item, (list, tuple, str)) else 1
        copied += running
        if copied > MAX_TEXT:
            break
    return copied


def _printf_bound(fmt: str, values) -> int:
    """An upper bound on the characters of ``fmt % values``."""
    if isinstance(values, tuple):
        size = _text_sizer()
        longest = max((size(v)[0] for v in values), default=0)
    else:  # one value, or a mapping of them ("%s" takes all of it, "%(name)s" one)
        longest = _text_size(values)
        values = list(values.values()) if isinstance(values, dict) else (values,)
    widest, n = 0, 0
    for width, precision, kind in _PRINTF.findall(fmt):
        if kind == "%":
            continue
        n += 1
        for number in (width, precision):
            if number == "*":  # taken from the values: count the largest there
                number = max((abs(v) for v in values if isinstance(v, int)), default=0)
            widest = max(widest, int(number or 0))
    return len(fmt) + n * (max(widest, longest) + 400)  # 400: the digits of a float


def _method_bound(s: str, name: str, args: tuple, kwargs: dict) -> int | None:
    """An upper bound on the characters of ``s.name(*args, **kwargs)`` for the str methods
    whose result may be far larger than ``s`` and its arguments (None: not one of them)."""
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return max(len(s), width) if isinstance(width, int) else None
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t") * size if isinstance(size, int) else None
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[:2]
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        return len(s) + n * len(new)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(s) * max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
    if name == "join" and args:
        return _join_bound(len(s), args[0])
    return None


# the filters and tests whose value and arguments are not counted as text: those that never
# turn them into text ("messages | length" in a loop stays one step), and join, which counts its
# items itself (a string item's own text, not its repr)
_UNCOUNTED_FILTERS = frozenset([
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "join", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"])
_UNCOUNTED_TESTS = frozenset([
    "defined", "undefined", "filter", "test", "none", "boolean", "false", "true", "integer",
    "float", "string", "mapping", "number", "sequence", "iterable", "callable", "sameas",
    "escaped", "in", "==", "eq", "equalto", "!=", "ne", ">", "gt", "greaterthan", ">=", "ge",
    "<", "lt", "lessthan", "<=", "le"])
# the filters whose result is a string, whatever they are given
_TEXT_FILTERS = frozenset([
    "capitalize", "center", "e", "escape", "filesizeformat", "forceescape", "format", "indent",
    "join", "lower", "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim",
    "truncate", "upper", "urlencode", "urlize", "wordwrap", "xmlattr"])


@functools.cache
def _generation_tag():
    """Hugging Face's ``{% generation %} ... {% endgeneration %}`` (it marks the assistant's
    tokens for training masks): its body, rendered as it is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


@functools.cache
def _environment():
    from collections.abc import Iterator

    from jinja2 import nodes
    from jinja2.runtime import LoopContext, markup_join, str_join
    from jinja2.sandbox import (
        ImmutableSandboxedEnvironment,
        SandboxedEscapeFormatter,
        SandboxedFormatter,
        SecurityError,
    )
    from jinja2.utils import Namespace
    from jinja2.visitor import NodeTransformer
    from markupsafe import Markup

    # the values whose text may be far larger than they are: containers (their text holds their
    # items' repr, however often one recurs) and bytes
    textual = (list, tuple, set, frozenset, dict, bytes, bytearray, Namespace, *_VIEWS)

    def printed(value):
        """``value``, about to be turned into text: refused first when it is a container whose
        text may be over MAX_TEXT."""
        if type(value) is not str and isinstance(value, textual):
            Environment.bounded(f"the text of a {type(value).__name__}", _text_size(value))
        return value

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox, with a budget of work and text for each template it compiles (one
        environment renders one conversation)."""

        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = 0
            # what {{ }} writes, and what a filter or a test takes (see _Budgeted)
            self.filters[_COUNTED] = printed
            self.filters["tojson"] = _tojson
            self.globals["raise_exception"] = lambda message: _raise(printed(message))
            self.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            # the filters whose result may be far larger than their input, each checked first
            self.guard("format", lambda value, *args, **kwargs: _printf_bound(
                value, kwargs or args) if isinstance(value, str) else None)
            self.guard("center", lambda value, width=80: _method_bound(
                str(value), "center", (width,), {}))
            self.guard("indent", lambda s, width=4, *rest, **kwargs: len(str(s)) + (
                str(s).count("\n") + 1) * (len(width) if isinstance(width, str) else width))
            self.guard("replace", lambda ctx, s, old, new, count=None: _method_bound(
                str(s), "replace", (str(old), str(new), -1 if count is None else count), {}))
            # (a join's items count as the text it makes of them: a string's own, not its repr)
            self.guard("join", lambda ctx, items, d="", attribute=None: _join_bound(
                len(d) if isinstance(d, str) else _text_size(d), items) if attribute is None
                else _text_size(items) + len(items) * _text_size(d))
            self.guard("tojson", lambda value, ensure_ascii=False, indent=None, separators=None,
                       sort_keys=False: _json_bound(value, indent, separators))
            self.guard("pprint", lambda value: _pprint_bound(value))
            self.guard("urlencode", lambda value: 12 * (  # %XX for each byte of UTF-8
                len(value) if isinstance(value, str) else _text_size(value)))
            self.guard("wordwrap", lambda ctx, s, width=79, break_long_words=True,
                       wrapstring=None, *rest, **kwargs: None if wrapstring is None else
                       len(str(s)) * (1 + len(str(wrapstring))))
            # and those that loop or fill to a count they are given: its items
            self.guard("sum", lambda env, items, attribute=None, start=0: _sum_bound(
                items, start) if attribute is None else None)
            self.guard("list", lambda ctx, value: len(value) if isinstance(value, str) else None,
                       limit=MAX_REPEAT)  # a string: an object for each of its characters
            self.guard("batch", lambda value, count, fill_with=None: count)
            self.guard("slice", lambda ctx, value, count, fill_with=None: count)
            self.guard("lipsum", lambda n=5, html=True, min=20, max=100: n * (max * 14 + 20),
                       self.globals)
            # the tests that format a string with `%`
            for name in ("odd", "even"):
                self.guard(name, lambda value: _printf_bound(value, 2) if isinstance(
                    value, str) else None, self.tests)
            self.guard("divisibleby", lambda value, num: _printf_bound(value, num) if isinstance(
                value, str) else None, self.tests)

        def guard(self, name: str, bound, where=None, limit: int = MAX_TEXT) -> None:
            """The filter ``name`` (or the test or function in ``where``), refused when
            ``bound`` (of its arguments) is over ``limit``."""
            where = self.filters if where is None else where
            what = f"the {name} filter" if where is self.filters else (
                f"the {name} test" if where is self.tests else f"{name}()")
            original = where[name]
            # the position of the value (after the context a pass_context filter takes first)
            first = 1 if getattr(original, "jinja_pass_arg", None) else 0
            iterates = (str, list, tuple) if name in ("join", "sum") else None

            def guarded(*args, **kwargs):
                if len(args) > first and (iterates and not isinstance(args[first], iterates) or
                                          name == "urlencode" and isinstance(args[first],
                                                                             Iterator)):
                    # an iterator, a set or a mapping: its items, counted once
                    args = (*args[:first], list(args[first]), *args[first + 1:])
                self.bounded(what, bound(*args, **kwargs), limit)
                return original(*args, **kwargs)

            guarded.__dict__.update(getattr(original, "__dict__", {}))  # Jinja's pass_* mark
            where[name] = guarded

        def call_filter(self, name, value, args=None, kwargs=None, context=None,
                        eval_ctx=None):
            """A filter called by its name (``map``), its value and arguments counted as in
            a filter the template applies (see :class:`_Budgeted`); each call a step of the
            render's budget ("s | map('upper')" over sixteen million characters)."""
            self.step()
            if name not in _UNCOUNTED_FILTERS:
                for v in (value, *(args or ()), *(kwargs or {}).values()):
                    printed(v)
            return super().call_filter(name, value, args, kwargs, context, eval_ctx)

        def call_test(self, name, value, args=None, kwargs=None, context=None, eval_ctx=None):
            """A test called by its name (``select``), counted as :meth:`call_filter`."""
            self.step()
            if name not in _UNCOUNTED_TESTS:
                for v in (value, *(args or ()), *(kwargs or {}).values()):
                    printed(v)
            return super().call_test(name, value, args, kwargs, context, eval_ctx)

        def step(self) -> None:
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise SecurityError(f"it took over the {MAX_STEPS} loop iterations and calls "
                                    "a render may take")

        def iterate(self, items):
            """Every loop's items come through here (the template compiles so)."""
            for item in items:
                self.step()
                yield item

        def joined(self, values: tuple, context) -> str:
            """A ``~``'s operands joined (escaped where the template autoescapes), refused
            first when their text may be over MAX_TEXT."""
            n, size = 0, None
            for value in values:
                if isinstance(value, str):
                    n += len(value)
                else:
                    size = size or _text_sizer()
                    n += size(value)[0]
            self.bounded("a ~", n)
            eval_ctx = context.eval_ctx
            return (markup_join if eval_ctx.volatile or eval_ctx.autoescape else str_join)(values)

        @staticmethod
        def bounded(what: str, size: int | None, limit: int = MAX_TEXT) -> None:
            """Refuses ``what`` before it allocates when it may build ``size`` characters
            (or items) over ``limit``."""
            if size is not None and size > limit:
                raise SecurityError(f"{what} may build {size} characters or items, over the "
                                    f"{limit} a template may build")

        def concat(self, pieces) -> str:
            """What a template writes, joined (its output, a macro's, a set block's)."""
            out, n = [], 0
            for piece in pieces:
                n += len(piece)
                if n > MAX_TEXT:
                    raise SecurityError(f"it wrote over the {MAX_TEXT} characters a template "
                                        "may write")
                out.append(piece)
            return "".join(out)

        def call(__self, __context, __obj, *args, **kwargs):
            # Jinja's names: a template's call may pass any keyword, "self" included
            __self.step()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                name = getattr(__obj, "__name__", "")
                if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                    args = (list(args[0]), *args[1:])  # an iterator or a mapping, counted once
                __self.bounded(f"str.{name}()", _method_bound(owner, name, args, kwargs))
            if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop
                args = (__self.iterate(args[0]), *args[1:])
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple, bytes)) and isinstance(n, int) and \
                            len(seq) * n > MAX_REPEAT:
                        raise SecurityError(f"a repetition of {len(seq)} x {n} is over the "
                                            f"{MAX_REPEAT} a template may build")
                if isinstance(left, int) and isinstance(right, int) and \
                        left.bit_length() + right.bit_length() > MAX_POWER_BITS:
                    # a number squared in a loop doubles its digits each time
                    raise SecurityError("a product of integers of "
                                        f"{left.bit_length()} and {right.bit_length()} bits is "
                                        "larger than a template may compute")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, type(left)) and \
                        len(left) + len(right) > MAX_TEXT:
                    raise SecurityError(f"a sum of {len(left)} + {len(right)} characters or "
                                        f"items is over the {MAX_TEXT} a template may build")
            elif operator == "%":
                if isinstance(left, str):
                    self.bounded("a % format", _printf_bound(left, right))
            elif isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} is larger than a template may compute")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value) -> bool:
            # no bytes: the text budget counts characters, and nothing a chat template writes
            # needs them (b"x" * n, b"%999999999d" % 1 and bytes.ljust would go uncounted)
            if attr in ("encode", "to_bytes"):
                return False
            return super().is_safe_attribute(obj, attr, value)

        def wrap_str_format(self, value):
            """str.format and str.format_map, formatted by :class:`_Formatter` (Jinja's
            sandboxed formatter, with a budget of text)."""
            if super().wrap_str_format(value) is None:
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"
            formatter = _EscapeFormatter(self, escape=fmt.escape) if isinstance(fmt, Markup) \
                else _Formatter(self)

            def wrapper(*args, **kwargs):
                if is_map:
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one argument")
                    args, kwargs = (), args[0]
                formatter.built = 0
                return type(fmt)(formatter.vformat(fmt, args, kwargs))

            return functools.update_wrapper(wrapper, value)

        def compile_budgeted(self, source: str):
            """``source`` as a template whose loops take their items through :meth:`iterate`
            and whose ``~`` operands are joined by :meth:`joined` (environment attributes: no
            name the template sets can take their place), and whose ``{{ }}``, filters and tests
            take what may be a container through the ``_COUNTED`` filter before it is text."""
            return self.from_string(_Budgeted().visit(self.parse(source)))

    class _Fields:
        """Each field of a str.format within MAX_TEXT (its width and precision are allocated
        before anything sees them), and all of them together too."""

        built = 0

        def convert_field(self, value, conversion):
            if conversion in ("r", "a") or not isinstance(value, (str, int, float)):
                Environment.bounded("a format field", self.built + _text_size(value))
            return super().convert_field(value, conversion)

        def format_field(self, value, spec: str) -> str:
            Environment.bounded("a format field", max(map(int, re.findall(r"\d+", spec)),
                                                      default=0))
            text = super().format_field(value, spec)
            self.built += len(text)
            Environment.bounded("str.format()", self.built)
            return text

    class _Formatter(_Fields, SandboxedFormatter):
        pass

    class _EscapeFormatter(_Fields, SandboxedEscapeFormatter):
        pass

    class _Budgeted(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = _call("iterate", node.iter)
            return node

        def visit_Output(self, node):
            texts = [_is_text(child) for child in node.nodes]
            node = self.generic_visit(node)
            node.nodes = [child if text or isinstance(child, nodes.TemplateData) else
                          _count(child) for child, text in zip(node.nodes, texts)]
            return node

        def visit_Filter(self, node):
            return _counted(self.generic_visit(node), _UNCOUNTED_FILTERS)

        def visit_Test(self, node):
            return _counted(self.generic_visit(node), _UNCOUNTED_TESTS)

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            try:
                node.as_const()
                return node  # the template's own constants, joined as it compiles
            except nodes.Impossible:
                pass
            return _call("joined", nodes.Tuple(node.nodes, "load", lineno=node.lineno),
                         nodes.ContextReference(lineno=node.lineno))

    def _counted(node, uncounted: frozenset):
        """A filter or test that may turn its value or arguments into text, each of them
        (constants aside) passed through the ``_COUNTED`` filter first: a direct call, far
        cheaper than a wrapper around the filter."""
        if node.name not in uncounted:
            node.node = _count(node.node)
            node.args = [_count(arg) for arg in node.args]
            for keyword in node.kwargs:
                keyword.value = _count(keyword.value)
            node.dyn_args, node.dyn_kwargs = _count(node.dyn_args), _count(node.dyn_kwargs)
        return node

    def _is_text(node) -> bool:
        """Whether ``node`` is a string when it is not an error (no container to count)."""
        if isinstance(node, nodes.Const):
            return isinstance(node.value, str)
        if isinstance(node, nodes.Filter):
            return node.name in _TEXT_FILTERS
        if isinstance(node, nodes.Add):  # a string added to anything but a string fails
            return _is_text(node.left) or _is_text(node.right)
        if isinstance(node, nodes.Mod):
            return _is_text(node.left)
        if isinstance(node, nodes.CondExpr):
            return _is_text(node.expr1) and node.expr2 is not None and _is_text(node.expr2)
        return isinstance(node, nodes.Concat)

    def _count(node):
        if node is None or isinstance(node, nodes.Const) and not isinstance(node.value, textual):
            return node  # a filter block's text, or the template's own constant
        return nodes.Filter(node, _COUNTED, [], [], None, None, lineno=node.lineno,
                            environment=node.environment)

    def _call(method: str, *args):
        return nodes.Call(nodes.EnvironmentAttribute(method), list(args), [], None, None,
                          lineno=args[0].lineno)

    return Environment


# the templates compiled in each thread, the most recently used last: compiling one takes
# milliseconds, a short chat renders in a fraction of that (each thread its own environments,
# since an environment counts the work of the render it runs)
_compiled_here = threading.local()
MAX_COMPILED = 8


def _compiled(template: str):
    """``template`` compiled in its own sandbox (see :func:`_environment`), its work budget
    reset for a new render."""
    cache = getattr(_compiled_here, "templates", None)
    if cache is None:
        cache = _compiled_here.templates = OrderedDict()
    found = cache.get(template)
    if found is None:
        env = _environment()(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        found = cache[template] = (env, env.compile_budgeted(template))
        if len(cache) > MAX_COMPILED:
            cache.popitem(last=False)
    cache.move_to_end(template)
    env, compiled = found
    env.steps = 0
    return compiled


def render(template: str | None, messages: list[dict[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True,
           template_name: str = "the model's chat template", **extra: Any) -> str:
    """``messages`` rendered with ``template`` (``extra``: more template variables);
    ``template_name`` says whose template it is in errors.

    The template is code from the model file: it runs in a sandbox, with a budget of loop
    iterations and calls (``MAX_STEPS``) and of the text it may build (``MAX_TEXT``) per
    render; one that goes over, or fails in any other way, is a :class:`PocketError`."""
    if not template:
        raise UnsupportedError("this model has no chat template; use `pocket run` / "
                               "generate() with a plain prompt instead")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise PocketError("messages must be a list of {'role': str, 'content': str} objects")
    if not isinstance(template, str):
        raise PocketError(f"chat template must be a string, got {type(template).__name__}")
    # tools and documents are None unless given, as Hugging Face renders them: a template
    # that asks `tools is not none` (Mistral's) wrote an empty tool list into every prompt
    extra = {"tools": None, "documents": None, **extra}
    try:
        return _compiled(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **extra)
    except PocketError:
        raise  # raise_exception() in the template: its own message
    except Exception as exc:  # the template is code from the model file: any failure is its own
        raise PocketError(f"{template_name} failed to render ({type(exc).__name__}: {exc}); fix the "
                          "template or pass a plain prompt") from None


class MarkedChat(NamedTuple):
    """A chat whose message texts spell control tokens, each such spelling replaced by a
    marker."""

    messages: list[dict[str, Any]]  # the chat, each control-token spelling a marker
    contents: list[str]  # the texts replaced, in marker order
    nonce: str  # the markers' nonce: no message text holds it
    example: str  # one control token's text found, for errors


def mark_control_text(messages: Any, tokenizer, template: str | None = None
                      ) -> MarkedChat | None:
    """None when no message's content spells a control token's text (``<|im_end|>``, or an
    added token ``template`` writes, see ``Tokenizer.control_finder``); else the chat with
    each such spelling replaced by a marker, for :func:`encode_rendered`: the text a user
    wrote is tokenized as text, so it cannot close a turn or open one of its own (OpenAI's
    API treats it so). An assistant's message, the model's own words, is searched for control
    tokens only: the added tokens a template writes are the model's to write (Qwen3's
    ``<think>``, which its template also looks for in the history). Only the spellings are
    marked: the rest of the content reaches the
    template as it is, so a template that trims it, or writes it as JSON (``tojson``:
    escaped quotes and newlines), treats it as any other message's. Inference
    (``PocketModel.chat_ids``) and training (``SFTData``) both encode chats so, so a tuned
    model learns the prompts it will be given."""
    if not isinstance(messages, list):
        return None
    finders = {False: tokenizer.control_finder(template), True: tokenizer.control_finder(None)}
    found = {i: finders[m.get("role") == "assistant"].finditer(m["content"])
             for i, m in enumerate(messages)
             if isinstance(m, dict) and isinstance(m.get("content"), str)}
    if not any(found.values()):
        return None
    import secrets

    nonce = secrets.token_hex(8)
    marked, contents = list(messages), []
    for i, spans in found.items():
        if not spans:
            continue
        text, out, pos = messages[i]["content"], [], 0
        for at, control in spans:
            out += [text[pos:at], f"\ue000{nonce}{len(contents)}\ue001"]
            contents.append(control)
            pos = at + len(control)
        out.append(text[pos:])
        marked[i] = {**messages[i], "content": "".join(out)}
    example = next(spans for spans in found.values() if spans)[0][1]
    return MarkedChat(marked, contents, nonce, example)


def non_text_part(parts: list) -> int | None:
    """The index of the first of OpenAI's content parts that is not a text part
    (``{"type": "text", "text": str}``), or None when all are (their text is the message's);
    the server and the Python API read content parts alike."""
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            return j
    return None


def refuse_control_text(messages: Any, template_args: dict[str, Any], tokenizer,
                        template: str | None = None) -> None:
    """A :class:`PocketError` naming where control-token text (``<|im_end|>``) appears in what a
    template renders besides a message's content: a role, a name, an earlier tool call's name
    or arguments, the tools offered (their names, descriptions, schemas). Contents are kept
    as text (:func:`mark_control_text`); these are rendered in many ways (compared, written as
    JSON), so cannot be, and would be read as those tokens: a tool description could close
    the system turn and open one of its own."""
    todo: list[tuple[Any, str]] = [(v, k) for k, v in template_args.items()]
    if isinstance(messages, list):
        todo += [(v, f"messages[{i}].{k}") for i, m in enumerate(messages)
                 if isinstance(m, dict) for k, v in m.items() if k != "content"]
    while todo:  # a stack, not recursion: a tool's schema may be nested deeply
        value, where = todo.pop()
        if isinstance(value, str):
            found = tokenizer.control_text_in(value, template)
            if found is not None:
                raise PocketError(f"{where} holds control-token text ({found!r}), which the "
                                  "chat template would read as that token; remove it",
                                  param=where.removesuffix(" (a key)"))
        elif isinstance(value, dict):
            for k, v in value.items():
                todo += [(k, f"{where} (a key)"), (v, f"{where}.{k}")]
        elif isinstance(value, (list, tuple)):
            todo += [(v, f"{where}[{i}]") for i, v in enumerate(value)]


def encode_rendered(tokenizer, text: str, marked: MarkedChat | None) -> list[int]:
    """The ids (no BOS) of ``text``, a chat (or part of one) rendered from ``marked.messages``:
    the template's own control-token texts are those tokens, each marker its control-token
    spelling tokenized as text. A template that altered a marker (sliced or rewrote the
    content, changed its case) cannot be followed: refused, not guessed."""
    if marked is None:
        return tokenizer.encode(text, add_bos=False, special=True)
    parts = re.split(f"\ue000{marked.nonce}(\\d+)\ue001", text)
    # what is left of a marker the template cut into or rewrote: its nonce's first or last ten
    # characters, in any case (an upper filter, a slice; by chance, one place of a text in
    # 16**10 spells them)
    ends = (marked.nonce[:10].lower(), marked.nonce[-10:].lower())
    if any(end in p.lower() for p in parts[::2] for end in ends):
        raise PocketError("a message's content holds control-token text (such as "
                          f"{marked.example!r}) and the chat template alters it, so it cannot "
                          "be kept as plain text; remove that text")
    # [text, whether it is the template's]: the template's parts, each marker's spelling
    pieces = [[part, True] if i % 2 == 0 else [marked.contents[int(part)], False]
              for i, part in enumerate(parts)]
    for i in range(1, len(pieces), 2):
        # the spaces before a spelling go with it, as in the text it is read as (" <|" is one
        # piece of a byte-level BPE: "hello <|im_end|>" kept "hello" and " <|")
        before = pieces[i - 1][0]
        spaces = len(before) - len(before.rstrip(" "))
        if spaces:
            pieces[i - 1][0], pieces[i][0] = before[:-spaces], before[-spaces:] + pieces[i][0]
    ids: list[int] = []
    for piece, template in pieces:
        if template:
            if piece:
                ids += tokenizer.encode(piece, add_bos=False, special=True)
        else:
            ids += tokenizer.encode_text(piece)
    return ids
