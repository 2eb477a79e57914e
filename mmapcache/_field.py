"""`Field`: the fixed shape and dtype of one named part of a sample.

A field's values are stored as a numpy dtype. torch dtypes that numpy lacks
(bfloat16, complex32, the float8 family, bits*) are stored as their raw bits in
an unsigned integer of the same width and remembered by name in
``Field.torch_dtype``, so :mod:`mmapcache.torch` hands them back as the torch
dtype they were. Such a field needs no torch to exist, nor to store and read
its raw bits (see :mod:`mmapcache._region.values`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["TEXT_KINDS", "Field", "FieldsLike", "normalize_fields"]

# numpy (and off_t) cannot describe an array of more bytes than this; numpy
# refuses such a shape even when another dimension is 0.
_MAX_NBYTES = 2**63 - 1

_BITS_BY_SIZE: dict[int, np.dtype[Any]] = {
    1: np.dtype("u1"),
    2: np.dtype("=u2"),
    4: np.dtype("=u4"),
    8: np.dtype("=u8"),
}


class Field:
    """One named part of a sample: a ``shape`` and a ``dtype``.

    >>> Field((3, 32, 32), "uint8").nbytes
    3072
    >>> Field((), "int64") == Field((), np.int64)
    True
    >>> Field((None,), "int32").variable  # token sequences of any length
    True

    ``dtype`` is anything ``numpy.dtype()`` accepts, or a ``torch.dtype``.
    ``Field.dtype`` is the numpy dtype the values are stored as;
    ``Field.torch_dtype`` names the torch dtype for types numpy lacks
    (e.g. ``"bfloat16"``), else it is ``None``.

    A dimension given as ``None`` is variable: each sample has its own size
    there (``Field((3, None, None), "uint8")`` holds images of any height and
    width, ``Field((None, 4), "float32")`` any number of boxes). Such a field
    is stored in the cache's variable region, sized by ``max_bytes``.

    ``dtype=str`` or ``bytes`` makes a *text* field: ``Field((None,), str)``
    holds strings of any length, stored as their UTF-8 bytes (``bytes``: as
    given); ``Field.dtype`` is then ``uint8`` and ``Field.text`` says which.
    """

    __slots__ = ("dtype", "shape", "text", "torch_dtype", "variable")

    # Plain read-only attributes, not properties: reading one runs no Python code (every batch reads them).
    #: The dimensions; ``None`` where each sample has its own size.
    shape: tuple[int | None, ...]
    #: The numpy dtype the values are stored as.
    dtype: np.dtype[Any]
    #: The torch dtype's name for dtypes numpy lacks (``"bfloat16"``), else ``None``.
    torch_dtype: str | None
    #: ``"str"`` (UTF-8) or ``"bytes"`` for a text field, whose values are stored as their bytes; else None.
    text: str | None
    #: Whether some dimension is ``None`` (each sample has its own shape).
    variable: bool

    def __init__(self, shape: Iterable[int | None] | int, dtype: Any) -> None:
        dims = _normalize_shape(shape)
        text = _text_kind(dtype)
        if text is not None:
            if dims != (None,):
                raise ValueError(
                    f"a {text} field holds one value of any length per sample: declare it as "
                    f"Field((None,), {text}), not with shape {dims}"
                )
            _set(self, dims, np.dtype(np.uint8), None, text)
            return
        stored, torch_dtype = _normalize_dtype(dtype)
        _set(self, dims, stored, torch_dtype, None)
        if stored.itemsize == 0 and None in dims:
            raise ValueError(
                f"Field({dims!r}, {self.dtype_name!r}): a field with variable dimensions needs a dtype "
                "of at least one byte, and this one has none (a structured dtype without fields or with "
                "empty ones); give the dtype a field of non-zero size, or use a fixed shape"
            )
        span = math.prod(d for d in dims if d) * stored.itemsize  # numpy checks it even with a 0
        if span > _MAX_NBYTES:
            raise ValueError(
                f"Field({dims!r}, {self.dtype_name!r}) spans {span} bytes, more than an array "
                f"can describe ({_MAX_NBYTES} bytes); use smaller dimensions"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Field cannot be changed (its {name!r}); make a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Field cannot be changed (its {name!r}); make a new one")

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """The shape of a fixed field; ``TypeError`` for a variable one."""
        if self.variable:
            raise TypeError(f"{self!r} has variable dimensions: each sample has its own shape")
        return self.shape  # type: ignore[return-value]  # no None in it

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` can be stored: same number of dimensions, and every fixed one equal."""
        return len(shape) == len(self.shape) and all(
            d is None or d == n for d, n in zip(self.shape, shape, strict=True)
        )

    @property
    def nbytes(self) -> int:
        """Bytes one sample of this field takes (fixed fields; ``TypeError`` for a variable one)."""
        return math.prod(self.fixed_shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The dtype as people write it: ``"uint8"``, ``"bfloat16"``, ``"<U10"``; ``"str"``/``"bytes"`` for text."""
        if self.text is not None:
            return self.text
        if self.torch_dtype is not None:
            return self.torch_dtype
        if self.dtype.isbuiltin and self.dtype.isnative:
            return str(self.dtype.name)
        return str(self.dtype.str if self.dtype.fields is None else self.dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Field):
            return NotImplemented
        return (self.shape, self.dtype, self.torch_dtype, self.text) == (
            other.shape,
            other.dtype,
            other.torch_dtype,
            other.text,
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.torch_dtype, self.text))

    def __repr__(self) -> str:
        if self.text is not None:
            return f"Field({self.shape!r}, {self.text})"
        return f"Field({self.shape!r}, {self.dtype_name!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_field_from_state, (self.shape, self.dtype, self.torch_dtype, self.text))


def _set(
    field: Field, shape: tuple[int | None, ...], dtype: np.dtype[Any], torch_dtype: str | None, text: str | None
) -> None:
    """A field's attributes set, once (a Field refuses ``setattr`` afterwards)."""
    put = object.__setattr__
    put(field, "shape", shape)
    put(field, "dtype", dtype)
    put(field, "torch_dtype", torch_dtype)
    put(field, "text", text)
    put(field, "variable", None in shape)


def _field_from_state(
    shape: tuple[int, ...], dtype: np.dtype[Any], torch_dtype: str | None, text: str | None = None
) -> Field:
    field = Field.__new__(Field)
    _set(field, shape, dtype, torch_dtype, text)
    return field


TEXT_KINDS = ("str", "bytes")


def _text_kind(dtype: Any) -> str | None:
    """``"str"``/``"bytes"`` when ``dtype`` asks for a text field (the type ``str``/``bytes``, or its name)."""
    if dtype is str or dtype is bytes:
        return dtype.__name__
    if isinstance(dtype, str) and dtype in TEXT_KINDS:
        return dtype
    return None


def _normalize_shape(shape: Iterable[int | None] | int) -> tuple[int | None, ...]:
    dims_in: Iterable[Any] = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        if isinstance(shape, (bool, str)):
            raise TypeError
        dims = tuple(None if d is None else operator.index(d) for d in dims_in)
    except TypeError:
        raise TypeError(
            f"a Field shape must be a tuple of ints (None for a variable dimension), e.g. (3, 32, 32), "
            f"(None,) or (), not {shape!r}"
        ) from None
    if any(d is not None and d < 0 for d in dims):
        raise ValueError(f"a Field shape must not have negative dimensions, got {dims}")
    return dims


def _is_torch_dtype(dtype: Any) -> bool:
    kind = type(dtype)
    return kind.__module__ == "torch" and kind.__name__ == "dtype"


def _normalize_dtype(dtype: Any) -> tuple[np.dtype[Any], str | None]:
    if _is_torch_dtype(dtype):
        return _from_torch_dtype(dtype)
    if isinstance(dtype, str) and dtype.startswith("torch."):
        raise TypeError(f"pass the torch dtype itself (e.g. torch.bfloat16), not the string {dtype!r}")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as error:
        if isinstance(dtype, str) and dtype in _TORCH_ONLY_NAMES:
            return _BITS_BY_SIZE[_TORCH_ONLY_NAMES[dtype]], dtype
        raise TypeError(f"{dtype!r} is not a dtype numpy or torch understands: {error}") from None
    _check_storable(np_dtype)
    return np_dtype, None


def _check_storable(dtype: np.dtype[Any]) -> None:
    if dtype.hasobject:
        raise TypeError(
            f"dtype {dtype} holds Python objects, which cannot live in a shared file; "
            "store fixed-size values (numbers, fixed-length 'S'/'U' strings) instead"
        )
    if dtype.subdtype is not None:
        raise TypeError(
            f"dtype {dtype} has a sub-array; put its shape {dtype.shape} into Field.shape "
            f"and use the element dtype {dtype.base} instead"
        )
    if dtype.itemsize == 0 and dtype.fields is None:
        raise TypeError(f"dtype {dtype} has no size; give strings a length, e.g. 'U16' or 'S32'")


# torch dtypes without a numpy equivalent, by name, with their size in bytes.
# Quantized dtypes are refused: their scale and zero point live outside the data.
_TORCH_ONLY_NAMES = {
    "bfloat16": 2,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"{sign}int{n}": 1 for sign in ("", "u") for n in range(1, 8)},
}


