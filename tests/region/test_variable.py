"""Variable-shape fields: ragged values round-trip exactly; a full region and bad values are refused cleanly.

Hypothesis draws schemas mixing variable fields (``None`` dimensions, some
fixed ones among them, zero-length ones too) and fixed fields, of numeric,
bool, bytes and unicode dtypes, and samples with arbitrary values (the
extremes of every type, NaNs, empty strings); every read must give back the
stored bytes, dtype and shape exactly: through ``put``/``get``,
``put_many``/``get_many``, ``read_many`` and a fresh process that opens the
file by path. Values are compared as bytes, so ``-0.0``, NaN payloads and
trailing NULs in ``'S'`` values count.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs_variable import VariableWorker, decode, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mmapcache
from mmapcache import Cache, CacheMissError, Field, Jagged
from mmapcache._format.spec import extent_size_for

MiB = 2**20

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    ">i4",  # non-native byte order
    ">f8",
    "S1",
    "S7",
    "U1",
    "U5",
]

_names = itertools.count()

Sample = dict[str, np.ndarray[Any, Any]]


# -- strategies ---------------------------------------------------------------------


@st.composite
def variable_fields(draw: st.DrawFn) -> Field:
    """A field with at least one ``None`` dimension, maybe fixed ones (0 included) beside it."""
    ndim = draw(st.integers(1, 3))
    dims: list[int | None] = draw(st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=ndim, max_size=ndim))
    if None not in dims:
        dims[draw(st.integers(0, ndim - 1))] = None
    return Field(tuple(dims), draw(st.sampled_from(DTYPES)))


@st.composite
def fixed_fields(draw: st.DrawFn) -> Field:
    shape = draw(st.lists(st.integers(0, 3), max_size=2))
    return Field(tuple(shape), draw(st.sampled_from(DTYPES)))


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Field]:
    """1-3 variable fields and 0-2 fixed ones, in a random order."""
    fields = draw(st.lists(variable_fields(), min_size=1, max_size=3)) + draw(st.lists(fixed_fields(), max_size=2))
    order = draw(st.permutations(range(len(fields))))
    return {f"f{k}": fields[k] for k in order}


def value_of(draw: st.DrawFn, field: Field, *, max_elements: int = 64) -> np.ndarray[Any, Any]:
    """A value for ``field``: its fixed dimensions, variable ones drawn (0 included), any elements."""
    shape = []
    for d in field.shape:
        if d is None:
            d = draw(st.integers(0, 9)) if draw(st.booleans()) else draw(st.sampled_from((0, 1, 17)))
        shape.append(d)
    while math.prod(shape) > max_elements:  # keep examples small: shrink the biggest variable dim
        k = max((k for k, d in enumerate(field.shape) if d is None), key=lambda k: shape[k])
        shape[k] //= 2
    value: np.ndarray[Any, Any] = draw(hnp.arrays(field.dtype, tuple(shape)))
    return value


@st.composite
def datasets(draw: st.DrawFn) -> tuple[dict[str, Field], int, dict[int, Sample]]:
    """A schema, a length, and samples at some distinct indices."""
    fields = draw(schemas())
    length = draw(st.integers(1, 12))
    indices = draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=length, unique=True))
    samples = {i: {name: value_of(draw, field) for name, field in fields.items()} for i in indices}
    return fields, length, samples


# -- helpers ------------------------------------------------------------------------


def assert_same(got: Any, want: np.ndarray[Any, Any], field: Field, what: str) -> None:
    assert isinstance(got, np.ndarray), f"{what}: got {type(got).__name__}"
    assert got.dtype == field.dtype, f"{what}: dtype {got.dtype}, field {field.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, stored {want.shape}"
    assert got.tobytes() == want.astype(field.dtype).tobytes(), f"{what}: other bytes than were stored"


def assert_sample(got: Any, want: Sample, fields: dict[str, Field], what: str) -> None:
    assert isinstance(got, dict), f"{what}: {got!r}"
    assert got.keys() == fields.keys()
    for name, field in fields.items():
        assert_same(got[name], want[name], field, f"{what} field {name!r}")


def payload(samples: dict[int, Sample], fields: dict[str, Field]) -> int:
    """Bytes of the samples' variable values (what ``variable_region.used`` counts)."""
    return sum(samples[i][n].nbytes for i in samples for n, f in fields.items() if f.variable)


