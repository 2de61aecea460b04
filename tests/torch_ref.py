"""Reference decoder in PyTorch: the oracle pocketlm's numpy runtime is tested against.

Written for obviousness, not speed: float64 by default, one sequence at a time, attention as
an explicit masked softmax, the KV cache kept whole (the sliding window is applied by the mask,
never by evicting entries).  It reads only :class:`pocketlm.config.ModelConfig` from pocketlm;
every formula below is written out from the conventions documented there:

* norm:    ``x * rsqrt(mean(x^2) + eps) * weight``
* RoPE:    rotate-half over the full ``head_dim``, ``inv_freq[i] = theta^(-2i / head_dim)``
* linear:  ``x @ weight.T + bias``
* block:   ``h = x + [post_attn_norm](attn(attn_norm(x)))``;
           ``out = h + [post_mlp_norm](mlp(mlp_norm(h)))``  (bracketed norms: sandwich_norms)
* MLP:     ``w_down(act(w_gate(x)) * w_up(x))``
* logits:  ``norm(h) @ (lm_head or embed).T``

Reading order follows the model: norm -> rope -> attention -> MLP -> block -> model, then the
test helpers (tiny configs, random weights) and the INT4 fake-quantizer.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    from pocketlm.config import ModelConfig
except ModuleNotFoundError:  # run from outside the repository root: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pocketlm.config import ModelConfig

# the numpy fixtures (tiny configs, random weights, the INT4 round trip), re-exported here for
# the reference tiers, live in tiny_models.py, which needs no torch
from tiny_models import fake_quantize_int4, random_state_dict, tiny_config  # noqa: E402

__all__ = [
    "TorchRefModel",
    "apply_rope",
    "attention_mask",
    "fake_quantize_int4",
    "random_state_dict",
    "rms_norm",
    "rope_cos_sin",
    "rotate_half",
    "tiny_config",
]


# -------------------------------------------------------------------------------------------
# norm
# -------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * weight`` (eps inside the root)."""
    mean_square = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(mean_square + eps) * weight


# -------------------------------------------------------------------------------------------
# rope
# -------------------------------------------------------------------------------------------
def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (T, head_dim), for absolute ``positions`` (T,).

    Frequencies ``theta^(-2i/head_dim)`` for i in [0, head_dim/2) are computed in float64 and
    laid out twice (``[f0..f_{h/2-1}, f0..f_{h/2-1}]``) to match :func:`rotate_half`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (head_dim/2,)
    inv_freq = float(theta) ** (-exponents)  # (head_dim/2,)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1), halves taken over the last axis."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (heads, T, head_dim) by position; cos/sin are (T, head_dim)."""
    return x * cos + rotate_half(x) * sin


# -------------------------------------------------------------------------------------------
# attention
# -------------------------------------------------------------------------------------------
def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean (Tq, Tk): True where the query at q_pos may see the key at k_pos.

    Causal: k_pos <= q_pos.  With a window W (tokens, the current one included) also
    k_pos >= q_pos - W + 1, i.e. the query at p sees keys p-W+1 .. p.
    """
    q = q_pos[:, None]  # (Tq, 1)
    k = k_pos[None, :]  # (1, Tk)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed


@contextlib.contextmanager
def _single_thread():
    # The tensors here are tiny: intra-op threads only add overhead (badly so on a busy
    # machine).  The caller's setting is restored afterwards.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    y = x @ weight.T
    return y if bias is None else y + bias


class _LayerCache:
    """Everything one layer has seen: keys and values after RoPE, with their positions."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.k = torch.zeros(n_kv_heads, 0, head_dim, dtype=dtype)  # (n_kv_heads, T, head_dim)
        self.v = torch.zeros(n_kv_heads, 0, head_dim, dtype=dtype)  # (n_kv_heads, T, head_dim)
        self.pos = torch.zeros(0, dtype=torch.long)  # (T,)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k], dim=1)
        self.v = torch.cat([self.v, v], dim=1)
        self.pos = torch.cat([self.pos, pos])


