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
for every value stores the rows up to the first value that does not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checksum import checksum
from ._errors import CacheError
from ._heap import Heap
from ._mapping import Mapped
from ._slots import EMPTY, READY
from ._values import coerce_batch
from ._variable import VariableColumn
from .cache import Cache

__all__ = ["store_run"]

_ZEROS = np.zeros(16, np.uint8)  # padding between values (each starts on a multiple of 16)


def store_run(cache: Cache, start: int, batch: Any, count: int) -> int:
    """Store rows ``0 .. count - 1`` of ``batch`` (as ``put_many`` takes it) in slots ``start .. start + count - 1``.

    The slots must be fresh and the caller's own (handed out to it, never
    filled). Returns how many rows were stored: all of them, or the rows up to
    the first whose variable values found no room.
    """
    mapped = cache._live()  # the core's own view of the mapping
    handle = cache._handle
    if cache._readonly:
        raise cache._readonly_error("store_run")
    if count <= 0:
        return 0
    if start < 0 or start + count > cache.capacity:
        raise ValueError(f"slots {start}..{start + count - 1} are not in {cache.path} ({cache.capacity} slots)")
    arrays = coerce_batch(batch, cache.fields, count)
    if mapped.variables:
        mapped.check_dimensions(arrays)
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
    fit = min((len(values.offsets) for values in placed.values()), default=count)
    parts: list[list[tuple[Any, ...]]] = []  # per field in file order, per row: its checksum parts
    for k, entry in enumerate(mapped.order):
        values = placed.get(k)
        if values is not None:
            parts.append(_write_values(fd, mapped.layout.variable_offset, values, start, fit))
        else:
            parts.append(_write_fixed(fd, mapped.layout.field_offsets[entry[0]], arrays[k], start, fit))
    sums = np.fromiter((checksum([p for field in parts for p in field[r]]) for r in range(fit)), np.uint32, fit)
    slots.checksums[start : start + fit] = sums
    slots.states[start : start + fit] = READY
    return fit


def _write_fixed(fd: int, offset: int, rows: Any, start: int, fit: int) -> list[tuple[Any, ...]]:
    """Write a fixed field's first ``fit`` rows at slots ``start ..``; each row's checksum part."""
    if not fit:
        return []
    flat = np.ascontiguousarray(rows[:fit]).reshape(fit, -1).view(np.uint8)
    _pwrite(fd, flat, offset + start * flat.shape[1])
    return [(row,) for row in flat]


@dataclass
class _Values:
    """One variable field's values of a run: where each goes in the region, and its bytes."""

    column: VariableColumn
    shapes: np.ndarray[Any, Any]  # (rows, ndim) uint32, as the descriptors hold them
    offsets: np.ndarray[Any, Any]  # where each value starts in the region
    data: list[np.ndarray[Any, Any]]  # each value's bytes, contiguous
    packed: bool  # one allocation: value r + 1 follows value r (at a multiple of 16)


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
    data = [np.ascontiguousarray(value).reshape(-1).view(np.uint8) for value in values]
    sizes = np.fromiter((len(bytes_) for bytes_ in data), np.int64, len(data))
    rounded = -(-sizes // 16) * 16
    total = int(rounded.sum())
    first = heap.allocate(total, tally=False) if total else 0
    if first is not None:
        offsets = np.where(sizes > 0, first + np.cumsum(rounded) - rounded, 0)  # an empty value points nowhere
        packed = True
    else:  # no room for them all: value by value, up to the first that does not fit
        found: list[int] = []
        for size in sizes.tolist():
            offset = heap.allocate(size) if size else 0
            if offset is None:
                break
            found.append(offset)
        offsets, data, packed = np.array(found, np.int64), data[: len(found)], False
    shapes = np.array([value.shape for value in values[: len(data)]], "<u4").reshape(len(data), len(column.field.shape))
    return _Values(column, shapes, offsets, data, packed)


def _write_values(fd: int, region: int, values: _Values, start: int, fit: int) -> list[tuple[Any, ...]]:
    """Write the first ``fit`` values and their descriptors at slots ``start ..``; each row's checksum parts."""
    if not fit:
        return []
    data = values.data[:fit]
    if values.packed:
        pieces: list[Any] = []
        for bytes_ in data:
            pieces.append(bytes_)
            if len(bytes_) % 16:
                pieces.append(_ZEROS[: 16 - len(bytes_) % 16])
        _pwrite(fd, np.concatenate(pieces), region + int(values.offsets[0]))
    else:
        for bytes_, offset in zip(data, values.offsets.tolist(), strict=False):
            _pwrite(fd, bytes_, region + offset)
    column = values.column
    column.dims[start : start + fit] = values.shapes[:fit]
    column.offsets[start : start + fit] = values.offsets[:fit]
    return [(shape.view(np.uint8), bytes_) for shape, bytes_ in zip(values.shapes[:fit], data, strict=False)]


def _pwrite(fd: int, data: np.ndarray[Any, Any], offset: int) -> None:
    """All of ``data`` at ``offset`` of the file (``pwrite`` may write less than asked)."""
    view = data.data.cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
