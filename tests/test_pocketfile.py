"""Tests of the ``.pocket`` container: round trip, alignment, compatibility with the standard
safetensors reader, atomic writes, and a clean :class:`FormatError` for every kind of bad file."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from pocketlm.errors import ChecksumError, FormatError
from pocketlm.formats import pocketfile
from pocketlm.formats.pocketfile import ALIGN, PocketFile, write_pocket
from pocketlm.quant import QuantTensor, quantize_int4, quantize_int5, quantize_int8


def sample_tensors() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    return {
        "a.f32": r.standard_normal((3, 5)).astype(np.float32),  # 60 bytes: forces padding
        "b.f16": r.standard_normal(7).astype(np.float16),
        "c.u8": r.integers(0, 256, 13, dtype=np.uint8),
        "d.i8": r.integers(-128, 128, (2, 3, 4), dtype=np.int8),
        "e.i32": r.integers(-2**31, 2**31, 5, dtype=np.int32),
        "f.scalar": np.float32(2.5).reshape(1),
        "pocket.tokenizer": np.frombuffer(b'{"model": "tiny"}', dtype=np.uint8),
    }


METADATA = {"config": {"hidden": 8, "name": "tiny"}, "chat_template": "{{ messages }}",
            "generation": {"temperature": 0.7}}


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "model.pocket"
    write_pocket(path, sample_tensors().items(), METADATA)
    return path


def read_raw_header(path: Path) -> tuple[int, dict]:
    buf = path.read_bytes()
    (n,) = struct.unpack("<Q", buf[:8])
    return n, json.loads(buf[8:8 + n])


def craft(path: Path, header, data: bytes = b"") -> Path:
    """A safetensors-shaped file with an arbitrary header."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def rewrite_header(path: Path, edit) -> Path:
    """Re-serialize a good file's header after ``edit(header)``; the data stays as it is."""
    buf = path.read_bytes()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + buf[8 + n:])
    return path


def format_error(path: Path, cls=FormatError, **kw) -> str:
    """The message of the error opening ``path`` raises (it must name the file)."""
    with pytest.raises(cls) as info:
        PocketFile(path, **kw)
    msg = str(info.value)
    assert str(path) in msg, msg
    return msg


# -- round trip ------------------------------------------------------------------------------
def test_round_trip_metadata_and_values(good):
    tensors = sample_tensors()
    pf = PocketFile(good)
    assert pf.metadata["format"] == "pocket"
    assert pf.metadata["format_version"] == "1"
    assert pf.json("config") == METADATA["config"]
    assert pf.json("generation") == METADATA["generation"]
    assert pf.metadata["chat_template"] == "{{ messages }}"  # strings are stored as they are
    assert pf.json("missing", {"x": 1}) == {"x": 1}
    with pytest.raises(FormatError, match="missing"):
        pf.json("missing")
    checksums = json.loads(pf.metadata["checksums"])
    assert isinstance(checksums, dict)
    for name, a in tensors.items():
        assert checksums[name] == zlib.crc32(a.tobytes())
        v = pf.tensor(name)
        assert v.dtype == a.dtype and v.shape == a.shape
        assert np.array_equal(v, a)
    assert set(pf.infos) - set(tensors) == {n for n in pf.infos if n.startswith("_pad.")}
    assert pf.nbytes == good.stat().st_size
    with pytest.raises(FormatError, match="missing tensor 'nope'"):
        pf.tensor("nope")


def test_write_returns_file_size(tmp_path):
    path = tmp_path / "sub" / "dir" / "m.pocket"  # parent folders are created
    size = write_pocket(path, sample_tensors().items(), {})
    assert size == path.stat().st_size
    assert PocketFile(path).metadata["format"] == "pocket"


def test_views_are_zero_copy_and_read_only(good):
    pf = PocketFile(good)
    base = np.frombuffer(pf._buf, dtype=np.uint8)
    lo, hi = base.ctypes.data, base.ctypes.data + base.size
    for name, info in pf.infos.items():
        v = pf.tensor(name)
        assert v.flags.writeable is False
        assert v.ctypes.data == lo + info.start  # points into the mapping: no copy
        assert lo <= v.ctypes.data and v.ctypes.data + v.nbytes <= hi
        with pytest.raises(ValueError):
            v.reshape(-1)[0] = 0


