"""Turning what users pass to ``put`` into arrays of exactly a field's shape and dtype.

Rules: shapes must match exactly. Dtypes must match or cast within their kind
(``np.can_cast(..., "same_kind")``: float64 -> float32 is fine, float -> int is
not); integer and string narrowing is checked value by value, so 300 never
lands in a uint8 field as 44 and "abcdef" never becomes "abc". Python scalars
and lists may also go int -> float. torch tensors are detached and moved to
the CPU.

A field of a torch dtype numpy lacks (bfloat16, complex32, float8, ...) is
stored as raw bits in an unsigned integer of the same width: an array (or
tensor) of that width and kind *is* those bits, with or without torch.
Numbers (floats, other dtypes) need torch to become such bits.

The core's torch knowledge lives in :mod:`mmapcache._region.tensors`, imported only
when a value is a tensor (torch is then loaded already) or numbers must be
converted into a torch-only dtype; this module never imports torch itself.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._field import Field

__all__ = ["coerce_batch", "coerce_sample", "coerce_value", "text_array"]


def coerce_sample(sample: Any, fields: dict[str, Field]) -> list[np.ndarray[Any, Any]]:
    """One array per field, in field order, for a single sample mapping."""
    _check_names(sample, fields)
    return [coerce_value(sample[name], field, name) for name, field in fields.items()]


def coerce_batch(batch: Any, fields: dict[str, Field], count: int) -> list[Any]:
    """Per field, in field order: a stacked array of shape ``(count, *field.shape)`` (fixed fields),
    or a list of ``count`` arrays, one per row (variable fields)."""
    _check_names(batch, fields)
    return [
        _coerce_rows(batch[name], field, name, count)
        if field.variable
        else coerce_value(batch[name], field, name, count=count)
        for name, field in fields.items()
    ]


def _coerce_rows(values: Any, field: Field, name: str, count: int) -> list[np.ndarray[Any, Any]]:
    """A variable field's batch: a sequence of ``count`` values, each of its own shape."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise TypeError(
            f"field {name!r} has variable dimensions: give a sequence of {count} values (one per row), "
            f"not {type(values).__name__}"
        )
    if len(values) != count:
        raise ValueError(f"field {name!r}: expected {count} values (one per row), got {len(values)}")
    return [coerce_value(value, field, name) for value in values]


def _check_names(sample: Any, fields: dict[str, Field]) -> None:
    if not isinstance(sample, Mapping):
        raise TypeError(
            f"a sample must be a mapping of field name -> value (fields: {', '.join(fields)}), "
            f"not {type(sample).__name__}"
        )
    if sample.keys() != fields.keys():
        missing = [n for n in fields if n not in sample]
        extra = [str(n) for n in sample if n not in fields]
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unknown {', '.join(map(repr, extra))}")
        raise ValueError(f"sample fields do not match the cache: {'; '.join(parts)} (expected {list(fields)})")


def coerce_value(value: Any, field: Field, name: str, *, count: int | None = None) -> np.ndarray[Any, Any]:
    """``value`` as an array of ``field``'s dtype and shape (with a leading ``count`` axis).

    A variable field takes any shape with the field's number of dimensions and
    its fixed ones (``count`` is for fixed fields only).
    """
    if field.text is not None:
        return text_array(value, field.text, name)
    if _is_tensor(value):
        from .tensors import tensor_to_numpy  # torch is loaded already: the value is a tensor

        array = cast(tensor_to_numpy(value, field, name), field, name, from_python=False)
    elif field.torch_dtype is not None:
        array = _to_bits(value, field, name)
    else:
        array = _to_numpy(value, field, name)
    if count is None and field.fits(array.shape):
        return array
    if count is not None and array.shape[:1] == (count,) and field.fits(array.shape[1:]):
        return array
    what = "batch" if count is not None else "sample"
    shape = _spelled(field.shape if count is None else (count, *field.shape))
    raise ValueError(f"field {name!r}: expected a {what} of shape {shape}, got shape {array.shape}")


def text_array(value: Any, kind: str, name: str) -> np.ndarray[Any, Any]:
    """A text field's value (``str`` for a str field, bytes-like for a bytes field) as its stored uint8 bytes.

    A 1-D uint8 array is taken as the stored bytes themselves (UTF-8 for a str field).
    """
    if kind == "str" and isinstance(value, str):
        try:
            return np.frombuffer(value.encode("utf-8"), np.uint8)
        except UnicodeEncodeError as error:  # a lone surrogate ("\ud800") has no UTF-8 form
            raise ValueError(f"field {name!r}: the string cannot be encoded as UTF-8 ({error.reason})") from None
    if kind == "bytes" and isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(value), np.uint8)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:  # the stored bytes themselves
        if kind == "str":
            try:
                value.tobytes().decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"field {name!r}: the bytes given for a str value are not UTF-8 ({error})") from None
        return value
    want = "a str" if kind == "str" else "bytes (or a bytearray or memoryview)"
    raise TypeError(f"field {name!r} holds {kind} values: give {want}, not {type(value).__name__}")


