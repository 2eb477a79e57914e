"""Operating caches: list, inspect, collect and size them — the library side of ``mmapcache`` (the CLI).

Everything here returns data and prints nothing; ``cli.py`` formats it.

Looking must not change anything. A cache file's modification time means
"last used": every :meth:`Cache.open` refreshes it, read-only users included
(reads through a mapping never touch it). So :func:`list_caches` and
:func:`info` never open a :class:`~mmapcache.Cache`: they open the file
read-only, validate the header with the same code ``Cache.open`` uses, count
READY slots from the slot table with ``pread``, and ask the in-use ``flock``
whether anyone has the file open (an exclusive non-blocking attempt, released
at once; then ``/proc/locks`` for the process ids).

:func:`gc` removes caches that nobody has open and nobody opened within an
age, through :func:`mmapcache.remove`, which takes the exclusive in-use lock:
a job that opens the cache at the same moment wins, and the removal is
skipped. It also removes the temporary files of creators that died half-way
(``<name>.tmp-*``, as large as the cache they were building), under the
creation lock that every creator holds while its temporary file exists, and
orphan lock files (``<name>.lock`` with no ``<name>`` beside it, left by a
creation that failed, e.g. with :class:`CacheSpaceError`): see
:func:`remove_orphan_lock` for why that is safe.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ._counters import REFUTED, Usage, read_flags, read_usage
from ._errors import CacheError, CacheFormatError, CacheInUseError, CacheTimeoutError, UnsafeCacheFileError
from ._file import _check_removable, _open_fd, creation_lock, read_header, remove
from ._format import COUNTER_RECORD_SIZE, Header, Layout, descriptor_nbytes
from ._heap import VariableRegion
from ._locks import SlotLocks, flock_holders, try_lock_exclusive
from ._names import CHECK_OWNER, CHECK_PREFIX, LOCK_SUFFIX, SUFFIX, is_cache_name, lock_path_for, temp_stem
from ._paths import (
    check_file_stat,
    default_dir,
    filesystem_type,
    free_bytes,
    is_network_filesystem,
)
from ._residency import resident_bytes
from ._sizes import format_bytes, parse_duration
from ._slots import READY, WRITING
from ._stream import StreamStatus, read_stream_status
from ._times import iso_time
from ._variable import value_bytes

__all__ = [
    "CacheInfo",
    "DiskUsage",
    "FieldInfo",
    "GcReport",
    "Kept",
    "Removed",
    "Resident",
    "disk_usage",
    "error_message",
    "gc",
    "info",
    "is_lock_name",
    "list_caches",
    "memory_limit",
    "orphan_lock",
    "remove_orphan_lock",
]

DEFAULT_GC_AGE = "7d"
# A tmpfs smaller than this cannot hold a useful dataset cache (Docker gives 64 MB).
SMALL_TMPFS = 2**30
# Below this fraction of free space, say how to make room.
LOW_FREE_FRACTION = 0.10
# Slot records read per pread when counting states (8 MiB at 8 bytes a record).
_CHUNK_RECORDS = 2**20
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 2**60


def error_message(error: BaseException) -> str:
    """The message of ``error`` without Python's ``[Errno 2]`` decoration, naming the file once."""
    if isinstance(error, OSError) and not isinstance(error, CacheError) and error.strerror:
        name = error.filename
        if name is None or os.fspath(name) in error.strerror:
            return error.strerror
        return f"{error.strerror}: {os.fspath(name)}"
    return str(error)


