"""Surviving reboots: a cache on a disk never serves a slot that a crash may have torn.

Within one boot every process reads the same page cache, so a slot that is
READY in memory is complete in memory, whatever reached the disk. A kernel
crash or a power loss throws the page cache away, and the disk holds whatever
writeback had reached it — which need not follow program order: a slot's
record (state READY) can be on the disk while its data is not.

The file remembers enough to know when that may have happened (format version
5, spec in ``_format/spec.py``):

* the **boot page** holds the kernel's boot id
  (``/proc/sys/kernel/random/boot_id``, new at every boot) of the boot whose
  page cache the slots were last trusted in;
* each slot record has a **synced** byte: 1 once the slot's bytes are known to
  be on stable storage. A claim clears it; :func:`sync_slots` sets it after an
  ``fdatasync`` that started once the slot was READY.

Opening a file whose boot id is the running kernel's costs one 16-byte
comparison: no scan. Otherwise (the machine rebooted since), :func:`check_boot`
runs once, under the creation lock: it reads the state and synced bytes of
every slot (8 bytes a slot: 5 MB for 100 GB of 147 KB samples) and compares
every READY slot that is not synced with its checksum, reading its bytes
from the disk with read-ahead (``_cold``). Slots that differ are reset to
EMPTY and filled again like any miss; slots that match are marked synced (they
were just read back from the disk). The variable region's allocation counter
may have missed the disk while slots that use the region reached it: it is
moved past the end of every value kept, so that no new value is placed over
one. Then the running boot id is written. The
cost is the bytes written since the last :func:`sync_slots`, read at device speed:
nothing for a cache synced after its fill, the whole cache (100 GB: about
30 s at 3 GB/s) for one never synced.

A crash during the check leaves the old boot id: the next open checks again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._file import BootPage
from .readahead import Readahead
from .slots import READY, SlotTable
from .verify import intact_parts

__all__ = ["Checked", "check_boot", "sync_slots"]

log = logging.getLogger("mmapcache")

_CHUNK = 256  # slots checked between two read-ahead hints

Parts = Callable[[int], "list[np.ndarray[Any, Any]] | None"]


@dataclass(frozen=True)
class Checked:
    """What :func:`check_boot` did: READY slots it compared (``checked``), and those it reset (``torn``)."""

    checked: int
    torn: tuple[int, ...]


def check_boot(
    page: BootPage,
    slots: SlotTable,
    parts: Parts,
    *,
    lock: Callable[[], contextlib.AbstractContextManager[Any]],
    readahead: Readahead | None,
    reconcile: Callable[[], object] | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> Checked | None:
    """After a reboot, compare every READY slot not synced with its checksum; reset those that differ.

    ``None`` when the file's boot id is the running kernel's (no scan).
    ``lock`` excludes other checkers; the caller must have write access.
    ``reconcile`` runs once the slots are settled, before the boot id is
    written: it brings what the slots depend on (the variable region's
    allocation counter) in line with the slots that were kept.
    ``progress(done, total)`` is told how many suspect slots were compared,
    before each slot (the caller publishes it for processes waiting on the
    lock, and throttles it).
    """
    if page.current():
        return None
    with lock():
        if page.current():  # another process checked while we waited
            return None
        suspect = np.flatnonzero((np.asarray(slots.states) == READY) & (np.asarray(slots.synced) == 0))
        if len(suspect):
            log.warning(
                "%d slot(s) were filled and not synced before a reboot: comparing them with their checksums "
                "(reading them from the disk) before they are served; other processes wait for this",
                len(suspect),
            )
        torn = _compare(slots, parts, suspect, readahead, progress)
        if reconcile is not None:
            reconcile()
        page.record()
    if torn:
        log.warning(
            "%d slot(s) written before the last reboot did not reach the disk intact; they are not served "
            "and will be filled again: %s",
            len(torn),
            ", ".join(map(str, torn[:10])) + (", ..." if len(torn) > 10 else ""),
        )
    return Checked(len(suspect), tuple(torn))


def _compare(
    slots: SlotTable,
    parts: Parts,
    suspect: np.ndarray[Any, Any],
    readahead: Readahead | None,
    progress: Callable[[int, int], object] | None = None,
) -> list[int]:
    """Check ``suspect`` slots in chunks, the next chunk's reads queued before this one is hashed."""
    torn = []
    chunks = [suspect[k : k + _CHUNK] for k in range(0, len(suspect), _CHUNK)]
    done = 0
    for k, chunk in enumerate(chunks):
        if readahead is not None:
            if k == 0:
                readahead.hint(chunk)
            if k + 1 < len(chunks):
                readahead.hint(chunks[k + 1])
        for i in chunk.tolist():
            if progress is not None:
                progress(done, len(suspect))
            done += 1
            found = parts(i)
            if found is not None and intact_parts(slots, i, found):
                slots.synced[i] = 1  # just read back intact from the disk
            elif slots.reset(i, expect=READY):
                torn.append(i)
    return torn


def sync_slots(fd: int, slots: SlotTable) -> int:
    """``fdatasync`` the file, then mark synced every slot that was READY before it; how many were marked.

    A slot refilled meanwhile (reset, claimed, published again: another
    checksum) is left unsynced.
    """
    pending = np.flatnonzero((np.asarray(slots.states) == READY) & (np.asarray(slots.synced) == 0))
    sums = slots.checksums[pending].copy()
    os.fdatasync(fd)
    same = pending[(slots.states[pending] == READY) & (slots.checksums[pending] == sums)]
    slots.synced[same] = 1
    return len(same)
