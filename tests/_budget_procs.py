"""Processes of the budget tests, run as ``python tests/_budget_procs.py COMMAND ARGS...``.

Each imports only numpy and mmapcache and speaks over stdout, one line at a time:

- ``job DIR NAME LENGTH ROW ROLE STOP [GO]``: a job using the cache ``DIR/NAME`` (``LENGTH`` rows of
  ``ROW`` bytes): prints ``ready`` and once ``GO`` exists opens (or creates) it, fills the slots
  ``i % 2 == ROLE`` of its capacity, reads them back, prints one JSON line (``capacity``, ``filled``,
  ``bad``), and keeps the cache open until ``STOP`` exists.
- ``create DIR NAME LENGTH ROW``: prints ``ready``, creates the cache, prints ``done`` and exits (killed
  at random points by the crash test).
- ``fill DIR LENGTH ROW NAME...``: creates every cache and fills all its slots, printing one JSON line
  per cache (``refused`` for one the budget has no room for); the memory cgroup test runs it in a cgroup.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from mmapcache import Cache, CacheSpaceError, Field


def fields(row: int) -> dict[str, Field]:
    return {"x": Field((row,), "uint8")}


def row_of(index: int, row: int) -> np.ndarray:
    return np.full(row, index % 251, np.uint8)


def fill(cache: Cache, indices: list[int], row: int) -> None:
    for start in range(0, len(indices), 64):
        chunk = indices[start : start + 64]
        cache.put_many(chunk, {"x": np.stack([row_of(i, row) for i in chunk])})


def bad_rows(cache: Cache, indices: list[int], row: int) -> int:
    return sum(not np.array_equal(cache.get(i)["x"], row_of(i, row)) for i in indices)


def job(directory: str, name: str, length: str, row: str, role: str, stop: str, go: str = "") -> None:
    width = int(row)
    if go:
        print("ready", flush=True)
    while go and not Path(go).exists():  # every job opens at once
        time.sleep(0.001)
    with Cache.open(Path(directory) / name, fields(width), length=int(length), timeout=120) as cache:
        mine = [i for i in range(cache.capacity) if i % 2 == int(role)]
        fill(cache, mine, width)
        report = {"capacity": cache.capacity, "filled": len(mine), "bad": bad_rows(cache, mine, width)}
        print(json.dumps(report), flush=True)
        while not Path(stop).exists():
            time.sleep(0.01)


def create(directory: str, name: str, length: str, row: str) -> None:
    print("ready", flush=True)
    with Cache.open(Path(directory) / name, fields(int(row)), length=int(length), timeout=120):
        print("done", flush=True)


def fill_all(directory: str, length: str, row: str, *names: str) -> None:
    width = int(row)
    for name in names:
        try:
            cache = Cache.open(Path(directory) / name, fields(width), length=int(length), timeout=120)
        except CacheSpaceError as error:  # not even one slot fits what is left of the budget
            print(json.dumps({"name": name, "refused": str(error)}), flush=True)
            continue
        with cache:
            fill(cache, list(range(cache.capacity)), width)
            print(json.dumps({"name": name, "capacity": cache.capacity}), flush=True)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"job": job, "create": create, "fill": fill_all}[command](*arguments)
