"""Slot states and the write-once protocol: claim, copy, publish.

Each slot moves EMPTY -> WRITING -> READY, once. A writer

1. **claims** the slot: takes the kernel record lock on the slot's record
   (``F_OFD_SETLK``, non-blocking; see "Locks" below) and, holding it,
   re-reads the state; READY
   means someone else won, so it lets go and reports False. Otherwise it sets
   WRITING;
2. **copies** the sample into the data arrays and stores the checksum;
3. **publishes**: stores READY, then releases the lock.

A loader that wants one load per sample per node (``_region/flight.py``) **holds**
the slot first — the same lock, taken before the sample is loaded, with the
state left as it is — and fills it through the same three steps; the lock it
already holds makes step 1 succeed at once.

Two writers of one slot cannot interleave bytes: the second one's claim fails
while the first holds the lock, and sees READY after it. A writer killed at any
instant leaves the slot EMPTY or WRITING, never READY with torn bytes; the
kernel drops its lock, so the next claim succeeds on a WRITING slot and
rewrites it — no PID guessing, no manual repair. Everything READY stays READY.

Locks
-----
A slot's claim is an exclusive open-file-description record lock on its whole
record (``record_size`` bytes from the slot's state byte); the format's rule
is a lock on the state byte, which this covers, so the claims of every version
of mmapcache exclude each other. Whole records because the kernel keeps one
list of the record locks on a file and walks it at every lock call, any
process's: it merges the adjacent locks of one description into one entry, and
the records of consecutive slots are adjacent. So a holder of ``k``
consecutive slots costs the list one entry, taken and let go with one call
each (:meth:`SlotTable.hold_many`, :meth:`SlotTable.release_many`), where
``k`` one-byte locks cost ``k`` entries and made every other writer's lock
call ``k`` times longer. Scattered slots still cost an entry per run of
consecutive ones.

Memory ordering (the one place this argument is made)
-----------------------------------------------------
Readers take no lock: they load the state byte, and if it says READY, load
the data. That is correct when no process can observe READY before the data
stores that precede it, and the reader's data loads are not satisfied before
its state load.

* **x86-64 (and x86)** is TSO: stores become visible to other cores in program
  order, and loads are not reordered with other loads. Each step above is a
  separate C call (numpy copy, crc store, state store) that the compiler
  cannot reorder across, so program order is the order in the source. Nothing
  more is needed.
* **Weakly ordered CPUs (aarch64, POWER, RISC-V)** may make the READY store
  visible before the data, and may satisfy a reader's data loads early.
  Pure Python has no fence instruction to issue, so on these machines a reader
  *verifies every read against the slot checksum* (``STRONGLY_ORDERED`` below
  turns on ``verify`` in :class:`~mmapcache.Cache`): a slot whose bytes or
  checksum were not yet visible fails the comparison and is treated as a miss
  — the caller recomputes the sample — never returned as data. Writers need no
  such care: every claim and release is an ``fcntl`` system call, and the
  kernel's lock hand-off orders one writer's stores before the next writer's
  claim.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._file import SlotLocks
from .._format import Layout

__all__ = ["EMPTY", "READY", "STRONGLY_ORDERED", "WRITING", "SlotTable", "runs"]

EMPTY, WRITING, READY = 0, 1, 2

STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"}

_SPLITS = 64  # a run's lock refused: at most this many looks at what holds it, then slot by slot


def runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """The distinct ``indices`` as runs of consecutive ones, ``(first, last)``, in increasing order."""
    found: list[tuple[int, int]] = []
    first = last = -2
    for i in sorted(set(indices)):
        if i != last + 1:
            if last >= 0:
                found.append((first, last))
            first = i
        last = i
    if last >= 0:
        found.append((first, last))
    return found


class SlotTable:
    """Views of the slot table in a mapping, and the claim/publish protocol on it."""

    __slots__ = ("_record_size", "_table_offset", "checksums", "locks", "state_bytes", "states", "synced")

    def __init__(self, buffer: Any, layout: Layout, capacity: int, record_size: int, locks: SlotLocks) -> None:
        offset = layout.table_offset
        table = np.ndarray((capacity, record_size), np.uint8, buffer=buffer, offset=offset)
        self.states = table[:, 0]
        self.synced = table[:, 1]  # version 5: the slot's bytes are on stable storage (zero before)
        self.checksums = table[:, 4:8].view(np.dtype("<u4"))[:, 0]
        # Indexing a memoryview returns an int about twice as fast as a numpy scalar.
        self.state_bytes = memoryview(buffer)[offset : offset + capacity * record_size : record_size]
        self.locks = locks
        self._table_offset = offset
        self._record_size = record_size

    def close(self) -> None:
        """Drop the views of the mapping, so that it can be unmapped."""
        self.state_bytes.release()
        self.states = np.zeros(0, np.uint8)
        self.checksums = np.zeros(0, np.dtype("<u4"))
        self.synced = np.zeros(0, np.uint8)

    def lock_offset(self, index: int) -> int:
        """Where slot ``index``'s lock starts: its record (the lock covers the whole record)."""
        return self._table_offset + index * self._record_size

    def claim(self, index: int) -> bool:
        """Take slot ``index`` for writing; False if another writer holds it or it is READY."""
        if not self.hold(index):
            return False
        self.states[index] = WRITING
        self.synced[index] = 0  # before any byte of the new sample (see _region/reboot.py)
        return True

    def hold(self, index: int) -> bool:
        """Take slot ``index``'s lock before loading its sample; False if another holds it or it is READY.

        Unlike :meth:`claim` the state is left alone (EMPTY, or WRITING from a
        writer that died): letting go without a fill changes nothing.
        """
        offset, size = self.lock_offset(index), self._record_size
        if not self.locks.try_claim(offset, size):
            return False
        if self.states[index] == READY:
            self.locks.release(offset, size)
            return False
        return True

    def hold_many(self, indices: Iterable[int]) -> list[int]:
        """:meth:`hold` of many slots, one lock call per run of consecutive ones; those now held, in order.

        A run another description holds part of is split around what holds
        it (the kernel names one such lock per look) and the rest is tried
        again, so two holders of overlapping batches cost a call per boundary,
        not per slot.
        """
        locks, size, base = self.locks, self._record_size, self._table_offset
        got: list[int] = []
        for first, last in runs(indices):
            if locks.try_claim(base + first * size, (last - first + 1) * size):
                got.extend(range(first, last + 1))
            elif first < last:
                got += self._split_run(first, last)
        states = self.state_bytes
        ready: list[int] = []
        free: list[int] = []
        for i in got:  # a loop, not comprehensions: one frame less on every load
            (ready if states[i] == READY else free).append(i)
        if ready:
            self.release_many(ready)
        return free

    def _split_run(self, first: int, last: int) -> list[int]:
        """The slots of ``first .. last`` (a run whose lock was refused) whose locks this call took."""
        locks, size, base = self.locks, self._record_size, self._table_offset
        got: list[int] = []
        todo, looks = [(first, last)], 0
        while todo:
            a, b = todo.pop()
            offset, length = base + a * size, (b - a + 1) * size
            if looks and locks.try_claim(offset, length):
                got.extend(range(a, b + 1))
                continue
            if a == b:
                continue
            looks += 1
            found = locks.conflict(offset, length) if looks <= _SPLITS else None
            if found is None:  # let go meanwhile, or held in many pieces: slot by slot
                got.extend(i for i in range(a, b + 1) if locks.try_claim(base + i * size, size))
                continue
            lo, hi = max(a, (found[0] - base) // size), min(b, (found[1] - base) // size)
            if hi < b:
                todo.append((hi + 1, b))
            if a < lo:
                todo.append((a, lo - 1))
        return sorted(got)

    def release_many(self, indices: Iterable[int]) -> None:
        """Let go of the locks of ``indices``, one call per run of consecutive ones."""
        locks, size, base = self.locks, self._record_size, self._table_offset
        for first, last in runs(indices):
            locks.release(base + first * size, (last - first + 1) * size)

    def mark_writing(self, index: int) -> bool:
        """Step 1 for a slot this description holds already: WRITING, unless it is READY (then False)."""
        if self.states[index] == READY:
            return False
        self.states[index] = WRITING
        self.synced[index] = 0  # before any byte of the new sample (see _region/reboot.py)
        return True

    def publish(self, index: int, checksum: int) -> None:
        """Record the checksum, then mark READY (see the ordering argument above)."""
        self.checksums[index] = checksum
        self.states[index] = READY

    def release(self, index: int) -> None:
        self.locks.release(self.lock_offset(index), self._record_size)

    def ready_mask(
        self, indices: np.ndarray[Any, np.dtype[np.intp]], capacity: int, length: int
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """READY-ness of validated ``indices`` (indices >= capacity are never READY)."""
        # Fancy indexing, not np.take: ``states`` is a strided view (one byte every
        # record_size), and np.take first copies a non-contiguous source whole —
        # O(capacity) per call, 0.3 ms at 1 M slots (benchmarks/bench_protocol.py).
        if capacity == length:
            ready: np.ndarray[Any, np.dtype[np.bool_]] = self.states[indices] == READY
            return ready
        mask = np.zeros(indices.shape, dtype=bool)
        cacheable = indices < capacity
        mask[cacheable] = self.states[indices[cacheable]] == READY
        return mask

    def count_ready(self) -> int:
        return int(np.count_nonzero(self.states == READY))

    def writer_alive(self, index: int) -> bool:
        """Whether another open description holds slot ``index``'s claim (a live writer)."""
        return self.locks.held_elsewhere(self.lock_offset(index), self._record_size)

    def reset(self, index: int, expect: int | None = None) -> bool:
        """Mark a slot EMPTY under its claim; False if a live writer holds it.

        With ``expect``, only if the slot is still in that state: holding the
        claim, nobody else can change it, so a slot another writer reclaimed
        and published meanwhile is left alone.
        """
        offset, size = self.lock_offset(index), self._record_size
        if not self.locks.try_claim(offset, size):
            return False
        try:
            if expect is not None and self.states[index] != expect:
                return False
            self.states[index] = EMPTY
            self.checksums[index] = 0
            self.synced[index] = 0
        finally:
            self.locks.release(offset, size)
        return True
