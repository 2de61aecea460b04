"""Could an INT4 output head be screened as the INT8 one is? A numpy study, before any kernel.

    python benchmarks/int4_head_screen.py FILE.pocket [FILE.pocket ...] \
        --out benchmarks/int4_head_screen.jsonl

Greedy decoding screens an INT8 head (docs/engine.md, "Head screening"): every row's logit is
estimated from the high nibble of its codes (the low nibble replaced by its midpoint), and only
the K tiles of 16 rows with the largest estimates are computed exactly. An INT4 head (the
``--bits-per-weight`` packs' ``int4`` / ``int4_c8``) split the same way keeps 2 of its 4 bits
for the estimate (the low two replaced by their midpoint 1.5 steps). This script measures, on
the deploy file's own head and the float model's final hidden states (numpy reference engine)
over --positions teacher-forced tokens of tests/data/english.txt and chinese.txt:

- the estimate's error (standard deviation of estimate - logit, in logits);
- where the head's true greedy token lands: the rank of its tile among all tiles ordered by
  their largest estimate (0: the first), its maximum and 99th percentile, and the share of
  steps whose token a screen of 16 / 64 / 128 / 256 tiles would hold.

An INT8 head is measured the same way with its nibble estimate, for comparison with the screen
that is built. Activations stay float here (the engine's estimate uses their first int8 digit,
whose rounding is far below the missing bits'). One JSON line per file and text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TILES = (16, 64, 128, 256)


def head_values(qt) -> tuple[np.ndarray, np.ndarray]:
    """(exact, estimate) float32 rows of the quantized head ``qt``: the estimate keeps the
    high half of every code's bits and puts the missing low bits at their midpoint."""
    from pocketlm.quant import unpack_int4

    rows, cols = qt.shape
    gs = qt.group_size
    s = np.asarray(qt.scales, np.float32)[..., None]
    if qt.kind == "int4":
        q = np.asarray(qt.qweight)
        q = (unpack_int4(q) if q.shape[1] != cols else q).astype(np.float32)
        q = q.reshape(rows, cols // gs, gs)
        m = np.asarray(qt.mins, np.float32)[..., None]
        exact = q * s + m
        estimate = (4 * np.floor(q / 4) + 1.5) * s + m
    elif qt.kind == "int8":
        q = np.asarray(qt.qweight).astype(np.float32).reshape(rows, cols // gs, gs)
        exact = q * s
        estimate = (16 * np.floor((q + 128) / 16) - 120.5) * s
    else:
        raise SystemExit(f"a {qt.kind} head: only INT4 and INT8 heads are studied")
    return exact.reshape(rows, cols), estimate.reshape(rows, cols)


def study(path: str, positions: int) -> list[dict]:
    from pocketlm.api import file_config_and_tokenizer
    from pocketlm.formats.pocketfile import PocketFile
    from pocketlm.runtime.engine import KVCache, NumpyEngine

    pf = PocketFile(path)
    config, tokenizer = file_config_and_tokenizer(pf)
    weights = pf.weights()
    name = "lm_head.weight" if "lm_head.weight" in weights else "embed.weight"
    qt = weights[name]
    exact, estimate = head_values(qt)
    vocab = qt.shape[0]
    tiles = vocab // 16
    out = []
    for lang, text in (("en", "english.txt"), ("zh", "chinese.txt")):
        raw = (ROOT / "tests" / "data" / text).read_text(encoding="utf-8")
        ids = tokenizer.encode(raw, add_bos=False, special=False)[:positions]
        engine = NumpyEngine(config, weights)
        seen: dict[str, np.ndarray] = {}
        engine.observe = seen.__setitem__  # keeps the last input of each site
        engine.forward(np.asarray(ids, np.int64), KVCache(config, len(ids)), True)
        x = seen["head_in"]
        logits, est = x @ exact.T, x @ estimate.T
        best = logits.argmax(axis=1)
        tile_max = est[:, :tiles * 16].reshape(len(ids), tiles, 16).max(axis=2)
        own = tile_max[np.arange(len(ids)), np.minimum(best // 16, tiles - 1)]
        ranks = (tile_max > own[:, None]).sum(axis=1)
        out.append({
            "bench": "int4_head_screen", "file": Path(path).name, "head": name,
            "kind": qt.kind, "encoding": getattr(qt, "encoding", None),
            "vocab": vocab, "text": lang, "positions": len(ids),
            "estimate_error_std": round(float((est - logits).std()), 3),
            "rank_max": int(ranks.max()), "rank_p99": float(np.percentile(ranks, 99)),
            "held": {str(k): round(float((ranks < k).mean()), 4) for k in TILES},
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="deploy files (.pocket) whose head to study")
    ap.add_argument("--positions", type=int, default=300, help="tokens of each text")
    ap.add_argument("--out", help="append the JSON lines to this file")
    args = ap.parse_args()
    from pocketlm.bench import machine_info

    for path in args.files:
        for row in study(path, args.positions):
            row.update(date=time.strftime("%Y-%m-%d"), machine=machine_info(),
                       command=" ".join(["python", *sys.argv]))
            line = json.dumps(row, ensure_ascii=False)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
