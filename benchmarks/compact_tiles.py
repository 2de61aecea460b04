"""The engine's compact tiles against float16 scales and minimums in every tile
(POCKET_COMPACT_TILES 1 / 0): bytes streamed per token, prefill, one-token decode and
speculative verification steps, side by side.

    python benchmarks/compact_tiles.py -m qwen2.5-0.5b -m model-4.6.pocket [--rounds 6] \\
        --out benchmarks/compact_tiles.jsonl
    python benchmarks/compact_tiles.py -m qwen2.5-0.5b --pocket-bench --rounds 4 \\
        --out benchmarks/compact_tiles.jsonl
    python benchmarks/compact_tiles.py -m qwen2.5-0.5b --one-process --rounds 12 \\
        --out benchmarks/compact_tiles.jsonl

The same harness as benchmarks/huge_pages.py (one worker process per setting, the order
alternating round by round, every output compared bit for bit), for this setting: INT4 tensors
with coded scales (``int4_c8``, what ``pocket pack --bits-per-weight 4.6`` writes) keep their
codes in the tiles, 4.5 bits per weight instead of 5.0, and INT4 / INT5 tensors with implicit
minimums (a GGUF's Q4_0 / Q5_0, e.g. qwen2.5-0.5b's default pack) keep none, 0.5 bits per
weight fewer. ``tile_mb`` is what the tiles hold (a greedy step reads all but a screened
head's low plane). Summary ratios: compact over float16 (above 1 is faster for tokens/s, below
1 for milliseconds). The first rows of benchmarks/compact_tiles.jsonl were taken when this
script was benchmarks/coded_scales.py and the variable POCKET_CODED_SCALES (labels
``coded-scales``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import huge_pages  # noqa: E402

COMPACT_TILES = {"variable": "POCKET_COMPACT_TILES", "label": "compact-tiles", "on": "compact",
                 "off": "f16", "key": "compact_tiles"}

if __name__ == "__main__":
    huge_pages.main(COMPACT_TILES, __doc__)
