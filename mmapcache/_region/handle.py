"""The process-local side of an open cache: a locked descriptor, a mapping, fork safety.

The mechanics that :class:`~mmapcache.Cache` (the policy) stands on, beside
``_file/locks.py`` (the system calls).

Descriptors
-----------
``Handle.fd`` holds the shared in-use ``flock`` and the slot claims. The
mapping is made through a different open file description, because ``mmap``
keeps a duplicate of the descriptor it maps; were that our locked one, a forked
child's inherited mapping would keep the parent's claims alive after the
parent died.

Unmapping
---------
A handle never unmaps explicitly. ``np.ndarray(shape, dtype, buffer=mm)``
keeps a reference to the ``mmap`` object but holds no buffer export, so
``mm.close()`` succeeds while arrays over the mapping are alive and unmaps the
memory they point to: their next read is a SIGSEGV. ``close()`` therefore
releases the descriptor — and with it the in-use lock and any claim — at once,
drops the handle's own references to the mapping (the ``mmap`` object, the
variable region's arrays) and leaves the unmap to the ``mmap`` object's
deallocation, which happens when the last array, view or zero-copy tensor over
the mapping is gone — not when the closed handle itself is.

Replacement
-----------
A handle is bound to the file it opened, not to its name: after ``resize``
renames a new file over the name, the handle keeps reading (and filling) the
old one. :meth:`Handle.replaced` tells, with one ``stat``, that the name now
names another file; a binding that follows it (``CachedDataset`` does, on its
next miss) closes the handle and opens the name again.

Fork
----
Both lock kinds belong to an open file description, which ``fork()`` shares.
In a forked child every live handle takes a description of its own
(``os.register_at_fork``), so parent and child never hold one claim together.
If the child cannot (no descriptor left: EMFILE), the handle fails closed: it
keeps reading through the inherited mapping and refuses every write.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path

from .._errors import ReadonlyCacheError
from .._file import SlotLocks
from .._format import Layout
from .allocator import Heap
from .counters import Board

__all__ = ["Handle", "closed_error"]

log = logging.getLogger("mmapcache")


def closed_error(path: Path) -> ValueError:
    """The error every operation on a closed cache raises."""
    return ValueError(f"operation on a closed cache ({path})")


class Handle:
    """A locked descriptor of one cache file and its shared mapping, in one process."""

    __slots__ = (
        "__weakref__",
        "board",
        "fd",
        "heap",
        "identity",
        "locks",
        "mm",
        "path",
        "readonly",
        "refused",
        "write_lock",
    )

    def __init__(self, path: Path, fd: int, layout: Layout, *, readonly: bool) -> None:
        self.path, self.fd, self.readonly = path, fd, readonly
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)  # which file this is, whatever its name names later
        self.mm: mmap.mmap | None = _map(fd, layout.file_size, path, readonly=readonly)
        self.locks = SlotLocks(fd)
        self.board = Board(self.mm, layout, self.locks, writable=not readonly)
        self.heap = Heap(self.mm, layout, self.locks) if layout.variable_size else None
        # Held by every writer, by close() and by the operations that use ``fd``:
        # a descriptor is never closed under a writer's claim, and never used
        # after close (its number may already name another file).
        self.write_lock = threading.Lock()
        self.refused: str | None = None  # why writes are refused (see reopen_in_child)
        _LIVE_HANDLES.add(self)

    def check_usable(self, *, writing: bool) -> None:
        """Raise unless the descriptor is open (and, for ``writing``, safe to claim through).

        Call it holding ``write_lock``.
        """
        if self.fd < 0:
            raise closed_error(self.path)
        if writing and self.refused is not None:
            raise ReadonlyCacheError(self.refused, path=self.path)

    def replaced(self) -> bool:
        """Whether ``path`` names another file now (a resize swapped a new one in, or a remove and a create).

        One ``stat`` of the name. A name that names nothing is not a replacement:
        there is no newer file to follow.
        """
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.identity

    def reopen_in_child(self) -> None:
        """After fork: take our own description, so parent and child never share a claim."""
        self.write_lock = threading.Lock()  # another thread may have held it at fork time
        if self.heap is not None:
            self.heap.forget_extent()  # the parent keeps filling it
        if self.fd < 0:
            return
        try:
            new = _reopen(self.fd, self.path, self._flags())
        except OSError as error:
            self.refused = _refusal(self.path, error)
            log.warning("%s", self.refused)
            self.board.reset_after_fork(self.mm, claim=False)
            return
        fcntl.flock(new, fcntl.LOCK_SH)  # cannot block: the parent holds a shared lock
        os.close(self.fd)  # the parent's descriptor stays open: its locks stay
        self.fd = self.locks.fd = new
        self.board.reset_after_fork(self.mm, claim=True)

    def close(self) -> None:
        """Release the descriptor and its locks now; the mapping goes with its last user."""
        with self.write_lock:
            _LIVE_HANDLES.discard(self)
            if self.fd >= 0:
                self.board.release()
                os.close(self.fd)
                self.fd = self.locks.fd = -1
            # Drop the handle's own references to the mapping (the heap's arrays):
            # arrays others still hold keep it alive; it is unmapped after the last of them.
            self.mm = self.heap = None

    def _flags(self) -> int:
        return (os.O_RDONLY if self.readonly else os.O_RDWR) | os.O_CLOEXEC


def _refusal(path: Path, error: OSError) -> str:
    why = "no file descriptor was left (EMFILE)" if error.errno == errno.EMFILE else str(error)
    return (
        f"this handle of {path} cannot write in this forked process: it could not open a "
        f"descriptor of its own after fork ({why}), and writing through the parent's would let "
        "both hold one slot's claim. Reads still work; open the cache again in the child "
        "(Cache.open(path)), or raise the open-file limit (ulimit -n), to write"
    )


_LIVE_HANDLES: weakref.WeakSet[Handle] = weakref.WeakSet()


def _reopen_all_in_child() -> None:
    for handle in list(_LIVE_HANDLES):
        handle.reopen_in_child()


os.register_at_fork(after_in_child=_reopen_all_in_child)


def _reopen(fd: int, path: Path, flags: int) -> int:
    """A new open file description of the file behind ``fd``."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags)
    except OSError as error:
        if error.errno in (errno.EMFILE, errno.ENFILE):
            raise
        new = os.open(path, flags | os.O_NOFOLLOW)
        if not os.path.samestat(os.fstat(new), os.fstat(fd)):
            os.close(new)
            raise FileNotFoundError(errno.ENOENT, f"{path} was replaced; cannot reopen it", str(path)) from None
        return new


def _map(fd: int, size: int, path: Path, *, readonly: bool) -> mmap.mmap:
    access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, access=access, trackfd=False)
    map_fd = _reopen(fd, path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC)
    try:
        return mmap.mmap(map_fd, size, access=access)
    finally:
        os.close(map_fd)
