"""Whole batches for :meth:`mmapcache.torch.CachedDataset.loader`: one copy from the file to the batch.

``DataLoader(ds, batch_size=...)`` with the default collate reads each batch
twice: ``ds.__getitems__`` returns one tensor per sample, and
``default_collate`` stacks them into the batch (in a worker, into shared
memory). ``loader()`` instead hands DataLoader a view of the dataset whose
``__getitems__`` returns the finished batch: every field is gathered by one
``np.take`` straight into the tensor the training loop receives — in a
DataLoader worker, a tensor in shared memory, which crosses to the main
process as a handle without being copied again — and the collate function
passes it through. The batch has exactly the structure ``default_collate``
builds from the samples (a tuple becomes a list, as there).

The default path gets the same single copy another way. ``__getitems__``
gathers a batch into tensors made by :func:`new_batch` and returns each sample
as views of one row of them; those tensors are remembered (weakly) by
:func:`adopt`. ``default_collate`` stacks tensors through the function that
``torch.utils.data._utils.collate.default_collate_fn_map`` holds for
``torch.Tensor`` — the extension point torch documents for custom collation —
and :func:`install_collate` wraps it. When every tensor of a column is the
next row of one adopted batch tensor, in order, the wrapper returns a view
of those rows instead of a copy: the bytes a stack would make, without making
them. Anything else goes to torch's own function unchanged.

Buffers start on a page boundary: a gather into a buffer a few bytes off a page
boundary runs many times slower (4K aliasing, see ``_gather.py``).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ._gather import empty_aligned

__all__ = ["Batched", "Deferred", "adopt", "as_is", "collate_tree", "install_collate", "new_batch"]

_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def new_batch(
    shapes: Sequence[tuple[int, ...]], storage: Sequence[np.dtype[Any]], dtypes: Sequence[torch.dtype | None]
) -> tuple[list[torch.Tensor], list[np.ndarray[Any, Any]]]:
    """Uninitialised batch tensors (the fields' torch dtypes) and numpy views of their storage dtypes.

    Inside a DataLoader worker the tensors live in shared memory, so handing
    them to the main process copies nothing.
    """
    shared = torch.utils.data.get_worker_info() is not None
    tensors, arrays = [], []
    for shape, dtype, torch_dtype in zip(shapes, storage, dtypes, strict=True):
        if shared:
            raw = _shared_tensor(shape, dtype)
            array = raw.numpy()
        else:
            array = empty_aligned(shape, dtype)
            raw = torch.from_numpy(array)
        arrays.append(array)
        tensors.append(raw if torch_dtype is None else raw.view(torch_dtype))
    return tensors, arrays


def _shared_tensor(shape: tuple[int, ...], dtype: np.dtype[Any]) -> torch.Tensor:
    """An uninitialised tensor in a fresh shared-memory segment (page aligned), as default_collate makes in workers."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    strides = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=_storage_torch_dtype(dtype)).set_(storage, 0, shape, strides)


def _storage_torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def collate_tree(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The batch ``default_collate`` builds from samples of structure ``tree``, given one tensor per field.

    ``tree`` is the structure codec's node: an ``int`` (a leaf: the field's
    position) or ``(kind, keys, children)`` with kind ``"tuple"``, ``"list"``
    or ``"dict"``. Like ``default_collate``: tuples and lists become lists,
    dicts stay dicts with their key order.
    """
    if isinstance(tree, int):
        return tensors[tree]
    kind, keys, children = tree
    if kind == "dict":
        return {key: collate_tree(child, tensors) for key, child in zip(keys, children, strict=True)}
    return [collate_tree(child, tensors) for child in children]


def as_is(batch: Any) -> Any:
    """The collate function of ``loader()``: the dataset already returns finished batches."""
    return batch


class Deferred:
    """A batch a DataLoader worker leaves for the main process to gather: it pickles as the indices.

    A worker makes sure every cacheable sample of the batch is in the file
    (loading and storing the misses — the expensive part), then sends only
    the indices and the rows that could not be cached. Unpickling it in the
    main process gathers the batch from the file into fresh tensors there: one
    copy from the file to the batch, and nothing crosses between processes
    but a few hundred bytes — no shared-memory segment to create and fault in
    per batch.
    """

    __slots__ = ("args", "resolve")

    def __init__(self, resolve: Callable[..., Any], *args: Any) -> None:
        self.resolve, self.args = resolve, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.resolve, self.args)


class Batched(torch.utils.data.Dataset[Any]):
    """A :class:`CachedDataset` as ``loader()`` shows it to DataLoader.

    ``__getitems__`` returns the finished batch when ``collated`` (no
    ``collate_fn`` of the user's), else the samples for the user's collate.
    ``__getitem__`` and ``len`` are the dataset's, so samplers (including
    ``DistributedSampler`` and the ones Lightning injects) work unchanged.
    """

    def __init__(self, dataset: Any, *, collated: bool, token: str) -> None:
        self.dataset = dataset
        self.collated = collated
        self.token = token  # names the main process's dataset to a Deferred batch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        if not self.collated:
            return self.dataset.__getitems__(indices)
        if torch.utils.data.get_worker_info() is not None:
            return self.dataset._batch_in_worker(indices, self.token)
        return self.dataset._read_batch(indices)

    def __repr__(self) -> str:
        return f"Batched({self.dataset!r})"


# -- the default path: default_collate stacks adopted rows without copying ---------------

# id -> weak reference of each adopted tensor (a WeakSet would compare tensors with ==).
_ADOPTED: dict[int, weakref.ref[torch.Tensor]] = {}


def adopt(tensors: Sequence[torch.Tensor]) -> None:
    """Let ``default_collate`` return views of these batch tensors' rows instead of stacking copies.

    Only for tensors nobody else holds: a collated batch then shares memory
    with the sample views ``__getitems__`` handed out.
    """
    for tensor in tensors:
        key = id(tensor)
        _ADOPTED[key] = weakref.ref(tensor, functools.partial(_forget, key))


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _ADOPTED.get(key) is ref:  # not a newer tensor that got the same id
        del _ADOPTED[key]


def _adopted(tensor: torch.Tensor) -> bool:
    ref = _ADOPTED.get(id(tensor))
    return ref is not None and ref() is tensor


def _rows_of_one_batch(batch: Sequence[Any]) -> torch.Tensor | None:
    """The batch tensor whose rows 0..n-1 are exactly ``batch``, in order, if it is an adopted one."""
    first = batch[0]
    base: torch.Tensor | None = first._base
    if base is None or not _adopted(base) or not first.is_contiguous():
        return None
    step = first.numel() * first.element_size()
    if not step:
        return None
    start = first.data_ptr()
    for k, row in enumerate(batch):
        if (
            type(row) is not torch.Tensor
            or row._base is not base
            or row.data_ptr() != start + k * step
            or row.shape != first.shape
            or not row.is_contiguous()
        ):
            return None
    offset, remainder = divmod(start - base.data_ptr(), step)
    if remainder or offset < 0 or offset + len(batch) > base.shape[0] or base.shape[1:] != first.shape:
        return None
    return base.narrow(0, offset, len(batch))


def install_collate() -> None:
    """Wrap the tensor entry of torch's ``default_collate_fn_map`` (once) with the no-copy check."""
    from torch.utils.data._utils import collate

    previous: Callable[..., Any] = collate.default_collate_fn_map[torch.Tensor]
    if getattr(previous, "_mmapcache", False):
        return

    def collate_tensors(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
        rows = _rows_of_one_batch(batch)
        if rows is not None:
            return rows
        return previous(batch, collate_fn_map=collate_fn_map)

    collate_tensors._mmapcache = True  # type: ignore[attr-defined]
    collate.default_collate_fn_map[torch.Tensor] = collate_tensors
