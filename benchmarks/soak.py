"""Sustained use: back-to-back calls for minutes, through the API and through `pocket serve`.

The report this project follows asks for "continuous calls and multitask concurrency" to be
measured for latency and power over time, not only one call at a time. This script runs two
phases, one after the other, in one invocation:

* ``api``: one process loads the model with ``pocketlm.load`` and generates back to back
  (``--api-callers`` threads sharing the model, distinct chat prompts, greedy, ``--gen`` tokens
  with EOS ignored, through :func:`pocketlm.generate.stream_tokens`) for ``--minutes`` minutes;
* ``server``: `pocket serve` in a subprocess (its default engine settings) gets
  ``--clients`` concurrent streaming clients sending /v1/completions back to back
  (EOS ignored, ``--gen`` tokens) for ``--minutes`` minutes.

Every call records its wall time (latency) and its decode rate; every ``--window`` seconds the
process that runs the model is sampled for its resident set (VmRSS) and CPU seconds
(utime + stime), giving the CPU-seconds per call and an energy estimate of CPU-seconds x
``--watts-per-core`` (labelled an estimate: RAPL is read instead where the machine has it).

Output, JSON lines (also appended to ``--out``): one ``window`` line per phase and window
(calls, tokens/s median, p50/p95 latency, RSS, CPU-s and joules per call) and one ``summary``
line per phase: the drift of the median tokens/s from the first windows after warm-up to the
last ones (percent), and the RSS growth after warm-up (MiB). ``--table FILE`` prints the
markdown table of docs/soak.md from such a file.

    python benchmarks/soak.py --minutes 10 --out benchmarks/soak.jsonl
    python benchmarks/soak.py --phases server --clients 8 --minutes 5
    python benchmarks/soak.py --table benchmarks/soak.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_load import SUBJECTS, one_request, start_server  # noqa: E402  (a sibling script)

CLK_TCK = os.sysconf("SC_CLK_TCK")
RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")


def proc_sample(pid: int) -> tuple[float, float]:
    """(resident set in MiB, CPU seconds so far) of process ``pid``."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    # fields after the ')' that ends the command name: utime and stime are the 12th and 13th
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return rss_kb / 1024, cpu


def read_rapl() -> int | None:
    try:
        return int(RAPL.read_text())
    except (OSError, ValueError):
        return None


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Recorder:
    """Calls as they finish, cut into windows with a process sample at each window's end."""

    def __init__(self, pid: int, window: float, watts_per_core: float):
        self.pid, self.window, self.watts = pid, window, watts_per_core
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.windows: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.perf_counter()
        self._rss0, self._cpu0 = proc_sample(pid)
        self._energy0 = read_rapl()

    def add(self, call: dict) -> None:
        with self.lock:
            self.calls.append(call)

    def record_while(self, workers: list) -> None:
        """Run ``workers[k](k)`` in threads of their own, sampling until all have returned."""
        sampler = threading.Thread(target=self.run, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=w, args=(k,)) for k, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.stop.set()
        sampler.join()

    def run(self) -> None:
        """Sample until ``stop`` is set (in its own thread)."""
        cpu_prev, rapl_prev = self._cpu0, self._energy0
        while not self.stop.wait(self.window):
            rss, cpu = proc_sample(self.pid)
            energy = read_rapl()
            with self.lock:
                calls, self.calls = self.calls, []
            row = {"t_s": round(time.perf_counter() - self.t0, 1), "calls": len(calls),
                   "rss_mb": round(rss, 1)}
            if calls:
                cpu_per_call = (cpu - cpu_prev) / len(calls)
                row.update(
                    tok_s=round(statistics.median(c["tok_s"] for c in calls), 1),
                    latency_p50_s=round(percentile([c["latency"] for c in calls], 0.5), 3),
                    latency_p95_s=round(percentile([c["latency"] for c in calls], 0.95), 3),
                    tokens=sum(c["tokens"] for c in calls),
                    cpu_s_per_call=round(cpu_per_call, 3),
                )
                if energy is not None and rapl_prev is not None and energy >= rapl_prev:
                    row["joules_per_call"] = round((energy - rapl_prev) / 1e6 / len(calls), 3)
                    row["energy_method"] = "rapl (package, measured)"
                else:
                    row["joules_per_call"] = round(cpu_per_call * self.watts, 3)
                    row["energy_method"] = f"estimate: CPU-s x {self.watts} W per core"
            self.windows.append(row)
            cpu_prev, rapl_prev = cpu, energy


