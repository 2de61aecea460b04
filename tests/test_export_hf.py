"""``pocket export --to hf``: Hugging Face folders, checked by transformers itself.

For each model (random tiny models of every family packed from Hugging Face folders; a tiny
model trained here, of pocketlm's own family, written as Qwen3; smollm2-135m in CI; gemma3-270m,
qwen2.5-0.5b and the trimmed gemma3-270m-zh-en marked slow), exported in float32:

* transformers loads the folder (``AutoModelForCausalLM``, ``AutoTokenizer``);
* its tokenizer gives pocketlm's ids on English, Chinese and code text (BOS as pocketlm adds
  it), decodes them to the same text, and its chat template renders what pocketlm renders;
* its float32 logits on a 64-token text agree with pocketlm's float reference path (the numpy
  engine on the deploy file's dequantized weights): the same top-1 token at >= 99.5 % of the
  positions and a mean KL below 1e-4. Both compute in float32 from the same float32 weights,
  so only the order of summation differs (measured: top-1 100 %, KL ~1e-11, max logit
  difference ~1e-4 on the real models);
* ``pocket pack DIR`` imports the folder back: the same config (the family aside: pocket comes
  back as qwen3), the same tensors, the same tokenizer ids.

Then the parts: bfloat16 rounding against torch's, the safetensors file against the
safetensors library, configs no Hugging Face model computes, and the CLI's refusals, which
leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # the oracle: part of the test extra, never skipped
from tiny_hf import write_tiny_hf

from pocketlm.api import PocketModel, deploy_file, file_config_and_tokenizer, load_pocket
from pocketlm.cli import main
from pocketlm.config import ModelConfig
from pocketlm.errors import PocketError, UnsupportedError
from pocketlm.export.hf import bfloat16_bits, export_hf, hf_target, write_safetensors
from pocketlm.formats.hf import read_hf
from pocketlm.formats.pocketfile import PocketFile, write_pocket
from pocketlm.head_patch import PATCH, PATCH_IDS, patched_head
from pocketlm.quant import QuantTensor

EN = "The quick brown fox jumps over the lazy dog. It's 3.14 o'clock, isn't it?"
ZH = "今天天气很好，我们去公园散步吧。人工智能正在改变世界，小猫在花园里玩。"
CODE = "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))\n"
TEXTS = [EN, ZH, CODE, "  two  spaces\n\nand\ttabs  ", f"{EN}\n{ZH}\n{CODE}"]
# the logits text: 64 tokens of it (every tokenizer here makes more)
LONG = (f"{EN} {ZH}\n{CODE}The history of the city goes back to Roman times, when a small "
        "fort stood by the river. 这座城市的历史可以追溯到罗马时代。")
N_TOKENS = 64
MESSAGES = [{"role": "user", "content": "Where is the cat? 猫在哪里？"},
            {"role": "assistant", "content": "On the mat."},
            {"role": "user", "content": "Thanks!"}]

REAL = [
    pytest.param("smollm2-135m", marks=pytest.mark.real),
    pytest.param("gemma3-270m", marks=[pytest.mark.real, pytest.mark.slow]),
    pytest.param("qwen2.5-0.5b", marks=[pytest.mark.real, pytest.mark.slow]),
    pytest.param("gemma3-270m-zh-en", marks=[pytest.mark.real, pytest.mark.slow]),
]
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


# -- the checks every exported model gets ---------------------------------------------------
def float_reference(deploy: Path) -> PocketModel:
    """pocketlm's float path on the deploy file: its weights dequantized, the numpy engine
    (the caller sets POCKET_KERNELS=numpy)."""
    pf = PocketFile(deploy)
    config, tok = file_config_and_tokenizer(pf)
    weights = {name: w.dequantize() if isinstance(w, QuantTensor) and name != PATCH
               else w if name in (PATCH, PATCH_IDS) else np.array(w, np.float32)
               for name, w in pf.weights().items()}  # a head patch stays as the runtime reads it
    model = PocketModel(config, weights, tok, chat_template=pf.text("chat_template") or None)
    assert model.runtime.engine == "numpy"
    return model


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    lp = torch.log_softmax(torch.from_numpy(ours).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(theirs).double(), -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    return {"top1": top1, "kl": kl, "max_abs_diff": float(np.abs(ours - theirs).max())}


def check_transformers(deploy: Path, folder: Path, monkeypatch) -> None:
    """transformers loads ``folder`` and computes what pocketlm computes from ``deploy``."""
    monkeypatch.setenv("POCKET_KERNELS", "numpy")
    ref = float_reference(deploy)
    tok = ref.tokenizer
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(
            text, add_bos=False), text
        assert hf_tok.decode(ids) == tok.decode(ids), text
    if ref.chat_template:
        text = ref.render_chat(MESSAGES)
        assert hf_tok.apply_chat_template(MESSAGES, tokenize=False,
                                          add_generation_prompt=True) == text
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(
            text, add_bos=False)

    ids = tok.encode(LONG)[:N_TOKENS]
    assert len(ids) == N_TOKENS
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    del model
    stats = agreement(ref.logits(ids), theirs)
    assert stats["top1"] >= 0.995 and stats["kl"] < 1e-4, stats


def check_pack_round_trip(deploy: Path, folder: Path, tmp: Path) -> None:
    """``pocket pack DIR`` imports the export: config, tensors and tokenizer come back."""
    pf = PocketFile(deploy)
    config, tok = file_config_and_tokenizer(pf)
    back = read_hf(folder)
    assert back.config == dataclasses.replace(config, arch=back.config.arch)
    assert back.config.arch == {"pocket": "qwen3"}.get(config.arch, config.arch)
    weights = pf.weights()
    assert set(back.tensors) == set(weights)
    for name, st in back.tensors.items():
        w = weights[name]
        want = w.dequantize() if isinstance(w, QuantTensor) else np.asarray(w)
        got = st.to_float()
        # exact but for Gemma's norms, written as weight - 1 and read back as that + 1
        assert np.abs(got - want).max() <= 1e-6 * max(1.0, float(np.abs(want).max())), name
    for text in TEXTS:
        assert back.tokenizer.encode(text) == tok.encode(text), text
    assert back.tokenizer.eos_ids[:1] == tok.eos_ids[:1]
    out = tmp / "back.pocket"
    assert main(["pack", str(folder), "-o", str(out)]) == 0
    assert load_pocket(out).config == back.config


# -- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model of pocketlm's own family, trained for a few steps, packed with
    ``pocket export RUN -o x.pocket`` and exported with ``--to hf``."""
    root = tmp_path_factory.mktemp("trained")
    rng = random.Random(0)
    lines = [EN, ZH, CODE, "The cat sat on the mat.", "小狗在河边玩。小狗很高兴。"]
    (root / "corpus.txt").write_text(
        "\n\n".join(" ".join(rng.choices(lines, k=rng.randint(1, 4))) for _ in range(300)),
        encoding="utf-8")
    run, deploy, folder = root / "run", root / "tiny.pocket", root / "tiny-hf"
    assert main(["train", "--data", str(root / "corpus.txt"), "--out", str(run),
                 "--steps", "8", "--eval-every", "8", "--save-every", "8",
                 "--vocab-size", "400", "--holdout", "0.05", "--preset", "tiny",
                 "--seq-len", "64", "--batch-size", "4", "--warmup", "2",
                 "--eval-batches", "2", "--threads", "1", "--quiet"]) == 0
    assert main(["export", str(run), "-o", str(deploy)]) == 0
    assert main(["export", str(deploy), "--to", "hf", "-o", str(folder), "--dtype",
                 "float32", "--quiet"]) == 0
    return deploy, folder


