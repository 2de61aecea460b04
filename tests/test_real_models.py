"""Real registry models against llama.cpp, the independent oracle.

For each model, on a 256-token English text and a 256-token Chinese text (both in tests/data,
tokenized by llama.cpp so that every engine sees the same ids):

* the dequantized float path agrees with llama.cpp running the same dequantized weights (an F32
  copy of the GGUF) on the top-1 next token at >= 99 % of positions, with close distributions;
* against llama.cpp on the original quantized GGUF (where llama.cpp also rounds activations to
  8 bits) agreement is reported and held to a looser bound;
* the default deploy file keeps top-1 agreement >= 95 % with the float path and perplexity
  within 3 % of it. smollm2-135m (Q4_1) imports losslessly into INT4. gemma3-270m and
  qwen2.5-0.5b store most weights as Q5_0/Q6_K/Q8_0, which the default pack keeps (Q5_0 tensors
  in INT5, the wider ones in INT8) and plain INT4 rounding cannot hold: their strict-INT4 figures
  (``keep_precision=False``, ``pack --all-int4``) are checked against looser regression bounds
  (see docs/accuracy.md for how far and why);
* greedy decoding from the INT4 deploy file follows llama.cpp's greedy tokens.

smollm2-135m runs in CI; gemma3-270m and qwen2.5-0.5b are marked slow (`make test-all`).
Figures per model are in docs/accuracy.md (benchmarks/accuracy.py).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import llama_cpp  # noqa: F401  (the oracle: part of the test extra, never skipped)
import numpy as np
import oracle
import pytest

import pocketlm
from pocketlm.api import from_source
from pocketlm.formats import open_source
from pocketlm.registry import pull

MODELS = [
    pytest.param("smollm2-135m", marks=pytest.mark.real),
    pytest.param("gemma3-270m", marks=[pytest.mark.real, pytest.mark.slow]),
    pytest.param("qwen2.5-0.5b", marks=[pytest.mark.real, pytest.mark.slow]),
]
TEXTS = ["english", "chinese"]
_TMP = tempfile.TemporaryDirectory(prefix="pocketlm-oracle-")


# name -> whether its default pack keeps tensors above 4 bits (else it is strict INT4 already)
KEEP = {"smollm2-135m": False, "gemma3-270m": True, "qwen2.5-0.5b": True}


@functools.lru_cache(maxsize=1)
def _models(name: str):
    path = pull(name, quiet=True)
    f32 = Path(_TMP.name) / f"{name}-f32.gguf"
    for old in Path(_TMP.name).glob("*.gguf"):
        old.unlink()  # one model's F32 copy at a time (they are large)
    oracle.write_f32_gguf(path, f32)
    kept = pocketlm.load(path)  # the default: a GGUF's 5-8-bit tensors keep their precision
    strict = pocketlm.load(path, keep_precision=False) if KEEP[name] else kept
    return path, f32, from_source(open_source(path)), strict, kept


@functools.lru_cache(maxsize=2)
def _logits(name: str, text: str):
    path, f32, float_model, strict, kept = _models(name)
    ids = oracle.text_ids(path, text, add_bos=float_model.tokenizer.add_bos)
    return {
        "ids": ids,
        "llama_f32": oracle.oracle_logits(f32, ids),
        "llama_quant": oracle.oracle_logits(path, ids),
        "float": float_model.logits(ids),
        "int4": strict.logits(ids),
        "kept": kept.logits(ids) if kept is not strict else None,
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_float_path_agrees_with_llama_cpp(name, text):
    r = _logits(name, text)
    stats = oracle.compare(r["llama_f32"], r["float"])
    assert stats["top1"] >= 0.99, stats
    assert stats["kl"] < 1e-3, stats
    ppl_ref = oracle.perplexity(r["llama_f32"], r["ids"])
    ppl_ours = oracle.perplexity(r["float"], r["ids"])
    assert abs(ppl_ours / ppl_ref - 1) < 0.005, (ppl_ref, ppl_ours)
    # llama.cpp on the quantized file rounds activations to 8 bits: agreement is looser
    loose = oracle.compare(r["llama_quant"], r["float"])
    assert loose["top1"] >= 0.85 and loose["kl"] < 0.05, loose


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_deploy_file_keeps_quality(name, text):
    r = _logits(name, text)
    packed = r["kept"] if r["kept"] is not None else r["int4"]
    stats = oracle.compare(r["float"], packed)
    assert stats["top1"] >= 0.95, stats
    ppl_float = oracle.perplexity(r["float"], r["ids"])
    ppl_packed = oracle.perplexity(packed, r["ids"])
    assert abs(ppl_packed / ppl_float - 1) <= 0.03, (ppl_float, ppl_packed)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_strict_int4_stays_within_its_measured_loss(name, text):
    """Regression bounds for strict INT4 (measured: docs/accuracy.md)."""
    r = _logits(name, text)
    stats = oracle.compare(r["float"], r["int4"])
    ppl_ratio = oracle.perplexity(r["int4"], r["ids"]) / oracle.perplexity(r["float"], r["ids"])
    if not KEEP[name]:  # lossless import: the same numbers up to float rounding
        # where the prefill runs on AMX its default one-bfloat16-term weights for q/k/v, W_o
        # and W_down move the logits further (docs/engine.md: mean KL up to 4e-5 for this
        # model; measured 0.14 % perplexity on the Chinese text, Intel Sapphire Rapids)
        native = getattr(_models(name)[3].runtime, "native", None)
        bound = 3e-3 if getattr(native, "amx", False) else 1e-3
        assert stats["top1"] >= 0.99 and abs(ppl_ratio - 1) < bound, (stats, ppl_ratio)
    else:
        assert stats["top1"] >= 0.6 and ppl_ratio < 1.35, (stats, ppl_ratio)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuation_matches_llama_cpp(name):
    """Greedy decoding (prefill, then one token at a time through the KV cache): the float path
    gives llama.cpp's tokens on the same float weights; for smollm2-135m the INT4 deploy file
    also gives llama.cpp's tokens on the original Q4_1 file."""
    path, f32, float_model, strict, _ = _models(name)
    ids = float_model.tokenize("The three primary colours are")
    eos = float_model.tokenizer.eos_ids
    ours = list(float_model.stream_ids(ids, max_tokens=16))
    theirs = oracle.oracle_greedy(f32, ids, len(ours), eos)
    assert ours == theirs, (float_model.detokenize(ours), float_model.detokenize(theirs))
    if not KEEP[name]:
        packed = list(strict.stream_ids(ids, max_tokens=16))
        assert packed == oracle.oracle_greedy(path, ids, len(packed), eos)


@pytest.mark.real
def test_registry_model_runs_from_the_api():
    m = pocketlm.load("smollm2-135m")
    out = m.generate("The capital of France is", max_tokens=8)
    assert "Paris" in out
    assert np.isfinite(m.logits(m.tokenize("Hello"))).all()


@pytest.mark.real
def test_inspect_takes_a_registry_name(capsys):
    from pocketlm import cli
    from pocketlm.api import deploy_file

    # it used to answer "smollm2-135m: no such file or folder" where every other verb runs it
    assert cli.main(["inspect", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert f"file:        {deploy_file('smollm2-135m')} " in out and "vocab 49152" in out
