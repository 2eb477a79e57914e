"""``CachedDataset.loader()``: a DataLoader whose batches of hits are copied once, from the file to the batch.

``DataLoader(ds, batch_size=...)`` with the default collate reads each batch
twice: ``ds.__getitems__`` returns one tensor per sample, and
``default_collate`` stacks them into the batch (in a worker, into shared
memory). ``loader()`` instead hands DataLoader a view of the dataset
(:class:`Batched`) whose ``__getitems__`` returns the finished batch: every
field is gathered by one ``np.take`` straight into the tensor the training
loop receives, and the collate function passes it through
(:func:`~._collate.as_is`). The batch has exactly the structure
``default_collate`` builds from the samples (a tuple becomes a list, as there).

In a DataLoader worker, :class:`Batched` makes sure every cacheable sample of
the batch is in the file (loading and storing the misses — the expensive
part) and returns a :class:`WorkerBatch`: the positions, plus the rows it could
not store. Only those few hundred bytes cross to the main process — no
shared-memory segment to create and fault in per batch — and there the
:class:`Loader`'s iterator gathers the batch from the file into fresh tensors:
still one copy from the file to the batch.

Without workers the batch is read where DataLoader's fetch would have asked
for it, with nothing around it but the sampler: the batches of indices come
as arrays drawn an epoch at a time and checked once (:mod:`._index_batches`),
a warm batch of fixed fields is one pass of the compiled read (slot states
and rows) into the arrays that become its tensors, and the iterator
(:class:`InProcess`) skips the fetcher, the pass-through collate and, unless
a profiler records, the profiler's range per batch.

A variable-shape field is gathered the same way, once per batch, into one
:class:`~mmapcache.Jagged`, which becomes the batch ``ragged=`` asks for
(:mod:`._ragged`: padded, nested, packed or a list), with no object made per
sample but for ``"list"``. Batches built from samples (with a ``transform``, or
indices the file does not cache) collate their variable leaves the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from .._region import Jagged
from ..cache import fixed_rows_of
from ._collate import Padded, Padder, as_is, collate, collate_tree
from ._columns import as_tensors
from ._index_batches import IndexBatch, index_batches
from ._ragged import Packed, jagged_batch, tensors_batch
from ._recycled import Recycled
from ._session import Session

__all__ = ["Batched", "Loader", "WorkerBatch"]


class WorkerBatch:
    """A batch a DataLoader worker leaves for the main process to gather: it pickles as the positions.

    ``positions`` are file positions; ``rows``/``leaves`` the samples the
    worker loaded but could not store (beyond the capacity, or being written
    by another process right now), as their leaves. The worker counted the reads.
    """

    __slots__ = ("leaves", "positions", "rows")

    def __init__(self, positions: np.ndarray[Any, np.dtype[np.intp]], rows: list[int], leaves: list[list[Any]]) -> None:
        self.positions, self.rows, self.leaves = positions, rows, leaves

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.positions, self.rows, self.leaves)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.positions, self.rows, self.leaves = state

    def __repr__(self) -> str:
        return f"WorkerBatch({len(self.positions)} samples to gather from the file in the main process)"


class Batched(torch.utils.data.Dataset[Any]):
    """A :class:`~mmapcache.torch.CachedDataset` as ``loader()`` shows it to DataLoader.

    ``__getitems__`` returns the finished batch when ``collated`` (no
    ``collate_fn`` of the user's) — in a worker, a :class:`WorkerBatch` for
    the main process to gather — else the samples for the user's collate.
    ``__getitem__`` and ``len`` are the dataset's, so samplers (including
    ``DistributedSampler`` and the ones Lightning injects) work unchanged.
    ``batch_transform`` runs on each finished batch, once, in the process that
    finishes it: the main process for a gathered batch, a worker for a batch
    it collated from samples. ``remake(dataset, collated, ragged,
    padding_value, batch_transform)`` makes it again from the dataset when it
    is unpickled (with the unpickled dataset's own session).
    """

    def __init__(
        self,
        dataset: Any,
        session: Session,
        *,
        collated: bool,
        ragged: str = "pad",
        padding_value: float = 0,
        batch_transform: Callable[[Any], Any] | None = None,
        remake: Callable[..., Batched],
    ) -> None:
        self.dataset, self.session, self.collated, self.remake = dataset, session, collated, remake
        self.ragged, self.padding_value, self.batch_transform = ragged, padding_value, batch_transform
        self.recycled = Recycled()  # the buffers of batches nothing refers to any more, read into again

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.remake, (self.dataset, self.collated, self.ragged, self.padding_value, self.batch_transform))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int] | IndexBatch) -> Any:
        if not self.collated:
            return self.dataset.__getitems__(indices)
        if torch.utils.data.get_worker_info() is not None:
            return self.in_worker(indices)
        return self.batch(indices)

    def batch(self, indices: Sequence[int] | IndexBatch) -> Any:
        """The batch ``default_collate(dataset.__getitems__(indices))`` is, with one copy for the hits.

        With a per-sample ``transform``, the hits are gathered once into this
        process's memory, the transform gets writable rows of that batch (no
        copy of its own), and what it returns is collated (a leaf it returns
        as it got it stays in the gathered batch, unstacked). Then the
        ``batch_transform``, if any.
        """
        finished = self._finished(indices)
        return finished if self.batch_transform is None else self.batch_transform(finished)

    def _finished(self, indices: Sequence[int] | IndexBatch) -> Any:
        session = self.session
        given: Any = indices
        checked = None
        if type(indices) is IndexBatch:  # drawn and checked by the loader's sampler
            given = checked = indices.indices
        if self.dataset.transform is not None or len(given) == 0:
            return self._collate_samples(self.dataset.__getitems__(given))
        idx = session.settings.positions(session.settings.indices(given) if checked is None else checked)
        if idx is None:  # some are not among cached_indices
            return self._collate_samples(self.dataset.__getitems__(given))
        cache = session.opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            return self._collate_samples(session.load(idx.tolist()))
        return self._read(cache, idx)

    def _read(
        self,
        cache: Any,
        idx: np.ndarray[Any, np.dtype[np.intp]],
        rows: Sequence[int] = (),
        leaves: Sequence[list[Any]] = (),
        *,
        counted: bool = False,
    ) -> Any:
        """The finished batch at file positions ``idx`` (``rows``, ``leaves``, ``counted``: as ``Session.gather``).

        One pass reads the slot states and the rows into arrays of this process's memory —
        a batch's that nothing refers to any more, else fresh ones (:mod:`._recycled`) — which
        become the batch tensors; misses (and variable fields) are ``Session.gather``'s, which
        takes this read on rather than reading again.
        """
        session = self.session
        schema = session.schema
        assert schema is not None
        if schema.ragged:
            return self._collate(session.gather(cache, idx, rows, leaves, counted=counted))
        fixed = fixed_rows_of(cache)
        outs = None if fixed is None else self.recycled.take(fixed, len(idx), fixed.empty)
        if fixed is not None and outs is not None:
            _, hits, found = fixed.take(idx, len(cache), outs)
            arrays = dict(zip(fixed.names, outs, strict=True))
        if outs is None or found < 0:  # fields read otherwise (verify, read-ahead), or an index out of range
            outs = None
            arrays, hits = cache.read_many(idx, count=False)
            found = int(np.count_nonzero(hits))
        if found < len(idx):
            assert hits is not None
            first = (arrays, hits)
            return self._collate(session.gather(cache, idx, rows, leaves, counted=counted, first=first))
        if not counted:
            session.hits += found
            cache.count(hits=found)
        batch = collate_tree(schema.tree, as_tensors(list(map(arrays.__getitem__, schema.names)), schema.dtypes))
        if outs is not None and fixed is not None:
            self.recycled.keep(fixed, outs)
        return batch

    def _collate_samples(self, samples: list[Any]) -> Any:
        """``collate`` (``default_collate`` without restacking rows of one gathered batch), but the leaves
        named as the variable fields are batched as ``ragged`` asks."""
        schema = self.session.schema
        if schema is None or not schema.ragged or not samples:
            return collate(samples)
        names = frozenset(
            name
            for name, variable, text in zip(schema.names, schema.variable, schema.texts, strict=True)
            if variable and text is None
        )
        leaf = functools.partial(tensors_batch, ragged=self.ragged, padding_value=self.padding_value)
        return Padder(names, leaf).collate(samples, [])

    def gather(self, batch: WorkerBatch) -> Any:
        """In the main process: the batch a worker's :class:`WorkerBatch` stands for, gathered from the file."""
        session = self.session
        cache = session.opened()
        assert cache is not None, "a worker sends a WorkerBatch only once the file exists"
        gathered = self._read(cache, batch.positions, batch.rows, batch.leaves, counted=True)
        return gathered if self.batch_transform is None else self.batch_transform(gathered)

    def _collate(self, columns: list[Any]) -> Any:
        schema = self.session.schema
        assert schema is not None
        if schema.ragged:
            columns = [
                jagged_batch(column, self.ragged, schema.dtypes[k], self.padding_value, name)
                if isinstance(column, Jagged)
                else column
                for k, (name, column) in enumerate(zip(schema.names, columns, strict=True))
            ]
        return collate_tree(schema.tree, columns)

    def in_worker(self, indices: Sequence[int] | IndexBatch) -> Any:
        """In a DataLoader worker: store the batch's misses, and leave the gather to the main process."""
        session = self.session
        if self.dataset.transform is not None or len(indices) == 0:
            return self.batch(indices)
        checked = indices.indices if type(indices) is IndexBatch else session.settings.indices(indices)
        idx = session.settings.positions(checked)
        cache = session.opened()
        if idx is None or cache is None:
            # Indices outside cached_indices, or nobody created the file yet (this batch creates it).
            return self.batch(indices)
        ready = cache.contains_many(idx)
        cache.count(hits=int(np.count_nonzero(ready)))  # the main process gathers without counting
        # On a disk, the reads of this batch start now, while the main process gathers earlier ones.
        cache.prefetch(idx[ready], background=False)
        rows: list[int] = []
        leaves: list[list[Any]] = []
        if not ready.all():
            todo = np.flatnonzero(~ready)
            samples = session.load(idx[todo].tolist())
            stored = cache.contains_many(idx[todo])
            schema = session.schema
            assert schema is not None
            for row, sample, cached in zip(todo.tolist(), samples, stored.tolist(), strict=True):
                if not cached:
                    rows.append(row)
                    leaves.append(schema.flatten(sample))
        return WorkerBatch(idx, rows, leaves)

    def __repr__(self) -> str:
        return f"Batched({self.dataset!r})"


