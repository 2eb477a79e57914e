"""Creating, opening, validating and removing cache files on disk.

Creation is race-safe: under a ``filelock`` on ``<stem>.lock`` (below) the creator
builds the whole file under a temporary name in the same directory
(``O_EXCL | O_NOFOLLOW``, mode 0600), preallocates it with
``posix_fallocate`` (a sparse file on a full tmpfs would SIGBUS on first
touch; fallocate fails up front with ENOSPC), writes the header, fsyncs, and
links it to its final name, which never replaces an existing file. Nobody ever
sees a half-made file, and a file others may have mapped is never truncated
or rewritten.

Opening validates in a fixed order and raises one precise error each time:
safety (symlink, not a regular file, owner, mode — from ``lstat`` before
anything is opened, so a socket, FIFO, device or another user's file gets the
same :class:`UnsafeCacheFileError` whatever the mode), size >= header, magic,
version, header checksum, expectations (fields/length/key), file size against
the layout. A creator validates the sizes (key, fields, whole header) before
it creates anything, and reads back what it wrote with the same reader before
linking it into place, so it never publishes a file nobody can open.

Side-file names (the creation lock, temp files) come from :mod:`mmapcache._names`.

When the file system says no, the error says what to do: no bytes *or no
inodes* left (for the lock file, the temp file, or the link: tmpfs counts
each link as an inode) raise :class:`CacheSpaceError`; a read-only mount
(EROFS), a directory one may not write or enter (EACCES), a name longer than
``NAME_MAX`` or a path longer than ``PATH_MAX`` (ENAMETOOLONG), a file where
a directory should be (ENOTDIR) and too many open files (EMFILE) keep their
``OSError`` type and errno, with a message naming the fix. A directory deleted
while a creator waits for the lock is made again (three times at most).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import stat
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import numpy as np

from ._boot import boot_page
from ._errors import (
    CacheError,
    CacheFormatError,
    CacheInUseError,
    CacheSpaceError,
    CacheTimeoutError,
    SchemaMismatchError,
    UnsafeCacheFileError,
)
from ._field import Field
from ._format import (
    MAGIC,
    PREFIX_SIZE,
    Header,
    Layout,
    compute_layout,
    indices_digest,
    new_header,
    pack_header,
    unpack_header,
    unpack_prefix,
)
from ._holders import held_by
from ._locks import flock_holders, lock_exclusive_soon, lock_shared, try_lock_exclusive
from ._names import SUFFIX, is_temp_name_of, lock_path_for, name_max, new_temp_path
from ._paths import (
    check_file_stat,
    check_kind,
    file_kind,
    filesystem_type,
    free_bytes,
    is_memory_filesystem,
    is_network_filesystem,
    statvfs_near,
)

__all__ = [
    "Expected",
    "LockStatus",
    "OpenedFile",
    "in_use",
    "open_or_create",
    "read_header",
    "read_lock_status",
    "remove",
]

log = logging.getLogger("mmapcache")

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class Expected:
    """What the caller said the file must hold (``None``: not checked)."""

    fields: dict[str, Field] | None = None
    length: int | None = None
    key: str | None = None
    indices_digest: str | None = None  # the dataset index table's digest ("": the file must have none)


@dataclass(frozen=True)
class NewFile:
    """What a file created by this call holds."""

    fields: dict[str, Field]
    length: int
    capacity: int
    key: str
    created: dict[str, Any]
    variable_size: int = 0
    extent_size: int = 0
    dataset_indices: np.ndarray[Any, np.dtype[np.uint64]] | None = None  # the index table to write (version 4)
    stream: tuple[int, int] | None = None  # (ranks, workers) of a cached stream (version 8)


@dataclass
class OpenedFile:
    """A validated cache file: a descriptor holding the shared in-use lock."""

    fd: int
    header: Header
    layout: Layout
    created_now: bool


def open_or_create(
    path: Path, expected: Expected, new: NewFile | None, *, readonly: bool, timeout: float
) -> OpenedFile:
    """Open ``path`` (creating it from ``new`` if it is missing and ``new`` is given)."""
    created_now = False
    planned: tuple[Header, Layout] | None = None
    vanished = 0
    while True:
        try:
            fd, header, layout = _open_existing(path, expected, readonly=readonly, timeout=timeout)
            return OpenedFile(fd, header, layout, created_now)
        except FileNotFoundError:
            if new is None:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"no cache file at {path}; pass fields= and length= to create one"
                    + (" (a readonly open never creates)" if readonly else ""),
                    str(path),
                ) from None
        except _ReplacedError:
            continue
        if planned is None:
            # Everything that can be checked is checked before anything (a
            # directory, the lock file, a temp file) is created.
            header = new_header(
                new.fields,
                new.length,
                new.capacity,
                new.key,
                new.created,
                variable_size=new.variable_size,
                extent_size=new.extent_size,
                indices_digest="" if new.dataset_indices is None else indices_digest(new.dataset_indices),
                on_disk=not is_memory_filesystem(filesystem_type(path.parent)),
                stream=new.stream,
            )
            planned = header, compute_layout(header)
            _check_space(path, planned[1].file_size)
        try:
            with _creating(path, planned[1].file_size):
                _make_private_dirs(path.parent)
                with creation_lock(path, timeout):
                    if not os.path.lexists(path):
                        _remove_leftovers(path)
                        _create(path, *planned, new.dataset_indices)
                        created_now = True
        except FileNotFoundError:
            # The directory was deleted under us (a job-end cleanup of /dev/shm,
            # `rm -r` of the cache directory): make it again, a few times.
            if path.parent.is_dir():
                raise
            vanished += 1
            if vanished > _VANISHED_RETRIES:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"cannot create the cache {path}: its directory {path.parent} was deleted "
                    f"{vanished} times while the cache was being created; stop whatever deletes it, or "
                    "keep caches elsewhere (MMAPCACHE_DIR or another path)",
                    str(path),
                ) from None
            log.warning("%s was deleted while %s was being created; creating it again", path.parent, path)


_VANISHED_RETRIES = 3


def _make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and any missing parents with mode 0700 (``mkdir -p`` would use 0777)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for each in reversed(missing):
        with contextlib.suppress(FileExistsError):
            each.mkdir(mode=0o700)


class _ReplacedError(Exception):
    """The name was removed or replaced between open() and taking the lock: retry."""


def _open_existing(path: Path, expected: Expected, *, readonly: bool, timeout: float) -> tuple[int, Header, Layout]:
    fd = _open_fd(path, readonly=readonly, check_owner=True)
    try:
        st = os.fstat(fd)
        check_file_stat(str(path), st)
        lock_shared(fd, timeout=timeout, path=str(path))
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise _ReplacedError from None
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _ReplacedError
        header, layout = read_header(fd, str(path), expected)
        _refresh_mtime(fd)
        return fd, header, layout
    except BaseException:
        os.close(fd)
        raise


def _open_fd(path: Path, *, readonly: bool, check_owner: bool = False) -> int:
    """Open the regular file at ``path`` without following a symlink or touching anything else.

    The type (and with ``check_owner``, the owner and mode) is checked with
    ``lstat`` *before* opening, so every mode gets the same answer for a
    socket, a FIFO, a device or another user's file; ``fstat`` after opening
    catches a name swapped in between.
    """
    try:
        before = os.lstat(path)
    except OSError as error:
        if error.errno == errno.EACCES:
            raise PermissionError(
                errno.EACCES,
                f"cannot look up {path}: permission denied on one of its directories "
                f"({path.parent}); use a path you can reach",
                str(path),
            ) from None
        raise _explained(error, path) from None
    check_kind(path, before)
    if check_owner:
        check_file_stat(str(path), before)
    # O_NONBLOCK: a FIFO swapped in after the lstat must fail the check below, not hang.
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES):
            # Replaced since the lstat (a symlink, a directory, a socket...), or another user's now.
            with suppress(FileNotFoundError):
                now = os.lstat(path)
                check_kind(path, now)
                if check_owner:
                    check_file_stat(str(path), now)
        if error.errno == errno.EACCES and not readonly:
            raise PermissionError(
                errno.EACCES,
                f"cannot open {path} for writing (permission denied, mode "
                f"{stat.S_IMODE(before.st_mode):o}); pass readonly=True to only read it",
                str(path),
            ) from None
        if error.errno == errno.EROFS:
            raise OSError(
                errno.EROFS,
                f"cannot open {path} for writing: it is on a read-only file system. Pass "
                "readonly=True to read the cache, or keep caches you fill in a writable directory "
                "(MMAPCACHE_DIR or another path)",
                str(path),
            ) from None
        raise _explained(error, path) from None
    try:
        after = os.fstat(fd)
        if not os.path.samestat(before, after):
            check_kind(path, after)
            if check_owner:
                check_file_stat(str(path), after)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _explained(error: OSError, path: Path) -> OSError:
    """``error`` with a message that says what to do, for the errnos users meet."""
    if error.errno == errno.ENAMETOOLONG:
        return OSError(errno.ENAMETOOLONG, _name_too_long(path), str(path))
    if error.errno == errno.ENOTDIR:
        parent = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), path.parent)
        return NotADirectoryError(
            errno.ENOTDIR, f"cannot use {path}: {parent} is not a directory; use another path", str(path)
        )
    if error.errno == errno.EMFILE:
        return OSError(
            errno.EMFILE,
            f"cannot open {path}: this process has too many open files (each open cache holds a "
            "descriptor); close caches and files you no longer use, or raise the limit (`ulimit -n`)",
            str(path),
        )
    return error


def _name_too_long(path: Path) -> str:
    name = os.fsencode(path.name)
    limit = name_max(path.parent)
    if len(name) > limit:
        return (
            f"the file name {path.name[:40]!r}... is {len(name)} bytes, longer than the {limit} bytes "
            f"the file system at {path.parent} accepts; use a shorter name (for instance a hash of it)"
        )
    return (
        f"the path {str(path)[:60]!r}... is {len(os.fsencode(str(path)))} bytes, longer than the "
        "system accepts (PATH_MAX); use a shorter path"
    )


@contextmanager
def _creating(path: Path, needed: int) -> Iterator[None]:
    """Turn the errors of creating files next to ``path`` into ones that say what to do."""
    try:
        yield
    except CacheError:
        raise
    except OSError as error:
        if error.errno in _SPACE_ERRNOS:
            raise _no_room(error, path, needed) from None
        if error.errno == errno.EROFS:
            raise OSError(
                errno.EROFS,
                f"cannot create the cache {path}: {path.parent} is on a read-only file system. Point "
                "MMAPCACHE_DIR (or the path) at a writable directory; an existing cache there can "
                "be read with readonly=True",
                str(path),
            ) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(
                error.errno,
                f"cannot create the cache {path}: no permission to create files in {path.parent} "
                f"({error.strerror}: {error.filename}). Point MMAPCACHE_DIR (or the path) at a "
                "directory you can write to; an existing cache there can be read with readonly=True",
                str(path),
            ) from None
        if error.errno == errno.ENAMETOOLONG:
            raise OSError(errno.ENAMETOOLONG, _name_too_long(path), str(path)) from None
        raise _explained(error, path) from None


def read_header(fd: int, path: str, expected: Expected = Expected()) -> tuple[Header, Layout]:
    """Validate the file behind ``fd`` in the documented order; return its header and layout."""
    size = os.fstat(fd).st_size
    header_size, _ = unpack_prefix(os.pread(fd, PREFIX_SIZE, 0), path=path, file_size=size)
    header = unpack_header(os.pread(fd, header_size, 0), path=path)
    _check_expected(header, expected, path)
    layout = compute_layout(header)
    if size != layout.file_size:
        what = "truncated" if size < layout.file_size else "longer than its layout"
        raise CacheFormatError(
            f"{path} is {what}: it holds {size} bytes but its header describes "
            f"{layout.file_size}; remove it (`mmapcache rm {path}`) to rebuild the cache",
            path=path,
        )
    return header, layout


def _check_expected(header: Header, expected: Expected, path: str) -> None:
    differences: dict[str, tuple[Any, Any]] = {}
    if expected.fields is not None and expected.fields != header.fields:
        differences["fields"] = (expected.fields, header.fields)
    if expected.length is not None and expected.length != header.length:
        differences["length"] = (expected.length, header.length)
    if expected.key is not None and expected.key != header.key:
        differences["key"] = (expected.key, header.key)
    if expected.indices_digest is not None and expected.indices_digest != header.indices_digest:
        differences["dataset_indices"] = (expected.indices_digest, header.indices_digest)
    if not differences:
        return
    lines = []
    for name, (want, found) in differences.items():
        if name == "fields":
            lines.extend(_field_differences(want, found))
        elif name == "dataset_indices":
            lines.append(
                f"dataset indices: {_index_set(want)} was asked for, the file caches {_index_set(found)} (another "
                "node's shard, or a job with another node count: each shard is a cache of its own)"
            )
        else:
            lines.append(f"{name}: expected {_short(want)}, found {_short(found)}")
    raise SchemaMismatchError(
        f"the cache at {path} holds different data than requested:\n  "
        + "\n  ".join(lines)
        + f"\nUse another key or path for the new data, or remove the old cache "
        f"(`mmapcache rm {path}`) if it is stale.",
        path=path,
        differences=differences,
    )


def _index_set(digest: str) -> str:
    return f"the index set with digest {digest}" if digest else "the whole dataset (no index table)"


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, shortened for a message (a key may be megabytes long)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-limit // 4 :]} ({len(text)} characters)"


def _field_differences(want: dict[str, Field], found: dict[str, Field]) -> list[str]:
    lines = []
    for name in want.keys() | found.keys():
        if name not in found:
            lines.append(f"field {name!r}: expected {want[name]!r}, the file has no such field")
        elif name not in want:
            lines.append(f"field {name!r}: not expected, the file has {found[name]!r}")
        elif want[name] != found[name]:
            lines.append(f"field {name!r}: expected {want[name]!r}, found {found[name]!r}")
    return sorted(lines)


def _refresh_mtime(fd: int) -> None:
    # Reads through a mapping never touch the mtime; opening does, so
    # `mmapcache gc` sees read-only users as users.
    with suppress(OSError):
        os.utime(fd)


@contextmanager
def creation_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold the side-file lock that serialises creating, removing, clearing and checking ``path``.

    ``timeout`` bounds a wait in which nothing moves: while the holder
    publishes progress (:class:`LockStatus`, e.g. the check after a reboot),
    the wait goes on, and is logged.
    """
    lock_path = lock_path_for(path)
    _check_lock_file(lock_path)
    # filelock 4: a native flock only (no soft marker files that get deleted),
    # and the lock file's name is kept on release.
    lock = filelock.UnixFileLock(
        lock_path, timeout=timeout, mode=0o600, fallback_to_soft=False, preserve_lock_file=True
    )
    _acquire(lock, path, lock_path, timeout)
    try:
        yield
    finally:
        lock.release()


