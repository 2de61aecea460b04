"""pocketlm against MNN (and llama.cpp when installed) on the three registry models (JSON lines,
one per engine).

    scripts/export-mnn smollm2-135m        # once per model: the MNN export in $POCKET_HOME/mnn
    python benchmarks/vs_mnn.py [--models ...] [--threads 2] >> benchmarks/vs_mnn.jsonl
    python benchmarks/vs_mnn.py --table benchmarks/vs_mnn.jsonl   # markdown table
    python benchmarks/vs_mnn.py --table FILE.jsonl --call 2   # the second call of each model

MNN is the MNN 3.6.1 wheel (`MNN.llm`, CPU backend, precision and memory "low": its settings for
speed) on an export with 4-bit weights in blocks of 64 and the lm head and embedding in 8 bits
(`scripts/export-mnn --help`). Every engine gets the same prompt ids, decodes greedily with
end-of-sequence ignored, runs in its own process, and the engines alternate run by run
(`pocket bench --vs mnn llama.cpp`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from importlib.metadata import version

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]
PACKS = {"mnn": "int4 b64 asym, head and embed int8", "llama.cpp": "gguf as published"}


def engine_versions() -> dict[str, str]:
    from pocketlm.runtime.kernels import native

    versions = {"pocketlm": "pocketlm native " + native.cpu_features()["selected"]}
    if importlib.util.find_spec("MNN"):
        versions["mnn"] = "MNN " + version("MNN")
    if importlib.util.find_spec("llama_cpp"):
        versions["llama.cpp"] = "llama-cpp-python " + version("llama_cpp_python")
    return versions


def run(models: list[str], threads: int, runs: int) -> None:
    from vs_llamacpp import pack_label

    from pocketlm.api import deploy_file
    from pocketlm.bench import bench

    versions = engine_versions()
    vs = ["mnn", *(["llama.cpp"] if "llama.cpp" in versions else [])]
    for name in models:
        packs = {**PACKS, "pocketlm": pack_label(deploy_file(name))}  # the file bench runs
        for r in bench(name, threads=threads, runs=runs, vs=vs):
            row = json.loads(r.to_json())
            row["pack"] = packs[r.engine]
            row["date"] = time.strftime("%Y-%m-%d %H:%M")
            row["engine_version"] = versions[r.engine]
            row["command"] = " ".join(sys.argv)
            print(json.dumps(row), flush=True)


def calls(rows: list[dict]) -> dict[str, list[dict[str, dict]]]:
    """model -> its bench calls in file order, each {engine: row}; a call opens with pocketlm."""
    by_model: dict[str, list[dict[str, dict]]] = {}
    for r in rows:
        model_calls = by_model.setdefault(r["model"], [])
        if r["engine"] == "pocketlm" or not model_calls:
            model_calls.append({})
        model_calls[-1][r["engine"]] = r
    return by_model


def table_text(path: str, call: int | None = None) -> str:
    """The markdown table; where a model has several calls, the one with the median prefill
    ratio against MNN (the lower middle one for an even count), or the `call`th of each."""
    from vs_llamacpp import ENGINE_HEADER, engine_row, load_rows, machine_line, ratio_row

    rows = load_rows(path)
    chosen, spread = {}, []
    for model, model_calls in calls(rows).items():
        if call is not None:
            chosen[model] = model_calls[call - 1]
        else:
            by_ratio = sorted(model_calls, key=lambda c: c["pocketlm"]["prefill_tps"]
                              / c["mnn"]["prefill_tps"])
            chosen[model] = by_ratio[(len(by_ratio) - 1) // 2]
        if len(model_calls) > 1:
            parts = []
            for other in ("mnn", "llama.cpp"):
                if other in model_calls[0]:
                    pre = [c["pocketlm"]["prefill_tps"] / c[other]["prefill_tps"]
                           for c in model_calls]
                    dec = [c["pocketlm"]["decode_tps"] / c[other]["decode_tps"]
                           for c in model_calls]
                    parts.append(f"against {other} prefill ×{min(pre):.2f}–×{max(pre):.2f}, "
                                 f"decode ×{min(dec):.2f}–×{max(dec):.2f}")
            spread.append(f"{model}: {len(model_calls)} calls, " + ", ".join(parts))
    out = [ENGINE_HEADER]
    for engines in chosen.values():
        out += [engine_row(r, r["pack"]) for r in engines.values()]
    out += ["", "| model | pocketlm vs | prefill ratio | decode ratio | peak memory ratio |",
            "|---|---|---|---|---|"]
    for model, engines in chosen.items():
        a = engines["pocketlm"]
        for other in ("mnn", "llama.cpp"):
            if other in engines:
                out.append(ratio_row(model, other, a, engines[other]))
    out += ["", f"{machine_line(rows)}; {', '.join(sorted({r['engine_version'] for r in rows}))}"]
    if spread:
        which = (f"call {call} of each model" if call is not None
                 else "the call with the median prefill ratio against MNN of each model")
        out += ["", f"{which}; the ratios over all calls: " + "; ".join(spread)]
    return "\n".join(out)


def table(path: str, call: int | None = None) -> None:
    print(table_text(path, call))


def main() -> None:
    from pocketlm.errors import PocketError

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of a results file")
    ap.add_argument("--call", type=int, metavar="N",
                    help="with --table: the Nth call of each model (default: the median one)")
    args = ap.parse_args()
    try:
        if args.table:
            table(args.table, args.call)
        else:
            run(args.models, args.threads, args.runs)
    except PocketError as exc:
        sys.exit(f"vs_mnn.py: error: {exc}")


if __name__ == "__main__":
    main()
