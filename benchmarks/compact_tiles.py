"""INT4 weights with coded scales (``int4_c8``) held coded in the engine's tiles, or decoded to
float16 scales and minimums (POCKET_COMPACT_TILES 1 / 0): bytes streamed per token, prefill,
one-token decode and speculative verification steps, side by side.

    python benchmarks/compact_tiles.py -m model-4.6.pocket [--rounds 6] \\
        --out benchmarks/compact_tiles.jsonl
    python benchmarks/compact_tiles.py -m model-4.6.pocket --pocket-bench --rounds 4 \\
        --out benchmarks/compact_tiles.jsonl

The same harness as benchmarks/huge_pages.py (one worker process per setting, the order
alternating round by round, every output compared bit for bit), for this setting: a pack made
with ``pocket pack SRC -o OUT --bits-per-weight 4.6`` holds its INT4 tensors with coded scales;
with the codes in its tiles, the avx512 level reads 4.5 bits per weight (plus two float16
steps per row) instead of 5.0. ``tile_mb`` is what the products stream per token. Summary
ratios: coded over float16 (above 1 is faster for tokens/s, below 1 for milliseconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import huge_pages  # noqa: E402

CODED_SCALES = {"variable": "POCKET_COMPACT_TILES", "label": "coded-scales", "on": "coded",
                "off": "f16", "key": "compact_tiles"}

if __name__ == "__main__":
    huge_pages.main(CODED_SCALES, __doc__)
