"""The engines behind :class:`~pocketlm.runtime.model.Runtime`, and their KV caches.

An :class:`Engine` computes the forward pass over one model's weights and owns the caches it
creates. Two implement it, with the same math:

* :class:`NumpyEngine` (``"numpy"``): the reference, layer by layer in numpy only
  (:mod:`pocketlm.runtime.kernels.numpy_ref`, for every weight kind); it never calls the
  native extension, so it is the specification the native engine is tested against.
* :class:`NativeModelEngine` (``"native"``): the whole forward pass in one C call
  (:class:`pocketlm.runtime.kernels.native.NativeEngine`), keys and values in C memory.

The engines trust their arguments: the runtime checks token ids, capacities and cache
ownership once, before calling them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..config import ModelConfig
from ..errors import ContextLengthError
from ..head_patch import head_patch_of
from .adapters import find_adapters
from .kernels import numpy_ref as R


def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or \
            capacity <= 0:
        raise ContextLengthError(f"KV cache capacity must be a positive number of positions, "
                                 f"got {capacity!r}")
    return int(capacity)


class CacheGuard:
    """Which call holds a KV cache: the first of the calls that asked, each named by a token
    of its own. Entering and leaving are single list operations (atomic under the GIL), and
    leaving with a token that never entered does nothing, so a call interrupted anywhere
    (Ctrl-C arrives between any two bytecodes) leaves by its token and never leaves the cache
    held: a lock acquired just before the interrupt, not yet recorded by its holder, stayed
    acquired and refused every later call on that cache."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: list[object] = []

    def enter(self, token: object) -> bool:
        """Ask for the cache: true when this call holds it; false (and gone) when another
        does."""
        self._calls.append(token)
        if self._calls[0] is token:
            return True
        self.leave(token)
        return False

    def leave(self, token: object) -> None:
        try:
            self._calls.remove(token)
        except ValueError:
            pass  # never entered, or refused


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions (float32)."""

    def __init__(self, config: ModelConfig, capacity: int):
        capacity = _check_capacity(capacity)
        self.capacity = capacity
        shape = (capacity, config.n_kv_heads, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.n_layers)]
        self.length = 0  # positions filled
        self.engine = None  # the engine that made it (None: made directly)
        self.busy = CacheGuard()  # held by the runtime call that runs it

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (to reuse a shared prompt prefix); a
        ``length`` at or beyond the positions filled forgets nothing."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ContextLengthError(f"truncate() takes a number of positions >= 0, got "
                                     f"{length!r}")
        self.length = min(int(length), self.length)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class NativeKVCache(KVCache):
    """A KV cache of the native engine (keys and values live in C memory: float32, float16 or
    int8).

    Same interface as :class:`KVCache` (``capacity``, ``length``, ``reset``, ``truncate``,
    ``nbytes``); usable only with the runtime that created it."""

    def __init__(self, engine, capacity: int):  # not KVCache.__init__: no numpy arrays
        capacity = _check_capacity(capacity)
        self.capacity = capacity
        self.length = 0
        self.engine = engine
        self.busy = CacheGuard()
        self.kv = engine.new_kv(capacity)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class Engine(ABC):
    """The forward pass of one model. ``ids``: int64 ``[n]`` token ids in the vocabulary; a
    cache passed in was created by :meth:`new_cache` of this engine (:meth:`owns`) and has room
    for the tokens."""

    name: str
    native = None  # the native engine (kernels.native.NativeEngine), where there is one

    @abstractmethod
    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for ``capacity`` (> 0) positions."""

    @abstractmethod
    def owns(self, cache) -> bool:
        """Whether ``cache`` is one of this engine's."""

    @abstractmethod
    def cache_nbytes(self, capacity: int) -> int:
        """Bytes of keys and values of a cache of ``capacity`` positions."""

    @abstractmethod
    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool,
                screen: bool = False) -> np.ndarray:
        """Run ``ids`` at the next positions of ``cache`` (its ``length`` grows by
        ``len(ids)``); float32 logits ``[n, vocab]`` (all_logits) or ``[vocab]``.
        ``screen``: the caller takes the largest logit only, so an engine with a screened head
        may leave estimates away from its best rows (docs/engine.md)."""

    @abstractmethod
    def forward_batch(self, ids: np.ndarray, caches: list[KVCache],
                      screen: list[bool] | None = None) -> np.ndarray:
        """One token per distinct cache: ``ids[i]`` at the next position of ``caches[i]``;
        float32 logits ``[n, vocab]``. ``screen``: per row, as in :meth:`forward`."""

    @abstractmethod
    def copy_prefix(self, dst: KVCache, src: KVCache, n: int) -> None:
        """Positions ``[0, n)`` of ``src`` into ``dst``, and ``dst.length = n``."""

    def verify(self, ids: np.ndarray, cache: KVCache, screen: bool = False) -> np.ndarray:
        """Logits ``[n, vocab]`` of ``ids`` at the next positions of ``cache``, row ``i``
        what a one-token :meth:`forward` (with the same ``screen``) computes after the rows
        before it. Here: exactly that, one token at a time (engines with a one-pass form
        override it)."""
        return np.stack([self.forward(ids[i:i + 1], cache, False, screen)
                         for i in range(len(ids))])

    def verify_batch(self, drafts: list[tuple[np.ndarray, KVCache]],
                     screen: list[bool] | None = None) -> list[np.ndarray]:
        """:meth:`verify` of several sequences (distinct caches), in one pass where the engine
        has one; ``screen``: per sequence."""
        return [self.verify(ids, cache, bool(screen and screen[i]))
                for i, (ids, cache) in enumerate(drafts)]


