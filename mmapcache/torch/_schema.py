"""A cache's fields as the torch layer sees them: inferred from a sample, declared, described.

:class:`Schema` goes between samples and per-field leaves (through the pure
structure codec, :mod:`mmapcache.torch._structure`) and between storage arrays and
tensors. The functions decide which fields a new file gets — the first
sample's own (:func:`infer_fields`, with ``dtypes=``), or ``fields=`` checked
against it — and spell them in messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import SchemaMismatchError
from .._field import Field, FieldsLike, normalize_fields
from .._region import Jagged, text_value, torch_dtype
from ._leaves import (
    SUPPORTED,
    Exact,
    check_declared,
    declared_leaves,
    exact_leaves,
    fit,
    is_field_value,
    is_leaf,
    is_numbers,
    leaf_field,
    leaf_hint,
    leaf_shape,
    misfit,
    variable_column,
)
from ._structure import BARE, Structure, name_leaves

if TYPE_CHECKING:
    from ._columns import ShapeVariesError

__all__ = [
    "Schema",
    "check_declared_sample",
    "declaration",
    "declared_fields",
    "describe",
    "first_fields",
    "infer_fields",
    "sample_fields",
    "storage_dtypes",
    "varying_shapes",
    "with_dtypes",
]


def infer_fields(sample: Any) -> dict[str, Field]:
    """The cache fields for ``sample``, named by their place in it (see :mod:`mmapcache.torch`)."""
    leaves = name_leaves(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)
    return {name: leaf_field(leaf, name) for name, leaf in leaves.items()}


class Schema:
    """The fields of the cache, and how to go between samples and per-field leaves."""

    def __init__(self, fields: dict[str, Field], path: Path) -> None:
        self.fields = dict(fields)
        self.names = tuple(fields)
        try:
            self.structure = Structure(self.names)
        except ValueError:
            raise SchemaMismatchError(
                f"the fields {list(self.names)} of the cache at {path} were not laid out by CachedDataset "
                "(see mmapcache.torch's docstring for the naming); use another key or path",
                path=path,
                differences={"fields": (None, list(self.names))},
            ) from None
        self.tree = self.structure.tree
        self.dtypes = tuple(torch_dtype(f) if f.torch_dtype is not None else None for f in fields.values())
        self.build = self.structure.build
        # Variable fields are read as one array per sample; the batch tricks are for fixed ones only.
        self.variable = tuple(field.variable for field in fields.values())
        self.fixed = [name for name, field in fields.items() if not field.variable]
        self.ragged = any(self.variable)
        self.texts = tuple(field.text for field in fields.values())
        # A batch of the fixed fields, as a read gathers it: each one's row shape, numpy and torch dtype.
        fixed = [(k, field) for k, field in enumerate(fields.values()) if not field.variable]
        self.fixed_shapes = tuple(field.fixed_shape for _, field in fixed)
        self.fixed_storage = tuple(field.dtype for _, field in fixed)
        self.fixed_dtypes = tuple(self.dtypes[k] for k, _ in fixed)
        # What each field's column takes as it is, when every field has such leaves (no variable field).
        exact = tuple(exact_leaves(field) for field in fields.values())
        self.exact: tuple[Exact, ...] = () if None in exact else exact  # type: ignore[assignment]

    def to_tensor(self, array: Any, position: int) -> Any:
        """A storage array of the field at ``position`` as a tensor of its torch dtype, sharing memory.

        A text field's value is its ``str``/``bytes`` (decoded here when given as stored bytes).
        """
        kind = self.texts[position]
        if kind is not None:
            return array if isinstance(array, (str, bytes)) else text_value(kind, array)
        tensor = torch.from_numpy(array)
        dtype = self.dtypes[position]
        return tensor if dtype is None else tensor.view(dtype)

    def to_tensors(self, arrays: Iterable[np.ndarray[Any, Any]]) -> list[torch.Tensor]:
        """Storage arrays (one per field) as tensors of the fields' torch dtypes, sharing memory."""
        return [self.to_tensor(array, k) for k, array in enumerate(arrays)]

    def flatten(self, sample: Any) -> list[Any]:
        """``sample``'s leaves in field order; ValueError/TypeError naming the first part that does not fit."""
        leaves = self.structure.candidates(sample)
        if leaves is not None and all(map(is_field_value, leaves)):
            return leaves
        try:
            return self.structure.flatten(sample, is_field_value, supported=SUPPORTED, hint=leaf_hint)
        except ValueError as error:
            raise ValueError(_numbers_advice(self, sample) or str(error)) from None

    def rows(self, columns: list[Any]) -> list[Any]:
        """Gathered columns (a batch tensor, a :class:`~mmapcache.Jagged` or a list per field) as leaves per sample."""
        rows: list[Any] = []
        for k, column in enumerate(columns):  # a loop, not a comprehension: every batch runs it
            if isinstance(column, torch.Tensor):
                rows.append(column.unbind(0))
            elif isinstance(column, Jagged):
                rows.append([None if a is None else self.to_tensor(a, k) for a in column])
            else:
                rows.append(column)
        return rows

    def with_rows(self, columns: list[Any], found: Mapping[int, list[Any]]) -> list[Any]:
        """Gathered columns with the leaves of the rows in ``found`` (samples loaded, not read) put in.

        A :class:`~mmapcache.Jagged` is rebuilt with them (each leaf converted exactly to the storage dtype).
        """
        out = []
        for k, (column, (name, field)) in enumerate(zip(columns, self.fields.items(), strict=True)):
            if isinstance(column, Jagged):
                arrays: list[Any] = list(column)
                for row, leaves in found.items():
                    arrays[row] = variable_column([fit(leaves[k], field, name, convert=True)], field)[0]
                column = Jagged.from_arrays(arrays, dtype=field.dtype, tail=column.tail, ndim=column.shapes.shape[1])
            else:
                for row, leaves in found.items():
                    column[row] = leaves[k]
            out.append(column)
        return out

    def samples(self, columns: list[Any]) -> list[Any]:
        """Samples, as a read returns them, from storage columns (an array per fixed field, a list per variable one)."""
        return self.build(
            [
                [self.to_tensor(a, k) for a in column] if self.variable[k] else self.to_tensor(column, k).unbind(0)
                for k, column in enumerate(columns)
            ]
        )


