"""The inference runtime: weights as loaded, a KV cache, and the forward pass."""

from .model import KVCache, NativeKVCache, Runtime

__all__ = ["KVCache", "NativeKVCache", "Runtime"]
