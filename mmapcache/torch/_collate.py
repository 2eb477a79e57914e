"""Collating: the batch ``default_collate`` makes, from columns (:func:`collate_tree`), without a second copy
(:func:`collate`) or padded (:func:`pad_collate`).

Importing mmapcache changes nothing in torch's collation: ``default_collate``
and its ``default_collate_fn_map`` stay torch's own. ``loader()`` needs no
collate of its own (its dataset returns finished batches, :func:`as_is`
passes them through). For a ``DataLoader(ds)`` of one's own, :func:`collate`
is ``default_collate`` with one entry of its ``collate_fn_map`` (the
extension point torch documents) replaced, for that call only: a column of
tensors that are the consecutive rows of one batch ``__getitems__`` gathered
(:func:`adopt`) is returned as those rows instead of being stacked into a
copy. :func:`pad_collate` is a ``collate_fn`` for samples with variable-shape
leaves, which pads them into a :class:`Padded` batch.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Collection, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from ._columns import shared_empty
from ._structure import Step, name_of

__all__ = [
    "Padded",
    "Padder",
    "Then",
    "adopt",
    "as_is",
    "collate",
    "collate_tree",
    "leaf_names",
    "pad_collate",
    "pad_tensors",
]


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
    # Loops, not comprehensions, and leaves taken here: every batch of loader() runs this.
    if kind == "dict":
        batch = {}
        for key, child in zip(keys, children, strict=True):
            batch[key] = tensors[child] if type(child) is int else collate_tree(child, tensors)
        return batch
    out = []
    for child in children:
        out.append(tensors[child] if type(child) is int else collate_tree(child, tensors))
    return out


# Batch tensors whose rows __getitems__ handed out as samples, by id (weakly: a batch lives as long as its rows).
_ADOPTED: dict[int, weakref.ref[torch.Tensor]] = {}


def adopt(tensor: torch.Tensor) -> None:
    """Let :func:`collate` return rows of ``tensor`` (a fresh batch nobody else holds) instead of stacking them."""
    root = tensor if tensor._base is None else tensor._base
    key = id(root)
    _ADOPTED[key] = weakref.ref(root, functools.partial(_forget, key))


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _ADOPTED.get(key) is ref:  # not a newer tensor that got the same id
        del _ADOPTED[key]


def _rows_of_one_batch(column: Sequence[Any]) -> torch.Tensor | None:
    """The adopted batch whose consecutive rows are exactly ``column``, in order, as one tensor; else None."""
    first = column[0]
    base: torch.Tensor | None = first._base
    if base is None:
        return None
    ref = _ADOPTED.get(id(base))
    if ref is None or ref() is not base or not first.is_contiguous():
        return None
    step = first.numel() * first.element_size()
    start = first.data_ptr()
    if not step:
        return None
    for k, row in enumerate(column):
        if type(row) is not torch.Tensor or row._base is not base or row.data_ptr() != start + k * step:
            return None
        if row.shape != first.shape or row.dtype != first.dtype or not row.is_contiguous():
            return None
    offset, remainder = divmod(start - base.data_ptr(), step)
    rows = base.view(first.dtype) if base.dtype != first.dtype else base  # a bits view: bfloat16 in uint16
    if remainder or offset < 0 or offset + len(column) > rows.shape[0] or rows.shape[1:] != first.shape:
        return None
    return rows.narrow(0, offset, len(column))


def collate(batch: Any) -> Any:
    """``default_collate``, without copying a warm batch of a :class:`CachedDataset` a second time.

    ``DataLoader(ds, collate_fn=collate)``: ``ds.__getitems__`` gathers a
    batch of hits into one tensor per field (in a worker, in shared memory)
    and hands out its rows as the samples; ``default_collate`` would stack
    those rows into a copy, ``collate`` returns the rows as the batch. Every
    other tensor, and everything else, is collated as ``default_collate``
    does (with torch's ``default_collate_fn_map`` as it is when called). The
    batch then shares memory with the samples ``__getitems__`` returned (not
    with the cache): keep the batch *or* the samples if you modify either in
    place. ``ds.loader()`` needs no collate: it gathers each batch once.
    """
    from torch.utils.data._utils.collate import collate as collate_with
    from torch.utils.data._utils.collate import default_collate_fn_map

    stack = default_collate_fn_map[torch.Tensor]

    def tensors(column: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
        rows = _rows_of_one_batch(column)
        return rows if rows is not None else stack(column, collate_fn_map=collate_fn_map)

    return collate_with(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: tensors})


def as_is(batch: Any) -> Any:
    """The collate function of ``loader()``: the dataset already returns finished batches."""
    return batch


class Then:
    """A collate function followed by a batch transform: ``then(collate_fn(samples))`` (pickles as the two)."""

    __slots__ = ("collate_fn", "then")

    def __init__(self, collate_fn: Callable[[Any], Any], then: Callable[[Any], Any]) -> None:
        self.collate_fn, self.then = collate_fn, then

    def __call__(self, samples: Any) -> Any:
        return self.then(self.collate_fn(samples))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Then, (self.collate_fn, self.then))

    def __repr__(self) -> str:
        return f"Then({self.collate_fn!r}, {self.then!r})"


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
    names = leaf_names(batch[0], pad, "pad")
    return Padder(names, functools.partial(_padded, padding_value=padding_value)).collate(list(batch), [])


def leaf_names(sample: Any, given: str | Collection[str] | None, argument: str) -> frozenset[str] | None:
    """The leaves ``given`` names (``argument``, for errors), checked against the tensor leaves of ``sample``."""
    if given is None:
        return None
    names = frozenset([given]) if isinstance(given, str) else frozenset(given)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"{argument} names leaves by their field names (strings), got {sorted(map(repr, names))}")
    leaves: list[str] = []
    _tensor_leaves(sample, [], leaves)
    if not names <= set(leaves):
        raise ValueError(
            f"{argument} names {sorted(names - set(leaves))}, which are not tensor leaves of the samples; their "
            f"tensor leaves are {leaves} (named as in mmapcache.torch: '0' for a tuple's first element, "
            "'key' for a dict's, '.' for a bare leaf)"
        )
    return names


def _padded(column: list[torch.Tensor], name: str, *, padding_value: float) -> Padded:
    return pad_tensors(column, padding_value, name)


def _tensor_leaves(value: Any, path: list[Step], names: list[str]) -> None:
    """The names of the leaves of one sample that :class:`Padder` treats as tensors, in its order."""
    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype.kind in "biufc"):
        names.append(name_of(path))
    elif isinstance(value, Mapping):
        for key in value:
            _tensor_leaves(value[key], [*path, ("dict", key)], names)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        for k, item in enumerate(value):
            _tensor_leaves(item, [*path, (kind, k)], names)


class Padder:
    """One ``pad_collate`` call: ``default_collate``'s walk over the structure, knowing each leaf's name.

    The tensors of a leaf in ``names`` (or, with ``names=None``, of any leaf
    whose shapes differ in the batch) become ``leaf(tensors, name)``.
    """

    def __init__(self, names: frozenset[str] | None, leaf: Callable[[list[torch.Tensor], str], Any]) -> None:
        self.names, self.leaf = names, leaf

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
        return self.leaf(column, name)


# Same-size signed dtypes, whose kernels torch has where the unsigned ones lack them (index_put).
_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def pad_tensors(column: list[torch.Tensor], padding_value: float, name: str) -> Padded:
    """The tensors of one leaf (``name``, for errors) padded into a :class:`Padded` (in a worker, in shared memory)."""
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
        data = shared_empty(shape, dtype)  # as default_collate does: no copy to ship it to the main process
    else:
        data = torch.empty(shape, dtype=dtype, device=column[0].device)
    data.fill_(padding_value)
    lengths = torch.tensor(shapes, dtype=torch.int64).reshape(len(column), ndim)
    if ndim == 1:
        # Sequences: many short rows. One masked copy of them all costs half the per-row loop.
        filled = torch.arange(longest[0], device=data.device) < lengths.to(data.device)  # (batch, longest)
        bits = _SIGNED.get(dtype, dtype)  # torch has no masked assignment for uint16/32/64: move their bits
        data.view(bits)[filled] = torch.cat(column).to(dtype).view(bits)
        return Padded(data, lengths[:, 0])
    for row, tensor in zip(data, column, strict=True):
        row[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return Padded(data, lengths)