class NumpyEngine(Engine):
    """The reference: the forward pass layer by layer, in numpy only."""

    name = "numpy"

    def __init__(self, config: ModelConfig, weights: dict, *, logits: bool = True):
        """``logits=False``: the forward pass stops at the head's input (what calibration
        observes) and returns ``[rows, 0]`` logits, without the head's products."""
        self.config = config
        self.w = weights
        self.logits = logits
        self._head = weights.get("lm_head.weight", weights["embed.weight"])
        # the head patch (pocketlm.head_patch): (INT8 rows, their ids), or None
        self._patch = head_patch_of(weights, config.vocab_size, config.d_model)
        self._rope_cache: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self._adapters = None  # LoRA adapters (runtime.adapters), found on the first forward
        # observe(site, x): called with the input of each group of linear products (sites
        # "layers.{i}.attn_in", ".o_in", ".mlp_in", ".down_in" and "head_in"); calibration
        # gathers activation statistics through it
        self.observe = None

    def new_cache(self, capacity: int) -> KVCache:
        cache = KVCache(self.config, capacity)
        cache.engine = self
        return cache

    def owns(self, cache) -> bool:
        """One of this engine's caches, or one made directly for this config's shapes."""
        c = self.config
        if not isinstance(cache, KVCache) or isinstance(cache, NativeKVCache):
            return False
        return cache.engine is self or (
            cache.engine is None and len(cache.k) == c.n_layers
            and all(np.shape(a)[1:] == (c.n_kv_heads, c.head_dim) for a in cache.k + cache.v))

    def cache_nbytes(self, capacity: int) -> int:
        c = self.config
        return 2 * c.n_layers * capacity * c.n_kv_heads * c.head_dim * 4

    def forward_batch(self, ids: np.ndarray, caches: list[KVCache],
                      screen: list[bool] | None = None) -> np.ndarray:
        return np.stack([self.forward(ids[i:i + 1], c, False) for i, c in enumerate(caches)])

    def copy_prefix(self, dst: KVCache, src: KVCache, n: int) -> None:
        for layer in range(self.config.n_layers):
            dst.k[layer][:n] = src.k[layer][:n]
            dst.v[layer][:n] = src.v[layer][:n]
        dst.length = n

    def _rope(self, theta: float, positions: np.ndarray):
        end = int(positions.max()) + 1
        cached = self._rope_cache.get(theta)
        if cached is None or cached[0].shape[0] < end:
            size = max(end, 256 if cached is None else 2 * cached[0].shape[0])
            cached = R.rope_tables(np.arange(size), self.config.head_dim, theta)
            self._rope_cache[theta] = cached
        return cached[0][positions], cached[1][positions]

    def _linear(self, stem: str, x: np.ndarray, bias: bool = False) -> np.ndarray:
        """x W^T (+ bias) of the weight ``stem``, plus its LoRA adapter's (x A^T) B^T."""
        w = self.w
        y = R.linear_ref(x, w[stem + ".weight"], w.get(stem + ".bias") if bias else None)
        ab = self._adapters.get(stem)
        if ab is not None:
            y = y + (x @ ab[0].T) @ ab[1].T
        return y

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool,
                screen: bool = False) -> np.ndarray:
        # every logit is the head's here: ``screen`` allows estimates, never requires them
        cfg = self.config
        n = ids.shape[0]
        start = cache.length
        positions = np.arange(start, start + n)
        w = self.w
        if self._adapters is None:  # the adapters' part in float32
            self._adapters = {stem: (a.astype(np.float32), b.astype(np.float32))
                              for stem, (a, b) in find_adapters(cfg, w).items()}
        lin = self._linear
        obs = self.observe or (lambda site, a: None)
        x = R.embedding_ref(w["embed.weight"], ids)  # [n, d_model]
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            # attention
            h = R.rmsnorm_ref(x, w[p + "attn_norm.weight"], cfg.norm_eps)
            obs(p + "attn_in", h)
            q = lin(p + "attn.w_q", h, True)
            k = lin(p + "attn.w_k", h, True)
            v = lin(p + "attn.w_v", h, True)
            q = q.reshape(n, cfg.n_heads, cfg.head_dim)
            k = k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = R.rmsnorm_ref(q, w[p + "attn.q_norm.weight"], cfg.norm_eps)
                k = R.rmsnorm_ref(k, w[p + "attn.k_norm.weight"], cfg.norm_eps)
            cos, sin = self._rope(cfg.layer_rope_theta(i), positions)
            q = R.rope_ref(q, cos, sin)
            k = R.rope_ref(k, cos, sin)
            cache.k[i][start:start + n] = k
            cache.v[i][start:start + n] = v
            a = R.attention_ref(q, cache.k[i][:start + n], cache.v[i][:start + n], positions,
                                cfg.scale, cfg.layer_window(i))  # [n, H, hd]
            a = np.ascontiguousarray(a.reshape(n, cfg.q_dim))
            obs(p + "o_in", a)
            o = lin(p + "attn.w_o", a)
            if cfg.sandwich_norms:
                o = R.rmsnorm_ref(o, w[p + "post_attn_norm.weight"], cfg.norm_eps)
            x = x + o
            # MLP
            h = R.rmsnorm_ref(x, w[p + "mlp_norm.weight"], cfg.norm_eps)
            obs(p + "mlp_in", h)
            gate = lin(p + "mlp.w_gate", h)
            up = lin(p + "mlp.w_up", h)
            act = R.silu_ref(gate) if cfg.activation == "silu" else R.gelu_tanh_ref(gate)
            act = np.ascontiguousarray(act * up)
            obs(p + "down_in", act)
            d = lin(p + "mlp.w_down", act)
            if cfg.sandwich_norms:
                d = R.rmsnorm_ref(d, w[p + "post_mlp_norm.weight"], cfg.norm_eps)
            x = x + d
        cache.length = start + n
        if not all_logits:
            x = x[-1:]
        x = R.rmsnorm_ref(np.ascontiguousarray(x), w["norm.weight"], cfg.norm_eps)
        obs("head_in", x)
        if not self.logits:
            return np.zeros((len(x), 0) if all_logits else (0,), np.float32)
        logits = R.linear_ref(x, self._head)
        if self._patch is not None:  # the patch's rows written over the head's
            logits[:, self._patch[1]] = R.linear_ref(x, self._patch[0])
        return logits if all_logits else logits[0]


