"""GGUF import against tiny GGUF files written the way llama.cpp's converter writes them.

Every check compares with values computed independently of the importer: the weights the
file holds (dequantized with ``gguf.quants``, in pocketlm's row order) and the PyTorch
reference decoder run on them.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import tiny_gguf
import torch_ref

from pocketlm.api import from_source, load_pocket
from pocketlm.errors import FormatError, PocketError, UnsupportedError
from pocketlm.formats import open_source
from pocketlm.formats.pocketfile import PocketFile
from pocketlm.pack import QUANT_SUFFIXES, choose_bits, pack
from pocketlm.packcache import packed_cache_path
from pocketlm.quant import QuantTensor

IDS = [5, 17, 3, 250, 11, 9, 42, 7, 101, 64, 2, 300, 18]  # longer than gemma3's window (5)

# (arch, weight type, config overrides)
CASES = [
    ("llama", "Q4_0", {}),
    ("llama", "Q4_1", {}),
    ("llama", "F32", {}),
    ("llama", "Q4_0", {"qkv_bias": True}),  # q/k biases are permuted by the converter too
    ("qwen2", "Q4_1", {}),
    ("gemma3", "Q4_0", {}),
]


# an import held to a float reference at float32 rounding: float activations (conftest)
FLOAT_ACTIVATIONS = True


def _case_id(case) -> str:
    arch, wt, over = case
    return f"{arch}-{wt}" + "".join(f"-{k}" for k in over)


def _tol(ref: np.ndarray) -> float:
    return 2e-4 * float(np.abs(ref).max())


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def tiny(request, tmp_path_factory):
    arch, weight_type, overrides = request.param
    path = tmp_path_factory.mktemp("gguf") / f"{_case_id(request.param)}.gguf"
    config, state = tiny_gguf.write_tiny_gguf(path, arch, seed=1, weight_type=weight_type,
                                              **overrides)
    return path, config, state, weight_type


def test_config_is_read_from_the_metadata(tiny):
    path, config, _, _ = tiny
    source = open_source(path)
    assert source.config == config
    if config.arch == "gemma3":
        # every 6th layer global, as llama.cpp reads Gemma 3 files
        assert source.config.layer_types == ["sliding"] * 5 + ["global"]
        assert source.config.sliding_window == 5
    assert source.chat_template == tiny_gguf.CHATML_TEMPLATE
    assert source.provenance["source_format"] == "gguf"


def test_float_weights_equal_what_the_file_holds(tiny):
    path, config, state, weight_type = tiny
    source = open_source(path)
    assert set(source.tensors) == set(state)
    for name, tensor in source.tensors.items():
        values = tensor.to_float()
        assert values.dtype == np.float32 and values.shape == state[name].shape, name
        np.testing.assert_array_equal(values, state[name], err_msg=name)
        if values.ndim == 2 and name not in ("embed.weight", "lm_head.weight"):
            assert tensor.dtype == weight_type


def test_llama_rows_are_unpermuted():
    """The file's q/k rows really are permuted: reading them as stored would be wrong."""
    config = torch_ref.tiny_config("llama")
    w = np.arange(config.kv_dim * 3, dtype=np.float32).reshape(config.kv_dim, 3)
    permuted = tiny_gguf.permute_rows(w, config.n_kv_heads)
    assert not np.array_equal(permuted, w)
    from pocketlm.formats.gguf import unpermute_rows

    np.testing.assert_array_equal(unpermute_rows(permuted, config.n_kv_heads), w)
    bias = np.arange(config.q_dim, dtype=np.float32)
    np.testing.assert_array_equal(
        unpermute_rows(tiny_gguf.permute_rows(bias, config.n_heads), config.n_heads), bias)