_POLL = 0.5  # seconds between two looks at the holder's progress while waiting for a creation lock
_LOG_EVERY = 10.0  # seconds between two log lines of a waiter


def _acquire(lock: filelock.UnixFileLock, path: Path, lock_path: Path, timeout: float) -> None:
    """Take ``lock``, waiting while its holder makes progress and for ``timeout`` seconds without any."""
    if timeout <= 0:
        try:
            lock.acquire(timeout=0)
            return
        except filelock.Timeout:
            raise _timeout_error(path, lock_path, timeout, None) from None
    seen: dict[str, Any] | None = None
    moved = time.monotonic()  # the last time the holder was seen to make progress (or the wait began)
    logged = -math.inf
    while True:
        try:
            lock.acquire(timeout=max(min(_POLL, moved + timeout - time.monotonic()), 0.001))
            return
        except filelock.Timeout:
            pass
        status, now = read_lock_status(lock_path), time.monotonic()
        if status is not None and status != seen:
            seen, moved = status, now
            if now - logged >= _LOG_EVERY:
                logged = now
                log.warning("waiting for %s", _describe(status, path))
        if now - moved >= timeout:
            raise _timeout_error(path, lock_path, timeout, seen)


def _describe(status: dict[str, Any], path: Path) -> str:
    """``pid 12, which checks PATH after a reboot: 40% (1024 of 2560 slots)``."""
    done, total = status.get("done"), status.get("total")
    text = f"pid {status.get('pid')}, which {status.get('doing', f'holds the lock of {path}')}"
    if isinstance(done, int) and isinstance(total, int) and total:
        text += f": {100 * done / total:.0f}% ({done} of {total} {status.get('unit', 'items')})"
    return text


