"""`Jagged`: a batch of arrays of different shapes, held as one contiguous array and offsets.

What :meth:`Cache.get_many` and :meth:`Cache.read_many` return for a
variable-shape field. A batch of small ragged rows (token ids, box lists) is
read by one gather into one buffer; making one numpy array per row would cost
more than copying the bytes (~0.3 µs a row against a few ns), so rows become
arrays only when they are indexed.

A field's dimensions split into a *head*, up to and including its last
variable dimension, and a fixed *tail* after it: ``(None,)`` has head
``(None,)`` and tail ``()``; ``(None, 4)`` has head ``(None,)`` and tail
``(4,)``; ``(3, None, None)`` has head ``(3, None, None)`` and tail ``()``.
A row's *length* is the number of tail-shaped units it holds (the product of
its head dimensions), and ``values`` stacks every row's units:
``(sum of lengths, *tail)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from . import gathers as _gather

__all__ = ["Jagged", "rows_like", "split_shape"]

_INT32_MAX = 2**31 - 1


def split_shape(shape: tuple[int | None, ...]) -> tuple[int, tuple[int, ...]]:
    """``(head rank, tail)`` of a field's shape: the dimensions up to its last ``None``, and the fixed rest."""
    head = max((axis + 1 for axis, d in enumerate(shape) if d is None), default=0)
    return head, tuple(d for d in shape[head:] if d is not None)