def test_every_tensor_is_64_byte_aligned(good):
    n, header = read_raw_header(good)
    base = 8 + n
    assert base % ALIGN == 0
    ranges = sorted(tuple(e["data_offsets"]) for k, e in header.items() if k != "__metadata__")
    for k, e in header.items():
        if k != "__metadata__" and not k.startswith("_pad."):
            assert (base + e["data_offsets"][0]) % ALIGN == 0, k
    assert any(k.startswith("_pad.") for k in header)  # the sample does need padding
    # no holes and nothing after the last tensor (the safetensors rules)
    assert ranges[0][0] == 0
    for (_, e0), (b1, _) in zip(ranges, ranges[1:], strict=False):
        assert e0 == b1
    assert base + ranges[-1][1] == good.stat().st_size
    assert all(isinstance(v, str) for v in header["__metadata__"].values())


def test_readable_by_safetensors(good):
    tensors = sample_tensors()
    with safe_open(str(good), framework="numpy") as f:
        keys = set(f.keys())
        assert set(tensors) <= keys
        assert all(k.startswith("_pad.") for k in keys - set(tensors))
        meta = f.metadata()
        assert meta["format"] == "pocket" and "checksums" in meta
        for name, a in tensors.items():
            v = f.get_tensor(name)
            assert v.dtype == a.dtype and v.shape == a.shape
            assert np.array_equal(v, a)
    loaded = load_file(str(good))
    assert np.array_equal(loaded["d.i8"], tensors["d.i8"])


def test_zero_size_tensor(tmp_path):
    path = tmp_path / "z.pocket"
    tensors = {"w": np.ones((2, 3), np.float32), "empty": np.zeros((0, 4), np.float16),
               "last": np.zeros(0, np.uint8)}
    write_pocket(path, tensors.items(), {})
    pf = PocketFile(path)
    for name, a in tensors.items():
        assert pf.tensor(name).shape == a.shape and np.array_equal(pf.tensor(name), a)
    with safe_open(str(path), framework="numpy") as f:
        assert f.get_tensor("empty").shape == (0, 4)


def test_write_refuses_bad_tensors(tmp_path):
    path = tmp_path / "x.pocket"
    cases = [
        [("w", np.zeros(4, np.float64))],
        [("w", np.zeros(4, np.bool_))],
        [("w", np.zeros(4, np.float32)), ("w", np.zeros(4, np.float32))],  # duplicate
        [("_pad.0", np.zeros(4, np.uint8))],  # reserved for the padding
        [("__metadata__", np.zeros(4, np.uint8))],
    ]
    for tensors in cases:
        with pytest.raises(FormatError, match="cannot store tensor"):
            write_pocket(path, tensors, {})
        assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_written_file_gets_the_usual_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_pocket(tmp_path / "m.pocket", sample_tensors().items(), {})
    finally:
        os.umask(old)
    assert (tmp_path / "m.pocket").stat().st_mode & 0o777 == 0o640


# -- atomic write ----------------------------------------------------------------------------
@pytest.mark.parametrize("fail_at,exc", [("replace", OSError), ("fsync", OSError),
                                         ("fsync", KeyboardInterrupt)])
