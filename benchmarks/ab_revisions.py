"""Before / after: the engine at two git revisions, side by side on one model (JSON lines).

Each revision is exported from this repository (``git archive``) into a temporary directory and
its extension built there (``setup.py build_ext --inplace``). Then one worker process per
revision loads the model and the two are driven in turn, round by round: a prompt of
--n-prompt tokens (tests/data/english.txt, repeated) in one forward() call, then --n-gen greedy
tokens one forward() at a time (EOS ignored). 1 warm-up round, then --runs measured ones. Both
workers stay loaded the whole time, so each round of one is next to a round of the other on a
machine that drifts; the paired ratios (B / A per round) are the numbers to quote.

One JSON line per model: command, machine, the two revisions (hash and subject), threads,
n_prompt, n_gen, runs, each revision's median / min / max tokens/s, the medians of the paired
ratios, and whether the two produced the same greedy tokens.

    python benchmarks/ab_revisions.py 72d5221 ae3329a
    python benchmarks/ab_revisions.py HEAD~1 HEAD --models smollm2-135m gemma3-270m --runs 9
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The worker: reads one line per round ("warm" or "run"), answers one JSON line.
WORKER = r"""
import json, sys, time
import numpy as np
import pocketlm

name, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = pocketlm.load(name, quiet=True)
text = open(sys.argv[4], encoding="utf-8").read()
ids = m.tokenize(text)
while len(ids) < n_prompt:
    ids = ids + ids
ids = ids[:n_prompt]
rt = m.runtime
print(json.dumps({"ready": True, "engine": rt.engine, "package": pocketlm.__file__}), flush=True)
for line in sys.stdin:
    gen = n_gen if line.strip() == "run" else min(n_gen, 8)
    cache = rt.new_cache(len(ids) + gen)
    t0 = time.perf_counter()
    logits = rt.forward(ids, cache)
    t1 = time.perf_counter()
    tokens = []
    for _ in range(gen):
        tokens.append(int(np.argmax(logits)))
        logits = rt.forward([tokens[-1]], cache)
    t2 = time.perf_counter()
    print(json.dumps({"prefill": len(ids) / (t1 - t0), "decode": gen / (t2 - t1),
                      "tokens": tokens}), flush=True)
"""


def revision(rev: str) -> tuple[str, str]:
    """(full hash, subject) of a revision of this repository."""
    out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H%x00%s", rev],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ab_revisions: error: no revision {rev!r} in {ROOT}")
    full, subject = out.stdout.strip().split("\x00", 1)
    return full, subject


def build(full: str, into: Path) -> Path:
    """The tree of revision `full` in `into`, its extension built in place."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", full], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=into,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"ab_revisions: error: building {full[:12]} failed:\n{done.stderr[-2000:]}")
    return into


class Worker:
    def __init__(self, tree: Path, model: str, n_prompt: int, n_gen: int, threads: int):
        env = dict(os.environ, PYTHONPATH=str(tree), POCKET_THREADS=str(threads))
        text = ROOT / "tests" / "data" / "english.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, model, str(n_prompt), str(n_gen), str(text)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
        self.info = self._read()
        if not Path(self.info["package"]).resolve().is_relative_to(tree.resolve()):
            sys.exit(f"ab_revisions: error: the worker imported {self.info['package']}, not the "
                     f"tree in {tree} (an installed pocketlm shadows it)")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"ab_revisions: error: a worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def round(self, kind: str) -> dict:
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev_a", help="the revision before (any git revision: hash, tag, HEAD~1)")
    ap.add_argument("rev_b", help="the revision after")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.runs < 1 or args.n_prompt < 1 or args.n_gen < 1 or args.threads < 1:
        sys.exit("ab_revisions: error: --runs, --n-prompt, --n-gen and --threads must be >= 1")

    sys.path.insert(0, str(ROOT))
    from pocketlm.bench import machine_info

    revs = [revision(args.rev_a), revision(args.rev_b)]
    tmp = Path(tempfile.mkdtemp(prefix="pocket-ab-"))
    try:
        trees = [build(full, tmp / f"{i}-{full[:12]}") for i, (full, _) in enumerate(revs)]
        command = " ".join([os.path.basename(sys.executable)] + sys.argv)
        for model in args.models:
            workers = [Worker(t, model, args.n_prompt, args.n_gen, args.threads) for t in trees]
            try:
                for w in workers:
                    w.round("warm")
                rounds = [[], []]
                for _ in range(args.runs):
                    for i, w in enumerate(workers):
                        rounds[i].append(w.round("run"))
            finally:
                for w in workers:
                    w.close()
            rec = {"bench": "ab_revisions", "command": command, "machine": machine_info(),
                   "model": model, "threads": args.threads, "n_prompt": args.n_prompt,
                   "n_gen": args.n_gen, "runs": args.runs}
            for tag, (full, subject), rs, w in zip("ab", revs, rounds, workers):
                rec[tag] = {"rev": full[:12], "subject": subject, "engine": w.info["engine"],
                            "prefill_tok_s": summary([r["prefill"] for r in rs]),
                            "decode_tok_s": summary([r["decode"] for r in rs])}
            for kind in ("prefill", "decode"):
                rec[f"{kind}_ratio_b_over_a"] = round(statistics.median(
                    b[kind] / a[kind] for a, b in zip(*rounds)), 3)
            rec["same_tokens"] = all(a["tokens"] == b["tokens"] for a, b in zip(*rounds))
            print(json.dumps(rec), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
