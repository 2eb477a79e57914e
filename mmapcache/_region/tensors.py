"""torch tensors and torch-only dtypes in the core's ``put``, and :meth:`Jagged.to_nested`: the core's only torch code.

:mod:`mmapcache._region.values` imports this module lazily, only when it meets a
tensor (torch is then loaded already) or has to convert numbers into a dtype
numpy lacks, and :class:`~mmapcache.Jagged` when asked for a nested tensor;
nothing else in the core imports it, and it imports nothing of
mmapcache but :mod:`mmapcache._field`. The torch layer (:mod:`mmapcache.torch`)
imports it for the same facts — the dependency points one way, from the torch
layer to the core (as ``safetensors.torch`` does).

torch dtypes numpy lacks (bfloat16, complex32, the float8 family, ...) are
stored as their raw bits in an unsigned integer of the same width
(``Field.dtype``); a same-width unsigned array or tensor given for such a field
*is* those bits, not numbers to convert.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .._field import Field

__all__ = ["BITS", "as_tensor", "is_raw_bits", "nested", "tensor_to_numpy", "torch_dtype", "value_to_numpy"]

# The unsigned torch dtype that holds the raw bits of an element of this many bytes.
BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


@functools.cache
def torch_dtype(field: Field) -> torch.dtype:
    """The torch dtype of ``field``'s values (``torch.bfloat16`` for a field stored as uint16 bits)."""
    if field.torch_dtype is not None:
        dtype = getattr(torch, field.torch_dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype
    return torch.from_numpy(np.empty(0, field.dtype.newbyteorder("="))).dtype


def as_tensor(array: np.ndarray[Any, Any], field: Field) -> torch.Tensor:
    """A storage array of ``field`` as a tensor of the field's torch dtype, sharing memory."""
    tensor = torch.from_numpy(array)
    return tensor if field.torch_dtype is None else tensor.view(torch_dtype(field))


def is_raw_bits(dtype: torch.dtype, field: Field) -> bool:
    """Whether tensors of ``dtype`` are the raw bits of a torch-only ``field`` (same-width unsigned).

    The same rule as ``mmapcache._region.values`` applies to numpy arrays, without torch.
    """
    return field.torch_dtype is not None and dtype in BITS.values() and dtype.itemsize == field.dtype.itemsize


def tensor_to_numpy(value: torch.Tensor, field: Field, name: str) -> np.ndarray[Any, Any]:
    """``value`` (a tensor) as a numpy array for ``field``, without copying when it can.

    A dtype numpy knows comes back as is, for :func:`mmapcache._region.values.cast`
    to apply the core's casting rules. For a torch-only field (or a tensor
    dtype numpy lacks) the tensor is cast by torch's rules (within its kind)
    and its raw bits come back in ``field.dtype``.
    """
    tensor = value.detach()
    if tensor.is_quantized:
        raise TypeError(f"field {name!r}: quantized tensors cannot be cached; dequantize them first")
    if tensor.layout != torch.strided or tensor.is_nested:
        raise TypeError(f"field {name!r}: {tensor.layout} tensors cannot be cached; convert them to dense tensors")
    tensor = tensor.cpu().resolve_conj().resolve_neg()
    if is_raw_bits(tensor.dtype, field):
        return tensor.numpy()
    if field.torch_dtype is None and _numpy_knows(tensor.dtype):
        return tensor.numpy()
    target = torch_dtype(field)
    if tensor.dtype != target:
        if not torch.can_cast(tensor.dtype, target):
            raise TypeError(
                f"field {name!r}: cannot store {tensor.dtype} values in a {field.dtype_name} field "
                f"(only casts within the same kind are allowed); convert them to {target} first"
            )
        tensor = tensor.to(target)
    if field.torch_dtype is None:
        return tensor.numpy()
    return tensor.view(BITS[field.dtype.itemsize]).numpy()


def value_to_numpy(value: Any, field: Field, name: str) -> np.ndarray[Any, Any]:
    """Numbers (an array, scalar or list) for a torch-only ``field``, converted by torch into its raw bits."""
    array = np.asarray(value)
    if array.dtype.hasobject or array.dtype.kind not in "biufc":
        raise TypeError(f"field {name!r}: cannot store {type(value).__name__} in a {field.dtype_name} field")
    native = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="), copy=False))
    return tensor_to_numpy(torch.from_numpy(native), field, name)


@functools.cache
def _numpy_knows(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def nested(values: torch.Tensor, offsets: np.ndarray[Any, Any], extent: tuple[int, int]) -> torch.Tensor:
    """A jagged-layout nested tensor over ``values`` (a view) cut at ``offsets``.

    ``extent`` is the rows' ``(min, max)`` length, passed on so that nothing reads them back from a device.
    """
    cuts = torch.from_numpy(np.array(offsets, np.int64))  # B + 1 integers: copied, torch owns them afterwards
    return torch.nested.nested_tensor_from_jagged(values, cuts, min_seqlen=extent[0], max_seqlen=extent[1])
