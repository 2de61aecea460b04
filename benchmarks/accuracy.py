"""Accuracy of pocketlm against llama.cpp on the registry models (JSON lines).

For each model and text (tests/data/english.txt, chinese.txt; first 256 tokens as llama.cpp
tokenizes them): top-1 agreement, KL divergence and perplexity of
  float  (pocketlm's dequantized float path) vs llama.cpp on an F32 copy of the same GGUF,
  float  vs llama.cpp on the original quantized GGUF,
  int4   (the .pocket deploy file) vs float.

    python benchmarks/accuracy.py [--models smollm2-135m gemma3-270m qwen2.5-0.5b]
        [--group-size 32] [--embed-bits 8] [--all-int4 | --keep-precision]
        >> benchmarks/accuracy.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import oracle  # noqa: E402

import pocketlm  # noqa: E402
from pocketlm.api import deploy_file, from_source  # noqa: E402
from pocketlm.cli import add_precision_options  # noqa: E402
from pocketlm.formats import open_source  # noqa: E402
from pocketlm.pack import precision_record  # noqa: E402
from pocketlm.registry import pull  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--embed-bits", type=int, default=8)
    add_precision_options(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = pull(name, quiet=True)
            f32 = Path(tmp) / "f32.gguf"
            oracle.write_f32_gguf(path, f32)
            fm = from_source(open_source(path))
            opts = dict(group_size=args.group_size, embed_bits=args.embed_bits,
                        keep_precision=args.keep_precision)
            qm = pocketlm.load(path, **opts)
            packed = deploy_file(path, **opts)
            quant = json.loads(qm.metadata.get("quant") or "{}")
            for text in ("english", "chinese"):
                ids = oracle.text_ids(path, text, add_bos=fm.tokenizer.add_bos)
                ref32 = oracle.oracle_logits(f32, ids)
                refq = oracle.oracle_logits(path, ids)
                fl, q = fm.logits(ids), qm.logits(ids)
                row = {
                    "model": name, "text": text, "n_tokens": len(ids),
                    "group_size": args.group_size, "embed_bits": args.embed_bits,
                    "keep_precision": precision_record(args.keep_precision),
                    "pocket_file_mb": round(packed.stat().st_size / 1e6, 1),
                    "scheme": quant.get("scheme", ""),
                    "embed_kind": quant.get("tensors", {}).get("embed.weight", {}).get("kind"),
                    "float_vs_llama_f32": oracle.compare(ref32, fl),
                    "float_vs_llama_quant": oracle.compare(refq, fl),
                    "int4_vs_float": oracle.compare(fl, q),
                    "ppl_llama_f32": oracle.perplexity(ref32, ids),
                    "ppl_llama_quant": oracle.perplexity(refq, ids),
                    "ppl_float": oracle.perplexity(fl, ids),
                    "ppl_int4": oracle.perplexity(q, ids),
                    "command": " ".join(sys.argv), "machine": platform.machine(),
                    "cpu": _cpu(), "pocketlm": pocketlm.__version__,
                    "date": time.strftime("%Y-%m-%d"),
                }
                print(json.dumps(row), flush=True)
            f32.unlink()


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