def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, fail_at, exc):
    dest = tmp_path / "model.pocket"
    dest.write_bytes(b"previous contents")

    def boom(*args, **kwargs):
        raise exc("simulated failure")

    monkeypatch.setattr(pocketfile.os, fail_at, boom)
    with pytest.raises(exc, match="simulated failure"):
        write_pocket(dest, sample_tensors().items(), METADATA)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pocket"]
    assert dest.read_bytes() == b"previous contents"

    dest.unlink()  # and with no previous file, nothing at all remains
    monkeypatch.setattr(pocketfile.os, fail_at, boom)
    with pytest.raises(exc):
        write_pocket(dest, sample_tensors().items(), METADATA)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_failure_while_writing_tensor_data(tmp_path, monkeypatch):
    dest = tmp_path / "model.pocket"
    dest.write_bytes(b"previous contents")
    real = pocketfile._raw_bytes
    calls = []

    def counting(a):
        calls.append(a)
        return real(a)

    monkeypatch.setattr(pocketfile, "_raw_bytes", counting)
    write_pocket(tmp_path / "dry" / "run.pocket", sample_tensors().items(), METADATA)
    total = len(calls)  # one pass for the checksums, one for the writes
    (tmp_path / "dry" / "run.pocket").unlink()
    (tmp_path / "dry").rmdir()
    calls.clear()

    def flaky(a):
        calls.append(a)
        if len(calls) > total // 2 + 2:  # fail on the third tensor written
            assert [p.suffix for p in tmp_path.iterdir()].count(".tmp") == 1  # mid-write
            raise OSError("No space left on device")
        return real(a)

    monkeypatch.setattr(pocketfile, "_raw_bytes", flaky)
    with pytest.raises(OSError, match="No space left"):
        write_pocket(dest, sample_tensors().items(), METADATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pocket"]
    assert dest.read_bytes() == b"previous contents"


def test_overwrite_replaces_the_file(good):
    write_pocket(good, [("only", np.arange(4, dtype=np.int32))], {})
    pf = PocketFile(good)
    assert [n for n in pf.infos if not n.startswith("_pad.")] == ["only"]
    assert sorted(p.name for p in good.parent.iterdir()) == [good.name]


# -- bad files -------------------------------------------------------------------------------
def test_missing_and_empty_files(tmp_path):
    assert "no such file" in format_error(tmp_path / "nothing.pocket")
    assert "no such file" in format_error(tmp_path)  # a folder
    empty = tmp_path / "empty.pocket"
    empty.write_bytes(b"")
    assert "empty" in format_error(empty)
    seven = tmp_path / "seven.pocket"
    seven.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00")
    assert "truncated" in format_error(seven)


@pytest.mark.parametrize("n", [0, 1, 1000, 2**40, 2**64 - 1])
def test_header_length_does_not_fit(tmp_path, n):
    path = tmp_path / "h.pocket"
    path.write_bytes(struct.pack("<Q", n) + b'{"a": 1}' + b" " * 92)
    assert "header length" in format_error(path)


@pytest.mark.parametrize("cut", [1, 7, 100])
def test_truncated_data(good, cut):
    data = good.read_bytes()
    good.write_bytes(data[:-cut])
    assert "truncated" in format_error(good)


def test_truncated_inside_the_header(good):
    n, _ = read_raw_header(good)
    good.write_bytes(good.read_bytes()[:8 + n // 2])
    assert "header length" in format_error(good)


@pytest.mark.parametrize("header", [
    b"{not json}",
    b'{"a": ',
    b"\xff\xfe{}",  # not UTF-8
    b"[" * 50_000 + b"]" * 50_000,  # nesting deep enough to exhaust the parser's recursion
    b'{"x": ' + b"9" * 10_000 + b"}",  # an integer beyond Python's conversion limit
])
def test_header_not_json(tmp_path, header):
    assert "not valid JSON" in format_error(craft(tmp_path / "j.pocket", header))


@pytest.mark.parametrize("header", [b"[]", b'"text"', b"42", b"null"])
def test_header_not_an_object(tmp_path, header):
    assert "not a JSON object" in format_error(craft(tmp_path / "j.pocket", header))


def test_flipped_byte_is_a_checksum_error(good):
    pf = PocketFile(good)
    info = pf.infos["d.i8"]
    del pf
    data = bytearray(good.read_bytes())
    data[info.start + 5] ^= 0x01
    good.write_bytes(bytes(data))
    msg = format_error(good, cls=ChecksumError)
    assert "'d.i8'" in msg and "corrupt" in msg
    pf = PocketFile(good, verify=False)  # loads without the check...
    assert not np.array_equal(pf.tensor("d.i8"), sample_tensors()["d.i8"])
    pf.verify(["a.f32", "b.f16"])  # ...the other tensors are fine...
    with pytest.raises(ChecksumError, match="'d.i8'"):
        pf.verify()  # ...and an explicit verify finds it


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_checksum_of_a_tensor_summed_in_chunks(tmp_path, monkeypatch, where):
    """Large tensors are summed chunk by chunk (their pages dropped as it goes): a flipped byte
    in any chunk is found, and an intact file passes."""
    from pocketlm.formats import pocketfile

    monkeypatch.setattr(pocketfile, "CHECKSUM_CHUNK", 4096)
    path = tmp_path / "big.pocket"
    w = np.random.default_rng(0).integers(-128, 128, size=(100, 1000), dtype=np.int8)
    write_pocket(path, [("w", w), ("b", np.ones(7, np.float32))], METADATA)
    info = PocketFile(path).infos["w"]  # intact: verifies across 25 chunks
    size = info.end - info.start
    offset = {"first": 0, "middle": size // 2 + 1, "last": size - 1}[where]
    data = bytearray(path.read_bytes())
    data[info.start + offset] ^= 0x10
    path.write_bytes(bytes(data))
    assert "'w'" in format_error(path, cls=ChecksumError)


def test_flipped_byte_in_padding_and_tokenizer(good):
    pf = PocketFile(good)
    pads = [i for n, i in pf.infos.items() if n.startswith("_pad.")]
    tok = pf.infos["pocket.tokenizer"]
    del pf
    for start, name in ((pads[0].start, "_pad."), (tok.start, "pocket.tokenizer")):
        data = bytearray(good.read_bytes())
        data[start] ^= 0x80
        good.write_bytes(bytes(data))
        assert name in format_error(good, cls=ChecksumError)
        data[start] ^= 0x80
        good.write_bytes(bytes(data))
    PocketFile(good)


def test_padding_without_recorded_checksums_loads(good):
    """Files whose writer recorded no checksums for the ``_pad.*`` tensors still load."""
    def edit(h):
        sums = json.loads(h["__metadata__"]["checksums"])
        h["__metadata__"]["checksums"] = json.dumps(
            {k: v for k, v in sums.items() if not k.startswith("_pad.")})
    rewrite_header(good, edit)
    pf = PocketFile(good)
    assert np.array_equal(pf.tensor("a.f32"), sample_tensors()["a.f32"])


def test_plain_safetensors_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": np.ones((2, 2), np.float32)}, str(path))
    assert "pocket pack" in format_error(path)
    save_file({"w": np.ones((2, 2), np.float32)}, str(path), metadata={"format": "pt"})
    assert "pocket pack" in format_error(path)


@pytest.mark.parametrize("version", ["2", "0", "x", "1.0", None, 2, [1], {"v": 1}])
def test_wrong_format_version(good, version):
    def edit(h):
        if version is None:
            del h["__metadata__"]["format_version"]
        else:
            h["__metadata__"]["format_version"] = version
    rewrite_header(good, edit)
    assert "format version" in format_error(good)


def test_random_bytes(tmp_path):
    r = np.random.default_rng(1)
    for i in range(20):
        path = tmp_path / f"r{i}.pocket"
        path.write_bytes(r.integers(0, 256, int(r.integers(1, 5000)), dtype=np.uint8).tobytes())
        assert format_error(path)
        # a plausible header length followed by junk
        path.write_bytes(struct.pack("<Q", 100) + r.integers(0, 256, 300, np.uint8).tobytes())
        assert format_error(path)


def test_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 10, 2) + bytes(range(256)) * 4)
    assert format_error(path)
    path.write_bytes(b"GGUF")
    assert "truncated" in format_error(path)


META = {"format": "pocket", "format_version": "1"}


def _meta(**checksums):
    return {**META, "checksums": json.dumps(checksums)}


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 10]}, "byte range"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [4, 12]}, "byte range"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "byte range"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 12.0]}, "byte range"),
    ({"dtype": "F32", "shape": [30], "data_offsets": [0, 120]}, "truncated"),
    ({"dtype": "Q4", "shape": [3], "data_offsets": [0, 12]}, "unknown dtype"),
    ({"dtype": ["F32"], "shape": [3], "data_offsets": [0, 12]}, "unknown dtype"),
    ({"dtype": None, "shape": [3], "data_offsets": [0, 12]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [-3], "data_offsets": [0, 12]}, "malformed shape"),
    ({"dtype": "F32", "shape": [1.5, 2], "data_offsets": [0, 12]}, "malformed shape"),
    ({"dtype": "F32", "shape": 3, "data_offsets": [0, 12]}, "malformed shape"),
    ({"dtype": "F32", "shape": None, "data_offsets": [0, 12]}, "malformed shape"),
    ({"dtype": "F32", "shape": "abc", "data_offsets": [0, 12]}, "malformed shape"),
    ({"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}, "byte range"),
    ({"dtype": "F32", "shape": [3]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 12, 14]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [3], "data_offsets": 12}, "malformed header entry"),
    ({"shape": [3], "data_offsets": [0, 12]}, "malformed header entry"),
    ("F32", "malformed header entry"),
    ([1, 2, 3], "malformed header entry"),
    (None, "malformed header entry"),
])
def test_bad_tensor_entry(tmp_path, entry, match):
    data = np.arange(3, dtype=np.float32).tobytes()
    path = craft(tmp_path / "t.pocket", {"__metadata__": _meta(w=zlib.crc32(data)), "w": entry},
                 data)
    msg = format_error(path)
    assert match in msg and "'w'" in msg