def _timeout_error(path: Path, lock_path: Path, timeout: float, status: dict[str, Any] | None) -> CacheTimeoutError:
    if status is not None:
        what = f"{_describe(status, path)}, made no progress in that time"
    else:
        what = "another process holds it: it is creating, removing or clearing this cache"
    return CacheTimeoutError(
        f"waited {timeout:g} s for the lock {lock_path} ({what}); pass a larger timeout= if that process needs longer",
        path=path,
    )


class LockStatus:
    """What the holder of a creation lock is doing, written into the lock file for its waiters.

    One line of JSON (``pid``, ``doing``, ``done``, ``total``, ``unit``),
    replaced at most every :data:`_POLL` / 2 seconds and removed by
    :meth:`clear`. The lock file's contents mean nothing else: filelock
    never reads or writes them.
    """

    def __init__(self, path: Path, doing: str, unit: str) -> None:
        self._lock_path, self._doing, self._unit = lock_path_for(path), doing, unit
        self._last = -math.inf

    def publish(self, done: int, total: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < _POLL / 2:
            return
        self._last = now
        line = {"pid": os.getpid(), "doing": self._doing, "done": done, "total": total, "unit": self._unit}
        self._write(json.dumps(line).encode() + b"\n")

    def clear(self) -> None:
        self._write(b"")

    def _write(self, data: bytes) -> None:
        with suppress(OSError):  # progress is for people: never a reason to fail the work
            fd = os.open(self._lock_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)


def read_lock_status(lock_path: Path) -> dict[str, Any] | None:
    """The status the holder of ``lock_path`` published (``None``: none, or unreadable)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        status = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return status if isinstance(status, dict) else None


def _check_lock_file(lock_path: Path) -> None:
    """Refuse a planted lock file: a symlink, not a regular file, or another user's."""
    try:
        st = os.lstat(lock_path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheFileError(
            f"{lock_path} is a symlink; remove it (mmapcache never follows symlinks)", path=lock_path
        )
    if not stat.S_ISREG(st.st_mode):
        kind = file_kind(st)
        raise UnsafeCacheFileError(
            f"the lock file {lock_path} is {kind}, not a regular file; mmapcache leaves it alone. "
            "Remove it or use another path",
            path=lock_path,
        )
    if st.st_uid != os.geteuid():
        raise UnsafeCacheFileError(
            f"the lock file {lock_path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
            "another user could hold it forever. Remove it or use another path",
            path=lock_path,
        )


def _remove_leftovers(path: Path) -> None:
    """Delete temp files of creators that died mid-way (only lock holders make them)."""
    try:
        names = [n for n in os.listdir(path.parent) if is_temp_name_of(n, path)]
    except OSError:
        return
    for name in names:
        leftover = path.parent / name
        try:
            st = os.lstat(leftover)
            if st.st_uid == os.geteuid():
                os.unlink(leftover)
                log.info("removed %s, left by a creator that did not finish", leftover)
        except OSError:
            pass


def _create(
    path: Path, header: Header, layout: Layout, dataset_indices: np.ndarray[Any, np.dtype[np.uint64]] | None = None
) -> None:
    _warn_if_network(path)
    _check_space(path, layout.file_size)
    temp = new_temp_path(path)
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise _no_room(error, path, layout.file_size) from None
    try:
        _preallocate(fd, layout.file_size, path)
        data = pack_header(header)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.EIO, f"short write of the header of {temp}")
        if dataset_indices is not None:
            _write_all(fd, np.ascontiguousarray(dataset_indices, dtype="<u8").tobytes(), layout.indices_offset, temp)
        if layout.boot_offset:
            _write_all(fd, boot_page(), layout.boot_offset, temp)
        if layout.stream_offset:  # the stream page starts with the fill boot id, as a boot page does
            _write_all(fd, boot_page(), layout.stream_offset, temp)
        os.fsync(fd)
        _check_written(fd, path, header)
        try:
            os.link(temp, path)  # unlike rename, never replaces an existing file
        except FileExistsError:
            log.info("%s appeared while it was being created; using that file", path)
        except OSError as error:
            # Before the temp file is deleted: its inode tells whether inodes ran out.
            raise _no_room(error, path, layout.file_size) from None
    finally:
        os.close(fd)
        os.unlink(temp)
    _fsync_dir(path.parent)
    log.info("created %s (%d bytes, capacity %d of %d)", path, layout.file_size, header.capacity, header.length)


def _write_all(fd: int, data: bytes, offset: int, path: Path) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"short write at offset {offset} of {path}")
        view, offset = view[written:], offset + written


