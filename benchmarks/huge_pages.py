"""The engine's repacked weights in transparent huge pages or in 4 KB pages (POCKET_HUGEPAGES
1 / 0): prefill, one-token decode and speculative verification steps, side by side.

    python benchmarks/huge_pages.py -m smollm2-135m -m gemma3-270m [--rounds 6] \
        --out benchmarks/huge_pages.jsonl
    python benchmarks/huge_pages.py -m qwen2.5-0.5b --pocket-bench --rounds 4 \
        --out benchmarks/huge_pages.jsonl

Each round runs one worker process per setting, the order alternating round by round (the
machine is shared and its speed drifts; a setting is a property of the process, read when the
model loads). A worker loads the model, then measures on the same cache, each figure the
median of its repetitions: prefill of --n-prompt tokens (tests/data/english.txt), a one-token
decode step (``Runtime.forward`` of one token, as plain decoding runs it) and verification
steps of 5, 9 and 13 rows (``Runtime.verify``, as speculative decoding runs them: 9 rows are
the default draft of 8 and its token), after the prompt; plus the share of the process's memory
in huge pages and its peak resident set. The outputs of the two settings are compared bit for
bit (the same logits, or the line says so).

``--pocket-bench`` measures whole generations instead: ``pocket bench -m MODEL --runs 3
--json`` (a --n-prompt prompt, 128 greedy tokens) under each setting, alternating round by
round; the summary gives the medians of its prefill and decode tokens/s and their ratios.

``--one-process`` times greedy decode steps (48 after the prompt) of both settings alternating
in one process, the model loaded once under each; since the model loaded second decoded
8-13 % faster on this VM whatever its setting, it runs once per load order (a process each) and
the summary gives each order's paired ratio and their geometric mean (``x_decode_step``).

One JSON line per worker, then one summary line per model: the medians over the rounds and the
ratios (huge pages over 4 KB pages: above 1 is faster for tokens/s, below 1 is faster for
milliseconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = (1, 5, 9, 13)


def worker(model_name: str, n_prompt: int, reps: int) -> dict:
    """Measure in this process (its POCKET_HUGEPAGES is the setting)."""
    import resource

    import numpy as np

    import pocketlm

    model = pocketlm.load(model_name)
    rt = model.runtime
    text = (ROOT / "tests" / "data" / "english.txt").read_text()
    ids = model.tokenizer.encode(text)
    while len(ids) < n_prompt:
        ids = ids + ids
    ids = ids[:n_prompt]
    cache = rt.new_cache(n_prompt + max(ROWS) + 1)
    prefill = []
    for _ in range(3):
        cache.truncate(0)
        t0 = time.perf_counter()
        last = rt.forward(ids, cache)
        prefill.append(n_prompt / (time.perf_counter() - t0))
    base = cache.length
    digest = hashlib.sha256(np.ascontiguousarray(last).tobytes())
    step_ms: dict[int, list[float]] = {r: [] for r in ROWS}
    for rep in range(reps):
        for rows in ROWS if rep % 2 == 0 else ROWS[::-1]:
            draft = [int(t) for t in ids[:rows]]
            t0 = time.perf_counter()
            out = rt.forward(draft, cache) if rows == 1 else rt.verify(draft, cache)
            step_ms[rows].append((time.perf_counter() - t0) * 1e3)
            cache.truncate(base)
            if rep == 0:
                digest.update(np.ascontiguousarray(out).tobytes())
    huge_kb = rss_kb = 0
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                huge_kb = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss_kb = int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    native = getattr(rt, "native", None)
    tiles = native.model.tile_bytes if native is not None else (0, 0)
    return {"prefill_tps": round(statistics.median(prefill), 1),
            "tile_mb": round(tiles[0] / 1e6, 2), "coded_tile_mb": round(tiles[1] / 1e6, 2),
            "step_ms": {str(r): round(statistics.median(v), 3) for r, v in step_ms.items()},
            "huge_pages_mb": round(huge_kb / 1024, 1), "rss_mb": round(rss_kb / 1024, 1),
            "peak_rss_mb": round(peak / 1024, 1), "logits_sha256": digest.hexdigest()[:16]}


def _alternating(rounds: int):
    """``(round, setting)`` for every worker: both settings each round, the order alternating."""
    for r in range(rounds):
        for setting in (1, 0) if r % 2 == 0 else (0, 1):
            yield r, setting


def _last_json(cmd: list[str], env: dict, what: str) -> dict:
    """Run ``cmd`` and parse the last line it printed (exit with its error if it failed)."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {what} failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _emit(out, line: dict) -> None:
    for f in out:
        f.write(json.dumps(line) + "\n")
        f.flush()


