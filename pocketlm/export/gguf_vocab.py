"""The tokenizer half of the GGUF export: the deploy file's tokenizer as the ``tokenizer.ggml.*``
keys llama.cpp reads (:func:`tokenizer_fields`), checked on probe texts against the tokenizer
llama.cpp will build from them (:func:`first_difference`). :mod:`pocketlm.export.gguf` writes
them with the weights.

Byte-level BPE vocabularies become ``tokenizer.ggml.model = "gpt2"`` (tokens, types, merges)
with the ``tokenizer.ggml.pre`` name whose built-in llama.cpp regexes are the vocabulary's own
pre-tokenizer; SentencePiece vocabularies (Gemma's, trimmed or not) become ``"llama"`` (tokens,
scores, types). A pre-tokenizer llama.cpp does not know (pocketlm's trained ``pocket-zh-en-v1``)
takes the nearest llama.cpp one that tokenizes every probe text (English, Chinese, code, mixed;
:data:`PROBE_TEXTS`) exactly as the vocabulary does, and the report says so; when none does, the
export is refused. Whatever the case, the tokenizer llama.cpp will build from the written keys
(as :mod:`pocketlm.formats.gguf_vocab` rebuilds it) must tokenize the probe texts exactly as the
deploy file's tokenizer, or nothing is written. BOS/EOS (and EOT/EOM, padding) ids go along.
"""

from __future__ import annotations

import json
from functools import cache, lru_cache
from typing import Any

from ..errors import UnsupportedError
from ..tokenizer import DROPPED_BYTE, EOG_TEXTS, SpmTokenizer, Tokenizer

__all__ = ["PROBE_TEXTS", "TT_BYTE", "TT_CONTROL", "TT_NORMAL", "TT_UNKNOWN", "TT_UNUSED",
           "TT_USER_DEFINED", "first_difference", "probe_texts", "tokenizer_fields"]

# GGUF token types (llama.cpp's llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

# Text every exported tokenizer must split exactly as the deploy file's tokenizer does, in the
# form llama.cpp will run: English prose, Chinese prose, code, mixed scripts, digits, symbols,
# whitespace runs, upper-case contractions.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 3:45 pm; we'll leave at 17:00, won't we?",
    "SHE'S SURE THEY'LL COME, AREN'T THEY? Mr. O'Neil paid $1,234.56 (about 9%) on 2024-03-15.",
    "人工智能正在改变我们的生活。小猫在花园里玩，小狗在河边跑。今天是2024年3月15日，气温23℃。",
    "“你好！”他说：“我们明天见。”《红楼梦》是中国古典小说之一，共一百二十回……",
    "我在用 PyTorch 训练模型，loss 从3.2降到1.5。Hello世界！这是GPT-4o和Qwen2.5的对比。",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];  // dot\n}\nprint(f\"{x!r:>10}\")\n",
    '{"name": "pocketlm", "version": "0.1.0", "tags": ["zh", "en"], "ok": true, "n": null}',
    "Spaces:  two,   three,\ttab,\n\nblank lines,\r\nCRLF, trailing   \n  indented",
    "Émile naïve café — smart “quotes” and ‘single’ ones… 10–20 × 3 ≠ 31 ± 2 → ∞ 😀👍🏽 ©®™",
    "日本語のテキストとカタカナ、한국어 문장도 조금. Ünïcödé ß ﬁ ｆｕｌｌｗｉｄｔｈ １２３",
    "http://example.com/a/b?x=1&y=2#frag user@example.org 0x1F 1e-5 3.14159 -42 +7 100000000",
)


def tokenizer_fields(tokenizer: Tokenizer, n_vocab: int) -> tuple[dict[str, Any], dict]:
    """The ``tokenizer.ggml.*`` keys (plain values, as ``GGUFReader`` fields read back) that
    make llama.cpp tokenize as ``tokenizer`` does, for an embedding of ``n_vocab`` rows, and a
    description for the report. Raises UnsupportedError when no GGUF tokenizer does."""
    if isinstance(tokenizer, SpmTokenizer):
        return _spm_fields(tokenizer, n_vocab)
    if tokenizer.kind == "bpe":
        return _bpe_fields(tokenizer, n_vocab)
    raise UnsupportedError("the tokenizer is a Hugging Face BPE with byte fallback "
                           "(SentencePiece pieces): GGUF export needs it as a SentencePiece "
                           "model; pack the model from its GGUF file instead")


def _pad_tokens(tokens: list[str | None], types: list[int]) -> None:
    """Fill ids no piece has (an embedding wider than the vocabulary) with unused pieces."""
    taken = set(t for t in tokens if t is not None)
    for i, t in enumerate(tokens):
        if t is None:
            pad = f"[PAD{i}]"
            while pad in taken:
                pad = f"[{pad}]"
            tokens[i] = pad
            types[i] = TT_UNUSED


