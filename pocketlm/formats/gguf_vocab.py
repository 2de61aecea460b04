"""Tokenizers rebuilt from a GGUF file's vocabulary, with token ids equal to llama.cpp's.

A GGUF file stores its tokenizer as metadata: the token strings, their types, the BPE merges
(byte-level BPE, ``tokenizer.ggml.model = "gpt2"``) or the piece scores (SentencePiece,
``"llama"``), and a *name* for the pre-tokenizer (``tokenizer.ggml.pre``) whose regexes are not
stored in the file but compiled into llama.cpp. :func:`tokenizer_from_gguf_fields` turns that
metadata into a :class:`pocketlm.tokenizer.Tokenizer` that splits text the way llama.cpp does:

* **byte-level BPE** — the pre-tokenizer is the chain of regex splits llama.cpp runs for the
  given ``tokenizer.ggml.pre`` (each regex isolates its matches inside the pieces left by the
  previous one), followed by the GPT-2 byte-to-unicode mapping; the model is BPE with the
  file's merges, ranked by their order.
* **SentencePiece** — llama.cpp starts from single characters and repeatedly merges the
  adjacent pair whose concatenation is the highest-scoring vocabulary piece, which is what the
  ``sentencepiece`` library's BPE model does: the vocabulary becomes a SentencePiece model
  (:class:`~pocketlm.tokenizer.SpmTokenizer`, a few MB however large the vocabulary), written
  here as a protobuf ``ModelProto`` without a protobuf runtime. For the rare file that
  library cannot hold (no unknown piece, incomplete byte pieces), a Hugging Face BPE model
  reproduces this when its merge list holds, for every piece, every split of it into two
  vocabulary pieces, ranked by the score of the piece (the one possible difference: where two
  overlapping pairs make different pieces of equal score, llama.cpp takes the leftmost and BPE
  the lower id); unknown characters fall back to ``<0xNN>`` byte tokens. Spaces become ``▁``
  (with a leading ``▁`` only if the file asks for a space prefix).
* **special tokens** — CONTROL tokens become special added tokens (matched in text only when
  ``special=True``, like llama.cpp's ``parse_special``); USER_DEFINED tokens become ordinary
  added tokens, matched always, as llama.cpp does.

This runs when a GGUF file is imported (packing, ``precision="float"``); a deploy file holds
the result, serialised, and loading it needs only :mod:`pocketlm.tokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import tokenizers

from ..errors import FormatError, UnsupportedError
from ..tokenizer import BYTE_TO_CHAR, DROPPED_BYTE, EOG_TEXTS, SPACE_MARK, SpmTokenizer, Tokenizer

__all__ = ["SUPPORTED_MODELS", "SUPPORTED_PRE", "tokenizer_from_gguf_fields"]

# GGUF token types (llama.cpp's llama_token_type).
TT_UNDEFINED = 0
TT_NORMAL = 1
TT_UNKNOWN = 2
TT_CONTROL = 3
TT_USER_DEFINED = 4
TT_UNUSED = 5
TT_BYTE = 6

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
        if t in EOG_TEXTS and types[i] == TT_NORMAL:
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
        return _spm_tokenizer(fields, tokens, types, vocab, unk_id)
    if model == "gpt2":
        spec, add_bos_default = _bpe_spec(fields, tokens, vocab)
    else:
        spec, add_bos_default = _spm_spec(fields, tokens, types, vocab)
    spec["added_tokens"] = added_tokens
    try:
        hf = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as e:  # tokenizers raises a bare Exception
        raise FormatError(f"cannot build the tokenizer from the GGUF vocabulary: {e}") from e

    bos_id, add_bos = _bos(fields, n, add_bos_default)
    eos_ids = _eos_ids(fields, vocab.get, types, n)
    special = _control_tokens(tokens, types)
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
    if any(BYTE_TO_CHAR[b] not in vocab for b in range(256)):
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


def _bos(fields: dict, n: int, add_bos_default: bool) -> tuple[int | None, bool]:
    """The BOS id and whether it is added: the file's flag, else ``add_bos_default``; never
    without a BOS id."""
    bos_id = _opt_id(fields, "tokenizer.ggml.bos_token_id", n)
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    add_bos = add_bos_default if add_bos is None else bool(add_bos)
    return bos_id, bos_id is not None and add_bos


def _control_tokens(tokens: list[str], types: np.ndarray) -> dict[str, int]:
    """The special tokens (text -> id): the UNKNOWN and CONTROL ones."""
    return {
        tokens[i]: i for i in np.flatnonzero(np.isin(types, (TT_UNKNOWN, TT_CONTROL))).tolist()
    }


def _add_space_prefix(fields: dict) -> bool:
    """Whether a SentencePiece vocabulary puts a space before the text (the default)."""
    value = fields.get("tokenizer.ggml.add_space_prefix")
    return True if value is None else bool(value)


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
    for text in EOG_TEXTS:
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


def _spm_tokenizer(fields: dict, tokens: list[str], types: np.ndarray, vocab: dict[str, int],
                   unk_id: int) -> SpmTokenizer:
    n = len(tokens)
    scores = _scores(fields, n)
    proto = _spm_model_proto(tokens, scores, types, unk_id)
    bos_id, add_bos = _bos(fields, n, True)
    user = {tokens[i]: i for i in np.flatnonzero(types == TT_USER_DEFINED).tolist()}
    return SpmTokenizer(
        proto,
        bos_id=bos_id,
        eos_ids=_eos_ids(fields, vocab.get, types, n),
        add_bos=add_bos,
        add_space_prefix=_add_space_prefix(fields),
        special_tokens=_control_tokens(tokens, types),
        user_defined=user,
    )


def _spm_spec(
    fields: dict, tokens: list[str], types: np.ndarray, vocab: dict[str, int]
) -> tuple[dict, bool]:
    """tokenizer.json for a SentencePiece vocabulary, as llama.cpp's SPM tokenizer runs it."""
    n = len(tokens)
    scores = _scores(fields, n)
    merges = spm_merges(tokens, scores, vocab)

    unk_id = _opt_id(fields, "tokenizer.ggml.unknown_token_id", n)
    spec = spm_bpe_spec(vocab, merges, None if unk_id is None else tokens[unk_id],
                        _add_space_prefix(fields))
    return spec, True


def spm_bpe_spec(vocab: dict[str, int], merges: list[list[str]], unk_token: str | None,
                 add_space_prefix: bool, added_tokens: list[dict] | None = None) -> dict:
    """The ``tokenizer.json`` of a SentencePiece vocabulary run as a byte-fallback BPE: spaces
    as ``▁`` (one in front of the text when ``add_space_prefix``), ``merges`` from
    :func:`spm_merges`, ``added_tokens`` matched before anything else."""
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
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    if added_tokens is not None:
        spec = {"version": "1.0", "truncation": None, "padding": None,
                "added_tokens": added_tokens, **spec}
    return spec


def spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[list[str]]:
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
# the SentencePiece model, in protobuf wire format
# ---------------------------------------------------------------------------------------------


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
