"""pocketlm: app-native small language models on the CPU.

    import pocketlm
    m = pocketlm.load("smollm2-135m")
    print(m.generate("The capital of France is", max_tokens=16))
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    ChecksumError,
    ContextLengthError,
    FetchError,
    FormatError,
    GrammarError,
    KernelError,
    ModelNotFoundError,
    PocketError,
    SamplingError,
    TextError,
    TokenIdError,
    UnsupportedError,
)

__all__ = [
    "load", "PocketModel", "PocketError", "FormatError", "ChecksumError", "UnsupportedError",
    "ModelNotFoundError", "ContextLengthError", "SamplingError", "FetchError", "GrammarError",
    "TokenIdError", "TextError", "KernelError", "__version__",
]


def __getattr__(name: str):
    # the runtime (numpy, the native engine: about half a second) is imported on first use, so
    # that `pocket` is interruptible and quick to start; `pocketlm.load` works as before
    if name in ("load", "PocketModel"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pocketlm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"load", "PocketModel"})
