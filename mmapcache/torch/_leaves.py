"""The leaves of a sample: what may be one, the field it makes, and ONE rule for whether it fits a field.

A leaf is a tensor, a numpy array or scalar, or a Python bool/int/float/str/
bytes (:func:`is_leaf`). :func:`leaf_field` is the field a first sample's leaf
makes; :func:`fit` is the only place that decides whether a leaf fits a field
(tensors and arrays keep its dtype exactly and fit its shape; Python scalars
and text follow the core's casting rules, :func:`mmapcache._region.values.coerce_value`);
:func:`misfit` asks it for a whole sample without raising. A field whose dtype
the user chose (``fields=``, ``dtypes=``) first converts a leaf of another
numeric dtype with :func:`convert_leaf`, which refuses any conversion that
changes a value (:func:`converted`). :func:`write_column`
and :func:`variable_column` then copy the fitted leaves of a batch once into
storage arrays.

A miss batch asks :func:`fit` nothing when every leaf of a fixed field is one
it would return as it is (:func:`exact_column`: a CPU tensor or an array of the
field's dtype and shape, or a Python number of the field's own dtype): those
are stacked into the storage array at once, and any other batch goes leaf by
leaf through :func:`fit`, which raises for the first that does not fit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .._field import Field
from .._region import BITS, as_tensor, coerce_value, torch_dtype
from ._structure import name_leaves

__all__ = [
    "SUPPORTED",
    "Exact",
    "LeafShapeError",
    "as_text",
    "check_declared",
    "convert_leaf",
    "converted",
    "declared_leaves",
    "exact_column",
    "exact_leaves",
    "fit",
    "is_field_value",
    "is_leaf",
    "is_numbers",
    "leaf_field",
    "leaf_hint",
    "leaf_shape",
    "misfit",
    "variable_column",
    "write_column",
]

SUPPORTED = (
    "a torch.Tensor, a numpy array or scalar, a Python bool/int/float/str/bytes, "
    "or a tuple/list/dict of those (nested at most one level)"
)


def is_leaf(value: Any) -> bool:
    """Whether ``value`` is one field of a CachedDataset sample (a leaf of its structure)."""
    return isinstance(value, (torch.Tensor, np.ndarray, np.generic, bool, int, float, str, bytes))


def is_numbers(value: Any) -> bool:
    """Whether ``value`` is a Python list of numbers (Hugging Face's token ids): one leaf where a field is declared.

    Only the first item is looked at; :func:`fit` judges the whole list.
    """
    return type(value) is list and (not value or isinstance(value[0], (int, float, np.number, np.bool_)))


def is_field_value(value: Any) -> bool:
    """Whether ``value`` can be the value of a field: a leaf, or a list of numbers (see :func:`declared_leaves`)."""
    return is_leaf(value) or is_numbers(value)


def declared_leaves(sample: Any, fields: Mapping[str, Field]) -> dict[str, Any]:
    """``sample``'s leaves named as ``fields`` (``fields=``) names them.

    A list of numbers is one leaf where the fields declare one (``{"input_ids": [101, 2023]}`` with
    ``fields={"input_ids": Field((None,), "uint16")}``), and a structure of one leaf per position where
    they name its positions (``[0]``, ``[1]``). When neither matches, the leaves with each list of numbers
    as one (their names are what an error lists, one per field rather than one per number).
    """
    try:
        as_values: dict[str, Any] | None = name_leaves(sample, is_field_value, supported=SUPPORTED, hint=leaf_hint)
    except (TypeError, ValueError):
        as_values = None
    if as_values is not None and set(as_values) == set(fields):
        return as_values
    try:
        plain = name_leaves(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)
    except (TypeError, ValueError):
        if as_values is None:
            raise
        return as_values
    return plain if set(plain) == set(fields) or as_values is None else as_values


def leaf_field(value: Any, name: str) -> Field:
    """The field a leaf (the first sample's) makes; TypeError if it cannot be cached."""
    where = f"field {name!r}"
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested:
            raise TypeError(f"{where}: {value.layout} tensors cannot be cached; use dense tensors ({SUPPORTED})")
        return Field(tuple(value.shape), value.dtype)
    text = as_text(value)
    if text is not None:
        return Field((None,), type(text))
    if isinstance(value, (np.ndarray, np.generic)):
        dtype = value.dtype
        if dtype.kind not in "biufc" or not _torch_knows(dtype.newbyteorder("=")):
            raise TypeError(f"{where}: numpy dtype {dtype} has no torch equivalent; supported: {SUPPORTED}")
        return Field(np.shape(value), np.dtype(dtype.newbyteorder("=").str))  # the builtin dtype: named "int64"
    if isinstance(value, bool):
        return Field((), np.bool_)
    if isinstance(value, int):
        return Field((), np.int64)
    if isinstance(value, float):
        return Field((), np.float64)
    kind = type(value).__name__
    raise TypeError(f"{where}: {kind} values cannot be cached{leaf_hint(value)}; supported: {SUPPORTED}")


def as_text(value: Any) -> str | bytes | None:
    """A text leaf as the Python ``str``/``bytes`` it holds: numpy string scalars and 0-d string arrays
    (what ``datasets``' numpy format gives for a string column) count as text; None for anything else."""
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "SU" and value.ndim == 0:
        item = value.item()
        return item if isinstance(item, (str, bytes)) else None
    if isinstance(value, (str, bytes)):
        return str(value) if isinstance(value, str) else bytes(value)
    return None


def leaf_hint(value: Any) -> str:
    """What to do instead, for the values people most often meet in a sample that cannot be cached."""
    module = type(value).__module__
    if module.startswith("PIL."):
        return (
            " (a PIL image: convert it with torchvision's PILToTensor() — uint8, 4x smaller than ToTensor()'s "
            "float32 — or numpy.asarray(image) at the end of the cached part of the pipeline)"
        )
    if value is None:
        return " (None: give the field a value in every sample, e.g. an empty tensor or -1)"
    return ""


@functools.cache
def _torch_knows(dtype: np.dtype[Any]) -> bool:
    try:
        torch.from_numpy(np.empty(0, dtype))
    except TypeError:
        return False
    return True


def convert_leaf(leaf: Any, field: Field, name: str) -> Any:
    """A leaf in the storage dtype ``dtypes=`` chose for ``field``, converted only when every value is kept.

    ``TypeError`` for a conversion across kinds that cannot hold the values
    (complex to real), ``ValueError`` naming the first value the storage
    dtype cannot represent (see :func:`_unrepresented`: -1 into uint8, 300
    into int8, 0.5 into int64, 1e-8 into float16).
    """
    target = torch_dtype(field)
    tensor = leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else torch.as_tensor(np.asarray(leaf))
    if tensor.dtype == target:
        return tensor
    if tensor.is_complex() and not target.is_complex:
        kind = str(target).removeprefix("torch.")
        raise TypeError(f"field {name!r}: complex values cannot be stored as {kind} (dtypes= asks for it)")
    converted = tensor.to(target)
    lost = _unrepresented(tensor, converted)
    if lost.any():
        first = int(np.flatnonzero(lost)[0])
        value = tensor.reshape(-1)[first].item()
        raise ValueError(
            f"field {name!r}: the value {value!r} cannot be stored as {str(target).removeprefix('torch.')} "
            f"without changing it (it would read back as {converted.reshape(-1)[first].item()!r}); the field's "
            f"dtype (fields= or dtypes=) must hold every value exactly — {_wider(tensor)}, or convert before the cache"
        )
    return converted


def _wider(tensor: torch.Tensor) -> str:
    """What to declare instead of a dtype that cannot hold ``tensor``'s values: the narrowest that can."""
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool or not tensor.numel():
        return f"choose {str(tensor.dtype).removeprefix('torch.')} (the values' own dtype)"
    numbers = _integers(tensor)  # numpy: torch has no min/max for uint16/32/64
    low, high = int(numbers.min()), int(numbers.max())
    kinds = ("uint8", "uint16", "uint32", "uint64") if low >= 0 else ("int8", "int16", "int32", "int64")
    holds = next((k for k in kinds if np.iinfo(k).min <= low and high <= np.iinfo(k).max), None)
    if holds is None:  # below 0 and above int64's range
        return f"no integer dtype holds {low}..{high}"
    return f"choose a dtype that holds {low}..{high}, such as {holds}"


def converted(leaf: Any, field: Field, name: str) -> Any:
    """``leaf`` in ``field``'s dtype, for a field whose dtype the user chose (``fields=``, ``dtypes=``).

    A tensor or numeric array of another dtype goes through :func:`convert_leaf`
    (exactly, or an error naming the value); anything else is returned as is
    for :func:`fit` to judge.
    """
    if field.text is not None:
        return leaf
    if isinstance(leaf, torch.Tensor):
        same = leaf.dtype == torch_dtype(field)
    elif isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "biufc":
        same = field.torch_dtype is None and leaf.dtype.newbyteorder("=") == field.dtype.newbyteorder("=")
    else:
        return leaf
    return leaf if same else convert_leaf(leaf, field, name)


def _unrepresented(tensor: torch.Tensor, converted: torch.Tensor) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which values of ``tensor`` its conversion ``converted`` did not keep exactly (flat, a bool per value).

    Integer and bool targets are checked by range, never by a round trip: a
    conversion between signed and unsigned integers wraps modulo 2**bits, and
    the wrap converts back to the same value (int8 -1 -> uint8 255 -> -1).
    Floats must be finite, whole and in range to become integers; integers
    must be in the range a float can take and read back equal to become one;
    floats into floats must round-trip (NaN keeps NaN).
    """
    target = converted.dtype
    if not (target.is_floating_point or target.is_complex):  # an integer or bool target: a range
        low, high = (0, 1) if target == torch.bool else (torch.iinfo(target).min, torch.iinfo(target).max)
        if tensor.is_floating_point():
            real = tensor.reshape(-1).to(torch.float64).numpy()  # every float dtype converts exactly
            with np.errstate(invalid="ignore"):
                bad: np.ndarray[Any, np.dtype[np.bool_]] = ~np.isfinite(real) | (real != np.trunc(real))
                return bad | (real < float(low)) | (real >= float(high) + 1)  # low and high + 1: powers of two
        return _outside(_integers(tensor), low, high)
    if tensor.is_floating_point() or tensor.is_complex():
        back = converted.to(tensor.dtype)
        same = (back == tensor) | (torch.isnan(back) & torch.isnan(tensor))
        return ~same.reshape(-1).numpy()
    # Integers (or bools) into a float or complex dtype: the float must be a whole number the integer
    # dtype holds (else converting it back is undefined), and read back as the integer.
    numbers = _integers(tensor)
    wide = converted.reshape(-1).to(torch.complex128 if target.is_complex else torch.float64).numpy().real
    kind = np.iinfo(numbers.dtype) if numbers.dtype.kind in "iu" else np.iinfo(np.uint8)
    with np.errstate(invalid="ignore"):
        fits: np.ndarray[Any, np.dtype[np.bool_]] = (
            np.isfinite(wide) & (wide >= float(kind.min)) & (wide < float(kind.max) + 1)
        )
    out = ~fits
    out[fits] = wide[fits].astype(numbers.dtype) != numbers[fits]
    return out


def _integers(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """The values of an integer or bool tensor as a flat numpy array of the same dtype."""
    return tensor.reshape(-1).resolve_neg().numpy()


def _outside(numbers: np.ndarray[Any, Any], low: int, high: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which integers lie outside ``[low, high]`` (the bounds clipped to the array's own range, so no
    comparison ever converts a bound that its dtype cannot hold)."""
    if numbers.dtype == np.bool_:
        numbers = numbers.view(np.uint8)
    own = np.iinfo(numbers.dtype)
    below = numbers < max(low, own.min) if low > own.min else np.zeros(numbers.shape, bool)
    above = numbers > min(high, own.max) if high < own.max else np.zeros(numbers.shape, bool)
    return below | above


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """The shape of a leaf: a tensor's or array's own, ``()`` for a number, ``(bytes,)`` for text."""
    if isinstance(leaf, (str, bytes)):
        return (len(leaf.encode("utf-8", "surrogatepass") if isinstance(leaf, str) else leaf),)
    return tuple(leaf.shape) if isinstance(leaf, (torch.Tensor, np.ndarray, np.generic)) else ()


class LeafShapeError(ValueError):
    """A leaf whose shape does not fit its field: ``name``, the leaf's ``shape`` and the ``field``."""

    def __init__(self, message: str, name: str, shape: tuple[int, ...], field: Field) -> None:
        super().__init__(message)
        self.name, self.shape, self.field = name, shape, field


def check_declared(field: Field, name: str) -> None:
    """TypeError unless a field declared for a CachedDataset holds values torch has a dtype for."""
    if field.torch_dtype is None and (
        field.dtype.kind not in "biufc" or not _torch_knows(field.dtype.newbyteorder("="))
    ):
        raise TypeError(f"field {name!r}: dtype {field.dtype_name} has no torch equivalent; supported: {SUPPORTED}")


def fit(leaf: Any, field: Field, name: str, *, convert: bool = False) -> Any:
    """``leaf`` checked against ``field``: ready for :func:`write_column` / :func:`variable_column`.

    Tensors and arrays must keep the field's dtype exactly — a silent cast
    would change the data — and fit its shape (a ``None`` dimension takes any
    size; a mismatch raises :class:`LeafShapeError`). ``convert`` (the user
    chose the field's dtype) first converts them when no value changes
    (:func:`converted`). Text and Python scalars follow the core's casting
    rules (:func:`mmapcache._region.values.coerce_value`). TypeError/ValueError
    naming the field otherwise.
    """
    if convert:
        leaf = converted(leaf, field, name)
    if type(leaf) is list:
        return _numbers(leaf, field, name)
    if field.text is not None:
        text = as_text(leaf)
        return coerce_value(leaf if text is None else text, field, name)
    if isinstance(leaf, (torch.Tensor, np.ndarray, np.generic)):
        return _exact(leaf, field, name)
    return coerce_value(leaf, field, name)


_AS_ARRAYS = (
    "; a Python list of numbers is one value of a field of one or more dimensions (a Hugging Face dataset "
    'gives arrays instead with .with_format("numpy"))'
)


def _numbers(leaf: list[Any], field: Field, name: str) -> np.ndarray[Any, Any]:
    """A Python list of numbers for ``field``: the core's casting rules for Python numbers (an int that the
    field's dtype cannot hold is refused, never wrapped), as an array of the field's dtype and shape."""
    if field.text is not None or not field.shape:
        what = f"{field.text} values" if field.text is not None else "single values (shape ())"
        raise TypeError(f"field {name!r} holds {what}, but the sample gave a list of {len(leaf)} items{_AS_ARRAYS}")
    try:
        return coerce_value(leaf if leaf else np.zeros(0, field.dtype), field, name)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{error}{_AS_ARRAYS}") from None


def misfit(sample: Any, fields: Mapping[str, Field], *, convert: bool = False) -> tuple[type[Exception], str] | None:
    """Why ``sample`` does not fit ``fields`` (an error type and a message naming the field), or None.

    The names of its leaves must be the fields' (in any order), and each leaf must :func:`fit` its
    field (``convert``: after an exact conversion to the field's dtype, for ``fields=``).
    """
    try:
        leaves = declared_leaves(sample, fields)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    if list(leaves) != list(fields) and set(leaves) != set(fields):
        missing = [name for name in fields if name not in leaves]
        extra = [name for name in leaves if name not in fields]
        parts = []
        if missing:
            parts.append(f"the sample has no {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"no field is given for {', '.join(map(repr, extra))}")
        return ValueError, (
            f"the sample's leaves are {list(leaves)} (named by their place in it, see mmapcache.torch), "
            f"the fields {list(fields)}: {'; '.join(parts)}"
        )
    for name, leaf in leaves.items():
        try:
            fit(leaf, fields[name], name, convert=convert)
        except LeafShapeError as error:
            return ValueError, str(error)
        except (TypeError, ValueError) as error:
            return type(error), str(error)
    return None


def _exact(leaf: torch.Tensor | np.ndarray[Any, Any] | np.generic, field: Field, name: str) -> Any:
    if isinstance(leaf, torch.Tensor):
        if leaf.dtype != torch_dtype(field):
            _wrong_dtype(str(leaf.dtype).removeprefix("torch."), field.dtype_name, name)
        if leaf.layout != torch.strided or leaf.is_nested:
            raise TypeError(f"field {name!r}: {leaf.layout} tensors cannot be cached; use dense tensors")
        if leaf.shape != field.shape and not field.fits(tuple(leaf.shape)):
            _wrong_shape(tuple(leaf.shape), field, name)
        if leaf.requires_grad:
            leaf = leaf.detach()
        return leaf if leaf.is_cpu else leaf.cpu()
    dtype = leaf.dtype
    if field.torch_dtype is not None or dtype.newbyteorder("=") != field.dtype.newbyteorder("="):
        want = field.dtype_name if field.torch_dtype is None else f"torch.{field.dtype_name}"
        _wrong_dtype(str(dtype.newbyteorder("=")), want, name)
    if leaf.shape != field.shape and not field.fits(leaf.shape):
        _wrong_shape(leaf.shape, field, name)
    return leaf


def _wrong_dtype(got: str, want: str, name: str) -> None:
    raise TypeError(f"field {name!r}: the dataset gave {got} values, the cache holds {want}")


def _wrong_shape(shape: tuple[int, ...], field: Field, name: str) -> None:
    expected = f"of shape {field.shape}" if not field.variable else f"matching shape {field.shape} (None: any size)"
    raise LeafShapeError(f"field {name!r}: expected a sample {expected}, got shape {shape}", name, shape, field)


def write_column(leaves: list[Any], field: Field) -> np.ndarray[Any, Any]:
    """One field of a batch: the checked leaves stacked into a new array of ``field``'s storage dtype.

    Each leaf is copied once, straight into its row (the only conversion on a
    miss); ``put_many`` takes the result as is.
    """
    out = np.empty((len(leaves), *field.fixed_shape), field.dtype)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        torch.stack(leaves, out=as_tensor(out, field))
        return out
    bits = BITS[field.dtype.itemsize] if field.torch_dtype is not None else None
    arrays = [_storage(leaf, bits) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    np.stack(arrays, out=out)
    return out


def variable_column(leaves: list[Any], field: Field) -> list[np.ndarray[Any, Any]]:
    """One variable field of a batch: each checked leaf copied once into a fresh array of ``field``'s storage dtype.

    ``put_many`` takes the list as is (one array per row); the copies are
    also what the miss hands back, so it never shares memory with the dataset.
    """
    bits = BITS[field.dtype.itemsize] if field.torch_dtype is not None else None
    return [
        np.array(_storage(leaf, bits) if isinstance(leaf, torch.Tensor) else leaf, dtype=field.dtype, order="C")
        for leaf in leaves
    ]


def _storage(tensor: torch.Tensor, bits: torch.dtype | None) -> np.ndarray[Any, Any]:
    tensor = tensor.resolve_conj().resolve_neg()
    return (tensor if bits is None else tensor.view(bits)).numpy()


class Exact(NamedTuple):
    """The leaves :func:`fit` returns as they are for a fixed field (see :func:`exact_leaves`)."""

    shape: tuple[int, ...]  # the field's
    storage: np.dtype[Any]  # the field's numpy dtype, that of the column made
    tensors: torch.dtype  # tensors of this dtype (the field's torch dtype), on the CPU, without grad
    view: torch.dtype | None  # the column seen as this torch dtype (a torch-only dtype), to stack into
    arrays: bool  # numpy arrays of ``storage`` (never for a torch-only dtype: their raw bits are converted)
    number: type | None  # Python numbers of this type (a field of shape () whose dtype is theirs)


_NUMBERS = {np.dtype(np.int64): int, np.dtype(np.float64): float, np.dtype(np.bool_): bool}


def exact_leaves(field: Field) -> Exact | None:
    """What :func:`exact_column` takes as it is for ``field``; None for a field whose leaves go one by one.

    Those are variable and text fields, and fields of a dtype torch has no tensor of (structured, strings,
    another byte order: a cache made without the torch layer may hold them).
    """
    dtype = field.dtype
    if field.variable or not dtype.isnative or dtype.kind not in "biufc":
        return None
    if field.torch_dtype is None and not _torch_knows(dtype):
        return None
    shape = field.fixed_shape
    number = _NUMBERS.get(dtype) if not shape and field.torch_dtype is None else None
    view = torch_dtype(field) if field.torch_dtype is not None else None
    return Exact(shape, dtype, torch_dtype(field), view, field.torch_dtype is None, number)


def exact_column(leaves: Sequence[Any], exact: Exact) -> np.ndarray[Any, Any] | None:
    """One fixed field of a batch stacked into a new storage array, if :func:`fit` would take every leaf as is.

    That is: every leaf a dense CPU tensor of the field's torch dtype and shape
    that needs no grad, or every leaf a numpy array of its dtype and shape, or
    every leaf a Python number of its dtype (``int`` for int64, ``float`` for
    float64, ``bool`` for bool). The column is then what :func:`write_column`
    makes of them, with one copy of each leaf and no call per leaf. None for
    any other batch: the caller asks :func:`fit` about each leaf, which
    converts it or raises for it.
    """
    first = leaves[0]
    shape = exact.shape
    if type(first) is torch.Tensor:
        dtype, strided = exact.tensors, torch.strided
        for leaf in leaves:
            if (
                type(leaf) is not torch.Tensor
                or leaf.is_nested
                or leaf.layout is not strided
                or leaf.dtype is not dtype
                or leaf.shape != shape
                or leaf.requires_grad
                or not leaf.is_cpu
            ):
                return None
        out = np.empty((len(leaves), *shape), exact.storage)
        target = torch.from_numpy(out)
        torch.stack(leaves, out=target if exact.view is None else target.view(exact.view))  # type: ignore[arg-type]
        return out
    if type(first) is np.ndarray:
        if not exact.arrays:
            return None
        storage = exact.storage
        for leaf in leaves:
            if type(leaf) is not np.ndarray or leaf.dtype != storage or leaf.shape != shape:
                return None
        return np.stack(leaves)
    number = exact.number
    if number is None:
        return None
    for leaf in leaves:
        if type(leaf) is not number:
            return None
    try:
        return np.array(leaves, exact.storage)
    except (OverflowError, TypeError, ValueError):  # an int beyond the dtype: fit says which
        return None
