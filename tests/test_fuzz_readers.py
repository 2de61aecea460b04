"""Fuzz tests of the readers: mutants of a valid ``.pocket`` deploy file and of a valid GGUF.

Each mutant is written to a file and opened the way a user's file is: ``load_pocket`` (the
deploy file reader, the config and tensor checks, the runtime with the native engine when it is
built, then a two-token forward pass when it loads) or ``open_source`` (the GGUF reader, then
every tensor dequantized and converted to a pocketlm layout). The rule: it loads, or it raises
a :class:`~pocketlm.errors.PocketError` subclass; never any other exception, never a crash,
never more than a bounded amount of memory.

The mutants come from a seeded ``random.Random`` (reproducible: each has a label that says what
was done to the file) and cover truncation at every boundary of the container, bit flips and
byte overwrites in the length prefix, the header and the tensor data, hand-edited header fields
(every config and generation field set to zero, negative, huge, NaN, infinite, a wrong type, a
string, null or a nested value), removed, repeated and renamed tensors and metadata keys, wrong
dtypes, shapes and offsets; in GGUF, metadata values of every type, tensor infos, counts and the
alignment. Many mutants are "resealed": their header checksum (and their tensor CRCs, where the
mutant moved data) recomputed, as a deliberate forger would, so that the field checks behind the
checksum are exercised too.

The mutants run in child processes (one per reader), so that a segfault or an abort fails the
test, naming the mutant, instead of killing the test run; each child runs under an address
space limit of its warmed-up size + 1 GiB and reports its peak resident set.

Default run: 3,000 ``.pocket`` mutants and 1,200 GGUF mutants (4,200 in all; about 9 s and
16 s of child time on a shared 2-core machine, every mutant family included). ``-m slow`` runs
30,000 + 12,000 more with other seeds (the random families then dominate).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
from crafted import stored_zlib

HERE = Path(__file__).resolve().parent
CHILD_LIMIT_BYTES = 1 << 30  # address space a child may grow by after warming up
PEAK_GROWTH_LIMIT = 256 << 20  # peak resident set growth over a whole batch


TOKENIZER = "pocket.tokenizer.zlib"  # what a pack writes (format version 4)


# -- base files --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama GGUF (Q4_0 weights, Q8_0 embedding) and the deploy file packed from it."""
    import tiny_gguf

    from pocketlm.pack import pack

    root = tmp_path_factory.mktemp("fuzz")
    gguf_path = root / "base.gguf"
    tiny_gguf.write_tiny_gguf(gguf_path, "llama", seed=7, weight_type="Q4_0")
    pocket_path = root / "base.pocket"
    pack(gguf_path, pocket_path)
    return {"gguf": gguf_path, "pocket": pocket_path}


# -- values a hand-edited field takes --------------------------------------------------------
NAN, INF = float("nan"), float("inf")
JSON_VALUES = [0, -1, 1, 2, 3, 7, 63, 1.5, -0.0, 1e-300, 1e300, 2**31, 2**32 + 1, 2**63,
               2**64, 10**12, 10**20, 10**300, NAN, INF, -INF, True, False, None, "", "x", "3",
               "NaN", [], [1], [[1]], {}, {"a": 1}, ["global"] * 3, ["sliding"] * 3]


# -- .pocket mutants -------------------------------------------------------------------------
def take(families, count: int, more):
    """The first ``count`` mutants of ``families`` (generators, in order), then ``more()``
    until there are ``count``. Generators run lazily, so their random draws stay in order."""
    produced = 0
    for family in families:
        for mutant in family:
            if produced >= count:
                return
            yield mutant
            produced += 1
    while produced < count:
        yield more()
        produced += 1


def bit_flips(base: bytes, rng: random.Random, lo: int, hi: int, count: int, where: str):
    """``count`` copies of ``base`` with one random bit of ``[lo, hi)`` flipped each."""
    for _ in range(count):
        data = bytearray(base)
        at, bit = rng.randrange(lo, hi), rng.randrange(8)
        data[at] ^= 1 << bit
        yield f"{where} byte {at} bit {bit} flipped", bytes(data)


