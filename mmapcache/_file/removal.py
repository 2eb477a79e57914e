"""Removing a cache file, and the exclusive use that removing and clearing share.

:func:`remove` deletes a cache file and its side files only while nobody has
it open (unless forced), and only a file that looks like an mmapcache file
(:func:`check_removable`). :func:`exclusive_use` is the one protocol for
using a cache alone: the creation lock first, then the exclusive in-use
``flock``; ``remove`` and ``Cache.clear`` both go through it, so that one never
finds the cache unused while the other switches locks. :func:`in_use` asks the
same lock whether anyone has the file open.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from .._errors import (
    CacheError,
    CacheFormatError,
    CacheInUseError,
    UnsafeCacheFileError,
)
from .._format import (
    MAGIC,
)
from .create import creation_lock, fsync_dir, remove_leftovers
from .holders import held_by
from .locks import flock_holders, lock_exclusive_soon, try_lock_exclusive
from .names import SUFFIX, lock_path_for, plans_of
from .paths import (
    check_file_stat,
)
from .validate import open_fd

__all__ = ["check_removable", "exclusive_use", "in_use", "remove", "remove_plans"]

log = logging.getLogger("mmapcache")


def in_use(path: str | os.PathLike[str]) -> bool:
    """Whether any process (this one included) has the cache at ``path`` open.

    Raises ``FileNotFoundError`` when there is no such file.
    """
    fd = open_fd(Path(path), readonly=True)
    try:
        return not try_lock_exclusive(fd)
    finally:
        os.close(fd)


def remove(
    path: str | os.PathLike[str], *, force: bool = False, timeout: float = 60.0, same_as: os.stat_result | None = None
) -> None:
    """Delete the cache file at ``path`` and its side files (its lock, leftovers, packing plans).

    Refuses with :class:`CacheInUseError` while any process (this one
    included) has the cache open. ``force=True`` deletes it anyway: processes
    that have it mapped keep reading their now-nameless copy (the memory is
    freed when the last of them closes it), and new openers get a new file —
    so they no longer share. Refuses files that are not mmapcache files.
    ``same_as``: delete only that file (``os.stat`` of it); if ``path`` now
    names another one, ``FileNotFoundError`` and nothing is deleted.
    """
    target = Path(path)
    fd = open_fd(target, readonly=True)
    try:
        st = os.fstat(fd)
        if same_as is not None and not os.path.samestat(st, same_as):
            raise FileNotFoundError(errno.ENOENT, f"{target} was replaced already", str(target))
        if not os.path.samestat(st, os.stat(target, follow_symlinks=False)):
            raise FileNotFoundError(errno.ENOENT, f"{target} was replaced while removing it", str(target))
        if st.st_uid != os.geteuid():
            check_file_stat(str(target), st)  # the same answer as opening it: another user's file
        check_removable(fd, target, st)
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
            remove_leftovers(target)
            remove_plans(target)  # its packing plans (PackedSequences) go with it
            # Deleting the lock file while holding it is safe: a waiter that
            # then acquires the unlinked inode sees st_nlink == 0 and retries.
            with suppress(FileNotFoundError):
                os.unlink(lock_path_for(target))
    finally:
        os.close(fd)
    fsync_dir(target.parent)


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


def check_removable(fd: int, path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheFileError(f"{path} is not a regular file; refusing to remove it", path=path)
    head = os.pread(fd, len(MAGIC), 0)
    if head != MAGIC and not (path.name.endswith(SUFFIX) and st.st_size < len(MAGIC)):
        raise CacheFormatError(
            f"{path} is not an mmapcache file (it starts with {head!r}); refusing to delete it",
            path=path,
        )


def remove_plans(path: Path) -> None:
    """Delete the packing plans of the cache at ``path``: they name its file's uuid, which a new file there lacks."""
    for plan in plans_of(path):
        with suppress(FileNotFoundError):
            os.unlink(plan)
