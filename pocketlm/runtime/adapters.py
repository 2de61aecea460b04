"""LoRA adapters kept beside a quantized model: the product of a layer weight becomes
``x W^T + (x A^T) B^T``.

A fine-tune by low-rank adapters moves each weight by a small fraction of an INT4 step, so
folding the adapters into the weights and rounding them again can give the base model back
(docs/sentiment.md). ``pocket export RUN --keep-lora`` therefore keeps them apart: the base
weights quantized as usual, and for each adapted weight ``<weight>.lora_a`` ``[rank, in]`` and
``<weight>.lora_b`` ``[out, rank]`` (float16, the adapter's scale ``alpha / rank`` folded into
``B``), where ``<weight>`` is ``layers.N.attn.w_q`` (``w_k``, ``w_v``, ``w_o``) or
``layers.N.mlp.w_gate`` (``w_up``, ``w_down``). Both engines add the adapters' part in float32:
the numpy reference as written above, the native engine on every path (prefill, decode,
batched decode, verification), each token alike.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import FormatError

__all__ = ["ADAPTED", "LORA_A", "LORA_B", "find_adapters", "is_adapter_tensor"]

LORA_A, LORA_B = ".lora_a", ".lora_b"
# the layer weights an adapter may sit beside (the stems under layers.N.)
ADAPTED = ("attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "mlp.w_gate", "mlp.w_up",
           "mlp.w_down")
_STEM = re.compile(r"layers\.(\d+)\.(" + "|".join(re.escape(a) for a in ADAPTED) + r")")


def is_adapter_tensor(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def find_adapters(config, weights: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapters among ``weights``: ``{stem: (A [rank, in], B [out, rank])}``, the arrays
    as given (float16 or float32, not copied; empty when there are none). Every adapter tensor
    is checked: a known stem of a layer the config has, A and B together, the shapes of the
    weight beside them, one rank for all, float16 or float32, finite values; anything else is
    a FormatError naming it."""
    names = [n for n in weights if is_adapter_tensor(n)]
    if not names:
        return {}
    shapes = config.tensor_shapes()
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rank = None
    for name in sorted(names):
        if not name.endswith(LORA_A):
            continue
        stem = name[: -len(LORA_A)]
        m = _STEM.fullmatch(stem)
        if m is None or int(m.group(1)) >= config.n_layers or stem + ".weight" not in shapes:
            raise FormatError(f"tensor {name!r}: an adapter of no layer weight this model has "
                              f"(adapters sit beside layers.N.{{{','.join(ADAPTED)}}})")
        if stem + LORA_B not in weights:
            raise FormatError(f"tensor {name!r} has no {stem + LORA_B!r} beside it")
        a, b = weights[name], weights[stem + LORA_B]
        rows, cols = shapes[stem + ".weight"]
        for label, t in ((name, a), (stem + LORA_B, b)):
            if not isinstance(t, np.ndarray) or t.dtype not in (np.float16, np.float32) \
                    or t.ndim != 2:
                raise FormatError(f"tensor {label!r}: an adapter must be a float16 or float32 "
                                  f"matrix, got {getattr(t, 'dtype', type(t).__name__)} "
                                  f"{list(getattr(t, 'shape', ()))}")
        r = a.shape[0]
        if a.shape != (r, cols) or b.shape != (rows, r) or not 1 <= r <= 256:
            raise FormatError(f"adapter {stem!r}: A {list(a.shape)} and B {list(b.shape)} do "
                              f"not fit the weight [{rows}, {cols}] (A [rank, {cols}], B "
                              f"[{rows}, rank], rank 1..256)")
        if rank is not None and r != rank:
            raise FormatError(f"adapter {stem!r} has rank {r}, the others {rank}: one rank "
                              "for all")
        rank = r
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise FormatError(f"adapter {stem!r} holds values that are not finite")
        out[stem] = (a, b)
    for name in names:
        if name.endswith(LORA_B) and name[: -len(LORA_B)] not in out:
            raise FormatError(f"tensor {name!r} has no {name[:-len(LORA_B)] + LORA_A!r} "
                              "beside it")
    return out
