"""Exact tests of the INT4/INT5/INT8 layouts, the quantizers and the lossless GGUF block import.

Everything here is pure numpy on small arrays (plus gguf-py as the reference for the GGUF block
formats), so it runs in a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from pocketlm import quant
from pocketlm.errors import UnsupportedError
from pocketlm.quant import (
    QuantTensor,
    dequantize_int4,
    dequantize_int5,
    dequantize_int8,
    int4_from_gguf_blocks,
    int5_from_gguf_blocks,
    int8_from_gguf_blocks,
    pack_int4,
    pack_int5,
    quantize,
    quantize_int4,
    quantize_int5,
    quantize_int8,
    relative_error,
    unpack_int4,
    unpack_int5,
)

U = 2.0 ** -11  # unit roundoff of float16
F16_SUB = 2.0 ** -25  # half the spacing of float16 subnormals


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def ref_pack(q: np.ndarray) -> bytes:
    """The documented INT4 layout, element by element."""
    rows, cols = q.shape
    out = bytearray()
    for r in range(rows):
        for b in range(cols // 32):
            for k in range(16):
                out.append(int(q[r, 32 * b + k]) | (int(q[r, 32 * b + 16 + k]) << 4))
    return bytes(out)


# -- byte-level layout -----------------------------------------------------------------------
def test_pack_int4_1x64_exact_bytes():
    q = np.zeros((1, 64), np.uint8)
    q[0, 0:16] = np.arange(16)  # block 0, low nibbles
    q[0, 16:32] = np.arange(15, -1, -1)  # block 0, high nibbles
    q[0, 32:48] = 1  # block 1, low
    q[0, 48:64] = 2  # block 1, high
    packed = pack_int4(q)
    expected = bytes.fromhex("f0e1d2c3b4a5968778695a4b3c2d1e0f") + b"\x21" * 16
    assert packed.dtype == np.uint8 and packed.shape == (1, 32)
    assert packed.tobytes() == expected
    assert packed.tobytes() == ref_pack(q)
    assert np.array_equal(unpack_int4(packed), q)


def test_pack_int4_2x32_exact_bytes():
    q = np.zeros((2, 32), np.uint8)
    q[0, :16] = 15  # row 0: low nibbles 15, high nibbles 0
    q[1] = np.arange(32) % 16  # row 1: byte k = k | k << 4
    packed = pack_int4(q)
    assert packed.shape == (2, 16)
    assert packed[0].tobytes() == b"\x0f" * 16
    assert packed[1].tobytes() == bytes(k * 0x11 for k in range(16))
    assert packed.tobytes() == ref_pack(q)
    assert np.array_equal(unpack_int4(packed), q)


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (5, 256), (2, 4096)])
def test_pack_unpack_random_roundtrip(shape):
    q = rng(1).integers(0, 16, size=shape, dtype=np.uint8)
    packed = pack_int4(q)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.flags.c_contiguous
    assert packed.tobytes() == ref_pack(q)
    assert np.array_equal(unpack_int4(packed), q)
    # every byte value unpacks and repacks to itself
    allbytes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(pack_int4(unpack_int4(allbytes)), allbytes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_int4_formula(group_size):
    r = rng(2)
    rows, cols = 3, 256
    q = r.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    scales = r.standard_normal((rows, cols // group_size)).astype(np.float16)
    mins = r.standard_normal((rows, cols // group_size)).astype(np.float16)
    w = dequantize_int4(pack_int4(q), scales, mins, group_size)
    assert w.dtype == np.float32 and w.shape == (rows, cols)
    expected = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for c in range(cols):
            g = c // group_size
            expected[i, c] = np.float32(
                float(q[i, c]) * float(scales[i, g]) + float(mins[i, g])
            )
    assert np.array_equal(w, expected)
    qt = QuantTensor("int4", (rows, cols), group_size, pack_int4(q), scales, mins)
    assert np.array_equal(qt.dequantize(), expected)
    assert np.array_equal(qt.dequantize(slice(1, 3)), expected[1:3])
    assert np.array_equal(qt.dequantize(np.array([2, 0])), expected[[2, 0]])


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_int8_formula(group_size):
    r = rng(3)
    rows, cols = 2, 256
    q = r.integers(-127, 128, size=(rows, cols), dtype=np.int8)
    scales = r.standard_normal((rows, cols // group_size)).astype(np.float16)
    w = dequantize_int8(q, scales, group_size)
    expected = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for c in range(cols):
            expected[i, c] = np.float32(float(q[i, c]) * float(scales[i, c // group_size]))
    assert np.array_equal(w, expected)
    qt = QuantTensor("int8", (rows, cols), group_size, q, scales)
    assert np.array_equal(qt.dequantize(), expected)


def test_bits_per_weight():
    w = rng(4).standard_normal((4, 128)).astype(np.float32)
    assert quantize_int4(w, 32).bits_per_weight == pytest.approx(4 + 16 / 32 + 16 / 32)
    assert quantize_int4(w, 128).bits_per_weight == pytest.approx(4 + 32 / 128)
    assert quantize_int8(w, 32).bits_per_weight == pytest.approx(8 + 16 / 32)
    qt = quantize_int4(w, 64)
    assert qt.nbytes == qt.qweight.nbytes + qt.scales.nbytes + qt.mins.nbytes == 4 * 64 + 2 * 16


# -- quantizers ------------------------------------------------------------------------------
def _groups(a: np.ndarray, g: int) -> np.ndarray:
    return a.astype(np.float64).reshape(-1, g)


def _int4_minmax_bound(w: np.ndarray, g: int) -> np.ndarray:
    """Per-element bound of plain min-max INT4: half a step plus the float16 rounding of the
    step and of the minimum, plus float32 arithmetic slack."""
    grp = _groups(w, g)
    lo, hi = grp.min(axis=1), grp.max(axis=1)
    bound = (hi - lo) / 30 * (1 + 2 * U) + U * (np.abs(lo) + (hi - lo)) + 16 * F16_SUB
    bound += 2.0 ** -20 * np.maximum(np.abs(lo), np.abs(hi))
    return np.repeat(bound, g)


def _check_asym(kind: str, qt: QuantTensor, shape, g, nonneg_scales: bool = True):
    """An INT4 / INT5 tensor of `shape`, group size `g`, in its layout."""
    rows, cols = shape
    qbytes = cols // 2 if kind == "int4" else cols // 32 * 20
    assert qt.kind == kind and qt.shape == (rows, cols) and qt.group_size == g
    assert qt.qweight.dtype == np.uint8 and qt.qweight.shape == (rows, qbytes)
    assert qt.scales.dtype == np.float16 and qt.scales.shape == (rows, cols // g)
    assert qt.mins.dtype == np.float16 and qt.mins.shape == (rows, cols // g)
    assert np.isfinite(qt.scales).all() and np.isfinite(qt.mins).all()
    if nonneg_scales:  # our quantizers; imported GGUF blocks may carry negative scales
        assert (qt.scales >= 0).all()


def _check_int4(qt: QuantTensor, shape, g, nonneg_scales: bool = True):
    _check_asym("int4", qt, shape, g, nonneg_scales)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_int4_minmax_error_bound(group_size, scale):
    r = rng(5)
    w = (r.standard_normal((8, 256)) * scale + r.standard_normal((8, 1)) * scale).astype(
        np.float32)
    qt = quantize_int4(w, group_size, search=False)
    _check_int4(qt, w.shape, group_size)
    err = np.abs(qt.dequantize().astype(np.float64) - w).reshape(-1)
    assert (err <= _int4_minmax_bound(w, group_size)).all()
    # and the stored scale/min are the float16 roundings of (max - min) / 15 and min
    grp = w.reshape(-1, group_size)
    lo, hi = grp.min(axis=1), grp.max(axis=1)
    assert np.array_equal(qt.mins.reshape(-1), lo.astype(np.float16))
    assert np.array_equal(qt.scales.reshape(-1), ((hi - lo) / 15.0).astype(np.float16))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_search_never_worse_per_group(group_size):
    r = rng(6)
    # gaussian rows, heavy-tailed rows and rows with outliers
    w = np.concatenate([
        r.standard_normal((16, 512)),
        r.standard_t(2, (16, 512)) * 0.1,
        np.where(r.random((16, 512)) < 0.01, 50.0, 1.0) * r.standard_normal((16, 512)),
    ]).astype(np.float32)
    plain = quantize_int4(w, group_size, search=False)
    best = quantize_int4(w, group_size, search=True)
    _check_int4(best, w.shape, group_size)
    e_plain = ((_groups(plain.dequantize(), group_size) - _groups(w, group_size)) ** 2).sum(1)
    e_best = ((_groups(best.dequantize(), group_size) - _groups(w, group_size)) ** 2).sum(1)
    # float32 accumulation inside the quantizer: allow a relative 1e-5
    assert (e_best <= e_plain * (1 + 1e-5) + 1e-30).all()
    assert e_best.sum() < e_plain.sum()  # and the search does help overall
    assert relative_error(w[:16], best.dequantize()[:16]) < 0.13  # gaussian rows


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("kind", ["int4", "int5"])
def test_asymmetric_exact_on_grid(kind, group_size, search):
    """Values of the form q * s + m with float16 s, m and both q = 0 and the largest q in every
    group quantize without any error."""
    qmax, pack_fn, unpack_fn, deq, quant = {
        "int4": (15, pack_int4, unpack_int4, dequantize_int4, quantize_int4),
        "int5": (31, pack_int5, unpack_int5, dequantize_int5, quantize_int5),
    }[kind]
    r = rng(7)
    rows, cols = 4, 256
    ng = cols // group_size
    s = (np.abs(r.standard_normal((rows, ng))) + 0.01).astype(np.float16)
    m = r.standard_normal((rows, ng)).astype(np.float16)
    q = r.integers(0, qmax + 1, size=(rows, cols)).astype(np.uint8)
    q[:, ::group_size] = 0
    q[:, 1::group_size] = qmax
    w = deq(pack_fn(q), s, m, group_size)
    qt = quant(w, group_size, search=search)
    assert qt.kind == kind
    assert np.array_equal(qt.dequantize(), w)
    assert np.array_equal(unpack_fn(qt.qweight), q)
    assert np.array_equal(qt.scales, s) and np.array_equal(qt.mins, m)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int8_exact_on_grid_and_error_bound(group_size):
    r = rng(8)
    rows, cols = 4, 256
    ng = cols // group_size
    s = (np.abs(r.standard_normal((rows, ng))) + 0.01).astype(np.float16)
    q = r.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    q[:, ::group_size] = 127
    q[:, 1::group_size] = -127
    w = dequantize_int8(q, s, group_size)
    qt = quantize_int8(w, group_size)
    assert qt.kind == "int8" and qt.mins is None and qt.qweight.dtype == np.int8
    assert np.array_equal(qt.dequantize(), w)
    assert np.array_equal(qt.qweight, q) and np.array_equal(qt.scales, s)

    w = (r.standard_normal((rows, cols)) * 3).astype(np.float32)
    qt = quantize_int8(w, group_size)
    amax = np.abs(_groups(w, group_size)).max(axis=1)
    bound = np.repeat(amax / 254 * (1 + 2 * U) + amax * U + 2 * F16_SUB, group_size)
    err = np.abs(qt.dequantize().astype(np.float64) - w).reshape(-1)
    assert (err <= bound).all()
    assert np.array_equal(qt.scales.reshape(-1), (amax.astype(np.float32) / 127).astype(
        np.float16))
    assert np.abs(qt.qweight.astype(int)).max() <= 127


@pytest.mark.filterwarnings("error")  # no divide-by-zero / invalid-value warnings either
@pytest.mark.parametrize("search", [False, True])
def test_constant_groups_and_zero_rows(search):
    w = np.zeros((4, 128), np.float32)
    w[1, :32] = 3.25  # a constant group
    w[1, 32:64] = -1e-3  # a constant group not on the float16 grid
    w[2] = 7.0  # a whole constant row
    w[3, 64:] = np.linspace(-1, 1, 64)  # half zero
    for g in (32, 64, 128):
        qt = quantize_int4(w, g, search=search)
        _check_int4(qt, w.shape, g)
        deq = qt.dequantize()
        assert np.isfinite(deq).all()
        assert np.array_equal(deq[0], np.zeros(128, np.float32))
        assert np.array_equal(deq[2], np.full(128, 7.0, np.float32))
        if g == 32:
            assert np.array_equal(deq[1, :32], np.full(32, 3.25, np.float32))
            assert np.allclose(deq[1, 32:64], -1e-3, rtol=U, atol=0)
            assert np.array_equal(deq[3, :64], np.zeros(64, np.float32))
        q8 = quantize_int8(w, g)
        d8 = q8.dequantize()
        assert np.isfinite(d8).all() and np.isfinite(q8.scales).all()
        assert np.array_equal(d8[0], np.zeros(128, np.float32))
        assert np.allclose(d8[2], 7.0, rtol=U, atol=0)


def test_single_row_and_empty():
    w = rng(9).standard_normal((1, 32)).astype(np.float32)
    qt = quantize_int4(w)
    _check_int4(qt, (1, 32), 32)
    assert relative_error(w, qt.dequantize()) < 0.15
    assert quantize_int8(w).qweight.shape == (1, 32)
    empty = quantize_int4(np.zeros((0, 64), np.float32))
    assert empty.qweight.shape == (0, 32) and empty.scales.shape == (0, 2)


def test_input_dtypes_and_noncontiguous():
    w = rng(10).standard_normal((64, 96)).astype(np.float32)
    ref = quantize_int4(w)
    wt = np.asfortranarray(w)  # same values, column-major
    for variant in (wt, w.astype(np.float64), w.tolist()):
        qt = quantize_int4(variant)
        assert np.array_equal(qt.qweight, ref.qweight)
        assert np.array_equal(qt.scales, ref.scales) and np.array_equal(qt.mins, ref.mins)
    assert np.array_equal(quantize_int8(wt).qweight, quantize_int8(w).qweight)


def test_many_rows_cross_the_chunk_size():
    """70000 x 32 spans three internal chunks; every row must equal its own quantization."""
    rows = 70000
    assert rows * 32 > 2 * quant._ROW_CHUNK
    r = rng(11)
    w = (r.standard_normal((rows, 32)) * r.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    qt = quantize_int4(w, search=False)
    _check_int4(qt, w.shape, 32)
    step = quant._ROW_CHUNK // 32
    for r0 in (0, step - 1, step, 2 * step - 1, 2 * step, rows - 1):
        one = quantize_int4(w[r0:r0 + 1], search=False)
        assert np.array_equal(qt.qweight[r0:r0 + 1], one.qweight), r0
        assert np.array_equal(qt.scales[r0:r0 + 1], one.scales), r0
        assert np.array_equal(qt.mins[r0:r0 + 1], one.mins), r0
    err = np.abs(qt.dequantize().astype(np.float64) - w).reshape(-1)
    assert (err <= _int4_minmax_bound(w, 32)).all()
    q8 = quantize_int8(w)
    assert np.array_equal(q8.qweight[-5:], quantize_int8(w[-5:]).qweight)
    assert np.array_equal(q8.scales[step:step + 3], quantize_int8(w[step:step + 3]).scales)


@pytest.mark.parametrize("chunk", [32, 100, 4096])
def test_small_chunks_give_identical_results(monkeypatch, chunk):
    w = rng(12).standard_normal((37, 128)).astype(np.float32)
    ref4, ref8 = quantize_int4(w, 64), quantize_int8(w, 64)
    monkeypatch.setattr(quant, "_ROW_CHUNK", chunk)  # down to one row per chunk
    q4, q8 = quantize_int4(w, 64), quantize_int8(w, 64)
    for a, b in ((q4.qweight, ref4.qweight), (q4.scales, ref4.scales), (q4.mins, ref4.mins),
                 (q8.qweight, ref8.qweight), (q8.scales, ref8.scales)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("shape,group_size", [
    ((4, 48), 32),  # cols not a multiple of 32
    ((4, 16), 32),
    ((4, 96), 64),  # cols not a multiple of the group size
    ((4, 64), 128),
    ((4, 160), 128),
    ((64,), 32),  # not 2-D
    ((2, 2, 32), 32),
])
def test_unquantizable_shapes(shape, group_size):
    w = np.ones(shape, np.float32)
    for fn in (lambda: quantize_int4(w, group_size), lambda: quantize_int8(w, group_size)):
        with pytest.raises(UnsupportedError, match="cannot be quantized"):
            fn()


@pytest.mark.parametrize("group_size", [0, 16, 48, 256, -32])
def test_unsupported_group_size(group_size):
    w = np.ones((2, 256), np.float32)
    with pytest.raises(UnsupportedError, match="group size"):
        quantize_int4(w, group_size)
    with pytest.raises(UnsupportedError, match="group size"):
        quantize_int8(w, group_size)


def test_quantize_dispatch():
    w = rng(13).standard_normal((2, 64)).astype(np.float32)
    assert quantize(w, 4).kind == "int4"
    assert quantize(w, 8, 64).kind == "int8" and quantize(w, 8, 64).group_size == 64
    q5 = quantize(w, 5, 64, search=False)
    assert q5.kind == "int5" and q5.group_size == 64
    assert np.array_equal(q5.qweight, quantize_int5(w, 64, search=False).qweight)
    for bits in (2, 3, 6, 16):
        with pytest.raises(UnsupportedError, match=f"{bits}-bit"):
            quantize(w, bits)


# -- lossless GGUF import --------------------------------------------------------------------
def _gguf_matrix(seed: int, shape, scale: float) -> np.ndarray:
    r = rng(seed)
    return (r.standard_normal(shape) * scale + r.standard_normal((shape[0], 1)) * scale).astype(
        np.float32)


SHAPES = [(1, 32), (3, 96), (5, 512)]
SCALES = [1.0, 1e-6, 200.0]  # 1e-6: subnormal float16 block scales


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_int4_from_gguf_q4_0_q4_1_bit_exact(type_name, shape, scale):
    gtype = GT[type_name]
    x = _gguf_matrix(sum(shape), shape, scale)
    raw = gq.quantize(x, gtype)
    ref = gq.dequantize(raw, gtype)
    qt = int4_from_gguf_blocks(raw, type_name, shape)
    assert qt is not None
    _check_int4(qt, shape, 32, nonneg_scales=False)
    ours = qt.dequantize()
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.array_equal(ours, ref)  # equal values (+0.0 == -0.0)
    # the nibbles are a byte copy of the blocks' qs
    bsize = 18 if type_name == "Q4_0" else 20
    blocks = raw.reshape(shape[0], shape[1] // 32, bsize)
    assert np.array_equal(qt.qweight.reshape(blocks.shape[0], -1, 16), blocks[:, :, bsize - 16:])
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    assert np.array_equal(qt.scales, d)
    if type_name == "Q4_0":
        assert np.array_equal(qt.mins.astype(np.float32), -8 * d.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_int8_from_gguf_q8_0_bit_exact(shape, scale):
    x = _gguf_matrix(7 + sum(shape), shape, scale)
    raw = gq.quantize(x, GT.Q8_0)
    qt = int8_from_gguf_blocks(raw, "Q8_0", shape)
    assert qt is not None and qt.kind == "int8" and qt.group_size == 32 and qt.mins is None
    assert qt.qweight.dtype == np.int8 and qt.qweight.shape == shape
    assert np.array_equal(qt.dequantize(), gq.dequantize(raw, GT.Q8_0))
    if scale >= 1:  # (tiny inputs get subnormal float16 scales: gguf-py's own loss)
        assert relative_error(x, qt.dequantize()) < 0.01


def test_q4_0_scale_overflow_is_not_imported():
    """-8 * d overflows float16 for |d| > 8191.875: no exact INT4 minimum, so None."""
    block = np.zeros(18, np.uint8)
    block[0:2] = np.array([10000.0], np.float16).view(np.uint8)
    block[2:] = 0x5A
    assert int4_from_gguf_blocks(block[None, :], "Q4_0", (1, 32)) is None
    block[0:2] = np.array([8000.0], np.float16).view(np.uint8)
    qt = int4_from_gguf_blocks(block[None, :], "Q4_0", (1, 32))
    assert np.array_equal(qt.dequantize(), gq.dequantize(block[None, :], GT.Q4_0))


def _pack_q4k_scales(sc, mn) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes of a Q4_K super-block (ggml layout)."""
    s = np.zeros(12, np.uint8)
    for j in range(4):
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        s[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    return s


def test_int4_from_gguf_q4_k_hand_built_superblock():
    sc = [1, 2, 3, 4, 60, 61, 62, 63]
    mn = [63, 5, 0, 17, 33, 48, 2, 9]
    q = rng(14).integers(0, 16, 256).astype(np.uint8)  # value index i -> q[i]
    qs = np.zeros(128, np.uint8)
    for j in range(4):  # chunk j: sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
        qs[32 * j:32 * j + 32] = q[64 * j:64 * j + 32] | (q[64 * j + 32:64 * j + 64] << 4)
    block = np.concatenate([np.array([1.0, 0.5], np.float16).view(np.uint8),
                            _pack_q4k_scales(sc, mn), qs])
    assert block.size == 144
    expected = np.array([1.0 * sc[i // 32] * q[i] - 0.5 * mn[i // 32] for i in range(256)],
                        np.float32)
    qt = int4_from_gguf_blocks(block[None, :], "Q4_K", (1, 256))
    assert qt.group_size == 32 and qt.scales.shape == (1, 8)
    assert np.array_equal(qt.dequantize()[0], expected)
    assert np.array_equal(gq.dequantize(block[None, :], GT.Q4_K)[0], expected)
    assert np.array_equal(qt.scales[0].astype(np.float32), np.array(sc, np.float32))
    assert np.array_equal(qt.mins[0].astype(np.float32), -0.5 * np.array(mn, np.float32))


def _random_q4k(seed: int, rows: int, nsb: int, d_scale: float) -> np.ndarray:
    r = rng(seed)
    raw = r.integers(0, 256, size=(rows, nsb, 144), dtype=np.uint8)
    # d, dmin: finite float16 values over many magnitudes (including subnormals) and signs
    mag = d_scale * 10.0 ** r.uniform(-7, 0, size=(rows, nsb, 2))
    dd = (mag * r.choice([-1, 1], size=mag.shape)).astype(np.float16)
    dd[0, 0] = [0.0, 0.0]
    raw[:, :, 0:4] = dd.view(np.uint8)
    return raw.reshape(rows, nsb * 144)


@pytest.mark.parametrize("seed,rows,nsb,d_scale", [(0, 1, 1, 1.0), (1, 4, 3, 1.0),
                                                    (2, 8, 2, 1000.0)])
def test_int4_from_gguf_q4_k_within_documented_loss(seed, rows, nsb, d_scale):
    raw = _random_q4k(seed, rows, nsb, d_scale)
    shape = (rows, nsb * 256)
    qt = int4_from_gguf_blocks(raw, "Q4_K", shape)
    assert qt is not None
    _check_int4(qt, shape, 32, nonneg_scales=False)
    ours = qt.dequantize().astype(np.float64)
    ref = gq.dequantize(raw, GT.Q4_K).astype(np.float64)
    assert ref.shape == shape and np.isfinite(ours).all()

    blocks = raw.reshape(rows * nsb, 144)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
    sc, mn = gq.Q4_K.get_scale_min(blocks[:, 4:16])
    eff_s = np.abs(d[:, None] * sc).reshape(rows, -1)  # |d * sc| per 32-value sub-block
    eff_m = np.abs(dmin[:, None] * mn).reshape(rows, -1)
    q = unpack_int4(qt.qweight).astype(np.float64)
    tol = (U * (np.repeat(eff_s, 32, axis=1) * q + np.repeat(eff_m, 32, axis=1))
           + (q + 1) * F16_SUB + 2.0 ** -23 * np.abs(ref) + 1e-45)
    assert (np.abs(ours - ref) <= tol).all()
    # the effective scales and minimums are exactly the float16 roundings
    assert np.array_equal(qt.scales.reshape(-1), (d[:, None] * sc).astype(np.float16).reshape(-1))
    assert np.array_equal(qt.mins.reshape(-1), (-(dmin[:, None] * mn)).astype(np.float16)
                          .reshape(-1))


def test_q4_k_effective_scale_overflow_is_not_imported():
    """d * sc beyond the float16 range cannot be held: the block must not import as inf."""
    raw = _random_q4k(3, 2, 1, 1.0)
    blocks = raw.reshape(2, 144)
    blocks[1, 0:2] = np.array([30000.0], np.float16).view(np.uint8)
    blocks[1, 4:16] = 0  # all other scales and mins 0
    blocks[1, 4] = 63  # sc[0] = 63: 30000 * 63 overflows float16
    assert np.isfinite(gq.dequantize(raw, GT.Q4_K)).all()  # the source values are finite
    assert int4_from_gguf_blocks(raw, "Q4_K", (2, 256)) is None
    blocks[1, 4] = 2  # 60000 fits
    qt = int4_from_gguf_blocks(raw, "Q4_K", (2, 256))
    assert qt is not None and np.isfinite(qt.dequantize()).all()
    # the same holds for the minimums (dmin * mn)
    blocks[1, 2:4] = np.array([-30000.0], np.float16).view(np.uint8)
    blocks[1, 8] = 40  # mn[0] = 40
    assert int4_from_gguf_blocks(raw, "Q4_K", (2, 256)) is None


def test_types_without_a_compatible_grid():
    x = _gguf_matrix(20, (2, 256), 1.0)
    q5 = gq.quantize(x, GT.Q5_0)
    assert int4_from_gguf_blocks(q5, "Q5_0", (2, 256)) is None
    assert int8_from_gguf_blocks(q5, "Q5_0", (2, 256)) is None
    q6k = np.zeros((2, 210), np.uint8)  # Q6_K: 210 bytes per 256 values
    assert int4_from_gguf_blocks(q6k, "Q6_K", (2, 256)) is None
    assert int8_from_gguf_blocks(q6k, "Q6_K", (2, 256)) is None
    f16 = x.astype(np.float16).view(np.uint8)
    assert int4_from_gguf_blocks(f16, "F16", (2, 256)) is None
    assert int8_from_gguf_blocks(f16, "F16", (2, 256)) is None
    # INT4 types are not INT8 grids and vice versa
    assert int8_from_gguf_blocks(gq.quantize(x, GT.Q4_0), "Q4_0", (2, 256)) is None
    assert int4_from_gguf_blocks(gq.quantize(x, GT.Q8_0), "Q8_0", (2, 256)) is None


def test_imports_are_always_group_32():
    """The block formats carry group-32 grids whatever group size the caller asked for."""
    x = _gguf_matrix(21, (2, 256), 1.0)
    for t in ("Q4_0", "Q4_1"):
        assert int4_from_gguf_blocks(gq.quantize(x, GT[t]), t, (2, 256)).group_size == 32
    assert int8_from_gguf_blocks(gq.quantize(x, GT.Q8_0), "Q8_0", (2, 256)).group_size == 32
    assert int4_from_gguf_blocks(_random_q4k(4, 2, 1, 1.0), "Q4_K", (2, 256)).group_size == 32


# -- source encodings (Q4_K / Q6_K blocks kept in the deploy file) --------------------------
def _random_q6k(seed: int, rows: int, nsb: int) -> np.ndarray:
    r = rng(seed)
    raw = r.integers(0, 256, size=(rows, nsb, 210), dtype=np.uint8)
    d = (10.0 ** r.uniform(-6, 0, size=(rows, nsb)) * r.choice([-1, 1], size=(rows, nsb)))
    raw[:, :, 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, nsb * 210)


@pytest.mark.parametrize("seed,rows,nsb", [(0, 1, 1), (1, 5, 3)])
def test_q6k_values_are_ggmls(seed, rows, nsb):
    """pocketlm's Q6_K decoder against the gguf library's, bit for bit."""
    raw = _random_q6k(seed, rows, nsb)
    ours = quant.dequantize_q6k(raw, (rows, nsb * 256))
    ref = gq.dequantize(raw, GT.Q6_K).reshape(rows, nsb * 256)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and np.array_equal(np.asarray(a).view(np.uint8),
                                                 np.asarray(b).view(np.uint8))


def test_q4k_encoding_decodes_to_the_exact_import():
    raw = _random_q4k(7, 3, 2, 1.0)
    qt = int4_from_gguf_blocks(raw, "Q4_K", (3, 512))
    enc = quant.encode_as_source(qt, "Q4_K", raw)
    assert enc is not None and enc.encoding == "q4_k" and enc.kind == "int4"
    assert enc.nbytes == raw.nbytes == 3 * 2 * 144  # 4.5 bits a weight, against qt's 5.0
    assert enc.bits_per_weight == 4.5 and qt.bits_per_weight == 5.0
    assert set(enc.stored) == {"", ".kscales", ".kd"}
    for a, b in ((enc.qweight, qt.qweight), (enc.scales, qt.scales), (enc.mins, qt.mins)):
        assert _same_bits(a, b)
    assert np.array_equal(enc.dequantize(), qt.dequantize())


def test_q6k_encoding_decodes_to_its_int8_requantization():
    raw = _random_q6k(8, 4, 2)
    values = gq.dequantize(raw, GT.Q6_K).reshape(4, 512)
    qt = quant.quantize_int8(values, 32)  # what a pack makes of a Q6_K tensor
    enc = quant.encode_as_source(qt, "Q6_K", raw)
    assert enc is not None and enc.encoding == "q6_k" and enc.kind == "int8"
    assert enc.nbytes == raw.nbytes and enc.bits_per_weight == 6.5625
    assert _same_bits(enc.qweight, qt.qweight) and _same_bits(enc.scales, qt.scales)
    assert enc.mins is None
    # decoded on use, dropped by release(), decoded again the same
    first = enc.qweight
    enc.release()
    assert enc._decoded is None and _same_bits(enc.qweight, first)


def test_q6k_decodes_a_few_rows_at_a_time_to_the_same_bits(monkeypatch):
    # the decode bounds its float temporaries by working on row chunks: a tensor of several
    # chunks (and a ragged last one) decodes to what the whole tensor requantizes to
    monkeypatch.setattr(quant, "_ROW_CHUNK", 4 * 512 * 3)  # 3 rows of 512 a chunk
    raw = _random_q6k(11, 10, 2)
    whole = quant.quantize_int8(gq.dequantize(raw, GT.Q6_K).reshape(10, 512), 32)
    q, s, mins = quant.decode("q6_k", (10, 512), {"": raw.reshape(10, 2 * 210)})
    assert _same_bits(q, whole.qweight) and _same_bits(s, whole.scales) and mins is None


def test_int4_c8_codes_decode_to_their_steps():
    r = rng(12)
    s = (np.abs(r.standard_normal((5, 8))) * 0.01).astype(np.float32)
    m = (r.standard_normal((5, 8)) * 0.05).astype(np.float32)
    s[3], m[3] = 0, 0  # a row of zeros codes to zeros
    sc, mc, rd = quant.code_steps(s, m)
    assert sc.dtype == np.uint8 and mc.dtype == np.int8 and rd.dtype == np.float16
    assert sc.max() == 255 and np.abs(mc).max() == 127  # each row's largest takes the top code
    scales, mins = quant.coded_steps(sc, mc, rd)
    d = rd.astype(np.float32)
    # within half a code (and float16's rounding) of what was coded
    assert np.all(np.abs(scales.astype(np.float32) - s) <= 0.5 * d[:, :1] + 1e-3 * s + 1e-9)
    assert np.all(np.abs(mins.astype(np.float32) - m) <= 0.5 * d[:, 1:] + 1e-3 * np.abs(m) + 1e-9)
    assert not scales[3].any() and not mins[3].any()
    q = r.integers(0, 16, (5, 256), dtype=np.uint8)
    enc = quant.EncodedQuantTensor("int4_c8", (5, 256), {
        "": quant.pack_int4(q), ".sc": sc, ".mc": mc, ".rd": rd})
    assert enc.kind == "int4" and enc.group_size == 32 and enc.nbytes == 5 * (128 + 16 + 4)
    assert _same_bits(enc.scales, scales) and _same_bits(enc.mins, mins)
    want = (np.repeat(scales.astype(np.float32), 32, axis=1) * q +
            np.repeat(mins.astype(np.float32), 32, axis=1))
    np.testing.assert_allclose(enc.dequantize(), want, rtol=1e-6, atol=1e-7)
    arrays = quant.encoded_arrays("int4_c8", (5, 256))
    assert {k: v[1] for k, v in arrays.items()} == {"": (5, 128), ".sc": (5, 8), ".mc": (5, 8),
                                                    ".rd": (5, 2)}


def test_encoding_only_where_the_blocks_give_the_same_bits():
    raw = _random_q4k(9, 2, 1, 1.0)
    qt = int4_from_gguf_blocks(raw, "Q4_K", (2, 256))
    moved = QuantTensor("int4", qt.shape, 32, qt.qweight, qt.scales.copy(), qt.mins)
    moved.scales[1, 3] = np.float16(float(moved.scales[1, 3]) * 2 + 1)  # not the source's
    assert quant.encode_as_source(moved, "Q4_K", raw) is None
    q6 = _random_q6k(10, 2, 1)
    q8 = quant.quantize_int8(gq.dequantize(q6, GT.Q6_K).reshape(2, 256), 32)
    q8.qweight[0, 0] ^= 1
    assert quant.encode_as_source(q8, "Q6_K", q6) is None
    g64 = quant.quantize_int8(gq.dequantize(q6, GT.Q6_K).reshape(2, 256), 64)
    assert quant.encode_as_source(g64, "Q6_K", q6) is None  # the encoding is group 32
    assert quant.encode_as_source(qt, "Q6_K", raw) is None  # an INT4 tensor is not Q6_K's
    assert quant.encode_as_source(qt, "Q4_0", raw) is None  # no encoding for that type


def test_untied_embedding_is_never_encoded():
    assert quant.may_encode("embed.weight", tied=True)
    assert not quant.may_encode("embed.weight", tied=False)
    assert quant.may_encode("lm_head.weight", tied=False)
    assert quant.may_encode("layers.0.mlp.w_down.weight", tied=False)


# -- INT5 ------------------------------------------------------------------------------------
def ref_pack5(q: np.ndarray) -> bytes:
    """The documented INT5 layout, element by element: per block of 32 values a little-endian
    uint32 of the high bits, then the low nibbles as INT4 packs them."""
    rows, cols = q.shape
    out = bytearray()
    for r in range(rows):
        for b in range(cols // 32):
            qh = sum(((int(q[r, 32 * b + k]) >> 4) & 1) << k for k in range(32))
            out += qh.to_bytes(4, "little")
            for k in range(16):
                out.append((int(q[r, 32 * b + k]) & 15) | ((int(q[r, 32 * b + 16 + k]) & 15) << 4))
    return bytes(out)


def test_pack_int5_1x32_exact_bytes():
    q = np.arange(32, dtype=np.uint8)[None, :]  # column k holds k
    packed = pack_int5(q)
    # high bits set for columns 16..31; nibble byte k holds k and (16 + k) & 15 = k
    expected = bytes.fromhex("0000ffff") + bytes(k * 0x11 for k in range(16))
    assert packed.dtype == np.uint8 and packed.shape == (1, 20)
    assert packed.tobytes() == expected
    assert packed.tobytes() == ref_pack5(q)
    assert np.array_equal(unpack_int5(packed), q)


def test_pack_int5_2x64_exact_bytes():
    q = np.zeros((2, 64), np.uint8)
    q[0, 5] = 16  # row 0, block 0: high bit 5, nibble 0
    q[0, 31] = 31  # high bit 31, nibble 15 in the high half of byte 15
    q[1, 40] = 17  # row 1, block 1, column 8 of the block: high bit 8, nibble 1
    packed = pack_int5(q)
    assert packed.shape == (2, 40)
    row0 = bytes.fromhex("20000080") + bytes(15) + b"\xf0" + bytes(20)
    row1 = bytes(20) + bytes.fromhex("00010000") + bytes(8) + b"\x01" + bytes(7)
    assert packed[0].tobytes() == row0 and packed[1].tobytes() == row1
    assert packed.tobytes() == ref_pack5(q)
    assert np.array_equal(unpack_int5(packed), q)


@pytest.mark.parametrize("shape", [(1, 32), (1, 96), (17, 32), (17, 96), (1, 640), (17, 640)])
def test_pack_unpack_int5_roundtrip(shape):
    q = rng(31).integers(0, 32, size=shape, dtype=np.uint8)
    packed = pack_int5(q)
    assert packed.dtype == np.uint8 and packed.flags.c_contiguous
    assert packed.shape == (shape[0], shape[1] // 32 * 20)
    assert packed.tobytes() == ref_pack5(q)
    out = unpack_int5(packed)
    assert out.dtype == np.uint8 and np.array_equal(out, q)
    assert np.array_equal(unpack_int5(packed[::2]), q[::2])  # a strided view of the rows
    # the low nibbles are exactly INT4's packing
    blocks = packed.reshape(shape[0], -1, 20)
    assert np.array_equal(blocks[:, :, 4:].reshape(shape[0], -1), pack_int4(q & 15))
    # any bytes are an INT5 block: unpacking and repacking gives them back
    anybytes = rng(32).integers(0, 256, size=packed.shape, dtype=np.uint8)
    assert np.array_equal(pack_int5(unpack_int5(anybytes)), anybytes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_int5_formula(group_size):
    r = rng(33)
    rows, cols = 3, 256
    q = r.integers(0, 32, size=(rows, cols), dtype=np.uint8)
    q[0, :32] = 31
    scales = r.standard_normal((rows, cols // group_size)).astype(np.float16)
    mins = r.standard_normal((rows, cols // group_size)).astype(np.float16)
    w = dequantize_int5(pack_int5(q), scales, mins, group_size)
    assert w.dtype == np.float32 and w.shape == (rows, cols)
    expected = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for c in range(cols):
            g = c // group_size
            expected[i, c] = np.float32(float(q[i, c]) * float(scales[i, g]) + float(mins[i, g]))
    assert np.array_equal(w, expected)
    qt = QuantTensor("int5", (rows, cols), group_size, pack_int5(q), scales, mins)
    assert np.array_equal(qt.dequantize(), expected)
    assert np.array_equal(qt.dequantize(slice(1, 3)), expected[1:3])
    assert np.array_equal(qt.dequantize(np.array([2, 0])), expected[[2, 0]])


def test_int5_bits_per_weight_and_unknown_kind():
    w = rng(34).standard_normal((4, 128)).astype(np.float32)
    assert quantize_int5(w, 32).bits_per_weight == pytest.approx(5 + 16 / 32 + 16 / 32)
    assert quantize_int5(w, 128).bits_per_weight == pytest.approx(5 + 32 / 128)
    qt = quantize_int5(w, 64)
    bad = QuantTensor("int3", qt.shape, 64, qt.qweight, qt.scales, qt.mins)
    with pytest.raises(UnsupportedError, match="int3"):
        bad.dequantize()


def _check_int5(qt: QuantTensor, shape, g, nonneg_scales: bool = True):
    _check_asym("int5", qt, shape, g, nonneg_scales)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_int5_minmax_error_bound(group_size, scale):
    r = rng(35)
    w = (r.standard_normal((8, 256)) * scale + r.standard_normal((8, 1)) * scale).astype(
        np.float32)
    qt = quantize_int5(w, group_size, search=False)
    _check_int5(qt, w.shape, group_size)
    grp = _groups(w, group_size)
    lo, hi = grp.min(axis=1), grp.max(axis=1)
    # half a step, plus the float16 rounding of the step and of the minimum, plus slack
    bound = (hi - lo) / 62 * (1 + 2 * U) + U * (np.abs(lo) + (hi - lo)) + 32 * F16_SUB
    bound += 2.0 ** -20 * np.maximum(np.abs(lo), np.abs(hi))
    err = np.abs(qt.dequantize().astype(np.float64) - w).reshape(-1)
    assert (err <= np.repeat(bound, group_size)).all()
    grp32 = w.reshape(-1, group_size)
    assert np.array_equal(qt.mins.reshape(-1), grp32.min(axis=1).astype(np.float16))
    assert np.array_equal(qt.scales.reshape(-1),
                          ((grp32.max(axis=1) - grp32.min(axis=1)) / 31.0).astype(np.float16))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int5_error_below_int4_and_values_in_range(group_size):
    r = rng(36)
    w = np.concatenate([
        r.standard_normal((16, 512)),
        r.standard_t(2, (16, 512)) * 0.1,
        np.where(r.random((16, 512)) < 0.01, 50.0, 1.0) * r.standard_normal((16, 512)),
    ]).astype(np.float32)
    for search in (False, True):
        q4 = quantize_int4(w, group_size, search=search)
        q5 = quantize_int5(w, group_size, search=search)
        _check_int5(q5, w.shape, group_size)
        q = unpack_int5(q5.qweight)
        assert q.max() == 31 and q.min() == 0  # the whole range 0..31 is used
        e4 = relative_error(w[:16], q4.dequantize()[:16])
        e5 = relative_error(w[:16], q5.dequantize()[:16])
        assert e5 < 0.6 * e4, (e4, e5)  # one more bit: about half the error (gaussian rows)
        assert relative_error(w, q5.dequantize()) < relative_error(w, q4.dequantize())
    plain = quantize_int5(w, group_size, search=False)
    best = quantize_int5(w, group_size, search=True)
    e_plain = ((_groups(plain.dequantize(), group_size) - _groups(w, group_size)) ** 2).sum(1)
    e_best = ((_groups(best.dequantize(), group_size) - _groups(w, group_size)) ** 2).sum(1)
    assert (e_best <= e_plain * (1 + 1e-5) + 1e-30).all()
    assert e_best.sum() < e_plain.sum()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("search", [False, True])
def test_int5_constant_groups_zero_rows_and_chunks(monkeypatch, search):
    w = np.zeros((4, 128), np.float32)
    w[1, :32] = 3.25
    w[2] = 7.0
    w[3, 64:] = np.linspace(-1, 1, 64)
    qt = quantize_int5(w, 32, search=search)
    _check_int5(qt, w.shape, 32)
    deq = qt.dequantize()
    assert np.array_equal(deq[:3], w[:3]) and np.array_equal(deq[3, :64], np.zeros(64))
    w = rng(38).standard_normal((37, 128)).astype(np.float32)
    ref = quantize_int5(w, 64, search=search)
    monkeypatch.setattr(quant, "_ROW_CHUNK", 100)  # one row per chunk
    small = quantize_int5(w, 64, search=search)
    for a, b in ((small.qweight, ref.qweight), (small.scales, ref.scales),
                 (small.mins, ref.mins)):
        assert np.array_equal(a, b)
    with pytest.raises(UnsupportedError, match="cannot be quantized"):
        quantize_int5(np.ones((2, 48), np.float32))


def _q5_blocks(seed: int, rows: int, nblocks: int, type_name: str, d_scale: float):
    """Random GGUF Q5_0/Q5_1 rows: random qh and qs bytes, float16 d (and m) over many
    magnitudes (subnormals included) and both signs."""
    r = rng(seed)
    head = 2 if type_name == "Q5_0" else 4
    raw = r.integers(0, 256, size=(rows, nblocks, head + 20), dtype=np.uint8)
    mag = d_scale * 10.0 ** r.uniform(-7, 0, size=(rows, nblocks, head // 2))
    dm = (mag * r.choice([-1, 1], size=mag.shape)).astype(np.float16)
    dm[0, 0] = 0.0
    raw[:, :, :head] = dm.view(np.uint8)
    return raw.reshape(rows, nblocks * (head + 20)), head


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("seed,rows,nblocks,d_scale", [(0, 1, 1, 1.0), (1, 17, 3, 1.0),
                                                        (2, 4, 20, 4000.0), (3, 2, 8, 1e-3)])
def test_int5_from_gguf_random_blocks_bit_exact(type_name, seed, rows, nblocks, d_scale):
    raw, head = _q5_blocks(seed, rows, nblocks, type_name, d_scale)
    shape = (rows, nblocks * 32)
    qt = int5_from_gguf_blocks(raw, type_name, shape)
    assert qt is not None
    _check_int5(qt, shape, 32, nonneg_scales=False)
    ref = gq.dequantize(raw, GT[type_name])
    ours = qt.dequantize()
    assert ref.shape == shape and ours.dtype == np.float32
    assert np.array_equal(ours, ref)  # equal values (+0.0 == -0.0)
    # a byte copy of {qh, qs}, and the block's d (and m) as scale (and minimum)
    blocks = raw.reshape(rows, nblocks, head + 20)
    assert np.array_equal(qt.qweight.reshape(rows, nblocks, 20), blocks[:, :, head:])
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    assert np.array_equal(qt.scales, d)
    if type_name == "Q5_0":
        assert np.array_equal(qt.mins.astype(np.float32), -16 * d.astype(np.float32))
    else:
        assert np.array_equal(qt.mins, blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0])


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_int5_from_gguf_hand_built_block(type_name):
    q = rng(39).integers(0, 32, 32).astype(np.uint8)
    q[3], q[20] = 31, 16
    qh = sum(((int(q[k]) >> 4) & 1) << k for k in range(32))
    qs = bytes((int(q[k]) & 15) | ((int(q[16 + k]) & 15) << 4) for k in range(16))
    head = np.array([0.5] if type_name == "Q5_0" else [0.5, -3.0], np.float16).tobytes()
    block = np.frombuffer(head + qh.to_bytes(4, "little") + qs, np.uint8)[None, :]
    if type_name == "Q5_0":
        expected = ((q.astype(np.float32) - 16) * 0.5)
    else:
        expected = q.astype(np.float32) * 0.5 - 3.0
    assert np.array_equal(gq.dequantize(block, GT[type_name])[0], expected)
    qt = int5_from_gguf_blocks(block, type_name, (1, 32))
    assert np.array_equal(unpack_int5(qt.qweight)[0], q)
    assert np.array_equal(qt.dequantize()[0], expected)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_int5_from_gguf_quantized_matrices(type_name, shape, scale):
    x = _gguf_matrix(40 + sum(shape), shape, scale)
    raw = gq.quantize(x, GT[type_name])
    qt = int5_from_gguf_blocks(raw, type_name, shape)
    assert np.array_equal(qt.dequantize(), gq.dequantize(raw, GT[type_name]))
    if scale >= 1:
        assert relative_error(x, qt.dequantize()) < 0.05


def test_q5_0_scale_overflow_is_not_imported():
    """-16 * d overflows float16 for |d| > 4094: no exact INT5 minimum, so None."""
    block = np.full(22, 0x5A, np.uint8)
    block[0:2] = np.array([4096.0], np.float16).view(np.uint8)
    assert int5_from_gguf_blocks(block[None, :], "Q5_0", (1, 32)) is None
    two = np.concatenate([block, block])
    two[0:2] = np.array([1.0], np.float16).view(np.uint8)  # one good block, one overflowing
    assert int5_from_gguf_blocks(two[None, :], "Q5_0", (1, 64)) is None
    block[0:2] = np.array([-4094.0], np.float16).view(np.uint8)  # minimum 65504 fits
    qt = int5_from_gguf_blocks(block[None, :], "Q5_0", (1, 32))
    assert qt is not None and qt.mins[0, 0] == np.float16(65504.0)
    assert np.array_equal(qt.dequantize(), gq.dequantize(block[None, :], GT.Q5_0))
    # Q5_1 carries its minimum: the same d imports
    b1 = np.full(24, 0x5A, np.uint8)
    b1[0:4] = np.array([4096.0, -60000.0], np.float16).view(np.uint8)
    qt = int5_from_gguf_blocks(b1[None, :], "Q5_1", (1, 32))
    assert np.array_equal(qt.dequantize(), gq.dequantize(b1[None, :], GT.Q5_1))


def test_int5_types_without_a_compatible_grid():
    x = _gguf_matrix(41, (2, 256), 1.0)
    for t in ("Q4_0", "Q4_1", "Q8_0"):
        assert int5_from_gguf_blocks(gq.quantize(x, GT[t]), t, (2, 256)) is None
    assert int5_from_gguf_blocks(np.zeros((2, 176), np.uint8), "Q5_K", (2, 256)) is None
    assert int5_from_gguf_blocks(x.astype(np.float16).view(np.uint8), "F16", (2, 256)) is None
    q51 = gq.quantize(x, GT.Q5_1)
    assert int4_from_gguf_blocks(q51, "Q5_1", (2, 256)) is None
    assert int8_from_gguf_blocks(q51, "Q5_1", (2, 256)) is None
    for t in ("Q5_0", "Q5_1"):
        assert int5_from_gguf_blocks(gq.quantize(x, GT[t]), t, (2, 256)).group_size == 32


# -- relative_error --------------------------------------------------------------------------
def test_relative_error_properties():
    r = rng(22)
    a = r.standard_normal((4, 64)).astype(np.float32)
    b = a + r.standard_normal((4, 64)).astype(np.float32) * 0.01
    assert relative_error(a, a) == 0.0
    e = relative_error(a, b)
    assert isinstance(e, float) and 0 < e < 0.05
    assert relative_error(a * 8, b * 8) == pytest.approx(e, rel=1e-6)  # scale invariant
    assert relative_error(a, np.zeros_like(a)) == pytest.approx(1.0)
    assert relative_error([3.0, 4.0], [3.0, 9.0]) == pytest.approx(1.0)
    assert relative_error([1.0, 0.0], [1.0, 1.0]) == pytest.approx(1.0)
    z = np.zeros(8, np.float32)
    assert relative_error(z, z) == 0.0
    assert relative_error(z, np.full(8, 0.5)) == pytest.approx(np.sqrt(8) * 0.5)
    # computed in float64: no overflow on large float16/float32 values
    big = np.full(1000, 60000.0, np.float16)
    assert relative_error(big, big * np.float16(0.5)) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [[np.inf, -np.inf], [np.nan], [np.inf]])
def test_a_tensor_that_is_not_finite_is_refused_in_one_line(bad):
    """The check sums in float64: inf - inf warned ('invalid value encountered in reduce', two
    lines of numpy before pack's one-line error)."""
    import warnings

    from pocketlm.errors import FormatError
    from pocketlm.quant import check_finite

    values = np.array([1.0, *bad, 2.0], np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FormatError, match="NaN or infinite"):
            check_finite("w", values)
        check_finite("w", np.full(8, 65504.0, np.float16))  # the largest float16s are fine
