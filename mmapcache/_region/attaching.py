"""Opening a cache file: its descriptor mapped, and the checks before a first use.

:func:`attach` turns a descriptor that :func:`~mmapcache._file.create.open_or_create`
opened into a :class:`~mmapcache._region.handle.Handle` and its
:class:`~mmapcache._region.mapped.Mapped` views, then makes the checks a file needs
before anyone reads it: a file on a disk used in a boot other than its last is
checked for what a crash may have torn (:func:`check_after_reboot`), and a file
made in memory but found on a disk is warned about (:func:`warn_if_on_a_disk`).
A failed open leaks no descriptor and no in-use lock.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from .._errors import ReadonlyCacheError
from .._file import LockStatus, OpenedFile, creation_lock, filesystem_type, is_memory_filesystem
from .handle import Handle
from .mapped import Mapped
from .reboot import check_boot

__all__ = ["attach", "check_after_reboot", "warn_if_on_a_disk"]


def attach(
    path: Path, opened: OpenedFile, *, readonly: bool, timeout: float, reopen: Callable[[], None]
) -> tuple[Handle, Mapped]:
    """The handle and views of an opened file, checked for a first use; ``reopen`` opens it writable once."""
    header, layout = opened.header, opened.layout
    try:
        handle = Handle(path, opened.fd, layout, readonly=readonly)
    except BaseException:
        os.close(opened.fd)
        raise
    try:
        mapped = Mapped(handle, header, layout)
        check_after_reboot(path, mapped, readonly=readonly, timeout=timeout, reopen=reopen)
        if mapped.boot is None:
            warn_if_on_a_disk(path, header.version, os.fstat(opened.fd))
    except BaseException:
        handle.close()  # a failed open leaks no descriptor and no in-use lock
        raise
    return handle, mapped


def check_after_reboot(
    path: Path, mapped: Mapped, *, readonly: bool, timeout: float, reopen: Callable[[], None]
) -> None:
    """Before a file on a disk is used in a boot other than its last: check what a crash may have torn.

    A readonly handle cannot reset torn slots: ``reopen()`` opens (and closes)
    a writable handle of the file, which checks it.
    """
    if mapped.boot is None or mapped.boot.current():
        return
    if not readonly:
        lock = functools.partial(creation_lock, path, timeout)
        status = LockStatus(path, f"checks {path} after a reboot", "slots")
        try:
            check_boot(
                mapped.boot,
                mapped.slots,
                mapped.parts,
                lock=lock,
                readahead=mapped.readahead,
                reconcile=mapped.cover_values,
                progress=status.publish,
            )
        finally:
            status.clear()
        return
    try:  # resetting torn slots takes write access: a writable handle checks, then we read
        reopen()
    except OSError as error:
        raise ReadonlyCacheError(
            f"{path} was last written before a reboot, and the slots that were not synced must be checked "
            f"against their checksums before they are read, which needs write access ({error}); open it once "
            "without readonly=True (or run `mmapcache verify --fix PATH`) as a user who may write it",
            path=path,
        ) from None


_warned_without_boot: set[tuple[int, int]] = set()


def warn_if_on_a_disk(path: Path, version: int, st: os.stat_result) -> None:
    """Warn (once per file and process) about a file made in memory and used from a disk: no reboot check."""
    kind = filesystem_type(path.parent)
    if is_memory_filesystem(kind) or (st.st_dev, st.st_ino) in _warned_without_boot:
        return
    _warned_without_boot.add((st.st_dev, st.st_ino))
    warnings.warn(
        f"{path} is on a disk ({kind or 'unknown file system'}) but was made on a memory file system (format "
        f"version {version}, without the boot page of version 5): after a crash or power loss mmapcache cannot "
        "tell which of its slots reached the disk, and may serve samples whose bytes did not. Make it on the "
        f"disk instead: remove it (`mmapcache rm {path}`) and let the next run create and fill it there",
        RuntimeWarning,
        stacklevel=5,
    )
