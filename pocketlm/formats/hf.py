"""Hugging Face folder import: ``config.json``, ``*.safetensors``, ``tokenizer.json`` and the
chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import FormatError, UnsupportedError
from . import SourceModel, SourceTensor
from .pocketfile import map_file, read_header, tensor_view

# model_type -> pocketlm family
FAMILY_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "gemma3": "gemma3", "pocket": "pocket"}

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.w_q.weight",
    "self_attn.k_proj.weight": "attn.w_k.weight",
    "self_attn.v_proj.weight": "attn.w_v.weight",
    "self_attn.q_proj.bias": "attn.w_q.bias",
    "self_attn.k_proj.bias": "attn.w_k.bias",
    "self_attn.v_proj.bias": "attn.w_v.bias",
    "self_attn.o_proj.weight": "attn.w_o.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
}
# Gemma 3 has four norms per layer; in llama-style models post_attention_layernorm is the MLP's
# input norm.
LAYER_NAMES_STD = {**LAYER_NAMES, "post_attention_layernorm.weight": "mlp_norm.weight"}
LAYER_NAMES_GEMMA = {
    **LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def config_from_hf(hf: dict[str, Any], origin: str) -> ModelConfig:
    if "text_config" in hf and hf.get("model_type") == "gemma3":
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    model_type = hf.get("model_type")
    family = FAMILY_OF.get(model_type)
    if family is None:
        raise UnsupportedError(f"{origin}: model_type {model_type!r} is not supported; "
                               f"supported: {', '.join(sorted(FAMILY_OF))}")

    def req(key: str) -> Any:
        if key not in hf:
            raise FormatError(f"{origin}: config.json lacks {key!r}")
        return hf[key]

    if hf.get("rope_scaling") not in (None, {}):
        raise UnsupportedError(f"{origin}: rope_scaling {hf['rope_scaling']!r} is not supported "
                               "yet")
    if hf.get("mlp_bias"):
        raise UnsupportedError(f"{origin}: MLP biases are not supported")
    d_model = int(req("hidden_size"))
    n_heads = int(req("num_attention_heads"))
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    n_layers = int(req("num_hidden_layers"))
    cfg: dict[str, Any] = dict(
        arch=family,
        vocab_size=int(req("vocab_size")),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        d_ff=int(req("intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_context=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "gemma3", "pocket"),
    )
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    if family == "gemma3":
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedError(f"{origin}: activation {act!r} is not supported for gemma3")
        types = hf.get("layer_types")
        if not types:
            pattern = int(hf.get("sliding_window_pattern", 6))
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(n_layers)]
        cfg.update(
            sandwich_norms=True,
            activation="gelu_tanh",
            embed_scale=math.sqrt(d_model),
            attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=int(hf.get("sliding_window", 512)),
            rope_theta_local=float(hf.get("rope_local_base_freq", 10000.0)),
            layer_types=["sliding" if t == "sliding_attention" else "global" for t in types],
        )
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise UnsupportedError(f"{origin}: logit soft-capping is not supported")
    elif act != "silu":
        raise UnsupportedError(f"{origin}: activation {act!r} is not supported for {family}")
    elif hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedError(f"{origin}: sliding-window attention is only supported for gemma3")
    return ModelConfig(**cfg)


def read_hf(path: str | Path) -> SourceModel:
    from ..tokenizer import Tokenizer

    root = Path(path)
    origin = str(root)
    try:
        hf_config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"{origin}/config.json: cannot be read: {exc}") from None
    config = config_from_hf(hf_config, origin)
    gemma = config.arch == "gemma3"
    layer_names = LAYER_NAMES_GEMMA if gemma else LAYER_NAMES_STD

    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{origin}: no *.safetensors files (pytorch .bin checkpoints are not "
                          "supported: convert them to safetensors)")
    tensors: dict[str, SourceTensor] = {}
    unmapped: list[str] = []
    for file in files:
        buf = map_file(file)
        _, infos = read_header(file, buf)
        for hf_name, info in infos.items():
            name = _map(hf_name, layer_names)
            if name is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from the config
                unmapped.append(hf_name)
                continue
            norm_offset = 1.0 if gemma and name.endswith("norm.weight") else 0.0
            tensors[name] = _source_tensor(name, buf, info, norm_offset)
    if unmapped:
        raise UnsupportedError(f"{origin}: tensors pocketlm does not map: {unmapped[:5]}"
                               f"{' ...' if len(unmapped) > 5 else ''}")
    if config.tie_embeddings and "lm_head.weight" in tensors:
        del tensors["lm_head.weight"]  # tied checkpoints may still store the (same) head

    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise FormatError(f"{origin}: no tokenizer.json (pocketlm needs the fast-tokenizer file)")
    tok_config: dict[str, Any] = {}
    if (root / "tokenizer_config.json").is_file():
        tok_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_hf_file(tok_file, tok_config)
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    model = SourceModel(config=config, tokenizer=tokenizer, chat_template=template,
                        tensors=tensors,
                        provenance={"source_format": "hf", "source_file": root.name,
                                    "source_files": [f.name for f in files]})
    model.check_tensors(origin)
    return model


def _map(hf_name: str, layer_names: dict[str, str]) -> str | None:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


def _source_tensor(name, buf, info, norm_offset: float) -> SourceTensor:
    if info.dtype not in ("F32", "F16", "BF16"):
        raise UnsupportedError(f"tensor {name}: dtype {info.dtype} is not supported in "
                               "Hugging Face folders (F32, F16, BF16)")

    def to_float() -> np.ndarray:
        a = tensor_view(buf, info)
        if info.dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        a = np.array(a, dtype=np.float32)
        if norm_offset:
            a += np.float32(norm_offset)  # Gemma stores norm weights as (weight - 1)
        return a

    return SourceTensor(name=name, shape=info.shape, dtype=info.dtype, to_float=to_float)
