"""Which epoch a pass over a ``CachedStream`` is: counted per rank, shared with its DataLoader workers.

The rule (docs/streams.md, "Epochs"): the epoch of a pass is the last
``set_epoch`` value (0 before any) plus the passes *this rank* began since.
A rank is the process that owns the object — the training script's process
under torchrun or Lightning ``ddp`` — and a pass is one iteration of the
object by it (``num_workers=0``) or one iteration of a DataLoader over it,
whose workers are all one pass together. Every rank of a job makes the same
passes, so every rank counts the same epochs without communicating, and a
run starts again at 0 (or at ``set_epoch``'s value): nothing of it lives in
the cache file, which another node, another job or an earlier run shares.

DataLoader workers cannot count by themselves: workers that are not
persistent are new processes every epoch (a copy of the object as the rank
had it), and persistent ones never see a ``set_epoch`` made after they
started. So the count lives in a page of shared memory (:class:`EpochBoard`)
that the object carries: inherited by forked workers, handed to spawned
ones as a descriptor while they are being started. A row per rank process
(found by pid: a worker's row is its parent's) holds ``set_epoch``'s value,
the passes since, and the current round — the pass the workers of one
DataLoader iteration join. A worker joins the round when it has the same key
(its loader's base seed and its own pass number: what every worker of one
iteration shares) and the round has not all its workers yet; else it opens
the next round, which takes the next epoch.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import weakref
from multiprocessing import context, reduction
from typing import Any

import numpy as np
import torch.utils.data

__all__ = ["EpochBoard"]

log = logging.getLogger("mmapcache")

_ROWS = 64  # rank processes that share one board (ddp_spawn's ranks share their launcher's)
_PID, _BASE, _PASSES, _SEED, _PASS, _JOINED, _WORKERS, _EPOCH, _EMPTY = range(9)
_WORDS = 16


class EpochBoard:
    """A page of memory shared with the workers a process starts: the rows that count each rank's passes."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = _new_fd()
        self.fd = fd
        size = _ROWS * _WORDS * 8
        if fd >= 0:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED)
            weakref.finalize(self, os.close, fd)
        else:  # no memfd: anonymous shared memory, inherited by forked workers only
            self._map = mmap.mmap(-1, size, mmap.MAP_SHARED)
        self.rows: np.ndarray[Any, np.dtype[np.int64]] = np.ndarray((_ROWS, _WORDS), np.int64, buffer=self._map)
        self._threads = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        """While a process is being started (spawn, forkserver): the same memory, as a descriptor; else a new board."""
        if self.fd >= 0 and context.get_spawning_popen() is not None:
            return (_rebuild, (reduction.DupFd(self.fd),))
        return (EpochBoard, ())

    # -- the rule ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """``epoch`` is the next pass of this process's rank; later passes count on from it."""
        with self._locked():
            row = self._row(os.getpid())
            row[_BASE], row[_PASSES], row[_JOINED], row[_WORKERS] = epoch, 0, 0, 0

    def next_pass(self, passes: int) -> int:
        """The epoch of the pass this process begins now (``passes``: its own passes over the object, this one too)."""
        info = torch.utils.data.get_worker_info()
        with self._locked():
            if info is None:  # the rank iterates the object itself
                row = self._row(os.getpid())
                row[_JOINED] = row[_WORKERS] = 0
                return self._open_round(row)
            row = self._row(os.getppid())  # a DataLoader worker: its rank is the process that started it
            key = (info.seed - info.id, passes)
            if (int(row[_SEED]), int(row[_PASS])) == key and 0 < row[_JOINED] < row[_WORKERS]:
                row[_JOINED] += 1
                return int(row[_EPOCH])
            row[_SEED], row[_PASS], row[_JOINED], row[_WORKERS], row[_EMPTY] = key[0], key[1], 1, info.num_workers, 0
            return self._open_round(row)

    def ended_empty(self) -> None:
        """This worker's pass found its partition empty (see :meth:`all_empty`)."""
        if torch.utils.data.get_worker_info() is not None:
            with self._locked():
                self._row(os.getppid())[_EMPTY] += 1

    def all_empty(self) -> bool:
        """Whether every worker of this worker's round found its partition empty (always, outside workers)."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return True
        with self._locked():
            row = self._row(os.getppid())
            return bool(row[_EMPTY] >= info.num_workers)

    @staticmethod
    def _open_round(row: np.ndarray[Any, Any]) -> int:
        epoch = int(row[_BASE] + row[_PASSES])
        row[_PASSES] += 1
        row[_EPOCH] = epoch
        return epoch

    # -- rows and locking ------------------------------------------------------------

    def _row(self, pid: int) -> np.ndarray[Any, Any]:
        pids = self.rows[:, _PID]
        found = np.flatnonzero(pids == pid)
        if len(found):
            row: np.ndarray[Any, Any] = self.rows[int(found[0])]
            return row
        free = np.flatnonzero(pids == 0)
        r = int(free[0]) if len(free) else pid % _ROWS  # more ranks than rows: the oldest use of a row is lost
        self.rows[r] = 0
        self.rows[r, _PID] = pid
        claimed: np.ndarray[Any, Any] = self.rows[r]
        return claimed

    def _locked(self) -> _Locked:
        return _Locked(self)


class _Locked:
    """The board's lock: a thread lock, and a POSIX record lock on its memory for the other processes."""

    def __init__(self, board: EpochBoard) -> None:
        self.board = board

    def __enter__(self) -> None:
        self.board._threads.acquire()
        if self.board.fd >= 0:
            fcntl.lockf(self.board.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.board.fd >= 0:
            fcntl.lockf(self.board.fd, fcntl.LOCK_UN)
        self.board._threads.release()


def _new_fd() -> int:
    create = getattr(os, "memfd_create", None)
    if create is None:  # pragma: no cover - Linux has it
        return -1
    fd: int = create("mmapcache-epochs", os.MFD_CLOEXEC)
    os.ftruncate(fd, _ROWS * _WORDS * 8)
    return fd


def _rebuild(dup: Any) -> EpochBoard:
    return EpochBoard(dup.detach())
