"""Token shards: documents → tokenized, EOS-separated binary shards → training batches.

A shard set is a folder::

    meta.json        {"format": "pocketlm-shards", "version": 1, "dtype": "uint16"|"uint32",
                      "vocab_size", "eos_id", "splits": {"train": {"files", "tokens", "documents"},
                      "val": {...}}, "tokenizer_sha256", "vocabulary_sha256", "sources": [...]}
    train_000.bin    raw little-endian token ids, one document after another, each followed by
    train_001.bin    ``eos_id`` (``uint16`` when the vocabulary has at most 65535 tokens)
    val_000.bin

A document goes to the held-out ``val`` split when a keyed hash of its text falls below
``holdout``: the split of a document depends only on its text and the seed, never on the order
documents arrive in; copies of one text therefore all land in the same split, and each split
records its ``distinct_documents`` as well as its ``documents``
(:func:`check_trainable_splits` uses both to say why a split is too small).

A set is written into a temporary sibling folder (``.{name}.tmp-{pid}-{hex}``) and renamed into
place when complete, so an error or Ctrl-C never leaves a half-written set behind; the temp
folders of writers killed outright (their pid no longer alive) are removed by the next write of
the same set.

:class:`TokenShards` reads a split back through read-only memory maps. Its batches are a pure
function of ``(seed, step)``, so a resumed run sees the same batches, and data-parallel ranks
split one global batch between them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import uuid
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pocketlm.config import short_repr
from pocketlm.errors import FormatError, PocketError

SHARDS_FORMAT = "pocketlm-shards"
SHARDS_VERSION = 1
SPLITS = ("train", "val")
ENCODE_BATCH_DOCS = 512  # documents tokenized per call of the tokenizer


# -- writing ------------------------------------------------------------------------------------


def prepare_shards(
    documents: Iterable[str],
    tokenizer: Any,
    out_dir: Path,
    *,
    holdout: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
    sources: list[dict] | None = None,
) -> dict:
    """Tokenize ``documents`` into a shard set in ``out_dir`` and return its ``meta.json`` dict.

    Each document is encoded with ``tokenizer.encode(doc, add_bos=False)`` (batched through
    ``tokenizer.hf.encode_batch`` when that gives the same ids) and followed by
    ``tokenizer.eos_ids[0]``. A document goes to ``val`` with probability ``holdout``, decided by
    a hash of its text keyed with ``seed``. Each split is cut into files of at most
    ``shard_tokens`` tokens. ``sources`` (for example a corpus manifest's entries) is recorded in
    ``meta.json`` as is. An existing shard set in ``out_dir`` is replaced only once the new one
    is complete; a folder holding anything else is refused.
    """
    out_dir = Path(out_dir)
    if not 0.0 <= float(holdout) < 1.0:
        raise PocketError(f"holdout must be in [0, 1), got {holdout}")
    if int(shard_tokens) < 1:
        raise PocketError(f"shard_tokens must be at least 1, got {shard_tokens}")
    eos_ids = list(getattr(tokenizer, "eos_ids", None) or [])
    if not eos_ids:
        raise PocketError("the tokenizer has no end-of-sequence token to separate documents with")
    eos_id = int(eos_ids[0])
    vocab_size = int(tokenizer.vocab_size)
    dtype = np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")
    _check_replaceable(out_dir)

    tmp = _temp_sibling(out_dir)
    tmp.mkdir()
    try:
        writers = {s: _SplitWriter(tmp, s, dtype, int(shard_tokens)) for s in SPLITS}
        bar = _progress_bar(progress, f"tokenizing → {out_dir.name}", "docs")
        batch: list[str] = []

        def flush() -> None:
            for doc, ids in zip(batch, _encode_many(tokenizer, batch), strict=True):
                digest = _doc_digest(doc, seed)
                split = "val" if digest / 2.0**64 < holdout else "train"
                writers[split].add(ids, eos_id, vocab_size, digest)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tokens=sum(w.tokens for w in writers.values()), refresh=False)
            batch.clear()

        for doc in documents:
            if not isinstance(doc, str):
                raise PocketError(f"documents must be str, got {type(doc).__name__}")
            if not doc:
                continue
            batch.append(doc)
            if len(batch) >= ENCODE_BATCH_DOCS:
                flush()
        flush()
        if bar is not None:
            bar.close()
        for w in writers.values():
            w.close()
        if writers["train"].tokens == 0 and writers["val"].tokens == 0:
            raise PocketError("no documents to write: the document stream was empty")
        if writers["train"].tokens == 0:
            raise PocketError(f"--holdout {holdout} sent all {writers['val'].documents} "
                              f"documents to the held-out split and none to train on; give a "
                              f"smaller --holdout (the default is 0.01)")
        meta = {
            "format": SHARDS_FORMAT,
            "version": SHARDS_VERSION,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "splits": {s: w.summary() for s, w in writers.items()},
            "holdout": float(holdout),
            "seed": int(seed),
            "tokenizer_sha256": tokenizer_sha256(tokenizer),
            "vocabulary_sha256": vocabulary_sha256(tokenizer),
            "sources": list(sources or []),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        _swap_into_place(tmp, out_dir)
    except BaseException:  # includes KeyboardInterrupt: never leave a partial set behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def prepare_text_file(
    path: Path,
    tokenizer: Any,
    out_dir: Path,
    *,
    holdout: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
) -> dict:
    """Shard one UTF-8 text file: documents are separated by blank lines; in a ``.jsonl`` /
    ``.ndjson`` file each line is a JSON object whose ``"text"`` field is one document.

    Empty, binary (a NUL byte) and non-UTF-8 files are refused with the file and byte offset.
    Returns the shard set's ``meta.json`` dict (see :func:`prepare_shards`).
    """
    path = Path(path)
    documents = read_text_documents(path)
    source = {
        "name": path.name,
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "documents": len(documents),
        "characters": sum(len(d) for d in documents),
    }
    return prepare_shards(
        documents,
        tokenizer,
        out_dir,
        holdout=holdout,
        seed=seed,
        shard_tokens=shard_tokens,
        progress=progress,
        sources=[source],
    )


def read_text_documents(path: Path) -> list[str]:
    """The documents of a text or JSONL file, as :func:`prepare_text_file` reads them."""
    from ..textfile import read_text_file

    path = Path(path)
    text = read_text_file(path)
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        documents = _jsonl_documents(path, text)
    else:
        documents = [d.strip() for d in re.split(r"\n[ \t]*\n", text)]
        documents = [d for d in documents if d]
    if not documents:
        raise PocketError(f"{path}: holds no documents")
    return documents


def check_trainable_splits(shards: Path, seq_len: int, *, data: str | Path | None = None) -> None:
    """Refuse a shard set whose training or held-out split is shorter than one sequence of
    ``seq_len + 1`` tokens, naming the reason: no held-out split asked for (holdout 0), one
    document (a text file without blank lines between documents), copies of few distinct
    documents (all copies of a text take the same split), or too little text. ``data`` names
    the source in the message (default: the shard folder). A folder without a readable
    ``meta.json`` is left to :class:`TokenShards` to refuse."""
    shards = Path(shards)
    try:
        meta = json.loads((shards / "meta.json").read_text(encoding="utf-8"))
        splits = meta["splits"]
        tokens = {s: int(splits[s]["tokens"]) for s in SPLITS}
        docs = {s: int(splits[s]["documents"]) for s in SPLITS}
    except (OSError, ValueError, KeyError, TypeError):
        return
    need = int(seq_len) + 1
    short = [s for s in SPLITS if tokens[s] < need]
    if not short:
        return
    split = min(short, key=lambda s: docs[s])  # an empty split is the cause to name
    label = {"train": "training", "val": "held-out"}[split]
    other = {"train": "held-out", "val": "training"}[split]
    where = data if data is not None else shards
    holdout = meta.get("holdout")
    n = docs["train"] + docs["val"]
    try:
        distinct = sum(int(splits[s]["distinct_documents"]) for s in SPLITS)
    except (KeyError, TypeError, ValueError):
        distinct = None  # a set written before the distinct count was recorded
    counted = f"{n} document{'s' * (n != 1)}" + (f", {distinct} distinct" if distinct is not None
                                                  else "")
    lead = (f"{where}: the {label} split has {tokens[split]} tokens, fewer than one sequence of "
            f"--seq-len {seq_len} + 1")
    by_hash = "the held-out split takes whole documents by hash"
    holdout_fix = "a larger --holdout" if split == "val" else "a smaller --holdout"
    if split == "val" and holdout == 0:
        raise PocketError(f"{lead}: --holdout 0 means no held-out split, but pocket train "
                          "measures the held-out loss every --eval-every steps and needs one; "
                          "prepare the data with a --holdout above 0 (the default is 0.01)")
    if n == 1 or distinct == 1:
        one = ("it is one document: a text file's documents are separated by blank lines, and "
               "it has none between them" if n == 1 else
               f"all {n} documents are the same text")
        raise PocketError(f"{lead} ({counted}): {by_hash}, so the {other} split got all of "
                          f"it; {one}. Separate documents with blank lines (in JSONL: one "
                          '{"text": ...} object per line)')
    if docs[split] == 0:
        copies = (f", and copies of a text all go to the same split, so {distinct} distinct "
                  f"texts are what is split" if distinct is not None and distinct < n else "")
        raise PocketError(f"{lead} ({counted}): {by_hash} (--holdout {holdout}){copies}, and "
                          f"the {label} split got none; use more distinct documents, separated "
                          f"by blank lines, or {holdout_fix}")
    raise PocketError(f"{lead} ({counted}; {docs[split]} in the {label} split): use more text, "
                      f"{holdout_fix} or a shorter --seq-len")


def _jsonl_documents(path: Path, text: str) -> list[str]:
    from ..textfile import json_line
    from ..tokenizer import check_text

    documents = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json_line(line)
        except ValueError as e:
            raise PocketError(f"{path}:{lineno}: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise PocketError(f'{path}:{lineno}: expected an object with a string "text" field')
        try:  # a JSON "\ud800" is valid JSON but no text: no tokenizer encodes it
            check_text(record["text"], '"text"')
        except PocketError as e:
            raise PocketError(f"{path}:{lineno}: {e}") from None
        if record["text"].strip():
            documents.append(record["text"])
    return documents


def tokenizer_sha256(tokenizer: Any) -> str | None:
    """SHA-256 of the tokenizer's serialised form (``to_json()``), or None if it has none."""
    if hasattr(tokenizer, "to_json"):
        blob = tokenizer.to_json()
    elif hasattr(getattr(tokenizer, "hf", None), "to_str"):
        blob = tokenizer.hf.to_str()
    else:
        return None
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def vocabulary_sha256(tokenizer: Any) -> str | None:
    """SHA-256 of the tokenizer's token strings by id, or None if it cannot list them.

    Unlike :func:`tokenizer_sha256` it does not depend on how the tokenizer was stored (a GGUF
    file's and a Hugging Face folder's copy of one vocabulary agree), so a training run can
    refuse shards of another vocabulary without refusing the same one read another way: two
    tokenizers trained to one size share the size and end-of-text id, and nothing else."""
    if not hasattr(tokenizer, "id_to_token"):
        return None
    tokens = [tokenizer.id_to_token(i) for i in range(int(tokenizer.vocab_size))]
    return hashlib.sha256(json.dumps(tokens, ensure_ascii=False).encode("utf-8")).hexdigest()


def _doc_digest(doc: str, seed: int) -> int:
    """A 64-bit number that depends only on the document's text and ``seed``."""
    digest = hashlib.blake2b(
        doc.encode("utf-8"), digest_size=8, key=int(seed).to_bytes(8, "little", signed=True)
    ).digest()
    return int.from_bytes(digest, "little")


def _holdout_hash(doc: str, seed: int) -> float:
    """A number in [0, 1) that depends only on the document's text and ``seed``."""
    return _doc_digest(doc, seed) / 2.0**64


def _encode_many(tokenizer: Any, docs: list[str]) -> list[list[int]]:
    """``[tokenizer.encode(d, add_bos=False) for d in docs]``, batched where that is exact."""
    if not docs:
        return []
    from pocketlm.tokenizer import Tokenizer

    hf = getattr(tokenizer, "hf", None)
    # A plain pocketlm Tokenizer encodes with hf.encode(add_special_tokens=False) and drops one
    # placeholder id; encode_batch does the same work on all cores. Subclasses (SentencePiece)
    # and foreign tokenizers go through their own encode().
    if isinstance(tokenizer, Tokenizer) and type(tokenizer).encode is Tokenizer.encode and hf:
        encodings = hf.encode_batch(docs, add_special_tokens=False)
        dropped = getattr(tokenizer, "_dropped_id", None)
        if dropped is None:
            return [e.ids for e in encodings]
        return [[i for i in e.ids if i != dropped] for e in encodings]
    return [tokenizer.encode(d, add_bos=False) for d in docs]


class _SplitWriter:
    """Appends token ids to ``{split}_000.bin``, ``{split}_001.bin``, ... of at most
    ``shard_tokens`` tokens each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.files: list[str] = []
        self.tokens = 0
        self.documents = 0
        self._digests = array("Q")  # one per document (8 bytes each), for the distinct count
        self._fh = None
        self._in_file = 0

    def add(self, ids: list[int], eos_id: int, vocab_size: int, digest: int = 0) -> None:
        arr = np.empty(len(ids) + 1, dtype=np.int64)
        arr[:-1] = ids
        arr[-1] = eos_id
        if arr.size and (arr.min() < 0 or arr.max() >= max(vocab_size, eos_id + 1)):
            raise PocketError(
                f"the tokenizer produced id {int(arr.max())} outside its vocabulary "
                f"of {vocab_size} tokens"
            )
        arr = arr.astype(self.dtype)
        self.documents += 1
        self._digests.append(digest)
        pos = 0
        while pos < arr.size:
            if self._fh is None or self._in_file >= self.shard_tokens:
                self._open_next()
            n = min(arr.size - pos, self.shard_tokens - self._in_file)
            self._fh.write(arr[pos : pos + n].tobytes())
            self._in_file += n
            self.tokens += n
            pos += n

    def _open_next(self) -> None:
        if self._fh is not None:
            self._fh.close()
        name = f"{self.split}_{len(self.files):03d}.bin"
        self._fh = open(self.folder / name, "wb")  # noqa: SIM115 (closed by close/_open_next)
        self.files.append(name)
        self._in_file = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def summary(self) -> dict:
        distinct = int(np.unique(np.frombuffer(self._digests, dtype=np.uint64)).size)
        return {"files": list(self.files), "tokens": self.tokens, "documents": self.documents,
                "distinct_documents": distinct}


def _is_shard_set(folder: Path) -> bool:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == SHARDS_FORMAT


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise PocketError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()) and not _is_shard_set(out_dir):
            raise PocketError(
                f"{out_dir}: the folder is not empty and holds no shard set; "
                "choose an empty or new folder"
            )


def _sweep_dead_writers(out_dir: Path) -> None:
    """Remove the temp folders (``.{name}.tmp-{pid}-{hex}``) that writers of ``out_dir`` killed
    by a signal left behind: those whose process is gone (a reused pid keeps its folder); also
    the earlier folder that :func:`replace_folder` had moved aside (``.{name}.old-{pid}-{hex}``)
    when a kill came between its two renames."""
    pattern = re.compile(re.escape(f".{out_dir.name}.") + r"(?:tmp|old)-(\d+)-[0-9a-f]{8}")
    try:
        entries = list(out_dir.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _process_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True  # another user's process (EPERM), or a pid we cannot ask about: keep it
    return True


def _temp_sibling(out_dir: Path) -> Path:
    """A new name (``.{name}.tmp-{pid}-{hex}``) beside ``out_dir`` to write its next version
    under; the parent is made, and the temp folders of dead writers of ``out_dir`` removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _sweep_dead_writers(out_dir)
    return out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """A temp sibling of ``out_dir`` (not yet made) to write a new version of that folder
    into, for :func:`replace_folder` to put in place; removed if that has not happened when
    the block ends (an error or Ctrl-C before it)."""
    tmp = _temp_sibling(Path(out_dir))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` folder to ``out_dir``, replacing an older shard set."""
    _check_replaceable(out_dir)
    replace_folder(tmp, out_dir)


def replace_folder(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` folder to ``out_dir``; a folder there is replaced whole
    (moved aside, then removed once the new one is in place)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _progress_bar(enabled: bool, desc: str, unit: str):
    """A bar of unknown length (pocketlm.progress: plain lines off a terminal), or None."""
    if not enabled:
        return None
    from ..progress import bar

    return bar(None, desc, unit)


# -- reading ------------------------------------------------------------------------------------


class TokenShards:
    """One split (``"train"`` or ``"val"``) of a shard set, memory-mapped read-only.

    The split reads as one token stream, the files one after another; training windows may span
    file boundaries, as they span document boundaries (documents are separated by ``eos_id``).
    """

    def __init__(self, out_dir: Path, split: str = "train"):
        self.path = Path(out_dir)
        self.split = split
        meta_path = self.path / "meta.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PocketError(
                f"{self.path}: not a shard set (no meta.json); create one with prepare_shards"
            ) from None
        except (OSError, ValueError) as e:
            raise FormatError(f"{meta_path}: cannot read: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != SHARDS_FORMAT:
            raise FormatError(
                f"{meta_path}: not a pocketlm shard set (format is not {SHARDS_FORMAT!r})"
            )
        if meta.get("version") != SHARDS_VERSION:
            raise FormatError(
                f"{meta_path}: shard format version {meta.get('version')!r} is not "
                f"supported (expected {SHARDS_VERSION})"
            )
        if meta.get("dtype") not in ("uint16", "uint32"):
            raise FormatError(f"{meta_path}: unknown dtype {meta.get('dtype')!r}")
        splits = meta.get("splits") or {}
        if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
            raise FormatError(f"{meta_path}: 'splits' is not an object of split records")
        if split not in splits:
            raise PocketError(f"{self.path}: no split {split!r} (has: {', '.join(splits)})")
        self.meta = meta
        try:
            self.vocab_size = int(meta["vocab_size"])
            self.eos_id = int(meta["eos_id"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{meta_path}: vocab_size and eos_id must be integers, got "
                              f"{meta.get('vocab_size')!r} and {meta.get('eos_id')!r}") from None
        self.dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        info = splits[split]
        if not isinstance(info.get("files", []), list) or not all(
                isinstance(f, str) for f in info.get("files", [])):
            raise FormatError(f"{meta_path}: split {split!r}: 'files' is not a list of names")
        self._arrays: list[np.ndarray] = []
        total = 0
        for name in info.get("files", []):
            f = self.path / name
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                raise FormatError(f"{f}: shard file is missing") from None
            if size % self.dtype.itemsize:
                raise FormatError(f"{f}: size {size} is not a multiple of {self.dtype.itemsize}")
            if size:
                self._arrays.append(np.memmap(f, dtype=self.dtype, mode="r"))
            total += size // self.dtype.itemsize
        if not isinstance(info.get("tokens"), int) or total != info["tokens"]:
            raise FormatError(
                f"{self.path}: split {split!r} holds {total} tokens, meta.json says "
                f"{info.get('tokens')} (truncated or modified shard files)"
            )
        self.n_tokens = total
        self._offsets = np.cumsum([0] + [a.size for a in self._arrays])

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, split={self.split!r}, "
            f"n_tokens={self.n_tokens}, vocab_size={self.vocab_size})"
        )

    def _check_fits(self, seq_len: int) -> None:
        if int(seq_len) < 1:
            raise PocketError(f"seq_len must be at least 1, got {seq_len}")
        if self.n_tokens < seq_len + 1:
            raise PocketError(
                f"the corpus is too small for seq_len {seq_len}: split {self.split!r} of "
                f"{self.path} has {self.n_tokens} tokens, a window needs {seq_len + 1}"
            )

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start+length-1`` of the split as int64 (may span files)."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"window {start}+{length} outside the split of {self.n_tokens}")
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            arr = self._arrays[k]
            lo = start + filled - int(self._offsets[k])
            n = min(length - filled, arr.size - lo)
            out[filled : filled + n] = arr[lo : lo + n]
            filled += n
            k += 1
        if length and int(out.max()) >= self.vocab_size:
            # a damaged shard file: the id would index past the embedding table
            raise FormatError(
                f"{self.path}: split {self.split!r} holds token id {int(out.max())} near token "
                f"{start}, outside the {self.vocab_size}-token vocabulary of meta.json (a "
                "damaged shard file; prepare the shards again)"
            )
        return out

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> np.ndarray:
        """Random windows, int64 ``[batch_size, seq_len + 1]`` (inputs ``[:, :-1]``, targets
        ``[:, 1:]``).

        The start positions are a pure function of ``(seed, step)``: one global batch of
        ``batch_size * world`` windows is drawn per step and rank ``r`` takes rows
        ``r * batch_size .. (r + 1) * batch_size - 1`` of it. Resuming at ``step`` therefore
        repeats the same batches, and ``world`` ranks together see what one process with
        ``batch_size * world`` would.
        """
        for name, v, lo in (
            ("step", step, 0),
            ("seed", seed, 0),
            ("batch_size", batch_size, 1),
            ("world", world, 1),
        ):
            if int(v) < lo:
                raise PocketError(f"{name} must be at least {lo}, got {v}")
        if not 0 <= int(rank) < int(world):
            raise PocketError(f"rank must be in [0, {world}), got {rank}")
        self._check_fits(seq_len)
        rng = np.random.default_rng([int(seed), int(step)])
        starts = rng.integers(0, self.n_tokens - seq_len, size=int(batch_size) * int(world))
        mine = starts[int(rank) * int(batch_size) : (int(rank) + 1) * int(batch_size)]
        return np.stack([self.window(int(s), seq_len + 1) for s in mine])

    def n_eval_windows(self, seq_len: int) -> int:
        """How many windows :meth:`iter_eval_batches` has at most for ``seq_len``."""
        self._check_fits(seq_len)
        return (self.n_tokens - 1) // int(seq_len)

    def iter_eval_batches(
        self, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> Iterator[np.ndarray]:
        """Deterministic held-out batches, int64 ``[rows, seq_len + 1]``.

        Window ``i`` starts at token ``i * seq_len``: consecutive windows share only their
        boundary token, so every token after the first is a target exactly once. The last batch
        may have fewer than ``batch_size`` rows; at most ``max_batches`` batches (all if None).
        """
        if int(batch_size) < 1:
            raise PocketError(f"batch_size must be at least 1, got {batch_size}")
        n = self.n_eval_windows(seq_len)
        if max_batches is not None:
            n = min(n, int(max_batches) * int(batch_size))
        for first in range(0, n, int(batch_size)):
            rows = range(first, min(first + int(batch_size), n))
            yield np.stack([self.window(i * int(seq_len), int(seq_len) + 1) for i in rows])


# -- mixtures -----------------------------------------------------------------------------------

DEFAULT_MIXTURE = {"chinese-poetry": 0.3, "sharegpt": 0.3, "peoples-daily": 0.3, "idioms": 0.1}


def load_mixture(config: Path | str | dict) -> dict[str, float]:
    """Corpus weights from a mixture file (JSON, or YAML when PyYAML is installed) or a dict.

    Either ``{"chinese-poetry": 0.3, ...}`` or ``{"corpora": {...}}``. Names must be known
    corpora (:data:`pocketlm.data.corpora.CORPORA`), weights positive numbers; the weights are
    normalised to sum to 1.
    """
    from pocketlm.data.corpora import CORPORA

    where = "mixture"
    if isinstance(config, (str, Path)):
        from pocketlm.textfile import json_problem, read_text_file

        path = Path(config)
        where = str(path)
        if not path.exists():
            raise PocketError(f"{path}: no such mixture file")
        # a FIFO (which blocked forever), a folder, binary or non-UTF-8 bytes refused by name;
        # a byte-order mark dropped
        text = read_text_file(path, what="mixture file (JSON or YAML)")
        if path.suffix.lower() in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise PocketError(
                    f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON"
                ) from None
            try:
                config = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise PocketError(f"{path}: not valid YAML: {e}".splitlines()[0]) from None
            except (ValueError, RecursionError) as e:
                raise PocketError(f"{path}: not valid YAML ({json_problem(e)})") from None
        else:
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                raise PocketError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # 4,300+ digits; nested too deeply
                raise PocketError(f"{path}: not valid JSON ({json_problem(e)})") from None
    if isinstance(config, dict) and isinstance(config.get("corpora"), dict):
        config = config["corpora"]
    if not isinstance(config, dict) or not config:
        raise PocketError(f"{where}: expected a mapping of corpus names to weights")
    weights: dict[str, float] = {}
    for name, w in config.items():
        if name not in CORPORA:
            raise PocketError(
                f"{where}: unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}"
            )
        try:  # an integer too large for a float is no finite weight either
            value = float(w) if isinstance(w, (int, float)) and not isinstance(w, bool) else None
        except OverflowError:
            value = math.inf
        if value is None or not 0 < value < math.inf:
            raise PocketError(f"{where}: weight of {name!r} must be a positive finite number, "
                              f"got {short_repr(w)}")
        weights[name] = value
    total = sum(weights.values())
    if total == math.inf:  # finite weights whose sum is not: relative to the largest
        top = max(weights.values())
        weights = {k: v / top for k, v in weights.items()}
        total = sum(weights.values())
    return {k: v / total for k, v in weights.items()}


def mix_documents(
    corpora: dict[str, list[str]],
    weights: dict[str, float],
    *,
    seed: int = 0,
    total_chars: int | None = None,
    max_repeat: float = 4.0,
) -> tuple[list[str], dict]:
    """Sample documents so that each corpus's share of characters matches its weight.

    The mixture's size is ``total_chars`` or, by default, the largest size (at most all the
    characters there are) at which no corpus is repeated more than ``max_repeat`` times. A
    corpus then contributes ``floor(r)`` full copies of itself plus a seeded random subset of
    its documents for the fraction of ``r = weight * size / its characters`` (a whole document
    at a time). The result is shuffled with ``seed``. Returns the documents and, per corpus,
    ``{"weight", "characters", "selected_characters", "selected_documents", "repeat"}``.
    """
    missing = [n for n in weights if n not in corpora]
    if missing:
        raise PocketError(f"no documents given for corpora: {', '.join(missing)}")
    chars = {n: sum(len(d) for d in corpora[n]) for n in weights}
    empty = [n for n, c in chars.items() if c == 0]
    if empty:
        raise PocketError(f"corpus {', '.join(empty)} has no documents left after cleaning")
    if total_chars is None:
        total_chars = min(
            sum(chars.values()), *(max_repeat * chars[n] / w for n, w in weights.items())
        )
    if total_chars <= 0:
        raise PocketError(f"total_chars must be positive, got {total_chars}")
    out: list[str] = []
    stats: dict[str, dict] = {}
    for k, (name, w) in enumerate(sorted(weights.items())):
        docs = corpora[name]
        target = w * total_chars
        full, frac_chars = divmod(target, chars[name])
        picked = docs * int(full)
        rng = np.random.default_rng([int(seed), k, 0x6D6978])
        got = 0
        for i in rng.permutation(len(docs)):
            if got >= frac_chars:
                break
            picked.append(docs[i])
            got += len(docs[i])
        stats[name] = {
            "weight": w,
            "characters": chars[name],
            "selected_characters": sum(len(d) for d in picked),
            "selected_documents": len(picked),
            "repeat": round(target / chars[name], 4),
        }
        out.extend(picked)
    order = np.random.default_rng([int(seed), 0x73687566]).permutation(len(out))
    return [out[i] for i in order], stats


def prepare_mixture(
    config: Path | str | dict,
    tokenizer: Any,
    out_dir: Path,
    *,
    holdout: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
    total_chars: int | None = None,
    max_repeat: float = 4.0,
    min_chars: int = 16,
    near_threshold: float | None = 0.8,
    mixture: tuple[list[str], list[dict]] | None = None,
) -> dict:
    """Fetch, clean and dedup each corpus of the mixture ``config`` (see :func:`load_mixture`),
    sample them to their weights (see :func:`mix_documents`) and write a shard set to
    ``out_dir`` (see :func:`prepare_shards`). ``meta.json``'s ``sources`` holds each corpus's
    provenance and licence, its cleaning and dedup counts, and what the mixture took from it.
    ``mixture``: the result of :func:`build_mixture` when the caller already has it (for
    example to train a tokenizer on the same documents first)."""
    if mixture is None:
        mixture = build_mixture(config, seed=seed, progress=progress, total_chars=total_chars,
                                max_repeat=max_repeat, min_chars=min_chars,
                                near_threshold=near_threshold)
    mixed, sources = mixture
    return prepare_shards(
        mixed,
        tokenizer,
        out_dir,
        holdout=holdout,
        seed=seed,
        shard_tokens=shard_tokens,
        progress=progress,
        sources=sources,
    )


def build_mixture(
    config: Path | str | dict,
    *,
    seed: int = 0,
    progress: bool = True,
    total_chars: int | None = None,
    max_repeat: float = 4.0,
    min_chars: int = 16,
    near_threshold: float | None = 0.8,
) -> tuple[list[str], list[dict]]:
    """The mixture's documents (fetched, cleaned, deduplicated, sampled to the weights and
    shuffled) and, per corpus, its provenance, pipeline counts and selection."""
    from pocketlm.data.corpora import clean_and_dedup, corpus_documents, read_manifest_entry

    weights = load_mixture(config)
    kept: dict[str, list[str]] = {}
    pipeline: dict[str, dict] = {}
    for name in sorted(weights):
        docs: Iterable[str] = corpus_documents(name)
        bar = _progress_bar(progress, f"reading {name}", "docs")
        if bar is not None:
            docs = _with_bar(docs, bar)
        kept[name], pipeline[name] = clean_and_dedup(
            docs,
            min_chars=min_chars,
            near_threshold=near_threshold,
            seed=seed,
            progress=progress,
        )
    mixed, selection = mix_documents(
        kept, weights, seed=seed, total_chars=total_chars, max_repeat=max_repeat
    )
    sources = [
        {**read_manifest_entry(name), "pipeline": pipeline[name], "mixture": selection[name]}
        for name in sorted(weights)
    ]
    return mixed, sources


def _with_bar(items: Iterable[str], bar: Any) -> Iterator[str]:
    try:
        for item in items:
            bar.update(1)
            yield item
    finally:
        bar.close()