def summarize(windows: list[dict], warmup: int) -> dict:
    """Drift of tokens/s and RSS growth over the windows after the first ``warmup`` ones."""
    steady = [w for w in windows[warmup:] if w.get("calls")]
    if len(steady) < 2:
        return {"windows": len(windows), "note": "too few windows after warm-up"}
    k = max(1, len(steady) // 4)  # first and last quarter of the steady windows
    first = statistics.median(w["tok_s"] for w in steady[:k])
    last = statistics.median(w["tok_s"] for w in steady[-k:])
    rss = [w["rss_mb"] for w in steady]
    return {
        "windows": len(windows), "warmup_windows": warmup, "calls": sum(w["calls"] for w in
                                                                     windows),
        "tok_s_first": first, "tok_s_last": last,
        "tok_s_drift_pct": round(100 * (last - first) / first, 2) if first else None,
        "rss_first_mb": rss[0], "rss_last_mb": rss[-1], "rss_max_mb": max(rss),
        "rss_growth_mb": round(rss[-1] - rss[0], 1),
        "latency_p50_s": statistics.median(w["latency_p50_s"] for w in steady),
        "latency_p95_s": max(w["latency_p95_s"] for w in steady),
        "cpu_s_per_call": round(statistics.median(w["cpu_s_per_call"] for w in steady), 3),
        "joules_per_call": round(statistics.median(w["joules_per_call"] for w in steady), 3),
        "energy_method": steady[-1]["energy_method"],
    }


def prompt(i: int) -> str:
    return f"Request {i}: write a short paragraph about {SUBJECTS[i % len(SUBJECTS)]}."


def api_phase(args) -> tuple[Recorder, dict]:
    import pocketlm
    from pocketlm.generate import stream_tokens
    from pocketlm.sampling import Sampler, SamplingParams

    m = pocketlm.load(args.model)
    rec = Recorder(os.getpid(), args.window, args.watts_per_core)
    deadline = time.perf_counter() + 60 * args.minutes
    seq = iter(range(10**9))
    seq_lock = threading.Lock()

    def caller() -> None:
        while time.perf_counter() < deadline:
            with seq_lock:
                i = next(seq)
            t0 = time.perf_counter()
            first = None
            n = 0
            ids = m.chat_ids([{"role": "user", "content": prompt(i)}])
            cache = m.runtime.new_cache(len(ids) + args.gen)
            for _ in stream_tokens(m.runtime, cache, ids, max_tokens=args.gen,
                                   sampler=Sampler(SamplingParams()), stop_ids=()):
                n += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            rec.add({"latency": end - t0, "tokens": n,
                     "tok_s": (n - 1) / (end - first) if first and n > 1 else 0.0})

    rec.record_while([lambda k: caller() for _ in range(args.api_callers)])
    return rec, {"callers": args.api_callers}


def server_phase(args) -> tuple[Recorder, dict]:
    import httpx

    proc, url = start_server(args.model, args.threads, args.max_batch, args.ctx)
    try:
        rec = Recorder(proc.pid, args.window, args.watts_per_core)
        deadline = time.perf_counter() + 60 * args.minutes
        errors: list[BaseException] = []

        def client(k: int) -> None:
            try:
                with httpx.Client(timeout=600) as http:
                    i = k
                    while time.perf_counter() < deadline:
                        t0 = time.perf_counter()
                        out = one_request(http, url, args.model, prompt(i), args.gen)
                        rec.add({"latency": time.perf_counter() - t0, "tokens": out["tokens"],
                                 "tok_s": out["decode_tps"]})
                        i += args.clients
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        rec.record_while([client] * args.clients)
        health = httpx.get(url + "/health").json()
        if errors:
            raise errors[0]
        return rec, {"clients": args.clients, "max_batch": args.max_batch,
                     "server_health": health}
    finally:
        proc.terminate()
        proc.wait(30)


def table(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = ["| phase | load | minutes | calls | tok/s first → last (drift) | RSS first → last "
           "(growth) | latency p50 / p95 | CPU-s / call | J / call |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") != "summary" or "tok_s_drift_pct" not in r:
            continue
        load = (f"{r['clients']} clients" if r["phase"] == "server"
                else f"{r['callers']} caller(s)")
        out.append(
            f"| {r['phase']} | {load} | {r['minutes']} | {r['calls']} | {r['tok_s_first']:.1f} → "
            f"{r['tok_s_last']:.1f} ({r['tok_s_drift_pct']:+.1f} %) | {r['rss_first_mb']:.0f} → "
            f"{r['rss_last_mb']:.0f} MiB ({r['rss_growth_mb']:+.1f}) | {r['latency_p50_s']:.2f} / "
            f"{r['latency_p95_s']:.2f} s | {r['cpu_s_per_call']:.2f} | {r['joules_per_call']:.2f}"
            f" ({'RAPL' if 'rapl' in r['energy_method'] else 'est.'}) |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--phases", nargs="+", choices=["api", "server"], default=["api", "server"])
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes per phase (default 10)")
    ap.add_argument("--gen", type=int, default=64, help="tokens per call at most (default 64)")
    ap.add_argument("--api-callers", type=int, default=1,
                    help="threads calling the one loaded model in the api phase (default 1)")
    ap.add_argument("--clients", type=int, default=4, help="server clients (default 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--window", type=float, default=30.0, help="seconds per window (default 30)")
    ap.add_argument("--warmup-windows", type=int, default=1,
                    help="windows left out of the drift and growth figures (default 1)")
    ap.add_argument("--watts-per-core", type=float, default=3.0,
                    help="power of one busy core for the energy estimate without RAPL")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--table", metavar="FILE", help="print the markdown table of FILE and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return 0

    os.environ.setdefault("POCKET_THREADS", str(args.threads))
    from pocketlm.bench import machine_info

    common = {"bench": "soak", "command": "python benchmarks/" + " ".join(
        [Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": machine_info(),
        "model": args.model, "threads": args.threads, "n_gen": args.gen,
        "minutes": args.minutes, "window_s": args.window}
    sink = open(args.out, "a", encoding="utf-8") if args.out else None  # noqa: SIM115
    try:
        for phase in args.phases:
            rec, extra = (api_phase if phase == "api" else server_phase)(args)
            for w in rec.windows:
                emit({**common, "kind": "window", "phase": phase, **w}, sink)
            emit({**common, "kind": "summary", "phase": phase, **extra,
                  **summarize(rec.windows, args.warmup_windows)}, sink)
    finally:
        if sink:
            sink.close()
    return 0


def emit(row: dict, sink) -> None:
    line = json.dumps(row, ensure_ascii=False)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")
        sink.flush()


if __name__ == "__main__":
    sys.exit(main())
