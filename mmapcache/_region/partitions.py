"""The stream region of a version 8 file: the allocation counter, the partition table, the element table.

The mechanics of caching a stream (the rules are in ``_format/spec.py``, "Stream
region"); the policy — which partition a process reads, when to restart a
fill — is ``_streams/stream_cache.py``'s.

Why a stored element is counted exactly once
--------------------------------------------
A writer of partition ``p`` holds the kernel lock on ``p``'s record and
stores elements from ``j == stored`` on. It fills a *run* of fresh slots
with elements ``j .. k`` (one slot is a run of one), which name no partition
while they are filled (:meth:`StreamRegion.reserve`: a READY slot whose
partition is not one of the file's holds no element; its element record
says ``RESERVED + p``, the writer that reserved it), and then counts the
run: it writes ``pending = (last slot, k)``, the run's element records, then
``stored = k + 1``, then clears ``pending``; each word is one aligned 8-byte
store. Killed

* before the run's slots are READY, or before their records name ``p``:
  no slot of the run is counted (holes nobody serves), ``stored`` is still
  ``j``, and the next writer stores ``j`` elsewhere;
* after every record, before ``stored`` moved: the next writer to take the
  lock finds ``pending``, and the run's slots (the ``k - j + 1`` slots up to
  the pending one) READY with records ``(p, j) .. (p, k)``, and rolls
  forward to ``stored = k + 1``;
* with only some records written: that writer turns the run's records that
  name ``p`` back into holes reserved by ``p``, so that none is counted when
  ``stored`` later passes its element;
* after ``stored`` moved: ``k`` is below ``stored``, so nothing is done twice.

Holes are used again
--------------------
A run that was never counted leaves holes reserved by ``p``: records
``(RESERVED + p, HOLE)``, EMPTY or READY. Only the holder of ``p``'s lock
writes such records, and every record it writes on the way to or from one
(a run counted element first, then partition; a hole made partition first,
then element) is either counted or names no writer, so the holes a writer
finds when it takes the lock belong to nobody alive (a killed writer, or the slots a pass could not fill): it sets them
EMPTY and fills them again before it takes fresh slots
(:meth:`StreamRegion.reclaim`). No reader serves a hole, so emptying a READY
one is invisible. A file of a stream with ``len()`` has little room beyond
its elements: without this, one writer killed mid-batch would leave it full
for good.

The kernel drops the lock of a dead writer, so there is no stale lock: the
next run (or a second job behind it on the same partition) takes over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._file import SlotLocks
from .._format import ELEMENT_RECORD_SIZE, PARTITION_RECORD_SIZE, Layout
from .slots import EMPTY, READY
from .verify import Problem

__all__ = ["ENDED", "FULL", "HOLE", "RESERVED", "PartitionState", "StreamRegion", "read_region", "stream_problems"]

ENDED, FULL = 1, 2  # partition flags
HOLE = 0xFFFFFFFF  # the partition of a slot that holds no element (yet)
RESERVED = 1 << 63  # a hole's element RESERVED + p: reserved by a writer of p (below: no writer is named)
_BOOT_ID_SIZE = 16
_ALLOCATED = 16  # offset of `allocated` in the stream page

_PARTITION = np.dtype(
    [
        ("stored", "<u8"),
        ("pending_slot", "<u8"),
        ("pending_element", "<u8"),
        ("total", "<u8"),
        ("flags", "<u4"),
        ("zero", "V28"),
    ]
)
_ELEMENT = np.dtype([("element", "<u8"), ("partition", "<u4"), ("zero", "<u4")])
assert _PARTITION.itemsize == PARTITION_RECORD_SIZE
assert _ELEMENT.itemsize == ELEMENT_RECORD_SIZE


def read_region(fd: int, layout: Layout) -> tuple[int, np.ndarray[Any, Any]]:
    """``(allocated, partition table)`` of the file behind ``fd``, read with ``pread`` (no mapping)."""
    (allocated,) = np.frombuffer(os.pread(fd, 8, layout.stream_offset + _ALLOCATED), "<u8")
    table = np.frombuffer(os.pread(fd, layout.partitions * PARTITION_RECORD_SIZE, layout.partitions_offset), _PARTITION)
    return int(allocated), table


@dataclass(frozen=True)
class PartitionState:
    """One partition's record, as read."""

    stored: int
    total: int
    ended: bool
    full: bool


