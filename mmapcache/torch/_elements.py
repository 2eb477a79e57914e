"""A stream element on the first epoch's path: its storage arrays and the value yielded, in one pass.

``CachedStream`` turns each element into one storage array per field (what
the file holds) and yields the element as a read from the cache returns it.
For the commonest elements — a flat tuple, list or dict (or a bare leaf) of
arrays and CPU tensors of the field's exact dtype that plainly fit it,
Python ints for int64 scalars, ``str`` for text — :meth:`ElementPath.convert`
does both in one pass at a few hundred nanoseconds a leaf, reusing what it
can: a tensor is yielded as the stream gave it, a ``str`` as it was. Anything
else returns ``None``, and the caller takes the general rule
(``_leaves.fit``), which also words the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._field import Field
from .._region import torch_dtype
from ._schema import Schema
from ._structure import Node

__all__ = ["ElementPath"]

_INT64 = np.dtype(np.int64)
_ARRAY, _INT, _STR, _NEVER = range(4)  # what a field takes on the fast path: arrays/tensors, also ints, str, nothing


class ElementPath:
    """The one-pass conversion of a schema's elements (see the module docstring)."""

    def __init__(self, schema: Schema, converted: Mapping[str, Any] | None) -> None:
        self._parts = schema.structure.candidates
        self._fields = tuple(schema.fields.values())
        self._dtypes = tuple(_tensor_dtype(field) for field in self._fields)
        self._kinds = tuple(_kind(field, name, converted) for name, field in schema.fields.items())
        self.schema = schema
        self._build = _builder(schema.tree)

    def convert(self, element: Any) -> tuple[list[Any], Any] | None:
        """``(storage arrays in field order, the value to yield)``, or ``None``: take the general path."""
        parts = self._parts(element)
        if parts is None:
            return None
        arrays: list[Any] = []
        values: list[Any] = []
        for part, field, kind, dtype in zip(parts, self._fields, self._kinds, self._dtypes, strict=True):
            of = type(part)
            if of is np.ndarray and kind <= _INT:
                if part.dtype != field.dtype or not (part.shape == field.shape or field.fits(part.shape)):
                    return None
                arrays.append(part)
                values.append(torch.from_numpy(part if part.flags.writeable else part.copy()))
            elif of is torch.Tensor and kind <= _INT:
                if not _plain(part, dtype):
                    return None
                array = part.numpy()
                if not (array.shape == field.shape or field.fits(array.shape)):
                    return None
                arrays.append(array)
                values.append(part)  # the stream's own tensor: what from_numpy(array) would share
            elif of is int and kind == _INT:
                if not -(2**63) <= part < 2**63:
                    return None
                array = np.array(part, _INT64)
                arrays.append(array)
                values.append(torch.from_numpy(array))
            elif of is str and kind == _STR:
                try:
                    arrays.append(np.frombuffer(part.encode("utf-8"), np.uint8))
                except UnicodeEncodeError:
                    return None
                values.append(part)  # a read decodes the same bytes back to an equal str
            else:
                return None
        return arrays, self._build(values)


def _kind(field: Field, name: str, converted: Mapping[str, Any] | None) -> int:
    """What field ``name`` takes on the fast path (``dtypes=`` names a field whose leaves are always converted)."""
    if converted is not None and name in converted:
        return _NEVER
    if field.text is not None:
        return _STR if field.text == "str" else _NEVER
    if field.torch_dtype is not None:
        return _NEVER  # stored as the bits of another dtype: the general path
    if field.dtype == _INT64 and not field.shape:
        return _INT  # a Python int, or an array or tensor as for _ARRAY
    return _ARRAY


def _tensor_dtype(field: Field) -> torch.dtype | None:
    """The torch dtype of ``field``'s tensors, or ``None`` when torch has none (then tensors take the general path)."""
    try:
        return torch_dtype(field)
    except TypeError:
        return None


def _plain(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """A CPU tensor of the field's exact ``dtype`` whose ``numpy()`` is its plain storage."""
    return (
        tensor.dtype == dtype
        and not tensor.requires_grad
        and tensor.layout == torch.strided
        and tensor.is_cpu
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _builder(tree: Node) -> Callable[[list[Any]], Any]:
    """The element from its values in field order (the flat shapes only: ``candidates`` gave their parts)."""
    if isinstance(tree, int):
        return lambda values: values[0]
    kind, keys, _ = tree
    if kind == "tuple":
        return tuple
    if kind == "list":
        return lambda values: values
    return lambda values: dict(zip(keys, values, strict=True))