_POSITION = re.compile(r"(.*)\[(0|[1-9][0-9]*)\]")


def _numbers_advice(schema: Schema, sample: Any) -> str | None:
    """For a sample whose list of numbers has another length than the first sample's (whose fields, without
    ``fields=``, are one per position): what to declare instead. ``None`` for any other sample."""
    try:
        leaves = name_leaves(sample, is_field_value, supported=SUPPORTED, hint=leaf_hint)
    except (TypeError, ValueError):
        return None
    lists = [name for name, leaf in leaves.items() if is_numbers(leaf) and f"{name}/[0]" in schema.fields]
    lists += [name for name, leaf in leaves.items() if is_numbers(leaf) and name == BARE and "[0]" in schema.fields]
    if not lists:
        return None
    name = lists[0]
    prefix = "[" if name == BARE else f"{name}/["
    first = sum(1 for field in schema.fields if field.startswith(prefix))
    spelled = {
        other: 'Field((None,), "int64")'
        if is_numbers(leaf)
        else f"Field({schema.fields[other].shape!r}, {json.dumps(schema.fields[other].dtype_name)})"
        if other in schema.fields
        else "..."
        for other, leaf in leaves.items()
    }
    declaration = "{" + ", ".join(f"{json.dumps(other)}: {field}" for other, field in spelled.items()) + "}"
    return (
        f"field {name!r}: a Python list of {len(leaves[name])} numbers, where the first sample's had "
        f"{first}: without fields=, a list is a structure of one field per position. Declare it as one field "
        f"whose length varies (fields={declaration}, with Field from mmapcache and max_bytes=), or give arrays "
        '(a Hugging Face dataset does with .with_format("numpy"))'
    )


def _positions(stem: str, first: int, last: int) -> str:
    return f"{stem}[{first}]" if first == last else f"{stem}[{first}..{last}]"


def describe(fields: Mapping[str, Field]) -> str:
    """``{'0': (3, 32, 32) uint8, ...}``: fields as messages show them.

    Consecutive list positions of one field (what a list of numbers makes without ``fields=``) are shown
    once: ``'input_ids/[0..511]': () int64``.
    """
    parts: list[tuple[str, int, int, str]] = []  # (list, first position, last position, field) or (name, -1, -1, ..)
    for name, field in fields.items():
        spelled = f"{field.shape} {field.dtype_name}"
        position = _POSITION.fullmatch(name)
        if position is not None:
            stem, k = position.group(1), int(position.group(2))
            if parts and parts[-1][0] == stem and parts[-1][2] == k - 1 and parts[-1][3] == spelled:
                parts[-1] = (stem, parts[-1][1], k, spelled)
                continue
            parts.append((stem, k, k, spelled))
        else:
            parts.append((name, -1, -1, spelled))
    shown = [
        f"{stem!r}: {spelled}" if first < 0 else f"{_positions(stem, first, last)!r}: {spelled}"
        for stem, first, last, spelled in parts
    ]
    return "{" + ", ".join(shown) + "}"


def declared_fields(fields: FieldsLike) -> dict[str, Field]:
    """``fields=`` of a CachedDataset, checked for what does not depend on the samples."""
    declared = normalize_fields(fields)
    try:
        Structure(declared)
    except ValueError as error:
        raise ValueError(
            f"fields= names {list(declared)} do not describe a sample ({error}). The names are the places of "
            "the leaves in a sample: '.' for a bare leaf; '0', '1' for a tuple's elements; '[0]', '[1]' for a "
            "list's; 'image' for a dict key; '1/m' one level down (see mmapcache.torch)"
        ) from None
    for name, field in declared.items():
        check_declared(field, name)
    return declared