def test_trained_model_runs_in_transformers(trained, monkeypatch):
    deploy, folder = trained
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    check_transformers(deploy, folder, monkeypatch)


def test_trained_model_packs_back(trained, tmp_path):
    deploy, folder = trained
    check_pack_round_trip(deploy, folder, tmp_path)


def test_bfloat16_export_is_the_rounded_float32_one(trained, tmp_path):
    from safetensors.torch import load_file

    deploy, folder = trained
    report = export_hf(deploy, tmp_path / "bf16", progress=False)  # the default dtype
    assert report.dtype == "bfloat16" and "model.safetensors" in report.summary()
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"
    wide, narrow = load_file(folder / "model.safetensors"), load_file(
        tmp_path / "bf16" / "model.safetensors")
    assert set(wide) == set(narrow)
    for name, t in narrow.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, wide[name].to(torch.bfloat16)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_runs_in_transformers(arch, tmp_path, monkeypatch):
    """Random tiny models packed from Hugging Face folders (gemma3 with a 5-token sliding
    window, so the 64-token text crosses it; qwen2 and qwen3 with an untied head)."""
    write_tiny_hf(tmp_path / "src", arch, seed=3)
    deploy = tmp_path / "tiny.pocket"
    assert main(["pack", str(tmp_path / "src"), "-o", str(deploy)]) == 0
    report = export_hf(deploy, tmp_path / "hf", dtype="float32", progress=False)
    assert report.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM",
                                   "gemma3": "Gemma3ForCausalLM"}[arch]
    check_transformers(deploy, tmp_path / "hf", monkeypatch)
    check_pack_round_trip(deploy, tmp_path / "hf", tmp_path)


