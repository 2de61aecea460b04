"""llama.cpp, through llama-cpp-python: the independent engine that evaluation, the benchmark and
the real-model checks compare pocketlm with.

:class:`LlamaCpp` loads a GGUF file with llama.cpp's logs silenced and gives what those callers
share: tokenizing, the logits of a sequence, the last position's logits, greedy continuation.
Only the settings a caller names are passed to ``llama_cpp.Llama``; the rest keep
llama-cpp-python's defaults, so each caller's numbers stay its own.

llama-cpp-python is optional (the test extra): it is imported when a model is loaded, never when
this module is.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PocketError

__all__ = ["LlamaCpp", "available", "import_llama_cpp"]


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    return importlib.util.find_spec("llama_cpp") is not None


def import_llama_cpp(what: str | None = None):
    """The ``llama_cpp`` module. Without it: ImportError, or, when ``what`` names what needs it
    (``"--engine llama.cpp"``), a :class:`PocketError` that says how to install it."""
    try:
        import llama_cpp
    except ImportError:
        if what is None:
            raise
        raise PocketError(f"{what} needs llama-cpp-python: pip install llama-cpp-python") from None
    return llama_cpp


class LlamaCpp:
    """A GGUF model loaded by llama.cpp (``llama_cpp.Llama`` as :attr:`llm`).

    ``threads`` sets llama.cpp's decode threads and ``batch_threads`` its prefill threads;
    ``logits_all`` keeps the logits of every position (needed by :meth:`logits`);
    ``vocab_only`` loads the vocabulary alone (for :meth:`tokenize`); ``kv_type`` is the ggml
    type of the KV cache (keys and values). ``needed_by`` names what needs llama.cpp, for the
    error when it is not installed.
    """

    def __init__(self, path: str | Path, *, n_ctx: int | None = None,
                 n_batch: int | None = None, n_ubatch: int | None = None,
                 threads: int | None = None, batch_threads: int | None = None,
                 logits_all: bool | None = None, vocab_only: bool | None = None,
                 flash_attn: bool | None = None, kv_type: int | None = None,
                 seed: int | None = None, needed_by: str | None = None):
        self.llama_cpp = import_llama_cpp(needed_by)
        settings: dict[str, Any] = {
            "n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "n_threads": threads,
            "n_threads_batch": batch_threads, "logits_all": logits_all, "vocab_only": vocab_only,
            "flash_attn": flash_attn, "type_k": kv_type, "type_v": kv_type, "seed": seed,
        }
        self.llm = self.llama_cpp.Llama(
            model_path=str(path), **{k: v for k, v in settings.items() if v is not None},
            verbose=False)
        # llama-cpp-python's own methods, bound once: the benchmark's timed loops call them
        # with no layer of ours in between
        self.eval = self.llm.eval
        self.reset = self.llm.reset

    # -- vocabulary

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of ``text`` (``add_bos``: with the model's BOS where it adds one;
        ``special``: special-token text parsed as those tokens)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def bos_ids(self) -> list[int]:
        """``[bos]`` when the model's tokenizer adds a BOS token, else ``[]``."""
        with_bos = self.llm.tokenize(b"a", add_bos=True, special=False)
        without = self.llm.tokenize(b"a", add_bos=False, special=False)
        return [self.llm.token_bos()] if len(with_bos) > len(without) else []

    def eos_id(self) -> int:
        return self.llm.token_eos()

    def token_text(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self.llm.detokenize(list(ids), special=True).decode("utf-8", "replace")

    @property
    def metadata(self) -> dict[str, str]:
        return self.llm.metadata

    def max_context(self) -> int:
        """The context it was loaded with, capped at what the model was trained for."""
        meta = self.llm.metadata
        trained = meta.get(f"{meta.get('general.architecture')}.context_length")
        return min(self.llm.n_ctx(), int(trained) if trained else self.llm.n_ctx())

    # -- running

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position of ``ids`` from an empty cache: float32
        ``[len(ids), vocab]`` (loaded with ``logits_all``)."""
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def last_logits(self) -> np.ndarray:
        """The logits of the last position evaluated: a float32 view of llama.cpp's buffer,
        valid until the next :meth:`eval`."""
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def greedy_ids(self, ids: Sequence[int], max_tokens: int,
                   stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ``ids`` from an empty cache: up to ``max_tokens`` ids,
        ending before the first of ``stop_ids``."""
        out: list[int] = []
        for tok in self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True):
            if tok in stop_ids or len(out) == max_tokens:
                break
            out.append(int(tok))
        return out

    def complete(self, ids: Sequence[int], max_tokens: int, stop: Sequence[str] = ()) -> str:
        """Greedy continuation of ``ids`` from an empty cache as text, cut before the first
        stop string."""
        self.llm.reset()
        out = self.llm.create_completion(list(ids), max_tokens=max_tokens, temperature=0.0,
                                         top_k=1, stop=list(stop) or None)
        return out["choices"][0]["text"]

    def close(self) -> None:
        self.llm.close()
