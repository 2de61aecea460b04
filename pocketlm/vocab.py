"""Vocabulary trimming: keep the pieces an app's languages use, exactly as the source tokenizes.

A multilingual model spends most of its parameters on pieces an app never produces (Gemma 3
270M: 168 M of 268 M on 262,144 pieces). :func:`trim_source` keeps a subset of them and gives a
model of the same architecture whose tokenizer, on text in the kept languages, produces the
same pieces as the source's (renumbered), and whose logits over those pieces are the source's.

**The kept set** (:func:`choose_kept`) is chosen by one of two rules:

* ``corpus`` (the default): every piece the source tokenizer produces on the zh / en corpora
  the project already fetches (:data:`LANGUAGES`: People's Daily and the idiom and character
  dictionaries for zh, ShareGPT chats for en; one document in eight is held out by a hash of
  its text, never used to choose) and on an app's own text (``--vocab-corpus``);
  ``--vocab-size N`` keeps the most frequent of them (by rate per character in each text).
  A corpus of a few million characters misses some pieces that text in the languages does use
  (rare names and words), so the rule also *backfills*: it keeps the pieces of the languages'
  scripts that the source itself ranks (merge rank, SentencePiece score) ahead of the share
  ``--vocab-backfill Q`` (default :data:`DEFAULT_BACKFILL`) of the pieces the corpus produced
  in the same script. They rank after every produced piece, so a size cap takes them last.
* ``script``: every piece made only of the languages' scripts, digits, punctuation and
  whitespace (for byte-level pieces: any byte string that can occur inside such text).

Either way the set also holds everything tokenization needs to reach the kept pieces and to
stay total: the merge intermediates (each kept piece is tokenized alone by the source's own
algorithm and every piece formed on the way is kept: the merges within a final piece are the
same whatever text surrounds it), all byte pieces (byte-level symbols, ``<0xNN>`` byte
fallback), every special, control and user-defined token, the BOS / EOS / unknown pieces and
the pieces the chat template renders to (its tools branch included).

**Why it stays exact.** A BPE applies, at each step, the best-ranked merge (byte-level BPE: the
earliest merge in the list; SentencePiece: the highest-scoring piece, leftmost on ties) whose
result is in the vocabulary. The trimmed tokenizer keeps the source's ranks and scores for the
pieces it keeps, so on a word whose source merges all form kept pieces, each step's best merge
is still available and still best: the same pieces come out. A word that needs a piece the set
lacks stops earlier and comes out in smaller kept pieces, or in bytes: never an error, and
``decode(encode(text)) == text`` holds for any text.

The rebuilt tokenizer is a Hugging Face BPE (byte-level or byte-fallback; the source's merges
that form kept pieces from kept pieces, in their order) or a SentencePiece model (the kept
pieces with their scores and types). The embedding and an untied output head keep the rows of
the kept pieces, in source-id order, sliced from the source's own blocks (quantized rows are
whole blocks: nothing is requantized). The deploy file records the map back to the source ids
(tensor ``pocket.vocab.source_ids``) and the rule, languages and digests (metadata ``vocab``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PocketError, UnsupportedError, refuse_empty
from .formats.pocketfile import SOURCE_IDS_TENSOR
from .tokenizer import BYTE_TO_CHAR, DROPPED_BYTE, SPACE_MARK, SpmTokenizer, Tokenizer

__all__ = [
    "LANGUAGES",
    "RULES",
    "SOURCE_IDS_TENSOR",
    "VocabSpec",
    "choose_kept",
    "parse_languages",
    "trim_source",
    "trim_tokenizer",
]

RULES = ("corpus", "script")
# Bumped when the kept set chosen for the same inputs changes (the corpus, the rule, the
# closure), so that derived caches are rebuilt.
VOCAB_REVISION = 2
# The corpus rule's backfill (see the module's doc): chosen by measurement in docs/vocabulary.md
# (the held-out lines tokenized identically against the pieces added, per model): the smallest
# measured share that keeps >= 99.5 % of held-out zh and en lines identical on every registry
# model (0.9 left gemma3-270m's English at 99.48 %).
DEFAULT_BACKFILL = 0.95

# Code point ranges (inclusive) of what text "in" a language is written with. COMMON (digits,
# punctuation, whitespace) belongs to every language.
COMMON = (
    (0x09, 0x0A), (0x0D, 0x0D), (0x20, 0x40), (0x5B, 0x60), (0x7B, 0x7E),
    (0xA0, 0xBF), (0xD7, 0xD7), (0xF7, 0xF7),
    (0x2000, 0x206F),  # general punctuation: dashes, quotes, ellipsis
    (0x20A0, 0x20CF),  # currency signs
    (0x2100, 0x21FF),  # letterlike symbols (℃, №), number forms (Ⅳ), arrows
    (0x2200, 0x22FF),  # mathematical operators (≤, ∶ as newspapers write scores)
    (0x2460, 0x24FF),  # enclosed numbers (①)
    (0x25A0, 0x25FF),  # geometric shapes (○ as a zero in dates, ●, ■, △)
    (0x2605, 0x2606),  # ★ ☆
)


@dataclass(frozen=True)
class Language:
    name: str
    description: str
    ranges: tuple[tuple[int, int], ...]
    corpora: tuple[str, ...]  # pocketlm.data.corpora names the corpus rule reads


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language("en", "English: Latin letters (with Latin-1 accents)",
                 ((0x41, 0x5A), (0x61, 0x7A), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0xFF)),
                 ("sharegpt",)),
        Language("zh", "Chinese: CJK ideographs (basic, extension A, compatibility), radicals, "
                 "bopomofo, pinyin tone letters, CJK and fullwidth punctuation and symbols",
                 ((0x0100, 0x017F), (0x01CD, 0x01DC),  # pinyin: ā á ǎ à ü ǖ ...
                  (0x2E80, 0x2FDF), (0x3000, 0x303F), (0x3100, 0x312F), (0x31A0, 0x31EF),
                  (0x3200, 0x33FF),  # enclosed CJK, CJK compatibility (㈠, ㎡)
                  (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFE10, 0xFE1F),
                  (0xFE30, 0xFE4F), (0xFF00, 0xFFEF)),
                 ("peoples-daily", "idioms", "xinhua-dictionary")),
    )
}

# English chats are long; the corpus rule reads this many characters of them (documents in
# their published order), which keeps the zh and en shares within a factor of two.
CORPUS_CHARS: dict[str, int] = {}


def parse_languages(text: str | Iterable[str], flag: str = "--vocab") -> tuple[str, ...]:
    """``"zh,en"`` (or a list) as a sorted tuple of known language names; an unknown or empty
    name is refused naming ``flag`` and the known ones."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = []
    for raw in items:
        name = str(raw).strip().lower()
        if name not in LANGUAGES:
            shown = repr(str(raw).strip()) if str(raw).strip() else "an empty name"
            raise PocketError(f"{flag}: unknown language {shown}; known: "
                              f"{', '.join(sorted(LANGUAGES))} (comma-separated, e.g. zh,en)")
        if name not in names:
            names.append(name)
    if not names:
        raise PocketError(f"{flag}: no language given; known: {', '.join(sorted(LANGUAGES))}")
    return tuple(sorted(names))


