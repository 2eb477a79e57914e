"""``CachedStream``: an ``IterableDataset`` streamed once into a cache file, then read from it with a true shuffle.

The file format and the store-once protocol are the core's (``mmapcache._streams.stream_cache``,
``mmapcache._region.partitions``); this module says which partition a process reads
(its DDP rank and DataLoader worker), turns stream elements into cache fields
and back, and chooses, per epoch, between filling, reading and streaming.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._errors import CacheInUseError, SchemaMismatchError
from .._field import Field, FieldsLike
from .._file import remove
from .._format import format_bytes, parse_bytes
from .._region import place
from .._streams import (
    Partition,
    StreamPlan,
    StreamStatus,
    checked_records,
    epoch_slots,
    open_stream,
    per_rank,
    plan_stream,
    rank_ended,
    region,
    stream_status,
    usable,
)
from ..cache import Cache
from ._checks import schema_problem
from ._elements import ElementPath, as_element
from ._epochs import EpochBoard
from ._fill_checks import StoredCheck
from ._sampler import SEEDS, checked_integer
from ._schema import Schema, declared_fields, first_fields, storage_dtypes, with_dtypes
from ._settings import default_path
from ._stream_fill import Filler, row_bytes

__all__ = ["CachedStream"]

log = logging.getLogger("mmapcache")

_READ = 64  # elements read from the file at a time in a later epoch (at most)
_READ_BYTES = 1 << 20  # and at most about this many bytes: an element kept alive keeps its chunk's buffer
_EMPTY_WAIT = 60.0  # seconds an empty partition waits for another partition to make the file
_LEN_WAIT = 60.0  # seconds len() waits, once this rank's partitions ended, for the other ranks' to end


def _rank() -> tuple[int, int]:
    """``(rank, world size)``: from ``torch.distributed`` once initialised, else ``RANK``/``WORLD_SIZE``, else one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        return int(rank), int(world)
    return 0, 1