# -- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldInfo:
    """One field of a cache: ``nbytes`` is the size of one sample of it (``None``: variable, each its own)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    nbytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes}


@dataclass(frozen=True)
class CacheInfo:
    """What a cache file holds and who uses it, read without opening it as a cache.

    ``status`` is ``"ok"``, ``"corrupt"`` (not a cache this version reads:
    bad magic, version or checksum, truncated), ``"unsafe"`` (a symlink,
    another user's file, writable by others, not a regular file) or
    ``"unreadable"`` (the file could not be opened or read); ``error`` then
    says why, and the header fields are ``None``. ``nbytes`` is the file's
    size, ``last_used`` its modification time (every open refreshes it).
    ``pids`` lists the processes holding it open where ``/proc/locks`` tells.
    ``filled`` counts READY slots, ``writing`` slots being written now or
    abandoned by a writer that died (the next writer reclaims them).
    ``refuted``: a process found that the fields, inferred from a first
    sample, do not fit the dataset (see ``Cache.refute``).
    """

    path: Path
    status: str
    nbytes: int
    last_used: float
    in_use: bool
    pids: tuple[int, ...] = ()
    error: str | None = None
    version: int | None = None
    fields: tuple[FieldInfo, ...] = ()
    length: int | None = None
    capacity: int | None = None
    key: str | None = None
    created: dict[str, Any] = field(default_factory=dict, hash=False)
    filled: int | None = None
    writing: int | None = None
    filesystem: str | None = None
    free: int | None = None
    usage: Usage | None = None
    variable: VariableRegion | None = None
    indices_digest: str | None = None  # the digest of the dataset index table (a shard's cache), if any
    refuted: bool = False  # a process found the fields, inferred from a first sample, do not fit the dataset
    stream: StreamStatus | None = None  # version 8: how far the fill of a cached stream got

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def uncounted_pids(self) -> tuple[int, ...]:
        """Processes that have the cache open but count its use only in themselves (not in ``usage``).

        Readonly handles, and handles that found every usage record taken
        (their counts join the totals when they close). Known where
        ``/proc/locks`` tells who has the file open.
        """
        if self.usage is None or not self.usage.shared:
            return ()
        return tuple(pid for pid in self.pids if pid not in self.usage.processes)

    @property
    def fill(self) -> float | None:
        """``filled / capacity`` (1.0 for a cache of capacity 0), or ``None`` when unknown."""
        if self.filled is None or self.capacity is None:
            return None
        return self.filled / self.capacity if self.capacity else 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: paths as strings, ``last_used`` as ISO 8601 UTC (and as a timestamp)."""
        return {
            "path": str(self.path),
            "name": self.path.name,
            "status": self.status,
            "error": self.error,
            "nbytes": self.nbytes,
            "last_used": iso_time(self.last_used),
            "last_used_timestamp": self.last_used,
            "in_use": self.in_use,
            "pids": list(self.pids),
            "version": self.version,
            "fields": [f.to_dict() for f in self.fields],
            "length": self.length,
            "capacity": self.capacity,
            "key": self.key,
            "created": dict(self.created),
            "filled": self.filled,
            "writing": self.writing,
            "fill": self.fill,
            "filesystem": self.filesystem,
            "free": self.free,
            "usage": self.usage.to_dict() if self.usage is not None else None,
            "variable": self.variable.to_dict() if self.variable is not None else None,
            "indices_digest": self.indices_digest,
            "refuted": self.refuted,
            "uncounted_pids": list(self.uncounted_pids),
            "stream": self.stream.to_dict() if self.stream is not None else None,
        }


@dataclass(frozen=True)
class Removed:
    """A file :func:`gc` removed (or, in a dry run, would remove).

    ``kind`` is ``"cache"``, ``"corrupt"`` (a damaged cache file),
    ``"leftover"`` (the temporary file of a creator that died), ``"lock"``
    (the lock file of a cache that does not exist: its creation failed, or the
    cache was deleted without ``mmapcache rm``) or ``"check"`` (the private
    directory of a :func:`mmapcache.testing.check_concurrent_access` run that
    died, with everything in it).
    """

    path: Path
    kind: str
    nbytes: int
    last_used: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "nbytes": self.nbytes,
            "last_used": iso_time(self.last_used),
            "last_used_timestamp": self.last_used,
        }


@dataclass(frozen=True)
class Kept:
    """A file old enough for :func:`gc` that it left alone, and why (in use: ``pids`` hold it)."""

    path: Path
    reason: str
    last_used: float
    in_use: bool = False
    pids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "reason": self.reason,
            "last_used": iso_time(self.last_used),
            "last_used_timestamp": self.last_used,
            "in_use": self.in_use,
            "pids": list(self.pids),
        }


