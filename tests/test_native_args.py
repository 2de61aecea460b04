"""Arguments of the native engine's constructor (``pocketlm._native.NativeModel``), called
directly: ``avxvnni`` chooses the avx2 level's int8 products (1: AVX-VNNI where the CPU has it,
0: AVX2's multiply-add pairs), and both give the same logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


# -- the arguments of a call, as the engine reads them without the GIL ------------------------
def test_rows_of_one_cache_in_verify_batch_come_in_increasing_positions(model_args):
    # rows run in blocks of 128: a cache's row in an earlier block read a later block's keys
    # before they were written (silently wrong logits); rows at one position were refused
    cfg, tensors = model_args
    model = native._native.NativeModel(cfg.to_dict(), tensors, 256)
    kv, V = native._native.NativeKV(model, 256), cfg.vocab_size
    n = 130
    ids, up = IDS[np.arange(n) % len(IDS)], np.arange(n, dtype=np.int32)
    model.verify_batch([kv] * n, ids, up, np.empty((n, V), np.float32))  # in order: taken
    for pos in (up[::-1].copy(), np.array([1, 0], np.int32), np.array([3, 3], np.int32)):
        k = len(pos)
        with pytest.raises(ValueError, match="rows 0 and 1 of one KV cache are at positions "
                           f"{pos[0]} and {pos[1]}: its rows must come in increasing"):
            model.verify_batch([kv] * k, ids[:k].copy(), pos, np.empty((k, V), np.float32))


MEDDLER = """
import sys, threading
import numpy as np
import tiny_models
from pocketlm.runtime.kernels import native

N = native._native
cfg = tiny_models.tiny_config("llama", n_layers=6, d_model=128, d_ff=256, max_context=512)
model = N.NativeModel(cfg.to_dict(), native.engine_weights(
    cfg, tiny_models.random_state_dict(cfg, seed=0))[0], 512)
V = cfg.vocab_size
ids, pos, kvs, calling, stop = np.ones(300, np.int32), np.zeros(4, np.int32), [], [], []

def meddle():  # another thread, during a call: ids and positions out of range, no caches
    while not stop:
        if calling:
            ids[:] = pos[:] = 10**8
            kvs.clear()
            calling.clear()

sys.setswitchinterval(1e-5)
thread = threading.Thread(target=meddle)
thread.start()
for _ in range(40):
    for call in (lambda: model.forward(N.NativeKV(model, 512), ids, 0, np.empty(V, np.float32)),
                 lambda: model.forward_batch(kvs, ids[:4], pos, np.empty((4, V), np.float32)),
                 lambda: model.verify_batch(kvs, ids[:4], pos, np.empty((4, V), np.float32))):
        ids[:], pos[:], kvs[:] = 1, 0, [N.NativeKV(model, 16) for _ in range(4)]
        calling.append(1)
        try:
            call()
        except ValueError:  # the meddling came before the checks
            pass
stop.append(1)
thread.join()
print("done")
"""


def test_a_thread_changing_the_arguments_during_a_call_cannot_crash_it():
    # the engine read the caller's ids and positions after the checks, without the GIL, and
    # held the caches only through the caller's list: a thread writing an id or position out
    # of range wrote out of bounds, one emptying the list freed a cache in use (segfaults)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    run = subprocess.run([sys.executable, "-c", MEDDLER], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-2000:]


def test_python_code_run_by_a_weight_cannot_free_what_the_constructor_reads(model_args):
    # the constructor read the weights dict's values as borrowed references: a mins_in_memory
    # flag whose __bool__ emptied the dict freed the tuple being read; one whose __bool__ raised
    # had its exception swallowed
    cfg, tensors = model_args
    name = "layers.0.attn.w_q.weight"

    class Emptying:
        def __bool__(self):
            weights.clear()
            return False

    class Raising:
        def __bool__(self):
            raise RuntimeError("no truth value")

    def logits(weights):
        model = native._native.NativeModel(cfg.to_dict(), weights, 32)
        out = np.zeros((len(IDS), cfg.vocab_size), np.float32)
        model.forward(native._native.NativeKV(model, 32), IDS, 0, out, all_logits=True)
        return out

    weights = {**tensors, name: tensors[name][:5] + (Emptying(),)}
    np.testing.assert_array_equal(logits(weights), logits(tensors))
    assert weights == {}
    with pytest.raises(RuntimeError, match="no truth value"):
        native._native.NativeModel(cfg.to_dict(), {**tensors, name: tensors[name][:5] +
                                                   (Raising(),)}, 32)


def test_the_wrappers_constants_are_the_extensions():
    # the scheduler cuts prompts by AMX_MIN_TOKENS (a seeded answer must not change with how
    # a prompt is cut), the engine settings by the Q8_* classes: one value on both sides
    for name in ("AMX_MIN_TOKENS", "Q8_QKV", "Q8_WO", "Q8_GATE_UP", "Q8_DOWN", "Q8_HEAD",
                 "Q8_ONE_DIGIT_SHIFT"):
        assert getattr(native, name) == getattr(native._native, name), name
