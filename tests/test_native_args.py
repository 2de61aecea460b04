"""Arguments of the native engine's constructor (``pocketlm._native.NativeModel``), called
directly: ``avxvnni`` chooses the avx2 level's int8 products (1: AVX-VNNI where the CPU has it,
0: AVX2's multiply-add pairs), and both give the same logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch_ref

from pocketlm.errors import KernelError
from pocketlm.quant import quantize_int4, quantize_int8
from pocketlm.runtime.kernels import native

IDS = np.array([5, 17, 3, 250, 11, 9, 42, 7], dtype=np.int32)


@pytest.fixture(scope="module")
def model_args():
    if not native.engine_available():
        pytest.fail(native.unavailable_reason() or "the native engine is not built: run "
                    "`pip install -e .`", pytrace=False)
    cfg = torch_ref.tiny_config("llama", max_context=64)
    sd = torch_ref.random_state_dict(cfg, seed=3)
    w = {name: (v if v.ndim != 2 else quantize_int8(v, 32)
                if name in ("embed.weight", "lm_head.weight") else quantize_int4(v, 32))
         for name, v in sd.items()}
    tensors, reason = native.engine_weights(cfg, w)
    assert tensors is not None, reason
    return cfg, tensors


def _logits(cfg, tensors, level: int, **kwargs) -> tuple[np.ndarray, str]:
    act_q8 = native._native.Q8_QKV | native._native.Q8_WO | native._native.Q8_GATE_UP | \
        native._native.Q8_DOWN | native._native.Q8_HEAD
    model = native._native.NativeModel(cfg.to_dict(), tensors, 32, act_q8=act_q8, level=level,
                                       **kwargs)
    kv = native._native.NativeKV(model, 32)
    out = np.zeros((len(IDS), cfg.vocab_size), dtype=np.float32)
    model.forward(kv, IDS, 0, out, all_logits=True)
    return out, model.level


def test_avxvnni_keyword_gives_the_same_logits(model_args):
    cfg, tensors = model_args
    levels = native.cpu_features()["levels"]
    level = native._native.LEVEL_AVX2 if "avx2" in levels else native._native.LEVEL_SCALAR
    default, name = _logits(cfg, tensors, level)
    on, _ = _logits(cfg, tensors, level, avxvnni=1)
    off, _ = _logits(cfg, tensors, level, avxvnni=0)
    assert np.isfinite(default).all()
    np.testing.assert_array_equal(on, default)
    np.testing.assert_array_equal(off, on)
    if name == "avx2":  # the products each setting runs on
        vnni = native.cpu_features()["features"]["avxvnni"]
        assert native._native.ops_name(level, avxvnni=0) == "avx2"
        assert native._native.ops_name(level, avxvnni=1) == ("avx2+avxvnni" if vnni else "avx2")
        assert native._native.ops_name(level) == native._native.ops_name(level, avxvnni=1)


@pytest.mark.parametrize("bad, error", [(2, ValueError), (-1, ValueError), ("0", TypeError),
                                        (0.5, TypeError), (None, TypeError)])
def test_avxvnni_keyword_is_checked(model_args, bad, error):
    cfg, tensors = model_args
    with pytest.raises(error):
        native._native.NativeModel(cfg.to_dict(), tensors, 32, avxvnni=bad)
    with pytest.raises(error):
        native._native.ops_name(avxvnni=bad)


# the wrapper's calls (kernels.native.NativeEngine): an int past C's int was a raw
# OverflowError from the argument parser, an out-of-range head_screen a raw ValueError
WRAPPER_MISUSE = [
    ("capacity=2**31", lambda e, cfg, w: native.NativeEngine(cfg, w, capacity=2**31),
     "capacity"),
    ("new_kv(2**40)", lambda e, cfg, w: e.new_kv(2**40), "native kernel"),
    ("kv_copy(n=2**40)", lambda e, cfg, w: e.kv_copy(e.new_kv(8), e.new_kv(8), 2**40),
     "native kernel"),
    ("forward(start_pos=2**70)",
     lambda e, cfg, w: e.forward(e.new_kv(8), IDS[:1], 2**70, False), "native kernel"),
    ("head_screen=300", lambda e, cfg, w: native.NativeEngine(cfg, w, head_screen=300),
     "head_screen must be 0 to 256"),
]


@pytest.mark.parametrize("call, words", [(c, w) for _, c, w in WRAPPER_MISUSE],
                         ids=[n for n, *_ in WRAPPER_MISUSE])
def test_the_wrapper_turns_every_bad_argument_into_a_kernel_error(model_args, call, words):
    cfg = torch_ref.tiny_config("llama", max_context=64)
    w = torch_ref.random_state_dict(cfg, seed=3)
    engine = native.NativeEngine(cfg, w, act="f32", threads=1)
    with pytest.raises(KernelError, match=words):
        call(engine, cfg, w)
