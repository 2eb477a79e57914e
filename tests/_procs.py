"""Real worker processes for the concurrency tests: each one serves cache operations over a pipe.

A :class:`Worker` is a *spawned* Python process (a fresh interpreter, nothing
inherited from pytest) that holds at most one open :class:`~mmapcache.Cache`
and runs the operations the test sends it, one at a time. This module imports
only numpy and mmapcache, so a worker starts in about a tenth of a second.

Sample data is deterministic: the bytes stored at ``index`` by a writer using
``tag`` are :func:`sample_data` ``(index, tag)``, and the ``tag`` field records
the tag. A reader can therefore check any sample it sees on its own: the
bytes must equal ``sample_data(index, stored_tag)``. Writers of one slot use
different tags, so a slot whose bytes mixed two writers' puts cannot pass.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

import mmapcache
from mmapcache import Cache, Field

__all__ = [
    "Worker",
    "WorkerPool",
    "check_sample",
    "make_batch",
    "make_fields",
    "sample_data",
    "stop_all",
]

SPAWN = multiprocessing.get_context("spawn")


def make_fields(nbytes: int) -> dict[str, Field]:
    """The schema every test cache uses: ``nbytes`` of sample data and the writer's tag."""
    return {"data": Field((nbytes,), "uint8"), "tag": Field((), "int32")}


