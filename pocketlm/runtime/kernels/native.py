"""The native kernel backend: quantized matrix products in C (``pocketlm._native``).

Same semantics as :func:`pocketlm.runtime.kernels.numpy_ref.linear_ref`. Two activation modes:

* ``act="f32"``: float32 activations, the reference's decomposition per group
  ((x_g . q_g) * scale + sum(x_g) * min) with float32 accumulation; matches numpy to float
  rounding.
* ``act="q8"``: activations quantized per block of 32 to int8 (absmax / 127), integer dot
  products, float32 rescaling. Faster; the result is exactly ``W . x~`` where ``x~`` is the
  quantized activation, so ``|y - y_ref| <= ||W_r|| * ||x - x~||`` with
  ``||x - x~|| <= sqrt(32) / 254 * ||x||``.

Settings (:class:`~pocketlm.runtime.settings.EngineSettings`, read from the environment once
by whoever creates the engine or makes the call, and passed down): ``POCKET_THREADS`` (threads;
default for a kernel call: the usable CPUs, at most 8; for the engine: 2, or the usable CPUs if
fewer) and ``POCKET_CPU_LEVEL`` (``scalar`` | ``avx2`` | ``avx512`` on x86-64, ``scalar`` |
``neon`` on ARM64: force a kernel level, default the best the CPU supports). The kernel level
and threads can also be passed per call. ``neon`` (ARM64 with the dot-product extension)
changes the whole-model engine's int8-activation products only; its per-call kernels are the
scalar ones. A per-call product's activations are ``f32`` unless asked for (``act``;
:func:`pocketlm.runtime.kernels.linear` passes ``POCKET_ACT``, default ``f32``).

The whole-model engine (:class:`NativeEngine`, ``pocketlm._native.NativeModel``) runs the
complete forward pass in one native call; the runtime uses it by default (see
:mod:`pocketlm.runtime.model`). Its settings:

* ``POCKET_ACT=f32``: float32 activations (products in float32 with the reference's per-group
  decomposition); logits within ~1e-6 (relative to the largest) of the numpy reference.
* ``POCKET_ACT=q8``: int8 dot products. Each activation block of 32 is carried as two int8
  digits, ``x ~ d/128 * (128 q1 + q2)`` (~15 bits of the block's range; ``POCKET_Q8_DIGITS=1``:
  one digit, plain int8 like the per-call kernels above, faster prefill, coarser).
  Unset: q8 at the avx2, avx512 and neon levels, f32 at the scalar level
  (:func:`default_activation`).
* ``POCKET_AVXVNNI=0`` (avx2 level): the int8 products on AVX2's multiply-add pairs even where
  the CPU has AVX-VNNI (same results, for comparison); ``1`` (default): AVX-VNNI where the CPU
  has it.
* ``POCKET_AMX`` (with q8): ``1`` runs the products of 16 or more tokens (prefill) on the
  AMX-BF16 tile unit, bfloat16 weights and activations (an error where the CPU or OS lacks
  it); ``0`` keeps them on the int8 products; unset: AMX where available.
* ``POCKET_AMX_WEIGHTS`` (with AMX): how many bfloat16 terms carry a weight in those products.
  ``two-term``: ``hi + lo`` everywhere (three tile products per block, logits as close to the
  reference as the int8 path's); ``one-term``: ``bf16(w)`` everywhere (two products, prefill
  ~1.3x faster, top-1 agreement ~99-99.9 %); ``mixed`` (default): one term for q/k/v, W_o and
  W_down, two for gate/up (half the weights; prefill ~1.13x, agreement >= 99.6 % on the registry
  models, see docs/engine.md).
* ``POCKET_KV``: ``f32`` | ``f16`` | ``q8`` KV cache (default f32 with f32 activations, f16
  with q8); ``q8`` is int8 with a float16 scale per 16 values of a position and KV head
  (0.56 of the f16 cache's bytes; it moves logits ~100x more than f16 does, see docs/engine.md).
* ``POCKET_THREADS``: threads of the engine (default: 2, or the usable CPUs if fewer; a
  standalone kernel call defaults to the usable CPUs, at most 8).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading

import numpy as np

from ...errors import KernelError, PocketError
from ...head_patch import PATCH, PATCH_IDS
from ...quant import EncodedQuantTensor, QuantTensor, q4k_codes
from ..adapters import find_adapters
from ..settings import (  # noqa: F401 (DEFAULT_AMX_WEIGHTS, KV_FORMATS, LEVELS: public here)
    AMX_WEIGHT_TERMS,
    DEFAULT_AMX_WEIGHTS,
    KV_FORMATS,
    LEVELS,
    MAX_THREADS,
    EngineSettings,
)

try:
    from ... import _native
except ImportError as e:  # not built: pip install -e .
    _native = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

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
                "install pocketlm again from its folder where a C compiler is found (`pip "
                "install .`, or `pip install -e .` for a working copy)")
    if not available():
        return ("pocketlm._native is stale (API mismatch); build it again: `pip install .` "
                "from pocketlm's folder (`pip install -e .` for a working copy)")
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


def _settings(settings: EngineSettings | None) -> EngineSettings:
    """``settings``, or those of the environment now (for a caller that passes none)."""
    return EngineSettings.from_env() if settings is None else settings


def _require() -> None:
    if not available():
        raise KernelError(unavailable_reason())


def cpu_features(settings: EngineSettings | None = None) -> dict:
    """Detected CPU features, the kernel levels this CPU supports, the best one and the one in
    use (``POCKET_CPU_LEVEL`` applied), and a kernel call's default threads. Empty dict when the
    extension is not built. An invalid setting gives None for what it decides, and ``error``."""
    if not available():
        return {}
    info = dict(_info())
    try:
        settings = _settings(settings)
    except PocketError as e:
        return {**info, "selected": None, "threads": None, "error": str(e)}
    try:
        info["selected"] = LEVELS[_level_id(None, settings)]
    except KernelError as e:
        info["selected"] = None
        info["error"] = str(e)
    info["threads"] = default_threads(settings)
    return info


def transparent_huge_pages() -> str | None:
    """The OS's transparent huge page mode (``always``, ``madvise`` or ``never``), None where
    there is none to read (not Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def engine_setting(settings: EngineSettings | None = None) -> dict:
    """What a NativeEngine created with ``settings`` (default: the environment's) runs on:
    ``level`` (kernel level, ``+avxvnni`` where the avx2 level's int8 products use it), ``act``,
    ``amx`` (prefill on AMX-BF16), ``amx_weights`` (their weight terms, None without AMX),
    ``kv`` (the KV cache format), ``huge_pages`` (the repacked weights in transparent huge
    pages: POCKET_HUGEPAGES, where the OS hands them out on request), ``head_screen`` (the
    tiles of an INT8 head that greedy decoding reads whole; 0 where the level cannot screen).
    Raises KernelError (UnsupportedError for POCKET_ACT) for an invalid setting, or one this
    machine cannot run (a kernel level it lacks, POCKET_AMX=1 without AMX)."""
    settings = _settings(settings)
    level_id = _level_id(None, settings)
    level = LEVELS[level_id]
    act = settings.act or default_activation(level)
    amx = level == "avx512" and amx_setting(act, settings)
    if level == "avx2" and act == "q8":  # the engine's own choice of products
        level = _native.ops_name(level_id, avxvnni=int(settings.avxvnni))
    huge = bool(settings.hugepages) and transparent_huge_pages() in ("always", "madvise")
    # head screening runs on the plane products (every level has them) with int8 head
    # activations
    screen = settings.head_screen if act == "q8" else 0
    return {"level": level, "act": act, "amx": amx,
            "amx_weights": settings.amx_weights if amx else None, "kv": kv_format(act, settings),
            "huge_pages": huge, "head_screen": screen}


def check_settings(settings: EngineSettings | None = None) -> None:
    """Raise KernelError for an engine setting this machine cannot run (a kernel level the CPU
    lacks, POCKET_AMX=1 without AMX; the values themselves are checked by
    :meth:`EngineSettings.from_env`), so that it is an error rather than a reason to run
    without the engine."""
    engine_setting(settings)


def default_threads(settings: EngineSettings | None = None) -> int:
    """Threads of a single kernel call: POCKET_THREADS, else the usable CPUs, at most 8."""
    threads = _settings(settings).threads
    if threads is not None:
        return threads
    return max(1, min(_usable_cpus(), MAX_DEFAULT_THREADS))


def _level_id(level: str | None, settings: EngineSettings | None = None) -> int:
    """The LEVEL_* index of ``level``, else of POCKET_CPU_LEVEL (``settings``), else of the
    best level the CPU supports."""
    if level is None:
        level = _settings(settings).cpu_level
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
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: too large for C
        raise KernelError(f"native kernel: {e}") from e


def matmul(x: np.ndarray, w: QuantTensor, *, act: str = "f32", level: str | None = None,
           threads: int | None = None, out: np.ndarray | None = None,
           settings: EngineSettings | None = None) -> np.ndarray:
    """``x @ W.T`` for a quantized weight (no bias). x: float32 [n, cols], C order. ``level``
    and ``threads`` default to ``settings`` (default: the environment's)."""
    _require()
    if act not in ("f32", "q8"):
        raise KernelError(f"act must be 'f32' or 'q8', got {act!r}")
    if not isinstance(w, QuantTensor) or w.kind not in ("int4", "int8"):
        raise KernelError(f"matmul: expected an int4/int8 QuantTensor, got {type(w).__name__}")
    lid = None if level is None else _level_id(level)  # an explicit level is checked first
    if settings is None and (level is None or threads is None):
        settings = EngineSettings.from_env()
    if lid is None:
        lid = _level_id(None, settings)
    nthreads = default_threads(settings) if threads is None else int(threads)
    if not 1 <= nthreads <= MAX_THREADS:
        raise KernelError(f"threads must be in 1..{MAX_THREADS}, got {nthreads}")
    rows = w.shape[0]
    n = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else None
    if out is None:
        if n is None:
            raise KernelError(f"activations must be a 2-D float32 array, got "
                              f"{getattr(x, 'dtype', type(x))} with shape "
                              f"{getattr(x, 'shape', '?')}")
        out = np.empty((n, rows), dtype=np.float32)
    if act == "q8" and isinstance(x, np.ndarray) and x.dtype == np.float32 and \
            not np.isfinite(x).all():
        # int8 has no NaN or inf: a NaN became -127 and the result a plausible number
        raise KernelError("act='q8' cannot round non-finite activations (NaN or inf) to int8; "
                          "use act='f32', which carries them through")
    pool = _get_pool(nthreads)
    if w.kind == "int4":
        _call(_native.matmul_q4, x, w.qweight, w.scales, w.mins, w.group_size, out,
              act_q8=act == "q8", level=lid, threads=nthreads, pool=pool)
    else:
        _call(_native.matmul_q8, x, w.qweight, w.scales, w.group_size, out,
              act_q8=act == "q8", level=lid, threads=nthreads, pool=pool)
    return out


def linear(x: np.ndarray, w, bias: np.ndarray | None = None, *, act: str = "f32",
           level: str | None = None, threads: int | None = None,
           settings: EngineSettings | None = None) -> np.ndarray:
    """``x @ w.T (+ bias)``: x float32 [n, in]; w float32 [out, in] or a QuantTensor."""
    if isinstance(w, QuantTensor):
        y = matmul(x, w, act=act, level=level, threads=threads, settings=settings)
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


# -- the whole-model engine ------------------------------------------------------------------
# pocketlm._native.NativeModel runs the complete forward pass (all layers, attention, the
# output head) in one native call; see pocketlm/runtime/csrc/pocket_model.h. The runtime uses
# it when the native backend is in force and every weight is in a layout it supports.

_MODEL_API = 1
MAX_DEFAULT_ENGINE_THREADS = 2
Q8_QKV, Q8_WO, Q8_GATE_UP, Q8_DOWN, Q8_HEAD = 1, 2, 4, 8, 16
Q8_ALL = Q8_QKV | Q8_WO | Q8_GATE_UP | Q8_DOWN | Q8_HEAD  # every product class of the engine
Q8_ONE_DIGIT_SHIFT = 5
# with AMX, calls of this many prompt tokens or more run on the tiles (bfloat16), shorter ones
# on the int8 products; a row's numbers are the same wherever a prompt is cut into calls of
# at least this many (the extension's AMX_MIN_TOKENS; tests/test_native_args.py checks it)
AMX_MIN_TOKENS = 16
# POCKET_AMX_WEIGHTS: the product classes whose AMX products take one bfloat16 weight term
AMX_WEIGHTS = {"two-term": 0, "mixed": Q8_QKV | Q8_WO | Q8_DOWN, "one-term": Q8_ALL}
assert tuple(AMX_WEIGHTS) == AMX_WEIGHT_TERMS


def engine_available() -> bool:
    """True when the extension is built with the whole-model engine of this wrapper's API."""
    return available() and getattr(_native, "MODEL_API", None) == _MODEL_API


def engine_threads(settings: EngineSettings | None = None) -> int:
    """Threads of the engine: POCKET_THREADS, else 2 or the usable CPUs if fewer (the
    products of a small model are memory bound; more threads mostly add synchronisation)."""
    threads = _settings(settings).threads
    if threads is not None:
        return threads
    return max(1, min(_usable_cpus(), MAX_DEFAULT_ENGINE_THREADS))


def default_activation(level: str) -> str:
    """The engine's activations when POCKET_ACT is unset: ``q8`` where the kernel level has
    SIMD int8 products (avx2, avx512, neon), ``f32`` at the scalar level, whose portable int8
    loop is several times slower than its float products (smollm2-135m, 2 threads: prefill 6
    vs 74 tokens/s, decode 6 vs 26)."""
    return "f32" if level == "scalar" else "q8"


def kv_format(act: str, settings: EngineSettings | None = None) -> str:
    """POCKET_KV (``f32`` | ``f16`` | ``q8``), else ``f32`` with float activations and ``f16`` with
    int8 activations (the fast setting)."""
    kv = _settings(settings).kv
    if kv is None:
        return "f16" if act == "q8" else "f32"
    return kv


def q8_digits(settings: EngineSettings | None = None) -> int:
    """POCKET_Q8_DIGITS: int8 digits per activation in the engine's q8 products. 2 (default):
    each activation block of 32 carries ``q1 + q2 / 128`` (~15 bits of its range), top-1
    agreement with the float reference ~100 % on smollm2-135m; 1: plain int8 (prefill ~1.5x
    faster, agreement ~97 %)."""
    return _settings(settings).q8_digits


def amx_available() -> bool:
    """Whether the engine can run prefill products on AMX-BF16 here."""
    return available() and bool(getattr(_native, "amx_available", lambda: False)())


def amx_setting(act: str, settings: EngineSettings | None = None) -> bool:
    """POCKET_AMX: ``1`` (required), ``0`` (off), unset (where available); only with q8."""
    amx = _settings(settings).amx
    if act != "q8" or amx is False:
        return False
    if amx:
        if not amx_available():
            raise KernelError("POCKET_AMX=1, but this build, CPU or OS has no AMX-BF16")
        return True
    return amx_available()


def amx_weights_setting(settings: EngineSettings | None = None) -> str:
    """POCKET_AMX_WEIGHTS: ``two-term`` | ``mixed`` | ``one-term`` (unset: ``mixed``)."""
    return _settings(settings).amx_weights


def coded_steps_of(w) -> tuple | None:
    """The codes an INT4 tensor in a coded encoding hands the engine (pocket_weight.
    scale_codes): ``(scale codes uint8, minimum codes int8, steps float16 [rows, 2 * nsteps],
    groups per step)``: ``int4_c8``'s per row, GGUF Q4_K's per 256 columns (its minimums
    ``-(dmin * m)`` as the codes ``m`` under the step ``-dmin``: the same float16 bits, a
    zero's sign included); None for other tensors."""
    encoding = getattr(w, "encoding", None)
    s = getattr(w, "stored", None)
    rows, cols = w.shape
    if encoding == "int4_c8":
        return s[".sc"], s[".mc"], s[".rd"], cols // 32
    if encoding == "q4_k":
        sc, mn = q4k_codes(s[".kscales"].reshape(rows, cols // 256, 12))
        steps = np.array(s[".kd"]).view(np.uint16)  # d, dmin per super-block: dmin negated
        steps[:, 1::2] ^= np.uint16(0x8000)
        return (sc.reshape(rows, cols // 32), mn.astype(np.int8).reshape(rows, cols // 32),
                steps.view(np.float16), 8)
    return None


def _engine_tensor(w):
    """The engine's form of a weight, or None if its layout is not supported."""
    if isinstance(w, QuantTensor):
        arrays = [w.qweight, w.scales] + ([w.mins] if w.kind in ("int4", "int5") else [])
        if w.kind not in ("int4", "int5", "int8") or w.group_size not in (32, 64, 128):
            return None
        if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays):
            return None
        if w.kind in ("int4", "int5"):
            if w.qweight.dtype != np.uint8 or w.scales.dtype != np.float16 or \
                    w.mins.dtype != np.float16:
                return None
            if w.zero_point is not None:  # mins computed, not mapped: never released; the
                # zero point lets the tiles hold none
                return (w.kind, w.qweight, w.scales, w.mins, int(w.group_size),
                        int(w.zero_point))
            codes = coded_steps_of(w)
            if codes is not None:  # the codes the tiles may keep
                return (w.kind, w.qweight, w.scales, w.mins, int(w.group_size), False, codes)
            return (w.kind, w.qweight, w.scales, w.mins, int(w.group_size))
        if w.qweight.dtype != np.int8 or w.scales.dtype != np.float16:
            return None
        return ("int8", w.qweight, w.scales, int(w.group_size))
    if isinstance(w, np.ndarray) and w.dtype == np.float32 and w.flags.c_contiguous:
        return w
    return None


def _model_tensors(config, weights: dict) -> list[str]:
    """The names of the model's tensors the engine takes: the config's, a separate output
    head, and the head patch's INT8 rows (its ids are handed over apart)."""
    names = list(config.tensor_shapes())
    if "lm_head.weight" in weights and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    if PATCH in weights:
        names.append(PATCH)
    return names


def file_mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a read-only view of a file mapping (``mmap``): a page of it the engine
    hands back (madvise) is read back from the file when next touched. Handing back a page of
    any other memory loses what it held."""
    b = a
    while isinstance(b, (np.ndarray, memoryview)):
        b = b.base if isinstance(b, np.ndarray) else b.obj
    return isinstance(b, mmap.mmap) and not a.flags.writeable


def unmapped_tensor(config, weights: dict) -> str | None:
    """The first model tensor whose arrays the engine would hand back (``release_source``)
    that is not a read-only view of a file mapping, or None. A tensor in a source encoding is
    decoded into arrays of its own (released once repacked: not the caller's), and computed
    minimums (a zero point) are never handed back."""
    for name in _model_tensors(config, weights):
        w = weights.get(name)
        if isinstance(w, EncodedQuantTensor):
            continue
        if isinstance(w, QuantTensor):
            arrays = [w.qweight, w.scales]
            if w.kind in ("int4", "int5") and w.zero_point is None:
                arrays.append(w.mins)
        else:
            arrays = [w]
        if not all(isinstance(a, np.ndarray) and file_mapped(a) for a in arrays):
            return name
    return None


def engine_weights(config, weights: dict, *, adapters: bool = True
                   ) -> tuple[dict | None, str]:
    """The weights in the engine's form, or (None, the reason they cannot be used).
    ``adapters=False``: leave out the LoRA adapters' transposes (a caller that only asks
    whether the engine takes the weights). The adapters are handed over as float16 (half the
    bytes the engine reads per token) when float16 holds every value exactly, as it does for
    a deploy file's; else as float32."""
    out = {}
    for name in _model_tensors(config, weights):
        t = _engine_tensor(weights[name])
        if t is None:
            w = weights[name]
            return None, (f"tensor {name!r} ({type(w).__name__} "
                          f"{getattr(w, 'kind', getattr(w, 'dtype', ''))}) is not in a layout "
                          "the native engine supports")
        out[name] = t
    if PATCH_IDS in weights:  # int32 [K], checked by the extension (never converted here)
        out[PATCH_IDS] = weights[PATCH_IDS]
    found = find_adapters(config, weights) if adapters else {}
    dtype = np.float16 if all(_exact_f16(t) for ab in found.values() for t in ab) \
        else np.float32
    for stem, (a, b) in found.items():  # A^T, B^T
        out[stem + ".lora_at"] = np.ascontiguousarray(a.T, dtype)
        out[stem + ".lora_bt"] = np.ascontiguousarray(b.T, dtype)
    return out, ""


def _exact_f16(t: np.ndarray) -> bool:
    """Whether float16 holds every value of ``t`` (float16 or float32) exactly."""
    if t.dtype == np.float16:
        return True
    with np.errstate(over="ignore"):
        return bool(np.array_equal(t.astype(np.float16).astype(np.float32), t))


def adapter_rank(tensors: dict) -> int:
    """The rank of the LoRA adapters among the engine's tensors (0: none)."""
    return next((int(t.shape[1]) for n, t in tensors.items() if n.endswith(".lora_at")), 0)


def key_smoothing(config, weights: dict) -> dict[str, np.ndarray]:
    """Per layer, ``layers.N.attn.k_smooth``: float32 ``[kv_dim]`` by which the int8 KV cache
    divides keys (and multiplies the queries reading them), so that channels of large range do
    not set the quantization step of a whole block (SmoothQuant's idea, static, from the
    weights). A key channel c of the normalized input x (unit RMS) through W_k, with the norm
    weight g, has a spread of about sqrt(|W_k[c] * g|^2 + bias_c^2) (times |k_norm_c| under
    QK-norm); RoPE mixes channels c and c + head_dim / 2, so both get the pair's root sum of
    squares; the cache uses its square root (half the evening out), scaled to mean 1 per head.
    On 256 tokens of english / chinese text, qwen2.5-0.5b's mean KL to the float reference goes
    from 5.6e-3 / 6.3e-3 to 7.5e-4 / 6.5e-4 with it (benchmarks/kv_cache.jsonl)."""
    nkv, hd = config.n_kv_heads, config.head_dim
    out = {}
    for i in range(config.n_layers):
        wk = weights[f"layers.{i}.attn.w_k.weight"]
        wk = wk.dequantize() if isinstance(wk, QuantTensor) else np.asarray(wk, np.float32)
        g = np.asarray(weights[f"layers.{i}.attn_norm.weight"], np.float32)
        s2 = np.square(wk.astype(np.float64) * g).sum(1)
        bias = weights.get(f"layers.{i}.attn.w_k.bias")
        if bias is not None:
            s2 = s2 + np.square(np.asarray(bias, np.float64))
        s = np.sqrt(s2).reshape(nkv, hd)
        k_norm = weights.get(f"layers.{i}.attn.k_norm.weight")
        if k_norm is not None:
            s = s / np.sqrt(np.mean(np.square(s), 1, keepdims=True)) * np.abs(
                np.asarray(k_norm, np.float64))
        pair = np.sqrt(np.square(s[:, :hd // 2]) + np.square(s[:, hd // 2:]))
        s = np.sqrt(np.concatenate([pair, pair], 1))
        s = np.maximum(s / s.mean(1, keepdims=True), 1e-2)
        out[f"layers.{i}.attn.k_smooth"] = np.ascontiguousarray(s.reshape(-1), np.float32)
    return out


def _screen_rows(screen, n: int) -> bytes | None:
    """Per-row screen flags as the extension takes them: None (no row), else n bytes."""
    if screen is None:
        return None
    flags = bytes(1 if s else 0 for s in screen)
    if len(flags) != n:
        raise KernelError(f"screen has {len(flags)} entries for {n} rows")
    return flags if any(flags) else None


class NativeEngine:
    """The whole forward pass in C over the runtime's weights (kept alive by the model)."""

    def __init__(self, config, weights: dict, *, act: str | None = None, kv: str | None = None,
                 threads: int | None = None, level: str | None = None,
                 capacity: int | None = None, digits: int | None = None,
                 release_source: bool = False, amx: bool | None = None,
                 amx_weights: str | None = None, smooth_keys: bool = True,
                 avxvnni: bool | None = None, huge_pages: bool | None = None,
                 head_screen: int | None = None, compact_tiles: bool | None = None,
                 settings: EngineSettings | None = None):
        """Every argument left None takes its value from ``settings`` (default: read from the
        environment now, :meth:`EngineSettings.from_env`; see the module docstring for the
        defaults). ``release_source``: every weight is a view of a read-only file mapping,
        whose pages the engine may hand back once it has repacked (or copied) them. ``amx``:
        prefill products on AMX-BF16 (only with q8 at the avx512 level). ``amx_weights``:
        ``two-term`` | ``mixed`` | ``one-term``, the bfloat16 terms of a weight in those
        products. ``smooth_keys``: with the int8 KV cache, even out the keys' channels before
        rounding (:func:`key_smoothing`; False: round them as they are). ``avxvnni``: the avx2
        level's int8 products on AVX-VNNI where the CPU has it. ``huge_pages``: the repacked
        weights in transparent huge pages where the OS offers them (the same results).
        ``head_screen``: K > 0 holds an INT8 output head as two INT4 planes and, in decode
        steps, verifications and last-row prefills, reads the low plane only for the tiles of
        the K tiles (16 rows each) with the largest estimates of the high plane's pass
        (docs/engine.md, "Head screening"). ``compact_tiles``: INT4 weights stored with coded
        scales (``int4_c8``) keep the codes in the repacked tiles (not with ``amx``; fewer
        bytes per token, the same results)."""
        if not engine_available():
            raise KernelError(unavailable_reason() or "the native engine is not built; build "
                              "it: `pip install .` from pocketlm's folder")
        settings = _settings(settings)
        level_id = _level_id(level, settings)
        if act is None:  # int8 activations where the level has SIMD int8 products
            act = settings.act or default_activation(LEVELS[level_id])
        self.act = act
        if self.act not in ("f32", "q8"):
            raise KernelError(f"act must be 'f32' or 'q8', got {self.act!r}")
        self.kv_format = kv_format(self.act, settings) if kv is None else kv
        self.digits = settings.q8_digits if digits is None else int(digits)
        if self.digits not in (1, 2):
            raise KernelError(f"digits must be 1 or 2, got {digits!r}")
        if self.kv_format not in KV_FORMATS:
            raise KernelError(f"kv must be one of {', '.join(KV_FORMATS)}, got {kv!r}")
        if self.kv_format == "q8" and config.head_dim % 16:
            raise KernelError(f"the int8 KV cache (q8) needs a head_dim that is a multiple of "
                              f"16; this model's is {config.head_dim}: use f16")
        self.threads = engine_threads(settings) if threads is None else int(threads)
        if not 1 <= self.threads <= MAX_THREADS:
            raise KernelError(f"threads must be in 1..{MAX_THREADS}, got {self.threads}")
        tensors, reason = engine_weights(config, weights)
        if tensors is None:
            raise KernelError(reason)
        self.k_smooth = (key_smoothing(config, weights)
                         if self.kv_format == "q8" and smooth_keys else {})
        tensors.update(self.k_smooth)
        self.capacity = int(config.max_context if capacity is None else capacity)
        if not 1 <= self.capacity <= 1 << 24:  # the extension's bound (an int, not a long)
            raise KernelError(f"capacity must be in 1..{1 << 24}, got {self.capacity}")
        self.vocab_size = config.vocab_size
        if amx is None:  # POCKET_AMX, at the avx512 level (the one it extends)
            self.amx = amx_setting(self.act, settings) and LEVELS[level_id] == "avx512"
        else:
            self.amx = bool(amx)
            if self.amx and (self.act != "q8" or not amx_available()):
                raise KernelError("amx needs act='q8' and a build, CPU and OS with AMX-BF16")
        if amx_weights is None:
            amx_weights = settings.amx_weights
        if amx_weights not in AMX_WEIGHTS:
            raise KernelError(f"amx_weights must be one of {', '.join(AMX_WEIGHTS)}, "
                              f"got {amx_weights!r}")
        self.amx_weights = amx_weights if self.amx else None
        self.avxvnni = int(settings.avxvnni if avxvnni is None else bool(avxvnni))
        cfg = config.to_dict()
        if release_source and (name := unmapped_tensor(config, weights)) is not None:
            # handing back pages of memory that is not a file mapping zeroes what they hold
            raise KernelError(f"release_source needs every weight to be a read-only view of a "
                              f"file mapping; {name!r} is not (load a deploy file, or leave "
                              "release_source / file_backed off)")
        cfg["release_source"] = bool(release_source)
        # the embedding's lookups hand back the pages they read (a separate embedding stays in
        # the file); a decoded one is not in the file, and a tied one is read from the head's
        # tiles where there are tiles, else in place
        cfg["release_lookups"] = bool(release_source) and not isinstance(
            weights.get("embed.weight"), EncodedQuantTensor)
        self.huge_pages = int(settings.hugepages if huge_pages is None else bool(huge_pages))
        cfg["huge_pages"] = self.huge_pages
        self.head_screen = int(settings.head_screen if head_screen is None else head_screen)
        if not 0 <= self.head_screen <= 256:
            raise KernelError(f"head_screen must be 0 to 256, got {self.head_screen}")
        cfg["head_screen"] = self.head_screen
        self.compact_tiles = int(settings.compact_tiles if compact_tiles is None
                                else bool(compact_tiles))
        cfg["compact_tiles"] = self.compact_tiles
        cfg["amx"] = self.amx
        cfg["amx_one_term"] = AMX_WEIGHTS[amx_weights] if self.amx else 0
        cfg["lora_rank"] = self.lora_rank = adapter_rank(tensors)
        cfg["lora_f16"] = self.lora_f16 = int(any(
            n.endswith(".lora_at") and t.dtype == np.float16 for n, t in tensors.items()))
        self.model = _call(_native.NativeModel, cfg, tensors, self.capacity,
                           act_q8=self.q8_mask(), level=level_id, threads=self.threads,
                           pool=_get_pool(self.threads), avxvnni=self.avxvnni)
        self.level = self.model.level

    def q8_mask(self) -> int:
        """The engine's act_q8 argument: the products with int8 activations (all under q8),
        and those among them with one digit."""
        if self.act != "q8":
            return 0
        return Q8_ALL | ((Q8_ALL << Q8_ONE_DIGIT_SHIFT) if self.digits == 1 else 0)

    def new_kv(self, capacity: int):
        return _call(_native.NativeKV, self.model, int(capacity), format=self.kv_format)

    def forward(self, kv, ids: np.ndarray, start_pos: int, all_logits: bool,
                screen: bool = False) -> np.ndarray:
        """Logits float32 ``[n, vocab]`` (all_logits) or ``[vocab]``; ids int32 ``[n]``.
        ``screen`` (without all_logits): a screened head (``head_screen``) may leave
        estimates outside its K best tiles of 16 rows: for a caller that takes the largest
        logit only."""
        n = ids.shape[0]
        logits = np.empty((n, self.vocab_size) if all_logits else (self.vocab_size,),
                          dtype=np.float32)
        _call(self.model.forward, kv, ids, int(start_pos), logits, all_logits=all_logits,
              threads=self.threads, pool=_get_pool(self.threads), screen=bool(screen))
        return logits

    def forward_batch(self, kvs: list, ids: np.ndarray, pos: np.ndarray,
                      screen=None) -> np.ndarray:
        """One token per sequence: logits float32 ``[n, vocab]`` of ``ids[i]`` (int32) at
        position ``pos[i]`` (int32) of ``kvs[i]``; one pass over the weights for all of them.
        ``screen``: per row, whether it may be screened (see :meth:`forward`; None: none)."""
        logits = np.empty((ids.shape[0], self.vocab_size), dtype=np.float32)
        _call(self.model.forward_batch, kvs, ids, pos, logits, threads=self.threads,
              pool=_get_pool(self.threads), screen=_screen_rows(screen, ids.shape[0]))
        return logits

    def verify(self, kv, ids: np.ndarray, start_pos: int, screen: bool = False) -> np.ndarray:
        """Drafted tokens ``ids`` (int32) at ``start_pos``.. of ``kv``: logits float32
        ``[n, vocab]``, each row what a one-token :meth:`forward` at its position computes
        (with the same ``screen``)."""
        n = ids.shape[0]
        return self.verify_batch([kv] * n, ids,
                                 np.arange(start_pos, start_pos + n, dtype=np.int32),
                                 screen=[screen] * n if screen else None)

    def verify_batch(self, kvs: list, ids: np.ndarray, pos: np.ndarray,
                     screen=None) -> np.ndarray:
        """Drafted tokens of several sequences: row ``i`` is ``ids[i]`` at ``pos[i]`` of
        ``kvs[i]`` (a cache may repeat, at increasing positions); logits float32 ``[n, vocab]``,
        each row what a one-token :meth:`forward` at its position computes. ``screen``: per
        row, as in :meth:`forward_batch`."""
        logits = np.empty((ids.shape[0], self.vocab_size), dtype=np.float32)
        _call(self.model.verify_batch, kvs, ids, pos, logits, threads=self.threads,
              pool=_get_pool(self.threads), screen=_screen_rows(screen, ids.shape[0]))
        return logits

    def kv_copy(self, dst, src, n: int) -> None:
        """Positions ``[0, n)`` of the cache ``src`` into ``dst``."""
        _call(self.model.kv_copy, dst, src, int(n))
