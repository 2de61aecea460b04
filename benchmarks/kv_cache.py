"""The engine's KV cache formats side by side: float16 (the default) against int8 (JSON lines).

For each model and format, with the engine's default int8 activations: top-1 agreement and mean
KL of the logits against the numpy float reference (float32 cache) on 256 tokens of
tests/data/english.txt and chinese.txt, once as one prefill and once as a 128-token prefill
followed by 128 one-token steps (the decode attention); then decode speed at the bench's
lengths (a 512-token prompt, 128 tokens decoded one at a time), the formats alternating run by
run in one process, 1 warm-up and --runs measured runs each, medians and their ratio; and the
cache's bytes for those 640 positions.

Where llama-cpp-python is installed, the same texts through llama.cpp on the registry GGUF with its
float16 cache and with its q8_0 cache (blocks of 32, flash attention on for both): how often its
q8_0 cache changes its own greedy tokens, next to how often pocketlm's int8 cache changes
pocketlm's (``*_vs_f16_top1``).

    python benchmarks/kv_cache.py [--models smollm2-135m ...] [--runs 5] >> benchmarks/kv_cache.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amx_prefill import _log_softmax  # noqa: E402

import pocketlm  # noqa: E402
from pocketlm.bench import machine_info  # noqa: E402
from pocketlm.llamacpp import LlamaCpp  # noqa: E402
from pocketlm.llamacpp import available as llamacpp_available  # noqa: E402
from pocketlm.runtime import Runtime  # noqa: E402
from pocketlm.runtime.kernels import native  # noqa: E402

FORMATS = ("f16", "q8")
GGML_TYPE_F16, GGML_TYPE_Q8_0 = 1, 8


def _engine(m, kv: str, threads: int) -> Runtime:
    rt = Runtime(m.config, m.runtime.w, engine="numpy")
    rt.native = native.NativeEngine(m.config, m.runtime.w, act="q8", kv=kv, threads=threads)
    return rt


def _logits(rt: Runtime, ids: list[int], split: int) -> np.ndarray:
    cache = rt.new_cache(len(ids))
    rows = [rt.forward(ids[:split], cache, all_logits=True)]
    rows += [rt.forward([t], cache, all_logits=True) for t in ids[split:]]
    return np.concatenate(rows)


def _llama_cpp_logits(name: str, ids: list[int], type_kv: int, threads: int) -> np.ndarray:
    from pocketlm.registry import pull

    llm = LlamaCpp(pull(name, quiet=True), n_ctx=512, threads=threads, logits_all=True,
                   flash_attn=True, kv_type=type_kv)
    return llm.logits(ids)


def run(name: str, runs: int, threads: int, n_prompt: int, n_gen: int) -> dict:
    m = pocketlm.load(name, quiet=True)
    engines = {kv: _engine(m, kv, threads) for kv in FORMATS}
    row = {"command": " ".join(["python"] + sys.argv), "machine": machine_info(), "model": name,
           "threads": threads, "kernel_level": native.cpu_features()["selected"],
           "amx": engines["q8"].native.amx, "k_smooth": bool(engines["q8"].native.k_smooth),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    for text in ("english", "chinese"):
        ids = m.tokenize((ROOT / "tests" / "data" / f"{text}.txt").read_text("utf-8"))[:256]
        ref = Runtime(m.config, m.runtime.w, engine="numpy")
        expected = ref.forward(ids, ref.new_cache(len(ids)), all_logits=True)
        lp_ref = _log_softmax(expected)
        top = {}
        for kv, rt in engines.items():
            for how, split in (("prefill", len(ids)), ("decode", 128)):
                got = _logits(rt, ids, split)
                key = f"{text}_{how}_{kv}"
                top[how, kv] = got.argmax(-1)
                row[key + "_top1"] = float((top[how, kv] == expected.argmax(-1)).mean())
                row[key + "_kl"] = float(
                    (np.exp(lp_ref) * (lp_ref - _log_softmax(got))).sum(-1).mean())
        row[f"{text}_pocketlm_q8_vs_f16_top1"] = float(
            (top["prefill", "q8"] == top["prefill", "f16"]).mean())
        if llamacpp_available():
            f16, q8 = (_llama_cpp_logits(name, ids, t, threads).argmax(-1)
                       for t in (GGML_TYPE_F16, GGML_TYPE_Q8_0))
            row[f"{text}_llama_cpp_q8_0_vs_f16_top1"] = float((q8 == f16).mean())
    ids = (m.tokenize((ROOT / "tests" / "data" / "english.txt").read_text("utf-8")) * 8)[:n_prompt]
    tps: dict[str, list[float]] = {kv: [] for kv in FORMATS}
    for r in range(runs + 1):
        for kv in FORMATS:
            rt = engines[kv]
            cache = rt.new_cache(n_prompt + n_gen)
            logits = rt.forward(ids, cache)
            t = time.perf_counter()
            for _ in range(n_gen):
                logits = rt.forward([int(np.argmax(logits))], cache)
            if r:  # the first round warms up
                tps[kv].append(n_gen / (time.perf_counter() - t))
    row.update(n_prompt=n_prompt, n_gen=n_gen, runs=runs)
    for kv in FORMATS:
        row[f"decode_tps_{kv}"] = statistics.median(tps[kv])
        row[f"kv_mb_{kv}"] = engines[kv].cache_nbytes(n_prompt + n_gen) / 1e6
    row["decode_q8_over_f16"] = row["decode_tps_q8"] / row["decode_tps_f16"]
    row["decode_runs"] = tps
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    args = ap.parse_args()
    if not native.engine_available():
        sys.exit("kv_cache: the native engine is not built")
    for name in args.models:
        print(json.dumps(run(name, args.runs, args.threads, args.n_prompt, args.n_gen)),
              flush=True)


if __name__ == "__main__":
    main()
