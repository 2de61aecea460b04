"""LoRA adapters kept beside quantized weights (pocketlm.runtime.adapters): the native engine
adds them as the numpy reference does, on every path (prefill, decode, split prefill, batched
decode, verification), each row bit for bit what a one-token decode computes, whatever the
threads; malformed adapters are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch_ref

from pocketlm.errors import FormatError
from pocketlm.quant import quantize_int4, quantize_int8
from pocketlm.runtime import Runtime
from pocketlm.runtime.adapters import ADAPTED, find_adapters
from pocketlm.runtime.kernels import native

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "pocket"]
IDS = [5, 17, 3, 250, 11, 9, 42, 7, 101, 64, 2, 300, 18]
MODES = {"f32": ("f32", "f32", 2e-5), "q8": ("q8", "f16", 2e-2)}  # act, kv, bound


def _weights(cfg, seed, rank=4, skip=(), dtype=np.float16):
    """INT4 layers, INT8 embedding / head, and an adapter of ``rank`` beside every layer weight
    (but the stems in ``skip``), large enough to change the logits; float16 (what deploy files
    hold) or float32 values that float16 does not hold."""
    sd = torch_ref.random_state_dict(cfg, seed=seed)
    w = {}
    for name, t in sd.items():
        if t.ndim != 2:
            w[name] = t
        else:
            w[name] = quantize_int8(t) if name in ("embed.weight", "lm_head.weight") \
                else quantize_int4(t, 32)
    rng = np.random.default_rng(seed)
    shapes = cfg.tensor_shapes()
    for layer in range(cfg.n_layers):
        for stem in ADAPTED:
            s = f"layers.{layer}.{stem}"
            if s in skip:
                continue
            rows, cols = shapes[s + ".weight"]
            w[s + ".lora_a"] = (rng.standard_normal((rank, cols)) / np.sqrt(cols)).astype(
                dtype)
            w[s + ".lora_b"] = (rng.standard_normal((rows, rank)) * 0.2).astype(dtype)
    return w


def _native(cfg, w, mode, threads=2):
    act, kv, _ = MODES[mode]
    rt = Runtime(cfg, w, engine="numpy")
    rt.native = native.NativeEngine(cfg, w, act=act, kv=kv, threads=threads)
    assert rt.engine == "native" and rt.native.lora_rank == 4
    # float16 in the engine exactly when float16 holds the adapters' values
    assert rt.native.lora_f16 == all(w[n].dtype == np.float16 for n in w if ".lora_" in n)
    return rt


def _run(rt, ids, split):
    cache = rt.new_cache(len(ids))
    rows = [rt.forward(ids[:split], cache, all_logits=True)] if split else []
    rows += [rt.forward([t], cache, all_logits=True) for t in ids[split:]]
    return np.concatenate(rows)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", FAMILIES)
def test_native_adds_the_adapters_as_the_reference_does(arch, mode, dtype):
    cfg = torch_ref.tiny_config(arch)
    # one weight without an adapter: the others still get theirs
    w = _weights(cfg, 3, skip=("layers.0.mlp.w_up",), dtype=dtype)
    ref = _run(Runtime(cfg, w, engine="numpy"), IDS, len(IDS))
    base = {k: v for k, v in w.items() if ".lora_" not in k}
    plain = _run(Runtime(cfg, base, engine="numpy"), IDS, len(IDS))
    bound = MODES[mode][2]
    assert _rel(plain, ref) > 0.3  # the adapters matter here
    nat = _native(cfg, w, mode)
    for split in (len(IDS), 0, 1, 6):  # prefill, decode, split prefill + decode
        assert _rel(_run(nat, IDS, split), ref) <= bound, split
    long = IDS * 3  # a block long enough for its rows to be split over the threads
    assert _rel(_run(nat, long, len(long)), _run(Runtime(cfg, w, engine="numpy"), long,
                                                 len(long))) <= bound


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_adapter_rows_are_one_token_decode_bit_for_bit(arch, mode):
    """verify() and batched decode rows equal one-token forwards exactly, and threads do not
    change a bit (the speculative and batched paths keep their exactness with adapters)."""
    extra = {"sliding_window": 40} if arch == "gemma3" else {}
    cfg = torch_ref.tiny_config(arch, max_context=256, **extra)
    w = _weights(cfg, 5)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 160)]
    results = []
    for threads in (1, 2):
        nat = _native(cfg, w, mode, threads)
        for start, k in ((5, 1), (20, 4), (126, 6)):
            plain = nat.new_cache(200)
            nat.forward(ids[:start], plain)
            want = np.stack([nat.forward([t], plain) for t in ids[start:start + k]])
            spec = nat.new_cache(200)
            nat.forward(ids[:start], spec)
            got = nat.verify(ids[start:start + k], spec)
            assert np.array_equal(got, want), (threads, start, k)
            results.append(got)
        # a batch of three sequences: each row is its sequence's one-token decode
        caches = [nat.new_cache(64) for _ in range(3)]
        for c, p in zip(caches, (ids[:3], ids[10:19], ids[30:31]), strict=True):
            nat.forward(p, c)
        solo = nat.new_cache(64)
        nat.forward(ids[10:19], solo)
        batch = nat.forward_batch([ids[40], ids[41], ids[42]], caches)
        assert np.array_equal(batch[1], nat.forward([ids[41]], solo))
        results.append(batch)
    half = len(results) // 2
    assert all(np.array_equal(a, b) for a, b in zip(results[:half], results[half:],
                                                      strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float16_adapters_compute_what_their_float32_values_do(arch, monkeypatch):
    """The engine holds float16 adapters as float16 (half the bytes per token) and converts
    them as it reads them: bit for bit the logits of the same values held in float32, on
    prefill, decode, verification and batched decode, over several chunks of a long column
    range (rank 64: 32 columns of A per conversion chunk)."""
    cfg = torch_ref.tiny_config(arch, max_context=256)
    w = _weights(cfg, 9, rank=64)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, cfg.vocab_size, 40)]

    def outputs():
        rt = Runtime(cfg, w, engine="numpy")
        rt.native = native.NativeEngine(cfg, w, act="q8", kv="f16", threads=2)
        c = rt.new_cache(64)
        out = [rt.forward(ids[:30], c, all_logits=True), rt.forward([ids[30]], c),
               rt.verify(ids[31:35], c)]
        caches = [rt.new_cache(64) for _ in range(2)]
        for k, cache in enumerate(caches):
            rt.forward(ids[k:k + 5], cache)
        out.append(rt.forward_batch([ids[35], ids[36]], caches))
        return rt.native.lora_f16, out

    half, got = outputs()
    monkeypatch.setattr(native, "_exact_f16", lambda t: False)  # the float32 path
    full, want = outputs()
    assert (half, full) == (1, 0)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def _bad(cfg, w, edit):
    w = dict(w)
    edit(w)
    return w


@pytest.mark.parametrize("case, message", [
    ("no_b", "has no 'layers.0.attn.w_q.lora_b' beside it"),
    ("no_a", "has no 'layers.1.mlp.w_down.lora_a' beside it"),
    ("shape", "do not fit the weight"),
    ("rank", "has rank 3, the others 4"),
    ("stem", "an adapter of no layer weight"),
    ("layer", "an adapter of no layer weight"),
    ("nan", "not finite"),
    ("dtype", "float16 or float32 matrix"),
])
def test_malformed_adapters_are_refused_by_name(case, message):
    cfg = torch_ref.tiny_config("llama")
    w = _weights(cfg, 7)
    q = "layers.0.attn.w_q"

    def edit(d):
        if case == "no_b":
            del d[q + ".lora_b"]
        elif case == "no_a":
            del d["layers.1.mlp.w_down.lora_a"]
        elif case == "shape":
            d[q + ".lora_a"] = d[q + ".lora_a"][:, :-1].copy()
        elif case == "rank":
            d[q + ".lora_a"] = d[q + ".lora_a"][:3].copy()
            d[q + ".lora_b"] = d[q + ".lora_b"][:, :3].copy()
        elif case == "stem":
            d["layers.0.attn_norm.lora_a"] = d[q + ".lora_a"]
            d["layers.0.attn_norm.lora_b"] = d[q + ".lora_b"]
        elif case == "layer":
            d[f"layers.{cfg.n_layers}.attn.w_q.lora_a"] = d[q + ".lora_a"]
            d[f"layers.{cfg.n_layers}.attn.w_q.lora_b"] = d[q + ".lora_b"]
        elif case == "nan":
            a = d[q + ".lora_a"].copy()
            a[0, 0] = np.nan
            d[q + ".lora_a"] = a
        elif case == "dtype":
            d[q + ".lora_b"] = d[q + ".lora_b"].astype(np.int8)

    bad = _bad(cfg, w, edit)
    with pytest.raises(FormatError, match=message):
        find_adapters(cfg, bad)
    with pytest.raises(FormatError, match=message):  # whichever engine would run it
        Runtime(cfg, bad, engine="numpy")


def test_native_model_checks_adapter_arrays():
    """The extension itself refuses adapter arrays of the wrong shape or a missing half."""
    cfg = torch_ref.tiny_config("llama")
    w = _weights(cfg, 9)
    tensors, reason = native.engine_weights(cfg, w)
    assert not reason and native.adapter_rank(tensors) == 4
    c = cfg.to_dict()
    c["lora_rank"] = 4
    bad = dict(tensors)
    del bad["layers.0.attn.w_q.lora_bt"]
    with pytest.raises(ValueError, match="come together"):
        native._native.NativeModel(c, bad, 64)
    bad = dict(tensors)
    bad["layers.0.attn.w_q.lora_at"] = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="lora_at"):
        native._native.NativeModel(c, bad, 64)
    c["lora_rank"] = 1000
    with pytest.raises(ValueError, match="lora_rank"):
        native._native.NativeModel(c, tensors, 64)
