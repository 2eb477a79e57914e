"""Batches as columns, one per field: raw samples into storage columns, and fresh batch tensors.

A miss turns the samples a dataset gave into what ``Cache.put_many`` stores:
per field, the rows stacked into one array (fixed fields) or a list of arrays
(variable fields), each leaf checked by :func:`~._leaves.fit` and copied once
(:func:`columns`: the one conversion of a miss, whose columns single flight
stores as they are). A hit gathers into tensors made by :func:`new_batch`.

Buffers start on a page boundary: a gather into a buffer a few bytes off a page
boundary runs many times slower (4K aliasing, see ``mmapcache/_region/gathers.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._region import empty_aligned
from ._leaves import LeafShapeError, converted, exact_column, fit, variable_column, write_column
from ._schema import Schema, describe

__all__ = [
    "ConversionError",
    "ShapeVariesError",
    "as_tensors",
    "columns",
    "fitted_leaves",
    "new_batch",
    "shared_empty",
    "worded_leaves",
]


class ShapeVariesError(ValueError):
    """A leaf of ``dataset[index]`` whose shape does not fit its field (see :class:`~._leaves.LeafShapeError`)."""

    def __init__(self, index: int, error: LeafShapeError) -> None:
        super().__init__(f"dataset[{index}]: {error}")
        self.index, self.error = index, error


def columns(
    schema: Schema, indices: Sequence[int], raw: list[Any], dtypes: Mapping[str, Any] | None, *, declared: bool
) -> list[Any]:
    """The batch ``put_many`` stores: per field, the rows stacked (fixed) or a list of arrays (variable).

    ``indices`` are the dataset indices of ``raw`` (for errors). Each leaf is converted to the
    storage dtype ``fields=`` or ``dtypes=`` chose (exactly, or an error), checked against its
    field by :func:`~._leaves.fit`, then copied once: into its row of a fixed field's batch
    array, or into its own array.
    ``declared``: the fields are ``fields=``'s (else the first sample's: a leaf of another shape
    raises :class:`ShapeVariesError`). TypeError/ValueError naming the sample and the field otherwise.

    A batch of flat samples whose every field takes its leaves as they are
    (:func:`~._leaves.exact_column`) is stacked field by field, without a call per leaf.
    """
    if raw and schema.exact:
        rows = list(map(schema.structure.candidates, raw))
        if None not in rows:
            stacked: list[Any] = []
            for leaves, exact in zip(zip(*rows, strict=True), schema.exact, strict=True):
                array = exact_column(leaves, exact)
                if array is None:
                    break
                stacked.append(array)
            else:
                return stacked
    origin = ", as fields= declares" if declared else ", from the first sample"
    fields = list(schema.fields.values())
    out: list[list[Any]] = [[] for _ in fields]
    for index, sample in zip(indices, raw, strict=True):
        try:
            leaves = worded_leaves(schema, sample, dtypes, declared=declared, where=f"dataset[{index}]", origin=origin)
        except LeafShapeError as error:
            if declared:
                raise ValueError(f"dataset[{index}]: {error}, which fields= declares") from None
            raise ShapeVariesError(index, error) from None
        for column, leaf in zip(out, leaves, strict=True):
            column.append(leaf)
    return [
        variable_column(column, field) if field.variable else write_column(column, field)
        for column, field in zip(out, fields, strict=True)
    ]


def fitted_leaves(schema: Schema, sample: Any, dtypes: Mapping[str, Any] | None, *, declared: bool) -> list[Any]:
    """``sample``'s leaves in field order, each as the file stores it: the one route from a leaf to storage.

    A leaf of a field whose dtype the user chose (every field when ``declared``, else those ``dtypes``
    names) is first converted to it, exactly or not at all (:func:`~._leaves.converted`); then
    :func:`~._leaves.fit` checks it against its field. What comes back is ready for
    :func:`~._leaves.write_column` / :func:`~._leaves.variable_column` (a miss batch) or for
    :func:`~mmapcache._region.tensor_to_numpy` (a stream element). Raises :class:`ConversionError` for a
    conversion that would change a value, :class:`~._leaves.LeafShapeError` for a shape that does not
    fit, TypeError/ValueError naming the field otherwise; callers say which sample it was.
    """
    out = []
    for leaf, (name, field) in zip(schema.flatten(sample), schema.fields.items(), strict=True):
        if declared or (dtypes is not None and name in dtypes):
            try:
                leaf = converted(leaf, field, name)
            except (TypeError, ValueError) as error:
                raise ConversionError(type(error), str(error)) from None
        out.append(fit(leaf, field, name))  # a loop, not a comprehension: every leaf of a miss or stream runs it
    return out


def worded_leaves(
    schema: Schema,
    sample: Any,
    dtypes: Mapping[str, Any] | None,
    *,
    declared: bool,
    where: str,
    origin: str = "",
    advice: str = "convert them before the cache, or in transform",
) -> list[Any]:
    """:func:`fitted_leaves`, its errors worded for the sample ``where`` names (``dataset[3]``, ``stream element
    3``): a value a conversion would change, or a leaf of another kind or dtype, says which field, what the
    fields are (``origin``: where they came from) and ``advice``. A :class:`~._leaves.LeafShapeError`
    propagates as it is: what to declare instead is the caller's to say."""
    try:
        return fitted_leaves(schema, sample, dtypes, declared=declared)
    except LeafShapeError:
        raise
    except ConversionError as error:
        raise error.kind(f"{where}: {error.message}") from None
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"{where}: {error}. mmapcache caches samples of one structure and dtype per field "
            f"({describe(schema.fields)}{origin}); {advice}"
        ) from None


class ConversionError(Exception):
    """A leaf that ``fields=``/``dtypes=`` cannot convert without loss: the error's type and its message."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def new_batch(
    shapes: Sequence[tuple[int, ...]],
    storage: Sequence[np.dtype[Any]],
    dtypes: Sequence[torch.dtype | None],
    *,
    private: bool = False,
) -> tuple[list[torch.Tensor], list[np.ndarray[Any, Any]]]:
    """Uninitialised batch tensors (the fields' torch dtypes) and numpy views of their storage dtypes.

    Inside a DataLoader worker the tensors live in shared memory, so handing
    them to the main process copies nothing; ``private`` keeps them in this
    process's memory (a batch that a transform turns into others never leaves it).
    """
    shared = not private and torch.utils.data.get_worker_info() is not None
    tensors, arrays = [], []
    for shape, dtype, torch_dtype in zip(shapes, storage, dtypes, strict=True):
        if shared:
            raw = shared_empty(shape, torch.from_numpy(np.empty(0, dtype)).dtype)
            array = raw.numpy()
        else:
            array = empty_aligned(shape, dtype)
            raw = torch.from_numpy(array)
        arrays.append(array)
        tensors.append(raw if torch_dtype is None else raw.view(torch_dtype))
    return tensors, arrays


def as_tensors(arrays: Sequence[np.ndarray[Any, Any]], dtypes: Sequence[torch.dtype | None]) -> list[torch.Tensor]:
    """Batch tensors over fresh storage arrays (viewed as a field's torch dtype where it has one)."""
    tensors = []
    for array, dtype in zip(arrays, dtypes, strict=True):
        tensor = torch.from_numpy(array)
        tensors.append(tensor if dtype is None else tensor.view(dtype))
    return tensors


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in a fresh shared-memory segment (page aligned), as default_collate makes in workers."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    strides = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)
