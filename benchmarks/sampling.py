"""What sampling costs per token, pocketlm's sampler against the plain formulation (JSON lines).

For each model: the next-token logits at 16 positions of tests/data/english.txt and chinese.txt
(real distributions, the model's whole vocabulary), then for each sampling setting the time a
token takes in ``Sampler`` (pocketlm's: candidates ranked alone, two-level draw) and in
``plain_draw`` (every token sorted, numpy's ``Generator.choice``), alternating, median of
--runs, and whether both drew the same tokens from the same seed (they must). Then end to end:
128 tokens generated after a 64-token prompt with the setting (``stream_ids``), once with the
sampler and once with the plain formulation swapped in, beside greedy decoding, alternating in
one process, median tokens/s of --runs.

    python benchmarks/sampling.py [--models smollm2-135m ...] [--runs 5] >> benchmarks/sampling.jsonl
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
from pocketlm import sampling  # noqa: E402
from pocketlm.bench import machine_info  # noqa: E402

SETTINGS = {
    "t0.8": dict(temperature=0.8),
    "t1-top_p0.95": dict(temperature=1.0, top_p=0.95),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
    "t0.8-top_k40": dict(temperature=0.8, top_k=40),
    "t1-top_k50-top_p0.9-min_p0.05": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
}


def _rows(m, n: int = 16) -> list[np.ndarray]:
    rows = []
    for name in ("english.txt", "chinese.txt"):
        ids = m.tokenize((ROOT / "tests" / "data" / name).read_text(encoding="utf-8"))[:256]
        logits = m.logits(ids)
        rows += [logits[i] for i in np.linspace(8, len(ids) - 1, n // 2).astype(int)]
    return rows


def _per_token(rows, setting: dict, plain: bool, seed: int = 0) -> tuple[float, list[int]]:
    if plain:
        rng = np.random.default_rng(seed)
        draw = lambda x: sampling.plain_draw(x, rng, **setting)  # noqa: E731
    else:
        draw = sampling.Sampler(sampling.SamplingParams(**setting, seed=seed))
    t0 = time.perf_counter()
    got = [draw(x) for _ in range(5) for x in rows]
    return (time.perf_counter() - t0) / len(got) * 1e3, got


def _plain_call(self, logits, history=None, allowed=None, generated=None):
    p = self.params
    if p.temperature == 0:
        return int(np.argmax(logits))
    return sampling.plain_draw(logits, self.rng, p.temperature, p.top_k, p.top_p, p.min_p)


def _decode(m, ids: list[int], setting: dict, plain: bool, n: int = 128) -> float:
    fast = sampling.Sampler.__call__
    if plain:
        sampling.Sampler.__call__ = _plain_call
    try:
        t0 = time.perf_counter()
        got = sum(1 for _ in m.stream_ids(ids, max_tokens=n, seed=1, **setting))
        return got / (time.perf_counter() - t0)
    finally:
        sampling.Sampler.__call__ = fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b",
                                                    "gemma3-270m"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["POCKET_THREADS"] = str(args.threads)
    info = machine_info()
    for name in args.models:
        m = pocketlm.load(name)
        rows = _rows(m)
        text = (ROOT / "tests" / "data" / "english.txt").read_text(encoding="utf-8")
        prompt = m.tokenize(text)[:64]
        for label, setting in SETTINGS.items():
            times = {"sampler": [], "plain": []}
            same = True
            for _ in range(args.runs):
                ms, fast = _per_token(rows, setting, plain=False)
                times["sampler"].append(ms)
                ms, slow = _per_token(rows, setting, plain=True)
                times["plain"].append(ms)
                same &= fast == slow
            tps = {"greedy": [], "sampler": [], "plain": []}
            for _ in range(args.runs):
                tps["greedy"].append(_decode(m, prompt, dict(temperature=0.0), False))
                tps["sampler"].append(_decode(m, prompt, setting, False))
                tps["plain"].append(_decode(m, prompt, setting, True))
            med = {k: statistics.median(v) for k, v in times.items()}
            dec = {k: statistics.median(v) for k, v in tps.items()}
            print(json.dumps({
                "bench": "sampling", "model": name, "vocab": m.config.vocab_size,
                "setting": label, **setting,
                "ms_per_token": {k: round(v, 3) for k, v in med.items()},
                "speedup": round(med["plain"] / med["sampler"], 2),
                "same_tokens": same,
                "decode_tok_s": {k: round(v, 1) for k, v in dec.items()},
                "decode_vs_greedy": round(dec["sampler"] / dec["greedy"], 3),
                "decode_vs_plain": round(dec["sampler"] / dec["plain"], 3),
                "runs": args.runs, "prompt_tokens": len(prompt), "new_tokens": 128,
                "threads": args.threads,
                "command": "python " + " ".join(sys.argv), **info,
                "date": time.strftime("%Y-%m-%d"),
            }), flush=True)


if __name__ == "__main__":
    main()