@dataclass(frozen=True)
class GcReport:
    """What one :func:`gc` run removed and which old files it kept; ``freed`` is in bytes."""

    directory: Path
    older_than: float
    dry_run: bool
    removed: tuple[Removed, ...]
    kept: tuple[Kept, ...]

    @property
    def freed(self) -> int:
        return sum(item.nbytes for item in self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "older_than_seconds": self.older_than,
            "dry_run": self.dry_run,
            "removed": [item.to_dict() for item in self.removed],
            "kept": [item.to_dict() for item in self.kept],
            "freed": self.freed,
        }


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
        }


# -- listing and reading --------------------------------------------------------------------


@dataclass(frozen=True)
class _Location:
    filesystem: str | None
    free: int | None

    @classmethod
    def of(cls, directory: Path) -> _Location:
        return cls(filesystem_type(directory), free_bytes(directory))


def _directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is None:
        return default_dir()
    path = Path(os.path.abspath(os.fspath(directory)))
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, f"no such directory: {path}", str(path))
        raise NotADirectoryError(errno.ENOTDIR, f"not a directory: {path}", str(path))
    return path


def _entries(directory: Path, *, recursive: bool) -> Iterator[os.DirEntry[str]]:
    """Non-directory entries of ``directory`` (and, if ``recursive``, of real subdirectories)."""
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if recursive:
                yield from _entries(Path(entry.path), recursive=True)
        else:
            yield entry


def _leftover_stem(path: Path) -> str | None:
    """The side-file stem of the cache whose creator made the temp file ``path``, if it is one."""
    stem = temp_stem(path.name, path.parent)
    return stem if stem is not None and is_cache_name(stem) else None


def _lock_stem(path: Path) -> str | None:
    """The side-file stem of the cache whose creation lock ``path`` is, if it is one (``<stem>.lock``)."""
    stem = path.name.removesuffix(LOCK_SUFFIX)
    if stem == path.name or not is_cache_name(stem) or lock_path_for(path.with_name(stem)) != path:
        return None
    return stem


def _locks_in_use(directory: Path) -> set[str]:
    """Names of the lock files that belong to a file present in ``directory`` (whatever its type)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    # A long cache name's side files use a shortened stem, so the lock's own
    # name does not tell which cache it guards: ask lock_path_for of each.
    return {lock_path_for(directory / name).name for name in names}


def list_caches(directory: str | os.PathLike[str] | None = None, *, recursive: bool = False) -> list[CacheInfo]:
    """Every ``*.mmc`` file in ``directory`` (default: :func:`mmapcache.default_dir`), sorted by path.

    Damaged or unreadable files are listed too, with ``status`` and ``error``
    saying what is wrong; one bad file never makes the listing fail. Side
    files (``*.lock``, ``*.tmp-*``) are not listed. ``recursive=True`` also
    looks in subdirectories (symlinked directories are not followed).
    """
    base = _directory(directory)
    location = _Location.of(base)
    found = []
    for entry in _entries(base, recursive=recursive):
        if is_cache_name(entry.name):
            result, error = _inspect(Path(entry.path), location)
            if not isinstance(error, FileNotFoundError):  # removed while we listed
                found.append(result)
    return found


def info(path: str | os.PathLike[str]) -> CacheInfo:
    """Everything the header of the cache at ``path`` says, its fill, who uses it, and space there.

    Opens the file read-only and does not change it (not even its
    modification time). Raises ``FileNotFoundError``,
    :class:`CacheFormatError` for a damaged file or
    :class:`UnsafeCacheFileError` for one mmapcache would refuse to open.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    result, error = _inspect(target, _Location.of(target.parent))
    if error is not None:
        raise error
    return result


