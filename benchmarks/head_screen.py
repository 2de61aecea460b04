"""Head screening (POCKET_HEAD_SCREEN=K) against the INT8 output head read whole, side by side:
decode speed in whole generations, and what the logits keep.

    python benchmarks/head_screen.py -m smollm2-135m -m gemma3-270m --k 16 --rounds 4 \
        --out benchmarks/head_screen.jsonl

A screened engine holds an INT8 head as two INT4 planes (the high and low nibbles of its codes,
the same bytes); a greedy decode step reads the high plane for every row of the vocabulary, then
the head's values for the K tiles of 16 rows with the largest estimates (docs/engine.md, "Head
screening"). Calls that want every logit get the INT8 head's values, bit for bit.

Speed: ``pocket bench -m MODEL --runs 3 --json`` (a --n-prompt prompt, 128 greedy tokens)
under POCKET_HEAD_SCREEN=0 and =K, the order alternating round by round (a setting is a
property of the process); the summary gives the medians of prefill and decode tokens/s and
their ratios.

Steps (one process): a one-token step after a 256-token prompt with the whole head, screened
(greedy), and on the screened engine wanting every logit (sampling), alternating; medians.

Logits (one process, two engines on the same weights): teacher-forced one-token decode steps
over tests/data/english.txt and chinese.txt (--positions tokens of each): top-1 agreement with
the whole head, how many of the whole head's top 5 / top 40 the screened step returns exactly
(within 1e-3), and the total variation distance of the next-token distributions at temperature
1 and 0.7; plus greedy answers (128 tokens) to the 20 chat requests of
tests/data/pocket_zh_en_chat.jsonl, compared token for token.
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
sys.path.insert(0, str(ROOT / "benchmarks"))  # huge_pages: the alternating pocket bench

# the 20 hand-written zh + en chat requests of the pocket-zh-en model card
REQUESTS = [json.loads(line)["prompt"] for line in
            (ROOT / "tests" / "data" / "pocket_zh_en_chat.jsonl").read_text().splitlines()
            if line.strip()]


def _tv(a, b, temp: float) -> float:
    import numpy as np

    def sm(x):
        z = (x - x.max()) / temp
        e = np.exp(z)
        return e / e.sum()
    return float(0.5 * np.abs(sm(a.astype(np.float64)) - sm(b.astype(np.float64))).sum())


def logit_quality(name: str, k: int, positions: int) -> dict:
    import numpy as np

    import pocketlm
    from pocketlm.runtime.engine import NativeModelEngine
    from pocketlm.runtime.kernels.native import NativeEngine

    model = pocketlm.load(name)
    rt = model.runtime
    if rt.native is None:
        sys.exit(f"error: {name} does not run on the native engine here")
    whole = NativeModelEngine(model.config, rt.native)
    screened = NativeModelEngine(model.config, NativeEngine(model.config, rt.w, head_screen=k))
    top1 = n = 0
    top5 = top40 = 0
    tv1, tv07 = [], []
    for f in ("english.txt", "chinese.txt"):
        ids = model.tokenize((ROOT / "tests" / "data" / f).read_text())[:positions]
        c0, c1 = whole.new_cache(len(ids)), screened.new_cache(len(ids))
        for tok in ids:
            a = whole.forward(np.array([tok]), c0, False)
            b = screened.forward(np.array([tok]), c1, False, screen=True)
            order = np.argsort(-a)
            exact = np.abs(a - b) < 1e-3
            top1 += int(a.argmax() == b.argmax())
            top5 += int(exact[order[:5]].all())
            top40 += int(exact[order[:40]].sum())
            tv1.append(_tv(a, b, 1.0))
            tv07.append(_tv(a, b, 0.7))
            n += 1
    same = 0
    for req in REQUESTS:
        outs = []
        for eng in (rt.native, screened.native):
            rt.native = eng
            outs.append(model.chat([{"role": "user", "content": req}], max_tokens=128,
                                   temperature=0.0))
        same += outs[0] == outs[1]
    rt.native = whole.native
    return {"positions": n, "top1_agreement": round(top1 / n, 4),
            "top5_exact": round(top5 / n, 4), "top40_exact_mean": round(top40 / n, 2),
            "tv_t1_median": round(statistics.median(tv1), 5), "tv_t1_max": round(max(tv1), 4),
            "tv_t07_median": round(statistics.median(tv07), 5),
            "tv_t07_max": round(max(tv07), 4),
            "greedy_chats_identical": f"{same}/{len(REQUESTS)}"}


def step_times(name: str, k: int, reps: int = 60) -> dict:
    """Median milliseconds of a one-token step after a 256-token prompt: the whole INT8 head
    (head_screen 0), a screened greedy step, and a step of the screened engine that wants every
    logit (sampling): the three alternating in one process."""
    import numpy as np

    import pocketlm
    from pocketlm.runtime.kernels.native import NativeEngine

    model = pocketlm.load(name)
    cfg, w = model.config, model.runtime.w
    whole, screened = NativeEngine(cfg, w, head_screen=0), NativeEngine(cfg, w, head_screen=k)
    ids = np.array(model.tokenize((ROOT / "tests" / "data" / "english.txt").read_text())[:256],
                   dtype=np.int32)
    kv0, kv1 = whole.new_kv(len(ids) + 1), screened.new_kv(len(ids) + 1)
    whole.forward(kv0, ids, 0, False)
    screened.forward(kv1, ids, 0, False)
    times: dict[str, list[float]] = {"whole": [], "screened": [], "screened_all_logits": []}
    runs = (("whole", whole, kv0, False), ("screened", screened, kv1, True),
            ("screened_all_logits", screened, kv1, False))
    for rep in range(reps):
        for key, eng, kv, scr in runs if rep % 2 == 0 else runs[::-1]:
            t0 = time.perf_counter()
            eng.forward(kv, ids[:1], len(ids), False, screen=scr)
            times[key].append(time.perf_counter() - t0)
    med = {key: round(statistics.median(v) * 1e3, 3) for key, v in times.items()}
    return {"step_ms": med, "x_step_greedy": round(med["whole"] / med["screened"], 3),
            "x_step_all_logits": round(med["whole"] / med["screened_all_logits"], 3)}


def speed(name: str, k: int, rounds: int, n_prompt: int, threads: int) -> dict:
    from huge_pages import pocket_bench_alternating

    rates = pocket_bench_alternating(name, "POCKET_HEAD_SCREEN", (k, 0), rounds, n_prompt,
                                     threads, "head-screen-round", "head_screen")
    med = {s: {key: statistics.median(v) for key, v in d.items() if None not in v}
           for s, d in rates.items()}
    return {"screened": med[k], "whole": med[0],
            "x_decode": round(med[k]["decode"] / med[0]["decode"], 3),
            "x_prefill": round(med[k]["prefill"] / med[0]["prefill"], 3),
            "runs": {"screened": rates[k], "whole": rates[0]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=None,
                    help="model (repeatable; default smollm2-135m)")
    ap.add_argument("--k", type=int, default=None,
                    help="tiles of 16 rows refined per row (default: the engine's default)")
    ap.add_argument("--rounds", type=int, default=4, help="pocket bench pairs per model")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--positions", type=int, default=300, help="tokens of each text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-speed", action="store_true", help="only the logits part")
    ap.add_argument("--out", type=Path, default=None, help="append the summaries here too")
    args = ap.parse_args()
    if args.k is None:
        from pocketlm.runtime.settings import EngineSettings

        args.k = EngineSettings().head_screen or 64
    if not 1 <= args.k <= 256 or args.rounds < 1 or args.positions < 1:
        sys.exit("error: --k must be 1 to 256, --rounds and --positions at least 1")
    from pocketlm.bench import machine_info

    out = [sys.stdout] + ([args.out.open("a")] if args.out else [])
    for name in args.model or ["smollm2-135m"]:
        line = {"bench": "head-screen", "model": name, "k": args.k,
                **logit_quality(name, args.k, args.positions)}
        line.update(step_times(name, args.k))
        if not args.no_speed:
            line.update(speed(name, args.k, args.rounds, args.n_prompt, args.threads))
        line.update({"threads": args.threads, "n_prompt": args.n_prompt, "n_gen": 128,
                     "machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                     "command": " ".join(sys.argv)})
        for f in out:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
