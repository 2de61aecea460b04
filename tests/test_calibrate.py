"""Calibrated quantization: the statistics, the quantizers, the bit budget, the layouts stored
without minimums, and the pack path's refusals (pocketlm.calibrate, pocketlm.calibdata)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tiny_gguf

from pocketlm import calibdata, calibrate
from pocketlm.errors import PocketError, UnsupportedError
from pocketlm.formats import open_source
from pocketlm.formats.pocketfile import PocketFile
from pocketlm.pack import pack
from pocketlm.quant import find_zero_point, implicit_mins, quantize
from pocketlm.runtime.model import Runtime


@pytest.fixture(autouse=True)
def _stats_cache_in_tmp(tmp_path, monkeypatch):
    # the statistics cache lives in the test's folder, not in the shared POCKET_HOME
    monkeypatch.setattr(calibrate, "_stats_path",
                        lambda model, cset: tmp_path / "calib" / f"{cset.digest[:16]}.npz")


def _inputs(n=4096, d=128, seed=0):
    """Inputs with a few loud channels and correlated ones, like a transformer's."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d)) * 0.3 + np.eye(d)
    x = rng.standard_normal((n, d)) @ mix
    x[:, :4] *= 12.0
    return x.astype(np.float32)


def _hessian(x):
    return (x.T.astype(np.float64) @ x) / len(x)


def test_calibrated_methods_cut_the_output_error_that_rounding_leaves():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 128)).astype(np.float32)
    h = _hessian(_inputs())
    err = {}
    for m in calibrate.METHODS:
        qt = calibrate.quantize_calibrated(w, "int4", 32, h, m)
        err[m] = calibrate.output_error(w, qt, h)
    assert err["rtn"] == pytest.approx(calibrate.output_error(w, quantize(w, 4, 32), h))
    assert err["act"] < 0.9 * err["rtn"]
    assert err["gptq"] < 0.7 * err["rtn"]
    assert err["gptq"] < err["act"]


@pytest.mark.parametrize("kind,zp,bpw", [("int4", 8, 4.5), ("int5", 16, 5.5), ("int4", None, 5.0)])
def test_symmetric_grids_store_no_minimums(kind, zp, bpw):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    h = _hessian(_inputs())
    qt = calibrate.quantize_calibrated(w, kind, 32, h, "gptq", zp)
    assert find_zero_point(qt) == zp
    qt.zero_point = find_zero_point(qt)
    assert qt.bits_per_weight == bpw
    if zp is not None:
        assert np.array_equal(qt.mins.view(np.uint16), implicit_mins(qt.scales, zp).view(np.uint16))


@pytest.mark.parametrize("method", ["act", "gptq"])
def test_coded_scales_keep_group_32s_error_at_group_64s_size(method):
    # INT4 group 32 with 8-bit coded scales and minimums (4.5 bits + 32 / columns) against
    # group 64 (4.5 bits) and group 32 with float16 steps (5.0 bits)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((96, 256)) * rng.uniform(0.2, 2.0, (96, 1))).astype(np.float32)
    h = _hessian(_inputs(d=256))
    err = {}
    for key, gs, zp in (("g64", 64, None), ("g32", 32, None), ("c8", 32, calibrate.CODED)):
        qt = calibrate.quantize_calibrated(w, "int4", gs, h, method, zp)
        err[key] = calibrate.output_error(w, qt, h)
        if key == "c8":
            assert qt.encoding == "int4_c8" and qt.nbytes == calibrate.layout_bytes(
                "int4", 32, w.shape, calibrate.CODED) == 96 * (128 + 16 + 4)
            assert qt.bits_per_weight == 4.625  # 4.5 + 32 / 256
    assert err["g32"] < err["c8"] < 0.9 * err["g64"]
    assert err["c8"] < 1.25 * err["g32"]


def test_untied_embedding_never_takes_coded_scales():
    assert ("int4", 32, calibrate.CODED) in calibrate.LAYOUTS
    assert all(zp != calibrate.CODED for _, _, zp in calibrate.PLAIN_LAYOUTS)
    assert len(calibrate.PLAIN_LAYOUTS) == len(calibrate.LAYOUTS) - 1


def test_quantizers_are_deterministic():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    h = _hessian(_inputs(d=256))
    a = calibrate.quantize_calibrated(w, "int4", 64, h, "gptq")
    b = calibrate.quantize_calibrated(w.copy(), "int4", 64, h.copy(), "gptq")
    for x, y in ((a.qweight, b.qweight), (a.scales, b.scales), (a.mins, b.mins)):
        assert x.tobytes() == y.tobytes()
    a = calibrate.quantize_calibrated(w, "int4", 32, h, "gptq", calibrate.CODED)
    b = calibrate.quantize_calibrated(w.copy(), "int4", 32, h.copy(), "gptq", calibrate.CODED)
    assert all(x.tobytes() == b.stored[k].tobytes() for k, x in a.stored.items())


def test_allocate_meets_the_budget_and_spends_it_where_it_removes_most_error():
    rng = np.random.default_rng(4)
    h = _hessian(_inputs())
    cands = {}
    for i in range(6):
        w = (rng.standard_normal((64, 128)) * (1 + i)).astype(np.float32)
        cands[f"t{i}"] = calibrate.candidates(w, np.diag(h).copy(), None)
    small = sum(min(c.nbytes for c in cs) for cs in cands.values())
    large = sum(max(c.nbytes for c in cs) for cs in cands.values())
    last = None
    for budget in np.linspace(small, large, 6):
        pick = calibrate.allocate(cands, budget)
        used = sum(c.nbytes for c in pick.values())
        assert used <= budget
        total = sum(c.error for c in pick.values())
        if last is not None:
            assert total <= last + 1e-12  # more bytes never buy more error
        last = total
    assert last == pytest.approx(sum(min(c.error for c in cs) for cs in cands.values()))
    with pytest.raises(UnsupportedError, match="below what the smallest layouts reach"):
        calibrate.allocate(cands, small - 1)
    # said in bits per weight, the unit of --bits-per-weight, when the weights are counted
    count = 6 * 64 * 128
    with pytest.raises(UnsupportedError, match=r"\(4\.\d\d bits per weight, .* MB\) is below "
                       r"what the smallest layouts reach \(4\.\d\d bits per weight"):
        calibrate.allocate(cands, small - 1, count)


