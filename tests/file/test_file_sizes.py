"""A creator validates every size before it creates anything, and never publishes a file it cannot open."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import mmapcache._file.create
from mmapcache import Cache, CacheFormatError, Field
from mmapcache._format.header import PREFIX_SIZE, new_header, pack_header
from mmapcache._format.spec import ALIGNMENT, MAX_HEADER_SIZE, Header

FIELDS = {"x": Field((4,), "uint8")}


def test_a_key_over_the_header_limit_is_refused_before_anything_is_created(cache_dir: Path) -> None:
    path = cache_dir / "missing" / "c.mmc"
    with pytest.raises(ValueError, match="over the format's limit") as info:
        Cache.open(path, FIELDS, length=10, key="k" * (70 * 2**20))
    message = str(info.value)
    assert not isinstance(info.value, CacheFormatError)  # the caller's argument, not a damaged file
    assert f"the key takes {70 * 2**20 + 2} bytes" in message  # its JSON string, quotes included
    assert f"limit of {MAX_HEADER_SIZE} bytes (64 MiB)" in message
    assert "shorter key" in message
    assert os.listdir(cache_dir) == []  # no directory, no lock file, no temp file, no cache


def test_too_many_fields_are_refused_before_anything_is_created(cache_dir: Path) -> None:
    fields = {f"{i:04d}" + "n" * 2**16: Field((), "uint8") for i in range(1100)}
    path = cache_dir / "c.mmc"
    with pytest.raises(ValueError, match="the description of the 1100 fields") as info:
        Cache.open(path, fields, length=10)
    assert "fewer fields" in str(info.value)
    assert os.listdir(cache_dir) == []


CREATED = {"time": "2026-01-01T00:00:00Z"}


def _largest_key_that_fits() -> int:
    """Key length (ASCII) at which the header is exactly MAX_HEADER_SIZE bytes."""
    data = pack_header(new_header(FIELDS, 10, 10, "", CREATED))
    meta_size = int.from_bytes(data[16:20], "little")
    return MAX_HEADER_SIZE - PREFIX_SIZE - meta_size


def test_a_header_of_exactly_64_mib_is_allowed_and_one_byte_more_is_not() -> None:
    fits = _largest_key_that_fits()
    header = new_header(FIELDS, 10, 10, "k" * fits, CREATED)
    assert header.header_size == MAX_HEADER_SIZE
    with pytest.raises(ValueError, match=f"the key takes {fits + 3} bytes"):
        new_header(FIELDS, 10, 10, "k" * (fits + 1), CREATED)


def test_a_cache_with_the_largest_key_round_trips(cache_dir: Path) -> None:
    # Through Cache.open, whose creation metadata differs slightly from CREATED: stay a page below.
    key = "k" * (_largest_key_that_fits() - ALIGNMENT)
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=10, key=key) as cache:
        cache.put(3, {"x": np.arange(4, dtype=np.uint8)})
    with Cache.open(path, FIELDS, length=10, key=key, readonly=True) as cache:
        assert cache.get(3)["x"].tolist() == [0, 1, 2, 3]


def test_a_writer_bug_never_publishes_an_unopenable_file(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Defence in depth: the creator reads its temp file back with the reader every
    # opener uses before linking it into place. Inject a writer bug (a header
    # checksum off by one bit) and check nothing is published.
    def buggy_pack_header(header: Header) -> bytes:
        data = bytearray(pack_header(header))
        data[20] ^= 1
        return bytes(data)

    monkeypatch.setattr(mmapcache._file.create, "pack_header", buggy_pack_header)
    path = cache_dir / "c.mmc"
    with pytest.raises(CacheFormatError, match="does not read back as written") as info:
        Cache.open(path, FIELDS, length=10)
    assert "bug in mmapcache" in str(info.value)
    assert "corrupt header: its checksum" in str(info.value)
    assert sorted(os.listdir(cache_dir)) == ["c.mmc.lock"]  # no cache, no temp file
    monkeypatch.undo()
    with Cache.open(path, FIELDS, length=10) as cache:  # the next (correct) creator succeeds
        assert cache.length == 10
