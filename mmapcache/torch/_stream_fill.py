"""A first epoch's stores: a partition's stream elements copied into batches and stored beside the stream.

``CachedStream`` hands each element's storage arrays to its pass's :class:`Filler` before yielding the
element; the filler copies them into the current :class:`Batch` and stores full batches through the
core's partition writer (``mmapcache._streams``), making the file in a thread when there is none yet.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CacheError
from .._field import Field
from .._streams import Partition, PartitionWriter, StreamPlan
from ..cache import Cache
from ._fill_checks import RepeatCheck

__all__ = ["Batch", "Filler", "row_bytes"]

log = logging.getLogger("mmapcache")

_BATCH = 64  # elements stored at a time in a first epoch (at most: a killed writer leaves up to this many holes)
_BATCH_BYTES = 4 << 20  # and at most about this many bytes of them
_WAITING_BYTES = 64 << 20  # full batches kept while the file is being made, before waiting for it
_THREADED_ROW = 16 << 10  # rows at least this large are stored by a thread beside the stream


class Filler:
    """One pass's stores into the cache of its partition: the elements a batch at a time, beside the stream.

    Each element is copied into the current batch before it is yielded (what
    the consumer does to it cannot change what is stored), and full batches
    are stored with :meth:`PartitionWriter.offer_many`. A thread makes the
    file when there is none yet (preallocating it takes ~0.4 ms per MB on
    tmpfs) while the stream goes on. Batches of large rows (``_THREADED_ROW``
    bytes and more: images, audio) are stored by that thread too, whose
    writes release the GIL while the stream decodes its next elements;
    batches of small rows are stored by the iterating thread, because storing
    them is Python work that would only contend for the GIL. Up to
    ``_WAITING_BYTES`` of full batches wait before the stream does. What was
    yielded is stored also when the pass stops early (a ``break``, an error,
    the iterator dropped): :meth:`close`.
    """

    def __init__(
        self,
        partition: Partition,
        cache: Cache | None,
        plan: StreamPlan | None = None,
        *,
        key: str,
        path: Path,
        open_file: Callable[[Partition, Callable[[], StreamPlan]], Cache | None],
        stored: Callable[[int], None],
    ) -> None:
        """``cache``: the file, or ``None`` and the ``plan`` to make it from (by ``open_file``, in the thread);
        ``stored`` is told how many elements each store wrote."""
        self.partition, self.key, self.path = partition, key, path
        self.open_file, self.stored = open_file, stored
        self.writer = None if cache is None else PartitionWriter(cache, partition)
        self.fields: dict[str, Field] = cache.fields if cache is not None else plan.fields  # type: ignore[union-attr]
        self.batch = Batch(self.fields)
        self.repeats = RepeatCheck(list(self.fields), partition.index, key=key, path=path)
        self.spare: list[Batch] = []  # stored ones, to fill again
        self.waiting: list[Batch] = []  # full batches the iterating thread stores (small rows)
        self.error: BaseException | None = None
        self.threaded = self.batch.row_bytes >= _THREADED_ROW
        self.limit = max(2, _WAITING_BYTES // max(1, self.batch.size * self.batch.row_bytes))
        self.queue: queue.Queue[Batch | None] = queue.Queue(maxsize=self.limit)
        self.thread: threading.Thread | None = None
        self.creating = plan is not None  # the thread is making the file: hand it the GIL at every element
        if plan is not None or self.threaded:
            self.thread = threading.Thread(target=self._run, args=(plan,), name="mmapcache-store", daemon=True)
            self.thread.start()

    def add(self, j: int, leaves: list[Any]) -> None:
        """Element ``j`` of the partition, as storage arrays: copied into the batch, stored when the batch is full."""
        if self.creating:
            time.sleep(0)  # lets the thread take the GIL now, not after a switch interval (5 ms) of waiting
        self._raise()
        writer = self.writer
        if writer is not None and writer.done:
            return  # not ours to store (another pass holds the partition, or it has ended)
        if not self.batch.add(j, leaves):
            return
        if self.threaded:
            self.queue.put(self.batch)
        else:
            self.waiting.append(self.batch)
            if self.thread is None or not self.thread.is_alive() or len(self.waiting) >= self.limit:
                self._store_waiting()
        self.batch = self.spare.pop() if self.spare else Batch(self.fields)

    def finish(self, count: int) -> None:
        """The partition ended after ``count`` elements: store what waits, then mark it ended if this pass may."""
        self._drain()
        self._raise()
        if self.writer is not None:
            self.writer.finish(count)

    def close(self) -> None:
        """Store what was yielded and waits (if the file is there), let go of the partition.

        The cleanup of a pass that stopped early (a ``break``, an error of the
        stream or of the loop, the iterator dropped) raises nothing of its own:
        a failure to make the file or store the last batches is logged, and
        what stopped the pass is what propagates.
        """
        try:
            self._drain()
        except Exception as error:
            log.warning(
                "the first epoch over %s stopped early, and storing what it had yielded failed: %s. What was "
                "not stored is streamed again in the next epoch",
                self.path,
                error,
            )
        finally:
            if self.writer is not None:
                self.writer.close()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _drain(self) -> None:
        """Store the last batch and everything that waits."""
        threaded = self.threaded and self.thread is not None
        if len(self.batch):
            if threaded:
                self.queue.put(self.batch)
            else:
                self.waiting.append(self.batch)
            self.batch = Batch(self.fields)
        if threaded:
            self.queue.put(None)  # the thread stores what it was given, then stops
        self._store_waiting()

    def _store_waiting(self) -> None:
        """Wait for the thread (the file is made, or every batch it was given is stored), then store ``waiting``."""
        if self.thread is not None:
            if self.thread is not threading.current_thread():  # a generator finalized by the collector there
                self.thread.join()
            self.thread = None
            self.threaded = False  # what comes after is stored here
            self._raise()
        batches, self.waiting = self.waiting, []
        for batch in batches:
            self._store(batch)

    def _run(self, plan: StreamPlan | None) -> None:
        """The thread: make the file (from ``plan``) when there is none, then store each batch it is given."""
        try:
            if self.writer is None:
                made = plan
                assert made is not None  # a pass without a file has the plan to make it from
                opened = self.open_file(self.partition, lambda: made)
                assert opened is not None
                writer = PartitionWriter(opened, self.partition)
                if opened.fields != self.fields:  # made at once by another process, from another first element
                    writer.close()  # this pass stores nothing; a later one does
                self.writer = writer
                self.creating = False
            if self.threaded:
                while (batch := self.queue.get()) is not None:
                    self._store(batch)
        except BaseException as error:  # raised in the iterating thread, by add or finish
            self.error = error
            self.creating = False
            if self.threaded:
                while self.queue.get() is not None:  # let the stream go on; nothing more is stored
                    pass

    def _store(self, batch: Batch) -> None:
        writer = self.writer
        if writer is not None and not writer.done:
            try:
                self.repeats.add(batch.first, self.repeats.digests(batch.fixed, batch.values, batch.count))
            except CacheError:
                writer.close()  # a stream that repeats itself: nothing more of this pass is stored
                raise
            first, rows, count = batch.take()
            self.stored(writer.offer_many(first, rows, count, checked=True))
        batch.clear()
        self.spare.append(batch)


def row_bytes(fields: Mapping[str, Field]) -> int:
    """About how many bytes an element takes (a variable field counted as 256), to size batches and reads."""
    return sum(256 if field.variable else field.nbytes for field in fields.values())


class Batch:
    """Elements of a partition waiting to be stored: their leaves copied into columns as ``put_many`` takes them."""

    def __init__(self, fields: dict[str, Field]) -> None:
        self.fields = list(fields.items())
        self.row_bytes = row_bytes(fields)
        self.size = max(1, min(_BATCH, _BATCH_BYTES // max(self.row_bytes, 1)))
        self.fixed = [
            None if field.variable else np.empty((self.size, *field.fixed_shape), field.dtype)
            for _, field in self.fields
        ]
        self.values: list[list[Any]] = [[] for _ in self.fields]
        self.first = self.count = 0  # the partition's element in row 0, and the rows

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.count * self.row_bytes

    def add(self, j: int, leaves: list[Any]) -> bool:
        """Copy the leaves of the partition's element ``j`` into the next row; True when the batch is full."""
        row = self.count
        if not row:
            self.first = j
        for k, leaf in enumerate(leaves):
            column = self.fixed[k]
            if column is not None:
                column[row] = leaf
            elif self.fields[k][1].text is None:
                self.values[k].append(leaf.copy())  # a storage array (ndarray), C-contiguous after
            else:
                self.values[k].append(leaf)  # text: a fresh array made from the str/bytes
        self.count = row + 1
        return self.count == self.size

    def take(self) -> tuple[int, dict[str, Any], int]:
        """``(first element, columns by field name, rows)``."""
        count = self.count
        rows = {
            name: (column[:count] if (column := self.fixed[k]) is not None else self.values[k])
            for k, (name, _) in enumerate(self.fields)
        }
        return self.first, rows, count

    def clear(self) -> None:
        self.count = 0
        self.values = [[] for _ in self.fields]
