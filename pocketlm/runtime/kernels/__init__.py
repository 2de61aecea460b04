"""The kernel interface the runtime calls, and the choice of implementation behind it.

``POCKET_KERNELS`` selects the backend: ``numpy`` (the reference, :mod:`.numpy_ref`) is the only
one in this version; a native backend plugs in behind the same functions and is tested against
the reference. The wrapper functions here check what they are handed (dtype, shape, layout)
before calling a backend, so a backend may trust its inputs.
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import KernelError, UnsupportedError
from ...quant import QuantTensor
from . import numpy_ref

BACKENDS = ("numpy",)


def backend_name() -> str:
    name = os.environ.get("POCKET_KERNELS", "numpy").strip().lower() or "numpy"
    if name not in BACKENDS:
        raise UnsupportedError(f"POCKET_KERNELS={name!r} is not available; choose one of "
                               f"{', '.join(BACKENDS)}")
    return name


def _check_activations(x: np.ndarray, features: int, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise KernelError(f"{what}: activations must be a 2-D float32 array, got "
                          f"{getattr(x, 'dtype', type(x))} with shape {getattr(x, 'shape', '?')}")
    if x.shape[1] != features:
        raise KernelError(f"{what}: activations have {x.shape[1]} features, the weight expects "
                          f"{features}")
    if not x.flags.c_contiguous:
        raise KernelError(f"{what}: activations must be C-contiguous")


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T (+ bias)``: x float32 [n, in]; w float32 [out, in] or a QuantTensor."""
    if isinstance(w, QuantTensor):
        out_f, in_f = w.shape
    elif isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype == np.float32:
        out_f, in_f = w.shape
    else:
        raise KernelError(f"linear: unsupported weight {type(w).__name__} "
                          f"{getattr(w, 'dtype', '')}")
    _check_activations(x, in_f, "linear")
    if bias is not None and (bias.dtype != np.float32 or bias.shape != (out_f,)):
        raise KernelError(f"linear: bias must be float32 of shape ({out_f},)")
    return numpy_ref.linear_ref(x, w, bias)


def embedding(w, ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    rows = w.shape[0]
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise KernelError("embedding: ids must be a 1-D integer array")
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise KernelError(f"embedding: token id out of range 0..{rows - 1}")
    return numpy_ref.embedding_ref(w, ids)


rmsnorm = numpy_ref.rmsnorm_ref
rope_tables = numpy_ref.rope_tables
rope = numpy_ref.rope_ref
attention = numpy_ref.attention_ref
silu = numpy_ref.silu_ref
gelu_tanh = numpy_ref.gelu_tanh_ref