@functools.lru_cache(maxsize=64)
def _base(tag: int, words: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.random.default_rng(tag).integers(0, 2**64, words, dtype=np.uint64, endpoint=False)


def sample_data(index: int, tag: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes a writer with ``tag`` stores at ``index``: pseudo-random, a pure function of both.

    A random block per tag, plus a per-index constant added to every 8-byte
    word (wrapping): distinct for every (index, tag), and cheap enough (a few
    µs for 256 KiB) that writers spend their time inside ``put``.
    """
    words = _base(tag, -(-nbytes // 8))
    offset = np.uint64((index + 1) * 0x9E3779B97F4A7C15 % 2**64)
    data: np.ndarray[Any, np.dtype[np.uint8]] = (words + offset).view(np.uint8)[:nbytes]
    return data


def make_sample(index: int, tag: int, nbytes: int) -> dict[str, Any]:
    return {"data": sample_data(index, tag, nbytes), "tag": tag}


def make_batch(indices: Sequence[int], tag: int, nbytes: int) -> dict[str, Any]:
    data = np.empty((len(indices), nbytes), np.uint8)
    for row, index in enumerate(indices):
        data[row] = sample_data(index, tag, nbytes)
    return {"data": data, "tag": np.full(len(indices), tag, np.int32)}


def check_sample(index: int, data: np.ndarray[Any, Any], tag: int) -> bool:
    """Whether ``data`` is exactly what the writer with ``tag`` stored at ``index``."""
    return bool(np.array_equal(data, sample_data(index, tag, data.shape[-1])))


# -- the worker side ------------------------------------------------------------


class _Server:
    """Runs in the worker process: one open cache, one operation at a time."""

    def __init__(self, conn: multiprocessing.connection.Connection, barrier: Any) -> None:
        self.conn = conn
        self.barrier = barrier
        self.cache: Cache | None = None
        self.logs: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: self.logs.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("mmapcache")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    @property
    def open_cache(self) -> Cache:
        if self.cache is None:
            raise RuntimeError("the worker has no cache open")
        return self.cache

    def nbytes(self) -> int:
        return self.open_cache.fields["data"].fixed_shape[0]

    # Operations: op_<name>(*args) -> picklable result.

    def op_open(self, path: str, nbytes: int | None, length: int | None, kwargs: dict[str, Any]) -> int:
        if self.cache is not None:
            self.cache.close()
        fields = make_fields(nbytes) if nbytes is not None else None
        self.cache = Cache.open(path, fields, length, **kwargs)
        return self.cache.capacity

    def op_race_open(self, path: str, nbytes: int, length: int, capacity: int) -> dict[str, Any]:
        """Wait at the barrier with every other worker, then open-or-create ``path``."""
        self.logs.clear()
        self.barrier.wait(timeout=60)
        self.cache = Cache.open(path, make_fields(nbytes), length, capacity=capacity, timeout=60)
        return {
            "ino": os.stat(path).st_ino,
            "creator": self.cache.created["pid"],
            "capacity": self.cache.capacity,
            "logs": list(self.logs),
        }

    def op_close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    # The samples this server writes; a server for another schema overrides these two.

    def sample(self, index: int, tag: int) -> dict[str, Any]:
        return make_sample(index, tag, self.nbytes())

    def batch(self, indices: Sequence[int], tag: int) -> dict[str, Any]:
        return make_batch(indices, tag, self.nbytes())

    def op_put(self, indices: list[int], tag: int) -> list[bool]:
        cache = self.open_cache
        return [cache.put(i, self.sample(i, tag)) for i in indices]

    def op_put_many(self, indices: list[int], tag: int) -> list[bool]:
        stored = self.open_cache.put_many(indices, self.batch(indices, tag))
        return [bool(s) for s in stored]

    def op_kill_me_in_put_many(self, indices: list[int], tag: int) -> None:
        """Say "started" once the batch is made, then write it: the test kills us during the put."""
        batch = self.batch(indices, tag)
        self.conn.send(("started", None))
        self.open_cache.put_many(indices, batch)

    def op_fill(self, indices: list[int], tag: int, batch: int) -> list[int]:
        """Fill ``indices`` in order (``put`` if ``batch`` is 1, else ``put_many`` in chunks).

        Says "started" first; returns the indices whose put returned True.
        """
        cache = self.open_cache
        self.conn.send(("started", None))
        stored: list[int] = []
        for start in range(0, len(indices), batch):
            # As a dataset would: compute only what is not cached yet.
            chunk = indices[start : start + batch]
            chunk = [i for i, cached in zip(chunk, cache.contains_many(chunk), strict=True) if not cached]
            if not chunk:
                continue
            if batch == 1:
                if cache.put(chunk[0], self.sample(chunk[0], tag)):
                    stored.append(chunk[0])
            else:
                won = cache.put_many(chunk, self.batch(chunk, tag))
                stored.extend(i for i, w in zip(chunk, won.tolist(), strict=True) if w)
        return stored

    def op_read(self, indices: list[int]) -> list[tuple[int, bytes] | None]:
        """``get`` each index: ``(tag, data bytes)`` or None when not cached."""
        cache = self.open_cache
        out: list[tuple[int, bytes] | None] = []
        for i in indices:
            sample = cache.get(i)
            out.append(None if sample is None else (int(sample["tag"]), sample["data"].tobytes()))
        return out

    def op_read_many(self, indices: list[int]) -> tuple[str, Any]:
        """``get_many``: ``("ok", [(tag, bytes), ...])`` or ``("missing", sorted missing indices)``."""
        try:
            batch = self.open_cache.get_many(indices)
        except KeyError as error:
            missing = getattr(error, "missing", None)
            if missing is None:
                raise
            return "missing", sorted(int(i) for i in missing)
        return "ok", [(int(t), d.tobytes()) for t, d in zip(batch["tag"], batch["data"], strict=True)]

    def op_contains(self, indices: list[int]) -> list[bool]:
        return [bool(c) for c in self.open_cache.contains_many(indices)]

    def op_verify(self, fix: bool) -> list[tuple[str, int | None, bool]]:
        return [(p.kind, p.index, p.fixed) for p in self.open_cache.verify(fix=fix)]

    def op_clear(self) -> None:
        self.open_cache.clear()

    def op_filled(self) -> int:
        return self.open_cache.filled

    def op_read_random(self, length: int, seed: int) -> dict[str, Any]:
        """Read at random (get, get_many, contains) until the test sends anything; check every hit.

        Says "started" first. Returns how many samples were read, how many
        READY ones were checked, in how many rounds the cache was seen partly
        filled, and the indices of bad reads.
        """
        cache, rng = self.open_cache, random.Random(seed)
        self.conn.send(("started", None))
        checked, reads, partial, bad = 0, 0, 0, []
        while not self.conn.poll():
            ready = np.flatnonzero(cache.contains_many(range(length)))
            partial += 0 < len(ready) < length
            # get_many of slots seen READY: slots never go back while filling.
            picked = sorted(rng.sample(ready.tolist(), min(16, len(ready))))
            if picked:
                batch = cache.get_many(picked)
                for i, data, tag in zip(picked, batch["data"], batch["tag"], strict=True):
                    checked += 1
                    if not check_sample(i, data, int(tag)):
                        bad.append(i)
            for _ in range(16):
                i = rng.randrange(length)
                sample = cache.get(i)
                reads += 1
                if sample is not None:
                    checked += 1
                    if not check_sample(i, sample["data"], int(sample["tag"])):
                        bad.append(i)
        self.conn.recv()
        return {"checked": checked, "reads": reads + checked, "partial": partial, "bad": bad}

    def op_churn(self, path: str, nbytes: int, length: int, seconds: float, remover: bool) -> dict[str, Any]:
        """For ``seconds``: open-or-create, put, check, close, again -- or, as the remover, try to remove.

        While a handle is open its file must stay the one at ``path`` (remove
        refuses caches in use). Returns counts, the mismatches, and the log
        lines about creating files.
        """
        target = Path(path)
        counts = {"opened": 0, "removed": 0, "refused": 0, "missing": 0}
        mismatches: list[str] = []
        self.logs.clear()
        self.conn.send(("started", None))
        deadline = time.monotonic() + seconds
        rng = random.Random(os.getpid())
        while time.monotonic() < deadline:
            if remover:
                try:
                    mmapcache.remove(target)
                    counts["removed"] += 1
                except mmapcache.CacheInUseError:
                    counts["refused"] += 1
                except FileNotFoundError:
                    counts["missing"] += 1
                time.sleep(rng.uniform(0, 0.002))
                continue
            with Cache.open(target, make_fields(nbytes), length, timeout=30) as cache:
                counts["opened"] += 1
                index = rng.randrange(length)
                stored = cache.put(index, make_sample(index, 1, nbytes))
                held = os.fstat(cache._handle.fd)
                try:
                    now = os.stat(target)
                except FileNotFoundError:
                    mismatches.append("the file of an open cache was removed")
                else:
                    if not os.path.samestat(held, now):
                        mismatches.append("the path of an open cache points to another file")
                # (put may lose to another process still writing the slot: then it may not be READY yet.)
                if stored and cache.get(index) is None:
                    mismatches.append(f"slot {index} not readable after its put succeeded")
            # A short pause: on a loaded machine, openers that never pause overlap without end and
            # the remover never finds the file unused.
            time.sleep(rng.uniform(0, 0.0005))
        logs = [m for m in self.logs if m.startswith("created ") or "appeared while" in m]
        return {"counts": counts, "mismatches": mismatches, "logs": logs}

    def op_in_use(self, path: str) -> bool:
        return mmapcache.in_use(path)

    def op_remove(self, path: str, force: bool) -> None:
        mmapcache.remove(path, force=force)

    def serve(self) -> None:
        while True:
            try:
                op, args = self.conn.recv()
            except EOFError:
                return
            if op == "exit":
                self.op_close()
                self.conn.send(("ok", None))
                return
            try:
                method: Callable[..., Any] = getattr(self, f"op_{op}")
                reply: tuple[str, Any] = ("ok", method(*args))
            except Exception as error:
                reply = ("error", error)
            try:
                self.conn.send(reply)
            except Exception as error:  # an unpicklable error: send its text
                self.conn.send(("error", RuntimeError(f"{type(error).__name__}: {error}")))


def _serve(conn: multiprocessing.connection.Connection, barrier: Any) -> None:
    _Server(conn, barrier).serve()


# -- the test side ----------------------------------------------------------------


class WorkerDiedError(RuntimeError):
    """The worker process exited (or was killed) instead of answering."""


class Worker:
    """A spawned process running cache operations for the test; see :class:`_Server`."""

    def __init__(self, *, barrier: Any = None) -> None:
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_serve, args=(child, barrier), daemon=True)
        self.process.start()
        child.close()
        self.op = ""

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def send(self, op: str, *args: Any) -> None:
        self.op = op
        self.conn.send((op, args))

    def _reply(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.pid} did not answer {self.op!r} within {timeout} s")
        try:
            reply: tuple[str, Any] = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise WorkerDiedError(
                f"worker {self.pid} died during {self.op!r} (exit code {self.process.exitcode})"
            ) from None
        return reply

    def recv(self, timeout: float = 60.0) -> Any:
        status, value = self._reply(timeout)
        if status == "error":
            raise value
        if status != "ok":
            raise AssertionError(f"worker {self.pid}: expected a result of {self.op!r}, got {status!r}")
        return value

    def wait_started(self, timeout: float = 60.0) -> None:
        status, value = self._reply(timeout)
        if status == "error":
            raise value
        assert status == "started", (status, value)

    def call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        self.send(op, *args)
        return self.recv(timeout)

    def sigkill(self) -> None:
        """SIGKILL the process now, without waiting for it (:meth:`kill` reaps it)."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        self.conn.close()

    def stop(self) -> None:
        """Close its cache and let it exit; kill it if it does not."""
        if self.alive and not self.conn.closed:
            try:
                self.conn.send(("exit", ()))
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.process.join(10)
        if not self.conn.closed:
            self.kill()
        elif self.alive:
            os.kill(self.pid, signal.SIGKILL)
            self.process.join(10)


_W = TypeVar("_W", bound="Worker")


class WorkerPool(Generic[_W]):
    """Spawned workers started one round ahead, so spawning overlaps the previous round."""

    def __init__(self, make: Callable[[], _W]) -> None:
        self.make = make
        self.ready: list[_W] = []

    def take(self, n: int) -> list[_W]:
        while len(self.ready) < 2 * n:
            self.ready.append(self.make())
        taken, self.ready = self.ready[:n], self.ready[n:]
        return taken

    def close(self) -> None:
        stop_all(self.ready)


def stop_all(workers: Sequence[Worker]) -> None:
    for worker in workers:
        worker.stop()


def sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)
