"""Activation-aware channel scaling (AWQ: Lin et al., 2023), folded into the model.

A product ``y = W x`` whose input channels differ in size loses most of its rounding error
through the loud channels: ``E = tr((W~ - W) H (W~ - W)^T)`` weighs column ``c``'s error by
``H_cc``, the mean square of channel ``c`` (:mod:`pocketlm.calibrate`). Scaling column ``c`` of
``W`` up by ``s_c`` and its input down by ``s_c`` computes the same product in float, but gives
the loud channels more of each group's grid. The input scale is folded into the operation
that makes the input, so the deploy file holds an ordinary model of the same architecture:

============  =====================================  ==========================================
site          consumers (columns times ``s``)        made by (divided by ``s``)
============  =====================================  ==========================================
``attn_in``   ``attn.w_q``, ``attn.w_k``, ``w_v``    ``attn_norm.weight``
``mlp_in``    ``mlp.w_gate``, ``mlp.w_up``           ``mlp_norm.weight``
``down_in``   ``mlp.w_down``                         the rows of ``mlp.w_up`` (``act(gate) * up``)
``o_in``      ``attn.w_o``                           the rows (and bias) of ``attn.w_v``
``head_in``   ``lm_head`` (untied heads only)        ``norm.weight``
============  =====================================  ==========================================

Every norm here is ``x / rms(x) * weight`` (Gemma's ``1 + weight`` is folded at import), so
dividing its weight divides its output. ``o_in``'s channels are the query heads' outputs, each a
mixture of its key-value head's values: one scale per key-value channel, shared by the query
heads of its group (their second moments averaged). A tied head is left alone: its columns are
the embedding's, which no operation before it can absorb.

The scale of a site is ``s = d^alpha`` with ``d_c = sqrt(H_cc)``, divided by
``sqrt(max(s) * min(s))`` so that it centres on 1; ``alpha`` is searched over :data:`ALPHAS`
(0: no scaling) and the one whose quantized consumers have the least summed output error on the
calibration statistics wins (each consumer quantized by the activation-weighted range search on
at most :data:`SEARCH_ROWS` evenly spaced rows, its error scaled back to all rows). The
statistics transform with the model: the input's second moment becomes ``H / (s s^T)``, which is
what the rounding that follows (GPTQ by default) is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedError

ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
SEARCH_ROWS = 256


@dataclass
class Site:
    """One input shared by ``consumers``, made by ``fold`` (a norm weight, or a matrix whose
    rows make the input's channels)."""

    name: str  # the statistics site, e.g. layers.3.mlp_in
    consumers: tuple[str, ...]
    fold: str
    fold_rows: bool  # the fold is a matrix whose rows are divided (else a norm weight)
    fold_bias: str | None = None


def sites(config, names) -> list[Site]:
    """The sites of a model with tensors ``names`` that a scale can be folded into; raises
    when a layer lacks the norm that the scale of its input would be folded into."""
    names = set(names)
    out = []
    for i in range(config.n_layers):
        p = f"layers.{i}."
        for norm in ("attn_norm.weight", "mlp_norm.weight"):
            if p + norm not in names:
                raise UnsupportedError(f"{p + norm}: missing, so channel scaling (--awq) has "
                                       "nothing to fold its input scale into")
        out.append(Site(p + "attn_in", (p + "attn.w_q.weight", p + "attn.w_k.weight",
                                        p + "attn.w_v.weight"), p + "attn_norm.weight", False))
        out.append(Site(p + "mlp_in", (p + "mlp.w_gate.weight", p + "mlp.w_up.weight"),
                        p + "mlp_norm.weight", False))
        out.append(Site(p + "down_in", (p + "mlp.w_down.weight",), p + "mlp.w_up.weight", True))
        bias = p + "attn.w_v.bias"
        out.append(Site(p + "o_in", (p + "attn.w_o.weight",), p + "attn.w_v.weight", True,
                        bias if bias in names else None))
    if not config.tie_embeddings and "lm_head.weight" in names and "norm.weight" in names:
        out.append(Site("head_in", ("lm_head.weight",), "norm.weight", False))
    return out


def _query_groups(config) -> tuple[int, int, int]:
    """W_o's input channels as ``[key-value head, query head of its group, dim]``."""
    return (config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim)


def _normalised(d: np.ndarray, alpha: float) -> np.ndarray:
    s = np.power(d, alpha)
    return (s / np.sqrt(s.max() * s.min())).astype(np.float32)


def channel_rms(h: np.ndarray, config=None, site: str = "") -> np.ndarray:
    """``sqrt(diag H)`` with silent channels lifted to a small floor (so no scale is 0); for
    ``o_in``, averaged over the query heads that share a key-value head, then repeated so
    that every query head of a group gets its key-value channel's value."""
    msq = np.maximum(np.diag(h).astype(np.float64), 0.0)
    if site.endswith("o_in") and config is not None:
        shape = _query_groups(config)
        per = msq.reshape(shape).mean(axis=1)  # [kv head, dim]
        msq = np.repeat(per[:, None, :], shape[1], axis=1).reshape(-1)
    floor = max(float(msq.mean()) * 1e-6, 1e-12)
    return np.sqrt(np.maximum(msq, floor))


def search(ws: list[np.ndarray], quantizers: list[Callable[[np.ndarray, np.ndarray], object]],
           h: np.ndarray, d: np.ndarray, error: Callable[[np.ndarray, object, np.ndarray], float]
           ) -> tuple[float, np.ndarray, float, float]:
    """``(alpha, s, error at alpha 0, error at alpha)`` over :data:`ALPHAS` for the consumers
    ``ws`` of an input with second moment ``h`` and channel RMS ``d``. ``quantizers[i](w,
    hdiag)`` rounds consumer ``i`` (scaled) in its layout; ``error(w, q, h)`` is the output
    error of the rounded matrix ``q``."""
    subs = []
    for w in ws:
        rows = w.shape[0]
        idx = np.unique(np.linspace(0, rows - 1, min(rows, SEARCH_ROWS)).astype(np.int64))
        subs.append((np.ascontiguousarray(w[idx], dtype=np.float32), rows / len(idx)))
    best = None
    base = None
    for alpha in ALPHAS:
        s = _normalised(d, alpha)
        hs = h / np.outer(s, s)
        hdiag = np.diag(hs).copy()
        total = 0.0
        for (sub, weight), quantize in zip(subs, quantizers, strict=True):
            scaled = sub * s[None, :]
            total += weight * error(scaled, quantize(scaled, hdiag), hs)
        if base is None:
            base = total
        if best is None or total < best[2]:
            best = (alpha, s, total)
    return best[0], best[1], float(base), float(best[2])


def apply(site: Site, s: np.ndarray, weights: dict, config) -> None:
    """Scale ``site``'s consumers' columns by ``s`` and fold ``1 / s`` into what makes its
    input, in ``weights`` (float32 arrays, replaced, not modified in place)."""
    for n in site.consumers:
        weights[n] = (weights[n] * s[None, :]).astype(np.float32)
    inv = (1.0 / s).astype(np.float32)
    if site.name.endswith("o_in"):
        # one scale per key-value channel: the first query head of each group carries it
        inv = inv.reshape(_query_groups(config))[:, 0, :].reshape(-1)
    if site.fold_rows:
        weights[site.fold] = (weights[site.fold] * inv[:, None]).astype(np.float32)
    else:
        weights[site.fold] = (weights[site.fold] * inv).astype(np.float32)
    if site.fold_bias is not None:
        weights[site.fold_bias] = (weights[site.fold_bias] * inv).astype(np.float32)


def scale_model(config, weights: dict, stats, names: list[str], keep: set[str],
                layout: dict[str, tuple], scales: dict[str, np.ndarray],
                progress: bool = True) -> tuple[dict, set[str]]:
    """Channel scaling of every site none of whose tensors is in ``keep`` (``stats``: the
    :class:`pocketlm.calibrate.Stats` of the unscaled model): searches each
    site's scale with its consumers rounded in ``layout[name]`` (kind, group size, zero point),
    applies it to ``weights`` and records it in ``scales``. Returns (a record for the deploy
    file: sites searched and scaled, their mean alpha, the estimated output error removed; the
    names of the tensors changed)."""
    from .calibrate import output_error, progress_bar, quantize_act
    from .quant import quantize_int8

    def quantizer(name):
        kind, gs, zp = layout[name]
        if weights[name].shape[1] % gs:
            gs, zp = 32, None  # a width the probe's group does not divide
        if kind == "int8":
            return lambda w, hdiag: quantize_int8(w, gs)
        return lambda w, hdiag: quantize_act(w, kind, gs, hdiag, zp)

    all_sites = sites(config, list(weights))
    changed: set[str] = set()
    alphas, base, after, skipped = [], 0.0, 0.0, 0
    bar = progress_bar(len(all_sites), "channel scaling", "site", enabled=progress)
    for site in all_sites:
        touched = set(site.consumers) | ({site.fold} if site.fold_rows else set())
        if not set(site.consumers) <= set(names) or touched & keep:
            skipped += 1
        else:
            h = stats.hessian(site.name)
            d = channel_rms(h, config, site.name)
            alpha, s, e0, e1 = search([weights[n] for n in site.consumers],
                                      [quantizer(n) for n in site.consumers], h, d,
                                      output_error)
            base += e0
            after += e1
            alphas.append(alpha)
            if alpha > 0:
                apply(site, s, weights, config)
                scales[site.name] = s
                changed |= touched | {site.fold} | ({site.fold_bias} - {None})
        bar.update(1)
    bar.close()
    record = {"sites": len(all_sites) - skipped, "scaled": len(scales),
              "mean_alpha": round(float(np.mean(alphas)), 3) if alphas else 0.0,
              "error_removed": round(1.0 - after / base, 4) if base > 0 else 0.0}
    return record, changed


__all__ = ["ALPHAS", "SEARCH_ROWS", "Site", "sites", "channel_rms", "search", "apply",
           "scale_model"]