def test_float_logits_match_torch_reference(tiny):
    path, config, state, _ = tiny
    model = from_source(open_source(path))
    ours = model.logits(IDS)
    ref = torch_ref.TorchRefModel(config, state).forward(IDS)
    assert ours.shape == (len(IDS), config.vocab_size) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=0, atol=_tol(ref))
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_tokenizer_comes_from_the_file(tiny):
    path, config, _, _ = tiny
    tok = open_source(path).tokenizer
    assert tok.vocab_size == config.vocab_size
    assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>")
    text = "hello world, the cat sat on them"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges fire
    special = tok.encode("<|im_start|>user")
    assert special[0] == tok.token_to_id("<|im_start|>")


# -- packing ---------------------------------------------------------------------------------
def _assert_lossless(report, config, stored, weight_type):
    """Every linear weight imported as `stored` without loss, the Q8_0 embedding / head into
    INT8, nothing requantized; returns the linear weights' reports."""
    linear = [t for t in report.tensors if t.name.endswith(QUANT_SUFFIXES)]
    assert len(linear) == 7 * config.n_layers
    for t in linear:
        assert (t.how, t.stored, t.source_dtype) == ("lossless", stored, weight_type), t
        assert t.rel_error == 0.0, t
    for t in report.tensors:
        if t.name in ("embed.weight", "lm_head.weight"):  # Q8_0 in the file
            assert (t.how, t.stored) == ("lossless", "int8")
        assert t.how != "requantized", t
    return linear


@pytest.mark.parametrize("arch,weight_type", [("llama", "Q4_0"), ("llama", "Q4_1"),
                                              ("qwen2", "Q4_0"), ("gemma3", "Q4_1")])
def test_pack_of_4bit_gguf_is_lossless(tmp_path, arch, weight_type):
    src = tmp_path / "m.gguf"
    config, state = tiny_gguf.write_tiny_gguf(src, arch, seed=2, weight_type=weight_type)
    report = pack(src, tmp_path / "m.pocket", progress=False)
    _assert_lossless(report, config, "int4", weight_type)

    packed = load_pocket(tmp_path / "m.pocket").logits(IDS)
    floats = from_source(open_source(src)).logits(IDS)
    np.testing.assert_allclose(packed, floats, rtol=0, atol=_tol(floats))
    ref = torch_ref.TorchRefModel(config, state).forward(IDS)
    np.testing.assert_allclose(packed, ref, rtol=0, atol=_tol(ref))


@pytest.mark.parametrize("arch,weight_type,keep", [("llama", "Q8_0", False),
                                                   ("qwen2", "F32", None),
                                                   ("gemma3", "Q8_0", False)])
def test_pack_of_8bit_or_float_gguf_requantizes(tmp_path, arch, weight_type, keep):
    """--all-int4 requantizes Q8_0 weights to INT4; the default does so for float ones."""
    from pocketlm.quant import QuantTensor

    src = tmp_path / "m.gguf"
    config, state = tiny_gguf.write_tiny_gguf(src, arch, seed=3, weight_type=weight_type)
    report = pack(src, tmp_path / "m.pocket", keep_precision=keep, progress=False)
    for t in report.tensors:
        if t.name.endswith(QUANT_SUFFIXES):
            assert (t.how, t.stored) == ("requantized", "int4"), t
            assert 0 < t.rel_error < 0.12, t  # INT4 on Gaussian weights: about 0.07
        elif t.name in ("embed.weight", "lm_head.weight"):
            assert t.stored == "int8"
            assert t.how == ("lossless" if weight_type == "Q8_0" else "requantized")
            assert t.rel_error < 0.01, t

    model = load_pocket(tmp_path / "m.pocket")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab_size, 48)]
    packed = model.logits(ids)
    # exactly the float model at the packed weights ...
    deq = {n: w.dequantize() if isinstance(w, QuantTensor) else np.asarray(w)
           for n, w in model.runtime.w.items()}
    ref_q = torch_ref.TorchRefModel(config, deq).forward(ids)
    np.testing.assert_allclose(packed, ref_q, rtol=0, atol=_tol(ref_q))
    # ... and close to the source model (random tiny models have flat logits, so INT4 noise
    # flips some near-ties; a real model agrees far more often)
    ref = torch_ref.TorchRefModel(config, state).forward(ids)
    top1 = float((packed.argmax(-1) == ref.argmax(-1)).mean())
    assert top1 >= 0.5, top1
    c_ours = packed - packed.mean(-1, keepdims=True)
    c_ref = ref - ref.mean(-1, keepdims=True)
    assert np.linalg.norm(c_ours - c_ref) / np.linalg.norm(c_ref) < 0.5


