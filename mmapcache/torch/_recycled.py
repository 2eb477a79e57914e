"""Batch buffers read into again once nothing refers to them: warm epochs without page faults.

A batch of large rows is tens of MiB (256 rows of 147 KB: 37 MiB). Gathered into fresh memory each
time, every page of it is faulted in and zeroed by the kernel first — a third of a warm epoch at that
size, more than the copy of the rows. :class:`Recycled` keeps the storage arrays of the last few batches
a loader made and reads a later batch into one of them once nothing but the pool refers to it: no
tensor, view, storage or array made from that batch is left. CPython's reference counts say so exactly
(a tensor made by ``torch.from_numpy`` holds its array through its storage, and every view of the tensor
holds that storage). A batch that is kept — in a list, as a tensor autograd saved, as a ``.numpy()``
view — is never written again: the next batch goes to fresh memory instead, as without the pool.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Recycled"]

_KEEP = 3  # batches kept: the one the training loop holds, one a prefetching fetcher holds, one free
_MAX_BYTES = 256 << 20  # the kept batches' bytes, at most (a larger batch is not kept: it goes back at once)
# References to a kept array that is free: the pool's list, the generator's variable, getrefcount's argument.
_FREE = 3


class Recycled:
    """The storage arrays of a loader's recent batches (see the module docstring); safe across threads.

    Batches are told apart by a ``key`` (what made them: a cache's :class:`~mmapcache._region.FixedRows`,
    a mixture) and their row count; arrays of one key and count have one layout.
    """

    def __init__(self) -> None:
        self._kept: list[tuple[object, int, list[np.ndarray[Any, Any]]]] = []
        self._lock = threading.Lock()

    def take(
        self, key: object, count: int, make: Callable[[int], list[np.ndarray[Any, Any]]]
    ) -> list[np.ndarray[Any, Any]]:
        """Outputs for a batch of ``count`` rows: a kept batch of ``key`` nothing refers to, or ``make(count)``.

        A kept batch handed out leaves the pool until :meth:`keep` gives it back (another thread never gets it).
        """
        with self._lock:
            for k, (made_by, rows, arrays) in enumerate(self._kept):
                if made_by is key and rows == count and _free(arrays):
                    return self._kept.pop(k)[2]
        return make(count)

    def keep(self, key: object, arrays: list[np.ndarray[Any, Any]]) -> None:
        """Offer ``arrays`` (a batch being handed out: tensors over them exist now) for a later batch."""
        nbytes = sum(array.nbytes for array in arrays)
        if not arrays or nbytes > _MAX_BYTES:
            return
        with self._lock:
            kept = self._kept
            # The oldest go first: still held by the caller (else they would have been taken).
            while kept and (len(kept) >= _KEEP or nbytes + sum(a.nbytes for _, _, b in kept for a in b) > _MAX_BYTES):
                del kept[0]
            kept.append((key, len(arrays[0]), arrays))


def _free(arrays: list[np.ndarray[Any, Any]]) -> bool:
    return all(sys.getrefcount(array) <= _FREE for array in arrays)
