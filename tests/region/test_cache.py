"""Cache: open-or-create, reads, writes, index rules, pickling, other processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmapcache
from mmapcache import Cache, CacheMissError, Field, Jagged, ReadonlyCacheError, SchemaMismatchError

FIELDS = {"image": Field((3, 8, 8), "uint8"), "label": Field((), "int64")}


def sample(i: int) -> dict[str, Any]:
    return {"image": np.full((3, 8, 8), i % 251, np.uint8), "label": i * 10}


def assert_sample(got: dict[str, np.ndarray], i: int) -> None:
    want = sample(i)
    assert set(got) == set(FIELDS)
    np.testing.assert_array_equal(got["image"], want["image"])
    assert got["image"].dtype == np.uint8
    assert got["label"].shape == ()
    assert got["label"].dtype == np.int64
    assert int(got["label"]) == want["label"]


@pytest.fixture
def cache(cache_dir: Path) -> Any:
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=100, key="test/v1") as c:
        yield c


# -- open or create ---------------------------------------------------------------


def test_create_then_reopen_sees_the_data(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=10, key="k") as cache:
        assert cache.put(3, sample(3))
        assert cache.path == path
        assert cache.fields == FIELDS
        assert (cache.length, cache.capacity, cache.key, len(cache)) == (10, 10, "k", 10)
        assert cache.nbytes == path.stat().st_size
    with Cache.open(path) as again:
        assert again.fields == FIELDS
        assert again.key == "k"
        assert_sample(again[3], 3)


def test_fields_may_be_shape_dtype_pairs(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", {"x": ((2,), "float32")}, length=4) as cache:
        assert cache.fields == {"x": Field((2,), np.float32)}


def test_missing_file_without_schema_is_file_not_found(cache_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pass fields= and length="):
        Cache.open(cache_dir / "absent.mmc")
    with pytest.raises(FileNotFoundError):
        Cache.open(cache_dir / "absent.mmc", FIELDS)  # no length
    with pytest.raises(FileNotFoundError, match="readonly"):
        Cache.open(cache_dir / "absent.mmc", FIELDS, length=3, readonly=True)
    assert not (cache_dir / "absent.mmc").exists()


def test_schema_mismatch_names_every_difference(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, FIELDS, length=10, key="a").close()
    before = path.read_bytes()
    other = {"image": Field((3, 8, 8), "float32"), "extra": Field((), "int8")}
    with pytest.raises(SchemaMismatchError) as info:
        Cache.open(path, other, length=11, key="b")
    message = str(info.value)
    for part in ("'image'", "float32", "'extra'", "'label'", "length: expected 11, found 10", "key: expected 'b'"):
        assert part in message
    assert "mmapcache rm" in message
    assert set(info.value.differences) == {"fields", "length", "key"}
    assert path.read_bytes() == before  # a failed open never modifies the file


@pytest.mark.parametrize("kwargs", [{"length": 10}, {"key": "a"}, {"fields": FIELDS}])
def test_partial_expectations_that_match_open_the_file(cache_dir: Path, kwargs: dict[str, Any]) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, FIELDS, length=10, key="a").close()
    with Cache.open(path, **kwargs) as cache:
        assert cache.length == 10


def test_field_order_does_not_matter_for_matching(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, FIELDS, length=5).close()
    reordered = {"label": FIELDS["label"], "image": FIELDS["image"]}
    with Cache.open(path, reordered, length=5) as cache:
        assert list(cache.fields) == ["image", "label"]


def test_bad_open_arguments(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with pytest.raises(ValueError, match="not both"):
        Cache.open(path, FIELDS, length=10, capacity=5, max_bytes=1000)
    with pytest.raises(ValueError, match="negative"):
        Cache.open(path, FIELDS, length=-1)
    with pytest.raises(TypeError, match="length must be an int"):
        Cache.open(path, FIELDS, length=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key must be a string"):
        Cache.open(path, FIELDS, length=10, key=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too small for one slot"):
        Cache.open(path, FIELDS, length=10, max_bytes=100)
    with pytest.raises(ValueError, match="byte size"):
        Cache.open(path, FIELDS, length=10, max_bytes="lots")
    with pytest.raises(ValueError, match="at least one field"):
        Cache.open(path, {}, length=10)
    assert not path.exists()


def test_sizes_beyond_the_format_raise_value_error_naming_the_argument(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with pytest.raises(ValueError, match=r"length must be below 2\*\*64"):
        Cache.open(path, FIELDS, length=2**64, capacity=1)
    with pytest.raises(ValueError, match="capacity must be below"):
        Cache.open(path, FIELDS, length=10, capacity=2**64)
    with pytest.raises(ValueError, match="more than a file can hold"):
        Cache.open(path, FIELDS, length=2**62)
    with pytest.raises(ValueError, match=r"max_bytes gives .* more than a file can hold"):
        Cache.open(path, FIELDS, length=2**62, max_bytes="1" * 400)
    with pytest.raises(ValueError, match="max_bytes 'x1'"):
        Cache.open(path, FIELDS, length=10, max_bytes="x1")
    with pytest.raises(ValueError, match=r"spans \d+ bytes, more than an array"):
        Cache.open(path, {"x": Field((2**40, 2**40), "u1")}, length=0)
    assert not path.exists()
    # A budget beyond any disk is no error: it just does not limit the capacity.
    with Cache.open(path, FIELDS, length=10, max_bytes="1" * 400) as cache:
        assert cache.capacity == 10


def test_a_length_near_2_to_the_64_keeps_indices_exact(cache_dir: Path) -> None:
    # Before the fix, put_many([2**64 - 3]) wrapped to slot -3 and overwrote slot 7.
    huge = 2**64 - 1
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=huge, capacity=10) as cache:
        assert cache.put(7, sample(7))
        far = np.array([2**64 - 3, 2**63, 2**63 - 1], np.uint64)
        image = np.full((3, 3, 8, 8), 99, np.uint8)
        assert cache.put_many(far, {"image": image, "label": [1, 2, 3]}).tolist() == [False] * 3
        assert cache.put_many([2**64 - 3], {"image": image[:1], "label": [1]}).tolist() == [False]
        assert_sample(cache[7], 7)
        assert cache.filled == 1
        assert cache.contains_many(far).tolist() == [False] * 3
        with pytest.raises(KeyError, match=str(2**64 - 3)) as missing:
            cache.get_many(far)
        assert missing.value.missing.tolist() == far.tolist()  # type: ignore[attr-defined]
        assert cache.get(2**64 - 3) is None
        assert (2**64 - 3) not in cache
        with pytest.raises(IndexError, match="out of range"):
            cache.contains_many(np.array([2**64 - 1], np.uint64))


# -- capacity -----------------------------------------------------------------------


def test_capacity_limits_cacheable_indices(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=10, capacity=4) as cache:
        assert cache.capacity == 4
        assert [cache.put(i, sample(i)) for i in range(10)] == [True] * 4 + [False] * 6
        assert cache.filled == 4
        assert cache.get(7) is None
        assert 7 not in cache
        assert cache.contains_many(range(10)).tolist() == [True] * 4 + [False] * 6
        with pytest.raises(KeyError):
            cache.get_many([0, 5])
        assert (
            cache.put_many([2, 3, 4, 9], {"image": np.zeros((4, 3, 8, 8), np.uint8), "label": [0] * 4}).tolist()
            == [False] * 4
        )


def test_max_bytes_budgets_data_and_slot_records(cache_dir: Path) -> None:
    per_slot = 3 * 8 * 8 + 8 + 8  # image + label + slot record
    with Cache.open(cache_dir / "a.mmc", FIELDS, length=1000, max_bytes=per_slot * 7 + per_slot - 1) as cache:
        assert cache.capacity == 7
    with Cache.open(cache_dir / "b.mmc", FIELDS, length=1000, max_bytes="10KiB") as cache:
        assert cache.capacity == 10 * 1024 // per_slot
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=5, max_bytes="1GiB") as cache:
        assert cache.capacity == 5  # never more than length


def test_capacity_beyond_length_is_clamped(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=5, capacity=50) as cache:
        assert cache.capacity == 5


def test_zero_length_cache(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=0) as cache:
        assert len(cache) == 0
        assert cache.filled == 0
        with pytest.raises(IndexError):
            cache.get(0)
        assert cache.get_many([])["image"].shape == (0, 3, 8, 8)


# -- reads and writes ------------------------------------------------------------


def test_put_get_round_trip(cache: Cache) -> None:
    assert cache.get(5) is None
    assert cache.get(5, "nope") == "nope"
    assert 5 not in cache
    with pytest.raises(KeyError):
        cache[5]
    assert cache.put(5, sample(5)) is True
    assert 5 in cache
    assert_sample(cache.get(5), 5)
    assert_sample(cache[5], 5)
    assert cache.filled == 1


def test_first_writer_wins(cache: Cache) -> None:
    assert cache.put(1, sample(1))
    assert cache.put(1, sample(2)) is False
    assert_sample(cache[1], 1)


def test_get_returns_fresh_copies(cache: Cache) -> None:
    cache.put(0, sample(0))
    got = cache[0]
    got["image"][:] = 99
    got["label"][...] = -1
    assert_sample(cache[0], 0)
    assert got["image"].flags.writeable


def test_get_many_stacks_in_order(cache: Cache) -> None:
    order = [7, 3, 7, 0, 99]
    for i in set(order):
        cache.put(i, sample(i))
    batch = cache.get_many(order)
    assert batch["image"].shape == (5, 3, 8, 8)
    assert batch["label"].shape == (5,)
    for row, i in enumerate(order):
        assert_sample({name: batch[name][row] for name in batch}, i)
    assert cache.get_many(np.array(order, dtype=np.uint16))["label"].tolist() == [i * 10 for i in order]


def test_get_many_into_caller_buffers(cache: Cache) -> None:
    cache.put_many([4, 5, 6], {"image": np.stack([sample(i)["image"] for i in (4, 5, 6)]), "label": [40, 50, 60]})
    out: dict[str, np.ndarray[Any, Any]] = {"image": np.zeros((2, 3, 8, 8), np.uint8), "label": np.zeros(2, np.int64)}
    image = out["image"]
    assert cache.get_many([6, 4], out=out) is out
    assert out["image"] is image, "written in place, nothing allocated"
    assert_sample({"image": out["image"][0], "label": out["label"][0]}, 6)
    assert_sample({"image": out["image"][1], "label": out["label"][1]}, 4)
    out["label"][:] = -1
    with pytest.raises(KeyError) as missing:
        cache.get_many([4, 7], out=out)
    assert missing.value.missing.tolist() == [7]  # type: ignore[attr-defined]
    assert out["label"].tolist() == [-1, -1], "a miss leaves the buffers untouched"


def test_read_many_reports_hits_and_misses_without_raising(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=20, capacity=10) as cache:
        cache.put_many([2, 3], {"image": np.stack([sample(2)["image"], sample(3)["image"]]), "label": [20, 30]})
        arrays, hits = cache.read_many([3, 7, 2, 15])
        assert hits.tolist() == [True, False, True, False]
        assert arrays["label"][hits].tolist() == [30, 20]
        assert arrays["image"].shape == (4, 3, 8, 8)
        out: dict[str, np.ndarray[Any, Any]] = {
            "image": np.full((2, 3, 8, 8), 9, np.uint8),
            "label": np.full(2, -1, np.int64),
        }
        arrays, hits = cache.read_many([5, 2], out=out)
        assert arrays is out
        assert hits.tolist() == [False, True]
        assert out["label"].tolist() == [-1, 20], "a miss's row is left as it was"
        arrays, hits = cache.read_many([2, 3], out=out)
        assert hits.all()
        assert out["label"].tolist() == [20, 30]
        usage = cache.usage().processes[os.getpid()]
        assert (usage.hits, usage.misses) == (5, 3)


def test_read_many_with_verify_treats_a_damaged_row_as_a_miss(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=10) as writer:
        for i in range(4):
            writer.put(i, sample(i))
        _corrupt_slot(writer, 2)
    with Cache.open(path, verify=True) as cache:
        _, hits = cache.read_many([1, 2, 3])
        assert hits.tolist() == [True, False, True]
        with pytest.raises(mmapcache.CacheMissError, match="failed their checksum") as info:
            cache.get_many([2, 3])
        assert info.value.missing.tolist() == [2]
        assert isinstance(info.value, KeyError)


@pytest.mark.parametrize(
    ("out", "words"),
    [
        ({"image": np.zeros((2, 3, 8, 8), np.uint8)}, "every fixed-shape field"),
        ([np.zeros(2)], "every fixed-shape field"),
        ({"image": np.zeros((3, 3, 8, 8), np.uint8), "label": np.zeros(2, np.int64)}, r"shape \(2, 3, 8, 8\)"),
        ({"image": np.zeros((2, 3, 8, 8), np.int16), "label": np.zeros(2, np.int64)}, "dtype uint8"),
        ({"image": np.zeros((2, 3, 8, 8), np.uint8), "label": np.zeros(4, np.int64)[::2]}, "C-contiguous"),
        ({"image": np.zeros((2, 3, 8, 8), np.uint8), "label": [0, 0]}, "numpy array"),
    ],
)
def test_get_many_refuses_wrong_buffers(cache: Cache, out: Any, words: str) -> None:
    cache.put(4, sample(4))
    with pytest.raises(ValueError, match=words):
        cache.get_many([4, 4], out=out)


def test_get_many_reports_missing_indices(cache: Cache) -> None:
    cache.put(1, sample(1))
    with pytest.raises(KeyError, match="2 of 3 indices are not cached") as info:
        cache.get_many([1, 2, 3])
    assert info.value.missing.tolist() == [2, 3]  # type: ignore[attr-defined]


def test_get_many_output_is_writable_and_independent(cache: Cache) -> None:
    for i in range(40):
        cache.put(i, sample(i))
    batch = cache.get_many(list(range(40)))
    batch["image"][:] = 0
    assert_sample(cache[39], 39)


def test_put_many_and_contains_many(cache: Cache) -> None:
    idx = [4, 5, 4, 6]
    batch = {"image": np.stack([sample(i)["image"] for i in idx]), "label": np.array([i * 10 for i in idx])}
    assert cache.put_many(idx, batch).tolist() == [True, True, False, True]
    assert cache.contains_many([3, 4, 5, 6, 7]).tolist() == [False, True, True, True, False]
    for i in (4, 5, 6):
        assert_sample(cache[i], i)
    # an all-filled batch is not even validated: it costs a state read
    assert cache.put_many([4, 5], {"image": "garbage", "label": None}).tolist() == [False, False]


def test_put_many_validates_batch_shape(cache: Cache) -> None:
    with pytest.raises(ValueError, match=r"field 'image': expected a batch of shape \(2, 3, 8, 8\)"):
        cache.put_many([0, 1], {"image": np.zeros((3, 3, 8, 8), np.uint8), "label": [1, 2]})
    assert cache.filled == 0


# -- index rules -----------------------------------------------------------------


@pytest.mark.parametrize("index", [-1, 100, 10**20])
def test_out_of_range_indices(cache: Cache, index: int) -> None:
    for call in (cache.get, cache.__getitem__, cache.__contains__, lambda i: cache.put(i, sample(0))):
        with pytest.raises(IndexError, match="out of range"):
            call(index)
    with pytest.raises(IndexError, match="out of range"):
        cache.get_many([0, index])
    with pytest.raises(IndexError):
        cache.contains_many([index])


@pytest.mark.parametrize("index", [1.0, "1", None, True, np.float64(1), [1]])
def test_non_integer_indices(cache: Cache, index: Any) -> None:
    with pytest.raises(TypeError, match="integers"):
        cache.get(index)
    with pytest.raises(TypeError, match="integers"):
        cache.put(index, sample(0))


def test_numpy_integer_indices(cache: Cache) -> None:
    assert cache.put(np.int64(3), sample(3))
    assert_sample(cache[np.uint8(3)], 3)
    assert np.int32(3) in cache


@pytest.mark.parametrize("indices", [[1.5], np.array([True, False]), ["a"]])
def test_non_integer_index_arrays(cache: Cache, indices: Any) -> None:
    with pytest.raises(TypeError):
        cache.contains_many(indices)


def test_index_arrays_must_be_one_dimensional(cache: Cache) -> None:
    with pytest.raises(ValueError, match="1-D"):
        cache.get_many([[1, 2]])


# -- value checks ------------------------------------------------------------------


def test_wrong_shape_names_field_and_shapes(cache: Cache) -> None:
    with pytest.raises(ValueError, match=r"field 'image'.*\(3, 8, 8\).*\(3, 8, 7\)"):
        cache.put(0, {"image": np.zeros((3, 8, 7), np.uint8), "label": 1})
    assert cache.filled == 0


def test_missing_and_extra_fields(cache: Cache) -> None:
    with pytest.raises(ValueError, match="missing 'label'"):
        cache.put(0, {"image": np.zeros((3, 8, 8), np.uint8)})
    with pytest.raises(ValueError, match="unknown 'extra'"):
        cache.put(0, {**sample(0), "extra": 1})
    with pytest.raises(TypeError, match="mapping"):
        cache.put(0, [1, 2])  # type: ignore[arg-type]


def test_unsafe_dtypes_are_refused(cache: Cache) -> None:
    with pytest.raises(TypeError, match=r"field 'image'.*float64.*uint8"):
        cache.put(0, {"image": np.zeros((3, 8, 8)), "label": 1})
    with pytest.raises(TypeError, match="field 'label'"):
        cache.put(0, {"image": np.zeros((3, 8, 8), np.uint8), "label": 1.5})
    with pytest.raises(ValueError, match="out of range"):
        cache.put(0, {"image": np.full((3, 8, 8), 300).tolist(), "label": 1})  # Python ints
    with pytest.raises(ValueError, match="out of range"):
        cache.put(0, {"image": np.full((3, 8, 8), 300, np.uint16), "label": 1})  # same kind, too big
    with pytest.raises(TypeError, match="int16"):
        cache.put(0, {"image": np.full((3, 8, 8), 1, np.int16), "label": 1})  # signed -> unsigned
    with pytest.raises(ValueError, match="out of range"):
        cache.put(0, {"image": np.zeros((3, 8, 8), np.uint8), "label": 2**63})
    assert cache.filled == 0


def test_safe_casts_are_accepted(cache: Cache) -> None:
    # Python ints that fit, and int8 -> int64, cast cleanly.
    assert cache.put(0, {"image": np.full((3, 8, 8), 255).tolist(), "label": np.int8(-3)})
    got = cache[0]
    assert got["image"].max() == 255
    assert int(got["label"]) == -3


def test_structured_values_are_stored_by_member_name(cache_dir: Path) -> None:
    # Before the fix, numpy's positional cast stored {b=1, a=2} as {a=1, b=2}.
    record = np.dtype([("a", "<i4"), ("b", "<f8")])
    with Cache.open(cache_dir / "c.mmc", {"r": Field((2,), record)}, length=4) as cache:
        swapped = np.array([(1.5, 2), (3.5, 4)], dtype=[("b", "<f4"), ("a", "<i2")])
        assert cache.put(0, {"r": swapped})
        got = cache[0]["r"]
        assert got.dtype == record
        assert got["a"].tolist() == [2, 4]
        assert got["b"].tolist() == [1.5, 3.5]
        with pytest.raises(TypeError, match=r"members \['a', 'c'\]"):
            cache.put(1, {"r": np.zeros(2, dtype=[("a", "<i4"), ("c", "<f8")])})
        with pytest.raises(TypeError, match=r"field 'r\.a'.*float64.*int32"):
            cache.put(1, {"r": np.zeros(2, dtype=[("b", "<f8"), ("a", "<f8")])})
        with pytest.raises(ValueError, match=r"field 'r\.a'.*out of range"):
            cache.put(1, {"r": np.array([(2**40, 0.0)] * 2, dtype=[("a", "<i8"), ("b", "<f8")])})
        assert cache.filled == 1


def test_readonly_handle_reads_but_refuses_writes(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=4) as writer:
        writer.put(0, sample(0))
        with Cache.open(path, readonly=True) as reader:
            assert reader.readonly
            assert_sample(reader[0], 0)
            writer.put(1, sample(1))
            assert_sample(reader[1], 1)  # sees later writes
            with pytest.raises(ReadonlyCacheError, match="readonly"):
                reader.put(2, sample(2))
            with pytest.raises(PermissionError):
                reader.put_many([2], {"image": np.zeros((1, 3, 8, 8), np.uint8), "label": [0]})
            with pytest.raises(ReadonlyCacheError):
                reader.clear()


# -- lifecycle ---------------------------------------------------------------------


def test_closed_cache_raises_value_error(cache_dir: Path) -> None:
    cache = Cache.open(cache_dir / "c.mmc", FIELDS, length=4, capacity=2)
    cache.put(0, sample(0))
    cache.close()
    cache.close()  # idempotent
    assert cache.closed
    for call in (
        lambda: cache.get(0),
        lambda: cache.get(3),
        lambda: cache[0],
        lambda: 0 in cache,
        lambda: cache.put(0, sample(0)),
        lambda: cache.put(3, sample(0)),
        lambda: cache.get_many([0]),
        lambda: cache.contains_many([0]),
        lambda: cache.filled,
        lambda: cache.verify(),
        lambda: cache.clear(),
    ):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert "closed" in repr(cache)


def test_repr_shows_path_fields_and_fill(cache: Cache) -> None:
    cache.put(0, sample(0))
    text = repr(cache)
    assert str(cache.path) in text
    assert "Field((3, 8, 8), 'uint8')" in text
    assert "filled=1/100" in text


def test_not_iterable(cache: Cache) -> None:
    with pytest.raises(TypeError):
        iter(cache)


# -- pickling and other processes ----------------------------------------------------


def test_pickle_is_small_and_reopens(cache_dir: Path) -> None:
    path = cache_dir / "big.mmc"
    with Cache.open(path, {"x": Field((1024, 1024), "uint8")}, length=64) as cache:
        cache.put(9, {"x": np.full((1024, 1024), 9, np.uint8)})
        blob = pickle.dumps(cache)
        assert len(blob) < 1024  # a 64 MiB cache pickles as its path
        with pickle.loads(blob) as copy:
            assert copy.path == path
            assert copy[9]["x"][5, 5] == 9
            copy.put(10, {"x": np.full((1024, 1024), 10, np.uint8)})
            assert cache[10]["x"][0, 0] == 10


def _child_reads_and_writes(path: str, queue: Any) -> None:
    with Cache.open(path) as cache:
        seen = int(cache[3]["label"])
        cache.put(4, sample(4))
    queue.put(seen)


def _child_unpickles(blob: bytes, queue: Any) -> None:
    cache = pickle.loads(blob)
    queue.put((str(cache.path), cache.readonly, int(cache[3]["label"])))
    cache.close()


def test_second_process_by_path_sees_writes_both_ways(cache: Cache) -> None:
    ctx = mp.get_context("spawn")
    cache.put(3, sample(3))
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads_and_writes, args=(str(cache.path), queue))
    child.start()
    assert queue.get(timeout=60) == 30
    child.join(60)
    assert child.exitcode == 0
    assert_sample(cache[4], 4)  # the child's write, visible through our mapping


def test_pickled_handle_reopens_in_a_spawned_process(cache_dir: Path) -> None:
    ctx = mp.get_context("spawn")
    with Cache.open(cache_dir / "c.mmc", FIELDS, length=10) as cache:
        cache.put(3, sample(3))
        with Cache.open(cache.path, readonly=True) as reader:
            queue = ctx.Queue()
            child = ctx.Process(target=_child_unpickles, args=(pickle.dumps(reader), queue))
            child.start()
            assert queue.get(timeout=60) == (str(cache.path), True, 30)
            child.join(60)
            assert child.exitcode == 0


def test_relative_paths_become_absolute(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(cache_dir)
    with Cache.open("rel.mmc", FIELDS, length=3) as cache:
        assert cache.path == cache_dir / "rel.mmc"


def test_remove_deletes_file_and_side_files(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, FIELDS, length=3).close()
    assert (cache_dir / "c.mmc.lock").exists()
    mmapcache.remove(path)
    assert os.listdir(cache_dir) == []
    with pytest.raises(FileNotFoundError):
        mmapcache.remove(path)


# -- checksums and verification ---------------------------------------------------


def _corrupt_slot(cache: Cache, index: int) -> None:
    """Flip one byte of a slot's image through the file itself, as a stray writer or bad RAM would."""
    offset = cache._layout.field_offsets["image"] + index * FIELDS["image"].nbytes + 5
    with open(cache.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verified_reads_treat_a_damaged_slot_as_a_miss(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=10) as writer:
        for i in range(4):
            writer.put(i, sample(i))
        _corrupt_slot(writer, 2)
        with Cache.open(path, verify=True) as checked:
            assert checked.get(2) is None
            assert "slot 2" in caplog.text
            assert "does not match its checksum" in caplog.text
            assert_sample(checked[1], 1)
            with pytest.raises(KeyError, match="1 of 3 indices failed their checksum") as info:
                checked.get_many([0, 2, 3])
            assert info.value.missing.tolist() == [2]  # type: ignore[attr-defined]
            assert checked.get_many([0, 1, 3])["label"].tolist() == [0, 10, 30]
        # without verify=True a read trusts the state byte (the cheap default)
        assert writer.get(2) is not None


def test_verify_finds_and_fixes_damaged_and_abandoned_slots(cache_dir: Path) -> None:
    import signal

    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=10) as cache:
        for i in range(5):
            cache.put(i, sample(i))
        assert cache.verify() == []
        _corrupt_slot(cache, 3)
        pid = os.fork()
        if pid == 0:  # a writer that dies holding slot 7 mid-write
            cache._mapped.slots.claim(7)  # type: ignore[union-attr]
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(pid, 0)
        problems = cache.verify()
        assert sorted((p.kind, p.index) for p in problems) == [("checksum", 3), ("stuck", 7)]
        assert all(not p.fixed for p in problems)
        assert cache.get(7) is None  # WRITING is never data
        fixed = cache.verify(fix=True)
        assert all(p.fixed for p in fixed)
        assert "fixed" in str(fixed[0])
        assert cache.verify() == []
        assert 3 not in cache
        assert cache.put(3, sample(3))
        assert cache.put(7, sample(7))
        assert_sample(cache[3], 3)
        assert cache.filled == 6


