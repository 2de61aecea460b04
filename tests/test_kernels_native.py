"""The native kernels (pocketlm._native) against their numpy twins.

Every kernel level the CPU supports is tested (scalar always; avx2 / avx512 where the CPU has
them), for INT4 and INT8 weights, float32 and int8 activations, over awkward shapes.

Bounds used:

* float activations (``act="f32"``): ``|y - y_ref| <= 1e-5 * S`` elementwise, with
  ``S = |x| @ (|W| + 2|M|).T`` (M: the INT4 minimums broadcast over their group, 0 for INT8),
  the scale of float32 rounding in the per-group decomposition (q*s)·x + sum(x)·m that both the
  reference and the kernels evaluate. Observed errors are ~100x below this.
* int8 activations (``act="q8"``): the kernel computes exactly ``W . x~`` where ``x~`` is the
  block-quantized activation, so ``|y - y_ref| <= ||W_r|| * ||x - x~||
  <= sqrt(32)/254 * ||x_i|| * ||W_r||`` (each block's rounding error is at most half a step of
  ``absmax/127``), plus the float32 term above. The test also checks the kernel against
  ``x~ @ W.T`` computed in float64 (x~ from a numpy twin of the quantizer, compared bit for bit)
  to the float32 bound, which pins the integer path down far more tightly.

If the extension is not built these tests fail (they do not skip): run ``pip install -e .``.
"""

from __future__ import annotations

import functools
import os
import platform
import zlib

import numpy as np
import pytest

from pocketlm.errors import KernelError
from pocketlm.quant import QuantTensor, quantize_int4, quantize_int8
from pocketlm.runtime.kernels import native, numpy_ref

try:
    from pocketlm import _native
except ImportError:
    _native = None

ALL_LEVELS = ("scalar", "avx2", "avx512", "neon")  # indices: _native.LEVEL_*
# the levels of this architecture (the NEON kernels are checked on x86 machines too, cross-built
# and run under qemu: tests/test_arm_build.py)
ARCH_LEVELS = (("scalar", "neon") if platform.machine().lower() in ("aarch64", "arm64")
               else ("scalar", "avx2", "avx512"))
NS = (1, 2, 3, 7, 33)
ROWS = (1, 3, 32, 100, 257)
COLS = (32, 64, 96, 576, 1536)
F32_RTOL = 1e-5
Q8_STEP_BOUND = np.sqrt(32.0) / 254.0  # ||x - x~|| <= this * ||x||


@pytest.fixture(autouse=True)
def _require_native():
    if not native.available():
        pytest.fail(f"{native.unavailable_reason()}. The native kernel tests need the compiled "
                    f"extension: run `pip install -e .` (or `python setup.py build_ext "
                    f"--inplace`) in the source tree.", pytrace=False)


def _supported_levels() -> list[str]:
    return list(native.cpu_features().get("levels", [])) if native.available() else []


def _require_level(level: str) -> None:
    if level not in _supported_levels():
        pytest.skip(f"this CPU does not support the {level} kernels "
                    f"(supported: {_supported_levels()})")


# -- data ------------------------------------------------------------------------------------
def _weights(kind: str, rows: int, cols: int, gs: int, seed: int) -> QuantTensor:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w += rng.standard_normal((rows, 1)).astype(np.float32) * 0.02  # row offsets: mins matter
    if rows > 2:
        w[1] = 0.0  # zero scales and minimums
        w[2] = 0.125  # constant row
    if kind == "int4":
        return quantize_int4(w, gs)
    return quantize_int8(w, gs)


