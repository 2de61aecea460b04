"""Chat templates: render a conversation with the model's own Jinja template.

Templates run in a sandboxed Jinja environment with the helpers Hugging Face templates expect
(``raise_exception``, ``strftime_now``, ``tojson``). Models whose file carries no template get
their family's published format when pocketlm knows it.
"""

from __future__ import annotations

import datetime
import json
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


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                            len(seq) * n > MAX_REPEAT:
                        raise SecurityError(f"a repetition of {len(seq)} x {n} is over the "
                                            f"{MAX_REPEAT} a template may build")
            elif isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} is larger than a template may compute")
            return super().call_binop(context, operator, left, right)

    return Environment


def render(template: str | None, messages: list[dict[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
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
        return env.from_string(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **extra)
    except PocketError:
        raise  # raise_exception() in the template: its own message
    except Exception as exc:  # the template is code from the model file: any failure is its own
        raise PocketError(f"the model's chat template failed to render ({type(exc).__name__}: "
                          f"{exc}); fix the template or pass a plain prompt") from None
