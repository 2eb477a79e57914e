"""The exceptions mmapcache raises.

Every error derives from :class:`CacheError` and also from the builtin that fits
it, so code that already catches ``ValueError`` or ``OSError`` keeps working::

    CacheError (Exception)
    ├── CacheFormatError (ValueError)        not a cache, unsupported version,
    │                                        corrupt header, truncated file
    ├── SchemaMismatchError (ValueError)     the file holds other fields/length/key
    ├── CacheSpaceError (OSError)            no room (bytes or inodes) to create the file
    ├── UnsafeCacheFileError (PermissionError)
    │                                        symlink, another user's file,
    │                                        writable by others, not a regular file
    ├── CacheInUseError (OSError)            another handle has the cache open
    ├── CacheMissError (KeyError)            get_many: some indices are not cached
    ├── ReadonlyCacheError (PermissionError) a write through a readonly handle
    └── CacheTimeoutError (TimeoutError)     the creation lock was not acquired in time

Each error carries the path it is about (``error.path``, may be ``None``) and
pickles cleanly, so it crosses process boundaries (DataLoader workers, spawn).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = [
    "CacheError",
    "CacheFormatError",
    "CacheInUseError",
    "CacheMissError",
    "CacheSpaceError",
    "CacheTimeoutError",
    "ReadonlyCacheError",
    "SchemaMismatchError",
    "StaleCacheError",
    "UnsafeCacheFileError",
]


class CacheError(Exception):
    """Base class of every error mmapcache raises on purpose."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path: str | None = None if path is None else os.fspath(path)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        # Builtin exceptions pickle as ``cls(*args)``, which drops keyword-only
        # attributes; rebuild from the message and restore the attributes.
        return (_rebuild, (type(self), str(self)), self.__dict__.copy())


def _rebuild(cls: type[CacheError], message: str) -> CacheError:
    error = cls.__new__(cls)
    CacheError.__init__(error, message)
    return error


class CacheFormatError(CacheError, ValueError):
    """The file is not a cache this version can read, or it is damaged."""


class SchemaMismatchError(CacheError, ValueError):
    """The cache file holds other fields, another length or another key.

    ``differences`` maps each differing property to ``(expected, found)``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        differences: dict[str, tuple[Any, Any]] | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.differences: dict[str, tuple[Any, Any]] = dict(differences or {})


class StaleCacheError(SchemaMismatchError):
    """A cached sample differs from the one the wrapped dataset gives now: the data or its preprocessing changed.

    Raised by :class:`~mmapcache.torch.CachedDataset` when it first uses an
    existing cache in a process and compares a few cached samples with fresh
    ones (``check=``). ``index`` is the dataset index compared and ``field``
    the field that differs. Change the key, or remove the cache.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        differences: dict[str, tuple[Any, Any]] | None = None,
        index: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message, path=path, differences=differences)
        self.index, self.field = index, field


class CacheSpaceError(CacheError, OSError):
    """There is not enough free space to create the cache file.

    ``needed`` and ``free`` are byte counts (``free`` may be ``None`` when the
    file system did not say).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        needed: int = 0,
        free: int | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.needed = needed
        self.free = free


class UnsafeCacheFileError(CacheError, PermissionError):
    """The path is a symlink, not a regular file, another user's, or writable by others."""


class CacheInUseError(CacheError, OSError):
    """Another handle has the cache open, so it cannot be cleared or removed.

    ``pids`` lists the processes holding it where the operating system tells
    (Linux ``/proc/locks``), else it is empty. The message tells this process
    and the processes it started (its DataLoader workers) apart from other
    jobs, and says what to do about each: close a handle, delete a
    DataLoader iterator, stop a job.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        pids: list[int] | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.pids: list[int] = list(pids or [])


class CacheMissError(CacheError, KeyError):
    """:meth:`Cache.get_many` was asked for indices that are not cached (or failed their checksum).

    ``missing`` holds those indices (a 1-D integer array, in request order).
    A miss is an ordinary outcome on a cold epoch: :meth:`Cache.read_many`
    reports hits and misses as a mask instead of raising.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        missing: Any = (),
    ) -> None:
        super().__init__(message, path=path)
        indices = np.asarray(missing)
        self.missing: np.ndarray[Any, Any] = indices if indices.size else indices.astype(np.int64)


class CacheTimeoutError(CacheError, TimeoutError):
    """A lock needed to create, open or remove the cache was not acquired in time."""


class ReadonlyCacheError(CacheError, PermissionError):
    """A write (``put``, ``clear``, ...) was attempted through a readonly handle."""
