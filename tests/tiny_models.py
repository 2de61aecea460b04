"""Tiny model configurations, random weights and the INT4 round trip, in numpy only.

The fixtures every tier shares (tests/tiny_gguf.py, tests/tiny_hf.py, the runtime and engine
tests), kept free of torch so that the tests of the runtime, the API, the CLI and the deploy
file collect on a machine without it. torch_ref.py re-exports them for the reference tiers.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from pocketlm.config import ModelConfig


# -------------------------------------------------------------------------------------------
# tiny configurations and random weights for tests
# -------------------------------------------------------------------------------------------
def _gemma_layer_types(n_layers: int) -> list[str]:
    """Every third layer global, and always the last one; the others sliding."""
    return [
        "global" if (i + 1) % 3 == 0 or i == n_layers - 1 else "sliding" for i in range(n_layers)
    ]


def tiny_config(arch: str, **overrides) -> ModelConfig:
    """A small config of family ``arch`` for random-weight tests; ``overrides`` set any field.

    d_model and d_ff are multiples of 32 (INT4 group size).  For gemma3, if n_layers is
    overridden but layer_types is not, the sliding/global pattern is rebuilt for the new depth.
    """
    base: dict = {
        "arch": arch,
        "vocab_size": 320,
        "d_model": 64,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "d_ff": 96,
        "max_context": 128,
    }
    if arch == "llama":
        base.update(tie_embeddings=True, norm_eps=1e-5, rope_theta=10000.0)
    elif arch == "qwen2":
        base.update(tie_embeddings=False, qkv_bias=True, norm_eps=1e-6, rope_theta=1e6)
    elif arch == "qwen3":
        base.update(tie_embeddings=False, qk_norm=True, norm_eps=1e-6, rope_theta=1e6)
    elif arch == "gemma3":
        head_dim = overrides.get("head_dim", 32)
        d_model = overrides.get("d_model", base["d_model"])
        base.update(
            tie_embeddings=True,
            qk_norm=True,
            sandwich_norms=True,
            activation="gelu_tanh",
            embed_scale=math.sqrt(d_model),
            head_dim=head_dim,
            attn_scale=1.0 / math.sqrt(head_dim),
            sliding_window=5,
            rope_theta=1e6,
            rope_theta_local=10000.0,
            norm_eps=1e-6,
            layer_types=_gemma_layer_types(overrides.get("n_layers", base["n_layers"])),
        )
    elif arch == "pocket":
        base.update(tie_embeddings=True, qk_norm=True, norm_eps=1e-5, rope_theta=10000.0)
    else:
        raise ValueError(f"no tiny config for family {arch!r}")
    base.update(overrides)
    return ModelConfig(**base)


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # One stream per tensor name: toggling a switch adds/removes tensors without changing
    # the values of the others, so two configs differing in one switch share their weights.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for exactly ``config.tensor_shapes()``.

    Linear weights ~ N(0, std) with std = 0.8 / sqrt(fan_in) clipped to [0.02, 0.1];
    embeddings / lm_head N(0, 0.1); norm weights 1 + 0.1 N(0, 1); biases N(0, 0.05).
    Deterministic in (seed, tensor name).
    """
    out: dict[str, np.ndarray] = {}
    for name, shape in config.tensor_shapes().items():
        rng = _tensor_rng(seed, name)
        z = rng.standard_normal(shape)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * z
        elif name.endswith(".bias"):
            value = 0.05 * z
        elif name in ("embed.weight", "lm_head.weight"):
            value = 0.1 * z
        else:
            fan_in = shape[1]
            value = float(np.clip(0.8 / math.sqrt(fan_in), 0.02, 0.1)) * z
        out[name] = value.astype(np.float32)
    return out


# -------------------------------------------------------------------------------------------
# INT4 reference round trip
# -------------------------------------------------------------------------------------------
def fake_quantize_int4(w: np.ndarray, group_size: int = 32) -> np.ndarray:
    """Asymmetric 4-bit quantize + dequantize, per row, per group of input columns.

    For each run of ``group_size`` consecutive entries of the last axis:
    ``lo = min``, ``scale = (max - min) / 15`` (1 when that is 0, i.e. a constant group);
    scale and lo are rounded to float16 and back to float32; ``q = clip(rint((w - lo16) /
    scale16), 0, 15)`` (rint: halves to even); the result is ``q * scale16 + lo16`` in float32.
    A scale that becomes 0 in float16 (range below ~1e-6) is also replaced by 1.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise ValueError(f"last axis ({w.shape}) must be a multiple of group_size {group_size}")
    groups = w.reshape(-1, w.shape[-1] // group_size, group_size)  # (rows, n_groups, group)
    lo = groups.min(axis=-1, keepdims=True)  # (rows, n_groups, 1)
    hi = groups.max(axis=-1, keepdims=True)  # (rows, n_groups, 1)
    scale = (hi - lo) / np.float32(15.0)
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    scale16 = scale.astype(np.float16).astype(np.float32)
    scale16 = np.where(scale16 == 0, np.float32(1.0), scale16).astype(np.float32)
    lo16 = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((groups - lo16) / scale16), 0, 15).astype(np.float32)
    deq = q * scale16 + lo16  # float32
    return deq.astype(np.float32).reshape(w.shape)


# -------------------------------------------------------------------------------------------
# the compact layouts of quantized weights (the engine's compact tiles)
# -------------------------------------------------------------------------------------------
def coded_int4(qt):
    """An INT4 group-32 tensor with its scales and minimums as codes (``int4_c8``; the values
    are not refitted to the coded steps: any codes make a valid tensor)."""
    from pocketlm.quant import EncodedQuantTensor, code_steps

    sc, mc, rd = code_steps(qt.scales.astype(np.float32), qt.mins.astype(np.float32))
    return EncodedQuantTensor("int4_c8", qt.shape, {"": qt.qweight, ".sc": sc, ".mc": mc,
                                                    ".rd": rd})


def implicit_minimums(qt, zero_point: int):
    """``qt`` with implicit minimums ``-zero_point * scales`` (a GGUF Q4_0 / Q5_0's layout;
    the values are not refitted)."""
    from pocketlm.quant import QuantTensor, implicit_mins

    return QuantTensor(qt.kind, qt.shape, qt.group_size, qt.qweight, qt.scales,
                       implicit_mins(qt.scales, zero_point), zero_point)
