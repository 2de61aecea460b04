"""The head patch: the most used rows of an INT4 output head, also stored in INT8.

A 4.6-bit pack stores the output head (``lm_head.weight``, or the tied ``embed.weight``) in
INT4; its top-1 agreement with the float head is 92-94 %. A patch keeps K of its rows (those the
calibration set uses most) a second time, in INT8, and their logits replace the INT4 head's:

* ``head_patch.weight``: an INT8 group-32 :class:`~pocketlm.quant.QuantTensor`
  ``[K, d_model]``, row ``k`` the head's row ``ids[k]``;
* ``head_patch.ids``: int32 ``[K]``, strictly increasing, each ``< vocab_size``;
* ``logits[:, ids] = x @ dequantize(head_patch.weight)^T``, after the head's product, on every
  path that computes the head (prefill, decode, batched decode, verification).

Measured in ``benchmarks/head_patch.py`` (docs/quantization.md): 99 % top-1 agreement on
held-out English and Chinese for 2k-16k rows (0.3-0.9 bits per head weight). The names and
checks live here, once: the deploy file, the runtime and the pack use them.
"""

from __future__ import annotations

import numpy as np

from .quant import QuantTensor

PATCH = "head_patch.weight"
PATCH_IDS = "head_patch.ids"
PATCH_GROUP = 32  # the INT8 layout's group, the one the engine's head tiles take


def head_patch_of(weights: dict, vocab_size: int, d_model: int
                  ) -> tuple[QuantTensor, np.ndarray] | None:
    """The model's head patch (weight, ids) checked, or None when it has none. Raises
    ValueError naming the tensor for one alone, a weight not INT8 group 32 ``[K, d_model]``,
    or ids not int32 ``[K]``, strictly increasing, in ``0..vocab_size - 1``."""
    w, ids = weights.get(PATCH), weights.get(PATCH_IDS)
    if w is None and ids is None:
        return None
    if w is None or ids is None:
        have, lack = (PATCH, PATCH_IDS) if ids is None else (PATCH_IDS, PATCH)
        raise ValueError(f"tensor {have!r} needs {lack!r} beside it (a head patch is both)")
    check_head_patch(w, ids, vocab_size, d_model)
    return w, ids


def check_head_patch(w, ids, vocab_size: int, d_model: int) -> None:
    """Raise ValueError naming the tensor unless ``w`` is an INT8 group-32 QuantTensor
    ``[K, d_model]`` and ``ids`` int32 ``[K]``, strictly increasing, each < vocab_size."""
    if not isinstance(w, QuantTensor) or w.kind != "int8" or w.group_size != PATCH_GROUP:
        found = (f"{w.kind} group {w.group_size}" if isinstance(w, QuantTensor)
                 else type(w).__name__)
        raise ValueError(f"tensor {PATCH!r} must be INT8 group {PATCH_GROUP}, got {found}")
    if len(w.shape) != 2 or w.shape[1] != d_model or w.shape[0] < 1:
        raise ValueError(f"tensor {PATCH!r} has shape {tuple(w.shape)}, expected "
                         f"(K, {d_model}) with K >= 1 (d_model columns)")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 or ids.ndim != 1:
        found = f"{ids.dtype} {ids.shape}" if isinstance(ids, np.ndarray) \
            else type(ids).__name__
        raise ValueError(f"tensor {PATCH_IDS!r} must be a 1-D int32 array, got {found}")
    if ids.shape[0] != w.shape[0]:
        raise ValueError(f"tensor {PATCH_IDS!r} has {ids.shape[0]} ids for the "
                         f"{w.shape[0]} rows of {PATCH!r}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"tensor {PATCH_IDS!r} holds ids out of 0..{vocab_size - 1} "
                         f"(found {int(ids.min())}..{int(ids.max())})")
    if ids.shape[0] > 1 and not (np.diff(ids) > 0).all():
        at = int(np.nonzero(np.diff(ids) <= 0)[0][0])
        raise ValueError(f"tensor {PATCH_IDS!r} must be strictly increasing; ids[{at}] = "
                         f"{int(ids[at])} then {int(ids[at + 1])}")


class PatchedHead:
    """The head's float32 values with the patch's rows written over them, read a block of
    rows at a time (``head[r0:r1]``): what exporters write for a patched head."""

    def __init__(self, head, w: QuantTensor, ids: np.ndarray):
        self.head, self.w, self.ids = head, w, np.asarray(ids, np.int64)
        self.shape = tuple(head.shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        r0, r1, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("a patched head is read in contiguous blocks of rows")
        h = self.head
        out = h.dequantize(slice(r0, r1)) if isinstance(h, QuantTensor) else \
            np.array(h[r0:r1], np.float32)
        inside = (self.ids >= r0) & (self.ids < r1)
        if inside.any():
            out[self.ids[inside] - r0] = self.w.dequantize(np.nonzero(inside)[0])
        return out


def patched_head(head: np.ndarray, w: QuantTensor, ids: np.ndarray) -> np.ndarray:
    """The float32 head ``[vocab, d_model]`` with rows ``ids`` replaced by the patch's values
    (what the patched head computes, as one matrix: exporters, agreement measurements)."""
    out = np.array(head, np.float32, copy=True)
    out[ids] = w.dequantize()
    return out


def patched_head_for_export(weights: dict, config):
    """For exporters, whose formats hold one head: the patch (if any) taken out of
    ``weights`` and the head replaced by a :class:`PatchedHead` under ``lm_head.weight``; a
    tied head becomes untied, so that the embedding's lookups keep the INT4 rows. Returns the
    config to write (untied where a patch was applied, else ``config`` itself)."""
    import dataclasses

    patch = head_patch_of(weights, config.vocab_size, config.d_model)
    if patch is None:
        return config
    head = "lm_head.weight" if "lm_head.weight" in weights else "embed.weight"
    weights["lm_head.weight"] = PatchedHead(weights[head], *patch)
    del weights[PATCH], weights[PATCH_IDS]
    return dataclasses.replace(config, tie_embeddings=False)
