"""llama.cpp (through llama-cpp-python) as the independent oracle for real-model checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pocketlm.llamacpp import LlamaCpp

DATA = Path(__file__).parent / "data"
N_TOKENS = 256


def write_f32_gguf(src, dst) -> None:
    """Copy a GGUF with every tensor dequantized to F32 (by the gguf library), so that llama.cpp
    runs exactly the float weights of pocketlm's reference path. (On quantized weights llama.cpp
    also rounds the activations to 8 bits, which costs it 3-7 % top-1 agreement with itself on
    F32 weights: a property of the oracle, not of the import.)"""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            writer.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def oracle_tokens(gguf_path, text: str, add_bos: bool, special: bool = False) -> list[int]:
    llm = LlamaCpp(gguf_path, vocab_only=True)
    return llm.tokenize(text, add_bos=add_bos, special=special)


def oracle_logits(gguf_path, ids: list[int]) -> np.ndarray:
    """llama.cpp's next-token logits at every position of ``ids`` (float32 [n, vocab])."""
    llm = LlamaCpp(gguf_path, n_ctx=max(512, len(ids)), n_batch=512, threads=2, logits_all=True)
    return llm.logits(ids)


def oracle_greedy(gguf_path, ids: list[int], n: int, eos: list[int]) -> list[int]:
    """llama.cpp's greedy continuation of ``ids``: up to ``n`` tokens, ending before an EOS."""
    llm = LlamaCpp(gguf_path, n_ctx=256, threads=2)
    out = llm.greedy_ids(ids, n, eos)
    llm.close()
    return out


def text_ids(gguf_path, name: str, add_bos: bool, n: int = N_TOKENS) -> list[int]:
    text = (DATA / f"{name}.txt").read_text(encoding="utf-8")
    ids = oracle_tokens(gguf_path, text, add_bos=add_bos)
    assert len(ids) >= n, f"{name}.txt is only {len(ids)} tokens"
    return ids[:n]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """Perplexity of ids[1:] given the logits at positions 0..n-2."""
    lp = log_softmax(logits[:-1])
    nll = -lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Agreement of two logit arrays [n, vocab]: top-1 and closeness of the distributions."""
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    la, lb = log_softmax(a), log_softmax(b)
    pa = np.exp(la)
    kl = float((pa * (la - lb)).sum(-1).mean())
    # logits are defined up to a constant per position: compare centred values
    ca = a - a.mean(-1, keepdims=True)
    cb = b - b.mean(-1, keepdims=True)
    rel = float(np.linalg.norm(ca - cb) / np.linalg.norm(ca))
    return {"top1": top1, "kl": kl, "rel_logit_err": rel, "max_abs_diff": float(np.abs(ca - cb).max())}
