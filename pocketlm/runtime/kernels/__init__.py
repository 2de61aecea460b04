"""The kernel interface, and the choice of implementation behind it.

``POCKET_KERNELS`` selects the backend for quantized matrix products: ``native`` (the C
extension ``pocketlm._native``, the default when it is built) or ``numpy`` (the reference,
:mod:`.numpy_ref`, which every native kernel is tested against). INT5 weights have no native
single-matrix kernel: :func:`linear` computes them with the numpy reference under either
backend. ``POCKET_ACT`` chooses the native activation format: ``f32`` (the same numbers as the
reference up to float rounding) or ``q8`` (activations as INT8 for integer dot products:
faster, slightly different). The wrapper functions here check what they are handed (dtype,
shape, layout) before calling a backend, so a backend may trust its inputs. The settings come
as an :class:`~pocketlm.runtime.settings.EngineSettings` (default: read from the environment
at the call).

With the native backend the runtime runs the whole forward pass in the native engine
(:class:`.native.NativeEngine`), whose default is ``q8`` at the avx2, avx512 and neon levels
(``f32`` at the scalar level): each block of 32 activations is carried as two int8 digits
(about 15 bits), which keeps top-1 agreement with the f32 path at 100 % on the real-text tests
while using int8 dot products. Single matrix products outside the engine (:func:`linear`)
default to ``f32``, because there ``q8`` means one digit (8 bits). The runtime's numpy
reference engine does not come through here: it calls :mod:`.numpy_ref` only.
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelError, UnsupportedError
from ...quant import QuantTensor
from ..settings import ACTIVATIONS, BACKENDS, EngineSettings
from . import native, numpy_ref

__all__ = ["ACTIVATIONS", "BACKENDS", "NATIVE_MATMUL_KINDS", "activation_format",
           "attention", "backend_name", "embedding", "gelu_tanh", "linear", "rmsnorm", "rope",
           "rope_tables", "silu"]
# QuantTensor kinds with a native single-matrix kernel; the others (INT5) take the numpy twin
NATIVE_MATMUL_KINDS = ("int4", "int8")


def backend_name(settings: EngineSettings | None = None) -> str:
    """The backend in force: POCKET_KERNELS (``settings``, default the environment's), else
    native when built, else numpy."""
    name = (EngineSettings.from_env() if settings is None else settings).kernels
    if name is None:
        return "native" if native.available() else "numpy"
    if name == "native" and not native.available():
        raise UnsupportedError(f"POCKET_KERNELS=native, but {native.unavailable_reason()}")
    return name


def activation_format(default: str = "q8", settings: EngineSettings | None = None) -> str:
    """POCKET_ACT (``settings``, default the environment's), else ``default`` (the engine's
    default depends on the kernel level, see :func:`.native.default_activation`; linear()
    asks for f32)."""
    act = (EngineSettings.from_env() if settings is None else settings).act
    return default if act is None else act


def _check_activations(x: np.ndarray, features: int, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise KernelError(f"{what}: activations must be a 2-D float32 array, got "
                          f"{getattr(x, 'dtype', type(x))} with shape {getattr(x, 'shape', '?')}")
    if x.shape[1] != features:
        raise KernelError(f"{what}: activations have {x.shape[1]} features, the weight expects "
                          f"{features}")
    if not x.flags.c_contiguous:
        raise KernelError(f"{what}: activations must be C-contiguous")


def linear(x: np.ndarray, w, bias: np.ndarray | None = None, *,
           settings: EngineSettings | None = None) -> np.ndarray:
    """``x @ w.T (+ bias)``: x float32 [n, in]; w float32 [out, in] or a QuantTensor. An INT4 /
    INT8 weight runs on the backend in force (``settings``, default the environment's), with
    POCKET_ACT's activations (default ``f32``)."""
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
    if isinstance(w, QuantTensor):
        if settings is None:
            settings = EngineSettings.from_env()
        if backend_name(settings) == "native" and w.kind in NATIVE_MATMUL_KINDS:
            return native.linear(x, w, bias, act=activation_format("f32", settings),
                                 settings=settings)
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