def _frozen(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    array.flags.writeable = False
    return array


class Jagged(Sequence[Any]):
    """A read-only sequence of arrays of different shapes (one batch of a variable-shape field).

    It behaves like the list of per-row arrays it stands for — ``len``,
    indexing (negative too), iteration and ``==`` against another sequence of
    arrays — and holds them as one contiguous array:

    * ``values``: every row's data, ``(total, *tail)``, where ``tail`` is the
      field's fixed dimensions after its last variable one (a fresh,
      writable copy: nothing here views the cache);
    * ``offsets``: int64, ``len + 1`` entries from 0: row ``k`` is
      ``values[offsets[k]:offsets[k + 1]]``; ``lengths`` are their
      differences, ``cu_seqlens`` the same offsets as int32 (what varlen
      attention kernels take), ``max_length``/``min_length`` their extremes;
    * ``shapes``: int64 ``(len, ndim)``, each row's full shape (what a field
      with several variable dimensions needs to rebuild its rows).

    ``jagged[k]`` is a view of ``values`` with row ``k``'s shape, made when
    asked for. A row that :meth:`Cache.read_many` did not find is ``None``
    (``present[k]`` is False and its length 0). Slicing gives a list of rows.
    ``to_padded()`` makes one padded array.

    ``Jagged.from_arrays(rows)`` builds one from arrays of one dtype and rank
    whose shapes differ only in the head (``None`` marks a missing row).
    """

    __slots__ = ("_cu", "_dtype", "_extent", "_lengths", "_ndim", "_present", "_shapes", "_tail", "offsets", "values")

    values: np.ndarray[Any, Any]
    offsets: np.ndarray[Any, np.dtype[np.int64]]

    def __init__(
        self,
        values: np.ndarray[Any, Any],
        offsets: np.ndarray[Any, Any],
        shapes: np.ndarray[Any, Any] | None = None,
        *,
        present: np.ndarray[Any, Any] | None = None,
    ) -> None:
        offsets = np.asarray(offsets)
        if offsets.ndim != 1 or not len(offsets) or offsets.dtype.kind not in "iu":
            raise ValueError(f"offsets must be a 1-D integer array of len(rows) + 1 entries, got {offsets!r}")
        offsets = offsets.astype(np.int64, copy=False)
        values = np.asarray(values)
        if values.ndim == 0:
            raise ValueError("values must have at least one dimension (the units of the rows)")
        count = len(offsets) - 1
        if offsets[0] != 0 or offsets[-1] != len(values) or (count and np.any(offsets[1:] < offsets[:-1])):
            raise ValueError(
                f"offsets must start at 0, never decrease and end at len(values) = {len(values)}; "
                f"got {offsets[:3].tolist()}...{offsets[-1:].tolist()}"
            )
        self.values, self.offsets = values, _frozen(offsets if offsets.base is None else offsets.copy())
        self._tail: tuple[int, ...] = values.shape[1:]
        self._dtype = values.dtype
        self._lengths: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._cu: np.ndarray[Any, np.dtype[np.int32]] | None = None
        self._extent: tuple[int, int] | None = None
        if shapes is not None:
            shapes = np.asarray(shapes, np.int64).reshape(count, -1)
            ndim = shapes.shape[1]
            rank = ndim - len(self._tail)
            if rank < 0 or (count and tuple(shapes[0, rank:].tolist()) != self._tail):
                raise ValueError(f"shapes {shapes.shape} do not end in the values' tail {self._tail}")
            if count and not np.array_equal(shapes[:, :rank].prod(axis=1), np.diff(offsets)):
                raise ValueError("shapes do not match the row lengths the offsets give")
            shapes = _frozen(shapes)
        self._shapes = shapes
        self._ndim = 1 + len(self._tail) if shapes is None else shapes.shape[1]
        if present is not None:
            present = np.asarray(present, bool)
            if present.shape != (count,):
                raise ValueError(f"present must have {count} entries, got shape {present.shape}")
            if present.all():
                present = None
            else:
                if np.diff(offsets)[~present].any():
                    raise ValueError("a missing row (present False) must have length 0")
                present = _frozen(present.copy())
        self._present: np.ndarray[Any, np.dtype[np.bool_]] | None = present

    # -- building -------------------------------------------------------------

    @classmethod
    def _trusted(
        cls,
        values: np.ndarray[Any, Any],
        offsets: np.ndarray[Any, np.dtype[np.int64]],
        shapes: np.ndarray[Any, Any] | None,
        present: np.ndarray[Any, Any] | None,
    ) -> Jagged:
        """A batch the cache just gathered: the checks of ``__init__`` hold by construction (a hot path)."""
        self = object.__new__(cls)
        self.values, self.offsets = values, _frozen(offsets)
        self._tail, self._dtype = values.shape[1:], values.dtype
        self._lengths = self._cu = self._extent = None
        self._shapes = None if shapes is None else _frozen(shapes)
        self._ndim = 1 + len(self._tail) if shapes is None else shapes.shape[1]
        self._present = None if present is None or present.all() else _frozen(present)
        return self

    @classmethod
    def from_arrays(
        cls, rows: Sequence[Any], *, dtype: Any = None, tail: tuple[int, ...] | None = None, ndim: int | None = None
    ) -> Jagged:
        """A :class:`Jagged` of ``rows`` (arrays, or ``None`` for a missing row), copied into one buffer.

        ``dtype``, ``tail`` and ``ndim`` say what an empty (or all-missing)
        batch holds; otherwise they come from the rows, which must share a
        dtype, a rank and the tail (the dimensions after the last one that
        differs between them, or that ``tail`` names).
        """
        arrays = [None if row is None else np.asarray(row) for row in rows]
        found = [a for a in arrays if a is not None]
        if dtype is None:
            dtype = found[0].dtype if found else np.dtype(np.float64)
        dtype = np.dtype(dtype)
        if ndim is None:
            ndim = found[0].ndim if found else 1 + len(tail or ())
        if any(a.ndim != ndim for a in found):
            raise ValueError(f"rows must all have {ndim} dimensions, got shapes {[a.shape for a in found][:5]}")
        if ndim == 0:
            raise ValueError("rows must have at least one dimension")
        if tail is None:
            shapes_seen = {a.shape for a in found}
            varying = [axis for axis in range(ndim) if len({s[axis] for s in shapes_seen}) > 1]
            head = max(varying, default=0) + 1
            tail = found[0].shape[head:] if found else ()
        rank = ndim - len(tail)
        if rank < 1 or any(a.shape[rank:] != tuple(tail) for a in found):
            raise ValueError(f"every row must end in the dimensions {tuple(tail)}, got {[a.shape for a in found][:5]}")
        lengths = np.array([0 if a is None else math.prod(a.shape[:rank]) for a in arrays], np.int64)
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty((int(offsets[-1]), *tail), dtype)
        for a, start, end in zip(arrays, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            if a is not None:
                values[start:end] = a.reshape(end - start, *tail)
        shapes = None
        if rank > 1:
            shapes = np.array([[0] * rank + list(tail) if a is None else a.shape for a in arrays], np.int64)
            shapes = shapes.reshape(len(arrays), ndim)
        present = np.array([a is not None for a in arrays], bool)
        return cls(values, offsets, shapes, present=present)

    # -- the sequence ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._row(k) for k in range(*index.indices(len(self)))]
        count = len(self.offsets) - 1
        try:
            k = index.__index__()
        except AttributeError:
            raise TypeError(f"Jagged indices must be integers or slices, not {type(index).__name__}") from None
        if k < 0:
            k += count
        if not 0 <= k < count:
            raise IndexError(f"row {index} is out of range for a batch of {count}")
        return self._row(k)

    def _row(self, k: int) -> np.ndarray[Any, Any] | None:
        if self._present is not None and not self._present[k]:
            return None
        start, end = self.offsets[k : k + 2].tolist()
        row = self.values[start:end]
        if self._shapes is not None:
            row = row.reshape(self._shapes[k].tolist())
        return row

    def __iter__(self) -> Iterator[Any]:
        bounds = self.offsets.tolist()
        values, shapes, present = self.values, self._shapes, self._present
        for k in range(len(bounds) - 1):
            if present is not None and not present[k]:
                yield None
                continue
            row = values[bounds[k] : bounds[k + 1]]
            yield row if shapes is None else row.reshape(shapes[k].tolist())

    def __eq__(self, other: object) -> bool:
        """Row by row: ``None`` equals ``None``, arrays equal in shape and values (``np.array_equal``)."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        for mine, theirs in zip(self, other, strict=True):
            if mine is None or theirs is None:
                if mine is not theirs:
                    return False
            elif not np.array_equal(mine, theirs):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        missing = "" if self._present is None else f", {int((~self._present).sum())} missing"
        return (
            f"Jagged({len(self)} rows of {self._dtype}, tail {self._tail}, total {len(self.values)}{missing}, "
            f"lengths {self.lengths[:8].tolist()}{'...' if len(self) > 8 else ''})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.values, self.offsets, self._shapes, self._present))

    # -- the batch ------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def tail(self) -> tuple[int, ...]:
        """The fixed dimensions every row ends in (and ``values`` after its first)."""
        return self._tail

    @property
    def lengths(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """int64, one per row: how many ``tail``-shaped units each holds (0 for a missing row)."""
        if self._lengths is None:
            self._lengths = _frozen(np.subtract(self.offsets[1:], self.offsets[:-1]))  # np.diff: 3x the cost
        return self._lengths

    @property
    def present(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """bool, one per row: False where the row is missing (``None``)."""
        if self._present is None:
            return _frozen(np.ones(len(self), bool))
        return self._present

    @property
    def shapes(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """int64 ``(len, ndim)``: each row's full shape (a missing row's is its head of zeros and the tail)."""
        if self._shapes is None:
            shapes = np.empty((len(self), 1 + len(self._tail)), np.int64)
            shapes[:, 0] = self.lengths
            shapes[:, 1:] = self._tail
            self._shapes = _frozen(shapes)
        return self._shapes

    @property
    def cu_seqlens(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """``offsets`` as int32, for varlen attention kernels; ``OverflowError`` past 2**31 - 1 units."""
        if self._cu is None:
            if self.offsets[-1] > _INT32_MAX:
                raise OverflowError(f"the batch holds {int(self.offsets[-1])} units, too many for int32 cu_seqlens")
            self._cu = _frozen(self.offsets.astype(np.int32))
        return self._cu

    def _lengths_extent(self) -> tuple[int, int]:
        if self._extent is None:
            lengths = self.lengths
            self._extent = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
        return self._extent

    @property
    def max_length(self) -> int:
        """The longest row's length (0 for an empty batch); computed once."""
        return self._lengths_extent()[1]

    @property
    def min_length(self) -> int:
        """The shortest row's length (0 for an empty batch); computed once."""
        return self._lengths_extent()[0]

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def to_nested(self, dtype: Any = None) -> Any:
        """A torch jagged-layout nested tensor ``(len, j, *tail)`` that views ``values`` (no copy).

        Its ``values()`` is ``values`` itself (copied only when ``values`` is
        read-only), its offsets are ``offsets``, and the rows' shortest and
        longest lengths are passed in, so nothing reads them back from a
        device. ``dtype`` reinterprets the stored bits as a torch dtype of the
        same width (``torch.bfloat16`` for a field stored as uint16 bits).
        Rows must vary in their first dimension only (``ValueError``
        otherwise: use ``to_padded()``), and none may be missing. Imports
        torch when called.
        """
        if self._ndim - len(self._tail) != 1:
            raise ValueError(
                f"a nested tensor has one ragged dimension, but these rows vary in their first "
                f"{self._ndim - len(self._tail)} dimensions (shapes such as {self.shapes[0].tolist()}); "
                "use to_padded(), or iterate over the rows"
            )
        if self._present is not None:
            missing = np.flatnonzero(~self._present)
            raise ValueError(f"rows {missing[:5].tolist()} are missing (None): a nested tensor has no place for them")
        import torch

        from .tensors import nested

        # torch.from_numpy of a read-only array warns and would let writes through: copy those.
        values = torch.from_numpy(self.values if self.values.flags.writeable else self.values.copy())
        if dtype is not None and dtype != values.dtype:
            values = values.view(dtype)
        return nested(values, self.offsets, self._lengths_extent())

    def to_padded(self, pad_value: Any = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, np.dtype[np.int64]]]:
        """``(array, lengths)``: every row in the leading corner of one array, the rest ``pad_value``.

        The array has shape ``(len, *longest)``, the largest size of each
        dimension in the batch. ``lengths`` holds each row's own shape:
        ``(len,)`` for rows of one dimension, ``(len, ndim)`` otherwise (as
        ``mmapcache.torch.Padded``). A missing row is all padding.
        """
        count = len(self)
        if self._ndim - len(self._tail) == 1:  # only the first dimension varies: one step, no per-row Python
            native = _gather.native
            values = self.values
            if native is None or self._dtype.hasobject or not values.flags.c_contiguous:
                return self._padded_numpy(pad_value)
            # One memcpy and one fill a row, straight into the padded array: ~9 µs for 64 token rows, where
            # the masked assignment took ~290 µs (its boolean mask walks every padded element).
            fill = np.full(self._tail, pad_value, self._dtype)  # a bad pad_value fails here as in np.full
            padded = _gather.empty_aligned((count, self.max_length, *self._tail), self._dtype)
            native.pad(values, self.offsets, fill, padded)
            return padded, (self.lengths if self._ndim == 1 else self.shapes)
        shapes = self.shapes
        longest_shape = tuple(shapes.max(axis=0).tolist()) if count else (0,) * self._ndim
        padded = np.full((count, *longest_shape), pad_value, self._dtype)
        for k, row in enumerate(self):
            if row is not None:
                corner: tuple[Any, ...] = (k, *(slice(0, d) for d in row.shape))
                padded[corner] = row
        return padded, shapes

    def _padded_numpy(self, pad_value: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, np.dtype[np.int64]]]:
        """``to_padded`` of rows that vary in their first dimension, by one masked assignment (no compiled code)."""
        count, longest = len(self), self.max_length
        padded = np.full((count, longest, *self._tail), pad_value, self._dtype)
        if count and longest:
            padded[np.arange(longest) < self.lengths[:, None]] = self.values
        return padded, (self.lengths if self._ndim == 1 else self.shapes)


def rows_like(template: Jagged, rows: Sequence[Any]) -> Jagged:
    """A :class:`Jagged` of ``rows`` (arrays or ``None``) of ``template``'s dtype, tail and rank.

    For a batch whose rows changed after the gather: some made missing, some
    filled in. Copies the rows into one buffer.
    """
    return Jagged.from_arrays(rows, dtype=template.dtype, tail=template.tail, ndim=template.shapes.shape[1])


def _rebuild(values: Any, offsets: Any, shapes: Any, present: Any) -> Jagged:
    return Jagged(values, offsets, shapes, present=present)
