"""What a spell of large request bodies leaves in `pocket serve`'s memory.

    python benchmarks/serve_large_bodies.py -m smollm2-135m --rounds 8 --label HEAD \
        --out benchmarks/serve_large_bodies.jsonl

A server is started alone; its resident set (VmRSS) is read once it is ready, then after each
round of 40 requests sent by 4 concurrent clients, a third each of: a 900 KB completions prompt
(tokenized, then refused as longer than the context: 400), a 900 KB chat message (the same),
and a 1.2 MB /tokenize body (over the default --max-body-kb: 413, read and dropped). The
requests are refused, but each is parsed, rendered and tokenized first (tens of MB for a
moment), as a client's oversized input is. One JSON line per run: the resident MB at start and
after each round, the status counts, the machine, the command. Compare revisions by running
this on each in turn (alternating) on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocketlm.bench import machine_info  # noqa: E402

ROUND = 40
CLIENTS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _bodies(model: str) -> list[tuple[str, bytes]]:
    return [
        ("/v1/completions", json.dumps({"model": model, "prompt": "word " * 180_000,
                                        "max_tokens": 1}).encode()),
        ("/v1/chat/completions", json.dumps({"model": model, "max_tokens": 1, "messages": [
            {"role": "user", "content": "x" * 900_000}]}).encode()),
        ("/tokenize", json.dumps({"prompt": "中文 " * 120_000}).encode()),
    ]


def run(model: str, rounds: int) -> dict:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "pocketlm.cli", "serve", "-m", model, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}) before it was ready")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server was not ready within 300 s")
            time.sleep(0.3)
        bodies = _bodies(model)

        def one(i: int) -> str:
            path, body = bodies[i % len(bodies)]
            try:
                return str(httpx.post(base + path, content=body, timeout=120,
                                      headers={"Content-Type": "application/json"})
                           .status_code)
            except httpx.HTTPError as e:
                return type(e).__name__

        time.sleep(1)
        rss = [round(_rss_mb(proc.pid), 1)]
        codes: dict[str, int] = {}
        with ThreadPoolExecutor(CLIENTS) as pool:
            for r in range(rounds):
                for code in pool.map(one, range(r * ROUND, (r + 1) * ROUND)):
                    codes[code] = codes.get(code, 0) + 1
                time.sleep(1)
                rss.append(round(_rss_mb(proc.pid), 1))
        return {"rss_mb": rss, "statuses": codes}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--label", default="", help="what this run measures (e.g. a revision)")
    ap.add_argument("--out", type=Path, help="append the JSON line to this file")
    args = ap.parse_args()
    result = run(args.model, args.rounds)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip()
    row = {"benchmark": "serve_large_bodies", "label": args.label, "revision": rev,
           "model": args.model, "rounds": args.rounds, "requests_per_round": ROUND,
           "clients": CLIENTS, "threads": os.environ.get("POCKET_THREADS", "default"),
           **result, "start_mb": result["rss_mb"][0],
           "last_mb": result["rss_mb"][-1], "max_mb": max(result["rss_mb"]),
           "machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
           "command": "python benchmarks/serve_large_bodies.py " + " ".join(sys.argv[1:])}
    line = json.dumps(row, ensure_ascii=False)
    print(line)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