def pocket_bench_alternating(name: str, variable: str, values: tuple, rounds: int,
                             n_prompt: int, threads: int, label: str, key: str) -> dict:
    """``pocket bench -m NAME --runs 3 --json`` under each value of the environment
    ``variable``, the order alternating round by round; prints a ``label`` line per run (the
    value under ``key``) and returns ``{value: {"prefill": [...], "decode": [...],
    "peak_mb": [...]}}`` in round order."""
    rates = {v: {"prefill": [], "decode": [], "peak_mb": []} for v in values}
    cmd = [sys.executable, "-m", "pocketlm.cli", "bench", "-m", name, "--runs", "3",
           "--threads", str(threads), "--n-prompt", str(n_prompt), "--json"]
    for r in range(rounds):
        for v in values if r % 2 == 0 else values[::-1]:
            row = _last_json(cmd, dict(os.environ, **{variable: str(v)}),
                             f"pocket bench on {name}")
            rates[v]["prefill"].append(round(row["prefill_tps"], 1))
            rates[v]["decode"].append(round(row["decode_tps"], 1))
            rates[v]["peak_mb"].append(row.get("peak_rss_delta_mb"))
            print(json.dumps({"bench": label, "model": name, key: v, "round": r,
                              "prefill_tps": rates[v]["prefill"][-1],
                              "decode_tps": rates[v]["decode"][-1]}), file=sys.stderr)
    return rates


# The setting compared (an engine variable, 1 against 0): its name, the benchmark's label, the
# names of the two sides and the key of a worker line. benchmarks/compact_tiles.py reuses this
# file for POCKET_COMPACT_TILES.
HUGE_PAGES = {"variable": "POCKET_HUGEPAGES", "label": "huge-pages", "on": "huge",
              "off": "small", "key": "hugepages"}


def run_pocket_bench(models: list[str], rounds: int, n_prompt: int, threads: int, out,
                     setting: dict = HUGE_PAGES) -> None:
    """``pocket bench`` under each setting, alternating: whole generations."""
    from pocketlm.bench import machine_info

    machine, today = machine_info(), time.strftime("%Y-%m-%d")
    on, off, label = setting["on"], setting["off"], setting["label"]
    for name in models:
        got = pocket_bench_alternating(name, setting["variable"], (1, 0), rounds, n_prompt,
                                       threads, f"{label}-pocket-bench", setting["key"])
        rates = {s: {k: got[s][k] for k in ("prefill", "decode")} for s in (0, 1)}
        med = {s: {k: round(statistics.median(v), 1) for k, v in rates[s].items()} for s in (0, 1)}
        summary = {"bench": f"{label}-pocket-bench-summary", "model": name, "rounds": rounds,
                   on: med[1], off: med[0],
                   "x_prefill": round(med[1]["prefill"] / med[0]["prefill"], 3),
                   "x_decode": round(med[1]["decode"] / med[0]["decode"], 3),
                   "runs": {on: rates[1], off: rates[0]}, "n_gen": 128,
                   "threads": threads, "n_prompt": n_prompt, "machine": machine, "date": today,
                   "command": " ".join(sys.argv)}
        _emit(out, summary)


def run(models: list[str], rounds: int, n_prompt: int, reps: int, threads: int, out,
        setting: dict = HUGE_PAGES) -> None:
    from pocketlm.bench import machine_info

    machine, today = machine_info(), time.strftime("%Y-%m-%d")
    label = setting["label"]
    for name in models:
        results: dict[int, list[dict]] = {0: [], 1: []}
        cmd = [sys.executable, __file__, "--worker", name, "--n-prompt", str(n_prompt),
               "--reps", str(reps)]
        for r, value in _alternating(rounds):
            env = dict(os.environ, POCKET_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                       **{setting["variable"]: str(value)})
            row = _last_json(cmd, env, f"the worker for {name}")
            results[value].append(row)
            line = {"bench": label, "model": name, setting["key"]: value, "round": r,
                    **row, "threads": threads, "n_prompt": n_prompt, "machine": machine,
                    "date": today, "command": " ".join(sys.argv)}
            print(json.dumps(line), file=sys.stderr)
        med = {}
        for value, rows in results.items():
            med[value] = {"prefill_tps": statistics.median(x["prefill_tps"] for x in rows),
                          **{f"step_ms_{r}": statistics.median(x["step_ms"][str(r)]
                                                              for x in rows) for r in ROWS},
                          "huge_pages_mb": statistics.median(x["huge_pages_mb"] for x in rows),
                          "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in rows),
                          "tile_mb": statistics.median(x["tile_mb"] for x in rows)}
        on, off = med[1], med[0]
        same = {x["logits_sha256"] for x in results[0] + results[1]}
        summary = {"bench": f"{label}-summary", "model": name, "rounds": rounds,
                   setting["on"]: on, setting["off"]: off,
                   "x_prefill": round(on["prefill_tps"] / off["prefill_tps"], 3),
                   **{f"x_step_{r}": round(off[f"step_ms_{r}"] / on[f"step_ms_{r}"], 3)
                      for r in ROWS},
                   "verify9_in_steps": {setting["on"]: round(on["step_ms_9"] / on["step_ms_1"], 2),
                                        setting["off"]: round(off["step_ms_9"] / off["step_ms_1"],
                                                              2)},
                   "identical_logits": len(same) == 1,
                   "threads": threads, "n_prompt": n_prompt, "machine": machine, "date": today,
                   "command": " ".join(sys.argv)}
        _emit(out, summary)