def _inspect(path: Path, location: _Location) -> tuple[CacheInfo, Exception | None]:
    """A :class:`CacheInfo` for ``path``, and the error that kept the header from being read."""
    try:
        fd = _open_fd(path, readonly=True)
    except OSError as error:
        return _broken(path, location, error), error
    try:
        st = os.fstat(fd)
        try:
            check_file_stat(str(path), st)
        except UnsafeCacheFileError as error:
            return _broken(path, location, error, st=st), error
        in_use, pids = _usage(fd, st)
        try:
            header, layout = read_header(fd, str(path))
            filled, writing = _count_states(fd, header)
            usage, flags = _read_usage(fd, layout)
            variable = _read_variable_region(fd, header, layout)
            stream = read_stream_status(fd, header, layout)
        except (CacheError, OSError) as error:
            return _broken(path, location, error, st=st, in_use=in_use, pids=pids), error
    finally:
        os.close(fd)
    healthy = _healthy(path, location, st, header, in_use, pids, filled, writing)
    return replace(healthy, usage=usage, variable=variable, refuted=bool(flags & REFUTED), stream=stream), None


def _read_usage(fd: int, layout: Layout) -> tuple[Usage, int]:
    """The usage counters and the file's flags, read with pread; live owners found with a lock probe.

    No mapping, no writes.
    """
    if not layout.counter_records:
        return read_usage(None, layout, SlotLocks(fd)), 0
    region = os.pread(fd, layout.counter_records * COUNTER_RECORD_SIZE, layout.counters_offset)
    return read_usage(region, layout, SlotLocks(fd)), read_flags(region, layout)


def _usage(fd: int, st: os.stat_result) -> tuple[bool, tuple[int, ...]]:
    """Whether anyone holds the in-use lock, and who (where /proc/locks tells)."""
    if try_lock_exclusive(fd):
        # Nobody had it open; let go at once so that openers are not held up.
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, ()
    return True, tuple(flock_holders(st))


def _read_variable_region(fd: int, header: Header, layout: Layout) -> VariableRegion | None:
    """How full the variable region is, read with pread: the claimed counter, and READY values' bytes."""
    if not layout.variable_size:
        return None
    claimed, refused = np.frombuffer(os.pread(fd, 16, layout.allocator_offset), np.dtype("<u8")).tolist()
    table = os.pread(fd, header.capacity * header.record_size, header.header_size)
    ready = np.frombuffer(table, np.uint8)[:: header.record_size] == READY
    used = 0
    for name, spec in header.fields.items():
        if not spec.variable:
            continue
        size = descriptor_nbytes(spec)
        raw = np.frombuffer(os.pread(fd, header.capacity * size, layout.field_offsets[name]), np.uint8)
        dims = raw.reshape(header.capacity, size)[:, 8 : 8 + 4 * len(spec.shape)].copy().view("<u4")
        used += value_bytes(dims[ready], spec.dtype.itemsize)
    return VariableRegion(layout.variable_size, claimed, used, refused)


def _count_states(fd: int, header: Header) -> tuple[int, int]:
    """READY and WRITING slots, from the slot table read with pread (no mapping, no writes)."""
    ready = writing = 0
    record = header.record_size
    for start in range(0, header.capacity, _CHUNK_RECORDS):
        count = min(_CHUNK_RECORDS, header.capacity - start)
        data = os.pread(fd, count * record, header.header_size + start * record)
        states = np.frombuffer(data, np.uint8)[::record]
        ready += int(np.count_nonzero(states == READY))
        writing += int(np.count_nonzero(states == WRITING))
    return ready, writing


def _status(error: BaseException) -> str:
    if isinstance(error, CacheFormatError):
        return "corrupt"
    if isinstance(error, UnsafeCacheFileError):
        return "unsafe"
    return "unreadable"


def _broken(
    path: Path,
    location: _Location,
    error: BaseException,
    *,
    st: os.stat_result | None = None,
    in_use: bool = False,
    pids: tuple[int, ...] = (),
) -> CacheInfo:
    if st is None:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
    return CacheInfo(
        path=path,
        status=_status(error),
        nbytes=st.st_size if st is not None else 0,
        last_used=st.st_mtime if st is not None else 0.0,
        in_use=in_use,
        pids=pids,
        error=error_message(error),
        filesystem=location.filesystem,
        free=location.free,
    )


