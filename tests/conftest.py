import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The tests run the engine's defaults (two-digit INT8 activations, float16 KV cache). The
# modules that hold an import to a float reference at float32 rounding (test_gguf_import,
# test_hf_import, test_train_loop) ask for float activations themselves.
