"""The one writer of a mapped cache: every store of a sample's bytes goes through :class:`Writer`.

``Cache.put`` and ``Cache.put_many``, single flight's store of the slots it
held (``_region/flight.py``) and a stream's batch (``_stream.PartitionWriter``) are
thin callers of three entry points that share one store:

1. **the checks, before any slot is claimed**: the handle is writable, the
   batch is in storage form (``_region/values.py``), and every variable value fits a
   descriptor (``check_dimensions``) — a refused batch leaves every slot as
   it was;
2. **the handle's write lock** (threads of a process share the descriptor and
   its locks) and the check that the descriptor is open and safe to claim
   through;
3. the slots' bytes, by one of two mechanics:

   * **a slot at a time** (:meth:`Writer.put`, :meth:`Writer.put_many`): claim
     (the slot's kernel record lock), copy (variable values into the region
     first), checksum, publish READY, release; a slot READY or held by another
     writer is skipped. Slots the caller holds already (single flight,
     ``held=True``) skip the lock calls: marked WRITING, filled and published
     under the lock the caller holds, which the caller lets go of afterwards,
     a run of consecutive slots at a time;
   * **a fresh run** (:meth:`Writer.put_run`): slots handed out to one writer
     and never filled (a stream's fill), stored without per-slot locks by a
     ``pwrite`` per field and one publish for the batch (see
     :func:`_store_run`);

4. **the count** of slots written, in the file's counters.

Why ``pwrite`` for a fresh run rather than copies through the mapping: a
preallocated page that was never touched is zeroed by the kernel when it is
first mapped, and each 4 KiB page costs a fault; ``pwrite`` of whole pages
fills it without either (a 110 KB row took 38 µs through the mapping, 11 µs
with ``pwrite``, on the tmpfs here; same page cache, so every mapping sees the
bytes at once). A writer killed in the middle of a run leaves its slots EMPTY
(nothing published) or READY. A file system without room for a run's bytes
(``ENOSPC`` from ``pwrite``: blocks the file does not hold, on a copy-on-write
file system or after a hole was punched) stores none of them and says so in
the log; a write through the mapping would have killed the process with
``SIGBUS`` instead.

A variable region without room for a value stores nothing of its row: one
slot at a time, the slot stays a miss; in a run, the rows up to the first
value that does not fit are stored.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CacheError, ReadonlyCacheError
from .._field import Field
from .._file import write_all
from .._format import PAYLOAD_ALIGNMENT, checksum, checksums
from .allocator import Heap, place
from .handle import Handle
from .mapped import Mapped
from .slots import EMPTY, READY
from .values import coerce_batch, coerce_sample
from .variable import VariableColumn, check_dimensions

__all__ = ["Writer", "readonly_error"]

log = logging.getLogger("mmapcache")

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

Write = Callable[[bytes | memoryview, int], None]  # all of the bytes at an offset of the file

_PADS = [bytes(n) for n in range(PAYLOAD_ALIGNMENT)]  # after a value, up to the next multiple of 16


def readonly_error(path: Path, what: str) -> ReadonlyCacheError:
    """The error for a write (``what``) through a handle opened ``readonly=True``."""
    return ReadonlyCacheError(
        f"cannot {what}: {path} was opened with readonly=True; open it without readonly to write", path=path
    )


class Writer:
    """The one store of an open mapping: checks, write lock, claim / copy / checksum / publish, counts.

    ``Cache`` makes one per open handle; single flight and a stream's writer
    store through it. Methods raise the closed-cache ``ValueError`` once the
    handle's descriptor is closed.
    """

    __slots__ = ("capacity", "fields", "handle", "length", "mapped", "readonly")

    def __init__(
        self, handle: Handle, mapped: Mapped, fields: dict[str, Field], *, length: int, capacity: int, readonly: bool
    ) -> None:
        self.handle, self.mapped, self.fields = handle, mapped, fields
        self.length, self.capacity, self.readonly = length, capacity, readonly

    # -- the entry points ---------------------------------------------------------

    def put(self, index: int, sample: Mapping[str, Any]) -> bool:
        """Store ``sample`` at slot ``index`` (a valid index); False if it is not cacheable or taken.

        The cheap checks first: a slot READY already costs a state read, not
        a validation of the sample.
        """
        if self.readonly:
            raise readonly_error(self.handle.path, "put")
        if index >= self.capacity or self.mapped.states[index] == READY:
            return False
        arrays = self.checked(coerce_sample(sample, self.fields))
        return self._store(arrays, (index,), (None,), None) == 1

    def put_many(
        self, idx: np.ndarray[Any, Any], batch: Any, *, rows: Any = None, coerced: bool = False, held: bool = False
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Store row ``k`` of ``batch`` at slot ``idx[k]`` (valid indices); which rows were stored.

        Each slot is claimed, filled and published on its own: one that is
        not cacheable, READY, or held by another writer is skipped. ``held``:
        the caller holds every slot of ``idx`` (single flight); they are stored
        without lock calls and stay locked (the caller lets go). ``rows``:
        only those rows are stored (an array of row numbers). ``coerced``:
        ``batch`` is the list :func:`~._values.coerce_batch` makes, in field
        order, not converted again.
        """
        if self.readonly:
            raise readonly_error(self.handle.path, "put_many")
        stored = np.zeros(len(idx), bool)
        free = (idx < self.capacity) & ~self.mapped.slots.ready_mask(idx, self.capacity, self.length)
        todo = np.flatnonzero(free) if rows is None else rows[free[rows]]
        if not len(todo):
            return stored
        arrays = batch if coerced else coerce_batch(batch, self.fields, len(idx))
        if self.mapped.variables:
            self.checked(arrays)
        self._store(arrays, idx[todo].tolist(), todo.tolist(), stored, held=held)
        return stored

    def put_run(self, start: int, batch: Any, count: int, *, coerced: bool = False) -> int:
        """Store rows ``0 .. count - 1`` of ``batch`` in fresh slots ``start .. start + count - 1``; how many.

        The slots must be the caller's own: handed out to it, never filled.
        Returns all of them, or the rows up to the first whose variable values
        found no room, or none when the file system had no room for their
        bytes (logged). ``coerced``: the batch is in storage form already — per
        field, an array of shape ``(count, *shape)`` of its dtype (fixed
        fields) or a list of ``count`` arrays of its dtype that fit it
        (variable ones) — and is not converted again.
        """
        if self.readonly:
            raise readonly_error(self.handle.path, "store a run")
        if count <= 0:
            return 0
        if start < 0 or start + count > self.capacity:
            raise ValueError(
                f"slots {start}..{start + count - 1} are not in {self.handle.path} ({self.capacity} slots)"
            )
        arrays = [batch[name] for name in self.fields] if coerced else coerce_batch(batch, self.fields, count)
        return self._store(self.checked(arrays), range(start, start + count), None, None)

    # -- the one store ------------------------------------------------------------

    def checked(self, arrays: list[Any]) -> list[Any]:
        """``arrays`` (a sample's or a batch's, in field order) once every variable value fits a descriptor.

        Called before any slot is claimed: a refused batch leaves every slot as it was.
        """
        mapped = self.mapped
        if mapped.variables:
            for entry, values in zip(mapped.order, arrays, strict=True):
                if len(entry) == 2:
                    check_dimensions(entry[0], values)
        return arrays

    def _store(
        self,
        arrays: list[Any],
        slots: Sequence[int],
        rows: Sequence[int | None] | None,
        stored: np.ndarray[Any, np.dtype[np.bool_]] | None,
        *,
        held: bool = False,
    ) -> int:
        """Checked ``arrays`` stored under the write lock and counted; how many of ``slots`` were stored.

        ``rows[k]``: the row of each array that slot ``slots[k]`` takes
        (``None``: the arrays are one sample), and ``stored[rows[k]]`` set when
        it was stored; ``rows=None``: ``slots`` is a fresh run taking rows
        ``0 ..`` (:func:`_store_run`).
        """
        handle, mapped = self.handle, self.mapped
        written = 0
        with handle.write_lock:
            handle.check_usable(writing=True)
            if rows is None:
                assert isinstance(slots, range)
                written = _store_run(handle.fd, mapped, slots.start, arrays, len(slots))
            else:
                fill = _fill if not mapped.variables else _fill_variable
                for i, row in zip(slots, rows, strict=True):
                    if fill(mapped, i, arrays, row, held):
                        written += 1
                        if stored is not None:
                            stored[row] = True
        if written:
            handle.board.add(written=written)
        return written