@dataclass(frozen=True)
class VocabSpec:
    """What to keep: ``languages`` (:data:`LANGUAGES` names), the ``rule`` (:data:`RULES`),
    an app's own ``corpus`` file, a ``size`` cap (most frequent pieces first) and the corpus
    rule's ``backfill`` share (0: only the pieces the corpus produced)."""

    languages: tuple[str, ...] = ()
    rule: str = "corpus"
    corpus: Path | None = None
    size: int | None = None
    backfill: float = DEFAULT_BACKFILL

    def __post_init__(self):
        if self.languages:
            object.__setattr__(self, "languages", parse_languages(self.languages))
        if self.rule not in RULES:
            raise PocketError(f"--vocab-rule must be one of {', '.join(RULES)}, got "
                              f"{self.rule!r}")
        if not self.languages and self.corpus is None:
            raise PocketError("vocabulary trimming needs --vocab LANGS or --vocab-corpus FILE")
        if self.rule == "script" and not self.languages:
            raise PocketError("--vocab-rule script needs the languages: pass --vocab, e.g. "
                              "--vocab zh,en")
        if self.size is not None and (isinstance(self.size, bool)
                                      or not isinstance(self.size, int) or self.size < 1):
            raise PocketError(f"--vocab-size must be a positive number of pieces, got "
                              f"{self.size!r}")
        if (isinstance(self.backfill, bool) or not isinstance(self.backfill, (int, float))
                or not 0.0 <= float(self.backfill) <= 1.0):
            raise PocketError(f"--vocab-backfill must be a share between 0 and 1, got "
                              f"{self.backfill!r}")
        object.__setattr__(self, "backfill", float(self.backfill))
        if self.corpus is not None:
            from .calibdata import check_text_file

            refuse_empty("--vocab-corpus", self.corpus, "a text file")  # Path("") is "."
            object.__setattr__(self, "corpus", Path(self.corpus))
            check_text_file(self.corpus, flag="--vocab-corpus")

    def record(self) -> dict:
        return {"languages": list(self.languages), "rule": self.rule,
                "corpus": None if self.corpus is None else self.corpus.name,
                "size": self.size,
                "backfill": self.backfill if self.rule == "corpus" and self.languages else None}


# ---------------------------------------------------------------------------------------------
# what a tokenizer holds
# ---------------------------------------------------------------------------------------------


@dataclass
class _Vocab:
    """A tokenizer's pieces as the trimming sees them."""

    kind: str  # "hf" (merge-ranked BPE in tokenizer.json) or "spm" (score-ranked)
    pieces: list[str]  # piece text by id, as the model stores it
    required: set[int]  # ids that are always kept
    merge: Any  # hf: {(a, b): rank}; spm: (scores, usable piece -> id)
    spec: dict | None = None  # hf: the tokenizer.json
    types: list[int] | None = None  # spm: piece types

    def ids(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.pieces)}