def _healthy(
    path: Path,
    location: _Location,
    st: os.stat_result,
    header: Header,
    in_use: bool,
    pids: tuple[int, ...],
    filled: int,
    writing: int,
) -> CacheInfo:
    return CacheInfo(
        path=path,
        status="ok",
        nbytes=st.st_size,
        last_used=st.st_mtime,
        in_use=in_use,
        pids=pids,
        version=header.version,
        fields=tuple(
            FieldInfo(name, f.shape, f.dtype_name, None if f.variable else f.nbytes)
            for name, f in header.fields.items()
        ),
        length=header.length,
        capacity=header.capacity,
        key=header.key,
        created=dict(header.created),
        filled=filled,
        writing=writing,
        filesystem=location.filesystem,
        free=location.free,
        indices_digest=header.indices_digest or None,
    )


# -- garbage collection ---------------------------------------------------------------------


def gc(
    directory: str | os.PathLike[str] | None = None,
    *,
    older_than: float | str = DEFAULT_GC_AGE,
    dry_run: bool = False,
    recursive: bool = False,
) -> GcReport:
    """Remove the caches in ``directory`` that nobody has open and nobody opened for ``older_than``.

    ``older_than`` is seconds or a duration such as ``"7d"``, ``"12h"``.
    "Opened" includes read-only use: every open refreshes the file's
    modification time. A cache in use is never touched, however old: it is
    reported in :attr:`GcReport.kept` with the process ids holding it. Damaged
    ``*.mmc`` files that start like a cache are removed by the same rule;
    files that are not mmapcache files are kept. Temporary files left by
    creators that died are removed once they are as old, and so are orphan
    lock files (a cache's ``.lock`` whose cache is gone; see
    :func:`remove_orphan_lock`). The private ``check-*`` directories of
    :mod:`mmapcache.testing` runs that were killed are removed whatever their
    age (a running check keeps a lock on them). ``dry_run=True`` reports what
    would go and removes nothing.
    """
    age = parse_duration(older_than) if isinstance(older_than, str) else float(older_than)
    if age < 0:
        raise ValueError(f"older_than must not be negative, got {older_than!r}")
    base = _directory(directory)
    cutoff = time.time() - age
    removed: list[Removed] = []
    kept: list[Kept] = []
    for item in list_caches(base, recursive=recursive):
        if item.last_used <= cutoff:
            _collect_cache(item, cutoff, dry_run, removed, kept)
    # Listed again: removing a cache above removed its side files too.
    abandoned: set[Path] = set()  # caches whose creator's leftover went: their lock goes too, whatever its age
    for path in _side_files(base, recursive=recursive):
        stem = _leftover_stem(path)
        if stem is not None and _collect_leftover(path, stem, cutoff, dry_run, removed, kept):
            abandoned.add(path.with_name(stem))
    # Lock files last, listed once more: collecting a leftover takes (so may make) its cache's lock file.
    guarded: dict[Path, set[str]] = {}
    for path in _side_files(base, recursive=recursive):
        stem = _lock_stem(path)
        if stem is None:
            continue
        if path.parent not in guarded:
            guarded[path.parent] = _locks_in_use(path.parent)
        if path.name not in guarded[path.parent]:
            limit = time.time() if path.with_name(stem) in abandoned else cutoff
            _collect_orphan_lock(path, limit, dry_run, removed, kept)
    _collect_checks(base, cutoff, dry_run, removed, kept)
    return GcReport(base, age, dry_run, tuple(removed), tuple(kept))


_UNOWNED_GRACE = 60.0  # seconds a check directory without an owner file is left alone (it may be starting)


