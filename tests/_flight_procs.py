"""Processes for tests/region/test_flight.py: loaders that share a cache by path and log every load they make.

Every function here runs in a *spawned* process (a fresh interpreter, as
another job or a spawn DataLoader worker is). A load appends one line
``"<pid> <index>"`` per sample to a log file opened with ``O_APPEND`` (each
line one ``write``, so lines from many processes never mix): counting the
lines of an index counts its loads across every process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmapcache import Cache, Field

SPAWN = multiprocessing.get_context("spawn")
FIXED = {"x": Field((4,), "float32"), "i": Field((), "int64")}
VARIABLE = {"tokens": Field((None,), "int32"), "text": Field((None,), "str"), "i": Field((), "int64")}


def start(procs: list[Any], target: Any, *args: Any) -> Any:
    """A spawned process running ``target(*args)``, recorded in ``procs`` (the test's fixture ends them)."""
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    procs.append(proc)
    return proc


def sample(index: int, *, variable: bool = False) -> dict[str, Any]:
    """The one true sample at ``index`` (what every loader returns, and every read must)."""
    if variable:
        return {"tokens": np.arange(index % 7, dtype=np.int32) * index, "text": "é" * (index % 5), "i": index}
    return {"x": np.full(4, index * 0.5, np.float32), "i": index}


def wrong_rows(batch: dict[str, Any], indices: Sequence[int], *, variable: bool = False) -> list[int]:
    """The indices whose row of ``batch`` differs from :func:`sample`."""
    bad = []
    for row, i in enumerate(indices):
        want = sample(i, variable=variable)
        for name, value in want.items():
            got = batch[name][row]
            same = got == value if isinstance(value, str) else np.array_equal(np.asarray(got), np.asarray(value))
            if not same:
                bad.append(i)
                break
    return bad


def logged_load(log: str, delay: float, *, variable: bool = False, started: str | None = None) -> Any:
    """A ``load`` that logs each index it loads, sleeps ``delay`` per sample, and may touch ``started`` first."""

    def load(indices: list[int]) -> list[dict[str, Any]]:
        if started is not None:
            Path(started).touch()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            out = []
            for i in indices:
                os.write(fd, f"{os.getpid()} {i}\n".encode())
                time.sleep(delay)
                out.append(sample(i, variable=variable))
            return out
        finally:
            os.close(fd)

    return load


def loads(log: Path) -> dict[int, int]:
    """How many times each index was loaded, by every process (from the log)."""
    counts: dict[int, int] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            i = int(line.split()[1])
            counts[i] = counts.get(i, 0) + 1
    return counts


def load_batch(
    path: str,
    indices: list[int],
    log: str,
    delay: float,
    barrier: Any,
    results: Any,
    options: dict[str, Any],
) -> None:
    """Open the cache, meet the others at ``barrier``, ``get_or_load_many`` once; report on ``results``."""
    variable = options.pop("variable", False)
    started = options.pop("started", None)
    rounds = options.pop("rounds", 1)
    with Cache.open(path) as cache:
        if barrier is not None:
            barrier.wait(timeout=60)
        begin = time.monotonic()
        wrong: list[int] = []
        loaded = 0
        for _ in range(rounds):
            batch, mask = cache.get_or_load_many(
                indices, logged_load(log, delay, variable=variable, started=started), **options
            )
            wrong += wrong_rows(batch, indices, variable=variable)
            loaded += int(mask.sum())
        results.put({"pid": os.getpid(), "wrong": wrong, "loaded": loaded, "seconds": time.monotonic() - begin})


def hold_then_sleep(path: str, indices: list[int], started: str, seconds: float) -> None:
    """Hold ``indices`` (claim_many), say so by touching ``started``, then sleep: a loader that is stuck or dies."""
    with Cache.open(path) as cache, cache.claim_many(indices) as claims:
        assert len(claims) == len(indices), claims
        Path(started).touch()
        time.sleep(seconds)


def hold_then_store(path: str, indices: list[int], started: str, seconds: float) -> None:
    """Hold ``indices``, say so, load them in ``seconds``, then store them: a slow but healthy loader."""
    with Cache.open(path) as cache, cache.claim_many(indices) as claims:
        Path(started).touch()
        time.sleep(seconds)
        claims.put_many(claims.indices, {"x": [sample(i)["x"] for i in indices], "i": list(indices)})


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.005)


class FlightDataset:
    """A map-style dataset whose misses go through ``get_or_load_many`` (for ``check_concurrent_access``)."""

    def __init__(self, path: str, length: int = 24) -> None:
        self.length = length
        self.cache = Cache.open(path, VARIABLE, length, max_bytes="4MiB")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.cache.get_or_load(index, truth)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        batch, _ = self.cache.get_or_load_many(indices, _slow_truths, timeout=5.0)
        return [{name: batch[name][row] for name in VARIABLE} for row in range(len(indices))]


def truth(index: int) -> dict[str, Any]:
    return sample(index, variable=True)


def _slow_truths(indices: list[int]) -> list[dict[str, Any]]:
    time.sleep(0.002 * len(indices))  # slow enough to be waited for, and to be killed in the middle of
    return [truth(i) for i in indices]