@pytest.mark.parametrize("meta,match", [
    ([1, 2], "__metadata__"),
    ("format=pocket", "__metadata__"),
    (META, "checksums"),  # no checksums at all
    ({**META, "checksums": "{not json"}, "checksums"),
    ({**META, "checksums": "[1, 2]"}, "checksums"),
    ({**META, "checksums": "7"}, "checksums"),
    ({**META, "checksums": {"w": 1}}, "checksums"),  # not a string
    ({**META, "checksums": "{}"}, "no checksum recorded"),
])
def test_bad_metadata(tmp_path, meta, match):
    data = np.arange(3, dtype=np.float32).tobytes()
    entry = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    path = craft(tmp_path / "m.pocket", {"__metadata__": meta, "w": entry}, data)
    assert match in format_error(path)


@pytest.mark.parametrize("recorded", [12345, "abc", None, 1.5, [1]])
def test_wrong_recorded_checksum(tmp_path, recorded):
    data = np.arange(3, dtype=np.float32).tobytes()
    entry = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    path = craft(tmp_path / "c.pocket", {"__metadata__": _meta(w=recorded), "w": entry}, data)
    assert "'w'" in format_error(path, cls=ChecksumError)
    PocketFile(path, verify=False)


def test_hand_made_minimal_file_loads(tmp_path):
    """The reader needs no alignment or padding: any valid safetensors layout with the pocket
    metadata loads (the check above are about what is wrong, not about our own writer)."""
    data = np.arange(3, dtype=np.float32).tobytes() + b"\x07"
    header = {"__metadata__": _meta(w=zlib.crc32(data[:12]), b=zlib.crc32(data[12:])),
              "w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
              "b": {"dtype": "U8", "shape": [], "data_offsets": [12, 13]}}
    pf = PocketFile(craft(tmp_path / "ok.pocket", header, data))
    assert np.array_equal(pf.tensor("w"), np.arange(3, dtype=np.float32))
    assert pf.tensor("b").shape == () and int(pf.tensor("b")) == 7


