"""What a speculative verification costs per row: ``Runtime.verify`` of 1 to 9 drafted rows
against a one-token step, after prompts of several lengths.

    python benchmarks/verify_rows.py -m smollm2-135m --rounds 7 --out benchmarks/verify_rows.jsonl

(threads: POCKET_THREADS, as for every pocketlm process; the rows record the engine's count)

A step of k + 1 rows streams the weights once, like a one-token step; each more row adds its
integer products (two activation digits per weight, bit for bit the one-token step's), its
attention over the cache and its share of the screened head's estimate. This measures that
cost as greedy speculative decoding pays it (``screen=True``, the rows' logits as a one-token
step computes them), so that the ratio a drafter can reach at a given acceptance follows: a step
of n rows that yields a accepted tokens is worth a one-token steps.

Per prompt length (random token ids, a fixed seed): a cache filled by one prefill, then rounds
in which every row count runs once, in the same order, the cache truncated back after each;
one JSON line per prompt length with the median milliseconds per row count, the added
milliseconds per row (least squares over 2..9 rows) and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocketlm.bench import machine_info  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def measure(name: str, prompt_len: int, rounds: int) -> dict:
    import numpy as np

    import pocketlm
    m = pocketlm.load(name)
    rt = m.runtime
    if rt.native is None:
        raise SystemExit("verify_rows: the native engine is not in use (POCKET_KERNELS?)")
    rng = np.random.default_rng(0)
    hi = min(20000, m.config.vocab_size)
    cache = rt.new_cache(prompt_len + max(ROWS) + 1)
    rt.forward(rng.integers(100, hi, prompt_len).tolist(), cache, screen=True)
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for _ in range(rounds):
        for n in ROWS:
            ids = rng.integers(100, hi, n).tolist()
            t = time.perf_counter()
            if n == 1:
                rt.forward(ids, cache, screen=True)
            else:
                rt.verify(ids, cache, screen=True)
            times[n].append(time.perf_counter() - t)
            cache.truncate(prompt_len)
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    xs = [n for n in ROWS if n > 1]
    mx = statistics.fmean(xs)
    my = statistics.fmean(ms[n] for n in xs)
    slope = sum((n - mx) * (ms[n] - my) for n in xs) / sum((n - mx) ** 2 for n in xs)
    return {"bench": "verify_rows", "model": name, "prompt_tokens": prompt_len,
            "rounds": rounds, "threads": rt.native.threads,
            "ms": {str(n): round(v, 3) for n, v in ms.items()},
            "ms_per_added_row": round(slope, 3),
            "one_token_ms": round(ms[1], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="registry name or .pocket file "
                    "(repeatable; default smollm2-135m)")
    ap.add_argument("--prompt", type=int, action="append",
                    help="prompt lengths in tokens (repeatable; default 32 and 450)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every row count (7)")
    ap.add_argument("--label", help="a name for the build measured, recorded in each row "
                    "(for a trial build beside the tree's)")
    ap.add_argument("--out", type=Path, help="append the JSON lines to this file too")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    command = " ".join(["python", "benchmarks/verify_rows.py", *sys.argv[1:]])
    for name in args.model or ["smollm2-135m"]:
        for plen in args.prompt or [32, 450]:
            row = measure(name, plen, args.rounds)
            if args.label:
                row["build"] = args.label
            row.update(command=command, machine=machine_info(),
                       date=time.strftime("%Y-%m-%d"))
            line = json.dumps(row, ensure_ascii=False)
            print(line, flush=True)
            if args.out:
                with args.out.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
