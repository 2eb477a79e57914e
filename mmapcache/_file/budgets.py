"""A byte budget per cache directory: its setting, its default and its ledger (what admission reads).

The budget of a directory is, first found: ``MMAPCACHE_BUDGET`` (a size, for this process), the
size set in the directory (:func:`set_budget`, kept in ``.mmapcache-budget``), and on a tmpfs a
default (:func:`default_limit`): the smaller of the file system's size and half the memory cgroup's
limit. A directory on a disk with no budget set has none, and creating there admits everything.

The ledger has no counter to drift. It is derived, whenever it is needed, from

- the files themselves: the allocated blocks (``st_blocks``) of every file in the directory,
  each inode counted once (``used``);
- the reservations of live creators (``reserved``): a creator writes the bytes it is about to
  allocate into ``.mmapcache-reserve-<pid>-<hex>`` and holds an exclusive ``flock`` on it until its
  file has its name. The kernel drops the lock when the creator dies, so a reservation whose lock
  is free is dead: ignored, and deleted by the next admission. A live reservation counts only the
  bytes its temp file has not allocated yet, so no byte is counted twice.

Admission of every new file against the budget, and reclaim, are :mod:`.admission`'s; they run
under the directory's lock (:func:`directory_lock`), an exclusive ``flock`` on the directory itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import CacheError, CacheTimeoutError
from .._format import (
    format_bytes,
    parse_bytes,
    parse_duration,
)
from .create import creation_lock, remove_leftovers
from .names import (
    BUDGET_NAME,
    is_cache_name,
    is_reservation_name,
    new_reservation_name,
    side_stem,
    temp_stem,
)
from .paths import default_dir, filesystem_type, is_memory_filesystem, memory_limit
from .removal import in_use

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_CGROUP_FRACTION",
    "PAGE",
    "RECLAIM_GRACE",
    "Budget",
    "CacheShare",
    "budget",
    "default_limit",
    "directory_lock",
    "ledger_of",
    "limit_of",
    "release",
    "remove_dead_temps",
    "reserve",
    "set_budget",
    "settings_of",
]

log = logging.getLogger("mmapcache")

BUDGET_ENV = "MMAPCACHE_BUDGET"
# Without a budget set, a tmpfs directory's caches may take this fraction of the memory cgroup's
# limit (the rest is for the processes that share the limit), and never more than the tmpfs holds.
DEFAULT_CGROUP_FRACTION = 0.5
PAGE = 4096
# A cache opened this recently is never reclaimed, whatever the setting: its creator links it and
# only then opens it (takes the in-use lock), and must find it there.
RECLAIM_GRACE = 5.0


@dataclass(frozen=True)
class CacheShare:
    """One cache of a budgeted directory: its allocated ``bytes``, whether it is ``in_use``, when last opened."""

    path: Path
    bytes: int
    in_use: bool
    last_used: float  # seconds since the epoch: the file's mtime, which every open refreshes

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.bytes, "in_use": self.in_use, "last_used": self.last_used}


@dataclass(frozen=True)
class Budget:
    """The byte budget of a directory and what holds it.

    ``limit`` is ``None`` when the directory has no budget. ``used`` is what
    the files in the directory have allocated, ``reserved`` what live
    creators are about to allocate, ``free`` what is left for the next cache
    (``None`` without a limit). ``source`` says where the limit comes from;
    ``caches`` lists every cache file, least recently used first.
    """

    directory: Path
    limit: int | None
    used: int
    reserved: int
    free: int | None
    caches: tuple[CacheShare, ...]
    source: str
    reclaim_unused_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "limit": self.limit,
            "used": self.used,
            "reserved": self.reserved,
            "free": self.free,
            "source": self.source,
            "reclaim_unused_after": self.reclaim_unused_after,
            "caches": [share.to_dict() for share in self.caches],
        }

    def describe(self) -> str:
        """``the budget of DIR (1.0 GiB, set with `mmapcache budget`): 2 caches hold 800 MiB, ...``."""
        assert self.limit is not None
        holders = ", ".join(
            f"{share.path.name} {format_bytes(share.bytes)}{' (in use)' if share.in_use else ''}"
            for share in sorted(self.caches, key=lambda share: -share.bytes)
        )
        others = self.used - sum(share.bytes for share in self.caches)
        held = f"{len(self.caches)} cache(s) hold {format_bytes(self.used - others)}" + (
            f" ({holders})" if holders else ""
        )
        if others > 0:
            held += f", other files {format_bytes(others)}"
        if self.reserved:
            held += f", creators reserved {format_bytes(self.reserved)}"
        return f"the budget of {self.directory} ({format_bytes(self.limit)}, {self.source}): {held}"


def budget(directory: str | os.PathLike[str] | None = None) -> Budget:
    """The byte budget of ``directory`` (default: :func:`mmapcache.default_dir`) and what holds it."""
    base = _directory(directory)
    return ledger_of(base, settings_of(base), collect=False)


def set_budget(
    directory: str | os.PathLike[str] | None,
    max_bytes: int | str | None,
    reclaim_unused_after: float | str | None = None,
) -> Budget:
    """Set the byte budget of ``directory``, kept in the directory (``None``: remove it).

    ``max_bytes`` is an int or a size such as ``"8GiB"``. ``reclaim_unused_after``
    (seconds or a duration such as ``"7d"``) lets a new cache that does not fit
    remove caches that nobody has open and that were last opened longer ago than
    that, least recently used first; ``None`` never removes a cache. Caches
    already there are not touched: the budget applies to the next ones.
    ``MMAPCACHE_BUDGET`` overrides the size for the processes it is set in.
    """
    base = _directory(directory)
    limit = None if max_bytes is None else parse_bytes(max_bytes, name="max_bytes")
    after = _seconds(reclaim_unused_after)
    path = base / BUDGET_NAME
    with directory_lock(base, 60.0):
        if limit is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            staged = base / (BUDGET_NAME + ".new")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps({"max_bytes": limit, "reclaim_unused_after": after}).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(staged, path)
    log.info("set the budget of %s to %s", base, "none" if limit is None else format_bytes(limit))
    return budget(base)


def default_limit(directory: Path) -> int | None:
    """The budget of a directory with none set: on a tmpfs, the smaller of its size and part of the cgroup limit.

    Looked up at most every :data:`_DEFAULT_TTL` seconds per file system (reading the mount table and
    the cgroup's files costs milliseconds, and every admission asks).
    """
    device, now = os.stat(directory).st_dev, time.monotonic()
    known = _defaults.get(device)
    if known is not None and now - known[0] < _DEFAULT_TTL:
        return known[1]
    limit = _default_limit(directory)
    _defaults[device] = (now, limit)
    return limit


_DEFAULT_TTL = 5.0
_defaults: dict[int, tuple[float, int | None]] = {}


def _default_limit(directory: Path) -> int | None:
    if not is_memory_filesystem(filesystem_type(directory)):
        return None

    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    cgroup = memory_limit()
    return size if cgroup is None else min(size, int(cgroup * DEFAULT_CGROUP_FRACTION))


def remove_dead_temps(directory: Path) -> None:
    """Delete the temp files of creators that died (their cache's creation lock is free): bytes nobody will use."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    stems = {stem for name in names if (stem := temp_stem(name, directory)) is not None and is_cache_name(stem)}
    for stem in sorted(stems):
        try:
            with creation_lock(directory / stem, 0):  # a live creator holds it: its temp file stays
                remove_leftovers(directory / stem)
        except (CacheError, OSError):
            continue


# -- the ledger ------------------------------------------------------------------------


@dataclass
class _Reservation:
    fd: int
    path: Path


def reserve(directory: Path, target: Path, size: int) -> _Reservation:
    """Write a reservation of ``size`` bytes for ``target`` and hold its lock (under the directory lock)."""
    path = directory / new_reservation_name()
    try:
        before = os.stat(target, follow_symlinks=False).st_ino
    except FileNotFoundError:
        before = None
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {"bytes": size, "stem": side_stem(target), "name": target.name, "inode": before, "pid": os.getpid()}
        os.write(fd, json.dumps(record).encode() + b"\n")
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return _Reservation(fd, path)


def release(reservation: _Reservation, directory: Path) -> None:
    # Unlink first, unlock last: whoever finds the file unlocked finds it dead.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(reservation.path)
    os.close(reservation.fd)


@dataclass
class _Scan:
    used: int = 0
    blocks: dict[str, tuple[tuple[int, int], int]] = field(default_factory=dict)  # name -> (inode key, bytes)
    caches: list[CacheShare] = field(default_factory=list)
    reservations: list[Path] = field(default_factory=list)


def _scan(directory: Path, *, probe: bool) -> _Scan:
    scan, seen = _Scan(), set()
    with os.scandir(directory) as listing:
        for entry in listing:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            key, nbytes = (st.st_dev, st.st_ino), st.st_blocks * 512
            if key not in seen:
                seen.add(key)
                scan.used += nbytes
            scan.blocks[entry.name] = (key, nbytes)
            if is_reservation_name(entry.name):
                scan.reservations.append(Path(entry.path))
            elif is_cache_name(entry.name):
                used = _in_use(Path(entry.path)) if probe else False
                scan.caches.append(CacheShare(Path(entry.path), nbytes, used, st.st_mtime))
    scan.caches.sort(key=lambda share: share.last_used)
    return scan


def _in_use(path: Path) -> bool:
    try:
        return in_use(path)
    except OSError:
        return True  # cannot tell: never a candidate for removal


def ledger_of(
    directory: Path,
    settings: dict[str, Any],
    *,
    collect: bool,
    probe: bool = True,
    limit: tuple[int | None, str] | None = None,
) -> Budget:
    """The budget's ledger, read from the files.

    ``collect``: delete dead reservations (under the directory lock); ``probe``: ask whether each cache
    is in use (else every ``in_use`` is ``False``: admission asks only when it may reclaim).
    """
    limit_bytes, source = limit if limit is not None else limit_of(directory, settings)
    scan = _scan(directory, probe=probe)
    reserved = sum(_outstanding(path, scan, directory, collect=collect) for path in scan.reservations)
    free = None if limit_bytes is None else max(0, limit_bytes - scan.used - reserved)
    after = settings.get("reclaim_unused_after")
    return Budget(
        directory,
        limit_bytes,
        scan.used,
        reserved,
        free,
        tuple(scan.caches),
        source,
        float(after) if isinstance(after, (int, float)) else None,
    )


def _outstanding(path: Path, scan: _Scan, directory: Path, *, collect: bool) -> int:
    """The bytes the live reservation ``path`` holds beyond what its file allocated so far (0: dead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise
            return _still_needed(os.pread(fd, 4096, 0), scan, directory)
        if collect:  # its creator died: the kernel let go of its lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            log.info("removed %s, the reservation of a creator that died", path)
        return 0
    finally:
        os.close(fd)


def _still_needed(data: bytes, scan: _Scan, directory: Path) -> int:
    try:
        record = json.loads(data)
        size, stem, name, inode = int(record["bytes"]), str(record["stem"]), str(record["name"]), record["inode"]
    except (ValueError, KeyError, TypeError):
        return 0  # being written: its creator holds the directory lock, and no reader looks then
    allocated, seen = 0, set()
    for each, (key, nbytes) in scan.blocks.items():
        mine = temp_stem(each, directory) == stem or (each == name and key[1] != inode)
        if mine and key not in seen:
            seen.add(key)
            allocated += nbytes
    return max(0, size - allocated)


def limit_of(directory: Path, settings: dict[str, Any]) -> tuple[int | None, str]:
    given = os.environ.get(BUDGET_ENV, "").strip()
    if given:
        return parse_bytes(given, name=BUDGET_ENV), f"from {BUDGET_ENV}"
    if isinstance(settings.get("max_bytes"), int):
        return int(settings["max_bytes"]), f"set in {directory / BUDGET_NAME}"
    default = default_limit(directory)
    if default is not None:
        return default, "the default of a tmpfs: its size or half the memory cgroup's limit, the smaller"
    return None, "none set"


def settings_of(directory: Path) -> dict[str, Any]:
    try:
        fd = os.open(directory / BUDGET_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        found = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        log.warning("cannot read the budget in %s; set it again with `mmapcache budget --set`", directory)
        return {}
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else {}


def _seconds(value: float | str | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"reclaim_unused_after must be seconds or a duration such as '7d', not {value!r}")
    return float(value)


def _directory(directory: str | os.PathLike[str] | None) -> Path:
    base = default_dir() if directory is None else Path(os.path.abspath(os.fspath(directory)))
    if not base.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"no such directory: {base}", str(base))
    return base


@contextmanager
def directory_lock(directory: Path, timeout: float) -> Iterator[None]:
    """Hold the directory's admission lock: an exclusive ``flock`` on the directory itself.

    The directory is the lock file that is never deleted while anything in it
    is: no side file to plant, to delete under a waiter, or to leave behind.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline, delay = time.monotonic() + timeout, 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise CacheTimeoutError(
                    f"waited {timeout:g} s for the budget lock of {directory} (another process is admitting a "
                    "new cache there); pass a larger timeout= if that process needs longer",
                    path=directory,
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        yield
    finally:
        os.close(fd)  # drops the lock
