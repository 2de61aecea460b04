"""llama.cpp (through llama-cpp-python) as the independent oracle for real-model checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
N_TOKENS = 256


def llama_cpp():
    import llama_cpp

    return llama_cpp


def oracle_tokens(gguf_path, text: str, add_bos: bool, special: bool = False) -> list[int]:
    llm = llama_cpp().Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))


def oracle_logits(gguf_path, ids: list[int]) -> np.ndarray:
    """llama.cpp's next-token logits at every position of ``ids`` (float32 [n, vocab])."""
    llm = llama_cpp().Llama(model_path=str(gguf_path), n_ctx=max(512, len(ids)), n_batch=512,
                            n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


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
