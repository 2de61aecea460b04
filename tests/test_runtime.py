"""The numpy runtime against an independent PyTorch implementation on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch_ref

from pocketlm.quant import quantize_int4, quantize_int8
from pocketlm.runtime import Runtime

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "pocket"]
IDS = [5, 17, 3, 250, 11, 9, 42, 7, 101, 64, 2, 300, 18]


def _logits_incremental(rt: Runtime, ids, split: int) -> np.ndarray:
    cache = rt.new_cache(len(ids))
    rows = []
    if split:
        rows.append(rt.forward(ids[:split], cache, all_logits=True))
    for t in ids[split:]:
        rows.append(rt.forward([t], cache, all_logits=True))
    return np.concatenate(rows, axis=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_prefill_matches_torch(arch):
    cfg = torch_ref.tiny_config(arch)
    sd = torch_ref.random_state_dict(cfg, seed=1)
    ref = torch_ref.TorchRefModel(cfg, sd).forward(IDS)
    rt = Runtime(cfg, sd)
    ours = rt.forward(IDS, rt.new_cache(len(IDS)), all_logits=True)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("split", [0, 1, 6])
def test_incremental_decode_matches_torch(arch, split):
    cfg = torch_ref.tiny_config(arch)
    sd = torch_ref.random_state_dict(cfg, seed=2)
    ref = torch_ref.TorchRefModel(cfg, sd).forward(IDS)
    ours = _logits_incremental(Runtime(cfg, sd), IDS, split)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("arch", FAMILIES)
def test_int4_runtime_matches_fake_quantized_torch(arch):
    """The INT4 path equals the float model whose weights went through the INT4 grid."""
    cfg = torch_ref.tiny_config(arch)
    sd = torch_ref.random_state_dict(cfg, seed=3)
    packed, fake = dict(sd), dict(sd)
    for name, w in sd.items():
        if w.ndim == 2 and name not in ("embed.weight", "lm_head.weight"):
            qt = quantize_int4(w, 32, search=False)
            packed[name] = qt
            fake[name] = torch_ref.fake_quantize_int4(w, 32)
            np.testing.assert_array_equal(qt.dequantize(), fake[name])
        elif w.ndim == 2:
            qt = quantize_int8(w, 32)
            packed[name] = qt
            fake[name] = qt.dequantize()
    ref = torch_ref.TorchRefModel(cfg, fake).forward(IDS)
    ours = _logits_incremental(Runtime(cfg, packed), IDS, 4)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_sliding_window_is_honoured_beyond_the_window():
    cfg = torch_ref.tiny_config("gemma3", sliding_window=4)
    sd = torch_ref.random_state_dict(cfg, seed=4)
    ids = IDS + IDS
    ref = torch_ref.TorchRefModel(cfg, sd).forward(ids)
    ours = _logits_incremental(Runtime(cfg, sd), ids, 3)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