# -- quantized weights -----------------------------------------------------------------------
def quant_file(path: Path, layouts=None, arrays=None) -> tuple[Path, dict]:
    r = np.random.default_rng(2)
    w4 = r.standard_normal((4, 64)).astype(np.float32)
    w8 = r.standard_normal((6, 128)).astype(np.float32)
    q4, q8 = quantize_int4(w4), quantize_int8(w8, 64)
    norm = r.standard_normal(64).astype(np.float32)
    if arrays is None:
        arrays = [("blk.0.attn.w_q.weight", q4.qweight),
                  ("blk.0.attn.w_q.weight.scales", q4.scales),
                  ("blk.0.attn.w_q.weight.mins", q4.mins),
                  ("embed.weight", q8.qweight), ("embed.weight.scales", q8.scales),
                  ("blk.0.norm.weight", norm),
                  ("pocket.tokenizer", np.frombuffer(b"{}", np.uint8))]
    if layouts is None:
        layouts = {"blk.0.attn.w_q.weight": {"kind": "int4", "shape": [4, 64], "group_size": 32},
                   "embed.weight": {"kind": "int8", "shape": [6, 128], "group_size": 64}}
    write_pocket(path, arrays, {"quant": {"scheme": "int4-g32", "group_size": 32,
                                          "embed_bits": 8, "tensors": layouts}})
    return path, {"q4": q4, "q8": q8, "norm": norm}


