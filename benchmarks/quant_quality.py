"""Quantization quality: perplexity and size of every quantization method, pocketlm's and
llama.cpp's, on held-out text (JSON lines).

    python benchmarks/quant_quality.py run [--models M ...] [--methods NAME ...] [--tokens 512]
        >> benchmarks/quant_quality.jsonl
    python benchmarks/quant_quality.py write [--check]     # docs/quantization.md's tables
                                  # (and the channel-scaling table of benchmarks/awq_sites.jsonl)

Texts (none is in any calibration set, see pocketlm.calibdata): tests/data/english.txt and
chinese.txt, and the held-out slices of the calibration corpora's code and Chinese news; the
first ``--tokens`` tokens of each. The float reference is pocketlm's float path (every tensor of
the registry GGUF dequantized to float32). llama.cpp's rows come from llama-cpp-python's own
quantizer (``llama_model_quantize``) applied to an F32 GGUF of the same weights, evaluated by
llama.cpp; the binding's ``imatrix`` parameter is a pointer to a C++ map, which Python cannot
build, so llama.cpp's rows are without an importance matrix. pocketlm's rows are deploy files
packed with the options of :data:`POCKET_METHODS`, evaluated by the native engine at its
default settings.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import oracle  # noqa: E402

import pocketlm  # noqa: E402
from pocketlm import calibdata  # noqa: E402
from pocketlm.api import from_source  # noqa: E402
from pocketlm.formats import open_source  # noqa: E402
from pocketlm.pack import pack  # noqa: E402
from pocketlm.registry import pull  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")
TEXTS = ("english", "chinese", "code", "news")
LLAMA_TYPES = {"llama-q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "llama-q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
# name -> pocketlm.pack options
POCKET_METHODS: dict[str, dict] = {
    "pocket-source": {"keep_precision": None},  # the default pack before calibration
    "pocket-rtn-int4": {"keep_precision": False},  # every linear weight INT4 g32, RTN
    "pocket-gptq-int4": {"keep_precision": False, "calib": "default"},
    "pocket-budget-source": {"bits_per_weight": "source"},
    "pocket-bpw-4.6": {"bits_per_weight": 4.6},
    "pocket-bpw-4.6-patch": {"bits_per_weight": 4.6, "head_patch": "auto"},
    "pocket-awq-int4": {"keep_precision": False, "calib": "default", "awq": True},
    "pocket-awq-bpw-4.6": {"bits_per_weight": 4.6, "awq": True},
    "pocket-awq-budget-source": {"bits_per_weight": "source", "awq": True},
    # what each rounding method buys (docs/quantization.md, Calibration): every linear weight
    # requantized to INT4 group 64, rounded three ways
    "pocket-rtn-int4-g64": {"keep_precision": False, "group_size": 64},
    "pocket-act-int4-g64": {"keep_precision": False, "group_size": 64, "calib": "default",
                            "quant_method": "act"},
    "pocket-gptq-int4-g64": {"keep_precision": False, "group_size": 64, "calib": "default",
                             "quant_method": "gptq"},
}
OUT = ROOT / "benchmarks" / "quant_quality.jsonl"
DOC = ROOT / "docs" / "quantization.md"


def texts(tokenizer, n: int) -> dict[str, list[int]]:
    raw = {
        "english": (ROOT / "tests/data/english.txt").read_text(encoding="utf-8"),
        "chinese": (ROOT / "tests/data/chinese.txt").read_text(encoding="utf-8"),
        "code": calibdata.heldout_text("code", 8 * n),
        "news": calibdata.heldout_text("zh", 4 * n),
    }
    out = {}
    for name, text in raw.items():
        ids = tokenizer.encode(text)
        out[name] = ids[:n]
    return out


def ppl(logits: np.ndarray, ids: list[int]) -> float:
    return oracle.perplexity(logits, ids)


def llama_quantize(src: Path, dst: Path, ftype_name: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(llama_cpp, ftype_name)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(args) -> None:
    for name in args.models:
        run_model(name, args)


def run_model(name: str, args) -> None:
    path = pull(name, quiet=True)
    src = open_source(path)
    ids = texts(src.tokenizer, args.tokens)
    base = {"model": name, "tokens": args.tokens, "command": " ".join(sys.argv),
            "machine": platform.machine(), "cpu": cpu(), "threads": 2,
            "pocketlm": pocketlm.__version__, "date": time.strftime("%Y-%m-%d")}
    fm = from_source(src)
    ref = {t: fm.logits(i) for t, i in ids.items()}
    ref_ppl = {t: ppl(ref[t], ids[t]) for t in ids}
    del fm
    n_params = sum(int(np.prod(t.shape)) for t in src.tensors.values())

    def emit(method, engine, file_bytes, logits, extra=None):
        row = dict(base, method=method, engine=engine, file_mb=round(file_bytes / 1e6, 1),
                   file_bits_per_weight=round(8 * file_bytes / n_params, 3),
                   ppl={t: round(ppl(logits[t], ids[t]), 4) for t in ids},
                   ppl_float={t: round(v, 4) for t, v in ref_ppl.items()})
        row["dppl_pct"] = {t: round(100 * (row["ppl"][t] / ref_ppl[t] - 1), 3) for t in ids}
        row["top1_vs_float"] = {t: round(float((logits[t].argmax(-1) ==
                                                ref[t].argmax(-1)).mean()), 4) for t in ids}
        row.update(extra or {})
        print(json.dumps(row, ensure_ascii=False), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        need_f32 = any(m in LLAMA_TYPES or m == "llama-f32" for m in args.methods)
        if need_f32:
            oracle.write_f32_gguf(path, f32)
        for method in args.methods:
            if method == "llama-f32":
                logits = {t: oracle.oracle_logits(f32, i) for t, i in ids.items()}
                emit(method, "llama.cpp", f32.stat().st_size, logits)
            elif method in LLAMA_TYPES:
                q = Path(tmp) / f"{method}.gguf"
                llama_quantize(f32, q, LLAMA_TYPES[method])
                logits = {t: oracle.oracle_logits(q, i) for t, i in ids.items()}
                emit(method, "llama.cpp", q.stat().st_size, logits)
                q.unlink()
            elif method in POCKET_METHODS:
                out = Path(tmp) / f"{method}.pocket"
                t0 = time.time()
                rep = pack(src, out, progress=False, **POCKET_METHODS[method])
                secs = time.time() - t0
                qm = pocketlm.load(out)
                logits = {t: qm.logits(i) for t, i in ids.items()}
                emit(method, "pocketlm", out.stat().st_size, logits,
                     {"options": POCKET_METHODS[method], "pack_seconds": round(secs, 1),
                      "quant_bits_per_weight": round(rep.quant_bits_per_weight, 3),
                      **({"channel_scaling": rep.calibration["channel_scaling"]}
                         if rep.calibration and "channel_scaling" in rep.calibration else {}),
                      **({"head": rep.calibration["head"]}
                         if rep.calibration and "head" in rep.calibration else {})})
                del qm
                out.unlink()
            else:
                raise SystemExit(f"unknown method {method!r}")


METHOD_LABELS = {
    "llama-q4_0": "llama.cpp Q4_0",
    "llama-q4_k_m": "llama.cpp Q4_K_M",
    "pocket-source-r7": "pocketlm default, pack revision 7 (minimums always stored)",
    "pocket-source-r8": "pocketlm exact import before source encodings (Q6_K in INT8, Q4_K "
                        "with float16 scales, tokenizer uncompressed)",
    "pocket-source": "pocketlm exact import, K-quant blocks kept (every registry model's "
                     "default pack)",
    "pocket-rtn-int4": "pocketlm `--all-int4`, rounding (RTN)",
    "pocket-gptq-int4": "pocketlm `--all-int4 --calib default` (GPTQ)",
    "pocket-budget-source": "pocketlm `--bits-per-weight source`",
    "pocket-bpw-4.6-r8": "pocketlm `--bits-per-weight 4.6` before source encodings (a Q4_K "
                         "tensor kept exactly cost 5.0 bits)",
    "pocket-bpw-4.6-r9": "pocketlm `--bits-per-weight 4.6` before coded scales (requantized "
                         "INT4 at 4.5 bits only in group 64 or zero point 8)",
    "pocket-bpw-4.6": "pocketlm `--bits-per-weight 4.6`",
    "pocket-bpw-4.6-patch": "pocketlm `--bits-per-weight 4.6 --head-patch auto` (the head's "
                            "most used rows also in INT8, inside the budget)",
    "pocket-awq-int4": "pocketlm `--all-int4 --awq` (channel scaling, then GPTQ)",
    "pocket-awq-budget-source": "pocketlm `--bits-per-weight source --awq`",
    "pocket-awq-bpw-4.6": "pocketlm `--bits-per-weight 4.6 --awq`",
    "pocket-rtn-int4-g64": "pocketlm `--all-int4 --group-size 64`, rounding (RTN)",
    "pocket-act-int4-g64": "pocketlm `--all-int4 --group-size 64 --calib default "
                           "--quant-method act`",
    "pocket-gptq-int4-g64": "pocketlm `--all-int4 --group-size 64 --calib default` (GPTQ)",
    "pocket-seq-bpw-4.6": "pocketlm `--bits-per-weight 4.6`, rounded layer by layer (tried at "
                          "commit 1f6ac85, not kept)",
}
AWQ_SITES = ROOT / "benchmarks" / "awq_sites.jsonl"


def _block(kind: str, path: str) -> re.Pattern:
    """A generated block of the doc: ``<!-- generated: KIND PATH -->`` ... its end marker."""
    return re.compile(rf"^(<!-- generated: {kind} {re.escape(path)} -->\n)"
                      r"(.*?)^(<!-- end of generated block -->)$", re.S | re.M)


BLOCK = _block("quant_quality", "benchmarks/quant_quality.jsonl")
AWQ_BLOCK = _block("awq_sites", "benchmarks/awq_sites.jsonl")


def _latest(rows: list[dict], field: str) -> dict[tuple[str, str], dict]:
    """The latest row of each (model, ``field``), in first-seen order."""
    latest: dict[tuple[str, str], dict] = {}
    for r in rows:
        latest[(r["model"], r[field])] = r
    return latest


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def table(rows: list[dict]) -> str:
    """The latest row of each (model, method), grouped by model, llama.cpp first."""
    latest = _latest(rows, "method")
    order = list(METHOD_LABELS)
    out = ["| model | method | file MB | bits/weight (file) | Δppl english | Δppl chinese | "
           "Δppl code | Δppl news | top-1 vs float (en / zh) | date |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for method in sorted((m for (mo, m) in latest if mo == model),
                             key=lambda m: order.index(m) if m in order else len(order)):
            r = latest[(model, method)]
            d = r["dppl_pct"]
            t = r["top1_vs_float"]
            out.append(
                f"| {model} | {METHOD_LABELS.get(method, method)} | {r['file_mb']:.1f} | "
                f"{r['file_bits_per_weight']:.2f} | "
                + " | ".join(f"{d[k]:+.2f} %" for k in TEXTS)
                + f" | {100 * t['english']:.1f} / {100 * t['chinese']:.1f} % | {r['date']} |")
    return "\n".join(out)


def awq_table(rows: list[dict]) -> str:
    """The latest row of each (model, site), by model then layer."""
    latest = _latest(rows, "site")
    out = ["| model | input | alpha | error ratio, range search | error ratio, GPTQ | "
           "channel RMS max / median |", "|---|---|---|---|---|---|"]
    for model in MODELS:
        for (mo, _), r in latest.items():
            if mo == model:
                out.append(f"| {model} | {r['site']} | {r['alpha']:.1f} | {r['act_ratio']:.3f} "
                           f"| {r['gptq_ratio']:.3f} | {r['d_max_over_median']:.1f} |")
    return "\n".join(out)


def write(check: bool) -> None:
    from vs_llamacpp import update_files

    text = DOC.read_text(encoding="utf-8")
    new = BLOCK.sub(lambda m: m[1] + table(_read(OUT)) + "\n" + m[3], text)
    new = AWQ_BLOCK.sub(lambda m: m[1] + awq_table(_read(AWQ_SITES)) + "\n" + m[3], new)
    update_files({DOC: new}, check)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--models", nargs="+", default=list(MODELS))
    r.add_argument("--methods", nargs="+",
                   default=["llama-q4_0", "llama-q4_k_m", *POCKET_METHODS])
    r.add_argument("--tokens", type=int, default=512)
    w = sub.add_parser("write")
    w.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        write(args.check)


if __name__ == "__main__":
    main()
