"""GGUF export: time, peak memory and size per registry model (JSON lines), and the table of
docs/export.md.

``run`` exports each model's default deploy file (``pocket export NAME --to gguf``) --runs times,
each in a fresh process, and appends one JSON line per model to benchmarks/export.jsonl: the
command, the machine, the deploy file and GGUF sizes, the median / min / max seconds of the
export call, the process's peak resident set (VmHWM) and its rise over the resident set just
before the export (imports done, nothing loaded), and the GGUF types written. Then llama.cpp
runs the export (and its weights dequantized to F32: tests/oracle.py) next to pocketlm on the
deploy file: perplexity on 256 tokens of tests/data/english.txt and chinese.txt, and how many
of 24 greedy tokens after a fixed prompt agree. ``write`` renders the latest line of each model
into docs/export.md between ``<!-- export:start -->`` and ``<!-- export:end -->``.

    python benchmarks/export.py run --models smollm2-135m qwen2.5-0.5b
    python benchmarks/export.py write
    python benchmarks/export.py write --check    # exit 1 if the table is out of date
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "export.jsonl"
DOC = ROOT / "docs" / "export.md"
MODELS = ("smollm2-135m", "gemma3-270m", "gemma3-270m-zh-en", "qwen2.5-0.5b")
PROMPT = "The three primary colours are"
GREEDY_TOKENS = 24

# One export in a fresh process: the resident set before it, then the report as JSON.
WORKER = r"""
import json, sys
from pathlib import Path
from pocketlm.export.gguf import export_gguf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0

source, out = Path(sys.argv[1]), Path(sys.argv[2])
before = status("VmRSS")
r = export_gguf(source, out, progress=False)
print(json.dumps({"seconds": r.seconds, "rss_before": before, "peak_rss": status("VmHWM"),
                  "file_bytes": r.file_bytes, "architecture": r.architecture,
                  "types": r.type_counts(), "tokenizer": r.tokenizer,
                  "max_rel_error": max(t.rel_error for t in r.tensors),
                  "copied": sum(t.how == "copied" for t in r.tensors),
                  "tensors": len(r.tensors)}))