# -- variable-shape fields ------------------------------------------------------------------

RAGGED = {"tokens": Field((None,), "int32"), "label": Field((), "int64"), "boxes": Field((None, 4), "float32")}


def ragged(i: int) -> dict[str, Any]:
    return {
        "tokens": np.arange(i % 7 * 3, dtype=np.int32) + i,
        "label": i,
        "boxes": np.full((i % 3, 4), i / 2, np.float32),
    }


def assert_ragged(got: dict[str, Any], i: int) -> None:
    want = ragged(i)
    assert set(got) == set(RAGGED)
    for name in ("tokens", "boxes"):
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])
    assert int(got["label"]) == i


def test_variable_fields_round_trip(cache_dir: Path) -> None:
    path = cache_dir / "r.mmc"
    with Cache.open(path, RAGGED, length=50, max_bytes="1MiB") as cache:
        assert all(cache.put(i, ragged(i)) for i in range(0, 50, 2))
        assert cache.put_many([1, 3, 5], {name: [ragged(i)[name] for i in (1, 3, 5)] for name in RAGGED}).all()
        assert_ragged(cache[4], 4)
        batch = cache.get_many([3, 8, 0])
        assert isinstance(batch["tokens"], Jagged)
        assert batch["tokens"].lengths.tolist() == [len(ragged(i)["tokens"]) for i in (3, 8, 0)]
        assert batch["label"].tolist() == [3, 8, 0]
        for row, i in enumerate([3, 8, 0]):
            assert_ragged({name: batch[name][row] for name in RAGGED}, i)
        arrays, hits = cache.read_many([2, 7, 5])
        assert hits.tolist() == [True, False, True]
        assert arrays["tokens"][1] is None
        assert_ragged({name: arrays[name][2] for name in RAGGED}, 5)
        out = {"label": np.zeros(2, np.int64)}
        assert cache.get_many([2, 4], out=out)["label"] is out["label"]
        region = cache.variable_region
        assert region is not None
        assert region.used == sum(
            ragged(i)["tokens"].nbytes + ragged(i)["boxes"].nbytes for i in [*range(0, 50, 2), 1, 3, 5]
        )
        assert region.used <= region.claimed <= region.size
        assert cache.verify() == []
    with Cache.open(path, verify=True) as again:  # another handle, checksums checked
        assert again.fields == RAGGED
        assert_ragged(again[3], 3)
        assert_ragged({name: again.get_many([48])[name][0] for name in RAGGED}, 48)