@pytest.mark.parametrize("value", [4.0, 8.5, -1, "many", float("nan"), True])
def test_bits_per_weight_out_of_range_is_refused(value):
    with pytest.raises(UnsupportedError, match="bits-per-weight"):
        calibrate.check_bits_per_weight(value)


class _Tok:
    def encode(self, text, add_bos=False, special=False):
        return list(text.encode("utf-8"))


@pytest.mark.parametrize("content,message", [
    (b"", "empty"), (b"  \n", "empty"), (b"abc\0def" * 40, "binary"),
    ("\ufeff\n\u00a0\u3000\n".encode(), "no text"),  # a byte-order mark and wide blanks
    (b"caf\xe9 " * 100, "not UTF-8"), (b"short text", "shorter than one calibration"),
])
def test_bad_calibration_files_are_refused_by_name(tmp_path, content, message):
    path = tmp_path / "calib.txt"
    path.write_bytes(content)
    with pytest.raises(PocketError, match=message) as e:
        calibdata.file_set(path, _Tok(), seq_len=64)
    assert str(path) in str(e.value)


def test_a_calibration_path_that_is_no_text_file_is_named_for_what_it_is(tmp_path):
    # a FIFO or /dev/null was "no such file", an empty --calib "--calib .: is a folder"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, message in ((fifo, "not a regular file"), ("/dev/null", "not a regular file"),
                          (tmp_path / "none.txt", "no such file"), (tmp_path, "is a folder")):
        with pytest.raises(PocketError, match=message):
            calibdata.check_text_file(path)
    for path in ("", " "):
        with pytest.raises(PocketError, match="^--vocab-corpus is empty"):
            calibdata.check_text_file(path, flag="--vocab-corpus")


@pytest.mark.parametrize("calib", [5, 4.6, ["app.txt"], b"app.txt"])
def test_a_calib_argument_that_is_no_path_is_refused_by_name(tmp_path, calib):
    """pack(calib=5) was a bare TypeError from Path(5)."""
    src = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=2, weight_type="F32")
    with pytest.raises(PocketError, match="calib must be 'default' or a text file's path"):
        pack(src, tmp_path / "out.pocket", calib=calib, progress=False)
    assert not (tmp_path / "out.pocket").exists()


def test_a_failed_pack_leaves_no_folders_it_made(tiny, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short to calibrate on")
    with pytest.raises(PocketError, match="shorter than one calibration sequence"):
        pack(tiny["src"], tmp_path / "new" / "sub" / "x.pocket", calib=short, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    with pytest.raises(PocketError):
        pack(tiny["src"], tmp_path / "kept" / "x.pocket", calib=short, progress=False)
    assert (tmp_path / "kept").is_dir()


def test_calibration_file_is_cut_into_sequences(tmp_path):
    path = tmp_path / "app.txt"
    path.write_text("订单已发货，预计明天送达。Order shipped. " * 40, encoding="utf-8")
    cs = calibdata.file_set(path, _Tok(), n_sequences=5, seq_len=64)
    assert len(cs.sequences) == 5 and all(len(s) == 64 for s in cs.sequences)
    assert cs.record()["source"] == "app.txt" and len(cs.digest) == 64  # the name, as spelled anywhere


def test_default_set_is_fixed_and_never_holds_heldout_text():
    cs1 = calibdata.default_set(_Tok(), n_sequences=12, seq_len=64)
    cs2 = calibdata.default_set(_Tok(), n_sequences=12, seq_len=64)
    assert cs1.sequences == cs2.sequences and cs1.digest == cs2.digest
    assert len(cs1.sequences) == 12
    for kind in calibdata.KINDS:
        calib, held = calibdata.split(kind)
        assert held and calib and not set(calib) & set(held)
        assert all(calibdata.is_heldout(d) for d in held)
        assert calibdata.heldout_text(kind, 500) in "\n".join(held)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    src = root / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=5, weight_type="F32", embed_type="F32")
    text = root / "app.txt"
    text.write_text(("The parcel left the depot this morning; it will arrive tomorrow. "
                     "包裹今早已离开仓库，明天送达。 ") * 60, encoding="utf-8")
    return {"src": src, "text": text, "root": root}


def test_statistics_are_kept_and_reused(tiny, tmp_path):
    src = open_source(tiny["src"])
    cs = calibdata.file_set(tiny["text"], src.tokenizer, n_sequences=4, seq_len=64)
    assert calibrate.cached_stats(src, cs) is None
    floats = {n: t.to_float() for n, t in src.tensors.items()}
    st = calibrate.gather(src.config, floats, cs.sequences, progress=False)
    calibrate.save_stats(src, cs, st)
    again = calibrate.cached_stats(src, cs)
    assert again is not None and sorted(again.h) == sorted(st.h) and again.tokens == 256
    for site in st.h:
        np.testing.assert_allclose(again.hessian(site), st.hessian(site), rtol=1e-6)


def test_pack_with_an_app_file_offline_says_the_head_was_not_measured(tiny, tmp_path,
                                                                       monkeypatch):
    """--calib FILE needs no corpora; offline, the head's agreement (measured on held-out
    corpora) is said to be unmeasured instead of failing the pack after its calibration."""
    from pocketlm.errors import FetchError

    def offline(kind, chars=6000):
        raise FetchError("cannot download the corpus (offline)")

    monkeypatch.setattr(calibdata, "heldout_text", offline)
    out = tmp_path / "o.pocket"
    rep = pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False)
    head = rep.calibration["head"]
    assert "top1_vs_float" not in head and "offline" in head["not_measured"]
    assert "top-1 agreement with the float head not measured (no held-out text: cannot " \
        "download" in rep.summary()
    assert PocketFile(out).json("quant")["calibration"]["head"] == head


