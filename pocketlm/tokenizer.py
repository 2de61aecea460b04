"""The runtime tokenizer: text to token ids and back, as a model's deploy file describes it.

:class:`Tokenizer` wraps a Hugging Face :class:`tokenizers.Tokenizer` (byte-level BPE or
SentencePiece-style pieces) with the model's BOS/EOS conventions, raw token bytes and JSON
round-tripping (the form a deploy file stores); :class:`SpmTokenizer` runs a SentencePiece
vocabulary with the ``sentencepiece`` library, split the way llama.cpp splits it;
:class:`StreamingDetokenizer` turns a stream of ids into text that never splits a UTF-8
character. Tokenizers are built from a GGUF file's vocabulary by
:mod:`pocketlm.formats.gguf_vocab` and from a Hugging Face ``tokenizer.json`` by
:meth:`Tokenizer.from_hf_file`.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import json
import operator
import re
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from .errors import FormatError, TextError, TokenIdError

__all__ = [
    "SpmTokenizer",
    "StreamingDetokenizer",
    "Tokenizer",
    "check_text",
    "release_free_heap",
]

SPACE_MARK = "\u2581"  # '▁', SentencePiece's visible space

# Placeholder appended to byte-level vocabularies that lack some of the 256 byte tokens. llama.cpp
# drops a byte it has no token for, but never merges the pieces on either side of it; as BPE's
# unknown token the placeholder keeps them apart, and encode() then removes it.
DROPPED_BYTE = "<|pocketlm:dropped-byte|>"

# Token texts that end a turn or the text. llama.cpp treats them as control tokens even when a
# converter marked them as normal ones; the chat-ending ones are also generation stoppers.
EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
)

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


BYTE_TO_CHAR = _byte_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
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
        # pocketlm encodes one text at a time, whole: a tokenizer.json that pads or truncates
        # (a fixed padding length pads every text to it, so 10**8 took 10 GB per encode) has
        # both turned off
        hf.no_padding()
        hf.no_truncation()
        self.hf = hf
        self.bos_id = None if bos_id is None else _token_id(bos_id, "bos_id")
        self.eos_ids = _dedupe(_token_id(i, "eos_ids") for i in eos_ids)
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
        self.special_tokens: dict[str, int] = {
            str(k): _token_id(v, f"special token {k!r}") for k, v in special_tokens.items()}
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

    def control_finder(self, template: str | None = None) -> LiteralFinder:
        """What finds control-token texts: every control token's (``<|im_end|>``), and, given
        a chat template, every other added token's text the template writes (Qwen's
        ``<tool_call>``, an added token not marked special: the template's structure all the
        same), whitespace aside (Gemma's user-defined ``\\n``). Added tokens no template
        writes (Gemma's ``<table>``) are the model's text."""
        cache = self.__dict__.setdefault("_control_finders", {})
        finder = cache.get(template)
        if finder is None:
            texts = {t for t in self.special_tokens if t}
            if template:
                texts |= {t for t in self._added.values()
                          if t and not t.isspace() and t in template}
            if len(cache) >= 8:
                cache.pop(next(iter(cache), None), None)  # another thread may have evicted it
            finder = cache[template] = LiteralFinder(texts)
        return finder

    def control_text_in(self, text: str, template: str | None = None) -> str | None:
        """The first control token's text (``<|im_end|>``) that ``text`` spells, or None
        (``template``: as :meth:`control_finder` takes it)."""
        return next(iter(self.control_finder(template).findall(text)), None)

    def encode_text(self, text: str) -> list[int]:
        """The ids (no BOS) of ``text`` read as text throughout: no token's text in it is cut
        out as that token, an added one that :meth:`encode` always cuts out included (Qwen's
        ``<tool_call>`` with ``special=False``). For control-token text a user wrote."""
        check_text(text)
        hf = self.hf
        with untokenizable():
            n = hf.normalizer.normalize_str(text) if hf.normalizer is not None else text
            pieces = (hf.pre_tokenizer.pre_tokenize_str(n) if hf.pre_tokenizer is not None
                      else [(n, None)])
            ids = [t.id for piece, _ in pieces for t in hf.model.tokenize(piece)]
        return [i for i in ids if i != self._dropped_id]

    def is_special(self, id: int) -> bool:
        """True for control tokens (``<|im_start|>``, ``<bos>``, ...)."""
        return _checked_id(id) in self._special_ids

    def is_eos(self, id: int) -> bool:
        return _checked_id(id) in self.eos_ids

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
        check_whitespace_runs([text])
        with self._lock, untokenizable():
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

    def encode_batch(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        """:meth:`encode` of each text, without BOS, on all cores."""
        for t in texts:
            check_text(t)
        check_whitespace_runs(texts)
        with self._lock, untokenizable():
            if not special:
                self.hf.encode_special_tokens = True
            try:
                encs = self.hf.encode_batch(texts, add_special_tokens=False)
            finally:
                self.hf.encode_special_tokens = False
        drop = self._dropped_id
        return [[i for i in e.ids if i != drop] if drop is not None else list(e.ids)
                for e in encs]

    # -- decoding -----------------------------------------------------------------------------

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (control tokens: their text as UTF-8)."""
        id = _checked_id(id)
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
        if isinstance(ids, (str, bytes, bytearray)):  # their characters or bytes are no ids
            raise TokenIdError(f"decode takes a sequence of token ids, got "
                               f"{type(ids).__name__}")
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    # -- serialisation ------------------------------------------------------------------------

    def to_json(self) -> str:
        return self._serialise(1, {"hf": self.hf.to_str()}, special_tokens=self.special_tokens)

    def _serialise(self, version: int, vocabulary: dict[str, str], **options: Any) -> str:
        """The JSON that :meth:`from_json` reads: the vocabulary (``"hf"`` or ``"spm"``), the
        BOS/EOS conventions, then ``options``."""
        return json.dumps(
            {
                "format": "pocketlm-tokenizer",
                "version": version,
                **vocabulary,
                "bos_id": self.bos_id,
                "eos_ids": self.eos_ids,
                "add_bos": self.add_bos,
                **options,
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
        for text in EOG_TEXTS:
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
        self.bos_id = None if bos_id is None else _token_id(bos_id, "bos_id")
        self.eos_ids = _dedupe(_token_id(i, "eos_ids") for i in eos_ids)
        self.add_bos = bool(add_bos)
        self.add_space_prefix = bool(add_space_prefix)
        self.special_tokens = {str(k): _token_id(v, f"special token {k!r}")
                               for k, v in special_tokens.items()}
        self.user_defined = {str(k): _token_id(v, f"user-defined piece {k!r}")
                             for k, v in user_defined.items()}
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
        self._finders: dict[bool, tuple[LiteralFinder | None, dict[str, int]]] = {}

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

    def _finder(self, special: bool) -> tuple[LiteralFinder | None, dict[str, int]]:
        """What finds every token text that is cut out of the text (longest first), and those
        texts' ids; built once per ``special``."""
        if special not in self._finders:
            table = {**self.user_defined, **(self.special_tokens if special else {})}
            self._finders[special] = (LiteralFinder(table) if table else None, table)
        return self._finders[special]

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """``text`` as raw-text pieces and token ids, as llama.cpp partitions it: each token
        text, longest first, is cut out of the raw pieces wherever it occurs."""
        finder, table = self._finder(special)
        if finder is None or not text:
            return [text] if text else []
        present = set(finder.findall(text))
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

    def encode_batch(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_bos=False, special=special) for t in texts]

    def encode_text(self, text: str) -> list[int]:
        check_text(text)
        ids = self.sp.encode(text)
        if any(i in self._added for i in ids):
            # SentencePiece itself matches its user-defined pieces: one character at a time,
            # none can be spelled
            ids = [i for c in text for i in self.sp.encode(c)]
        return ids

    def to_json(self) -> str:
        proto = base64.b64encode(self.sp.serialized_model_proto()).decode("ascii")
        return self._serialise(2, {"spm": proto}, add_space_prefix=self.add_space_prefix,
                               special_tokens=self.special_tokens,
                               user_defined=self.user_defined)

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
# loading and text checks
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


def _checked_id(id: Any) -> int:
    """``id`` as a Python int, if it is an integer (numpy's too); else a TokenIdError (a float,
    a bool, a string: ``int()`` would have taken 1.5, True and "1")."""
    if isinstance(id, bool) or not hasattr(id, "__index__"):
        raise TokenIdError(f"token ids must be integers, got {id!r}")
    return operator.index(id)


MAX_WHITESPACE_RUN = 1_000_000


def check_whitespace_runs(texts) -> None:
    """A :class:`TextError` for a text holding a run of :data:`MAX_WHITESPACE_RUN` whitespace
    characters or more, for every tokenizer alike: Qwen's pre-tokenizer pattern gives up on a
    run of about ten million spaces ("retry-limit-in-match over"), with a panic the tokenizers
    library prints before :func:`untokenizable` can name it."""
    for t in texts:
        if len(t) >= MAX_WHITESPACE_RUN and _WHITESPACE_RUN.search(t):
            raise TextError(f"the text holds a run of {MAX_WHITESPACE_RUN:,} or more whitespace "
                            "characters, more than a tokenizer's pattern is sure to match; "
                            "shorten it")


@contextlib.contextmanager
def untokenizable():
    """A failure inside the tokenizers library (a Rust panic: ``pyo3_runtime.PanicException``
    derives from BaseException only, so ``except Exception`` let it through, a traceback in
    the CLI) as a :class:`TextError`."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__module__ != "pyo3_runtime":
            raise  # not the library's panic: a KeyboardInterrupt, a caller's own iterator's
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TextError(f"the text cannot be tokenized ({why})") from None


# anchored at a run's start: tried at every position inside a run, the search was quadratic
# (a 1 MB prompt of spaces then letters held the GIL, and a server, for minutes)
_WHITESPACE_RUN = re.compile(rf"(?<!\s)\s{{{MAX_WHITESPACE_RUN}}}")


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


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


class LiteralFinder:
    """Finds a set of literal texts in a text as their regex alternation, longest first, does
    (leftmost, then the longest text starting there; no overlaps), without compiling one: the
    texts are indexed by their first two characters, so a place costs a dict lookup or two. A
    regex of gemma's 6,400 token texts took a second to compile and 80-180 ms to scan a 12 KB
    prompt."""

    def __init__(self, texts):
        self.texts = frozenset(t for t in texts if t)
        lengths: dict[str, set[int]] = {}  # first two characters -> lengths of 2 and more
        for t in self.texts:
            if len(t) > 1:
                lengths.setdefault(t[:2], set()).add(len(t))
        self.lengths = {k: sorted(v, reverse=True) for k, v in lengths.items()}
        firsts = sorted({t[0] for t in self.texts})
        self.starts = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") \
            if firsts else None

    def findall(self, text: str) -> list[str]:
        return [found for _, found in self.finditer(text)]

    def finditer(self, text: str) -> list[tuple[int, str]]:
        """Each text found, with where it starts."""
        out: list[tuple[int, str]] = []
        if self.starts is None:
            return out
        texts, lengths, search = self.texts, self.lengths, self.starts.search
        m = search(text)
        while m is not None:
            at = m.start()
            found = None
            for n in lengths.get(text[at:at + 2], ()):
                if text[at:at + n] in texts:
                    found = text[at:at + n]
                    break
            if found is None and text[at] in texts:
                found = text[at]
            if found is not None:
                out.append((at, found))
                at += len(found) - 1
            m = search(text, at + 1)
        return out


class StreamingDetokenizer:
    """Feed token ids one at a time; returns text pieces that never split a UTF-8 character
    (important for Chinese/emoji)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True,
                 strip_leading_space: bool | None = None):
        """``strip_leading_space``: drop the space a SentencePiece vocabulary writes before
        the first word, as :meth:`Tokenizer.decode` does for a text from its start (None: the
        tokenizer's rule); False for a continuation, whose first word follows text."""
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._strip = (tokenizer._strip_leading_space if strip_leading_space is None
                       else strip_leading_space)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False  # whether any text has been emitted yet

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._strip and text.startswith(" "):
                text = text[1:]
        return text

    def add(self, id: int) -> str:
        """Text that became complete with this token (``''`` if waiting for more bytes)."""
        if self.skip_special and self.tokenizer.is_special(id):
            return ""
        return self._emit(self._decoder.decode(self.tokenizer.token_bytes(id), final=False))

    def flush(self, *, drop_incomplete: bool = False) -> str:
        """Whatever is left: the first bytes of a character whose last bytes never came
        become U+FFFD, as in :meth:`Tokenizer.decode`, or with ``drop_incomplete`` are left
        out (the end of generation: a token limit or an end token can fall inside a
        character, and the U+FFFD would stand for nothing the model wrote). Any other
        invalid byte already came out of :meth:`add` as U+FFFD. The stream can go on."""
        if drop_incomplete:
            self._decoder.reset()  # holds only the start of one character, never more
            return ""
        return self._emit(self._decoder.decode(b"", final=True))

    def reset(self) -> None:
        self._decoder.reset()
        self._started = False


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _token_id(value: Any, what: str) -> int:
    """A token id a tokenizer's description gives (``bos_id``, an EOS id, a special token's):
    an integer >= 0, not a bool, float or string that happens to convert."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 0:
        raise FormatError(f"the tokenizer's {what} must be a token id (an integer >= 0), "
                          f"got {value!r}")
    return operator.index(value)


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