@pytest.mark.parametrize("arch,weight_type", [("llama", "Q5_0"), ("qwen2", "Q5_1"),
                                              ("gemma3", "Q5_0")])
def test_keep_precision_pack_of_5bit_gguf_is_lossless_int5(tmp_path, arch, weight_type):
    src = tmp_path / "m.gguf"
    config, state = tiny_gguf.write_tiny_gguf(src, arch, seed=4, weight_type=weight_type)
    report = pack(src, tmp_path / "m.pocket", keep_precision=True, progress=False)
    linear = _assert_lossless(report, config, "int5", weight_type)

    pf = PocketFile(tmp_path / "m.pocket")
    quant = pf.json("quant")
    assert quant["scheme"] == "int4-g32+int5" and quant["keep_precision"] is True
    weights = pf.weights()
    source = open_source(src)
    for t in linear:
        w = weights[t.name]
        assert isinstance(w, QuantTensor) and w.kind == "int5" and w.group_size == 32
        # 5 bits + float16 scale and minimum per 32; Q5_0's minimum is -16 * scale, so the
        # file stores no minimums (zero point 16)
        assert w.bits_per_weight == (5.5 if weight_type == "Q5_0" else 6.0)
        assert w.zero_point == (16 if weight_type == "Q5_0" else None)
        assert np.array_equal(w.dequantize(), source.tensors[t.name].to_float()), t.name

    model = load_pocket(tmp_path / "m.pocket")
    packed = model.logits(IDS)
    floats = from_source(source).logits(IDS)
    np.testing.assert_allclose(packed, floats, rtol=0, atol=_tol(floats))
    ref = torch_ref.TorchRefModel(config, state).forward(IDS)
    np.testing.assert_allclose(packed, ref, rtol=0, atol=_tol(ref))


@pytest.mark.parametrize("weight_type,stored", [("Q5_0", "int5"), ("Q8_0", "int8")])
def test_default_pack_keeps_the_gguf_precision(tmp_path, weight_type, stored):
    """By default a GGUF runs as its publisher quantized it: Q5_0 exact in INT5, Q8_0 exact in
    INT8 (the file records the policy as "source")."""
    src = tmp_path / "m.gguf"
    config, _ = tiny_gguf.write_tiny_gguf(src, "llama", seed=5, weight_type=weight_type)
    report = pack(src, tmp_path / "m.pocket", progress=False)
    _assert_lossless(report, config, stored, weight_type)
    quant = PocketFile(tmp_path / "m.pocket").json("quant")
    assert quant["scheme"] == f"int4-g32+{stored}" and quant["keep_precision"] == "source"
    packed = load_pocket(tmp_path / "m.pocket").logits(IDS)
    floats = from_source(open_source(src)).logits(IDS)
    np.testing.assert_allclose(packed, floats, rtol=0, atol=_tol(floats))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied head (llama), untied (qwen2)
def test_default_pack_keeps_a_5bit_embedding_in_int5(tmp_path, arch):
    src = tmp_path / "m.gguf"
    config, _ = tiny_gguf.write_tiny_gguf(src, arch, seed=7, weight_type="Q4_0",
                                          embed_type="Q5_0")
    report = pack(src, tmp_path / "m.pocket", progress=False)
    embeds = [t for t in report.tensors if t.name in ("embed.weight", "lm_head.weight")]
    assert embeds and all((t.how, t.stored) == ("lossless", "int5") for t in embeds), embeds
    packed = load_pocket(tmp_path / "m.pocket").logits(IDS)
    floats = from_source(open_source(src)).logits(IDS)
    np.testing.assert_allclose(packed, floats, rtol=0, atol=_tol(floats))
    strict = pack(src, tmp_path / "s.pocket", keep_precision=False, progress=False)
    assert {t.stored for t in strict.tensors if t.name in ("embed.weight", "lm_head.weight")} \
        == {"int8"}