# -- a slot at a time -----------------------------------------------------------------


def _fill(mapped: Mapped, index: int, arrays: list[np.ndarray[Any, Any]], row: int | None, held: bool = False) -> bool:
    """Claim, copy (row ``row`` of each array, or the arrays themselves), publish; False if taken.

    ``held``: the caller holds the slot's lock, and keeps it.
    """
    slots = mapped.slots
    if not (slots.mark_writing(index) if held else slots.claim(index)):
        return False
    try:
        parts = []  # the slot's bytes, field by field (a loop: no frame of its own)
        for (_, target), source, raw in zip(mapped.items, arrays, mapped.raws, strict=True):
            target[index] = source if row is None else source[row]
            parts.append(raw[index])
        slots.publish(index, checksum(parts))
        return True
    finally:
        if not held:
            slots.release(index)


def _fill_variable(mapped: Mapped, index: int, arrays: list[Any], row: int | None, held: bool = False) -> bool:
    """:func:`_fill` for a cache with variable fields: values go to this writer's extent first."""
    slots, heap = mapped.slots, mapped.heap
    assert heap is not None
    if not (slots.mark_writing(index) if held else slots.claim(index)):
        return False
    try:
        values = [source if row is None else source[row] for source in arrays]
        if not _place_one(mapped, heap, index, values):
            slots.states[index] = EMPTY  # nothing was stored: the slot stays a miss
            heap.warn_full(mapped.path)
            return False
        for entry, value in zip(mapped.order, values, strict=True):
            if len(entry) == 3:
                entry[1][index] = value
        parts = mapped.parts(index)
        assert parts is not None  # just written within bounds
        slots.publish(index, checksum(parts))
        return True
    finally:
        if not held:
            slots.release(index)


