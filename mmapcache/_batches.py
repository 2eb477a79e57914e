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

Variable-shape fields take no part in either trick: each sample's leaf is its
own tensor, and a batch of them is collated by torch (which stacks them when
their shapes agree, and raises when they do not, as without the cache) or by
:func:`pad_collate`, which pads them into a :class:`Padded` batch.
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from collections.abc import Callable, Collection, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from ._gather import empty_aligned
from ._structure import Step, name_of

__all__ = [
    "Batched",
    "Deferred",
    "Padded",
    "adopt",
    "as_is",
    "collate_tree",
    "install_collate",
    "new_batch",
    "pad_collate",
]

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
    return _shared_empty(shape, _storage_torch_dtype(dtype))


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    strides = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)


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


# -- padding variable-shape leaves ---------------------------------------------------------


class Padded(NamedTuple):
    """A batch of tensors of different shapes, padded to one: what :func:`pad_collate` makes of a leaf.

    ``data`` has shape ``(batch, *longest)``, where ``longest`` is the largest
    size of each dimension in the batch; sample ``k`` sits in its leading
    corner, ``data[k, :lengths[k]]`` for 1-D leaves, and the rest is
    ``padding_value``. ``lengths`` (int64) holds each sample's own shape:
    shape ``(batch,)`` for 1-D leaves, ``(batch, ndim)`` otherwise.
    """

    data: torch.Tensor
    lengths: torch.Tensor


def pad_collate(batch: Sequence[Any], *, pad: str | Collection[str] | None = None, padding_value: float = 0) -> Any:
    """``default_collate``, but leaves of different shapes are padded into :class:`Padded` instead of stacked.

    ``pad`` names the leaves to pad by their field names (``"0"`` for the
    first element of a tuple, ``"tokens"`` for a dict key, ``"."`` for a bare
    leaf: see :mod:`mmapcache.torch`): each of them always becomes a
    :class:`Padded`, whatever the batch holds, and every other leaf is
    collated by ``default_collate`` (which raises for tensors of different
    shapes). ``pad=None`` pads every tensor leaf whose shapes differ *in this
    batch* — convenient, but a batch whose samples happen to agree (say a last
    batch of one) then gets a plain stacked tensor there; name the leaves for
    a structure that never changes. numpy arrays count as tensors, as in
    ``default_collate``. Containers become what ``default_collate`` makes of them.
    """
    if len(batch) == 0:
        raise ValueError("pad_collate needs at least one sample")
    names: frozenset[str] | None
    if pad is None:
        names = None
    elif isinstance(pad, str):
        names = frozenset([pad])
    else:
        names = frozenset(pad)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"pad names leaves by their field names (strings), got {sorted(map(repr, names))}")
    if names is not None:
        leaves: list[str] = []
        _tensor_leaves(batch[0], [], leaves)
        if not names <= set(leaves):
            raise ValueError(
                f"pad names {sorted(names - set(leaves))}, which are not tensor leaves of the samples; their "
                f"tensor leaves are {leaves} (named as in mmapcache.torch: '0' for a tuple's first element, "
                "'key' for a dict's, '.' for a bare leaf)"
            )
    return _Padder(names, padding_value).collate(list(batch), [])


def _tensor_leaves(value: Any, path: list[Step], names: list[str]) -> None:
    """The names of the leaves of one sample that :class:`_Padder` treats as tensors, in its order."""
    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype.kind in "biufc"):
        names.append(name_of(path))
    elif isinstance(value, Mapping):
        for key in value:
            _tensor_leaves(value[key], [*path, ("dict", key)], names)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        for k, item in enumerate(value):
            _tensor_leaves(item, [*path, (kind, k)], names)


