"""Storing a batch into a run of fresh slots that one writer owns: a few system calls per batch, not per row.

The fill of a stream cache (``_stream.PartitionWriter``) takes its slots from
the stream region's counter, which only grows: the slots of a run are EMPTY,
were never filled, and no other process is handed them. So the slot protocol
of ``_slots.py`` holds without its per-slot lock, and a batch is stored with

1. each fixed field's rows written with one ``pwrite`` (the run's rows of a
   field are contiguous in the file);
2. each variable field's values placed in one allocation of the variable
   region, copied into one buffer and written with one ``pwrite``, and their
   descriptors set with one array assignment;
3. the checksums of the rows, then every state READY (checksum before state,
   slot by slot, as ``publish`` orders them).

``pwrite`` rather than copies through the mapping: a preallocated page that
was never touched is zeroed by the kernel when it is first mapped, and each
4 KiB page costs a fault; ``pwrite`` of whole pages fills it without either
(a 110 KB row took 38 µs through the mapping, 11 µs with ``pwrite``, on the
tmpfs here; same page cache, so every mapping sees the bytes at once).

A writer killed in the middle leaves slots EMPTY (nothing published) or
READY; the caller counts them only after this returns (``_partitions.py``),
so either way they are holes nobody serves. A variable region without room
for every value stores the rows up to the first value that does not fit. A
file system without room for the bytes (``ENOSPC`` from ``pwrite``: blocks the
file does not hold, on a copy-on-write file system or after a hole was
punched) stores none of them and says so in the log; a write through the
mapping would have killed the process with ``SIGBUS`` instead.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checksum import checksums
from ._errors import CacheError
from ._file import write_all
from ._format import PAYLOAD_ALIGNMENT
from ._heap import Heap
from ._mapping import Mapped
from ._slots import EMPTY, READY
from ._values import coerce_batch
from ._variable import MAX_DIMENSION, VariableColumn, check_dimensions
from .cache import Cache

__all__ = ["store_run"]

log = logging.getLogger("mmapcache")

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

Write = Callable[[bytes | memoryview, int], None]  # all of the bytes at an offset of the file

_PADS = [bytes(n) for n in range(PAYLOAD_ALIGNMENT)]  # after a value, up to the next multiple of 16


def store_run(cache: Cache, start: int, batch: Any, count: int, *, checked: bool = False) -> int:
    """Store rows ``0 .. count - 1`` of ``batch`` (as ``put_many`` takes it) in slots ``start .. start + count - 1``.

    The slots must be fresh and the caller's own (handed out to it, never
    filled). Returns how many rows were stored: all of them, or the rows up to
    the first whose variable values found no room, or none when the file
    system had no room for their bytes (logged). ``checked``: the batch is
    already in storage form — per field, an array of shape ``(count,
    *shape)`` of its dtype (fixed fields) or a list of ``count`` arrays of its
    dtype that fit it (variable ones) — and is not converted again.
    """
    mapped = cache._live()  # the core's own view of the mapping
    handle = cache._handle
    if cache._readonly:
        raise cache._readonly_error("store_run")
    if count <= 0:
        return 0
    if start < 0 or start + count > cache.capacity:
        raise ValueError(f"slots {start}..{start + count - 1} are not in {cache.path} ({cache.capacity} slots)")
    arrays = [batch[name] for name in cache.fields] if checked else coerce_batch(batch, cache.fields, count)
    with handle.write_lock:
        handle.check_usable(writing=True)
        stored = _store(handle.fd, mapped, start, arrays, count)
    cache._board.add(written=stored)
    return stored


def _store(fd: int, mapped: Mapped, start: int, arrays: list[Any], count: int) -> int:
    slots = mapped.slots
    if np.any(slots.states[start : start + count] != EMPTY):
        raise CacheError(
            f"slots {start}..{start + count - 1} of {mapped.path} are not fresh: a run is stored only into slots "
            "handed out to its writer and never filled",
            path=mapped.path,
        )
    slots.synced[start : start + count] = 0  # before any byte of the rows (see _boot.py)
    placed = _place(mapped, arrays, count)
    write = functools.partial(write_all, fd, path=mapped.path)
    fit = min((len(values.offsets) for values in placed.values()), default=count)
    columns: list[Sequence[Any]] = []  # each checksum part, in field order, for every row
    try:
        for k, entry in enumerate(mapped.order):
            values = placed.get(k)
            if values is not None:
                columns.extend(_write_values(write, mapped.layout.variable_offset, values, start, fit))
            else:
                columns.append(_write_fixed(write, mapped.layout.field_offsets[entry[0]], arrays[k], start, fit))
    except OSError as error:
        if error.errno not in _NO_ROOM:
            raise
        log.warning(
            "no space left on the file system of %s to write %d rows (%s): they stay empty, nothing cached is "
            "lost. Its preallocated blocks were not kept for it (a copy-on-write or compressing file system, or "
            "a hole punched in the file); free space there, or put caches elsewhere with MMAPCACHE_DIR",
            mapped.path,
            fit,
            error.strerror,
        )
        return 0  # the slots stay EMPTY: never published
    slots.checksums[start : start + fit] = checksums(columns, fit)
    slots.states[start : start + fit] = READY
    return fit


def _write_fixed(write: Write, offset: int, rows: Any, start: int, fit: int) -> list[Any]:
    """Write a fixed field's first ``fit`` rows at slots ``start ..``; each row's bytes."""
    if not fit:
        return []
    flat = np.ascontiguousarray(rows[:fit]).reshape(fit, -1).view(np.uint8)
    width = flat.shape[1]
    if not width:  # a field of shape (0,): nothing to write, an empty part to hash
        return [b""] * fit
    data = flat.reshape(-1).data
    write(data, offset + start * width)
    return [data[i : i + width] for i in range(0, fit * width, width)]


@dataclass
class _Values:
    """One variable field's values of a run: where each goes in the region, and its bytes."""

    column: VariableColumn
    shapes: np.ndarray[Any, Any]  # (rows, ndim) uint32, as the descriptors hold them
    offsets: np.ndarray[Any, Any]  # where each value starts in the region (0 for an empty value)
    data: list[memoryview]  # each value's bytes
    packed: bool  # one allocation: value r + 1 follows value r (at a multiple of 16)
    first: int  # packed: where the allocation starts (not offsets[0], which is 0 when value 0 is empty)