def _place(nbytes: int) -> int:
    from mmapcache._format.spec import PAYLOAD_ALIGNMENT

    return -(-nbytes // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


class Files:
    """Fresh cache paths in one directory, each removed after its example."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self) -> Path:
        return self.directory / f"v{next(_names)}.mmc"

    def done(self, path: Path) -> None:
        mmapcache.remove(path)
        assert not path.exists()


@pytest.fixture
def files(cache_dir: Path) -> Files:
    return Files(cache_dir)  # (a failing example's file is removed with cache_dir)


HYPOTHESIS = settings(
    max_examples=60,
    deadline=None,
    database=None,  # no .hypothesis directory left behind
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# -- Field --------------------------------------------------------------------------


def test_a_none_dimension_makes_a_field_variable() -> None:
    tokens, boxes, images = Field((None,), "int64"), Field((None, 4), "float32"), Field((3, None, None), "uint8")
    assert tokens.variable
    assert boxes.variable
    assert images.variable
    assert not Field((3, 4), "uint8").variable
    assert not Field((), "int64").variable
    assert boxes.shape == (None, 4)
    assert repr(images) == "Field((3, None, None), 'uint8')"
    assert pickle.loads(pickle.dumps(boxes)) == boxes
    assert Field([None, 4], np.float32) == boxes
    assert hash(Field((None, 4), "float32")) == hash(boxes)
    assert Field((None, 4), "float32") != Field((4, None), "float32")
    with pytest.raises(ValueError, match="negative"):
        Field((None, -1), "uint8")


# -- round trips --------------------------------------------------------------------


@given(data=datasets())
@HYPOTHESIS
def test_put_then_get_gives_back_exactly_what_was_stored(files: Files, data: Any) -> None:
    fields, length, samples = data
    path = files.path()
    with Cache.open(path, fields, length, max_bytes=2 * MiB) as cache:
        assert cache.fields == fields
        for i, sample in samples.items():
            assert cache.put(i, sample) is True
            assert cache.put(i, sample) is False  # write-once
        for i in range(length):
            got = cache.get(i)
            if i in samples:
                assert_sample(got, samples[i], fields, f"get({i})")
            else:
                assert got is None
        region = cache.variable_region
        assert region is not None
        assert region.used == payload(samples, fields)
        assert region.used <= region.claimed <= region.size
        assert cache.verify() == []
    # Reopened by path (no schema given): same fields, same values.
    with Cache.open(path) as again:
        assert again.fields == fields
        for i, sample in samples.items():
            assert_sample(again[i], sample, fields, f"reopened [{i}]")
    files.done(path)


@given(data=datasets())
@HYPOTHESIS
def test_put_many_get_many_and_read_many_round_trip(files: Files, data: Any) -> None:
    fields, length, samples = data
    indices = list(samples)
    batch: dict[str, Any] = {}
    for name, field in fields.items():
        rows = [samples[i][name] for i in indices]
        batch[name] = rows if field.variable else np.stack(rows).reshape(len(rows), *field.fixed_shape)
    path = files.path()
    with Cache.open(path, fields, length, max_bytes=2 * MiB) as cache:
        assert cache.put_many(indices, batch).tolist() == [True] * len(indices)
        assert not cache.put_many(indices, batch).any()
        for order in (indices, indices[::-1], [indices[0]] * 3):
            got = cache.get_many(order)
            assert got.keys() == fields.keys()
            for name, field in fields.items():
                if field.variable:
                    kind = list if field.text is not None else Jagged  # text: str/bytes; numbers: one buffer
                    assert isinstance(got[name], kind), f"get_many: variable field {name!r} is not a {kind.__name__}"
                    assert len(got[name]) == len(order)
                    for row, i in enumerate(order):
                        assert_same(got[name][row], samples[i][name], field, f"get_many row {row} {name!r}")
                else:
                    stacked = got[name]
                    assert isinstance(stacked, np.ndarray)
                    assert stacked.shape == (len(order), *field.fixed_shape)
                    for row, i in enumerate(order):
                        assert_same(stacked[row, ...], samples[i][name], field, f"get_many row {row} {name!r}")
        # read_many over every index: hits as stored, variable rows of misses are None.
        everything = list(range(length))
        arrays, hits = cache.read_many(everything)
        assert hits.tolist() == [i in samples for i in everything]
        for name, field in fields.items():
            for i in everything:
                if i in samples:
                    value = arrays[name][i] if field.variable else arrays[name][i, ...]
                    assert_same(value, samples[i][name], field, f"read_many row {i} {name!r}")
                elif field.variable:
                    assert arrays[name][i] is None, f"read_many: miss {i} of {name!r} is {arrays[name][i]!r}"
        misses = [i for i in everything if i not in samples]
        if misses:
            with pytest.raises(CacheMissError) as error:
                cache.get_many(everything)
            assert sorted(error.value.missing.tolist()) == misses
        assert cache.verify() == []
    files.done(path)


@pytest.fixture(scope="module")
def fresh_process() -> Iterator[VariableWorker]:
    worker = VariableWorker()
    try:
        yield worker
    finally:
        worker.stop()


@given(data=datasets())
@settings(HYPOTHESIS, max_examples=15)
def test_another_process_reads_and_writes_the_same_values(
    files: Files, fresh_process: VariableWorker, data: Any
) -> None:
    """A spawned process opens the file by path: it reads what we stored, and we read what it stores."""
    fields, length, samples = data
    ours = dict(list(samples.items())[: (len(samples) + 1) // 2])
    theirs = {i: s for i, s in samples.items() if i not in ours}
    path = files.path()
    with Cache.open(path, fields, length, max_bytes=2 * MiB) as cache:
        for i, sample in ours.items():
            assert cache.put(i, sample)
        assert fresh_process.call("open_any", str(path)) == fields
        sent = [(i, {name: encode(v) for name, v in s.items()}) for i, s in theirs.items()]
        assert fresh_process.call("put_samples", sent) == [True] * len(theirs)
        for i, got in zip(samples, fresh_process.call("get_samples", list(samples)), strict=True):
            assert got is not None, f"the other process does not see sample {i}"
            read = {name: decode(v) for name, v in got.items()}
            assert_sample(read, samples[i], fields, f"the other process's get({i})")
        for i, sample in samples.items():
            assert_sample(cache.get(i), sample, fields, f"get({i}) of a sample the other process stored")
        fresh_process.call("close")
        assert cache.verify() == []
    files.done(path)


def test_reads_are_fresh_copies(cache_dir: Path) -> None:
    fields = {"tokens": Field((None,), "int32"), "boxes": Field((None, 4), "float32")}
    with Cache.open(cache_dir / "c.mmc", fields, 4, max_bytes=MiB) as cache:
        cache.put(1, {"tokens": np.arange(5, dtype=np.int32), "boxes": np.ones((2, 4), np.float32)})
        got = cache.get(1)
        got["tokens"][:] = -1
        got["boxes"][:] = -1
        many = cache.get_many([1, 1])
        many["tokens"][0][:] = -1
        assert cache.get(1)["tokens"].tolist() == [0, 1, 2, 3, 4]
        assert cache.get_many([1])["boxes"][0].tolist() == [[1.0] * 4] * 2
        assert cache.verify() == []


@pytest.mark.parametrize(
    ("field", "shape"),
    [
        (Field((None,), "int64"), (0,)),
        (Field((3, None, None), "uint8"), (3, 0, 5)),
        (Field((3, None, None), "uint8"), (3, 7, 0)),
        (Field((None, 4), "float32"), (0, 4)),
        (Field((0, None), "float32"), (0, 9)),
    ],
)
def test_empty_values_round_trip(cache_dir: Path, field: Field, shape: tuple[int, ...]) -> None:
    with Cache.open(cache_dir / "c.mmc", {"x": field, "y": Field((), "int8")}, 3, max_bytes=MiB) as cache:
        assert cache.put(0, {"x": np.zeros(shape, field.dtype), "y": 1})
        assert cache.get(0)["x"].shape == shape
        assert cache.get_many([0])["x"][0].shape == shape
        assert cache.verify() == []


def test_big_values_and_python_lists(cache_dir: Path) -> None:
    """A value larger than an extent, and values given as Python lists (cast as for fixed fields)."""
    fields = {"tokens": Field((None,), "int64"), "audio": Field((None,), "float32")}
    with Cache.open(cache_dir / "c.mmc", fields, 4, max_bytes=64 * MiB) as cache:
        region = cache.variable_region
        assert region is not None
        big = np.random.default_rng(0).standard_normal(3 * cache._layout.extent_size // 4 + 5).astype(np.float32)
        assert cache.put(0, {"tokens": [2**62, -(2**62), 0], "audio": big})
        assert cache.put(1, {"tokens": [1, 2], "audio": [0.5, -0.25]})  # float64 -> float32: same kind
        got0, got1 = cache[0], cache[1]
        assert got0["tokens"].tolist() == [2**62, -(2**62), 0]
        assert got0["audio"].tobytes() == big.tobytes()
        assert got1["audio"].dtype == np.float32
        assert got1["audio"].tolist() == [0.5, -0.25]
        assert cache.verify() == []


# -- creation -----------------------------------------------------------------------


def test_variable_fields_need_max_bytes(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    fields = {"tokens": Field((None,), "int32"), "label": Field((), "int64")}
    with pytest.raises(ValueError, match="max_bytes") as error:
        Cache.open(path, fields, 100)
    assert "tokens" in str(error.value)
    with pytest.raises(ValueError, match="max_bytes"):
        Cache.open(path, fields, 100, capacity=10)
    assert not path.exists()
    # Once created, the file holds the budget: openers need not repeat it.
    Cache.open(path, fields, 100, max_bytes="1MiB").close()
    with Cache.open(path, fields, 100) as cache:
        region = cache.variable_region
        assert region is not None
        assert 0 < region.size < MiB
        assert cache.capacity == 100
        assert cache.nbytes <= MiB + 64 * 1024  # the budget, plus header, counters and page padding


def test_fixed_caches_have_no_variable_region(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", {"x": Field((2,), "int8")}, 3) as cache:
        assert cache.variable_region is None


# -- a full region ------------------------------------------------------------------


def _fill_until_full(cache: Cache, nbytes: int) -> list[int]:
    stored = []
    for i in range(len(cache)):
        if not cache.put(i, {"data": np.full(nbytes, i % 251, np.uint8), "label": i}):
            break
        stored.append(i)
    return stored


def test_a_full_region_refuses_puts_with_one_warning(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    fields = {"data": Field((None,), "uint8"), "label": Field((), "int64")}
    length, nbytes = 400, 1000
    with Cache.open(cache_dir / "c.mmc", fields, length, max_bytes=128 * 1024) as cache:
        region = cache.variable_region
        assert region is not None
        with caplog.at_level(logging.WARNING, logger="mmapcache"):
            stored = _fill_until_full(cache, nbytes)
            assert 0 < len(stored) < length
            assert len(stored) * nbytes <= region.size
            filled, used = cache.filled, cache.variable_region.used  # type: ignore[union-attr]
            # Every later put is refused as a value: put, put_many, a sample larger than the region.
            rest = list(range(len(stored), length))
            assert cache.put(rest[0], {"data": np.ones(nbytes, np.uint8), "label": 0}) is False
            batch = {"data": [np.ones(nbytes, np.uint8)] * 5, "label": np.zeros(5, np.int64)}
            assert cache.put_many(rest[:5], batch).tolist() == [False] * 5
            huge = {"data": np.ones(region.size + 1, np.uint8), "label": 0}
            assert cache.put(rest[-1], huge) is False
        full = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(full) == 1, [r.getMessage() for r in full]
        assert "max_bytes" in full[0].getMessage()
        assert str(cache.path) in full[0].getMessage()
        assert cache.filled == filled
        assert cache.variable_region.used == used  # type: ignore[union-attr]
        for i in stored:  # earlier samples intact
            got = cache[i]
            assert got["data"].tolist() == [i % 251] * nbytes
            assert int(got["label"]) == i
        assert all(i not in cache for i in rest)
        assert cache.verify() == []


def test_a_full_region_warns_once_in_each_process(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"tokens": Field((None,), "int32"), "tag": Field((), "int32")}, 64, max_bytes=64 * 1024):
        pass
    worker = VariableWorker()
    try:
        worker.call("open_any", str(path))
        big = [
            (i, {"tokens": encode(np.arange(2000, dtype=np.int32)), "tag": encode(np.array(i, np.int32))})
            for i in range(64)
        ]
        first = worker.call("put_samples", big[:32])
        second = worker.call("put_samples", big[32:])
        assert any(first)
        assert not any(second)
        warnings = worker.call("warnings")
        assert len(warnings) == 1, warnings
        assert "full" in warnings[0]
    finally:
        worker.stop()


# -- validation ---------------------------------------------------------------------

FIELDS = {
    "tokens": Field((None,), "int32"),
    "boxes": Field((None, 4), "float32"),
    "image": Field((3, None, None), "uint8"),
    "name": Field((None,), "U3"),
    "label": Field((), "int64"),
}


def good(i: int = 0, boxes: int = 2) -> dict[str, Any]:
    return {
        "tokens": np.arange(i + 3, dtype=np.int32),
        "boxes": np.full((boxes, 4), i, np.float32),
        "image": np.full((3, 2, i + 1), i, np.uint8),
        "name": np.array(["a", "bc"]),
        "label": i,
    }


def bad_values() -> list[tuple[str, Any, type[Exception], list[str]]]:
    """``(field, value, error, words the message must contain)``."""
    return [
        ("boxes", np.zeros((2, 3), np.float32), ValueError, ["'boxes'", "(2, 3)"]),  # wrong fixed dim
        ("boxes", np.zeros((8,), np.float32), ValueError, ["'boxes'", "(8,)"]),  # too few dims
        ("boxes", np.zeros((2, 4, 1), np.float32), ValueError, ["'boxes'", "(2, 4, 1)"]),  # too many
        ("image", np.zeros((4, 2, 2), np.uint8), ValueError, ["'image'", "(4, 2, 2)"]),
        ("tokens", np.int32(5), ValueError, ["'tokens'", "()"]),  # a scalar for a (None,) field
        ("tokens", np.zeros(3, np.float32), TypeError, ["'tokens'", "float32", "int32"]),  # float -> int
        ("tokens", np.array([1, 2**40]), ValueError, ["'tokens'", "out of range"]),  # int narrowing
        ("image", np.full((3, 1, 1), 300, np.uint16), ValueError, ["'image'", "out of range"]),
        ("name", np.array(["abcd"]), ValueError, ["'name'", "too long"]),
        ("tokens", [[1, 2], [3]], ValueError, ["'tokens'"]),  # ragged Python lists
        ("tokens", "abc", TypeError, ["'tokens'"]),
    ]


@pytest.fixture
def checked(cache_dir: Path) -> Iterator[Cache]:
    with Cache.open(cache_dir / "v.mmc", FIELDS, 8, max_bytes=MiB) as cache:
        assert cache.put(0, good(0))
        yield cache


def _state(cache: Cache) -> tuple[int, int, list[bool]]:
    region = cache.variable_region
    assert region is not None
    return cache.filled, region.used, cache.contains_many(range(len(cache))).tolist()


@pytest.mark.parametrize(("name", "value", "error", "words"), bad_values())
def test_a_bad_value_is_refused_and_nothing_is_stored(
    checked: Cache, name: str, value: Any, error: type[Exception], words: list[str]
) -> None:
    cache, before = checked, _state(checked)
    sample = {**good(1), name: value}
    with pytest.raises(error) as info:
        cache.put(1, sample)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    # In a batch, the bad row (the last one) refuses the whole batch before anything is stored.
    batch: dict[str, Any] = {n: [good(k)[n] for k in (2, 3)] + [sample[n]] for n in FIELDS if FIELDS[n].variable}
    batch["label"] = np.array([2, 3, 1])
    with pytest.raises(error):
        cache.put_many([2, 3, 1], batch)
    assert _state(cache) == before, "a refused put stored something"
    assert cache.verify() == []
    assert cache.put(1, good(1))  # and the slot takes a good value afterwards
    assert_sample(cache[1], {k: np.asarray(v) for k, v in good(1).items()}, FIELDS, "after the refusal")


def test_a_batch_of_the_wrong_length_is_refused(checked: Cache) -> None:
    before = _state(checked)
    batch: dict[str, Any] = {n: [good(k)[n] for k in (2, 3)] for n in FIELDS if FIELDS[n].variable}
    batch["label"] = np.array([2, 3, 4])
    with pytest.raises(ValueError, match=r"'tokens'|'boxes'|'image'|'name'"):
        checked.put_many([2, 3, 4], batch)
    batch["label"] = np.array([2, 3])
    with pytest.raises(ValueError, match=r"'tokens'|'boxes'|'image'|'name'|'label'"):
        checked.put_many([2, 3, 4], batch)
    assert _state(checked) == before


@pytest.mark.parametrize("share", [0.5, 0.8, 0.95, 1.0])
def test_a_writer_that_stops_early_strands_little_of_a_nearly_full_region(cache_dir: Path, share: float) -> None:
    """Two writers share the fill; one stops (its part of the data is done): the other still stores every
    value of a budget with 2 % headroom over the bytes the values take (whole extents held by the idle
    writer would be more than that)."""
    path = cache_dir / "c.mmc"
    fields = {"data": Field((None,), "uint8")}
    size = 128  # a 4 KiB extent holds 32 of them exactly: no extent ends unused because a value did not fit
    with Cache.open(path, fields, 600, max_bytes=600 * 24 + 64 * 1024) as first:
        region = first.variable_region
        assert region is not None
        assert extent_size_for(region.size) == 4096
        assert region.size >= 64 * 1024
        count = int(0.98 * region.size) // size
        with Cache.open(path, fields, 600) as second:
            stop = int(share * count)
            for i in range(count):
                writer = first if i < stop and i % 2 == 0 else second
                assert writer.put(i, {"data": np.full(size, i % 251, np.uint8)}), f"value {i} of {count} refused"
            assert second.filled == count
            assert second.variable_region.refused == 0  # type: ignore[union-attr]
            assert all(second[i]["data"].tolist() == [i % 251] * size for i in range(count))
            assert second.verify() == []


@pytest.mark.parametrize("size", [100, 208, 250, 4000])
def test_a_single_writer_fills_the_whole_region(cache_dir: Path, size: int) -> None:
    """Values that do not divide an extent: a writer alone continues its extent instead of leaving its end."""
    fields = {"data": Field((None,), "uint8")}
    with Cache.open(cache_dir / "c.mmc", fields, 2000, max_bytes=2000 * 24 + 64 * 1024) as cache:
        region = cache.variable_region
        assert region is not None
        rounded = -(-size // 16) * 16
        count = min(region.size // rounded, 2000)
        for i in range(count):
            assert cache.put(i, {"data": np.full(size, i % 251, np.uint8)}), f"value {i} of {count} refused"
        assert cache.variable_region.claimed == count * rounded  # type: ignore[union-attr]
        assert cache.put(count, {"data": np.zeros(rounded + (region.size - count * rounded) + 16, np.uint8)}) is False
        assert all(cache[i]["data"].tolist() == [i % 251] * size for i in range(0, count, 7))
        assert cache.verify() == []


def test_one_rule_places_values_and_one_policy_sizes_a_variable_region_without_a_budget() -> None:
    from mmapcache._file.planning import EXTENT_ROOM, VARIABLE_HEADROOM, variable_budget
    from mmapcache._format.spec import slot_nbytes
    from mmapcache._region.allocator import place

    sizes = np.array([0, 1, 15, 16, 17, 4096], np.int64)
    assert place(sizes).tolist() == [place(int(n)) for n in sizes] == [0, 16, 16, 16, 32, 4096]
    fields = {"tokens": Field((None,), "int32"), "label": Field((), "int64")}
    budget = variable_budget(fields, 1000, 100.0)
    assert budget == 1000 * slot_nbytes(fields) + int(VARIABLE_HEADROOM * 100 * 1000) + EXTENT_ROOM


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_parts_of_values_are_gathered_back_to_back_with_gaps_left_and_damage_reported(
    cache_dir: Path, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmapcache._region import gathers
    from mmapcache.cache import column_of

    if compiled and gathers.native is None:
        pytest.skip("the compiled gather is not built here (MMAPCACHE_NO_EXTENSION=1 or no compiler)")
    if not compiled:
        monkeypatch.setattr(gathers, "native", None)
    rng = np.random.default_rng(11)
    values = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in rng.integers(0, 50, 30)]
    with Cache.open(cache_dir / "t.mmc", {"t": Field((None,), "uint16")}, len(values), max_bytes=MiB) as cache:
        cache.put_many(range(len(values)), {"t": values})
        column = column_of(cache, "t")
        for _ in range(40):
            count = int(rng.integers(0, 12))
            slots = rng.integers(-1, len(values), count)  # -1: a gap
            starts = np.array([int(rng.integers(0, len(values[s]) + 1)) if s >= 0 else 0 for s in slots], np.int64)
            lengths = np.array(
                [int(rng.integers(0, len(values[s]) - a + 1)) if s >= 0 else int(rng.integers(1, 9)) for s, a in
                 zip(slots.tolist(), starts.tolist(), strict=True)], np.int64
            )  # fmt: skip
            out = np.full(int(lengths.sum()), 7, np.uint16)
            offsets, bad = column.fragments(slots.astype(np.int64), starts, lengths, out)
            assert len(bad) == 0
            assert offsets.tolist() == [0, *np.cumsum(lengths).tolist()]
            for k, (s, a, n) in enumerate(zip(slots.tolist(), starts.tolist(), lengths.tolist(), strict=True)):
                if s >= 0:
                    assert out[offsets[k] : offsets[k] + n].tolist() == values[s][a : a + n].tolist()
        for damaged in (2**40, 2**63 + 2):  # damaged descriptors: the part lies outside the region
            column.offsets[3] = damaged
            offsets, bad = column.fragments(
                np.array([0, 3, 5], np.int64), np.zeros(3, np.int64), np.ones(3, np.int64), np.zeros(3, np.uint16)
            )
            assert bad.tolist() == [1], damaged
