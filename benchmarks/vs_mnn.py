"""pocketlm against MNN (and llama.cpp when installed) on the three registry models (JSON lines,
one per engine).

    scripts/export-mnn smollm2-135m        # once per model: the MNN export in $POCKET_HOME/mnn
    python benchmarks/vs_mnn.py [--models ...] [--threads 2] >> benchmarks/vs_mnn.jsonl
    python benchmarks/vs_mnn.py --table benchmarks/vs_mnn.jsonl   # markdown table

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


def table(path: str) -> None:
    from vs_llamacpp import ENGINE_HEADER, engine_row, machine_line, ratio_row

    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    print(ENGINE_HEADER)
    by_model: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["engine"]] = r
        print(engine_row(r, r["pack"]))
    print()
    print("| model | pocketlm vs | prefill ratio | decode ratio | peak memory ratio |")
    print("|---|---|---|---|---|")
    for model, engines in by_model.items():
        a = engines["pocketlm"]
        for other in ("mnn", "llama.cpp"):
            if other in engines:
                print(ratio_row(model, other, a, engines[other]))
    print(f"\n{machine_line(rows)}; {', '.join(sorted({r['engine_version'] for r in rows}))}")


def main() -> None:
    from pocketlm.errors import PocketError

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of a results file")
    args = ap.parse_args()
    try:
        if args.table:
            table(args.table)
        else:
            run(args.models, args.threads, args.runs)
    except PocketError as exc:
        sys.exit(f"vs_mnn.py: error: {exc}")


if __name__ == "__main__":
    main()