def _place(mapped: Mapped, arrays: list[Any], count: int) -> dict[int, _Values]:
    """Room in the variable region for each variable field's values (by field position in file order).

    Fewer offsets than rows: the region had no room for the next value, and
    the rows from there on are not stored (nor placed for later fields).
    """
    placed: dict[int, _Values] = {}
    fit = count
    for k, entry in enumerate(mapped.order):
        if len(entry) == 3:
            continue
        assert mapped.heap is not None
        values = _values(mapped.heap, entry[1], arrays[k][:fit])
        fit = min(fit, len(values.offsets))
        placed[k] = values
    if fit < count:
        assert mapped.heap is not None
        mapped.heap.warn_full(mapped.path)
    return placed


def _values(heap: Heap, column: VariableColumn, values: list[Any]) -> _Values:
    data = [_bytes(value) for value in values]
    sizes = np.array([len(bytes_) for bytes_ in data], np.int64)
    ndim = len(column.field.shape)
    if ndim == 1:  # the commonest (tokens, text): the shapes follow from the sizes
        dims = (sizes // column.dtype.itemsize).reshape(len(values), 1)
    else:
        dims = np.array([value.shape for value in values], np.int64).reshape(len(values), ndim)
    if dims.size and int(dims.max()) > MAX_DIMENSION:
        check_dimensions(column.name, values)  # raises, naming the value, before any room is taken
    rounded = -(-sizes // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT
    total = int(rounded.sum())
    first = heap.allocate(total, tally=False) if total else 0
    if first is not None:
        offsets = np.where(sizes > 0, first + np.cumsum(rounded) - rounded, 0)  # an empty value points nowhere
        packed = True
        start = first
    else:  # no room for them all: value by value, up to the first that does not fit
        found: list[int] = []
        for size in sizes.tolist():
            offset = heap.allocate(size) if size else 0
            if offset is None:
                break
            found.append(offset)
        offsets, data, packed, start = np.array(found, np.int64), data[: len(found)], False, 0
    return _Values(column, dims[: len(data)].astype("<u4"), offsets, data, packed, start)


def _bytes(value: np.ndarray[Any, Any]) -> memoryview:
    """A value's bytes, in C order, without a copy where it can."""
    try:
        return np.ascontiguousarray(value).data.cast("B")
    except TypeError:  # a view with a 0 in its shape or strides cannot be cast
        return memoryview(value.tobytes())


def _write_values(write: Write, region: int, values: _Values, start: int, fit: int) -> tuple[list[Any], list[Any]]:
    """Write the first ``fit`` values and their descriptors at slots ``start ..``; each row's shape bytes and bytes."""
    if not fit:
        return [], []
    data = values.data[:fit]
    if values.packed:
        pieces: list[Any] = []
        for bytes_ in data:
            pieces += (bytes_, _PADS[-len(bytes_) % PAYLOAD_ALIGNMENT])
        write(b"".join(pieces), region + values.first)
    else:
        for bytes_, offset in zip(data, values.offsets.tolist(), strict=False):
            write(bytes_, region + offset)
    column = values.column
    shapes = np.ascontiguousarray(values.shapes[:fit])
    column.dims[start : start + fit] = shapes
    column.offsets[start : start + fit] = values.offsets[:fit]
    raw, width = shapes.tobytes(), shapes.shape[1] * 4
    return [raw[i : i + width] for i in range(0, fit * width, width)], data