class Loader(torch.utils.data.DataLoader[Any]):
    """The DataLoader ``loader()`` returns: a plain DataLoader over a :class:`Batched` dataset, whose
    iterators turn the :class:`WorkerBatch` its workers send into batches (pinned if ``pin_memory``).

    It takes exactly DataLoader's arguments, so code that rebuilds a DataLoader
    from its class and arguments (Lightning's sampler injection) gets a Loader again.
    """

    @property
    def _index_sampler(self) -> Any:
        """What the iterators draw batches of indices from: DataLoader's, as arrays (:mod:`._index_batches`).

        Only for a Loader itself (a subclass such as the stateful one keeps DataLoader's batches and their
        state) whose batches this package gathers; ``batch_sampler`` stays what DataLoader made of the arguments.
        """
        sampler = super()._index_sampler
        if type(self) is not Loader or not self._auto_collation:
            return sampler
        dataset = self.dataset
        if not isinstance(dataset, Batched) or not dataset.collated:
            return sampler
        return index_batches(sampler, len(dataset))

    def _get_iterator(self) -> Any:
        if isinstance(self.dataset, Batched):
            # The spot checks run here, in the main process, before the workers start: they inherit the verdict.
            self.dataset.session.opened()
            if self.num_workers == 0 and type(self) is Loader and self.collate_fn is as_is and self._auto_collation:
                return InProcess(self)
        return super()._get_iterator()

    def __iter__(self) -> Any:
        inner = super().__iter__()
        if self.num_workers == 0 or not isinstance(self.dataset, Batched):
            return inner
        return _Gathering(inner, self.dataset, pin=self.pin_memory and torch.accelerator.is_available())


