"""Reading rows that are not in memory: ask the device for a whole batch at once.

A read through a mapping of a file on disk that is not in the page cache is a
chain of synchronous page faults, each waiting for its own small read: 256
random 147 KB rows of an evicted file on the root disk here read at ~60 MB/s.
Telling the kernel first which byte ranges are about to be read
(``posix_fadvise(POSIX_FADV_WILLNEED)`` on each row) queues all of their reads
at once, and the gather that follows waits for I/O already in flight: the
same batch reads at 1.6-1.9 GB/s, at or above 32 threads of ``preadv`` into a
preallocated buffer (1.1-1.4 GB/s; ``madvise(MADV_WILLNEED)`` on the mapping
reached 1.1 GB/s) — see ``benchmarks/bench_cold.py``.

Why these choices:

* **Hints through a descriptor of our own.** Each :class:`Readahead` opens the
  file once more, read-only. It takes no lock, so keeping it open (or sharing it
  with a forked child) never keeps a cache "in use" or a slot claimed, and a
  hint queued for a background thread stays valid after the cache is closed.
* **128 KiB per hint.** The kernel caps one WILLNEED call at the device's
  read-ahead window (``read_ahead_kb``, 128 KiB on most NVMe drives): a longer
  row is hinted in 128 KiB pieces, or its tail would still fault page by page.
* **Probe before hinting.** Hinting a resident row costs a system call and a
  page-cache walk (2.3 us for a 147 KB row, 40 % of the gather it precedes), so
  a batch first probes a few of its rows (up to :data:`PROBES`, spread over the
  batch) with a one-byte ``preadv(RWF_NOWAIT)``, which fails with ``EAGAIN``
  instead of waiting when the byte is not in memory. All present: the batch is
  read as before. One missing: every row is hinted. A cache that is partly
  resident (larger than RAM) nearly always shows a missing row among the probes.
* **Memory file systems take the old path.** On tmpfs (``/dev/shm``) every page
  is already in memory: no :class:`Readahead` exists, and reads cost exactly
  what they cost before.
* **No private copies, no mlock.** Hints and gathers go through the page cache,
  which the kernel may reclaim at any time: a cache larger than the job's memory
  limit reads through without being charged more than what is resident.

``MMAPCACHE_READAHEAD=0`` in the environment turns hints off (every read faults
page by page, as before): for comparisons, and as a way out should a file
system misbehave.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._file import filesystem_type, is_memory_filesystem
from .._format import Header, Layout, field_slot_nbytes
from .handle import _reopen

__all__ = ["HINT_CHUNK", "PROBES", "Readahead", "enabled_for", "prefetch_later", "readahead_for"]

log = logging.getLogger("mmapcache")

HINT_CHUNK = 128 * 1024  # bytes per WILLNEED call: the smallest common read-ahead window
PROBES = 8  # rows of a batch probed for residency before deciding to hint
ENV = "MMAPCACHE_READAHEAD"

# (start, nbytes) of every slot's bytes in one region: slot i at start + i * nbytes.
Rows = tuple[int, int]
# Extra ranges of a batch (variable fields' values): starts and lengths for some slots.
Ranges = Callable[[np.ndarray[Any, np.dtype[np.intp]]], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]


def enabled_for(path: Path) -> bool:
    """Whether reads of the cache at ``path`` should be hinted: on a disk, unless the environment says no."""
    if os.environ.get(ENV, "1").strip().lower() in {"0", "off", "no", "false"}:
        return False
    return not is_memory_filesystem(filesystem_type(path))


class Readahead:
    """Read-ahead hints for one open cache file on a disk: probe a batch, hint its rows.

    ``rows`` lists, per fixed region, where slot 0 starts and how many bytes a
    slot takes; ``ranges`` adds per-slot ranges that are not at fixed strides
    (the values of variable fields). Thread-safe: it holds no state but its
    descriptor.
    """

    __slots__ = ("__weakref__", "_fd", "_finalizer", "_largest", "_nowait", "_probe", "_ranges", "_rows")

    def __init__(self, path: Path, fd: int, rows: Sequence[Rows], ranges: Sequence[Ranges] = ()) -> None:
        self._fd = _reopen(fd, path, os.O_RDONLY | os.O_CLOEXEC)  # a description of its own: no locks on it
        # A probe of a byte that is not in memory starts the kernel's read-ahead for this descriptor,
        # up to read_ahead_kb (8 MiB here) when it guesses a pattern: RANDOM keeps it to that page.
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        self._rows = tuple((start, nbytes) for start, nbytes in rows if nbytes)
        self._ranges = tuple(ranges)
        # Probes look at the largest region: it holds most of the bytes to read.
        self._largest = max(self._rows, key=lambda region: region[1]) if self._rows else (0, 0)
        self._probe = bytearray(1)
        self._nowait = True  # cleared when the file system refuses RWF_NOWAIT: then always hint

    def close(self) -> None:
        """Close the descriptor (also done when the object is collected)."""
        self._finalizer()

    def before_read(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> bool:
        """Hint slots ``idx`` (in range, READY) if any of a few probed rows is not in memory; whether it hinted."""
        if not len(idx) or not self._finalizer.alive or self.resident(idx):
            return False
        self.hint(idx)
        return True

    def before_read_one(self, index: int) -> None:
        """:meth:`before_read` of one slot, without building an array on the way when it is in memory."""
        if self._finalizer.alive and not self._resident_one(index):
            self.hint(np.array([index], np.intp))

    def resident(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> bool:
        """Whether the last byte of up to :data:`PROBES` rows spread over ``idx`` is in memory."""
        step = max(1, len(idx) // PROBES)
        return all(self._resident_one(i) for i in idx[::step][:PROBES].tolist())

    def _resident_one(self, index: int) -> bool:
        """Whether the last byte of slot ``index`` in its largest region is in memory (one system call)."""
        if not self._nowait or not self._rows:
            return not self._rows
        start, nbytes = self._largest
        try:
            return os.preadv(self._fd, [self._probe], start + index * nbytes + nbytes - 1, os.RWF_NOWAIT) == 1
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False  # this file system cannot say: hint every batch
            return False

    def hint(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> None:
        """Queue the reads of every byte of slots ``idx`` (``POSIX_FADV_WILLNEED``); returns before they finish."""
        fd = self._fd
        willneed = os.POSIX_FADV_WILLNEED
        for start, nbytes in self._rows:
            if nbytes <= HINT_CHUNK:
                for offset in (start + idx * nbytes).tolist():
                    os.posix_fadvise(fd, offset, nbytes, willneed)
            else:
                _hint_long(fd, (start + idx * nbytes).tolist(), [nbytes] * len(idx))
        for ranges in self._ranges:
            starts, lengths = ranges(idx)
            _hint_long(fd, starts.tolist(), lengths.tolist())


def readahead_for(path: Path, fd: int, layout: Layout, header: Header, variables: Sequence[Any]) -> Readahead | None:
    """A :class:`Readahead` for an open cache file, or ``None`` where hints would only cost (memory, or turned off).

    ``variables`` are the file's variable columns (``_variable.VariableColumn``):
    their descriptors are rows like any other, their values extra ranges.
    """
    if not enabled_for(path):
        return None
    rows = [(layout.field_offsets[name], field_slot_nbytes(field)) for name, field in header.fields.items()]
    return Readahead(path, fd, rows, [_value_ranges(column, layout.variable_offset) for column in variables])


def _value_ranges(column: Any, base: int) -> Ranges:
    def ranges(idx: np.ndarray[Any, np.dtype[np.intp]]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        lengths = column.dims[idx].astype(np.int64).prod(axis=1) * column.dtype.itemsize
        return base + column.offsets[idx].astype(np.int64), lengths

    return ranges


def _hint_long(fd: int, starts: list[int], lengths: list[int]) -> None:
    """Hint each range in pieces of at most :data:`HINT_CHUNK` bytes."""
    willneed = os.POSIX_FADV_WILLNEED
    for start, length in zip(starts, lengths, strict=True):
        end = start + length
        for offset in range(start, end, HINT_CHUNK):
            os.posix_fadvise(fd, offset, min(HINT_CHUNK, end - offset), willneed)


# -- prefetch: hints issued by a background thread -------------------------------------------

_QUEUE_SIZE = 64  # batches waiting to be hinted; more are dropped (a hint is only a hint)


class _Prefetcher:
    """One daemon thread per process that issues queued hints, so that the caller never waits for them.

    A WILLNEED call can block: when the device's request queue is full, the
    kernel waits for room before it returns.
    """

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[Readahead, np.ndarray[Any, Any]]] = queue.Queue(_QUEUE_SIZE)
        self.thread = threading.Thread(target=self._run, name="mmapcache-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            readahead, idx = self.queue.get()
            try:
                readahead.before_read(idx)
            except OSError as error:  # the file went away, the descriptor was closed: nothing to hint
                log.debug("prefetch of %d slots failed: %s", len(idx), error)


_prefetcher: _Prefetcher | None = None
_prefetcher_lock = threading.Lock()


def prefetch_later(readahead: Readahead, idx: np.ndarray[Any, np.dtype[np.intp]]) -> bool:
    """Hand ``idx`` to the background thread; False when its queue is full (the hint is dropped)."""
    global _prefetcher
    with _prefetcher_lock:
        if _prefetcher is None:
            _prefetcher = _Prefetcher()
        prefetcher = _prefetcher
    try:
        prefetcher.queue.put_nowait((readahead, idx))
    except queue.Full:
        return False
    return True


def _forget_prefetcher() -> None:
    # A forked child has no thread of its parent's, and the queue's lock may be held: start afresh.
    global _prefetcher, _prefetcher_lock
    _prefetcher, _prefetcher_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_prefetcher)
