"""Group-wise weight quantization: the INT4, INT5 and INT8 layouts, specified once.

INT4 (asymmetric, ``kind="int4"``), for a weight ``W`` of shape ``[rows, cols]``:

* ``qweight``: uint8 ``[rows, cols // 2]``. Columns are taken in blocks of 32; block ``b`` of a
  row occupies bytes ``16*b .. 16*b + 15`` and byte ``k`` holds column ``32*b + k`` in its low
  nibble and column ``32*b + 16 + k`` in its high nibble. (The nibble order is the one GGUF's
  Q4_0/Q4_1 blocks use, so those blocks import as a byte copy, and SIMD kernels unpack a block
  with one mask and one shift.) The layout does not depend on the group size.
* ``scales``, ``mins``: float16 ``[rows, cols // group_size]``.
* ``W[r, c] = q[r, c] * scales[r, c // g] + mins[r, c // g]`` with ``q`` in ``0..15``.

INT5 (asymmetric, ``kind="int5"``), same shape rules:

* ``qweight``: uint8 ``[rows, cols // 32 * 20]``. Block ``b`` of a row occupies bytes
  ``20*b .. 20*b + 19``: bytes ``20*b .. 20*b + 3`` are a little-endian uint32 whose bit ``k``
  is bit 4 (the high bit) of the value at column ``32*b + k``; bytes ``20*b + 4 .. 20*b + 19``
  are the low 4 bits exactly as INT4 packs them (byte ``k``: column ``32*b + k`` in the low
  nibble, column ``32*b + 16 + k`` in the high nibble). This is GGUF Q5_0's ``{qh[4]; qs[16]}``
  in block order, so Q5_0/Q5_1 blocks import as a byte copy.
* ``scales``, ``mins``: float16 ``[rows, cols // group_size]``.
* ``W[r, c] = q[r, c] * scales[r, c // g] + mins[r, c // g]`` with ``q`` in ``0..31``.

INT8 (symmetric, ``kind="int8"``): ``qweight`` int8 ``[rows, cols]``, ``scales`` float16
``[rows, cols // group_size]``, ``W[r, c] = q[r, c] * scales[r, c // g]`` (GGUF Q8_0 with
``g = 32`` imports exactly).

Group sizes are 32 (default), 64 or 128; ``cols`` must be a multiple of 32 and of the group size.

Implicit minimums (``zero_point``): an INT4 or INT5 tensor whose every minimum is
``-zero_point * scale`` exactly (8 for INT4, 16 for INT5: GGUF Q4_0's and Q5_0's grids) may be
stored without its ``mins`` (4.5 and 5.5 bits per weight at group 32 instead of 5.0 and 6.0);
readers compute ``mins = float16(-zero_point * scales)``, which is exact (a float16 times a power
of two), and hold the tensor as the layout above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError, UnsupportedError

GROUP_SIZES = (32, 64, 128)
KINDS = ("int4", "int5", "int8")
BLOCK = 32  # nibble-packing block, independent of the group size
INT5_BLOCK_BYTES = 20  # bytes of one 32-value INT5 block: 4 of high bits, 16 of nibbles


@dataclass
class QuantTensor:
    """A quantized 2-D weight in one of the layouts above (arrays may be views of a mmap)."""

    kind: str  # "int4" | "int5" | "int8"
    shape: tuple[int, int]
    group_size: int
    qweight: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None
    zero_point: int | None = None  # mins implicit: -zero_point * scales (not stored)

    @property
    def nbytes(self) -> int:
        """Bytes as stored in a deploy file (implicit minimums are not stored)."""
        n = self.qweight.nbytes + self.scales.nbytes
        stored = self.mins is not None and self.zero_point is None
        return n + (self.mins.nbytes if stored else 0)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])

    def dequantize(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Float32 values of all rows (or of the selected rows)."""
        sel = slice(None) if rows is None else rows
        if self.kind == "int4":
            return dequantize_int4(self.qweight[sel], self.scales[sel], self.mins[sel],
                                   self.group_size)
        if self.kind == "int5":
            return dequantize_int5(self.qweight[sel], self.scales[sel], self.mins[sel],
                                   self.group_size)
        if self.kind == "int8":
            return dequantize_int8(self.qweight[sel], self.scales[sel], self.group_size)
        raise UnsupportedError(f"quantized weight kind {self.kind!r} is not supported; "
                               f"choose one of {', '.join(KINDS)}")


