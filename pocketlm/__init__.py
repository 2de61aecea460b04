"""pocketlm: app-native small language models on the CPU.

    import pocketlm
    m = pocketlm.load("smollm2-135m")
    print(m.generate("The capital of France is", max_tokens=16))
"""

__version__ = "0.1.0"

from .api import PocketModel, load  # noqa: E402
from .errors import (  # noqa: E402
    ChecksumError,
    ContextLengthError,
    FetchError,
    FormatError,
    ModelNotFoundError,
    PocketError,
    SamplingError,
    UnsupportedError,
)

__all__ = [
    "load", "PocketModel", "PocketError", "FormatError", "ChecksumError", "UnsupportedError",
    "ModelNotFoundError", "ContextLengthError", "SamplingError", "FetchError", "__version__",
]
