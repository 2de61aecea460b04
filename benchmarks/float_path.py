"""Speed of the float reference path (``pocketlm.load(MODEL, precision="float")``: the source's
weights dequantized to float32, the path the capability suite's float rows run on).

Each run loads the model in a fresh process, prefills a prompt of --prompt tokens (English
text from tests/data) and decodes --decode tokens greedily; prefill tok/s is the prompt over the
time to the first token, decode tok/s the rest over their time. ``--trees A B ...`` runs the
same measurement from several checkouts of pocketlm (each with its native extension built),
alternating, so that a kernel change is measured against the code before it in one run.
Prints one JSON line per run, then one summary line per tree (medians).

    python benchmarks/float_path.py -m smollm2-135m --trees . /tmp/before --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

WORKER = r"""
import json, sys, time
import pocketlm
from pocketlm.runtime.kernels import native
model, prompt, decode, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t0 = time.perf_counter()
m = pocketlm.load(model, precision="float")
load_s = time.perf_counter() - t0
ids = (m.tokenize(open(text, encoding="utf-8").read()) * 8)[:prompt]
times = []
t0 = time.perf_counter()
for _ in m.stream_ids(ids, max_tokens=decode):
    times.append(time.perf_counter())
first = times[0] - t0
print(json.dumps({"load_s": round(load_s, 2), "prompt_tokens": len(ids),
                  "decoded_tokens": len(times),
                  "prefill_tok_s": round(len(ids) / first, 2),
                  "decode_tok_s": round((len(times) - 1) / (times[-1] - times[0]), 2)
                  if len(times) > 1 else None,
                  "level": native.cpu_features()["selected"],
                  "threads": native.engine_threads()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--decode", type=int, default=32, help="tokens to decode (default 32)")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree (default 3)")
    ap.add_argument("--trees", nargs="+", default=["."],
                    help="pocketlm checkouts to measure, alternating (default: this one)")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = os.path.join(root, "tests", "data", "english.txt")
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    trees = [os.path.abspath(t) for t in args.trees]
    from pocketlm.bench import machine_info

    machine = machine_info()
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for run in range(args.runs):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, "-c", WORKER, args.model, str(args.prompt),
                                  str(args.decode), text], env=env, cwd=tree,
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            git = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h"],
                                 capture_output=True, text=True).stdout.strip()
            if subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                              capture_output=True, text=True).stdout.strip():
                git += "+changes"
            rec = {"command": command, "model": args.model, "precision": "float",
                   "tree": tree, "commit": git, "run": run, "machine": machine, **rec}
            results[tree].append(rec)
            print(json.dumps(rec), flush=True)
    base = results[trees[-1]]
    for tree in trees:
        rs = results[tree]
        summary = {"summary": True, "command": command, "model": args.model, "tree": tree,
                   "commit": rs[0]["commit"], "runs": len(rs),
                   "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs),
                   "decode_tok_s": statistics.median(r["decode_tok_s"] or 0 for r in rs)}
        if len(trees) > 1:
            summary["x_prefill_vs_last"] = round(summary["prefill_tok_s"] / statistics.median(
                r["prefill_tok_s"] for r in base), 2)
            summary["x_decode_vs_last"] = round(summary["decode_tok_s"] / statistics.median(
                r["decode_tok_s"] or 0 for r in base), 2)
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
