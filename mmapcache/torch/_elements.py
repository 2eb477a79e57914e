"""A stream element on the first epoch's path: its storage arrays and the value yielded.

``CachedStream`` turns each element into one storage array per field (what
the file holds) and yields the element as a read from the cache returns it,
both by :meth:`ElementPath.convert`. For the commonest elements — a flat
tuple, list or dict (or a bare leaf) of arrays and CPU tensors of the field's
exact dtype that plainly fit it, Python ints for int64 scalars, ``str`` for
text — it does both in one pass at a few hundred nanoseconds a leaf, reusing
what it can: a tensor is yielded as the stream gave it, a ``str`` as it was.
Any other element takes the route a miss batch of ``CachedDataset`` takes
(:func:`~._columns.fitted_leaves`: the same conversions, checks and errors,
worded for a stream element).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._field import Field
from .._region import tensor_to_numpy, torch_dtype
from ._columns import worded_leaves
from ._leaves import LeafShapeError
from ._schema import Schema, declaration
from ._structure import Node

__all__ = ["ElementPath", "as_element"]

_INT64 = np.dtype(np.int64)
_ARRAY, _INT, _STR, _NEVER = range(4)  # what a field takes on the fast path: arrays/tensors, also ints, str, nothing


class ElementPath:
    """The conversion of a schema's stream elements (see the module docstring).

    ``dtypes``: the stream's ``dtypes=``; ``declared``: its fields are ``fields=``'s (else the first element's).
    """

    def __init__(self, schema: Schema, dtypes: Mapping[str, Any] | None, *, declared: bool) -> None:
        self._parts = schema.structure.candidates
        self._fields = tuple(schema.fields.values())
        self._named = tuple(schema.fields.items())
        self._dtypes = tuple(_tensor_dtype(field) for field in self._fields)
        self._kinds = tuple(_kind(field, name, dtypes) for name, field in schema.fields.items())
        self._build = _builder(schema.tree)
        self.schema, self.dtypes, self.declared = schema, dtypes, declared

    def convert(self, element: Any, index: int) -> tuple[list[Any], Any]:
        """``(storage arrays in field order, the value to yield)`` of the stream's element ``index``.

        TypeError/ValueError naming the element and the field for one that does not fit the fields.
        """
        fast = self._one_pass(element)
        if fast is not None:
            return fast
        leaves = self.leaves(element, index)
        schema = self.schema
        columns = [[schema.to_tensor(_writable(leaf, schema.texts[k]), k)] for k, leaf in enumerate(leaves)]
        return leaves, schema.build(columns)[0]

    def leaves(self, element: Any, index: int) -> list[Any]:
        """Element ``index``'s storage arrays in field order, by the route a miss batch takes.

        Arrays are views of the element's own tensors where they can be (the
        store copies them into the file), so the first epoch copies nothing more.
        """
        schema = self.schema
        where, advice = f"stream element {index}", "convert them in the stream before the cache"
        try:
            fitted = worded_leaves(schema, element, self.dtypes, declared=self.declared, where=where, advice=advice)
        except LeafShapeError as error:
            if self.declared:
                raise ValueError(f"stream element {index}: {error}, which fields= declares") from None
            raise ValueError(
                f"stream element {index}: field {error.name!r} has shape {error.shape}, but the cache's field has "
                f"the fixed shape {error.field.shape}: without fields=, every field keeps the shape of the first "
                f"element. Declare the dimensions that vary as None: CachedStream(..., "
                f"fields={declaration(schema, [element])}, max_bytes=...), with Field from mmapcache."
            ) from None
        arrays = []
        for leaf, (name, field) in zip(fitted, self._named, strict=True):
            if type(leaf) is np.ndarray:
                arrays.append(leaf)
            elif isinstance(leaf, torch.Tensor):
                arrays.append(tensor_to_numpy(leaf, field, name))
            else:  # a numpy scalar (np.float32(0.5)) is stored, and yielded, as the 0-d array it stands for
                arrays.append(np.asarray(leaf))
        return arrays

    def _one_pass(self, element: Any) -> tuple[list[Any], Any] | None:
        """The element's arrays and value in one pass, or ``None``: take the general route."""
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


def as_element(message: str) -> str:
    """A message of the shared torch layer, which speaks of ``dataset[i]``, about a stream element."""
    return re.sub(r"dataset\[(\d+)\]", r"stream element \1", message)


def _writable(array: Any, text: str | None) -> Any:
    """``array``, copied if torch would have to share a read-only buffer (text is decoded, never shared)."""
    if text is None and isinstance(array, np.ndarray) and not array.flags.writeable:
        return array.copy()
    return array


def _kind(field: Field, name: str, dtypes: Mapping[str, Any] | None) -> int:
    """What field ``name`` takes in one pass (``dtypes=`` names a field whose leaves are always converted; a
    declared field's leaves of its exact dtype need no conversion)."""
    if dtypes is not None and name in dtypes:
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
