"""Processes for tests/torch/test_torch_flight.py: jobs that read one CachedDataset through its loader.

Every function here runs in a *spawned* process (a fresh interpreter, as another
job is). The wrapped dataset is ``Slow``: ``Recorded`` (each load logged as one
``"pid ppid index"`` line of a shared file, so counting lines counts loads
across every process) that also takes ``delay`` seconds per sample.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from pathlib import Path
from typing import Any

from torch_helpers import Recorded, check_batch

from mmapcache.torch import CachedDataset

SPAWN = multiprocessing.get_context("spawn")


class Slow(Recorded):
    """``Recorded`` whose every sample takes ``delay`` seconds to load (a decode, a fetch)."""

    def __init__(self, length: int, log: str | os.PathLike[str] | None = None, delay: float = 0.0) -> None:
        super().__init__(length, log)
        self.delay = delay

    def __getitem__(self, index: int) -> Any:
        sample = super().__getitem__(index)
        time.sleep(self.delay)
        return sample


def read_epochs(
    path: str,
    length: int,
    log: str,
    delay: float,
    order: list[int],
    barrier: Any,
    results: Any,
    options: dict[str, Any],
) -> None:
    """One job: a CachedDataset over ``Slow``, ``epochs`` epochs of ``order`` through ``ds.loader()``."""
    ds = CachedDataset(Slow(length, log, delay), path, key="slow/v1", check=options.get("check", 0))
    workers = options.get("workers", 0)
    loader = ds.loader(
        batch_size=options.get("batch_size", 8),
        sampler=order,
        num_workers=workers,
        multiprocessing_context=options.get("context") if workers else None,
    )
    if barrier is not None:
        barrier.wait(timeout=60)
    seen: list[int] = []
    for _ in range(options.get("epochs", 1)):
        for batch in loader:
            seen += check_batch(batch)
    results.put({"pid": os.getpid(), "seen": seen, **ds.stats()})


def read_pickled(pickled: str, indices: list[int], out: str) -> None:
    """Unpickle a CachedDataset and read ``indices``; write what happened (or the error) to ``out``."""
    ds = pickle.loads(Path(pickled).read_bytes())
    try:
        for i in indices:
            ds[i]
        Path(out).write_text("ok")
    except Exception as error:  # reported to the test, which asserts on it
        Path(out).write_text(f"{type(error).__name__}: {error}")


def read_pickled_orphaned(pickled: str, indices: list[int], out: str) -> None:
    """:func:`read_pickled` in a grandchild whose parent exits first: a process of no job of the caller's."""
    parent = os.getpid()
    if os.fork():
        os._exit(0)
    os.setsid()
    deadline = time.monotonic() + 30
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    read_pickled(pickled, indices, out)
    os._exit(0)
