"""Collecting caches nobody uses: ``mmapcache gc``, and the orphan lock files of failed creations.

Everything here returns data and prints nothing; ``_admin/reports.py`` formats it.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import CacheError, CacheFormatError, CacheInUseError, CacheTimeoutError
from .._file import (
    CHECK_OWNER,
    CHECK_PREFIX,
    LOCK_SUFFIX,
    SUFFIX,
    check_file_stat,
    check_removable,
    creation_lock,
    flock_holders,
    is_cache_name,
    leftover_stem,
    lock_path_for,
    lock_stem,
    open_fd,
    plan_stem,
    remove,
    side_stem,
    try_lock_exclusive,
)
from .._format import iso_time, parse_duration
from .listing import CacheInfo, directory_of, entries, error_message, list_caches

__all__ = ["DEFAULT_GC_AGE", "GcReport", "Kept", "Removed", "gc", "is_lock_name", "orphan_lock", "remove_orphan_lock"]


DEFAULT_GC_AGE = "7d"


@dataclass(frozen=True)
class Removed:
    """A file :func:`gc` removed (or, in a dry run, would remove).

    ``kind`` is ``"cache"``, ``"corrupt"`` (a damaged cache file),
    ``"leftover"`` (the temporary file of a creator that died), ``"lock"``
    (the lock file of a cache that does not exist: its creation failed, or the
    cache was deleted without ``mmapcache rm``), ``"plan"`` (a packing plan of
    ``PackedSequences`` whose cache does not exist) or ``"check"`` (the private
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


def _locks_in_use(directory: Path) -> set[str]:
    """Names of the lock files that belong to a file present in ``directory`` (whatever its type)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    # A long cache name's side files use a shortened stem, so the lock's own
    # name does not tell which cache it guards: ask lock_path_for of each.
    return {lock_path_for(directory / name).name for name in names}


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
    creators or resizers that died are removed whatever their age (a live one
    holds the cache's creation lock, and its file is kept), and orphan
    lock files as old as ``older_than`` (a cache's ``.lock`` whose cache is gone; see
    :func:`remove_orphan_lock`). Packing plans whose cache is gone (deleted
    without ``mmapcache rm``) are removed whatever their age. The private ``check-*`` directories of
    :mod:`mmapcache.testing` runs that were killed are removed whatever their
    age (a running check keeps a lock on them). ``dry_run=True`` reports what
    would go and removes nothing.
    """
    age = parse_duration(older_than) if isinstance(older_than, str) else float(older_than)
    if age < 0:
        raise ValueError(f"older_than must not be negative, got {older_than!r}")
    base = directory_of(directory)
    cutoff = time.time() - age
    removed: list[Removed] = []
    kept: list[Kept] = []
    for item in list_caches(base, recursive=recursive):
        if item.last_used <= cutoff:
            _collect_cache(item, cutoff, dry_run, removed, kept)
    # Listed again: removing a cache above removed its side files too.
    abandoned: set[Path] = set()  # caches whose creator's leftover went: their lock goes too, whatever its age
    for path in _side_files(base, recursive=recursive):
        stem = leftover_stem(path)
        if stem is not None and _collect_leftover(path, stem, cutoff, dry_run, removed, kept):
            abandoned.add(path.with_name(stem))
    for path in _side_files(base, recursive=recursive):
        stem = plan_stem(path)
        if stem is not None:
            _collect_orphan_plan(path, stem, dry_run, removed)
    # Lock files last, listed once more: collecting a leftover takes (so may make) its cache's lock file.
    guarded: dict[Path, set[str]] = {}
    for path in _side_files(base, recursive=recursive):
        stem = lock_stem(path)
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
        fd = open_fd(item.path, readonly=True)
    except OSError as error:
        return error_message(error)
    try:
        check_removable(fd, item.path, os.fstat(fd))
    except (CacheError, OSError) as error:
        return error_message(error)
    finally:
        os.close(fd)
    return None


def _side_files(directory: Path, *, recursive: bool) -> list[Path]:
    return [Path(entry.path) for entry in entries(directory, recursive=recursive) if not is_cache_name(entry.name)]


def _collect_leftover(
    path: Path, stem: str, cutoff: float, dry_run: bool, removed: list[Removed], kept: list[Kept]
) -> bool:
    """Remove the temp file ``path`` if abandoned, whatever its age; whether it was (would be) removed.

    Only a creator or resizer holding the cache's creation lock makes (and
    removes) a temp file, so while we hold that lock, every temp file of the
    cache was abandoned by a process that died: its age says nothing more
    (``cutoff`` is not used). A dry run takes the lock too, to leave out the
    temp file of a creation in progress.
    """
    del cutoff
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    target = path.with_name(stem)  # a stem is its own stem: same lock as the cache's
    if not (dry_run and not os.path.lexists(lock_path_for(target))):  # no lock file: nobody holds it
        try:
            with creation_lock(target, timeout=0):
                if not os.path.samestat(st, os.lstat(path)):
                    return False
                if not dry_run:
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


def _collect_orphan_plan(path: Path, stem: str, dry_run: bool, removed: list[Removed]) -> None:
    """Remove the packing plan ``path`` if no cache of side-file stem ``stem`` is beside it (it is never used again)."""
    try:
        st = os.lstat(path)
        names = os.listdir(path.parent)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return
    if any(is_cache_name(name) and side_stem(path.parent / name) == stem for name in names):
        return
    if not dry_run:
        try:
            os.unlink(path)
        except OSError:
            return
    removed.append(Removed(path, "plan", st.st_blocks * 512, st.st_mtime))


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
    return lock_stem(Path(os.path.abspath(os.fspath(path)))) is not None


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
    if lock_stem(lock) is None:
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