def _from_torch_dtype(dtype: Any) -> tuple[np.dtype[Any], str | None]:
    name = str(dtype).removeprefix("torch.")
    if getattr(dtype, "is_quantized", False) or name.startswith(("qint", "quint")):
        raise TypeError(
            f"torch.{name} is a quantized dtype: its scale and zero point are not part of "
            "the data, so it cannot be cached; cache the dequantized or integer tensor instead"
        )
    if name in _TORCH_ONLY_NAMES:
        return _BITS_BY_SIZE[int(dtype.itemsize)], name
    try:
        return np.dtype(name), None
    except TypeError:
        size = int(dtype.itemsize)
        if size not in _BITS_BY_SIZE:
            raise TypeError(f"torch.{name} ({size} bytes per element) cannot be stored") from None
        return _BITS_BY_SIZE[size], name


FieldsLike = Mapping[str, "Field | tuple[Any, Any]"]


def normalize_fields(fields: FieldsLike) -> dict[str, Field]:
    """Return ``{name: Field}`` in the given order from Fields or ``(shape, dtype)`` pairs."""
    if not isinstance(fields, Mapping):
        raise TypeError(
            f"fields must be a mapping of name -> Field(shape, dtype) or (shape, dtype), not {type(fields).__name__}"
        )
    if not fields:
        raise ValueError("fields must name at least one field")
    result: dict[str, Field] = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"field names must be non-empty strings, got {name!r}")
        if isinstance(spec, Field):
            result[name] = spec
        elif isinstance(spec, tuple) and len(spec) == 2:
            result[name] = Field(spec[0], spec[1])
        else:
            raise TypeError(f"field {name!r}: expected Field(shape, dtype) or a (shape, dtype) pair, got {spec!r}")
    return result
