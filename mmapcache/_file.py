"""Creating, opening, validating and removing cache files on disk.

Creation is race-safe: under a ``filelock`` on ``<path>.lock`` the creator
builds the whole file under a temporary name in the same directory
(``O_EXCL | O_NOFOLLOW``, mode 0600), preallocates it with
``posix_fallocate`` (a sparse file on a full tmpfs would SIGBUS on first
touch; fallocate fails up front with ENOSPC), writes the header, fsyncs, and
links it to its final name, which never replaces an existing file. Nobody ever
sees a half-made file, and a file others may have mapped is never truncated
or rewritten.

Opening validates in a fixed order and raises one precise error each time:
safety (symlink, owner, mode), size >= header, magic, version, header
checksum, expectations (fields/length/key), file size against the layout.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from ._errors import (
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
    new_header,
    pack_header,
    unpack_header,
    unpack_prefix,
)
from ._locks import flock_holders, lock_exclusive_soon, lock_shared, try_lock_exclusive
from ._paths import check_file_stat, filesystem_type, is_network_filesystem

__all__ = ["Expected", "OpenedFile", "in_use", "lock_path_for", "open_or_create", "read_header", "remove"]

log = logging.getLogger("mmapcache")

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class Expected:
    """What the caller said the file must hold (``None``: not checked)."""

    fields: dict[str, Field] | None = None
    length: int | None = None
    key: str | None = None


@dataclass(frozen=True)
class NewFile:
    """What a file created by this call holds."""

    fields: dict[str, Field]
    length: int
    capacity: int
    key: str
    created: dict[str, Any]


@dataclass
class OpenedFile:
    """A validated cache file: a descriptor holding the shared in-use lock."""

    fd: int
    header: Header
    layout: Layout
    created_now: bool


def lock_path_for(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _temp_prefix(path: Path) -> str:
    return f"{path.name}.tmp-"


def open_or_create(
    path: Path, expected: Expected, new: NewFile | None, *, readonly: bool, timeout: float
) -> OpenedFile:
    """Open ``path`` (creating it from ``new`` if it is missing and ``new`` is given)."""
    created_now = False
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
        _make_private_dirs(path.parent)
        with creation_lock(path, timeout):
            if not os.path.lexists(path):
                _remove_leftovers(path)
                _create(path, new)
                created_now = True


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
    fd = _open_fd(path, readonly=readonly)
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


def _open_fd(path: Path, *, readonly: bool) -> int:
    # O_NONBLOCK: opening a planted FIFO must fail the regular-file check, not hang.
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP and os.path.islink(path):
            raise UnsafeCacheFileError(
                f"{path} is a symlink; mmapcache opens cache files only by their real path "
                "(a planted symlink could point at any of your files)",
                path=path,
            ) from None
        if error.errno == errno.EISDIR:
            raise UnsafeCacheFileError(f"{path} is not a regular file", path=path) from None
        if error.errno == errno.EACCES and not readonly:
            raise PermissionError(
                errno.EACCES,
                f"cannot open {path} for writing; pass readonly=True to only read it",
                str(path),
            ) from None
        raise


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
    if not differences:
        return
    lines = []
    for name, (want, found) in differences.items():
        if name == "fields":
            lines.extend(_field_differences(want, found))
        else:
            lines.append(f"{name}: expected {want!r}, found {found!r}")
    raise SchemaMismatchError(
        f"the cache at {path} holds different data than requested:\n  "
        + "\n  ".join(lines)
        + f"\nUse another key or path for the new data, or remove the old cache "
        f"(`mmapcache rm {path}`) if it is stale.",
        path=path,
        differences=differences,
    )


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
    """Hold the side-file lock that serialises creating and removing ``path``."""
    lock_path = lock_path_for(path)
    if os.path.islink(lock_path):
        raise UnsafeCacheFileError(
            f"{lock_path} is a symlink; remove it (mmapcache never follows symlinks)", path=lock_path
        )
    # filelock 4: a native flock only (no soft marker files that get deleted),
    # and the lock file's name is kept on release.
    lock = filelock.UnixFileLock(
        lock_path, timeout=timeout, mode=0o600, fallback_to_soft=False, preserve_lock_file=True
    )
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CacheTimeoutError(
            f"waited {timeout:g} s for the lock {lock_path} (another process is creating or "
            "removing this cache); pass a larger timeout= if creating it takes longer",
            path=path,
        ) from None
    try:
        yield
    finally:
        lock.release()


def _remove_leftovers(path: Path) -> None:
    """Delete temp files of creators that died mid-way (only lock holders make them)."""
    prefix = _temp_prefix(path)
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix)]
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


def _create(path: Path, new: NewFile) -> None:
    header = new_header(new.fields, new.length, new.capacity, new.key, new.created)
    layout = compute_layout(header)
    _warn_if_network(path)
    _check_space(path, layout.file_size)
    temp = path.parent / f"{_temp_prefix(path)}{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _preallocate(fd, layout.file_size, path)
        data = pack_header(header)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.EIO, f"short write of the header of {temp}")
        os.fsync(fd)
        try:
            os.link(temp, path)  # unlike rename, never replaces an existing file
        except FileExistsError:
            log.info("%s appeared while it was being created; using that file", path)
    finally:
        os.close(fd)
        os.unlink(temp)
    _fsync_dir(path.parent)
    log.info("created %s (%d bytes, capacity %d of %d)", path, layout.file_size, new.capacity, new.length)


def _check_space(path: Path, needed: int) -> None:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise _space_error(path, needed, free)


def _space_error(path: Path, needed: int, free: int | None) -> CacheSpaceError:
    from ._sizes import format_bytes

    have = "an unknown amount" if free is None else format_bytes(free)
    return CacheSpaceError(
        f"not enough space for the cache {path}: it needs {format_bytes(needed)} "
        f"({needed} bytes) and {path.parent} has {have} free. Free some space (`mmapcache ls`, "
        "`mmapcache gc`), give a smaller budget (max_bytes=...), or put caches on a larger disk "
        "with MMAPCACHE_DIR=/path/to/local/nvme; in Docker, raise /dev/shm with --shm-size",
        path=path,
        needed=needed,
        free=free,
    )


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


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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


def remove(path: str | os.PathLike[str], *, force: bool = False, timeout: float = 60.0) -> None:
    """Delete the cache file at ``path`` and its side files.

    Refuses with :class:`CacheInUseError` while any process (this one
    included) has the cache open. ``force=True`` deletes it anyway: processes
    that have it mapped keep reading their now-nameless copy (the memory is
    freed when the last of them closes it), and new openers get a new file —
    so they no longer share. Refuses files that are not mmapcache files.
    """
    target = Path(path)
    fd = _open_fd(target, readonly=True)
    try:
        st = os.fstat(fd)
        if not os.path.samestat(st, os.stat(target, follow_symlinks=False)):
            raise FileNotFoundError(errno.ENOENT, f"{target} was replaced while removing it", str(target))
        _check_removable(fd, target, st)
        with creation_lock(target, timeout):
            if not lock_exclusive_soon(fd, holds_shared=False, path=str(target), timeout=timeout):
                pids = flock_holders(st)
                if not force:
                    who = f" (process ids: {', '.join(map(str, pids))})" if pids else ""
                    raise CacheInUseError(
                        f"{target} is in use{who}; close every handle first (stop the jobs using "
                        "it), or pass force=True / --force to delete it anyway",
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


def _check_removable(fd: int, path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheFileError(f"{path} is not a regular file; refusing to remove it", path=path)
    head = os.pread(fd, len(MAGIC), 0)
    if head != MAGIC and not (path.name.endswith(".mmc") and st.st_size < len(MAGIC)):
        raise CacheFormatError(
            f"{path} is not an mmapcache file (it starts with {head!r}); refusing to delete it",
            path=path,
        )
