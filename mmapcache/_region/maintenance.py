"""Maintenance of an open file: ``Cache.clear``, ``Cache.sync`` and ``Cache.verify``'s bodies.

Each takes the handle's write lock, so that it never runs beside a fill of the
same handle; ``Cache`` checks first that the handle is open and may write.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from .._errors import CacheError, CacheInUseError
from .._file import current_boot_id, exclusive_use, held_by, read_header
from .._format import Header, indices_digest
from .handle import Handle
from .mapped import Mapped
from .partitions import stream_problems
from .reboot import sync_slots
from .slots import EMPTY
from .verify import Problem, region_problems, slot_problems

__all__ = ["clear_cache", "sync_cache", "verify_cache"]


def clear_cache(path: Path, handle: Handle, mapped: Mapped, *, timeout: float) -> None:
    """Mark every slot empty, once no other handle has the file open (else :class:`CacheInUseError`)."""
    with handle.write_lock:
        handle.check_usable(writing=True)
        fd = handle.fd
        with exclusive_use(path, fd, holds_shared=True, timeout=timeout) as holders:
            if holders is None:
                mapped.slots.states[:] = EMPTY
                mapped.slots.checksums[:] = 0
                mapped.slots.synced[:] = 0
                if mapped.heap is not None:
                    mapped.heap.reset()
                if mapped.stream is not None:
                    mapped.stream.reset(current_boot_id())
                if mapped.boot is not None:
                    # On a disk, before anyone refills: a crash must not find the old
                    # synced READY records beside new bytes (a synced slot is never
                    # checked after a reboot).
                    os.fdatasync(fd)
                return
    pids = [p for p in holders if p != os.getpid()]
    # No other process holds it: another handle in this one does.
    raise CacheInUseError(
        f"cannot clear {path}: it is in use{held_by(pids or [os.getpid()], other_handles=True)}",
        path=path,
        pids=pids,
    )


def sync_cache(handle: Handle, mapped: Mapped) -> int:
    """``fdatasync`` the file and mark its filled slots synced: how many were marked (0 in memory)."""
    with handle.write_lock:
        handle.check_usable(writing=True)
        if mapped.boot is None:
            os.fdatasync(handle.fd)
            return 0
        return sync_slots(handle.fd, mapped.slots)


def verify_cache(path: Path, header: Header, handle: Handle, mapped: Mapped, *, fix: bool) -> list[Problem]:
    """The header's and every slot's problems; with ``fix``, bad slots reset to EMPTY."""
    with handle.write_lock:
        handle.check_usable(writing=fix)
        problems = _header_problems(path, header, mapped, handle.fd)
        ranges = mapped.value_ranges if mapped.variables else None
        problems += slot_problems(mapped.slots, mapped.parts, fix=fix, ranges=ranges)
        if mapped.heap is not None:
            used, end = mapped.region_use()
            found = region_problems(mapped.heap.size, int(mapped.heap.claimed[0]), used, end)
            problems += [replace(p, fixed=fix and mapped.heap.cover(end)) for p in found]
        if mapped.stream is not None:
            problems += stream_problems(mapped.stream)
        if fix and mapped.boot is not None and any(p.fixed for p in problems):
            # Reset slots may have been synced: their new state must be on the disk before
            # their bytes are written again (see clear()).
            os.fdatasync(handle.fd)
    return problems


def _header_problems(path: Path, opened: Header, mapped: Mapped, fd: int) -> list[Problem]:
    try:
        header, _ = read_header(fd, str(path))
    except CacheError as error:
        return [Problem("header", None, str(error))]
    if header != opened:
        return [Problem("header", None, f"the header of {path} changed after it was opened")]
    table = mapped.indices
    if table is not None and indices_digest(table) != header.indices_digest:
        return [Problem("header", None, f"the dataset index table of {path} does not match its digest")]
    return []