def test_pack_with_a_bit_budget_meets_it_and_records_its_calibration(tiny, tmp_path):
    out = tmp_path / "b.pocket"
    rep = pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False)
    assert rep.quant_bits_per_weight <= 4.6
    assert rep.calibration["bits_per_weight"] == 4.6
    assert rep.calibration["set"]["source"] == tiny["text"].name
    assert "calibrated" in {t.how for t in rep.tensors}
    listing = rep.choices()
    assert all(t.name in listing for t in rep.tensors if t.stored != "f32")
    pf = PocketFile(out)
    assert pf.json("quant")["calibration"]["method"] == "gptq"
    shown = _cli("inspect", out).stdout
    assert "calibration: gptq on" in shown and "bit budget 4.6" in shown
    again = tmp_path / "c.pocket"
    pack(tiny["src"], again, calib=tiny["text"], bits_per_weight=4.6, progress=False)
    a, b = PocketFile(out).weights(), PocketFile(again).weights()
    for name, w in a.items():  # same inputs, same bytes
        x, y = w, b[name]
        if hasattr(x, "qweight"):
            assert x.qweight.tobytes() == y.qweight.tobytes() and \
                x.scales.tobytes() == y.scales.tobytes(), name
        else:
            assert x.tobytes() == y.tobytes(), name


def test_calibrated_pack_is_closer_to_float_than_rounding(tiny, tmp_path):
    src = open_source(tiny["src"])
    floats = {n: t.to_float() for n, t in src.tensors.items()}
    ids = np.asarray(src.tokenizer.encode("The parcel left the depot; 包裹明天送达。")[:48])
    rt0 = Runtime(src.config, floats)
    ref = rt0.forward(ids, rt0.new_cache(64), all_logits=True)

    def err(path):
        rt = Runtime(src.config, PocketFile(path).weights())
        lg = rt.forward(ids, rt.new_cache(64), all_logits=True)
        return float(np.linalg.norm(lg - ref))

    pack(tiny["src"], tmp_path / "rtn.pocket", progress=False)
    pack(tiny["src"], tmp_path / "cal.pocket", calib=tiny["text"], progress=False)
    assert err(tmp_path / "cal.pocket") < err(tmp_path / "rtn.pocket")


def test_implicit_minimums_survive_the_engine_releasing_file_pages(tmp_path):
    src = tmp_path / "q.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=6, weight_type="Q4_0")
    out = tmp_path / "q.pocket"
    pack(src, out, progress=False)
    pf = PocketFile(out)
    layouts = pf.json("quant")["tensors"]
    assert any(v.get("zero_point") == 8 for v in layouts.values())
    assert not any(n.endswith(".mins") for n in pf.infos
                   if layouts.get(n[:-5], {}).get("zero_point"))
    import pocketlm

    model = pocketlm.load(out)
    before = {n: w.mins.copy() for n, w in model.runtime.w.items() if getattr(w, "zero_point", 0)}
    assert before
    model.logits([1, 2, 3, 4])
    for n, m in before.items():
        assert np.array_equal(model.runtime.w[n].mins, m), n


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pocketlm.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags,message", [
    (["--bits-per-weight", "3"], "bits-per-weight"),
    (["--bits-per-weight", "9"], "bits-per-weight"),
    (["--calib", "EMPTY"], "empty"),
    (["--calib", "MISSING"], "no such file"),
    (["--quant-method", "gptq"], "needs calibration"),
])
def test_cli_refuses_bad_calibration_flags_and_writes_nothing(tiny, tmp_path, flags, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    flags = [str(empty) if f == "EMPTY" else str(tmp_path / "nope.txt") if f == "MISSING"
             else f for f in flags]
    out = tmp_path / "x.pocket"
    r = _cli("pack", tiny["src"], "-o", out, *flags)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not out.exists() and not list(tmp_path.glob("x.pocket*"))


def test_registry_default_packs_take_their_bit_budget(tmp_path):
    from pocketlm import registry
    from pocketlm.packcache import packed_cache_path

    # every registry model's default is the exact import, no larger than its GGUF
    assert all(e.pack_bits is None for e in registry.REGISTRY.values())
    assert registry.default_pack_bits(tmp_path / "gemma3-270m.gguf") is None  # not the pulled file
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    budgeted = packed_cache_path(src, 32, 8, None, bits_per_weight="source")
    plain = packed_cache_path(src, 32, 8, None)
    assert "-bsource-" in budgeted.name and budgeted != plain


@pytest.mark.parametrize("bpw", [5.2, 4.6])
def test_budgeted_pack_greedy_tokens_agree_native_and_numpy(tiny, tmp_path, monkeypatch, bpw):
    # the per-tensor layouts of a bit budget (mixed kinds, group sizes, implicit minimums,
    # coded scales) run the same in the native engine as in the numpy reference
    out = tmp_path / "g.pocket"
    pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=bpw, progress=False)
    layouts = PocketFile(out).json("quant")["tensors"].values()
    assert len({(v["kind"], v["group_size"], v.get("zero_point"), v.get("encoding"))
                for v in layouts}) >= 2
    if bpw == 4.6:
        assert "int4_c8" in set(PocketFile(out).encodings().values())
    monkeypatch.setenv("POCKET_ACT", "f32")
    src = open_source(tiny["src"])
    prompt = src.tokenizer.encode("The parcel left the depot")
    runs = []
    for engine in ("native", "numpy"):
        rt = Runtime(src.config, PocketFile(out).weights(), engine=engine)
        cache = rt.new_cache(64)
        ids, nxt = list(prompt), None
        logits = rt.forward(np.asarray(ids), cache)
        for _ in range(24):
            nxt = int(np.argmax(logits))
            ids.append(nxt)
            logits = rt.forward(np.asarray([nxt]), cache)
        runs.append(ids)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_coded_scales_kept_in_the_tiles_give_the_same_logits(tiny, tmp_path, monkeypatch, act,
                                                              level):
    # INT4 weights with coded scales keep their codes in the engine's tiles (fewer bytes read
    # per token) and compute exactly what float16-scale tiles compute: prefill, decode and a
    # verification, bit for bit, at every x86 kernel level (neon: tests/test_arm_build.py)
    from pocketlm.runtime.kernels import native as native_kernels

    if not native_kernels.engine_available():
        pytest.skip("the native engine is not built")
    if level not in native_kernels.cpu_features()["levels"]:
        pytest.skip(f"this CPU has no {level} level")
    out = tmp_path / "c.pocket"
    pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False)
    assert "int4_c8" in set(PocketFile(out).encodings().values())
    monkeypatch.setenv("POCKET_ACT", act)
    monkeypatch.setenv("POCKET_CPU_LEVEL", level)
    src = open_source(tiny["src"])
    prompt = np.asarray(src.tokenizer.encode("The parcel left the depot, 包裹今早"))
    runs, tiles = [], []
    for coded in ("1", "0"):
        monkeypatch.setenv("POCKET_COMPACT_TILES", coded)
        rt = Runtime(src.config, PocketFile(out).weights(), engine="native")
        assert rt.native.level == level
        tiles.append(rt.native.model.tile_bytes)
        cache = rt.new_cache(64)
        rows = [rt.forward(prompt, cache, all_logits=True)]
        nxt = int(np.argmax(rows[0][-1]))
        rows.append(rt.forward(np.asarray([nxt]), cache)[None])
        rows.append(rt.verify(np.asarray([nxt, 5, 9, 11]), cache))
        runs.append(np.concatenate(rows))
    np.testing.assert_array_equal(runs[0], runs[1])
    (on_total, on_coded), (off_total, off_coded) = tiles  # (bytes, of which coded) per run
    assert off_coded == 0
    if rt.native.amx:  # the AMX prefill reads float16 steps
        assert on_total == off_total and on_coded == 0
    else:
        assert 0 < on_coded and on_total <= off_total  # equal at 64 columns: 2 groups


