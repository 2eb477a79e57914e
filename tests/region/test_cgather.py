"""The compiled gather (`_cgather.c`) against the numpy fallback: the same batches, damaged descriptors included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapcache
from mmapcache import Cache, Field, Jagged
from mmapcache._region.gathers import native
from mmapcache._region.variable import VariableColumn

BUILT = importlib.util.find_spec("mmapcache._region._cgather") is not None
needs_native = pytest.mark.skipif(
    native is None, reason="the compiled gather is not built or is turned off (pip install -e . with a C compiler)"
)
SETTINGS = settings(
    max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ROOT = Path(__file__).resolve().parents[2]
SLOTS = 120

# Fields of every kind of head and tail: one variable dimension, a fixed tail, several variable
# dimensions (whose element count can pass int64), a fixed dimension inside the head.
FIELDS = [
    Field((None,), "uint16"),
    Field((None,), "int32"),
    Field((None, 4), "float32"),
    Field((3, None, None), "uint8"),
    Field((None, None), "int16"),
    Field((2, None, 3), "<f8"),
]


def sample(field: Field, i: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    shape = tuple(int(rng.integers(0, 12 if len(field.shape) > 1 else 90)) if d is None else d for d in field.shape)
    return (rng.integers(0, 200, shape) + i).astype(field.dtype)


@pytest.fixture(params=FIELDS, ids=[repr(f.shape) for f in FIELDS])
def filled(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Cache, VariableColumn, dict[int, np.ndarray[Any, Any]]]]:
    """A cache of one variable field with most slots filled (some empty: their descriptors are zeros)."""
    field: Field = request.param
    rng = np.random.default_rng(len(field.shape))
    path = tmp_path / "c.mmc"
    cache = Cache.open(path, {"x": field}, SLOTS, max_bytes="2MiB")
    samples = {i: sample(field, i, rng) for i in range(SLOTS) if i % 7}
    assert cache.put_many(list(samples), {"x": list(samples.values())}).all()
    try:
        yield cache, cache._live().variables[0], samples
    finally:
        cache.close()
        mmapcache.remove(path)


def same(a: Jagged, b: Jagged) -> None:
    assert a.values.dtype == b.values.dtype
    assert a.values.shape == b.values.shape
    assert a.values.tobytes() == b.values.tobytes()
    assert a.offsets.tolist() == b.offsets.tolist()
    assert a.shapes.tolist() == b.shapes.tolist()
    assert a.present.tolist() == b.present.tolist()


def damage(column: VariableColumn, slot: int, offset: int, dims: list[int]) -> None:
    column.offsets[slot] = offset
    column.dims[slot] = dims


def offsets_near(size: int) -> st.SearchStrategy[int]:
    """Offsets of a damaged descriptor: within the region, at and past its end, past int64 and uint64's end."""
    return st.one_of(
        st.integers(0, size),
        st.sampled_from([0, size - 16, size - 1, size, size + 1, 2**63 - 1, 2**63, 2**64 - 16, 2**64 - 1]),
        st.integers(0, 2**64 - 1),
    )


