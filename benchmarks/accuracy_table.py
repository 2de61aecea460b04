"""Render benchmarks/accuracy.jsonl as the markdown table in docs/accuracy.md.

    python benchmarks/accuracy_table.py benchmarks/accuracy.jsonl
"""

from __future__ import annotations

import argparse
import json


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    print("| model | text | pack | file MB | float vs llama.cpp F32: top-1 / KL | "
          "float vs llama.cpp quant: top-1 | packed vs float: top-1 / KL | ppl float | "
          "ppl packed | Δppl |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        embed = (r.get("embed_kind") or f"int{r['embed_bits']}").upper()  # recorded since 12-01
        pack = f"INT4 g{r['group_size']}, embed {embed}"
        scheme = r.get("scheme", "")
        if "+" in scheme or r.get("keep_precision") is True:  # tensors kept above 4 bits
            # INT5 for Q5_0 since 2026-12-01 (scheme ...+int5); the default since 2026-12-01
            pack += (", keep-precision (Q5_0 INT5, wider INT8)" if "int5" in scheme
                     else ", keep-precision (INT8)")
        f32, fq, q = r["float_vs_llama_f32"], r["float_vs_llama_quant"], r["int4_vs_float"]
        dppl = r["ppl_int4"] / r["ppl_float"] - 1
        print(f"| {r['model']} | {r['text']} | {pack} | {r['pocket_file_mb']} | "
              f"{f32['top1']:.1%} / {f32['kl']:.1e} | {fq['top1']:.1%} | "
              f"{q['top1']:.1%} / {q['kl']:.1e} | {r['ppl_float']:.2f} | {r['ppl_int4']:.2f} | "
              f"{dppl:+.1%} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default="benchmarks/accuracy.jsonl",
                    help="the results file (default: benchmarks/accuracy.jsonl)")
    main(ap.parse_args().path)