def test_coded_scales_that_do_not_give_the_steps_are_refused(tiny, tmp_path):
    # the engine checks every group's codes against the float16 steps it is handed
    from pocketlm.quant import EncodedQuantTensor
    from pocketlm.runtime.kernels import native as native_kernels

    if not native_kernels.engine_available():
        pytest.skip("the native engine is not built")
    out = tmp_path / "c.pocket"
    pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False)
    src = open_source(tiny["src"])
    weights = PocketFile(out).weights()
    probe = native_kernels.NativeEngine(src.config, weights, act="q8", compact_tiles=True, amx=False)
    assert probe.model.tile_bytes[1] > 0
    name = next(n for n, w in weights.items() if getattr(w, "encoding", None) == "int4_c8")
    w = weights[name]
    bad = EncodedQuantTensor("int4_c8", w.shape, dict(w.stored, **{".sc": w.stored[".sc"] ^ 1}))
    bad._decoded = w._arrays()  # the steps of the true codes beside codes off by one
    weights[name] = bad
    with pytest.raises(Exception, match="contradict their stored codes"):
        native_kernels.NativeEngine(src.config, weights, act="q8", compact_tiles=True, amx=False)
    # without coded tiles the codes are not used, and the model loads
    native_kernels.NativeEngine(src.config, weights, act="q8", compact_tiles=False, amx=False)


def _poisoned(path, name, value):
    """The source at ``path`` with one value of tensor ``name`` replaced by ``value``."""
    model = open_source(path)
    st = model.tensors[name]
    clean = st.to_float

    def to_float():
        w = clean().copy()
        w.reshape(-1)[3] = value
        return w

    st.to_float = to_float
    return model


@pytest.mark.parametrize("value,name", [
    (np.nan, "layers.0.attn.w_q.weight"), (np.inf, "layers.1.mlp_norm.weight"),
    (1e6, "layers.0.attn.w_q.weight"),  # finite, but its INT4 minimum overflows float16
])
@pytest.mark.parametrize("mode", ["plain", "calib", "budget"])
def test_non_finite_or_overflowing_weights_are_refused_by_name(tiny, tmp_path, value, name,
                                                               mode):
    # they packed into NaN scales (or a NaN norm): a file that computes NaN for every token
    kwargs = {"plain": {}, "calib": {"calib": tiny["text"]},
              "budget": {"calib": tiny["text"], "bits_per_weight": 4.6}}[mode]
    out = tmp_path / "n.pocket"
    if mode == "budget" and value == 1e6:  # a budget chooses a layout whose steps hold it
        report = pack(_poisoned(tiny["src"], name, value), out, progress=False, **kwargs)
        assert next(t for t in report.tensors if t.name == name).stored != "int4"
        from pocketlm.api import load_pocket

        m = load_pocket(out)
        assert np.isfinite(m.logits(m.tokenize("The parcel left the depot"))).all()
        return
    with pytest.raises(PocketError, match=name.replace(".", r"\.")):
        pack(_poisoned(tiny["src"], name, value), out, progress=False, **kwargs)
    assert not out.exists() and not list(tmp_path.glob("n.pocket*"))


