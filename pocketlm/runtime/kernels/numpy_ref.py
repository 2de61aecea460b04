"""Numpy reference kernels: the specification every native kernel must match.

Shapes: activations are float32 ``[n_tokens, features]`` (C order). A weight is either a
float32 ``[out, in]`` array or a :class:`pocketlm.quant.QuantTensor` of the same logical shape.
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelError
from ...quant import QuantTensor, unpack_int4, unpack_int5

_ROWS_PER_CHUNK = 2048  # rows of a quantized weight widened to float32 at a time


def matmul_int4_ref(x: np.ndarray, w: QuantTensor) -> np.ndarray:
    """``x @ W.T`` for an INT4 weight: per group, (x_g . q_g) * scale + sum(x_g) * min."""
    return _matmul_asym_ref(x, w, unpack_int4)


def matmul_int5_ref(x: np.ndarray, w: QuantTensor) -> np.ndarray:
    """``x @ W.T`` for an INT5 weight: per group, (x_g . q_g) * scale + sum(x_g) * min."""
    return _matmul_asym_ref(x, w, unpack_int5)


def _matmul_asym_ref(x: np.ndarray, w: QuantTensor, unpack) -> np.ndarray:
    n = x.shape[0]
    rows, cols = w.shape
    g = w.group_size
    ng = cols // g
    xg = x.reshape(n, ng, g)
    xsum = xg.sum(axis=2)  # [n, ng]
    y = np.empty((n, rows), dtype=np.float32)
    for r0 in range(0, rows, _ROWS_PER_CHUNK):
        r1 = min(rows, r0 + _ROWS_PER_CHUNK)
        q = unpack(w.qweight[r0:r1]).astype(np.float32).reshape(r1 - r0, ng, g)
        dots = np.einsum("ngk,rgk->nrg", xg, q, optimize=True)  # [n, r, ng]
        s = w.scales[r0:r1].astype(np.float32)
        m = w.mins[r0:r1].astype(np.float32)
        y[:, r0:r1] = (dots * s[None]).sum(axis=2) + xsum @ m.T
    return y


def matmul_int8_ref(x: np.ndarray, w: QuantTensor) -> np.ndarray:
    """``x @ W.T`` for an INT8 weight: per group, (x_g . q_g) * scale."""
    n = x.shape[0]
    rows, cols = w.shape
    g = w.group_size
    ng = cols // g
    xg = x.reshape(n, ng, g)
    y = np.empty((n, rows), dtype=np.float32)
    for r0 in range(0, rows, _ROWS_PER_CHUNK):
        r1 = min(rows, r0 + _ROWS_PER_CHUNK)
        q = w.qweight[r0:r1].astype(np.float32).reshape(r1 - r0, ng, g)
        dots = np.einsum("ngk,rgk->nrg", xg, q, optimize=True)
        y[:, r0:r1] = (dots * w.scales[r0:r1].astype(np.float32)[None]).sum(axis=2)
    return y


_MATMUL_REF = {"int4": matmul_int4_ref, "int5": matmul_int5_ref, "int8": matmul_int8_ref}


def linear_ref(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    if isinstance(w, QuantTensor):
        matmul = _MATMUL_REF.get(w.kind)
        if matmul is None:
            raise KernelError(f"linear: quantized weight kind {w.kind!r} is not supported")
        y = matmul(x, w)
    else:
        y = x @ w.T
    if bias is not None:
        y += bias
    return y.astype(np.float32, copy=False)


def embedding_ref(w, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of an embedding table, as float32 ``[n, d]``."""
    if isinstance(w, QuantTensor):
        return w.dequantize(np.asarray(ids))
    return np.asarray(w[ids], dtype=np.float32)


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (float32 in and out)."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps)) * weight).astype(np.float32, copy=False)


def rope_tables(positions: np.ndarray, head_dim: int, theta: float):
    """cos and sin ``[n, head_dim // 2]`` for the given positions (angles in float64)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the two halves of each head. ``x``: [n, heads, head_dim]; cos/sin: [n, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                  scale: float, window: int | None) -> np.ndarray:
    """Causal grouped-query attention over a cache.

    q: [n, H, d] for positions ``q_pos``; k, v: [T, KVH, d] holding positions 0..T-1.
    A query at position p attends to keys at positions max(0, p - window + 1) .. p.
    Returns [n, H, d].
    """
    n, n_heads, d = q.shape
    t, n_kv, _ = k.shape
    group = n_heads // n_kv
    qg = q.reshape(n, n_kv, group, d)  # query heads h = kv * group + j share kv head kv
    scores = np.einsum("nkgd,tkd->kgnt", qg, k, optimize=True) * np.float32(scale)
    kpos = np.arange(t)[None, :]
    qp = np.asarray(q_pos)[:, None]
    allowed = kpos <= qp
    if window is not None:
        allowed &= kpos > qp - window
    scores = np.where(allowed[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("kgnt,tkd->nkgd", p.astype(np.float32), v, optimize=True)
    return out.reshape(n, n_heads, d).astype(np.float32, copy=False)


def silu_ref(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written with tanh so that large |x| cannot overflow
    return (x * (0.5 + 0.5 * np.tanh(0.5 * x))).astype(np.float32, copy=False)


def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(
        np.float32, copy=False)
