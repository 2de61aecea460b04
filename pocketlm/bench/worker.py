"""One engine in its own process, driven over stdin/stdout with JSON lines.

A fresh process per engine makes the peak-memory figure that engine's own: the resident set is
read after the engine's library is imported and just before the model is loaded (the baseline),
and the peak (VmHWM, started again from the baseline) at the end. Commands:

    {"cmd": "run", "ids": [...], "n_gen": 128}  -> {"prefill_s", "decode_s", "cpu_s", "n_gen"}
    {"cmd": "stats"}                             -> {"peak_rss_mb", "baseline_rss_mb", ...}
    {"cmd": "quit"}

    python -m pocketlm.bench.worker ENGINE MODEL_PATH THREADS N_CTX

The JSON lines go out on a copy of the standard output; file descriptor 1 itself is pointed at
standard error, so what a native library prints (MNN prints its CPU features) cannot break them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cpu_seconds() -> float:
    return time.process_time()  # every thread of this process, nanosecond clock


def _reset_peak() -> None:
    """Start VmHWM again from the resident set now (Linux 4.0+), so that the peak is the one
    reached after the baseline: an import that peaked and freed before it was counted in
    every engine's peak. Where the kernel refuses, the lifetime peak stands."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


class PocketEngine:
    name = "pocketlm"

    def __init__(self, path: str, threads: int, n_ctx: int):
        os.environ["POCKET_THREADS"] = str(threads)
        import numpy as np

        import pocketlm
        import pocketlm.api  # noqa: F401 (imported before the baseline, as llama.cpp's is:
        # its 8 MB and 0.07 s counted as loading the model, in the peak and the load time)

        self.np = np
        self.pocketlm = pocketlm
        self.path, self.n_ctx = path, n_ctx
        self.cache = None

    def load(self, stages: list) -> None:
        from pocketlm.api import load_pocket

        def stage(name: str) -> None:
            stages.append([name, _status_kb("VmRSS") / 1024, _status_kb("VmHWM") / 1024])

        self.model = load_pocket(self.path, n_ctx=self.n_ctx, on_stage=stage)
        self.runtime = self.model.runtime

    def run(self, ids: list[int], n_gen: int, speculative=None) -> tuple[float, float]:
        np = self.np
        # one KV cache for every run, emptied between them, as the other engines keep theirs
        if self.cache is None or self.cache.capacity < len(ids) + n_gen + 1:
            self.cache = self.runtime.new_cache(len(ids) + n_gen + 1)
        cache = self.cache
        cache.reset()
        if speculative:
            return self._run_speculative(ids, n_gen, speculative)
        # greedy, end-of-sequence ignored: the largest logit is all that is read, so the head
        # is screened as greedy generation screens it (docs/engine.md, "Head screening")
        out = self.last_ids = []
        t0 = time.perf_counter()
        logits = self.runtime.forward(ids, cache, screen=True)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            out.append(int(np.argmax(logits)))
            logits = self.runtime.forward(out[-1:], cache, screen=True)
        t2 = time.perf_counter()
        out.append(int(np.argmax(logits)))  # n_gen + 1 tokens, as the speculative run gives
        return t1 - t0, t2 - t1

    def _run_speculative(self, ids: list[int], n_gen: int, spec) -> tuple[float, float]:
        """The same greedy tokens (end-of-sequence ignored), decoded speculatively: the
        prompt and first token, then ``n_gen`` more, timed as the plain run is."""
        from pocketlm.generate import Sequence
        from pocketlm.sampling import Sampler, SamplingParams
        from pocketlm.speculative import SpeculativeStats, run_speculative

        drafter, lengths = self.model._drafter(spec)
        seq = Sequence(ids, max_tokens=n_gen + 1, sampler=Sampler(SamplingParams()),
                       stop_ids=(), ignore_eos=True)
        self.last_stats = SpeculativeStats()
        t0 = time.perf_counter()
        t1 = None
        for _ in run_speculative(self.runtime, self.cache, seq, drafter, lengths,
                                 self.last_stats):
            if t1 is None:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        self.last_ids = list(seq.state.generated)
        return t1 - t0, t2 - t1


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int):
        import numpy as np

        from pocketlm.llamacpp import import_llama_cpp

        import_llama_cpp()  # the library is in the baseline, as the other engines' are
        self.np = np
        self.path, self.threads, self.n_ctx = path, threads, n_ctx

    def load(self, stages: list) -> None:
        from pocketlm.llamacpp import LlamaCpp

        self.llm = LlamaCpp(self.path, n_ctx=self.n_ctx, n_batch=512, n_ubatch=512,
                            threads=self.threads, batch_threads=self.threads)

    def run(self, ids: list[int], n_gen: int) -> tuple[float, float]:
        llm, np = self.llm, self.np
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(n_gen):  # greedy, end-of-sequence ignored
            llm.eval([int(np.argmax(llm.last_logits()))])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


