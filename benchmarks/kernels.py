"""Benchmark of the native matrix kernels against the numpy reference.

Prints one JSON object per line: command, machine, backend (native level or numpy), threads,
shape (rows x cols), weight kind, activation mode, tokens n, median microseconds per call over
the runs, and the weight-streaming rate (weight bytes incl. scales and minimums / median time).

Shapes are smollm2-135m's (hidden 576, MLP 1536, 3 KV heads of 64, vocabulary 49152):
decode (n = 1) and a 128-token prefill. ``--f32`` times the engine's float32-weight product
instead (the float reference path, ``precision="float"``), one thread, at each level: the
portable loop is the scalar level's.

    python benchmarks/kernels.py                       # best level, 1 thread and default threads
    python benchmarks/kernels.py --levels all --n 1    # every supported level, decode only
    python benchmarks/kernels.py --f32 --levels all    # float32 weights, every level
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pocketlm.quant import QuantTensor  # noqa: E402
from pocketlm.runtime.kernels import native, numpy_ref  # noqa: E402

SHAPES = [  # (name, rows, cols, kind)
    ("attn_q_o", 576, 576, "int4"),
    ("attn_kv", 192, 576, "int4"),
    ("mlp_up_gate", 1536, 576, "int4"),
    ("mlp_down", 576, 1536, "int4"),
    ("lm_head", 49152, 576, "int8"),
]


def machine() -> dict:
    from pocketlm.bench import machine_info

    return dict(machine_info(), numpy=np.__version__)


def random_weight(rows: int, cols: int, kind: str, group_size: int, rng) -> QuantTensor:
    ng = cols // group_size
    scales = (rng.random((rows, ng), dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
    if kind == "int4":
        q = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        mins = (-8 * scales.astype(np.float32)).astype(np.float16)
        return QuantTensor("int4", (rows, cols), group_size, q, scales, mins)
    q = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    return QuantTensor("int8", (rows, cols), group_size, q, scales, None)


def timeit(fn, runs: int, budget_s: float) -> list[float]:
    fn()  # warm up (pool start, page faults)
    times = []
    start = time.perf_counter()
    while len(times) < runs:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return times


def emit(base: dict, w: QuantTensor, rec: dict, times: list[float]) -> None:
    med = statistics.median(times)
    rec = {**base, **rec, "median_us": round(med * 1e6, 2), "runs": len(times),
           "weight_gbps": round(w.nbytes / med / 1e9, 3)}
    print(json.dumps(rec), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="best",
                    help="comma list of scalar,avx2,avx512; 'best' or 'all' (default: best)")
    ap.add_argument("--threads", default=None,
                    help="comma list of thread counts (default: 1 and POCKET_THREADS/cpus)")
    ap.add_argument("--n", default="1,128", help="token counts (default: 1,128)")
    ap.add_argument("--acts", default="f32,q8", help="activation modes (default: f32,q8)")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per configuration")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy reference")
    ap.add_argument("--f32", action="store_true",
                    help="float32 weights: the engine's float product, one thread per call")
    args = ap.parse_args()

    if not native.available():
        print(json.dumps({"error": native.unavailable_reason()}))
        sys.exit(1)
    info = native.cpu_features()
    if args.levels == "best":
        levels = [info["best"]]
    elif args.levels == "all":
        levels = list(info["levels"])
    else:
        levels = args.levels.split(",")
    if args.threads:
        threads = [int(t) for t in args.threads.split(",")]
    else:
        threads = sorted({1, native.default_threads()})
    ns = [int(v) for v in args.n.split(",")]
    acts = args.acts.split(",")
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    mach = machine()
    rng = np.random.default_rng(0)

    if args.f32:
        from pocketlm import _native

        for name, rows, cols, _ in shapes:
            w = rng.standard_normal((rows, cols), dtype=np.float32)
            for n in ns:
                x = rng.standard_normal((n, cols), dtype=np.float32)
                out = np.empty((n, rows), dtype=np.float32)
                base = {"command": command, "machine": mach, "shape": [rows, cols],
                        "name": name, "kind": "f32", "n": n}
                for level in levels:
                    fn = functools.partial(_native.matmul_f32, x, w, out,
                                           level=native.LEVELS.index(level))
                    emit(base, w, {"backend": "native", "level": level, "act": "f32",
                                   "threads": 1}, timeit(fn, args.runs, args.budget))
        return
    for name, rows, cols, kind in shapes:
        w = random_weight(rows, cols, kind, args.group_size, rng)
        for n in ns:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            base = {"command": command, "machine": mach, "shape": [rows, cols], "name": name,
                    "kind": kind, "group_size": args.group_size, "n": n}
            if not args.no_numpy:
                t = timeit(functools.partial(numpy_ref.linear_ref, x, w), args.runs, args.budget)
                emit(base, w, {"backend": "numpy", "level": None, "act": "f32", "threads": None},
                     t)
            for level in levels:
                for act in acts:
                    for th in threads:
                        out = np.empty((n, rows), dtype=np.float32)
                        fn = functools.partial(native.matmul, x, w, act=act, level=level,
                                               threads=th, out=out)
                        t = timeit(fn, args.runs, args.budget)
                        emit(base, w, {"backend": "native", "level": level, "act": act,
                                       "threads": th}, t)

if __name__ == "__main__":
    main()
