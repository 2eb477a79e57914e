"""Checking slots against their checksums: verified reads, and ``Cache.verify``'s sweep.

Beside ``_region/slots.py`` (the protocol) so that ``Cache`` reads as the policy:
which reads are checked (``verify=True``, and every read on weakly ordered
CPUs), what a mismatch means (a miss, logged), and what ``fix=True`` may reset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format import checksum
from .slots import READY, WRITING, SlotTable

__all__ = ["Problem", "failed_rows", "intact", "intact_parts", "region_problems", "slot_problems"]


@dataclass(frozen=True)
class Problem:
    """One thing :meth:`Cache.verify` found wrong.

    ``kind`` is ``"header"``, ``"checksum"`` (a READY slot whose bytes do not
    match its checksum), ``"stuck"`` (WRITING, and its writer is gone),
    ``"state"`` (an invalid state byte), ``"variable"`` (a variable value
    described outside the variable region or with the wrong shape) or
    ``"overlap"`` (two slots' variable values share bytes) or ``"region"``
    (the variable region's allocation counter is behind the values that use
    it, so new values would overwrite them, or beyond the region; ``index``
    is ``None``) or ``"stream"`` (the cache of a stream whose counts and
    element records disagree: an element in two slots or in none, a READY
    slot never handed out, a partition that does not exist, a total below
    what is stored; never fixed: remove the file to fill it again).
    ``fixed`` says whether ``fix=True`` reset the slot to EMPTY (for
    ``"region"``: moved the counter past every value, within the region).
    """

    kind: str
    index: int | None
    message: str
    fixed: bool = False

    def __str__(self) -> str:
        if not self.fixed:
            return self.message
        return self.message + (" (fixed: counter moved)" if self.kind == "region" else " (fixed: slot reset to empty)")


def intact(slots: SlotTable, index: int, arrays: Iterable[np.ndarray[Any, Any]]) -> bool:
    """Whether one sample's arrays (in field order) match slot ``index``'s checksum."""
    return checksum(map(_byte_view, arrays)) == int(slots.checksums[index])


def intact_parts(slots: SlotTable, index: int, parts: Iterable[np.ndarray[Any, Any]]) -> bool:
    """Whether a slot's checksum parts (see ``Mapped.parts``) match its checksum."""
    return checksum(parts) == int(slots.checksums[index])


def failed_rows(
    slots: SlotTable, idx: np.ndarray[Any, Any], out: Sequence[np.ndarray[Any, Any]]
) -> np.ndarray[Any, Any]:
    """Rows of a gathered batch (one array per field, row ``k`` from slot ``idx[k]``) that fail their checksum."""
    count = len(idx)
    rows = [array.reshape(count, math.prod(array.shape[1:])).view(np.uint8) for array in out]
    sums = np.fromiter((checksum([r[row] for r in rows]) for row in range(count)), np.uint32, count)
    return np.flatnonzero(sums != slots.checksums[idx])


def slot_problems(
    slots: SlotTable,
    parts: Callable[[int], list[np.ndarray[Any, Any]] | None],
    *,
    fix: bool,
    ranges: Callable[[np.ndarray[Any, Any]], list[tuple[int, int, int]]] | None = None,
) -> list[Problem]:
    """Invalid states, abandoned writes, damaged and overlapping values; reset them when ``fix``.

    ``parts(i)`` gives slot ``i``'s checksum parts (``None``: a variable
    descriptor is impossible — out of the region, or of the wrong shape).
    ``ranges(ready)`` gives ``(start, end, slot)`` of every variable value of
    the READY slots, for the check that no two share bytes. Slots a live
    writer holds are never reported or reset: a WRITING slot is "stuck" only
    when no one holds its claim *and* it is still WRITING after the probe.
    """
    problems = []
    states = np.array(slots.states)  # a snapshot
    for i in np.flatnonzero(states > READY).tolist():
        problems.append(Problem("state", i, f"slot {i} has the invalid state byte {states[i]}"))
    for i in np.flatnonzero(states == WRITING).tolist():
        # Re-read the state after the lock probe: a live writer may have
        # published and let go since the snapshot (not stuck, just done).
        if not slots.writer_alive(i) and slots.states[i] == WRITING:
            problems.append(Problem("stuck", i, f"slot {i} was left half-written by a writer that died"))
    ready = np.flatnonzero(states == READY)
    for i in ready.tolist():
        found = parts(i)
        if found is None:
            message = f"slot {i} describes a variable value outside the variable region or of the wrong shape"
            problems.append(Problem("variable", i, message))
            continue
        crc = checksum(found)
        if crc != int(slots.checksums[i]):
            message = f"slot {i} does not match its checksum ({crc:#010x} != {int(slots.checksums[i]):#010x})"
            problems.append(Problem("checksum", i, message))
    if ranges is not None:
        problems += _overlaps(ranges(ready), {p.index for p in problems})
    if not fix:
        return problems
    return [
        Problem(
            p.kind,
            p.index,
            p.message,
            # A stuck slot may have been refilled since: reset it only if still WRITING.
            fixed=p.index is not None and slots.reset(p.index, expect=WRITING if p.kind == "stuck" else None),
        )
        for p in problems
    ]


def region_problems(size: int, claimed: int, used: int, end: int) -> list[Problem]:
    """What is wrong with a variable region whose counter says ``claimed`` of ``size`` bytes were handed out.

    ``used``: bytes READY values hold; ``end``: where the last of them ends.
    Space is only handed out by advancing the counter, so every value lies
    below it, and it never passes the region's end.
    """
    if claimed > size:
        message = (
            f"the variable region's allocation counter says {claimed} bytes were handed out, beyond the "
            f"region's {size} bytes"
        )
        return [Problem("region", None, message)]
    if used > claimed or end > claimed:
        message = (
            f"the variable region's allocation counter says {claimed} bytes were claimed, but READY values "
            f"use {used} bytes and reach byte {end}: new values would overwrite them"
        )
        return [Problem("region", None, message)]
    return []


def _overlaps(spans: list[tuple[int, int, int]], known: set[int | None]) -> list[Problem]:
    """Slots whose variable values share bytes with another's (space handed out twice)."""
    problems = []
    spans = sorted(span for span in spans if span[0] < span[1] and span[2] not in known)
    reach, owner = -1, -1
    for start, end, slot in spans:
        if start < reach and slot != owner:
            for i in (owner, slot):
                if i not in known:
                    known.add(i)
                    problems.append(
                        Problem("overlap", i, f"slot {i}'s variable value shares bytes with another slot's")
                    )
        if end > reach:
            reach, owner = end, slot
    return problems


def _byte_view(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