def dimensions(field: Field) -> st.SearchStrategy[list[int]]:
    """Dimensions of a damaged descriptor: small, huge, and (for a fixed one) right or wrong."""
    one = st.one_of(st.integers(0, 20), st.sampled_from([2**16, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
    return st.tuples(*(one if d is None else st.one_of(st.just(d), one) for d in field.shape)).map(list)


@needs_native
@SETTINGS
@given(data=st.data())
def test_the_compiled_gather_reads_what_the_numpy_gather_reads(
    filled: tuple[Cache, VariableColumn, dict[int, np.ndarray[Any, Any]]], data: st.DataObject
) -> None:
    """Random batches (empty, repeated slots, misses) over descriptors of which some are damaged."""
    _, column, samples = filled
    size = column._size
    table = column._descriptors
    saved = table.copy()
    damaged = data.draw(
        st.dictionaries(st.integers(0, SLOTS - 1), st.tuples(offsets_near(size), dimensions(column.field)), max_size=6),
        label="damaged",
    )
    try:
        for slot, (offset, dims) in damaged.items():
            damage(column, slot, offset, dims)
        idx = np.array(data.draw(st.lists(st.integers(0, SLOTS - 1), max_size=300), label="idx"), np.intp)
        chosen = data.draw(st.none() | st.lists(st.booleans(), min_size=len(idx), max_size=len(idx)), label="rows")
        rows = None if chosen is None else np.flatnonzero(np.array(chosen, bool))
        compiled, bad = column.gather(idx, rows)  # the compiled gather (needs_native)
        fallback, bad_numpy = column.gather_numpy(idx, rows)
        same(compiled, fallback)
        assert bad.tolist() == bad_numpy.tolist()
        read = range(len(idx)) if rows is None else rows.tolist()
        for k in range(len(idx)):
            i = int(idx[k])
            if k not in read:
                assert compiled[k] is None
            elif i not in damaged and i in samples:
                np.testing.assert_array_equal(compiled[k], samples[i])
                assert compiled[k].shape == samples[i].shape
        # Only damaged descriptors and the zeros of slots never filled can be impossible.
        assert set(bad.tolist()) <= {k for k in read if int(idx[k]) in damaged or int(idx[k]) not in samples}
        assert not compiled.present[bad].any()
    finally:
        table[:] = saved


@needs_native
def test_descriptors_that_point_outside_the_region_are_impossible_rows_and_nothing_is_read_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None, None), "uint8")}, 8, max_bytes="64KiB") as cache:
        assert cache.put_many(range(8), {"t": [np.full((2, i + 1), i, np.uint8) for i in range(8)]}).all()
        column = cache._live().variables[0]
        size = column._size
        damage(column, 1, 2**64 - 1, [1, 1])  # past int64 and the region
        damage(column, 2, size - 3, [2, 2])  # one byte past the end
        damage(column, 3, 0, [2**32 - 1, 2**32 - 1])  # an element count near 2**64
        damage(column, 4, 16, [2**32 - 1, 2**31 + 1])  # past 2**64: would wrap to a few bytes
        damage(column, 5, size - 4, [2, 2])  # exactly the last 4 bytes: possible
        idx = np.arange(8, dtype=np.intp)
        batch, bad = column.gather(idx)
        assert bad.tolist() == [1, 2, 3, 4]
        assert batch.present.tolist() == [True, False, False, False, False, True, True, True]
        assert batch.shapes.tolist()[1:5] == [[0, 0]] * 4
        assert batch[5].tobytes() == column._region[size - 4 :].tobytes()
        np.testing.assert_array_equal(batch[7], np.full((2, 8), 7, np.uint8))
        _, hits = cache.read_many(idx)
        assert hits.tolist() == [True, False, False, False, False, True, True, True]
    mmapcache.remove(path)


@needs_native
def test_the_compiled_gather_refuses_what_the_cache_never_passes_it(tmp_path: Path) -> None:
    """Slots outside the table, rows outside the batch, indices that are not int64: errors, not reads."""
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None,), "int32")}, 4, max_bytes="64KiB") as cache:
        column = cache._live().variables[0]

        def call(indices: Any, rows: Any = None, alloc: Any = column._alloc) -> Any:
            assert native is not None
            offsets = np.empty(len(indices) + 1, np.int64)
            return native.gather(
                column._region,
                column._descriptors,
                column._width,
                indices,
                rows,
                column._dims,
                4,
                4,
                offsets,
                None,
                alloc,
            )

        with pytest.raises(IndexError, match="slot 4 is outside a table of 4"):
            call(np.array([0, 4]))
        with pytest.raises(IndexError, match="slot -1"):
            call(np.array([-1]))
        with pytest.raises(IndexError, match="row 2 is not a position in a batch of 2"):
            call(np.array([0, 1]), np.array([2]))
        with pytest.raises(TypeError, match="indices must hold int64"):
            call(np.array([0, 1], np.int32))
        with pytest.raises(TypeError, match="C-contiguous"):
            call(np.arange(4)[::2])
        cache.put(0, {"t": np.arange(10, dtype=np.int32)})
        with pytest.raises(ValueError, match="alloc gave 4 bytes for 40"):
            call(np.array([0]), alloc=lambda shape: np.empty(1, np.int32))
        values, bad = call(np.array([0, 9], np.int64), np.array([0]))  # an unread slot may be anything
        assert values.tolist() == list(range(10))
        assert bad == []
    mmapcache.remove(path)


def test_threads_gathering_at_once_each_get_their_own_rows(tmp_path: Path) -> None:
    """The compiled copy runs without the GIL: threads overlap and every batch still holds its own rows."""
    path = tmp_path / "c.mmc"
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 2**31, int(rng.integers(2000, 6000)), dtype=np.int32) for _ in range(64)]
    with Cache.open(path, {"t": Field((None,), "int32")}, 64, max_bytes="4MiB") as cache:
        assert cache.put_many(range(64), {"t": rows}).all()
        errors: list[BaseException] = []

        def read(seed: int) -> None:
            local = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    idx = local.integers(0, 64, 32)
                    assert cache.get_many(idx)["t"] == [rows[i] for i in idx]
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
    mmapcache.remove(path)


