"""Summarise a pre-training run: held-out perplexity, tokens/s, the loss curve and samples.

    python benchmarks/pretrain_report.py RUN [--svg docs/pretrain_cpu_loss.svg] >> benchmarks/pretrain_cpu.jsonl

Reads RUN/metrics.jsonl and RUN/train_config.json, exports RUN to an INT4 deploy file next to it
(RUN.pocket) and generates greedy continuations of fixed English and Chinese prompts with the
runtime, plus the held-out loss of the exported file on the run's own validation shard (the
quantization cost). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

PROMPTS = ["The weather today is", "User: What is a computer?\nAssistant:", "床前明月光，",
           "人民日报讯", "我们今天"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--svg", type=Path, help="copy the loss curve here")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()

    import numpy as np

    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.config import ModelConfig
    from pocketlm.train.data import TokenShards
    from pocketlm.train.export import export

    rows = [json.loads(x) for x in (a.run / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((a.run / "train_config.json").read_text())
    evals = [r for r in rows if "val_loss" in r]
    tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    out = a.run.with_suffix(".pocket")
    report = export(a.run, out, progress=False)
    model = pocketlm.load(out)
    samples = {p: model.generate(p, max_tokens=a.max_tokens, temperature=0.0) for p in PROMPTS}

    # the exported INT4 file's loss on the same held-out windows as the run's last evaluation
    val = TokenShards(Path(cfg["train"]["data"]), "val")
    seq, nll, n = cfg["train"]["seq_len"], 0.0, 0
    for batch in val.iter_eval_batches(cfg["train"]["batch_size"], seq,
                                       cfg["train"]["eval_batches"]):
        for row in batch:
            logits = model.logits([int(t) for t in row[:-1]]).astype(np.float64)
            m = logits.max(-1, keepdims=True)
            lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
            nll += float((lse - logits[np.arange(len(row) - 1), row[1:]]).sum())
            n += len(row) - 1
    if a.svg:
        shutil.copyfile(a.run / "loss.svg", a.svg)
    first, last = evals[0], evals[-1]
    print(json.dumps({
        "run": str(a.run), "preset": cfg["train"]["preset"],
        "params_m": round(ModelConfig.from_dict(cfg["model"]).n_params() / 1e6, 2),
        "model": cfg["model"], "steps": last["step"], "tokens": rows[-1]["tokens"],
        "seq_len": seq, "batch_size": cfg["train"]["batch_size"], "lr": cfg["train"]["lr"],
        "dtype": cfg["train"]["dtype"],
        "val_loss_first_eval": round(first["val_loss"], 4), "val_loss": round(last["val_loss"], 4),
        "val_ppl": round(last["val_ppl"], 2),
        "val_ppl_int4_export": round(math.exp(nll / n), 2),
        "train_tokens_per_s_median": round(statistics.median(tps), 1),
        "int4_file_mb": round(report.file_bytes / 1e6, 2),
        "samples": samples, "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
    }, ensure_ascii=False))


if __name__ == "__main__":
    main()
