"""Usage counters kept in the file: hits, misses and slots written, per process.

The region and its protocol are specified in ``_format/spec.py`` (format version
2, "Process counters"). In short: 256 records of four little-endian uint64
words ``[pid, hits, misses, written]``; a process owns record ``r >= 1`` while
it holds the kernel record lock on the record's first byte (dropped when the
process dies); record 0 collects the counts of owners that are gone.

So every process — DataLoader workers, DDP ranks, other jobs — counts into the
shared file, and anyone can read the totals and the live processes' counts
without asking them. An update is one unlocked read-modify-write of the
owner's own words (about 0.1 µs): two threads of one process counting at the
same instant may lose one update. The counts are for people, not for
correctness.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._file import SlotLocks
from .._format import COUNTER_RECORD_SIZE, Layout

__all__ = ["REFUTED", "Board", "Counts", "Usage", "read_flags", "read_usage"]

_PID, _HITS, _MISSES, _WRITTEN = range(4)
REFUTED = 1  # record 0's flags: the inferred fields were found not to fit the dataset (see _format/spec.py)
_FLAGS_SHIFT = 32  # record 0's flags are the upper half of its pid word
_WORDS = COUNTER_RECORD_SIZE // 8
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class Counts:
    """Samples served from the cache (``hits``), asked for but not cached (``misses``), slots filled."""

    hits: int = 0
    misses: int = 0
    written: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``, or ``None`` before any read."""
        reads = self.hits + self.misses
        return self.hits / reads if reads else None

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.hits + other.hits, self.misses + other.misses, self.written + other.written)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.hits - other.hits, self.misses - other.misses, self.written - other.written)

    def to_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "written": self.written, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class Usage:
    """How a cache has been used, from its counter records.

    ``total`` counts every process since the file was created (record 0 plus
    every record); ``processes`` maps the pid of each process that has the
    cache open *and counts into the file* to its counts; ``shared`` is False
    for a file without counters (format version 1). A process may have the
    cache open without counting into it: a readonly handle counts only in its
    own process, and a handle that found all 255 records taken counts in its
    own process until it closes, when its counts join the totals.
    """

    total: Counts = Counts()
    processes: dict[int, Counts] = field(default_factory=dict)
    shared: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total.to_dict(),
            "processes": {str(pid): counts.to_dict() for pid, counts in sorted(self.processes.items())},
            "shared": self.shared,
        }


def _records(buffer: Any, layout: Layout) -> np.ndarray[Any, np.dtype[np.uint64]]:
    shape = (layout.counter_records, _WORDS)
    records: np.ndarray[Any, np.dtype[np.uint64]] = np.ndarray(
        shape, np.dtype("<u8"), buffer=buffer, offset=layout.counters_offset
    )
    return records


def _counts(row: np.ndarray[Any, Any]) -> Counts:
    return Counts(int(row[_HITS]), int(row[_MISSES]), int(row[_WRITTEN]))


def read_flags(region: bytes | None, layout: Layout) -> int:
    """Record 0's flags in a counter region's bytes (0 for a file without counters)."""
    if region is None or not layout.counter_records:
        return 0
    return int.from_bytes(region[4:8], "little")  # the upper half of record 0's pid word


def read_usage(region: bytes | np.ndarray[Any, Any] | None, layout: Layout, locks: SlotLocks) -> Usage:
    """The usage recorded in a counter region (its bytes, or a view of it; ``None``: version 1).

    ``locks`` is on a descriptor of the file: a record counts as a live
    process's when another open file description holds its lock.
    """
    if region is None or not layout.counter_records:
        return Usage(shared=False)
    records = np.frombuffer(bytes(region), np.dtype("<u8")).reshape(layout.counter_records, _WORDS)
    total = Counts(*(int(n) for n in records[:, _HITS:].sum(axis=0, dtype=np.uint64)))
    processes: dict[int, Counts] = {}
    for r in range(1, layout.counter_records):
        pid = int(records[r, _PID])
        if pid and _owned(locks, layout, r):
            processes[pid] = processes.get(pid, Counts()) + _counts(records[r])
    return Usage(total, processes)


def _offset(layout: Layout, r: int) -> int:
    return layout.counters_offset + r * COUNTER_RECORD_SIZE


def _owned(locks: SlotLocks, layout: Layout, r: int) -> bool:
    return locks.fd >= 0 and locks.held_elsewhere(_offset(layout, r))


