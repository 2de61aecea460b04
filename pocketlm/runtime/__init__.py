"""The inference runtime: weights as loaded, a KV cache, and the forward pass."""

from .engine import Engine, NativeModelEngine, NumpyEngine
from .model import KVCache, NativeKVCache, Runtime
from .settings import EngineSettings

__all__ = ["Engine", "EngineSettings", "KVCache", "NativeKVCache", "NativeModelEngine",
           "NumpyEngine", "Runtime"]