class NativeModelEngine(Engine):
    """The whole forward pass in C: ``native`` is the
    :class:`~pocketlm.runtime.kernels.native.NativeEngine` holding the model."""

    name = "native"

    def __init__(self, config: ModelConfig, native):
        self.config = config
        self.native = native

    def new_cache(self, capacity: int) -> NativeKVCache:
        return NativeKVCache(self.native, capacity)

    def owns(self, cache) -> bool:
        return isinstance(cache, NativeKVCache) and cache.engine is self.native

    def cache_nbytes(self, capacity: int) -> int:
        """Positions rounded up to 16; float32, float16, or int8 with a float16 scale per 16
        values."""
        c = self.config
        positions = -(-capacity // 16) * 16
        fmt = self.native.kv_format
        per_head = c.head_dim * 4 if fmt == "f32" else c.head_dim * 2 if fmt == "f16" \
            else c.head_dim + c.head_dim // 16 * 2
        return 2 * c.n_layers * c.n_kv_heads * positions * per_head

    def forward(self, ids: np.ndarray, cache: NativeKVCache, all_logits: bool,
                screen: bool = False) -> np.ndarray:
        start = cache.length
        logits = self.native.forward(cache.kv, ids.astype(np.int32), start, all_logits,
                                     screen=screen)
        cache.length = start + ids.shape[0]
        return logits

    def forward_batch(self, ids: np.ndarray, caches: list[NativeKVCache],
                      screen: list[bool] | None = None) -> np.ndarray:
        pos = np.array([c.length for c in caches], dtype=np.int32)
        logits = self.native.forward_batch([c.kv for c in caches], ids.astype(np.int32), pos,
                                           screen=screen)
        for c in caches:
            c.length += 1
        return logits

    def copy_prefix(self, dst: NativeKVCache, src: NativeKVCache, n: int) -> None:
        self.native.kv_copy(dst.kv, src.kv, n)
        dst.length = n

    def verify(self, ids: np.ndarray, cache: NativeKVCache, screen: bool = False) -> np.ndarray:
        start = cache.length
        logits = self.native.verify(cache.kv, ids.astype(np.int32), start, screen=screen)
        cache.length = start + ids.shape[0]
        return logits

    def verify_batch(self, drafts: list[tuple[np.ndarray, NativeKVCache]],
                     screen: list[bool] | None = None) -> list[np.ndarray]:
        kvs, pos, rows = [], [], []
        for i, (ids, cache) in enumerate(drafts):
            kvs += [cache.kv] * len(ids)
            pos += range(cache.length, cache.length + len(ids))
            rows += [bool(screen and screen[i])] * len(ids)
        flat = np.concatenate([ids for ids, _ in drafts]).astype(np.int32)
        logits = self.native.verify_batch(kvs, flat, np.asarray(pos, dtype=np.int32),
                                          screen=rows)
        out, at = [], 0
        for ids, cache in drafts:
            out.append(logits[at:at + len(ids)])
            at += len(ids)
            cache.length += len(ids)
        return out