def _check_written(fd: int, path: Path, header: Header) -> None:
    """Read the new file back with the reader every opener uses: never publish what cannot be opened."""
    try:
        found, _ = read_header(fd, str(path), Expected(header.fields, header.length, header.key, header.indices_digest))
        if (found.capacity, found.uuid, found.header_size) != (header.capacity, header.uuid, header.header_size):
            raise CacheFormatError(
                f"it reads back capacity {found.capacity}, header size {found.header_size} instead of "
                f"{header.capacity}, {header.header_size}",
                path=path,
            )
    except (CacheFormatError, SchemaMismatchError) as error:
        raise CacheFormatError(
            f"refusing to create {path}: the file just written does not read back as written ({error}). "
            "Nothing was published; this is a bug in mmapcache, please report it",
            path=path,
        ) from error


def _check_space(path: Path, needed: int) -> None:
    free = _free_bytes(path)
    if free is not None and needed > free:
        raise _space_error(path, needed, free)


def _no_room(error: OSError, path: Path, needed: int) -> OSError:
    """A :class:`CacheSpaceError` for a file system's ENOSPC/EDQUOT (bytes or inodes), else ``error``."""
    if error.errno not in _SPACE_ERRNOS:
        return error
    return _space_error(path, needed, _free_bytes(path), inodes=_free_inodes(path) == 0)


