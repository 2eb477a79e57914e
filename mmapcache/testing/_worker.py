"""The processes of :mod:`mmapcache.testing`: each one holds the dataset under test and loads on command.

A :class:`Process` is a fork of the :class:`Zygote`, a *spawned* Python
process (a fresh interpreter, like a DataLoader worker with the spawn start
method, a DDP rank or another job) that unpickled ``make_dataset`` and
``oracle`` and does nothing else. A worker calls ``make_dataset(path)`` when told to open, loads batches of indices from
that dataset, and compares every sample with ``oracle(index)`` itself, so that
only short descriptions of differences travel back over the pipe (never the
samples: torch would move tensors through shared memory files).

This module imports neither Hypothesis nor torch: a worker starts as fast as
the user's dataset lets it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._compare import difference
from .._errors import CacheError

__all__ = ["Process", "StepError", "Zygote", "wait_until"]

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT = 60.0  # seconds a process may take to answer one command: a hang is a failure too
_SHOWN = 3  # differences a load reports at most (the first ones)

Loaded = dict[str, Any]  # what a load reports: {"seconds": float, "wrong": [descriptions]}


class StepError(Exception):
    """A process could not carry out a step: the dataset raised, the process died, or it hung."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.summary = summary
        self.details = details


# -- the worker side --------------------------------------------------------------


def load(dataset: Any, indices: Sequence[int], *, by_item: bool) -> list[Any]:
    """``dataset.__getitems__(indices)`` when it has one (as DataLoader calls it), else ``dataset[i]`` each."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None and not by_item:
        return list(getitems(list(indices)))
    return [dataset[i] for i in indices]


def check(oracle: Callable[[int], Any], indices: Sequence[int], samples: Sequence[Any]) -> list[str]:
    """How the loaded ``samples`` differ from the oracle's, one line per wrong index (at most a few)."""
    if len(samples) != len(indices):
        return [f"{len(samples)} samples came back for {len(indices)} indices"]
    wrong = []
    for i, sample in zip(indices, samples, strict=True):
        found = difference(sample, oracle(i))
        if found is not None:
            wrong.append(f"index {i}: {found}")
            if len(wrong) == _SHOWN:
                break
    return wrong


def _check_batch(oracle: Callable[[int], Any], indices: list[int], samples: list[Any]) -> list[str]:
    """A DataLoader ``collate_fn``: compare in the DataLoader worker, send back only the differences."""
    return check(oracle, indices, samples)


class _Server:
    """Runs in the worker process: at most one dataset, one command at a time."""

    def __init__(
        self,
        conn: multiprocessing.connection.Connection,
        make_dataset: Callable[[str], Any],
        oracle: Callable[[int], Any],
    ) -> None:
        self.conn = conn
        self.make_dataset = make_dataset
        self.oracle = oracle
        self.dataset: Any = None

    def op_open(self, path: str) -> int:
        self.op_close()
        self.dataset = self.make_dataset(path)
        return len(self.dataset)

    def op_probe(self, path: str) -> tuple[int, bool]:
        """The dataset's length, and whether it keeps its samples in an mmapcache Cache (at a scratch path)."""
        length = self.op_open(path)
        mmapcache = length > 0 and _mmapcache_of(self.dataset) is not None
        self.op_close()
        return length, mmapcache

    def op_close(self) -> None:
        dataset, self.dataset = self.dataset, None
        close = getattr(dataset, "close", None)
        if callable(close):
            close()
        elif dataset is not None:
            del dataset
            gc.collect()  # a cache without close() lets go of its file when collected (~0.1 s with torch)

    def op_load(self, indices: list[int], by_item: bool, start_at: float, announce: bool) -> Loaded:
        """Load ``indices`` at ``start_at`` (time.monotonic, shared by all processes); say "started" if asked."""
        wait_until(start_at)
        if announce:
            self.conn.send(("started", time.monotonic()))
        start = time.perf_counter()
        samples = load(self.dataset, indices, by_item=by_item)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "wrong": check(self.oracle, indices, samples)}

    def op_forked_load(self, indices: list[int]) -> Loaded:
        """Load in a child forked from this process, which holds the dataset (a DataLoader worker if torch's)."""
        start = time.perf_counter()
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(self.dataset, torch.utils.data.Dataset):
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=[indices],
                num_workers=1,
                multiprocessing_context="fork",
                collate_fn=functools.partial(_check_batch, self.oracle, indices),
                timeout=TIMEOUT,
            )
            (wrong,) = list(loader)
        else:
            wrong = self._in_child(indices)
        return {"seconds": time.perf_counter() - start, "wrong": wrong}

    def _in_child(self, indices: list[int]) -> list[str]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: load, report, and leave without running the parent's cleanup
            os.close(read)
            try:
                payload = pickle.dumps(("ok", check(self.oracle, indices, load(self.dataset, indices, by_item=False))))
            except BaseException as error:
                payload = pickle.dumps(("error", _error_text(error), traceback.format_exc()))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            data = answer.read()
        _, status = os.waitpid(pid, 0)
        if not data:
            raise StepError(f"the forked child died ({_exit_text(status)})")
        reply = pickle.loads(data)
        if reply[0] == "error":
            raise StepError(f"the forked child raised {reply[1]}", reply[2])
        wrong: list[str] = reply[1]
        return wrong

    def op_observe(self, path: str, indices: list[int]) -> dict[str, Any]:
        """Open ``path`` afresh, report which slots an mmapcache cache holds, load ``indices`` and those, close."""
        self.op_open(path)
        cache = _mmapcache_of(self.dataset)
        cached = None if cache is None else np.flatnonzero(cache.contains_many(range(cache.capacity))).tolist()
        everything = sorted(set(indices) | set(cached or []))
        samples = load(self.dataset, everything, by_item=False) if everything else []
        wrong = check(self.oracle, everything, samples)
        self.op_close()
        return {"cached": cached, "wrong": wrong, "loaded": len(everything)}

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
                reply: tuple[Any, ...] = ("ok", getattr(self, f"op_{op}")(*args))
            except StepError as error:
                reply = ("error", error.summary, error.details)
            except Exception as error:
                reply = ("error", f"raised {_error_text(error)}", traceback.format_exc())
            self.conn.send(reply)