class PocketMutator:
    """Mutants of a valid deploy file, as ``(label, bytes)``."""

    def __init__(self, base: bytes, rng: random.Random):
        self.base = base
        self.rng = rng
        (self.n,) = struct.unpack("<Q", base[:8])
        self.header = json.loads(base[8:8 + self.n])
        self.data = base[8 + self.n:]
        self.meta = self.header["__metadata__"]
        self.tensors = [k for k in self.header if k != "__metadata__"]
        self.config = json.loads(self.meta["config"])
        self.generation = json.loads(self.meta["generation"])
        self.quant = json.loads(self.meta["quant"])

    # serialisation ----------------------------------------------------------------------
    @staticmethod
    def seal(header: dict, data: bytes, *, crcs: bool = False) -> dict:
        """Record a matching header checksum (and, with ``crcs``, the CRC of every tensor's
        current range, where it lies in ``data``), as a forger would."""
        meta = header["__metadata__"]
        if not isinstance(meta, dict):
            return header
        if crcs:
            sums = {}
            for name, e in header.items():
                try:
                    b, end = e["data_offsets"]
                    if 0 <= b <= end <= len(data):
                        sums[name] = zlib.crc32(data[b:end])
                except (KeyError, TypeError, ValueError):
                    pass
            meta["checksums"] = json.dumps(sums, sort_keys=True)
        body = {k: v for k, v in meta.items() if k != "header_checksum"}
        table = {}
        for k, e in header.items():
            if k == "__metadata__":
                continue
            try:
                table[k] = [e["dtype"], e["shape"], e["data_offsets"]]
            except (KeyError, TypeError):
                return header  # no valid table: nothing a forger could seal
        text = json.dumps({"metadata": body, "tensors": table}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=True)
        meta["header_checksum"] = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
        return header

    def build(self, header: dict | bytes, data: bytes | None = None, *, seal: bool = True,
              crcs: bool = False, align: bool = True) -> bytes:
        data = self.data if data is None else data
        if isinstance(header, dict):
            if seal:
                self.seal(header, data, crcs=crcs)
            raw = json.dumps(header).encode()
        else:
            raw = header
        if align:
            raw += b" " * ((64 - (8 + len(raw)) % 64) % 64)
        return struct.pack("<Q", len(raw)) + raw + data

    def copy(self) -> dict:
        return json.loads(json.dumps(self.header))

    # mutation families ------------------------------------------------------------------
    def truncations(self):
        size = len(self.base)
        cuts = set(range(0, 18)) | {8 + self.n - 1, 8 + self.n, 8 + self.n + 1, size - 1}
        base = 8 + self.n
        for name in self.tensors:
            b, e = self.header[name]["data_offsets"]
            cuts |= {base + b, base + b + 1, base + e - 1}
        for cut in sorted(c for c in cuts if 0 <= c < size):
            yield f"truncated to {cut} bytes", self.base[:cut]
        for _ in range(20):
            cut = self.rng.randrange(size)
            yield f"truncated to {cut} bytes", self.base[:cut]
        yield "appended bytes", self.base + b"\x00" * 7

    def length_prefix(self):
        for bit in range(64):
            data = bytearray(self.base)
            data[bit // 8] ^= 1 << (bit % 8)
            yield f"length prefix bit {bit} flipped", bytes(data)
        for value in (0, 1, 2, self.n - 1, self.n + 1, len(self.base) - 8, len(self.base),
                      2**63, 2**64 - 1):
            yield f"length prefix {value}", struct.pack("<Q", value) + self.base[8:]

    def flips(self, lo: int, hi: int, count: int, where: str):
        return bit_flips(self.base, self.rng, lo, hi, count, where)

    def overwrites(self, lo: int, hi: int, count: int, where: str):
        alphabet = b'{}[]":,0123456789-+.eE \\\x00\x7f\x80\xff'
        for _ in range(count):
            data = bytearray(self.base)
            at = self.rng.randrange(lo, hi)
            width = self.rng.choice((1, 1, 2, 4, 8))
            for i in range(at, min(at + width, hi)):
                data[i] = self.rng.choice(alphabet) if self.rng.random() < 0.7 else \
                    self.rng.randrange(256)
            yield f"{where} bytes {at}..{at + width} overwritten", bytes(data)

    def json_fields(self, key: str, obj: dict, values, *, remove: bool):
        """Each field of the JSON metadata ``key`` set to each of ``values`` (and removed)."""
        for field in sorted(obj):
            edits = [(f"= {value!r:.40}", {**obj, field: value}) for value in values]
            if remove:
                edits.append(("removed", {k: v for k, v in obj.items() if k != field}))
            for what, edited in edits:
                h = self.copy()
                h["__metadata__"][key] = json.dumps(edited)
                yield f"{key}.{field} {what}", self.build(h)

    def config_fields(self, values):
        return self.json_fields("config", self.config, values, remove=True)

    def generation_fields(self, values):
        return self.json_fields("generation", self.generation, values, remove=False)

    def metadata_fields(self):
        raw_values = [5, None, [1], {"a": 1}, "", "{bad", "null", "[]", "5", '"x"', "{}",
                      "[" * 5000 + "1" + "]" * 5000]
        for key in sorted(self.meta):
            h = self.copy()
            del h["__metadata__"][key]
            yield f"metadata {key} removed", self.build(h, seal=key != "header_checksum")
            for value in raw_values:
                h = self.copy()
                h["__metadata__"][key] = value
                yield f"metadata {key} = {value!r:.40}", self.build(
                    h, seal=key != "header_checksum")
        for value in ([1], "x", None, 5):
            h = self.copy()
            h["__metadata__"] = value
            yield f"__metadata__ = {value!r}", self.build(h, seal=False)

    def quant_layouts(self):
        layouts = self.quant["tensors"]
        names = sorted(layouts)
        picks = [names[0], names[-1]] + self.rng.sample(names, 3)
        edits = {"kind": ["int3", "int8", "int5", 4, None], "group_size": [0, 16, 64, 33, "32",
                                                                              True, None],
                 "shape": [[], [64], [64, 64, 1], [-1, 64], [2**40, 64], "x", None, [64.0, 64]]}
        for name in picks:
            for key, values in edits.items():
                for value in values:
                    q = json.loads(json.dumps(self.quant))
                    q["tensors"][name][key] = value
                    h = self.copy()
                    h["__metadata__"]["quant"] = json.dumps(q)
                    yield f"quant {name}.{key} = {value!r:.40}", self.build(h)
            q = json.loads(json.dumps(self.quant))
            del q["tensors"][name]
            h = self.copy()
            h["__metadata__"]["quant"] = json.dumps(q)
            yield f"quant layout of {name} removed", self.build(h)
        for name in ("norm.weight", "layers.0.attn_norm.weight", TOKENIZER):
            q = json.loads(json.dumps(self.quant))
            q["tensors"][name] = {"kind": "int4", "shape": [1, 64], "group_size": 32}
            h = self.copy()
            h["__metadata__"]["quant"] = json.dumps(q)
            yield f"quant layout added for {name}", self.build(h)

    def table_edits(self, count: int):
        pool = self.tensors
        kinds = ["remove", "rename", "dtype", "shape", "offsets", "duplicate", "swap",
                 "entry"]
        dtypes = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "U16", "U32",
                  "BOOL", "Q4", 5, None]
        for i in range(count):
            kind = kinds[i % len(kinds)]
            name = self.rng.choice(pool + [TOKENIZER, "embed.weight", "norm.weight"])
            h = self.copy()
            e = h[name]
            b, end = e["data_offsets"]
            crcs = self.rng.random() < 0.5
            if kind == "remove":
                del h[name]
                label = f"tensor {name} removed"
            elif kind == "rename":
                h[name + self.rng.choice(["x", ".scales", ".mins", ""])] = h.pop(name)
                label = f"tensor {name} renamed"
            elif kind == "dtype":
                e["dtype"] = self.rng.choice(dtypes)
                label = f"tensor {name} dtype {e['dtype']!r}"
            elif kind == "shape":
                e["shape"] = self.rng.choice([[], [0], list(reversed(e["shape"])), [-1],
                                              [2**40], "x", [1.5], [e["shape"][0]] if
                                              e["shape"] else [1], [1] + e["shape"],
                                              [(end - b)], [2**32, 2**32]])
                label = f"tensor {name} shape {e['shape']!r}"
            elif kind == "offsets":
                delta = self.rng.choice([1, -1, 64, -64, 2, 4096, -b, len(self.data)])
                e["data_offsets"] = self.rng.choice([[b + delta, end + delta], [b, end + delta],
                                                     [b + delta, end], [end, b], [0, 0],
                                                     [b, b], [b, 2**63], [str(b), end]])
                label = f"tensor {name} offsets {e['data_offsets']!r}"
            elif kind == "duplicate":
                text = json.dumps(self.seal(h, self.data))
                extra = json.dumps({"dtype": "U8", "shape": [end - b], "data_offsets": [b, end]})
                raw = (text[:-1] + f', "{name}": ' + extra + "}").encode()
                yield f"tensor {name} listed twice", self.build(raw)
                continue
            elif kind == "swap":
                other = self.rng.choice(pool)
                h[name], h[other] = h[other], h[name]
                label = f"tensors {name} and {other} swapped"
            else:
                h[name] = self.rng.choice([None, [1], "F32", {}, {"dtype": "F32"},
                                           {"dtype": "F32", "shape": [1], "data_offsets": 4}])
                label = f"tensor {name} entry {h[name]!r}"
            yield label + (" (CRCs recomputed)" if crcs else ""), self.build(h, crcs=crcs)

    def tokenizer_bytes(self):
        """Edits of the (compressed) tokenizer's bytes: broken zlib streams, and streams that
        inflate to what is not a tokenizer."""
        info = self.header[TOKENIZER]
        b, end = info["data_offsets"]
        n = end - b
        fills = {"not UTF-8": b"\xff" * n, "bad JSON": b"[" + b" " * (n - 1),
                 "not a tokenizer": b"{}" + b" " * (n - 2), "zeros": b"\x00" * n,
                 "deep JSON": (b"[" * (n // 2) + b"]" * (n - n // 2))}
        tok = self.data[b:end]
        for at in (0, 1, n // 3, n // 2, n - 2):  # edits inside the stream, same length
            fills[f"bytes at {at}"] = tok[:at] + b'"}' + tok[at + 2:]
        for label, text in (("non-UTF-8", b"\xff"), ("[", b"["), ("{}", b"{}"),
                            ("deep JSON", b"[" * 500)):
            z = zlib.compress(text, 9)  # trailing bytes after a complete stream
            fills[f"zlib of {label}, then zeros"] = z + b"\x00" * (n - len(z))
            fills[f"zlib of {label}"] = stored_zlib(text, n)  # the stream fills the tensor
        for label, fill in fills.items():
            data = self.data[:b] + fill + self.data[end:]
            yield f"tokenizer {label} (CRCs recomputed)", self.build(self.copy(), data,
                                                                      crcs=True)

    def version_1(self, values):
        """Version 1 files (no header checksum) with config edits: the unverified path."""
        for field in self.rng.sample(sorted(self.config), 8):
            value = self.rng.choice(values)
            h = self.copy()
            h["__metadata__"]["format_version"] = "1"
            h["__metadata__"].pop("header_checksum", None)
            cfg = dict(self.config)
            cfg[field] = value
            h["__metadata__"]["config"] = json.dumps(cfg)
            yield f"v1, config.{field} = {value!r:.40}", self.build(h, seal=False)
        h = self.copy()
        h["__metadata__"]["format_version"] = "1"
        yield "v1 with a header checksum", self.build(h, seal=True)

    def unsealed(self, count: int):
        for _ in range(count):
            field = self.rng.choice(sorted(self.config))
            value = self.rng.choice(JSON_VALUES)
            h = self.copy()
            cfg = dict(self.config)
            cfg[field] = value
            h["__metadata__"]["config"] = json.dumps(cfg)
            yield f"config.{field} = {value!r:.40} (not resealed)", self.build(h, seal=False)

    def misaligned(self):
        for pad in (1, 3, 8, 31):
            raw = json.dumps(self.header).encode() + b" " * pad
            yield f"header padded by {pad}: tensors misaligned", self.build(raw, align=False)

    def mutants(self, count: int):
        size = len(self.base)
        hdr = (8, 8 + self.n)
        families = [
            self.truncations(), self.length_prefix(), self.misaligned(),
            self.flips(*hdr, 120, "header"), self.overwrites(*hdr, 120, "header"),
            self.flips(8 + self.n, size, 40, "data"), self.overwrites(8 + self.n, size, 20,
                                                                          "data"),
            self.config_fields(JSON_VALUES), self.generation_fields(JSON_VALUES[:24]),
            self.metadata_fields(), self.quant_layouts(), self.table_edits(160),
            self.tokenizer_bytes(), self.version_1(JSON_VALUES), self.unsealed(20),
        ]
        # the rest: random combinations of two mutations
        return take(families, count, self.random_pair)

    def random_pair(self) -> tuple[str, bytes]:
        h = self.copy()
        labels = []
        for _ in range(2):
            choice = self.rng.randrange(4)
            if choice == 0:
                field = self.rng.choice(sorted(self.config))
                cfg = json.loads(h["__metadata__"]["config"])
                cfg[field] = self.rng.choice(JSON_VALUES)
                h["__metadata__"]["config"] = json.dumps(cfg)
                labels.append(f"config.{field} = {cfg[field]!r:.30}")
            elif choice == 1:
                name = self.rng.choice([k for k in h if k != "__metadata__"])
                h[name]["shape"] = [self.rng.choice([0, 1, 2, 64, 96, 320, 2**31])
                                    for _ in range(self.rng.randrange(0, 4))]
                labels.append(f"tensor {name} shape {h[name]['shape']}")
            elif choice == 2:
                field = self.rng.choice(sorted(self.generation))
                gen = json.loads(h["__metadata__"]["generation"])
                gen[field] = self.rng.choice(JSON_VALUES)
                h["__metadata__"]["generation"] = json.dumps(gen)
                labels.append(f"generation.{field} = {gen[field]!r:.30}")
            else:
                name = self.rng.choice([k for k in h if k != "__metadata__"])
                del h[name]
                labels.append(f"tensor {name} removed")
        crcs = self.rng.random() < 0.5
        return " + ".join(labels), self.build(h, crcs=crcs)


# -- GGUF mutants ----------------------------------------------------------------------------
# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def _gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _gvalue(vtype: int, value) -> bytes:
    """The bytes of one GGUF value (without its type), written independently of the gguf
    library so that any type/value combination can be made."""
    if vtype in _SCALAR:
        return struct.pack(_SCALAR[vtype], value)
    if vtype == 8:
        return _gstr(value)
    item_type, items = value
    return struct.pack("<IQ", item_type, len(items)) + b"".join(_gvalue(item_type, v)
                                                                for v in items)


class GGUFFile:
    """A GGUF v3 file split into its parts: the key/value entries (raw bytes each), the tensor
    infos and the data, so that any part can be changed and the file written again."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
        at = 24
        self.kvs: list[tuple[str, bytes]] = []
        for _ in range(n_kv):
            start = at
            (klen,) = struct.unpack_from("<Q", raw, at)
            key = raw[at + 8:at + 8 + klen].decode()
            at += 8 + klen
            (vtype,) = struct.unpack_from("<I", raw, at)
            at = self._skip(vtype, at + 4)
            self.kvs.append((key, raw[start:at]))
        self.kv_end = at
        self.infos: list[list] = []  # [name, dims, ggml type, offset]
        for _ in range(n_tensors):
            (nlen,) = struct.unpack_from("<Q", raw, at)
            name = raw[at + 8:at + 8 + nlen].decode()
            at += 8 + nlen
            (n_dims,) = struct.unpack_from("<I", raw, at)
            dims = list(struct.unpack_from(f"<{n_dims}Q", raw, at + 4))
            at += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", raw, at)
            at += 12
            self.infos.append([name, dims, ttype, offset])
        self.info_end = at
        self.data_start = at + (-at % 32)
        self.data = raw[self.data_start:]

    def _skip(self, vtype: int, at: int) -> int:
        if vtype in _SCALAR:
            return at + struct.calcsize(_SCALAR[vtype])
        if vtype == 8:
            (n,) = struct.unpack_from("<Q", self.raw, at)
            return at + 8 + n
        item_type, count = struct.unpack_from("<IQ", self.raw, at)
        at += 12
        for _ in range(count):
            at = self._skip(item_type, at)
        return at

    def build(self, kvs=None, infos=None, data=None, *, n_kv=None, n_tensors=None,
              align: int = 32, version=None) -> bytes:
        kvs = self.kvs if kvs is None else kvs
        infos = self.infos if infos is None else infos
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version if version is None
                                              else version,
                                              len(infos) if n_tensors is None else n_tensors,
                                              len(kvs) if n_kv is None else n_kv))
        for _, raw in kvs:
            out += raw
        for name, dims, ttype, offset in infos:
            out += _gstr(name) + struct.pack("<I", len(dims))
            out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset)
        out += b"\x00" * (-len(out) % align)
        return bytes(out + (self.data if data is None else data))


def kv(key: str | bytes, vtype: int, value) -> tuple[str, bytes]:
    return (key if isinstance(key, str) else repr(key)), _gstr(key) + struct.pack(
        "<I", vtype) + _gvalue(vtype, value)


# (type, value) pairs a hand-edited or corrupt metadata value takes
GGUF_VALUES = [
    (0, 0), (1, -1), (2, 65535), (3, -32768), (4, 0), (4, 1), (4, 3), (4, 2**32 - 1), (5, -1),
    (5, 2**31 - 1), (6, NAN), (6, INF), (6, -INF), (6, 0.0), (6, -1.0), (6, 1e-38), (6, 3.0),
    (7, True), (7, False), (8, ""), (8, "x"), (8, "64"), (8, "\u00ff" * 3), (10, 2**64 - 1),
    (10, 2**40), (11, -(2**63)), (12, NAN), (12, 1e308), (9, (4, [])), (9, (4, [64, 64])),
    (9, (8, ["a", "b"])), (9, (9, [(4, [1])])), (9, (6, [NAN])),
]


class GGUFMutator:
    def __init__(self, base: bytes, rng: random.Random):
        self.base = base
        self.rng = rng
        self.g = GGUFFile(base)
        self.keys = [k for k, _ in self.g.kvs]

    def with_kv(self, key: str, entry: tuple[str, bytes] | None) -> bytes:
        kvs = [(k, raw) if k != key else entry for k, raw in self.g.kvs]
        return self.g.build([e for e in kvs if e is not None])

    def truncations(self):
        size = len(self.base)
        cuts = set(range(0, 26)) | {self.g.kv_end - 1, self.g.kv_end, self.g.info_end,
                                    self.g.data_start, size - 1}
        at = 24
        for _, raw in self.g.kvs:
            at += len(raw)
            cuts |= {at - 1, at + 3}
        for *_, offset in self.g.infos:
            cuts |= {self.g.data_start + offset, self.g.data_start + offset + 1}
        for cut in sorted(c for c in cuts if 0 <= c < size):
            yield f"GGUF truncated to {cut} bytes", self.base[:cut]
        for _ in range(15):
            cut = self.rng.randrange(size)
            yield f"GGUF truncated to {cut} bytes", self.base[:cut]

    def flips(self, lo: int, hi: int, count: int, where: str):
        return bit_flips(self.base, self.rng, lo, hi, count, f"GGUF {where}")

    def overwrites(self, lo: int, hi: int, count: int, where: str):
        for _ in range(count):
            data = bytearray(self.base)
            at = self.rng.randrange(lo, hi)
            width = self.rng.choice((1, 2, 4, 8))
            fill = self.rng.choice([b"\xff", b"\x00", b"\x7f", bytes([self.rng.randrange(256)])])
            data[at:at + width] = fill * width
            yield f"GGUF {where} bytes {at}..{at + width} = {fill!r}", bytes(data[:len(
                self.base)])

    def counts(self):
        for n_kv in (0, len(self.g.kvs) - 1, len(self.g.kvs) + 1, 2**32, 2**63, 2**64 - 1):
            yield f"GGUF kv count {n_kv}", self.g.build(n_kv=n_kv)
        for n_t in (0, len(self.g.infos) - 1, len(self.g.infos) + 1, 2**40, 2**64 - 1):
            yield f"GGUF tensor count {n_t}", self.g.build(n_tensors=n_t)
        for version in (0, 1, 2, 4, 2**16, 2**32 - 1):
            yield f"GGUF version {version}", self.g.build(version=version)

    def field_values(self):
        arch = "llama."
        keys = [k for k in self.keys if k.startswith(arch)] + [
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "tokenizer.ggml.model",
            "tokenizer.ggml.pre", "general.architecture", "general.name"]
        for key in keys:
            for vtype, value in GGUF_VALUES:
                yield f"GGUF {key} = type {vtype} {value!r:.30}", self.with_kv(
                    key, kv(key, vtype, value))
            yield f"GGUF {key} removed", self.with_kv(key, None)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges"):
            for vtype, value in [(4, 5), (8, "x"), (9, (4, [])), (9, (4, [1, 2, 3])),
                                 (9, (8, [""] * 3)), (9, (8, ["a"] * 400)), (9, (6, [NAN])),
                                 (9, (9, [(8, ["a"])]))]:
                yield f"GGUF {key} = type {vtype} {value!r:.30}", self.with_kv(
                    key, kv(key, vtype, value))
            yield f"GGUF {key} removed", self.with_kv(key, None)
        for arch_name in ("qwen2", "gemma3", "mamba", "", "llama\x00"):
            yield f"GGUF architecture {arch_name!r}", self.with_kv(
                "general.architecture", kv("general.architecture", 8, arch_name))
        for key in self.rng.sample(self.keys, 6):
            entry = dict(self.g.kvs)[key]
            yield f"GGUF {key} listed twice", self.g.build(self.g.kvs + [(key, entry)])
        yield "GGUF key not UTF-8", self.g.build(self.g.kvs + [kv(b"\xff\xfe", 4, 1)])
        for align_type, align in ((4, 0), (4, 3), (4, 64), (4, 2**31), (10, 32), (8, "32")):
            yield f"GGUF general.alignment = type {align_type} {align}", self.g.build(
                self.g.kvs + [kv("general.alignment", align_type, align)],
                align=64 if align == 64 else 32)

    def tensor_infos(self, count: int):
        g = self.g
        for i in range(count):
            infos = [list(x) for x in g.infos]
            j = self.rng.randrange(len(infos))
            name, dims, ttype, offset = infos[j]
            kind = i % 7
            if kind == 0:
                infos[j][1] = self.rng.choice([[], [0], dims[::-1], dims + [1], [2**40] + dims[1:],
                                               [d * 2 for d in dims], [2**63, 2**63], [1] * 5])
                label = f"dims {infos[j][1]}"
            elif kind == 1:
                infos[j][2] = self.rng.choice([0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 14, 24, 30, 31,
                                               39, 99, 2**31])
                label = f"type {infos[j][2]}"
            elif kind == 2:
                infos[j][3] = self.rng.choice([offset + 1, offset + 32, 0, 2**63,
                                               len(g.data), len(g.data) - 1, offset - 32])
                label = f"offset {infos[j][3]}"
            elif kind == 3:
                infos[j][0] = self.rng.choice([infos[(j + 1) % len(infos)][0], "", "blk.0.x",
                                               "blk.99.attn_q.weight", "output.weight",
                                               name + ".bias"])
                label = f"name {infos[j][0]!r}"
            elif kind == 4:
                del infos[j]
                label = "removed"
            elif kind == 5:
                infos.append(list(infos[j]))
                label = "listed twice"
            else:
                infos[j], infos[(j + 1) % len(infos)] = infos[(j + 1) % len(infos)], infos[j]
                infos[j][0], infos[(j + 1) % len(infos)][0] = (
                    infos[(j + 1) % len(infos)][0], infos[j][0])
                label = "swapped with the next"
            yield f"GGUF tensor {name} {label}", g.build(infos=infos)

    def mutants(self, count: int):
        size = len(self.base)
        families = [
            self.truncations(), self.counts(), self.field_values(), self.tensor_infos(120),
            self.flips(24, self.g.kv_end, 60, "metadata"),
            self.overwrites(24, self.g.kv_end, 60, "metadata"),
            self.flips(self.g.kv_end, self.g.info_end, 50, "tensor info"),
            self.overwrites(self.g.kv_end, self.g.info_end, 50, "tensor info"),
            self.flips(self.g.data_start, size, 20, "data"),
        ]
        return take(families, count, self.random_bytes)

    def random_bytes(self) -> tuple[str, bytes]:
        size = len(self.base)
        lo = self.rng.choice([0, 24, self.g.kv_end])
        data = bytearray(self.base)
        at = self.rng.randrange(lo, size)
        for k in range(self.rng.randrange(1, 4)):
            data[min(at + k, size - 1)] = self.rng.randrange(256)
        return f"GGUF random bytes at {at}", bytes(data)


# -- the child process -----------------------------------------------------------------------
def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _open_pocket(path: str) -> None:
    from pocketlm.api import load_pocket

    model = load_pocket(path)
    model.logits([0, 1])


def _open_gguf(path: str) -> None:
    from pocketlm.formats import open_source

    source = open_source(path)
    for tensor in source.tensors.values():
        tensor.to_float()
        tensor.to_quant(4, 32)


def child(kind: str, base: str, seed: int, count: int) -> None:
    """Run ``count`` mutants of ``base``; one JSON line per mutant on stdout ("begin" before it
    runs, so that a crash names it), and a summary line at the end."""
    import resource

    from pocketlm.errors import PocketError

    rng = random.Random(seed)
    raw = Path(base).read_bytes()
    mutator = PocketMutator(raw, rng) if kind == "pocket" else GGUFMutator(raw, rng)
    run = _open_pocket if kind == "pocket" else _open_gguf
    run(base)  # warm up: imports, thread pool, allocator
    if sys.platform.startswith("linux"):
        limit = _vm("VmSize:") + CHILD_LIMIT_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    peak0 = _vm("VmHWM:")
    t0 = time.perf_counter()
    outcomes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="pocket-fuzz-") as tmp:
        for i, (label, data) in enumerate(mutator.mutants(count)):
            path = os.path.join(tmp, f"m{i}.{kind}")
            with open(path, "wb") as f:
                f.write(data)
            print(json.dumps({"begin": i, "label": label}), flush=True)
            try:
                run(path)
                outcome = "loaded"
            except PocketError as exc:
                outcome = type(exc).__name__
                message = str(exc)
                if "\n" in message:
                    outcome = "MULTILINE " + outcome
            except BaseException as exc:  # the failure this test exists to find
                outcome = "UNTYPED"
                message = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps({"bad": i, "label": label, "error": message}), flush=True)
            os.unlink(path)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(json.dumps({"done": sum(outcomes.values()), "outcomes": outcomes,
                      "seconds": round(time.perf_counter() - t0, 2),
                      "peak_growth": _vm("VmHWM:") - peak0}), flush=True)


def run_child(kind: str, base: Path, seed: int, count: int, timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), kind, str(base),
                           str(seed), str(count)], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = next((x for x in reversed(lines) if "begin" in x), None)
    assert proc.returncode == 0, (
        f"{kind} fuzz child died (exit {proc.returncode}) on mutant {last}: "
        f"{proc.stderr[-3000:]}")
    bad = [x for x in lines if "bad" in x]
    assert not bad, f"{len(bad)} {kind} mutants raised untyped errors, e.g. {bad[:5]}"
    summary = lines[-1]
    assert summary.get("done") == count, summary
    multiline = {k: v for k, v in summary["outcomes"].items() if k.startswith("MULTILINE")}
    assert not multiline, multiline
    assert summary["peak_growth"] < PEAK_GROWTH_LIMIT, summary
    return summary


POCKET_MUTANTS, GGUF_MUTANTS = 3000, 1200


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, RLIMIT_AS")
def test_pocket_reader_fuzz(bases):
    """3,000 seeded mutants of a deploy file: each loads or raises a PocketError (one line),
    in a child process (a crash fails the test), peak memory growth < 256 MB."""
    summary = run_child("pocket", bases["pocket"], seed=1, count=POCKET_MUTANTS)
    outcomes = summary["outcomes"]
    # the families reach every layer: the container, the header checksum, the field checks
    assert outcomes.get("FormatError", 0) > 2000 and outcomes.get("ChecksumError", 0) > 100
    assert outcomes.get("loaded", 0) > 0  # some edits are harmless (bounds, unused fields)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, RLIMIT_AS")
def test_gguf_reader_fuzz(bases):
    """1,200 seeded mutants of a GGUF file: each opens (and every tensor dequantizes) or raises
    a PocketError, in a child process, peak memory growth < 256 MB."""
    summary = run_child("gguf", bases["gguf"], seed=2, count=GGUF_MUTANTS)
    outcomes = summary["outcomes"]
    assert outcomes.get("FormatError", 0) > 500 and outcomes.get("loaded", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind,count", [("pocket", 30000), ("gguf", 12000)])
def test_reader_fuzz_long(bases, kind, count):
    """The long run: ten times the mutants, with other seeds."""
    for seed in (11, 12):
        summary = run_child(kind, bases[kind], seed=seed, count=count // 2, timeout=3600)
        assert sum(summary["outcomes"].values()) == count // 2
        assert summary["outcomes"].get("FormatError", 0) > 0


def test_mutators_are_reproducible(bases):
    """A seed names a mutant set: the same seed gives the same files (so a failure can be
    replayed from its label and index)."""
    for cls, path in ((PocketMutator, bases["pocket"]), (GGUFMutator, bases["gguf"])):
        raw = path.read_bytes()
        first = [(label, hashlib.sha256(data).hexdigest())
                 for label, data in cls(raw, random.Random(5)).mutants(300)]
        again = [(label, hashlib.sha256(data).hexdigest())
                 for label, data in cls(raw, random.Random(5)).mutants(300)]
        assert first == again and len(first) == 300
        assert len({h for _, h in first}) > 250  # distinct files, not one mutant repeated


def test_the_gguf_splitter_rebuilds_the_file(bases):
    """The GGUF mutator's own reading of the format is right: splitting the base file and
    writing it again gives the same bytes, so each mutant differs only where it says."""
    raw = bases["gguf"].read_bytes()
    g = GGUFFile(raw)
    assert g.build() == raw
    assert len(g.kvs) > 10 and len(g.infos) > 20


@pytest.mark.parametrize("edit", ["same-offset", "inside"])
def test_gguf_tensors_that_share_bytes_are_refused(bases, tmp_path, edit):
    """A tensor table pointing a tensor at another's bytes packed one tensor's values as the
    other's, exit 0: refused, naming both, and nothing is written."""
    from pocketlm import cli
    from pocketlm.errors import FormatError
    from pocketlm.formats import open_source

    g = GGUFFile(bases["gguf"].read_bytes())
    infos = [list(x) for x in g.infos]
    infos[1][3] = infos[0][3] + (0 if edit == "same-offset" else 32)
    path = tmp_path / "overlap.gguf"
    path.write_bytes(g.build(infos=infos))
    with pytest.raises(FormatError, match="share bytes") as info:
        open_source(path)
    assert infos[0][0] in str(info.value) and infos[1][0] in str(info.value)
    assert cli.main(["pack", str(path), "-o", str(tmp_path / "out.pocket")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overlap.gguf"]


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
