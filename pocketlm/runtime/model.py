"""The forward pass: one decoder for every supported family (see :mod:`pocketlm.config`).

The runtime holds weights as loaded (float32 arrays or :class:`~pocketlm.quant.QuantTensor`
views of the deploy file) and computes through :mod:`pocketlm.runtime.kernels`. It never
imports torch.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import ContextLengthError, FormatError
from ..quant import QuantTensor
from . import kernels as K

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


class Runtime:
    def __init__(self, config: ModelConfig, weights: dict[str, Weight]):
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

    def new_cache(self, capacity: int | None = None) -> KVCache:
        cap = self.config.max_context if capacity is None else capacity
        if cap > self.config.max_context:
            raise ContextLengthError(f"requested context {cap} exceeds the model's maximum "
                                     f"{self.config.max_context}")
        return KVCache(self.config, cap)

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