# K-quant blocks hold 256 values: every input width a multiple of it
K_SHAPES = {"d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64}


@pytest.mark.parametrize("arch,weight_type", [("llama", "Q4_K"), ("qwen2", "Q6_K"),
                                              ("gemma3", "Q6_K"), ("qwen2", "Q4_K")])
def test_k_quant_tensors_stay_in_their_blocks(tmp_path, monkeypatch, arch, weight_type):
    """Q4_K / Q6_K tensors are stored as the GGUF's own blocks (4.5 / 6.5625 bits a weight
    instead of 5.0 / 8.5) and load as exactly the layouts the pack computes with: the same
    weights and the same logits as a pack that stores those layouts."""
    import pocketlm.pack as pack_mod

    src = tmp_path / "m.gguf"
    config, state = tiny_gguf.write_tiny_gguf(src, arch, seed=11, weight_type=weight_type,
                                              **K_SHAPES)
    # the exact import itself (a qwen2 file's untied Q6_K embedding, 8.5 bits in INT8, makes
    # it larger than the GGUF, where the default would take the source's bit budget instead)
    monkeypatch.setattr(pack_mod, "_gguf_bytes", lambda source: None)
    report = pack(src, tmp_path / "k.pocket", progress=False)
    monkeypatch.setattr(pack_mod, "encode_as_source", lambda *a: None)
    plain = pack(src, tmp_path / "p.pocket", progress=False)
    monkeypatch.undo()

    enc = {"Q4_K": "q4_k", "Q6_K": "q6_k"}[weight_type]
    bits = {"Q4_K": (4.5, 5.0), "Q6_K": (6.5625, 8.5)}[weight_type]
    linear = [t for t in report.tensors if t.name.endswith(QUANT_SUFFIXES)]
    assert len(linear) == 7 * config.n_layers
    for t in report.tensors:
        if t.stored == "f32" or t.source_dtype != weight_type:
            continue
        untied_embed = t.name == "embed.weight" and not config.tie_embeddings
        assert t.encoding == (None if untied_embed else enc), t  # looked up in place
        assert 8 * t.nbytes / t.n_params == bits[1 if untied_embed else 0], t
    assert report.file_bytes < plain.file_bytes
    pf = PocketFile(tmp_path / "k.pocket")
    assert pf.format_version == 4 and set(pf.encodings().values()) == {enc}
    assert all(t.encoding is None for t in plain.tensors)
    # the same layouts, bit for bit, and the same logits from the engine
    wk, wp = pf.weights(), PocketFile(tmp_path / "p.pocket").weights()
    assert wk.keys() == wp.keys()
    for name, w in wk.items():
        if isinstance(w, QuantTensor):
            for a, b in ((w.qweight, wp[name].qweight), (w.scales, wp[name].scales),
                         (w.mins, wp[name].mins)):
                assert (a is None) == (b is None) and (a is None or np.array_equal(
                    np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))), name
    k_logits = load_pocket(tmp_path / "k.pocket").logits(IDS)
    assert np.array_equal(k_logits, load_pocket(tmp_path / "p.pocket").logits(IDS))
    if weight_type == "Q4_K":  # imported exactly (up to the float16 rounding of d * sc)
        ref = torch_ref.TorchRefModel(config, state).forward(IDS)
        np.testing.assert_allclose(k_logits, ref, rtol=0, atol=0.01 * np.abs(ref).max())
    else:  # Q6_K's values in INT8: each within half a step of its group's grid
        for t in report.tensors:
            if t.encoding == "q6_k":
                w, v = wk[t.name], state[t.name]
                step = np.repeat(w.scales.astype(np.float32), 32, axis=1)
                assert (np.abs(w.dequantize() - v) <= 0.5 * step * (1 + 1e-3) + 1e-30).all()


