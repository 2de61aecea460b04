"""Can an INT4 output head hold 99 % top-1 agreement if its most used rows stay INT8? A numpy
study, before any layout or kernel.

    python benchmarks/head_patch.py -m smollm2-135m -m gemma3-270m -m qwen2.5-0.5b \
        --out benchmarks/head_patch.jsonl

docs/quantization.md's 4.6-bit packs store the output head in INT4 (``int4_c8``, GPTQ on the
calibration set) and measure a top-1 agreement with the float head of 92-94 % where the issue
asks 99 %. A language model's greedy choices on the text an app sends fall on a small part of
its vocabulary, so this script asks what it costs to keep that part exact: the head is rounded
to INT4 as the pack rounds it, then its K most used rows are replaced by their INT8 values (a
"patch": K rows of INT8 group 32 and their ids, computed after the INT4 head and written over
its logits). Which rows are most used is counted on the pack's default calibration set
(never on the held-out text), two ways:

- ``targets``: how often each token occurs in the calibration sequences;
- ``predictions``: that, plus how often the float head ranks it among its top 5 on the
  calibration set's final hidden states (what the head is asked to decide between).

Measured on the float model's final hidden states (numpy reference engine) over --positions
teacher-forced tokens of held-out English and Chinese text (``calibdata.heldout_text``, the
pack report's texts): top-1 agreement with the float head, and the mean negative log-likelihood
of the next token with each head (the float layers' states, so the difference is the head's
own share of a pack's perplexity change). One JSON line per model, ranking and K.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KS = (0, 1024, 2048, 4096, 8192, 16384)


def scores(x: np.ndarray, w: np.ndarray, targets: np.ndarray, rows: int = 16384):
    """(argmax, log-probability of each target) of ``x @ w.T``, a few head rows at a time."""
    n = len(x)
    best = np.full(n, -np.inf, np.float64)
    arg = np.zeros(n, np.int64)
    m = np.full(n, -np.inf, np.float64)  # running log-sum-exp
    s = np.zeros(n, np.float64)
    tgt = np.zeros(n, np.float64)
    for r0 in range(0, w.shape[0], rows):
        lg = (x @ w[r0:r0 + rows].T).astype(np.float64)
        mx = lg.max(axis=1)
        better = mx > best
        arg[better] = r0 + lg.argmax(axis=1)[better]
        best[better] = mx[better]
        m2 = np.maximum(m, mx)
        s = s * np.exp(m - m2) + np.exp(lg - m2[:, None]).sum(axis=1)
        m = m2
        inside = (targets >= r0) & (targets < r0 + lg.shape[1])
        tgt[inside] = lg[np.nonzero(inside)[0], targets[inside] - r0]
    return arg, tgt - (m + np.log(s))


def study(name: str, positions: int, n_calib: int, residual: bool = False) -> list[dict]:
    from pocketlm import calibdata, calibrate, registry
    from pocketlm.calibrate import final_states
    from pocketlm.formats import open_source
    from pocketlm.quant import quantize_int4, quantize_int8

    model = open_source(registry.resolve(name, quiet=True))
    cfg = model.config
    weights = {n: st.to_float() for n, st in model.tensors.items()}
    head = "lm_head.weight" if "lm_head.weight" in weights else "embed.weight"
    w = np.asarray(weights[head], np.float32)
    t0 = time.time()
    cset = calibdata.default_set(model.tokenizer)
    seqs = cset.sequences[:n_calib]
    xs = final_states(cfg, weights, seqs)
    h = (xs.T.astype(np.float64) @ xs.astype(np.float64)) / len(xs)
    counts = {"targets": np.zeros(w.shape[0], np.int64)}
    for s in seqs:
        np.add.at(counts["targets"], np.asarray(s[1:]), 1)
    pred = counts["targets"].copy()
    for r0 in range(0, len(xs), 256):
        lg = xs[r0:r0 + 256] @ w.T
        np.add.at(pred, np.argpartition(-lg, 5, axis=1)[:, :5].ravel(), 1)
    counts["predictions"] = pred
    held = {}
    for lang in ("en", "zh"):
        ids = model.tokenizer.encode(calibdata.heldout_text(lang, 8 * (positions + 1)),
                                     add_bos=False, special=False)[:positions + 1]
        held[lang] = (final_states(cfg, weights, [ids[:-1]]), np.asarray(ids[1:], np.int64))
    ref = {k: scores(x, w, t) for k, (x, t) in held.items()}
    q4 = calibrate.quantize_calibrated(w, "int4", 32, h, "gptq", calibrate.CODED)
    w4 = q4.dequantize(slice(0, w.shape[0]))
    w8 = quantize_int8(w, 32).dequantize(slice(0, w.shape[0]))
    if residual:  # the patch as an INT4 correction added to the INT4 rows' logits
        layouts = {f"int4 residual g{g}": (g, 4 + 32 / g) for g in (32, 64)}
    else:
        layouts = {"int8": (32, 8.5)}
    print(f"{name}: calibration states and heads in {time.time() - t0:.0f} s", file=sys.stderr)
    out = []
    for how, c in counts.items():
        if residual and how == "targets":
            continue
        order = np.argsort(-c, kind="stable")
        for (layout, (g, bits)), k in ((lb, k) for lb in layouts.items() for k in KS):
            if k == 0 and (how != "targets" or residual):
                continue
            wk = w4.copy()
            rows = order[:k]
            if residual:
                wk[rows] += quantize_int4(w[rows] - w4[rows], g).dequantize(slice(0, k))
            else:
                wk[rows] = w8[rows]
            row = {"bench": "head_patch", "model": name, "head": head,
                   "vocab": int(w.shape[0]), "d_model": int(w.shape[1]),
                   "layout": "int4_c8 gptq", "ranking": how if k else None, "patch_rows": k,
                   "rows_counted": int((c > 0).sum()),
                   "added_bits_per_head_weight": round(k * bits / w.shape[0], 3),
                   "calib_sequences": len(seqs), "positions": positions}
            if k:
                row["patch_layout"] = layout
            for lang, (x, t) in held.items():
                arg, lp = scores(x, wk, t)
                row[f"top1_{lang}"] = round(float((arg == ref[lang][0]).mean()), 4)
                row[f"nll_{lang}"] = round(float(-lp.mean()), 4)
                row[f"nll_float_{lang}"] = round(float(-ref[lang][1].mean()), 4)
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", required=True,
                    help="registry model (repeat for several)")
    ap.add_argument("--positions", type=int, default=512, help="held-out tokens of each text")
    ap.add_argument("--calib", type=int, default=128,
                    help="calibration sequences counted (the pack's default set has 128)")
    ap.add_argument("--residual", action="store_true",
                    help="patch rows as an INT4 correction of the INT4 rows (added to their "
                         "logits) instead of INT8 rows written over them")
    ap.add_argument("--out", help="append the JSON lines to this file")
    args = ap.parse_args()
    from pocketlm.bench import machine_info

    for name in args.model:
        for row in study(name, args.positions, args.calib, args.residual):
            row.update(date=time.strftime("%Y-%m-%d"), machine=machine_info(),
                       command=" ".join(["python", *sys.argv]))
            line = json.dumps(row, ensure_ascii=False)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
