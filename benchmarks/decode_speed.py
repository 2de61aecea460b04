"""Prefill and decode speed of the runtime on a registry model (JSON lines).

For each setting: a prompt of --prompt tokens (tests/data/english.txt, repeated as needed) is
run in one forward() call (prefill), then --gen tokens are decoded one forward() at a time
(greedy, EOS ignored, with the head screening greedy decoding uses; ``--no-screen``: the whole
head each step), driving ``runtime.forward`` directly. Each setting runs 1 warm-up round
and --runs measured rounds; the medians are reported.

One JSON object per setting: command, machine (cpu, cpus, kernel level), engine, act, kv,
threads, n_prompt, n_gen, prefill_tok_s, decode_tok_s (medians) and the per-round values.

    python benchmarks/decode_speed.py                          # native f32 and q8, 2 threads
    python benchmarks/decode_speed.py --engines native numpy --acts f32 --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketlm  # noqa: E402
from pocketlm.runtime import Runtime  # noqa: E402
from pocketlm.runtime.kernels import native  # noqa: E402


def machine() -> dict:
    from pocketlm.bench import machine_info

    return dict(machine_info())


def prompt_ids(m, n: int) -> list[int]:
    text = (ROOT / "tests" / "data" / "english.txt").read_text(encoding="utf-8")
    ids = m.tokenize(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def one_round(rt: Runtime, ids: list[int], n_gen: int, screen: bool) -> tuple[float, float]:
    cache = rt.new_cache(len(ids) + n_gen)
    t0 = time.perf_counter()
    logits = rt.forward(ids, cache, screen=screen)
    t1 = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(logits))
        logits = rt.forward([token], cache, screen=screen)
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n_gen / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", nargs="+", default=["native"], choices=["native", "numpy"])
    ap.add_argument("--acts", nargs="+", default=["f32", "q8"], choices=["f32", "q8"])
    ap.add_argument("--kv", default=None, choices=["f32", "f16"],
                    help="KV cache format (default: f32 with f32 activations, f16 with q8)")
    ap.add_argument("--threads", nargs="+", type=int, default=[2])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-screen", action="store_true",
                    help="read the whole output head each step (default: greedy decoding's "
                    "head screening, as pocket run and pocket bench decode)")
    args = ap.parse_args()
    screen = not args.no_screen

    m = pocketlm.load(args.model)
    ids = prompt_ids(m, args.prompt)
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    for engine in args.engines:
        for act in (args.acts if engine == "native" else ["f32"]):
            for threads in args.threads:
                os.environ["POCKET_ACT"] = act
                os.environ["POCKET_THREADS"] = str(threads)
                os.environ["POCKET_KERNELS"] = "native" if native.available() else "numpy"
                if args.kv:
                    os.environ["POCKET_KV"] = args.kv
                rt = Runtime(m.config, m.runtime.w, engine=engine)
                one_round(rt, ids, min(args.gen, 8), screen)  # warm-up
                rounds = [one_round(rt, ids, args.gen, screen) for _ in range(args.runs)]
                rec = {  # the machine's settings as this setting runs them
                    "command": command, "machine": machine(), "model": args.model,
                    "engine": rt.engine, "act": act, "screen": screen,
                    "kv": rt.native.kv_format if rt.native else "f32",
                    "threads": threads, "n_prompt": len(ids), "n_gen": args.gen,
                    "prefill_tok_s": round(statistics.median(r[0] for r in rounds), 1),
                    "decode_tok_s": round(statistics.median(r[1] for r in rounds), 1),
                    "prefill_runs": [round(r[0], 1) for r in rounds],
                    "decode_runs": [round(r[1], 1) for r in rounds],
                }
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