def test_corrupt_source_block_scales_are_refused(tmp_path):
    # a lossless import copies the source's scales: a NaN one is a corrupt file, not a model
    src = tmp_path / "q.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=6, weight_type="Q4_0")
    model = open_source(src)
    st = model.tensors["layers.0.mlp.w_up.weight"]
    clean = st.to_quant

    def to_quant(bits, gs):
        qt = clean(bits, gs)
        if qt is not None:
            qt.scales = qt.scales.copy()
            qt.scales[0, 0] = np.float16(np.nan)
        return qt

    st.to_quant = to_quant
    with pytest.raises(PocketError, match=r"layers\.0\.mlp\.w_up\.weight.*NaN or infinite"):
        pack(model, tmp_path / "q.pocket", progress=False)
    assert not (tmp_path / "q.pocket").exists()


def test_a_calibration_file_named_default_is_the_apps_text(tiny, tmp_path, monkeypatch):
    # str(Path("./default")) is "default": the app's file was swapped for the built-in set
    import hashlib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_bytes(tiny["text"].read_bytes())

    def builtin(*a, **k):
        raise AssertionError("the built-in calibration set was used")

    monkeypatch.setattr(calibdata, "default_set", builtin)
    rep = pack(tiny["src"], tmp_path / "d.pocket", calib="./default", progress=False)
    assert rep.calibration["set"]["sha256"] == hashlib.sha256(
        tiny["text"].read_bytes()).hexdigest()


