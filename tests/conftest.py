import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The tests run the engine's defaults (two-digit INT8 activations, float16 KV cache). The
# modules that hold an import to a float reference at float32 rounding (test_gguf_import,
# test_hf_import, test_train_loop) ask for float activations with FLOAT_ACTIVATIONS = True.


@pytest.fixture(scope="module", autouse=True)
def _float_activations(request):
    """POCKET_ACT=f32 for a module that sets FLOAT_ACTIVATIONS (the engine's default int8
    activations have their own bounds in test_native_forward.py and test_runtime.py)."""
    if not getattr(request.module, "FLOAT_ACTIVATIONS", False):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_ACT", "f32")
        yield


@pytest.fixture
def clean_env(monkeypatch):
    """No engine variable (POCKET_*) set: the test suite's own defaults removed too."""
    from pocketlm.runtime.settings import VARIABLES

    for var in VARIABLES.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch
