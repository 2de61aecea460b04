"""Tokenizers rebuilt from a GGUF file's vocabulary, with token ids equal to llama.cpp's.

A GGUF file stores its tokenizer as metadata: the token strings, their types, the BPE merges
(byte-level BPE, ``tokenizer.ggml.model = "gpt2"``) or the piece scores (SentencePiece,
``"llama"``), and a *name* for the pre-tokenizer (``tokenizer.ggml.pre``) whose regexes are not
stored in the file but compiled into llama.cpp. :func:`tokenizer_from_gguf_fields` turns that
metadata into a Hugging Face :class:`tokenizers.Tokenizer` that splits text the way llama.cpp
does:

* **byte-level BPE** — the pre-tokenizer is the chain of regex splits llama.cpp runs for the
  given ``tokenizer.ggml.pre`` (each regex isolates its matches inside the pieces left by the
  previous one), followed by the GPT-2 byte-to-unicode mapping; the model is BPE with the
  file's merges, ranked by their order.
* **SentencePiece** — llama.cpp starts from single characters and repeatedly merges the
  adjacent pair whose concatenation is the highest-scoring vocabulary piece, which is what the
  ``sentencepiece`` library's BPE model does: the vocabulary becomes a SentencePiece model
  (:class:`SpmTokenizer`, a few MB however large the vocabulary). For the rare file that
  library cannot hold (no unknown piece, incomplete byte pieces), a Hugging Face BPE model
  reproduces this when its merge list holds, for every piece, every split of it into two
  vocabulary pieces, ranked by the score of the piece (the one possible difference: where two
  overlapping pairs make different pieces of equal score, llama.cpp takes the leftmost and BPE
  the lower id); unknown characters fall back to ``<0xNN>`` byte tokens. Spaces become ``▁`` (with a leading ``▁`` only if the
  file asks for a space prefix).
* **special tokens** — CONTROL tokens become special added tokens (matched in text only when
  ``special=True``, like llama.cpp's ``parse_special``); USER_DEFINED tokens become ordinary
  added tokens, matched always, as llama.cpp does.

:class:`Tokenizer` wraps the result with BOS/EOS handling, raw token bytes and JSON
round-tripping; :class:`StreamingDetokenizer` turns a stream of ids into text that never
splits a UTF-8 character.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from .errors import FormatError, TextError, TokenIdError, UnsupportedError

__all__ = [
    "SpmTokenizer",
    "StreamingDetokenizer",
    "Tokenizer",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE",
    "tokenizer_from_gguf_fields",
]

# GGUF token types (llama.cpp's llama_token_type).
TT_UNDEFINED = 0
TT_NORMAL = 1
TT_UNKNOWN = 2
TT_CONTROL = 3
TT_USER_DEFINED = 4
TT_UNUSED = 5
TT_BYTE = 6

SPACE_MARK = "\u2581"  # '▁', SentencePiece's visible space

# Placeholder appended to byte-level vocabularies that lack some of the 256 byte tokens. llama.cpp
# drops a byte it has no token for, but never merges the pieces on either side of it; as BPE's
# unknown token the placeholder keeps them apart, and encode() then removes it.
DROPPED_BYTE = "<|pocketlm:dropped-byte|>"

# Token texts that end a turn or the text. llama.cpp treats them as control tokens even when a
# converter marked them as normal ones; the chat-ending ones are also generation stoppers.
_EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
)

# ---------------------------------------------------------------------------------------------
# pre-tokenizer regexes (as llama.cpp applies them, per ``tokenizer.ggml.pre``)
# ---------------------------------------------------------------------------------------------

# GPT-2's split. llama.cpp matches a lone whitespace character that no alternative accepts on
# its own, which the trailing ``\s+`` spells out.
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreSpec:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not split by merges
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_PRE_DEFAULT = _PreSpec((r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_GPT2 = _PreSpec((_RE_GPT2,))
_PRE_DIGITS_GPT2 = _PreSpec((r"\p{N}", _RE_GPT2))
_PRE_LLAMA3 = _PreSpec((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_LLAMA3_MERGES = _PreSpec((_RE_LLAMA3,))
_PRE_QWEN2 = _PreSpec((_RE_QWEN2,))

_PRE_TYPES: dict[str, _PreSpec] = {
    "default": _PRE_DEFAULT,
    # GPT-2 regex
    "gpt-2": _PRE_GPT2,
    "gpt2": _PRE_GPT2,
    "phi-2": _PRE_GPT2,
    "mpt": _PRE_GPT2,
    "olmo": _PRE_GPT2,
    "jais": _PRE_GPT2,
    # single digits, then the GPT-2 regex
    "smollm": _PRE_DIGITS_GPT2,
    "starcoder": _PRE_DIGITS_GPT2,
    "refact": _PRE_DIGITS_GPT2,
    "command-r": _PRE_DIGITS_GPT2,
    "codeshell": _PRE_DIGITS_GPT2,
    "exaone": _PRE_DIGITS_GPT2,
    # Llama 3 (digits in groups of up to three)
    "llama3": _PRE_LLAMA3,
    "llama-v3": _PRE_LLAMA3,
    "llama-bpe": _PRE_LLAMA3,
    "falcon3": _PRE_LLAMA3,
    "dbrx": _PRE_LLAMA3_MERGES,
    "smaug-bpe": _PRE_LLAMA3_MERGES,
    # Qwen 2 (single digits)
    "qwen2": _PRE_QWEN2,
    "deepseek-r1-qwen": _PRE_QWEN2,
    "stablelm2": _PRE_QWEN2,
    "megrez": _PRE_QWEN2,
}

SUPPORTED_MODELS = ("gpt2", "llama")
SUPPORTED_PRE = tuple(sorted(_PRE_TYPES))

# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping
# ---------------------------------------------------------------------------------------------


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes stand for themselves; the others (control characters, space,
    DEL, NBSP, soft hyphen) are moved to code points 256, 257, ... in byte order.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# ---------------------------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """A :class:`tokenizers.Tokenizer` plus the BOS/EOS conventions of the model it belongs to.

    Whether the vocabulary is byte-level BPE or SentencePiece, which ids are special and
    whether a space prefix is added are all read from ``hf`` itself, so a tokenizer rebuilt
    with :meth:`from_json` (or loaded with :meth:`from_hf_file`) behaves the same.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        special_tokens: dict[str, int] | None = None,
    ):
        self.hf = hf
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_ids = _dedupe(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos)
        self._lock = threading.Lock()
        self._byte_cache: dict[int, bytes] = {}

        normalizer = _component_json(hf.normalizer)
        pre_tokenizer = _component_json(hf.pre_tokenizer)
        decoder = _component_json(hf.decoder)
        self._byte_level = _mentions(decoder, "ByteLevel") or _mentions(pre_tokenizer, "ByteLevel")
        self._byte_fallback = bool(getattr(hf.model, "byte_fallback", False))
        self._space_mark = not self._byte_level and (
            _mentions(normalizer, "Replace", SPACE_MARK)
            or _mentions(pre_tokenizer, "Metaspace")
            or _mentions(decoder, "Replace", SPACE_MARK)
        )
        # A space prefix added on encoding is removed again on decoding (like HF's Strip).
        self._strip_leading_space = self._space_mark and (
            _mentions(normalizer, "Prepend", SPACE_MARK)
            or _mentions(decoder, "Strip")
            or _mentions(decoder, "Metaspace", '"prepend_scheme": "first"')
            or _mentions(decoder, "Metaspace", '"prepend_scheme": "always"')
        )
        # Added tokens stand for their own text; the special ones can be skipped on decode.
        self._added: dict[int, str] = {}
        special_ids: set[int] = set()
        for tid, tok in hf.get_added_tokens_decoder().items():
            self._added[int(tid)] = tok.content
            if tok.special:
                special_ids.add(int(tid))
        if special_tokens is None:
            special_tokens = {self._added[i]: i for i in sorted(special_ids)}
        self.special_tokens: dict[str, int] = {str(k): int(v) for k, v in special_tokens.items()}
        self._special_ids = frozenset(special_ids | set(self.special_tokens.values()))
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._dropped_id = hf.token_to_id(DROPPED_BYTE)
        if self._dropped_id is not None:
            self._vocab_size = min(self._vocab_size, self._dropped_id)

    # -- basic properties ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def kind(self) -> str:
        """``"bpe"`` (byte-level BPE) or ``"spm"`` (SentencePiece-style pieces)."""
        return "bpe" if self._byte_level else "spm"

    def id_to_token(self, id: int) -> str | None:
        if not 0 <= int(id) < self._vocab_size:
            return None
        return self.hf.id_to_token(int(id))

    def token_to_id(self, tok: str) -> int | None:
        return self.hf.token_to_id(tok)

    def _piece(self, id: int) -> str | None:
        return self.hf.id_to_token(id)

    def is_special(self, id: int) -> bool:
        """True for control tokens (``<|im_start|>``, ``<bos>``, ...)."""
        return int(id) in self._special_ids

    def is_eos(self, id: int) -> bool:
        return int(id) in self.eos_ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, add_bos={self.add_bos})"
        )

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``special=True`` reads control-token texts such as ``<|im_start|>`` as those single
        tokens; ``special=False`` tokenizes them as plain text. ``add_bos=None`` follows the
        model's convention.
        """
        check_text(text)
        # encode_special_tokens is a switch on the shared tokenizer: hold the lock while set
        with self._lock:
            if special:
                ids = self.hf.encode(text, add_special_tokens=False).ids
            else:
                self.hf.encode_special_tokens = True
                try:
                    ids = self.hf.encode(text, add_special_tokens=False).ids
                finally:
                    self.hf.encode_special_tokens = False
        if self._dropped_id is not None:
            ids = [i for i in ids if i != self._dropped_id]
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            return [self.bos_id, *ids]
        return list(ids)

    # -- decoding -----------------------------------------------------------------------------

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (control tokens: their text as UTF-8)."""
        id = int(id)
        cached = self._byte_cache.get(id)
        if cached is not None:
            return cached
        if not 0 <= id < self._vocab_size:
            raise TokenIdError(f"token id {id} is out of range 0..{self._vocab_size - 1}")
        if id in self._added:
            out = self._added[id].encode("utf-8")
        else:
            text = self._piece(id)
            if text is None:
                out = b""
            elif self._byte_level:
                try:
                    out = bytes(_CHAR_TO_BYTE[c] for c in text)
                except KeyError:  # not a byte-level string: stands for itself
                    out = text.encode("utf-8")
            else:
                m = _BYTE_TOKEN_RE.fullmatch(text) if self._byte_fallback else None
                if m is not None:
                    out = bytes([int(m.group(1), 16)])
                elif self._space_mark:
                    out = text.replace(SPACE_MARK, " ").encode("utf-8")
                else:
                    out = text.encode("utf-8")
        self._byte_cache[id] = out
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    # -- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "pocketlm-tokenizer",
                "version": 1,
                "hf": self.hf.to_str(),
                "bos_id": self.bos_id,
                "eos_ids": self.eos_ids,
                "add_bos": self.add_bos,
                "special_tokens": self.special_tokens,
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, s: str) -> Tokenizer:
        try:
            data = json.loads(s)
            if "spm" in data:
                return SpmTokenizer._from_data(data)
            hf = _hf_from_str(data["hf"])
            return cls(
                hf,
                bos_id=data.get("bos_id"),
                eos_ids=list(data.get("eos_ids") or []),
                add_bos=bool(data.get("add_bos", False)),
                special_tokens=data.get("special_tokens"),
            )
        except Exception as e:  # tokenizers raises a bare Exception
            raise FormatError(f"not a serialised pocketlm tokenizer: {e}") from e

    @classmethod
    def from_hf_file(
        cls, tokenizer_json_path: str | Path, tokenizer_config: dict | None = None
    ) -> Tokenizer:
        """Load a Hugging Face ``tokenizer.json``; BOS/EOS/add_bos come from
        ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``add_bos_token``) when given."""
        path = Path(tokenizer_json_path)
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise FormatError(f"{path}: cannot load as a Hugging Face tokenizer.json: {e}") from e
        cfg = tokenizer_config or {}

        def tok_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            if not isinstance(value, str):
                return None
            return hf.token_to_id(value)

        bos_id = tok_id(cfg.get("bos_token"))
        eos_ids: list[int] = []
        eos = cfg.get("eos_token")
        for e in eos if isinstance(eos, list) else [eos]:
            i = tok_id(e)
            if i is not None:
                eos_ids.append(i)
        for text in _EOG_TEXTS:
            i = hf.token_to_id(text)
            if i is not None:
                eos_ids.append(i)
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:
            add_bos = bos_id is not None and _post_processor_adds(hf, bos_id)
        return cls(hf, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos)


class SpmTokenizer(Tokenizer):
    """A SentencePiece vocabulary run by the ``sentencepiece`` library, split the way llama.cpp
    splits it.

    The vocabulary travels as a serialised SentencePiece ``ModelProto`` (BPE, byte fallback,
    no normalisation besides spaces becoming ``▁``): a few MB that load in milliseconds, where
    the same 262k-piece vocabulary as a Hugging Face BPE model needs every split of every piece
    as a merge (about 180 MB resident and twice that while it is built).

    Control and user-defined tokens are cut out of the text first, longest token first as
    llama.cpp does (user-defined ones always, control ones only with ``special=True``); each
    piece of text between them is encoded on its own, with a leading space when the model asks
    for a space prefix and the piece starts the text or follows a token.
    """

    def __init__(
        self,
        proto: bytes,
        *,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        add_space_prefix: bool,
        special_tokens: dict[str, int],
        user_defined: dict[str, int],
    ):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(bytes(proto))
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own text
            raise FormatError(f"cannot load the SentencePiece vocabulary: {e}") from e
        self.sp = sp  # holds the vocabulary; to_json() asks it for the serialised model
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_ids = _dedupe(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos)
        self.add_space_prefix = bool(add_space_prefix)
        self.special_tokens = {str(k): int(v) for k, v in special_tokens.items()}
        self.user_defined = {str(k): int(v) for k, v in user_defined.items()}
        self._special_ids = frozenset(self.special_tokens.values())
        self._added = {i: t for t, i in {**self.special_tokens, **self.user_defined}.items()}
        self._byte_cache = {}
        self._byte_level = False
        self._byte_fallback = True
        self._space_mark = True
        self._strip_leading_space = self.add_space_prefix
        self._vocab_size = sp.get_piece_size()
        self._dropped_id = None
        self._lock = threading.Lock()
        self._finders: dict[bool, tuple[re.Pattern | None, dict[str, int]]] = {}

    @property
    def kind(self) -> str:
        return "spm"

    def id_to_token(self, id: int) -> str | None:
        if not 0 <= int(id) < self._vocab_size:
            return None
        return self.sp.id_to_piece(int(id))

    def token_to_id(self, tok: str) -> int | None:
        i = self.special_tokens.get(tok, self.user_defined.get(tok))
        if i is not None:
            return i
        i = self.sp.piece_to_id(tok)
        # sentencepiece answers the unknown id for a piece it does not have
        return i if self.sp.id_to_piece(i) == tok else None

    def _piece(self, id: int) -> str | None:
        return self.sp.id_to_piece(id)

    def _finder(self, special: bool) -> tuple[re.Pattern | None, dict[str, int]]:
        """A regex matching every token text that is cut out of the text (longest first), and
        those texts' ids; built once per ``special``."""
        if special not in self._finders:
            table = {**self.user_defined, **(self.special_tokens if special else {})}
            texts = sorted(table, key=lambda t: (-len(t), t))
            self._finders[special] = (
                re.compile("|".join(re.escape(t) for t in texts)) if texts else None, table)
        return self._finders[special]

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """``text`` as raw-text pieces and token ids, as llama.cpp partitions it: each token
        text, longest first, is cut out of the raw pieces wherever it occurs."""
        finder, table = self._finder(special)
        if finder is None or not text:
            return [text] if text else []
        present = {m.group(0) for m in finder.finditer(text)}
        if not present:
            return [text]
        parts: list[str | int] = [text]
        for tok in sorted(present, key=lambda t: (-len(t), t)):
            tid = table[tok]
            out: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or tok not in part:
                    out.append(part)
                    continue
                pieces = part.split(tok)
                for k, piece in enumerate(pieces):
                    if k:
                        out.append(tid)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        check_text(text)
        ids: list[int] = []
        after_token = True  # the text's start counts as following a token
        for part in self._partition(text, special):
            if isinstance(part, int):
                ids.append(part)
                after_token = True
                continue
            if self.add_space_prefix and after_token:
                part = " " + part
            ids.extend(self.sp.encode(part))
            after_token = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "pocketlm-tokenizer",
                "version": 2,
                "spm": base64.b64encode(self.sp.serialized_model_proto()).decode("ascii"),
                "bos_id": self.bos_id,
                "eos_ids": self.eos_ids,
                "add_bos": self.add_bos,
                "add_space_prefix": self.add_space_prefix,
                "special_tokens": self.special_tokens,
                "user_defined": self.user_defined,
            },
            ensure_ascii=False,
        )

    @classmethod
    def _from_data(cls, data: dict) -> SpmTokenizer:
        return cls(
            base64.b64decode(data["spm"], validate=True),
            bos_id=data.get("bos_id"),
            eos_ids=list(data.get("eos_ids") or []),
            add_bos=bool(data.get("add_bos", False)),
            add_space_prefix=bool(data.get("add_space_prefix", False)),
            special_tokens=data.get("special_tokens") or {},
            user_defined=data.get("user_defined") or {},
        )


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


def _hf_from_str(text: str) -> tokenizers.Tokenizer:
    """``tokenizers.Tokenizer.from_str``, then the freed heap handed back to the system.

    Deserialising a BPE model from JSON holds several times its final size, and the C heap
    keeps that after it is freed (SmolLM2's 49k merges: +41 MB resident) unless it is returned
    (:func:`release_free_heap`): then qwen2.5's 151k-merge tokenizer loads in 0.37 s with a
    54 MB resident set.
    """
    try:
        return tokenizers.Tokenizer.from_str(text)
    finally:
        release_free_heap()


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; a no-op
    elsewhere): parsing leaves megabytes of freed but resident memory behind."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):  # not glibc
                pass
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def check_text(text: Any, what: str = "text") -> str:
    """``text`` if it is a str that encodes as UTF-8; else a :class:`TextError` saying where not.

    Python strings can hold lone surrogates (U+D800-U+DFFF): what undecodable bytes become
    when read with ``surrogateescape`` (argv, a non-UTF-8 stdin) or a JSON ``"\\ud800"``.
    No tokenizer can encode them.
    """
    if not isinstance(text, str):
        raise TextError(f"{what} must be a str, got {type(text).__name__}")
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise TextError(
            f"{what} is not valid Unicode: a lone surrogate U+{ord(bad):04X} at character "
            f"{exc.start} (undecodable bytes in the input?); send UTF-8 text"
        ) from None
    return text


class StreamingDetokenizer:
    """Feed token ids one at a time; returns text pieces that never split a UTF-8 character
    (important for Chinese/emoji)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False  # whether any text has been emitted yet

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self.tokenizer._strip_leading_space and text.startswith(" "):
                text = text[1:]
        return text

    def add(self, id: int) -> str:
        """Text that became complete with this token (``''`` if waiting for more bytes)."""
        if self.skip_special and self.tokenizer.is_special(id):
            return ""
        return self._emit(self._decoder.decode(self.tokenizer.token_bytes(id), final=False))

    def flush(self) -> str:
        """Whatever is left (invalid trailing bytes become U+FFFD); the stream can go on."""
        return self._emit(self._decoder.decode(b"", final=True))

    def reset(self) -> None:
        self._decoder.reset()
        self._started = False


# ---------------------------------------------------------------------------------------------
# building from GGUF metadata
# ---------------------------------------------------------------------------------------------


def tokenizer_from_gguf_fields(fields: dict) -> Tokenizer:
    """Build the :class:`Tokenizer` described by a GGUF file's ``tokenizer.ggml.*`` metadata.

    ``fields`` maps metadata keys to plain Python values, as in
    ``{k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}``.
    """
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise FormatError(
            "the GGUF file has no tokenizer (tokenizer.ggml.model is missing); "
            f"supported tokenizer models: {', '.join(SUPPORTED_MODELS)}"
        )
    model = str(model)
    if model not in SUPPORTED_MODELS:
        raise UnsupportedError(
            f"tokenizer.ggml.model = {model!r} is not supported; supported: "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
        )

    tokens = _str_list(fields, "tokenizer.ggml.tokens", required=True)
    n = len(tokens)
    if n == 0:
        raise FormatError("tokenizer.ggml.tokens is empty: the GGUF file has no vocabulary")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _int_array(fields, "tokenizer.ggml.token_type", n, default=TT_NORMAL)
    # llama.cpp treats these as control tokens whatever the converter said
    for i, t in enumerate(tokens):
        if t in _EOG_TEXTS and types[i] == TT_NORMAL:
            types[i] = TT_CONTROL

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        j = vocab.setdefault(t, i)
        if j != i:
            raise FormatError(
                f"duplicate token in tokenizer.ggml.tokens: {t!r} has ids {j} and {i}"
            )

    added_tokens = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": bool(types[i] != TT_USER_DEFINED),
        }
        for i in np.flatnonzero(np.isin(types, (TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED))).tolist()
    ]

    unk_id = _spm_unknown_id(fields, tokens, types) if model == "llama" else None
    if unk_id is not None:
        return _spm_tokenizer(fields, tokens, types, unk_id)
    if model == "gpt2":
        spec, add_bos_default = _bpe_spec(fields, tokens, vocab)
    else:
        spec, add_bos_default = _spm_spec(fields, tokens, types, vocab)
    spec["added_tokens"] = added_tokens
    try:
        hf = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as e:  # tokenizers raises a bare Exception
        raise FormatError(f"cannot build the tokenizer from the GGUF vocabulary: {e}") from e

    bos_id = _opt_id(fields, "tokenizer.ggml.bos_token_id", n)
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    add_bos = add_bos_default if add_bos is None else bool(add_bos)
    if bos_id is None:
        add_bos = False

    eos_ids = _eos_ids(fields, vocab.get, types, n)
    special = {
        tokens[i]: i for i in np.flatnonzero(np.isin(types, (TT_UNKNOWN, TT_CONTROL))).tolist()
    }
    return Tokenizer(hf, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, special_tokens=special)


def _bpe_spec(fields: dict, tokens: list[str], vocab: dict[str, int]) -> tuple[dict, bool]:
    """tokenizer.json for a byte-level BPE vocabulary."""
    pre_name = fields.get("tokenizer.ggml.pre")
    pre_name = "default" if pre_name is None else str(pre_name)
    pre = _PRE_TYPES.get(pre_name)
    if pre is None:
        raise UnsupportedError(
            f"tokenizer.ggml.pre = {pre_name!r} (the pre-tokenizer of this byte-level BPE "
            f"vocabulary) is not supported; supported: {', '.join(SUPPORTED_PRE)}"
        )
    raw_merges = _str_list(fields, "tokenizer.ggml.merges", required=True)
    merges: list[list[str]] = []
    for m in raw_merges:
        pos = m.find(" ", 1)
        if pos < 0:
            raise FormatError(
                f"tokenizer.ggml.merges: entry {m!r} is not two tokens separated by a space"
            )
        a, b = m[:pos], m[pos + 1 :]
        # a merge whose parts or result are not tokens can never fire in the vocabulary
        if a in vocab and b in vocab and (a + b) in vocab:
            merges.append([a, b])

    unk_token = None
    if any(_BYTE_TO_CHAR[b] not in vocab for b in range(256)):
        unk_token = DROPPED_BYTE
        vocab = {**vocab, DROPPED_BYTE: len(tokens)}

    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in pre.regexes
    ]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre.ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return spec, pre.add_bos


def _eos_ids(fields: dict, vocab_get: Any, types: np.ndarray, n: int) -> list[int]:
    eos_ids: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        i = _opt_id(fields, key, n)
        if i is not None:
            eos_ids.append(i)
    for text in _EOG_TEXTS:
        i = vocab_get(text)
        if i is not None and types[i] == TT_CONTROL:
            eos_ids.append(i)
    return eos_ids


def _scores(fields: dict, n: int) -> np.ndarray:
    if "tokenizer.ggml.scores" not in fields:
        return np.zeros(n, dtype=np.float64)
    scores = np.asarray(fields["tokenizer.ggml.scores"], dtype=np.float64)
    if scores.shape != (n,):
        raise FormatError(
            f"tokenizer.ggml.scores has {scores.size} entries but the vocabulary has {n} tokens"
        )
    return scores


_BYTE_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))


def _spm_unknown_id(fields: dict, tokens: list[str], types: np.ndarray) -> int | None:
    """The piece the ``sentencepiece`` library can use as its unknown piece (it needs exactly
    one): the UNKNOWN-typed piece, else the file's ``unknown_token_id`` (Gemma marks ``<unk>``
    as a control token); None when the library cannot hold the vocabulary, which also happens
    without all 256 byte pieces for byte fallback."""
    byte_ids = np.flatnonzero(types == TT_BYTE).tolist()
    if len(byte_ids) != 256 or {tokens[i] for i in byte_ids} != _BYTE_PIECES:
        return None
    unknown = np.flatnonzero(types == TT_UNKNOWN).tolist()
    if len(unknown) == 1:
        return unknown[0]
    if unknown:
        return None
    return _opt_id(fields, "tokenizer.ggml.unknown_token_id", len(tokens))


def _spm_tokenizer(fields: dict, tokens: list[str], types: np.ndarray,
                   unk_id: int) -> SpmTokenizer:
    n = len(tokens)
    scores = _scores(fields, n)
    proto = _spm_model_proto(tokens, scores, types, unk_id)
    add_space_prefix = fields.get("tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    bos_id = _opt_id(fields, "tokenizer.ggml.bos_token_id", n)
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bos_id is not None and (True if add_bos is None else bool(add_bos))
    ids_of = {t: i for i, t in enumerate(tokens)}
    special = {
        tokens[i]: i for i in np.flatnonzero(np.isin(types, (TT_UNKNOWN, TT_CONTROL))).tolist()
    }
    user = {tokens[i]: i for i in np.flatnonzero(types == TT_USER_DEFINED).tolist()}
    return SpmTokenizer(
        proto,
        bos_id=bos_id,
        eos_ids=_eos_ids(fields, ids_of.get, types, n),
        add_bos=add_bos,
        add_space_prefix=add_space_prefix,
        special_tokens=special,
        user_defined=user,
    )


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_bytes(field: int, value: bytes) -> bytes:
    return _pb_varint(field << 3 | 2) + _pb_varint(len(value)) + value


def _pb_int(field: int, value: int) -> bytes:
    return _pb_varint(field << 3) + _pb_varint(value)


def _spm_model_proto(tokens: list[str], scores: np.ndarray, types: np.ndarray,
                     unk_id: int) -> bytes:
    """A serialised SentencePiece ``ModelProto`` for the vocabulary: BPE over the pieces and
    their scores, byte fallback, no normalisation except spaces written as ``▁``.

    Written field by field (protobuf wire format) so that no protobuf runtime is needed: each
    piece is ``{1: text, 2: score (float32), 3: type}``; the trainer spec says BPE (field 3 =
    2), its size (4), byte fallback (35) and the unknown id (40); the normaliser spec is
    ``identity`` (1) without a dummy prefix (3 = 0), keeping repeated spaces (4 = 0) and
    escaping spaces (5 = 1). GGUF token types are SentencePiece's own numbering.
    """
    score32 = np.asarray(scores, dtype="<f4")
    piece_types = np.where(types == TT_UNDEFINED, TT_NORMAL, types)
    piece_types[unk_id] = TT_UNKNOWN
    piece_types = piece_types.tolist()
    score_bytes = [score32[i : i + 1].tobytes() for i in range(len(tokens))]
    parts = []
    for text, sc, ty in zip(tokens, score_bytes, piece_types):
        body = _pb_bytes(1, text.encode("utf-8")) + b"\x15" + sc + _pb_int(3, ty)
        parts.append(_pb_bytes(1, body))
    trainer = (
        _pb_int(3, 2) + _pb_int(4, len(tokens)) + _pb_int(35, 1) + _pb_int(40, unk_id)
        + _pb_int(41, (1 << 64) - 1) + _pb_int(42, (1 << 64) - 1) + _pb_int(43, (1 << 64) - 1)
    )
    normalizer = _pb_bytes(1, b"identity") + _pb_int(3, 0) + _pb_int(4, 0) + _pb_int(5, 1)
    parts.append(_pb_bytes(2, trainer))
    parts.append(_pb_bytes(3, normalizer))
    return b"".join(parts)


def _spm_spec(
    fields: dict, tokens: list[str], types: np.ndarray, vocab: dict[str, int]
) -> tuple[dict, bool]:
    """tokenizer.json for a SentencePiece vocabulary, as llama.cpp's SPM tokenizer runs it."""
    n = len(tokens)
    scores = _scores(fields, n)
    merges = _spm_merges(tokens, scores, vocab)

    add_space_prefix = fields.get("tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    norms: list[dict] = []
    if add_space_prefix:
        norms.append({"type": "Prepend", "prepend": SPACE_MARK})
    norms.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK})
    decoders: list[dict] = [
        {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})

    unk_id = _opt_id(fields, "tokenizer.ggml.unknown_token_id", n)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": {"type": "Sequence", "normalizers": norms},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None if unk_id is None else tokens[unk_id],
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return spec, True