def one_process_worker(name: str, variable: str, first: int, rounds: int, n_prompt: int,
                       steps: int) -> dict:
    """Both settings in this process: the model loaded under ``variable`` = ``first``, then
    under the other value, and greedy decode steps (``steps`` after an ``n_prompt`` prefill)
    timed on each, alternating round by round. Milliseconds per step, per setting."""
    import numpy as np

    import pocketlm

    models = {}
    for value in (first, 1 - first):
        os.environ[variable] = str(value)
        models[value] = pocketlm.load(name)
    text = (ROOT / "tests" / "data" / "english.txt").read_text()
    ids = models[1].tokenizer.encode(text)
    while len(ids) < n_prompt:
        ids = ids + ids
    ids = ids[:n_prompt]
    ms: dict[int, list[float]] = {1: [], 0: []}
    tokens = {}
    for r in range(rounds):
        for value in (1, 0) if r % 2 == 0 else (0, 1):
            rt = models[value].runtime
            cache = rt.new_cache(n_prompt + steps + 1)
            tok = int(np.argmax(rt.forward(ids, cache)))
            got = [tok]
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = int(np.argmax(rt.forward([tok], cache, screen=True)))
                got.append(tok)
            ms[value].append((time.perf_counter() - t0) / steps * 1e3)
            tokens.setdefault(value, got)
    return {"ms_on": ms[1], "ms_off": ms[0], "same_tokens": tokens[1] == tokens[0]}


def run_one_process(models: list[str], rounds: int, n_prompt: int, threads: int, out,
                    setting: dict, steps: int = 48) -> None:
    """Decode steps of both settings alternating in one process, each load order in its own
    process (the model loaded second decoded 8-13 % faster on this VM whatever its
    setting): the paired ratio per order and their geometric mean."""
    from pocketlm.bench import machine_info

    machine, today = machine_info(), time.strftime("%Y-%m-%d")
    for name in models:
        orders = {}
        for first in (1, 0):
            cmd = [sys.executable, __file__, "--one-process-worker", name, "--first", str(first),
                   "--rounds", str(rounds), "--n-prompt", str(n_prompt),
                   "--variable", setting["variable"]]
            env = dict(os.environ, POCKET_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            row = _last_json(cmd, env, f"the one-process worker for {name}")
            pairs = [off / on for on, off in zip(row["ms_on"], row["ms_off"])]
            orders[f"{setting['on']}_loaded_first" if first else f"{setting['off']}_loaded_first"] = {
                "ms_on": round(statistics.median(row["ms_on"]), 3),
                "ms_off": round(statistics.median(row["ms_off"]), 3),
                "x_paired": round(statistics.median(pairs), 3),
                "on_faster": sum(p > 1 for p in pairs), "rounds": len(pairs),
                "same_tokens": row["same_tokens"]}
        xs = [o["x_paired"] for o in orders.values()]
        _emit(out, {"bench": f"{setting['label']}-one-process-summary", "model": name,
                    "steps": steps, "orders": orders,
                    "x_decode_step": round((xs[0] * xs[1]) ** 0.5, 3),
                    "threads": threads, "n_prompt": n_prompt, "machine": machine,
                    "date": today, "command": " ".join(sys.argv)})


def main(setting: dict = HUGE_PAGES, doc: str = __doc__) -> None:
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=None,
                    help="registry model (repeatable; default smollm2-135m)")
    ap.add_argument("--rounds", type=int, default=6, help="worker pairs per model")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15, help="timed steps per size per worker")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="append the summaries here too")
    ap.add_argument("--pocket-bench", action="store_true",
                    help="measure whole generations with `pocket bench` instead of steps")
    ap.add_argument("--one-process", action="store_true",
                    help="decode steps of both settings alternating in one process, once per "
                         "load order (--rounds pairs each)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-process-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--variable", default=setting["variable"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n_prompt, args.reps)))
        return
    if args.one_process_worker:
        print(json.dumps(one_process_worker(args.one_process_worker, args.variable, args.first,
                                            args.rounds, args.n_prompt, 48)))
        return
    if args.rounds < 1 or args.reps < 1 or args.n_prompt < 1:
        sys.exit("error: --rounds, --reps and --n-prompt must be at least 1")
    out = [sys.stdout] + ([args.out.open("a")] if args.out else [])
    if args.one_process:
        run_one_process(args.model or ["smollm2-135m"], args.rounds, args.n_prompt,
                        args.threads, out, setting)
    elif args.pocket_bench:
        run_pocket_bench(args.model or ["smollm2-135m"], args.rounds, args.n_prompt,
                         args.threads, out, setting)
    else:
        run(args.model or ["smollm2-135m"], args.rounds, args.n_prompt, args.reps,
            args.threads, out, setting)


if __name__ == "__main__":
    main()
