"""PyTorch binding: the only module of mmapcache that imports torch."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ._field import Field
from ._values import cast

__all__ = ["value_to_storage"]

_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _torch_dtype(field: Field) -> torch.dtype:
    if field.torch_dtype is not None:
        dtype = getattr(torch, field.torch_dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype
    return torch.from_numpy(np.empty(0, field.dtype.newbyteorder("="))).dtype


def value_to_storage(value: Any, field: Field, name: str) -> np.ndarray[Any, Any]:
    """``value`` (tensor, array or Python value) as an array of ``field``'s storage dtype."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.is_quantized:
            raise TypeError(f"field {name!r}: quantized tensors cannot be cached; dequantize them first")
        tensor = tensor.cpu()
    elif field.torch_dtype is None:
        raise TypeError(f"field {name!r}: expected a tensor, got {type(value).__name__}")
    else:
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise TypeError(f"field {name!r}: cannot store {type(value).__name__} in a {field.dtype_name} field")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if field.torch_dtype is None and _numpy_knows(tensor.dtype):
        array = tensor.resolve_conj().resolve_neg().numpy()
        return cast(array, field, name, from_python=False)
    target = _torch_dtype(field)
    if tensor.dtype != target:
        if not torch.can_cast(tensor.dtype, target):
            raise TypeError(
                f"field {name!r}: cannot store {tensor.dtype} values in a {field.dtype_name} field "
                f"(only casts within the same kind are allowed); convert them to {target} first"
            )
        tensor = tensor.to(target)
    if field.torch_dtype is None:
        return tensor.numpy()
    return tensor.contiguous().view(_BITS[tensor.element_size()]).numpy()


@functools.cache
def _numpy_knows(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True
