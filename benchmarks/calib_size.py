"""How many calibration sequences: the 4.6-bit budget of smollm2-135m calibrated on N sequences
of the default set (128 is the default), held-out perplexity as benchmarks/quant_quality.py
measures it; one JSON line per run (method ``pocket-bpw-4.6-calibN``).

    python benchmarks/calib_size.py 384 >> benchmarks/calib_size.jsonl
"""

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_quality as qq  # noqa: E402

from pocketlm import calibdata  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, metavar="N", help="calibration sequences of 128 tokens")
    n = ap.parse_args().n
    if n < 1:
        ap.error(f"N must be at least 1, got {n}")
    calibdata.default_set = functools.partial(calibdata.default_set, n_sequences=n)
    qq.POCKET_METHODS[f"pocket-bpw-4.6-calib{n}"] = {"bits_per_weight": 4.6}
    sys.argv = ["benchmarks/calib_size.py", "run", "--models", "smollm2-135m", "--methods",
                f"pocket-bpw-4.6-calib{n}"]
    qq.main()


if __name__ == "__main__":
    main()
