"""Exact comparison of two samples, and the words for how they differ.

:class:`~mmapcache.torch.CachedDataset` compares cached samples with fresh
ones (stale caches, datasets that are not deterministic) with it, and the
worker processes of :mod:`mmapcache.testing` compare samples with the
oracle's. It imports neither Hypothesis nor torch (a torch tensor is
recognised by its type's module, and torch is already imported wherever one
exists).

Leaves are compared *exactly*: the same shape, the same element type and the
same bytes (so ``-0.0`` differs from ``0.0`` and a NaN equals only the same
NaN). A torch tensor, a numpy array or scalar and a Python ``bool``/``int``/
``float`` are all leaves, and match across kinds when their dtype names agree
(``torch.int64`` and ``numpy.int64``; a Python ``int`` is ``int64``, as
:class:`~mmapcache.torch.CachedDataset` returns it), because a cached dataset
hands back tensors for what the uncached one returned as numbers or arrays.
Tuples, lists and dicts must match in kind, length and keys.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["describe", "difference"]

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 60
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 6


def _is_tensor(value: Any) -> bool:
    kind = type(value)
    return kind.__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "detach")


def _leaf(value: Any) -> tuple[str, tuple[int, ...], bytes] | None:
    """``(dtype name, shape, bytes)`` of a leaf; None for anything that is not one."""
    if _is_tensor(value):
        import torch  # already imported: `value` is a tensor

        # A fresh tensor of standard strides: .contiguous() keeps the 0 stride of an expanded size-1 dimension.
        tensor = torch.empty_like(value, device="cpu", memory_format=torch.contiguous_format).copy_(value.detach())
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.element_size() > 0 else tensor
        return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), bytes(raw.numpy().tobytes())
    if isinstance(value, (np.ndarray, np.generic, bool, int, float, complex)):
        array = np.asarray(value)
        if array.dtype.hasobject:
            return None
        return array.dtype.name, array.shape, np.ascontiguousarray(array).tobytes()
    return None


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for values that are not leaves (str, bytes, None, objects), never raising."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. object arrays: == is elementwise
        return a is b


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    if _is_tensor(value):
        tensor = value.detach().cpu()
        try:
            return np.asarray(tensor.numpy())
        except TypeError:  # bfloat16 and the other dtypes numpy lacks: show their values as float32
            return np.asarray(tensor.float().numpy())
    return np.asarray(value)


def describe(value: Any) -> str:
    """A short description of a sample or a leaf: ``tensor int64 (3, 4) [0, 1, 2, 3, 4, 5, ...]``."""
    if _is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
        flat = _as_array(value).reshape(-1)
        shown = ", ".join(str(x) for x in flat[:6].tolist()) + (", ..." if flat.size > 6 else "")
        kind = "tensor" if _is_tensor(value) else "array"
        return f"{kind} {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)} [{shown}]"
    return _repr.repr(value)


def _kind(value: Any) -> str:
    return "tuple" if isinstance(value, tuple) else "list" if isinstance(value, list) else type(value).__name__


def difference(got: Any, expected: Any, where: str = "") -> str | None:
    """How ``got`` differs from ``expected`` (the first difference found), or None when they are equal."""
    place = f"sample{where}"
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return f"{place} is {describe(got)}, expected a dict"
        if set(got) != set(expected):
            return f"{place} has keys {sorted(map(str, got))}, expected {sorted(map(str, expected))}"
        for key in expected:
            found = difference(got[key], expected[key], f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, (tuple, list)):
        if _kind(got) != _kind(expected):
            return f"{place} is a {_kind(got)}, expected a {_kind(expected)}"
        if len(got) != len(expected):
            return f"{place} has {len(got)} parts, expected {len(expected)}"
        for k, (g, e) in enumerate(zip(got, expected, strict=True)):
            found = difference(g, e, f"{where}[{k}]")
            if found is not None:
                return found
        return None
    want, have = _leaf(expected), _leaf(got)
    if want is None or have is None:
        return None if _equal(got, expected) else f"{place} is {describe(got)}, expected {describe(expected)}"
    if have[:2] != want[:2]:
        return f"{place} is {have[0]} {have[1]}, expected {want[0]} {want[1]}"
    if have[2] != want[2]:
        a, b = np.frombuffer(have[2], np.uint8), np.frombuffer(want[2], np.uint8)
        wrong = np.flatnonzero(a != b)
        return (
            f"{place} differs in {wrong.size} of {a.size} bytes (first at byte {wrong[0]}): "
            f"got {describe(got)}, expected {describe(expected)}"
        )
    return None