def _space_error(path: Path, needed: int, free: int | None, *, inodes: bool = False) -> CacheSpaceError:
    from ._sizes import format_bytes

    have = "an unknown amount" if free is None else format_bytes(free)
    if inodes:
        what = (
            f"no free inodes (file entries) left in {path.parent} to create the cache {path} "
            f"(it needs {format_bytes(needed)}, {needed} bytes, and {have} are free). Free some "
            "(`mmapcache ls`, `mmapcache gc`, or delete other files there), put caches on another "
            "file system with MMAPCACHE_DIR=/path/to/local/nvme; a tmpfs gets more inodes with "
            "`mount -o remount,nr_inodes=N`, and in Docker a larger /dev/shm (--shm-size)"
        )
    else:
        what = (
            f"not enough space for the cache {path}: it needs {format_bytes(needed)} "
            f"({needed} bytes) and {path.parent} has {have} free. Free some space (`mmapcache ls`, "
            "`mmapcache gc`), give a smaller budget (max_bytes=...), or put caches on a larger disk "
            "with MMAPCACHE_DIR=/path/to/local/nvme; in Docker, raise /dev/shm with --shm-size"
        )
    return CacheSpaceError(what, path=path, needed=needed, free=free)


def _preallocate(fd: int, size: int, path: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as error:
        if error.errno in _SPACE_ERRNOS:
            raise _space_error(path, size, _free_bytes(path)) from None
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    # The file system cannot preallocate: write zeros so that every block exists.
    chunk = bytes(1 << 20)
    written = 0
    try:
        while written < size:
            written += os.pwrite(fd, chunk[: min(len(chunk), size - written)], written)
    except OSError as error:
        if error.errno in _SPACE_ERRNOS:
            raise _space_error(path, size, _free_bytes(path)) from None
        raise


def _statvfs(path: Path) -> os.statvfs_result | None:
    return statvfs_near(path.parent)


def _free_bytes(path: Path) -> int | None:
    return free_bytes(path.parent)


def _free_inodes(path: Path) -> int | None:
    st = _statvfs(path)
    # f_files == 0: the file system does not count inodes (btrfs, some FUSE).
    return st.f_favail if st is not None and st.f_files else None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_warned_network: set[str] = set()


def _warn_if_network(path: Path) -> None:
    fs_type = filesystem_type(path.parent)
    if is_network_filesystem(fs_type) and str(path.parent) not in _warned_network:
        _warned_network.add(str(path.parent))
        warnings.warn(
            f"{path.parent} is on a {fs_type} file system: locks and shared mappings are not "
            "coherent across machines there, so only processes on one node may share this "
            "cache. Prefer /dev/shm or a local disk (MMAPCACHE_DIR)",
            RuntimeWarning,
            stacklevel=4,
        )


def in_use(path: str | os.PathLike[str]) -> bool:
    """Whether any process (this one included) has the cache at ``path`` open.

    Raises ``FileNotFoundError`` when there is no such file.
    """
    fd = _open_fd(Path(path), readonly=True)
    try:
        return not try_lock_exclusive(fd)
    finally:
        os.close(fd)


def remove(
    path: str | os.PathLike[str], *, force: bool = False, timeout: float = 60.0, same_as: os.stat_result | None = None
) -> None:
    """Delete the cache file at ``path`` and its side files.

    Refuses with :class:`CacheInUseError` while any process (this one
    included) has the cache open. ``force=True`` deletes it anyway: processes
    that have it mapped keep reading their now-nameless copy (the memory is
    freed when the last of them closes it), and new openers get a new file —
    so they no longer share. Refuses files that are not mmapcache files.
    ``same_as``: delete only that file (``os.stat`` of it); if ``path`` now
    names another one, ``FileNotFoundError`` and nothing is deleted.
    """
    target = Path(path)
    fd = _open_fd(target, readonly=True)
    try:
        st = os.fstat(fd)
        if same_as is not None and not os.path.samestat(st, same_as):
            raise FileNotFoundError(errno.ENOENT, f"{target} was replaced already", str(target))
        if not os.path.samestat(st, os.stat(target, follow_symlinks=False)):
            raise FileNotFoundError(errno.ENOENT, f"{target} was replaced while removing it", str(target))
        if st.st_uid != os.geteuid():
            check_file_stat(str(target), st)  # the same answer as opening it: another user's file
        _check_removable(fd, target, st)
        with _removing(target), exclusive_use(target, fd, holds_shared=False, timeout=timeout) as pids:
            if pids is not None:
                if not force:
                    raise CacheInUseError(
                        f"{target} is in use{held_by(pids)}, or pass force=True / --force to delete it anyway",
                        path=target,
                        pids=pids,
                    )
                log.warning("removing %s although processes %s have it open", target, pids)
            if os.path.samestat(st, os.stat(target, follow_symlinks=False)):
                os.unlink(target)
            _remove_leftovers(target)
            # Deleting the lock file while holding it is safe: a waiter that
            # then acquires the unlinked inode sees st_nlink == 0 and retries.
            with suppress(FileNotFoundError):
                os.unlink(lock_path_for(target))
    finally:
        os.close(fd)
    _fsync_dir(target.parent)


@contextmanager
def exclusive_use(path: Path, fd: int, *, holds_shared: bool, timeout: float) -> Iterator[list[int] | None]:
    """Use the cache at ``path`` alone (to remove or clear it): ``None``, or the pids that have it open.

    Takes the creation lock, then the exclusive ``flock`` on ``fd`` (waiting
    up to ``timeout`` for handles that are closing). Both ``remove`` and
    ``clear`` go through here, so that one never finds the cache unused while
    the other switches locks: switching between a shared and the exclusive
    flock is not atomic in the kernel, and only the creation lock, taken
    first by both, closes that gap. When another process holds the file, the
    body gets its pids (this process's included: a caller that holds its own
    shared lock leaves itself out) and decides (refuse, or ``force``). A
    descriptor that held the shared lock (``holds_shared``) gets it back.
    """
    with creation_lock(path, timeout):
        alone = lock_exclusive_soon(fd, holds_shared=holds_shared, path=str(path), timeout=timeout)
        try:
            yield None if alone else flock_holders(os.fstat(fd))
        finally:
            if alone and holds_shared:
                fcntl.flock(fd, fcntl.LOCK_SH)


@contextmanager
def _removing(path: Path) -> Iterator[None]:
    """Turn the errors of deleting ``path`` and its side files into ones that say what to do."""
    try:
        yield
    except CacheError:
        raise
    except OSError as error:
        if error.errno == errno.EROFS:
            raise OSError(
                errno.EROFS,
                f"cannot remove {path}: it is on a read-only file system; remount it read-write first",
                str(path),
            ) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(
                error.errno,
                f"cannot remove {path}: no permission to delete files in {path.parent} "
                f"({error.strerror}: {error.filename})",
                str(path),
            ) from None
        raise


def _check_removable(fd: int, path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheFileError(f"{path} is not a regular file; refusing to remove it", path=path)
    head = os.pread(fd, len(MAGIC), 0)
    if head != MAGIC and not (path.name.endswith(SUFFIX) and st.st_size < len(MAGIC)):
        raise CacheFormatError(
            f"{path} is not an mmapcache file (it starts with {head!r}); refusing to delete it",
            path=path,
        )
