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


_BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias",
                                 "use_sliding_window"])
def test_switches_must_be_json_booleans(key):
    """A switch written as a string is refused, not read by its truthiness: "false" is a true
    string, and tie_word_embeddings read from it dropped the file's own output head."""
    from pocketlm.formats.hf import config_from_hf

    with pytest.raises(FormatError, match=f"x: config.json {key} must be true or false, got "
                                          "'false'"):
        config_from_hf({**_BASE, key: "false"}, "x")
    assert config_from_hf({**_BASE, "tie_word_embeddings": None}, "x").tie_embeddings is False


def test_untied_head_written_as_a_string_is_not_dropped(tmp_path):
    write_tiny_hf(tmp_path / "m", "llama", tie_embeddings=False)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg,
                                                            "tie_word_embeddings": "false"}))
    with pytest.raises(FormatError, match="tie_word_embeddings must be true or false"):
        open_source(tmp_path / "m")


def test_gemma3_layer_types_must_be_known_kinds():
    """An entry other than sliding_attention / full_attention is refused (it was read as a
    global layer: a sliding one would attend past its window)."""
    from pocketlm.formats.hf import config_from_hf

    gemma = {**_BASE, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
             "head_dim": 16}
    cfg = config_from_hf({**gemma, "layer_types": ["sliding_attention", "full_attention"]}, "x")
    assert cfg.layer_types == ["sliding", "global"]
    for types in (["sliding", "full_attention"], [{}, "full_attention"]):
        with pytest.raises(FormatError, match=r"^x: config.json layer_types must list "
                                              "'sliding_attention' or 'full_attention'"):
            config_from_hf({**gemma, "layer_types": types}, "x")
    # an error of a Gemma field names the folder once
    with pytest.raises(FormatError, match=r"^x: config.json sliding_window_pattern must be an "
                                          "integer"):
        config_from_hf({**gemma, "sliding_window_pattern": "6"}, "x")


def test_gemma3_activation_is_hidden_activation():
    """Gemma 3's MLP (transformers) reads hidden_activation, whatever hidden_act says."""
    from pocketlm.formats.hf import config_from_hf

    gemma = {**_BASE, "model_type": "gemma3_text", "head_dim": 16}
    cfg = config_from_hf({**gemma, "hidden_act": "gelu",
                          "hidden_activation": "gelu_pytorch_tanh"}, "x")
    assert cfg.activation == "gelu_tanh"
    with pytest.raises(UnsupportedError, match="activation 'silu'"):
        config_from_hf({**gemma, "hidden_act": "gelu_pytorch_tanh",
                        "hidden_activation": "silu"}, "x")


def test_gemma3_keys_left_out_take_transformers_defaults():
    """A Gemma 3 config.json without its attention and RoPE keys reads as transformers'
    Gemma3TextConfig would: query_pre_attn_scalar 256, sliding_window 4096, rope_theta 1e6,
    rope_local_base_freq 1e4, a global layer every 6th."""
    from pocketlm.formats.hf import config_from_hf

    gemma = {**_BASE, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
             "head_dim": 16, "num_hidden_layers": 6}
    cfg = config_from_hf(gemma, "x")
    assert cfg.attn_scale == pytest.approx(256 ** -0.5)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_theta_local) == (4096, 1e6, 1e4)
    assert cfg.layer_types == ["sliding"] * 5 + ["global"]
    cfg = config_from_hf({**gemma, "query_pre_attn_scalar": 16, "sliding_window": 512,
                          "rope_theta": 5e5, "rope_local_base_freq": 2e4}, "x")
    assert cfg.attn_scale == pytest.approx(0.25)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_theta_local) == (512, 5e5, 2e4)


def test_tensor_in_two_files_is_refused(tmp_path):
    """A tensor stored in two *.safetensors files (a stale consolidated file beside shards)
    is refused by name, not taken from whichever file sorts last."""
    from safetensors.numpy import save_file

    _, sd = write_tiny_hf(tmp_path / "m", "llama")
    save_file({"model.norm.weight": np.zeros(sd["norm.weight"].shape, np.float32)},
              str(tmp_path / "m" / "zz-extra.safetensors"))
    with pytest.raises(FormatError, match=r"model\.norm\.weight is stored twice.*zz-extra"):
        open_source(tmp_path / "m")


def test_unsupported_dtype_names_the_file(tmp_path):
    import re

    from safetensors.numpy import load_file, save_file

    write_tiny_hf(tmp_path / "m", "llama")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    save_file(tensors, str(path))
    with pytest.raises(UnsupportedError, match=f"^{re.escape(str(path))}: tensor norm.weight: "
                                               "dtype F64"):
        open_source(tmp_path / "m")


def test_config_keys_transformers_reads_otherwise():
    """Found against transformers 5: bidirectional Gemma attention ran causal (refused now);
    a top-level rope_theta beside a different one in rope_parameters took the wrong one
    (refused: two bases); a Gemma config without an activation was refused as 'silu' (it is
    gelu_pytorch_tanh); rope_parameters that is not an object was ignored; the plain RoPE
    written the old way (rope_scaling type default) was refused."""
    from pocketlm.formats.hf import config_from_hf

    gemma = {**_BASE, "model_type": "gemma3_text", "head_dim": 16}
    with pytest.raises(UnsupportedError, match="bidirectional attention"):
        config_from_hf({**gemma, "use_bidirectional_attention": True}, "x")
    assert config_from_hf({**gemma, "use_bidirectional_attention": False}, "x")
    assert config_from_hf(gemma, "x").activation == "gelu_tanh"
    with pytest.raises(FormatError, match="two RoPE bases"):
        config_from_hf({**_BASE, "rope_theta": 100.0,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "x")
    same = {**_BASE, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e4}}
    assert config_from_hf(same, "x").rope_theta == 1e4
    with pytest.raises(FormatError, match="rope_parameters must be an object"):
        config_from_hf({**_BASE, "rope_parameters": [1, 2]}, "x")
    for old in ({"type": "default"}, {"rope_type": "default"}):
        assert config_from_hf({**_BASE, "rope_scaling": old}, "x").rope_theta == 10000.0
    with pytest.raises(UnsupportedError, match="rope_scaling"):
        config_from_hf({**_BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}, "x")