def test_weights_returns_quant_tensors(tmp_path):
    path, ref = quant_file(tmp_path / "q.pocket")
    weights = PocketFile(path).weights()
    assert set(weights) == {"blk.0.attn.w_q.weight", "embed.weight", "blk.0.norm.weight"}
    q4 = weights["blk.0.attn.w_q.weight"]
    assert isinstance(q4, QuantTensor)
    assert (q4.kind, q4.shape, q4.group_size) == ("int4", (4, 64), 32)
    assert q4.qweight.flags.writeable is False  # a view of the mapping
    assert np.array_equal(q4.dequantize(), ref["q4"].dequantize())
    q8 = weights["embed.weight"]
    assert isinstance(q8, QuantTensor) and q8.mins is None
    assert (q8.kind, q8.shape, q8.group_size) == ("int8", (6, 128), 64)
    assert np.array_equal(q8.dequantize(), ref["q8"].dequantize())
    norm = weights["blk.0.norm.weight"]
    assert isinstance(norm, np.ndarray) and np.array_equal(norm, ref["norm"])


def test_weights_without_quant_metadata(good):
    weights = PocketFile(good).weights()
    assert set(weights) == set(sample_tensors()) - {"pocket.tokenizer"}
    assert not any(isinstance(v, QuantTensor) for v in weights.values())


INT4 = "blk.0.attn.w_q.weight"


@pytest.mark.parametrize("layout", [
    {"kind": "int4", "shape": [4, 128], "group_size": 32},  # wrong cols
    {"kind": "int4", "shape": [5, 64], "group_size": 32},  # wrong rows
    {"kind": "int4", "shape": [4, 64], "group_size": 64},  # scales do not match
    {"kind": "int8", "shape": [4, 64], "group_size": 32},  # packed bytes are not int8 values
    {"kind": "int8", "shape": [4, 32], "group_size": 32},  # the shape fits, the dtype does not
])
def test_weights_layout_mismatch(tmp_path, layout):
    path, _ = quant_file(tmp_path / "q.pocket", layouts={INT4: layout})
    pf = PocketFile(path)
    with pytest.raises(FormatError, match="quant layout") as info:
        pf.weights()
    assert str(path) in str(info.value) and INT4 in str(info.value)


@pytest.mark.parametrize("layout", [
    {"shape": [4, 64], "group_size": 32},
    {"kind": "int4", "group_size": 32},
    {"kind": "int4", "shape": [4, 64]},
    {"kind": "int3", "shape": [4, 64], "group_size": 32},
    {"kind": "int4", "shape": [4, 64], "group_size": 0},
    {"kind": "int4", "shape": [4, 64], "group_size": "x"},
    {"kind": "int4", "shape": [256], "group_size": 32},
    {"kind": "int4", "shape": 7, "group_size": 32},
    "int4",
])
def test_weights_malformed_layout(tmp_path, layout):
    path, _ = quant_file(tmp_path / "q.pocket", layouts={INT4: layout})
    with pytest.raises(FormatError, match="quant layout") as info:
        PocketFile(path).weights()
    assert str(path) in str(info.value)


def test_weights_missing_companion(tmp_path):
    q4 = quantize_int4(np.ones((4, 64), np.float32))
    arrays = [(INT4, q4.qweight), (INT4 + ".scales", q4.scales)]  # no .mins
    path, _ = quant_file(tmp_path / "q.pocket", arrays=arrays,
                         layouts={INT4: {"kind": "int4", "shape": [4, 64], "group_size": 32}})
    with pytest.raises(FormatError, match="missing tensor") as info:
        PocketFile(path).weights()
    assert ".mins" in str(info.value) and str(path) in str(info.value)