def test_all_int4_pack_of_5bit_gguf_requantizes(tmp_path):
    src = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=5, weight_type="Q5_0")
    report = pack(src, tmp_path / "m.pocket", keep_precision=False, progress=False)
    for t in report.tensors:
        if t.name.endswith(QUANT_SUFFIXES):
            assert (t.how, t.stored, t.source_dtype) == ("requantized", "int4", "Q5_0"), t
            assert 0 < t.rel_error < 0.12, t
    quant = PocketFile(tmp_path / "m.pocket").json("quant")
    assert quant["scheme"] == "int4-g32" and quant["keep_precision"] is False
    assert {q["kind"] for n, q in quant["tensors"].items() if n.endswith(QUANT_SUFFIXES)} == {
        "int4"}


def test_bad_keep_precision_value(tmp_path):
    src = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=5, weight_type="Q5_0")
    with pytest.raises(UnsupportedError, match="keep_precision must be None, False or True"):
        pack(src, tmp_path / "m.pocket", keep_precision="yes", progress=False)
    assert not (tmp_path / "m.pocket").exists()


def test_keep_precision_at_another_group_size_requantizes_int5(tmp_path):
    """Q5_0 blocks are group-32 grids: at group size 64 they are requantized, still to INT5."""
    src = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(src, "qwen2", seed=6, weight_type="Q5_0", d_ff=128)
    report = pack(src, tmp_path / "m.pocket", group_size=64, keep_precision=True,
                  progress=False)
    for t in report.tensors:
        if t.name.endswith(QUANT_SUFFIXES):
            assert (t.how, t.stored) == ("requantized", "int5"), t
            assert 0 < t.rel_error < 0.06, t  # INT5 on INT5-rounded Gaussian weights
    weights = PocketFile(tmp_path / "m.pocket").weights()
    assert weights["layers.0.mlp.w_up.weight"].group_size == 64


@pytest.mark.parametrize("name", ["layers.0.attn.w_q.weight", "layers.3.mlp.w_down.weight"])
def test_choose_bits_policy(name):
    for keep in (False, True):  # types that import into INT4 stay 4 bits
        for t in ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL"):
            assert choose_bits(name, 8, t, keep) == 4, t
    for t in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32"):
        assert choose_bits(name, 8, t, False) == 4, t  # --all-int4: INT4 throughout
    for keep in (None, True):  # the default and --keep-precision keep quantized types
        assert choose_bits(name, 8, "Q5_0", keep) == 5
        assert choose_bits(name, 8, "Q5_1", keep) == 5
        for t in ("Q5_K", "Q6_K", "Q8_0"):
            assert choose_bits(name, 8, t, keep) == 8, t
    for t in ("F16", "BF16", "F32"):  # float weights: INT4 unless --keep-precision
        assert choose_bits(name, 8, t, None) == 4, t
        assert choose_bits(name, 8, t, True) == 8, t
    # a Q5_0/Q5_1 embedding or head stays INT5 (exact) unless --all-int4 or --embed-bits 4
    assert choose_bits("embed.weight", 8, "Q5_0", False) == 8
    for keep in (None, True):
        assert choose_bits("embed.weight", 8, "Q5_0", keep) == 5
        assert choose_bits("lm_head.weight", 8, "Q5_1", keep) == 5
    # the rest of the embedding, head and float tensors do not depend on keep_precision
    for keep in (False, None, True):
        assert choose_bits("embed.weight", 8, "Q6_K", keep) == 8
        assert choose_bits("lm_head.weight", 4, "Q5_1", keep) == 4
        assert choose_bits("embed.weight", 8, "Q4_K", keep) == 4
        assert choose_bits("layers.0.attn_norm.weight", 8, "F32", keep) is None


