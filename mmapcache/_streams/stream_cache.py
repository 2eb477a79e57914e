"""Caching a stream: which file a run uses, how a partition is filled, how a finished cache is read.

The policy on top of the stream region (``_region/partitions.py`` holds the
mechanics, ``_format/spec.py`` the rules). No torch here: ``mmapcache.torch``'s
``CachedStream`` says which partition a process reads and converts samples.

A run is partitioned ``ranks * workers`` ways: each process reads partition
``rank * workers + worker`` of the stream, numbering its elements in the
order it reads them. Element ``j`` of a partition is stored once, by whoever
holds the partition's kernel lock when ``j`` is next to store; everybody else
reading that partition (a second job, the next run) just reads past it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CacheError, CacheInUseError, SchemaMismatchError, StaleCacheError
from .._field import Field
from .._file import Expected, NewFile, creation_info, current_boot_id, held_by, open_or_create, remove, variable_room
from .._format import (
    ALIGNMENT,
    ELEMENT_RECORD_SIZE,
    MAX_PARTITIONS,
    PAYLOAD_ALIGNMENT,
    Header,
    Layout,
    align,
    align_down,
    extent_size_for,
    parse_bytes,
    slot_nbytes,
)
from .._region import ENDED, FULL, PartitionState, StreamRegion, place, read_region
from ..cache import Cache, attach_opened, open_unrefuted, writer_of

__all__ = [
    "Partition",
    "PartitionWriter",
    "StreamPlan",
    "StreamStatus",
    "checked_records",
    "describe",
    "epoch_slots",
    "open_stream",
    "per_rank",
    "plan_stream",
    "read_stream_status",
    "region",
    "stream_status",
    "usable",
]

log = logging.getLogger("mmapcache")

_STREAM_VERSION = 8
_RESTART_SECONDS = 5.0  # how long processes of one new run may take to agree on restarting a fill


@dataclass(frozen=True)
class Partition:
    """The part of a stream one process reads: worker ``worker`` of ``workers`` in rank ``rank`` of ``ranks``."""

    rank: int = 0
    ranks: int = 1
    worker: int = 0
    workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.ranks and 0 <= self.worker < self.workers):
            raise ValueError(f"rank {self.rank} of {self.ranks}, worker {self.worker} of {self.workers}: out of range")
        if self.ranks * self.workers > MAX_PARTITIONS:
            raise ValueError(f"{self.ranks} ranks x {self.workers} workers: at most {MAX_PARTITIONS} partitions")

    @property
    def index(self) -> int:
        return self.rank * self.workers + self.worker

    @property
    def partitioning(self) -> tuple[int, int]:
        return self.ranks, self.workers


@dataclass(frozen=True)
class StreamPlan:
    """What a new stream cache holds: its fields, its slots and the bytes of its variable region."""

    fields: dict[str, Field]
    slots: int
    variable_size: int = 0


@dataclass(frozen=True)
class StreamStatus:
    """Where the fill of a stream cache stands (see :func:`stream_status`)."""

    partitioning: tuple[int, int]  # (ranks, workers) of the run that fills it
    complete: bool  # every partition was read to its end
    full: bool  # an element did not fit: the rest of its partition is streamed, uncached, every epoch
    stored: int  # elements in the file
    total: int | None  # elements in the stream, once complete
    partitions_ended: int
    slots_used: int  # slots handed out (stored elements plus holes left by writers that were killed)
    capacity: int

    @property
    def cached(self) -> bool:
        """Complete and nothing left out: every epoch reads only the file."""
        return self.complete and not self.full

    def to_dict(self) -> dict[str, Any]:
        return {
            "partitioning": list(self.partitioning),
            "complete": self.complete,
            "full": self.full,
            "stored": self.stored,
            "total": self.total,
            "partitions_ended": self.partitions_ended,
            "slots_used": self.slots_used,
            "capacity": self.capacity,
        }


def region(cache: Cache) -> StreamRegion:
    """The stream region of ``cache`` (a ``SchemaMismatchError`` when the file caches no stream)."""
    found = cache._live().stream  # the core's own view of the mapping
    if found is None:
        raise SchemaMismatchError(
            f"{cache.path} is a dataset cache, not the cache of a stream (format version 8): use another key or "
            "path for the stream, or remove the file (`mmapcache rm PATH`)",
            path=cache.path,
            differences={"stream": (True, False)},
        )
    return found


def stream_status(cache: Cache) -> StreamStatus:
    """How far the fill of the stream cached in ``cache`` got."""
    stream = region(cache)
    partitioning = cache._header.stream or (1, 1)
    return _status(partitioning, int(stream.allocated[0]), stream.stored, stream.total, stream.flags, cache.capacity)


def read_stream_status(fd: int, header: Header, layout: Layout) -> StreamStatus | None:
    """The status of the stream cached in the file behind ``fd``, read with ``pread`` (``None``: no stream)."""
    if not layout.stream_offset or header.stream is None:
        return None
    allocated, table = read_region(fd, layout)
    return _status(header.stream, allocated, table["stored"], table["total"], table["flags"], header.capacity)


def _status(
    partitioning: tuple[int, int],
    allocated: int,
    stored: np.ndarray[Any, Any],
    total: np.ndarray[Any, Any],
    flags: np.ndarray[Any, Any],
    capacity: int,
) -> StreamStatus:
    ended = (flags & ENDED) != 0
    complete = bool(ended.all())
    return StreamStatus(
        partitioning=partitioning,
        complete=complete,
        full=bool(np.any(flags & FULL)),
        stored=int(stored.sum()),
        total=int(total.sum()) if complete else None,
        partitions_ended=int(ended.sum()),
        slots_used=min(allocated, capacity),
        capacity=capacity,
    )


def describe(status: StreamStatus) -> str:
    """One line for people (``mmapcache info``)."""
    ranks, workers = status.partitioning
    split = f"{ranks} rank(s) x {workers} worker(s)"
    if status.cached:
        return f"complete: {status.stored} elements, every epoch reads the file (filled by {split})"
    if status.complete:
        uncached = (status.total or 0) - status.stored
        return (
            f"complete but full: {status.stored} elements stored, {uncached} streamed uncached every epoch "
            f"(partitioned as {split}; `mmapcache resize PATH --max-bytes SIZE` grows the file, and the next pass "
            "partitioned so stores the rest)"
        )
    partitions = ranks * workers
    return (
        f"filling: {status.stored} elements stored, {status.partitions_ended} of {partitions} partitions ended "
        f"({split}){', full' if status.full else ''}"
    )


# -- planning and opening ---------------------------------------------------------


def plan_stream(
    fields: dict[str, Field],
    *,
    max_bytes: int | str | None,
    length: int | None,
    partitions: int,
    value_bytes: int = 0,
) -> StreamPlan:
    """Slots and variable region for a new stream cache.

    ``length`` is the stream's length when it tells (``len(stream)``), else
    ``None``; ``value_bytes`` the bytes of an element's variable values as
    measured (the first element's, each placed as the variable region
    places it: a file is made while its first element streams). With a
    length, the file has a slot for every element plus a little room for
    the holes killed writers leave; ``max_bytes`` caps it. Without one,
    ``max_bytes`` decides. The variable region gets what the budget leaves;
    without a budget, the one sizing policy of files with variable fields
    (:func:`mmapcache._file.variable_room`: headroom over the measured
    values per element, plus room for extents).
    """
    per_slot = slot_nbytes(fields, _STREAM_VERSION) + ELEMENT_RECORD_SIZE
    variable = [name for name, field in fields.items() if field.variable]
    budget = None if max_bytes is None else parse_bytes(max_bytes, name="max_bytes")
    value = max(PAYLOAD_ALIGNMENT, place(value_bytes)) if variable else 0
    if budget is None and length is None:
        raise ValueError(
            "the stream has no len(), so the cache needs a byte budget to preallocate its file: pass max_bytes= "
            '(e.g. max_bytes="8GiB"); elements beyond it are streamed uncached every epoch'
        )
    # Room for holes: the unused slots of each pass's last extent, a few killed writers.
    wanted = None if length is None else length + max(16, length // 100) + 16 * partitions
    if budget is None:
        assert wanted is not None
        return StreamPlan(fields, wanted, align(variable_room(wanted, value)) if variable else 0)
    if not variable:
        slots = budget // per_slot if wanted is None else min(wanted, budget // per_slot)
        if slots == 0:
            raise ValueError(
                f"max_bytes={max_bytes!r} ({budget} bytes) is too small for one element ({per_slot} bytes)"
            )
        return StreamPlan(fields, slots, 0)
    # The budget covers the slots and the values: as many slots as elements like the first fit.
    slots = min(budget // (per_slot + value), (budget - ALIGNMENT) // per_slot)  # the region takes whole pages
    if wanted is not None:
        slots = min(slots, wanted)
    region_size = align_down(budget - slots * per_slot)
    if slots == 0 or region_size < ALIGNMENT:
        raise ValueError(
            f"max_bytes={max_bytes!r} ({budget} bytes) leaves no room for the values of the variable fields "
            f"{variable}: one element takes {per_slot} bytes of slot and about {value} of values"
        )
    return StreamPlan(fields, slots, region_size)


def open_stream(
    path: Path,
    *,
    key: str,
    fields: dict[str, Field] | None,
    partition: Partition,
    plan: Callable[[], StreamPlan] | None,
    timeout: float = 60.0,
) -> Cache | None:
    """Open the stream cache at ``path`` for a run partitioned like ``partition``, creating it from ``plan()``.

    A file that is not complete and was filled by a run of another
    partitioning, or before the last reboot, cannot be continued: when
    nobody else has it open it is removed and created again, else
    :class:`CacheInUseError` says who holds it. A file refuted by a first
    try (fields inferred from an element the stream does not fit) is replaced
    (:func:`~mmapcache.cache.open_unrefuted`). ``None`` when the file is
    missing and ``plan`` is ``None`` (nothing to create it from yet).
    """
    deadline = time.monotonic() + _RESTART_SECONDS
    while True:
        opened = open_unrefuted(path, lambda: Cache(path, fields=fields, key=key, timeout=timeout), timeout=timeout)
        if opened is None:  # missing, or refuted by a first try (then removed)
            if plan is None:
                return None
            opened = _create(path, key, partition, plan(), timeout)
        cache = opened
        stale = _why_restart(cache, partition)
        if stale is None:
            return cache
        cache.close()
        if plan is None:
            return None  # a process with an element to infer the fields from restarts it
        try:
            remove(path)
            log.warning("restarting the fill of the stream cache %s: %s", path, stale)
        except FileNotFoundError:
            pass  # another process of this run removed it first
        except CacheInUseError as error:
            if time.monotonic() > deadline:
                raise CacheInUseError(
                    f"the stream cache {path} cannot be used by this run: {stale}; it would have to be filled again, "
                    f"but it is in use{held_by(error.pids)}. Wait for that job to end, or give this run another "
                    "key or path",
                    path=path,
                    pids=error.pids,
                ) from None
            time.sleep(random.uniform(0.01, 0.1))  # the other processes of this run are closing it too


def _create(path: Path, key: str, partition: Partition, plan: StreamPlan, timeout: float) -> Cache:
    new = NewFile(
        fields=plan.fields,
        length=plan.slots,
        capacity=plan.slots,
        key=key,
        created=creation_info(),
        variable_size=plan.variable_size,
        extent_size=extent_size_for(plan.variable_size) if plan.variable_size else 0,
        stream=partition.partitioning,
    )
    opened = open_or_create(path, Expected(None, None, key, ""), new, readonly=False, timeout=timeout)
    return attach_opened(path, opened, timeout=timeout)


def usable(cache: Cache, partition: Partition) -> bool:
    """Whether a run partitioned like ``partition`` may use ``cache`` as it is (else :func:`open_stream` decides)."""
    return _why_restart(cache, partition) is None


def _why_restart(cache: Cache, partition: Partition) -> str | None:
    """Why this run cannot continue the fill in ``cache`` (``None``: it can)."""
    stream = region(cache)
    if stream.complete() and not stream.full():
        return None  # every epoch reads the file, split across whatever partitioning
    recorded = cache._header.stream
    if recorded != partition.partitioning:
        state = "is full (the rest is streamed by its partitions)" if stream.complete() else "is not complete"
        return f"it {state} and was filled by {_describe(recorded)}, this run is {_describe(partition.partitioning)}"
    if not stream.complete() and bytes(stream.boot_id.tobytes()) != current_boot_id():
        return "its fill began before the machine rebooted (what reached the disk is not known)"
    return None


def _describe(partitioning: tuple[int, int] | None) -> str:
    ranks, workers = partitioning or (1, 1)
    return f"{ranks} rank(s) x {workers} worker(s)"


# -- filling ---------------------------------------------------------------------


class PartitionWriter:
    """One process's pass over its partition while the cache is not complete: :meth:`offer` every element.

    Or :meth:`offer_many` every batch of consecutive elements. The pass stores
    element ``j`` when it holds the partition's lock and ``j`` is the next
    element to store; it never waits for the lock (another process that holds
    it stores the same elements). :meth:`finish` marks the
    partition ended when this pass saw every element from the first stored
    by nobody else; :meth:`close` lets go of the lock (also on a break or an
    error). A process that dies lets go too: the kernel drops the lock.
    """

    def __init__(self, cache: Cache, partition: Partition) -> None:
        self.cache = cache
        self.stream = region(cache)
        self.p = partition.index
        if self.p >= len(self.stream.stored):
            raise ValueError(f"partition {self.p} is not in {cache.path} (it has {len(self.stream.stored)})")
        # Slots are taken from the shared counter a few at a time; those a pass does not use are holes.
        self.extent = max(1, min(16, cache.capacity // (64 * len(self.stream.stored))))
        self.slots: range = range(0)
        self.holes: list[range] = []  # the partition's holes, taken back when this pass took its lock
        self.held = False
        self.done = False  # nothing more to do for this pass: not ours, or ended, or we came too late
        self.stored = 0  # elements this pass stored

    def offer(self, j: int, sample: Mapping[str, Any]) -> bool:
        """Element ``j`` of the partition (0, 1, ... in stream order); True when this call stored it."""
        if self.done or not self._may_store(j):
            return False
        stream = self.stream
        if j != stream.stored[self.p] or stream.flags[self.p] & FULL:
            return False
        if not self.slots:
            self.slots = self._take(self.extent)
            stream.reserve(self.slots, self.p)  # the extent's unused slots stay holes this partition takes back
        if not self.slots:
            self._full()
            return False
        slot, self.slots = self.slots[0], self.slots[1:]
        stream.begin(self.p, j, slot)
        if not self.cache.put(slot, sample):  # only a full variable region refuses our own slot
            stream.set_full(self.p)
            return False
        stream.commit(self.p, j)
        self.stored += 1
        return True

    def offer_many(self, first: int, batch: Mapping[str, Any], count: int, *, checked: bool = False) -> int:
        """Elements ``first .. first + count - 1`` of the partition, as ``put_many`` takes them; how many it stored.

        ``checked``: the batch is in storage form already (see :meth:`~mmapcache._region.writer.Writer.put_run`).

        Those below the partition's ``stored`` are skipped (another pass has
        them); the rest go into runs of slots — the partition's holes first,
        then fresh slots taken in one step — each filled with one
        :meth:`~mmapcache._region.writer.Writer.put_run` and only then counted (see
        ``_region/partitions.py``): a pass killed in the middle leaves them holes,
        which the next pass fills again.
        """
        if self.done or not self._may_store(first):
            return 0
        stream, p = self.stream, self.p
        skip = int(stream.stored[p]) - first
        if skip < 0 or skip >= count or stream.flags[p] & FULL:
            return 0
        stored = 0
        while skip < count:
            slots = self._take(count - skip)
            if not slots:
                self._full()
                break
            stream.reserve(slots, p)
            whole = not skip and len(slots) == count
            rows = {name: values if whole else values[skip : skip + len(slots)] for name, values in batch.items()}
            # Fewer than len(slots) only when the variable region is full; none when the file system is.
            fit = writer_of(self.cache).put_run(slots.start, rows, len(slots), coerced=checked)
            stream.count(p, first + skip, slots[:fit])
            self.stored += fit
            stored += fit
            skip += fit
            if fit < len(slots):
                self._full()
                break
        return stored

    def _take(self, count: int) -> range:
        """Up to ``count`` consecutive slots: from the partition's holes, else fresh (empty: none is left)."""
        if self.holes:
            run = self.holes[0]
            taken, rest = run[:count], run[count:]
            if rest:
                self.holes[0] = rest
            else:
                self.holes.pop(0)
            return taken
        return self.stream.allocate(count)

    def _may_store(self, j: int) -> bool:
        """Whether this pass holds the lock of the partition, with element ``j`` not beyond what is stored."""
        if self.held:
            return True
        stream = self.stream
        if not stream.try_lock(self.p):
            return False
        self.held = True
        state = stream.state(self.p)
        if state.ended or (j > state.stored and not state.full):
            self._let_go()  # ended, or elements before j are missing: a later pass stores them
            return False
        if not state.full:
            self.holes = stream.reclaim(self.p)  # left by writers of the partition that were killed
        return True

    def _full(self) -> None:
        self.stream.set_full(self.p)
        log.warning("the stream cache %s is full: later elements are streamed uncached", self.cache.path)

    def finish(self, count: int) -> PartitionState:
        """The partition ended after ``count`` elements: mark it ended if this pass may; its state after."""
        stream = self.stream
        if not self.held and not self.done and stream.try_lock(self.p):
            self.held = True  # an empty partition, or one whose writer let go at the very end
        state = stream.state(self.p)
        try:
            if state.stored > count or (state.ended and state.total != count):
                had = state.total if state.ended else state.stored
                raise StaleCacheError(
                    f"partition {self.p} of the stream gave {count} elements, but the cache at {self.cache.path} "
                    f"holds {had} of it from an earlier pass: the stream is not deterministic, or it shards "
                    "itself differently than the ranks and workers it runs in. Use a new key for a changed stream",
                    path=self.cache.path,
                )
            if self.held and not state.ended and (state.stored == count or state.full):
                self.cache.sync()  # the slots reach the disk before the mark that makes them the whole partition
                stream.end(self.p, count)
                state = stream.state(self.p)
        finally:
            self.close()
        return state

    def close(self) -> None:
        self.done = True
        self._let_go()

    def _let_go(self) -> None:
        self.done = True
        if self.held:
            self.held = False
            self.stream.unlock(self.p)


