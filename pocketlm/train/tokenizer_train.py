"""Training a zh+en byte-level BPE tokenizer, and comparing vocabularies.

:func:`train_tokenizer` learns a byte-level BPE vocabulary with Hugging Face ``tokenizers``:

* **byte fallback** — the initial alphabet holds all 256 bytes (GPT-2's byte-to-unicode map),
  so every input, in any script or none, encodes and decodes back to itself;
* **Chinese-aware pre-tokenizer** (:data:`PRE_TOKENIZER_REGEX`) — text is cut into pieces
  before BPE sees it, and merges never cross a piece boundary: runs of Han characters, of
  kana and of hangul are pieces of their own, never joined to Latin letters or digits; CJK and
  fullwidth punctuation form their own pieces too; every digit is a piece; the rest is split
  the way GPT-2 and Qwen split English (contractions, a leading space joined to a word,
  punctuation runs, whitespace);
* **special tokens** — by default ``<|endoftext|>`` (id 0: BOS, EOS and document separator),
  ``<|im_start|>`` (1), ``<|im_end|>`` (2) and ``<|pad|>`` (3), each a single id that ordinary
  text never produces by accident.

The result is a folder holding ``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS, a
ChatML chat template, and a ``pocketlm`` section recording how it was trained), loadable with
:func:`load_trained_tokenizer` or by Hugging Face ``transformers``.

:func:`chars_per_token` and :func:`compare_tokenizers` measure what a vocabulary buys and costs:
characters per token on held-out text (more is better: shorter sequences, faster prefill, more
text per context) against the memory of the embedding table it needs at a given model width.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, PocketError, TextError
from ..tokenizer import Tokenizer, check_whitespace_runs, untokenizable

__all__ = [
    "DEFAULT_SPECIAL_TOKENS",
    "CHATML_TEMPLATE",
    "PRE_TOKENIZER_REGEX",
    "MIN_VOCAB_SIZE_LIMIT",
    "MAX_VOCAB_SIZE",
    "TokenizerTrainingError",
    "train_tokenizer",
    "load_trained_tokenizer",
    "read_training_lines",
    "chars_per_token",
    "embedding_bytes",
    "registry_tokenizer",
    "compare_tokenizers",
    "VocabComparison",
]

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

# ChatML, as Qwen writes it: one <|im_start|>role\n...<|im_end|>\n block per message.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

MAX_VOCAB_SIZE = 1_000_000
MIN_VOCAB_SIZE_LIMIT = 256  # the byte alphabet; specials and at least one merge come on top

# ---------------------------------------------------------------------------------------------
# the pre-tokenizer
# ---------------------------------------------------------------------------------------------

_HAN = r"\p{Han}\p{Bopomofo}"
_KANA = r"\p{Hiragana}\p{Katakana}\x{30FC}"  # U+30FC: the prolonged sound mark ー
_HANGUL = r"\p{Hangul}"
_CJK_LETTERS = _HAN + _KANA + _HANGUL
# CJK symbols and punctuation (、。「」…), fullwidth punctuation (，！？：；（）), vertical and
# small forms. U+3000 (the ideographic space) is left to the whitespace rules; fullwidth
# letters and digits (Ａ, １) are letters and digits like any other.
_CJK_PUNCT = (
    r"\x{3001}-\x{303F}\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF20}\x{FF3B}-\x{FF40}\x{FF5B}-\x{FF65}"
    r"\x{FE10}-\x{FE1F}\x{FE30}-\x{FE4F}"
)

#: The pre-tokenizer's regex (Oniguruma syntax, as ``tokenizers`` runs it); each match is one
#: piece, and BPE merges stay inside a piece. Alternatives are tried in order at each position.
PRE_TOKENIZER_REGEX = "|".join(
    (
        # English contractions, any case: 's 't 're 've 'm 'll 'd
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        # a run of one CJK script, optionally after one space (mixed text: "使用 PyTorch 训练")
        rf" ?[{_HAN}]+",
        rf" ?[{_KANA}]+",
        rf" ?[{_HANGUL}]+",
        # other letters (Latin, Cyrillic, ...), optionally after one non-letter, non-digit,
        # non-CJK character (a space, an opening bracket)
        rf"[^\r\n\p{{L}}\p{{N}}{_CJK_LETTERS}{_CJK_PUNCT}]?[\p{{L}}&&[^{_CJK_LETTERS}]]+",
        # every digit on its own
        r"\p{N}",
        # CJK punctuation runs (。」 ……), then the newlines that follow them
        rf"[{_CJK_PUNCT}]+[\r\n]*",
        # other punctuation and symbols (emoji too), optionally after one space
        rf" ?[^\s\p{{L}}\p{{N}}{_CJK_PUNCT}]+[\r\n]*",
        # whitespace: line breaks, runs of spaces except the one a following word takes
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

PRE_TOKENIZER_NAME = "pocket-zh-en-v1"


class TokenizerTrainingError(PocketError, ValueError):
    """Bad training input: no files, an empty corpus, a file that is not UTF-8 text, or an
    impossible vocabulary size."""


# ---------------------------------------------------------------------------------------------
# reading the corpus
# ---------------------------------------------------------------------------------------------

_READ_CHUNK = 1 << 16


def _check_file(path: Path) -> int:
    """Fail early on a missing, empty or binary file; return its size in bytes."""
    if not path.exists():
        raise TokenizerTrainingError(f"{path}: no such file")
    if not path.is_file():
        raise TokenizerTrainingError(f"{path}: not a regular file (training data must be text files)")
    size = path.stat().st_size
    if size == 0:
        raise TokenizerTrainingError(f"{path}: the file is empty")
    with open(path, "rb") as fh:
        head = fh.read(_READ_CHUNK)
    nul = head.find(b"\0")
    if nul >= 0:
        raise TokenizerTrainingError(
            f"{path}: binary file (a NUL byte at offset {nul}), not UTF-8 text"
        )
    # the first chunk's bytes too (a character cut by the chunk's end is fine): a file that is
    # not text is refused before training starts its progress bar, not after
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError as e:
        raise TokenizerTrainingError(
            f"{path}: not UTF-8 text (byte 0x{head[e.start]:02x} at offset {e.start})"
        ) from None
    return size


def _file_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (with their line ends), streamed.

    A leading byte-order mark is dropped. Bytes that are not UTF-8 raise
    :class:`TokenizerTrainingError` naming the file, line and byte offset.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            nul = raw.find(b"\0")
            if nul >= 0:
                raise TokenizerTrainingError(
                    f"{path}: binary data (a NUL byte at offset {offset + nul}, "
                    f"line {lineno}), not UTF-8 text"
                )
            try:
                line = decoder.decode(raw)
            except UnicodeDecodeError as e:
                raise TokenizerTrainingError(
                    f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                    f"{offset + e.start}, line {lineno}); convert it first, e.g. "
                    f"`iconv -f GBK -t UTF-8`"
                ) from None
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            offset += len(raw)
            yield line
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise TokenizerTrainingError(
                f"{path}: not UTF-8 text (the file ends inside a multi-byte character at "
                f"offset {offset})"
            ) from None


def read_training_lines(sources: Iterable[Path | str]) -> Iterator[str]:
    """The non-blank lines of the training data, in order, each with its line end.

    ``sources`` holds :class:`~pathlib.Path` objects (UTF-8 text files, streamed) and ``str``
    objects (text given directly, split into lines). Lines holding only whitespace are skipped.
    """
    for src in sources:
        if isinstance(src, os.PathLike):
            _check_file(Path(src))
            lines: Iterable[str] = _file_lines(Path(src))
        elif isinstance(src, str):
            lines = src.splitlines(keepends=True)
        else:
            raise TypeError(
                f"training data items must be Path (a text file) or str (text), "
                f"not {type(src).__name__}"
            )
        for line in lines:
            if line.strip():
                yield line


def _reservoir(lines: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` lines (all of them if fewer), in their original order."""
    rng = random.Random(seed)
    sample: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        if i < k:
            sample.append((i, line))
        else:
            j = rng.randint(0, i)
            if j < k:
                sample[j] = (i, line)
    sample.sort()
    return [line for _, line in sample]


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def _check_vocab_size(vocab_size: int, n_special: int, name: str = "vocab_size") -> None:
    """``name``: how the caller calls it (``--vocab-size`` on the command line)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TokenizerTrainingError(f"{name} must be an integer, not {vocab_size!r}")
    smallest = MIN_VOCAB_SIZE_LIMIT + n_special + 1
    if vocab_size < smallest:
        raise TokenizerTrainingError(
            f"{name} {vocab_size} is too small: the 256 byte tokens and {n_special} special "
            f"tokens already take {MIN_VOCAB_SIZE_LIMIT + n_special} ids; use at least {smallest} "
            "(32000-64000 suits a zh+en model)"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise TokenizerTrainingError(
            f"{name} {vocab_size} is beyond {MAX_VOCAB_SIZE:,}; an embedding table that "
            "large defeats a small model (32000-64000 suits a zh+en model)"
        )


def _check_special_tokens(special_tokens: Sequence[str]) -> list[str]:
    out = list(special_tokens)
    if not out:
        raise TokenizerTrainingError(
            "special_tokens is empty: at least one (the end-of-text token) is needed"
        )
    for t in out:
        if not isinstance(t, str) or not t.strip():
            raise TokenizerTrainingError(f"special token {t!r} is not a non-blank string")
        if t.replace(" ", "").replace("_", "").isalnum():
            # a control token is matched wherever its text occurs: every "the", even inside
            # "then", would have become the end-of-text token
            raise TokenizerTrainingError(f"special token {t!r} is plain text, which ordinary "
                                         "text holds; mark it off, e.g. <|" + t.strip() + "|>")
    dupes = sorted({t for t in out if out.count(t) > 1})
    if dupes:
        raise TokenizerTrainingError(f"special tokens repeated: {', '.join(dupes)}")
    return out


def _build_tokenizer():
    """An untrained Hugging Face tokenizer with the pipeline described in the module docstring."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def _tokenizer_config(special_tokens: list[str], training: dict) -> dict:
    """``tokenizer_config.json``: BOS/EOS in Hugging Face's keys, the chat template, and how
    the vocabulary was trained (under ``pocketlm``)."""
    end = special_tokens[0]
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": end,
        # transformers wants one string here; pocketlm also ends generation at <|im_end|>
        # (Tokenizer.from_hf_file adds every end-of-turn token the vocabulary holds)
        "eos_token": end,
        "pad_token": "<|pad|>" if "<|pad|>" in special_tokens else end,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": special_tokens[1:],
    }
    if "<|im_start|>" in special_tokens and "<|im_end|>" in special_tokens:
        config["chat_template"] = CHATML_TEMPLATE
    config["pocketlm"] = training
    return config