def _collect_checks(base: Path, cutoff: float, dry_run: bool, removed: list[Removed], kept: list[Kept]) -> None:
    """Remove the private directories of ``mmapcache.testing`` checks that died (SIGKILL, a node reboot).

    A running check holds an exclusive ``flock`` on the directory's owner
    file; when that lock is free the check is gone, whatever the age. A
    directory whose files a process still holds (a worker that outlived its
    check) is kept and reported.
    """
    try:
        with os.scandir(base) as scan:
            names = sorted(entry.name for entry in scan if entry.name.startswith(CHECK_PREFIX))
    except OSError:
        return
    for name in names:
        path = base / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            fd: int | None = os.open(path / CHECK_OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None  # made by an older mmapcache, or a check starting now: only once old
            if st.st_mtime > min(cutoff, time.time() - _UNOWNED_GRACE):
                continue
        except OSError:
            continue
        try:
            if fd is not None and not try_lock_exclusive(fd):
                kept.append(Kept(path, "a running mmapcache.testing check uses it", st.st_mtime, in_use=True))
                continue
            held = _held_file(path)
            if held is not None:
                reason = f"a process of a check that died still has {held.name} open"
                kept.append(Kept(path, reason, st.st_mtime, in_use=True))
                continue
            nbytes = _tree_bytes(path)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)  # holding the owner's lock: no check runs in it
            removed.append(Removed(path, "check", nbytes, st.st_mtime))
        finally:
            if fd is not None:
                os.close(fd)


def _tree_files(directory: Path) -> Iterator[Path]:
    for root, _, files in os.walk(directory):
        for name in files:
            if name != CHECK_OWNER:
                yield Path(root) / name


def _held_file(directory: Path) -> Path | None:
    """A file under ``directory`` that some process holds a ``flock`` on (an open cache, a creation lock)."""
    for path in _tree_files(directory):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not try_lock_exclusive(fd):
                return path
        finally:
            os.close(fd)
    return None


def _tree_bytes(directory: Path) -> int:
    total = 0
    for path in _tree_files(directory):
        with contextlib.suppress(OSError):
            total += os.lstat(path).st_blocks * 512
    return total


def _collect_cache(item: CacheInfo, cutoff: float, dry_run: bool, removed: list[Removed], kept: list[Kept]) -> None:
    kind = "cache" if item.ok else "corrupt"
    if item.in_use:
        kept.append(Kept(item.path, "in use", item.last_used, in_use=True, pids=item.pids))
        return
    refusal = _not_removable(item)
    if refusal is not None:
        kept.append(Kept(item.path, refusal, item.last_used))
        return
    if dry_run:
        removed.append(Removed(item.path, kind, item.nbytes, item.last_used))
        return
    try:
        # Re-check the age right before removing: a job may have opened and
        # closed it since it was listed. (One that still has it open makes
        # remove() refuse: it takes the exclusive in-use lock.)
        if os.stat(item.path, follow_symlinks=False).st_mtime > cutoff:
            return
        remove(item.path, timeout=10.0)
    except FileNotFoundError:
        return
    except CacheInUseError as error:
        kept.append(Kept(item.path, "in use", item.last_used, in_use=True, pids=tuple(error.pids)))
        return
    except (CacheError, OSError) as error:
        kept.append(Kept(item.path, error_message(error), item.last_used))
        return
    removed.append(Removed(item.path, kind, item.nbytes, item.last_used))


def _not_removable(item: CacheInfo) -> str | None:
    """Why :func:`mmapcache.remove` would refuse a damaged file (it deletes only what looks like a cache)."""
    if item.ok:
        return None
    if item.status != "corrupt":
        return f"{item.status}: {item.error}"
    try:
        fd = _open_fd(item.path, readonly=True)
    except OSError as error:
        return error_message(error)
    try:
        _check_removable(fd, item.path, os.fstat(fd))
    except (CacheError, OSError) as error:
        return error_message(error)
    finally:
        os.close(fd)
    return None


def _side_files(directory: Path, *, recursive: bool) -> list[Path]:
    return [Path(entry.path) for entry in _entries(directory, recursive=recursive) if not is_cache_name(entry.name)]


