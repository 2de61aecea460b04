"""Load on `pocket serve`: aggregate tokens/s and time to first token at 1, 4 and 16 clients.

Starts `pocket serve` (a subprocess, the engine's default settings) and, for each level of
concurrency C, runs C client threads that each send streaming /v1/completions requests back to
back (distinct prompts, greedy or with --sampling's settings, --gen tokens with EOS ignored,
usage read from the last chunk).
Per level: aggregate completion tokens/s over the level's wall time, p50/p95 time to first
token, the median per-request decode rate, and the mean tokens per batched decode step (rows,
without speculation), the share of the server's engine time spent on prompts and of the wall
time the engine was busy, and with
--speculative the decode tokens/s its batched steps measured with and without drafts. Levels run
--rounds times, alternating their order, and the medians are reported. The clients share the
machine with the server (2 vCPUs here): they use raw HTTP, not a client library, to keep their
share small.

One JSON line per level: command, machine, model, threads, n_prompt (mean), n_gen, clients,
requests, agg_tok_s, ttft_p50_s, ttft_p95_s, req_decode_tok_s, mean_batch, prefill_share,
engine_busy, draft_gate (n_prompt: the
prompts' tokens as pocketlm counts them; both engines get the same prompts).

With --vs llama.cpp, llama-cpp-python's OpenAI server (``python -m llama_cpp.server``, run by
--llama-python, same GGUF, same threads and context) gets the same load in the same run, the
two servers alternating level by level; its EOS is banned with logit_bias (its completions
have no ignore_eos), its tokens are counted one per streamed chunk, and it runs with
--interrupt_requests False (by default a new request aborts the one streaming).

    python benchmarks/serve_load.py                        # smollm2-135m, 1/4/16 clients
    python benchmarks/serve_load.py -m qwen2.5-0.5b --clients 1 4 16 --gen 64
    python benchmarks/serve_load.py --vs llama.cpp --llama-python /path/to/venv/bin/python
    python benchmarks/serve_load.py -m gemma3-270m --sampling temperature=1 top_p=0.95 \
        --baseline /tmp/pocketlm-before        # a worktree of an earlier revision, built
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SUBJECTS = ["cats", "rivers", "the moon", "bread", "trains", "music", "winter", "bees",
            "the sea", "tea", "bicycles", "mountains", "clocks", "gardens", "rain", "paper"]


def start_server(model: str, threads: int, max_batch: int, ctx: int,
                 extra: tuple[str, ...] = (), src: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, POCKET_THREADS=str(threads))
    if src:  # pocketlm as another checkout has it (its extension built there)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, "-m", "pocketlm.cli", "serve", "-m", model,
                             "--port", "0", "--max-batch", str(max_batch), "--ctx", str(ctx),
                             "--max-queue", "256", "--prefix-cache-mb", "0", *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, cwd=src)
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"(http://[\d.]+:\d+)/  \(OpenAI", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("the server did not start: " + proc.stderr.read())


def start_llama_server(python: str, gguf: str, threads: int,
                       n_ctx: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", gguf, "--n_threads",
                             str(threads), "--n_threads_batch", str(threads), "--n_ctx",
                             str(n_ctx), "--port", str(port), "--host", "127.0.0.1",
                             "--verbose", "False", "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama_cpp.server did not start (is llama-cpp-python[server] installed in "
                     f"{python}?)")


SAMPLING: dict = {"temperature": 0}  # the requests' sampling settings (--sampling)


def one_request(http: httpx.Client, url: str, model: str, prompt: str, n_gen: int,
                ban: int | None = None, chat: bool = False) -> dict:
    body = {"model": model, "max_tokens": n_gen, **SAMPLING, "stream": True}
    if chat:  # a task: the model's own template, and its answer ends where it ends
        body.update(messages=[{"role": "user", "content": prompt}],
                    stream_options={"include_usage": True})
    else:
        body["prompt"] = prompt
        if ban is None:
            body.update(ignore_eos=True, stream_options={"include_usage": True})
        else:  # llama_cpp.server: EOS banned instead
            body["logit_bias"] = {str(ban): -100.0}
    t0 = time.perf_counter()
    first = None
    usage = None
    chunks = 0
    text = []
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with http.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"]:
                chunks += 1
                c = chunk["choices"][0]
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if piece:
                    text.append(piece)
                if first is None and piece:
                    first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks - (ban is not None)  # its final chunk
    return {"ttft": (first or end) - t0, "tokens": n, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "decode_tps": (n - 1) / (end - first) if first and end > first and n > 1 else 0.0}


def run_level(url: str, model: str, clients: int, per_client: int, n_gen: int,
              seq: int, ban: int | None = None, tasks: list[str] | None = None) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(k: int):
        try:
            with httpx.Client(timeout=600) as http:
                for r in range(per_client):
                    i = seq + k * per_client + r
                    if tasks:
                        prompt = tasks[i % len(tasks)]
                    else:
                        prompt = (f"Request {i}: write a short paragraph about "
                                  f"{SUBJECTS[i % len(SUBJECTS)]}.")
                    out = one_request(http, url, model, prompt, n_gen, ban, chat=bool(tasks))
                    out["i"] = i
                    with lock:
                        results.append(out)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pocket = ban is None
    before = httpx.get(url + "/health").json() if pocket else {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    after = httpx.get(url + "/health").json() if pocket else {}
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "agg_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "req_decode_tok_s": statistics.median(r["decode_tps"] for r in results),
        "n_prompt": statistics.mean(r["prompt_tokens"] for r in results),
        "requests": len(results),
        "answers": {r["i"]: r["text"] for r in results},
        # rows per batched decode step (the first token of a request comes from its prefill)
        "mean_batch": ((sum(r["tokens"] for r in results) - len(results))
                       / max(1, after["steps"] - before["steps"])) if pocket else None,
        # the server's engine time in prompt chunks against decode steps, and (speculative)
        # the decode tokens/s its batched steps measured with and without drafts
        "prefill_share": _share(before, after) if pocket else None,
        # the share of the wall time the engine was busy (the rest: HTTP, streaming, clients)
        "engine_busy": _busy(before, after, wall) if pocket else None,
        "draft_gate": after.get("draft_gate") if pocket else None,
    }


def _busy(before: dict, after: dict, wall: float) -> float:
    return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in ("prefill_s", "decode_s")) / wall


def _share(before: dict, after: dict) -> float | None:
    p = after.get("prefill_s", 0.0) - before.get("prefill_s", 0.0)
    d = after.get("decode_s", 0.0) - before.get("decode_s", 0.0)
    return p / (p + d) if p + d > 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--gen", type=int, default=64, help="tokens per request (EOS ignored)")
    ap.add_argument("--requests", type=int, default=32,
                    help="requests per level (at least 2 per client)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per level (medians)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--vs", choices=["llama.cpp"], help="also load llama-cpp-python's server")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="the Python with llama-cpp-python[server] (default: this one)")
    ap.add_argument("--ctx", type=int, default=4096, help="context of both servers")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--tasks", choices=["free", "grounded"], default="free",
                    help="free: short paragraphs on a subject (EOS ignored, --gen tokens); "
                    "grounded: the input-grounded chat tasks of benchmarks/speculative.py "
                    "(answers end where the model ends them, at most --gen tokens)")
    ap.add_argument("--speculative", action="store_true",
                    help="also serve with --speculative lookup, alternating with the plain "
                    "server; its answers must equal the plain server's")
    ap.add_argument("--sampling", nargs="+", metavar="NAME=VALUE", default=[],
                    help="the requests' sampling settings (default temperature=0), e.g. "
                    "temperature=1 top_p=0.95 seed=1; every engine gets the same")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also serve pocketlm from another checkout (its extension built "
                    "there), e.g. a git worktree of an earlier revision: before / after in "
                    "one run, alternating")
    args = ap.parse_args()
    for item in args.sampling:
        name, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--sampling takes NAME=VALUE, got {item!r}")
        SAMPLING[name] = json.loads(value)

    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.registry import resolve

    servers = {"pocketlm": start_server(args.model, args.threads, args.max_batch, args.ctx)}
    if args.speculative:
        servers["pocketlm+lookup"] = start_server(args.model, args.threads, args.max_batch,
                                                  args.ctx, ("--speculative", "lookup"))
    if args.baseline:
        servers["pocketlm@baseline"] = start_server(args.model, args.threads, args.max_batch,
                                                    args.ctx, src=args.baseline)
    tasks = None
    if args.tasks == "grounded":
        from benchmarks.speculative import tasks as grounded

        tasks = [t["prompt"] for t in grounded() if t["kind"] == "grounded"]
    ban = None
    if args.vs:
        gguf = str(resolve(args.model))
        ban = pocketlm.load(args.model).tokenizer.eos_ids[0]
        servers["llama.cpp"] = start_llama_server(args.llama_python, gguf, args.threads,
                                                  args.ctx)
    try:
        rows = {(e, c): [] for e in servers for c in args.clients}
        def pocket(e):
            return e.startswith("pocketlm")

        for e, (_, url) in servers.items():  # warm-up
            run_level(url, args.model, 1, 2, 8, 10_000, None if pocket(e) else ban, tasks)
        seq = 0
        for rnd in range(args.rounds):
            order = args.clients if rnd % 2 == 0 else list(reversed(args.clients))
            for c in order:
                engines = list(servers) if rnd % 2 == 0 else list(reversed(servers))
                per = max(2, args.requests // c)
                for e in engines:  # the same prompts for both engines
                    rows[e, c].append(run_level(servers[e][1], args.model, c, per, args.gen,
                                                seq, None if pocket(e) else ban, tasks))
                if "pocketlm+lookup" in servers:  # speculation changes no answer
                    a = rows["pocketlm", c][-1]["answers"]
                    b = rows["pocketlm+lookup", c][-1]["answers"]
                    if a != b:
                        raise SystemExit(f"speculative answers differ at {c} clients")
                seq += c * per
        lines = []
        for (e, c), rs in rows.items():
            def med(key, rs=rs):
                return round(statistics.median(r[key] for r in rs), 3)

            lines.append({
                "bench": "serve_load", "command": " ".join([Path(sys.executable).name]
                                                            + sys.argv),
                "machine": machine_info(), "model": args.model, "engine": e,
                "threads": args.threads, "ctx": args.ctx, "clients": c,
                "max_batch": args.max_batch if pocket(e) else 1, "tasks": args.tasks,
                "sampling": SAMPLING, "baseline": args.baseline if e == "pocketlm@baseline"
                else None,
                "requests": rs[0]["requests"], "rounds": len(rs), "n_gen": args.gen,
                "n_prompt": round(statistics.mean(r["n_prompt"] for r in rows["pocketlm", c]), 1),
                "agg_tok_s": med("agg_tok_s"), "ttft_p50_s": med("ttft_p50_s"),
                "ttft_p95_s": med("ttft_p95_s"), "req_decode_tok_s": med("req_decode_tok_s"),
                "mean_batch": med("mean_batch") if pocket(e) else None,
                "prefill_share": med("prefill_share") if pocket(e) else None,
                "engine_busy": med("engine_busy") if pocket(e) else None,
                "draft_gate": rs[-1]["draft_gate"] if e == "pocketlm+lookup" else None,
                "agg_tok_s_rounds": [round(r["agg_tok_s"], 1) for r in rs],
            })
        for line in lines:
            print(json.dumps(line, ensure_ascii=False), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                for line in lines:
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