class StreamRegion:
    """Views of the stream region in a mapping, and the store-once protocol on it.

    Each column of the partition and element tables is a strided view of its
    own: indexing one costs a plain array access, which the per-element path
    of a fill does a few times.
    """

    __slots__ = (
        "_alloc_lock",
        "_records_offset",
        "allocated",
        "boot_id",
        "element",
        "flags",
        "locks",
        "partition",
        "pending_element",
        "pending_slot",
        "states",
        "stored",
        "total",
    )

    def __init__(
        self, buffer: Any, layout: Layout, capacity: int, states: np.ndarray[Any, Any], locks: SlotLocks
    ) -> None:
        self.boot_id = np.ndarray((_BOOT_ID_SIZE,), np.uint8, buffer=buffer, offset=layout.stream_offset)
        self.allocated = np.ndarray((1,), "<u8", buffer=buffer, offset=layout.stream_offset + _ALLOCATED)
        table = np.ndarray((layout.partitions,), _PARTITION, buffer=buffer, offset=layout.partitions_offset)
        self.stored = table["stored"]
        self.pending_slot = table["pending_slot"]
        self.pending_element = table["pending_element"]
        self.total = table["total"]
        self.flags = table["flags"]
        elements = np.ndarray((capacity,), _ELEMENT, buffer=buffer, offset=layout.elements_offset)
        self.element = elements["element"]
        self.partition = elements["partition"]
        self.states = states  # the slot table's state column
        self.locks = locks
        self._alloc_lock = layout.stream_offset + _ALLOCATED
        self._records_offset = layout.partitions_offset

    # -- reading -------------------------------------------------------------

    def state(self, p: int) -> PartitionState:
        flags = int(self.flags[p])
        return PartitionState(int(self.stored[p]), int(self.total[p]), bool(flags & ENDED), bool(flags & FULL))

    def complete(self) -> bool:
        """Every partition ended: the file holds what it will ever hold of the stream."""
        return bool(np.all(self.flags & ENDED))

    def full(self) -> bool:
        """Some partition had an element that did not fit."""
        return bool(np.any(self.flags & FULL))

    def counted(self) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The READY slots that hold a counted element, in canonical order (by partition, then element).

        A READY slot whose element is not below its partition's ``stored`` (a
        writer died between publishing and counting it, and nobody recovered
        the partition yet) is left out.
        """
        allocated = min(int(self.allocated[0]), len(self.element))
        slots = np.flatnonzero(self.states[:allocated] == READY)
        partition = self.partition[slots].astype(np.intp)
        element = self.element[slots]
        known = partition < len(self.stored)
        slots, partition, element = slots[known], partition[known], element[known]
        keep = element < self.stored[partition]
        slots, partition, element = slots[keep], partition[keep], element[keep]
        counted: np.ndarray[Any, np.dtype[np.intp]] = slots[np.lexsort((element, partition))]
        return counted

    def elements_of(self, p: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The slots of partition ``p``'s counted elements in element order: element ``j`` in the ``j``-th.

        Empty when they are not exactly elements ``0 .. stored - 1`` (a damaged region: ``verify`` says more).
        """
        counted = self.counted()
        mine: np.ndarray[Any, np.dtype[np.intp]] = counted[self.partition[counted] == p]
        return mine if np.array_equal(self.element[mine], np.arange(len(mine))) else mine[:0]

    # -- writing (the caller holds the partition's lock) ----------------------

    def lock_offset(self, p: int) -> int:
        return self._records_offset + p * PARTITION_RECORD_SIZE

    def try_lock(self, p: int) -> bool:
        """Take partition ``p``'s writer lock without waiting, and settle a dead writer's pending run."""
        if not self.locks.try_claim(self.lock_offset(p)):
            return False
        pending = int(self.pending_slot[p])
        if pending:
            self._settle(p, int(self.pending_element[p]), pending - 1)
            self.pending_slot[p] = 0
        return True

    def _settle(self, p: int, last: int, last_slot: int) -> None:
        """Roll forward the run of ``p`` that ends at element ``last`` in ``last_slot``, or make its records holes."""
        stored = int(self.stored[p])
        if last < stored:
            return  # counted before its writer died
        run = slice(last_slot - (last - stored), last_slot + 1)
        if run.start < 0 or last_slot >= len(self.element):
            return  # not a run this module wrote
        if (
            np.all(self.states[run] == READY)
            and np.all(self.partition[run] == p)
            and np.array_equal(self.element[run], np.arange(stored, last + 1))
        ):
            self.stored[p] = last + 1  # filled and recorded, then killed before it was counted
            return
        named = self.partition[run] == p
        self.partition[run][named] = HOLE  # first: (HOLE, j) names no writer, (p, RESERVED + p) is never counted
        self.element[run][named] = RESERVED + p  # holes p's next writer fills again (see reclaim)

    def unlock(self, p: int) -> None:
        self.locks.release(self.lock_offset(p))

    def allocate(self, count: int = 1) -> range:
        """Up to ``count`` slots of our own from the shared counter (empty when every slot is handed out)."""
        self.locks.claim_wait(self._alloc_lock)
        try:
            first = int(self.allocated[0])
            last = min(first + count, len(self.element))
            self.allocated[0] = max(first, last)
        finally:
            self.locks.release(self._alloc_lock)
        return range(first, last)

    def begin(self, p: int, element: int, slot: int) -> None:
        """Announce that ``slot`` is being filled with element ``element`` of partition ``p`` (a run of one)."""
        self.pending_element[p] = element
        self.pending_slot[p] = slot + 1
        self.element[slot] = element
        self.partition[slot] = p

    def commit(self, p: int, element: int) -> None:
        """Count element ``element`` (its slot is READY)."""
        self.stored[p] = element + 1
        self.pending_slot[p] = 0

    def reserve(self, slots: range, p: int) -> None:
        """Mark ``slots`` as holes reserved by ``p``'s writer: filled first, counted after (:meth:`count`).

        Partition ``HOLE`` first, then the element (see the module docstring).
        """
        self.partition[slots.start : slots.stop] = HOLE
        self.element[slots.start : slots.stop] = RESERVED + p

    def reclaim(self, p: int) -> list[range]:
        """The holes reserved by ``p`` below ``allocated``, set EMPTY to be filled again: runs of consecutive slots.

        The caller holds ``p``'s lock, so no live writer owns them (see the module docstring).
        """
        allocated = min(int(self.allocated[0]), len(self.element))
        holes = np.flatnonzero((self.partition[:allocated] == HOLE) & (self.element[:allocated] == RESERVED + p))
        if not len(holes):
            return []
        self.states[holes] = EMPTY
        breaks = np.flatnonzero(np.diff(holes) != 1) + 1
        return [range(int(run[0]), int(run[-1]) + 1) for run in np.split(holes, breaks)]

    def count(self, p: int, first: int, slots: range) -> None:
        """Count the READY reserved ``slots`` as elements ``first, first + 1, ...`` of ``p``: one run.

        In the order of the module docstring: pending (the run's last slot
        and element), the element records, ``stored``, pending cleared.
        """
        if not slots:
            return
        last = first + len(slots) - 1
        self.pending_element[p] = last
        self.pending_slot[p] = slots.stop  # the last slot, plus one
        self.element[slots.start : slots.stop] = np.arange(first, last + 1, dtype=np.uint64)
        self.partition[slots.start : slots.stop] = p
        self.stored[p] = last + 1
        self.pending_slot[p] = 0

    def set_full(self, p: int) -> None:
        """An element of ``p`` did not fit; nothing after it is stored (the pending slot, if any, stays a hole)."""
        self.pending_slot[p] = 0
        self.flags[p] |= FULL

    def end(self, p: int, total: int) -> None:
        self.total[p] = total
        self.flags[p] |= ENDED

    def reset(self, boot_id: bytes) -> None:
        """Forget the fill (for ``Cache.clear``, which empties every slot under the exclusive lock)."""
        self.allocated[0] = 0
        for column in (self.stored, self.pending_slot, self.pending_element, self.total, self.flags):
            column[:] = 0
        self.element[:] = 0
        self.partition[:] = 0
        self.boot_id[:] = np.frombuffer(boot_id, np.uint8)


