"""What activation-aware channel scaling (``pocket pack --awq``) buys, site by site (JSON lines).

    python benchmarks/awq_sites.py -m qwen2.5-0.5b [--layers first,middle,last] \
        >> benchmarks/awq_sites.jsonl

For each chosen layer's four sites (and an untied head's) of a registry model, on the default
calibration set's statistics (gathered on first use, then cached): the scale exponent alpha
that :func:`pocketlm.awq.search` picks for INT4 group 64, and the output error
``tr((W~ - W) H (W~ - W)^T)`` of the site's consumers with that scale relative to without it,
once with the activation-weighted range search that the search itself uses (``act``) and once
with GPTQ rounding (``gptq``), which is what a pack then applies. A ratio below 1 is error
removed; ``d_max_over_median`` is how uneven the input channels are (RMS, largest over median).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pocketlm import awq, calibdata, calibrate  # noqa: E402
from pocketlm.bench import machine_info  # noqa: E402
from pocketlm.formats import open_source  # noqa: E402
from pocketlm.registry import pull  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--layers", default="first,middle,last",
                   help="comma-separated layer indices, or first / middle / last")
    p.add_argument("--group-size", type=int, default=64)
    args = p.parse_args()
    src = open_source(pull(args.model, quiet=True))
    n = src.config.n_layers
    named = {"first": 0, "middle": n // 2, "last": n - 1}
    layers = sorted({named[x] if x in named else int(x) for x in args.layers.split(",")})
    cset = calibdata.default_set(src.tokenizer)
    w = {k: t.to_float() for k, t in src.tensors.items()}
    stats = calibrate.cached_stats(src, cset)
    if stats is None:
        stats = calibrate.gather(src.config, w, cset.sequences)
        calibrate.save_stats(src, cset, stats)
    gs = args.group_size

    def act(m, hdiag):
        return calibrate.quantize_act(m, "int4", gs, hdiag)

    for site in awq.sites(src.config, list(w)):
        if site.name != "head_in" and int(site.name.split(".")[1]) not in layers:
            continue
        t0 = time.time()
        h = stats.hessian(site.name).astype(np.float64)
        d = awq.channel_rms(h, src.config, site.name)
        ws = [w[c] for c in site.consumers]
        alpha, s, e0, e1 = awq.search(ws, [act] * len(ws), h, d, calibrate.output_error)
        g0 = g1 = 0.0
        hs = h / np.outer(s, s)
        for m in ws:
            g0 += calibrate.output_error(m, calibrate.quantize_gptq(m, "int4", gs, h), h)
            ms = m * s[None, :]
            g1 += calibrate.output_error(ms, calibrate.quantize_gptq(ms, "int4", gs, hs), hs)
        print(json.dumps({
            "model": args.model, "site": site.name, "layout": f"int4 g{gs}", "alpha": alpha,
            "act_ratio": round(e1 / e0, 4), "gptq_ratio": round(g1 / g0, 4),
            "d_max_over_median": round(float(d.max() / np.median(d)), 1),
            "seconds": round(time.time() - t0, 1), "machine": machine_info(),
            "command": "python benchmarks/awq_sites.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}), flush=True)


if __name__ == "__main__":
    main()
