"""pocketlm against llama.cpp on the three registry models (JSON lines, one per engine).

    python benchmarks/vs_llamacpp.py [--models ...] [--threads 2] >> benchmarks/vs_llamacpp.jsonl
    python benchmarks/vs_llamacpp.py --keep-precision ...   # the quality-parity deploy files
    python benchmarks/vs_llamacpp.py --table benchmarks/vs_llamacpp.jsonl   # markdown table

llama.cpp is llama-cpp-python, built for the machine's CPU features (see the README's
benchmark section); both engines get the same prompt ids, alternate run by run, and run in
their own processes (`pocket bench --vs llama.cpp`).

The default deploy file stores every matrix in INT4. gemma3-270m's and qwen2.5-0.5b's GGUFs keep
most matrices at 5-8 bits, so their default packs are smaller and less accurate than what
llama.cpp runs (docs/accuracy.md); `--keep-precision` benchmarks the packs that keep those
tensors (Q5_0 in INT5, Q6_K/Q8_0 in INT8: top-1 agreement with the float model 97-99 %), i.e.
at quality parity or above.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]


def run(models: list[str], threads: int, runs: int, keep_precision: bool) -> None:
    import llama_cpp

    import pocketlm
    from pocketlm.bench import bench
    from pocketlm.registry import resolve
    from pocketlm.runtime.kernels import native

    pack = "int4 g32, embed int8" + (", keep-precision (q5_0 int5, q6_k/q8_0 int8)"
                                      if keep_precision else "")
    for name in models:
        if keep_precision:  # the pack's path, its GGUF for llama.cpp
            target = pocketlm.load(name, keep_precision=True, quiet=False).path
            results = bench(str(target), threads=threads, runs=runs, vs=["llama.cpp"],
                            gguf=str(resolve(name)))
        else:
            results = bench(name, threads=threads, runs=runs, vs=["llama.cpp"])
        for r in results:
            row = json.loads(r.to_json())
            row["model"] = name
            row["pack"] = pack if r.engine == "pocketlm" else "gguf as published"
            row["date"] = time.strftime("%Y-%m-%d %H:%M")
            row["engine_version"] = ("llama-cpp-python " + llama_cpp.__version__
                                     if r.engine == "llama.cpp"
                                     else "pocketlm native " + native.cpu_features()["selected"]
                                     + (" + amx-bf16 prefill" if native.amx_setting("q8") else ""))
            row["command"] = " ".join(sys.argv)
            print(json.dumps(row), flush=True)


# -- markdown (shared with vs_mnn.py) -----------------------------------------------------------
ENGINE_HEADER = ("| model | engine | weights | prefill tok/s (min–max) | decode tok/s (min–max) | "
                 "peak RSS Δ MB | file MB | load s | energy J (est.) |\n"
                 "|---|---|---|---|---|---|---|---|---|")


def engine_row(r: dict, pack: str) -> str:
    return (f"| {r['model']} | {r['engine']} | {pack} | {r['prefill_tps']:.0f} "
            f"({r['prefill_tps_min']:.0f}–{r['prefill_tps_max']:.0f}) | {r['decode_tps']:.0f} "
            f"({r['decode_tps_min']:.0f}–{r['decode_tps_max']:.0f}) | "
            f"{r['peak_rss_delta_mb']:.0f} | {r['file_mb']:.0f} | {r['load_s']:.2f} | "
            f"{r['energy_j_est']:.2f} |")


def ratio_row(model: str, label: str, a: dict, b: dict) -> str:
    """pocketlm's row `a` over another engine's `b`."""
    return (f"| {model} | {label} | ×{a['prefill_tps'] / b['prefill_tps']:.2f} | "
            f"×{a['decode_tps'] / b['decode_tps']:.2f} | "
            f"×{a['peak_rss_delta_mb'] / b['peak_rss_delta_mb']:.2f} |")


def machine_line(rows: list[dict]) -> str:
    r0 = rows[0]
    return (f"machine: {r0['machine']['cpu']}, {r0['machine']['cores']} CPUs; threads "
            f"{r0['threads']}; prompt {r0['n_prompt']} tokens, {r0['n_gen']} generated; median "
            f"of {r0['runs']} runs after 1 warm-up; energy: {r0['energy_method']}")


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    print(ENGINE_HEADER)
    pairs = []  # (pocketlm row, the llama.cpp row of the same bench call)
    ours = None
    for r in rows:
        pack = r.get("pack", "int4 g32, embed int8" if r["engine"] == "pocketlm" else
                     "gguf as published")
        if r["engine"] == "pocketlm":
            ours = r
        elif ours is not None and ours["model"] == r["model"]:
            pairs.append((ours, r))
        print(engine_row(r, pack))
    print()
    print("| model | pocketlm weights | prefill ratio | decode ratio | peak memory ratio |")
    print("|---|---|---|---|---|")
    for a, b in pairs:
        print(ratio_row(a["model"], a.get("pack", "int4 g32, embed int8"), a, b))
    print("\n" + machine_line(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep-precision", action="store_true",
                    help="benchmark the packs that keep the source's 5-8-bit tensors (Q5_0 in "
                    "INT5, wider types in INT8)")
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of a results file")
    args = ap.parse_args()
    if args.table:
        table(args.table)
    else:
        run(args.models, args.threads, args.runs, args.keep_precision)


if __name__ == "__main__":
    main()
