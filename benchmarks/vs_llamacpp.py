"""pocketlm against llama.cpp on the three registry models (JSON lines, one per engine).

    python benchmarks/vs_llamacpp.py [--models ...] [--threads 2] >> benchmarks/vs_llamacpp.jsonl
    python benchmarks/vs_llamacpp.py --all-int4 ...   # the packs with every matrix in INT4
    python benchmarks/vs_llamacpp.py --calls 3 ...   # three bench calls per model (noisy VMs)
    python benchmarks/vs_llamacpp.py --table benchmarks/vs_llamacpp.jsonl   # markdown table
    python benchmarks/vs_llamacpp.py --write   # rewrite the tables in README.md, docs/benchmarks.md
    python benchmarks/vs_llamacpp.py --write --check   # exit 1 if a table there is out of date

Where a results file holds several calls for a model and pack, the table shows the call with
the median prefill ratio (the lower middle one for an even count) and states the range of the
ratios over all the calls.

`--write` regenerates every block of README.md and docs/benchmarks.md that opens with a marker
line `<!-- generated: table benchmarks/FILE.jsonl -->` (the table above; `... call N -->`: the
Nth call of every model) or `<!-- generated: details benchmarks/FILE.jsonl -->` (every run of
the file, one row per engine per call, with its date, engine build and command) and closes with
`<!-- end of generated block -->`; a results file that holds MNN rows gets vs_mnn.py's table.
The text outside the markers is written by hand.

llama.cpp is llama-cpp-python, built for the machine's CPU features (docs/benchmarks.md
has the build flags); both engines get the same prompt ids, alternate run by run, and run in
their own processes (`pocket bench --vs llama.cpp`).

gemma3-270m's and qwen2.5-0.5b's GGUFs keep most matrices at 5-8 bits; the default deploy file
keeps them too (Q5_0 in INT5, Q6_K/Q8_0 in INT8: top-1 agreement with the float model 99-100 %),
i.e. llama.cpp and pocketlm run the model at the same quality. `--all-int4` benchmarks the
packs that requantize them to INT4 (smaller, top-1 agreement 69-89 %: docs/accuracy.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]


def pack_label(path) -> str:
    """The deploy file's weights, as the results name them."""
    from pocketlm.formats.pocketfile import PocketFile

    quant = PocketFile(path, verify=False).json("quant")
    label = f"int4 g{quant['group_size']}, embed int{quant['embed_bits']}"
    if "+" in quant["scheme"]:  # tensors kept above 4 bits
        label += ", keep-precision (q5_0 int5, q6_k/q8_0 int8)"
    return label


def run(models: list[str], threads: int, runs: int, keep_precision: bool | None,
        calls: int = 1) -> None:
    import llama_cpp

    from pocketlm.api import deploy_file
    from pocketlm.bench import bench
    from pocketlm.registry import resolve
    from pocketlm.runtime.kernels import native

    for name, call in ((n, c) for n in models for c in range(calls)):
        target = deploy_file(name, keep_precision=keep_precision, quiet=False)
        pack = pack_label(target)
        results = bench(str(target), threads=threads, runs=runs, vs=["llama.cpp"],
                        gguf=str(resolve(name)))
        ours = native.engine_setting()
        for r in results:
            row = json.loads(r.to_json())
            row["model"] = name
            row["pack"] = pack if r.engine == "pocketlm" else "gguf as published"
            row["date"] = time.strftime("%Y-%m-%d %H:%M")
            row["engine_version"] = ("llama-cpp-python " + llama_cpp.__version__
                                     if r.engine == "llama.cpp"
                                     else "pocketlm native " + ours["level"]
                                     + (" + amx-bf16 prefill" if ours["amx"] else ""))
            row["command"] = " ".join(sys.argv)
            row["call"] = f"{call + 1}/{calls}"
            print(json.dumps(row), flush=True)