class InProcess(_SingleProcessDataLoaderIter):
    """A Loader's (or a mixture loader's) iterator without workers: DataLoader's, the batch asked of the
    dataset view directly.

    The view's batches are finished (the collate function passes them through), so ``__next__`` skips
    the fetcher, the collate call and, while no profiler records, the profiler's range around each batch
    (a few µs a batch: as much as the Python of the read itself). Under a profiler it is DataLoader's own.
    """

    def __next__(self) -> Any:
        if torch._C._autograd._profiler_enabled():
            return super().__next__()
        data = self._dataset.__getitems__(next(self._sampler_iter))  # type: ignore[attr-defined]  # a view's
        if self._pin_memory:
            data = torch.utils.data._utils.pin_memory.pin_memory(  # type: ignore[no-untyped-call]  # no hints
                data, self._pin_memory_device
            )
        self._num_yielded += 1
        return data


class _Gathering:
    """An iterator of a :class:`Loader` with workers: the DataLoader's own, with worker batches gathered."""

    def __init__(self, inner: Any, batched: Batched, *, pin: bool) -> None:
        self.inner, self.batched, self.pin = inner, batched, pin

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        if type(batch) is WorkerBatch:
            batch = self.batched.gather(batch)
            if self.pin:
                batch = _pinned(batch)
        return batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _pinned(batch: Any) -> Any:
    """A gathered batch (dicts, lists and Padded/Packed of tensors) in pinned memory, as ``pin_memory`` makes it."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {key: _pinned(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [_pinned(value) for value in batch]
    if isinstance(batch, (Padded, Packed)):
        return type(batch)(*(_pinned(value) for value in batch))
    return batch
