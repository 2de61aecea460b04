"""The forward pass: one decoder for every supported family (see :mod:`pocketlm.config`).

The runtime holds weights as loaded (float32 arrays or :class:`~pocketlm.quant.QuantTensor`
views of the deploy file) and computes through :mod:`pocketlm.runtime.kernels`. It never
imports torch.

Two engines run the same math:

* the native engine (``pocketlm._native.NativeModel``): the whole forward pass, every layer
  and the output head, in one C call per :meth:`Runtime.forward`. Used when the kernel backend
  is native (``POCKET_KERNELS``, default when built) and every weight is in a layout it
  supports (INT4 / INT5 / INT8 QuantTensors, float32 arrays, C-contiguous). ``POCKET_ACT``
  picks float (``f32``) or int8 (``q8``) activations for the quantized products (default
  ``q8`` where the CPU level has SIMD int8 products, ``f32`` at the portable scalar level),
  ``POCKET_KV`` the KV cache format (``f32`` | ``f16`` | ``q8``; default ``f32`` with f32
  activations, ``f16`` with q8), ``POCKET_THREADS`` the threads (default: 2, or fewer CPUs).
  Its caches are :class:`NativeKVCache` objects.
* the numpy reference below (``POCKET_KERNELS=numpy``; also for weights handed in a layout the
  engine does not take, see :class:`Runtime`), which computes layer by layer through
  :mod:`pocketlm.runtime.kernels` and is the specification the native engine is tested
  against. A model the native engine refuses is an error, not a reason to switch engines.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import ContextLengthError, FormatError
from ..quant import QuantTensor
from . import kernels as K
from .kernels import native as _native_kernels

Weight = np.ndarray | QuantTensor


class KVCache:
    """Keys and values of every layer for up to ``capacity`` positions (float32)."""

    def __init__(self, config: ModelConfig, capacity: int):
        if capacity <= 0:
            raise ContextLengthError(f"KV cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        shape = (capacity, config.n_kv_heads, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.n_layers)]
        self.length = 0  # positions filled

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (to reuse a shared prompt prefix)."""
        self.length = max(0, min(length, self.length))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class NativeKVCache(KVCache):
    """A KV cache of the native engine (keys and values live in C memory: float32, float16 or
    int8).

    Same interface as :class:`KVCache` (``capacity``, ``length``, ``reset``, ``truncate``,
    ``nbytes``); usable only with the runtime that created it."""

    def __init__(self, engine, capacity: int):  # not KVCache.__init__: no numpy arrays
        if capacity <= 0:
            raise ContextLengthError(f"KV cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self.engine = engine
        self.kv = engine.new_kv(capacity)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class Runtime:
    def __init__(self, config: ModelConfig, weights: dict[str, Weight], *,
                 engine: str | None = None, file_backed: bool = False):
        """``engine``: ``"native"`` (required: raises if it cannot be used), ``"numpy"`` (the
        reference) or None (native when the native backend is in force, ``POCKET_KERNELS``;
        numpy only when a weight is in a layout the engine does not take, with the reason in
        ``engine_note``: a model the engine refuses is a KernelError, never a quiet switch to
        numpy). ``file_backed``: the quantized weights are views of a read-only file mapping
        (a deploy file), so the native engine may drop their pages once copied."""
        self.config = config
        expected = config.tensor_shapes()
        for name, shape in expected.items():
            w = weights.get(name)
            if w is None:
                raise FormatError(f"model weights lack tensor {name!r}")
            if tuple(w.shape) != tuple(shape):
                raise FormatError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
        self.w = weights
        self._head = weights.get("lm_head.weight", weights["embed.weight"])
        self._rope_cache: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self.native = None  # the native engine, when in use
        self.engine_note = ""  # why the native engine is not in use
        if engine not in (None, "native", "numpy"):
            raise ValueError(f"engine must be 'native', 'numpy' or None, got {engine!r}")
        if engine == "native" or (engine is None and K.backend_name() == "native"):
            # a bad POCKET_* setting is the user's error, not a model the engine cannot run
            _native_kernels.check_settings()
            if not _native_kernels.engine_available():
                reason = _native_kernels.unavailable_reason() or "the native engine is not built"
            else:
                reason = _native_kernels.engine_weights(config, weights)[1]
            if reason and engine is None:
                # weights handed in a layout only the reference reads (or no engine built):
                # the numpy path, and the reason is kept; nothing else falls back
                self.engine_note = reason
            else:
                # a model the engine refuses is an error: running it anyway on the numpy path
                # would hide the problem (POCKET_KERNELS=numpy is the way to ask for numpy)
                self.native = _native_kernels.NativeEngine(config, weights,
                                                           release_source=file_backed)

    @property
    def engine(self) -> str:
        """``"native"`` (the whole forward pass in C) or ``"numpy"`` (layer by layer)."""
        return "native" if self.native is not None else "numpy"

    def new_cache(self, capacity: int | None = None) -> KVCache:
        cap = self.config.max_context if capacity is None else capacity
        if cap > self.config.max_context:
            raise ContextLengthError(f"requested context {cap} exceeds the model's maximum "
                                     f"{self.config.max_context}")
        if self.native is not None and cap > 0:
            return NativeKVCache(self.native, cap)
        return KVCache(self.config, cap)

    def cache_nbytes(self, capacity: int) -> int:
        """Bytes of keys and values that :meth:`new_cache` allocates for ``capacity``
        positions (the native engine rounds positions up to 16 and may store float16, or int8
        with a float16 scale per 16 values)."""
        c = self.config
        if self.native is None:
            return 2 * c.n_layers * capacity * c.n_kv_heads * c.head_dim * 4
        positions = -(-capacity // 16) * 16
        fmt = self.native.kv_format
        per_head = c.head_dim * 4 if fmt == "f32" else c.head_dim * 2 if fmt == "f16" \
            else c.head_dim + c.head_dim // 16 * 2
        return 2 * c.n_layers * c.n_kv_heads * positions * per_head

    def forward_batch(self, ids, caches: list[KVCache]) -> np.ndarray:
        """One token for each of several sequences (continuous batching): ``ids[i]`` runs at
        the next position of ``caches[i]``; returns float32 logits ``[len(ids), vocab]``.

        The native engine streams the weights once for the whole batch; each row computes what
        :meth:`forward` of that one token computes (to float rounding: a one-token forward
        splits its attention differently), and bit for bit what it computes in any other batch
        (results do not depend on who else is in the batch). The caches must be distinct."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("forward_batch() needs at least one token")
        if len(caches) != n:
            raise ValueError(f"{len(caches)} caches for {n} tokens")
        if len({id(c) for c in caches}) != n:
            raise ValueError("a KV cache appears twice in one batch")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        for c in caches:
            if c.length >= c.capacity:
                raise ContextLengthError(f"{c.length + 1} tokens do not fit the context of "
                                         f"{c.capacity}")
        if all(isinstance(c, NativeKVCache) for c in caches):
            if any(self.native is None or c.engine is not self.native for c in caches):
                raise ValueError("this KV cache belongs to another runtime")
            pos = np.array([c.length for c in caches], dtype=np.int32)
            logits = self.native.forward_batch([c.kv for c in caches], ids.astype(np.int32),
                                               pos)
            for c in caches:
                c.length += 1
            return logits
        return np.stack([self.forward(ids[i:i + 1], c) for i, c in enumerate(caches)])

    def copy_prefix(self, dst: KVCache, src: KVCache, n: int) -> None:
        """Make the first ``n`` positions of ``dst`` those of ``src`` (``dst.length = n``): a
        prompt prefix computed once serves another sequence."""
        if dst is src:
            raise ValueError("copy_prefix() needs two different caches")
        if not 0 <= n <= min(src.length, dst.capacity):
            raise ContextLengthError(f"cannot copy {n} positions from a cache holding "
                                     f"{src.length} into one of capacity {dst.capacity}")
        if isinstance(src, NativeKVCache) != isinstance(dst, NativeKVCache):
            raise ValueError("copy_prefix() needs two caches of the same engine")
        if isinstance(src, NativeKVCache):
            if src.engine is not self.native or dst.engine is not self.native:
                raise ValueError("this KV cache belongs to another runtime")
            self.native.kv_copy(dst.kv, src.kv, n)
        else:
            for layer in range(self.config.n_layers):
                dst.k[layer][:n] = src.k[layer][:n]
                dst.v[layer][:n] = src.v[layer][:n]
        dst.length = n

    def _rope(self, theta: float, positions: np.ndarray):
        end = int(positions.max()) + 1
        cached = self._rope_cache.get(theta)
        if cached is None or cached[0].shape[0] < end:
            size = max(end, 256 if cached is None else 2 * cached[0].shape[0])
            cached = K.rope_tables(np.arange(size), self.config.head_dim, theta)
            self._rope_cache[theta] = cached
        return cached[0][positions], cached[1][positions]

    def forward(self, ids, cache: KVCache, *, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` at the next positions of ``cache``; return float32 logits
        ``[len(ids), vocab]`` (``all_logits``) or ``[vocab]`` for the last token."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("forward() needs at least one token")
        start = cache.length
        if start + n > cache.capacity:
            raise ContextLengthError(f"{start + n} tokens do not fit the context of "
                                     f"{cache.capacity}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
        if isinstance(cache, NativeKVCache):
            if self.native is None or cache.engine is not self.native:
                raise ValueError("this KV cache belongs to another runtime")
            logits = self.native.forward(cache.kv, ids.astype(np.int32), start, all_logits)
            cache.length = start + n
            return logits
        positions = np.arange(start, start + n)
        w = self.w
        x = K.embedding(w["embed.weight"], ids)  # [n, d_model]
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            # attention
            h = K.rmsnorm(x, w[p + "attn_norm.weight"], cfg.norm_eps)
            q = K.linear(h, w[p + "attn.w_q.weight"], w.get(p + "attn.w_q.bias"))
            k = K.linear(h, w[p + "attn.w_k.weight"], w.get(p + "attn.w_k.bias"))
            v = K.linear(h, w[p + "attn.w_v.weight"], w.get(p + "attn.w_v.bias"))
            q = q.reshape(n, cfg.n_heads, cfg.head_dim)
            k = k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = K.rmsnorm(q, w[p + "attn.q_norm.weight"], cfg.norm_eps)
                k = K.rmsnorm(k, w[p + "attn.k_norm.weight"], cfg.norm_eps)
            cos, sin = self._rope(cfg.layer_rope_theta(i), positions)
            q = K.rope(q, cos, sin)
            k = K.rope(k, cos, sin)
            cache.k[i][start:start + n] = k
            cache.v[i][start:start + n] = v
            a = K.attention(q, cache.k[i][:start + n], cache.v[i][:start + n], positions,
                            cfg.scale, cfg.layer_window(i))  # [n, H, hd]
            o = K.linear(np.ascontiguousarray(a.reshape(n, cfg.q_dim)),
                         w[p + "attn.w_o.weight"])
            if cfg.sandwich_norms:
                o = K.rmsnorm(o, w[p + "post_attn_norm.weight"], cfg.norm_eps)
            x = x + o
            # MLP
            h = K.rmsnorm(x, w[p + "mlp_norm.weight"], cfg.norm_eps)
            gate = K.linear(h, w[p + "mlp.w_gate.weight"])
            up = K.linear(h, w[p + "mlp.w_up.weight"])
            act = K.silu(gate) if cfg.activation == "silu" else K.gelu_tanh(gate)
            d = K.linear(np.ascontiguousarray(act * up), w[p + "mlp.w_down.weight"])
            if cfg.sandwich_norms:
                d = K.rmsnorm(d, w[p + "post_mlp_norm.weight"], cfg.norm_eps)
            x = x + d
        cache.length = start + n
        if not all_logits:
            x = x[-1:]
        x = K.rmsnorm(np.ascontiguousarray(x), w["norm.weight"], cfg.norm_eps)
        logits = K.linear(x, self._head)
        return logits if all_logits else logits[0]