# -- markdown (shared with vs_mnn.py) -----------------------------------------------------------
ENGINE_HEADER = ("| model | engine | weights | prefill tok/s (min–max) | decode tok/s (min–max) | "
                 "peak RSS Δ MiB | file MB | load s | energy J (est.) |\n"
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


def _pack(r: dict) -> str:
    return r.get("pack", "int4 g32, embed int8" if r["engine"] == "pocketlm" else
                 "gguf as published")


def load_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def table_text(path: str) -> str:
    rows = load_rows(path)
    groups: dict[tuple, list] = {}  # (model, pocketlm pack) -> [(pocketlm row, llama.cpp row)]
    ours = None
    for r in rows:
        if r["engine"] == "pocketlm":
            ours = r
        elif ours is not None and ours["model"] == r["model"]:
            groups.setdefault((r["model"], _pack(ours)), []).append((ours, r))
            ours = None
    chosen, spread = [], []
    for (model, pack), pairs in groups.items():
        by_ratio = sorted(pairs, key=lambda p: p[0]["prefill_tps"] / p[1]["prefill_tps"])
        chosen.append(by_ratio[(len(by_ratio) - 1) // 2])
        if len(pairs) > 1:
            pre = [a["prefill_tps"] / b["prefill_tps"] for a, b in pairs]
            dec = [a["decode_tps"] / b["decode_tps"] for a, b in pairs]
            spread.append(f"{model} ({pack}): {len(pairs)} calls, prefill ×{min(pre):.2f}–"
                          f"×{max(pre):.2f}, decode ×{min(dec):.2f}–×{max(dec):.2f}")
    out = [ENGINE_HEADER]
    for a, b in chosen:
        out += [engine_row(a, _pack(a)), engine_row(b, _pack(b))]
    out += ["", "| model | pocketlm weights | prefill ratio | decode ratio | peak memory ratio |",
            "|---|---|---|---|---|"]
    out += [ratio_row(a["model"], _pack(a), a, b) for a, b in chosen]
    out += ["", machine_line(rows)]
    if spread:
        out += ["", "the call with the median prefill ratio of each model; the ratios over all "
                "calls: " + "; ".join(spread)]
    return "\n".join(out)


def table(path: str) -> None:
    print(table_text(path))


def _settings(r: dict) -> str:
    m = r["machine"]
    parts = []
    if "activations" in m:
        parts.append(f"activations {m['activations']}")
    if "amx_prefill" in m:
        parts.append("amx prefill " + (m.get("amx_weights", "on") if m["amx_prefill"] else "off"))
    if "kv_cache" in m:
        parts.append(f"kv {m['kv_cache']}")
    return ", ".join(parts)


def details_text(path: str) -> str:
    """Every run of a results file: one row per engine and call, oldest first."""
    rows = load_rows(path)
    out = ["| date | call | model | engine | build | weights | prefill tok/s (min–max) | "
           "decode tok/s (min–max) | peak RSS Δ MiB | load s | energy J (est.) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        build = r.get("engine_version", r["engine"])
        if r["engine"] == "pocketlm" and _settings(r):
            build += f" ({_settings(r)})"
        out.append(f"| {r.get('date', '')} | {r.get('call', '')} | {r['model']} | {r['engine']} | "
                   f"{build} | {_pack(r)} | {r['prefill_tps']:.0f} ({r['prefill_tps_min']:.0f}–"
                   f"{r['prefill_tps_max']:.0f}) | {r['decode_tps']:.0f} "
                   f"({r['decode_tps_min']:.0f}–{r['decode_tps_max']:.0f}) | "
                   f"{r['peak_rss_delta_mb']:.0f} | {r['load_s']:.2f} | {r['energy_j_est']:.2f} |")
    commands = list(dict.fromkeys(r.get("command", "") for r in rows if r.get("command")))
    out += ["", machine_line(rows), "", "commands, as each row recorded it (flags of that day): " + "; ".join(f"`{c}`" for c in commands)]
    return "\n".join(out)


# -- the generated blocks of README.md and docs/benchmarks.md ------------------------------------
ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/benchmarks.md")
BLOCK = re.compile(r"^(<!-- generated: (table|details) (benchmarks/[\w.-]+\.jsonl)(?: call (\d+))? -->\n)"
                   r"(.*?)^(<!-- end of generated block -->)$", re.M | re.S)


def block_text(kind: str, path: str, call: str | None) -> str:
    if kind == "details":
        return details_text(path)
    if any(r["engine"] == "mnn" for r in load_rows(path)):
        sys.path.insert(0, str(Path(__file__).parent))
        from vs_mnn import table_text as mnn_table_text

        return mnn_table_text(path, int(call) if call else None)
    if call:
        sys.exit(f"vs_llamacpp.py: error: 'call {call}' is for MNN results, not {path}")
    return table_text(path)


def update_files(new_texts: dict[Path, str], check: bool) -> None:
    """Write each file whose text differs from its new text (``check``: write nothing); say
    which, and with ``check`` exit 1 when any is out of date. Shared by the scripts here that
    generate docs."""
    stale = [path for path, new in new_texts.items()
             if not path.exists() or path.read_text(encoding="utf-8") != new]
    if not check:
        for path in stale:
            path.write_text(new_texts[path], encoding="utf-8")
    if stale:
        print(("out of date: " if check else "rewrote: ")
              + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        if check:
            sys.exit(1)


def write(check: bool) -> None:
    """Rewrite the generated blocks of DOCS from the results files they name."""
    new_texts = {}
    for doc in DOCS:
        target = ROOT / doc
        new_texts[target] = BLOCK.sub(
            lambda m: m[1] + "\n" + block_text(m[2], str(ROOT / m[3]), m[4]) + "\n\n" + m[6],
            target.read_text(encoding="utf-8"))
    update_files(new_texts, check)


def main() -> None:
    from pocketlm.cli import add_precision_options

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    add_precision_options(ap)
    ap.add_argument("--calls", type=int, default=1,
                    help="bench calls per model (each: --runs runs per engine, alternating)")
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of a results file")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the generated tables of README.md and docs/benchmarks.md")
    ap.add_argument("--check", action="store_true",
                    help="with --write: change nothing, exit 1 if a generated table is out of date")
    args = ap.parse_args()
    if args.write:
        write(args.check)
    elif args.table:
        table(args.table)
    else:
        run(args.models, args.threads, args.runs, args.keep_precision, args.calls)


if __name__ == "__main__":
    main()