def _place_one(mapped: Mapped, heap: Heap, index: int, values: list[np.ndarray[Any, Any]]) -> bool:
    """Write slot ``index``'s variable values into the region; False when it has no room."""
    for entry, value in zip(mapped.order, values, strict=True):
        if len(entry) == 3:
            continue
        offset = heap.allocate(value.nbytes) if value.nbytes else 0
        if offset is None:
            return False
        entry[1].write(index, offset, value)
    return True


# -- a fresh run ------------------------------------------------------------------------


def _store_run(fd: int, mapped: Mapped, start: int, arrays: list[Any], count: int) -> int:
    """Rows ``0 .. count - 1`` into fresh slots from ``start``: how many were stored.

    The run's slots are EMPTY, never filled, and no other process is handed
    them, so the slot protocol of ``_region/slots.py`` holds without its per-slot
    lock: each fixed field's rows are written with one ``pwrite`` (they are
    contiguous in the file); each variable field's values are placed in one
    allocation of the region, written with one ``pwrite``, and their
    descriptors set with one array assignment; then the checksums of the
    rows, and every state READY (checksum before state, as ``publish``
    orders them).
    """
    slots = mapped.slots
    if np.any(slots.states[start : start + count] != EMPTY):
        raise CacheError(
            f"slots {start}..{start + count - 1} of {mapped.path} are not fresh: a run is stored only into slots "
            "handed out to its writer and never filled",
            path=mapped.path,
        )
    slots.synced[start : start + count] = 0  # before any byte of the rows (see _region/reboot.py)
    placed = _place_run(mapped, arrays, count)
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


def _place_run(mapped: Mapped, arrays: list[Any], count: int) -> dict[int, _Values]:
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
    rounded = place(sizes)
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
        offsets, data, packed, first = np.array(found, np.int64), data[: len(found)], False, 0
    return _Values(column, dims[: len(data)].astype("<u4"), offsets, data, packed, first)


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