def test_weights_scales_of_the_wrong_dtype(tmp_path):
    q4 = quantize_int4(np.ones((4, 64), np.float32))
    arrays = [(INT4, q4.qweight), (INT4 + ".scales", q4.scales.astype(np.float32)),
              (INT4 + ".mins", q4.mins)]
    path, _ = quant_file(tmp_path / "q.pocket", arrays=arrays,
                         layouts={INT4: {"kind": "int4", "shape": [4, 64], "group_size": 32}})
    with pytest.raises(FormatError, match="quant layout"):
        PocketFile(path).weights()


INT5 = "blk.0.mlp.w_up.weight"


def int5_file(path: Path, layout=None, arrays=None) -> tuple[Path, QuantTensor]:
    q5 = quantize_int5(np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32))
    if arrays is None:
        arrays = [(INT5, q5.qweight), (INT5 + ".scales", q5.scales), (INT5 + ".mins", q5.mins)]
    layout = layout or {"kind": "int5", "shape": [3, 96], "group_size": 32}
    write_pocket(path, arrays + [("pocket.tokenizer", np.frombuffer(b"{}", np.uint8))],
                 {"quant": {"scheme": "int4-g32+int5", "group_size": 32, "embed_bits": 8,
                            "tensors": {INT5: layout}}})
    return path, q5


def test_weights_returns_int5_tensors(tmp_path):
    path, q5 = int5_file(tmp_path / "q5.pocket")
    weights = PocketFile(path).weights()
    assert set(weights) == {INT5}
    w = weights[INT5]
    assert isinstance(w, QuantTensor) and (w.kind, w.shape, w.group_size) == ("int5", (3, 96), 32)
    assert w.qweight.shape == (3, 60) and w.qweight.dtype == np.uint8
    assert w.qweight.flags.writeable is False  # a view of the mapping
    for a, b in ((w.qweight, q5.qweight), (w.scales, q5.scales), (w.mins, q5.mins)):
        assert np.array_equal(a, b)
    assert np.array_equal(w.dequantize(), q5.dequantize())


@pytest.mark.parametrize("layout", [
    {"kind": "int5", "shape": [3, 64], "group_size": 32},  # qweight is 60 bytes a row, not 40
    {"kind": "int4", "shape": [3, 96], "group_size": 32},  # INT4 would be 48 bytes a row
    {"kind": "int5", "shape": [3, 96], "group_size": 96},  # not a group size
])
def test_int5_layout_mismatch(tmp_path, layout):
    path, _ = int5_file(tmp_path / "q5.pocket", layout=layout)
    with pytest.raises(FormatError, match="quant layout") as info:
        PocketFile(path).weights()
    assert INT5 in str(info.value)


def test_int5_needs_uint8_values_and_mins(tmp_path):
    q5 = quantize_int5(np.ones((3, 96), np.float32))
    path, _ = int5_file(tmp_path / "a.pocket", arrays=[
        (INT5, q5.qweight.view(np.int8)), (INT5 + ".scales", q5.scales),
        (INT5 + ".mins", q5.mins)])
    with pytest.raises(FormatError, match="quant layout"):
        PocketFile(path).weights()
    path, _ = int5_file(tmp_path / "b.pocket", arrays=[(INT5, q5.qweight),
                                                       (INT5 + ".scales", q5.scales)])
    with pytest.raises(FormatError, match="missing tensor") as info:
        PocketFile(path).weights()
    assert ".mins" in str(info.value)


@pytest.mark.parametrize("quant", ["[1, 2]", "{not json", '{"tensors": [1]}'])
def test_weights_malformed_quant_metadata(good, quant):
    rewrite_header(good, lambda h: h["__metadata__"].__setitem__("quant", quant))
    pf = PocketFile(good)
    with pytest.raises(FormatError, match="quant") as info:
        pf.weights()
    assert str(good) in str(info.value)
