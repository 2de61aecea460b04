"""The ``.pocket`` deploy file: one memory-mappable file with everything needed to run a model.

(docs/format.md gathers this specification with the weight layouts of :mod:`pocketlm.quant`.)

The container is safetensors (readable by ``safetensors.safe_open`` and any tool that reads
that format)::

    u64 little-endian N | N bytes of JSON header (space-padded) | tensor data

* ``__metadata__`` (string values, as safetensors requires) holds ``format: "pocket"``,
  ``format_version``, ``config`` (JSON of :class:`pocketlm.config.ModelConfig`), ``generation``
  (defaults), ``chat_template``, ``quant`` (scheme and the layout of every quantized tensor),
  ``provenance`` (source file, its sha256, pocketlm version, time), ``checksums`` (CRC-32 of
  every tensor's bytes) and ``header_checksum`` (below).
* The tokenizer (its JSON) is the uint8 tensor ``pocket.tokenizer``.
* Quantized weights use the layouts of :mod:`pocketlm.quant`: the packed values under the
  weight's own name (uint8 for INT4 and INT5, int8 for INT8), the float16 scales under
  ``<name>.scales`` and the INT4/INT5 minimums under ``<name>.mins``.
* Every tensor starts at a multiple of 64 bytes from the start of the file, so native kernels
  can read it in place; the gaps are filled with small ``_pad.<n>`` tensors because safetensors
  allows no holes.

Header checksum (format version 2). ``header_checksum`` is ``"sha256:"`` and the hex SHA-256
of the UTF-8 bytes of this canonical JSON::

    {"metadata": {every __metadata__ field but header_checksum},
     "tensors": {name: [dtype, shape, [begin, end]] for every tensor, padding included}}

serialised with sorted keys, separators ``","`` and ``":"``, ASCII escapes (``ensure_ascii``),
offsets relative to the data start as the header stores them. It covers the config, the
tokenizer's place, the quant layouts and the tensor CRCs, so no header edit goes unnoticed;
the tensor CRCs cover the bytes.

Versions. Version 2 files must carry a matching ``header_checksum``
(:class:`~pocketlm.errors.ChecksumError` otherwise). Version 1 files (written before the
header checksum) still load; :attr:`PocketFile.header_verified` is False for them and
``pocket inspect`` reports their header as unverified; repacking makes a version 2 file. Every
other version is refused. Whatever the version, the header is also validated field by field
(config bounds, tensor table against the config) before anything is sized from it.

Files are written to a temporary name in the destination folder and renamed into place, so an
interrupted write never leaves a partial ``.pocket`` file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import stat
import struct
import tempfile
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, short_repr
from ..errors import ChecksumError, FormatError, PocketError, UnsupportedError
from ..head_patch import PATCH, PATCH_GROUP, PATCH_IDS, check_head_patch
from ..quant import (
    BLOCK_VALUES,
    ENCODINGS,
    GROUP_SIZES,
    INT5_BLOCK_BYTES,
    KINDS,
    ZERO_POINTS,
    EncodedQuantTensor,
    QuantTensor,
    encoded_arrays,
    implicit_mins,
)

FORMAT_NAME = "pocket"
FORMAT_VERSION = 5  # 2: header_checksum; 3: LoRA adapters beside the weights; 4: encodings;
# 5: a head patch
READ_VERSIONS = (1, 2, 3, 4, 5)
ADAPTER_VERSION = 3  # files with LoRA adapters (a reader that ignored them would run the base)
ENCODING_VERSION = 4  # files with tensors in a source encoding (pocketlm.quant.ENCODINGS)
# files with a head patch (pocketlm.head_patch): a reader that ignored its two tensors would
# run the INT4 head alone, quietly less exact
PATCH_VERSION = 5
HEADER_CHECKSUM = "header_checksum"
CHECKSUM_CHUNK = 8 << 20  # bytes summed before their pages are dropped: bounds the resident set
ALIGN = 64
TOKENIZER_TENSOR = "pocket.tokenizer"
# the tokenizer's JSON compressed (zlib, RFC 1950), in format version 4 files: a deploy file
# carries one of the two
TOKENIZER_ZLIB_TENSOR = "pocket.tokenizer.zlib"
# what a compressed tokenizer may inflate to: far above what a pack writes (Gemma 3's 262,144
# pieces: 7 MB), and parsing JSON takes several times its size in memory
MAX_TOKENIZER_BYTES = 64 << 20
# a trimmed vocabulary's map back to its source's ids (pocketlm.vocab), int32 [vocab_size]
SOURCE_IDS_TENSOR = "pocket.vocab.source_ids"
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")  # LoRA adapters (pocketlm.runtime.adapters)
MAX_HEADER = 100_000_000  # the safetensors limit

DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
    "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "U16": np.uint16, "U32": np.uint32, "BOOL": np.bool_,
}
_NP_TO_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32"}


_PADDING = re.compile(r"_pad\.[0-9]+")  # what write_pocket names the gaps


# -- safetensors container (shared with the Hugging Face importer) ---------------------------
@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int


def read_header(path: str | Path, buf) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Parse and validate a safetensors header from a mapped buffer; absolute offsets."""
    size = len(buf)
    if size < 8:
        raise FormatError(f"{path}: truncated ({size} bytes): not a safetensors/.pocket file")
    (n,) = struct.unpack("<Q", buf[:8])
    if n < 2 or n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"{path}: header length {n} does not fit a {size}-byte file "
                          "(truncated, or not a safetensors/.pocket file)")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"), object_pairs_hook=_no_repeats)
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge numbers, deep nesting
        raise FormatError(f"{path}: header is not valid JSON ({exc}): file corrupt") from None
    except _RepeatedKey as exc:
        raise FormatError(f"{path}: header lists {exc.args[0]!r} twice: file corrupt or "
                          "hand-edited; repack the model") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise FormatError(f"{path}: __metadata__ is not an object")
    base = 8 + n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise FormatError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        count = math.prod(shape)
        if not (isinstance(b, int) and isinstance(e, int)) or e - b != count * np.dtype(
            DTYPES[dtype]
        ).itemsize or b < 0:
            raise FormatError(f"{path}: tensor {name!r}: byte range [{b}, {e}) does not match "
                              f"{dtype} {shape}")
        if base + e > size:
            raise FormatError(f"{path}: truncated: tensor {name!r} ends at byte {base + e} "
                              f"but the file has {size} bytes")
        infos[name] = TensorInfo(name, dtype, tuple(shape), base + b, base + e)
    # no two tensors share bytes (safetensors refuses such a file too): a table that maps one
    # tensor onto another's range would run one's values as the other's, checksums and all
    spans = sorted((i for i in infos.values() if i.end > i.start), key=lambda i: i.start)
    for prev, cur in zip(spans, spans[1:]):
        if cur.start < prev.end:
            raise FormatError(f"{path}: tensors {prev.name!r} and {cur.name!r} overlap (bytes "
                              f"[{prev.start}, {prev.end}) and [{cur.start}, {cur.end})): file "
                              "corrupt or hand-edited; repack the model")
    return {str(k): v for k, v in metadata.items()}, infos


