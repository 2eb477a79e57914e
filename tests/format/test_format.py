"""The on-disk format: header pack/unpack round trips, layout math, and the spec's byte offsets."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash

from mmapcache import Cache, CacheFormatError, Field
from mmapcache._format.header import PREFIX_SIZE, new_header, pack_header, unpack_header
from mmapcache._format.spec import ALIGNMENT, MAGIC, RECORD_SIZE, Header, align, compute_layout

FIELDS = {
    "image": Field((3, 5, 7), "uint8"),
    "label": Field((), "int64"),
    "name": Field((), "U12"),
    "record": Field((2,), np.dtype([("a", "<f4"), ("b", "S3", (2,))])),
    "half": Field((4,), "bfloat16"),
}


def header(**changes: object) -> Header:
    base = new_header(FIELDS, length=1000, capacity=600, key="ключ/v1", created={"time": "x"})
    return Header(**{**base.__dict__, **changes})


def test_align() -> None:
    assert [align(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


def test_header_round_trip() -> None:
    h = header()
    data = pack_header(h)
    assert len(data) == h.header_size
    assert h.header_size % ALIGNMENT == 0
    assert unpack_header(data, path="p") == h


def test_large_schema_grows_the_header() -> None:
    many = {f"field_{i:04d}": Field((i + 1,), "float32") for i in range(300)}
    h = new_header(many, length=10, capacity=10, key="", created={})
    assert h.header_size > ALIGNMENT
    assert unpack_header(pack_header(h), path="p").fields == many


def test_bytes_follow_the_spec() -> None:
    """A reader written from the docstring alone would decode these offsets."""
    h = header()
    data = pack_header(h)
    assert data[:8] == MAGIC == b"\x89MMC\r\n\x1a\n"
    version, header_size, meta_size, crc = struct.unpack_from("<IIII", data, 8)
    length, capacity, record_size, flags = struct.unpack_from("<QQII", data, 24)
    assert (version, header_size, length, capacity, record_size, flags) == (2, h.header_size, 1000, 600, 8, 0)
    assert data[48:64] == h.uuid
    zeroed = bytearray(data)
    zeroed[20:24] = bytes(4)
    assert crc == zlib.crc32(zeroed)
    meta = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + meta_size].decode("utf-8"))
    assert [f["name"] for f in meta["fields"]] == list(FIELDS)
    assert meta["fields"][0] == {"name": "image", "shape": [3, 5, 7], "dtype": "|u1", "torch_dtype": None}
    assert meta["fields"][4]["torch_dtype"] == "bfloat16"
    assert meta["fields"][4]["dtype"] == "<u2"
    assert meta["key"] == "ключ/v1"
    assert meta["checksum"] == "xxh3-64"
    assert set(data[PREFIX_SIZE + meta_size :]) <= {0}


def test_layout_math() -> None:
    h = header()
    layout = compute_layout(h)
    assert layout.table_offset == h.header_size
    pos = align(h.header_size + 600 * RECORD_SIZE)
    assert (layout.counters_offset, layout.counter_records) == (pos, 256)
    pos = align(pos + 256 * 32)
    for name, field in FIELDS.items():
        assert layout.field_offsets[name] == pos
        pos = align(pos + 600 * field.nbytes)
    assert layout.file_size == pos


def test_version_1_has_no_counter_region() -> None:
    h = header(version=1)
    assert unpack_header(pack_header(h), path="p") == h
    layout = compute_layout(h)
    assert layout.counter_records == 0
    assert layout.field_offsets["image"] == align(h.header_size + 600 * RECORD_SIZE)


def test_a_version_1_file_still_opens_and_reads(cache_dir: Path) -> None:
    """Files written before the counter region (format version 1) are read as they are."""
    path = cache_dir / "v1.mmc"
    fields = {"a": Field((3,), "<u2")}
    v1 = new_header(fields, length=4, capacity=4, key="old", created={})
    v1 = Header(**{**v1.__dict__, "version": 1})
    layout = compute_layout(v1)
    raw = bytearray(layout.file_size)
    raw[: v1.header_size] = pack_header(v1)
    raw[v1.header_size + 2 * RECORD_SIZE] = 2  # slot 2 READY
    start = layout.field_offsets["a"] + 2 * 6
    raw[start : start + 6] = np.array([7, 8, 9], "<u2").tobytes()
    struct.pack_into(
        "<I", raw, v1.header_size + 2 * RECORD_SIZE + 4, xxhash.xxh3_64_intdigest(raw[start : start + 6]) & 0xFFFFFFFF
    )
    path.write_bytes(bytes(raw))
    path.chmod(0o600)
    with Cache.open(path, fields, length=4, key="old", verify=True) as cache:
        assert cache.get(2)["a"].tolist() == [7, 8, 9]
        assert cache.put(1, {"a": [1, 2, 3]})
        assert cache.verify() == []
        usage = cache.usage()
        assert not usage.shared  # no counter region: counts stay in this process
        assert (usage.total.hits, usage.total.written) == (1, 1)
    assert path.stat().st_size == layout.file_size


def test_file_on_disk_matches_the_layout(cache_dir: Path) -> None:
    """Slot i of a field sits at offset_k + i * nbytes_k; the slot record at header_size + i * 8."""
    path = cache_dir / "c.mmc"
    fields = {"a": Field((3,), "<u2"), "b": Field((), "<f8")}
    with Cache.open(path, fields, length=5) as cache:
        cache.put(4, {"a": np.array([1, 2, 3], "<u2"), "b": 2.5})
        layout = cache._layout
        header_size = cache._header.header_size
    raw = path.read_bytes()
    assert len(raw) == layout.file_size
    record = raw[header_size + 4 * RECORD_SIZE : header_size + 5 * RECORD_SIZE]
    assert record[0] == 2  # READY
    a_bytes = raw[layout.field_offsets["a"] + 4 * 6 : layout.field_offsets["a"] + 5 * 6]
    b_bytes = raw[layout.field_offsets["b"] + 4 * 8 : layout.field_offsets["b"] + 5 * 8]
    assert np.frombuffer(a_bytes, "<u2").tolist() == [1, 2, 3]
    assert np.frombuffer(b_bytes, "<f8").tolist() == [2.5]
    # h = XXH3_64(a, seed=0); h = XXH3_64(b, seed=h); checksum = low 32 bits
    chained = xxhash.xxh3_64_intdigest(b_bytes, seed=xxhash.xxh3_64_intdigest(a_bytes, seed=0))
    assert struct.unpack("<I", record[4:8])[0] == chained & 0xFFFFFFFF


@pytest.mark.parametrize(
    ("meta_change", "match"),
    [
        ({"fields": []}, "fields must be a non-empty list"),
        ({"key": 5}, "key must be a string"),
        ({"checksum": "md5"}, "checksum algorithm"),
        ({"fields": [{"name": "a", "shape": [1], "dtype": "|O", "torch_dtype": None}]}, "Python objects"),
    ],
)
def test_bad_metadata_with_a_valid_checksum(meta_change: dict[str, object], match: str) -> None:
    h = header()
    data = bytearray(pack_header(h))
    (meta_size,) = struct.unpack_from("<I", data, 16)
    meta = json.loads(bytes(data[PREFIX_SIZE : PREFIX_SIZE + meta_size]))
    meta.update(meta_change)
    blob = json.dumps(meta).encode()
    data[PREFIX_SIZE:] = bytes(len(data) - PREFIX_SIZE)
    data[PREFIX_SIZE : PREFIX_SIZE + len(blob)] = blob
    struct.pack_into("<I", data, 16, len(blob))
    data[20:24] = bytes(4)
    struct.pack_into("<I", data, 20, zlib.crc32(data))
    with pytest.raises(CacheFormatError, match=match):
        unpack_header(bytes(data), path="p")


def test_capacity_larger_than_length_is_corrupt() -> None:
    with pytest.raises(CacheFormatError, match="capacity"):
        unpack_header(pack_header(header(capacity=2000)), path="p")


def test_a_stream_header_is_version_8_and_round_trips_its_partitioning() -> None:
    h = new_header(FIELDS, length=600, capacity=600, key="s", created={}, stream=(2, 3))
    assert h.version == 8
    data = pack_header(h)
    (meta_size,) = struct.unpack_from("<I", data, 16)
    assert json.loads(data[PREFIX_SIZE : PREFIX_SIZE + meta_size])["stream"] == {"ranks": 2, "workers": 3}
    assert unpack_header(data, path="p") == h


def test_stream_region_layout_follows_the_boot_page() -> None:
    h = new_header(FIELDS, length=600, capacity=600, key="s", created={}, stream=(2, 3))
    layout = compute_layout(h)
    assert layout.stream_offset == layout.boot_offset + ALIGNMENT
    assert layout.partitions_offset == layout.stream_offset + ALIGNMENT
    assert layout.partitions == 6
    assert layout.elements_offset == align(layout.partitions_offset + 6 * 64)
    assert layout.file_size == align(layout.elements_offset + 600 * 16)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"version": 5, "stream": (1, 1)}, "a stream partitioning in format version 5"),
        ({"version": 8, "stream": None}, "no stream partitioning in format version 8"),
    ],
)
def test_a_stream_partitioning_goes_with_version_8_only(changes: dict[str, object], match: str) -> None:
    with pytest.raises(CacheFormatError, match=match):
        unpack_header(pack_header(header(**changes)), path="p")