def test_variable_values_are_checked_like_fixed_ones(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="1MiB") as cache:
        with pytest.raises(ValueError, match=r"field 'boxes'.*\(\*, 4\).*\(2, 3\)"):
            cache.put(0, {**ragged(0), "boxes": np.zeros((2, 3), np.float32)})
        with pytest.raises(ValueError, match=r"field 'tokens'.*\(\*,\)"):
            cache.put(0, {**ragged(0), "tokens": np.zeros((2, 2), np.int32)})
        with pytest.raises(TypeError, match="field 'tokens'"):
            cache.put(0, {**ragged(0), "tokens": np.zeros(3)})  # float64 into int32
        with pytest.raises(TypeError, match="one per row"):
            cache.put_many([0], {"tokens": 5, "label": [0], "boxes": [np.zeros((0, 4))]})
        with pytest.raises(ValueError, match="expected 1 values"):
            cache.put_many([0], {"tokens": np.zeros(3, np.int32), "label": [0], "boxes": [np.zeros((0, 4))]})
        with pytest.raises(ValueError, match="expected 1 values"):
            cache.put_many([0], {"tokens": [], "label": [0], "boxes": [np.zeros((0, 4))]})
        assert cache.filled == 0
        region = cache.variable_region
        assert region is not None
        assert region.claimed == 0, "a refused value takes no space"


