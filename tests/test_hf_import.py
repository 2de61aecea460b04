"""Hugging Face folders: names, Gemma's norm offset, dtypes, tokenizer and template."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch_ref  # noqa: E402
from tiny_hf import write_tiny_hf  # noqa: E402

import pocketlm  # noqa: E402
from pocketlm.api import from_source  # noqa: E402
from pocketlm.errors import FormatError, UnsupportedError  # noqa: E402
from pocketlm.formats import open_source  # noqa: E402

IDS = [3, 70, 101, 33, 250, 12, 9, 64]


# an import held to a float reference at float32 rounding: float activations (conftest)
FLOAT_ACTIVATIONS = True


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_hf_folder_matches_reference(tmp_path, arch):
    cfg, sd = write_tiny_hf(tmp_path / arch, arch, seed=5)
    src = open_source(tmp_path / arch)
    got, want = src.config.to_dict(), cfg.to_dict()
    got.pop("attn_scale"), want.pop("attn_scale")
    assert src.config.scale == pytest.approx(cfg.scale)
    assert got == want
    for name, w in sd.items():
        np.testing.assert_array_equal(src.tensors[name].to_float(), w, err_msg=name)
    ref = torch_ref.TorchRefModel(cfg, sd).forward(IDS)
    ours = from_source(src).logits(IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_bf16_weights_are_widened(tmp_path):
    import ml_dtypes
    cfg, sd = write_tiny_hf(tmp_path / "m", "llama", dtype=ml_dtypes.bfloat16)
    src = open_source(tmp_path / "m")
    for name, w in sd.items():
        np.testing.assert_array_equal(src.tensors[name].to_float(), w)


def test_hf_pack_and_chat(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    write_tiny_hf(tmp_path / "m", "qwen2", seed=1)
    m = pocketlm.load(tmp_path / "m")
    assert m.chat_template and "<|im_start|>" in m.render_chat([{"role": "user", "content": "hi"}])
    assert m.tokenizer.eos_ids
    ids = m.tokenize("hello world")
    assert m.detokenize(ids) == "hello world"
    assert m.logits(ids).shape == (len(ids), m.config.vocab_size)
    assert isinstance(m.chat([{"role": "user", "content": "hi"}], max_tokens=4), str)


def test_unknown_model_type_is_refused(tmp_path):
    write_tiny_hf(tmp_path / "m", "llama")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="mamba.*supported"):
        open_source(tmp_path / "m")


def test_missing_tokenizer_and_weights(tmp_path):
    write_tiny_hf(tmp_path / "m", "llama")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(FormatError, match="tokenizer.json"):
        open_source(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FormatError, match="safetensors"):
        open_source(tmp_path / "m")


def test_unmapped_tensor_is_refused(tmp_path):
    from safetensors.numpy import save_file

    write_tiny_hf(tmp_path / "m", "llama")
    save_file({"model.vision_tower.weight": np.zeros((2, 2), np.float32)},
              str(tmp_path / "m" / "extra.safetensors"))
    with pytest.raises(UnsupportedError, match="vision_tower"):
        open_source(tmp_path / "m")


def test_rope_bases_from_rope_parameters():
    """transformers 5 writes the RoPE bases only under rope_parameters (per attention kind for
    Gemma 3); they are read from there, and a scaled RoPE is refused."""
    from pocketlm.formats.hf import config_from_hf

    base = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}
    cfg = config_from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 1e6}}, "x")
    assert cfg.rope_theta == 1e6
    gemma = {**base, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
             "head_dim": 16, "rope_parameters": {
                 "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    cfg = config_from_hf(gemma, "x")
    assert (cfg.rope_theta, cfg.rope_theta_local) == (1e6, 1e4)
    with pytest.raises(UnsupportedError, match="rope_parameters"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                                    "factor": 4.0}}, "x")
