"""`Jagged`: the batch a variable-shape field reads as, and the one-gather read that fills it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapcache
from mmapcache import Cache, Field, Jagged
from mmapcache._region.gathers import LARGE_RUNS, gather_runs

SETTINGS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tokens(i: int, length: int) -> np.ndarray[Any, Any]:
    return (np.arange(length, dtype=np.int64) * 7 + i).astype(np.uint16)


# -- the gather -------------------------------------------------------------------------


@st.composite
def runs(draw: st.DrawFn) -> tuple[np.ndarray[Any, Any], list[tuple[int, int]]]:
    """A region of random bytes and runs in it: many shorter than a chunk, some at the very end."""
    size = draw(st.integers(1, 6000))
    region = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), np.uint8).copy()
    count = draw(st.integers(0, 40))
    chosen = []
    for _ in range(count):
        length = draw(st.one_of(st.integers(0, 40), st.integers(0, min(size, 3000))))
        length = min(length, size)
        start = draw(st.one_of(st.just(size - length), st.integers(0, size - length)))
        chosen.append((start, length))
    return region, chosen


@SETTINGS
@given(case=runs())
def test_gather_runs_matches_one_copy_per_run(case: tuple[np.ndarray[Any, Any], list[tuple[int, int]]]) -> None:
    region, chosen = case
    starts = np.array([s for s, _ in chosen], np.int64)
    bounds = np.zeros(len(chosen) + 1, np.int64)
    np.cumsum([n for _, n in chosen], out=bounds[1:])
    want = b"".join(region[s : s + n].tobytes() for s, n in chosen)
    got = gather_runs(region, starts, bounds)
    assert got[: len(want)].tobytes() == want


def test_gather_runs_of_large_rows_is_exact() -> None:
    region = np.random.default_rng(0).integers(0, 256, 10 * LARGE_RUNS, dtype=np.uint8)
    chosen = [(5 * LARGE_RUNS, 2 * LARGE_RUNS), (3, LARGE_RUNS + 5), (8 * LARGE_RUNS, 2 * LARGE_RUNS)]
    bounds = np.zeros(4, np.int64)
    np.cumsum([n for _, n in chosen], out=bounds[1:])
    got = gather_runs(region, np.array([s for s, _ in chosen], np.int64), bounds)
    assert got.tobytes() == b"".join(region[s : s + n].tobytes() for s, n in chosen)


# -- Jagged as a sequence ---------------------------------------------------------------


def test_a_jagged_batch_behaves_as_the_list_of_rows_it_holds() -> None:
    rows = [np.arange(3), np.arange(0), np.arange(5) + 10]
    batch = Jagged.from_arrays(rows)
    assert len(batch) == 3
    assert batch == rows
    assert batch != rows[:2]
    assert batch != [np.arange(3), np.arange(1), np.arange(5) + 10]
    np.testing.assert_array_equal(batch[-1], rows[2])
    np.testing.assert_array_equal(batch[0], rows[0])
    assert [r.tolist() for r in batch] == [r.tolist() for r in rows]
    assert [r.tolist() for r in batch[1:]] == [[], list(range(10, 15))]
    with pytest.raises(IndexError, match="row 3 is out of range"):
        batch[3]
    with pytest.raises(IndexError):
        batch[-4]
    with pytest.raises(TypeError, match="integers or slices"):
        batch["0"]  # type: ignore[call-overload]
    assert batch.values.tolist() == [0, 1, 2, 10, 11, 12, 13, 14]
    assert batch.offsets.tolist() == [0, 3, 3, 8]
    assert batch.offsets.dtype == np.int64
    assert batch.lengths.tolist() == [3, 0, 5]
    assert batch.cu_seqlens.dtype == np.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert (batch.min_length, batch.max_length) == (0, 5)
    assert batch.shapes.tolist() == [[3], [0], [5]]
    assert "3 rows" in repr(batch)


def test_a_jagged_batch_cannot_be_changed_as_a_sequence_and_its_offsets_are_read_only() -> None:
    batch = Jagged.from_arrays([np.arange(3), np.arange(2)])
    with pytest.raises(TypeError):
        batch[0] = np.arange(3)  # type: ignore[index]
    for array in (batch.offsets, batch.lengths, batch.cu_seqlens, batch.shapes, batch.present):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1
    assert batch.values.flags.writeable  # a fresh copy, the caller's to change
    with pytest.raises(TypeError):
        hash(batch)


def test_jagged_checks_what_it_is_built_from() -> None:
    with pytest.raises(ValueError, match="start at 0"):
        Jagged(np.arange(4), np.array([1, 4]))
    with pytest.raises(ValueError, match="end at len"):
        Jagged(np.arange(4), np.array([0, 3]))
    with pytest.raises(ValueError, match="never decrease"):
        Jagged(np.arange(4), np.array([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="length 0"):
        Jagged(np.arange(4), np.array([0, 4]), present=np.array([False]))
    with pytest.raises(ValueError, match=r"end in"):
        Jagged.from_arrays([np.zeros((2, 3)), np.zeros((2, 4))], tail=(3,))


def test_rows_with_a_fixed_tail_stack_their_units_in_values() -> None:
    rows = [np.ones((2, 4), np.float32), np.zeros((0, 4), np.float32), np.full((3, 4), 2, np.float32)]
    batch = Jagged.from_arrays(rows)
    assert batch.values.shape == (5, 4)
    assert batch.tail == (4,)
    assert batch.lengths.tolist() == [2, 0, 3]
    assert batch.shapes.tolist() == [[2, 4], [0, 4], [3, 4]]
    assert batch == rows
    padded, lengths = batch.to_padded(pad_value=-1)
    assert padded.shape == (3, 3, 4)
    assert padded.dtype == np.float32
    assert lengths.tolist() == [[2, 4], [0, 4], [3, 4]]  # as mmapcache.torch.Padded: full shapes
    np.testing.assert_array_equal(padded[0, :2], rows[0])
    assert (padded[0, 2:] == -1).all()
    assert (padded[1] == -1).all()


def test_rows_with_several_variable_dimensions_keep_their_shapes() -> None:
    rows = [np.arange(6, dtype=np.uint8).reshape(3, 1, 2), np.arange(12, dtype=np.uint8).reshape(3, 2, 2)]
    assert Jagged.from_arrays(rows).tail == (2,)  # inferred: the dimensions after the last that differs
    batch = Jagged.from_arrays(rows, tail=())  # as a Field((3, None, None), "uint8") reads
    assert batch.values.shape == (18,)
    assert batch.tail == ()
    assert batch.shapes.tolist() == [[3, 1, 2], [3, 2, 2]]
    assert batch[1].shape == (3, 2, 2)
    assert batch == rows
    padded, shapes = batch.to_padded()
    assert padded.shape == (2, 3, 2, 2)
    np.testing.assert_array_equal(padded[0, :, :1, :], rows[0])
    assert (padded[0, :, 1:, :] == 0).all()
    assert shapes.tolist() == [[3, 1, 2], [3, 2, 2]]


def test_to_padded_of_tokens_gives_the_padded_array_and_lengths() -> None:
    batch = Jagged.from_arrays([np.array([1, 2, 3], np.uint16), np.array([4], np.uint16)])
    padded, lengths = batch.to_padded()
    assert padded.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert padded.dtype == np.uint16
    assert lengths.tolist() == [3, 1]
    empty, lengths = Jagged.from_arrays([], dtype=np.uint16).to_padded()
    assert empty.shape == (0, 0)
    assert lengths.shape == (0,)


def test_missing_rows_are_none_with_length_zero() -> None:
    batch = Jagged.from_arrays([np.arange(2), None, np.arange(1)])
    assert batch[1] is None
    assert list(batch)[1] is None
    assert batch.present.tolist() == [True, False, True]
    assert batch.lengths.tolist() == [2, 0, 1]
    assert batch == [np.arange(2), None, np.arange(1)]
    assert batch != [np.arange(2), np.arange(0), np.arange(1)]


def test_a_jagged_batch_pickles_as_its_arrays() -> None:
    batch = Jagged.from_arrays([np.arange(3), None, np.arange(2)])
    again = pickle.loads(pickle.dumps(batch))
    assert again == batch
    assert again.present.tolist() == [True, False, True]


# -- what the cache returns -------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((None,), "uint16"), ((None,), "int32"), ((None, 4), "float32"), ((3, None, None), "uint8"), ((None, 2), "<f8")],
)
def test_get_many_gathers_a_variable_field_into_one_jagged_batch(tmp_path: Path, shape: Any, dtype: str) -> None:
    rng = np.random.default_rng(0)
    n = 300
    samples = []
    for _ in range(n):
        dims = tuple(int(rng.integers(0, 60)) if d is None else d for d in shape)
        samples.append(rng.integers(0, 250, dims).astype(dtype))
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"x": Field(shape, dtype)}, n, max_bytes="8MiB") as cache:
        assert cache.put_many(range(n), {"x": samples}).all()
        for size in (0, 1, 7, 256):
            idx = rng.integers(0, n, size)
            batch = cache.get_many(idx)["x"]
            assert isinstance(batch, Jagged)
            assert batch.dtype == np.dtype(dtype)
            assert batch == [samples[i] for i in idx]
            assert [row.shape for row in batch] == [samples[i].shape for i in idx]
            assert batch.offsets[0] == 0
            assert len(batch.offsets) == size + 1
            assert batch.values.flags.c_contiguous
    mmapcache.remove(path)


def test_read_many_marks_misses_missing_in_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None,), "uint16"), "n": Field((), "int64")}, 20, max_bytes="1MiB") as cache:
        cache.put_many([1, 3, 4], {"t": [tokens(i, i * 3) for i in (1, 3, 4)], "n": [1, 3, 4]})
        arrays, hits = cache.read_many([4, 0, 3, 19, 1])
        assert hits.tolist() == [True, False, True, False, True]
        batch = arrays["t"]
        assert isinstance(batch, Jagged)
        assert batch == [tokens(4, 12), None, tokens(3, 9), None, tokens(1, 3)]
        assert batch.lengths.tolist() == [12, 0, 9, 0, 3]
        assert batch.present.tolist() == hits.tolist()
        nothing, hits = cache.read_many([0, 2])
        assert not hits.any()
        assert nothing["t"] == [None, None]
        empty = cache.get_many([])["t"]
        assert len(empty) == 0
        assert empty.values.shape == (0,)
        assert empty.offsets.tolist() == [0]
    mmapcache.remove(path)


def test_text_fields_stay_lists_of_str(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"s": Field((None,), str)}, 4, max_bytes="1MiB") as cache:
        cache.put_many([0, 1], {"s": ["héllo", ""]})
        assert cache.get_many([1, 0])["s"] == ["", "héllo"]
        assert cache.read_many([0, 2])[0]["s"] == ["héllo", None]
    mmapcache.remove(path)


def test_rows_at_the_very_end_of_the_variable_region_read_exactly(tmp_path: Path) -> None:
    """A region filled to its last byte: rows there read past no byte of the file."""
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None,), "uint8")}, 400, max_bytes=400 * 16 + 8192) as cache:
        region = cache.variable_region
        assert region is not None
        stored = [i for i in range(400) if cache.put(i, {"t": np.full(i % 37 + 1, i % 251, np.uint8)})]
        assert len(stored) < 400  # the region is full
        region = cache.variable_region
        assert region is not None
        assert region.size - region.claimed < 64
        batch = cache.get_many(stored[::-1])["t"]
        assert batch == [np.full(i % 37 + 1, i % 251, np.uint8) for i in stored[::-1]]
    mmapcache.remove(path)


def test_a_damaged_descriptor_makes_its_row_missing_in_read_many(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None, 2), "int32")}, 3, max_bytes="1MiB") as cache:
        cache.put_many([0, 1, 2], {"t": [np.ones((k + 1, 2), np.int32) * k for k in range(3)]})
        column = cache._live().variables[0]
        column.dims[1, 1] = 3  # the fixed dimension no longer matches the field
        arrays, hits = cache.read_many([0, 1, 2])
        assert hits.tolist() == [True, False, True]
        assert arrays["t"] == [np.zeros((1, 2), np.int32), None, np.full((3, 2), 2, np.int32)]
    mmapcache.remove(path)
