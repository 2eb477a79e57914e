"""Datasets for tests/testing/test_testing.py: correct ones for CachedDataset, and a small cache of ours with flaws.

Everything here is importable by the spawned worker processes of
``mmapcache.testing.check_concurrent_access``.

``ToyCache`` is the kind of cache a user writes: one file, mapped, shared by
path. The file holds a count of the data slots taken, one record per index
(state byte and data slot) and the data slots. A load serves hits from the
file, computes the misses, then stores each one: **claim** the index record
with a kernel record lock (``lockf``, non-blocking: a live writer holds it),
take the next data slot under the count's lock, copy the bytes, publish
READY, release. A writer killed at any instant leaves its record WRITING and
the kernel drops its lock, so the next writer rewrites that slot.

``flaw`` breaks one rule, as caches that pass every single-process test do:

* ``"publish_first"``: the record says READY before the bytes are copied;
* ``"unlocked_claim"``: a writer appends -- copies the bytes into the next
  free data slot, then counts the slot as taken -- without the count's kernel
  lock, so two writers can take the same slot;
* ``"trusts_dead_writer"``: a reader that meets a WRITING record waits for its
  writer's lock and then returns the slot's bytes, without checking that the
  writer published them (a writer killed mid-copy leaves them torn).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

import numpy as np
import torch

from mmapcache import Cache, Field

EMPTY, WRITING, READY = 0, 1, 2
FLAWS = ("publish_first", "unlocked_claim", "trusts_dead_writer")
PAGE = 4096


# -- deterministic sources (the oracles) ---------------------------------------------------------


NBYTES = 512 * 1024
# Made at import, so that the worker processes (forks of one that imported this) share it.
_NOISE = np.random.default_rng(0).integers(0, 256, NBYTES, dtype=np.uint8)


class Blobs:
    """``length`` samples of ``nbytes`` uint8 each, distinct for every index and cheap to make."""

    def __init__(self, length: int = 48, nbytes: int = NBYTES) -> None:
        self.length = length
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return np.roll(_NOISE[: self.nbytes], 997 * index + 1)


class Images(torch.utils.data.Dataset[Any]):
    """``(image, label, extras)`` samples of fixed shapes: uint8 image, Python int label, a dict of two leaves."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> Any:
        rng = np.random.default_rng(index)
        image = torch.from_numpy(rng.integers(0, 256, (3, 16, 16), dtype=np.uint8))
        return image, index % 10, {"weight": np.float32(index) / 3, "box": rng.standard_normal(4)}


class Tokens(torch.utils.data.Dataset[Any]):
    """``(tokens, label)``: int64 token sequences of 0 to 11 tokens (declared with ``None``), and an int label."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> Any:
        rng = np.random.default_rng(index)
        return torch.from_numpy(rng.integers(0, 50_000, index % 12)), index % 3


TOKEN_FIELDS = {"0": Field((None,), "int64"), "1": Field((), "int64")}


class Failing:
    """No cache at all: ``i`` for every index, but loading index 7 raises ``OSError``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index == 7:
            raise OSError(f"cannot read sample 7 of {self.path}")
        return index

    @staticmethod
    def truth(index: int) -> int:
        return index


class Miscounting(Failing):
    """No cache at all, and wrong without any concurrency: odd indices have the wrong ``x``."""

    def __getitem__(self, index: int) -> Any:
        return torch.tensor(index), {"x": np.float32(index)}

    @staticmethod
    def truth(index: int) -> Any:
        return index, {"x": np.float32(index + index % 2)}


# -- a cache of our own ---------------------------------------------------------------------------