def test_keep_precision_cache_is_not_an_older_int8_pack(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    keep = packed_cache_path(src, 32, 8, True)
    plain = packed_cache_path(src, 32, 8, False)
    default = packed_cache_path(src, 32, 8)
    assert len({keep, plain, default}) == 3 and keep.parent == plain.parent == default.parent
    assert "-keep5-" in keep.name and "-int4-" in plain.name and "-keep" not in default.name
    assert "-keep-" not in keep.name  # the name older (INT8) keep-precision packs were cached as


# -- bad input -------------------------------------------------------------------------------
def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", gguf_arch="mamba")
    with pytest.raises(UnsupportedError) as exc:
        open_source(path)
    msg = str(exc.value)
    assert "'mamba'" in msg
    for arch in ("llama", "qwen2", "gemma3"):
        assert arch in msg


def test_tensor_type_the_gguf_library_cannot_dequantize(tmp_path, monkeypatch):
    import gguf.quants

    path = tmp_path / "odd.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", weight_type="Q8_0")

    def refuse(data, qtype):
        raise NotImplementedError(f"dequantization of {qtype.name} is not implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    src = open_source(path)
    with pytest.raises(UnsupportedError, match=r"tensor blk\.0\.attn_q\.weight: GGUF type Q8_0"):
        src.tensors["layers.0.attn.w_q.weight"].to_float()


def test_extra_unmapped_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama",
                              extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 32))})
    with pytest.raises(UnsupportedError, match="blk.0.ffn_gate_exps.weight"):
        open_source(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", drop_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(FormatError, match=r"layers\.1\.mlp\.w_up\.weight"):
        open_source(path)


def test_missing_metadata(tmp_path, monkeypatch):
    import gguf

    real = gguf.GGUFWriter.add_uint32

    def skip_ffn_length(self, key, value):
        if not key.endswith(".feed_forward_length"):
            real(self, key, value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", skip_ffn_length)
    path = tmp_path / "nometa.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama")
    monkeypatch.undo()
    with pytest.raises(FormatError, match="feed_forward_length"):
        open_source(path)


def test_gemma3_without_its_sliding_window_is_refused(tmp_path, monkeypatch):
    """llama.cpp requires gemma3.attention.sliding_window: no default fits every Gemma 3 (the
    270M model slides over 512 tokens, the larger ones over 1024)."""
    path = _write_with_field(monkeypatch, tmp_path / "noswa.gguf", "attention.sliding_window",
                             None, arch="gemma3")
    with pytest.raises(FormatError, match="attention.sliding_window"):
        open_source(path)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.05, 0.004, 10])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama")
    data = path.read_bytes()
    cut = keep if isinstance(keep, int) else int(len(data) * keep)
    path.write_bytes(data[:cut])
    with pytest.raises(FormatError):
        open_source(path)


@pytest.mark.parametrize("model,pre,word", [("bert", None, "'bert'"),
                                            ("gpt2", "no-such-pre", "'no-such-pre'")])
def test_unsupported_tokenizer(tmp_path, model, pre, word):
    path = tmp_path / "tok.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", tokenizer_model=model, tokenizer_pre=pre)
    with pytest.raises(PocketError) as exc:
        open_source(path)
    assert word in str(exc.value)


@contextlib.contextmanager
def _address_space_limit(extra: int):
    """Let this process map at most ``extra`` more bytes meanwhile (Linux): a MemoryError
    instead of the machine's memory when a reader allocates what a header says."""
    import resource

    if not sys.platform.startswith("linux"):
        yield
        return
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _write_with_field(monkeypatch, path, key_suffix, value, vtype=None, sub_type=None,
                      arch="llama"):
    """A tiny GGUF whose metadata key ending in ``key_suffix`` holds ``value`` (of GGUF type
    ``vtype``: a hand-edited or corrupt file); value None drops the key."""
    import gguf

    real = gguf.GGUFWriter.add_key_value

    def substitute(self, key, val, vt, sub=None):
        if not key.endswith(key_suffix):
            return real(self, key, val, vt, sub)
        if value is not None:
            return real(self, key, value, vtype or vt, sub_type)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", substitute)
    tiny_gguf.write_tiny_gguf(path, arch)
    monkeypatch.undo()
    return path