class CachedStream(torch.utils.data.IterableDataset[Any]):
    """``stream`` (any iterable of samples) cached in one file as it is read, then read from the file.

    >>> ds = CachedStream(hf_stream, key="c4-en/gpt2/v1", max_bytes="20GiB")  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP

    While the cache is not complete, each process iterates ``stream`` as it
    would without the cache — the stream shards itself across DDP ranks and
    DataLoader workers, and each (rank, worker) is one *partition* — yields
    its elements in stream order and stores each of them once, whatever the
    number of processes and jobs reading it. Once every partition has been
    read to its end the cache is *complete*: every later epoch reads only the
    file, all elements in a fresh permutation per epoch (``set_epoch``; drawn
    from ``seed``, or in stored order with ``shuffle=False``), split evenly
    across ranks (padded by wrap-around, as ``DistributedSampler`` does) and
    workers, and ``len()`` is the count per rank.

    The first epoch stores its elements a batch at a time (up to 64 elements,
    or about 4 MiB): each is copied into the batch before it is yielded, so
    what the training loop does to it never changes what is stored, and an
    iteration stopped early (a ``break``, an error, the iterator dropped)
    stores what it yielded. A new file is made in a thread while the first
    elements stream.

    Samples are what :class:`CachedDataset` caches (tensors, arrays, Python
    scalars, ``str``/``bytes``, a tuple/list/dict of those one level deep);
    each element comes back as a read from the cache returns it, already in
    the first epoch. ``fields``/``dtypes`` are CachedDataset's: without
    ``fields`` the first element's shapes are kept; declare varying
    dimensions as ``None``.

    The file is preallocated: its size comes from ``max_bytes`` or, without
    it, from ``len(stream)`` (a stream without either is refused when it is
    first iterated). A stream that does not fit is admitted until the file is
    full; the rest of each partition is streamed uncached every epoch, and
    :meth:`stats` says so (``full``, ``uncached``).

    A run killed during the first epoch leaves a cache that the next run
    continues (same ranks and workers) or starts again (other ranks or
    workers, once no other job uses the file); nothing is stored twice and an
    incomplete cache is never read as the whole stream. The stream must give
    the same elements in the same order on every pass: a continued pass
    compares what was stored with what the stream gives now and refuses a
    difference (a shuffle buffer, ``resampled=True``, changed preprocessing),
    and a pass that repeats a ``__key__`` is refused (``_fill_checks``).
    """

    _source: Iterable[Any] | _Pickled

    def __init__(
        self,
        stream: Iterable[Any],
        path: str | os.PathLike[str] | None = None,
        *,
        key: str,
        fields: FieldsLike | None = None,
        dtypes: Mapping[str, Any] | None = None,
        max_bytes: int | str | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a string naming the cached content, not {type(key).__name__}")
        if not key:
            raise ValueError("key must not be empty: it names the cached content (stream + preprocessing)")
        if isinstance(stream, torch.utils.data.Dataset) and not isinstance(stream, torch.utils.data.IterableDataset):
            raise TypeError(
                f"{type(stream).__name__} is a map-style dataset: cache it with mmapcache.torch.CachedDataset, "
                "which reads any index in any order; CachedStream is for streams (IterableDataset...)"
            )
        if not hasattr(stream, "__iter__"):
            raise TypeError(f"stream must be an iterable (an IterableDataset...), not {type(stream).__name__}")
        if isinstance(stream, Iterator):
            raise TypeError(
                f"stream is a one-shot iterator ({type(stream).__name__}), but it is iterated again in each epoch "
                "until the cache is complete, and in each DataLoader worker: pass an iterable instead (an "
                "IterableDataset, or a class whose __iter__ is a generator function)"
            )
        seed = checked_integer("seed", seed, SEEDS)
        self.stream = stream
        self.key = key
        self.dtypes = None if dtypes is None else storage_dtypes(dtypes)
        declared = None if fields is None else declared_fields(fields)
        if declared is not None and self.dtypes is not None:  # as CachedDataset: dtypes= sets declared fields' dtypes
            declared = with_dtypes(declared, self.dtypes, where="fields=")
        self.fields = declared
        self.max_bytes = max_bytes
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch: int | None = None  # set_epoch's; None: each pass in a process draws the next
        self.path = Path(os.path.abspath(os.fspath(path))) if path is not None else default_path(key)
        self._ranks: tuple[int, int] | None = None  # the main process's rank, handed to its workers
        self._board = EpochBoard()  # this rank's passes, shared with its DataLoader workers
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._cache: Cache | None = None
        self._schema: Schema | None = None
        self._lock = threading.Lock()
        self._read = self._streamed = self._written = 0
        self._passes = 0  # iterations of this object in this process (see set_epoch)
        self._passing = threading.Lock()
        self._active = 0  # passes under way in this process that use the cache while it is not complete
        self._warned_budget = False  # that an existing file ignores a larger max_bytes= (once a process)

    @property
    def stream(self) -> Iterable[Any]:
        """The stream being cached (in a process that received the object pickled, unpickled when first needed)."""
        source = self._source
        if isinstance(source, _Pickled):
            loaded: Iterable[Any] = source.load()
            self._source = source = loaded
        return source

    @stream.setter
    def stream(self, stream: Iterable[Any]) -> None:
        self._source = stream

    def __getstate__(self) -> dict[str, Any]:
        state = {name: value for name, value in self.__dict__.items() if not name.startswith("_")}
        # Pickled apart: a worker over a complete cache never unpickles it (a HF dataset takes seconds to).
        state["_source"] = _Pickled.of(self._source)
        state["_ranks"] = self._ranks or _rank()  # workers started by spawn have no process group
        state["_board"] = self._board  # the same memory for workers being started, else a new board
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        board = state.pop("_board", None)
        if "stream" in state:  # pickled by 0.4 or 0.5: the stream itself, under its public name
            state["_source"] = state.pop("stream")
        self.__dict__.update(state)
        self._board = board if isinstance(board, EpochBoard) else EpochBoard()
        self._init_process_state()

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the epoch of this rank's next pass; the passes after it count on from it.

        Optional: without it the first pass is epoch 0 and each pass of this
        rank — an iteration of the object, or of a DataLoader over it, whatever
        its workers (none, new ones each epoch, persistent ones) — is the next
        epoch, the same on every rank. An epoch's permutation is drawn from
        ``(seed, epoch)``. Call it on every rank alike (as with
        ``DistributedSampler``), e.g. to resume at an epoch.
        """
        self.epoch = checked_integer("epoch", epoch, SEEDS)
        self._board.set_epoch(self.epoch)

    # -- who reads what ------------------------------------------------------------

    def _partition(self) -> Partition:
        rank, ranks = self._ranks or _rank()
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return Partition(rank, ranks, worker, workers)

    def _opened(self, partition: Partition, plan: Any = None) -> Cache | None:
        """The cache this process iterates as ``partition`` (``None``: it must be made from a first element)."""
        with self._lock:
            if self._cache is not None and not self._cache.closed:
                if usable(self._cache, partition):
                    return self._cache
                self._cache.close()  # e.g. opened by the main process, which forked workers of another partitioning
                self._cache = None
            cache = open_stream(self.path, key=self.key, fields=None, partition=partition, plan=plan)
            if cache is not None:
                self._adopt(cache)
            return cache

    def _adopt(self, cache: Cache) -> None:
        """Keep ``cache`` as this process's, once its fields are what ``fields=``/``dtypes=`` declare."""
        problem = schema_problem(cache.fields, self.fields, self.dtypes, self.path)
        if problem is not None:
            cache.close()
            raise SchemaMismatchError(
                f"the stream cache at {self.path} (key {self.key!r}) {problem[0]}",
                path=self.path,
                differences=problem[1],
            )
        self._cache = cache
        self._schema = Schema(cache.fields, self.path)
        self._warn_if_budget_ignored(cache)

    def _warn_if_budget_ignored(self, cache: Cache) -> None:
        """A full file made with a smaller budget than ``max_bytes=``: the file keeps its size; say how to grow it."""
        if self.max_bytes is None or self._warned_budget or not stream_status(cache).full:
            return
        budget = parse_bytes(self.max_bytes, name="max_bytes")
        if budget > cache.nbytes:
            self._warned_budget = True
            log.warning(
                "%s is full and was made %s, less than max_bytes=%r: an existing stream cache keeps its size. "
                "Grow it with `mmapcache resize %s --max-bytes %s` (what it holds stays; the next pass stores "
                "the rest)",
                self.path,
                format_bytes(cache.nbytes),
                self.max_bytes,
                self.path,
                self.max_bytes,
            )

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        partition = self._partition()
        epoch = self._next_epoch()
        cache = self._opened(partition)
        if cache is None:
            return self._incomplete(self._fill(None, partition), partition)
        status = stream_status(cache)
        if status.cached:
            return self._read_epoch(cache, partition, epoch)
        state = region(cache).state(partition.index)
        if state.ended:
            return self._incomplete(self._read_partition(cache, partition, state.stored, state.full, epoch), partition)
        return self._incomplete(self._fill(cache, partition), partition)

    def _next_epoch(self) -> int:
        """The epoch of the pass this process begins now (see :mod:`._epochs`)."""
        self._passes += 1
        return self._board.next_pass(self._passes)

    def _incomplete(self, elements: Iterator[Any], partition: Partition) -> Iterator[Any]:
        """A pass over a cache that is not complete (or not cached): ``elements``, then let go of the file.

        An empty partition ends only once the file exists: it waits for
        another partition of the run to make it. The handle is closed after
        the last such pass of this process (also when the iterator is
        dropped early), so that a run of another partitioning — its own
        DataLoader workers after a ``next(iter(stream))`` — can restart the fill.
        """
        with self._passing:
            self._active += 1
        streamed = self._streamed
        try:
            yield from elements
            if self._streamed == streamed and self._cache is None:
                self._end_empty(partition)
        finally:
            with self._passing:
                self._active -= 1
                last = not self._active
            if last:
                self._let_go_if_incomplete()

    def _let_go_if_incomplete(self) -> None:
        with self._lock:
            cache = self._cache
            if cache is not None and not cache.closed and not stream_status(cache).cached:
                cache.close()
                self._cache = None

    def _end_empty(self, partition: Partition) -> None:
        """An empty partition, no file yet: wait for the file (made from another partition's first element), end it."""
        self._board.ended_empty()
        deadline = time.monotonic() + _EMPTY_WAIT
        alone = partition.ranks == 1
        while (cache := self._opened(partition) if self.path.exists() else None) is None:
            # Not there yet, or a file of an earlier run that the partition with an element is replacing.
            if (alone and self._board.all_empty()) or time.monotonic() > deadline:
                return  # an empty stream, or nobody made the file in time: it ends in a later epoch
            time.sleep(0.05)
        filler = self._filler(partition, cache)
        try:
            filler.finish(0)
        finally:
            filler.close()

    def _read_epoch(self, cache: Cache, partition: Partition, epoch: int) -> Iterator[Any]:
        slots = epoch_slots(
            checked_records(cache),
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            rank=partition.rank,
            ranks=partition.ranks,
            worker=partition.worker,
            workers=partition.workers,
        )
        yield from self._from_file(cache, slots)

    def _read_partition(self, cache: Cache, partition: Partition, stored: int, full: bool, epoch: int) -> Iterator[Any]:
        """An ended partition of a cache that is not complete, or is full: its elements from the file, then the rest."""
        stream = region(cache)
        counted = checked_records(cache)
        mine = counted[stream.partition[counted] == partition.index]
        if self.shuffle:
            mine = mine[np.random.default_rng([self.seed, epoch, partition.index]).permutation(len(mine))]
        yield from self._from_file(cache, mine)
        if full:
            yield from self._stream_rest(partition, stored)

    def _from_file(self, cache: Cache, slots: np.ndarray[Any, Any]) -> Iterator[Any]:
        """The elements in ``slots``, a chunk at a time (one gather per field), yielded one by one.

        A chunk is up to ``_READ`` elements and about ``_READ_BYTES``: an element's tensors are views of its
        chunk's buffers.
        """
        schema = self._schema
        assert schema is not None
        names = schema.names
        size = max(1, min(_READ, _READ_BYTES // max(row_bytes(schema.fields), 1)))
        for start in range(0, len(slots), size):
            chunk = slots[start : start + size]
            read, hits = cache.read_many(chunk)
            if not hits.all():  # only a file that was cleared or damaged under us
                slot = int(chunk[int(np.argmin(hits))])
                raise RuntimeError(f"slot {slot} of the stream cache {self.path} is no longer filled")
            columns = [list(read[name]) if schema.variable[k] else read[name] for k, name in enumerate(names)]
            for element in schema.samples(columns):
                self._read += 1
                yield element

    def _stream_rest(self, partition: Partition, stored: int) -> Iterator[Any]:
        """The partition's elements after the ``stored`` cached ones, streamed and not stored (a full cache)."""
        schema = self._schema
        assert schema is not None
        path = self._path(schema)
        for j, element in enumerate(self.stream):
            if j < stored:
                continue  # a generic iterable cannot seek: its cached elements are read past
            self._streamed += 1
            yield path.convert(element, j)[1]

    def _fill(self, cache: Cache | None, partition: Partition) -> Iterator[Any]:
        """Stream the partition, yielding each element at once; a :class:`~._stream_fill.Filler` stores them."""
        filler = None if cache is None else self._filler(partition, cache)
        schema = self._schema
        stored = None if cache is None or schema is None else StoredCheck(cache, schema, partition.index, key=self.key)
        path: ElementPath | None = None
        count = 0
        unfit: TypeError | ValueError | None = None  # an element the fields inferred from a first one do not fit
        try:
            for element in self.stream:
                if filler is None:  # the first element, and no file yet: it is made while the stream goes on
                    plan = self._plan(element, count, partition)
                    schema = Schema(plan.fields, self.path)
                    filler = self._filler(partition, None, plan)
                assert schema is not None
                if path is None or path.schema is not schema:
                    path = self._path(schema)
                try:
                    converted = path.convert(element, count)
                except (TypeError, ValueError) as error:
                    if self.fields is not None:
                        raise
                    unfit = error
                    break
                if stored is not None and count < len(stored):
                    stored.check(count, converted[0], converted[1])
                filler.add(count, converted[0])
                self._streamed += 1
                yield converted[1]
                count += 1
            else:
                if filler is None:  # an empty partition: it ends once somebody made the file
                    cache = self._opened(partition)
                    filler = None if cache is None else self._filler(partition, cache)
                if filler is not None:
                    filler.finish(count)
        finally:
            if filler is not None:
                filler.close()
        if unfit is not None:  # once what was yielded is stored: the file exists, if it could be made
            raise type(unfit)(f"{str(unfit).rstrip('.')}. {self._refute()}") from None

    def _filler(self, partition: Partition, cache: Cache | None, plan: StreamPlan | None = None) -> Filler:
        """The stores of a pass over ``partition``: into ``cache``, or into the file made from ``plan``."""
        return Filler(
            partition, cache, plan, key=self.key, path=self.path, open_file=self._opened, stored=self._count_stored
        )

    def _count_stored(self, count: int) -> None:
        self._written += count

    def _refute(self) -> str:
        """Mark the file, whose fields a stream element does not fit, refuted; remove it if nobody else has it open.

        What became of it, for the message: the next try replaces a refuted file (:func:`open_stream`).
        """
        cache, path = self._cache, self.path
        if cache is None or cache.closed:
            return f"If a cache was made at {path}, remove it (`mmapcache rm {path}`) before the next try."
        cache.refute()
        self.close()
        try:
            remove(path)
        except CacheInUseError:
            return (
                f"The cache at {path}, made with the first element's fields, is marked as not fitting the stream: "
                "the next try replaces it, even while the processes using it now still hold it (nothing to "
                "remove by hand)."
            )
        except FileNotFoundError:
            pass
        return f"The cache at {path}, made with the first element's fields, was removed: the next try starts afresh."

    def _plan(self, first: Any, index: int, partition: Partition) -> StreamPlan:
        fields = self._first_fields(first, index)
        leaves = self._path(Schema(fields, self.path)).leaves(first, index)
        value_bytes = sum(  # as the region places them
            place(np.asarray(leaf).nbytes)
            for leaf, field in zip(leaves, fields.values(), strict=True)
            if field.variable
        )
        try:
            length: int | None = len(self.stream)  # type: ignore[arg-type]
        except TypeError:
            length = None
        return plan_stream(
            fields,
            max_bytes=self.max_bytes,
            length=length,
            partitions=partition.ranks * partition.workers,
            value_bytes=value_bytes,
        )

    def _first_fields(self, sample: Any, index: int) -> dict[str, Field]:
        """The fields to create the file with: ``fields=`` in the element's order, or its own."""
        try:
            return first_fields(sample, index, self.fields, self.dtypes)
        except (TypeError, ValueError) as error:
            raise type(error)(as_element(str(error))) from None

    def _path(self, schema: Schema) -> ElementPath:
        """How this stream's elements become storage arrays and the values yielded (the fields of ``schema``)."""
        return ElementPath(schema, self.dtypes, declared=self.fields is not None)

    def loader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        sampler: Any = None,
        num_workers: int = 0,
        drop_last: bool = False,
        ragged: str = "pad",
        padding_value: float = 0,
        stateful: bool = False,
        **dataloader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A DataLoader of this stream's batches that reads each batch of a complete cache with one gather per field.

        Its batches have the structure, dtypes and values of ``DataLoader(stream,
        batch_size, collate_fn=ragged_collate(ragged, padding_value=...))``
        over the same epoch, in the same order: this rank's share of the
        epoch's permutation (see :meth:`set_epoch`), ``batch_size`` elements
        a batch, gathered field by field straight into the batch tensors in
        the main process (one copy, nothing in shared memory; workers are
        not started for an epoch of a complete cache: they would only hand
        the slots over). While the cache is not complete, the pass fills it
        as iterating the stream does (in the workers, each its partition),
        and its elements are collated. ``shuffle``: ``None``
        keeps the stream's ``shuffle``; ``True``/``False`` decide for this
        loader. ``ragged``/``padding_value`` batch the variable fields as
        ``CachedDataset.loader()`` does. ``drop_last`` drops each epoch's
        last, shorter batch. Other DataLoader arguments (``pin_memory``,
        ``persistent_workers``, ``prefetch_factor``,
        ``multiprocessing_context``, ...) pass through. ``sampler``,
        ``batch_sampler``, ``collate_fn`` and ``stateful=True`` are refused:
        the order is the stream's own.
        """
        from ._collate import as_is
        from ._ragged import check_ragged
        from ._stream_loader import StreamBatches, StreamLoader

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int for a stream's loader, not {batch_size!r}")
        if shuffle is not None and not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be None, True or False, not {shuffle!r}")
        refused = [name for name in ("batch_sampler", "collate_fn") if dataloader_kwargs.get(name) is not None]
        if sampler is not None or refused or stateful:
            what = "sampler" if sampler is not None else refused[0] if refused else "stateful=True"
            raise TypeError(
                f"a CachedStream's loader draws its own order (seed, set_epoch) and batches it: {what} is not "
                "supported; use DataLoader(stream, ...) for your own collate_fn"
            )
        if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
            raise TypeError(f"padding_value must be a number, not {type(padding_value).__name__}")
        batches = StreamBatches(
            self,
            batch_size,
            shuffle=shuffle,
            drop_last=bool(drop_last),
            ragged=check_ragged(ragged),
            padding_value=padding_value,
        )
        return StreamLoader(batches, batch_size=None, num_workers=num_workers, collate_fn=as_is, **dataloader_kwargs)

    # -- what it knows -------------------------------------------------------------------

    def __len__(self) -> int:
        """Elements this rank reads in an epoch of a complete cache; else ``len(stream)`` if it has one.

        Once this rank's partitions have ended while another rank's have not (its first epoch is
        over; the other rank is storing its last elements), ``len()`` waits for them to end (up
        to a minute, then warns and counts ``len(stream)``): DDP ranks that asked a moment apart
        would otherwise get different lengths for the next epoch, the number of steps they take,
        and wait on each other forever.
        """
        partition = self._partition()
        status = self._status(partition)
        if status is not None and not status.complete and partition.ranks > 1:
            status = self._others_ended(partition)
        if status is not None and status.cached:
            assert status.total is not None
            return per_rank(status.total, partition.ranks)
        try:
            return len(self.stream)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"len() of a CachedStream is known once its cache is complete (after a first epoch that reads the "
                f"whole stream), and {type(self.stream).__name__} has no len() of its own"
            ) from None

    def stats(self) -> dict[str, Any]:
        """Where the cache stands, and what this process read, streamed and stored.

        ``complete``: every partition was read to its end. ``full``: the
        stream did not fit the file; ``uncached`` elements (known once
        complete) are streamed every epoch. ``read``/``streamed``/``written``
        count this process's elements from the file, from the stream, and
        stored.
        """
        counts = {"read": self._read, "streamed": self._streamed, "written": self._written}
        status = self._status(self._partition())
        if status is None:
            return {"complete": False, "full": False, "stored": 0, "total": None, "uncached": None, **counts}
        uncached = None if status.total is None else status.total - status.stored
        return {**status.to_dict(), "uncached": uncached, **counts}

    @property
    def cache(self) -> Cache | None:
        """The :class:`~mmapcache.Cache` holding the stream (``None`` until some process made the file).

        The handle stays open in this process: while it does, a run with other
        ranks or workers cannot restart a fill that is not complete.
        """
        with self._lock:
            if self._cache is None or self._cache.closed:
                try:
                    self._adopt(Cache(self.path, key=self.key))
                except FileNotFoundError:
                    return None
            return self._cache

    def _others_ended(self, partition: Partition) -> StreamStatus | None:
        """The fill's status once the other ranks' partitions ended too, if this rank's have (see ``__len__``)."""
        deadline = time.monotonic() + _LEN_WAIT
        while True:
            status, mine_ended = self._progress(partition)
            if status is None or status.complete or not mine_ended:
                return status
            if time.monotonic() > deadline:
                log.warning(
                    "%s: this rank's part of the stream ended %.0f s ago and another rank's has not: len() is "
                    "len(stream) until it does, and ranks that see the cache complete meanwhile count another "
                    "length (is a rank of this run stopped?)",
                    self.path,
                    _LEN_WAIT,
                )
                return status
            time.sleep(0.02)

    def _status(self, partition: Partition) -> StreamStatus | None:
        """The fill's status, without keeping an incomplete cache open (that would keep a restart from happening)."""
        return self._progress(partition)[0]

    def _progress(self, partition: Partition) -> tuple[StreamStatus | None, bool]:
        """:meth:`_status`, and whether this rank's partitions of the fill ended."""
        if self._cache is not None and not self._cache.closed:
            cache = self._cache
            return stream_status(cache), rank_ended(cache, partition.rank, partition.ranks)
        try:
            opened = Cache(self.path, key=self.key, readonly=True)
        except FileNotFoundError:
            return None, False
        with opened:
            return stream_status(opened), rank_ended(opened, partition.rank, partition.ranks)

    def close(self) -> None:
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None

    def __repr__(self) -> str:
        source = self._source  # not self.stream: a repr never unpickles the stream
        kind = source.kind if isinstance(source, _Pickled) else type(source).__name__
        return f"CachedStream({kind}, path={str(self.path)!r}, key={self.key!r})"


class _Pickled:
    """An object pickled apart from what holds it: unpickled only when :meth:`load` is called."""

    __slots__ = ("data", "kind")

    def __init__(self, data: bytes, kind: str) -> None:
        self.data, self.kind = data, kind  # kind: the object's type name, for what shows it unread

    def __setstate__(self, state: tuple[None, dict[str, Any]]) -> None:
        slots = state[1]
        self.data, self.kind = slots["data"], slots.get("kind", "a pickled stream")

    @classmethod
    def of(cls, value: Any) -> _Pickled:
        """``value`` pickled as processes being started pickle it (what is shared by descriptor stays shared)."""
        if isinstance(value, _Pickled):
            return value
        return cls(bytes(ForkingPickler.dumps(value)), type(value).__name__)

    def load(self) -> Any:
        return pickle.loads(self.data)