class ToyCache:
    """``source``'s samples (uint8 arrays of one size) cached in the file at ``path``; see the module docstring."""

    def __init__(self, source: Blobs, path: str, *, capacity: int | None = None, flaw: str | None = None) -> None:
        if flaw is not None and flaw not in FLAWS:
            raise ValueError(f"flaw must be one of {FLAWS} or None, not {flaw!r}")
        self.source = source
        self.path = path
        self.capacity = len(source) if capacity is None else capacity
        self.flaw = flaw
        self._fd: int | None = None

    def __len__(self) -> int:
        return len(self.source)

    # -- the file ---------------------------------------------------------------

    def _open(self) -> None:
        if self._fd is not None:
            return
        n, size = len(self.source), self.source.nbytes
        self._records_at = PAGE
        self._data_at = self._records_at + PAGE * -(-8 * n // PAGE)
        total = self._data_at + self.capacity * size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # one creator sizes the file; the others wait and find it sized
        if os.fstat(fd).st_size == 0:
            os.posix_fallocate(fd, 0, total)
        fcntl.flock(fd, fcntl.LOCK_UN)
        self._map = mmap.mmap(fd, total)
        self._end = np.ndarray((1,), np.uint64, self._map)  # data slots taken so far
        records = np.ndarray((n, 8), np.uint8, self._map, offset=self._records_at)
        self._states = records[:, 0]
        self._slots = records[:, 4:8].view(np.uint32)[:, 0]
        self._data = np.ndarray((self.capacity, size), np.uint8, self._map, offset=self._data_at)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            del self._end, self._states, self._slots, self._data
            self._map.close()
            os.close(self._fd)
            self._fd = None

    def _lock(self, offset: int, *, wait: bool) -> bool:
        assert self._fd is not None
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), 1, offset)
        except BlockingIOError:
            return False
        return True

    def _unlock(self, offset: int) -> None:
        assert self._fd is not None
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)

    # -- reading ----------------------------------------------------------------

    def __getitem__(self, index: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
        """Hits from the file; then the misses computed, and each one stored."""
        self._open()
        out: list[Any] = [self._hit(i) for i in indices]
        misses = [k for k, sample in enumerate(out) if sample is None]
        for k in misses:
            out[k] = self.source[indices[k]]
        for k in misses:
            self._store(indices[k], out[k])
        return out

    def _hit(self, i: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        state = self._states[i]
        if state == WRITING and self.flaw == "trusts_dead_writer":
            record = self._records_at + 8 * i
            self._lock(record, wait=True)  # the writer's claim: gone once it publishes -- or dies
            self._unlock(record)
            return self._copy(i)
        if state == READY:
            return self._copy(i)
        return None

    def _copy(self, i: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        data: np.ndarray[Any, np.dtype[np.uint8]] = self._data[int(self._slots[i])].copy()
        return data

    # -- writing ----------------------------------------------------------------

    def _store(self, i: int, value: np.ndarray[Any, Any]) -> None:
        record = self._records_at + 8 * i
        if not self._lock(record, wait=False):
            return  # a live writer has it
        try:
            state = self._states[i]
            if state == READY:
                return
            if state == WRITING:  # a dead writer's record: rewrite its data slot
                self._write(i, int(self._slots[i]), value)
            elif self.flaw == "unlocked_claim":
                self._append_unlocked(i, value)
            else:
                slot = self._take_slot()
                if slot is not None:
                    self._slots[i] = slot
                    self._states[i] = WRITING
                    self._write(i, slot, value)
        finally:
            self._unlock(record)

    def _write(self, i: int, slot: int, value: np.ndarray[Any, Any]) -> None:
        if self.flaw == "publish_first":
            self._states[i] = READY
            self._data[slot] = value
        else:
            self._data[slot] = value
            self._states[i] = READY

    def _take_slot(self) -> int | None:
        """The next free data slot, under the table's kernel lock; None when the cache is full."""
        self._lock(0, wait=True)
        try:
            slot = int(self._end[0])
            if slot >= self.capacity:
                return None
            self._end[0] = slot + 1
            return slot
        finally:
            self._unlock(0)

    def _append_unlocked(self, i: int, value: np.ndarray[Any, Any]) -> None:
        """The flaw: write at the end of the data, then move the end past it -- with no lock on the end."""
        slot = int(self._end[0])
        if slot >= self.capacity:
            return
        self._slots[i] = slot
        self._states[i] = WRITING
        self._data[slot] = value
        self._end[0] = slot + 1
        self._states[i] = READY


def toy(path: str, *, flaw: str | None = None, nbytes: int = NBYTES) -> ToyCache:
    """``make_dataset`` for the checker: ``functools.partial(toy, flaw=...)``."""
    return ToyCache(Blobs(nbytes=nbytes), path, flaw=flaw)


def blob(index: int, nbytes: int = NBYTES) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The oracle of ``toy``."""
    return Blobs(nbytes=nbytes)[index]


# -- a dataset over mmapcache's Cache, written as docs/guide.md shows --------------------------------

CACHE_LENGTH, CACHE_NBYTES = 40, 64 * 1024


def cache_sample(index: int) -> dict[str, Any]:
    """The oracle of ``CacheBacked``: the bytes and tag ``tests/_procs.py`` writes with tag 1."""
    from _procs import sample_data

    return {"data": sample_data(index, 1, CACHE_NBYTES), "tag": np.int32(1)}


class CacheBacked:
    """``cache_sample(i)`` for each index, cached in a ``Cache``: hits by ``get_many``, misses by ``put_many``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._cache: Cache | None = None

    @property
    def cache(self) -> Cache:
        if self._cache is None:
            from _procs import make_fields

            self._cache = Cache.open(self.path, make_fields(CACHE_NBYTES), CACHE_LENGTH)
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __len__(self) -> int:
        return CACHE_LENGTH

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        cache = self.cache
        hit = cache.contains_many(indices).tolist()
        hits = [i for i, h in zip(indices, hit, strict=True) if h]
        # Slots never go back from READY while processes fill, so what contains_many saw stays readable.
        got = cache.get_many(hits) if hits else {}
        rows = iter(range(len(hits)))
        out: list[dict[str, Any]] = []
        misses: dict[int, dict[str, Any]] = {}
        for i, h in zip(indices, hit, strict=True):
            if h:
                row = next(rows)
                out.append({"data": got["data"][row], "tag": got["tag"][row]})
            else:
                out.append(misses.setdefault(i, cache_sample(i)))
        if misses:  # False for slots another process stores first: fine, they hold the same bytes
            cache.put_many(
                list(misses), {name: np.stack([s[name] for s in misses.values()]) for name in ("data", "tag")}
            )
        return out
