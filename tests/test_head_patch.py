"""The head patch (pocketlm/head_patch.py): an INT4 head's most used rows also held in INT8,
their logits written over the head's.

The numpy reference is tied to the definition (the head with the patch's rows replaced); the
native engine to the reference at every kernel level the CPU supports, in the modes and
bounds of tests/test_native_forward.py (the patch's rows take the head's products, so the
head's bound holds), for a tied and an untied head; a row's logits are the same bits alone
and in a batch (batched decode, verification); bad patches are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch_ref
from test_native_forward import IDS, LEVELS, MODES, _rel_err, _run

from pocketlm.head_patch import PATCH, PATCH_IDS, patched_head
from pocketlm.quant import quantize_int4, quantize_int8
from pocketlm.runtime import Runtime
from pocketlm.runtime.kernels import native


def _patched(arch, seed=31, rows=(0, 3, 5, 17, 42, 101, 250, 300, 319), head_bits=4):
    """A tiny model with INT4 layers, an INT4 (or INT8) head and a patch of ``rows``."""
    cfg = torch_ref.tiny_config(arch)
    sd = torch_ref.random_state_dict(cfg, seed=seed)
    w = {}
    for name, t in sd.items():
        head = name in ("embed.weight", "lm_head.weight")
        w[name] = (quantize_int8(t) if head and head_bits == 8 else quantize_int4(t, 32)) \
            if t.ndim == 2 else t
    name = "lm_head.weight" if "lm_head.weight" in sd else "embed.weight"
    ids = np.asarray(rows, np.int32)
    w[PATCH] = quantize_int8(np.asarray(sd[name], np.float32)[ids], 32)
    w[PATCH_IDS] = ids
    return cfg, w, name


def _native(cfg, w, mode, level=None, threads=2, head_screen=0):
    act, kv, digits, _ = MODES[mode]
    rt = Runtime(cfg, w, engine="numpy")
    rt.native = native.NativeEngine(cfg, w, act=act, kv=kv, level=level, threads=threads,
                                    digits=digits, head_screen=head_screen)
    return rt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied, untied
def test_reference_is_the_head_with_the_rows_replaced(arch):
    cfg, w, name = _patched(arch)
    got = _run(Runtime(cfg, w, engine="numpy"), IDS, len(IDS))
    plain = {k: v for k, v in w.items() if k not in (PATCH, PATCH_IDS)}
    head = patched_head(w[name].dequantize(), w[PATCH], w[PATCH_IDS])
    if name == "embed.weight":  # the lookups keep the INT4 embedding; only the head changes
        plain["lm_head.weight"] = head
    else:
        plain[name] = head
    want = _run(Runtime(cfg, plain, engine="numpy"), IDS, len(IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    unpatched = {k: v for k, v in w.items() if k not in (PATCH, PATCH_IDS)}
    before = _run(Runtime(cfg, unpatched, engine="numpy"), IDS, len(IDS))
    assert np.abs(before[:, w[PATCH_IDS]] - got[:, w[PATCH_IDS]]).max() > 0  # it does change
    others = np.setdiff1d(np.arange(cfg.vocab_size), w[PATCH_IDS])
    np.testing.assert_array_equal(before[:, others], got[:, others])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied, untied
@pytest.mark.parametrize("level", LEVELS)
def test_native_matches_reference(arch, level):
    cfg, w, _ = _patched(arch)
    expected = _run(Runtime(cfg, w, engine="numpy"), IDS, len(IDS))
    for mode in ("f32", "f32-kv16", "q8", "q8-1digit"):
        nat = _native(cfg, w, mode, level)
        assert nat.engine == "native"
        for split in (len(IDS), 0, 1, 6):  # prefill, decode, split prefill + decode
            assert _rel_err(_run(nat, IDS, split), expected) <= MODES[mode][3], (mode, split)
        # last-row prefill (all_logits off) takes the head's one-row path
        last = _run(nat, IDS, len(IDS), all_logits=False)
        assert _rel_err(last, expected[-1:]) <= MODES[mode][3]


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_row_is_the_same_bits_alone_and_in_a_batch(arch, mode):
    cfg, w, _ = _patched(arch)
    nat = _native(cfg, w, mode)
    prompts = [IDS[:3], IDS[3:7], IDS[7:9]]
    caches = [nat.new_cache(16) for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        nat.forward(p, c)
    toks = [11, 250, 7]
    batch = nat.forward_batch(toks, caches)
    drafts = [[1, 2, 3], [4], [5, 6]]
    verified = nat.verify_batch([(d, c) for d, c in zip(drafts, caches, strict=True)])
    for i, (p, t, d) in enumerate(zip(prompts, toks, drafts, strict=True)):
        alone = nat.new_cache(16)
        nat.forward(p, alone)
        np.testing.assert_array_equal(batch[i], nat.forward([t], alone))
        rows = [nat.forward([x], alone) for x in d]
        np.testing.assert_array_equal(verified[i], np.stack(rows))
    # a verification of several rows of one sequence, row by row
    again = nat.new_cache(16)
    nat.forward(prompts[0], again)
    one = nat.new_cache(16)
    nat.forward(prompts[0], one)
    np.testing.assert_array_equal(nat.verify(IDS[:5], again),
                                  np.stack([nat.forward([x], one) for x in IDS[:5]]))


def test_threads_do_not_change_the_bits():
    cfg, w, _ = _patched("qwen2")
    outs = [_run(_native(cfg, w, "q8", threads=t), IDS, 6) for t in (1, 2, 3)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def _bad(w, **change):
    out = dict(w)
    out.update(change)
    return out


@pytest.mark.parametrize("engine", ["numpy", "native"])
def test_bad_patches_are_refused_by_name(engine):
    cfg, w, name = _patched("qwen2")
    ids = w[PATCH_IDS]
    src = w[name].dequantize()

    def refuse(weights, *words):
        with pytest.raises(ValueError) as e:
            if engine == "numpy":
                Runtime(cfg, weights, engine="numpy")
            else:
                native.NativeEngine(cfg, weights, act="q8", threads=1, head_screen=0)
        for word in words:
            assert word in str(e.value), str(e.value)

    refuse(_bad(w, **{PATCH_IDS: ids[::-1].copy()}), PATCH_IDS, "increasing")
    refuse(_bad(w, **{PATCH_IDS: np.concatenate([ids[:-1], [cfg.vocab_size]]).astype(
        np.int32)}), PATCH_IDS)
    refuse(_bad(w, **{PATCH_IDS: np.concatenate([[-1], ids[1:]]).astype(np.int32)}), PATCH_IDS)
    refuse(_bad(w, **{PATCH_IDS: ids[:-1].copy()}), PATCH_IDS)
    refuse(_bad(w, **{PATCH: quantize_int8(np.zeros((len(ids), 96), np.float32))}), PATCH)
    if engine == "numpy":  # the checks of pocketlm.head_patch (the engine takes the tuples)
        refuse(_bad(w, **{PATCH_IDS: ids.astype(np.int64)}), PATCH_IDS, "int32")
    else:  # the extension's dtype check: ids are never converted on the way
        with pytest.raises(ValueError, match="head_patch.ids.*int32"):
            native.NativeEngine(cfg, _bad(w, **{PATCH_IDS: ids.astype(np.int64)}), act="q8",
                                threads=1, head_screen=0)
    refuse(_bad(w, **{PATCH: quantize_int4(src[ids], 32)}), PATCH, "8")  # INT8, ('int8', ..
    refuse(_bad(w, **{PATCH: quantize_int8(src[ids], 64)}), PATCH, "group 32")
    alone = {k: v for k, v in w.items() if k != PATCH_IDS}
    refuse(alone, PATCH_IDS)


def test_a_screened_head_takes_no_patch():
    cfg, w, _ = _patched("qwen2", head_bits=8)
    with pytest.raises(ValueError, match="head_patch.weight.*screened"):
        native.NativeEngine(cfg, w, act="q8", threads=1, head_screen=64)
    # an INT4 head is never screened: the setting does not stand in the patch's way
    cfg, w4, _ = _patched("qwen2")
    nat = native.NativeEngine(cfg, w4, act="q8", threads=1, head_screen=64)
    assert nat.head_screen == 64
    # an INT8 head without screening takes one
    rt = _native(cfg, w, "q8", head_screen=0)
    expected = _run(Runtime(cfg, w, engine="numpy"), IDS, len(IDS))
    assert _rel_err(_run(rt, IDS, 0), expected) <= MODES["q8"][3]


def test_patch_bytes_are_counted_in_the_tiles():
    # the engine's weight bytes (tile_bytes: what the products stream) hold the patch's INT8
    # tiles: K rows rounded up to a tile of 16, each d_model int8 values and a float16 scale
    # per 32
    cfg, w, _ = _patched("qwen2")
    plain = {k: v for k, v in w.items() if k not in (PATCH, PATCH_IDS)}
    with_patch = native.NativeEngine(cfg, w, act="q8", threads=1).model.tile_bytes[0]
    without = native.NativeEngine(cfg, plain, act="q8", threads=1).model.tile_bytes[0]
    k, d = len(w[PATCH_IDS]), cfg.d_model
    assert with_patch - without == -(-k // 16) * 16 * (d + d // 32 * 2)


@pytest.mark.skipif(not native.amx_available(),
                    reason="this CPU (or OS) has no AMX-BF16 tile unit")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_amx_prefill_takes_the_patch(arch):
    # prefills of 16+ tokens run the head (and so the patch) on AMX-BF16: the q8 bound
    cfg, w, _ = _patched(arch)
    ids = (IDS * 3)[:35]
    expected = _run(Runtime(cfg, w, engine="numpy"), ids, len(ids))
    rt = Runtime(cfg, w, engine="numpy")
    rt.native = native.NativeEngine(cfg, w, act="q8", amx=True, threads=2, head_screen=0)
    for split in (len(ids), 20):
        assert _rel_err(_run(rt, ids, split), expected) <= MODES["q8"][3]
