"""The variable region: where values of variable-shape fields live, handed out in extents.

Many processes fill a cache in random order, so the region cannot be laid out
by slot. Instead every writer *claims an extent* — a run of ``extent_size``
bytes, about 1 MiB — by advancing one shared counter, the ``claimed`` word of
the allocation page, while holding the kernel record lock on that page's
first byte (``F_OFD_SETLKW``: a few microseconds, once per extent). It then
places values in its extent with no lock at all, each at a multiple of 16
bytes, and starts a new extent when the next value does not fit.

Why this is crash-safe, per record:

* A value larger than a sixteenth of an extent gets a run of exactly its size
  instead (its copy costs far more than the lock, and it would strand the
  tail of an extent), so the region's waste stays within a few percent.
* Near the end of the region a claim takes at most a sixteenth of what is
  left (:func:`grant`): a writer that stops storing keeps the unused end of
  its extent, and whole extents held by idle writers could exceed a budget's
  headroom while another writer is refused.
* A writer whose extent is the last one claimed continues it when it claims
  again: the next value starts in its unused end, so a writer alone (or
  mostly alone) leaves no tails.
* Space is handed out only by advancing ``claimed`` under the lock, so no two
  writers ever get the same bytes, and a writer killed mid-claim either
  advanced it (the extent is lost) or did not.
* A value is written, then the slot's descriptor and checksum, and only then
  is the slot published READY (the slot protocol in ``_region/slots.py``). A writer
  killed before that leaves the slot WRITING, which the next writer reclaims
  into space of its own; READY never points at bytes that were not written.
* After a crash (a disk cache, format version 5) the allocation page may
  have missed the disk while slots that use the region reached it: the check
  after the reboot (``_region/reboot.py``) moves ``claimed`` past the end of every value
  it keeps (:meth:`Heap.cover`), and ``Cache.verify`` reports a counter behind
  the values or beyond the region.
* What a dead writer had claimed but not filled is lost until the cache is
  cleared: at most one extent per writer that died. ``claimed`` minus the
  bytes of READY values is that loss plus what live writers hold in reserve
  (``mmapcache info`` shows both numbers).
* After ``fork`` a child must not write into its parent's extent: it forgets
  it and claims its own (see ``_region/handle.py``).

A value that finds no room is not stored; the writer that found so (holding
the lock already) adds one to the allocation page's ``refused`` word, so that
every process, and ``mmapcache info``, sees how many stores the budget turned
away (a sample refused in two epochs counts twice).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .._file import SlotLocks
from .._format import PAYLOAD_ALIGNMENT, Layout

__all__ = ["Heap", "VariableRegion", "grant", "place"]

log = logging.getLogger("mmapcache")

_Sizes = TypeVar("_Sizes", int, np.ndarray[Any, Any])

MiB = 2**20
REFUSED_OFFSET = 8  # the allocation page's second word: stores refused for lack of room


def grant(run: int, need: int, left: int) -> int:
    """How many of the ``left`` free bytes a claim of ``run`` (at least ``need``) takes: at most a sixteenth.

    A writer keeps the unused end of its extent until its next value; one that
    stops storing (its partition of the data is done) strands it. Far from the
    end an extent is a small part of what is left; near it, whole extents held
    by a few idle writers could exceed a budget's headroom while another
    writer is refused. Tapered, the reserve each writer holds shrinks with the
    free space, and every value that fits in the region is stored.
    """
    taper = left // 16 // need * need  # a whole number of values this size: no tail stranded by them
    return min(run, max(need, taper), left)


def place(nbytes: _Sizes) -> _Sizes:
    """``nbytes`` (an int, or an array of them) rounded up to the alignment of values in the region.

    The one rule for where values go: every value starts at a multiple of
    ``PAYLOAD_ALIGNMENT`` (16) bytes of the region.
    """
    return -(-nbytes // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


@dataclass(frozen=True)
class VariableRegion:
    """How full a cache's variable region is.

    ``size`` bytes in all; ``claimed`` handed out to writers in extents;
    ``used`` held by READY values. ``claimed - used`` is what writers hold in
    reserve, plus what writers that died or cleared slots left behind.
    ``refused``: stores turned away because the region had no room for a
    value, by every process since the file was created or cleared (a sample
    refused in two epochs counts twice; 0 in files of writers older than
    this counter). Grow the budget with :func:`mmapcache.resize`.
    """

    size: int
    claimed: int
    used: int
    refused: int = 0

    @property
    def free(self) -> int:
        return self.size - self.claimed

    def to_dict(self) -> dict[str, int]:
        return {
            "size": self.size,
            "claimed": self.claimed,
            "used": self.used,
            "free": self.free,
            "refused": self.refused,
        }


class Heap:
    """One handle's allocator in the variable region of a mapping."""

    __slots__ = (
        "_end",
        "_full_warned",
        "_lock_offset",
        "_locks",
        "_pos",
        "claimed",
        "extent",
        "refused",
        "region",
        "size",
    )

    def __init__(self, buffer: Any, layout: Layout, locks: SlotLocks) -> None:
        self.size, self.extent = layout.variable_size, layout.extent_size
        self.region: np.ndarray[Any, np.dtype[np.uint8]] = np.ndarray(
            (self.size,), np.uint8, buffer=buffer, offset=layout.variable_offset
        )
        self.claimed: np.ndarray[Any, np.dtype[np.uint64]] = np.ndarray(
            (1,), np.dtype("<u8"), buffer=buffer, offset=layout.allocator_offset
        )
        self.refused: np.ndarray[Any, np.dtype[np.uint64]] = np.ndarray(
            (1,), np.dtype("<u8"), buffer=buffer, offset=layout.allocator_offset + REFUSED_OFFSET
        )
        self._locks, self._lock_offset = locks, layout.allocator_offset
        self._pos = self._end = 0  # this process's current extent, [pos, end)
        self._full_warned = False

    def allocate(self, nbytes: int, *, tally: bool = True) -> int | None:
        """An offset of ``nbytes`` free bytes in the region for this writer, or ``None`` when it is full.

        The caller holds the handle's write lock (one allocator per handle).
        ``tally=False``: a refusal is not counted as a refused store (the
        caller asked for room for many values at once, and places them one by
        one after).
        """
        need = place(nbytes)
        if self._end - self._pos >= need:
            offset = self._pos
            self._pos += need
            return offset
        # A large value gets a run of its own, exactly its size: its copy costs far more than
        # the lock, and packing it into extents would strand their tails.
        return self._claim(need, extent=need <= self.extent // 16, tally=tally)

    def _claim(self, need: int, *, extent: bool, tally: bool) -> int | None:
        """Room for a value of ``need`` bytes from the shared counter, under the lock; ``None`` when full.

        ``extent``: claim an extent and place the value at its start; else a
        run of exactly the value's size. When nobody claimed since this
        writer's current extent was handed out, the claim continues it: the
        value starts in its unused end, which is not stranded. Near the end
        of the region an extent is tapered (:func:`grant`).
        """
        self._locks.claim_wait(self._lock_offset)
        try:
            start = int(self.claimed[0])
            tail = self._end - self._pos if start == self._end else 0
            left = self.size - start
            if tail + left < need:
                if tally:
                    self.refused[0] += 1  # under the lock: no update is lost
                return None
            offset = start - tail
            if extent:
                granted = grant(self.extent, need - tail, left)
                self._pos, self._end = offset + need, start + granted
            else:
                granted = need - tail
                if tail:  # the value used up the current extent
                    self._pos = self._end = offset + need
            self.claimed[0] = start + granted
            return offset
        finally:
            self._locks.release(self._lock_offset)

    def warn_full(self, path: Any) -> None:
        """Say once per process that the region is full (the samples stay misses)."""
        if not self._full_warned:
            self._full_warned = True
            log.warning(
                "the variable region of %s is full (%d bytes): further samples with variable-shape "
                "fields are not cached and are read from the dataset each time. Give it a larger max_bytes "
                "with `mmapcache resize %s --max-bytes SIZE` or mmapcache.resize(): what is cached stays",
                path,
                self.size,
                path,
            )

    def forget_extent(self) -> None:
        """After fork, in the child: the current extent is the parent's."""
        self._pos = self._end = 0

    def cover(self, end: int) -> bool:
        """Make ``claimed`` cover the first ``end`` bytes and stay within the region; whether it moved.

        For a counter that fell behind the values that use the region (its
        page missed the disk before a crash while the slots reached it): no
        new value may then be placed over a live one. A counter beyond the
        region is brought back to its end (the region stays full).
        """
        self._locks.claim_wait(self._lock_offset)
        try:
            claimed = int(self.claimed[0])
            wanted = min(max(claimed, place(end)), self.size)
            if wanted == claimed:
                return False
            self.claimed[0] = wanted
            return True
        finally:
            self._locks.release(self._lock_offset)

    def reset(self) -> None:
        """Everything was cleared (the caller holds the exclusive in-use lock): start from the beginning."""
        self.claimed[0] = 0
        self.refused[0] = 0
        self._pos = self._end = 0
