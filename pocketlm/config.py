"""Model configuration: the one schema every importer, the deploy file and the runtime share.

The runtime implements one decoder with switches; each supported family is a setting of them:

=========  ===========================================================================
family     what differs
=========  ===========================================================================
llama      RMSNorm, SwiGLU, GQA, RoPE (rotate-half); optional tied head (SmolLM2)
qwen2      llama + biases on the q/k/v projections
qwen3      llama + per-head RMSNorm on q and k (QK-norm)
gemma3     QK-norm, sandwich norms (after attention and MLP too), GeGLU (tanh GELU),
           embeddings scaled by sqrt(d_model), sliding-window layers with their own
           RoPE base, tied head
pocket     pocketlm's own: llama + QK-norm + tied head (deep and thin)
=========  ===========================================================================

Tensor names (the training model's state-dict keys, used unchanged in ``.pocket`` files):

    embed.weight                         [vocab_size, d_model]
    layers.{i}.attn_norm.weight          [d_model]
    layers.{i}.attn.w_q.weight           [n_heads * head_dim, d_model]   (+ .bias if qkv_bias)
    layers.{i}.attn.w_k.weight           [n_kv_heads * head_dim, d_model] (+ .bias)
    layers.{i}.attn.w_v.weight           [n_kv_heads * head_dim, d_model] (+ .bias)
    layers.{i}.attn.w_o.weight           [d_model, n_heads * head_dim]
    layers.{i}.attn.q_norm.weight        [head_dim]                       (qk_norm)
    layers.{i}.attn.k_norm.weight        [head_dim]                       (qk_norm)
    layers.{i}.post_attn_norm.weight     [d_model]                        (sandwich_norms)
    layers.{i}.mlp_norm.weight           [d_model]
    layers.{i}.mlp.w_gate.weight         [d_ff, d_model]
    layers.{i}.mlp.w_up.weight           [d_ff, d_model]
    layers.{i}.mlp.w_down.weight         [d_model, d_ff]
    layers.{i}.post_mlp_norm.weight      [d_model]                        (sandwich_norms)
    norm.weight                          [d_model]
    lm_head.weight                       [vocab_size, d_model]            (absent if tied)

Conventions: every norm is ``x / rms(x) * weight`` (Gemma's ``1 + weight`` is folded into the
stored weight at import); RoPE rotates the two halves of each head (``rotate_half``); linear
layers compute ``x @ weight.T (+ bias)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError, UnsupportedError

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "pocket")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_context: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # window size (tokens, the current one included)
    rope_theta_local: float | None = None  # RoPE base of sliding-window layers
    layer_types: list[str] = field(default_factory=list)  # "global" | "sliding" per layer

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["global"] * self.n_layers
        self.validate()

    # -- derived -----------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding" and self.rope_theta_local is not None:
            return self.rope_theta_local
        return self.rope_theta

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f = self.d_model, self.d_ff
        per_layer = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + 3 * d * f
        per_layer += 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        per_layer += (2 * d if self.sandwich_norms else 0)
        per_layer += (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0)
        total = self.n_layers * per_layer + self.vocab_size * d + d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model must have, with its shape: the contract importers fill."""
        d, f = self.d_model, self.d_ff
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab_size, d)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "attn.w_q.weight"] = (self.q_dim, d)
            shapes[p + "attn.w_k.weight"] = (self.kv_dim, d)
            shapes[p + "attn.w_v.weight"] = (self.kv_dim, d)
            shapes[p + "attn.w_o.weight"] = (d, self.q_dim)
            if self.qkv_bias:
                shapes[p + "attn.w_q.bias"] = (self.q_dim,)
                shapes[p + "attn.w_k.bias"] = (self.kv_dim,)
                shapes[p + "attn.w_v.bias"] = (self.kv_dim,)
            if self.qk_norm:
                shapes[p + "attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "attn.k_norm.weight"] = (self.head_dim,)
            if self.sandwich_norms:
                shapes[p + "post_attn_norm.weight"] = (d,)
                shapes[p + "post_mlp_norm.weight"] = (d,)
            shapes[p + "mlp_norm.weight"] = (d,)
            shapes[p + "mlp.w_gate.weight"] = (f, d)
            shapes[p + "mlp.w_up.weight"] = (f, d)
            shapes[p + "mlp.w_down.weight"] = (d, f)
        shapes["norm.weight"] = (d,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, d)
        return shapes

    # -- checks and (de)serialisation --------------------------------------------------------
    def validate(self) -> None:
        if self.arch not in FAMILIES:
            raise UnsupportedError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(FAMILIES)}"
            )
        if self.activation not in ACTIVATIONS:
            raise UnsupportedError(
                f"unsupported activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise FormatError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise FormatError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise FormatError(f"model config: head_dim must be even, got {self.head_dim}")
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= {
            "global", "sliding"
        }:
            raise FormatError(
                "model config: layer_types must list 'global' or 'sliding' for each of the "
                f"{self.n_layers} layers"
            )
        if "sliding" in self.layer_types and not self.sliding_window:
            raise FormatError("model config: sliding layers need a positive sliding_window")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise FormatError(
                f"model config has unknown fields {sorted(unknown)}; this file may come from a "
                "newer pocketlm: upgrade with `pip install -U pocketlm`"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise FormatError(f"model config is incomplete: {exc}") from None


@dataclass
class GenerationDefaults:
    """Sampling defaults stored in the deploy file; callers override any of them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
