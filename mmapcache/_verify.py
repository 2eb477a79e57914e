"""Checking slots against their checksums: verified reads, and ``Cache.verify``'s sweep.

Beside ``_slots.py`` (the protocol) so that ``Cache`` reads as the policy:
which reads are checked (``verify=True``, and every read on weakly ordered
CPUs), what a mismatch means (a miss, logged), and what ``fix=True`` may reset.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checksum import checksum
from ._slots import READY, WRITING, SlotTable

__all__ = ["Problem", "failed_rows", "intact", "slot_problems"]


@dataclass(frozen=True)
class Problem:
    """One thing :meth:`Cache.verify` found wrong.

    ``kind`` is ``"header"``, ``"checksum"`` (a READY slot whose bytes do not
    match its checksum), ``"stuck"`` (WRITING, and its writer is gone) or
    ``"state"`` (an invalid state byte). ``fixed`` says whether ``fix=True``
    reset the slot to EMPTY.
    """

    kind: str
    index: int | None
    message: str
    fixed: bool = False

    def __str__(self) -> str:
        return self.message + (" (fixed: slot reset to empty)" if self.fixed else "")


def intact(slots: SlotTable, index: int, arrays: Iterable[np.ndarray[Any, Any]]) -> bool:
    """Whether one sample's arrays (in field order) match slot ``index``'s checksum."""
    return checksum(map(_byte_view, arrays)) == int(slots.checksums[index])


def failed_rows(
    slots: SlotTable, idx: np.ndarray[Any, Any], out: Sequence[np.ndarray[Any, Any]]
) -> np.ndarray[Any, Any]:
    """Rows of a gathered batch (one array per field, row ``k`` from slot ``idx[k]``) that fail their checksum."""
    count = len(idx)
    rows = [array.reshape(count, math.prod(array.shape[1:])).view(np.uint8) for array in out]
    sums = np.fromiter((checksum([r[row] for r in rows]) for row in range(count)), np.uint32, count)
    return np.flatnonzero(sums != slots.checksums[idx])


def slot_problems(slots: SlotTable, raws: Sequence[np.ndarray[Any, Any]], *, fix: bool) -> list[Problem]:
    """Invalid states, abandoned writes and checksum mismatches of every slot; reset them when ``fix``.

    ``raws`` are the fields' flat byte rows. Slots a live writer holds are
    never reported or reset: a WRITING slot is "stuck" only when no one holds
    its claim *and* it is still WRITING after the probe.
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
    for i in np.flatnonzero(states == READY).tolist():
        crc = checksum([raw[i] for raw in raws])
        if crc != int(slots.checksums[i]):
            message = f"slot {i} does not match its checksum ({crc:#010x} != {int(slots.checksums[i]):#010x})"
            problems.append(Problem("checksum", i, message))
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


def _byte_view(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
