"""Vectorized reads of many slots into freshly allocated arrays: fixed rows, and ragged byte runs.

A gather into a buffer that sits a few bytes off a page boundary, while the
source rows are page aligned, can run many times slower (4K aliasing: the
CPU mistakes loads for dependents of earlier stores to the same low address
bits). Large glibc allocations sit 16 bytes off a page, so outputs are
allocated page aligned instead.

Ragged runs (:func:`gather_runs`: the values of a variable field, each at its
own offset of the variable region, with its own length) are copied into one
contiguous buffer without a Python object per run. numpy has no "copy these
byte runs" loop, but fancy indexing copies fixed-size items from any strided
view, so runs are cut into chunks of ``C`` bytes:

1. The output is a grid of ``C``-byte chunks. Chunk ``c`` starts at output
   byte ``c * C``, which lies in run ``r``; it is read from ``r``'s source at
   the same distance from the run's start, through a view of the region as
   overlapping ``C``-byte items one byte apart (one fancy index for all
   chunks). Its bytes past the end of run ``r`` are garbage.
2. Each run's first ``C`` bytes (its *head*) are copied again to where the run
   starts in the output, in run order, through a view of the output as
   overlapping ``C``-byte items (one fancy assignment). A head rewrites the
   garbage step 1 left after the previous run; its own bytes past its run's
   end are garbage that the next head rewrites, and the last one spills into
   ``C`` bytes of slack after the output. This relies on a fancy assignment
   writing its items in index order, which numpy's 1-D loop does
   (tests/region/test_jagged.py checks it against per-run copies).
3. A run that ends within ``C`` bytes of the region's end would read past it:
   its chunks are clamped (garbage) and the run is copied exactly at the end.

Runs of 16 KiB and more on average are copied with one ``concatenate`` of
per-run views instead: the views then cost nothing next to the copy.

A batch of fixed fields is read by :func:`take_ready`: each slot's state and, for
the READY ones, each field's row, in one pass of the compiled ``take`` (about a
third of the fixed cost of a state lookup plus one ``np.take`` per field, its
numpy twin), which asks for states and rows ahead of the copy (random rows of
a file without huge pages: each is a TLB and a cache miss). :class:`FixedRows`
is that read set up once per mapping, for the hot paths.

That is the fallback. Where the optional compiled gather (``_cgather.c``) was
built, a variable field's batch is read by one call of it instead — descriptors
read and checked, one ``memcpy`` per row, offsets filled — which takes about a
tenth of the numpy calls' fixed cost. :data:`native` is that module, or ``None``
when it was not built or ``MMAPCACHE_NO_EXTENSION=1`` turns it off (the two
give the same batches: tests/region/test_cgather.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "FixedRows",
    "accelerated",
    "compiled",
    "empty_aligned",
    "gather",
    "gather_runs",
    "native",
    "take_parts",
    "take_ready",
]


def _load_native() -> ModuleType | None:
    """The compiled gather, unless it was not built or ``MMAPCACHE_NO_EXTENSION`` (not ``0``) turns it off."""
    if os.environ.get("MMAPCACHE_NO_EXTENSION", "0") not in ("", "0"):
        return None
    try:
        from . import _cgather  # built by setup.py when a C compiler is there
    except ImportError:
        return None
    module: ModuleType = _cgather
    return module


native = _load_native()
accelerated = native is not None  # public as mmapcache.accelerated


def compiled() -> ModuleType | None:
    """The compiled gather in use now (``native``, read at each call: tests turn it off), or ``None``."""
    return native


PAGE = 4096


ALIGNED_ROWS = 2048  # rows of at least this many bytes are gathered into page-aligned buffers


def empty_aligned(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """An uninitialised array of rows (``shape[0]`` of them) whose data starts on a page boundary.

    Only rows of :data:`ALIGNED_ROWS` bytes or more alias (their sources are
    page aligned and large): an array of smaller rows, or a small one, is a
    plain ``np.empty``, whose allocation costs a fifth as much (measured at
    256 rows of 64 B: 0.4 µs against 3.4 µs, and the gather into it 3.2 µs
    against 8.6 µs in all).
    """
    nbytes = math.prod(shape) * dtype.itemsize  # math.prod: ~0.1 µs where np.prod takes ~3 µs
    if nbytes < PAGE or (shape and shape[0] and nbytes // shape[0] < ALIGNED_ROWS):
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.__array_interface__["data"][0] % PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def gather(source: np.ndarray[Any, Any], indices: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, Any]:
    """``source[indices]`` as a new array; ``indices`` must already be in range.

    ``mode="clip"`` because numpy buffers ``take(..., out=)`` in the default
    ``mode="raise"``, copying every row twice.
    """
    out = empty_aligned((len(indices), *source.shape[1:]), source.dtype)
    np.take(source, indices, axis=0, out=out, mode="clip")
    return out


def take_ready(
    states: np.ndarray[Any, np.dtype[np.uint8]],
    ready: int,
    indices: np.ndarray[Any, np.dtype[np.intp]],
    sources: tuple[np.ndarray[Any, Any], ...],
    length: int,
    outs: list[np.ndarray[Any, Any]] | None = None,
) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.bool_]], int]:
    """Rows ``indices`` of each of ``sources`` (fixed fields), which slots were ``ready``, and how many.

    ``states`` is the slot table's state column (a strided view of its
    records); ``indices`` must lie in ``[0, length)`` — the count is -1 when
    one does not (the caller raises; nothing else is meaningful then) — and
    one past the table is never ready. The rows go into ``outs``
    (C-contiguous, writable, checked by the caller) or new arrays; those of
    slots that are not ready are left as they were. Through the compiled
    ``take`` when it is there (one pass: a state, then its rows), else
    :func:`take_ready_numpy` (the same result). :class:`FixedRows` is this
    read set up once for a mapping's fields.
    """
    rows = FixedRows(states, ready, {str(k): source for k, source in enumerate(sources)})
    outs, hits, found = rows.take(indices, length, outs)
    assert hits is not None
    return outs, hits, found


_INT64 = np.dtype(np.int64)


class FixedRows:
    """The fixed fields of a mapping, read a batch at a time by :func:`take_ready`'s pass, set up once.

    :meth:`take` is the hot read of ``Cache.get_many``, ``Cache.read_many`` and
    the torch layer's batches: it allocates one output per field and makes one
    call of the compiled ``take`` (or its numpy twin), with everything that
    does not change between calls — the slot table, the sources, each output's
    row shape and whether it is page aligned — worked out here (the per-call
    Python costs as much as the copy of 256 small rows).
    """

    __slots__ = ("_allocate", "_numpy_only", "_record", "_table", "names", "ready", "sources", "states")

    def __init__(self, states: np.ndarray[Any, np.dtype[np.uint8]], ready: int, arrays: dict[str, Any]) -> None:
        self.states, self.ready = states, ready
        self.names: tuple[str, ...] = tuple(arrays)
        self.sources: tuple[np.ndarray[Any, Any], ...] = tuple(arrays.values())
        self._table, self._record = states.base, states.strides[0]
        self._numpy_only = any(source.dtype.kind in "mM" for source in self.sources)  # datetimes export no buffer
        # (row shape, dtype, page aligned) of each output: see empty_aligned.
        self._allocate = tuple(
            (source.shape[1:], source.dtype, source.dtype.itemsize * math.prod(source.shape[1:]) >= ALIGNED_ROWS)
            for source in self.sources
        )

    def empty(self, count: int) -> list[np.ndarray[Any, Any]]:
        """One uninitialised output of ``count`` rows per field, as :func:`empty_aligned` makes them."""
        return [
            empty_aligned((count, *tail), dtype) if aligned else np.empty((count, *tail), dtype)
            for tail, dtype, aligned in self._allocate
        ]

    def take(
        self,
        indices: np.ndarray[Any, np.dtype[np.intp]],
        length: int,
        outs: list[np.ndarray[Any, Any]] | None = None,
        *,
        hits: bool = True,
        at: int = 0,
    ) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.bool_]] | None, int]:
        """:func:`take_ready` of every field: ``(outputs, hits, found)``; ``hits=False`` skips the mask (None).

        ``at``: the rows of ``outs`` read into start there (``outs`` hold at least ``at + len(indices)``
        rows), so that a batch read from several files is read into its arrays a file at a time.
        """
        if outs is None:  # self.empty(), inline: a call and a comprehension cost as much as the allocation
            outs = []
            count = len(indices)
            for tail, dtype, aligned in self._allocate:
                outs.append(empty_aligned((count, *tail), dtype) if aligned else np.empty((count, *tail), dtype))
        compiled = native
        if compiled is None or self._numpy_only:
            count = len(indices)
            into = [out[at : at + count] for out in outs] if at or any(len(out) != count for out in outs) else outs
            return outs, *_take_ready_numpy(self.states, self.ready, indices, self.sources, length, into)
        mask = np.empty(len(indices), np.bool_) if hits else None
        wanted = indices if indices.dtype == _INT64 and indices.flags.c_contiguous else indices.astype(np.int64)
        found = compiled.take(
            self._table, self._record, self.ready, wanted, self.sources, tuple(outs), mask, length, at
        )
        return outs, mask, found


def take_parts(
    parts: Sequence[tuple[FixedRows, np.ndarray[Any, np.dtype[np.intp]], int, int]],
    outs: Sequence[np.ndarray[Any, Any]],
) -> list[int]:
    """:meth:`FixedRows.take` of several mappings into one batch: ``(rows, indices, length, at)`` a part.

    Each part's rows go to rows ``at ..`` of ``outs`` (whose fields every part has, row for
    row); returns each part's count of READY slots (a count below its number of indices:
    some were not READY, their rows left as they were; -1: an index not in ``[0, length)``).
    The compiled ``take_parts`` reads them all in one pass, its look-ahead running on from
    one part to the next; else one :meth:`FixedRows.take` a part (the same result).
    """
    compiled = native
    given = []  # a loop, not generators: this runs once a mixture batch
    for rows, indices, length, at in parts:
        if compiled is None or rows._numpy_only:
            return [rows.take(indices, length, list(outs), hits=False, at=at)[2] for rows, indices, length, at in parts]
        wanted = indices if indices.dtype == _INT64 and indices.flags.c_contiguous else indices.astype(np.int64)
        given.append((rows._table, rows._record, rows.ready, wanted, rows.sources, length, at))
    if compiled is None:  # no parts
        return []
    return list(compiled.take_parts(tuple(given), tuple(outs)))


def take_ready_numpy(
    states: np.ndarray[Any, np.dtype[np.uint8]],
    ready: int,
    indices: np.ndarray[Any, np.dtype[np.intp]],
    sources: tuple[np.ndarray[Any, Any], ...],
    length: int,
    outs: list[np.ndarray[Any, Any]] | None = None,
) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.bool_]], int]:
    """:func:`take_ready` in numpy: the states by one fancy index, then one ``np.take`` per field."""
    if outs is None:
        outs = [empty_aligned((len(indices), *source.shape[1:]), source.dtype) for source in sources]
    return outs, *_take_ready_numpy(states, ready, indices, sources, length, outs)


def _take_ready_numpy(
    states: np.ndarray[Any, np.dtype[np.uint8]],
    ready: int,
    indices: np.ndarray[Any, np.dtype[np.intp]],
    sources: tuple[np.ndarray[Any, Any], ...],
    length: int,
    outs: list[np.ndarray[Any, Any]],
) -> tuple[np.ndarray[Any, np.dtype[np.bool_]], int]:
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= length):
        return np.zeros(len(indices), bool), -1
    if not len(indices) or int(indices.max()) < len(states):
        hits: np.ndarray[Any, np.dtype[np.bool_]] = states[indices] == ready
    else:
        hits = np.zeros(len(indices), bool)
        cacheable = indices < len(states)
        hits[cacheable] = states[indices[cacheable]] == ready
    found = int(np.count_nonzero(hits))
    if found == len(indices):
        for source, out in zip(sources, outs, strict=True):
            np.take(source, indices, axis=0, out=out, mode="clip")  # mode="clip": see gather()
    elif found:
        rows = np.flatnonzero(hits)
        for source, out in zip(sources, outs, strict=True):
            out[rows] = source[indices[rows]]
    return hits, found


LARGE_RUNS = 16 * 1024  # mean run bytes from which per-run views + one concatenate win


def _chunk_size(mean: float) -> int:
    """The chunk for runs of ``mean`` bytes (measured in benchmarks/bench_variable.py: per-chunk cost vs slack)."""
    return 256 if mean < 512 else 512


def _chunks(region: np.ndarray[Any, np.dtype[np.uint8]], size: int) -> np.ndarray[Any, Any]:
    """``region`` as overlapping ``size``-byte items, one byte apart (item ``i`` is ``region[i:i + size]``)."""
    chunks: np.ndarray[Any, Any] = np.ndarray(
        (len(region) - size + 1,), np.dtype((np.void, size)), buffer=region, strides=(1,)
    )
    return chunks


def gather_runs(
    region: np.ndarray[Any, np.dtype[np.uint8]],
    starts: np.ndarray[Any, np.dtype[np.int64]],
    bounds: np.ndarray[Any, np.dtype[np.int64]],
    *,
    views: dict[int, np.ndarray[Any, Any]] | None = None,
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The byte runs ``region[starts[k]:starts[k] + bounds[k + 1] - bounds[k]]``, back to back.

    ``bounds`` (``len(starts) + 1`` entries from 0) are where each run goes in
    the output; every run must lie within ``region``. Returns a fresh buffer
    whose first ``bounds[-1]`` bytes are the runs (it may be longer).
    ``views`` caches the chunk views of ``region`` between calls.
    """
    total = int(bounds[-1])
    count = len(starts)
    out: np.ndarray[Any, np.dtype[np.uint8]]
    if total == 0:
        return np.empty(0, np.uint8)
    if total >= LARGE_RUNS * count:
        out = np.empty(total, np.uint8)
        ends = bounds[1:] - bounds[:-1] + starts
        np.concatenate([region[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)], out=out)
        return out
    size = _chunk_size(total / count)
    if len(region) < size:  # a tiny region: no chunk fits in it
        out = np.empty(total, np.uint8)
        for k, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
            out[a:b] = region[int(starts[k]) : int(starts[k]) + b - a]
        return out
    source = None if views is None else views.get(size)
    if source is None:
        source = _chunks(region, size)
        if views is not None:
            views[size] = source
    last = len(region) - size
    # 1. The grid: chunk c comes from the run holding output byte c * size.
    firsts = -(-bounds // size)  # the first chunk starting in each run
    grid = int(firsts[-1])
    where = np.zeros(grid + 1, np.int64)  # one chunk more (from offset 0): slack for the last head
    where[:grid] = np.repeat(starts - bounds[:-1], np.diff(firsts))
    where[:grid] += np.arange(0, grid * size, size)
    ends = starts + np.diff(bounds)
    unsafe = np.flatnonzero(ends > last) if int(ends.max()) > last else ()
    if len(unsafe):
        np.minimum(where, last, out=where)
    out = source[where].view(np.uint8)
    # 2. The heads, in run order.
    heads = _chunks(out, size)
    heads[bounds[:-1]] = source[np.minimum(starts, last) if len(unsafe) else starts]
    # 3. Runs near the region's end, exactly.
    for k in np.asarray(unsafe, np.intp).tolist():
        a, b, start = int(bounds[k]), int(bounds[k + 1]), int(starts[k])
        out[a:b] = region[start : start + b - a]
    return out
