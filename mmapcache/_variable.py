"""Variable-shape fields in a mapping: each slot's descriptor (where its value lies, its shape).

A variable field's region holds one descriptor per slot (``_format``:
uint64 offset into the variable region, then one uint32 per dimension); the
value itself lives in the variable region (``_heap``). The slot checksum
chains, for such a field, the shape's uint32 bytes and then the value's bytes,
so a descriptor or value that does not belong together fails verification.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._field import Field
from ._format import descriptor_nbytes

__all__ = ["VariableColumn", "shape_bytes"]

_DIM = np.dtype("<u4")
_OFFSET = np.dtype("<u8")


def shape_bytes(shape: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes a shape contributes to the slot checksum: one little-endian uint32 per dimension."""
    return np.asarray(shape, _DIM).view(np.uint8)


class VariableColumn:
    """The descriptors of one variable field in a mapping, and reads and writes through them."""

    __slots__ = ("dims", "dtype", "field", "name", "offsets")

    def __init__(self, name: str, field: Field, buffer: Any, offset: int, capacity: int) -> None:
        self.name, self.field, self.dtype = name, field, field.dtype
        ndim = len(field.shape)
        table = np.ndarray((capacity, descriptor_nbytes(field)), np.uint8, buffer=buffer, offset=offset)
        self.offsets: np.ndarray[Any, Any] = table[:, :8].view(_OFFSET)[:, 0]
        self.dims: np.ndarray[Any, Any] = table[:, 8 : 8 + 4 * ndim].view(_DIM)

    def shape(self, index: int) -> tuple[int, ...]:
        return tuple(self.dims[index].tolist())

    def locate(self, index: int, region_size: int) -> tuple[int, tuple[int, ...], int] | None:
        """``(offset, shape, nbytes)`` of slot ``index``'s value, or ``None`` if the descriptor is impossible."""
        shape = self.shape(index)
        offset = int(self.offsets[index])
        nbytes = math.prod(shape) * self.dtype.itemsize
        if not self.field.fits(shape) or offset + nbytes > region_size:
            return None
        return offset, shape, nbytes

    def view(self, region: np.ndarray[Any, Any], index: int) -> np.ndarray[Any, Any] | None:
        """Slot ``index``'s value as a view of the region (``None`` if its descriptor is impossible)."""
        where = self.locate(index, len(region))
        if where is None:
            return None
        offset, shape, nbytes = where
        return region[offset : offset + nbytes].view(self.dtype).reshape(shape)

    def write(self, region: np.ndarray[Any, Any], index: int, offset: int, value: np.ndarray[Any, Any]) -> None:
        """Store ``value`` at ``offset`` of the region and describe it in slot ``index``'s descriptor."""
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        region[offset : offset + len(data)] = data
        self.dims[index] = value.shape
        self.offsets[index] = offset

    def parts(self, region: np.ndarray[Any, Any], index: int) -> list[np.ndarray[Any, Any]] | None:
        """The checksum parts of slot ``index`` (shape bytes, value bytes), or ``None`` if impossible."""
        where = self.locate(index, len(region))
        if where is None:
            return None
        offset, shape, nbytes = where
        return [shape_bytes(shape), region[offset : offset + nbytes]]
