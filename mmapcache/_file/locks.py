"""Kernel locks: who has a cache open, and who is writing which slot.

Two kinds of lock live on the cache file itself, and the kernel keeps them
apart (on Linux ``flock`` and ``fcntl`` record locks never conflict):

* **In use** — every open handle holds a shared ``flock`` on its own open file
  description. An exclusive non-blocking ``flock`` on another description then
  answers "does anyone have this cache open?". The kernel drops the lock when
  the process dies, so there are no stale reference counts to clean up.
* **Slot claims** — a writer holds an exclusive open-file-description record
  lock (``F_OFD_SETLK``) on the one byte at the slot's state offset while it
  fills the slot. The kernel releases it if the writer dies, which is how a
  half-written slot is proven abandoned without guessing from a PID.

Both lock kinds belong to an *open file description*, which ``fork()`` shares
with the child; a handle therefore reopens its descriptor in a forked child
(see ``cache.py``) so that parent and child never share a claim.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time

from .._errors import CacheTimeoutError

__all__ = ["SlotLocks", "flock_holders", "lock_exclusive_soon", "lock_shared", "try_lock_exclusive"]

_CONTENDED = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def try_lock_exclusive(fd: int) -> bool:
    """Try to take the exclusive in-use lock on ``fd`` without waiting.

    On Linux a failed ``LOCK_EX`` conversion on a descriptor that held
    ``LOCK_SH`` drops the shared lock; callers that held one must take it back
    with :func:`lock_shared`.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in _CONTENDED:
            return False
        raise
    return True


def lock_exclusive_soon(fd: int, *, holds_shared: bool, path: str, timeout: float, tries: int = 5) -> bool:
    """Try for the exclusive in-use lock a few times over ~30 ms; False if it stays taken.

    Another process probing "is this in use?" (``in_use``, ``mmapcache ls``)
    holds the exclusive lock for microseconds; a single attempt would mistake
    that probe for a user. When ``holds_shared``, a failed attempt dropped our
    shared lock, which is taken back before trying again or giving up.
    """
    for attempt in range(tries):
        if try_lock_exclusive(fd):
            return True
        if holds_shared:
            lock_shared(fd, timeout=timeout, path=path)
        if attempt + 1 < tries:
            time.sleep(0.002 * 2**attempt)
    return False


def lock_shared(fd: int, *, timeout: float, path: str) -> None:
    """Take the shared in-use lock, waiting up to ``timeout`` seconds.

    Only a ``clear``/``remove`` holds the exclusive lock, and only briefly.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except OSError as error:
            if error.errno not in _CONTENDED:
                raise
        if time.monotonic() >= deadline:
            raise CacheTimeoutError(
                f"{path} stayed exclusively locked (being cleared or removed) for {timeout:g} s",
                path=path,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def flock_holders(st: os.stat_result) -> list[int]:
    """Process ids holding an ``flock`` on the file ``st`` describes (Linux /proc/locks).

    The kernel records the process that took each lock; a forked child sharing
    its parent's lock is not listed separately. Returns [] where /proc/locks
    is unavailable.
    """
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: set[int] = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                parts = line.split()
                # "1: FLOCK  ADVISORY  READ  1234 00:1a:5678 0 EOF"; blocked
                # waiters carry an extra "->" column.
                if "->" in parts:
                    parts.remove("->")
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == wanted:
                    pid = int(parts[4])
                    if pid > 0:
                        pids.add(pid)
    except (OSError, ValueError):
        return []
    return sorted(pids)


# struct flock on Linux (x86-64 and aarch64): short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid, padded to 32 bytes. Other systems
# order and size the members differently (macOS: l_start, l_len, l_pid, l_type,
# l_whence), so these requests are Linux's, with or without F_OFD_*.
_FLOCK = struct.Struct("@hhqqi4x")
_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
_SETLKW = getattr(fcntl, "F_OFD_SETLKW", fcntl.F_SETLKW)
_GETLK = getattr(fcntl, "F_OFD_GETLK", fcntl.F_GETLK)
HAVE_OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLK")


class SlotLocks:
    """Exclusive record locks on a file descriptor: a slot's claim, a record's owner, an allocation page.

    Each call is one ``fcntl`` (about 1-2 µs on a short lock list) on ``length``
    bytes from ``offset``. The kernel keeps the locks of one file in a list
    that every lock call walks (any process's), and merges adjacent or
    overlapping locks of one open file description into one entry: locking
    ``k`` adjacent ranges, in one call or in ``k``, leaves one entry, while
    ``k`` ranges with gaps between them leave ``k``. Unlocking part of an
    entry splits it. Linux only: the request is packed as Linux's ``struct
    flock`` (see ``_FLOCK``), which other systems lay out differently. When
    Python's ``fcntl`` lacks the open-file-description commands (built
    against Linux headers older than 3.15) it falls back to classic POSIX
    record locks, which belong to the process: there, two handles of one
    process do not exclude each other. A Python that has them on a kernel
    older than 3.15 fails the first claim with ``EINVAL``.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def try_claim(self, offset: int, length: int = 1) -> bool:
        """Lock ``length`` bytes from ``offset``; False when another description holds any of them."""
        try:
            fcntl.fcntl(self.fd, _SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0))
        except OSError as error:
            if error.errno in _CONTENDED:
                return False
            raise
        return True

    def claim_wait(self, offset: int, length: int = 1) -> None:
        """Lock ``length`` bytes from ``offset``, waiting while another description holds any of them."""
        fcntl.fcntl(self.fd, _SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0))

    def release(self, offset: int, length: int = 1) -> None:
        """Unlock ``length`` bytes from ``offset`` (bytes this description does not hold are left alone)."""
        fcntl.fcntl(self.fd, _SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, length, 0))

    def held_elsewhere(self, offset: int, length: int = 1) -> bool:
        """Whether another open file description (a live writer) holds any of ``length`` bytes from ``offset``."""
        return self.conflict(offset, length) is not None

    def conflict(self, offset: int, length: int = 1) -> tuple[int, int] | None:
        """One lock another description holds on the ``length`` bytes from ``offset``: its first and last byte.

        ``None`` when no other description holds any of them. When several
        do, the kernel names one of them (not necessarily the lowest).
        """
        result = fcntl.fcntl(self.fd, _GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0))
        kind, _, start, size, _ = _FLOCK.unpack(result)
        if kind == fcntl.F_UNLCK:
            return None
        # A lock to the end of the file has length 0.
        return start, (start + size - 1 if size > 0 else offset + length - 1)
