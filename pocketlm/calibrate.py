"""Calibrated quantization: activation statistics from the runtime, and quantizers that use them.

Statistics. :func:`gather` runs the float model on the calibration sequences
(:mod:`pocketlm.calibdata`) in the runtime's numpy reference engine (torch-free) and
accumulates, for the input ``X`` of every group of linear products, the second moment
``H = X^T X / n`` (float64). Products that read the same input share one ``H``: q/k/v read
``layers.{i}.attn_in``, W_o ``o_in``, gate/up ``mlp_in``, W_down ``down_in``, and the output
head (tied or not) ``head_in``, the final normed hidden state.

The output error of a quantized matrix ``W~`` on that input is
``E(W~) = sum_t ||(W~ - W) x_t||^2 / n = tr((W~ - W) H (W~ - W)^T)``: what each method here
minimizes instead of the weight error ``||W~ - W||^2``.

Methods (``method=`` of :func:`quantize_calibrated`):

* ``"rtn"``: no calibration: the weight-error range search of :mod:`pocketlm.quant`.
* ``"act"``: the same search, but each group's candidate ranges are judged by the
  activation-weighted error ``sum_c H_cc (w~_c - w_c)^2`` (the diagonal of ``E``), and the
  scale and minimum are refitted by weighted least squares.
* ``"gptq"``: error-compensating rounding (GPTQ: Frantar et al., 2022): columns are rounded one
  at a time, in blocks of 128, and the rounding error of each column is spread over the columns
  not yet rounded through the Cholesky factor of ``H^-1`` (damped by ``damp * mean(diag H)``),
  which minimizes ``E`` greedily; each group's scale and minimum are chosen (as ``"act"`` does)
  when its first column is reached, from the weights as updated so far.

Everything is deterministic: float64 statistics summed in a fixed order, and no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import FetchError, PocketError, UnsupportedError
from .head_patch import PATCH, PATCH_GROUP, PATCH_IDS
from .progress import bar as progress_bar
from .quant import (
    Q4K_BLOCK_BYTES,
    Q6K_BLOCK_BYTES,
    QK_K,
    EncodedQuantTensor,
    QuantTensor,
    check_finite,
    check_quantizable,
    code_steps,
    coded_steps,
    find_zero_point,
    may_encode,
    pack_int4,
    pack_int5,
    quantize,
    quantize_int8,
)

METHODS = ("rtn", "act", "gptq")
DEFAULT_METHOD = "gptq"
DAMP = 0.01
GPTQ_BLOCK = 128

# the statistics site each quantized tensor reads
_SITE = {"attn.w_q.weight": "attn_in", "attn.w_k.weight": "attn_in", "attn.w_v.weight": "attn_in",
         "attn.w_o.weight": "o_in", "mlp.w_gate.weight": "mlp_in", "mlp.w_up.weight": "mlp_in",
         "mlp.w_down.weight": "down_in"}


def site_of(name: str) -> str:
    """The statistics site whose input the tensor ``name`` multiplies."""
    if name in ("embed.weight", "lm_head.weight"):
        return "head_in"
    for suffix, site in _SITE.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + site
    raise UnsupportedError(f"{name}: not a tensor that calibration knows the input of")


@dataclass
class Stats:
    """Second moments ``H = X^T X / n`` of the inputs of each site."""

    h: dict[str, np.ndarray] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    _pending: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)
    FLUSH_ROWS = 2048  # inputs are buffered and multiplied in blocks of this many rows

    def add(self, site: str, x: np.ndarray) -> None:
        x = np.array(x, dtype=np.float32).reshape(-1, x.shape[-1])
        buf = self._pending.setdefault(site, [])
        buf.append(x)
        self.n[site] = self.n.get(site, 0) + x.shape[0]
        if sum(len(b) for b in buf) >= self.FLUSH_ROWS:
            self._flush(site)

    def _flush(self, site: str) -> None:
        buf = self._pending.pop(site, [])
        if not buf:
            return
        x = np.concatenate(buf) if len(buf) > 1 else buf[0]
        xtx = (x.T @ x).astype(np.float64)
        if site in self.h:
            self.h[site] += xtx
        else:
            self.h[site] = xtx

    def finish(self) -> None:
        for site in list(self._pending):
            self._flush(site)

    def round_as_stored(self) -> None:
        """Round the sums to float32, as :func:`save_stats` keeps them, so that a pack that
        gathered the statistics and one that read them back quantize byte for byte alike."""
        self.finish()
        for site in self.h:
            self.h[site] = self.h[site].astype(np.float32)

    def hessian(self, site: str) -> np.ndarray:
        self.finish()
        if site not in self.h:
            raise PocketError(f"calibration gathered no statistics for {site!r}")
        return self.h[site] / max(self.n[site], 1)


def gather(config, weights: dict, sequences: list[list[int]], *, progress: bool = True) -> Stats:
    """Statistics of every site over ``sequences`` (the float model ``weights``: float32
    arrays or QuantTensors, run by the numpy reference engine)."""
    import time

    from .runtime.engine import KVCache, NumpyEngine

    if not sequences:
        raise PocketError("calibration needs at least one sequence")
    t0 = time.time()
    eng = NumpyEngine(config, weights, logits=False)  # statistics need no logits
    stats = Stats()
    eng.observe = stats.add
    bar = progress_bar(len(sequences), "calibrating", "seq", enabled=progress)
    try:
        for seq in sequences:
            ids = np.asarray(seq, dtype=np.int64)
            eng.forward(ids, KVCache(config, len(ids)), True)
            stats.tokens += len(ids)
            bar.update(1)
    finally:
        bar.close()
    stats.seconds = time.time() - t0
    return stats


def _stats_path(model, cset):
    """Where the statistics of ``model`` on ``cset`` are kept (None: a source without a
    digest, not cached): ``pocket_home()/calib``, keyed by the source file's sha256, the
    calibration texts' sha256 and the sequence shape. The second moments are kept in float32:
    about 0.4 GB for gemma3-270m, 2.5 GB for qwen2.5-0.5b (delete the folder to reclaim it)."""
    from .registry import pocket_home

    sha = model.provenance.get("source_sha256")
    if not isinstance(sha, str) or not cset.sequences:
        return None
    key = f"{sha[:16]}-{cset.digest[:16]}-{len(cset.sequences)}x{len(cset.sequences[0])}"
    return pocket_home() / "calib" / f"stats-r{STATS_REVISION}-{key}.npz"


STATS_REVISION = 2  # 2: float32 on disk


def cached_stats(model, cset) -> Stats | None:
    """Statistics gathered before for the same source and calibration set, if any."""
    import zipfile

    path = _stats_path(model, cset)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as z:
            sites = [str(s) for s in z["sites"]]
            st = Stats(tokens=int(z["tokens"]))
            for i, site in enumerate(sites):
                st.h[site] = z[f"h{i}"]  # float32; each use upcasts what it needs
                st.n[site] = int(z["n"][i])
            return st
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # unreadable (a truncated or damaged file is not a zip): gather again


def save_stats(model, cset, stats: Stats) -> None:
    """Keep ``stats`` for the next pack of the same source and set (atomically; a failure
    to write only costs the next pack the gathering). The temp file is one that
    :func:`~pocketlm.data.download.sweep_stale_temps` knows: Ctrl-C or SIGTERM remove it at
    once, and what a SIGKILL left (up to gigabytes) is removed by the next save."""
    from .data.download import atomic_file, sweep_stale_temps

    path = _stats_path(model, cset)
    if path is None:
        return
    stats.finish()
    sites = sorted(stats.h)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(path.parent)
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, sites=np.array(sites), tokens=stats.tokens,
                     n=np.array([stats.n[s] for s in sites]),
                     **{f"h{i}": stats.h[s].astype(np.float32) for i, s in enumerate(sites)})
    except OSError:
        pass


# -- output error ------------------------------------------------------------------------------
def output_error(w: np.ndarray, qt: QuantTensor, h: np.ndarray, rows: int = 16384) -> float:
    """``tr((W~ - W) H (W~ - W)^T)``: the mean squared output error over the calibration
    inputs, summed over output rows."""
    h32 = h.astype(np.float32)
    total = 0.0
    for r0 in range(0, w.shape[0], rows):
        d = qt.dequantize(slice(r0, r0 + rows)) - w[r0:r0 + rows]
        total += float(np.einsum("ij,ij->", d @ h32, d, dtype=np.float64))
    return total


def output_energy(w: np.ndarray, h: np.ndarray, rows: int = 16384) -> float:
    """``tr(W H W^T)``: the mean squared output of the float matrix."""
    h32 = h.astype(np.float32)
    total = 0.0
    for r0 in range(0, w.shape[0], rows):
        a = w[r0:r0 + rows]
        total += float(np.einsum("ij,ij->", a @ h32, a, dtype=np.float64))
    return total


# -- group fitting with per-column importance --------------------------------------------------
_QMAX = {"int4": 15, "int5": 31}
_SHRINKS = (0.0, 0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.25)


def fit_groups(g: np.ndarray, imp: np.ndarray | None, qmax: int, zp: int | None = None):
    """Groups ``[n, gs]`` (importance ``imp`` broadcastable to it, or None) -> (q uint8,
    scale float16, min float16): the best of a few shrunken min-max ranges, each refitted by
    (weighted) least squares, judged by the weighted squared error with the float16-rounded
    scale and minimum that will be stored. ``zp``: the minimum is ``-zp * scale`` (a grid
    stored without minimums), and only the scale is fitted."""
    g = np.asarray(g, dtype=np.float32)
    wgt = np.ones_like(g) if imp is None else np.broadcast_to(
        np.asarray(imp, np.float32), g.shape)
    lo, hi = g.min(axis=1), g.max(axis=1)
    if zp is not None:
        return _fit_groups_sym(g, wgt, qmax, zp, lo, hi)
    best = None
    sw0 = wgt.sum(axis=1)
    for shrink in _SHRINKS:
        span = (hi - lo) * (1.0 - shrink)
        s = span / float(qmax)
        m = lo + (hi - lo) * shrink / 2
        cands = [(s, m)]
        if shrink:
            inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
            q = np.clip(np.rint((g - m[:, None]) * inv[:, None]), 0, qmax)
            # weighted least squares of (s, m) given q
            a11 = (wgt * q * q).sum(1)
            a12 = (wgt * q).sum(1)
            b1 = (wgt * q * g).sum(1)
            b2 = (wgt * g).sum(1)
            det = a11 * sw0 - a12 * a12
            ok = det > 1e-20 * np.maximum(a11 * sw0, 1e-30)
            dd = np.where(ok, det, 1.0)
            s_fit = np.where(ok, (b1 * sw0 - a12 * b2) / dd, s)
            m_fit = np.where(ok, (a11 * b2 - a12 * b1) / dd, m)
            cands.append((np.maximum(s_fit, 0), m_fit))
        for cs, cm in cands:
            s16 = np.asarray(cs, np.float32).astype(np.float16)
            m16 = np.asarray(cm, np.float32).astype(np.float16)
            sf, mf = s16.astype(np.float32), m16.astype(np.float32)
            inv = np.divide(1.0, sf, out=np.zeros_like(sf), where=sf != 0)
            q = np.clip(np.rint((g - mf[:, None]) * inv[:, None]), 0, qmax)
            err = (wgt * (q * sf[:, None] + mf[:, None] - g) ** 2).sum(axis=1)
            if best is None:
                best = [q.astype(np.uint8), s16, m16, err]
                continue
            better = err < best[3]
            best[0][better] = q[better].astype(np.uint8)
            best[1] = np.where(better, s16, best[1])
            best[2] = np.where(better, m16, best[2])
            best[3] = np.where(better, err, best[3])
    return best[0], best[1], best[2]


def _fit_groups_sym(g, wgt, qmax, zp, lo, hi):
    s0 = np.maximum(np.maximum(-lo, 0) / zp, np.maximum(hi, 0) / (qmax - zp))
    best = None
    for shrink in _SHRINKS:
        s = s0 * (1.0 - shrink)
        cands = [s]
        if shrink:
            inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
            q = np.clip(np.rint(g * inv[:, None]) + zp, 0, qmax) - zp
            num = (wgt * q * g).sum(1)
            den = (wgt * q * q).sum(1)
            cands.append(np.where(den > 0, num / np.where(den > 0, den, 1), s))
        for cs in cands:
            s16 = np.maximum(np.asarray(cs, np.float32), 0).astype(np.float16)
            sf = s16.astype(np.float32)
            inv = np.divide(1.0, sf, out=np.zeros_like(sf), where=sf != 0)
            q = np.clip(np.rint(g * inv[:, None]) + zp, 0, qmax)
            err = (wgt * ((q - zp) * sf[:, None] - g) ** 2).sum(axis=1)
            if best is None:
                best = [q.astype(np.uint8), s16, err]
                continue
            better = err < best[2]
            best[0][better] = q[better].astype(np.uint8)
            best[1] = np.where(better, s16, best[1])
            best[2] = np.where(better, err, best[2])
    with np.errstate(over="ignore"):
        m16 = (-float(zp) * best[1].astype(np.float32)).astype(np.float16)
    return best[0], best[1], m16


def _assemble(kind: str, shape, gs: int, q: np.ndarray, s: np.ndarray, m: np.ndarray):
    packer = pack_int4 if kind == "int4" else pack_int5
    return QuantTensor(kind, tuple(shape), gs, packer(q), s.astype(np.float16),
                       m.astype(np.float16))


def quantize_act(w: np.ndarray, kind: str, gs: int, hdiag: np.ndarray | None,
                 zp: int | str | None = None) -> QuantTensor:
    """Asymmetric INT4/INT5 with each group's range chosen by the activation-weighted error.
    ``zp``: a zero point (minimums not stored) or :data:`CODED` (the ``int4_c8`` encoding)."""
    if zp == CODED:
        _, s, m = _fit_rows(w, 32, hdiag, _QMAX["int4"])
        sc, mc, rd = code_steps(s, m)
        s, m = coded_steps(sc, mc, rd)
        return _coded_tensor(w.shape, _round_fixed(w, s, m), sc, mc, rd)
    return _assemble(kind, w.shape, gs, *_fit_rows(w, gs, hdiag, _QMAX[kind], zp))


def _fit_rows(w: np.ndarray, gs: int, hdiag: np.ndarray | None, qmax: int,
              zp: int | None = None):
    """:func:`fit_groups` over every group of ``w`` a few rows at a time: ``(q uint8 [rows,
    cols], scales, minimums float16 [rows, cols / gs])``."""
    rows, cols = w.shape
    ng = cols // gs
    imp = (np.ones(cols, np.float32) if hdiag is None
           else np.maximum(hdiag.astype(np.float32), 0)).reshape(ng, gs)
    q_all = np.empty((rows, cols), np.uint8)
    s_all = np.empty((rows, ng), np.float16)
    m_all = np.empty((rows, ng), np.float16)
    step = max(1, (1 << 20) // cols)
    for r0 in range(0, rows, step):
        blk = w[r0:r0 + step].astype(np.float32)
        n = blk.shape[0]
        g = blk.reshape(n * ng, gs)
        wi = np.broadcast_to(imp[None], (n, ng, gs)).reshape(n * ng, gs)
        q, s, m = fit_groups(g, wi, qmax, zp)
        q_all[r0:r0 + n] = q.reshape(n, cols)
        s_all[r0:r0 + n] = s.reshape(n, ng)
        m_all[r0:r0 + n] = m.reshape(n, ng)
    return q_all, s_all, m_all


CODED = "c8"  # the layout key of INT4 group 32 with coded scales (quant's "int4_c8")


def _round_fixed(w: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Nearest INT4 codes (uint8 [rows, cols]) of ``w`` on fixed group-32 steps."""
    rows, cols = w.shape
    q = np.empty((rows, cols), np.uint8)
    step = max(1, (1 << 20) // cols)  # rows at a time: bounds the float temporaries
    for r0 in range(0, rows, step):
        s = np.repeat(scales[r0:r0 + step].astype(np.float32), 32, axis=1)
        m = np.repeat(mins[r0:r0 + step].astype(np.float32), 32, axis=1)
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
        q[r0:r0 + step] = np.clip(np.rint((np.asarray(w[r0:r0 + step], np.float32) - m) * inv),
                                  0, 15)
    return q


def _coded_tensor(shape, q: np.ndarray, sc, mc, rd) -> EncodedQuantTensor:
    return EncodedQuantTensor("int4_c8", tuple(shape), {"": pack_int4(q), ".sc": sc,
                                                        ".mc": mc, ".rd": rd})


def _gptq_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(upper Cholesky factor of the damped H^-1, mask of dead input columns)."""
    h = np.array(h, dtype=np.float64, copy=True)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    h[np.diag_indices_from(h)] += damp * mean
    for extra in (0.0, 0.1, 1.0, 10.0):
        try:
            if extra:
                h[np.diag_indices_from(h)] += extra * mean
            lo = np.linalg.cholesky(h)
            hinv = np.linalg.inv(lo).T @ np.linalg.inv(lo)  # H^-1 = L^-T L^-1
            return np.linalg.cholesky(hinv).T, dead
        except np.linalg.LinAlgError:
            continue
    raise PocketError("calibration statistics are degenerate (the input covariance has no "
                      "Cholesky factor even with damping)")


def quantize_gptq(w: np.ndarray, kind: str, gs: int, h: np.ndarray, *, damp: float = DAMP,
                  block: int = GPTQ_BLOCK, row_chunk: int = 8192,
                  zp: int | None = None) -> QuantTensor:
    """GPTQ (module docstring) into an asymmetric INT4/INT5 layout of group size ``gs``.
    ``zp``: a zero point, or :data:`CODED`: INT4 group 32 in two passes, the first with
    float16 steps chosen group by group, whose steps are then coded (a row's codes depend on
    all its groups) and fixed while the second rounds the values with error compensation."""
    rows, cols = w.shape
    qmax = _QMAX[kind]
    codes = fixed = None
    if zp == CODED:
        # steps fitted to the float weights instead cost 5-10 % more output error: GPTQ's
        # updates move the later groups' ranges away from them
        free = quantize_gptq(w, "int4", 32, h, damp=damp, block=block, row_chunk=row_chunk)
        codes = code_steps(free.scales, free.mins)
        fixed = coded_steps(*codes)
        zp = None
    u, dead = _gptq_factor(h, damp)
    u = u.astype(np.float32)
    hdiag = np.maximum(np.diag(h).astype(np.float32), 0)
    ng = cols // gs
    block = max(gs, block // gs * gs)
    q_all = np.empty((rows, cols), np.uint8)
    s_all = np.empty((rows, ng), np.float16)
    m_all = np.empty((rows, ng), np.float16)
    for r0 in range(0, rows, row_chunk):
        W = np.array(w[r0:r0 + row_chunk], dtype=np.float32, copy=True)
        W[:, dead] = 0.0
        n = W.shape[0]
        for i1 in range(0, cols, block):
            i2 = min(i1 + block, cols)
            W1 = W[:, i1:i2].copy()
            E1 = np.zeros_like(W1)
            U1 = u[i1:i2, i1:i2]
            s = mn = None
            for i in range(i2 - i1):
                c = i1 + i
                if c % gs == 0:
                    gi = c // gs
                    if fixed is not None:
                        s16, m16 = fixed[0][r0:r0 + n, gi], fixed[1][r0:r0 + n, gi]
                    else:
                        _, s16, m16 = fit_groups(W1[:, i:i + gs], hdiag[c:c + gs][None, :],
                                                 qmax, zp)
                    s_all[r0:r0 + n, gi] = s16
                    m_all[r0:r0 + n, gi] = m16
                    s = s16.astype(np.float32)
                    mn = m16.astype(np.float32)
                    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
                col = W1[:, i]
                q = np.clip(np.rint((col - mn) * inv), 0, qmax)
                q_all[r0:r0 + n, c] = q.astype(np.uint8)
                err = (col - (q * s + mn)) / U1[i, i]
                W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
                E1[:, i] = err
            if i2 < cols:
                W[:, i2:] -= E1 @ u[i1:i2, i2:]
    if codes is not None:
        return _coded_tensor(w.shape, q_all, *codes)
    return _assemble(kind, w.shape, gs, q_all, s_all, m_all)


def quantize_calibrated(w: np.ndarray, kind: str, gs: int, h: np.ndarray | None,
                        method: str = DEFAULT_METHOD, zp: int | None = None) -> QuantTensor:
    """``w`` (float32 [rows, cols]) in ``kind`` / ``gs`` by ``method`` (``h``: the second
    moment of its input; unused by ``"rtn"`` and by INT8, which is symmetric absmax)."""
    check_quantizable(w.shape, gs)
    if method not in METHODS:
        raise UnsupportedError(f"quantization method {method!r} is not supported; choose one "
                               f"of {', '.join(METHODS)}")
    if kind == "int8":
        return quantize_int8(w, gs)
    if h is None or method == "rtn":
        if zp is not None or method != "rtn":
            return quantize_act(w, kind, gs, None, zp)
        return quantize(w, 4 if kind == "int4" else 5, gs)
    if method == "act":
        return quantize_act(w, kind, gs, np.diag(h), zp)
    return quantize_gptq(w, kind, gs, h, zp=zp)




# -- the bit budget ----------------------------------------------------------------------------
# Layouts a tensor may be stored in: (kind, group size). Bits per weight with the float16
# scale (and minimum for INT4/INT5): 4.25, 4.5, 5.0, 5.5, 6.0, 8.25, 8.5.
# (kind, group size, zero point or None); bits per weight 4.25, 4.5, 4.5 (no minimums), 5.0,
# 5.5, 5.5 (no minimums), 6.0, 8.25, 8.5
# ("int4", 32, CODED): group 32 with 8-bit coded scales and minimums (quant's "int4_c8"),
# 4.5 bits + 32 / columns; not for an untied embedding, which is read in place, not decoded.
LAYOUTS = (("int4", 128, None), ("int4", 64, None), ("int4", 32, 8), ("int4", 32, CODED),
           ("int4", 32, None), ("int5", 64, None), ("int5", 32, 16), ("int5", 32, None),
           ("int8", 64, None), ("int8", 32, None))
PLAIN_LAYOUTS = tuple(x for x in LAYOUTS if x[2] != CODED)
MIN_BITS = 4.25  # INT4 with group 128 everywhere
MAX_BITS = 8.0


def layout_bytes(kind: str, gs: int, shape, zp: int | None = None) -> int:
    rows, cols = shape
    if zp == CODED:
        return rows * (cols // 2 + 2 * (cols // 32) + 4)
    per = {"int4": cols // 2, "int5": cols // 32 * 20, "int8": cols}[kind]
    meta = (cols // gs) * 2 * (1 if kind == "int8" or zp is not None else 2)
    return rows * (per + meta)


# bits per weight of GGUF block types (scales included), for the "source" budget
GGUF_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 4.5, "Q5_0": 5.5, "Q5_1": 6.0, "Q5_K": 5.5,
             "Q6_K": 6.5625, "Q8_0": 8.5, "Q3_K": 3.4375, "Q2_K": 2.625, "IQ4_NL": 4.5,
             "IQ4_XS": 4.25}


def check_bits_per_weight(b) -> float | str:
    """A budget in bits per weight (MIN_BITS..MAX_BITS), or ``"source"``: the bytes the
    source holds its quantized tensors in (a GGUF's own types; float tensors count as INT8,
    8.5)."""
    if b == "source":
        return b
    if isinstance(b, str):
        try:
            b = float(b)
        except ValueError:
            raise UnsupportedError(f"--bits-per-weight must be a number or 'source', got "
                                   f"{b!r}") from None
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not np.isfinite(b):
        raise UnsupportedError(f"--bits-per-weight must be a number, got {b!r}")
    if b < MIN_BITS or b > MAX_BITS:
        raise UnsupportedError(f"--bits-per-weight {b:g} is out of range: INT4 everywhere "
                               f"(group 128) needs at least {MIN_BITS}, and above {MAX_BITS:g} "
                               f"there is nothing to choose (INT8 is the widest layout)")
    return float(b)


@dataclass
class Candidate:
    kind: str
    group_size: int
    nbytes: int
    error: float  # estimated relative output error E / tr(W H W^T), times its class weight
    lossless: bool = False
    zero_point: int | None = None


PROBE_LAYOUT = ("int4", 64, None)
PROBE_SEQUENCES = 8  # the layout whose end-to-end effect weighs each class of tensor


def tensor_class(name: str) -> str:
    """The class a tensor's sensitivity is measured for: its role, over all layers."""
    if name in ("embed.weight", "lm_head.weight"):
        return name.split(".")[0]
    return name.split(".", 2)[-1].rsplit(".", 1)[0]  # layers.3.attn.w_q.weight -> attn.w_q


def _diag_error(w: np.ndarray, qt: QuantTensor, hdiag: np.ndarray | None,
                rows: int = 16384) -> float:
    """Sum over columns of hdiag_c * ||column c of (W~ - W)||^2 (hdiag None: plain)."""
    total = 0.0
    for r0 in range(0, w.shape[0], rows):
        d = qt.dequantize(slice(r0, r0 + rows)) - w[r0:r0 + rows]
        col = np.einsum("ij,ij->j", d, d, dtype=np.float64)
        total += float(col @ hdiag) if hdiag is not None else float(col.sum())
    return total


def source_stored_bytes(st) -> dict[tuple, int]:
    """Bytes of the layouts that source tensor ``st`` can be stored in as its own blocks
    (:func:`pocketlm.quant.encode_as_source`: a GGUF Q4_K imported exactly, a Q6_K in INT8)."""
    if st.raw is None or len(st.shape) != 2 or st.shape[1] % QK_K:
        return {}
    blocks = st.shape[0] * st.shape[1] // QK_K
    if st.dtype == "Q4_K":
        return {("int4", 32, None): blocks * Q4K_BLOCK_BYTES}
    if st.dtype == "Q6_K":
        return {("int8", 32, None): blocks * Q6K_BLOCK_BYTES}
    return {}


def candidates(w: np.ndarray, hdiag: np.ndarray | None, lossless: QuantTensor | None,
               layouts=LAYOUTS, probe: dict | None = None, name: str = "",
               stored: dict[tuple, int] | None = None) -> list[Candidate]:
    """Every layout ``w`` fits, with its bytes and estimated relative output error (from the
    activation-weighted range search: fast, and in proportion to what GPTQ reaches), plus the
    source's own grid when it imports exactly (error 0). ``stored``: the bytes of the layouts
    the source's own blocks hold in fewer bytes (:func:`source_stored_bytes`)."""
    stored = stored or {}
    col = np.einsum("ij,ij->j", w, w, dtype=np.float64)
    energy = float(col @ hdiag) if hdiag is not None else float(col.sum())
    energy = energy if energy > 0 else 1.0
    out = []
    if lossless is not None:
        zp = find_zero_point(lossless)
        nbytes = stored.get((lossless.kind, lossless.group_size, zp),
                            layout_bytes(lossless.kind, lossless.group_size, lossless.shape, zp))
        out.append(Candidate(lossless.kind, lossless.group_size, nbytes, 0.0, True, zp))
    for kind, gs, zp in layouts:
        if w.shape[1] % gs:
            continue
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                if kind == "int8":
                    qt = quantize_int8(w, gs)
                else:
                    qt = quantize_act(w, kind, gs, hdiag, zp)
        except UnsupportedError:  # steps beyond float16 (int4_c8's row steps): not a candidate
            continue
        if not all(np.isfinite(a).all() for a in (qt.scales, qt.mins) if a is not None):
            continue  # weights beyond float16's range for this layout's steps: another may hold
        out.append(Candidate(kind, gs, stored.get((kind, gs, zp),
                                                  layout_bytes(kind, gs, w.shape, zp)),
                             _diag_error(w, qt, hdiag) / energy, False, zp))
        if probe is not None and (kind, gs, zp) == PROBE_LAYOUT:
            probe[name] = qt
    if not out:
        raise UnsupportedError(f"{name}: its weights exceed what every layout's float16 steps "
                               "can hold (65504); nothing was written")
    return out


def class_weights(config, weights: dict, probe: dict[str, QuantTensor],
                  cands: dict[str, list[Candidate]], sequences: list[list[int]],
                  tokenizer=None) -> dict[str, float]:
    """Measured sensitivity of each class of tensor: the mean KL divergence of the next-token
    distributions from the float model's when every tensor of the class (alone) is stored in
    :data:`PROBE_LAYOUT`, divided by the sum of their estimated errors in that layout. (The
    estimated errors of different classes are in different units: a relative error of the
    output head moves the logits directly, one of a query projection only through the layers
    above it.)"""
    from .runtime.model import Runtime

    def logp(w):
        rt = Runtime(config, w)
        out = []
        for seq in sequences:
            lg = rt.forward(np.asarray(seq), rt.new_cache(len(seq)), all_logits=True)
            lg = lg.astype(np.float64)
            lg -= lg.max(-1, keepdims=True)
            out.append(lg - np.log(np.exp(lg).sum(-1, keepdims=True)))
        return out

    ref = logp(weights)
    classes: dict[str, list[str]] = {}
    for n in probe:
        classes.setdefault(tensor_class(n), []).append(n)
    out = {}
    for cls, names in classes.items():
        w = dict(weights)
        for n in names:
            w[n] = probe[n]
        if config.tie_embeddings and "embed.weight" in names:
            pass  # the tied head is the same tensor
        lp = logp(w)
        kl = float(np.mean([(np.exp(r) * (r - q)).sum(-1).mean() for r, q in zip(ref, lp)]))
        est = sum(next(c.error for c in cands[n]
                       if (c.kind, c.group_size, c.zero_point) == PROBE_LAYOUT
                       and not c.lossless) for n in names)
        out[cls] = max(kl, 1e-12) / max(est, 1e-30)
    return out


def _hull(cs: list[Candidate]) -> list[Candidate]:
    """The candidates on the lower convex hull of error against bytes, by bytes."""
    cs = sorted(cs, key=lambda c: (c.nbytes, c.error))
    hull: list[Candidate] = []
    for c in cs:
        if hull and c.error >= hull[-1].error:
            continue  # more bytes, no less error
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is not on the lower hull if a -> c is at least as steep as a -> b
            if (a.error - c.error) * (b.nbytes - a.nbytes) >= \
                    (a.error - b.error) * (c.nbytes - a.nbytes):
                hull.pop()
            else:
                break
        hull.append(c)
    return hull


def _greedy(hulls: dict[str, list[Candidate]], budget: float) -> dict[str, int] | None:
    import heapq

    pos = {name: 0 for name in hulls}
    used = sum(h[0].nbytes for h in hulls.values())
    if used > budget:
        return None
    order = {name: i for i, name in enumerate(hulls)}
    heap = []

    def push(name):
        h, i = hulls[name], pos[name]
        if i + 1 < len(h):
            gain = (h[i].error - h[i + 1].error) / max(h[i + 1].nbytes - h[i].nbytes, 1)
            heapq.heappush(heap, (-gain, order[name], name))

    for name in hulls:
        push(name)
    while heap:
        _, _, name = heapq.heappop(heap)
        h, i = hulls[name], pos[name]
        extra = h[i + 1].nbytes - h[i].nbytes
        if used + extra > budget:
            continue  # does not fit; a cheaper upgrade elsewhere still may
        used += extra
        pos[name] = i + 1
        push(name)
    return pos


def allocate(cands: dict[str, list[Candidate]], budget_bytes: float,
             weights: int | None = None) -> dict[str, Candidate]:
    """One candidate per tensor, total bytes <= ``budget_bytes``, least total estimated error
    (``weights``: how many weights the tensors hold, for a refusal in bits per weight).

    Greedy marginal analysis: from each tensor's smallest candidate, repeatedly take the
    upgrade (along the lower convex hull of error against bytes) that removes the most error
    per added byte, while it fits. The few tensors too large for that to be near optimal
    (those whose smallest layout is over a tenth of the budget: the embedding and the output
    head) have every point of their hulls tried, the greedy filling the rest each time, and the
    least total error wins. Ties go to the order of ``cands``."""
    import itertools

    hulls = {name: _hull(cs) for name, cs in cands.items()}
    smallest = sum(h[0].nbytes for h in hulls.values())
    if smallest > budget_bytes:
        def say(nbytes: float) -> str:
            bits = f"{8.0 * nbytes / weights:.2f} bits per weight, " if weights else ""
            return f"{bits}{nbytes / 1e6:.1f} MB"
        raise UnsupportedError(f"the bit budget ({say(budget_bytes)}) is below what the "
                               f"smallest layouts reach ({say(smallest)})")
    big = [n for n, h in hulls.items() if h[0].nbytes > budget_bytes / 10][:3]
    rest = {n: h for n, h in hulls.items() if n not in big}
    best = None
    for combo in itertools.product(*(range(len(hulls[n])) for n in big)):
        fixed = {n: hulls[n][i] for n, i in zip(big, combo)}
        left = budget_bytes - sum(c.nbytes for c in fixed.values())
        pos = _greedy(rest, left)
        if pos is None:
            continue
        pick = dict(fixed, **{n: rest[n][i] for n, i in pos.items()})
        total = sum(c.error for c in pick.values())
        if best is None or total < best[0]:
            best = (total, pick)
    return {name: best[1][name] for name in cands}


def source_budget(model, names: list[str]) -> float:
    """Bytes for the quantized tensors so that the deploy file is no larger than the source:
    a GGUF's file size less what the deploy file holds besides them (float tensors, the
    tokenizer, a header allowance); else the source types' bits (float types as INT8)."""
    by_types = sum(int(np.prod(model.tensors[n].shape)) *
                   GGUF_BITS.get(model.tensors[n].dtype, 8.5) / 8.0 for n in names)
    size = model.provenance.get("source_size")
    if model.provenance.get("source_format") != "gguf" or not isinstance(size, int):
        return by_types
    quantized = set(names)
    floats = sum(4 * int(np.prod(t.shape)) for n, t in model.tensors.items()
                 if n not in quantized)
    from .formats.pocketfile import compress_tokenizer

    overhead = floats + compress_tokenizer(model.tokenizer.to_json()).nbytes + HEADER_ALLOWANCE
    return float(size - overhead)


HEADER_ALLOWANCE = 256 * 1024  # the deploy file's JSON header and alignment padding


def budget_bytes(model, names: list[str], bits_per_weight) -> tuple[float, int]:
    """The bytes a budget allows the quantized tensors ``names``, and how many weights they
    hold."""
    count = sum(int(np.prod(model.tensors[n].shape)) for n in names)
    budget = (source_budget(model, names) if bits_per_weight == "source"
              else bits_per_weight / 8.0 * count)
    return budget, count


def check_budget_reachable(model, names: list[str], bits_per_weight) -> None:
    """Refuse, from the tensors' shapes alone, a budget below the smallest layouts of
    ``names`` (no exact import is smaller than those: none holds fewer than 4 bits a weight),
    naming the flag and the source: :func:`allocate` found it only after the statistics."""
    tied = model.config.tie_embeddings
    smallest = 0
    for n in names:
        st = model.tensors[n]
        shape = tuple(st.shape)
        sizes = [layout_bytes(kind, gs, shape, zp)
                 for kind, gs, zp in (LAYOUTS if may_encode(n, tied) else PLAIN_LAYOUTS)
                 if shape[1] % gs == 0]
        sizes += source_stored_bytes(st).values() if may_encode(n, tied) else []
        smallest += min(sizes) if sizes else 0
    budget, count = budget_bytes(model, names, bits_per_weight)
    if smallest > budget:
        src = model.provenance.get("source_file") or "the source"
        asked = ("source (the source's own size)" if bits_per_weight == "source"
                 else f"{bits_per_weight:g}")
        room = max(budget, 0)  # none left: the header and float tensors take it all
        raise UnsupportedError(
            f"--bits-per-weight {asked}: {src} cannot be packed that small: its smallest "
            f"layouts take {8.0 * smallest / max(count, 1):.2f} bits per weight "
            f"({smallest / 1e6:.1f} MB), the budget {8.0 * room / max(count, 1):.2f} "
            f"({room / 1e6:.1f} MB" + ("; the file's header and float tensors take the rest)"
                                      if budget <= 0 else ")"))


def head_agreement(config, weights: dict, head: QuantTensor, tokenizer,
                   tokens: int = 256, patch: tuple[QuantTensor, np.ndarray] | None = None
                   ) -> dict[str, float]:
    """Top-1 agreement of the quantized output head with the float head, on the final hidden
    states of the float model over held-out English and Chinese text (never calibrated on):
    ``{"en": fraction, "zh": fraction}``. ``patch``: the head patch (INT8 rows, their ids),
    whose rows replace the head's (pocketlm.head_patch)."""
    from . import calibdata
    from .head_patch import PatchedHead

    name = "lm_head.weight" if "lm_head.weight" in weights else "embed.weight"
    w = weights[name]
    quantized = head if patch is None else PatchedHead(head, *patch)  # as the runtime takes it
    out = {}
    for lang, kind in (("en", "en"), ("zh", "zh")):
        ids = tokenizer.encode(calibdata.heldout_text(kind, 8 * tokens), add_bos=False,
                               special=False)[:tokens]
        x = final_states(config, weights, [ids])
        best_f = np.full(len(ids), -np.inf, np.float32)
        best_q = np.full(len(ids), -np.inf, np.float32)
        arg_f = np.zeros(len(ids), np.int64)
        arg_q = np.zeros(len(ids), np.int64)
        for r0 in range(0, w.shape[0], 16384):
            sel = slice(r0, r0 + 16384)
            rows = quantized.dequantize(sel) if patch is None else quantized[sel]
            for lg, best, arg in ((x @ w[sel].T, best_f, arg_f),
                                  (x @ rows.T, best_q, arg_q)):
                m = lg.max(axis=1)
                better = m > best
                arg[better] = r0 + lg.argmax(axis=1)[better]
                best[better] = m[better]
        out[lang] = round(float((arg_f == arg_q).mean()), 4)
    return out


# -- the head patch ----------------------------------------------------------------------------
# An INT4 head's most used rows also kept in INT8 (pocketlm.head_patch): the sizes tried, the
# smallest first; the top-1 agreement with the float head on the calibration set's final
# states that the smallest patch must reach (else the largest is taken); how many of the
# float head's best rows each state counts (benchmarks/head_patch.py: "predictions")
PATCH_ROWS = (1024, 2048, 4096, 8192, 16384)
PATCH_TARGET = 0.995
PATCH_TOP = 5
PATCH_HOLDOUT = 4  # one calibration sequence in 4 is held back to choose the size on


def check_head_patch_option(value) -> str | int:
    """``--head-patch``: ``"off"`` (None too, the default: 0, no patch), ``"auto"`` (the size
    rule above) or a number of rows (that many, or a refusal where the budget cannot hold
    them; 0 is off). Off by default: at a fixed budget the patch's bytes come from the other tensors,
    and on smollm2-135m at 4.6 bits that cost more than the head gained (docs/quantization.md)."""
    if value is None or value == "off":
        return 0
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise UnsupportedError(f"--head-patch must be 'auto', 'off' or a number of rows, "
                                   f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise UnsupportedError(f"--head-patch must be 'auto', 'off' or a number of rows "
                               f"(0 is off), got {value!r}")
    return int(value)


def final_states(config, weights: dict, sequences: list[list[int]]) -> np.ndarray:
    """The float model's head input (after the final norm) at every position of every
    sequence: float32 ``[tokens, d_model]``."""
    from .runtime.engine import KVCache, NumpyEngine

    eng = NumpyEngine(config, weights, logits=False)
    out = []
    for seq in sequences:
        seen: dict[str, np.ndarray] = {}
        eng.observe = seen.__setitem__  # keeps the last input of each site
        eng.forward(np.asarray(seq, np.int64), KVCache(config, len(seq)), True)
        out.append(seen["head_in"])
    return np.concatenate(out)


def patch_ranking(w: np.ndarray, xs: np.ndarray, sequences: list[list[int]],
                  chunk: int = 128) -> np.ndarray:
    """The head's rows, most used first: each token's occurrences in ``sequences`` (as a
    next token) plus how many of the states ``xs`` the float head ``w`` ranks it among its
    PATCH_TOP best; ties in id order."""
    counts = np.zeros(w.shape[0], np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(seq[1:], np.int64), 1)
    top = min(PATCH_TOP, w.shape[0] - 1)
    for r0 in range(0, len(xs), chunk):
        lg = xs[r0:r0 + chunk] @ w.T
        np.add.at(counts, np.argpartition(-lg, top, axis=1)[:, :top].ravel(), 1)
    return np.argsort(-counts, kind="stable")


def choose_patch(w: np.ndarray, head: QuantTensor, xs: np.ndarray, order: np.ndarray,
                 sizes: tuple[int, ...], target: float = PATCH_TARGET, chunk: int = 128
                 ) -> tuple[int, dict[int, float]]:
    """The smallest size K of ``sizes`` whose patch (rows ``order[:K]`` of the float head
    ``w`` in INT8 group 32 over the quantized ``head``) brings the top-1 agreement with the
    float head on the states ``xs`` to ``target``, else the largest; and the agreement of
    each size tried."""
    kmax = max(sizes)
    rows = order[:kmax]
    w8 = quantize_int8(np.asarray(w[rows], np.float32), PATCH_GROUP).dequantize()
    wq = head.dequantize()
    hits = dict.fromkeys(sizes, 0)
    for r0 in range(0, len(xs), chunk):
        x = xs[r0:r0 + chunk]
        ref = (x @ w.T).argmax(axis=1)
        lq = x @ wq.T
        l8 = x @ w8.T
        for k in sizes:
            lg = lq.copy()
            lg[:, rows[:k]] = l8[:, :k]
            hits[k] += int((lg.argmax(axis=1) == ref).sum())
    agree = {k: round(hits[k] / max(len(xs), 1), 4) for k in sizes}
    pick = next((k for k in sorted(sizes) if agree[k] >= target), kmax)
    return pick, agree


def patch_bytes(k: int, d_model: int) -> int:
    """Bytes of a head patch of k rows: INT8 group 32 values and scales, int32 ids."""
    return layout_bytes("int8", PATCH_GROUP, (k, d_model)) + 4 * k


def _plan_patch(model, weights: dict, head_name: str, head: QuantTensor, cset, cands: dict,
                picked: dict, budget: float, count: int, progress: bool,
                rows: int | None = None) -> dict | None:
    """The head patch of an INT4 ``head`` under a bit budget: its rows ranked and its size
    chosen on the calibration set (:func:`patch_ranking`, :func:`choose_patch`), its bytes
    reserved and the other tensors allocated again in the rest with the head's layout kept.
    Returns its record (``rows``, ``bytes``, the agreement of each size tried on a held-back
    quarter of the calibration set, ``ids``: int32, increasing, and ``picked``: the new
    allocation), or None when no size is below the vocabulary or none fits the budget.
    ``rows``: that size only (``--head-patch N``), measured the same way."""
    vocab, d = model.config.vocab_size, model.config.d_model
    sizes = (rows,) if rows else tuple(k for k in PATCH_ROWS if k < vocab)
    if not sizes:
        return None
    bar = progress_bar(4, "sizing the head patch", "step", enabled=progress)
    w = np.asarray(weights[head_name], np.float32)
    # the size is chosen on a held-back quarter of the sequences, for rows ranked on the rest:
    # measured on the states its rows were ranked on, a patch looks better than it is
    # (smollm2-135m: 99.6 % there, 98.0 % on held-out text); the rows kept are then ranked on
    # every sequence
    seqs = cset.sequences
    held = [s for i, s in enumerate(seqs) if i % PATCH_HOLDOUT == PATCH_HOLDOUT - 1]
    fit = [s for i, s in enumerate(seqs) if i % PATCH_HOLDOUT != PATCH_HOLDOUT - 1]
    if not held or not fit:  # too few sequences to hold any back
        held = fit = seqs
    xs_fit = final_states(model.config, weights, fit)
    xs_held = final_states(model.config, weights, held) if held is not fit else xs_fit
    bar.update(1)
    k, agree = choose_patch(w, head, xs_held, patch_ranking(w, xs_fit, fit), sizes)
    bar.update(1)
    xs = np.concatenate([xs_fit, xs_held]) if held is not fit else xs_fit
    order = patch_ranking(w, xs, fit + held if held is not fit else seqs)
    bar.update(2)
    bar.close()
    pinned = dict(cands)
    pinned[head_name] = [picked[head_name]]
    for k_try in [s for s in sorted(sizes, reverse=True) if s <= k]:  # the chosen, else less
        try:
            again = allocate(pinned, budget - patch_bytes(k_try, d), count)
        except UnsupportedError:
            continue
        ids = np.sort(order[:k_try]).astype(np.int32)
        return {"rows": k_try, "bytes": patch_bytes(k_try, d),
                "top1_calibration": agree[k_try],
                "top1_calibration_by_rows": {str(s): a for s, a in agree.items()},
                "ids": ids, "picked": again}
    return None


# -- the pack plan -----------------------------------------------------------------------------
_KINDS = {4: "int4", 5: "int5", 8: "int8"}


def _lossless(st) -> QuantTensor | None:
    """The source tensor in a pocketlm layout without requantizing, if its grid allows."""
    for bits in (4, 5, 8):
        qt = st.to_quant(bits, 32)
        if qt is not None:
            return qt
    return None


def _exact_bytes(st, qt: QuantTensor, encodable: bool) -> int:
    """Bytes of the source tensor ``st`` imported exactly as ``qt``, as the pack stores it:
    without minimums where they are implicit, in the source's own blocks where those are
    smaller (what :func:`candidates` counts)."""
    zp = find_zero_point(qt)
    stored = source_stored_bytes(st) if encodable else {}
    return stored.get((qt.kind, qt.group_size, zp),
                      layout_bytes(qt.kind, qt.group_size, qt.shape, zp))


def _weight_error(w: np.ndarray, qt: QuantTensor, rows: int = 8192) -> float:
    """``||W~ - W|| / ||W||``, a few rows at a time."""
    num = den = 0.0
    for r0 in range(0, w.shape[0], rows):
        a = np.asarray(w[r0:r0 + rows], np.float64)
        num += float(((qt.dequantize(slice(r0, r0 + rows)) - a) ** 2).sum())
        den += float((a * a).sum())
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


class _naming:
    """Prefixes a refusal raised while quantizing a tensor with the tensor's name."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, UnsupportedError) and not str(exc).startswith(self.name):
            raise UnsupportedError(f"{self.name}: {exc}") from None
        return False


def plan(model, *, calib, method: str = DEFAULT_METHOD, bits_per_weight: float | None = None,
         default_bits, group_size: int = 32, progress: bool = True,
         stats: Stats | None = None, awq: bool = False, head_patch: str | int = 0):
    """Calibrate ``model`` (a SourceModel) and quantize its tensors.

    ``default_bits(name, source_tensor)``: the pack's bits for a tensor (None: kept in float).
    Without ``bits_per_weight`` each tensor keeps those bits and the pack's group size (a
    source grid that imports exactly stays exact) and every requantized INT4 / INT5 tensor is
    made by ``method``; with it, each tensor's layout is chosen by :func:`allocate`. Returns
    ``({name: (QuantTensor, how, relative output error or None, relative weight error
    against the scaled matrix for a tensor channel scaling changed, else None)}, calibration
    record, {name: float32 array}``: the float tensors that channel scaling changed).

    ``awq``: activation-aware channel scaling (:mod:`pocketlm.awq`) before rounding, on the
    sites whose tensors are all requantized (a tensor that imports exactly keeps its grid, and
    one stored in its source's own blocks keeps them: without a budget, one that the pack
    keeps exact or in those blocks; with one, one whose exact layout or blocks fit the
    budget's bits per weight).

    ``head_patch`` (:func:`check_head_patch_option`): under a budget that rounds the head to
    INT4, 0 (the default) keeps no patch, ``"auto"`` sizes one by the held-back agreement, and
    a number of rows asks for that size (refused where the budget cannot hold it, or where the
    head is not requantized INT4)."""
    import time

    from . import calibdata

    t0 = time.time()
    # only the string names the built-in set: a file called "default" (pack passes files as
    # paths, and str(Path("./default")) is "default") is the app's own text
    head_patch = check_head_patch_option(head_patch)  # pack() refused it without a budget
    if head_patch not in (0, "auto"):
        if head_patch >= model.config.vocab_size:
            raise UnsupportedError(f"--head-patch {head_patch}: the head has only "
                                   f"{model.config.vocab_size} rows (ask for fewer, or 'auto')")
    names = [n for n, st in model.tensors.items() if default_bits(n, st) is not None]
    if bits_per_weight is not None:  # before minutes of statistics
        check_budget_reachable(model, names, bits_per_weight)
    cset = (calibdata.default_set(model.tokenizer) if isinstance(calib, str) and
            calib == "default" else calibdata.file_set(calib, model.tokenizer))
    weights = {n: st.to_float() for n, st in model.tensors.items()}
    for n, w in weights.items():  # before minutes of statistics that NaN would fill
        check_finite(n, w)
    if stats is None:
        stats = cached_stats(model, cset)
    if stats is None:
        stats = gather(model.config, weights, cset.sequences, progress=progress)
        save_stats(model, cset, stats)
        stats.round_as_stored()  # the first pack sees what later packs read from the cache
    tied = model.config.tie_embeddings
    scales: dict[str, np.ndarray] = {}  # site -> channel scale (awq)

    def hessian(name):
        if name == "embed.weight" and not tied:
            return None  # looked up, never multiplied: its weight error is what counts
        site = site_of(name)
        h = stats.hessian(site)
        return h if site not in scales else h / np.outer(scales[site], scales[site])

    choice: dict[str, tuple] = {}  # name -> (kind, group size, lossless, zero point)
    head_name = "embed.weight" if tied else "lm_head.weight"
    early: dict[str, QuantTensor] = {}  # tensors quantized before the final pass (the head)
    patch_record = None  # the head patch: its rows, ids, agreement (pocketlm.head_patch)
    if bits_per_weight is None:
        for n in names:
            bits = default_bits(n, model.tensors[n])
            exact = model.tensors[n].to_quant(bits, group_size) is not None
            choice[n] = (_KINDS[bits], group_size, exact, None)
    scaled_record = None
    changed: set[str] = set()
    if awq:
        # a tensor that imports exactly, or that the pack stores in its source's own blocks
        # (a Q6_K's INT8 as the Q6_K blocks: 6.5625 bits a weight), is left unscaled: scaled,
        # it would leave its grid, or be stored in 8.5 bits
        if bits_per_weight is None:
            keep = {n for n, c in choice.items() if c[2] or may_encode(n, tied) and (
                c[0], c[1], c[3]) in source_stored_bytes(model.tensors[n])}
            layout = {n: c[:2] + (c[3],) for n, c in choice.items()}
        else:
            bpw = (bits_per_weight if bits_per_weight != "source" else 8.0 * source_budget(
                model, names) / sum(int(np.prod(model.tensors[n].shape)) for n in names))
            keep = set()
            for n in names:
                st = model.tensors[n]
                qt = _lossless(st)
                sizes = [_exact_bytes(st, qt, may_encode(n, tied))] if qt is not None else []
                sizes += source_stored_bytes(st).values() if may_encode(n, tied) else []
                if sizes and 8.0 * min(sizes) / int(np.prod(st.shape)) <= bpw:
                    keep.add(n)
            layout = dict.fromkeys(names, PROBE_LAYOUT)
        from .awq import scale_model

        scaled_record, changed = scale_model(model.config, weights, stats, names, keep, layout,
                                             scales, progress)
    if bits_per_weight is not None:
        bar = progress_bar(len(names), "measuring layouts", "tensor", enabled=progress)
        cands = {}
        probe: dict[str, QuantTensor] = {}
        for n in names:
            h = hessian(n)
            with _naming(n):
                cands[n] = candidates(weights[n], None if h is None else np.diag(h).copy(),
                                      None if n in changed else _lossless(model.tensors[n]),
                                      LAYOUTS if may_encode(n, tied) else PLAIN_LAYOUTS,
                                      probe=probe, name=n, stored=source_stored_bytes(
                                          model.tensors[n])
                                      if n not in changed and may_encode(n, tied) else None)
            bar.update(1)
        bar.close()
        kappa = class_weights(model.config, weights, probe, cands,
                              cset.sequences[:PROBE_SEQUENCES])
        del probe
        # a class none of whose widths group 64 divides (d_model 96, d_ff 160) was not
        # probed: it takes the largest measured weight, or 1 when nothing could be probed
        unprobed = max(kappa.values(), default=1.0)
        for n, cs in cands.items():
            k = kappa.get(tensor_class(n), unprobed)
            for c in cs:
                c.error *= k
        budget, count = budget_bytes(model, names, bits_per_weight)
        picked = allocate(cands, budget, count)
        # an INT4 head (requantized) takes a patch of its most used rows in INT8: its bytes
        # reserved, the head's layout kept, and the other tensors allocated again in the rest
        hc = picked.get(head_name)
        if hc is not None and hc.kind == "int4" and not hc.lossless and head_patch != 0:
            with _naming(head_name):
                early[head_name] = quantize_calibrated(weights[head_name], hc.kind,
                                                       hc.group_size, hessian(head_name),
                                                       method, hc.zero_point)
            forced = None if head_patch == "auto" else head_patch
            patch = _plan_patch(model, weights, head_name, early[head_name], cset, cands,
                                picked, budget, count, progress, rows=forced)
            if patch is not None:
                picked = patch.pop("picked")
                patch_record = patch
            elif forced:
                raise UnsupportedError(
                    f"--head-patch {forced}: {forced} INT8 rows "
                    f"({patch_bytes(forced, model.config.d_model):,} bytes) do not fit "
                    f"the bit budget beside the other tensors at their smallest layouts; "
                    f"raise --bits-per-weight or ask for fewer rows")
        elif isinstance(head_patch, int) and head_patch > 0:
            layout = "not quantized" if hc is None else (
                f"{hc.kind} group {hc.group_size}" + (" (the source's own grid)"
                                                      if hc.lossless else ""))
            raise UnsupportedError(f"--head-patch {head_patch}: the bit budget keeps the "
                                   f"output head {head_name!r} in {layout}; a patch applies "
                                   f"to a requantized INT4 head only (a lower "
                                   f"--bits-per-weight gives one)")
        choice = {n: (c.kind, c.group_size, c.lossless, c.zero_point)
                  for n, c in picked.items()}

    out = {}
    bar = progress_bar(len(names), "quantizing", "tensor", enabled=progress)
    for n in names:
        kind, gs, exact, zp = choice[n]
        w = weights[n]
        h = hessian(n)
        if n in early:  # the head, quantized already to size its patch
            qt = early.pop(n)
            how = "calibrated" if h is not None else "requantized"
        elif exact:
            qt = _lossless(model.tensors[n]) if bits_per_weight is not None else \
                model.tensors[n].to_quant({"int4": 4, "int5": 5, "int8": 8}[kind], gs)
            how = "lossless"
        else:
            with _naming(n):
                qt = quantize_calibrated(w, kind, gs, h, method, zp)
            how = "calibrated" if h is not None and kind != "int8" else "requantized"
        err = None
        if h is not None:
            err = output_error(w, qt, h) / max(output_energy(w, h), 1e-30)
        # a tensor channel scaling changed is judged against the matrix it was rounded from;
        # the pack, which has only the source, measures the others itself
        werr = _weight_error(w, qt) if n in changed else None
        out[n] = (qt, how, err, werr)
        bar.update(1)
    bar.close()
    patch = None
    if patch_record is not None:  # its INT8 rows, ids increasing
        ids = patch_record.pop("ids")
        w8 = quantize_int8(np.asarray(weights[head_name][ids], np.float32), PATCH_GROUP)
        patch = (w8, ids)
        out[PATCH] = (w8, "head patch", None, None)
        out[PATCH_IDS] = (ids, "head patch", None, None)
    record = {"set": cset.record(), "method": method, "bits_per_weight": bits_per_weight,
              "tokens": stats.tokens}
    if head_patch != 0:
        record["head_patch"] = head_patch  # what was asked: "auto" or a number of rows
    if scaled_record is not None:
        record["channel_scaling"] = scaled_record
    if head_name in out:
        qt = out[head_name][0]
        enc = getattr(qt, "encoding", None)
        record["head"] = {"layout": f"{qt.kind} g{qt.group_size}" + (f" {enc}" if enc else "")}
        if patch_record is not None:
            record["head"]["patch"] = patch_record
        try:  # the head as the runtime computes it: with its patch
            record["head"]["top1_vs_float"] = head_agreement(model.config, weights, qt,
                                                             model.tokenizer, patch=patch)
        except FetchError as e:  # --calib FILE offline: the held-out corpora are not here
            record["head"]["not_measured"] = str(e)
    record["seconds"] = round(time.time() - t0, 1)
    floats = {n: weights[n] for n in changed if n not in out}
    return out, record, floats