@pytest.fixture(scope="module")
def real_export(tmp_path_factory):
    """name -> (deploy file, its float32 export); one real model's folder kept at a time."""
    root = tmp_path_factory.mktemp("real")
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            for old in list(made):
                _rmtree(made.pop(old)[1])
            deploy = deploy_file(name, quiet=True)
            export_hf(deploy, root / name, dtype="float32", progress=False)
            made[name] = deploy, root / name
        return made[name]

    return get


@pytest.mark.parametrize("name", REAL)
def test_registry_model_runs_in_transformers(name, real_export, monkeypatch):
    deploy, folder = real_export(name)
    check_transformers(deploy, folder, monkeypatch)
    readme = (folder / "README.md").read_text()
    assert PocketFile(deploy).metadata["header_checksum"] and "sha256" in readme
    if name.endswith("-zh-en"):  # the trimmed vocabulary, and the README says so
        assert json.loads((folder / "config.json").read_text())["vocab_size"] < 262144
        assert "of 262,144 pieces kept" in readme


@pytest.mark.parametrize("name", REAL)
def test_registry_model_packs_back(name, real_export, tmp_path):
    deploy, folder = real_export(name)
    check_pack_round_trip(deploy, folder, tmp_path)


# -- parts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["spm", "spm-prefix", "byte-bpe-missing-byte"])
def test_tokenizer_json_gives_pocketlms_ids(kind):
    """The written tokenizer.json, run by the tokenizers library as transformers runs it
    (special tokens matched, the post-processor adding BOS), on tiny vocabularies: a
    SentencePiece one (with and without a space prefix; the real Gemma 3 ones are checked in
    the slow tier) and a byte-level BPE lacking a byte token."""
    import tokenizers
    from test_tokenizer import byte_bpe_fields, spm_fields

    from pocketlm.export.hf import hf_tokenizer
    from pocketlm.formats.gguf_vocab import tokenizer_from_gguf_fields
    from pocketlm.tokenizer import SpmTokenizer

    fields = (byte_bpe_fields(all_bytes=False) if kind.startswith("byte")
              else spm_fields(add_space_prefix=kind == "spm-prefix"))
    tok = tokenizer_from_gguf_fields(fields)
    assert isinstance(tok, SpmTokenizer) == kind.startswith("spm")
    hf = tokenizers.Tokenizer.from_str(json.dumps(hf_tokenizer(tok)))
    rng = random.Random(4)
    alphabet = "abcdehlorw é\n" + ("\x04你" if kind.startswith("byte") else "")
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
             for _ in range(300)]
    texts += ["hello world", "<start_of_turn>hello\n<end_of_turn>", "<|im_start|>hello<tool>",
              "l\x04l"]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, text
        assert all(i < tok.vocab_size for i in ids)
        if "\x04" not in text:  # the missing byte is dropped on the way
            assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids), text


