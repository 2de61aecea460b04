"""AMX-BF16 prefill against the int8 products, same engine, same run (JSON lines).

With POCKET_AMX on, a prefill block's products and (since rows with "amx_attention") its
attention run on the tile unit; off, the int8 products and float32 AVX-512 attention.

For each model: top-1 agreement and mean KL of the engine's logits against the numpy
float-activation reference on 256 tokens of tests/data/english.txt and chinese.txt (one prefill,
all logits), with POCKET_AMX off (int8 products, two digits) and on; then a 512-token prefill
(english.txt repeated), the two settings alternating run by run, 1 warm-up and --runs measured
runs each, median tokens/s and their ratio. Needs a CPU with AMX-BF16.

    python benchmarks/amx_prefill.py [--models smollm2-135m ...] [--runs 7] >> benchmarks/amx_prefill.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketlm  # noqa: E402
from pocketlm.bench import machine_info  # noqa: E402
from pocketlm.runtime import Runtime  # noqa: E402
from pocketlm.runtime.kernels import native  # noqa: E402


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _engine(m, amx: bool, threads: int) -> Runtime:
    rt = Runtime(m.config, m.runtime.w, engine="numpy")
    rt.native = native.NativeEngine(m.config, m.runtime.w, act="q8", amx=amx, threads=threads)
    return rt


def run(name: str, runs: int, threads: int, keep: bool) -> dict:
    m = pocketlm.load(name, keep_precision=keep, quiet=True)
    engines = {amx: _engine(m, amx, threads) for amx in (False, True)}
    row = {"command": " ".join(["python"] + sys.argv), "machine": machine_info(), "model": name,
           "keep_precision": keep, "threads": threads, "amx_terms": "x_hi w_hi + x_lo w_hi + x_hi w_lo",
           "amx_attention": True,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    for text in ("english", "chinese"):
        ids = m.tokenize((ROOT / "tests" / "data" / f"{text}.txt").read_text("utf-8"))[:256]
        ref = Runtime(m.config, m.runtime.w, engine="numpy")
        expected = ref.forward(ids, ref.new_cache(len(ids)), all_logits=True)
        lp_ref = _log_softmax(expected)
        for amx, rt in engines.items():
            got = rt.forward(ids, rt.new_cache(len(ids)), all_logits=True)
            key = f"{text}_{'amx' if amx else 'int8'}"
            row[key + "_top1"] = float((got.argmax(-1) == expected.argmax(-1)).mean())
            row[key + "_kl"] = float((np.exp(lp_ref) * (lp_ref - _log_softmax(got))).sum(-1).mean())
    ids = (m.tokenize((ROOT / "tests" / "data" / "english.txt").read_text("utf-8")) * 8)[:512]
    tps: dict[bool, list[float]] = {False: [], True: []}
    for r in range(runs + 1):
        for amx in (False, True):
            cache = engines[amx].new_cache(len(ids))
            t = time.perf_counter()
            engines[amx].forward(ids, cache)
            if r:  # the first round warms up
                tps[amx].append(len(ids) / (time.perf_counter() - t))
    row["n_prompt"] = len(ids)
    row["prefill_tps_int8"] = statistics.median(tps[False])
    row["prefill_tps_amx"] = statistics.median(tps[True])
    row["amx_over_int8"] = row["prefill_tps_amx"] / row["prefill_tps_int8"]
    row["runs"] = {"int8": tps[False], "amx": tps[True]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-precision", action="store_true")
    args = ap.parse_args()
    if not native.amx_available():
        sys.exit("amx_prefill: this build, CPU or OS has no AMX-BF16")
    for name in args.models:
        print(json.dumps(run(name, args.runs, args.threads, args.keep_precision)), flush=True)


if __name__ == "__main__":
    main()