ZERO_POINTS = {"int4": 8, "int5": 16}


def implicit_mins(scales: np.ndarray, zero_point: int) -> np.ndarray:
    """The float16 minimums ``-zero_point * scales`` of a tensor stored without them."""
    with np.errstate(over="ignore"):
        return (-float(zero_point) * scales.astype(np.float32)).astype(np.float16)


def find_zero_point(qt: QuantTensor) -> int | None:
    """The zero point of ``qt`` if its minimums are all ``-zero_point * scale`` exactly
    (so they need not be stored), else None."""
    zp = ZERO_POINTS.get(qt.kind)
    if zp is None or qt.mins is None:
        return None
    m = implicit_mins(qt.scales, zp)
    if not np.isfinite(m.astype(np.float32)).all():
        return None
    return zp if np.array_equal(m.view(np.uint16), np.asarray(qt.mins).view(np.uint16)) else None


def check_finite(name: str, values: np.ndarray) -> None:
    """Refuse a source tensor that holds NaN or infinite values: rounded, they become NaN
    scales (or a NaN norm), and the deploy file would compute NaN for every token."""
    # a float64 sum of float16/float32 values cannot overflow, so it is finite exactly when
    # every value is, without a temporary the size of the tensor
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: the answer, not a warning
        total = np.sum(values, dtype=np.float64)
    if not np.isfinite(total):
        raise FormatError(f"{name}: the source holds NaN or infinite values (a corrupt or "
                          "diverged model); nothing was written")


def check_quantizable(shape: tuple[int, ...], group_size: int, name: str = "tensor") -> None:
    if group_size not in GROUP_SIZES:
        raise UnsupportedError(f"group size {group_size} is not supported; choose one of "
                               f"{', '.join(map(str, GROUP_SIZES))}")
    if len(shape) != 2 or shape[1] % BLOCK or shape[1] % group_size:
        raise UnsupportedError(
            f"{name}: shape {tuple(shape)} cannot be quantized with group size {group_size} "
            f"(the input dimension must be a multiple of {max(BLOCK, group_size)})"
        )