# MNN's settings for CPU speed (its LLM docs): fp16 where the CPU has it, runtime quantization
# (int8 activations against the 4-bit weights), flash attention with an fp16 KV cache.
MNN_CONFIG = {"backend_type": "cpu", "precision": "low", "memory": "low", "attention_mode": 8}


class MnnEngine:
    name = "mnn"

    def __init__(self, path: str, threads: int, n_ctx: int):
        import MNN.llm as mnn_llm  # only MNN.llm: importing MNN.tools pip-installs a logging SDK
        import numpy as np

        self.mnn_llm, self.np = mnn_llm, np
        self.path, self.threads = path, threads

    def load(self, stages: list) -> None:
        config = os.path.join(self.path, "config.json") if os.path.isdir(self.path) else self.path
        self.llm = self.mnn_llm.create(config)
        self.llm.set_config({**MNN_CONFIG, "thread_num": self.threads})
        self.llm.load()

    def run(self, ids: list[int], n_gen: int) -> tuple[float, float]:
        llm, np = self.llm, self.np
        llm.reset()  # drops the KV cache: the next forward is a prefill from position 0
        t0 = time.perf_counter()
        logits = llm.forward(ids)  # the last position's; read() is a view: keep the Var alive
        token = int(np.argmax(logits.read()))
        t1 = time.perf_counter()
        for _ in range(n_gen):  # greedy, end-of-sequence ignored
            logits = llm.forward([token])
            token = int(np.argmax(logits.read()))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


ENGINES = {"pocketlm": PocketEngine, "llama.cpp": LlamaCppEngine, "mnn": MnnEngine}


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: the parent stops the run and closes this
    # process (a traceback from every worker, before)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine_name, path, threads, n_ctx = argv[0], argv[1], int(argv[2]), int(argv[3])
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # native libraries' prints go to stderr (see above)
    try:
        engine = ENGINES[engine_name](path, threads, n_ctx)
        _reset_peak()
        baseline = _status_kb("VmRSS")
        stages: list = []
        t0 = time.perf_counter()
        engine.load(stages)
        load_s = time.perf_counter() - t0
        stages.append(["loaded", _status_kb("VmRSS") / 1024, _status_kb("VmHWM") / 1024])
    except Exception as exc:  # reported to the parent as one line
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True, "load_s": load_s,
                          "baseline_rss_mb": baseline / 1024}) + "\n")
    out.flush()
    try:
        return _serve(engine, out, baseline, load_s, stages)
    except BrokenPipeError:  # the parent has gone (SIGTERM, killed): nothing left to tell it
        return 1
    except Exception as exc:  # reported to the parent as one line, as a load error is
        with contextlib.suppress(OSError):
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            out.flush()
        return 1


def _serve(engine, out, baseline: int, load_s: float, stages: list) -> int:
    """Answer the parent's commands (one JSON line each) until it says quit."""
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "run":
            first = not any(name == "first run" for name, *_ in stages)
            c0 = _cpu_seconds()
            if msg.get("speculative"):
                prefill_s, decode_s = engine.run(msg["ids"], msg["n_gen"], msg["speculative"])
            else:
                prefill_s, decode_s = engine.run(msg["ids"], msg["n_gen"])
            reply = {"prefill_s": prefill_s, "decode_s": decode_s,
                     "cpu_s": _cpu_seconds() - c0, "n_gen": msg["n_gen"]}
            if msg.get("speculative"):
                reply["speculative"] = engine.last_stats.as_dict()
            if getattr(engine, "last_ids", None) is not None:  # pocketlm's greedy tokens
                reply["ids"] = engine.last_ids
            if first:  # KV cache and scratch of a full-length call
                stages.append(["first run", _status_kb("VmRSS") / 1024,
                               _status_kb("VmHWM") / 1024])
        elif msg["cmd"] == "stats":
            reply = {"peak_rss_mb": _status_kb("VmHWM") / 1024,
                     "rss_mb": _status_kb("VmRSS") / 1024,
                     "baseline_rss_mb": baseline / 1024, "load_s": load_s,
                     "stages": stages}
        else:
            return 0
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