def _activations(n: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    if n >= 3:
        x[1] = 0.0  # all-zero token
        x[2] *= 300.0  # large token with an outlier
        x[2, cols // 2] = 5e4
    return x


def _quantize_act_twin(x: np.ndarray):
    """numpy twin of the activation quantizer (same float32 operations)."""
    n, cols = x.shape
    b = x.reshape(n, cols // 32, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = (np.float32(1) / d).astype(np.float32)
    tiny = amax < np.float32(1e-30)
    d = np.where(tiny, np.float32(0), d)
    inv = np.where(tiny, np.float32(0), inv)
    v = np.clip(b * inv[:, :, None], np.float32(-127), np.float32(127))
    q = np.rint(v).astype(np.int8)
    sx = (d * q.astype(np.float32).sum(axis=2)).astype(np.float32)
    return q.reshape(n, cols), d, sx


def _act_digits_twin(x: np.ndarray, digits: int):
    """numpy twin of the engine's activation digits (pm_act, same float32 operations): a NaN
    never wins a block's maximum and quantizes to -127."""
    n, cols = x.shape
    b = x.reshape(n, cols // 32, 32)
    amax = np.where(np.isnan(b), np.float32(0), np.abs(b)).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = (np.float32(1) / d).astype(np.float32)
    tiny = ~(amax >= np.float32(1e-30))
    d = np.where(tiny, np.float32(0), d)
    inv = np.where(tiny, np.float32(0), inv)
    with np.errstate(invalid="ignore"):
        t = b * inv[:, :, None]
    t = np.where(np.isnan(t), np.float32(-127), np.clip(t, np.float32(-127), np.float32(127)))
    r1 = np.rint(t)
    s = r1.astype(np.int64).sum(axis=2)
    q2 = None
    if digits == 2:
        r2 = np.rint((t - r1) * np.float32(128))
        q2 = r2.astype(np.int8).reshape(n, cols)
        s = 128 * s + r2.astype(np.int64).sum(axis=2)
        d = (d * np.float32(1 / 128)).astype(np.float32)
    bsum = (d * s.astype(np.float32)).astype(np.float32)
    return r1.astype(np.int8).reshape(n, cols), q2, d, bsum


def _dense(w: QuantTensor):
    """(W, M): float64 dequantized weight and the INT4 minimums broadcast over their groups."""
    wd = w.dequantize().astype(np.float64)
    if w.kind == "int4":
        m = np.repeat(w.mins.astype(np.float64), w.group_size, axis=1)
    else:
        m = np.zeros_like(wd)
    return wd, m


@functools.cache
def _case(kind: str, n: int, rows: int, cols: int, gs: int):
    seed = zlib.crc32(repr((kind, n, rows, cols, gs)).encode()) % 10_000
    w = _weights(kind, rows, cols, gs, seed)
    x = _activations(n, cols, seed)
    ref = numpy_ref.linear_ref(x, w)
    wd, m = _dense(w)
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ (np.abs(wd) + 2 * np.abs(m)).T
    qx, dx, _ = _quantize_act_twin(x)
    xt = qx.astype(np.float64).reshape(n, cols // 32, 32) * dx[:, :, None].astype(np.float64)
    xt = xt.reshape(n, cols)
    y_xt = xt @ wd.T  # what the q8 path computes, exactly
    scale_xt = np.abs(xt) @ (np.abs(wd) + 2 * np.abs(m)).T
    q8_bound = (Q8_STEP_BOUND * np.linalg.norm(x64, axis=1)[:, None]
                * np.linalg.norm(wd, axis=1)[None, :])
    return w, x, ref, scale, y_xt, scale_xt, q8_bound


def _cases():
    for n in NS:
        for rows in ROWS:
            for cols in COLS:
                for gs in (32, 64, 128):
                    if cols % gs == 0:
                        yield n, rows, cols, gs


# -- accuracy --------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_f32_activations_match_numpy(kind, level):
    _require_level(level)
    worst = 0.0
    for n, rows, cols, gs in _cases():
        w, x, ref, scale, *_ = _case(kind, n, rows, cols, gs)
        y = native.linear(x, w, act="f32", level=level, threads=1)
        assert y.shape == (n, rows) and y.dtype == np.float32
        err = np.abs(y.astype(np.float64) - ref)
        bad = err > F32_RTOL * scale + 1e-30
        assert not bad.any(), (
            f"{kind} {level} n={n} rows={rows} cols={cols} gs={gs}: max error "
            f"{err.max():.3g}, bound {F32_RTOL} * S at the worst element "
            f"{(F32_RTOL * scale)[bad].min():.3g}")
        worst = max(worst, float((err / np.maximum(scale, 1e-30)).max()))
    assert worst < F32_RTOL


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_q8_activations_match_numpy(kind, level):
    _require_level(level)
    for n, rows, cols, gs in _cases():
        w, x, ref, scale, y_xt, scale_xt, q8_bound = _case(kind, n, rows, cols, gs)
        y = native.linear(x, w, act="q8", level=level, threads=1).astype(np.float64)
        where = f"{kind} {level} n={n} rows={rows} cols={cols} gs={gs}"
        # the documented bound against the float reference
        err = np.abs(y - ref)
        assert (err <= q8_bound + F32_RTOL * scale + 1e-30).all(), (
            f"{where}: error {err.max():.3g} exceeds sqrt(32)/254 ||x|| ||W_r||")
        # and the exact target of the integer path, to float32 rounding
        err_xt = np.abs(y - y_xt)
        assert (err_xt <= F32_RTOL * scale_xt + 1e-30).all(), (
            f"{where}: q8 result differs from x~ @ W.T by {err_xt.max():.3g}")


@pytest.mark.parametrize("level", ARCH_LEVELS)
def test_q8_typical_error_is_small(level):
    """On Gaussian data the q8 path's relative error is far below the worst-case bound."""
    _require_level(level)
    rng = np.random.default_rng(7)
    w = quantize_int4(rng.standard_normal((257, 1536)).astype(np.float32), 32)
    x = rng.standard_normal((7, 1536)).astype(np.float32)
    ref = numpy_ref.linear_ref(x, w)
    y = native.linear(x, w, act="q8", level=level)
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 0.01, rel


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_q8_refuses_non_finite_activations_f32_carries_them(level, bad):
    """int8 has no NaN or inf: a NaN activation became -127 and gave finite, plausible
    outputs (inf gave wrong-signed infinities at the scalar level)."""
    _require_level(level)
    rng = np.random.default_rng(8)
    w = quantize_int4(rng.standard_normal((64, 256)).astype(np.float32), 32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[1, 5] = bad
    with pytest.raises(KernelError, match="non-finite activations"):
        native.linear(x, w, act="q8", level=level)
    y = native.linear(x, w, act="f32", level=level)
    assert np.isfinite(y[0]).all() and not np.isfinite(y[1]).all()


def _awkward_activations(rows: int, seed: int) -> np.ndarray:
    """[rows >= 6, 576] activations with the quantizers' edge cases in rows 1-5."""
    x = np.random.default_rng(seed).standard_normal((rows, 576)).astype(np.float32)
    x[1] = 0.0
    x[2] *= 1e4
    x[3, :32] = 1e-35  # below the tiny threshold: quantizes to zero
    x[4, :32] = np.arange(32, dtype=np.float32) - 15.5  # ties after scaling by 127 / 15.5
    x[5, :32] = 0.5 + np.arange(32, dtype=np.float32)
    x[5, 0] = 127.0  # d = 1: x.5 values are exact ties (and their second digits too)
    return x


@pytest.mark.parametrize("level", ARCH_LEVELS)
def test_quantize_act_matches_twin_bit_for_bit(level):
    _require_level(level)
    x = _awkward_activations(9, seed=3)
    qx = np.empty((9, 576), np.int8)
    dx = np.empty((9, 18), np.float32)
    sx = np.empty((9, 18), np.float32)
    _native.quantize_act_q8(x, qx, dx, sx, level=ALL_LEVELS.index(level))
    q_ref, d_ref, s_ref = _quantize_act_twin(x)
    np.testing.assert_array_equal(qx, q_ref)
    np.testing.assert_array_equal(dx, d_ref)
    np.testing.assert_array_equal(sx, s_ref)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("level", ARCH_LEVELS)
def test_engine_act_digits_match_twin_bit_for_bit(level, digits):
    # the int8 digits the engine's products read (pm_act): every level computes the same bits
    _require_level(level)
    x = _awkward_activations(10, seed=5)
    x[6, 40] = np.nan  # a NaN neither wins its block's maximum nor breaks the others
    x[7, 64:96] = np.float32(3.0) * (np.arange(32) % 2 * 2 - 1)  # +-amax: digits +-127, 0
    q1 = np.full((10, 576), 99, np.int8)
    q2 = np.full((10, 576), 99, np.int8)
    dd = np.empty((10, 18), np.float32)
    bsum = np.empty((10, 18), np.float32)
    _native.act_digits(x, q1, q2, dd, bsum, digits=digits, level=ALL_LEVELS.index(level))
    r1, r2, rd, rb = _act_digits_twin(x, digits)
    np.testing.assert_array_equal(q1, r1)
    if digits == 2:
        np.testing.assert_array_equal(q2, r2)
    else:
        assert (q2 == 99).all()  # not written
    np.testing.assert_array_equal(dd, rd)
    np.testing.assert_array_equal(bsum, rb)


def test_engine_act_digits_bad_input():
    x = np.ones((2, 64), np.float32)
    q = np.empty((2, 64), np.int8)
    d = np.empty((2, 2), np.float32)
    b = np.empty((2, 2), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        _native.act_digits(np.ones((2, 48), np.float32), q[:, :48].copy(), q[:, :48].copy(),
                           d, b)
    with pytest.raises(ValueError, match="shape"):
        _native.act_digits(x, q, q.copy(), np.empty((2, 3), np.float32), b)
    with pytest.raises(TypeError, match="dtype"):
        _native.act_digits(x, q.view(np.uint8), q.copy(), d, b)
    with pytest.raises(ValueError, match="share memory"):
        _native.act_digits(x, q, q, d, b)
    with pytest.raises(ValueError, match="digits"):
        _native.act_digits(x, q, q.copy(), d, b, digits=3)
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.act_digits(np.ones((64, 2), np.float32).T, q, q.copy(), d, b)


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("act", ["f32", "q8"])
def test_int8_weights_with_minus_128(level, act):
    """GGUF Q8_0 blocks may hold -128; the |w| x sign(x, w) trick must stay exact."""
    _require_level(level)
    rng = np.random.default_rng(11)
    rows, cols = 37, 96
    q = rng.integers(-128, 128, (rows, cols), dtype=np.int8)
    q[:, ::7] = -128
    scales = (rng.random((rows, cols // 32)) * 0.01 + 1e-3).astype(np.float16)
    w = QuantTensor("int8", (rows, cols), 32, q, scales, None)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    ref = numpy_ref.linear_ref(x, w)
    y = native.linear(x, w, act=act, level=level)
    qx, dx, _ = _quantize_act_twin(x)
    xt = x if act == "f32" else (qx.reshape(5, 3, 32) * dx[:, :, None]).reshape(5, cols)
    target = xt.astype(np.float64) @ w.dequantize().astype(np.float64).T
    scale = np.abs(xt).astype(np.float64) @ np.abs(w.dequantize()).astype(np.float64).T
    assert (np.abs(y - target) <= F32_RTOL * scale).all()
    if act == "f32":
        assert (np.abs(y - ref) <= F32_RTOL * scale).all()


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_threads_give_identical_results(kind, level):
    _require_level(level)
    for n, rows, cols in [(1, 257, 1536), (1, 1000, 576), (7, 257, 576), (33, 100, 1536)]:
        w = _weights(kind, rows, cols, 32, 5)
        x = _activations(n, cols, 5)
        for act in ("f32", "q8"):
            y1 = native.linear(x, w, act=act, level=level, threads=1)
            for t in (2, 3):
                yt = native.linear(x, w, act=act, level=level, threads=t)
                assert np.array_equal(y1, yt), f"{kind} {act} {level} n={n} rows={rows} t={t}"


def test_levels_agree_closely():
    """All supported levels compute the same products (to float32 rounding)."""
    levels = _supported_levels()
    w = _weights("int4", 100, 576, 64, 1)
    x = _activations(7, 576, 1)
    for act in ("f32", "q8"):
        ys = [native.linear(x, w, act=act, level=lv) for lv in levels]
        for lv, y in zip(levels[1:], ys[1:], strict=True):
            np.testing.assert_allclose(y, ys[0], rtol=1e-4, atol=1e-4 * np.abs(ys[0]).max(),
                                       err_msg=f"{act}: {lv} vs {levels[0]}")


def test_special_values_do_not_crash():
    w = _weights("int4", 32, 64, 32, 2)
    x = np.ones((3, 64), np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    for level in _supported_levels():
        y = native.linear(x, w, act="f32", level=level)
        assert y.shape == (3, 32)
        assert np.isfinite(y[2]).all()  # one row's NaN stays in its row
        with pytest.raises(KernelError, match="non-finite"):  # int8 cannot hold them
            native.linear(x, w, act="q8", level=level)
    y = native.linear(x, w, act="f32")
    assert np.isnan(y[0]).all()


def test_empty_batch_and_bias():
    w = _weights("int8", 8, 64, 64, 4)
    y = native.linear(np.zeros((0, 64), np.float32), w)
    assert y.shape == (0, 8)
    x = _activations(2, 64, 4)
    b = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose(native.linear(x, w, b), numpy_ref.linear_ref(x, w, b),
                               rtol=1e-5, atol=1e-5)
    wf = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    np.testing.assert_allclose(native.linear(x, wf, b), numpy_ref.linear_ref(x, wf, b),
                               rtol=1e-6, atol=1e-6)


# -- CPU detection and selection -------------------------------------------------------------
def test_cpu_features_and_levels():
    info = native.cpu_features()
    assert info["levels"][0] == "scalar"
    assert info["best"] == info["levels"][-1]
    assert set(info["levels"]) <= set(info["compiled"]) <= set(ALL_LEVELS)
    f = info["features"]
    if "avx2" in info["levels"]:
        assert f["avx2"] and f["fma"] and f["f16c"]
    if "avx512" in info["levels"]:
        assert all(f[k] for k in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni"))


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="/proc/cpuinfo flags are checked on Linux x86-64 only")
def test_detection_matches_proc_cpuinfo():
    """A level the CPU has must not be missed (its tests would then be skipped)."""
    with open("/proc/cpuinfo") as fh:
        flags = next(line for line in fh if line.startswith("flags")).split(":", 1)[1].split()
    levels = native.cpu_features()["levels"]
    if {"avx2", "fma", "f16c"} <= set(flags):
        assert "avx2" in levels
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= set(flags):
        assert "avx512" in levels


def test_level_and_threads_from_environment(monkeypatch):
    w = _weights("int4", 16, 64, 32, 6)
    x = _activations(2, 64, 6)
    monkeypatch.setenv("POCKET_CPU_LEVEL", "scalar")
    assert native.cpu_features()["selected"] == "scalar"
    y_scalar = native.linear(x, w)
    np.testing.assert_array_equal(y_scalar, native.linear(x, w, level="scalar"))
    monkeypatch.setenv("POCKET_CPU_LEVEL", "pentium")
    with pytest.raises(KernelError, match="POCKET_CPU_LEVEL"):
        native.linear(x, w)
    monkeypatch.delenv("POCKET_CPU_LEVEL")
    monkeypatch.setenv("POCKET_THREADS", "2")
    assert native.default_threads() == 2
    monkeypatch.setenv("POCKET_THREADS", "many")
    with pytest.raises(KernelError, match="POCKET_THREADS"):
        native.linear(x, w)
    with pytest.raises(KernelError, match="level"):
        native.linear(x, w, level="avx9000")
    for level in set(ALL_LEVELS) - set(_supported_levels()):
        with pytest.raises(KernelError, match="does not support"):
            native.linear(x, w, level=level, threads=1)


# -- bad input at the native boundary --------------------------------------------------------
def _q4_args(n=2, rows=8, cols=64, gs=32):
    w = _weights("int4", rows, cols, gs, 9)
    x = _activations(n, cols, 9)
    out = np.empty((n, rows), np.float32)
    return dict(x=x, qweight=w.qweight, scales=w.scales, mins=w.mins, group_size=gs, out=out)


def _q8_args(n=2, rows=8, cols=64, gs=32):
    w = _weights("int8", rows, cols, gs, 9)
    x = _activations(n, cols, 9)
    out = np.empty((n, rows), np.float32)
    return dict(x=x, qweight=w.qweight, scales=w.scales, group_size=gs, out=out)


def _bad_q4_cases():
    a = _q4_args
    ro = np.empty((2, 8), np.float32)
    ro.flags.writeable = False
    wide = np.zeros((2, 128), np.float32)
    return [
        ("x float64", dict(a(), x=a()["x"].astype(np.float64)), TypeError),
        ("x big-endian", dict(a(), x=a()["x"].astype(">f4")), TypeError),
        ("x list", dict(a(), x=a()["x"].tolist()), TypeError),
        ("x None", dict(a(), x=None), TypeError),
        ("x 1-D", dict(a(), x=a()["x"][0]), ValueError),
        ("x 3-D", dict(a(), x=a()["x"][None]), ValueError),
        ("x non-contiguous", dict(a(), x=wide[:, ::2]), ValueError),
        ("x Fortran order", dict(a(), x=np.asfortranarray(a()["x"])), ValueError),
        ("x wrong features", dict(a(), x=np.zeros((2, 96), np.float32)), ValueError),
        ("qweight int8", dict(a(), qweight=a()["qweight"].view(np.int8)), TypeError),
        ("qweight float32", dict(a(), qweight=a()["qweight"].astype(np.float32)), TypeError),
        ("qweight non-contiguous", dict(a(), qweight=np.zeros((8, 64), np.uint8)[:, ::2]),
         ValueError),
        ("zero rows", dict(a(), qweight=np.zeros((0, 32), np.uint8),
                           scales=np.zeros((0, 2), np.float16), mins=np.zeros((0, 2), np.float16),
                           out=np.empty((2, 0), np.float32)), ValueError),
        ("cols not a multiple of 32", dict(a(), x=np.zeros((2, 48), np.float32),
                                           qweight=np.zeros((8, 24), np.uint8)), ValueError),
        ("scales float32", dict(a(), scales=a()["scales"].astype(np.float32)), TypeError),
        ("scales wrong shape", dict(a(), scales=np.zeros((8, 3), np.float16)), ValueError),
        ("scales wrong rows", dict(a(), scales=np.zeros((7, 2), np.float16)), ValueError),
        ("mins wrong shape", dict(a(), mins=np.zeros((8, 1), np.float16)), ValueError),
        ("mins None", dict(a(), mins=None), TypeError),
        ("group size 16", dict(a(), group_size=16), ValueError),
        ("group size not dividing cols", dict(a(cols=96), group_size=64,
                                              scales=np.zeros((8, 1), np.float16),
                                              mins=np.zeros((8, 1), np.float16)), ValueError),
        ("out wrong shape", dict(a(), out=np.empty((8, 2), np.float32)), ValueError),
        ("out float64", dict(a(), out=np.empty((2, 8), np.float64)), TypeError),
        ("out read-only", dict(a(), out=ro), ValueError),
        ("out non-contiguous", dict(a(), out=np.empty((2, 16), np.float32)[:, ::2]),
         ValueError),
    ]


@pytest.mark.parametrize("case", _bad_q4_cases(), ids=lambda c: c[0])
def test_bad_input_q4_raises(case):
    _, kwargs, exc = case
    for act_q8 in (False, True):
        with pytest.raises(exc):
            _native.matmul_q4(**kwargs, act_q8=act_q8)


def test_bad_input_q8_raises():
    a = _q8_args
    with pytest.raises(TypeError):
        _native.matmul_q8(**dict(a(), qweight=a()["qweight"].view(np.uint8)))
    with pytest.raises(ValueError):
        _native.matmul_q8(**dict(a(), scales=np.zeros((8, 3), np.float16)))
    with pytest.raises(ValueError):
        _native.matmul_q8(**dict(a(), qweight=np.zeros((0, 64), np.int8),
                                 scales=np.zeros((0, 2), np.float16),
                                 out=np.empty((2, 0), np.float32)))
    with pytest.raises(ValueError):
        _native.matmul_q8(**dict(a(), x=np.zeros((2, 32), np.float32)))


def test_bad_options_raise():
    a = _q4_args()
    with pytest.raises(ValueError, match="level"):
        _native.matmul_q4(**a, level=7)
    with pytest.raises(ValueError, match="threads"):
        _native.matmul_q4(**a, threads=0)
    with pytest.raises(TypeError, match="pool"):
        _native.matmul_q4(**a, pool="not a pool")
    with pytest.raises(ValueError):
        _native.ThreadPool(0)
    b = _q4_args(n=8, rows=64)  # x is (8, 64) and so is out: let them alias
    with pytest.raises(ValueError, match="share memory"):
        _native.matmul_q4(**dict(b, out=b["x"]))


def test_quantize_act_bad_input():
    x = np.zeros((2, 64), np.float32)
    qx, dx, sx = np.empty((2, 64), np.int8), np.empty((2, 2), np.float32), np.empty(
        (2, 2), np.float32)
    with pytest.raises(ValueError):
        _native.quantize_act_q8(np.zeros((2, 48), np.float32), qx, dx, sx)
    with pytest.raises(ValueError):
        _native.quantize_act_q8(x, qx, np.empty((2, 3), np.float32), sx)
    with pytest.raises(TypeError):
        _native.quantize_act_q8(x, qx.view(np.uint8), dx, sx)
    with pytest.raises(ValueError, match="share memory"):
        _native.quantize_act_q8(x, qx, dx, dx)


def test_linear_translates_errors_to_kernel_error():
    w = _weights("int4", 8, 64, 32, 8)
    with pytest.raises(KernelError):
        native.linear(np.zeros((2, 64), np.float64), w)
    with pytest.raises(KernelError):
        native.linear(np.zeros((2, 32), np.float32), w)
    with pytest.raises(KernelError):
        native.linear(np.zeros((4, 128), np.float32)[:, ::2], w)
    with pytest.raises(KernelError):
        native.linear(np.zeros((2, 64), np.float32), w, act="int3")
    with pytest.raises(KernelError):
        native.linear(np.zeros((2, 64), np.float32), w, np.zeros(3, np.float32))
    bad = QuantTensor("int4", (8, 64), 32, w.qweight, w.scales[:, :1], w.mins)
    with pytest.raises(KernelError):
        native.linear(np.zeros((2, 64), np.float32), bad)


def test_pool_survives_fork():
    """A pool created before fork is usable (serially) in the child, and a new one is made."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    w = _weights("int4", 300, 576, 32, 12)
    x = _activations(1, 576, 12)
    y = native.linear(x, w, threads=2)
    pool = native._get_pool(2)  # the parent's pool, with its worker threads
    pid = os.fork()
    if pid == 0:  # child: must not hang or crash
        code = 0
        try:
            yc = np.empty_like(y)
            _native.matmul_q4(x, w.qweight, w.scales, w.mins, 32, yc, threads=2, pool=pool)
            yd = native.linear(x, w, threads=2)
            code = 0 if np.array_equal(yc, y) and np.array_equal(yd, y) else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def _matmul_f32_twin(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The engine's float32-weight product in its documented order (pm_matmul_f32_portable):
    8 lane sums per dot product (a float32 multiply, then an add), folded as
    ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the last cols % 8 products one by
    one."""
    n, cols = x.shape
    acc = np.zeros((n, w.shape[0], 8), np.float32)
    c = 0
    while c + 8 <= cols:
        acc = acc + x[:, None, c:c + 8] * w[None, :, c:c + 8]
        c += 8
    s = ((acc[..., 0] + acc[..., 4]) + (acc[..., 1] + acc[..., 5])) + \
        ((acc[..., 2] + acc[..., 6]) + (acc[..., 3] + acc[..., 7]))
    for k in range(c, cols):
        s = s + x[:, None, k] * w[None, :, k]
    return s


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("n,rows,cols", [(1, 1, 5), (2, 4, 8), (3, 7, 37), (7, 33, 576),
                                         (65, 9, 1539), (23, 6, 5003)])
def test_engine_matmul_f32_bit_for_bit(level, n, rows, cols):
    # the float reference path's product: every level gives the documented order's bits, for
    # row counts around the avx2 level's blocks of 4 rows x 2 tokens, odd token counts, column
    # counts with a tail, and (5003 columns: 9 tokens per block) several token blocks
    _require_level(level)
    rng = np.random.default_rng(n * 1000 + cols)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float32)
    y = np.full((n, rows), np.nan, np.float32)
    _native.matmul_f32(x, w, y, level=ALL_LEVELS.index(level))
    np.testing.assert_array_equal(y, _matmul_f32_twin(x, w))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.astype(np.float64).T,
                               rtol=1e-4, atol=1e-4 * np.sqrt(cols))


def _lora_twin(x: np.ndarray, at: np.ndarray, bt: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The LoRA adapters' part in its documented order (pm_ops.lora_down / lora_up): t = 0 +
    x[:, 0] A^T[0] + x[:, 1] A^T[1] + ... and y + t[:, 0] B^T[0] + t[:, 1] B^T[1] + ..., each
    product a float32 multiply, then an add."""
    at, bt = at.astype(np.float32), bt.astype(np.float32)
    t = np.zeros((x.shape[0], at.shape[1]), np.float32)
    for c in range(at.shape[0]):
        t = t + x[:, c:c + 1] * at[c]
    for k in range(bt.shape[0]):
        y = y + t[:, k:k + 1] * bt[k]
    return y


@pytest.mark.parametrize("level", ARCH_LEVELS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,cols,rank,rows,step", [(1, 576, 16, 576, 0), (1, 64, 64, 192, 0),
                                                   (6, 37, 13, 45, 0), (9, 200, 24, 70, 3),
                                                   (4, 129, 256, 33, 5), (3, 96, 5, 1536, 16)])
def test_engine_lora_bit_for_bit(level, dtype, n, cols, rank, rows, step):
    # adapters beside the weights: every level gives the documented order's bits, for float16
    # (converted as read, in chunks) and float32 adapters, ranks with and without a tail of
    # eight, blocks of four tokens and single ones, output columns split as threads split them
    _require_level(level)
    rng = np.random.default_rng(n * 1000 + cols + rank)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    at = (rng.standard_normal((cols, rank)) / np.sqrt(cols)).astype(dtype)
    bt = (rng.standard_normal((rank, rows)) * 0.2).astype(dtype)
    y0 = rng.standard_normal((n, rows), dtype=np.float32)
    y = y0.copy()
    _native.lora(x, at, bt, y, step=step, level=ALL_LEVELS.index(level))
    np.testing.assert_array_equal(y, _lora_twin(x, at, bt, y0))
    want = y0 + (x.astype(np.float64) @ at.astype(np.float64)) @ bt.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.sqrt(cols))


def test_engine_lora_bad_input():
    x, y = np.ones((2, 8), np.float32), np.zeros((2, 3), np.float32)
    at, bt = np.ones((8, 4), np.float16), np.ones((4, 3), np.float16)
    with pytest.raises(TypeError, match="float16"):  # mixed dtypes
        _native.lora(x, at, bt.astype(np.float32), y)
    with pytest.raises(ValueError, match="at has shape"):
        _native.lora(x, np.ones((9, 4), np.float16), bt, y)
    with pytest.raises(ValueError, match="out has shape"):
        _native.lora(x, at, bt, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="rank 1..256"):
        _native.lora(x, np.ones((8, 257), np.float32), np.ones((257, 3), np.float32), y)
    buf = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        _native.lora(buf.reshape(2, 8), at, bt, buf[:6].reshape(2, 3))
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros((2, 3), np.float32)
        ro.flags.writeable = False
        _native.lora(x, at, bt, ro)


def test_engine_matmul_f32_bad_input():
    x, w = np.ones((2, 8), np.float32), np.ones((3, 8), np.float32)
    with pytest.raises(ValueError, match="out has shape"):
        _native.matmul_f32(x, w, np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="w has shape"):
        _native.matmul_f32(x, np.ones((3, 9), np.float32), np.empty((2, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        _native.matmul_f32(x.astype(np.float64), w, np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="features"):
        _native.matmul_f32(np.ones((2, 0), np.float32), np.ones((3, 0), np.float32),
                           np.empty((2, 3), np.float32))
    buf = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        _native.matmul_f32(buf.reshape(2, 8), w, buf[10:].reshape(2, 3))
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.matmul_f32(x, w, np.empty((3, 2), np.float32).T)