# -- nibble packing --------------------------------------------------------------------------
def pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 ``[rows, cols]`` -> packed ``[rows, cols // 2]`` (layout above)."""
    rows, cols = q.shape
    blocks = q.reshape(rows, cols // BLOCK, 2, 16).astype(np.uint8)
    packed = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)  # [rows, nblocks, 16]
    return np.ascontiguousarray(packed.reshape(rows, cols // 2))


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Packed ``[rows, cols // 2]`` -> uint8 values 0..15 ``[rows, cols]``."""
    rows, half = packed.shape
    blocks = packed.reshape(rows, half // 16, 1, 16)
    q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=2)  # [rows, nblocks, 2, 16]
    return q.reshape(rows, half * 2)


def pack_int5(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..31 ``[rows, cols]`` -> packed ``[rows, cols // 32 * 20]`` (layout
    above)."""
    rows, cols = q.shape
    q = np.asarray(q, dtype=np.uint8)
    nb = cols // BLOCK
    out = np.empty((rows, nb, INT5_BLOCK_BYTES), dtype=np.uint8)
    high = (q >> 4 & 1).reshape(rows, nb, BLOCK)
    out[:, :, :4] = np.packbits(high, axis=2, bitorder="little")  # little-endian uint32
    out[:, :, 4:] = pack_int4(q & 0x0F).reshape(rows, nb, 16)
    return out.reshape(rows, nb * INT5_BLOCK_BYTES)


def unpack_int5(packed: np.ndarray) -> np.ndarray:
    """Packed ``[rows, cols // 32 * 20]`` -> uint8 values 0..31 ``[rows, cols]``."""
    rows, nbytes = packed.shape
    nb = nbytes // INT5_BLOCK_BYTES
    blocks = packed.reshape(rows, nb, INT5_BLOCK_BYTES)
    high = np.unpackbits(blocks[:, :, :4], axis=2, bitorder="little")  # [rows, nb, 32]
    low = unpack_int4(blocks[:, :, 4:].reshape(rows, nb * 16))
    return low | (high.reshape(rows, nb * BLOCK) << 4)


def _dequantize_asym(q: np.ndarray, scales, mins, group_size: int) -> np.ndarray:
    q = q.astype(np.float32)
    rows, cols = q.shape
    q = q.reshape(rows, cols // group_size, group_size)
    w = q * scales.astype(np.float32)[:, :, None] + mins.astype(np.float32)[:, :, None]
    return w.reshape(rows, cols)


def dequantize_int4(qweight, scales, mins, group_size: int) -> np.ndarray:
    return _dequantize_asym(unpack_int4(qweight), scales, mins, group_size)


def dequantize_int5(qweight, scales, mins, group_size: int) -> np.ndarray:
    return _dequantize_asym(unpack_int5(qweight), scales, mins, group_size)


def dequantize_int8(qweight, scales, group_size: int) -> np.ndarray:
    rows, cols = qweight.shape
    q = qweight.astype(np.float32).reshape(rows, cols // group_size, group_size)
    return (q * scales.astype(np.float32)[:, :, None]).reshape(rows, cols)


# -- quantizers ------------------------------------------------------------------------------
_ROW_CHUNK = 1 << 20  # elements per chunk: bounds the temporary memory of large tensors


def quantize_int4(w: np.ndarray, group_size: int = 32, *, search: bool = True) -> QuantTensor:
    """Asymmetric INT4 with float16 scale and minimum per group.

    With ``search`` the range of each group is chosen among a few candidates (shrinking the
    min-max range, then refitting scale and minimum by least squares), keeping the one with the
    smallest squared error; without it, plain min-max rounding.
    """
    return _quantize_asym(w, group_size, search, "int4")


def quantize_int5(w: np.ndarray, group_size: int = 32, *, search: bool = True) -> QuantTensor:
    """Asymmetric INT5 (32 levels) with float16 scale and minimum per group; ``search`` as in
    :func:`quantize_int4`."""
    return _quantize_asym(w, group_size, search, "int5")


_ASYM = {"int4": (15, pack_int4), "int5": (31, pack_int5)}  # kind -> (largest q, packer)


def _quantize_asym(w: np.ndarray, group_size: int, search: bool, kind: str) -> QuantTensor:
    qmax, pack_fn = _ASYM[kind]
    w = np.asarray(w, dtype=np.float32)
    check_quantizable(w.shape, group_size)
    rows, cols = w.shape
    ng = cols // group_size
    q_all = np.empty((rows, cols), dtype=np.uint8)
    s_all = np.empty((rows, ng), dtype=np.float16)
    m_all = np.empty((rows, ng), dtype=np.float16)
    step = max(1, _ROW_CHUNK // cols)
    for r0 in range(0, rows, step):
        g = w[r0:r0 + step].reshape(-1, group_size)
        q, s, m = _quantize_groups_asym(g, search, qmax)
        n = g.shape[0] // ng
        q_all[r0:r0 + n] = q.reshape(n, cols)
        s_all[r0:r0 + n] = s.reshape(n, ng)
        m_all[r0:r0 + n] = m.reshape(n, ng)
    return QuantTensor(kind, (rows, cols), group_size, pack_fn(q_all), s_all, m_all)


def _round_to_grid(g, s16, m16, qmax: int = 15):
    """q = clip(round((g - m) / s), 0, qmax) with float16-rounded s and m (s == 0: q = 0)."""
    s = s16.astype(np.float32)
    m = m16.astype(np.float32)
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
    q = np.clip(np.rint((g - m[:, None]) * inv[:, None]), 0, qmax)
    err = ((q * s[:, None] + m[:, None] - g) ** 2).sum(axis=1)
    return q.astype(np.uint8), err


def _quantize_groups_asym(g: np.ndarray, search: bool, qmax: int = 15):
    """Groups ``[n, group_size]`` -> (q uint8, scale float16, min float16) on ``0..qmax``."""
    lo = g.min(axis=1)
    hi = g.max(axis=1)
    s16 = ((hi - lo) / float(qmax)).astype(np.float16)
    m16 = lo.astype(np.float16)
    best_q, best_err = _round_to_grid(g, s16, m16, qmax)
    best_s, best_m = s16, m16
    if not search:
        return best_q, best_s, best_m
    n = g.shape[1]
    for shrink in (0.02, 0.05, 0.08, 0.12, 0.16, 0.2):
        # candidate grid on a narrowed range, then a least-squares refit of (s, m) given q
        span = (hi - lo) * (1.0 - shrink)
        s = span / float(qmax)
        m = lo + (hi - lo) * shrink / 2
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
        q = np.clip(np.rint((g - m[:, None]) * inv[:, None]), 0, qmax)
        sq, sq2 = q.sum(axis=1), (q * q).sum(axis=1)
        sw, sqw = g.sum(axis=1), (q * g).sum(axis=1)
        det = n * sq2 - sq * sq
        ok = det > 0
        s_fit = np.where(ok, (n * sqw - sq * sw) / np.where(ok, det, 1), s)
        m_fit = np.where(ok, (sq2 * sw - sq * sqw) / np.where(ok, det, 1), m)
        s_fit = np.maximum(s_fit, 0)
        cand_s, cand_m = s_fit.astype(np.float16), m_fit.astype(np.float16)
        cq, cerr = _round_to_grid(g, cand_s, cand_m, qmax)
        better = cerr < best_err
        best_q[better] = cq[better]
        best_err = np.where(better, cerr, best_err)
        best_s = np.where(better, cand_s, best_s)
        best_m = np.where(better, cand_m, best_m)
    return best_q, best_s, best_m


def quantize_int8(w: np.ndarray, group_size: int = 32) -> QuantTensor:
    """Symmetric INT8 with a float16 scale per group (absmax / 127)."""
    w = np.asarray(w, dtype=np.float32)
    check_quantizable(w.shape, group_size)
    rows, cols = w.shape
    ng = cols // group_size
    q_all = np.empty((rows, cols), dtype=np.int8)
    s_all = np.empty((rows, ng), dtype=np.float16)
    step = max(1, _ROW_CHUNK // cols)
    for r0 in range(0, rows, step):
        g = w[r0:r0 + step].reshape(-1, group_size)
        s16 = (np.abs(g).max(axis=1) / 127.0).astype(np.float16)
        s = s16.astype(np.float32)
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
        q = np.clip(np.rint(g * inv[:, None]), -127, 127).astype(np.int8)
        n = g.shape[0] // ng
        q_all[r0:r0 + n] = q.reshape(n, cols)
        s_all[r0:r0 + n] = s16.reshape(n, ng)
    return QuantTensor("int8", (rows, cols), group_size, q_all, s_all, None)


def quantize(w: np.ndarray, bits: int, group_size: int = 32, *,
             search: bool = True) -> QuantTensor:
    """``search=False``: INT4/INT5 groups take plain min-max ranges (the grid
    quantization-aware training trains against), instead of the best of a few candidate
    ranges."""
    if bits == 4:
        return quantize_int4(w, group_size, search=search)
    if bits == 5:
        return quantize_int5(w, group_size, search=search)
    if bits == 8:
        return quantize_int8(w, group_size)
    raise UnsupportedError(f"{bits}-bit weights are not supported; choose 4, 5 or 8")


# -- lossless import of GGUF blocks ----------------------------------------------------------
# Block layouts (ggml): Q4_0 = {f16 d; u8 qs[16]} -> (q - 8) * d
#                       Q4_1 = {f16 d; f16 m; u8 qs[16]} -> q * d + m
#                       Q4_K = {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]} per 256 values,
#                              8 sub-blocks of 32 with 6-bit scale sc and min mn:
#                              d * sc * q - dmin * mn
#                       Q5_0 = {f16 d; u8 qh[4]; u8 qs[16]} -> (q - 16) * d
#                       Q5_1 = {f16 d; f16 m; u8 qh[4]; u8 qs[16]} -> q * d + m
#                              (q = low nibble from qs as in Q4_0, bit 4 from qh as a
#                              little-endian uint32, bit k for value k)
#                       Q8_0 = {f16 d; i8 qs[32]} -> q * d
# Each 32-value (sub-)block is an asymmetric group-32 INT4 or INT5 (or symmetric INT8) group,
# so these import without requantizing. Q4_0, Q4_1, Q5_0 and Q5_1 are exact (Q4_0 and Q5_0
# store the minimum -8 * d, -16 * d: a tensor where that overflows float16 is not imported).
# Q4_K's effective scale d * sc and minimum -dmin * mn are products of a float16 and a 6-bit
# integer, rounded here to float16: a relative error of at most 2^-11 on each (the only loss; at
# most 2^-25 absolute in float16's subnormal range). A block whose scale or minimum exceeds the
# float16 range is not imported.

def int4_from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]):
    """Raw GGUF rows (uint8 ``[rows, bytes_per_row]``) -> group-32 INT4, or None if the type
    has no compatible grid."""
    rows, cols = shape
    raw = np.ascontiguousarray(raw).reshape(rows, -1)
    if type_name == "Q4_0":
        b = raw.reshape(rows, cols // 32, 18)
        d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]
        qs = b[:, :, 2:18].reshape(rows, cols // 2)
        d32 = d.astype(np.float32)
        with np.errstate(over="ignore"):
            mins = (-8.0 * d32).astype(np.float16)
        if not np.array_equal(mins.astype(np.float32), -8.0 * d32):  # overflow: not exact
            return None
        return QuantTensor("int4", (rows, cols), 32, np.ascontiguousarray(qs), d.copy(), mins)
    if type_name == "Q4_1":
        b = raw.reshape(rows, cols // 32, 20)
        d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]
        m = b[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        qs = b[:, :, 4:20].reshape(rows, cols // 2)
        return QuantTensor("int4", (rows, cols), 32, np.ascontiguousarray(qs), d.copy(), m.copy())
    if type_name == "Q4_K":
        nsb = cols // QK_K
        b = raw.reshape(rows, nsb, Q4K_BLOCK_BYTES)
        scales, mins = q4k_scales_mins(b[:, :, 0:4], b[:, :, 4:16])
        if not (np.isfinite(scales).all() and np.isfinite(mins).all()):  # beyond float16
            return None
        qs = b[:, :, 16:144].reshape(rows, nsb, 4, 32)  # 4 chunks of 64 values
        lo = qs & 0x0F  # sub-block 2j
        hi = qs >> 4  # sub-block 2j + 1
        q = np.stack([lo, hi], axis=3).reshape(rows, cols)  # [rows, nsb, 4, 2, 32]
        return QuantTensor("int4", (rows, cols), 32, pack_int4(q), scales, mins)
    return None


QK_K = 256  # values per K-quant super-block
Q4K_BLOCK_BYTES, Q6K_BLOCK_BYTES = 144, 210


def q4k_scales_mins(dd: np.ndarray, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The group-32 float16 scales and minimums of Q4_K super-blocks: ``dd`` the 4 bytes
    ``d, dmin`` (two float16) and ``packed`` the 12 bytes of 6-bit scale and minimum codes of
    each super-block (uint8 ``[rows, nsb, 4]`` and ``[rows, nsb, 12]``) ->
    ``float16(d * sc)``, ``float16(-(dmin * mn))`` ``[rows, nsb * 8]`` (may hold inf where
    the products leave float16's range)."""
    rows, nsb = packed.shape[:2]
    f = np.ascontiguousarray(dd).view(np.float16).astype(np.float32)  # [rows, nsb, 2]
    sc, mn = _q4k_scale_min(packed)  # [rows, nsb, 8]
    with np.errstate(over="ignore"):
        scales = (f[:, :, 0:1] * sc).astype(np.float16).reshape(rows, nsb * 8)
        mins = (-(f[:, :, 1:2] * mn)).astype(np.float16).reshape(rows, nsb * 8)
    return scales, mins


def dequantize_q6k(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """GGUF Q6_K rows (uint8 ``[rows, cols // 256 * 210]``) -> float32 ``[rows, cols]``.

    A super-block of 256 values is ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits),
    ``scales[16]`` (int8, one per 16 values) and ``d`` (float16); value ``v = (d * sc) * (q -
    32)``, in float32 in that order (ggml's). Each half of 128 values takes ``ql[64 h ..]`` and
    ``qh[32 h ..]``: value ``32 j + l`` of the half (``j`` 0..3, ``l`` 0..31) has its low bits
    in nibble ``j // 2`` of ``ql[64 h + 32 (j % 2) + l]`` and its high bits at bit ``2 j`` of
    ``qh[32 h + l]``."""
    rows, cols = shape
    b = np.ascontiguousarray(raw).reshape(rows * (cols // QK_K), Q6K_BLOCK_BYTES)
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)  # [block, half, -, j % 2, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [block, half, -, l]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [block, 16]
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [block, 1]
    # j = 2 * nibble + j % 2
    low = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low | (high << 4)).view(np.int8) - np.int8(32)  # [block, half, j, l], exact
    step = (d * sc).reshape(-1, 16, 1)  # one per 16 values, in value order
    return (step * q.reshape(-1, 16, 16)).reshape(rows, cols)


# -- source encodings ------------------------------------------------------------------------
# A deploy file may hold a tensor that was imported from a GGUF K-quant in that source's own
# bytes, which are smaller than the pocketlm layout the engine computes with; the reader
# decodes them to that layout, bit for bit what the pack computed (docs/format.md):
#   "q4_k": INT4 group 32 whose scales and minimums are Q4_K's 6-bit codes under a float16
#           d / dmin per 256 values: the values (pocketlm's nibble order) plus the codes,
#           4.5 bits per weight instead of 5.0;
#   "q6_k": INT8 group 32 made from Q6_K blocks (quantize_int8 of their values): the blocks
#           themselves, 6.5625 bits per weight instead of 8.5.
# and one of pocketlm's own, for INT4 that it rounds itself (pocketlm.calibrate):
#   "int4_c8": INT4 group 32 whose scales and minimums are 8-bit codes under two float16 steps
#           per row (scale = sc * d, unsigned; minimum = mc * dmin, signed): the values plus
#           two bytes a group and four a row, 4.5 bits per weight (+ 32 / columns) instead of
#           5.0: group 32's resolution at group 64's size.
ENCODINGS = {"q4_k": "int4", "q6_k": "int8", "int4_c8": "int4"}
BLOCK_VALUES = {"q4_k": QK_K, "q6_k": QK_K, "int4_c8": 32}  # columns: a multiple of this
_ENCODING_OF_TYPE = {"Q4_K": "q4_k", "Q6_K": "q6_k"}


def encoded_arrays(encoding: str, shape: tuple[int, int]) -> dict[str, tuple[type, tuple]]:
    """What a tensor in ``encoding`` stores: name suffix -> (dtype, shape)."""
    rows, cols = shape
    nsb = cols // QK_K
    if encoding == "q4_k":
        return {"": (np.uint8, (rows, cols // 2)), ".kscales": (np.uint8, (rows, nsb * 12)),
                ".kd": (np.float16, (rows, nsb * 2))}
    if encoding == "q6_k":
        return {"": (np.uint8, (rows, nsb * Q6K_BLOCK_BYTES))}
    if encoding == "int4_c8":
        return {"": (np.uint8, (rows, cols // 2)), ".sc": (np.uint8, (rows, cols // 32)),
                ".mc": (np.int8, (rows, cols // 32)), ".rd": (np.float16, (rows, 2))}
    raise UnsupportedError(f"unknown tensor encoding {encoding!r}")


def coded_steps(sc: np.ndarray, mc: np.ndarray, rd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float16 scales and minimums of ``int4_c8`` codes: ``sc * d`` and ``mc * dmin``
    (``rd[:, 0]``, ``rd[:, 1]``), multiplied in float32 and rounded to float16 once."""
    d = rd.astype(np.float32)
    scales = (sc.astype(np.float32) * d[:, :1]).astype(np.float16)
    mins = (mc.astype(np.float32) * d[:, 1:2]).astype(np.float16)
    return scales, mins


def code_steps(scales: np.ndarray, mins: np.ndarray):
    """Float scales (>= 0) and minimums ``[rows, groups]`` as ``int4_c8`` codes: ``(sc, mc,
    rd)``, each row's steps ``d = max(scale) / 255`` and ``dmin = max|minimum| / 127`` in
    float16 and every value rounded to the nearest code."""
    s = np.maximum(np.asarray(scales, np.float32), 0)
    m = np.asarray(mins, np.float32)
    with np.errstate(over="ignore"):
        rd = np.stack([s.max(axis=1) / 255.0, np.abs(m).max(axis=1) / 127.0], axis=1
                      ).astype(np.float16)
    if not np.isfinite(rd).all():
        raise UnsupportedError("a group's scale or minimum does not fit float16")
    d = rd.astype(np.float32)
    di = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    sc = np.clip(np.rint(s * di[:, :1]), 0, 255).astype(np.uint8)
    mc = np.clip(np.rint(m * di[:, 1:2]), -127, 127).astype(np.int8)
    return sc, mc, rd


def decode(encoding: str, shape: tuple[int, int], stored: dict[str, np.ndarray]):
    """``(qweight, scales, mins)`` of the layout a tensor stored in ``encoding`` decodes to."""
    rows, cols = shape
    nsb = cols // QK_K
    if encoding == "q4_k":
        dd = stored[".kd"].reshape(rows, nsb, 2).view(np.uint8)
        scales, mins = q4k_scales_mins(dd, stored[".kscales"].reshape(rows, nsb, 12))
        return stored[""], scales, mins
    if encoding == "int4_c8":
        scales, mins = coded_steps(stored[".sc"], stored[".mc"], stored[".rd"])
        return stored[""], scales, mins
    if encoding == "q6_k":
        # a few rows at a time: the float32 values and their temporaries of a whole tensor
        # (about 12 bytes a weight) would add tens of MB to a model's load peak; every row
        # decodes alone, so the result does not depend on the chunking
        raw = stored[""].reshape(rows, nsb * Q6K_BLOCK_BYTES)
        q = np.empty((rows, cols), dtype=np.int8)
        s = np.empty((rows, cols // 32), dtype=np.float16)
        step = max(1, _ROW_CHUNK // 4 // cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            qt = quantize_int8(dequantize_q6k(raw[r0:r1], (r1 - r0, cols)), 32)
            q[r0:r1], s[r0:r1] = qt.qweight, qt.scales
        return q, s, None
    raise UnsupportedError(f"unknown tensor encoding {encoding!r}")


class EncodedQuantTensor(QuantTensor):
    """A :class:`QuantTensor` held in a source encoding (``encoding``, above) as the deploy
    file stores it (``stored``: name suffix -> array). Its layout's arrays are decoded on first
    use and kept until :meth:`release` (after the native engine has repacked them, so that
    they do not stay resident); ``nbytes`` counts the stored bytes."""

    def __init__(self, encoding: str, shape: tuple[int, int], stored: dict[str, np.ndarray]):
        self.kind, self.shape, self.group_size = ENCODINGS[encoding], tuple(shape), 32
        self.encoding, self.stored, self.zero_point = encoding, stored, None
        self._decoded = None

    def _arrays(self):
        if self._decoded is None:
            self._decoded = decode(self.encoding, self.shape, self.stored)
        return self._decoded

    qweight = property(lambda self: self._arrays()[0])
    scales = property(lambda self: self._arrays()[1])
    mins = property(lambda self: self._arrays()[2])

    def release(self) -> None:
        self._decoded = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.stored.values())


def may_encode(name: str, tied: bool) -> bool:
    """Whether tensor ``name`` may be stored in a source encoding: not an untied embedding,
    which the engine reads in place from the file for its lookups (a few rows a token) and
    which would otherwise be decoded whole into memory."""
    return tied or name != "embed.weight"


def encode_as_source(qt: QuantTensor, source_type: str, raw: np.ndarray
                     ) -> EncodedQuantTensor | None:
    """``qt`` stored in the bytes of its GGUF source ``raw`` (``source_type`` Q4_K or Q6_K,
    rows in the model's order), if those decode to ``qt`` bit for bit; else None."""
    encoding = _ENCODING_OF_TYPE.get(source_type)
    rows, cols = qt.shape
    if encoding is None or ENCODINGS[encoding] != qt.kind or qt.group_size != 32 or \
            cols % QK_K or qt.zero_point is not None:
        return None
    nsb = cols // QK_K
    if encoding == "q4_k":
        b = np.ascontiguousarray(raw).reshape(rows, nsb, Q4K_BLOCK_BYTES)
        stored = {"": np.ascontiguousarray(qt.qweight),
                  ".kscales": np.ascontiguousarray(b[:, :, 4:16]).reshape(rows, nsb * 12),
                  ".kd": np.ascontiguousarray(b[:, :, 0:4]).view(np.float16).reshape(rows,
                                                                                    nsb * 2)}
    else:
        stored = {"": np.ascontiguousarray(raw).reshape(rows, nsb * Q6K_BLOCK_BYTES)}
    enc = EncodedQuantTensor(encoding, qt.shape, stored)
    same = all(a is None and b is None or a is not None and b is not None and
               np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
               for a, b in ((enc.qweight, qt.qweight), (enc.scales, qt.scales),
                            (enc.mins, qt.mins)))
    enc.release()
    return enc if same else None


def int5_from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]):
    """Raw GGUF Q5_0/Q5_1 rows (uint8 ``[rows, bytes_per_row]``) -> group-32 INT5 (exact), or
    None for other types (and for a Q5_0 minimum beyond float16)."""
    if type_name not in ("Q5_0", "Q5_1"):
        return None
    rows, cols = shape
    head = 2 if type_name == "Q5_0" else 4  # bytes before qh: d, or d and m
    b = np.ascontiguousarray(raw).reshape(rows, cols // 32, head + INT5_BLOCK_BYTES)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    if type_name == "Q5_0":
        d32 = d.astype(np.float32)
        with np.errstate(over="ignore"):
            mins = (-16.0 * d32).astype(np.float16)
        if not np.array_equal(mins.astype(np.float32), -16.0 * d32):  # overflow: not exact
            return None
    else:
        mins = b[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    qweight = np.ascontiguousarray(b[:, :, head:]).reshape(rows, cols // 32 * INT5_BLOCK_BYTES)
    return QuantTensor("int5", (rows, cols), 32, qweight, d.copy(), mins)


def q4k_codes(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and minimum codes of Q4_K super-blocks (their 12 packed bytes
    ``[..., 12]``) as uint8 ``[..., 8]`` each."""
    sc, mn = _q4k_scale_min(packed)
    return sc.astype(np.uint8), mn.astype(np.uint8)


def _q4k_scale_min(s: np.ndarray):
    """Unpack the 12 bytes of 6-bit scales and mins of Q4_K/Q5_K super-blocks -> two
    float32 arrays ``[..., 8]``."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., 0:4] = s[..., 0:4] & 63
    mn[..., 0:4] = s[..., 4:8] & 63
    sc[..., 4:8] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:8] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def int8_from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]):
    """GGUF Q8_0 rows -> group-32 INT8 (exact), or None for other types."""
    if type_name != "Q8_0":
        return None
    rows, cols = shape
    b = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    qs = b[:, :, 2:34].copy().view(np.int8).reshape(rows, cols)
    return QuantTensor("int8", (rows, cols), 32, qs, d.copy(), None)


# -- quality ---------------------------------------------------------------------------------
def relative_error(reference: np.ndarray, approx: np.ndarray) -> float:
    """||approx - reference|| / ||reference|| (0 for an all-zero reference matched exactly)."""
    ref = np.asarray(reference, dtype=np.float64)
    diff = np.linalg.norm(np.asarray(approx, dtype=np.float64) - ref)
    norm = np.linalg.norm(ref)
    return float(diff / norm) if norm > 0 else float(diff)