def test_interrupted_statistics_save_leaves_no_temp_file(tiny, tmp_path, monkeypatch):
    # Ctrl-C (or SIGTERM's SystemExit) while the second moments are written: the cut-off
    # temp file (gigabytes for the larger models) must not stay in the cache folder
    src = open_source(tiny["src"])
    cs = calibdata.file_set(tiny["text"], src.tokenizer, n_sequences=2, seq_len=64)
    st = calibrate.Stats()
    st.add("head_in", np.ones((4, 8), np.float32))

    def interrupted(f, **arrays):
        f.write(b"PK\x03\x04 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        calibrate.save_stats(src, cs, st)
    assert not list((tmp_path / "calib").iterdir())


def test_statistics_save_killed_outright_leaves_nothing_after_the_next_save(tmp_path,
                                                                           monkeypatch):
    # SIGKILL (the OOM killer) while the second moments are written: no cleanup runs, and
    # the cut-off temp file must still not stay in the cache folder for good
    path = tmp_path / "calib" / "stats.npz"
    script = f"""
import os, signal
import numpy as np
from pathlib import Path
from pocketlm import calibrate

def killed(f, **arrays):
    f.write(b"PK\\x03\\x04 half")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

calibrate._stats_path = lambda model, cset: Path({str(path)!r})
np.savez = killed
st = calibrate.Stats()
st.add("head_in", np.ones((4, 8), np.float32))
calibrate.save_stats(None, None, st)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert list(path.parent.iterdir()) and not path.exists()  # the cut-off temp file
    monkeypatch.setattr(calibrate, "_stats_path", lambda model, cset: path)
    st = calibrate.Stats()
    st.add("head_in", np.ones((4, 8), np.float32))
    calibrate.save_stats(None, None, st)
    assert [p.name for p in path.parent.iterdir()] == ["stats.npz"]
    assert calibrate.cached_stats(None, None).n == {"head_in": 4}


def test_damaged_statistics_file_is_gathered_again(tiny, tmp_path):
    # a truncated cache file is not a zip at all (BadZipFile): it was a traceback
    src = open_source(tiny["src"])
    cs = calibdata.file_set(tiny["text"], src.tokenizer, n_sequences=2, seq_len=64)
    st = calibrate.Stats()
    st.add("head_in", np.ones((4, 8), np.float32))
    calibrate.save_stats(src, cs, st)
    path = calibrate._stats_path(src, cs)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert calibrate.cached_stats(src, cs) is None


def test_budget_for_widths_that_group_64_does_not_divide(tmp_path):
    # every width an odd multiple of 32: no tensor takes the probe layout (INT4 group 64), no
    # class is weighed, and the budget died on max() of nothing (a traceback)
    src = tmp_path / "w.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=5, weight_type="F32", embed_type="F32",
                              d_model=96, n_heads=3, n_kv_heads=1, head_dim=32, d_ff=160)
    text = tmp_path / "app.txt"
    text.write_text("The parcel left the depot this morning. 包裹今早已离开仓库。 " * 80,
                    encoding="utf-8")
    rep = pack(src, tmp_path / "w.pocket", calib=text, bits_per_weight=5.0, progress=False)
    assert rep.quant_bits_per_weight <= 5.0


def test_reproducible_calibrated_packs_are_the_same_bytes(tiny, tmp_path, monkeypatch):
    # reproducible=True promises the same bytes for the same inputs; the calibration record
    # kept the seconds it took (every call of the clock here is a second later than the last)
    import time

    clock = iter(range(10**6))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    files = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.pocket"
        rep = pack(tiny["src"], out, calib=tiny["text"], reproducible=True, progress=False)
        assert rep.calibration["seconds"] > 0  # the report still says how long it took
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_a_reproducible_pack_does_not_depend_on_how_the_calib_path_is_spelled(
        tiny, tmp_path, monkeypatch):
    # the path was recorded as typed: other bytes for ./app.txt and /abs/app.txt, and the
    # packing machine's folders in the file
    monkeypatch.chdir(tiny["root"])
    a, b = tmp_path / "a.pocket", tmp_path / "b.pocket"
    pack(tiny["src"], a, calib=tiny["text"].resolve(), reproducible=True, progress=False)
    pack(tiny["src"], b, calib=tiny["text"].name, reproducible=True, progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert str(tiny["root"]) not in PocketFile(a).metadata["quant"]


def test_cli_reproducible_packs_are_the_same_bytes(tiny, tmp_path):
    # pack(reproducible=True) had no flag: two CLI packs of the same inputs differed in the
    # packing time and the calibration's duration
    outs = [tmp_path / "a.pocket", tmp_path / "b.pocket"]
    for out in outs:
        r = _cli("pack", tiny["src"], "-o", out, "--calib", tiny["text"], "--reproducible")
        assert r.returncode == 0, r.stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()


# -- the head patch (pocketlm.head_patch) ----------------------------------------------------
def test_patch_ranking_counts_occurrences_and_the_float_heads_top_5():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 32)).astype(np.float32)
    xs = rng.standard_normal((7, 32)).astype(np.float32)
    seqs = [[39, 6, 6, 6], [5, 3], [6]]
    want = np.zeros(40, np.int64)
    for seq in seqs:  # next tokens only: a sequence's first token is no prediction
        for t in seq[1:]:
            want[t] += 1
    for x in xs:  # each state's five best rows of the float head
        for r in np.argsort(-(w @ x))[:5]:
            want[r] += 1
    order = calibrate.patch_ranking(w, xs, seqs, chunk=3)
    np.testing.assert_array_equal(order, np.argsort(-want, kind="stable"))
    assert want[39] == (np.argsort(-(xs @ w.T), axis=1)[:, :5] == 39).sum()


def test_patch_size_is_the_smallest_that_reaches_the_target():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((512, 64)).astype(np.float32)
    xs = rng.standard_normal((300, 64)).astype(np.float32)
    head = quantize(w, 4, 64)
    order = np.argsort(-(xs @ w.T).max(axis=0), kind="stable")  # the states' best rows first
    k, agree = calibrate.choose_patch(w, head, xs, order, (16, 64, 256, 511), target=0.0)
    assert k == 16
    values = [agree[s] for s in (16, 64, 256, 511)]
    assert values == sorted(values) and values[-1] > values[0]
    k, _ = calibrate.choose_patch(w, head, xs, order, (16, 64, 256, 511), target=1.01)
    assert k == 511  # never reached: the largest
    k, _ = calibrate.choose_patch(w, head, xs, order, (16, 64, 256, 511), target=agree[256])
    assert k == min(s for s in (16, 64, 256, 511) if agree[s] >= agree[256])


def test_budgeted_pack_patches_an_int4_head_within_the_budget(tiny, tmp_path, monkeypatch):
    from pocketlm.head_patch import PATCH, PATCH_IDS, patched_head

    monkeypatch.setattr(calibrate, "PATCH_ROWS", (16, 32, 64, 128))  # the vocabulary is 320
    out = tmp_path / "p.pocket"
    rep = pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False,
               head_patch="auto")
    assert rep.quant_bits_per_weight <= 4.6  # the patch's bytes in the budget
    head = rep.calibration["head"]
    assert head["layout"].startswith("int4")
    patch = head["patch"]
    by_rows = patch["top1_calibration_by_rows"]
    assert set(by_rows) == {"16", "32", "64", "128"} and \
        patch["top1_calibration"] == by_rows[str(patch["rows"])]
    assert "output head patch: " in rep.summary() and "+ patch" in rep.summary()
    assert f"+ patch of {patch['rows']} rows top-1" in _cli("inspect", out).stdout
    pf = PocketFile(out)
    assert pf.format_version == 5
    assert pf.json("quant")["calibration"]["head"]["patch"]["rows"] == patch["rows"]
    w = pf.weights()
    ids = w[PATCH_IDS]
    assert w[PATCH].shape == (patch["rows"], pf.config().d_model) and len(ids) == patch["rows"]
    assert (np.diff(ids) > 0).all()
    src = open_source(tiny["src"])
    fl = src.tensors["embed.weight"].to_float()  # tied: the embedding is the head
    np.testing.assert_array_equal(w[PATCH].dequantize(),
                                  quantize(fl[ids], 8, 32).dequantize())
    # the rows are the ranking's first ones on the calibration set
    cset = calibdata.file_set(tiny["text"], src.tokenizer)
    floats = {n: t.to_float() for n, t in src.tensors.items()}
    xs = calibrate.final_states(src.config, floats, cset.sequences)
    order = calibrate.patch_ranking(fl, xs, cset.sequences)
    assert list(ids) == sorted(order[:len(ids)])
    # its size was chosen on a held-back quarter of the sequences, for rows ranked on the rest
    # (on the states its rows were ranked on, a patch looks better than it is)
    q = calibrate.PATCH_HOLDOUT
    held = [s for i, s in enumerate(cset.sequences) if i % q == q - 1]
    fit = [s for i, s in enumerate(cset.sequences) if i % q != q - 1]
    assert held and fit
    _, agree = calibrate.choose_patch(
        fl, w["embed.weight"], calibrate.final_states(src.config, floats, held),
        calibrate.patch_ranking(fl, calibrate.final_states(src.config, floats, fit), fit),
        (16, 32, 64, 128))
    assert by_rows == {str(k): a for k, a in agree.items()}
    # the held-out agreement is the patched head's
    want = calibrate.head_agreement(src.config, floats, w["embed.weight"], src.tokenizer,
                                    patch=(w[PATCH], ids))
    assert head["top1_vs_float"] == want
    # the runtime computes what the patched head is
    prompt = np.asarray(src.tokenizer.encode("The parcel left the depot"))
    rt = Runtime(src.config, w, engine="numpy")
    got = rt.forward(prompt, rt.new_cache(32))
    plain = {k: v for k, v in w.items() if k not in (PATCH, PATCH_IDS)}
    plain["lm_head.weight"] = patched_head(w["embed.weight"].dequantize(), w[PATCH], ids)
    rt2 = Runtime(src.config, plain, engine="numpy")
    np.testing.assert_allclose(got, rt2.forward(prompt, rt2.new_cache(32)), rtol=0,
                               atol=1e-5 * np.abs(got).max())
    # and the native engine, from the file, the same greedy tokens as the reference (float
    # activations: no int8 rounding near a tie)
    monkeypatch.setenv("POCKET_ACT", "f32")
    runs = []
    for engine in ("native", "numpy"):
        rt = Runtime(src.config, PocketFile(out).weights(), engine=engine)
        cache = rt.new_cache(64)
        ids_run = list(prompt)
        logits = rt.forward(prompt, cache)
        for _ in range(16):
            ids_run.append(int(np.argmax(logits)))
            logits = rt.forward(np.asarray(ids_run[-1:]), cache)
        runs.append(ids_run)
    assert runs[0] == runs[1]


def test_no_patch_without_an_int4_head_or_a_size_below_the_vocabulary(tiny, tmp_path,
                                                                        monkeypatch):
    from pocketlm.head_patch import PATCH

    # the default sizes (1024 rows and up) are all beyond the tiny vocabulary of 320
    rep = pack(tiny["src"], tmp_path / "a.pocket", calib=tiny["text"], bits_per_weight=4.6,
               progress=False, head_patch="auto")
    assert "patch" not in rep.calibration["head"]
    assert PATCH not in PocketFile(tmp_path / "a.pocket").weights()
    assert PocketFile(tmp_path / "a.pocket").format_version == 4
    # a budget whose head is INT8 takes none either
    monkeypatch.setattr(calibrate, "PATCH_ROWS", (16, 32))
    rep = pack(tiny["src"], tmp_path / "c.pocket", calib=tiny["text"], bits_per_weight=8.0,
               progress=False, head_patch="auto")
    assert rep.calibration["head"]["layout"].startswith("int8")
    assert "patch" not in rep.calibration["head"]


def test_head_patch_option_off_or_a_number_of_rows(tiny, tmp_path, monkeypatch):
    from pocketlm.head_patch import PATCH

    monkeypatch.setattr(calibrate, "PATCH_ROWS", (16, 32, 64, 128))  # the vocabulary is 320
    for name, option in (("default", {}), ("off", {"head_patch": "off"})):  # off by default
        out = tmp_path / f"{name}.pocket"
        rep = pack(tiny["src"], out, calib=tiny["text"], bits_per_weight=4.6, progress=False,
                   **option)
        assert rep.calibration["head"]["layout"].startswith("int4")
        assert "patch" not in rep.calibration["head"] and "head_patch" not in rep.calibration
        assert PATCH not in PocketFile(out).weights()
    # a size outside the rule's sizes: that size, measured on the held-back quarter
    rep = pack(tiny["src"], tmp_path / "n.pocket", calib=tiny["text"], bits_per_weight=4.6,
               progress=False, head_patch="12")
    patch = rep.calibration["head"]["patch"]
    assert patch["rows"] == 12 and set(patch["top1_calibration_by_rows"]) == {"12"}
    assert PocketFile(tmp_path / "n.pocket").weights()[PATCH].shape[0] == 12
    assert rep.quant_bits_per_weight <= 4.6


@pytest.mark.parametrize("kwargs, message", [
    ({"bits_per_weight": 4.6, "head_patch": "many"}, "--head-patch must be 'auto', 'off' or"),
    ({"bits_per_weight": 4.6, "head_patch": -3}, "--head-patch must be 'auto', 'off' or"),
    ({"head_patch": 16}, "--head-patch needs --bits-per-weight"),
    ({"head_patch": "auto"}, "--head-patch needs --bits-per-weight"),
    ({"bits_per_weight": 4.6, "head_patch": 320}, "the head has only 320 rows"),
    ({"bits_per_weight": 8.0, "head_patch": 16}, "a patch applies to a requantized INT4 head"),
    ({"bits_per_weight": 4.6, "head_patch": 64}, "do not fit the bit budget"),
])
def test_bad_head_patch_options_are_refused_and_leave_no_file(tiny, tmp_path, kwargs, message):
    (tmp_path / "out").mkdir()
    with pytest.raises(PocketError, match=re.escape(message)):
        pack(tiny["src"], tmp_path / "out" / "x.pocket", calib=tiny["text"], progress=False,
             **kwargs)
    assert list((tmp_path / "out").iterdir()) == []


def test_head_patch_flag_in_the_cli(tiny, tmp_path):
    r = _cli("pack", tiny["src"], "-o", tmp_path / "x.pocket", "--head-patch", "auto")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "--head-patch needs --bits-per-weight" in r.stderr
    assert not (tmp_path / "x.pocket").exists()


def test_an_engine_without_logits_observes_what_the_full_engine_does(tiny):
    from pocketlm.runtime.engine import KVCache, NumpyEngine

    src = open_source(tiny["src"])
    w = {n: t.to_float() for n, t in src.tensors.items()}
    ids = np.asarray(src.tokenizer.encode("The parcel left the depot"), np.int64)
    seen = []
    for logits in (True, False):
        eng = NumpyEngine(src.config, w, logits=logits)
        got: dict[str, np.ndarray] = {}
        eng.observe = got.__setitem__
        out = eng.forward(ids, KVCache(src.config, len(ids)), True)
        assert out.shape == ((len(ids), src.config.vocab_size) if logits else (len(ids), 0))
        seen.append(got)
    assert seen[0].keys() == seen[1].keys()
    for site in seen[0]:
        np.testing.assert_array_equal(seen[0][site], seen[1][site])


def _wider_gguf(path, arch, weight_type, **kw):
    """A tiny model wide enough (256, two layers) that its quantized tensors outweigh the
    deploy file's fixed overhead."""
    tiny_gguf.write_tiny_gguf(path, arch, seed=4, weight_type=weight_type, d_model=256,
                              head_dim=64, n_heads=4, n_kv_heads=2, d_ff=1024, n_layers=2, **kw)
    return path


def test_the_default_pack_is_no_larger_than_its_gguf(tmp_path):
    """The exact import holds an untied Q6_K embedding (looked up in place, not decoded) in
    INT8, 8.5 bits a weight against 6.5625 (as it holds Q5_K in INT8 and Q3_K in INT4), so such
    a GGUF packed larger than itself; the default is then the bit budget of its own size."""
    src = tmp_path / "q6.gguf"  # the embedding a good share of the model: 512 wide, one layer
    tiny_gguf.write_tiny_gguf(src, "qwen2", seed=4, weight_type="Q6_K", d_model=512,
                              head_dim=128, n_heads=4, n_kv_heads=1, d_ff=256, n_layers=1)
    report = pack(src, tmp_path / "q6.pocket", progress=False)
    size = src.stat().st_size
    assert report.file_bytes <= size == report.larger_exact_import[1]
    assert report.larger_exact_import[0] > size * 1.01
    assert (tmp_path / "q6.pocket").stat().st_size == report.file_bytes
    assert report.calibration["bits_per_weight"] == "source"
    assert "is larger than the source GGUF" in report.summary()
    # a GGUF whose exact import is as small as its own blocks (Q4_0 at 4.5 bits, lossless)
    # keeps it, a few kilobytes of header over the GGUF, without calibrating
    q4 = _wider_gguf(tmp_path / "q4.gguf", "llama", "Q4_0")
    report = pack(q4, tmp_path / "q4.pocket", progress=False)
    assert report.larger_exact_import is None and report.calibration is None
    assert all(t.how in ("lossless", "float") for t in report.tensors)


def test_a_default_pack_stopped_while_packing_again_leaves_no_output(tmp_path, monkeypatch):
    """The exact import was written to OUT before the second (budgeted) pack: a Ctrl-C then
    left a whole deploy file behind a command that failed. With --group-size given, the exact
    import is what was asked for (the budgeted pack ignored the flag and recorded it)."""
    import pocketlm.pack as pack_module

    src = tmp_path / "q6.gguf"
    tiny_gguf.write_tiny_gguf(src, "qwen2", seed=4, weight_type="Q6_K", d_model=512,
                              head_dim=128, n_heads=4, n_kv_heads=1, d_ff=256, n_layers=1)
    real, calls = pack_module._pack, []

    def stopped_on_the_second(*args, **kw):
        calls.append(kw.get("bits_per_weight"))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(pack_module, "_pack", stopped_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        pack(src, tmp_path / "q6.pocket", progress=False)
    assert calls == [None, "source"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q6.gguf"]  # no output, no temp
    monkeypatch.setattr(pack_module, "_pack", real)
    report = pack(src, tmp_path / "g64.pocket", group_size=64, progress=False)
    assert report.calibration is None and report.larger_exact_import is None
    assert report.path == tmp_path / "g64.pocket" and report.path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g64.pocket", "q6.gguf"]


def test_weights_beyond_float16_are_one_clear_error_or_a_layout_that_holds_them(tmp_path):
    """A weight of 1e6 (finite, beyond float16) printed numpy's overflow warnings before the
    error, and a budget of 8 bits, where INT8 holds it, was refused because one of the
    candidate layouts could not."""
    import warnings

    import tiny_hf
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "hf"
    tiny_hf.write_tiny_hf(src, "llama", seed=2)
    tensors = load_file(src / "model.safetensors")
    name = next(n for n in tensors if "down_proj" in n)
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = 1e6
    save_file(tensors, src / "model.safetensors")
    text = tmp_path / "app.txt"
    text.write_text("The parcel left the depot this morning; it arrives tomorrow. " * 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning fails the test
        for kw in ({}, {"calib": text}):
            with pytest.raises(UnsupportedError, match="exceed what INT4's float16"):
                pack(src, tmp_path / "a.pocket", progress=False, **kw)
        report = pack(src, tmp_path / "b.pocket", bits_per_weight=8, calib=text,
                      progress=False)
    assert not (tmp_path / "a.pocket").exists()
    down = next(t for t in report.tensors if "w_down" in t.name and ".0." in t.name)
    assert down.stored in ("int5", "int8")  # a layout whose steps hold 1e6
    assert (tmp_path / "b.pocket").stat().st_size == report.file_bytes


@pytest.mark.parametrize("kw, flags", [
    (dict(group_size=64), "--group-size"), (dict(embed_bits=4), "--embed-bits"),
    (dict(keep_precision=True), "--keep-precision"), (dict(keep_precision=False), "--all-int4"),
])
def test_layouts_by_hand_with_a_bit_budget_are_refused(tiny, tmp_path, kw, flags):
    # they were ignored (every tensor as without them) and recorded as applied
    with pytest.raises(UnsupportedError, match=f"{flags} choose layouts by hand"):
        pack(tiny["src"], tmp_path / "b.pocket", bits_per_weight=5, progress=False, **kw)
    assert not (tmp_path / "b.pocket").exists()


def test_a_budget_below_the_smallest_layouts_is_refused_before_the_statistics(tiny, tmp_path,
                                                                              monkeypatch):
    # the tiny model's widths (64, 96) take no group 128: INT4 needs at least 4.5 bits here,
    # which allocate() found only after the statistics (minutes on a real model)
    def never(*args, **kwargs):
        raise AssertionError("statistics gathered for a budget that cannot be met")

    monkeypatch.setattr(calibrate, "gather", never)
    monkeypatch.setattr(calibrate, "cached_stats", never)
    with pytest.raises(UnsupportedError, match=r"^--bits-per-weight 4\.3: m\.gguf cannot be "
                       r"packed that small: its smallest layouts take 4\.\d\d bits per weight"):
        pack(tiny["src"], tmp_path / "x.pocket", calib=tiny["text"], bits_per_weight=4.3,
             progress=False)
    assert not list(tmp_path.glob("x.pocket*"))
