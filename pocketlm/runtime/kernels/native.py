"""The native kernel backend: quantized matrix products in C (``pocketlm._native``).

Same semantics as :func:`pocketlm.runtime.kernels.numpy_ref.linear_ref`. Two activation modes:

* ``act="f32"``: float32 activations, the reference's decomposition per group
  ((x_g . q_g) * scale + sum(x_g) * min) with float32 accumulation; matches numpy to float
  rounding.
* ``act="q8"``: activations quantized per block of 32 to int8 (absmax / 127), integer dot
  products, float32 rescaling. Faster; the result is exactly ``W . x~`` where ``x~`` is the
  quantized activation, so ``|y - y_ref| <= ||W_r|| * ||x - x~||`` with
  ``||x - x~|| <= sqrt(32) / 254 * ||x||``.

Environment: ``POCKET_THREADS`` (threads; default: usable CPUs, at most 8) and
``POCKET_CPU_LEVEL`` (``scalar`` | ``avx2`` | ``avx512``: force a kernel level, default the best
the CPU supports). The kernel level and threads can also be passed per call.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

from ...errors import KernelError
from ...quant import QuantTensor

try:
    from ... import _native
except ImportError as e:  # not built: pip install -e .
    _native = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

LEVELS = ("scalar", "avx2", "avx512")
MAX_DEFAULT_THREADS = 8
_API = 1

_pool_lock = threading.Lock()
_pool = None  # (pid, threads, ThreadPool)


def available() -> bool:
    """True when the extension is built and matches this version of the wrapper."""
    return _native is not None and getattr(_native, "KERNEL_API", None) == _API


def unavailable_reason() -> str:
    if _native is None:
        return (f"the native kernels (pocketlm._native) are not built ({_IMPORT_ERROR}); "
                f"run `pip install -e .` in the source tree")
    if not available():
        return "pocketlm._native is stale (API mismatch); rebuild with `pip install -e .`"
    return ""


@functools.lru_cache(maxsize=1)
def _info() -> dict:
    return _native.cpu_info()


@functools.lru_cache(maxsize=1)
def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _require() -> None:
    if not available():
        raise KernelError(unavailable_reason())


def cpu_features() -> dict:
    """Detected CPU features, the kernel levels this CPU supports, the best one and the one in
    use (``POCKET_CPU_LEVEL`` applied). Empty dict when the extension is not built."""
    if not available():
        return {}
    info = dict(_info())
    try:
        info["selected"] = LEVELS[_level_id(None)]
    except KernelError as e:
        info["selected"] = None
        info["error"] = str(e)
    try:
        info["threads"] = default_threads()
    except KernelError as e:
        info["threads"] = None
        info["error"] = str(e)
    return info


def default_threads() -> int:
    env = os.environ.get("POCKET_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise KernelError(f"POCKET_THREADS={env!r} is not an integer") from None
        if not 1 <= n <= 1024:
            raise KernelError(f"POCKET_THREADS={n} is out of range 1..1024")
        return n
    return max(1, min(_usable_cpus(), MAX_DEFAULT_THREADS))


def _level_id(level: str | None) -> int:
    if level is None:
        level = os.environ.get("POCKET_CPU_LEVEL", "").strip().lower() or None
        if level is None:
            return LEVELS.index(_info()["best"])
        source = f"POCKET_CPU_LEVEL={level!r}"
    else:
        source = f"level={level!r}"
    if level not in LEVELS:
        raise KernelError(f"{source}: unknown kernel level; choose one of {', '.join(LEVELS)}")
    if level not in _info()["levels"]:
        raise KernelError(f"{source}: this CPU does not support the {level} kernels "
                          f"(supported: {', '.join(_info()['levels'])})")
    return LEVELS.index(level)


def _get_pool(threads: int):
    """The process-wide thread pool, with at least `threads` threads (a call uses at most the
    threads it asks for). Recreated after fork, or grown when more threads are asked for."""
    global _pool
    if threads <= 1:
        return None
    pid = os.getpid()
    with _pool_lock:
        if _pool is None or _pool[0] != pid or _pool[1] < threads:
            _pool = (pid, threads, _native.ThreadPool(threads))
        return _pool[2]


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise KernelError(f"native kernel: {e}") from e


def matmul(x: np.ndarray, w: QuantTensor, *, act: str = "f32", level: str | None = None,
           threads: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` for a quantized weight (no bias). x: float32 [n, cols], C order."""
    _require()
    if act not in ("f32", "q8"):
        raise KernelError(f"act must be 'f32' or 'q8', got {act!r}")
    if not isinstance(w, QuantTensor) or w.kind not in ("int4", "int8"):
        raise KernelError(f"matmul: expected an int4/int8 QuantTensor, got {type(w).__name__}")
    lid = _level_id(level)
    nthreads = default_threads() if threads is None else int(threads)
    if not 1 <= nthreads <= 1024:
        raise KernelError(f"threads must be in 1..1024, got {nthreads}")
    rows = w.shape[0]
    n = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else None
    if out is None:
        if n is None:
            raise KernelError(f"activations must be a 2-D float32 array, got "
                              f"{getattr(x, 'dtype', type(x))} with shape "
                              f"{getattr(x, 'shape', '?')}")
        out = np.empty((n, rows), dtype=np.float32)
    pool = _get_pool(nthreads)
    if w.kind == "int4":
        _call(_native.matmul_q4, x, w.qweight, w.scales, w.mins, w.group_size, out,
              act_q8=act == "q8", level=lid, threads=nthreads, pool=pool)
    else:
        _call(_native.matmul_q8, x, w.qweight, w.scales, w.group_size, out,
              act_q8=act == "q8", level=lid, threads=nthreads, pool=pool)
    return out


def linear(x: np.ndarray, w, bias: np.ndarray | None = None, *, act: str = "f32",
           level: str | None = None, threads: int | None = None) -> np.ndarray:
    """``x @ w.T (+ bias)``: x float32 [n, in]; w float32 [out, in] or a QuantTensor."""
    if isinstance(w, QuantTensor):
        y = matmul(x, w, act=act, level=level, threads=threads)
        out_f = w.shape[0]
    elif isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype == np.float32:
        if (not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2
                or x.shape[1] != w.shape[1]):
            raise KernelError(f"linear: activations {getattr(x, 'dtype', type(x))} "
                              f"{getattr(x, 'shape', '?')} do not fit a weight of shape "
                              f"{w.shape}")
        y = x @ w.T
        out_f = w.shape[0]
    else:
        raise KernelError(f"linear: unsupported weight {type(w).__name__} "
                          f"{getattr(w, 'dtype', '')}")
    if bias is not None:
        if not isinstance(bias, np.ndarray) or bias.dtype != np.float32 or bias.shape != (out_f,):
            raise KernelError(f"linear: bias must be float32 of shape ({out_f},)")
        y += bias
    return y.astype(np.float32, copy=False)
