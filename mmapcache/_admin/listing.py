"""Inspecting caches: list them and read what a file says — ``mmapcache ls`` and ``mmapcache info``.

Everything here returns data and prints nothing; ``_admin/reports.py`` formats it.

Looking must not change anything. A cache file's modification time means
"last used": every :meth:`Cache.open` refreshes it, read-only users included
(reads through a mapping never touch it). So :func:`list_caches` and
:func:`info` never open a :class:`~mmapcache.Cache`: they open the file
read-only, validate the header with the same code ``Cache.open`` uses, count
READY slots from the slot table with ``pread``, and ask the in-use ``flock``
whether anyone has the file open (an exclusive non-blocking attempt, released
at once; then ``/proc/locks`` for the process ids). The directory a command
looks in (:func:`directory_of`) and its entries (:func:`entries`) are shared
with ``_admin/garbage.py`` and ``_admin/df.py``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CacheError, CacheFormatError, UnsafeCacheFileError
from .._file import (
    SlotLocks,
    check_file_stat,
    default_dir,
    filesystem_type,
    flock_holders,
    free_bytes,
    is_cache_name,
    open_fd,
    read_header,
    try_lock_exclusive,
)
from .._format import COUNTER_RECORD_SIZE, Header, Layout, descriptor_nbytes, iso_time
from .._region import READY, REFUTED, WRITING, Usage, VariableRegion, read_flags, read_usage, value_bytes
from .._streams import StreamStatus, read_stream_status

__all__ = ["CacheInfo", "FieldInfo", "directory_of", "entries", "error_message", "info", "list_caches"]


def error_message(error: BaseException) -> str:
    """The message of ``error`` without Python's ``[Errno 2]`` decoration, naming the file once."""
    if isinstance(error, OSError) and not isinstance(error, CacheError) and error.strerror:
        name = error.filename
        if name is None or os.fspath(name) in error.strerror:
            return error.strerror
        return f"{error.strerror}: {os.fspath(name)}"
    return str(error)


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
class _Location:
    filesystem: str | None
    free: int | None

    @classmethod
    def of(cls, directory: Path) -> _Location:
        return cls(filesystem_type(directory), free_bytes(directory))


def directory_of(directory: str | os.PathLike[str] | None) -> Path:
    if directory is None:
        return default_dir()
    path = Path(os.path.abspath(os.fspath(directory)))
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, f"no such directory: {path}", str(path))
        raise NotADirectoryError(errno.ENOTDIR, f"not a directory: {path}", str(path))
    return path


def entries(directory: Path, *, recursive: bool) -> Iterator[os.DirEntry[str]]:
    """Non-directory entries of ``directory`` (and, if ``recursive``, of real subdirectories)."""
    with os.scandir(directory) as scan:
        listed = sorted(scan, key=lambda entry: entry.name)
    for entry in listed:
        if entry.is_dir(follow_symlinks=False):
            if recursive:
                yield from entries(Path(entry.path), recursive=True)
        else:
            yield entry


def list_caches(directory: str | os.PathLike[str] | None = None, *, recursive: bool = False) -> list[CacheInfo]:
    """Every ``*.mmc`` file in ``directory`` (default: :func:`mmapcache.default_dir`), sorted by path.

    Damaged or unreadable files are listed too, with ``status`` and ``error``
    saying what is wrong; one bad file never makes the listing fail. Side
    files (``*.lock``, ``*.tmp-*``) are not listed. ``recursive=True`` also
    looks in subdirectories (symlinked directories are not followed).
    """
    base = directory_of(directory)
    location = _Location.of(base)
    found = []
    for entry in entries(base, recursive=recursive):
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
        fd = open_fd(path, readonly=True)
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


# Slot records read per pread when counting states (8 MiB at 8 bytes a record).
_CHUNK_RECORDS = 2**20