def _hf_vocab(tok: Tokenizer) -> _Vocab:
    spec = json.loads(tok.hf.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedError(f"the tokenizer's model is {model.get('type')!r}; only BPE "
                               "vocabularies (byte-level or with byte fallback) and "
                               "SentencePiece ones can be trimmed")
    vocab: dict[str, int] = model["vocab"]
    n = tok.vocab_size
    pieces = [""] * n
    for piece, i in vocab.items():
        if i < n:
            pieces[i] = piece
    for added in spec.get("added_tokens") or ():
        if added["id"] < n:
            pieces[added["id"]] = added["content"]
    merges = model.get("merges") or []
    ranks: dict[tuple[str, str], int] = {}
    for r, m in enumerate(merges):
        a, b = (m.split(" ", 1) if isinstance(m, str) else m)
        ranks.setdefault((a, b), r)
    required = {a["id"] for a in spec.get("added_tokens") or () if a["id"] < n}
    if tok.kind == "bpe":  # byte-level: every byte's symbol
        required |= {vocab[c] for c in BYTE_TO_CHAR.values() if c in vocab}
    else:
        required |= {vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab}
    unk = model.get("unk_token")
    if unk in vocab and unk != DROPPED_BYTE:
        required.add(vocab[unk])
    return _Vocab("hf", pieces, required, ranks, spec=spec)


def _spm_vocab(tok: SpmTokenizer) -> _Vocab:
    proto = tok.sp.serialized_model_proto()
    pieces, scores, types = _spm_pieces(proto)
    # pieces merges can form: normal and user-defined ones (sentencepiece skips the rest)
    usable = {p: i for i, p in enumerate(pieces) if types[i] in (1, 4)}
    required = {i for i, t in enumerate(types) if t in (2, 3, 4, 6)}  # unk, control, user, byte
    # the whitespace symbol alone: without it a space no kept piece holds falls back to the
    # bytes of U+2581, which decode to that character, not to a space
    if "\u2581" in usable:
        required.add(usable["\u2581"])
    return _Vocab("spm", pieces, required, (scores, usable), types=types)


def _vocab_of(tok: Tokenizer) -> _Vocab:
    if isinstance(tok, SpmTokenizer):
        v = _spm_vocab(tok)
    elif isinstance(tok, Tokenizer):
        v = _hf_vocab(tok)
    else:
        raise UnsupportedError(f"a {type(tok).__name__} cannot be trimmed")
    v.required |= set(tok.special_tokens.values()) | set(tok.eos_ids)
    v.required |= set(getattr(tok, "user_defined", {}).values())
    if tok.bos_id is not None:
        v.required.add(tok.bos_id)
    return v


# ---------------------------------------------------------------------------------------------
# the merge closure
# ---------------------------------------------------------------------------------------------


def _formed(v: _Vocab, piece: str) -> list[str]:
    """The pieces the source's BPE forms on the way when it tokenizes ``piece`` alone: the best
    adjacent pair merges first (byte-level BPE: lowest merge rank; SentencePiece: highest
    score), the leftmost on ties."""
    if v.kind == "hf":
        ranks = v.merge

        def cost(a: str, b: str) -> float | None:
            return ranks.get((a, b))
    else:
        scores, usable = v.merge

        def cost(a: str, b: str) -> float | None:
            i = usable.get(a + b)
            return None if i is None else -scores[i]

    symbols = list(piece)
    out: list[str] = []
    while len(symbols) > 1:
        best = None
        for k in range(len(symbols) - 1):
            c = cost(symbols[k], symbols[k + 1])
            if c is not None and (best is None or c < best[0]):
                best = (c, k)
        if best is None:
            break
        k = best[1]
        symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
        out.append(symbols[k])
    return out


def _closure(v: _Vocab, ids: Iterable[int], index: dict[str, int]) -> list[int]:
    """``ids`` and the ids of every piece formed on the way to them (see :func:`_formed`)."""
    out: list[int] = []
    for i in ids:
        out.append(i)
        if i in v.required:
            continue
        for p in _formed(v, v.pieces[i]):
            j = index.get(p)
            if j is not None:
                out.append(j)
    return out


# ---------------------------------------------------------------------------------------------
# the script rule
# ---------------------------------------------------------------------------------------------


def _code_points(ranges: Iterable[tuple[int, int]]) -> np.ndarray:
    """A boolean mask over every code point: True inside the inclusive ``ranges``."""
    mask = np.zeros(0x110000, dtype=bool)
    for lo, hi in ranges:
        mask[lo:hi + 1] = True
    return mask


class _Script:
    """Which byte strings can occur inside text written only with the allowed code points."""

    def __init__(self, languages: tuple[str, ...]):
        self.allowed = _code_points(
            [*COMMON, *(r for name in languages for r in LANGUAGES[name].ranges)])
        self.prefixes: set[bytes] = set()
        self.suffixes: set[bytes] = set()
        self.inner: set[bytes] = set()
        for cp in np.flatnonzero(self.allowed).tolist():
            if 0xD800 <= cp <= 0xDFFF:
                continue
            enc = chr(cp).encode("utf-8")
            n = len(enc)
            for k in range(1, n):
                self.prefixes.add(enc[:k])
                self.suffixes.add(enc[k:])
                for j in range(k + 1, n):
                    self.inner.add(enc[k:j])

    def text_ok(self, text: str) -> bool:
        return all(self.allowed[ord(c)] for c in text)

    def bytes_ok(self, b: bytes) -> bool:
        """Whether ``b`` is a substring of the UTF-8 of some allowed text."""
        if not b:
            return False
        try:
            return self.text_ok(b.decode("utf-8"))
        except UnicodeDecodeError:
            pass
        if b in self.inner:
            return True
        n = len(b)
        for i in range(0, min(3, n) + 1):
            if i and b[:i] not in self.suffixes:
                continue
            for j in range(0, min(3, n - i) + 1):
                if j and b[n - j:] not in self.prefixes:
                    continue
                try:
                    middle = b[i:n - j].decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if self.text_ok(middle):
                    return True
        return False


def _script_ids(tok: Tokenizer, v: _Vocab, languages: tuple[str, ...]) -> list[int]:
    script = _Script(languages)
    out = []
    for i, piece in enumerate(v.pieces):
        if i in v.required:
            continue
        if v.kind == "spm" or not tok._byte_level:
            ok = script.text_ok(piece.replace(SPACE_MARK, " "))
        else:
            ok = script.bytes_ok(tok.token_bytes(i))
        if ok:
            out.append(i)
    return out


def _piece_text(tok: Tokenizer, v: _Vocab, i: int) -> str:
    """Piece ``i``'s text (a byte-level piece's incomplete characters left out)."""
    if v.kind == "spm" or not tok._byte_level:
        return v.pieces[i].replace(SPACE_MARK, " ")
    return tok.token_bytes(i).decode("utf-8", "ignore")


def _priority(v: _Vocab, ids: Iterable[int]) -> dict[int, float]:
    """How early the source's BPE forms each piece (lower: earlier, i.e. more frequent in the
    source's own training text): the rank of the merge that forms it, or minus its
    SentencePiece score; single symbols come first."""
    if v.kind == "hf":
        rank: dict[str, int] = {}
        for (a, b), r in v.merge.items():
            p = a + b
            if r < rank.get(p, 1 << 62):
                rank[p] = r
        return {i: float(rank.get(v.pieces[i], -1)) for i in ids}
    scores = v.merge[0]
    return {i: -float(scores[i]) for i in ids}


def _backfill_ids(tok: Tokenizer, v: _Vocab, spec: VocabSpec, produced: set[int]) -> list[int]:
    """The corpus rule's backfill: the script rule's pieces the corpus did not produce that
    the source ranks ahead of the share ``spec.backfill`` of the pieces the corpus did produce
    in the same script (each language's own letters, or neither), earliest first."""
    if spec.rule != "corpus" or not spec.languages or spec.backfill <= 0:
        return []
    script = _script_ids(tok, v, spec.languages)
    prior = _priority(v, script)
    own = [(name, _code_points(LANGUAGES[name].ranges)) for name in spec.languages]

    def script_of(i: int) -> str:
        text = _piece_text(tok, v, i)
        for name, mask in own:
            if any(mask[ord(c)] for c in text):
                return name
        return ""

    kind = {i: script_of(i) for i in script}
    seen: dict[str, list[float]] = {}
    for i in script:
        if i in produced:
            seen.setdefault(kind[i], []).append(prior[i])
    limit = {k: float(np.quantile(np.array(vals), spec.backfill)) for k, vals in seen.items()}
    extra = [i for i in script if i not in produced and kind[i] in limit
             and prior[i] <= limit[kind[i]]]
    return sorted(extra, key=lambda i: (prior[i], i))


# ---------------------------------------------------------------------------------------------
# the corpus rule
# ---------------------------------------------------------------------------------------------


def corpus_documents(languages: tuple[str, ...], *, heldout: bool = False) -> Iterator[tuple[str, str]]:
    """``(language, document)`` of the built-in corpora of ``languages``: the documents the
    corpus rule reads (``heldout=False``) or the ones it never reads (one in eight, chosen by a
    hash of the text: :func:`pocketlm.calibdata.is_heldout`)."""
    from .calibdata import is_heldout
    from .data.corpora import corpus_documents as documents

    for lang in languages:
        for name in LANGUAGES[lang].corpora:
            budget = CORPUS_CHARS.get(name)
            used = 0
            for doc in documents(name, manifest=False):
                if not doc.strip():
                    continue
                if is_heldout(doc) != heldout:
                    continue
                yield lang, doc
                used += len(doc)
                if budget is not None and used >= budget:
                    break


def corpus_record(languages: tuple[str, ...]) -> list[dict]:
    """Package, version and sha256 of each built-in corpus the corpus rule reads."""
    from .data.corpora import corpus, fetch_source, source_record

    out = []
    for lang in languages:
        for name in LANGUAGES[lang].corpora:
            c = corpus(name)
            rec = source_record(c, fetch_source(c.source))
            out.append({"language": lang, "corpus": name, "package": rec["package"],
                        "version": rec["version"], "sha256": rec["sha256"],
                        "characters": CORPUS_CHARS.get(name)})
    return out


def _paragraphs(text: str, limit: int = 20_000) -> Iterator[str]:
    """An app's text in pieces as it is written, line breaks kept: paragraphs (each with the
    blank lines and spaces after it, up to the next word), a long one cut after a line break
    near ``limit`` characters. A
    tokenizer joins punctuation and the line breaks after it (".\n\n" is one piece of
    Qwen's): cut into lines, the text would never show those pieces, and the trimmed
    tokenizer would write the app's own text in other pieces than its source does."""
    for para in re.split(r"(?<=\n\n)(?=\S)", text):  # blanks before a word stay with it
        while len(para) > limit:
            cut = para.rfind("\n", 0, limit) + 1 or limit
            yield para[:cut]
            para = para[cut:]
        if para:
            yield para


def _count(tok: Tokenizer, texts: Iterable[str], counts: Counter, progress) -> int:
    """Add the pieces of ``texts`` to ``counts``; the characters read (``progress(n)`` is
    told each batch's)."""
    chars = 0
    batch: list[str] = []

    def flush():
        for ids in tok.encode_batch(batch, special=False):
            counts.update(ids)
        progress(sum(map(len, batch)))
        batch.clear()

    for t in texts:
        batch.append(t)
        chars += len(t)
        if len(batch) >= 1024:
            flush()
    flush()
    return chars


# ---------------------------------------------------------------------------------------------
# choosing
# ---------------------------------------------------------------------------------------------


def template_ids(tok: Tokenizer, chat_template: str | None) -> set[int]:
    """The ids a chat turn renders to (system, user and assistant turns, zh and en)."""
    if not chat_template:
        return set()
    from .chat import render

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello! 你好"},
                {"role": "assistant", "content": "Hi. 你好。"},
                {"role": "user", "content": "Thanks"}]
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.id_to_token(tok.eos_ids[0]) if tok.eos_ids else ""
    renders: list[tuple[list[dict], dict]] = [(messages, {}), (messages[1:], {})]
    if "tools" in chat_template:
        # the tools branch's own text (Qwen's "<args-json-object>", a call, a tool's answer):
        # a request with tools renders it, and a trimmed model must read it as its source does
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        turns = [*messages[:2], call, {"role": "tool", "content": "sunny, 21 C"}]
        renders += [(turns, {"tools": tools}), (turns[1:], {"tools": tools})]
    out: set[int] = set()
    for msgs, extra in renders:
        try:
            text = render(chat_template, msgs, bos_token=bos or "", eos_token=eos or "",
                          **extra)
        except PocketError:
            continue  # a template that refuses a system turn, say
        out.update(tok.encode(text, add_bos=False, special=True))
    return out