# -------------------------------------------------------------------------------------------
# model (attention, MLP, block, stack)
# -------------------------------------------------------------------------------------------
class TorchRefModel:
    """The reference decoder for any :class:`ModelConfig`.

    ``state_dict`` maps exactly the names of ``config.tensor_shapes()`` to arrays of those
    shapes (a missing, extra or misshapen tensor raises ValueError).
    """

    def __init__(
        self,
        config: ModelConfig,
        state_dict: dict[str, np.ndarray],
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.config = config
        self.dtype = dtype
        expected = config.tensor_shapes()
        missing = sorted(set(expected) - set(state_dict))
        extra = sorted(set(state_dict) - set(expected))
        if missing or extra:
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {extra}")
        self.w: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            array = np.asarray(state_dict[name])
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(array.shape)}, expected {tuple(shape)}")
            self.w[name] = torch.from_numpy(np.array(array, dtype=np.float64)).to(dtype)

    # -- pieces --------------------------------------------------------------------------
    def _get(self, name: str) -> torch.Tensor | None:
        return self.w.get(name)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.config.norm_eps)

    def attention(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: _LayerCache | None
    ) -> torch.Tensor:
        """Self-attention of layer ``layer`` for x (T, d_model) at absolute ``positions`` (T,).

        Without a cache the T tokens attend among themselves; with one, their keys/values are
        appended to it first and they attend to everything it holds.
        """
        cfg = self.config
        p = f"layers.{layer}.attn."
        T = x.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        q = _linear(x, self.w[p + "w_q.weight"], self._get(p + "w_q.bias"))  # (T, H*D)
        k = _linear(x, self.w[p + "w_k.weight"], self._get(p + "w_k.bias"))  # (T, KV*D)
        v = _linear(x, self.w[p + "w_v.weight"], self._get(p + "w_v.bias"))  # (T, KV*D)
        q = q.view(T, H, D).transpose(0, 1)  # (H, T, D)
        k = k.view(T, KV, D).transpose(0, 1)  # (KV, T, D)
        v = v.view(T, KV, D).transpose(0, 1)  # (KV, T, D)

        if cfg.qk_norm:  # per head, over head_dim, before RoPE
            q = rms_norm(q, self.w[p + "q_norm.weight"], cfg.norm_eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], cfg.norm_eps)

        cos, sin = rope_cos_sin(positions, D, cfg.layer_rope_theta(layer), self.dtype)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        if cache is not None:
            cache.append(k, v, positions)
            k, v, k_pos = cache.k, cache.v, cache.pos  # (KV, Tk, D), (KV, Tk, D), (Tk,)
        else:
            k_pos = positions

        # GQA: query head h reads kv head h // (H // KV)
        group = H // KV
        k = k.repeat_interleave(group, dim=0)  # (H, Tk, D)
        v = v.repeat_interleave(group, dim=0)  # (H, Tk, D)

        scores = (q @ k.transpose(1, 2)) * cfg.scale  # (H, T, Tk)
        allowed = attention_mask(positions, k_pos, cfg.layer_window(layer))  # (T, Tk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (H, T, Tk)
        out = probs @ v  # (H, T, D)
        out = out.transpose(0, 1).reshape(T, H * D)  # (T, H*D)
        return _linear(out, self.w[p + "w_o.weight"])  # (T, d_model)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP: w_down(act(w_gate x) * w_up x); act is SiLU or tanh-approximated GELU."""
        p = f"layers.{layer}.mlp."
        gate = _linear(x, self.w[p + "w_gate.weight"])  # (T, d_ff)
        up = _linear(x, self.w[p + "w_up.weight"])  # (T, d_ff)
        if self.config.activation == "silu":
            act = F.silu(gate)
        elif self.config.activation == "gelu_tanh":
            act = F.gelu(gate, approximate="tanh")
        else:  # pragma: no cover - ModelConfig.validate rejects it
            raise ValueError(self.config.activation)
        return _linear(act * up, self.w[p + "w_down.weight"])  # (T, d_model)

    def block(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: _LayerCache | None
    ) -> torch.Tensor:
        p = f"layers.{layer}."
        a = self.attention(layer, self._norm(x, p + "attn_norm.weight"), positions, cache)
        if self.config.sandwich_norms:
            a = self._norm(a, p + "post_attn_norm.weight")
        h = x + a
        m = self.mlp(layer, self._norm(h, p + "mlp_norm.weight"))
        if self.config.sandwich_norms:
            m = self._norm(m, p + "post_mlp_norm.weight")
        return h + m

    def _run(
        self, ids: list[int], positions: torch.Tensor, caches: list[_LayerCache] | None
    ) -> torch.Tensor:
        """Logits (T, vocab) for tokens ``ids`` at ``positions``."""
        cfg = self.config
        idx = torch.as_tensor(list(ids), dtype=torch.long)  # (T,)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cfg.vocab_size):
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
        x = self.w["embed.weight"][idx] * cfg.embed_scale  # (T, d_model)
        for layer in range(cfg.n_layers):
            x = self.block(layer, x, positions, None if caches is None else caches[layer])
        x = self._norm(x, "norm.weight")
        head = self.w["embed.weight"] if cfg.tie_embeddings else self.w["lm_head.weight"]
        return x @ head.T  # (T, vocab)

    # -- public --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: list[int]) -> np.ndarray:
        """Logits (len(ids), vocab) as float64 at every position, whole sequence at once."""
        positions = torch.arange(len(ids), dtype=torch.long)
        with _single_thread():
            return self._run(ids, positions, None).to(torch.float64).numpy()

    @torch.no_grad()
    def forward_incremental(self, ids: list[int], split: int) -> np.ndarray:
        """Same logits via a KV cache: prefill ``ids[:split]``, then one token at a time."""
        ids = list(ids)
        if not 0 <= split <= len(ids):
            raise ValueError(f"split {split} outside [0, {len(ids)}]")
        cfg = self.config
        caches = [_LayerCache(cfg.n_kv_heads, cfg.head_dim, self.dtype) for _ in range(cfg.n_layers)]
        chunks: list[torch.Tensor] = []
        with _single_thread():
            if split:
                chunks.append(self._run(ids[:split], torch.arange(split), caches))
            for pos in range(split, len(ids)):
                chunks.append(self._run(ids[pos : pos + 1], torch.tensor([pos]), caches))
        if not chunks:
            return np.zeros((0, cfg.vocab_size))
        return torch.cat(chunks, dim=0).to(torch.float64).numpy()

    __call__ = forward