def _collect_leftover(
    path: Path, stem: str, cutoff: float, dry_run: bool, removed: list[Removed], kept: list[Kept]
) -> bool:
    """Remove the temp file ``path`` if old and abandoned; whether it was (would be, in a dry run) removed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_mtime > cutoff or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    if not dry_run:
        target = path.with_name(stem)  # a stem is its own stem: same lock as the cache's
        try:
            # Only a creator holding this lock makes (and removes) a temp file, so
            # while we hold it, every temp file of this name was abandoned.
            with creation_lock(target, timeout=0):
                if not os.path.samestat(st, os.lstat(path)):
                    return False
                os.unlink(path)
        except CacheTimeoutError:
            kept.append(Kept(path, "a creator is building this cache right now", st.st_mtime))
            return False
        except FileNotFoundError:
            return False
        except (CacheError, OSError) as error:
            kept.append(Kept(path, error_message(error), st.st_mtime))
            return False
    removed.append(Removed(path, "leftover", st.st_blocks * 512, st.st_mtime))
    return True


def _collect_orphan_lock(path: Path, cutoff: float, dry_run: bool, removed: list[Removed], kept: list[Kept]) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_mtime > cutoff or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return
    try:
        if dry_run:
            _probe_lock(path, st)
        else:
            st = remove_orphan_lock(path)
    except (FileNotFoundError, FileExistsError):
        return  # gone, or its cache was created meanwhile: not an orphan
    except CacheInUseError as error:
        kept.append(
            Kept(
                path,
                "a process holds it (creating or removing that cache right now)",
                st.st_mtime,
                in_use=True,
                pids=tuple(error.pids),
            )
        )
        return
    except (CacheError, OSError) as error:
        kept.append(Kept(path, error_message(error), st.st_mtime))
        return
    removed.append(Removed(path, "lock", st.st_blocks * 512, st.st_mtime))


def _probe_lock(path: Path, st: os.stat_result) -> None:
    """Raise :class:`CacheInUseError` if a process holds the lock file ``path`` (a dry run's look)."""
    fd = _open_lock_file(path)
    try:
        if not try_lock_exclusive(fd):
            raise _lock_busy(path, st)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def orphan_lock(path: str | os.PathLike[str]) -> Path | None:
    """The lock file of the cache at ``path`` if the cache does not exist but its lock file does."""
    cache = Path(os.path.abspath(os.fspath(path)))
    lock = lock_path_for(cache)
    if os.path.lexists(cache) or not os.path.lexists(lock) or lock.name in _locks_in_use(cache.parent):
        return None
    return lock


def is_lock_name(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is named like the lock file of a cache (``<name>.mmc.lock``)."""
    return _lock_stem(Path(os.path.abspath(os.fspath(path)))) is not None


def remove_orphan_lock(path: str | os.PathLike[str]) -> os.stat_result:
    """Delete the lock file ``path`` of a cache that does not exist; return what it was (``lstat``).

    A creation that fails (``CacheSpaceError`` when ``fallocate`` finds the
    disk full, a killed creator) or a cache deleted without
    :func:`mmapcache.remove` leaves ``<name>.lock`` behind, and nothing else
    would delete it. Only creators and :func:`mmapcache.remove` lock it, so
    this takes the lock itself without waiting, then checks, *while holding
    it*, that the name is still the inode it locked and that no cache file
    it guards exists, and only then unlinks it. A creator that opened the
    old inode meanwhile finds it unlinked once it gets the lock (filelock
    checks ``st_nlink``) and makes a new one, so two creators never hold
    different lock files of one cache.

    Raises :class:`CacheInUseError` while a process holds the lock (it is
    creating or removing the cache right now), ``FileExistsError`` if its
    cache exists (remove the cache instead: ``mmapcache rm`` deletes the lock
    with it), :class:`CacheFormatError` for a file that is not an empty
    lock file of a ``*.mmc`` cache, :class:`UnsafeCacheFileError` for a
    symlink, another user's file or one that is not a regular file, and
    ``FileNotFoundError``.
    """
    lock = Path(os.path.abspath(os.fspath(path)))
    if _lock_stem(lock) is None:
        raise CacheFormatError(
            f"{lock} is not the lock file of a cache (<name>{SUFFIX}{LOCK_SUFFIX}); refusing to delete it",
            path=lock,
        )
    fd = _open_lock_file(lock)
    try:
        st = os.fstat(fd)
        if not try_lock_exclusive(fd):
            raise _lock_busy(lock, st)
        # Re-check under the lock: the name may have been replaced, or a
        # creator may have finished between our look and our lock.
        try:
            now = os.lstat(lock)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{lock} was removed meanwhile", str(lock)) from None
        if not os.path.samestat(st, now):
            raise FileNotFoundError(errno.ENOENT, f"{lock} was replaced meanwhile; run again", str(lock))
        if lock.name in _locks_in_use(lock.parent):
            raise FileExistsError(
                errno.EEXIST,
                f"{lock} is the lock file of a cache that exists; remove the cache "
                "(`mmapcache rm`), which deletes its lock file with it",
                str(lock),
            )
        os.unlink(lock)
    finally:
        os.close(fd)  # releases the lock
    return st


def _open_lock_file(path: Path) -> int:
    """Open a lock file for flock after checking, unopened, that it is an empty regular file of ours."""
    check_file_stat(str(path), os.lstat(path))  # a socket or FIFO is refused before any open
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        check_file_stat(str(path), st)
        if st.st_size:
            raise CacheFormatError(
                f"{path} is not empty ({st.st_size} bytes), so it is not an mmapcache lock file; refusing to delete it",
                path=path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_busy(path: Path, st: os.stat_result) -> CacheInUseError:
    pids = flock_holders(st)
    who = f" (process ids: {', '.join(map(str, pids))})" if pids else ""
    return CacheInUseError(
        f"{path} is held by a process creating or removing its cache right now{who}; try again later",
        path=path,
        pids=pids,
    )


# -- space ----------------------------------------------------------------------------------


def disk_usage(directory: str | os.PathLike[str] | None = None, *, recursive: bool = False) -> DiskUsage:
    """Free space where caches live, what caches take there, and warnings with their fixes.

    Warns when the location is a small tmpfs (Docker's default /dev/shm is
    64 MB), nearly full, on a network file system, charged to a memory cgroup
    limit, or holds leftovers of interrupted creations. ``resident`` says how
    much of each cache is in memory now (see :class:`Resident`).
    """
    base = _directory(directory)
    st = os.statvfs(base)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    caches = cache_bytes = leftovers = leftover_bytes = 0
    resident: list[Resident] = []
    for entry in _entries(base, recursive=recursive):
        with contextlib.suppress(OSError):
            allocated = entry.stat(follow_symlinks=False).st_blocks * 512
            if is_cache_name(entry.name):
                caches, cache_bytes = caches + 1, cache_bytes + allocated
                resident.append(Resident(Path(entry.path), entry.stat().st_size, resident_bytes(entry.path)))
            elif _leftover_stem(Path(entry.path)) is not None:
                leftovers, leftover_bytes = leftovers + 1, leftover_bytes + allocated
    fs_type = filesystem_type(base)
    limit = memory_limit() if fs_type == "tmpfs" else None
    usage = DiskUsage(
        base, fs_type, total, free, caches, cache_bytes, leftovers, leftover_bytes, limit, (), tuple(resident)
    )
    return replace(usage, warnings=tuple(_warnings(usage)))


def _warnings(usage: DiskUsage) -> list[str]:
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


def memory_limit() -> int | None:
    """This process's memory cgroup limit in bytes (cgroup v1 or v2), or ``None`` if unlimited or unknown."""
    for candidate in _cgroup_limit_files():
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if value < _NO_LIMIT else None
    return None


def _cgroup_limit_files() -> list[Path]:
    """Limit files for our cgroup, most specific first (in a container the root view is ours)."""
    root = Path("/sys/fs/cgroup")
    v1: list[Path] = []
    v2: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, relative = parts
        relative = relative.lstrip("/")
        if "memory" in controllers.split(","):
            v1 = [root / "memory" / relative / "memory.limit_in_bytes", root / "memory" / "memory.limit_in_bytes"]
        elif controllers == "":
            v2 = [root / relative / "memory.max", root / "memory.max"]
    return [path for path in v1 + v2 if path.exists()]
