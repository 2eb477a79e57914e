"""Variable-shape fields in a mapping: each slot's descriptor (where its value lies, its shape).

A variable field's region holds one descriptor per slot (``_format``:
uint64 offset into the variable region, then one uint32 per dimension); the
value itself lives in the variable region (``_heap``). The slot checksum
chains, for such a field, the shape's uint32 bytes and then the value's bytes,
so a descriptor or value that does not belong together fails verification.

Reads are the hot path, so descriptors are read through ``memoryview`` casts
(a Python int per index, no numpy scalar), a value is copied out of a typed
view of the region (two numpy calls), and a batch is read, validated and
copied into one buffer, a :class:`Jagged`, by one call of the compiled gather
(``_cgather.c``) or, without it, by array operations and ``_gather.gather_runs``.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from typing import Any

import numpy as np

from .._field import Field
from .._format import PAYLOAD_ALIGNMENT, descriptor_nbytes
from . import gathers as _gather
from .gathers import gather_runs
from .jagged import Jagged, split_shape

__all__ = [
    "MAX_DIMENSION",
    "NO_ROWS",
    "VariableColumn",
    "check_dimensions",
    "shape_bytes",
    "text_value",
    "texts",
    "value_bytes",
]

_DIM = np.dtype("<u4")
_OFFSET = np.dtype("<u8")
_LITTLE = sys.byteorder == "little"
_INT64 = np.dtype(np.int64)
_FRAGMENT = np.dtype([("offset", "<u8"), ("length", "<u4"), ("unused", "<u4")])  # a 1-D descriptor's layout
NO_ROWS = np.zeros(0, np.intp)  # an empty, read-only row list (no row failed)
NO_ROWS.flags.writeable = False


MAX_DIMENSION = 2**32 - 1  # a descriptor holds one uint32 per dimension


def check_dimensions(name: str, values: Any) -> None:
    """Refuse values of a variable field ``name`` with a dimension a descriptor cannot hold (``ValueError``).

    ``values`` is one array or a list of them (a batch). Called before any
    slot is claimed, so a refused value leaves every slot as it was.
    """
    for value in values if isinstance(values, list) else (values,):
        if value.shape and max(value.shape) > MAX_DIMENSION:
            raise ValueError(
                f"field {name!r}: a value of shape {value.shape} has a dimension of {max(value.shape)}, more "
                f"than the cache format holds (2**32 - 1 = {MAX_DIMENSION} per dimension); split the value"
            )


def value_bytes(dims: np.ndarray[Any, Any], itemsize: int) -> int:
    """Bytes of the values whose descriptors' shapes are the rows of ``dims`` (one uint32 per dimension)."""
    return int(dims.astype(np.int64).prod(axis=1).sum()) * itemsize


def text_value(kind: str, value: np.ndarray[Any, Any]) -> str | bytes | None:
    """A text field's stored bytes as the ``str`` (UTF-8) or ``bytes`` they are; None when they do not decode."""
    raw = value.tobytes()
    if kind == "bytes":
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def texts(kind: str, values: list[Any]) -> tuple[list[Any], list[int]]:
    """:func:`text_value` of each value (``None`` stays ``None``), and the rows that do not decode."""
    out: list[Any] = [None if value is None else text_value(kind, value) for value in values]
    return out, [row for row, (a, b) in enumerate(zip(values, out, strict=True)) if a is not None and b is None]