def stream_problems(stream: StreamRegion) -> list[Problem]:
    """What :meth:`Cache.verify` finds wrong in a stream region (kind ``"stream"``; nothing here is fixed).

    Every counted element in exactly one READY slot, no READY slot past the
    slots handed out, partitions that exist, totals that agree with what is
    stored. A writer that died mid-run leaves nothing to report: its run is
    holes, or is settled by the next writer of the partition.
    """
    capacity, partitions = len(stream.element), len(stream.stored)
    allocated = int(stream.allocated[0])
    problems: list[Problem] = []
    if allocated > capacity:
        problems.append(Problem("stream", None, f"{allocated} slots are handed out, but the file has {capacity}"))
    ready = np.flatnonzero(stream.states == READY)
    for slot in ready[ready >= allocated][:5].tolist():
        message = f"slot {slot} is READY but was never handed out (only the first {allocated} were)"
        problems.append(Problem("stream", slot, message))
    ready = ready[ready < allocated]
    partition = stream.partition[ready].astype(np.int64)
    foreign = ready[(partition >= partitions) & (partition != HOLE)]
    for slot in foreign[:5].tolist():
        problems.append(Problem("stream", slot, f"slot {slot} names partition {int(stream.partition[slot])} of "
                                f"{partitions}"))  # fmt: skip
    known = partition < partitions
    ready, partition, element = ready[known], partition[known], stream.element[ready[known]].astype(np.int64)
    stored = stream.stored.astype(np.int64)
    counted = element < stored[partition]
    for p in range(partitions):
        mine = counted & (partition == p)
        problems += _partition_problems(stream, p, ready[mine], element[mine])
    return problems


def _partition_problems(
    stream: StreamRegion, p: int, slots: np.ndarray[Any, Any], elements: np.ndarray[Any, Any]
) -> list[Problem]:
    """Partition ``p``'s counted elements (in ``slots``) against its record."""
    state = stream.state(p)
    problems: list[Problem] = []
    seen = np.bincount(elements, minlength=state.stored) if state.stored else np.zeros(0, np.int64)
    twice, missing = np.flatnonzero(seen > 1), np.flatnonzero(seen == 0)
    for j in twice[:5].tolist():
        where = slots[elements == j].tolist()
        problems.append(Problem("stream", where[0], f"element {j} of partition {p} is in slots {where}"))
    if len(missing):
        problems.append(Problem("stream", None, f"partition {p} counts {state.stored} elements, but {len(missing)} of "
                                f"them are in no READY slot (the first: element {int(missing[0])})"))  # fmt: skip
    if state.ended and (state.total < state.stored or (not state.full and state.total != state.stored)):
        problems.append(Problem("stream", None, f"partition {p} ended with {state.total} elements, but "
                                f"{state.stored} are stored{' (not full)' if not state.full else ''}"))  # fmt: skip
    return problems