def test_bfloat16_rounding_is_torchs():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000, 0x7F7FFFFF, 0x00008000,
                     0x00018000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000],
                    dtype=np.uint32)  # halfway cases, the largest finite, subnormals, +-inf, +-0
    x = np.concatenate([bits, ties]).view(np.float32)
    got = bfloat16_bits(x)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = (got.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(back[nan]).all() and not np.isnan(back[~nan]).any()


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_safetensors_file_reads_with_the_safetensors_library(tmp_path, dtype):
    from safetensors import safe_open

    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    tensors = [("model.a", a.shape, lambda: iter([a[:2], a[2:]])),  # written in blocks
               ("model.b", b.shape, lambda: iter([b]))]
    path = tmp_path / "x.safetensors"
    size = write_safetensors(path, tensors, dtype)
    raw = path.read_bytes()
    assert size == len(raw) == 8 + int.from_bytes(raw[:8], "little") + (a.size + b.size) * (
        4 if dtype == "F32" else 2)
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, want in (("model.a", a), ("model.b", b)):
            got = f.get_tensor(name)
            want = torch.from_numpy(want)
            assert torch.equal(got, want if dtype == "F32" else want.to(torch.bfloat16))


def test_a_tensor_of_the_wrong_size_is_an_error(tmp_path):
    a = np.zeros((4, 2), np.float32)
    with pytest.raises(PocketError, match="wrote 6 values, expected 8"):
        write_safetensors(tmp_path / "x.safetensors", [("a", a.shape, lambda: iter([a[:3]]))],
                          "F32")


def test_source_encoded_tensors_are_decoded_one_at_a_time(tmp_path, monkeypatch):
    """A deploy file packed from a Q4_K / Q6_K GGUF holds those tensors in their source bytes,
    decoded on use: the export dequantizes each and lets its decoded layout go, so that the
    whole model's are never resident together."""
    import tiny_gguf
    from safetensors.numpy import load_file

    from pocketlm.export.hf import hf_tensor_names
    from pocketlm.quant import EncodedQuantTensor

    tiny_gguf.write_tiny_gguf(tmp_path / "src.gguf", "qwen3", seed=3, weight_type="Q4_K",
                              embed_type="Q6_K", d_model=256, d_ff=512, head_dim=64,
                              max_context=128)
    deploy = tmp_path / "m.pocket"
    assert main(["pack", str(tmp_path / "src.gguf"), "-o", str(deploy)]) == 0
    read = []
    real = PocketFile.weights
    monkeypatch.setattr(PocketFile, "weights", lambda self: read.append(real(self)) or read[-1])
    export_hf(deploy, tmp_path / "hf", dtype="float32", progress=False)
    encoded = {n: w for n, w in read[0].items() if isinstance(w, EncodedQuantTensor)}
    assert {w.encoding for w in encoded.values()} == {"q4_k", "q6_k"}
    assert [n for n, w in encoded.items() if w._decoded is not None] == []
    written = load_file(tmp_path / "hf" / "model.safetensors")
    names = hf_tensor_names(PocketFile(deploy).config())
    for name, w in encoded.items():
        assert np.array_equal(written[names[name]], w.dequantize()), name


def _config(**changes) -> ModelConfig:
    base = dict(arch="pocket", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                head_dim=16, d_ff=64, qk_norm=True)
    return ModelConfig(**{**base, **changes})


def test_architectures_follow_the_computation():
    assert hf_target(_config()) == "qwen3"
    assert hf_target(_config(arch="llama", qk_norm=False)) == "llama"
    assert hf_target(_config(arch="llama", qk_norm=False, qkv_bias=True)) == "qwen2"
    assert hf_target(_config(arch="qwen2", qk_norm=False, qkv_bias=False)) == "llama"
    assert hf_target(_config(attn_scale=0.25)) == "qwen3"  # 1/sqrt(16), written explicitly


@pytest.mark.parametrize("changes, named", [
    (dict(embed_scale=2.0), "embed_scale=2"),
    (dict(qkv_bias=True), "qkv_bias=True"),
    (dict(attn_scale=0.1), "attn_scale=0.1"),
    (dict(sandwich_norms=True), "sandwich_norms=True"),
    (dict(arch="gemma3", sandwich_norms=True, activation="gelu_tanh"), "embed_scale=1"),
])
def test_configs_no_hf_model_computes_are_refused(changes, named):
    with pytest.raises(UnsupportedError, match="cannot write this") as exc:
        hf_target(_config(**changes))
    assert named in str(exc.value) and "--to gguf" in str(exc.value)
    # QK-norm with biases: the GGUF export refuses it too, and the advice says so (it sent
    # the user to --to gguf, which refused)
    if changes == dict(qkv_bias=True):
        assert "--to gguf cannot write it either" in str(exc.value)


def test_bad_dtype_is_refused(trained, tmp_path):
    deploy, _ = trained
    with pytest.raises(PocketError, match="dtype must be one of bfloat16, float32"):
        export_hf(deploy, tmp_path / "x", dtype="float16")
    assert not (tmp_path / "x").exists()


# -- the command line -----------------------------------------------------------------------
def test_existing_output_is_refused_without_force(trained, tmp_path, capsys):
    deploy, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(deploy), "--to", "hf", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--force" in err, err
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]
    # --force replaces an earlier export (config.json), never a folder of other things
    assert main(["export", str(deploy), "--to", "hf", "-o", str(out), "--force", "-q"]) == 1
    assert "holding other things" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    (out / "config.json").write_text("{}")
    assert main(["export", str(deploy), "--to", "hf", "-o", str(out), "--force", "-q"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["out"] and "config.json" in os.listdir(out)
    assert not (out / "keep.txt").exists()


def test_a_failed_export_leaves_nothing_behind(trained, tmp_path, capsys, monkeypatch):
    deploy, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export, which --force replaces

    def disk_full(path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("pocketlm.export.hf.write_safetensors", disk_full)
    capsys.readouterr()
    assert main(["export", str(deploy), "--to", "hf", "-o", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "disk is full" in err, err
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["config.json"]
    # a fresh name: not created at all
    assert main(["export", str(deploy), "--to", "hf", "-o", str(tmp_path / "new")]) == 1
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_model_no_hf_architecture_computes_is_refused_in_one_line(trained, tmp_path,
                                                                     capsys):
    deploy, _ = trained
    pf = PocketFile(deploy)
    config = json.loads(pf.metadata["config"])
    config["embed_scale"] = 2.0
    meta = {k: v for k, v in pf.metadata.items()
            if k not in ("format", "format_version", "checksums", "header_checksum")}
    meta["config"] = json.dumps(config)
    odd = tmp_path / "odd.pocket"
    write_pocket(odd, [(n, pf.tensor(n)) for n in pf.infos if not n.startswith("_pad.")],
                 meta)
    capsys.readouterr()
    assert main(["export", str(odd), "--to", "hf", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Qwen3ForCausalLM" in err and "embed_scale=2" in err
    assert sorted(os.listdir(tmp_path)) == ["odd.pocket"]


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)



@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied, untied
def test_a_head_patch_is_written_over_the_head(arch, tmp_path, monkeypatch):
    """A budgeted pack's INT4 head with its patch: the exported lm_head holds the patch's rows
    (a tied head becomes its own lm_head, the embedding staying the INT4 rows), and
    transformers computes what pocketlm does."""
    from safetensors.numpy import load_file

    from pocketlm import calibrate
    from pocketlm.pack import pack

    write_tiny_hf(tmp_path / "src", arch, seed=3)
    text = tmp_path / "app.txt"
    text.write_text(f"{EN} {ZH}\n" * 40, encoding="utf-8")
    monkeypatch.setattr(calibrate, "PATCH_ROWS", (16, 32, 64))
    monkeypatch.setattr(calibrate, "_stats_path",
                        lambda model, cset: tmp_path / "calib" / f"{cset.digest[:16]}.npz")
    deploy = tmp_path / "p.pocket"
    rep = pack(tmp_path / "src", deploy, calib=text, bits_per_weight=4.6, progress=False,
               head_patch="auto")
    assert "patch" in rep.calibration["head"], rep.calibration["head"]
    export_hf(deploy, tmp_path / "hf", dtype="float32", progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    w = PocketFile(deploy).weights()
    head = w.get("lm_head.weight", w["embed.weight"])
    got = load_file(tmp_path / "hf" / "model.safetensors")
    np.testing.assert_array_equal(got["lm_head.weight"],
                                  patched_head(head.dequantize(), w[PATCH], w[PATCH_IDS]))
    np.testing.assert_array_equal(got["model.embed_tokens.weight"],
                                  w["embed.weight"].dequantize())
    check_transformers(deploy, tmp_path / "hf", monkeypatch)
