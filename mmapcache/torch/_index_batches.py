"""A ``loader()``'s batches of indices as arrays: the sampler's order drawn as one array per epoch.

DataLoader's ``BatchSampler`` builds each batch as a list of ints, one
``next()`` of the sampler per index, and the dataset then turns the list back
into an array and checks it: for 256 rows of 1 KB that costs more than
gathering them. :class:`IndexBatches` stands in for the ``BatchSampler`` of a
:class:`~._loader.Loader` (through DataLoader's ``_index_sampler``, so the
loader's ``batch_sampler`` stays the one DataLoader made, and Lightning, which
rebuilds a loader with a ``DistributedSampler``, rebuilds a Loader whose
``BatchSampler`` this wraps again). It yields :class:`IndexBatch` objects:
slices of one array of the epoch's order, checked once against the dataset's
length, that :class:`~._loader.Batched` reads without checking again.

The order is the sampler's own, batch for batch:

* ``RandomSampler`` (without replacement): the same ``torch.randperm`` draws
  from the same generator, each drawn during the batch that first needs it
  (as the sampler draws it during that batch's ``next()`` calls);
* ``SequentialSampler``: ``arange``;
* a sampler whose ``iter()`` is a list, tuple or range iterator (its order
  exists already: ``DistributedSampler``, a list of indices): read whole into
  one array;
* ``NodeShardSampler``: its own batches of arrays (``NodeShardSampler.batches``),
  each taken when the batch is.

Any other sampler (a generator: ``RandomSampler(replacement=True)``, a custom
one) keeps DataLoader's batches of lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ._sampler import NodeShardSampler

__all__ = ["IndexBatch", "IndexBatches", "index_batches"]

_Indices = np.ndarray[Any, np.dtype[np.intp]]

# iter() of these is an order computed already: reading it whole draws nothing early.
_EAGER: tuple[type, ...] = (type(iter([])), type(iter(())), type(iter(range(0))))


class IndexBatch:
    """One batch of dataset indices in ``[0, len(dataset))``, checked already (a view of the epoch's order)."""

    __slots__ = ("indices",)

    def __init__(self, indices: _Indices) -> None:
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __reduce__(self) -> tuple[Any, ...]:  # to a DataLoader worker: the array
        return (IndexBatch, (self.indices,))

    def __repr__(self) -> str:
        return f"IndexBatch({self.indices.tolist()})"


class IndexBatches:
    """``batch_sampler`` (a plain ``BatchSampler``) yielding :class:`IndexBatch` es; see the module docstring."""

    def __init__(self, batch_sampler: torch.utils.data.BatchSampler, length: int) -> None:
        self.batch_sampler, self.length = batch_sampler, length

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        batch_sampler = self.batch_sampler
        sampler, size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
        if type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement:
            return _slices(_random_order(sampler), size, drop_last, self.length)
        if type(sampler) is torch.utils.data.SequentialSampler:
            n = len(sampler.data_source)
            return _slices(iter([np.arange(n, dtype=np.intp)]), size, drop_last, self.length)
        if type(sampler) is NodeShardSampler:  # its order as arrays, a batch at a time (its state counts them)
            return _slices(sampler.batches(size), size, drop_last, self.length)
        order = iter(sampler)
        if type(order) in _EAGER:
            return _slices(iter([np.fromiter(order, np.intp)]), size, drop_last, self.length)
        return _rebatched(order, batch_sampler)


def index_batches(batch_sampler: Any, length: int) -> Any:
    """What a Loader iterates for batches of indices: :class:`IndexBatches` over a plain ``BatchSampler``.

    Anything else (a ``batch_sampler`` of the user's, Lightning's wrapper when predicting) is left as it is.
    """
    if type(batch_sampler) is torch.utils.data.BatchSampler and isinstance(batch_sampler.batch_size, int):
        return IndexBatches(batch_sampler, length)
    return batch_sampler


def _random_order(sampler: torch.utils.data.RandomSampler) -> Iterator[_Indices]:
    """``RandomSampler(replacement=False)``'s order, a permutation at a time, each drawn when a batch needs it.

    The generator is the one ``RandomSampler.__iter__`` uses (its own, or one seeded from torch's global
    generator on the first batch); the draws are its draws, in its order.
    """
    n = len(sampler.data_source)
    generator = sampler.generator
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    full, rest = divmod(sampler.num_samples, n)
    for _ in range(full):
        yield torch.randperm(n, generator=generator).numpy()
    yield torch.randperm(n, generator=generator).numpy()[:rest]


def _slices(orders: Iterator[_Indices], size: int, drop_last: bool, length: int) -> Iterator[Any]:
    """Batches of ``size`` from the arrays ``orders`` yields, end to end, each drawn once a batch needs it.

    Each array is checked against ``length`` once. From one with an index out of range on, the batches
    are plain arrays, which the dataset checks (and raises for, naming the index, as it would for a list).
    """
    pending = np.empty(0, np.intp)
    checked = True
    while True:
        while len(pending) < size:
            order = next(orders, None)
            if order is None:
                break
            order = order.astype(np.intp, copy=False)
            if len(order) and (int(order.min()) < 0 or int(order.max()) >= length):
                checked = False
            pending = order if not len(pending) else np.concatenate([pending, order])
        if len(pending) < size and (drop_last or not len(pending)):
            return
        batch, pending = pending[:size], pending[size:]
        yield IndexBatch(batch) if checked else batch


def _rebatched(order: Iterator[int], batch_sampler: torch.utils.data.BatchSampler) -> Iterator[list[int]]:
    """DataLoader's own batches of ``order`` (an iterator of the sampler that was started already)."""
    size = batch_sampler.batch_size
    assert isinstance(size, int)
    if batch_sampler.drop_last:
        for whole in zip(*[order] * size, strict=False):
            yield [*whole]
        return
    batch = [*itertools.islice(order, size)]
    while batch:
        yield batch
        batch = [*itertools.islice(order, size)]
