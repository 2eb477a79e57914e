"""``CachedStream.loader()``: a complete stream's epochs read a batch at a time, one gather per field.

A plain ``DataLoader(stream, batch_size=...)`` reads a later epoch element by
element (chunks from the file, one tensor per element), then stacks them with
``default_collate``. The loader instead hands DataLoader :class:`StreamBatches`,
an iterable of finished batches: each is this rank's next ``batch_size``
slots of the epoch's permutation, gathered by :func:`gather` straight into
the batch tensors (variable fields into one ``Jagged`` each, batched as
``ragged=`` says), as ``CachedDataset.loader()`` gathers. With workers, worker
``w`` of ``W`` takes batches ``w, w + W, ...`` of the rank's epoch (so the
batches come out in the same order as without workers) and sends only their
slots (a :class:`~._loader.WorkerBatch`); the main process gathers them. A
cache that is not complete yet is read as the stream's pass is (filling it),
its elements collated as ``ragged_collate`` does.

Once the cache is complete the main process gathers every batch anyway, and
the slots of a batch are a slice of the epoch's permutation: workers would
only add a hand-off per batch. So :class:`StreamLoader` reads a complete
epoch in the main process without them (they are started only for epochs
that stream: a spawned worker costs seconds to start).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.utils.data

from .._streams import Partition, checked_records, epoch_slots, stream_status
from ..cache import Cache
from ._loader import Batched, Loader, WorkerBatch, _pinned
from ._ragged import ragged_collate
from ._stream import _rank

if TYPE_CHECKING:
    from ._schema import Schema
    from ._stream import CachedStream

__all__ = ["StreamBatches", "StreamLoader"]


class _Reads:
    """What :class:`~._loader.Batched` asks of its session, for a stream: the schema and the complete file."""

    def __init__(self, stream: CachedStream) -> None:
        self.stream = stream

    @property
    def schema(self) -> Schema | None:
        return self.stream._schema

    def opened(self) -> Cache | None:
        """The stream's file in this process, when it is complete (else ``None``: the stream's pass reads it)."""
        stream = self.stream
        rank, ranks = stream._ranks or _rank()
        cache = stream._opened(Partition(rank, ranks))
        if cache is None or not stream_status(cache).cached:
            stream._let_go_if_incomplete()  # kept open, it would keep the workers from restarting the fill
            return None
        return cache


class StreamBatches(Batched, torch.utils.data.IterableDataset[Any]):
    """A :class:`~mmapcache.torch.CachedStream` as ``loader()`` shows it to DataLoader: an iterable of batches."""

    def __init__(
        self,
        stream: CachedStream,
        batch_size: int,
        *,
        shuffle: bool | None,
        drop_last: bool,
        ragged: str,
        padding_value: float,
    ) -> None:
        super().__init__(
            stream,
            cast(Any, _Reads(stream)),
            collated=True,
            ragged=ragged,
            padding_value=padding_value,
            remake=_unused,
        )
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last

    def __reduce__(self) -> tuple[Any, ...]:
        options: dict[str, Any] = {"shuffle": self.shuffle, "drop_last": self.drop_last}
        options.update(ragged=self.ragged, padding_value=self.padding_value)
        return (_remake, (self.dataset, self.batch_size, options))

    def __len__(self) -> int:
        """Batches this rank reads in an epoch (of a complete cache; else from ``len(stream)``)."""
        elements = len(self.dataset)
        return elements // self.batch_size if self.drop_last else -(-elements // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        stream: CachedStream = self.dataset
        cache = self.session.opened()
        if cache is None:
            yield from self._from_elements(iter(stream))
            return
        partition = stream._partition()
        epoch = stream._next_epoch()
        shuffle = stream.shuffle if self.shuffle is None else self.shuffle
        slots = epoch_slots(
            checked_records(cache), epoch=epoch, seed=stream.seed, shuffle=shuffle, rank=partition.rank,
            ranks=partition.ranks,
        )  # fmt: skip
        size = self.batch_size
        stop = len(slots) - len(slots) % size if self.drop_last else len(slots)
        in_worker = torch.utils.data.get_worker_info() is not None
        for start in range(partition.worker * size, stop, partition.workers * size):
            positions = np.ascontiguousarray(slots[start : start + size], dtype=np.intp)
            if in_worker:
                yield WorkerBatch(positions, [], [])
            else:
                yield self._collate(gather(stream, cache, positions))

    def gather(self, batch: WorkerBatch) -> Any:
        """In the main process: the batch of a worker's slots, gathered from the file."""
        cache = self.session.opened()
        assert cache is not None, "a worker sends slots only from a complete cache"
        return self._collate(gather(self.dataset, cache, batch.positions))

    def _from_elements(self, elements: Iterator[Any]) -> Iterator[Any]:
        """A pass that fills (or streams) the cache: its elements in batches, collated as ``ragged_collate`` does."""
        collate: ragged_collate | None = None
        batch: list[Any] = []
        for element in elements:
            batch.append(element)
            if len(batch) == self.batch_size:
                collate = collate or self._element_collate()
                yield collate(batch)
                batch = []
        if batch and not self.drop_last:
            yield (collate or self._element_collate())(batch)

    def _element_collate(self) -> ragged_collate:
        schema = self.session.schema
        fields = schema.fields if schema is not None else self.dataset.fields
        leaves = None
        if fields is not None:
            leaves = [name for name, field in fields.items() if field.variable and field.text is None]
        return ragged_collate(self.ragged, leaves=leaves, padding_value=self.padding_value)

    def __repr__(self) -> str:
        return f"StreamBatches({self.dataset!r}, batch_size={self.batch_size})"


class StreamLoader(Loader):
    """The DataLoader ``CachedStream.loader()`` returns: over a complete cache, its epochs skip the workers."""

    def __iter__(self) -> Any:
        batches = self.dataset
        if self.num_workers and isinstance(batches, StreamBatches) and batches.session.opened() is not None:
            return _in_main(batches, pin=self.pin_memory and torch.accelerator.is_available())
        return super().__iter__()


def _in_main(batches: StreamBatches, *, pin: bool) -> Iterator[Any]:
    for batch in batches:
        yield _pinned(batch) if pin else batch


def gather(stream: CachedStream, cache: Cache, positions: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
    """One column per field holding the stream's elements in slots ``positions`` (all filled: a complete cache)."""
    schema = stream._schema
    assert schema is not None
    # Fresh arrays of this process (the main process gathers every batch), which become the batch tensors.
    read, hits = cache.read_many(positions, count=False)
    if not hits.all():  # only a file that was cleared or damaged under us
        slot = int(positions[int(np.argmin(hits))])
        raise RuntimeError(f"slot {slot} of the stream cache {stream.path} is no longer filled")
    stream._read += len(positions)
    columns: list[Any] = []
    for name, variable, text, dtype in zip(schema.names, schema.variable, schema.texts, schema.dtypes, strict=True):
        if variable:
            columns.append(read[name] if text is None else list(read[name]))
        else:
            tensor = torch.from_numpy(read[name])
            columns.append(tensor if dtype is None else tensor.view(dtype))
    return columns


def _remake(stream: CachedStream, batch_size: int, options: dict[str, Any]) -> StreamBatches:
    return StreamBatches(stream, batch_size, **options)


def _unused(*args: Any) -> Batched:  # pragma: no cover - StreamBatches pickles by its own __reduce__
    raise AssertionError("StreamBatches is remade by _remake")