def test_a_tied_checkpoint_with_a_head_of_its_own_uses_it(tmp_path):
    """tie_word_embeddings with a stored lm_head.weight that differs from the embedding: the
    head was dropped (top-1 agreement 0 with transformers, which unties them); the same head
    is still dropped."""
    from safetensors.numpy import load_file, save_file

    cfg, sd = write_tiny_hf(tmp_path / "m", "llama", seed=3, tie_embeddings=True)
    (weights,) = (tmp_path / "m").glob("*.safetensors")
    stored = load_file(str(weights))
    embed = stored["model.embed_tokens.weight"]
    save_file({**stored, "lm_head.weight": embed.copy()}, str(weights))
    src = open_source(tmp_path / "m")
    assert src.config.tie_embeddings and "lm_head.weight" not in src.tensors
    head = np.random.default_rng(0).normal(size=embed.shape).astype(embed.dtype)
    save_file({**stored, "lm_head.weight": head}, str(weights))
    src = open_source(tmp_path / "m")
    assert not src.config.tie_embeddings
    np.testing.assert_array_equal(src.tensors["lm_head.weight"].to_float(), head)
    ref = torch_ref.TorchRefModel(src.config, {**sd, "lm_head.weight": head}).forward(IDS)
    ours = from_source(src).logits(IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_a_multimodal_checkpoint_is_named_as_such(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_tiny_hf(tmp_path / "m", "gemma3", seed=3)
    (weights,) = (tmp_path / "m").glob("*.safetensors")
    stored = load_file(str(weights))
    save_file({("language_model." + k if k.startswith("model.") else k): v
               for k, v in stored.items()}, str(weights))
    with pytest.raises(UnsupportedError, match="multimodal checkpoint"):
        open_source(tmp_path / "m")


def test_the_float_path_refuses_nan_weights_as_packing_does(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_tiny_hf(tmp_path / "m", "llama", seed=3)
    (weights,) = (tmp_path / "m").glob("*.safetensors")
    stored = load_file(str(weights))
    name = next(k for k in stored if k.endswith("mlp.up_proj.weight"))
    stored[name] = stored[name].copy()
    stored[name].flat[7] = np.nan
    save_file(stored, str(weights))
    with pytest.raises(FormatError, match="NaN or infinite"):
        from_source(open_source(tmp_path / "m"))


def test_a_folder_edited_in_place_is_packed_again(tmp_path, monkeypatch):
    """A folder's own size and time change only when entries are added or removed: a
    config.json rewritten in place kept the old pack (and its old answers)."""
    import os

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    write_tiny_hf(tmp_path / "m", "llama", seed=3)
    first = pocketlm.load(tmp_path / "m")
    before = first.logits(IDS)
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    folder_time = (tmp_path / "m").stat().st_mtime_ns
    with open(path, "w") as f:  # in place: the folder's entries are unchanged
        json.dump({**cfg, "rms_norm_eps": 0.5}, f)
    os.utime(tmp_path / "m", ns=(folder_time, folder_time))
    again = pocketlm.load(tmp_path / "m")
    assert again.path != first.path and again.config.norm_eps == 0.5
    assert not np.array_equal(again.logits(IDS), before)
    assert not first.path.exists()  # the entry it replaces is removed


def test_what_lies_deeper_in_a_folder_does_not_repack_it(tmp_path, monkeypatch):
    """Only the folder's top-level files are the model: a log or a checkpoint written below
    it (a training run's, a hub cache) packed it again on the next load."""
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    write_tiny_hf(tmp_path / "m", "llama", seed=3)
    first = pocketlm.load(tmp_path / "m").path
    (tmp_path / "m" / "runs").mkdir()
    (tmp_path / "m" / "runs" / "events.out").write_text("log")
    assert pocketlm.load(tmp_path / "m").path == first


def test_a_sharded_checkpoint_reads_the_files_its_index_names(tmp_path):
    """transformers reads the shards model.safetensors.index.json names: a stale
    consolidated file beside them was refused as every tensor "stored twice"."""
    from safetensors.numpy import load_file, save_file

    cfg, sd = write_tiny_hf(tmp_path / "m", "llama", seed=3)
    (weights,) = (tmp_path / "m").glob("*.safetensors")
    stored = load_file(str(weights))
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: stored[k] for k in part}, str(tmp_path / "m" / file))
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))
    stale = {k: np.zeros_like(v) for k, v in stored.items()}
    weights.unlink()
    save_file(stale, str(tmp_path / "m" / "model.safetensors"))  # not in the index
    src = open_source(tmp_path / "m")
    for name, w in sd.items():
        np.testing.assert_array_equal(src.tensors[name].to_float(), w, err_msg=name)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FormatError, match="names model-00002-of-00002.safetensors, which is "
                                          "not in the folder"):
        open_source(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../x"}}')
    with pytest.raises(FormatError, match="weight_map must map"):
        open_source(tmp_path / "m")