def wait_until(moment: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``moment`` (one clock for every process), spinning at the end."""
    while (left := moment - time.monotonic()) > 0:
        time.sleep(left - 0.001 if left > 0.002 else 0)


def _mmapcache_of(dataset: Any) -> Any:
    """The :class:`~mmapcache.Cache` behind ``dataset`` (``dataset.cache``, as CachedDataset has), or None."""
    from ..cache import Cache

    if not isinstance(getattr(type(dataset), "cache", None), property):
        return None
    try:
        cache = dataset.cache
    except CacheError:
        return None
    return cache if isinstance(cache, Cache) else None


def _error_text(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _zygote(
    control: multiprocessing.connection.Connection, make_dataset: Callable[[str], Any], oracle: Callable[[int], Any]
) -> None:
    """The spawned process the workers are forked from: one fork per connection it receives."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    while True:
        try:
            conn = control.recv()
        except EOFError:
            return
        if conn is None:
            return
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a worker waits for the children it forks
            try:
                _Server(conn, make_dataset, oracle).serve()
            finally:
                os._exit(0)  # not back into the zygote's loop, nor its exit handlers
        conn.close()
        control.send(pid)


# -- the checker's side ------------------------------------------------------------


class Process:
    """A worker process holding the dataset under test; see :class:`_Server`."""

    def __init__(self, conn: multiprocessing.connection.Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.op = ""
        self.broken = False  # it died or hung: its pipe can no longer be trusted to answer in order

    def send(self, op: str, *args: Any) -> None:
        self.op = op
        self.conn.send((op, args))

    def answered(self) -> bool:
        """Whether a reply is waiting (without reading it)."""
        return self.conn.poll()

    def _receive(self, timeout: float, expected: str) -> Any:
        """The next message, which must have status ``expected``; :class:`StepError` otherwise, or if none comes."""
        if not self.conn.poll(timeout):
            self.broken = True
            raise StepError(f"did not answer within {timeout:.0f} s (a hang: a deadlock, or a lock never released?)")
        try:
            status, *value = self.conn.recv()
        except (EOFError, OSError):
            self.broken = True
            raise StepError("died (crashed, or killed by a signal)") from None
        if status == "error":
            raise StepError(value[0], value[1])
        if status != expected:
            self.broken = True
            raise StepError(f"answered {status!r} instead of {expected!r}")
        return value[0]

    def reply(self, timeout: float = TIMEOUT) -> Any:
        """The result of the command sent last; :class:`StepError` if it raised, the process died or hung."""
        return self._receive(timeout, "ok")

    def wait_started(self) -> float:
        """Wait for the "started" a load sends when asked to announce itself; the ``time.monotonic()`` it started."""
        started: float = self._receive(TIMEOUT, "started")
        return started

    def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.reply()

    def kill(self) -> None:
        """SIGKILL (no cleanup, no atexit, no finally blocks run), then wait until it is gone."""
        if self.conn.closed:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        try:  # its end of the pipe closes when it exits
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                self.conn.recv()
        except (EOFError, OSError):
            pass
        self.conn.close()

    def stop(self) -> None:
        """Close the dataset and let the process exit; kill it if it does not."""
        if self.conn.closed:
            return
        with contextlib.suppress(StepError, OSError, EOFError):
            self.call("exit")
        self.kill()


class Zygote:
    """A spawned process that has unpickled ``make_dataset`` and ``oracle``; workers are forks of it.

    A fresh worker then costs a fork, not a new interpreter importing torch;
    it still shares nothing with the checker's process, and calls
    ``make_dataset(path)`` itself.
    """

    def __init__(self, make_dataset: Callable[[str], Any], oracle: Callable[[int], Any]) -> None:
        self.conn, child = SPAWN.Pipe()
        # Not a daemon: its forks must be allowed to start DataLoader workers.
        self.process = SPAWN.Process(target=_zygote, args=(child, make_dataset, oracle), daemon=False)
        self.process.start()
        child.close()

    def fork(self) -> Process:
        ours, theirs = SPAWN.Pipe()
        self.conn.send(theirs)
        theirs.close()
        if not self.conn.poll(TIMEOUT):
            raise StepError(f"the process that starts workers did not answer within {TIMEOUT:.0f} s")
        try:
            pid = int(self.conn.recv())
        except (EOFError, OSError):
            raise StepError(f"the process that starts workers died (exit code {self.process.exitcode})") from None
        return Process(ours, pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(10)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
        self.conn.close()