def shape_bytes(shape: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes a shape contributes to the slot checksum: one little-endian uint32 per dimension."""
    return np.asarray(shape, _DIM).view(np.uint8)


class VariableColumn:
    """The descriptors of one variable field in a mapping, and reads and writes through them."""

    __slots__ = (
        "_align",
        "_alloc",
        "_chunk_views",
        "_descriptors",
        "_dim_words",
        "_dims",
        "_dims_mv",
        "_fixed_axes",
        "_head",
        "_item",
        "_may_overflow",
        "_ndim",
        "_offset_words",
        "_offsets_mv",
        "_region",
        "_row_bytes",
        "_rows",
        "_size",
        "_table",
        "_tail",
        "_typed",
        "_unit",
        "_unit_tail",
        "_width",
        "dims",
        "dtype",
        "field",
        "name",
        "offsets",
    )

    def __init__(
        self, name: str, field: Field, buffer: Any, offset: int, capacity: int, region: np.ndarray[Any, Any]
    ) -> None:
        self.name, self.field, self.dtype = name, field, field.dtype
        self._ndim = ndim = len(field.shape)
        width = descriptor_nbytes(field)
        table = np.ndarray((capacity, width), np.uint8, buffer=buffer, offset=offset)
        self.offsets: np.ndarray[Any, Any] = table[:, :8].view(_OFFSET)[:, 0]
        self.dims: np.ndarray[Any, Any] = table[:, 8 : 8 + 4 * ndim].view(_DIM)
        # Whole descriptors as one item each: a batch reads them with one fancy index.
        self._table: np.ndarray[Any, Any] = np.ndarray(
            (capacity,), np.dtype((np.void, width)), buffer=buffer, offset=offset
        )
        # Fast scalar access: word k of slot i is at i * words_per_slot + k.
        raw = memoryview(buffer)[offset : offset + capacity * width]
        self._offsets_mv = raw.cast("Q") if _LITTLE and capacity else None
        self._dims_mv = raw.cast("I") if _LITTLE and capacity else None
        self._offset_words, self._dim_words = width // 8, width // 4
        self._fixed_axes = tuple((axis, d) for axis, d in enumerate(field.shape) if d is not None)
        # A batch read: the dimensions up to the last variable one count units of the fixed rest.
        self._head, self._unit_tail = split_shape(field.shape)
        self._unit = math.prod(self._unit_tail) * field.dtype.itemsize
        self._chunk_views: dict[int, np.ndarray[Any, Any]] = {}
        # What the compiled gather takes: the table as bytes, the shape with -1 where it varies, and
        # how to allocate the values (a shape tuple in, an array out).
        self._descriptors, self._width = table, width
        self._dims = tuple(-1 if d is None else d for d in field.shape)
        self._alloc = functools.partial(np.empty, dtype=field.dtype)
        # Whether a descriptor's element count can pass int64 (several variable dims, or a large tail).
        self._may_overflow = MAX_DIMENSION**self._head * max(self._unit, 1) >= 2**63
        self._region, self._size, self._item = region, len(region), field.dtype.itemsize
        # Every value starts on a multiple of PAYLOAD_ALIGNMENT, so of its itemsize (up to that): an offset
        # that is not is a damaged descriptor, for every read alike.
        self._align = math.gcd(self._item, PAYLOAD_ALIGNMENT)
        # A view of the region in the field's dtype, when every value's offset is a multiple of its itemsize.
        usable = len(region) // self._item * self._item
        self._typed = region[:usable].view(field.dtype) if PAYLOAD_ALIGNMENT % self._item == 0 else None
        # Only the first dimension varies ((None, 4): boxes; (None, 80): spectrogram frames): a view of
        # the region as rows of the fixed tail reads a value with one slice and one copy.
        self._rows: np.ndarray[Any, Any] | None = None
        self._tail: tuple[int, ...] = ()
        self._row_bytes = 0
        tail = field.shape[1:]
        if ndim >= 2 and field.shape[0] is None and None not in tail and self._typed is not None:
            self._tail = tuple(d for d in tail if d is not None)
            row_items = math.prod(self._tail)
            if row_items:
                self._rows = self._typed[: len(self._typed) // row_items * row_items].reshape(-1, *self._tail)
                self._row_bytes = row_items * self._item

    def shape(self, index: int) -> tuple[int, ...]:
        mv = self._dims_mv
        if mv is None:
            return tuple(self.dims[index].tolist())
        start = index * self._dim_words + 2
        ndim = self._ndim
        # Spelled out for the common ranks: slicing a memoryview and building a tuple costs more.
        if ndim == 1:
            return (mv[start],)
        if ndim == 2:
            return (mv[start], mv[start + 1])
        if ndim == 3:
            return (mv[start], mv[start + 1], mv[start + 2])
        return tuple(mv[start : start + ndim])

    def _offset(self, index: int) -> int:
        if self._offsets_mv is None:
            return int(self.offsets[index])
        return int(self._offsets_mv[index * self._offset_words])

    def locate(self, index: int) -> tuple[int, tuple[int, ...], int] | None:
        """``(offset, shape, nbytes)`` of slot ``index``'s value, or ``None`` if the descriptor is impossible."""
        shape = self.shape(index)
        offset = self._offset(index)
        nbytes = math.prod(shape) * self._item
        if offset + nbytes > self._size or offset % self._align:
            return None
        if self._fixed_axes:
            for axis, d in self._fixed_axes:
                if shape[axis] != d:
                    return None
        return offset, shape, nbytes

    def copy(self, index: int) -> np.ndarray[Any, Any] | None:
        """A fresh copy of slot ``index``'s value (``None`` if its descriptor is impossible)."""
        typed, dims = self._typed, self._dims_mv
        if self._ndim == 1 and typed is not None and dims is not None and self._offsets_mv is not None:
            # The common case (token sequences): two memoryview reads and one copy.
            count = dims[index * self._dim_words + 2]
            offset = self._offsets_mv[index * self._offset_words]
            if offset + count * self._item > self._size or offset % self._item:
                return None
            start = offset // self._item
            fresh: np.ndarray[Any, Any] = typed[start : start + count].copy()
            return fresh
        rows = self._rows
        if rows is not None and dims is not None and self._offsets_mv is not None:
            start = index * self._dim_words + 2
            count = dims[start]
            offset = self._offsets_mv[index * self._offset_words]
            first, remainder = divmod(offset, self._row_bytes)
            fits = dims[start + 1] == self._tail[0] if self._ndim == 2 else self.shape(index)[1:] == self._tail
            if not remainder and fits:
                if offset + count * self._row_bytes > self._size:
                    return None
                fresh_rows: np.ndarray[Any, Any] = rows[first : first + count].copy()
                return fresh_rows
        where = self.locate(index)
        if where is None:
            return None
        offset, shape, nbytes = where
        if typed is not None:
            start = offset // self._item
            value = typed[start : start + nbytes // self._item]
            result: np.ndarray[Any, Any] = value.reshape(shape).copy()
            return result
        result = self._region[offset : offset + nbytes].view(self.dtype).reshape(shape).copy()
        return result

    def spans(self, indices: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
        """``(shapes, starts, counts, ends, bad)`` of the values of ``indices`` (int64 arrays; ``bad``: bool).

        ``bad`` marks the descriptors :meth:`locate` finds impossible. No
        overflow hides one: a shape whose element count cannot fit the region
        is bad however large its product (counted in floating point first;
        its ``count`` and ``end`` are then 0 and ``start``).
        """
        shapes = self.dims[indices].astype(np.int64)
        starts = self.offsets[indices].astype(np.int64)  # offsets >= 2**63 become negative: bad
        if self._ndim:
            huge = shapes.astype(np.float64).prod(axis=1) * self._item > self._size
            counts = np.where(huge, 0, shapes.prod(axis=1))
        else:
            huge, counts = np.zeros(len(indices), bool), np.ones(len(indices), np.int64)
        bad = huge | (starts < 0) | (starts > self._size) | (starts % self._align != 0)
        ends = starts + counts * self._item
        bad |= ends > self._size
        for axis, d in self._fixed_axes:
            bad |= shapes[:, axis] != d
        return shapes, starts, counts, ends, bad

    def copy_many(self, indices: np.ndarray[Any, Any]) -> tuple[list[Any], np.ndarray[Any, Any]]:
        """Fresh copies of the values of ``indices`` (rows of one new buffer), and which rows are impossible."""
        shapes, starts, counts, ends, bad = self.spans(indices)
        values: list[Any] = [None] * len(indices)
        good = np.flatnonzero(~bad)
        if not len(good):
            return values, np.flatnonzero(bad)
        if self._rows is not None and not (starts[good] % self._row_bytes).any():
            rows = self._copy_rows(starts[good] // self._row_bytes, shapes[good, 0])
        else:
            rows = self._copy_flat(good, starts, ends, counts, shapes)
        if len(good) == len(indices):
            return rows, np.flatnonzero(bad)
        for row, value in zip(good.tolist(), rows, strict=True):
            values[row] = value
        return values, np.flatnonzero(bad)

    def gather(
        self, indices: np.ndarray[Any, Any], rows: np.ndarray[Any, Any] | None = None
    ) -> tuple[Jagged, np.ndarray[Any, Any]]:
        """The values of slots ``indices`` as one :class:`Jagged` (one gather), and which rows are impossible.

        ``rows``: the positions in ``indices`` to read (the READY ones); the
        others, and impossible rows, come back missing (``None``, length 0).
        A row is impossible when a fixed dimension of its descriptor differs
        from the field's, its value would not lie within the region, or its
        offset is not a multiple of the itemsize (every value is stored at one).
        Through the compiled gather when it is there, else :meth:`gather_numpy` (the same result).
        """
        native = _gather.native
        if native is None:
            return self.gather_numpy(indices, rows)
        # One call reads, checks and copies every row (_cgather.c).
        count = len(indices)
        offsets = np.empty(count + 1, np.int64)
        shapes = np.empty((count, self._ndim), np.int64) if self._head > 1 else None
        values, bad = native.gather(
            self._region,
            self._descriptors,
            self._width,
            indices if indices.dtype == _INT64 and indices.flags.c_contiguous else indices.astype(np.int64),
            rows if rows is None or rows.dtype == _INT64 else rows.astype(np.int64),
            self._dims,
            self._unit,
            self._align,
            offsets,
            shapes,
            self._alloc,
        )
        present: np.ndarray[Any, Any] | None = None
        if rows is not None and len(rows) != count:
            present = np.zeros(count, bool)
            present[rows] = True
        if bad:
            impossible = np.array(bad, np.intp)
            if present is None:
                present = np.ones(count, bool)
            present[impossible] = False
        else:
            impossible = NO_ROWS
        return Jagged._trusted(values, offsets, shapes, present), impossible

    def gather_numpy(
        self, indices: np.ndarray[Any, Any], rows: np.ndarray[Any, Any] | None = None
    ) -> tuple[Jagged, np.ndarray[Any, Any]]:
        """:meth:`gather` in numpy: about ten array operations and one ``gather_runs``."""
        count = len(indices)
        wanted = indices if rows is None else indices[rows]
        found = self._table[wanted].view(np.uint8).reshape(len(wanted), self._table.itemsize)
        starts = found[:, :8].view(_OFFSET)[:, 0].astype(np.int64)
        shapes = found[:, 8 : 8 + 4 * self._ndim].view(_DIM).astype(np.int64)
        head = self._head
        if self._may_overflow:  # an element count past int64: counted in floating point first
            huge = shapes[:, :head].astype(np.float64).prod(axis=1) * max(self._unit, 1) > self._size
            shapes[huge, :head] = 0
        units = shapes[:, 0].copy() if head == 1 else shapes[:, :head].prod(axis=1)
        nbytes = units * self._unit
        extent = nbytes if self._unit else units  # a unit of 0 bytes: at most one unit per byte of the region
        bad = (starts < 0) | (starts > self._size) | (extent > self._size - starts) | (starts % self._align != 0)
        if self._may_overflow:
            bad |= huge
        for axis, d in self._fixed_axes:
            bad |= shapes[:, axis] != d
        if bad.any():
            units[bad] = nbytes[bad] = starts[bad] = 0
        if rows is not None and len(wanted) != count:
            full = np.zeros(count, np.int64)
            full[rows] = units
            units = full
            full_bytes = np.zeros(count, np.int64)
            full_bytes[rows] = nbytes
            nbytes = full_bytes
            full_starts = np.zeros(count, np.int64)
            full_starts[rows] = starts
            starts = full_starts
            if head > 1:
                full_shapes = np.zeros((count, shapes.shape[1]), np.int64)
                full_shapes[rows] = shapes
                shapes = full_shapes
            impossible = rows[np.flatnonzero(bad)]
            found = np.zeros(count, bool)
            found[rows] = ~bad
            present: np.ndarray[Any, Any] | None = found
        else:
            impossible = np.flatnonzero(bad)
            present = ~bad if len(impossible) else None
        bounds = np.zeros(count + 1, np.int64)
        np.cumsum(nbytes, out=bounds[1:])
        data = gather_runs(self._region, starts, bounds, views=self._chunk_views)
        total = int(bounds[-1]) // max(self._unit, 1) if self._unit else int(units.sum())
        values = data[: total * self._unit].view(self.dtype).reshape(total, *self._unit_tail)
        offsets = bounds // self._unit if self._unit else np.concatenate([[0], np.cumsum(units)])
        if head > 1:
            if present is not None:
                shapes[~present, :head] = 0
                shapes[~present, head:] = self._unit_tail
            return Jagged._trusted(values, offsets, shapes, present), impossible
        return Jagged._trusted(values, offsets, None, present), impossible

    def fragments(
        self,
        slots: np.ndarray[Any, np.dtype[np.int64]],
        starts: np.ndarray[Any, np.dtype[np.int64]],
        lengths: np.ndarray[Any, np.dtype[np.int64]],
        out: np.ndarray[Any, Any],
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.intp]]]:
        """Parts of one-dimensional values, back to back: ``out``'s items from ``offsets[k]`` are
        items ``starts[k] .. starts[k] + lengths[k] - 1`` of slot ``slots[k]``'s value.

        A slot of -1 is a gap of ``lengths[k]`` items, left for the caller to write (its
        contents are undefined). The slots must hold their values (the caller read their
        states). Returns ``(offsets, bad)``: the ``len(slots) + 1`` item offsets of the parts
        in ``out`` (a flat array of the field's dtype, of ``offsets[-1]`` items or more), and
        the parts that lie outside the region (a damaged descriptor; their items are not
        written). One call of the compiled gather, or array operations and ``gather_runs``.
        """
        count, item = len(slots), self._item
        gap = slots < 0
        table = np.zeros(count, _FRAGMENT)
        # In int64 (uint64 + int64 would be float64): a damaged offset past 2**63 turns negative, caught below.
        first = self.offsets[np.where(gap, 0, slots)].astype(np.int64) + starts * item
        first[gap] = 0
        table["offset"] = first
        table["length"] = lengths
        offsets = np.empty(count + 1, np.int64)
        native = _gather.native
        if native is not None and int(lengths[gap].max(initial=0)) * item <= self._size:
            # A gap reads the region's first bytes (the caller overwrites them): one gather in all.
            _, bad = native.gather(
                self._region, table.view(np.uint8), _FRAGMENT.itemsize, np.arange(count, dtype=np.int64), None,
                (-1,), item, item, offsets, None, lambda shape: out,
            )  # fmt: skip
            return offsets, np.asarray(bad, np.intp)
        offsets[0] = 0
        np.cumsum(lengths, out=offsets[1:])
        nbytes = lengths * item
        outside = (first < 0) | (first > self._size) | (nbytes > self._size - first)
        bad = ~gap & (outside | (first % self._align != 0))
        wanted = np.flatnonzero(~gap & ~bad)
        bounds = np.zeros(len(wanted) + 1, np.int64)
        np.cumsum(nbytes[wanted], out=bounds[1:])
        if not len(wanted):
            return offsets, np.flatnonzero(bad)
        data = gather_runs(self._region, first[wanted], bounds, views=self._chunk_views)
        flat = out.reshape(-1).view(np.uint8)
        # The gathered parts go where they belong, a block of consecutive parts at a time.
        breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
        for a, b in itertools.pairwise([0, *breaks.tolist(), len(wanted)]):
            at = int(offsets[wanted[a]]) * item
            flat[at : at + int(bounds[b] - bounds[a])] = data[bounds[a] : bounds[b]]
        return offsets, np.flatnonzero(bad)

    def _copy_rows(self, firsts: np.ndarray[Any, Any], counts: np.ndarray[Any, Any]) -> list[Any]:
        """Values whose first dimension alone varies: slices of the region's row view, into one buffer."""
        rows = self._rows
        assert rows is not None
        bounds = np.zeros(len(firsts) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        flat = np.empty((int(bounds[-1]), *self._tail), self.dtype)
        starts = firsts.tolist()
        np.concatenate([rows[a : a + n] for a, n in zip(starts, counts.tolist(), strict=True)], out=flat)
        return [flat[a:b] for a, b in itertools.pairwise(bounds.tolist())]

    def _copy_flat(
        self,
        good: np.ndarray[Any, Any],
        starts: np.ndarray[Any, Any],
        ends: np.ndarray[Any, Any],
        counts: np.ndarray[Any, Any],
        shapes: np.ndarray[Any, Any],
    ) -> list[Any]:
        """Values of any shape: their elements copied into one flat buffer, viewed row by row."""
        if self._typed is not None and not (starts[good] % self._item).any():
            firsts, lasts = (starts[good] // self._item).tolist(), (ends[good] // self._item).tolist()
            source = self._typed
        else:
            firsts, lasts, source = starts[good].tolist(), ends[good].tolist(), self._region
        # Into one buffer of the right dtype (concatenate alone would pick a native byte order),
        # which every row then views: one allocation, one C copy loop, one Python slice per row.
        bounds = np.zeros(len(good) + 1, np.int64)
        np.cumsum(counts[good], out=bounds[1:])
        flat = np.empty(int(bounds[-1]) * (self._item if source is self._region else 1), source.dtype)
        np.concatenate([source[a:b] for a, b in zip(firsts, lasts, strict=True)], out=flat)
        if source is self._region:
            flat = flat.view(self.dtype)
        edges = bounds.tolist()
        if self._ndim == 1:
            return [flat[a:b] for a, b in itertools.pairwise(edges)]
        return [
            flat[a:b].reshape(shape) for a, b, shape in zip(edges[:-1], edges[1:], shapes[good].tolist(), strict=True)
        ]

    def write(self, index: int, offset: int, value: np.ndarray[Any, Any]) -> None:
        """Store ``value`` at ``offset`` of the region and describe it in slot ``index``'s descriptor."""
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        self._region[offset : offset + len(data)] = data
        self.dims[index] = value.shape
        self.offsets[index] = offset

    def parts(self, index: int) -> list[np.ndarray[Any, Any]] | None:
        """The checksum parts of slot ``index`` (shape bytes, value bytes), or ``None`` if impossible."""
        where = self.locate(index)
        if where is None:
            return None
        offset, shape, nbytes = where
        return [shape_bytes(shape), self._region[offset : offset + nbytes]]
