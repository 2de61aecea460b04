"""Compact tiles (``POCKET_COMPACT_TILES``, docs/engine.md): INT4 weights with coded steps
(``int4_c8``, and GGUF Q4_K's ``q4_k``) keep their codes in the engine's tiles, and INT4 / INT5 weights with implicit
minimums (a zero point, as a GGUF's Q4_0 / Q5_0 imports) keep no minimums; every kernel decodes
a tile's steps as it reaches the tile. The results must be those of float16 tiles bit for bit:
prefill (every logit), decode steps, a verification and a batched step, on every x86 kernel
level and activation kind, on tiny random models of the five families. The ARM64 neon level is
checked against its scalar level in tests/test_arm_build.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import coded_int4, implicit_minimums, random_state_dict, tiny_config

from pocketlm.quant import (
    EncodedQuantTensor,
    QuantTensor,
    quantize_int4,
    quantize_int5,
    quantize_int8,
)
from pocketlm.runtime import Runtime
from pocketlm.runtime.kernels import native

pytestmark = pytest.mark.skipif(not native.engine_available(),
                                reason="the native engine is not built")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "pocket"]
IDS = [5, 17, 3, 250, 11, 9, 42, 7]


def _q4_k(rows: int, cols: int, seed: int):
    """A random GGUF Q4_K tensor (``q4_k``: its 6-bit codes under a float16 d, dmin per 256
    columns), as a pack stores it."""
    rng = np.random.default_rng(seed)
    nsb = cols // 256
    kd = rng.uniform(1e-3, 4e-3, (rows, nsb * 2)).astype(np.float16)
    return EncodedQuantTensor("q4_k", (rows, cols), {
        "": rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
        ".kscales": rng.integers(0, 256, (rows, nsb * 12), dtype=np.uint8), ".kd": kd})


def _weights(cfg, seed=3):
    """Every compact layout beside the plain ones: coded INT4 (W_gate, W_up, and the tied
    embedding / head where the model ties them; gemma3's in INT5 with zero point 16), GGUF Q4_K codes (W_down: d_ff 512, two runs of steps a row), INT5
    with zero point 16 (W_q, W_k), INT4 with zero point 8 (W_v), INT4 group 64 with zero
    point 8 (W_o)."""
    out = dict(random_state_dict(cfg, seed=seed))
    for name, w in list(out.items()):
        if w.ndim != 2:
            continue
        if name in ("embed.weight", "lm_head.weight"):  # tied: looked up in the head's tiles
            out[name] = (quantize_int8(w) if not cfg.tie_embeddings
                         else implicit_minimums(quantize_int5(w, 32), 16) if cfg.arch == "gemma3"
                         else coded_int4(quantize_int4(w, 32)))
        elif name.endswith(("w_gate.weight", "w_up.weight")):
            out[name] = coded_int4(quantize_int4(w, 32))
        elif name.endswith(("w_q.weight", "w_k.weight")):
            out[name] = implicit_minimums(quantize_int5(w, 32), 16)
        elif name.endswith("w_o.weight") and w.shape[1] % 64 == 0:
            out[name] = implicit_minimums(quantize_int4(w, 64), 8)
        elif name.endswith("w_down.weight"):
            out[name] = _q4_k(*w.shape, seed=len(name))
        else:
            out[name] = implicit_minimums(quantize_int4(w, 32), 8)
    return out


def _run(cfg, weights):
    """Prefill (every logit), 3 greedy decode steps, a verification of 4 rows and a batched
    step of two sequences, and the engine's (tile bytes, of which compact)."""
    rt = Runtime(cfg, weights, engine="native")
    a, b = rt.new_cache(64), rt.new_cache(64)
    rows = [rt.forward(np.asarray(IDS), a, all_logits=True)]
    nxt = int(np.argmax(rows[0][-1]))
    for _ in range(3):
        rows.append(rt.forward(np.asarray([nxt]), a)[None])
        nxt = int(np.argmax(rows[-1][0]))
    rows.append(rt.verify(np.asarray([nxt, 5, 9, 11]), a))
    rows.append(rt.forward(np.asarray(IDS[:3]), b, all_logits=True))
    rows.append(rt.forward_batch(np.asarray([7, 9]), [a, b]))
    return np.concatenate(rows), rt.native.model.tile_bytes, rt.native


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_compact_tiles_compute_what_float16_tiles_compute(arch, act, level, monkeypatch):
    if level not in native.cpu_features()["levels"]:
        pytest.skip(f"this CPU has no {level} level")
    cfg = tiny_config(arch, d_ff=512)
    w = _weights(cfg)
    monkeypatch.setenv("POCKET_ACT", act)
    monkeypatch.setenv("POCKET_CPU_LEVEL", level)
    monkeypatch.setenv("POCKET_COMPACT_TILES", "1")
    on, (on_total, on_compact), eng = _run(cfg, w)
    monkeypatch.setenv("POCKET_COMPACT_TILES", "0")
    off, (off_total, off_compact), _ = _run(cfg, w)
    assert eng.level == level
    np.testing.assert_array_equal(on, off)
    assert off_compact == 0
    if eng.amx:  # the AMX prefill reads float16 steps
        assert on_compact == 0 and on_total == off_total
    else:
        assert on_compact > 0 and on_total < off_total
    # and both are the numpy reference's model (bound: test_native_forward's MODES)
    ref = Runtime(cfg, w, engine="numpy")
    cache = ref.new_cache(64)
    logits = ref.forward(np.asarray(IDS), cache, all_logits=True)
    err = np.abs(on[:len(IDS)] - logits).max() / np.abs(logits).max()
    assert err <= (2e-5 if act == "f32" else 2e-2)


def test_zero_point_that_does_not_give_the_minimums_is_refused():
    # the repack checks every group's implicit minimum against the float16 one it is handed
    cfg = tiny_config("llama", d_ff=512)
    w = _weights(cfg)
    name = "layers.0.attn.w_v.weight"
    qt = w[name]
    wrong = qt.mins.copy()
    wrong[0, 0] = np.float16(float(wrong[0, 0]) + 1.0)
    w[name] = QuantTensor(qt.kind, qt.shape, qt.group_size, qt.qweight, qt.scales, wrong, 8)
    with pytest.raises(Exception, match="contradict their stored codes"):
        native.NativeEngine(cfg, w, act="q8", compact_tiles=True, amx=False)
    native.NativeEngine(cfg, w, act="q8", compact_tiles=False, amx=False)  # minimums as given