class Board:
    """This handle's counter record (or, without one, counts kept in the process)."""

    __slots__ = ("_layout", "_local", "_locks", "_mine", "_record", "_records", "_writable")

    def __init__(self, buffer: Any, layout: Layout, locks: SlotLocks, *, writable: bool) -> None:
        self._layout, self._locks, self._writable = layout, locks, writable
        self._records = _records(buffer, layout) if layout.counter_records else None
        self._local = np.zeros(_WORDS, np.uint64)
        self._mine: Any = self._local  # what add() writes to: our record's words, or _local
        self._record = 0
        if writable and self._records is not None:
            self._claim(buffer)

    def _claim(self, buffer: Any) -> None:
        assert self._records is not None
        for r in range(1, self._layout.counter_records):
            if self._locks.try_claim(_offset(self._layout, r)):
                self._retire(r)
                self._records[r, _PID] = os.getpid()
                self._record = r
                start = _offset(self._layout, r)
                if _LITTLE:  # a memoryview updates a word ~10x faster than numpy scalars
                    self._mine = memoryview(buffer)[start : start + COUNTER_RECORD_SIZE].cast("Q")
                else:  # pragma: no cover - no big-endian Linux machine to test on
                    self._mine = self._records[r]
                return

    def _retire(self, r: int) -> None:
        """Move record ``r``'s counts into record 0 (under record 0's lock) and zero it."""
        assert self._records is not None
        self._add_to_retired(self._records[r])

    def _add_to_retired(self, row: Any) -> None:
        """Move the counts of ``row`` (a record's words, or ours) into record 0, under its lock."""
        assert self._records is not None
        if row[_HITS:].any():
            zero = _offset(self._layout, 0)
            self._locks.claim_wait(zero)
            try:
                self._records[0, _HITS:] += row[_HITS:]
            finally:
                self._locks.release(zero)
            row[_HITS:] = 0

    def flags(self) -> int:
        """Record 0's flags: what processes found out about the whole file (0 for a file without counters)."""
        return 0 if self._records is None else int(self._records[0, _PID]) >> _FLAGS_SHIFT

    def set_flag(self, flag: int) -> None:
        """Set a flag in record 0, under its lock (a read-only mapping cannot: nothing happens)."""
        if self._records is None or not self._records.flags.writeable or self._locks.fd < 0:
            return
        zero = _offset(self._layout, 0)
        self._locks.claim_wait(zero)
        try:
            self._records[0, _PID] |= np.uint64(flag << _FLAGS_SHIFT)
        finally:
            self._locks.release(zero)

    @property
    def shared(self) -> bool:
        """Whether this handle counts into the file."""
        return self._record != 0

    def add(self, hits: int = 0, misses: int = 0, written: int = 0) -> None:
        mine = self._mine
        if hits:
            mine[_HITS] += hits
        if misses:
            mine[_MISSES] += misses
        if written:
            mine[_WRITTEN] += written

    def mine(self) -> Counts:
        mine = self._mine
        return Counts(int(mine[_HITS]), int(mine[_MISSES]), int(mine[_WRITTEN]))

    def usage(self) -> Usage:
        if self._records is None:
            return Usage(total=self.mine(), processes={os.getpid(): self.mine()}, shared=False)
        usage = read_usage(self._records, self._layout, self._locks)
        mine, pid = self.mine(), os.getpid()
        processes = dict(usage.processes)
        processes[pid] = processes.get(pid, Counts()) + mine  # our own lock does not show as "held elsewhere"
        # A handle without a record (readonly) counts only in this process.
        total = usage.total if self.shared else usage.total + mine
        return Usage(total, processes, usage.shared)

    def reset_after_fork(self, buffer: Any, *, claim: bool) -> None:
        """In a forked child: the parent's record stays the parent's; count from zero in one of our own.

        ``claim`` only through a descriptor of the child's own (else the claim
        would go through the parent's open file description, which holds the
        parent's record).
        """
        self._local = np.zeros(_WORDS, np.uint64)
        self._mine, self._record = self._local, 0
        self._writable = self._writable and claim  # never through the parent's description
        if claim and self._records is not None and buffer is not None and not self._readonly_buffer(buffer):
            self._claim(buffer)

    @staticmethod
    def _readonly_buffer(buffer: Any) -> bool:
        return bool(memoryview(buffer).readonly)

    def release(self) -> None:
        """On close: hand our counts to record 0, give the record up, and drop the mapping."""
        if self._record and self._locks.fd >= 0:
            self._retire(self._record)
            self._locks.release(_offset(self._layout, self._record))
        elif self._writable and self._records is not None and self._locks.fd >= 0:
            # Every record was taken when we opened: our counts join the totals now.
            self._add_to_retired(self._local)
        self._local = np.zeros(_WORDS, np.uint64)
        self._mine, self._record = self._local, 0
        self._records = None  # let go of the mapping: it is unmapped after its last user