def run_python(*args: str, **env: str) -> str:
    """``python *args`` importing this checkout, with ``env`` (and no MMAPCACHE_NO_EXTENSION of ours); its stdout."""
    environment = {k: v for k, v in os.environ.items() if k != "MMAPCACHE_NO_EXTENSION"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, *args], env={**environment, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout


def test_mmapcache_accelerated_says_whether_the_compiled_gather_is_used() -> None:
    code = "import mmapcache, mmapcache._region.gathers as g; print(mmapcache.accelerated, g.native is not None)"
    assert run_python("-c", code).split() == [str(BUILT), str(BUILT)]
    assert run_python("-c", code, MMAPCACHE_NO_EXTENSION="0").split() == [str(BUILT), str(BUILT)]
    assert run_python("-c", code, MMAPCACHE_NO_EXTENSION="1").split() == ["False", "False"]


def test_the_version_line_says_whether_the_compiled_gather_is_used() -> None:
    built = "yes" if BUILT else "no"
    assert run_python("-m", "mmapcache", "--version").endswith(f"(compiled gather: {built})\n")
    assert run_python("-m", "mmapcache", "--version", MMAPCACHE_NO_EXTENSION="1").endswith("(compiled gather: no)\n")


def test_with_the_extension_turned_off_reads_go_through_numpy(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    with Cache.open(path, {"t": Field((None, 2), "float32")}, 4, max_bytes="64KiB") as cache:
        cache.put_many([0, 2], {"t": [np.ones((3, 2), np.float32), np.zeros((1, 2), np.float32)]})
    code = (
        "import mmapcache, sys\n"
        f"with mmapcache.Cache({str(path)!r}, readonly=True) as c:\n"
        "    arrays, hits = c.read_many([2, 1, 0])\n"
        "    print(mmapcache.accelerated, hits.tolist(), arrays['t'].lengths.tolist(), arrays['t'].values.sum())\n"
    )
    out = run_python("-c", code, MMAPCACHE_NO_EXTENSION="1")
    assert out.split() == ["False", "[True,", "False,", "True]", "[1,", "0,", "3]", "6.0"]
    mmapcache.remove(path)


PAD_DTYPES = ["uint8", "uint16", "int32", "float32", ">i4", "<f8", "complex64"]


@st.composite
def padding_cases(draw: st.DrawFn) -> tuple[Jagged, Any]:
    """A batch of rows that vary in their first dimension (some missing, some empty), and a pad value."""
    dtype = np.dtype(draw(st.sampled_from(PAD_DTYPES)))
    tail = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, 40) | st.none(), max_size=70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = [None if n is None else rng.integers(0, 250, (n, *tail)).astype(dtype) for n in lengths]
    return Jagged.from_arrays(rows, dtype=dtype, tail=tail), draw(st.sampled_from([0, 1, 7, 255]))


@needs_native
@SETTINGS
@given(case=padding_cases())
def test_compiled_padding_gives_what_the_masked_numpy_padding_gives(case: tuple[Jagged, Any]) -> None:
    batch, pad_value = case
    padded, lengths = batch.to_padded(pad_value)  # the compiled pad (needs_native)
    expected, expected_lengths = batch._padded_numpy(pad_value)
    assert padded.dtype == expected.dtype
    assert padded.shape == expected.shape
    assert padded.tobytes() == expected.tobytes()
    assert lengths.tolist() == expected_lengths.tolist()
    for k, row in enumerate(batch):
        n = 0 if row is None else len(row)
        if row is not None:
            np.testing.assert_array_equal(padded[k, :n], row)
        assert (padded[k, n:] == np.array(pad_value, batch.dtype)).all()


@needs_native
def test_compiled_padding_of_a_large_batch_matches_numpy() -> None:
    """Past the size from which the copy runs without the GIL."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 8000, int(n), dtype=np.uint16) for n in rng.integers(8, 4096, 64)]
    batch = Jagged.from_arrays(rows)
    for pad_value in (0, 9):
        assert batch.to_padded(pad_value)[0].tobytes() == batch._padded_numpy(pad_value)[0].tobytes()


def test_a_pad_value_the_dtype_cannot_hold_fails_the_same_way_compiled_or_not() -> None:
    batch = Jagged.from_arrays([np.arange(3, dtype=np.uint16), np.arange(1, dtype=np.uint16)])
    with pytest.raises(OverflowError):
        batch.to_padded(-1)
    with pytest.raises(OverflowError):
        batch._padded_numpy(-1)


@needs_native
def test_the_compiled_pad_refuses_rows_that_do_not_fit_without_writing_anything() -> None:
    assert native is not None
    values = np.arange(6, dtype=np.int32)
    fill = np.zeros((), np.int32)

    def refused(offsets: list[int], out: np.ndarray[Any, Any], match: str) -> None:
        before = out.copy()
        with pytest.raises(ValueError, match=match):
            native.pad(values, np.array(offsets, np.int64), fill, out)
        assert out.tobytes() == before.tobytes()

    refused([0, 4, 6], np.full((2, 3), -5, np.int32), "row 0 .units 0 to 4. does not fit a padded row of 12 bytes")
    refused([0, 3, 7], np.full((2, 4), -5, np.int32), "past the 24 bytes of values")
    refused([0, 3, 2], np.full((2, 4), -5, np.int32), "row 1")
    refused([-1, 3], np.full((1, 4), -5, np.int32), "start at 0 or more")
    refused([0, 3, 6], np.full(7, -5, np.int32), "not a whole number of rows")
    refused([], np.full(1, -5, np.int32), "len.rows. . 1 items")
    with pytest.raises(TypeError, match="writable"):
        native.pad(values, np.array([0, 6], np.int64), fill, bytes(24))
    with pytest.raises(TypeError, match="offsets must hold int64"):
        native.pad(values, np.array([0, 6], np.int32), fill, np.empty(6, np.int32))


MISALIGNED = """
import sys
import numpy as np
import mmapcache
from mmapcache import Cache, Field

path, dtype = sys.argv[1], sys.argv[2]
with Cache.open(path, {"t": Field((None,), dtype)}, 4, max_bytes="64KiB") as cache:
    values = [np.arange(i * 10, i * 10 + 6).astype(dtype) for i in range(4)]
    assert cache.put_many(range(4), {"t": values}).all()
    column = cache._live().variables[0]
    column.offsets[1] += 1  # a damaged file: the value's offset is not a multiple of the item size
    arrays, hits = cache.read_many(range(4))
    try:
        cache.get_many([1])
        raised = "no"
    except KeyError as error:
        raised = str([int(i) for i in error.missing])
    print(mmapcache.accelerated, cache.get(1), hits.tolist(), arrays["t"][1], raised, [int(v) for v in arrays["t"][2]])
mmapcache.remove(path)
"""


@pytest.mark.parametrize("extension", ["0", "1"], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", ["uint16", "float32", "<f8"])
def test_a_value_offset_that_is_not_a_multiple_of_the_item_size_is_a_damaged_slot_for_every_read(
    tmp_path: Path, extension: str, dtype: str
) -> None:
    """``get``, ``get_many`` and ``read_many`` agree: the slot is damaged (a miss), the others read as stored."""
    if extension == "0" and not BUILT:
        pytest.skip("the compiled gather is not built")
    script = tmp_path / "misaligned.py"
    script.write_text(MISALIGNED)
    out = run_python(str(script), str(tmp_path / "c.mmc"), dtype, MMAPCACHE_NO_EXTENSION=extension)
    accelerated = str(extension == "0")
    expected = [accelerated, "None", "[True,", "False,", "True,", "True]", "None", "[1]", "[20,", "21,", "22,"]
    assert out.split()[: len(expected)] == expected


# -- take: fixed fields, the slot states read in the same pass -------------------------------------


@needs_native
@SETTINGS
@given(data=st.data())
def test_the_compiled_take_reads_what_the_numpy_take_reads(tmp_path_factory: pytest.TempPathFactory, data: Any) -> None:
    """Random batches (repeats, misses, indices past the capacity) over fields of several dtypes and shapes."""
    from mmapcache._region.gathers import FixedRows, take_ready, take_ready_numpy
    from mmapcache._region.slots import READY

    path = tmp_path_factory.mktemp("take") / "c.mmc"
    fields = {"a": Field((3, 5), "uint8"), "b": Field((), "<f8"), "c": Field((2,), "int16"), "d": Field((7,), "M8[s]")}
    capacity = 40
    with Cache.open(path, fields, 60, capacity=capacity) as cache:
        filled = data.draw(st.sets(st.integers(0, capacity - 1)), label="filled")
        for i in sorted(filled):
            cache.put(i, {"a": np.full((3, 5), i, np.uint8), "b": i / 3, "c": [i, -i], "d": np.full(7, i, "M8[s]")})
        mapped = cache._live()
        idx = np.array(data.draw(st.lists(st.integers(0, 59), max_size=200), label="idx"), np.intp)
        sources = tuple(mapped.arrays.values())
        rows, hits, found = take_ready(mapped.slots.states, READY, idx, sources[:3], 60)
        rows_numpy, hits_numpy, found_numpy = take_ready_numpy(mapped.slots.states, READY, idx, sources[:3], 60)
        assert found == found_numpy == int(np.count_nonzero(hits))
        assert hits.tolist() == hits_numpy.tolist() == [int(i) in filled for i in idx]
        for got, want in zip(rows, rows_numpy, strict=True):
            assert got.dtype == want.dtype
            assert got.shape == want.shape
            assert got[hits].tobytes() == want[hits].tobytes()
        np.testing.assert_array_equal(rows[0][hits][:, 0, 0], idx[hits])
        # Into given buffers: the rows of misses are left as they were.
        outs = [np.full((len(idx), *s.shape[1:]), 7, s.dtype) for s in sources[:3]]
        before = [o.copy() for o in outs]
        take_ready(mapped.slots.states, READY, idx, sources[:3], 60, outs)
        for take in (take_ready, take_ready_numpy):  # an index past the length: -1, the caller raises
            assert take(mapped.slots.states, READY, np.array([0, 60]), sources[:3], 60)[2] == -1
        for o, b, want in zip(outs, before, rows_numpy, strict=True):
            assert o[~hits].tobytes() == b[~hits].tobytes()
            assert o[hits].tobytes() == want[hits].tobytes()
        arrays, read = cache.read_many(idx)
        assert read.tolist() == hits.tolist()
        assert arrays["d"][read].astype(np.int64)[:, 0].tolist() == idx[read].tolist()
        # at=: into rows at .. of wider outputs, the rows around them left as they were; the compiled take
        # (fields a, b, c) and the numpy one (with d: datetimes) alike
        at = data.draw(st.integers(0, 5), label="at")
        for names in ("abc", "abcd"):
            rows_of = FixedRows(mapped.slots.states, READY, {name: mapped.arrays[name] for name in names})
            wide = [np.full((at + len(idx) + 2, *source.shape[1:]), 7, source.dtype) for source in rows_of.sources]
            untouched = [array.copy() for array in wide]
            _, wide_hits, wide_found = rows_of.take(idx, 60, wide, at=at)
            assert wide_found == found
            assert wide_hits is not None
            assert wide_hits.tolist() == hits.tolist()
            for array, blank, source in zip(wide, untouched, rows_of.sources, strict=True):
                inside = array[at : at + len(idx)]
                assert inside[hits].tobytes() == source[idx[hits]].tobytes()
                assert inside[~hits].tobytes() == blank[at : at + len(idx)][~hits].tobytes()
                assert array[:at].tobytes() == blank[:at].tobytes()
                assert array[at + len(idx) :].tobytes() == blank[at + len(idx) :].tobytes()
    mmapcache.remove(path)


@needs_native
def test_the_compiled_take_refuses_what_the_cache_never_passes_it(tmp_path: Path) -> None:
    assert native is not None
    table = np.zeros((4, 8), np.uint8)
    source = np.zeros((4, 3), np.uint8)
    hits = np.zeros(2, bool)
    idx = np.array([0, 1], np.int64)
    with pytest.raises(ValueError, match="out 0 holds 3 bytes, not rows of 3 to write 2 from row 0"):
        native.take(table, 8, 2, idx, (source,), (np.zeros(3, np.uint8),), hits, 4)
    with pytest.raises(ValueError, match="out 0 holds 9 bytes, not rows of 3 to write 2 from row 2"):
        native.take(table, 8, 2, idx, (source,), (np.zeros((3, 3), np.uint8),), hits, 4, 2)
    with pytest.raises(ValueError, match="at >= 0"):
        native.take(table, 8, 2, idx, (source,), (np.zeros((3, 3), np.uint8),), hits, 4, -1)
    with pytest.raises(ValueError, match="hits must hold 2 bytes"):
        native.take(table, 8, 2, idx, (source,), (np.zeros((2, 3), np.uint8),), np.zeros(3, bool), 4)
    with pytest.raises(ValueError, match="source 0 holds 10 bytes"):
        native.take(table, 8, 2, idx, (np.zeros(10, np.uint8),), (np.zeros((2, 3), np.uint8),), hits, 4)
    with pytest.raises(TypeError, match="as many buffers"):
        native.take(table, 8, 2, idx, (source,), (), hits, 4)
    readonly = np.zeros((2, 3), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        native.take(table, 8, 2, idx, (source,), (readonly,), hits, 4)
    table[1, 0] = 2
    source[1] = [4, 5, 6]
    out = np.zeros((3, 3), np.uint8)
    found = native.take(table, 8, 2, np.array([1, 0, 9], np.int64), (source,), (out,), np.zeros(3, bool), 10)
    assert found == 1
    assert out.tolist() == [[4, 5, 6], [0, 0, 0], [0, 0, 0]]
    assert native.take(table, 8, 2, np.array([1, -1], np.int64), (source,), (out[:2],), hits, 10) == -1
    # at: the rows go from that row of the outs on; the rows before and after stay as they were
    wide = np.full((5, 3), 7, np.uint8)
    assert native.take(table, 8, 2, np.array([0, 1], np.int64), (source,), (wide,), hits, 10, 3) == 1
    assert hits.tolist() == [False, True]
    assert wide.tolist() == [[7, 7, 7]] * 4 + [[4, 5, 6]]


@needs_native
def test_the_compiled_take_without_a_hits_buffer_copies_the_same_rows_and_counts_them() -> None:
    assert native is not None
    table = np.zeros((300, 8), np.uint8)
    table[::3, 0] = 2  # every third slot READY
    source = np.arange(300 * 5, dtype=np.uint8).reshape(300, 5)
    idx = np.random.default_rng(0).integers(0, 400, 257).astype(np.int64)  # past the table: never READY
    with_mask, without = np.zeros((257, 5), np.uint8), np.zeros((257, 5), np.uint8)
    hits = np.zeros(257, bool)
    found = native.take(table, 8, 2, idx, (source,), (with_mask,), hits, 400)
    assert native.take(table, 8, 2, idx, (source,), (without,), None, 400) == found == int(np.count_nonzero(hits))
    assert hits.tolist() == [i < 300 and i % 3 == 0 for i in idx.tolist()]
    assert without.tobytes() == with_mask.tobytes()
    assert without[hits].tobytes() == source[idx[hits]].tobytes()


@pytest.mark.parametrize("extension", ["0", "1"], ids=["compiled", "numpy"])
def test_get_many_and_read_many_of_fixed_fields_agree_with_and_without_the_extension(
    tmp_path: Path, extension: str
) -> None:
    if extension == "0" and not BUILT:
        pytest.skip("the compiled gather is not built")
    code = (
        "import sys, numpy as np, mmapcache\n"
        "from mmapcache import Cache, Field\n"
        "with Cache.open(sys.argv[1], {'x': Field((64,), 'uint8'), 'y': Field((), 'int64')}, 10) as c:\n"
        "    x = (np.arange(3 * 64).reshape(3, 64) % 251).astype(np.uint8)\n"
        "    c.put_many([1, 3, 4], {'x': x, 'y': [10, 30, 40]})\n"
        "    got = c.get_many([4, 1, 4])\n"
        "    arrays, hits = c.read_many([0, 3, 9])\n"
        "    try:\n"
        "        c.get_many([1, 2])\n"
        "    except KeyError as e:\n"
        "        missing = [int(i) for i in e.missing]\n"
        "    print(mmapcache.accelerated, got['y'].tolist(), int(got['x'][1].sum()), hits.tolist(),\n"
        "          int(arrays['y'][1]), missing, c.usage().total.hits, c.usage().total.misses)\n"
        "mmapcache.remove(sys.argv[1])\n"
    )
    out = run_python("-c", code, str(tmp_path / "c.mmc"), MMAPCACHE_NO_EXTENSION=extension)
    expected = f"{extension == '0'} [40, 10, 40] {sum(range(64))} [False, True, False] 30 [2] 4 3"
    assert out.split() == expected.split()


# -- a mixture's draws: dealt to positions, grouped by source ---------------------------------------


@needs_native
@SETTINGS
@given(data=st.data())
def test_the_compiled_deal_and_group_give_what_their_numpy_twins_give(data: Any, monkeypatch: Any) -> None:
    """Random codes of 1-5 sources cut into random ranges (empty ones too): the same order, draws and counts."""
    from mmapcache._region import gathers
    from mmapcache.torch import _draws

    sources = data.draw(st.integers(1, 5), label="sources")
    codes = np.array(data.draw(st.lists(st.integers(0, sources - 1), max_size=300), label="codes"), np.int64)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(codes)), max_size=8), label="cuts"))
    sizes = np.diff([0, *cuts, len(codes)]).astype(np.int64)
    drawn = np.arange(len(codes), dtype=np.int64) * 7 + 3
    draws = [np.arange(int(np.count_nonzero(codes == c)) + 2, dtype=np.int64) * 10 + c for c in range(sources)]
    compiled = (_draws.deal(codes, draws), *_draws.group(codes, drawn, sizes, sources))
    monkeypatch.setattr(gathers, "native", None)  # the numpy twins
    twins = (_draws.deal(codes, draws), *_draws.group(codes, drawn, sizes, sources))
    for got, want in zip(compiled, twins, strict=True):
        assert got.tolist() == want.tolist()
    dealt, order, indices, counts = compiled
    for c in range(sources):  # deal: each source's draws in the order of its positions
        assert dealt[codes == c].tolist() == draws[c][: int(np.count_nonzero(codes == c))].tolist()
    start = 0
    for k, size in enumerate(sizes.tolist()):  # group: each range by source, in order within a source
        part = order[start : start + size]
        assert sorted(part.tolist()) == list(range(start, start + size))
        assert [(int(codes[i]), int(i)) for i in part] == sorted((int(codes[i]), i) for i in range(start, start + size))
        assert counts[k].tolist() == np.bincount(codes[start : start + size], minlength=sources).tolist()
        start += size
    assert indices.tolist() == drawn[order].tolist()


@needs_native
def test_the_compiled_deal_and_group_refuse_what_the_mixture_never_passes_them() -> None:
    assert native is not None
    codes = np.array([0, 1, 1, 0], np.int64)
    out = np.empty(4, np.int64)
    with pytest.raises(ValueError, match=r"codes holds 1, not in \[0, 1\)"):
        native.deal(codes, (np.arange(4),), out)
    with pytest.raises(ValueError, match="source 1 has 1 draws, fewer than the codes name it"):
        native.deal(codes, (np.arange(2), np.arange(1)), out)
    with pytest.raises(ValueError, match="out must hold 4 items"):
        native.deal(codes, (np.arange(2), np.arange(2)), np.empty(3, np.int64))
    order, indices, counts = np.empty(4, np.int64), np.empty(4, np.int64), np.empty((2, 2), np.int64)
    with pytest.raises(ValueError, match="the sizes sum to 3, not the 4 codes"):
        native.group(codes, codes, np.array([1, 2]), 2, order, indices, counts)
    with pytest.raises(ValueError, match="the sizes sum to more than the 4 codes"):
        native.group(codes, codes, np.array([3, 3]), 2, order, indices, counts)
    with pytest.raises(ValueError, match="counts must hold 2 items, got 4"):
        native.group(codes, codes, np.array([4]), 2, order, indices, counts)
    with pytest.raises(ValueError, match="sources must be >= 1"):
        native.group(codes, codes, np.array([4]), 0, order, indices, counts)
    with pytest.raises(TypeError, match="int64"):
        native.group(codes.astype(np.int32), codes, np.array([2, 2]), 2, order, indices, counts)
    native.group(codes, codes * 10, np.array([2, 2]), 2, order, indices, counts)
    assert (order.tolist(), indices.tolist(), counts.tolist()) == ([0, 1, 3, 2], [0, 10, 0, 10], [[1, 1], [1, 1]])


@pytest.mark.parametrize("extension", ["compiled", "numpy"])
def test_take_parts_reads_several_files_into_one_batch_as_a_take_a_file_would(
    tmp_path: Path, extension: str, monkeypatch: Any
) -> None:
    """Three caches (one empty, one partly filled) into one batch; an index out of range spoils its part alone."""
    from mmapcache._region import gathers
    from mmapcache._region.gathers import take_parts

    if extension == "compiled" and native is None:
        pytest.skip("the compiled gather is not built or is turned off (pip install -e . with a C compiler)")
    if extension == "numpy":
        monkeypatch.setattr(gathers, "native", None)
    fields = {"a": Field((3, 5), "uint8"), "b": Field((), "<f8")}
    rng = np.random.default_rng(1)
    caches, reads, at = [], [], 0
    for k, (length, filled) in enumerate([(50, 50), (30, 12), (20, 0)]):
        cache = Cache.open(tmp_path / f"{k}.mmc", fields, length)
        caches.append(cache)
        for i in rng.choice(length, filled, replace=False).tolist():
            cache.put(i, {"a": np.full((3, 5), k * 60 + i, np.uint8), "b": k + i / 100})
        idx = rng.integers(0, length, 40 + k).astype(np.intp)
        reads.append((cache._live().fixed, idx, length, at))
        at += len(idx)
    outs = [np.full((at + 3, 3, 5), 255, np.uint8), np.full(at + 3, -1.0)]
    found = take_parts(reads, outs)
    for (rows, idx, length, start), cache, got in zip(reads, caches, found, strict=True):
        ready = np.array([int(i) in cache for i in idx.tolist()])
        assert got == int(np.count_nonzero(ready))
        alone = [np.full((len(idx), 3, 5), 255, np.uint8), np.full(len(idx), -1.0)]
        assert rows.take(idx, length, alone)[2] == got
        for out, want in zip(outs, alone, strict=True):
            assert out[start : start + len(idx)].tobytes() == want.tobytes()
    assert outs[0][at:].tolist() == np.full((3, 3, 5), 255).tolist()
    assert outs[1][at:].tolist() == [-1.0] * 3
    bad = [(rows, idx.copy(), length, start) for rows, idx, length, start in reads]
    bad[1][1][5] = 30  # past the second cache's length
    again = [np.full((at + 3, 3, 5), 255, np.uint8), np.full(at + 3, -1.0)]
    assert take_parts(bad, again) == [found[0], -1, found[2]]
    assert again[0][: len(reads[0][1])].tobytes() == outs[0][: len(reads[0][1])].tobytes()
    for cache in caches:
        cache.close()
        mmapcache.remove(cache.path)


@needs_native
def test_the_compiled_take_parts_refuses_what_the_cache_never_passes_it() -> None:
    assert native is not None
    table, source = np.zeros((4, 8), np.uint8), np.zeros((4, 3), np.uint8)
    part = (table, 8, 2, np.array([0, 1], np.int64), (source,), 4, 0)
    with pytest.raises(TypeError, match="a part is"):
        native.take_parts((part[:6],), (np.zeros((2, 3), np.uint8),))
    with pytest.raises(TypeError, match="a tuple of parts"):
        native.take_parts([part], (np.zeros((2, 3), np.uint8),))
    with pytest.raises(ValueError, match="not rows of 3 to write 2 from row 1"):
        native.take_parts((part, (*part[:6], 1)), (np.zeros((2, 3), np.uint8),))
    with pytest.raises(TypeError, match="as many buffers"):
        native.take_parts((part,), ())
    assert native.take_parts((), (np.zeros((2, 3), np.uint8),)) == ()


@needs_native
@SETTINGS
@given(data=st.data())
def test_the_compiled_codes_give_what_numpy_gives(data: Any, monkeypatch: Any) -> None:
    """Weights of 1-20 sources (zeros too: empty intervals), any start phase: the sources numpy's searchsorted finds."""
    from mmapcache._region import gathers
    from mmapcache.torch import _draws

    weights = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=20).filter(any), label="weights")
    cuts = _draws.thresholds([float(w) for w in weights])
    start = data.draw(st.integers(0, _draws.MODULUS - 1), label="start phase")
    n = data.draw(st.integers(0, 3000), label="n")
    compiled = _draws.codes(start, n, cuts)
    monkeypatch.setattr(gathers, "native", None)
    assert compiled.tolist() == _draws.codes(start, n, cuts).tolist()
    assert all(weights[code] > 0 for code in set(compiled.tolist())), "a source of weight 0 is never drawn"


