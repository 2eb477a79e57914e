"""Cache indices checked: one index, an array of them, and the ``out=`` buffers a read writes into.

Every verb of :class:`~mmapcache.Cache` takes positions ``0 <= i < length``;
what is not an integer raises ``TypeError``, what is out of range
``IndexError``, both before anything is read or written. The hot paths check
the common case (a plain ``int`` in range) inline and call here for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._field import Field

__all__ = ["BEYOND", "as_given", "check_index", "check_out", "index_array"]

_INTP = np.dtype(np.intp)
BEYOND = np.iinfo(np.intp).max  # a valid index beyond intp: never cacheable


def check_index(index: Any, length: int) -> int:
    """``index`` as an ``int`` in ``[0, length)``; ``TypeError`` or ``IndexError`` otherwise."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"cache indices must be integers, not {type(index).__name__}")
    i = int(index)
    if 0 <= i < length:
        return i
    raise IndexError(f"index {i} is out of range for a cache of length {length}")


def index_array(indices: Any, length: int) -> np.ndarray[Any, np.dtype[np.intp]]:
    """Validated indices as ``intp``; valid indices beyond ``intp`` become ``BEYOND`` (never cacheable)."""
    given = np.asarray(indices)
    if given.ndim != 1:
        raise ValueError(f"indices must be a 1-D sequence, got shape {given.shape}")
    if given.dtype.kind not in "iu":
        if given.size == 0 and given.dtype.kind != "b":
            return np.zeros(0, np.intp)
        if given.dtype.kind == "O":  # Python ints beyond 64 bits, or objects
            for value in given.tolist():
                check_index(value, length)
        raise TypeError(f"indices must be integers, got an array of {given.dtype}")
    if given.dtype.kind == "u" and given.dtype.itemsize >= _INTP.itemsize:
        if given.size and int(given.max()) >= length:
            raise IndexError(f"index {int(given.max())} is out of range for a cache of length {length}")
        # astype would wrap values >= 2**63 to negative slots; no slot lies that far
        # (a file holds < 2**63 bytes), so such an index is valid but never cached.
        clamped: np.ndarray[Any, np.dtype[np.intp]] = np.minimum(given, BEYOND).astype(np.intp)
        return clamped
    idx = given.astype(np.intp, copy=False)
    # One pass catches both ends: negative values become huge as unsigned.
    if idx.size and (idx.view(np.uintp).max() >= length or given.dtype != idx.dtype):
        bad = [i for i in given.tolist() if not 0 <= i < length]
        if bad:
            raise IndexError(f"index {bad[0]} is out of range for a cache of length {length}")
    return idx


def as_given(indices: Any, idx: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The indices as the caller wrote them, for messages (``idx`` may hold ``BEYOND``)."""
    given = np.asarray(indices)
    return given if given.dtype.kind == "u" else idx


def check_out(out: Any, fields: Mapping[str, Field], count: int) -> None:
    """``out=`` of a read of ``count`` rows: every fixed-shape field's buffer, of the right shape and dtype."""
    fixed: dict[str, Field] = {}  # a loop, not a comprehension: every read with out= makes this
    for name, field in fields.items():
        if not field.variable:
            fixed[name] = field
    if not isinstance(out, Mapping) or out.keys() != fixed.keys():
        got = list(out) if isinstance(out, Mapping) else type(out).__name__
        variable = [name for name in fields if name not in fixed]
        also = f" (variable-shape fields {variable} always come back in new buffers: Jagged)" if variable else ""
        raise ValueError(f"out must map every fixed-shape field {list(fixed)} to an array{also}, got {got}")
    for name, field in fixed.items():
        buffer = out[name]
        shape = (count, *field.shape)  # a fixed field's: no None in it
        if not isinstance(buffer, np.ndarray):
            raise ValueError(f"out[{name!r}] must be a numpy array, not {type(buffer).__name__}")
        if buffer.shape != shape or buffer.dtype != field.dtype:
            raise ValueError(
                f"out[{name!r}] must have shape {shape} and dtype {field.dtype}, "
                f"got shape {buffer.shape} and dtype {buffer.dtype}"
            )
        if not (buffer.flags.c_contiguous and buffer.flags.writeable):
            raise ValueError(f"out[{name!r}] must be C-contiguous and writable")
