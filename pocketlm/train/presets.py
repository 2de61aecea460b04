"""Model presets of the ``pocket`` family and what each costs at deploy time (no torch needed).

Deep and thin (MobileLLM's finding for sub-billion models: depth buys more than width at a fixed
budget), with GQA, QK-norm, SwiGLU and tied embeddings. The sizes printed by
``pocket train --list-presets`` come from :func:`preset_report`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import PocketError

__all__ = ["PRESETS", "Preset", "estimated_peak_bytes", "int4_file_bytes", "preset_config",
           "preset_report"]


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_context: int
    vocab_size: int  # the vocabulary the preset is sized for (a trained tokenizer sets the real one)
    about: str


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 4, 4, 2, 16, 192, 256, 2048, "for tests and a first run: trains in minutes"),
    "pocket-10m": Preset(256, 12, 4, 2, 64, 704, 1024, 16000, "~13 M: an hour on a laptop CPU"),
    "pocket-30m": Preset(384, 16, 6, 2, 64, 1024, 1024, 32000, "~37 M: a few CPU hours"),
    "pocket-0.3b": Preset(960, 28, 15, 5, 64, 2560, 2048, 48000,
                          "~0.32 B: the app-native target, trained on GPUs (torchrun, FSDP)"),
}


def preset_config(name: str, vocab_size: int | None = None, *,
                  max_context: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` with the tokenizer's ``vocab_size``."""
    p = PRESETS.get(name)
    if p is None:
        raise PocketError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig(
        arch="pocket", vocab_size=int(vocab_size or p.vocab_size), d_model=p.d_model,
        n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, head_dim=p.head_dim,
        d_ff=p.d_ff, max_context=int(max_context or p.max_context), norm_eps=1e-5,
        rope_theta=10000.0, tie_embeddings=True, qk_norm=True,
    )


def int4_file_bytes(cfg: ModelConfig, embed_bits: int = 8, group_size: int = 32) -> int:
    """Bytes of the INT4 deploy file's tensors: matrices at 4 bits plus a float16 scale and minimum
    per group; the embedding at ``embed_bits`` (INT8: one float16 scale per group); norms f32."""
    shapes = cfg.tensor_shapes()
    total = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if len(shape) == 1:
            total += 4 * n
        elif name in ("embed.weight", "lm_head.weight") and embed_bits == 8:
            total += n + 2 * n // group_size
        else:
            total += n // 2 + 4 * n // group_size
    return total


def estimated_peak_bytes(cfg: ModelConfig, context: int, embed_bits: int = 8) -> int:
    """An estimate of the runtime's peak memory delta at ``context`` tokens: the weights (repacked
    once, no float copy), an f16 KV cache for the context, 64-token prefill scratch, the logits,
    and about 20 MB for the tokenizer and buffers."""
    weights = int4_file_bytes(cfg, embed_bits)
    kv = 2 * cfg.n_layers * cfg.kv_dim * context * 2
    scratch = 64 * 4 * (3 * cfg.d_model + 2 * cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.d_ff)
    return weights + kv + scratch + 4 * cfg.vocab_size + 20 * 2**20


def preset_report(vocab_size: int | None = None) -> list[dict]:
    """For every preset: parameters, INT4 file size and estimated peak memory at 512/1024."""
    rows = []
    for name, p in PRESETS.items():
        cfg = preset_config(name, vocab_size)
        rows.append({
            "preset": name, "params_m": round(cfg.n_params() / 1e6, 2),
            "vocab_size": cfg.vocab_size, "d_model": p.d_model, "n_layers": p.n_layers,
            "heads": f"{p.n_heads}/{p.n_kv_heads}x{p.head_dim}", "d_ff": p.d_ff,
            "int4_file_mb": round(int4_file_bytes(cfg) / 2**20, 1),
            "peak_mb_512": round(estimated_peak_bytes(cfg, 512) / 2**20, 1),
            "peak_mb_1024": round(estimated_peak_bytes(cfg, 1024) / 2**20, 1),
            "about": p.about,
        })
    return rows