_F32, _F64, _U32, _I32, _U64, _STR, _ARR, _BOOL = (
    "FLOAT32", "FLOAT64", "UINT32", "INT32", "UINT64", "STRING", "ARRAY", "BOOL")


@pytest.mark.parametrize("arch,key,value,vtype,sub", [
    ("llama", "rope.freq_base", float("nan"), _F32, None),
    ("llama", "rope.freq_base", 0.0, _F32, None),
    ("llama", "rope.freq_base", float("-inf"), _F64, None),
    ("llama", "attention.layer_norm_rms_epsilon", -1.0, _F32, None),
    ("llama", "attention.layer_norm_rms_epsilon", "1e-5", _STR, None),
    ("llama", "attention.head_count", 0, _U32, None),  # d_model // 0
    ("llama", "attention.head_count", -4, _I32, None),
    ("llama", "attention.head_count", "four", _STR, None),
    ("llama", "attention.head_count", 4.0, _F32, None),
    ("llama", "embedding_length", [64, 64], _ARR, _U32),
    ("llama", "embedding_length", True, _BOOL, None),
    ("llama", "block_count", 2**64 - 1, _U64, None),
    ("llama", "block_count", 10**6, _U32, None),
    ("llama", "context_length", 2**40, _U64, None),
    ("llama", "feed_forward_length", 0, _U32, None),
    ("llama", "attention.head_count_kv", ["2"], _ARR, _STR),
    ("gemma3", "block_count", 10**8, _U32, None),  # no 10**8-entry layer list is built
    ("gemma3", "embedding_length", -64, _I32, None),  # sqrt(-64)
    ("gemma3", "attention.sliding_window", 0, _U32, None),
    ("gemma3", "attention.sliding_window", "512", _STR, None),
])
def test_malformed_gguf_metadata_is_a_format_error(tmp_path, monkeypatch, arch, key, value,
                                                   vtype, sub):
    import gguf

    vt = gguf.GGUFValueType[vtype]
    st = gguf.GGUFValueType[sub] if sub else None
    path = _write_with_field(monkeypatch, tmp_path / "bad.gguf", key, value, vt, st, arch=arch)
    with _address_space_limit(1 << 30), pytest.raises(FormatError) as info:
        open_source(path)  # a reader that sizes memory from block_count fails here, alone
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    field = {"embedding_length": "d_model", "block_count": "n_layers", "head_count": "n_heads",
             "context_length": "max_context", "feed_forward_length": "d_ff",
             "freq_base": "rope_theta", "epsilon": "norm_eps", "key_length": "head_dim",
             "sliding_window": "sliding_window", "head_count_kv": "n_kv_heads"}
    assert key in msg or any(k in key and v in msg for k, v in field.items()), msg


def test_chat_template_that_is_not_text(tmp_path, monkeypatch):
    import gguf

    path = _write_with_field(monkeypatch, tmp_path / "t.gguf", "chat_template", 7,
                             gguf.GGUFValueType.UINT32)
    with pytest.raises(FormatError, match="tokenizer.chat_template must be a string"):
        open_source(path)


