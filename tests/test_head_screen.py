"""Head screening (POCKET_HEAD_SCREEN=K): an INT8 output head held as two INT4 planes, the low
plane read only for the tiles of the K best rows of the high plane's pass. Checked against the
same engine reading the INT8 head whole (itself checked against the numpy reference and
llama.cpp elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models

import pocketlm
from pocketlm.errors import KernelError
from pocketlm.quant import quantize_int4, quantize_int8
from pocketlm.runtime import Runtime
from pocketlm.runtime.kernels import native
from pocketlm.runtime.settings import EngineSettings

pytestmark = pytest.mark.skipif(not native.engine_available(),
                                reason="the native engine is not built")


def _weights(cfg, seed=5):
    """INT4 layers and an INT8 head (tied, or separate when the config has lm_head)."""
    sd = tiny_models.random_state_dict(cfg, seed=seed)
    return {name: (quantize_int8(w) if name in ("embed.weight", "lm_head.weight")
                   else quantize_int4(w, 32) if w.ndim == 2 else w) for name, w in sd.items()}


def test_the_setting_is_parsed_and_checked():
    assert EngineSettings.from_env({}).head_screen == 64
    assert EngineSettings.from_env({"POCKET_HEAD_SCREEN": " 16 "}).head_screen == 16
    assert EngineSettings.from_env({"POCKET_HEAD_SCREEN": "256"}).head_screen == 256
    for bad in ("257", "-1", "yes", "1.5"):
        with pytest.raises(KernelError, match=r"POCKET_HEAD_SCREEN=.*choose 0 \(off\) or a "
                                              r"number of tiles from 1 to 256"):
            EngineSettings.from_env({"POCKET_HEAD_SCREEN": bad})


def test_the_setting_reaches_the_engine(clean_env):
    cfg = tiny_models.tiny_config("llama")
    w = _weights(cfg)
    assert native.NativeEngine(cfg, w).head_screen == 64
    clean_env.setenv("POCKET_HEAD_SCREEN", "4")
    assert Runtime(cfg, w, engine="native").native.head_screen == 4
    assert native.NativeEngine(cfg, w, head_screen=0).head_screen == 0
    with pytest.raises(ValueError, match="head_screen must be 0 to 256"):
        native.NativeEngine(cfg, w, head_screen=300)


# the plane products of every level this CPU runs: AVX-512, AVX2 on multiply-add pairs (and
# AVX-VNNI where the CPU has it), neon, and the portable loop (scalar, int8 activations); the
# neon level is also checked against the scalar one under qemu (test_arm_build.py)
_CPU = native.cpu_features() if native.engine_available() else {}
LEVELS = [(lv, vnni) for lv, vnni in (("avx512", 1), ("avx2", 0), ("avx2", 1), ("neon", 1),
                                      ("scalar", 1))
          if lv in _CPU.get("levels", ()) and (lv != "avx2" or not vnni
                                               or _CPU["features"]["avxvnni"])]


def _engine(cfg, w, level, vnni, k):
    return native.NativeEngine(cfg, w, head_screen=k, level=level, act="q8", avxvnni=bool(vnni))


@pytest.mark.parametrize("level,vnni", LEVELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_screened_logits_against_the_whole_head(arch, level, vnni):
    cfg = tiny_models.tiny_config(arch)
    w = _weights(cfg)
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], dtype=np.int32)
    whole = _engine(cfg, w, level, vnni, 0)
    one = _engine(cfg, w, level, vnni, 1)  # one candidate: one tile of 16 refined
    big = _engine(cfg, w, level, vnni, 256)  # every tile of the 320-piece vocabulary
    # every logit wanted: the INT8 head's values, bit for bit
    a = whole.forward(whole.new_kv(32), ids, 0, True)
    assert np.array_equal(a, one.forward(one.new_kv(32), ids, 0, True))
    kv = [e.new_kv(32) for e in (whole, one, one, big)]
    differs = 0
    for pos in range(len(ids)):
        x, exact, y, z = (e.forward(k, ids[pos:pos + 1], pos, False, screen=scr)
                          for e, k, scr in zip((whole, one, one, big), kv,
                                               (False, False, True, True)))
        assert np.array_equal(x, exact)  # a call that does not screen reads the whole head
        assert np.array_equal(x, z)
        # one candidate: the tile of the high plane's best row has the head's values, every
        # other tile the estimate (which is not the head: screening did happen)
        tiles = (x == y).reshape(-1, 16).all(axis=1)
        assert int(tiles.sum()) == 1
        err = np.abs(x - y).max()
        differs += int(err > 1e-3 * np.abs(x).max())
        assert err < 0.25 * np.abs(x).max()  # an estimate: off by at most half a low nibble
    assert differs == len(ids)


@pytest.mark.parametrize("level,vnni", LEVELS)
def test_verification_rows_equal_one_token_steps_bit_for_bit(level, vnni):
    # verification products run rows in pairs or fours (the avx2 / avx512 tiles), steps alone
    cfg = tiny_models.tiny_config("llama")
    e = _engine(cfg, _weights(cfg), level, vnni, 2)
    ids = np.array([7, 3, 9, 2, 8, 8, 1, 4, 6], dtype=np.int32)
    for screen in (False, True):
        kv = e.new_kv(32)
        e.forward(kv, ids[:4], 0, False)
        rows = e.verify(kv, ids[4:], 4, screen=screen)
        kv2 = e.new_kv(32)
        e.forward(kv2, ids[:4], 0, False)
        steps = np.stack([e.forward(kv2, ids[i:i + 1], i, False, screen=screen)
                          for i in range(4, len(ids))])
        assert np.array_equal(rows, steps)


def test_a_batch_row_computes_the_same_screened_or_not_beside_it():
    cfg = tiny_models.tiny_config("qwen2")
    e = native.NativeEngine(cfg, _weights(cfg), head_screen=1)
    kvs = [e.new_kv(8) for _ in range(3)]
    ids = np.array([5, 6, 7], dtype=np.int32)
    pos = np.zeros(3, dtype=np.int32)
    mixed = e.forward_batch(kvs, ids, pos, screen=[True, False, True])
    for i, scr in enumerate((True, False, True)):
        alone = e.forward(e.new_kv(8), ids[i:i + 1], 0, False, screen=scr)
        assert np.array_equal(mixed[i], alone)
    with pytest.raises(ValueError, match="screen has 2 entries for 3 rows"):
        e.forward_batch(kvs, ids, pos, screen=[True, False])


def test_a_head_that_is_not_int8_is_left_as_it_is():
    cfg = tiny_models.tiny_config("llama")
    sd = tiny_models.random_state_dict(cfg, seed=2)
    w = {n: quantize_int4(a, 32) if a.ndim == 2 else a for n, a in sd.items()}
    ids = np.array([1, 2, 3, 4], dtype=np.int32)
    outs = [e.forward(e.new_kv(8), ids, 0, False, screen=True) for e in
            (native.NativeEngine(cfg, w, head_screen=0),
             native.NativeEngine(cfg, w, head_screen=8))]
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.real
def test_smollm2_greedy_answers_are_identical_with_a_screened_head(clean_env):
    clean_env.setenv("POCKET_HEAD_SCREEN", "0")
    m = pocketlm.load("smollm2-135m")
    asks = ["Explain in three sentences why the sky is blue.",
            "Write a short email asking a colleague to move our meeting to Friday."]
    want = [m.chat([{"role": "user", "content": a}], max_tokens=64, temperature=0) for a in asks]
    m.runtime.native = native.NativeEngine(m.config, m.runtime.w, head_screen=64)
    got = [m.chat([{"role": "user", "content": a}], max_tokens=64, temperature=0) for a in asks]
    assert got == want
