"""Write a tiny Hugging Face model folder (config.json, model.safetensors, tokenizer files) the
way transformers saves one, from a tiny_models random state dict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tiny_models
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HF_LAYER = {  # pocketlm name (after layers.N.) -> HF name (after model.layers.N.)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.w_q.weight": "self_attn.q_proj.weight",
    "attn.w_k.weight": "self_attn.k_proj.weight",
    "attn.w_v.weight": "self_attn.v_proj.weight",
    "attn.w_q.bias": "self_attn.q_proj.bias",
    "attn.w_k.bias": "self_attn.k_proj.bias",
    "attn.w_v.bias": "self_attn.v_proj.bias",
    "attn.w_o.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def _hf_name(name: str, gemma: bool) -> str:
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    _, i, rest = name.split(".", 2)
    table = dict(HF_LAYER)
    if gemma:
        table.update({"post_attn_norm.weight": "post_attention_layernorm.weight",
                      "mlp_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_mlp_norm.weight": "post_feedforward_layernorm.weight"})
    else:
        table["mlp_norm.weight"] = "post_attention_layernorm.weight"
    return f"model.layers.{i}.{table[rest]}"


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() <= vocab_size
    return tok


def write_tiny_hf(root: Path, arch: str, *, seed: int = 0, dtype=np.float32, **overrides):
    """Returns (config, state_dict) of the model written to ``root``."""
    cfg = tiny_models.tiny_config(arch, **overrides)
    sd = tiny_models.random_state_dict(cfg, seed=seed)
    gemma = arch == "gemma3"
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, w in sd.items():
        value = w - 1.0 if gemma and name.endswith("norm.weight") else w  # Gemma stores w - 1
        tensors[_hf_name(name, gemma)] = np.ascontiguousarray(value.astype(dtype))
    save_file(tensors, str(root / "model.safetensors"))
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    hf = {
        "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_context,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "rope_scaling": None,
    }
    if gemma:
        hf.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                  query_pre_attn_scalar=cfg.head_dim, sliding_window=cfg.sliding_window,
                  rope_local_base_freq=cfg.rope_theta_local,
                  layer_types=["sliding_attention" if t == "sliding" else "full_attention"
                               for t in cfg.layer_types])
    (root / "config.json").write_text(json.dumps(hf))
    byte_level_tokenizer(cfg.vocab_size).save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
        "chat_template": CHATML}))
    if dtype != np.float32:  # what the importer sees after widening
        sd = {k: (v.astype(dtype).astype(np.float32)) for k, v in sd.items()}
    return cfg, sd