def _spm_fields(tok: SpmTokenizer, n_vocab: int) -> tuple[dict[str, Any], dict]:
    sp = tok.sp
    n = sp.get_piece_size()
    if n > n_vocab:
        raise UnsupportedError(f"the tokenizer has {n} pieces but the embedding only "
                               f"{n_vocab} rows")
    tokens: list[str | None] = [None] * n_vocab
    types = [TT_UNUSED] * n_vocab
    scores = [0.0] * n_vocab
    user = set(tok.user_defined.values())
    for i in range(n):
        tokens[i] = sp.id_to_piece(i)
        scores[i] = float(sp.get_score(i))
        if sp.is_unknown(i):
            types[i] = TT_UNKNOWN
        elif i in user:
            types[i] = TT_USER_DEFINED
        elif sp.is_control(i):
            types[i] = TT_CONTROL
        elif sp.is_byte(i):
            types[i] = TT_BYTE
        elif sp.is_unused(i):
            types[i] = TT_UNUSED
        else:
            types[i] = TT_NORMAL
    _pad_tokens(tokens, types)
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": bool(tok.add_space_prefix),
    }
    unk = [i for i in range(n) if types[i] == TT_UNKNOWN]
    if unk:
        fields["tokenizer.ggml.unknown_token_id"] = unk[0]
    fields.update(_special_ids(tok, tokens))
    return fields, {"model": "llama", "kind": "SentencePiece", "pre": None, "tokens": n_vocab,
                    "exact": True}