def storage_dtypes(dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """``dtypes=`` checked: field names to dtypes numpy or torch understand (kept as given, for pickling)."""
    if not isinstance(dtypes, Mapping):
        raise TypeError(
            f"dtypes must map field names to dtypes, e.g. {{'0': torch.uint8}}, not {type(dtypes).__name__}"
        )
    for name, dtype in dtypes.items():
        if not isinstance(name, str):
            raise TypeError(f"dtypes= keys are field names (strings such as '0' or 'image'), not {name!r}")
        check_declared(Field((), dtype), name)
    return dict(dtypes)


def with_dtypes(fields: dict[str, Field], dtypes: Mapping[str, Any], *, where: str) -> dict[str, Field]:
    """``fields`` with the storage dtypes ``dtypes=`` sets, each named field keeping its shape.

    ``where`` names what ``fields`` came from (``"fields="``, ``"dataset[0]"``), for the errors.
    """
    out = dict(fields)
    for name, dtype in dtypes.items():
        if name not in out:
            raise ValueError(
                f"dtypes= names the field {name!r}, but {where} has the fields {list(out)} "
                "(named by their place in the sample: see mmapcache.torch)"
            )
        if out[name].text is not None:
            raise TypeError(f"dtypes= gives field {name!r} a dtype, but it holds {out[name].text} values")
        out[name] = Field(out[name].shape, dtype)
    return out


def sample_fields(sample: Any, index: int, dtypes: Mapping[str, Any] | None) -> dict[str, Field]:
    """``sample``'s own fields, with the storage dtypes ``dtypes=`` sets."""
    return with_dtypes(infer_fields(sample), dtypes or {}, where=f"dataset[{index}]")


def check_declared_sample(sample: Any, index: int, fields: Mapping[str, Field]) -> None:
    """TypeError/ValueError naming the field unless ``sample`` fits ``fields=``."""
    problem = misfit(sample, fields, convert=True)
    if problem is not None:
        kind, message = problem
        raise kind(f"dataset[{index}] does not fit fields=: {message}")


def first_fields(
    sample: Any, index: int, declared: dict[str, Field] | None, dtypes: Mapping[str, Any] | None
) -> dict[str, Field]:
    """The fields to create the file with: ``fields=`` (checked against ``sample``) or ``sample``'s own.

    ``dtypes=`` sets the storage dtype of the fields it names.
    """
    if declared is None:
        return sample_fields(sample, index, dtypes)
    check_declared_sample(sample, index, declared)
    # The sample's order (dict keys keep theirs).
    order = declared_leaves(sample, declared)
    return {name: declared[name] for name in order}


def declaration(schema: Schema, samples: list[Any]) -> str:
    """``fields=`` as Python source: the schema, with None where ``samples`` differ in size."""
    shapes = {name: list(field.shape) for name, field in schema.fields.items()}
    for sample in samples:
        try:
            leaves = schema.flatten(sample)
        except (TypeError, ValueError):
            continue
        for name, leaf in zip(schema.names, leaves, strict=True):
            shape, seen = leaf_shape(leaf), shapes[name]
            if len(shape) == len(seen):
                shapes[name] = [None if old != new else old for old, new in zip(seen, shape, strict=True)]
    entries = [
        f"{json.dumps(name)}: Field({tuple(shapes[name])!r}, {json.dumps(field.dtype_name)})"
        for name, field in schema.fields.items()
    ]
    return "{" + ", ".join(entries) + "}"


def varying_shapes(schema: Schema, varies: ShapeVariesError, raw: list[Any], path: Path, refuted: str | None) -> str:
    """The message for a sample whose shape differs from the first one's, when ``fields=`` was not given.

    ``refuted``: what became of the file made with fixed shapes (``None``: nothing was created).
    """
    index, error = varies.index, varies.error
    name, shape, field = error.name, error.shape, error.field
    if refuted is None:  # nothing was created: the schema is the first sample's of this batch
        where, exists = f"the first sample's is {field.shape}", ""
    else:
        where = f"the cache's field has the fixed shape {field.shape}"
        exists = f" The cache at {path} was made with fixed shapes: {refuted}"
    if len(shape) != len(field.shape):
        return (
            f"dataset[{index}]: field {name!r} has shape {shape}, but {where}: a field has a fixed number of "
            "dimensions; only their sizes may vary (declared as None with fields=). Reshape or pad before the "
            f"cache, or move that part into transform.{exists}"
        )
    return (
        f"dataset[{index}]: field {name!r} has shape {shape}, but {where}: without fields=, every field keeps "
        "the fixed shape of the first sample. To cache samples whose shapes vary, declare the fields with None "
        "for each dimension that varies, and a max_bytes= budget for the values: "
        f"CachedDataset(..., fields={declaration(schema, raw)}, max_bytes=...), with Field from mmapcache. "
        f"Or pad, crop or resize before the cache.{exists}"
    )