class _RepeatedKey(Exception):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (Python's parser would keep the last silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return out


def header_digest(metadata: dict[str, Any], table: dict[str, tuple[str, list, list]]) -> str:
    """``"sha256:<hex>"`` of the canonical header (module docstring): ``metadata`` without
    ``header_checksum``, ``table`` maps each tensor to ``(dtype, shape, [begin, end])`` with
    offsets relative to the data start."""
    canonical = {"metadata": {k: v for k, v in metadata.items() if k != HEADER_CHECKSUM},
                 "tensors": {name: [d, list(sh), list(r)] for name, (d, sh, r) in table.items()}}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def tensor_view(buf, info: TensorInfo) -> np.ndarray:
    """A zero-copy numpy view of one tensor in a mapped buffer."""
    dt = np.dtype(DTYPES[info.dtype])
    count = (info.end - info.start) // dt.itemsize
    return np.frombuffer(buf, dtype=dt, count=count, offset=info.start).reshape(info.shape)


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def open_regular(path: str | Path, missing: type[PocketError] = FormatError):
    """``path`` opened for binary reading, if it is a regular file this process may read.

    Otherwise a PocketError that says why: ``missing`` (no such file), FormatError (a folder,
    a FIFO, a device: not a regular file, checked before opening so that a FIFO never blocks)
    or PocketError (permission denied, another OS error)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise missing(f"{p}: no such file") from None
    except OSError as e:
        raise os_error(p, e) from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a file")
        raise FormatError(f"{p}: not a regular file ({kind}); give the path of a model file")
    try:
        return open(p, "rb")
    except OSError as e:
        raise os_error(p, e) from None


def os_error(path: Path, e: OSError) -> PocketError:
    """The PocketError for an OS error reading ``path`` (permission denied named as such)."""
    if isinstance(e, PermissionError):
        return PocketError(f"cannot read {path} (permission denied); check its permissions "
                           "(chmod u+r) and those of its folders")
    return PocketError(f"cannot read {path} ({e.strerror or e})")


def map_file(path: str | Path):
    """A read-only mapping of a regular, non-empty file (PocketError when it is not one)."""
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise FormatError(f"{path}: empty file")
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise os_error(Path(path), e) from None


# -- writing ---------------------------------------------------------------------------------
def refuse_special(path: str | Path) -> None:
    """Refuse to write ``path`` if it is a device, FIFO or socket: the temp file renamed onto
    it would replace the node itself (``-o /dev/null --force`` would delete the device)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # nothing there (or nothing this process may see): the writer says why
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
        raise PocketError(f"cannot write {path}: it is not a regular file ({kind}); give the "
                          "path of a file to create or replace")


def _new_temp(path: Path) -> tuple[int, str]:
    """A temporary file beside ``path`` (which is replaced by it once written); an error that
    names ``path`` if its folder cannot hold one."""
    if path.is_dir():
        raise PocketError(f"cannot write {path}: it is a folder")
    refuse_special(path)
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise PocketError(f"cannot write {path}: {folder} is not a folder")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise PocketError(f"cannot write {path} ({e.strerror or e})") from None


def check_writable(path: str | Path) -> None:
    """Fail now if :func:`write_pocket` could not write ``path``, before the work that fills it."""
    fd, tmp = _new_temp(Path(path))
    os.close(fd)
    os.unlink(tmp)


def compress_tokenizer(tokenizer_json: str) -> np.ndarray:
    """The bytes of tensor ``pocket.tokenizer.zlib`` for a tokenizer's JSON (uint8)."""
    return np.frombuffer(zlib.compress(tokenizer_json.encode("utf-8"), 9), dtype=np.uint8)


def write_pocket(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]],
                 metadata: dict[str, Any], *, hold: list[Path] | None = None) -> int:
    """Write named arrays and metadata as a .pocket file, atomically. Returns the file size.
    ``hold``: the finished temporary file is appended to it instead of being renamed to
    ``path`` (the caller renames it, or removes it)."""
    path = Path(path)
    items = [(name, np.ascontiguousarray(a)) for name, a in tensors]
    seen: set[str] = set()
    for name, a in items:
        if name in seen or name == "__metadata__" or name.startswith("_pad."):
            raise FormatError(f"cannot store tensor {name!r}: duplicate or reserved name")
        if a.dtype not in _NP_TO_DTYPE:
            raise FormatError(f"cannot store tensor {name!r} of dtype {a.dtype}")
        seen.add(name)
    # version 2 unless the file holds LoRA adapters (pocketlm.runtime.adapters), which a
    # version 2 reader would load and ignore: those files are version 3, refused by it
    adapters = any(name.endswith(ADAPTER_SUFFIXES) for name, _ in items)
    # and files with tensors in a source encoding are version 4: an older reader would find
    # their arrays unlike its layouts (and say the file is corrupt)
    quant = metadata.get("quant")
    quant = json.loads(quant) if isinstance(quant, str) else quant
    tensors = quant.get("tensors") if isinstance(quant, dict) else None
    encoded = isinstance(tensors, dict) and any(
        isinstance(q, dict) and "encoding" in q for q in tensors.values())
    encoded = encoded or TOKENIZER_ZLIB_TENSOR in seen
    # a head patch makes it version 5, refused by the readers that would ignore it (other
    # files keep their version, so that older readers still load them)
    patched = PATCH in seen or PATCH_IDS in seen
    version = PATCH_VERSION if patched else ENCODING_VERSION if encoded else \
        ADAPTER_VERSION if adapters else 2
    meta = {"format": FORMAT_NAME, "format_version": str(version)}
    for k, v in metadata.items():
        if k == HEADER_CHECKSUM:
            raise FormatError(f"cannot store metadata field {k!r}: reserved for the writer")
        meta[k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)

    # Plan offsets (relative to the data start), inserting padding so that every tensor is
    # 64-byte aligned in the file once the data start itself is aligned.
    entries: dict[str, Any] = {"__metadata__": meta}
    layout: list[tuple[str, np.ndarray]] = []
    offset = 0
    n_pad = 0
    for name, a in items:
        if offset % ALIGN:
            pad = ALIGN - offset % ALIGN
            pad_name = f"_pad.{n_pad}"
            n_pad += 1
            entries[pad_name] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset,
                                                                                   offset + pad]}
            layout.append((pad_name, np.zeros(pad, np.uint8)))
            offset += pad
        entries[name] = {"dtype": _NP_TO_DTYPE[a.dtype], "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        layout.append((name, a))
        offset += a.nbytes
    # every tensor in the file, padding included, has its checksum (the reader requires them)
    meta["checksums"] = json.dumps({name: zlib.crc32(_raw_bytes(a)) for name, a in layout},
                                   sort_keys=True)
    meta[HEADER_CHECKSUM] = header_digest(meta, {
        name: (e["dtype"], e["shape"], e["data_offsets"]) for name, e in entries.items()
        if name != "__metadata__"})
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    total = 8 + len(header)
    header += b" " * ((ALIGN - total % ALIGN) % ALIGN)

    fd, tmp = _new_temp(path)
    try:
        if hasattr(os, "fchmod"):  # mkstemp creates 0600; give the mode a new file would get
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for _, a in layout:
                f.write(_raw_bytes(a))
            f.flush()
            os.fsync(f.fileno())
        if hold is not None:
            hold.append(Path(tmp))
            return Path(tmp).stat().st_size
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path.stat().st_size


def _raw_bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (zero-size arrays included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- reading ---------------------------------------------------------------------------------
class PocketFile:
    """A mapped ``.pocket`` file: metadata plus zero-copy tensor views."""

    def __init__(self, path: str | Path, *, verify: bool = True):
        """Map ``path`` and check its header (always: the header checksum of a version 2 file,
        the tensor table) and, when ``verify``, the CRC-32 of every tensor."""
        self.path = Path(path)
        self._buf = map_file(self.path)
        self.metadata, self.infos = read_header(self.path, self._buf)
        if self.metadata.get("format") != FORMAT_NAME:
            raise FormatError(f"{self.path}: a safetensors file, but not a pocketlm deploy file "
                              "(no 'format: pocket' metadata); convert it with `pocket pack`")
        raw = self.metadata.get("format_version")
        if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) < 10 and int(
                raw) > FORMAT_VERSION:  # ASCII: "²" is a digit int() cannot read
            raise UnsupportedError(f"{self.path}: deploy file format version {raw} was written "
                                   f"by a newer pocketlm (this one reads versions up to "
                                   f"{FORMAT_VERSION}); upgrade with `pip install -U pocketlm`")
        if raw not in [str(v) for v in READ_VERSIONS]:
            raise FormatError(f"{self.path}: deploy file format version {short_repr(raw)} is not "
                              f"supported (this pocketlm reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))}); repack the model with "
                              "this version's `pocket pack`")
        self.format_version = int(raw)
        #: the header checksum was recorded and matches (False for version 1 files)
        self.header_verified = self._check_header()
        self.checksums = self._json("checksums")
        if not isinstance(self.checksums, dict):
            raise FormatError(f"{self.path}: metadata field 'checksums' is not an object")
        missing = sorted(n for n in set(self.infos) - set(self.checksums)
                         if not n.startswith("_pad."))  # older writers skipped the padding
        if missing:
            raise FormatError(f"{self.path}: no checksum recorded for tensors {missing[:3]}")
        if verify:
            self.verify()

    def _check_header(self) -> bool:
        recorded = self.metadata.get(HEADER_CHECKSUM)
        if recorded is None:
            if self.format_version >= 2:
                raise ChecksumError(f"{self.path}: format version {self.format_version} file "
                                    "without a header checksum: the header was edited or is "
                                    "corrupt; re-download the file or repack the model with "
                                    "`pocket pack`")
            return False
        (n,) = struct.unpack("<Q", self._buf[:8])
        base = 8 + n
        computed = header_digest(self.metadata, {
            name: (i.dtype, list(i.shape), [i.start - base, i.end - base])
            for name, i in self.infos.items()})
        if recorded != computed:
            raise ChecksumError(f"{self.path}: the header does not match its checksum "
                                f"(recorded {short_repr(recorded)}, computed {computed[:23]}...): "
                                "the header was edited or is corrupt; re-download the file or "
                                "repack the model with `pocket pack`")
        return True

    def _json(self, key: str, default: Any = None) -> Any:
        raw = self.metadata.get(key)
        if raw is None:
            if default is not None:
                return default
            raise FormatError(f"{self.path}: metadata field {key!r} is missing")
        try:
            return json.loads(raw)
        except (TypeError, ValueError, RecursionError):
            raise FormatError(f"{self.path}: metadata field {key!r} is not valid JSON") from None

    def verify(self, names: Iterable[str] | None = None) -> None:
        try:
            self._verify(names)
        finally:  # a read maps the page cache's large folios, which straddle tensors: drop all
            self.drop_resident()

    def _verify(self, names: Iterable[str] | None) -> None:
        names = [n for n in (names if names is not None else self.infos)
                 if not (n.startswith("_pad.") and n not in self.checksums)]

        def crc(name: str) -> int:  # zlib releases the GIL: tensors are summed in parallel
            info, value = self.infos[name], 0
            for at in range(info.start, info.end, CHECKSUM_CHUNK):
                end = min(at + CHECKSUM_CHUNK, info.end)
                value = zlib.crc32(memoryview(self._buf)[at:end], value)
                self.drop_resident(at, end)  # reading is not using: give the pages back
            return value

        workers = min(4, os.cpu_count() or 1)
        if workers > 1 and len(names) > 1:
            with ThreadPoolExecutor(workers) as pool:
                sums = list(pool.map(crc, names))
        else:
            sums = [crc(n) for n in names]
        for name, value in zip(names, sums, strict=True):
            recorded = self.checksums.get(name)
            if value != recorded:
                shown = f"{recorded:08x}" if isinstance(recorded, int) else repr(recorded)
                raise ChecksumError(f"{self.path}: tensor {name!r} is corrupt (CRC-32 "
                                    f"{value:08x}, recorded {shown}); re-download or repack the "
                                    "model")

    def drop_resident(self, start: int = 0, end: int | None = None) -> None:
        """Let the kernel reclaim the mapped pages of ``[start, end)`` now.

        The mapping is read-only and file-backed, so nothing is lost: a page touched again is
        read back from the page cache. Used after the checksum pass and after the native engine
        has taken its own copy of the weights, so that neither holds resident memory.
        """
        advise = getattr(self._buf, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if self._buf is None or advise is None or dontneed is None:
            return
        end = len(self._buf) if end is None else end
        page = mmap.PAGESIZE
        lo = (start // page) * page
        length = min(end, len(self._buf)) - lo
        if length > 0:
            try:
                advise(dontneed, lo, length)
            except (OSError, ValueError):
                pass  # advice only

    def tensor(self, name: str) -> np.ndarray:
        try:
            return tensor_view(self._buf, self.infos[name])
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    def json(self, key: str, default: Any = None) -> Any:
        return self._json(key, default)

    def json_object(self, key: str, default: dict | None = None) -> dict[str, Any]:
        """Metadata field ``key`` parsed as a JSON object (``default`` when absent)."""
        value = self._json(key, default)
        if not isinstance(value, dict):
            raise FormatError(f"{self.path}: metadata field {key!r} must be a JSON object, got "
                              f"{short_repr(value)}; the file is corrupt: repack the model")
        return value

    def text(self, key: str) -> str | None:
        """Metadata field ``key`` as the string it is stored as (None when absent)."""
        value = self.metadata.get(key)
        if value is not None and not isinstance(value, str):
            raise FormatError(f"{self.path}: metadata field {key!r} must be a string, got "
                              f"{short_repr(value)}; the file is corrupt: repack the model")
        return value

    def config(self) -> ModelConfig:
        """The model config of the ``config`` field, validated (bounds included); errors name
        the file."""
        try:
            return ModelConfig.from_dict(self._json("config"))
        except PocketError as exc:
            if str(self.path) in str(exc):
                raise
            raise type(exc)(f"{self.path}: {exc}") from None

    def quant_layouts(self) -> dict[str, tuple[str, tuple[int, int], int]]:
        """``name -> (kind, (rows, cols), group_size)`` of every quantized tensor, as the
        ``quant`` field records them (each layout checked for form, not yet against the
        tensors)."""
        quant = self._json("quant", {})
        quant = quant.get("tensors", {}) if isinstance(quant, dict) else None
        if not isinstance(quant, dict):
            raise FormatError(f"{self.path}: metadata field 'quant' is malformed")
        out = {}
        for name, q in quant.items():
            try:
                kind, shape, gs = q["kind"], q["shape"], q["group_size"]
                rows, cols = shape
                ok = (isinstance(kind, str) and kind in KINDS and _is_int(gs)
                      and gs in GROUP_SIZES and isinstance(shape, list) and _is_int(rows)
                      and _is_int(cols) and rows >= 0 and cols >= 0 and cols % gs == 0)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                kind = q.get("kind") if isinstance(q, dict) else None
                gs = q.get("group_size") if isinstance(q, dict) else None
                if isinstance(kind, str) and kind not in KINDS:  # a layout of a newer pocketlm
                    raise FormatError(f"{self.path}: tensor {name!r} has an unknown layout "
                                      f"(kind {kind!r}); this pocketlm cannot read it")
                if _is_int(gs) and gs >= 16 and gs & (gs - 1) == 0 and gs not in GROUP_SIZES:
                    raise FormatError(f"{self.path}: tensor {name!r} has an unknown layout "
                                      f"(group size {gs}); this pocketlm cannot read it")
                raise FormatError(f"{self.path}: tensor {name!r} has a malformed quant layout "
                                  f"{short_repr(q)}")
            out[name] = (kind, (rows, cols), gs)
        return out

    def zero_points(self) -> dict[str, int]:
        """``name -> zero point`` of the tensors stored without minimums (see
        :mod:`pocketlm.quant`); a zero point other than INT4's 8 or INT5's 16 is refused."""
        out = {}
        for name, q, zp in self._layout_field("zero_point"):
            if not _is_int(zp) or ZERO_POINTS.get(q.get("kind")) != zp:
                raise FormatError(f"{self.path}: tensor {name!r} has an unknown layout "
                                  f"(zero point {short_repr(zp)} for {q.get('kind')!r}); "
                                  "this pocketlm cannot read it")
            out[name] = zp
        return out

    def encodings(self) -> dict[str, str]:
        """``name -> encoding`` of the tensors stored in a source encoding (see
        :mod:`pocketlm.quant`); one this pocketlm does not know is refused by name."""
        out = {}
        for name, q, enc in self._layout_field("encoding"):
            if not isinstance(enc, str) or ENCODINGS.get(enc) != q.get("kind") or \
                    q.get("group_size") != 32 or "zero_point" in q:
                raise FormatError(f"{self.path}: tensor {name!r} has an unknown layout "
                                  f"(encoding {short_repr(enc)} for {q.get('kind')!r}); "
                                  "this pocketlm cannot read it")
            out[name] = enc
        return out

    def _layout_field(self, key: str):
        """``(name, entry, entry[key])`` of every ``quant.tensors`` entry that holds ``key``."""
        quant = self._json("quant", {})
        tensors = quant.get("tensors", {}) if isinstance(quant, dict) else {}
        for name, q in (tensors.items() if isinstance(tensors, dict) else ()):
            if isinstance(q, dict) and key in q:
                yield name, q, q[key]

    @property
    def tokenizer_tensor(self) -> str:
        """The tensor that holds the tokenizer: ``pocket.tokenizer`` (its JSON) or, in format
        version 4, ``pocket.tokenizer.zlib`` (compressed)."""
        if TOKENIZER_ZLIB_TENSOR in self.infos and self.format_version >= ENCODING_VERSION:
            return TOKENIZER_ZLIB_TENSOR
        return TOKENIZER_TENSOR

    def tokenizer_json(self) -> str:
        """The serialised tokenizer the file carries (see :attr:`tokenizer_tensor`)."""
        name = self.tokenizer_tensor
        data = bytes(self.tensor(name))
        if name == TOKENIZER_ZLIB_TENSOR:
            d = zlib.decompressobj()
            try:
                out = d.decompress(data, MAX_TOKENIZER_BYTES)
                complete = d.eof and not d.unconsumed_tail and not d.unused_data
            except zlib.error as exc:
                raise FormatError(f"{self.path}: tensor {name!r} is not zlib data ({exc}); "
                                  "the file is corrupt: repack the model") from None
            if not complete:
                raise FormatError(f"{self.path}: tensor {name!r} does not inflate to one "
                                  f"tokenizer of at most {MAX_TOKENIZER_BYTES >> 20} MB; the "
                                  "file is corrupt: repack the model")
            data = out
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self.path}: tensor {name!r} is not UTF-8 text "
                              f"(byte {exc.start}); the file is corrupt: repack the model"
                              ) from None

    def check_model(self, config: ModelConfig) -> None:
        """Every tensor ``config`` calls for is in the file with its shape (its logical shape
        when quantized) and a dtype the runtime reads, and the tokenizer is a byte string:
        checked on the header alone, before any weight is touched."""
        layouts = self.quant_layouts()

        def found(name: str) -> str:
            if name in layouts:
                kind, shape, _ = layouts[name]
                return f"{kind} {list(shape)}"
            info = self.infos[name]
            return f"{info.dtype} {list(info.shape)}"

        expected = config.tensor_shapes()
        missing = [n for n in expected if n not in layouts and n not in self.infos]
        if missing:
            raise FormatError(f"{self.path}: the config calls for tensors the file lacks: "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; the file is "
                              "corrupt or its config was edited: repack the model")
        for name, shape in expected.items():
            if name in layouts:
                ok = layouts[name][1] == tuple(shape)
            else:
                info = self.infos[name]
                ok = info.shape == tuple(shape) and info.dtype == "F32"
            if not ok:
                raise FormatError(f"{self.path}: tensor {name!r} is {found(name)}, the config "
                                  f"calls for {list(shape)}"
                                  f"{'' if name in layouts else ' float32 (F32)'}; the file is "
                                  "corrupt or its config was edited: repack the model")
        head = "lm_head.weight"
        if config.tie_embeddings and (head in layouts or head in self.infos):
            raise FormatError(f"{self.path}: the config ties the output head to the embedding "
                              f"(tie_embeddings) but the file has {head!r}; repack the model")
        self._check_patch(config, layouts)
        tok = self.infos.get(self.tokenizer_tensor)
        if tok is None or tok.dtype != "U8" or len(tok.shape) != 1:
            shown = "none" if tok is None else f"{tok.dtype} {list(tok.shape)}"
            raise FormatError(f"{self.path}: tensor {self.tokenizer_tensor!r} must hold the "
                              f"tokenizer as bytes (U8, one dimension), found {shown}; repack "
                              "the model")
        if tok.shape[0] > MAX_TOKENIZER_BYTES:
            raise FormatError(f"{self.path}: tensor {self.tokenizer_tensor!r} holds "
                              f"{tok.shape[0]} bytes, over the {MAX_TOKENIZER_BYTES >> 20} MB a "
                              "tokenizer may take; repack the model")
        ids = self.infos.get(SOURCE_IDS_TENSOR)
        if ids is not None and (ids.dtype != "I32" or ids.shape != (config.vocab_size,)):
            raise FormatError(f"{self.path}: tensor {SOURCE_IDS_TENSOR!r} must map each of the "
                              f"{config.vocab_size} pieces to its source id (I32 "
                              f"[{config.vocab_size}]), found {ids.dtype} {list(ids.shape)}; "
                              "repack the model")
        for name, info in self.infos.items():
            if _PADDING.fullmatch(name) and (info.dtype != "U8" or len(info.shape) != 1 or
                                             info.shape[0] >= ALIGN):
                raise FormatError(f"{self.path}: tensor {name!r} is {info.dtype} "
                                  f"{list(info.shape)}, not the padding a pack writes (U8, "
                                  f"fewer than {ALIGN} bytes); repack the model")
        self._check_read(config, layouts)

    def _check_read(self, config: ModelConfig, layouts: dict) -> None:
        """Every tensor in the file is one pocketlm reads, as a pack writes them: a weight the
        config calls for (quantized: its values, ``.scales``, ``.mins`` unless implicit, or
        its encoding's arrays), LoRA adapters (``.lora_a`` / ``.lora_b``, checked by the
        runtime), the head patch, the tokenizer, a trimmed vocabulary's source ids and the
        padding. Anything else would be loaded and never used, so the file would run as
        another model than the one it holds: it is refused by name."""
        read = {*config.tensor_shapes(), PATCH, PATCH_IDS, self.tokenizer_tensor,
                SOURCE_IDS_TENSOR}
        zero_points, encodings = self.zero_points(), self.encodings()
        for name, (kind, shape, _) in layouts.items():
            if name not in read:
                continue  # the layout of a tensor this model lacks: refused below
            if name in encodings:
                read.update(name + suffix for suffix in encoded_arrays(encodings[name], shape))
            else:
                read.add(name + ".scales")
                if kind != "int8" and name not in zero_points:
                    read.add(name + ".mins")
        for name in [*self.infos, *layouts]:
            if name in read or name.endswith(ADAPTER_SUFFIXES) or _PADDING.fullmatch(name):
                continue
            raise FormatError(f"{self.path}: tensor {name!r} is nothing pocketlm reads (not a "
                              f"weight of this {config.arch} model, a quantized weight's scales "
                              "or minimums, an adapter, the head patch or the tokenizer); the "
                              "file was edited or written by another tool: repack the model")

    def _check_patch(self, config: ModelConfig, layouts: dict) -> None:
        """The head patch's two tensors (pocketlm.head_patch), from the header: both or
        neither, in a version 5 file or later, ``head_patch.weight`` INT8 group 32
        ``[K, d_model]``, ``head_patch.ids`` int32 (I32) ``[K]`` with K <= vocab_size (their
        values are checked by :meth:`weights`)."""
        has_w = PATCH in layouts or PATCH in self.infos
        has_ids = PATCH_IDS in self.infos
        if not has_w and not has_ids:
            return
        if has_w != has_ids:
            have, lack = (PATCH, PATCH_IDS) if has_w else (PATCH_IDS, PATCH)
            raise FormatError(f"{self.path}: tensor {have!r} comes without {lack!r} (a head "
                              "patch is both); the file is corrupt: repack the model")
        if self.format_version < PATCH_VERSION:
            raise FormatError(f"{self.path}: tensor {PATCH!r} in a format version "
                              f"{self.format_version} file (head patches are version "
                              f"{PATCH_VERSION}); the file is corrupt: repack the model")
        kind, shape, gs = layouts.get(PATCH, (None, None, None))
        if kind != "int8" or gs != PATCH_GROUP or shape[1] != config.d_model or not (
                1 <= shape[0] <= config.vocab_size):
            found = f"{kind} group {gs} {list(shape)}" if kind else "not quantized"
            raise FormatError(f"{self.path}: tensor {PATCH!r} must be int8 group {PATCH_GROUP} "
                              f"[K, {config.d_model}] with 1 <= K <= {config.vocab_size}, "
                              f"found {found}; repack the model")
        ids = self.infos[PATCH_IDS]
        if ids.dtype != "I32" or list(ids.shape) != [shape[0]]:
            raise FormatError(f"{self.path}: tensor {PATCH_IDS!r} must be I32 [{shape[0]}] (one "
                              f"id per row of {PATCH!r}), found {ids.dtype} "
                              f"{list(ids.shape)}; repack the model")

    def weights(self) -> dict[str, np.ndarray | QuantTensor]:
        """Every model tensor, quantized ones as :class:`QuantTensor` (views, no copies)."""
        out: dict[str, np.ndarray | QuantTensor] = {}
        companions = set()
        zero_points = self.zero_points()
        encodings = self.encodings()
        for name, (kind, shape, gs) in self.quant_layouts().items():
            rows, cols = shape
            if name in encodings:
                out[name] = self._encoded(name, encodings[name], shape)
                companions.update(name + suffix for suffix in out[name].stored)
                continue
            qweight = self.tensor(name)
            scales = self.tensor(name + ".scales")
            zp = zero_points.get(name)
            if zp is not None:
                if scales.dtype != np.float16:
                    raise FormatError(f"{self.path}: tensor {name!r}: scales must be float16")
                mins = implicit_mins(scales, zp)
            else:
                mins = self.tensor(name + ".mins") if kind != "int8" else None
            expect = {"int4": (rows, cols // 2), "int5": (rows, cols // 32 * INT5_BLOCK_BYTES),
                      "int8": (rows, cols)}[kind]
            qdtype = np.int8 if kind == "int8" else np.uint8
            if qweight.shape != expect or scales.shape != (rows, cols // gs) or (
                mins is not None and mins.shape != scales.shape
            ) or qweight.dtype != qdtype or scales.dtype != np.float16 or (
                mins is not None and mins.dtype != np.float16
            ):
                found = ", ".join(f"{np.dtype(a.dtype).name} {list(a.shape)}"
                                  for a in (qweight, scales, mins) if a is not None)
                raise FormatError(
                    f"{self.path}: tensor {name!r} does not match its quant layout ({kind} "
                    f"{list(shape)}, groups of {gs}: expects values {np.dtype(qdtype).name} "
                    f"{list(expect)} and float16 scales{' and mins' if mins is not None else ''}"
                    f" {[rows, cols // gs]}; found {found}); repack the model")
            out[name] = QuantTensor(kind, shape, gs, qweight, scales, mins, zp)
            companions.update({name + ".scales", name + ".mins"})
        for name in self.infos:
            if name in out or name in companions or name.startswith("_pad.") or name.startswith(
                "pocket."
            ):
                continue
            out[name] = self.tensor(name)
        self._check_finite(out)
        if PATCH in out or PATCH_IDS in out:  # its ids in range and increasing
            config = self.config()
            self._check_patch(config, self.quant_layouts())
            try:
                check_head_patch(out[PATCH], out[PATCH_IDS], config.vocab_size, config.d_model)
            except ValueError as e:
                raise FormatError(f"{self.path}: {e}; the file is corrupt: repack the "
                                  "model") from None
        return out

    def _check_finite(self, weights: dict) -> None:
        """Refuse float tensors (norms, biases) and embedding steps that are not finite: a pack
        never writes them, and the engine reads these in place (the matrices it repacks are
        checked as it repacks them), where a NaN norm made every logit 0 and the answer
        garbage, with no error."""
        for name, w in weights.items():
            if isinstance(w, QuantTensor):
                arrays = [w.scales, w.mins] if name == "embed.weight" else []
            else:
                arrays = [w] if isinstance(w, np.ndarray) and w.dtype.kind == "f" else []
            for a in arrays:
                if a is not None and not np.isfinite(a).all():
                    raise FormatError(f"{self.path}: tensor {name!r} holds values that are not "
                                      "finite; the file is damaged: repack the model")

    def _encoded(self, name: str, encoding: str, shape: tuple[int, int]) -> EncodedQuantTensor:
        if shape[1] % BLOCK_VALUES[encoding]:
            raise FormatError(f"{self.path}: tensor {name!r} is stored as {encoding}, whose "
                              f"blocks hold {BLOCK_VALUES[encoding]} values, but has "
                              f"{shape[1]} columns; repack the model")
        stored = {}
        for suffix, (dtype, want) in encoded_arrays(encoding, shape).items():
            if name + suffix not in self.infos:
                raise FormatError(f"{self.path}: tensor {name!r} is stored as {encoding} but "
                                  f"the file lacks {name + suffix!r}; repack the model")
            a = self.tensor(name + suffix)
            if a.dtype != dtype or a.shape != want:
                raise FormatError(
                    f"{self.path}: tensor {name + suffix!r} does not match its layout "
                    f"({encoding} {list(shape)}: expects {np.dtype(dtype).name} {list(want)}; "
                    f"found {np.dtype(a.dtype).name} {list(a.shape)}); repack the model")
            stored[suffix] = a
        return EncodedQuantTensor(encoding, shape, stored)

    @property
    def nbytes(self) -> int:
        return len(self._buf)

    @property
    def header_status(self) -> str:
        """One line for people: whether the header checksum was verified."""
        if self.header_verified:
            return "verified (sha256)"
        return f"unverified (format v{self.format_version}; repack to protect it)"

    def close(self) -> None:
        self._buf = None  # views keep the mapping alive until they are gone


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

