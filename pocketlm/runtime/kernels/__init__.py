"""The kernel interface the runtime calls, and the choice of implementation behind it.

``POCKET_KERNELS`` selects the backend for quantized matrix products: ``native`` (the C
extension ``pocketlm._native``, the default when it is built) or ``numpy`` (the reference,
:mod:`.numpy_ref`, which every native kernel is tested against). INT5 weights have no native
single-matrix kernel: :func:`linear` computes them with the numpy reference under either
backend. ``POCKET_ACT`` chooses the native activation format: ``f32`` (the same numbers as the
reference up to float rounding) or ``q8`` (activations as INT8 for integer dot products:
faster, slightly different). The wrapper functions here check what they are handed (dtype,
shape, layout) before calling a backend, so a backend may trust its inputs.

With the native backend the runtime normally runs the whole forward pass in the native engine
(:class:`.native.NativeEngine`), whose default is ``q8``: each block of 32 activations is carried
as two int8 digits (about 15 bits), which keeps top-1 agreement with the f32 path at 100 % on
the real-text tests while using int8 dot products. Single matrix products outside the engine
(:func:`linear`) default to ``f32``, because there ``q8`` means one digit (8 bits).
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import KernelError, UnsupportedError
from ...quant import QuantTensor
from . import native, numpy_ref

BACKENDS = ("native", "numpy")
ACTIVATIONS = ("f32", "q8")
# QuantTensor kinds with a native single-matrix kernel; the others (INT5) take the numpy twin
NATIVE_MATMUL_KINDS = ("int4", "int8")


def backend_name() -> str:
    """The backend in force: POCKET_KERNELS, else native when built, else numpy."""
    name = os.environ.get("POCKET_KERNELS", "").strip().lower()
    if not name:
        return "native" if native.available() else "numpy"
    if name not in BACKENDS:
        raise UnsupportedError(f"POCKET_KERNELS={name!r} is not a kernel backend; choose one of "
                               f"{', '.join(BACKENDS)}")
    if name == "native" and not native.available():
        raise UnsupportedError(f"POCKET_KERNELS=native, but {native.unavailable_reason()}")
    return name


def activation_format(default: str = "q8") -> str:
    """POCKET_ACT, else ``default`` (q8 for the engine; linear() asks for f32)."""
    act = os.environ.get("POCKET_ACT", default).strip().lower() or default
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"POCKET_ACT={act!r}; choose one of {', '.join(ACTIVATIONS)}")
    return act


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
    if isinstance(w, QuantTensor) and backend_name() == "native" and \
            w.kind in NATIVE_MATMUL_KINDS:
        return native.linear(x, w, bias, act=activation_format(default="f32"))
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