def _bpe_fields(tok: Tokenizer, n_vocab: int) -> tuple[dict[str, Any], dict]:
    spec = json.loads(tok.hf.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedError(f"the tokenizer's model is {model.get('type')!r}; GGUF holds "
                               "byte-level BPE and SentencePiece vocabularies")
    n = tok.vocab_size
    if n > n_vocab:
        raise UnsupportedError(f"the tokenizer has {n} tokens but the embedding only "
                               f"{n_vocab} rows")
    tokens: list[str | None] = [None] * n_vocab
    types = [TT_NORMAL] * n_vocab
    for text, i in model.get("vocab", {}).items():
        if i < n and text != DROPPED_BYTE:
            tokens[i] = text
    for added in spec.get("added_tokens") or []:
        i = int(added["id"])
        if i < n:
            tokens[i] = added["content"]
            types[i] = TT_CONTROL if added.get("special", True) else TT_USER_DEFINED
    _pad_tokens(tokens, types)
    merges = []
    for m in model.get("merges", []):
        a, b = m if isinstance(m, (list, tuple)) else m.split(" ", 1)
        if " " in a or " " in b:
            raise UnsupportedError(f"the BPE merge {a!r} + {b!r} holds a space, which GGUF's "
                                   "merge list cannot store")
        merges.append(f"{a} {b}")
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    fields.update(_special_ids(tok, tokens))
    pre = _pre_name(spec)
    info = {"model": "gpt2", "kind": "byte-level BPE", "tokens": n_vocab}
    if pre is not None:
        fields["tokenizer.ggml.pre"] = pre
        info.update(pre=pre, exact=True)
        return fields, info
    # a pre-tokenizer llama.cpp does not have: the nearest one that agrees on every probe
    for name in _PRE_PREFERENCE:
        fields["tokenizer.ggml.pre"] = name
        if first_difference(tok, fields) is None:
            info.update(pre=name, exact=False)
            return fields, info
    raise UnsupportedError("the tokenizer's pre-tokenizer has no llama.cpp equivalent: none of "
                           f"{', '.join(_PRE_PREFERENCE)} splits the probe texts the same way")


def _special_ids(tok: Tokenizer, tokens: list[str]) -> dict[str, Any]:
    """BOS/EOS/EOT/EOM/padding ids and whether BOS is added. End-of-generation tokens whose
    text llama.cpp recognises (:data:`pocketlm.tokenizer.EOG_TEXTS`) need no key."""
    fields: dict[str, Any] = {"tokenizer.ggml.add_bos_token": bool(tok.add_bos and
                                                                   tok.bos_id is not None),
                              "tokenizer.ggml.add_eos_token": False}
    if tok.bos_id is not None:
        fields["tokenizer.ggml.bos_token_id"] = tok.bos_id
    eos = list(tok.eos_ids)
    if eos:
        fields["tokenizer.ggml.eos_token_id"] = eos[0]
    others = [i for i in eos[1:] if tokens[i] not in EOG_TEXTS]
    for key, i in zip(("eot", "eom"), others):
        fields[f"tokenizer.ggml.{key}_token_id"] = i
    for text in ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"):
        i = tok.token_to_id(text)
        if i is not None and i < len(tokens) and tok.is_special(i):
            fields["tokenizer.ggml.padding_token_id"] = i
            break
    return fields


# names tried, in this order, for a pre-tokenizer llama.cpp does not know; also the name
# written when several of the importer's names share the vocabulary's pre-tokenizer
_PRE_PREFERENCE = ("qwen2", "llama-bpe", "dbrx", "smollm", "gpt-2", "default")
# Hugging Face spells the any-case contractions of Qwen 2 and Llama 3 this way; llama.cpp's
# regex engine lacks inline flags, so the importer spells them out
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA_CPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def _pre_name(spec: dict) -> str | None:
    """The ``tokenizer.ggml.pre`` name whose pre-tokenizer (as the importer rebuilds it: the
    regexes llama.cpp compiles in for that name) is the vocabulary's own, or None."""
    if spec.get("normalizer") is not None:
        return None
    mine = _regex_chain(spec.get("pre_tokenizer"))
    if mine is None:
        return None
    ignore = bool((spec.get("model") or {}).get("ignore_merges", False))
    table = _importer_pre_table()
    return table.get((mine, ignore))


def _regex_chain(pre: Any) -> tuple[str, ...] | None:
    """A byte-level pre-tokenizer as its chain of isolating regexes (Hugging Face's shorthand
    forms spelled out), or None when it is something else."""
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    regexes = []
    for step in steps[:-1]:
        kind = step.get("type")
        if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert") \
                and "Regex" in (step.get("pattern") or {}):
            regexes.append(step["pattern"]["Regex"].replace(_HF_CONTRACTIONS,
                                                            _LLAMA_CPP_CONTRACTIONS))
        elif kind == "Digits" and step.get("individual_digits"):
            regexes.append(r"\p{N}")
        else:
            return None
    if steps[-1].get("use_regex", True):  # ByteLevel's own split: GPT-2's regex
        regexes.append(_importer_regexes("gpt-2")[0][0])
    return tuple(regexes)


@cache
def _importer_regexes(name: str) -> tuple[tuple[str, ...], bool]:
    """The regex chain and ignore_merges the importer builds for ``tokenizer.ggml.pre =
    name`` (read off a one-byte-per-token vocabulary it rebuilds)."""
    from ..formats.gguf_vocab import tokenizer_from_gguf_fields
    from ..tokenizer import BYTE_TO_CHAR

    tok = tokenizer_from_gguf_fields({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": name,
        "tokenizer.ggml.tokens": [BYTE_TO_CHAR[b] for b in range(256)],
        "tokenizer.ggml.merges": []})
    spec = json.loads(tok.hf.to_str())
    chain = tuple(s["pattern"]["Regex"] for s in spec["pre_tokenizer"]["pretokenizers"][:-1])
    return chain, bool(spec["model"].get("ignore_merges", False))


@lru_cache(maxsize=1)
def _importer_pre_table() -> dict[tuple[tuple[str, ...], bool], str]:
    from ..formats.gguf_vocab import SUPPORTED_PRE

    table: dict[tuple[tuple[str, ...], bool], str] = {}
    for name in (*_PRE_PREFERENCE, *SUPPORTED_PRE):
        table.setdefault(_importer_regexes(name), name)
    return table


def probe_texts(tok: Tokenizer) -> list[tuple[str, bool]]:
    """``(text, special)`` pairs to compare: every probe as plain text, and the probes joined
    by the vocabulary's first special tokens, read as those tokens."""
    probes = [(t, False) for t in PROBE_TEXTS] + [(t, True) for t in PROBE_TEXTS]
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])[:6]
    if specials:
        joined = "".join(f"{text}{t}" for (text, _), t in zip(specials * 2, PROBE_TEXTS))
        probes += [(joined, True), (joined, False)]
    return probes


def first_difference(tok: Tokenizer, fields: dict[str, Any]) -> str | None:
    """None when the tokenizer llama.cpp builds from ``fields`` (as pocketlm's importer
    rebuilds it) tokenizes every probe as ``tok`` does; else what differs."""
    from ..formats.gguf_vocab import tokenizer_from_gguf_fields

    theirs = tokenizer_from_gguf_fields(fields)
    if (theirs.bos_id, theirs.add_bos) != (tok.bos_id, tok.add_bos and tok.bos_id is not None):
        return (f"BOS {theirs.bos_id} (added: {theirs.add_bos}) instead of {tok.bos_id} "
                f"(added: {tok.add_bos})")
    for text, special in probe_texts(tok):
        a = tok.encode(text, add_bos=False, special=special)
        b = theirs.encode(text, add_bos=False, special=special)
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{text[:40]!r}: token {at} is {b[at] if at < len(b) else 'missing'} "
                    f"instead of {a[at] if at < len(a) else 'missing'}")
    return None