def test_gguf_that_is_a_fifo_or_unreadable(tmp_path, monkeypatch):
    import builtins
    import os

    from pocketlm.formats import pocketfile

    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "pipe.gguf"
        os.mkfifo(fifo)
        with pytest.raises(FormatError, match="not a regular file"):
            open_source(fifo)
        from pocketlm.formats.gguf import read_gguf

        with pytest.raises(FormatError, match="not a regular file"):
            read_gguf(fifo)  # never opened: a FIFO would block the reader
    path = tmp_path / "m.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama")
    real = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    import pocketlm.formats as formats

    for module in (pocketfile, formats):
        monkeypatch.setattr(module, "open", guarded, raising=False)
    with pytest.raises(PocketError, match="permission denied") as info:
        open_source(path)
    assert f"cannot read {path}" in str(info.value)


@pytest.mark.parametrize("arch,dropped", [
    ("qwen3", ("attn_q_norm.weight", "attn_k_norm.weight")),
    ("gemma3", ("attn_q_norm.weight", "attn_k_norm.weight")),
    ("qwen2", ("attn_q.bias", "attn_k.bias", "attn_v.bias")),
])
def test_tensors_the_family_requires(tmp_path, arch, dropped):
    """A Qwen 3 / Gemma 3 file without its QK-norm weights, or a Qwen 2 file without its q/k/v
    biases, is missing tensors (llama.cpp refuses it too); it was read as a model without
    them, which runs and computes something else."""
    path = tmp_path / f"{arch}.gguf"
    config, _ = tiny_gguf.write_tiny_gguf(path, arch)
    drop = tuple(f"blk.{i}.{name}" for i in range(config.n_layers) for name in dropped)
    tiny_gguf.write_tiny_gguf(path, arch, drop_tensors=drop)
    with pytest.raises(FormatError, match="missing tensors.*layers.0.attn"):
        open_source(path)


@pytest.mark.parametrize("key,factor,refused", [
    ("rope.scaling.factor", 4.0, True),
    ("rope.scale_linear", 2.0, True),  # the older key name
    ("rope.scaling.factor", 1.0, False),
    ("rope.scaling.factor", 0.0, False),  # llama.cpp: no factor
])
def test_rope_scaling_factor_without_a_type(tmp_path, key, factor, refused):
    """llama.cpp reads a left-out rope.scaling.type as linear and stretches positions by the
    factor: such a file is refused (it was run unscaled), one without a factor is not."""
    path = tmp_path / "scaled.gguf"
    tiny_gguf.write_tiny_gguf(path, "llama", metadata={f"llama.{key}": factor})
    if not refused:
        assert open_source(path).config.rope_theta == 10000.0
        return
    with pytest.raises(UnsupportedError, match=f"RoPE scaling \\(linear, llama.{key} = "):
        open_source(path)


def test_gemma3_27b_attention_scale():
    """llama.cpp scales Gemma 3 27B's scores (62 layers) by 1 / sqrt(d_model / n_heads), its
    query_pre_attn_scalar 168, not by its head size 128; other sizes by the head size."""
    from pocketlm.formats.gguf import config_from_fields

    def fields(n_layers):
        return {"general.architecture": "gemma3", "gemma3.embedding_length": 5376,
                "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
                "gemma3.attention.key_length": 128, "gemma3.attention.value_length": 128,
                "gemma3.block_count": n_layers, "gemma3.feed_forward_length": 21504,
                "gemma3.vocab_size": 262208, "gemma3.attention.sliding_window": 1024}

    assert config_from_fields(fields(62), set(), "x").scale == pytest.approx(168 ** -0.5)
    assert config_from_fields(fields(48), set(), "x").scale == pytest.approx(128 ** -0.5)


def test_a_gguf_library_too_old_is_named_not_the_file():
    """gguf before 0.16 has no ReaderField.contents: every file read 'is corrupt' (the file
    was fine; the library was older than pocketlm needs)."""
    import types

    from pocketlm.errors import FormatError
    from pocketlm.formats.gguf import read_fields

    old = types.SimpleNamespace(fields={"GGUF.version": types.SimpleNamespace(parts=[3])})
    with pytest.raises(FormatError, match=r"gguf library \(.*\) is too old .* gguf>=0\.16"):
        read_fields(old, "m.gguf")
