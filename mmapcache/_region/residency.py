"""How much of a file is in the page cache (RAM) now: ``mincore`` over a read-only mapping of it.

Mapping a file and asking ``mincore`` faults nothing in and reads nothing:
the kernel reports, page by page, whether the file's page is in the page
cache. (Since Linux 5.2 it reports that only for files the caller owns or may
write, else only pages mapped by the caller itself — cache files are the
user's own.) The file is looked at in windows of :data:`WINDOW` bytes, so a
100 GB cache needs a 256 KiB vector at a time, not 25 MB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any

import numpy as np

__all__ = ["WINDOW", "resident_bytes"]

WINDOW = 2**30
_PAGE = mmap.PAGESIZE

_libc: Any = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the file at ``path`` that are in memory now (a multiple of the page size, at most its size)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        pages = sum(_resident_pages(fd, start, min(WINDOW, size - start)) for start in range(0, size, WINDOW))
    finally:
        os.close(fd)
    return min(pages * _PAGE, size)


def _resident_pages(fd: int, offset: int, length: int) -> int:
    mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
    try:
        view = np.frombuffer(mm, np.uint8)
        vector = np.zeros(-(-length // _PAGE), np.uint8)
        if _mincore(view.ctypes.data, length, vector.ctypes.data) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        del view  # the buffer export must end before the mapping is closed
        return int(np.count_nonzero(vector & 1))
    finally:
        mm.close()