def corpus_counts(tok: Tokenizer, spec: VocabSpec, *, progress: bool = False
                  ) -> tuple[dict[str, tuple[Counter, int]], dict]:
    """How often the source produces each piece on the corpus rule's text, per text: each of
    ``spec.languages``' built-in corpora and the app's ``spec.corpus`` (``"app"``), as
    ``{name: (counts, characters)}``; and a record of that text."""
    out: dict[str, tuple[Counter, int]] = {}
    record: dict[str, Any] = {}
    from .progress import bar as progress_bar

    bar = progress_bar(None, "choosing pieces", "char", enabled=progress, unit_scale=True)
    done = [0]

    def tick(n):
        bar.update(n)
        done[0] += n

    for lang in spec.languages:
        counts: Counter = Counter()
        chars = _count(tok, (d for _, d in corpus_documents((lang,))), counts, tick)
        out[lang] = (counts, chars)
    if spec.languages:
        record["corpora"] = corpus_record(spec.languages)
    if spec.corpus is not None:
        from .calibdata import check_text_file

        text, _ = check_text_file(spec.corpus, flag="--vocab-corpus")
        counts = Counter()
        out["app"] = (counts, _count(tok, _paragraphs(text), counts, tick))
        record["corpus_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    bar.close()
    record["corpus_characters"] = {k: chars for k, (_, chars) in out.items()}
    return out, record


def _ranked(counts: dict[str, tuple[Counter, int]]) -> list[int]:
    """Every piece produced, most frequent first, frequency being a piece's highest rate per
    character over the texts: each language's (and the app's) own pieces rank by how often
    that text uses them, however long the text is."""
    rate: dict[int, float] = {}
    for c, chars in counts.values():
        for i, n in c.items():
            r = n / max(chars, 1)
            if r > rate.get(i, 0.0):
                rate[i] = r
    return [i for i, _ in sorted(rate.items(), key=lambda kv: (-kv[1], kv[0]))]


def choose_kept(tok: Tokenizer, spec: VocabSpec, *, chat_template: str | None = None,
                progress: bool = False, counts: dict[str, tuple[Counter, int]] | None = None
                ) -> tuple[np.ndarray, dict]:
    """The source ids to keep (sorted) and a record of how they were chosen (``counts``: the
    corpus rule's :func:`corpus_counts`, when already taken)."""
    v = _vocab_of(tok)
    index = v.ids()
    required = set(v.required) | template_ids(tok, chat_template)
    required_closed = set(_closure(v, sorted(required), index))
    record: dict[str, Any] = {"revision": VOCAB_REVISION, **spec.record(),
                              "source_vocab": tok.vocab_size}
    if spec.size is not None and len(required_closed) > spec.size:
        raise PocketError(f"--vocab-size {spec.size} is smaller than the "
                          f"{len(required_closed)} pieces that must be kept (byte pieces, "
                          "special and control tokens, the chat template's pieces and what "
                          f"forms them); give at least {len(required_closed)}")
    if spec.rule == "script":
        candidates = _script_ids(tok, v, spec.languages)
        n_produced = len(candidates)
    else:
        if counts is None:
            counts, seen = corpus_counts(tok, spec, progress=progress)
            record.update(seen)
        produced = _ranked(counts)
        backfill = _backfill_ids(tok, v, spec, set(produced))
        candidates = [i for i in produced if i not in required_closed]
        n_produced = len(candidates)
        candidates += [i for i in backfill if i not in required_closed]
    kept = set(required_closed)
    if spec.rule == "script" and spec.size is not None:
        # no frequencies: the shortest pieces first (they are what longer ones are built from)
        candidates.sort(key=lambda i: (len(v.pieces[i]), i))
    dropped = 0
    kept_before_backfill = None
    for k, i in enumerate(candidates):
        if k == n_produced:
            kept_before_backfill = len(kept)
        if i in kept:
            continue
        add = [j for j in dict.fromkeys(_closure(v, [i], index)) if j not in kept]
        if spec.size is not None and len(kept) + len(add) > spec.size:
            dropped += 1
            continue
        kept.update(add)
    ids = np.array(sorted(kept), dtype=np.int32)
    record.update({
        "kept": int(ids.size),
        "required": len(required_closed),
        "backfilled": (0 if kept_before_backfill is None
                       else len(kept) - kept_before_backfill),
        "dropped_by_size": dropped,
        "source_ids_sha256": hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest(),
    })
    return ids, record


# ---------------------------------------------------------------------------------------------
# rebuilding the tokenizer
# ---------------------------------------------------------------------------------------------


def trim_tokenizer(tok: Tokenizer, kept: np.ndarray) -> Tokenizer:
    """The tokenizer over the ``kept`` source ids (sorted), renumbered 0..len(kept)-1."""
    kept_list = [int(i) for i in kept]
    new_id = {old: new for new, old in enumerate(kept_list)}

    def remap(i: int | None) -> int | None:
        return None if i is None else new_id.get(int(i))

    bos = remap(tok.bos_id)
    eos = [new_id[i] for i in tok.eos_ids if i in new_id]
    special = {t: new_id[i] for t, i in tok.special_tokens.items() if i in new_id}
    if isinstance(tok, SpmTokenizer):
        from .formats.gguf_vocab import _spm_model_proto

        pieces, scores, types = _spm_pieces(tok.sp.serialized_model_proto())
        types_arr = np.array([types[i] for i in kept_list], dtype=np.int32)
        unk = [k for k, t in enumerate(types_arr.tolist()) if t == 2]
        proto = _spm_model_proto([pieces[i] for i in kept_list],
                                 np.array([scores[i] for i in kept_list]), types_arr, unk[0])
        return SpmTokenizer(proto, bos_id=bos, eos_ids=eos, add_bos=tok.add_bos,
                            add_space_prefix=tok.add_space_prefix, special_tokens=special,
                            user_defined={t: new_id[i] for t, i in tok.user_defined.items()
                                          if i in new_id})
    from .tokenizer import _hf_from_str

    spec = json.loads(tok.hf.to_str())
    model = spec["model"]
    old_vocab: dict[str, int] = model["vocab"]
    vocab = {p: new_id[i] for p, i in old_vocab.items() if i in new_id}
    if DROPPED_BYTE in old_vocab:
        vocab[DROPPED_BYTE] = len(kept_list)
    merges = []
    for m in model.get("merges") or []:
        a, b = (m.split(" ", 1) if isinstance(m, str) else m)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"] = vocab
    model["merges"] = merges
    spec["added_tokens"] = [{**a, "id": new_id[a["id"]]} for a in spec.get("added_tokens") or ()
                            if a["id"] in new_id]
    spec["post_processor"] = _remap_ids(spec.get("post_processor"), new_id)
    try:
        hf = _hf_from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as e:  # tokenizers raises a bare Exception
        raise PocketError(f"cannot rebuild the trimmed tokenizer: {e}") from None
    return Tokenizer(hf, bos_id=bos, eos_ids=eos, add_bos=tok.add_bos, special_tokens=special)


def _remap_ids(node: Any, new_id: dict[int, int]) -> Any:
    """A post-processor with the token ids it names renumbered (dropped ids removed)."""
    if isinstance(node, list):
        return [_remap_ids(x, new_id) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, val in node.items():
        if k == "ids" and isinstance(val, list) and all(isinstance(x, int) for x in val):
            out[k] = [new_id[x] for x in val if x in new_id]
        else:
            out[k] = _remap_ids(val, new_id)
    return out


# ---------------------------------------------------------------------------------------------
# the SentencePiece model's pieces (protobuf wire format)
# ---------------------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: varints as ints, length-
    delimited fields as bytes, fixed32 as 4 bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise PocketError(f"the SentencePiece model has an unreadable field {field}")
        yield field, wire, value


def _spm_pieces(proto: bytes) -> tuple[list[str], list[float], list[int]]:
    """Texts, scores and types of a serialised SentencePiece ``ModelProto``'s pieces."""
    pieces, scores, types = [], [], []
    for field, _, value in _fields(proto):
        if field != 1:
            continue
        text, score, kind = "", 0.0, 1
        for f, _, x in _fields(value):
            if f == 1:
                text = x.decode("utf-8")
            elif f == 2:
                score = float(np.frombuffer(x, "<f4")[0])
            elif f == 3:
                kind = x
        pieces.append(text)
        scores.append(score)
        types.append(kind)
    return pieces, scores, types


# ---------------------------------------------------------------------------------------------
# what trimming costs outside the kept languages
# ---------------------------------------------------------------------------------------------


def reference_lines() -> list[str]:
    """A reference multilingual text (pocketlm/data/multilingual.txt): the kept languages,
    Japanese, Korean, Arabic, Cyrillic, Greek, Hebrew, Devanagari, Thai, accented Latin,
    emoji, rare Han characters, mathematics, code and JSON, one line each."""
    path = Path(__file__).parent / "data" / "multilingual.txt"
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def reference_cost(source: Tokenizer, trimmed: Tokenizer,
                   lines: list[str] | None = None) -> dict:
    """On the reference text: the share of lines that cost more tokens after trimming, and the
    extra tokens overall. Every line must still decode to itself."""
    lines = reference_lines() if lines is None else lines
    before = after = costlier = 0
    for line in lines:
        a = source.encode(line, add_bos=False, special=False)
        b = trimmed.encode(line, add_bos=False, special=False)
        if trimmed.decode(b) != line:
            raise PocketError(f"the trimmed tokenizer does not round-trip {line[:40]!r}; "
                              "please report this")
        before += len(a)
        after += len(b)
        costlier += len(b) > len(a)
    return {"lines": len(lines), "lines_costlier": round(costlier / max(len(lines), 1), 4),
            "extra_tokens": round(after / max(before, 1) - 1, 4)}


# ---------------------------------------------------------------------------------------------
# trimming a source model
# ---------------------------------------------------------------------------------------------


def _rows(qt, kept: np.ndarray):
    """A quantized tensor's rows ``kept`` (whole groups: no requantization)."""
    from .quant import QuantTensor

    return QuantTensor(qt.kind, (int(kept.size), qt.shape[1]), qt.group_size,
                       np.ascontiguousarray(qt.qweight[kept]),
                       np.ascontiguousarray(qt.scales[kept]),
                       None if qt.mins is None else np.ascontiguousarray(qt.mins[kept]),
                       qt.zero_point)


def _sliced(st, kept: np.ndarray):
    from .formats import SourceTensor

    def to_float():
        return np.ascontiguousarray(st.to_float()[kept])

    def to_quant(bits: int, group_size: int):
        qt = st.to_quant(bits, group_size)
        return None if qt is None else _rows(qt, kept)

    return SourceTensor(st.name, (int(kept.size), *st.shape[1:]), st.dtype, to_float, to_quant)


def trim_source(model, spec: VocabSpec | None = None, *, kept: np.ndarray | None = None,
                record: dict | None = None, progress: bool = False):
    """``model`` (a :class:`~pocketlm.formats.SourceModel`) with its vocabulary trimmed to
    ``spec`` (or to the given ``kept`` source ids); the result carries ``vocab`` (the record)
    and ``vocab_source_ids``."""
    from .calibrate import GGUF_BITS

    tok = model.tokenizer
    if kept is None:
        if spec is None:
            raise PocketError("trim_source needs a VocabSpec or the kept ids")
        try:
            kept, record = choose_kept(tok, spec, chat_template=model.chat_template,
                                       progress=progress)
        except UnsupportedError as e:  # a tokenizer that cannot be trimmed: say whose
            name = (model.provenance or {}).get("source_file") or "the source"
            flag = "--vocab" if spec.languages or spec.corpus is None else "--vocab-corpus"
            raise UnsupportedError(f"{flag}: {name}: {e}") from None
    kept = np.asarray(kept, dtype=np.int32)
    if kept.ndim != 1 or kept.size == 0 or np.any(np.diff(kept) <= 0) or kept[0] < 0 or (
            kept[-1] >= model.config.vocab_size):
        raise PocketError("the kept ids must be increasing source ids within the vocabulary")
    new_tok = trim_tokenizer(tok, kept)
    tensors = dict(model.tensors)
    removed_bytes = 0.0
    for name in ("embed.weight", "lm_head.weight"):
        if name in tensors:
            st = tensors[name]
            tensors[name] = _sliced(st, kept)
            rows = st.shape[0] - int(kept.size)
            bits = {**GGUF_BITS, "F16": 16, "BF16": 16}.get(st.dtype, 32)
            removed_bytes += rows * int(np.prod(st.shape[1:])) * bits / 8
    record = dict(record or {})
    record["reference_cost"] = reference_cost(tok, new_tok)
    record.setdefault("kept", int(kept.size))
    record.setdefault("source_vocab", int(model.config.vocab_size))
    source_ids = kept
    if model.vocab_source_ids is not None:  # trimming a trimmed model: map to the first source
        source_ids = np.asarray(model.vocab_source_ids, dtype=np.int32)[kept]
        record["source_vocab"] = int((model.vocab or {}).get("source_vocab",
                                                             model.config.vocab_size))
    record["source_ids_sha256"] = hashlib.sha256(
        source_ids.astype("<i4").tobytes()).hexdigest()
    prov = dict(model.provenance)
    sha = prov.get("source_sha256")
    if isinstance(sha, str):  # calibration statistics are cached per (trimmed) source
        prov["source_sha256"] = hashlib.sha256(
            f"{sha}|{record['source_ids_sha256']}".encode()).hexdigest()
        prov["untrimmed_sha256"] = sha
    if isinstance(prov.get("source_size"), int):  # the trimmed source's size, for budgets
        prov["source_size"] = int(prov["source_size"] - removed_bytes)
    return dataclasses.replace(
        model, config=dataclasses.replace(model.config, vocab_size=int(kept.size)),
        tokenizer=new_tok, tensors=tensors, provenance=prov, vocab=record,
        vocab_source_ids=source_ids)


# ---------------------------------------------------------------------------------------------
# trimmed registry models: a small source file that names its base and its kept pieces
# ---------------------------------------------------------------------------------------------

TRIMMED_FORMAT = "pocketlm-trimmed-source"


def read_trimmed(path: str | Path) -> dict:
    """The ``.trim.json`` source of a trimmed model: base name and sha256, vocabulary record
    and kept source ids; a damaged one is refused by name."""
    from .errors import FormatError

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != TRIMMED_FORMAT:
            raise ValueError("not a trimmed-model source")
        ids = np.asarray(data["source_ids"], dtype=np.int64)
        if ids.ndim != 1 or not isinstance(data.get("base"), str):
            raise ValueError("malformed")
        if hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest() != data["vocab"][
                "source_ids_sha256"]:
            raise ValueError("its kept ids do not match their sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError,
            RecursionError) as exc:  # a huge id, a hostile nesting: refused by name
        raise FormatError(f"{path}: not a readable trimmed-model source ({exc}); delete it and "
                          "run the model again to rebuild it") from None
    data["source_ids"] = ids.astype(np.int32)
    return data


def trimmed_state(entry, path: Path) -> str:
    """``"yes"`` when ``path`` holds the kept set the registry names for ``entry`` (and the
    base it was built from is the registry's), ``"changed"`` when it holds another, ``"no"``
    when there is none."""
    from .errors import FormatError
    from .registry import REGISTRY

    if not path.is_file():
        return "no"
    try:
        data = read_trimmed(path)
    except FormatError:
        return "changed"
    ok = (data["vocab"]["source_ids_sha256"] == entry.source_ids_sha256
          and data.get("base_sha256") == REGISTRY[entry.base].sha256)
    return "yes" if ok else "changed"


def build_trimmed(entry, path: Path, *, quiet: bool = True, check_only: bool = False) -> Path:
    """Choose ``entry``'s kept pieces from its pulled base (the corpus rule on the built-in
    corpora), check them against the registry's sha256 and write ``path`` (atomically);
    ``check_only``: compare with the registry and the file there, write nothing."""
    from .data.download import atomic_file
    from .errors import ChecksumError
    from .formats import open_source
    from .registry import REGISTRY, model_path

    base = REGISTRY[entry.base]
    model = open_source(model_path(entry.base))
    spec = VocabSpec(languages=entry.languages, size=entry.vocab_size)
    if not quiet:
        print(f"{entry.name}: choosing the pieces of {', '.join(entry.languages)} on the "
              "built-in corpora (a minute, once)", file=sys.stderr, flush=True)
    ids, record = choose_kept(model.tokenizer, spec, chat_template=model.chat_template,
                              progress=not quiet)
    if record["source_ids_sha256"] != entry.source_ids_sha256:
        raise ChecksumError(
            f"{entry.name}: the pieces chosen from {entry.base} ({record['kept']:,}, sha256 "
            f"{record['source_ids_sha256'][:16]}) are not the registry's ({entry.kept:,}, "
            f"sha256 {entry.source_ids_sha256[:16]}); the corpora or the tokenizer library "
            "tokenize differently here (`pocket pack " + entry.base + " --vocab "
            + ",".join(entry.languages) + "` trims without this check)")
    if check_only:
        if trimmed_state(entry, path) != "yes":
            raise ChecksumError(f"{path}: does not hold the registry's kept set for "
                                f"{entry.name}; rebuild it with `pocket pull {entry.name} "
                                "--force`")
        return path
    data = {"format": TRIMMED_FORMAT, "name": entry.name, "base": entry.base,
            "base_sha256": base.sha256, "vocab": record,
            "source_ids": [int(i) for i in ids]}
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def open_trimmed(path: str | Path):
    """The source model a ``.trim.json`` stands for: its base (pulled and verified), trimmed
    to the recorded pieces."""
    from .errors import ChecksumError
    from .formats import open_source
    from .registry import REGISTRY, pull

    data = read_trimmed(path)
    base = data["base"]
    if base not in REGISTRY:
        raise PocketError(f"{path}: its base model {base!r} is not in this pocketlm's registry")
    if data.get("base_sha256") != REGISTRY[base].sha256:
        raise ChecksumError(f"{path}: built from another version of {base}; delete it and run "
                            "the model again to rebuild it")
    model = open_source(pull(base, quiet=True))
    return trim_source(model, kept=data["source_ids"], record=data["vocab"])