def _write_atomic(out_dir: Path, files: dict[str, str]) -> None:
    """Write ``files`` (name: text) into ``out_dir`` as one: each to a temporary first, so that
    an error or Ctrl-C while they are written leaves no partial file and an earlier set as it
    was; then they are renamed into place in their order, an earlier copy of the last one
    removed before the first rename (the last, tokenizer.json, marks a folder as holding a
    tokenizer: a stop between the renames leaves none, never the earlier one read with this
    one's config)."""
    temps = {name: out_dir / (name + ".partial") for name in files}
    try:
        for name, text in files.items():
            temps[name].write_text(text, encoding="utf-8")
        with contextlib.suppress(FileNotFoundError):
            (out_dir / list(files)[-1]).unlink()
        for name, tmp in temps.items():
            os.replace(tmp, out_dir / name)
    except BaseException:  # no partial file left behind
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def train_tokenizer(
    files: Sequence[Path] | Iterable[str],
    vocab_size: int,
    out_dir: Path,
    *,
    min_frequency: int = 2,
    special_tokens: Sequence[str] | None = None,
    progress: bool = True,
    seed: int = 0,
    sample_lines: int | None = None,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on zh+en text and save it to ``out_dir``.

    ``files`` holds :class:`~pathlib.Path` objects, UTF-8 text files streamed line by line, or
    ``str`` objects, text given directly (an iterable of documents or lines; a plain ``str`` is
    text, never a file name). Blank lines are skipped; each other line, with its line end, is
    one training sequence. ``vocab_size`` counts every id: the special tokens (ids 0, 1, ...,
    in the order given; default :data:`DEFAULT_SPECIAL_TOKENS`), the 256 byte tokens and the
    learned merges. A small corpus can end with fewer tokens than asked. Merges seen fewer
    than ``min_frequency`` times are not learned. ``sample_lines`` trains on a uniform random
    sample of that many lines (drawn with ``seed``) instead of the whole corpus; the training
    itself is deterministic, so the same input and settings give the same ``tokenizer.json``.

    Writes ``out_dir/tokenizer.json`` and ``out_dir/tokenizer_config.json`` and returns the
    tokenizer as :meth:`pocketlm.tokenizer.Tokenizer.from_hf_file` loads it. Raises
    :class:`TokenizerTrainingError` for no input, an empty corpus, a file that is missing,
    binary or not UTF-8, bad special tokens, or a vocabulary size below
    256 + specials + 1 or above 1,000,000.
    """
    from tokenizers import pre_tokenizers, trainers

    specials = _check_special_tokens(
        DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens
    )
    _check_vocab_size(vocab_size, len(specials))
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 0:
        raise TokenizerTrainingError(
            f"min_frequency must be a non-negative integer, not {min_frequency!r}"
        )
    if sample_lines is not None and (not isinstance(sample_lines, int) or sample_lines < 1):
        raise TokenizerTrainingError(f"sample_lines must be a positive integer, not {sample_lines!r}")
    if isinstance(files, (str, os.PathLike)):
        files = [files]  # one file or one text, not an iterable of characters
    described: list[dict] = []
    if isinstance(files, Sequence):
        if not files:
            raise TokenizerTrainingError("no training data: give at least one text file")
        # check every file before the (long) training starts
        for src in files:
            if isinstance(src, os.PathLike):
                described.append({"file": Path(src).name, "bytes": _check_file(Path(src))})
        n_texts = sum(isinstance(src, str) for src in files)
        if n_texts:
            described.append({"texts": n_texts})
    else:
        described.append({"texts": "iterable"})

    stats = {"lines": 0, "chars": 0}

    def counted(lines: Iterable[str]) -> Iterator[str]:
        for line in lines:
            stats["lines"] += 1
            stats["chars"] += len(line)
            try:
                check_whitespace_runs([line])  # before the library's pattern gives up on it
            except TextError as e:
                raise TokenizerTrainingError(f"training line {stats['lines']:,}: {e}") from None
            yield line

    lines: Iterable[str] = read_training_lines(files)
    if sample_lines is not None:
        lines = _reservoir(lines, sample_lines, seed)

    def batches(it: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
        batch: list[str] = []
        for line in it:
            batch.append(line)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    hf = _build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    # A TokenizerTrainingError raised while reading (a bad byte deep in a file) surfaces
    # through the Rust trainer as itself.
    try:
        with untokenizable():
            hf.train_from_iterator(batches(counted(lines)), trainer=trainer)
    except TextError as e:  # the library failed on a line (a Rust panic)
        raise TokenizerTrainingError(f"a line of the corpus: {e}") from None
    if stats["lines"] == 0:
        paths = [str(s) for s in files if isinstance(s, os.PathLike)] if isinstance(files, Sequence) else []
        names = ", ".join(paths) or "the texts given"
        raise TokenizerTrainingError(f"the training corpus is empty: no non-blank lines in {names}")

    training = {
        "trainer": "byte-level BPE (Hugging Face tokenizers)",
        "pre_tokenizer": PRE_TOKENIZER_NAME,
        "vocab_size_requested": vocab_size,
        "vocab_size": hf.get_vocab_size(with_added_tokens=True),
        "min_frequency": min_frequency,
        "special_tokens": specials,
        "seed": seed,
        "sample_lines": sample_lines,
        "training_lines": stats["lines"],
        "training_chars": stats["chars"],
        "sources": described,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _tokenizer_config(specials, training)
    # the config first: tokenizer.json is what marks a folder as holding a tokenizer (a run
    # resumes with it), and read without its config it would lose its end-of-text and template
    _write_atomic(out_dir, {
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2) + "\n",
        "tokenizer.json": hf.to_str(pretty=True),
    })
    return Tokenizer.from_hf_file(out_dir / "tokenizer.json", config)


def load_trained_tokenizer(out_dir: Path) -> Tokenizer:
    """Load a folder written by :func:`train_tokenizer` (or any folder with a byte-level BPE
    ``tokenizer.json`` and, optionally, ``tokenizer_config.json``)."""
    out_dir = Path(out_dir)
    tok_path = out_dir / "tokenizer.json"
    if not out_dir.is_dir():
        raise FormatError(f"{out_dir}: no such tokenizer folder")
    if not tok_path.is_file():
        raise FormatError(
            f"{out_dir} has no tokenizer.json; train one with `pocket tokenizer train`"
        )
    cfg_path = out_dir / "tokenizer_config.json"
    config: dict = {}
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise FormatError(f"{cfg_path}: expected a JSON object, found {type(config).__name__}")
    return Tokenizer.from_hf_file(tok_path, config)


# ---------------------------------------------------------------------------------------------
# comparing vocabularies
# ---------------------------------------------------------------------------------------------

INT4_BITS_PER_WEIGHT = 4.5  # 4-bit weights plus one float16 scale per group of 32 (4 + 16/32)


def chars_per_token(tokenizer: Tokenizer, texts: Iterable[str]) -> float:
    """Characters (Unicode code points) per token over ``texts``, each encoded on its own,
    without BOS and with special-token texts read as plain text. Higher is better."""
    chars = tokens = 0
    for text in texts:
        chars += len(text)
        tokens += len(tokenizer.encode(text, add_bos=False, special=False))
    if tokens == 0:
        raise PocketError("chars_per_token: the texts are empty")
    return chars / tokens


def embedding_bytes(vocab_size: int, d_model: int, bits_per_weight: float) -> int:
    """Bytes of a ``vocab_size`` x ``d_model`` embedding table at ``bits_per_weight``."""
    return round(vocab_size * d_model * bits_per_weight / 8)


def registry_tokenizer(name: str, *, quiet: bool = True) -> Tokenizer:
    """The tokenizer of registry model ``name`` (pulled first if needed), built from its GGUF."""
    import gguf

    from ..formats.gguf_vocab import tokenizer_from_gguf_fields
    from ..registry import pull

    path = pull(name, quiet=quiet)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return tokenizer_from_gguf_fields(fields)


@dataclass(frozen=True)
class VocabComparison:
    """One vocabulary measured: what it buys (characters per token) and what it costs (the
    embedding table at ``d_model``, in MB = 10^6 bytes)."""

    name: str
    vocab_size: int
    chars_per_token_en: float
    chars_per_token_zh: float
    d_model: int
    embed_mb_f16: float
    embed_mb_int4: float

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "chars_per_token_en": round(self.chars_per_token_en, 3),
            "chars_per_token_zh": round(self.chars_per_token_zh, 3),
            "d_model": self.d_model,
            "embed_mb_f16": round(self.embed_mb_f16, 1),
            "embed_mb_int4": round(self.embed_mb_int4, 1),
        }


def compare_tokenizers(
    tokenizers: Mapping[str, Tokenizer],
    heldout_en: Sequence[str],
    heldout_zh: Sequence[str],
    *,
    d_model: int = 960,
    progress: bool = True,
) -> list[VocabComparison]:
    """Measure each named tokenizer on held-out English and Chinese text, and its embedding
    memory at width ``d_model`` in float16 and INT4 (:data:`INT4_BITS_PER_WEIGHT` bits per
    weight incl. scales). The held-out text must not have been used to train any of them."""
    from ..progress import track

    if not heldout_en or not heldout_zh:
        raise PocketError("compare_tokenizers needs non-empty English and Chinese held-out text")
    if d_model < 1:
        raise PocketError(f"d_model must be positive, not {d_model}")
    out = []
    for name, tok in track(list(tokenizers.items()), "measuring", "tokenizer",
                           enabled=progress):
        v = tok.vocab_size
        out.append(
            VocabComparison(
                name=name,
                vocab_size=v,
                chars_per_token_en=chars_per_token(tok, heldout_en),
                chars_per_token_zh=chars_per_token(tok, heldout_zh),
                d_model=d_model,
                embed_mb_f16=embedding_bytes(v, d_model, 16) / 1e6,
                embed_mb_int4=embedding_bytes(v, d_model, INT4_BITS_PER_WEIGHT) / 1e6,
            )
        )
    return out
