"""The decoder in PyTorch, for training: every family the runtime runs, under the runtime's names.

``PocketLM(config)`` is the model of :mod:`pocketlm.config` (llama, qwen2, qwen3, gemma3 and
pocketlm's own ``pocket`` family) as a :class:`torch.nn.Module` whose ``state_dict()`` keys are
exactly ``config.tensor_shapes()``: a checkpoint exports to a deploy file without a name table,
and a GGUF or Hugging Face model loads into it (a base model to fine-tune, a distillation
teacher) through the runtime's own importers.

Conventions match the runtime: norms are ``x / rms(x) * weight`` (Gemma's ``1 + w`` is folded into
the stored weight), RoPE rotates the two halves of each head, attention is causal with GQA and an
optional sliding window per layer, the MLP is gated (SiLU or tanh-GELU).

The presets are the ``pocket`` family, deep and thin (MobileLLM's finding for sub-billion models:
depth buys more than width at a fixed budget), with GQA, QK-norm, SwiGLU and tied embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .presets import PRESETS, Preset, preset_config, preset_report

__all__ = ["PRESETS", "PocketLM", "Preset", "preset_config", "preset_report"]


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head: x [B, H, T, D], cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, bias = cfg.d_model, cfg.qkv_bias
        self.w_q = nn.Linear(d, cfg.q_dim, bias=bias)
        self.w_k = nn.Linear(d, cfg.kv_dim, bias=bias)
        self.w_v = nn.Linear(d, cfg.kv_dim, bias=bias)
        self.w_o = nn.Linear(cfg.q_dim, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.cfg = cfg

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = self.w_q(x).view(B, T, H, D)
        k = self.w_k(x).view(B, T, KV, D)
        v = self.w_v(x).view(B, T, KV, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rope(q.transpose(1, 2), cos, sin)
        k = _rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale)
        return self.w_o(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.w_gate(x)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.w_down(g * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, cos, sin, mask):
        a = self.attn(self.attn_norm(x), cos, sin, mask)
        if self.sandwich:
            a = self.post_attn_norm(a)
        h = x + a
        m = self.mlp(self.mlp_norm(h))
        if self.sandwich:
            m = self.post_mlp_norm(m)
        return h + m


class PocketLM(nn.Module):
    """A decoder-only language model; ``forward(ids)`` gives logits ``[B, T, vocab]``."""

    def __init__(self, cfg: ModelConfig, *, init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if init_seed is not None:
            self.reset_parameters(init_seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """Normal(0, 0.02) weights, residual outputs scaled by 1/sqrt(2 n_layers), unit norms,
        zero biases; from a private generator, so a seed gives the same model anywhere."""
        gen = torch.Generator().manual_seed(int(seed))
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    std = out_std if name.endswith(("w_o.weight", "w_down.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def _rope_tables(self, layer: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        half = cfg.head_dim // 2
        inv = 1.0 / (cfg.layer_rope_theta(layer) ** (torch.arange(half, device=device,
                                                                  dtype=torch.float64) / half))
        ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states ``[B, T, d_model]`` for token ids ``[B, T]``."""
        cfg = self.cfg
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, time], got shape {tuple(ids.shape)}")
        T = ids.shape[1]
        if T > cfg.max_context:
            raise ValueError(f"{T} tokens exceed the model's context of {cfg.max_context}")
        x = self.embed(ids)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        tables: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[int | None, torch.Tensor | None] = {}
        for i, layer in enumerate(self.layers):
            theta = cfg.layer_rope_theta(i)
            if theta not in tables:
                tables[theta] = self._rope_tables(i, T, ids.device)
            window = cfg.layer_window(i)
            if window not in masks:
                masks[window] = None if window is None or window >= T else _window_mask(
                    T, window, ids.device)
            x = layer(x, *tables[theta], masks[window])
        return self.norm(x)

    def forward(self, ids: torch.Tensor, select: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]``; with a boolean ``select`` ``[B, T]``, only those positions'
        logits, ``[N, vocab]`` in row-major order (the head is the largest matrix of a small
        model: training computes it only where there is a target)."""
        h = self.hidden(ids)
        if select is not None:
            h = h[select]
        return F.linear(h, self.head_weight())

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy over the targets that are not ``ignore_index``."""
        keep = targets != ignore_index
        return F.cross_entropy(self(ids, keep).float(), targets[keep])


def _window_mask(T: int, window: int, device) -> torch.Tensor:
    """Causal attention limited to the last ``window`` positions (the current one included)."""
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)