# -- reading a complete cache -----------------------------------------------------


def epoch_slots(
    counted: np.ndarray[Any, Any],
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    rank: int = 0,
    ranks: int = 1,
    worker: int = 0,
    workers: int = 1,
) -> np.ndarray[Any, Any]:
    """The slots one worker of one rank reads in an epoch of a fully cached stream.

    A permutation of ``counted`` drawn from ``(seed, epoch)`` (the same in
    every process), padded by wrapping around to a multiple of ``ranks`` so
    that every rank reads as many (as ``DistributedSampler`` does), split
    across ranks and then across the rank's workers.
    """
    order = counted
    if shuffle:
        order = counted[np.random.default_rng([seed, epoch]).permutation(len(counted))]
    padded = per_rank(len(order), ranks) * ranks
    if padded > len(order):
        order = np.resize(order, padded)  # wraps around
    return order[rank::ranks][worker::workers]


def rank_ended(cache: Cache, rank: int, ranks: int) -> bool:
    """Whether every partition of ``rank`` (of a run of ``ranks``) was read to its end in ``cache``'s fill."""
    filled_by = cache._header.stream or (1, 1)
    if filled_by[0] != ranks or not 0 <= rank < ranks:
        return False  # filled by a run of another number of ranks: this rank had no partitions there
    workers = filled_by[1]
    flags = region(cache).flags[rank * workers : (rank + 1) * workers]
    return bool(((flags & ENDED) != 0).all())


def per_rank(count: int, ranks: int) -> int:
    """Elements each rank reads in an epoch of a fully cached stream of ``count`` elements."""
    return -(-count // ranks) if count else 0


def checked_records(cache: Cache) -> np.ndarray[Any, Any]:
    """The slots of a complete cache in canonical order; ``CacheError`` if they disagree with the counts."""
    stream = region(cache)
    counted = stream.counted()
    stored = int(stream.stored.sum())
    if len(counted) != stored:
        raise CacheError(
            f"the stream cache {cache.path} counts {stored} stored elements but {len(counted)} slots hold them: "
            "the file was damaged or written by something else; remove it (`mmapcache rm PATH`) to fill it again",
            path=cache.path,
        )
    return counted
