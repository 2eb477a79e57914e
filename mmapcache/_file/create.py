"""Opening a cache file or creating it: the creation lock, temp + fallocate + link, free space.

Creation is race-safe: under a ``filelock`` on ``<stem>.lock`` (below) the creator
builds the whole file under a temporary name in the same directory
(``O_EXCL | O_NOFOLLOW``, mode 0600), preallocates it with
``posix_fallocate`` (a sparse file on a full tmpfs would SIGBUS on first
touch; fallocate fails up front with ENOSPC), writes the header, fsyncs, and
links it to its final name, which never replaces an existing file. Nobody ever
sees a half-made file, and a file others may have mapped is never truncated
or rewritten.

Opening validates in a fixed order (``_file/validate.py``: ``open_fd``,
``read_header``) and raises one precise error each time. A creator validates
the sizes (key, fields, whole header) before it creates anything, and reads
back what it wrote with the same reader before linking it into place, so it
never publishes a file nobody can open. Removing a file, and the exclusive use
that removing and clearing share, live in ``_file/removal.py``.

Side-file names (the creation lock, temp files) come from :mod:`mmapcache._file.names`.

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

from .._errors import (
    CacheError,
    CacheFormatError,
    CacheSpaceError,
    CacheTimeoutError,
    SchemaMismatchError,
    UnsafeCacheFileError,
)
from .._field import Field
from .._format import Header, Layout, compute_layout, indices_digest, new_header, pack_header
from .boot import boot_page
from .locks import lock_shared
from .names import is_temp_name_of, lock_path_for, new_temp_path
from .paths import (
    check_file_stat,
    file_kind,
    filesystem_type,
    free_bytes,
    is_memory_filesystem,
    is_network_filesystem,
    statvfs_near,
)
from .validate import Expected, explained, name_too_long, open_fd, read_header

__all__ = [
    "LockStatus",
    "NewFile",
    "OpenedFile",
    "check_space",
    "creation_lock",
    "fsync_dir",
    "open_or_create",
    "preallocate",
    "read_lock_status",
    "remove_abandoned",
    "remove_leftovers",
    "write_all",
]

log = logging.getLogger("mmapcache")

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
            if not created_now:
                remove_abandoned(path)
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
            check_space(path, planned[1].file_size)
        try:
            with _creating(path, planned[1].file_size):
                _make_private_dirs(path.parent)
                with creation_lock(path, timeout):
                    if not os.path.lexists(path):
                        remove_leftovers(path)
                        from .admission import admitted  # the directory's byte budget decides the size

                        with admitted(path, planned[0], timeout=timeout) as admission:
                            chosen = admission.header
                            _create(path, chosen, compute_layout(chosen), new.dataset_indices)
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
    fd = open_fd(path, readonly=readonly, check_owner=True)
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
            raise OSError(errno.ENAMETOOLONG, name_too_long(path), str(path)) from None
        raise explained(error, path) from None


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


def remove_leftovers(path: Path) -> None:
    """Delete temp files of creators or resizers that died mid-way (only lock holders make them).

    Call it holding ``path``'s creation lock.
    """
    for name in _temp_names(path):
        leftover = path.parent / name
        try:
            st = os.lstat(leftover)
            if st.st_uid == os.geteuid():
                os.unlink(leftover)
                log.info("removed %s, left by a creator or resizer that did not finish", leftover)
        except OSError:
            pass


def remove_abandoned(path: Path) -> None:
    """On opening ``path``: delete the temp files of its creators or resizers that died, if there are any.

    The creation lock is only tried (``timeout=0``): while a creator or resizer
    holds it, its temp file is alive, and the open does not wait for it.
    """
    if not _temp_names(path):
        return
    try:
        with creation_lock(path, timeout=0):
            remove_leftovers(path)
    except (CacheError, OSError) as error:  # busy, or not ours to remove: a later open or `mmapcache gc` will
        log.debug("left the temp files of %s: %s", path, error)


def _temp_names(path: Path) -> list[str]:
    try:
        return [n for n in os.listdir(path.parent) if is_temp_name_of(n, path)]
    except OSError:
        return []


def _create(
    path: Path, header: Header, layout: Layout, dataset_indices: np.ndarray[Any, np.dtype[np.uint64]] | None = None
) -> None:
    _warn_if_network(path)
    check_space(path, layout.file_size)
    temp = new_temp_path(path)
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise _no_room(error, path, layout.file_size) from None
    try:
        preallocate(fd, layout.file_size, path)
        data = pack_header(header)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.EIO, f"short write of the header of {temp}")
        if dataset_indices is not None:
            write_all(fd, np.ascontiguousarray(dataset_indices, dtype="<u8").tobytes(), layout.indices_offset, temp)
        if layout.boot_offset:
            write_all(fd, boot_page(), layout.boot_offset, temp)
        if layout.stream_offset:  # the stream page starts with the fill boot id, as a boot page does
            write_all(fd, boot_page(), layout.stream_offset, temp)
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
    fsync_dir(path.parent)
    log.info("created %s (%d bytes, capacity %d of %d)", path, layout.file_size, header.capacity, header.length)


def write_all(fd: int, data: bytes | memoryview, offset: int, path: Path) -> None:
    """All of ``data`` at ``offset`` of the file (``pwrite`` may write less than asked)."""
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


def check_space(path: Path, needed: int) -> None:
    free = _free_bytes(path)
    if free is not None and needed > free:
        raise _space_error(path, needed, free)


def _no_room(error: OSError, path: Path, needed: int) -> OSError:
    """A :class:`CacheSpaceError` for a file system's ENOSPC/EDQUOT (bytes or inodes), else ``error``."""
    if error.errno not in _SPACE_ERRNOS:
        return error
    return _space_error(path, needed, _free_bytes(path), inodes=_free_inodes(path) == 0)


def _space_error(path: Path, needed: int, free: int | None, *, inodes: bool = False) -> CacheSpaceError:
    from .._format import format_bytes

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


def preallocate(fd: int, size: int, path: Path) -> None:
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


def fsync_dir(directory: Path) -> None:
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
