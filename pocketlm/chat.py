"""Chat templates: render a conversation with the model's own Jinja template.

Templates run in a sandboxed Jinja environment with the helpers Hugging Face templates expect
(``raise_exception``, ``strftime_now``, ``tojson``), and with a budget per render of loop
iterations and calls and of the text they may build. Models whose file carries no template get
their family's published format when pocketlm knows it.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from typing import Any

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
# block's) may hold: far more than any context window's text, far less than the machine's memory
MAX_STEPS = 1 << 17
MAX_TEXT = 1 << 24

# the numbers in a printf conversion ("%-*.3f", "%(name)10s"): a width or precision there is
# the size of what it builds, allocated before anything sees it
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.)", re.S)


def _printf_bound(fmt: str, values) -> int:
    """An upper bound on the characters of ``fmt % values`` (strings and numbers; a
    container's text is not counted)."""
    if isinstance(values, dict):
        values = list(values.values())
    elif not isinstance(values, tuple):
        values = (values,)
    widest, n = 0, 0
    for width, precision, kind in _PRINTF.findall(fmt):
        if kind == "%":
            continue
        n += 1
        for number in (width, precision):
            if number == "*":  # taken from the values: count the largest there
                number = max((abs(v) for v in values if isinstance(v, int)), default=0)
            widest = max(widest, int(number or 0))
    longest = max((len(v) for v in values if isinstance(v, str)), default=0)
    return len(fmt) + n * (max(widest, longest) + 400)  # 400: the digits of a float or int


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
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        return sum(len(i) for i in items if isinstance(i, str)) + len(items) * len(s)
    return None


def _environment():
    from jinja2 import nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import (
        ImmutableSandboxedEnvironment,
        SandboxedEscapeFormatter,
        SandboxedFormatter,
        SecurityError,
    )
    from jinja2.visitor import NodeTransformer
    from markupsafe import Markup

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox, with a budget of work and text for each template it compiles (one
        environment renders one conversation)."""

        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = 0
            # the filters whose result may be far larger than their input, each checked first
            self.guard("format", lambda value, *args, **kwargs: _printf_bound(
                value, kwargs or args) if isinstance(value, str) else None)
            self.guard("center", lambda value, width=80: _method_bound(
                str(value), "center", (width,), {}))
            self.guard("indent", lambda s, width=4, *rest, **kwargs: len(str(s)) + (
                str(s).count("\n") + 1) * (len(width) if isinstance(width, str) else width))
            self.guard("replace", lambda ctx, s, old, new, count=None: _method_bound(
                str(s), "replace", (str(old), str(new), -1 if count is None else count), {}))
            self.guard("join", lambda ctx, items, d="", attribute=None: _method_bound(
                str(d), "join", (items,), {}) if attribute is None else None)
            # and those that loop or fill to a count they are given: its items
            self.guard("batch", lambda value, count, fill_with=None: count)
            self.guard("slice", lambda ctx, value, count, fill_with=None: count)
            self.guard("lipsum", lambda n=5, html=True, min=20, max=100: n * (max * 14 + 20),
                       self.globals)

        def guard(self, name: str, bound, where=None) -> None:
            """The filter ``name`` (or the function in ``where``), refused when ``bound`` (of
            its arguments) is over MAX_TEXT."""
            what = f"the {name} filter" if where is None else f"{name}()"
            where = self.filters if where is None else where
            original = where[name]

            @functools.wraps(original)  # keeps Jinja's pass_eval_context mark
            def guarded(*args, **kwargs):
                if name == "join" and not isinstance(args[1], (list, tuple)):
                    args = (args[0], list(args[1]), *args[2:])  # an iterator, counted once
                self.bounded(what, bound(*args, **kwargs))
                return original(*args, **kwargs)

            where[name] = guarded

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

        def sized(self, value):
            if isinstance(value, (str, list, tuple)) and len(value) > MAX_TEXT:
                raise SecurityError(f"it built a text of {len(value)} characters or items, "
                                    f"over the {MAX_TEXT} a template may build")
            return value

        @staticmethod
        def bounded(what: str, size: int | None) -> None:
            """Refuses ``what`` before it allocates when it may build ``size`` characters
            over MAX_TEXT."""
            if size is not None and size > MAX_TEXT:
                raise SecurityError(f"{what} may build {size} characters or items, over the "
                                    f"{MAX_TEXT} a template may build")

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
                __self.bounded(f"str.{name}()", _method_bound(owner, name, args, kwargs))
            if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop
                args = (__self.iterate(args[0]), *args[1:])
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                            len(seq) * n > MAX_REPEAT:
                        raise SecurityError(f"a repetition of {len(seq)} x {n} is over the "
                                            f"{MAX_REPEAT} a template may build")
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
            and whose ``~`` results pass :meth:`sized` (environment attributes: no name the
            template sets can take their place)."""
            return self.from_string(_Budgeted().visit(self.parse(source)))

    class _Fields:
        """Each field of a str.format within MAX_TEXT (its width and precision are allocated
        before anything sees them), and all of them together too."""

        built = 0

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

        def visit_Concat(self, node):
            return _call("sized", self.generic_visit(node))

    def _call(method: str, arg):
        return nodes.Call(nodes.EnvironmentAttribute(method), [arg], [], None, None,
                          lineno=arg.lineno)

    return Environment


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
    env = _environment()(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                              indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    if not isinstance(template, str):
        raise PocketError(f"chat template must be a string, got {type(template).__name__}")
    try:
        return env.compile_budgeted(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **extra)
    except PocketError:
        raise  # raise_exception() in the template: its own message
    except Exception as exc:  # the template is code from the model file: any failure is its own
        raise PocketError(f"{template_name} failed to render ({type(exc).__name__}: {exc}); fix the "
                          "template or pass a plain prompt") from None