def test_variable_fields_need_a_budget(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="pass max_bytes="):
        Cache.open(cache_dir / "r.mmc", RAGGED, length=10)
    with pytest.raises(ValueError, match="leaves no room for the values"):
        Cache.open(cache_dir / "r.mmc", RAGGED, length=10_000, max_bytes="64KiB")
    assert not (cache_dir / "r.mmc").exists()
    # An existing file opens (and its schema is checked) without a budget: only creating needs one.
    Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="1MiB").close()
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=10) as again:
        assert again.fields == RAGGED
    # Malformed arguments are refused all the same.
    with pytest.raises(ValueError, match="capacity must not be negative"):
        Cache.open(cache_dir / "r.mmc", RAGGED, length=10, capacity=-1)
    with pytest.raises(ValueError, match="max_bytes 'lots'"):
        Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="lots")
    mmapcache.remove(cache_dir / "r.mmc")
    # capacity and max_bytes together: slots, and room for their values.
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=100, capacity=10, max_bytes="1MiB") as cache:
        assert cache.capacity == 10


def test_a_full_variable_region_leaves_samples_uncached(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    big = {"x": Field((None,), "uint8")}
    with Cache.open(cache_dir / "r.mmc", big, length=100, max_bytes=2 * 4096 + 100 * 24) as cache:
        region = cache.variable_region
        assert region is not None
        stored = [cache.put(i, {"x": np.full(1000, i, np.uint8)}) for i in range(20)]
        assert stored[0], "some fit"
        assert not all(stored), "the rest stay misses"
        assert stored == sorted(stored, reverse=True)
        assert caplog.text.count("is full") == 1, "one warning per process"
        assert cache.put_many([30, 31], {"x": [np.zeros(10, np.uint8)] * 2}).tolist() in ([True, True], [False, False])
        assert cache.put(40, {"x": np.zeros(0, np.uint8)}), "an empty value needs no room"
        for i in [i for i, ok in enumerate(stored) if ok]:
            assert cache[i]["x"].tolist() == [i] * 1000
        assert cache.verify() == []


def test_verify_finds_damaged_variable_descriptors(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="1MiB") as cache:
        for i in range(1, 6):
            cache.put(i, ragged(i))
        tokens = cache._mapped.variables[0]  # type: ignore[union-attr]
        tokens.dims[2] = [10**9]  # a shape that cannot be in the file
        tokens.offsets[4] = tokens.offsets[3]  # two slots claiming the same bytes
        problems = {(p.kind, p.index) for p in cache.verify()}
        assert ("variable", 2) in problems
        assert ("checksum", 4) in problems
        assert cache.get(2) is None, "an impossible descriptor is a miss, never an exception"
        fixed = cache.verify(fix=True)
        assert all(p.fixed for p in fixed)
        assert cache.verify() == []
        assert cache.put(2, ragged(2))
        assert_ragged(cache[2], 2)


def test_clear_empties_the_variable_region(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="1MiB") as cache:
        cache.put(1, ragged(1))
        cache.clear()
        region = cache.variable_region
        assert region is not None
        assert (region.claimed, region.used, cache.filled) == (0, 0, 0)
        assert cache.put(1, ragged(1))
        assert_ragged(cache[1], 1)


def test_a_forked_child_fills_its_own_extent(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=40, max_bytes="4MiB") as cache:
        cache.put(0, ragged(0))  # the parent holds an extent now
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = all(cache.put(i, ragged(i)) for i in range(1, 40, 2))
            os._exit(0 if ok else 1)
        for i in range(2, 40, 2):
            cache.put(i, ragged(i))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert cache.verify() == [], "no two slots share bytes"
        for i in range(40):
            assert_ragged(cache[i], i)


def test_verify_finds_an_allocation_counter_behind_the_values_or_beyond_the_region(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "r.mmc", RAGGED, length=10, max_bytes="1MiB") as cache:
        for i in range(1, 8):
            cache.put(i, ragged(i))
        assert cache._mapped is not None
        assert cache._mapped.heap is not None
        claimed = cache._mapped.heap.claimed
        region = cache.variable_region
        assert region is not None
        assert 0 < region.used <= region.claimed
        claimed[0] = 16  # as if the allocation page had missed the disk: new values would reuse live bytes
        problems = [p for p in cache.verify() if p.kind == "region"]
        assert len(problems) == 1, problems
        assert "claimed" in problems[0].message
        assert f"use {region.used} bytes" in problems[0].message
        fixed = cache.verify(fix=True)
        assert [p.fixed for p in fixed if p.kind == "region"] == [True]
        assert cache.verify() == []
        assert int(claimed[0]) >= region.used
        assert cache.put(9, ragged(9))
        for i in (*range(1, 8), 9):
            assert_ragged(cache[i], i)
        claimed[0] = region.size + 4096  # beyond the region
        problems = [p for p in cache.verify() if p.kind == "region"]
        assert len(problems) == 1, problems
        assert "beyond" in problems[0].message
        cache.verify(fix=True)
        assert int(claimed[0]) == region.size, "a counter beyond the region is brought back to its end"
        assert cache.verify() == []


def test_a_descriptor_whose_shape_product_overflows_is_a_damaged_slot_for_every_read(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cube = {"v": Field((None, None, None), "int8")}
    with Cache.open(cache_dir / "r.mmc", cube, length=4, max_bytes="1MiB") as cache:
        for i in range(4):
            cache.put(i, {"v": np.full((1, 2, i + 1), i, np.int8)})
        assert cache._mapped is not None
        cache._mapped.variables[0].dims[2] = [2**21, 2**21, 2**21]  # 2**63 elements: wraps in int64
        with caplog.at_level(logging.WARNING, logger="mmapcache"):
            assert cache.get(2) is None
            with pytest.raises(CacheMissError) as raised:
                cache.get_many([1, 2, 3])
            assert raised.value.missing.tolist() == [2]
            values, hits = cache.read_many([1, 2, 3])
            assert hits.tolist() == [True, False, True]
            assert values["v"][1] is None
        assert caplog.text.count("slot 2 of") == 3
        assert "cannot be in the file" in caplog.text
        assert [(p.kind, p.index) for p in cache.verify()] == [("variable", 2)]


def test_a_dimension_beyond_the_format_is_refused_before_the_slot_is_claimed(cache_dir: Path) -> None:
    grid = {"v": Field((None, None), "uint8"), "label": Field((), "int64")}
    with Cache.open(cache_dir / "r.mmc", grid, length=4, max_bytes="1MiB") as cache:
        huge = np.zeros((2**32, 0), np.uint8)  # no bytes, but a dimension a uint32 cannot describe
        with pytest.raises(ValueError, match=r"'v'.*4294967296.*2\*\*32 - 1"):
            cache.put(1, {"v": huge, "label": 1})
        with pytest.raises(ValueError, match=r"'v'.*4294967296"):
            cache.put_many([2, 3], {"v": [np.zeros((1, 1), np.uint8), huge], "label": [2, 3]})
        assert cache._mapped is not None
        assert cache._mapped.slots.states.tolist() == [0, 0, 0, 0], "no slot was claimed"
        assert cache.put(1, {"v": np.zeros((2**16, 0), np.uint8), "label": 1})
        assert cache[1]["v"].shape == (2**16, 0)
        assert cache.verify() == []


def test_uuid_names_the_file_and_a_file_made_again_has_another(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, FIELDS, length=4) as first, Cache.open(path) as second:
        assert first.uuid == second.uuid
        assert len(first.uuid) == 32
        made = first.uuid
    mmapcache.remove(path)
    with Cache.open(path, FIELDS, length=4) as again:
        assert again.uuid != made


def test_counts_are_this_handles_own(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    sample = {"image": np.zeros((3, 8, 8), np.uint8), "label": np.int64(1)}
    with Cache.open(path, FIELDS, length=4) as mine, Cache.open(path) as other:
        mine.put(0, sample)
        mine.get(0)
        mine.get(1)
        other.put(2, sample)
        assert (mine.counts.hits, mine.counts.misses, mine.counts.written) == (1, 1, 1)
        assert (other.counts.hits, other.counts.misses, other.counts.written) == (0, 0, 1)
