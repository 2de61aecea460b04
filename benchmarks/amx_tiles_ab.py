"""Prefill speed of this checkout against an earlier revision's engine, in alternating
processes: what a change to the native engine costs where prefill runs on AMX.

    python benchmarks/amx_tiles_ab.py --baseline 5f88609 [-m smollm2-135m] [--rounds 3] \
        [--out benchmarks/amx_tiles_ab.jsonl]

The baseline is checked out in a temporary worktree and its extension built there (a
minute); each round runs one process per build, which loads the model and times a
--n-prompt-token prefill 6 times (the first a warm-up; the median of the rest). One JSON line
per build and round, with the command, machine, threads and lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, statistics, sys, time
import pocketlm
m = pocketlm.load(sys.argv[1], quiet=True)
text = open(sys.argv[3], encoding="utf-8").read()
ids = (m.tokenize(text) * 8)[: int(sys.argv[2])]
rt = m.runtime
ts = []
for _ in range(6):
    cache = rt.new_cache(len(ids) + 8)
    t0 = time.perf_counter()
    rt.forward(ids, cache)
    ts.append(time.perf_counter() - t0)
print(json.dumps({"amx": bool(getattr(rt.native, "amx", False)),
                  "prefill_tps": round(len(ids) / statistics.median(ts[1:]), 1)}))
"""


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the revision to compare with")
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = str(ROOT / "tests" / "data" / "english.txt")
    with tempfile.TemporaryDirectory(prefix="pocketlm-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base),
                        args.baseline], check=True)
        try:
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=base, check=True, capture_output=True)
            rows = []
            for rnd in range(args.rounds):
                for name, tree in (("baseline", base), ("this checkout", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    r = subprocess.run([sys.executable, "-c", CHILD, args.model,
                                        str(args.n_prompt), text], env=env, check=True,
                                       capture_output=True, text=True, cwd=tmp)
                    row = {"bench": "amx_tiles_ab", "build": name,
                           "revision": args.baseline if name == "baseline" else "HEAD",
                           "round": rnd, "model": args.model, "n_prompt": args.n_prompt,
                           **json.loads(r.stdout.strip().splitlines()[-1]),
                           "threads": int(os.environ.get("POCKET_THREADS", "2")),
                           "machine": {"cpu": _cpu(), "cores": os.cpu_count()},
                           "command": "benchmarks/amx_tiles_ab.py " + " ".join(sys.argv[1:])}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False)
    if args.out:
        with args.out.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
