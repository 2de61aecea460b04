"""Activation-aware channel scaling (pocketlm.awq): the folded model computes what the source
computes, the search finds the scale that loud input channels need, and the pack path records
it, keeps exact imports exact and stays deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_gguf

from pocketlm import awq, calibrate
from pocketlm.errors import UnsupportedError
from pocketlm.formats import open_source
from pocketlm.formats.pocketfile import PocketFile
from pocketlm.pack import pack
from pocketlm.quant import quantize_int8
from pocketlm.runtime.model import Runtime

TEXT = ("The parcel left the depot this morning; it will arrive tomorrow. "
        "包裹今早已离开仓库，明天送达。 ") * 60


@pytest.fixture(autouse=True)
def _stats_cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "_stats_path",
                        lambda model, cset: tmp_path / "calib" / f"{cset.digest[:16]}.npz")


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch):
    monkeypatch.setenv("POCKET_ACT", "f32")  # logits compared at float32 rounding


def _logits(config, weights, ids):
    rt = Runtime(config, weights, engine="numpy")
    return rt.forward(np.asarray(ids), rt.new_cache(len(ids)), all_logits=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_folded_scales_leave_the_float_model_unchanged(arch, tmp_path):
    # every site of every family, scaled by a random positive vector, computes the same
    # logits: the scale is exactly undone by the norm, the up projection or the value rows
    src = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, arch, seed=7, weight_type="F32", embed_type="F32")
    model = open_source(src)
    w = {n: t.to_float() for n, t in model.tensors.items()}
    ids = model.tokenizer.encode("The parcel left the depot; 包裹明天送达。")[:40]
    ref = _logits(model.config, w, ids)
    rng = np.random.default_rng(0)
    sites = awq.sites(model.config, list(w))
    assert any(s.name == "head_in" for s in sites) == (not model.config.tie_embeddings)
    assert any(s.fold_bias for s in sites) == model.config.qkv_bias
    scaled = dict(w)
    for site in sites:
        h = np.diag(rng.uniform(0.1, 10.0, w[site.consumers[0]].shape[1]))
        d = awq.channel_rms(h, model.config, site.name)
        awq.apply(site, awq._normalised(d, 0.7), scaled, model.config)
    changed = [n for n in w if not np.array_equal(w[n], scaled[n])]
    assert any("w_o" in n for n in changed) and any("attn_norm" in n for n in changed)
    got = _logits(model.config, scaled, ids)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_value_channels_share_one_scale_per_key_value_head():
    config = tiny_gguf.reference_config("llama")  # 4 query heads on 2 key-value heads
    h = np.diag(np.arange(1.0, 1.0 + config.n_heads * config.head_dim))
    d = awq.channel_rms(h, config, "layers.0.o_in").reshape(
        config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim)
    assert np.array_equal(d[:, 0], d[:, 1])  # the two query heads of a group agree


def test_search_scales_up_loud_channels_and_cuts_the_output_error():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4096, 256)).astype(np.float32)
    x[:, :8] *= 20.0  # a few loud channels, as a transformer's residual stream has
    h = (x.T.astype(np.float64) @ x) / len(x)
    w = rng.standard_normal((128, 256)).astype(np.float32) * 0.05

    def q(m, hdiag):
        return calibrate.quantize_act(m, "int4", 64, hdiag)

    alpha, s, e0, e1 = awq.search([w], [q], h, awq.channel_rms(h), calibrate.output_error)
    assert alpha > 0 and e1 < 0.8 * e0
    assert s[:8].min() > s[8:].max()  # the loud channels get the larger scales
    again = awq.search([w.copy()], [q], h.copy(), awq.channel_rms(h), calibrate.output_error)
    assert again[0] == alpha and again[1].tobytes() == s.tobytes()
    # INT8 consumers are searched too (their error barely moves)
    a8 = awq.search([w], [lambda m, hd: quantize_int8(m, 32)], h, awq.channel_rms(h),
                    calibrate.output_error)
    assert a8[3] <= a8[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    src = root / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "qwen2", seed=5, weight_type="F32", embed_type="F32")
    text = root / "app.txt"
    text.write_text(TEXT, encoding="utf-8")
    return {"src": src, "text": text}


def test_awq_pack_records_its_scaling_and_is_deterministic(tiny, tmp_path):
    a, b = tmp_path / "a.pocket", tmp_path / "b.pocket"
    rep = pack(tiny["src"], a, calib=tiny["text"], awq=True, keep_precision=False,
               progress=False)
    cal = rep.calibration["channel_scaling"]
    assert cal["sites"] == 3 * 4 + 1  # four sites a layer, and the untied head
    assert cal["scaled"] >= 1 and 0.0 < cal["error_removed"] < 1.0
    assert PocketFile(a).json("quant")["calibration"]["channel_scaling"] == cal
    pack(tiny["src"], b, calib=tiny["text"], awq=True, keep_precision=False, progress=False)
    wa, wb = PocketFile(a).weights(), PocketFile(b).weights()
    for name, x in wa.items():
        y = wb[name]
        if hasattr(x, "qweight"):
            assert x.qweight.tobytes() == y.qweight.tobytes(), name
            assert x.scales.tobytes() == y.scales.tobytes(), name
        else:
            assert x.tobytes() == y.tobytes(), name


def test_awq_pack_stays_close_to_the_float_model(tiny, tmp_path):
    src = open_source(tiny["src"])
    floats = {n: t.to_float() for n, t in src.tensors.items()}
    ids = src.tokenizer.encode("The parcel left the depot; 包裹明天送达。")[:48]
    ref = _logits(src.config, floats, ids)

    def err(path):
        return float(np.linalg.norm(_logits(src.config, PocketFile(path).weights(), ids) - ref))

    pack(tiny["src"], tmp_path / "rtn.pocket", keep_precision=False, progress=False)
    pack(tiny["src"], tmp_path / "awq.pocket", calib=tiny["text"], awq=True,
         keep_precision=False, progress=False)
    assert err(tmp_path / "awq.pocket") < err(tmp_path / "rtn.pocket")


def test_exact_imports_are_never_scaled(tmp_path):
    # a Q4_0 source imports exactly: channel scaling would move it off its grid, so without a
    # budget no site is scaled and the tensors stay byte for byte the source's
    src = tmp_path / "q.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=6, weight_type="Q4_0")
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    rep = pack(src, tmp_path / "q.pocket", calib=text, awq=True, progress=False)
    assert rep.calibration["channel_scaling"]["scaled"] == 0
    assert {t.how for t in rep.tensors if t.stored != "f32"} == {"lossless"}


def test_tensors_kept_in_their_source_blocks_are_never_scaled(tmp_path):
    # a Q6_K tensor is packed as INT8 stored in its own Q6_K blocks (6.5625 bits a weight):
    # channel scaling moved it off them, into plain INT8 (8.5 bits), and a Q6_K file grew by
    # a quarter under --awq. Its sites are left alone, as those of exact imports are: the
    # tensors are byte for byte the plain pack's, while the other sites are still scaled
    src = tmp_path / "k.gguf"
    six = {f"layers.{i}.{t}.weight": "Q6_K" for i in range(3) for t in ("attn.w_v", "mlp.w_down")}
    tiny_gguf.write_tiny_gguf(src, "qwen2", seed=11, weight_type="F32", embed_type="F32",
                              tensor_types=six, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2,
                              head_dim=64)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    pack(src, tmp_path / "p.pocket", progress=False)
    rep = pack(src, tmp_path / "a.pocket", calib=text, awq=True, progress=False)
    assert rep.calibration["channel_scaling"]["scaled"] >= 1  # the mlp_in sites, the head's
    a, p = PocketFile(tmp_path / "a.pocket"), PocketFile(tmp_path / "p.pocket")
    assert {n for n, e in a.encodings().items() if e == "q6_k"} == set(six)
    for name in six:
        stored = sorted(k for k in p.infos if k == name or k.startswith(name + "."))
        assert sorted(k for k in a.infos if k == name or k.startswith(name + ".")) == stored
        for k in stored:
            assert a.tensor(k).tobytes() == p.tensor(k).tobytes(), k
    # all Q6_K: nothing is left to scale, and the file is the plain pack's size
    tiny_gguf.write_tiny_gguf(src, "llama", seed=11, weight_type="Q6_K", d_model=256,
                              d_ff=512, n_heads=4, n_kv_heads=2, head_dim=64)
    plain = pack(src, tmp_path / "p.pocket", progress=False)
    assert plain.larger_exact_import is None  # the exact import (a header over the GGUF)
    rep = pack(src, tmp_path / "a.pocket", calib=text, awq=True, progress=False)
    assert rep.calibration["channel_scaling"]["scaled"] == 0
    assert {t.encoding for t in rep.tensors if t.stored != "f32"} == {"q6_k"}
    assert rep.file_bytes < plain.file_bytes + 4096  # the calibration record


def test_a_budgeted_awq_pack_meets_its_budget(tiny, tmp_path):
    rep = pack(tiny["src"], tmp_path / "b.pocket", calib=tiny["text"], awq=True,
               bits_per_weight=4.6, progress=False)
    assert rep.quant_bits_per_weight <= 4.6
    assert rep.calibration["channel_scaling"]["sites"] >= 1


def test_a_layer_without_its_norm_is_refused():
    config = tiny_gguf.reference_config("llama")
    names = [n for n in config.tensor_shapes() if n != "layers.1.mlp_norm.weight"]
    with pytest.raises(UnsupportedError, match="layers.1.mlp_norm.weight"):
        awq.sites(config, names)


def test_cli_pack_awq_flag(tiny, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "c.pocket"
    r = subprocess.run([sys.executable, "-m", "pocketlm.cli", "pack", str(tiny["src"]), "-o",
                        str(out), "--calib", str(tiny["text"]), "--awq"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    shown = subprocess.run([sys.executable, "-m", "pocketlm.cli", "inspect", str(out)],
                           capture_output=True, text=True, timeout=120).stdout
    assert "channel scaling" in shown


def test_reported_weight_errors_are_against_the_scaled_matrices(tiny, tmp_path):
    # a scaled tensor's rounding was judged against the unscaled source: the INT8 output head
    # (error ~0.005) reported 0.13, the scale itself counted as rounding error
    out = tmp_path / "w.pocket"
    rep = pack(tiny["src"], out, calib=tiny["text"], awq=True, keep_precision=False,
               progress=False)
    src = open_source(tiny["src"])
    assert not np.array_equal(PocketFile(out).weights()["norm.weight"],
                              src.tensors["norm.weight"].to_float())  # the head was scaled
    head = next(t for t in rep.tensors if t.name == "lm_head.weight")
    assert head.stored == "int8" and head.rel_error < 0.02
    plain = {t.name: t.rel_error for t in pack(tiny["src"], tmp_path / "p.pocket",
                                               calib=tiny["text"], keep_precision=False,
                                               progress=False).tensors}
    for t in rep.tensors:
        if t.stored != "f32":
            assert t.rel_error < 1.3 * plain[t.name] + 1e-3, t.name


def test_a_budget_keeps_exact_imports_that_fit_it_unscaled(tmp_path):
    # a Q4_0 tensor imports exactly in 4.5 bits (minimums implicit), which a 4.6-bit budget
    # holds: scaling it would throw its exact grid away (it was judged at 5.0 bits, minimums
    # counted, so every site was scaled)
    src = tmp_path / "q.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=6, weight_type="Q4_0")
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    rep = pack(src, tmp_path / "q.pocket", calib=text, awq=True, bits_per_weight=4.6,
               progress=False)
    assert rep.calibration["channel_scaling"]["scaled"] == 0
    assert rep.calibration["channel_scaling"]["sites"] == 0
    assert rep.quant_bits_per_weight <= 4.6


def test_awq_with_adapters_kept_beside_is_refused(tiny, tmp_path):
    # the scales fold into the weights and norms, never into adapters kept beside them
    # (--keep-lora): their A would read x / s instead of x, and the file computed another model
    src = open_source(tiny["src"])
    rng = np.random.default_rng(0)
    stem = "layers.0.attn.w_q"
    rows, cols = src.tensors[stem + ".weight"].shape
    src.adapters = {stem: (rng.standard_normal((4, cols)).astype(np.float32),
                           rng.standard_normal((rows, 4)).astype(np.float32))}
    src.adapter = {"kind": "lora", "rank": 4, "alpha": 8.0, "weights": 1}
    out = tmp_path / "l.pocket"
    with pytest.raises(UnsupportedError, match="--keep-lora"):
        pack(src, out, calib=tiny["text"], awq=True, progress=False)
    assert not out.exists()