class _Padder:
    """One ``pad_collate`` call: ``default_collate``'s walk over the structure, knowing each leaf's name."""

    def __init__(self, names: frozenset[str] | None, padding_value: float) -> None:
        self.names, self.padding_value = names, padding_value

    def collate(self, column: list[Any], path: list[Step]) -> Any:
        from torch.utils.data._utils.collate import default_collate_fn_map

        elem = column[0]
        if isinstance(elem, np.ndarray) and elem.dtype.kind in "biufc":
            return self.tensors([torch.as_tensor(value) for value in column], path)
        if isinstance(elem, torch.Tensor):
            return self.tensors(column, path)
        if isinstance(elem, tuple(default_collate_fn_map)):  # numbers, strings, numpy scalars: as torch does
            return torch.utils.data.default_collate(column)
        if isinstance(elem, Mapping):
            values = {key: self.collate([sample[key] for sample in column], [*path, ("dict", key)]) for key in elem}
            try:
                if isinstance(elem, MutableMapping):
                    clone = copy.copy(elem)
                    clone.update(values)
                    return clone
                make: Any = type(elem)  # a Mapping subclass whose constructor takes a dict, or a TypeError
                return make(values)
            except TypeError:
                return values
        if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple stays one, as in default_collate
            parts = zip(*column, strict=True)
            return type(elem)(*(self.collate(list(part), [*path, ("tuple", k)]) for k, part in enumerate(parts)))
        if isinstance(elem, Sequence):
            if any(len(sample) != len(elem) for sample in column):
                raise RuntimeError("each element in list of batch should be of equal size")
            kind = "tuple" if isinstance(elem, tuple) else "list"
            items = [self.collate(list(part), [*path, (kind, k)]) for k, part in enumerate(zip(*column, strict=True))]
            if isinstance(elem, tuple):
                return items
            try:
                if isinstance(elem, MutableSequence):
                    seq = copy.copy(elem)
                    for k, item in enumerate(items):
                        seq[k] = item
                    return seq
                make_sequence: Any = type(elem)
                return make_sequence(items)
            except TypeError:
                return items
        return torch.utils.data.default_collate(column)

    def tensors(self, column: list[torch.Tensor], path: list[Step]) -> Any:
        from torch.utils.data._utils.collate import default_collate_fn_map

        name = name_of(path)
        first = column[0].shape
        padding = name in self.names if self.names is not None else any(t.shape != first for t in column)
        if not padding:
            return default_collate_fn_map[torch.Tensor](column, collate_fn_map=default_collate_fn_map)
        return _pad(column, self.padding_value, name)


def _pad(column: list[torch.Tensor], padding_value: float, name: str) -> Padded:
    ndim = column[0].ndim
    if ndim == 0:
        raise ValueError(f"leaf {name!r} holds 0-d tensors (scalars): there is nothing to pad")
    if any(tensor.ndim != ndim for tensor in column):
        shapes = sorted({tuple(tensor.shape) for tensor in column}, key=len)
        raise ValueError(f"leaf {name!r}: cannot pad tensors of different numbers of dimensions ({shapes})")
    dtype = functools.reduce(torch.promote_types, (tensor.dtype for tensor in column))
    shapes = [tuple(tensor.shape) for tensor in column]
    longest = tuple(max(sizes) for sizes in zip(*shapes, strict=True))
    shape = (len(column), *longest)
    if torch.utils.data.get_worker_info() is not None and column[0].device.type == "cpu":
        data = _shared_empty(shape, dtype)  # as default_collate does: no copy to ship it to the main process
    else:
        data = torch.empty(shape, dtype=dtype, device=column[0].device)
    data.fill_(padding_value)
    lengths = torch.tensor(shapes, dtype=torch.int64).reshape(len(column), ndim)
    if ndim == 1:
        # Sequences: many short rows. One masked copy of them all costs half the per-row loop.
        filled = torch.arange(longest[0], device=data.device) < lengths.to(data.device)  # (batch, longest)
        data[filled] = torch.cat(column).to(dtype)
        return Padded(data, lengths[:, 0])
    for row, tensor in zip(data, column, strict=True):
        row[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return Padded(data, lengths)