"""


def _agreement(packed: Path, out: Path, tmp: Path) -> dict:
    """llama.cpp on the export (and on its F32 copy) against pocketlm on the deploy file."""
    sys.path.insert(0, str(ROOT / "tests"))
    import oracle

    import pocketlm

    model = pocketlm.load(packed)
    f32 = tmp / "f32.gguf"
    oracle.write_f32_gguf(out, f32)
    result: dict = {}
    for text in ("english", "chinese"):
        ids = oracle.text_ids(out, text, add_bos=model.tokenizer.add_bos)
        ppl = oracle.perplexity(model.logits(ids), ids)
        result[text] = {
            "ppl": round(ppl, 4),
            "quantized": round(oracle.perplexity(oracle.oracle_logits(out, ids), ids) / ppl - 1,
                               5),
            "f32": round(oracle.perplexity(oracle.oracle_logits(f32, ids), ids) / ppl - 1, 5)}
    ids = model.tokenize(PROMPT)
    ours = list(model.stream_ids(ids, max_tokens=GREEDY_TOKENS))

    def agree(path: Path) -> int:
        theirs = oracle.oracle_greedy(path, ids, len(ours), model.tokenizer.eos_ids)
        return next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))

    result["greedy"] = {"tokens": len(ours), "quantized": agree(out), "f32": agree(f32)}
    f32.unlink()
    return result


def run(models: list[str], runs: int, with_agreement: bool = True) -> None:
    from pocketlm.api import deploy_file
    from pocketlm.bench import machine_info

    command = "python benchmarks/export.py " + " ".join(sys.argv[1:])
    for name in models:
        packed = deploy_file(name, quiet=True)
        rows = []
        with tempfile.TemporaryDirectory(prefix="pocketlm-export-bench-") as tmp:
            out = Path(tmp) / f"{name}.gguf"
            for _ in range(runs):
                out.unlink(missing_ok=True)
                p = subprocess.run([sys.executable, "-c", WORKER, str(packed), str(out)],
                                   capture_output=True, text=True, check=True)
                rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            agreement = _agreement(packed, out, Path(tmp)) if with_agreement else None
        seconds = [r["seconds"] for r in rows]
        last = rows[-1]
        record = {
            "model": name,
            "deploy_bytes": packed.stat().st_size,
            "gguf_bytes": last["file_bytes"],
            "architecture": last["architecture"],
            "seconds": round(statistics.median(seconds), 2),
            "seconds_min": round(min(seconds), 2),
            "seconds_max": round(max(seconds), 2),
            "peak_rss_mb": round(max(r["peak_rss"] for r in rows) / 1e6, 1),
            "peak_rss_delta_mb": round(max(r["peak_rss"] - r["rss_before"] for r in rows)
                                       / 1e6, 1),
            "types": last["types"],
            "copied": last["copied"],
            "tensors": last["tensors"],
            "max_rel_error": last["max_rel_error"],
            "tokenizer": {k: last["tokenizer"].get(k) for k in ("model", "pre", "tokens",
                                                                 "exact")},
            "llama_cpp": agreement,
            "runs": runs,
            "machine": machine_info(),
            "date": datetime.date.today().isoformat(),
            "command": command,
        }
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{name}: {record['seconds']} s, peak {record['peak_rss_mb']} MB "
              f"(+{record['peak_rss_delta_mb']} MB), {record['gguf_bytes'] / 1e6:.1f} MB")


def _read() -> dict[str, dict]:
    latest: dict[str, dict] = {}
    if RESULTS.is_file():
        for line in RESULTS.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                latest[r["model"]] = r
    return {m: latest[m] for m in MODELS if m in latest}


def table(latest: dict[str, dict]) -> str:
    out = ["| model | GGUF arch | deploy file MB | GGUF MB | tensor types written | "
           "copied bit for bit | largest error | tokenizer | export s | peak MB (rise) |",
           "|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
    agree = ["| model | English: F32 copy / quantized | Chinese: F32 copy / quantized | "
             "greedy tokens agreeing: F32 copy / quantized |", "|---|---:|---:|---:|"]

    def pct(x: float) -> str:
        return f"{100 * x:+.2f} %"
    for name, r in latest.items():
        types = ", ".join(f"{k} x{v}" for k, v in r["types"].items())
        tok = r["tokenizer"]
        pre = f", pre {tok['pre']}" if tok.get("pre") else ""
        near = "" if tok.get("exact") else " (nearest)"
        out.append(
            f"| {name} | {r['architecture']} | {r['deploy_bytes'] / 1e6:.1f} | "
            f"{r['gguf_bytes'] / 1e6:.1f} | {types} | {r['copied']} of {r['tensors']} | "
            f"{r['max_rel_error']:.3g} | {tok['model']}{pre}{near}, {tok['tokens']:,} | "
            f"{r['seconds']:.1f} | {r['peak_rss_mb']:.0f} (+{r['peak_rss_delta_mb']:.0f}) |")
        a = r.get("llama_cpp")
        if a:
            g = a["greedy"]
            agree.append(f"| {name} | {pct(a['english']['f32'])} / "
                         f"{pct(a['english']['quantized'])} | {pct(a['chinese']['f32'])} / "
                         f"{pct(a['chinese']['quantized'])} | {g['f32']} / {g['quantized']} "
                         f"of {g['tokens']} |")
    first = next(iter(latest.values()), None)
    if first:
        m = first["machine"]
        out.append("")
        out.append(f"Measured {first['date']} on {m.get('cpu')} ({m.get('cores')} CPUs), median "
                   f"of {first['runs']} exports each in a fresh process ("
                   + ", ".join(f"`{c}`" for c in dict.fromkeys(r["command"]
                                                               for r in latest.values()))
                   + "); copied: the quantized tensors, written as the same integers and "
                   "scales (the others are float32 norms and biases); peak: the process's "
                   "peak resident set (Python and pocketlm included), rise: above the "
                   "resident set just before the export.")
    if len(agree) > 2:
        out += ["", "llama.cpp against pocketlm, same run: perplexity ratio llama.cpp / "
                "pocketlm - 1 on 256 tokens of each text (llama.cpp on the export's weights "
                "dequantized to F32, and on the quantized export), and the greedy tokens "
                f"after \"{PROMPT}\" that agree with pocketlm's before the first difference.",
                "", *agree]
    return "\n".join(out)


BLOCK = re.compile(r"(<!-- export:start -->\n)(.*?)(<!-- export:end -->)", re.S)


def write(check: bool = False) -> None:
    """Write the table into docs/export.md (``check``: only say whether it is current)."""
    text = table(_read())
    doc = DOC.read_text(encoding="utf-8")
    if not BLOCK.search(doc):
        raise SystemExit(f"{DOC}: no <!-- export:start --> block")
    new = BLOCK.sub(lambda m: m.group(1) + text + "\n" + m.group(3), doc)
    if check:
        if new != doc:
            raise SystemExit(f"stale export table in {DOC}: run python benchmarks/export.py "
                             "write")
        return
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote the table into {DOC}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="export and measure; append JSON lines")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="time and memory only, without the llama.cpp comparison")
    w = sub.add_parser("write", help="regenerate the table from the JSON lines")
    w.add_argument("--check", action="store_true", help="fail if the table is not current")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.models, args.runs, with_agreement=not args.no_llama_cpp)
    else:
        write(args.check)


if __name__ == "__main__":
    main()