def _spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[list[str]]:
    """Every split of every piece into two pieces, best-scoring result first (ties by id).

    With these as BPE merges, BPE's "apply the best-ranked adjacent pair" is llama.cpp's
    "merge the adjacent pair whose concatenation is the highest-scoring piece".
    """
    res: list[int] = []
    left: list[int] = []
    right: list[int] = []
    get = vocab.get
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a = get(t[:k])
            if a is not None:
                b = get(t[k:])
                if b is not None:
                    res.append(i)
                    left.append(a)
                    right.append(b)
    if not res:
        return []
    res_a = np.asarray(res, dtype=np.int64)
    # sort by the result's score (best first), then the result's id, then the left piece's id;
    # the last key only fixes an order between splits of one piece, which never compete in
    # practice
    order = np.lexsort((np.asarray(left), res_a, -scores[res_a]))
    return [[tokens[left[j]], tokens[right[j]]] for j in order.tolist()]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _str_list(fields: dict, key: str, *, required: bool) -> list[str]:
    value = fields.get(key)
    if value is None:
        if required:
            raise FormatError(
                f"the GGUF file has no {key}: the tokenizer cannot be built without it"
            )
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise FormatError(f"{key} should be a list of strings, found {type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        elif not isinstance(v, str):
            raise FormatError(
                f"{key} should be a list of strings, found an element of type {type(v).__name__}"
            )
        out.append(v)
    return out


def _int_array(fields: dict, key: str, n: int, *, default: int) -> np.ndarray:
    value = fields.get(key)
    if value is None:
        return np.full(n, default, dtype=np.int32)
    try:
        arr = np.asarray(value, dtype=np.int32).copy()
    except (TypeError, ValueError, OverflowError):
        raise FormatError(f"{key} should be an array of {n} integers, found "
                          f"{type(value).__name__}") from None
    if arr.shape != (n,):
        raise FormatError(f"{key} has {arr.size} entries but the vocabulary has {n} tokens")
    return arr


def _opt_id(fields: dict, key: str, n: int) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    try:
        i = int(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"{key} should be a token id, found {value!r}") from e
    if not 0 <= i < n:
        return None  # out of range: llama.cpp ignores it too
    return i


def _dedupe(ids: Iterable[int]) -> list[int]:
    seen: set[int] = set()
    out: list[int] = []
    for i in ids:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


def _mentions(node: Any, type_name: str, content: str | None = None) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) contains ``type_name``
    (whose fields mention ``content``, if given)."""
    if isinstance(node, list):
        return any(_mentions(x, type_name, content) for x in node)
    if not isinstance(node, dict):
        return False
    if node.get("type") == type_name and (
        content is None or content in json.dumps(node, ensure_ascii=False)
    ):
        return True
    return any(
        _mentions(v, type_name, content) for v in node.values() if isinstance(v, (dict, list))
    )


def _component_json(component: Any) -> Any:
    """The tokenizer.json form of one component (normalizer, decoder, ...), or None."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except Exception:
        return None


def _post_processor_adds(hf: tokenizers.Tokenizer, token_id: int) -> bool:
    """Whether the tokenizer's own post-processor puts ``token_id`` in front of a sequence."""
    try:
        return hf.encode("a", add_special_tokens=True).ids[:1] == [token_id]
    except Exception:
        return False