def _spelled(shape: tuple[int | None, ...]) -> str:
    """A shape for messages, ``None`` dimensions shown as ``*`` (any size): ``(3, *, *)``."""
    dims = ["*" if d is None else str(d) for d in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


def _is_tensor(value: Any) -> bool:
    # Nothing can be a tensor unless torch was imported; never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _to_bits(value: Any, field: Field, name: str) -> np.ndarray[Any, Any]:
    """A value for a torch-only field: raw bits as they are, numbers converted by torch."""
    if isinstance(value, (np.ndarray, np.generic)) and _is_raw_bits(value.dtype, field):
        return np.asarray(value).astype(field.dtype, copy=False)  # the bits themselves
    try:
        from .tensors import value_to_numpy
    except ImportError:
        raise TypeError(
            f"field {name!r}: converting {type(value).__name__} values to {field.dtype_name} needs torch, "
            f"which cannot be imported; install torch, or pass the raw bits as a {field.dtype} array "
            f"(e.g. tensor.view(torch.{field.dtype}).numpy())"
        ) from None
    return value_to_numpy(value, field, name)


def _is_raw_bits(dtype: np.dtype[Any], field: Field) -> bool:
    return dtype.kind == "u" and dtype.itemsize == field.dtype.itemsize


def _to_numpy(value: Any, field: Field, name: str) -> np.ndarray[Any, Any]:
    from_python = not isinstance(value, (np.ndarray, np.generic))
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as error:
        raise ValueError(f"field {name!r}: cannot read {type(value).__name__} as an array ({error})") from None
    if array.dtype.hasobject:
        raise TypeError(
            f"field {name!r}: got {type(value).__name__} that is not a fixed-size {field.dtype_name} "
            "array (ragged lists, None, arbitrary objects or ints beyond 64 bits cannot be stored)"
        )
    return cast(array, field, name, from_python=from_python)


def cast(array: np.ndarray[Any, Any], field: Field, name: str, *, from_python: bool) -> np.ndarray[Any, Any]:
    """``array`` in ``field.dtype``, refusing kind changes and lossy integer/string narrowing."""
    if array.dtype == field.dtype and field.dtype.names is None:
        return array  # the common case, before field.dtype_name (a few µs) is needed for a message
    return _cast(array, field.dtype, field.dtype_name, name, from_python=from_python)


def _cast(
    array: np.ndarray[Any, Any], target: np.dtype[Any], target_name: str, name: str, *, from_python: bool
) -> np.ndarray[Any, Any]:
    source = array.dtype
    if target.names is not None and source != target:
        return _cast_by_name(array, target, name, from_python=from_python)
    if source == target:
        return array
    python_number = from_python and source.kind in "iub" and target.kind in "fc"
    if not (np.can_cast(source, target, "same_kind") or python_number or _python_int(source, target, from_python)):
        raise TypeError(
            f"field {name!r}: cannot store {source} values in a {target_name} field "
            f"(only casts within the same kind are allowed, e.g. float64 -> float32); "
            f"convert them to {target_name} first"
        )
    if array.size and not np.can_cast(source, target, "safe"):
        _check_fits(array, target, target_name, name)
    return array.astype(target)


def _cast_by_name(
    array: np.ndarray[Any, Any], target: np.dtype[Any], name: str, *, from_python: bool
) -> np.ndarray[Any, Any]:
    """A structured value, member by member *by name* (numpy's own cast goes by position)."""
    assert target.names is not None
    source_names = array.dtype.names
    if source_names is None or set(source_names) != set(target.names):
        got = "no named members" if source_names is None else f"members {list(source_names)}"
        raise TypeError(
            f"field {name!r}: the field is a structured {target} with members {list(target.names)}, "
            f"the value has {got}; give a structured array with exactly those members"
        )
    out = np.empty(array.shape, target)
    for member in target.names:
        slot = out[member]
        value = _cast(array[member], slot.dtype, str(slot.dtype), f"{name}.{member}", from_python=from_python)
        if value.shape != slot.shape:
            raise ValueError(
                f"field {name!r}: member {member!r} has shape {value.shape[array.ndim :]}, "
                f"the field stores {slot.shape[array.ndim :]}"
            )
        slot[...] = value
    return out


def _check_fits(array: np.ndarray[Any, Any], target: np.dtype[Any], target_name: str, name: str) -> None:
    """Refuse integer values outside the target's range and strings longer than its width."""
    if target.kind in "iu" and array.dtype.kind in "iu":
        info = np.iinfo(target)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise ValueError(
                f"field {name!r}: values from {low} to {high} are out of range for "
                f"{target_name} ({info.min} to {info.max})"
            )
    elif target.kind in "SU" and not np.array_equal(array.astype(target), array):
        raise ValueError(f"field {name!r}: some strings are too long for {target_name}")


def _python_int(source: np.dtype[Any], target: np.dtype[Any], from_python: bool) -> bool:
    # np.asarray(5) is int64, and int64 -> uint8 is not "same_kind"; a Python
    # int has no width, so it may go to any integer field (the caller then
    # checks that every value fits).
    return from_python and source.kind in "iu" and target.kind in "iu"