@needs_native
def test_the_compiled_codes_refuse_what_the_mixture_never_passes_them() -> None:
    assert native is not None
    out = np.empty(4, np.int64)
    with pytest.raises(ValueError, match="cuts run from 0 to the modulus"):
        native.codes(0, 3, 10, np.array([0, 5, 9]), out)
    with pytest.raises(ValueError, match="cuts must not decrease"):
        native.codes(0, 3, 10, np.array([0, 6, 5, 10]), out)
    with pytest.raises(ValueError, match="< modulus"):
        native.codes(10, 3, 10, np.array([0, 5, 10]), out)
    native.codes(8, 3, 10, np.array([0, 5, 10]), out)  # phases 8, 1, 4, 7
    assert out.tolist() == [1, 0, 0, 1]


@needs_native
@settings(max_examples=60, deadline=None, database=None)
@given(n=st.one_of(st.integers(0, 300), st.integers(0, 1 << 21)), seed=st.integers(0, 2**128 - 1))
def test_the_compiled_permute_is_numpys_permutation(n: int, seed: int) -> None:
    """Generator(PCG64(SeedSequence(seed))).permutation(n), exactly, for any length up to EXACT_MAX and any seed."""
    assert native is not None
    bits = np.random.PCG64(np.random.SeedSequence(seed))
    state = bits.state
    got = np.empty(n, np.int64)
    native.permute(state["state"]["state"], state["state"]["inc"], state["has_uint32"], state["uinteger"], got)
    assert np.array_equal(got, np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed))).permutation(n))


@needs_native
def test_the_compiled_permute_takes_a_buffered_draw_and_refuses_what_is_not_a_state() -> None:
    assert native is not None
    generator = np.random.Generator(np.random.PCG64(3))
    generator.integers(0, 2**32, dtype=np.uint32)  # a 32-bit draw: the other half of its 64 bits is buffered
    state = generator.bit_generator.state
    assert state["has_uint32"] == 1
    got = np.empty(1000, np.int64)
    native.permute(state["state"]["state"], state["state"]["inc"], state["has_uint32"], state["uinteger"], got)
    assert got.tolist() == generator.permutation(1000).tolist()
    with pytest.raises(ValueError, match=r"state must be an integer in \[0, 2\*\*128\)"):
        native.permute(2**128, 1, 0, 0, got)
    with pytest.raises(TypeError, match="inc must be an integer"):
        native.permute(1, 1.5, 0, 0, got)
    with pytest.raises(TypeError, match="int64"):
        native.permute(1, 1, 0, 0, np.empty(3, np.int32))
