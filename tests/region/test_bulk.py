"""Storing a batch into a run of fresh slots (``Writer.put_run``, the fill path of a stream cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mmapcache import CacheError, Field
from mmapcache._streams.stream_cache import Partition, PartitionWriter, open_stream, plan_stream, region
from mmapcache.cache import writer_of

sys.path.insert(0, str(Path(__file__).parents[1]))
from _tmpfs import mounted_tmpfs

KEY = "bulk"
FIELDS = {
    "image": Field((3, 40, 40), "uint8"),  # 4,800-byte rows: not a multiple of a page
    "label": Field((), "int64"),
    "tokens": Field((None,), "int32"),
    "boxes": Field((None, 4), "float32"),
    "caption": Field((None,), str),
}


def _open(path: Path, fields: dict[str, Field] = FIELDS, **plan: int) -> object:
    made = plan_stream(fields, max_bytes=plan.get("max_bytes"), length=plan.get("length", 200), partitions=1,
                       value_bytes=plan.get("value_bytes", 1024))  # fmt: skip
    cache = open_stream(path, key=KEY, fields=fields, partition=Partition(), plan=lambda: made)
    assert cache is not None
    return cache


def _rows(count: int, seed: int) -> dict[str, list[object] | np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (count, 3, 40, 40), dtype=np.uint8),
        "label": np.arange(count, dtype=np.int64) + seed,
        "tokens": [rng.integers(0, 50_000, int(n), dtype=np.int32) for n in rng.integers(0, 300, count)],
        "boxes": [rng.random((int(n), 4), dtype=np.float32) for n in rng.integers(0, 5, count)],
        "caption": [f"caption {seed}-{r} " + "é" * int(n) for r, n in enumerate(rng.integers(0, 40, count))],
    }


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_run_reads_back_and_verifies_as_if_each_row_were_put(tmp_path: Path, where: str, disk_dir: Path) -> None:
    path = (tmp_path if where == "memory" else disk_dir) / "s.mmc"
    with _open(path) as cache:  # type: ignore[attr-defined]
        first, second = _rows(37, 1), _rows(5, 2)
        assert region(cache).allocate(43) == range(43)  # slots handed out, as a stream's writer takes them
        assert writer_of(cache).put_run(0, first, 37) == 37
        assert writer_of(cache).put_run(37, second, 5) == 5
        assert cache.counts.written == 42
        for start, rows in ((0, first), (37, second)):
            for r in range(len(rows["label"])):
                sample = cache.get(start + r)
                assert sample is not None
                for name, values in rows.items():
                    got = sample[name]
                    if name == "caption":
                        assert got == values[r]
                    else:
                        np.testing.assert_array_equal(got, values[r])
        assert cache.get(42) is None  # the next slot is untouched
        assert cache.verify() == []  # every checksum is the one put() would have written
        with pytest.raises(CacheError, match="not fresh"):
            writer_of(cache).put_run(40, _rows(3, 3), 3)  # 40 and 41 are filled
        assert cache.verify() == []


def test_a_full_variable_region_stores_the_rows_before_the_first_value_that_does_not_fit(tmp_path: Path) -> None:
    fields = {"tokens": Field((None,), "uint8"), "label": Field((), "int64")}
    with _open(tmp_path / "s.mmc", fields, max_bytes=64 * 1024, length=0, value_bytes=100) as cache:  # type: ignore[attr-defined]
        room = cache.variable_region.size
        sizes = [100] * 10 + [room] + [10] * 5  # the 11th cannot fit, the later small ones could
        rows = {"tokens": [np.full(n, k, np.uint8) for k, n in enumerate(sizes)], "label": np.arange(16)}
        region(cache).allocate(16)
        assert writer_of(cache).put_run(0, rows, 16) == 10
        assert [cache.get(k) is not None for k in range(16)] == [True] * 10 + [False] * 6
        assert cache.variable_region.refused == 1  # one store turned away, not one per attempt
        assert cache.verify() == []


def test_bad_rows_are_refused_before_any_slot_changes(tmp_path: Path) -> None:
    with _open(tmp_path / "s.mmc") as cache:  # type: ignore[attr-defined]
        rows = _rows(4, 1)
        rows["boxes"][2] = np.zeros((3, 5), np.float32)  # type: ignore[index]
        with pytest.raises(ValueError, match="boxes"):
            writer_of(cache).put_run(0, rows, 4)
        with pytest.raises(ValueError, match="not in"):
            writer_of(cache).put_run(cache.capacity - 1, _rows(2, 1), 2)
        assert all(cache.get(k) is None for k in range(4))
        region(cache).allocate(4)
        assert writer_of(cache).put_run(0, _rows(4, 1), 4) == 4
        assert cache.verify() == []


def _punch_hole(path: Path, offset: int, size: int) -> None:
    """Give back the blocks of ``[offset, offset + size)`` of a file (``FALLOC_FL_PUNCH_HOLE``): a hole again."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, 0x01 | 0x02, offset, size) != 0:  # KEEP_SIZE | PUNCH_HOLE
            pytest.skip(f"cannot punch a hole here: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def test_a_file_system_without_room_for_the_bytes_stores_nothing_and_the_partition_goes_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks the file no longer has, on a full file system: pwrite says ENOSPC where the mapping would SIGBUS."""
    fields = {"image": Field((64, 64), "uint8"), "label": Field((), "int64")}
    with mounted_tmpfs(tmp_path / "small", "size=2m,mode=0700") as small:
        path = small / "s.mmc"
        with _open(path, fields, length=100) as cache:  # type: ignore[attr-defined]
            writer = PartitionWriter(cache, Partition())
            rows = {"image": np.full((10, 64, 64), 7, np.uint8), "label": np.arange(10)}
            assert writer.offer_many(0, rows, 10) == 10
            image = cache.views["image"]
            start = image[32].ctypes.data - image[0].ctypes.data  # slots 32.. lose their blocks
            _punch_hole(path, cache._live().layout.field_offsets["image"] + start, 64 * 4096)
            filler = small / "filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # the file system fills up
                while True:
                    os.write(fd, bytes(4096))
            except OSError:
                pass
            finally:
                os.close(fd)
            with caplog.at_level(logging.WARNING, logger="mmapcache"):
                stored = writer.offer_many(10, {"image": np.full((40, 64, 64), 9, np.uint8), "label": np.arange(40)},
                                           40)  # fmt: skip
            assert stored == 0
            assert "no space left on the file system" in caplog.text
            assert "streamed uncached" in caplog.text  # the partition is full: the rest is streamed
            state = writer.finish(50)
            assert (state.stored, state.full, state.ended) == (10, True, True)
            assert all(cache.get(k) is not None for k in range(10))  # what was cached stays
            assert cache.verify() == []
            filler.unlink()


def test_a_field_of_no_bytes_is_stored_and_read_back(tmp_path: Path) -> None:
    fields = {"empty": Field((0,), "float32"), "label": Field((), "int64")}
    with _open(tmp_path / "s.mmc", fields, length=10) as cache:  # type: ignore[attr-defined]
        region(cache).allocate(3)
        assert writer_of(cache).put_run(0, {"empty": np.zeros((3, 0), np.float32), "label": np.arange(3)}, 3) == 3
        sample = cache.get(2)
        assert sample is not None
        assert sample["empty"].shape == (0,)
        assert int(sample["label"]) == 2
        assert cache.verify() == []


def _with_empty(count: int, empty: set[int]) -> dict[str, list[object] | np.ndarray]:
    """Rows of the variable fields only, row ``r`` empty (no tokens, ``""``) when ``r in empty``."""
    return {
        "tokens": [np.arange(0 if r in empty else r % 9 + 1, dtype=np.int32) + r for r in range(count)],
        "caption": ["" if r in empty else f"row {r} " + "é" * (r % 4) for r in range(count)],
        "label": np.arange(count, dtype=np.int64),
    }


@pytest.mark.parametrize("empty", [{0}, {0, 1, 2}, {0, 5}, {3}, set(range(6))], ids=str)
def test_a_batch_starting_with_empty_values_does_not_overwrite_earlier_rows(tmp_path: Path, empty: set[int]) -> None:
    fields = {"tokens": Field((None,), "int32"), "caption": Field((None,), str), "label": Field((), "int64")}
    with _open(tmp_path / "s.mmc", fields, length=40) as cache:  # type: ignore[attr-defined]
        region(cache).allocate(12)
        first, second = _with_empty(6, set()), _with_empty(6, empty)
        assert writer_of(cache).put_run(0, first, 6) == 6
        assert writer_of(cache).put_run(6, second, 6) == 6
        for start, rows in ((0, first), (6, second)):
            for r in range(6):
                sample = cache.get(start + r)
                assert sample is not None, start + r
                np.testing.assert_array_equal(sample["tokens"], rows["tokens"][r])  # type: ignore[arg-type]
                assert sample["caption"] == rows["caption"][r]
        assert cache.verify() == []
