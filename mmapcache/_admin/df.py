"""Disk usage where caches live — ``mmapcache du``/``df``: free space, what caches take, memory limits.

Everything here returns data and prints nothing; ``_admin/reports.py`` formats it.
:func:`disk_usage` adds up the caches and the leftovers of interrupted
creations in a directory, how much of each cache is in memory, and the
warnings that say what is wrong there and how to fix it (a small tmpfs, a
nearly full disk, a network file system, a memory cgroup limit).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._file import Budget, budget, filesystem_type, is_cache_name, is_network_filesystem, leftover_stem, memory_limit
from .._format import format_bytes
from .._region import resident_bytes
from .listing import directory_of, entries

__all__ = [
    "LOW_FREE_FRACTION",
    "SMALL_TMPFS",
    "DiskUsage",
    "Resident",
    "disk_usage",
    "disk_warnings",
    "memory_limit",
]


# A tmpfs smaller than this cannot hold a useful dataset cache (Docker gives 64 MB).
SMALL_TMPFS = 2**30


# Below this fraction of free space, say how to make room.
LOW_FREE_FRACTION = 0.10


@dataclass(frozen=True)
class Resident:
    """How much of one cache file is in memory (the page cache) now: ``resident`` of its ``nbytes``.

    On tmpfs every page of a file is in memory. On a disk, the kernel evicts
    pages when memory is needed and reads them back on use: a cache larger
    than RAM is partly resident, and reads of the rest go to the device.
    """

    path: Path
    nbytes: int
    resident: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "nbytes": self.nbytes, "resident": self.resident}


@dataclass(frozen=True)
class DiskUsage:
    """Space where caches live: the file system's size and free bytes, what caches take there.

    ``cache_bytes`` and ``leftover_bytes`` are allocated bytes (RAM, on
    tmpfs). ``memory_limit`` is this process's memory cgroup limit (``None``
    if unlimited or unknown); pages of a tmpfs file count against the cgroup
    that first touched them. ``warnings`` are sentences saying what is wrong
    and how to fix it; ``resident``, one :class:`Resident` per cache file.
    """

    directory: Path
    filesystem: str | None
    total: int
    free: int
    caches: int
    cache_bytes: int
    leftovers: int
    leftover_bytes: int
    memory_limit: int | None
    warnings: tuple[str, ...]
    resident: tuple[Resident, ...] = ()
    budget: Budget | None = None  # the directory's byte budget (not looked up for a recursive listing)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "filesystem": self.filesystem,
            "total": self.total,
            "free": self.free,
            "caches": self.caches,
            "cache_bytes": self.cache_bytes,
            "leftovers": self.leftovers,
            "leftover_bytes": self.leftover_bytes,
            "memory_limit": self.memory_limit,
            "warnings": list(self.warnings),
            "resident": [item.to_dict() for item in self.resident],
            "budget": None if self.budget is None else self.budget.to_dict(),
        }


def disk_usage(directory: str | os.PathLike[str] | None = None, *, recursive: bool = False) -> DiskUsage:
    """Free space where caches live, what caches take there, and warnings with their fixes.

    Warns when the location is a small tmpfs (Docker's default /dev/shm is
    64 MB), nearly full, on a network file system, charged to a memory cgroup
    limit, or holds leftovers of interrupted creations. ``resident`` says how
    much of each cache is in memory now (see :class:`Resident`), ``budget`` the
    directory's byte budget and what holds it (:func:`mmapcache.budget`).
    """
    base = directory_of(directory)
    st = os.statvfs(base)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    caches = cache_bytes = leftovers = leftover_bytes = 0
    resident: list[Resident] = []
    for entry in entries(base, recursive=recursive):
        with contextlib.suppress(OSError):
            allocated = entry.stat(follow_symlinks=False).st_blocks * 512
            if is_cache_name(entry.name):
                caches, cache_bytes = caches + 1, cache_bytes + allocated
                resident.append(Resident(Path(entry.path), entry.stat().st_size, resident_bytes(entry.path)))
            elif leftover_stem(Path(entry.path)) is not None:
                leftovers, leftover_bytes = leftovers + 1, leftover_bytes + allocated
    fs_type = filesystem_type(base)
    limit = memory_limit() if fs_type == "tmpfs" else None
    usage = DiskUsage(
        base,
        fs_type,
        total,
        free,
        caches,
        cache_bytes,
        leftovers,
        leftover_bytes,
        limit,
        (),
        tuple(resident),
        None if recursive else budget(base),
    )
    return replace(usage, warnings=tuple(disk_warnings(usage)))


def disk_warnings(usage: DiskUsage) -> list[str]:
    found = []
    where = str(usage.directory)
    in_shm = where == "/dev/shm" or where.startswith("/dev/shm/")
    if usage.filesystem == "tmpfs" and usage.total < SMALL_TMPFS:
        mount = "/dev/shm" if in_shm else f"the tmpfs holding {where}"
        docker = " (Docker's default is 64 MB)" if in_shm else ""
        found.append(
            f"{mount} is only {format_bytes(usage.total)}{docker}: too small for most dataset caches. "
            "Give the container a larger one (`docker run --shm-size=16g ...`, `shm_size: 16gb` in "
            "docker compose) or put caches on a local disk: `export MMAPCACHE_DIR=/path/to/local/nvme`"
        )
    if usage.total and usage.free < LOW_FREE_FRACTION * usage.total:
        found.append(
            f"{where} is nearly full ({format_bytes(usage.free)} free of {format_bytes(usage.total)}): "
            "remove unused caches (`mmapcache gc`, `mmapcache rm PATH`) or set MMAPCACHE_DIR to a larger disk"
        )
    if is_network_filesystem(usage.filesystem):
        found.append(
            f"{where} is on a {usage.filesystem} file system: locks and shared mappings are not coherent "
            "across machines there. Use /dev/shm or a local disk (MMAPCACHE_DIR)"
        )
    if usage.memory_limit is not None:
        found.append(
            f"files in {where} are RAM charged to the memory cgroup (limit {format_bytes(usage.memory_limit)} "
            "here): caches and the training processes share that limit, and exceeding it gets processes "
            "OOM-killed. Size caches to leave room (max_bytes=...), or use a local disk (MMAPCACHE_DIR)"
        )
    if usage.leftovers:
        found.append(
            f"{usage.leftovers} temporary file(s) ({format_bytes(usage.leftover_bytes)}) were left by cache "
            "creations that did not finish; `mmapcache gc` removes them"
        )
    return found
