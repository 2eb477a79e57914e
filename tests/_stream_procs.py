"""A process streaming one partition of a deterministic stream through a stream cache (tests/streams/test_stream.py).

Run as ``python tests/_stream_procs.py PATH RANK RANKS WORKER WORKERS LENGTH [--die MODE AT] [--pause S]
[--batch K] [--stop N]``. Element ``j`` of partition ``p`` is :func:`element` ``(p, j)``; the
partition has ``LENGTH`` elements. ``--die`` kills the process with SIGKILL
at element ``AT``: ``before-store`` (a slot was taken and announced, nothing
written), ``after-publish`` (the slot is READY, the element not counted),
``after-count`` (counted, the pending slot not cleared). ``--pause`` sleeps
that long after each element (so a test can kill it mid-fill). It prints
``stored N`` and ``ended E`` at the end.

``--batch K`` offers the elements ``K`` at a time (``offer_many``, as
``CachedStream`` does); ``--die`` then takes the batch modes ``batch-filled``
(the batch starting at ``AT`` is READY in its slots, nothing counted),
``batch-recording`` (its first half counted, the next element announced, its
slot's record half written) and ``batch-counting`` (the same with the record
written, the element not counted). ``--stop N`` gives up after ``N`` elements (the
lock let go, the partition not ended), as an abandoned iterator does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmapcache import Field
from mmapcache._streams.stream_cache import Partition, PartitionWriter, open_stream, plan_stream, region
from mmapcache.cache import writer_of

FIELDS = {"value": Field((4,), "int64"), "tokens": Field((None,), "int32")}
KEY = "test-stream"


def element(p: int, j: int) -> dict[str, Any]:
    """Element ``j`` of partition ``p``: its identity in ``value``, a variable-length ``tokens``."""
    return {"value": np.array([p, j, p * 1000 + j, 7], np.int64), "tokens": np.arange(j % 5 + 1, dtype=np.int32) + j}


def plan(length: int, partitions: int, max_bytes: int | None = None) -> Any:
    return plan_stream(FIELDS, max_bytes=max_bytes or 2**20, length=length * partitions, partitions=partitions)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run(
    path: Path,
    partition: Partition,
    length: int,
    die: tuple[str, int] | None,
    pause: float,
    batch: int = 0,
    stop: int | None = None,
) -> None:
    cache = open_stream(
        path,
        key=KEY,
        fields=FIELDS,
        partition=partition,
        plan=lambda: plan(length, partition.ranks * partition.workers),
    )
    assert cache is not None
    writer = PartitionWriter(cache, partition)
    stream = region(cache)
    p = partition.index
    if batch:
        _batches(cache, writer, stream, p, length, batch, die, pause, stop)
        return
    for j in range(length):
        if die is not None and die[1] == j and die[0] != "after-count":
            _die_at(cache, writer, stream, p, j, die[0])
        writer.offer(j, element(p, j))
        if die is not None and die == ("after-count", j):
            # Killed between counting the element and clearing its pending slot.
            (slot,) = np.flatnonzero((stream.partition == p) & (stream.element == j) & (stream.states == 2))
            stream.pending_slot[p] = slot + 1
            _die()
        if pause:
            time.sleep(pause)
    state = writer.finish(length)
    print(f"stored {writer.stored}", flush=True)
    print(f"ended {int(state.ended)}", flush=True)


def _die_at(cache: Any, writer: PartitionWriter, stream: Any, p: int, j: int, mode: str) -> None:
    """Do what ``offer`` does for element ``j`` up to the point ``mode`` names, then die."""
    assert writer.held, "the partition is ours"
    assert int(stream.stored[p]) == j, "j is next"
    slot = stream.allocate(1)[0]
    stream.begin(p, j, slot)
    if mode == "before-store":
        _die()
    assert mode == "after-publish"
    assert cache.put(slot, element(p, j))
    _die()


def _batches(
    cache: Any,
    writer: PartitionWriter,
    stream: Any,
    p: int,
    length: int,
    size: int,
    die: tuple[str, int] | None,
    pause: float,
    stop: int | None,
) -> None:
    end = length if stop is None else stop
    for first in range(0, end, size):
        count = min(size, end - first)
        elements = [element(p, j) for j in range(first, first + count)]
        rows = {name: [e[name] for e in elements] for name in FIELDS}
        rows["value"] = np.stack(rows["value"])
        if die is not None and die[1] == first:
            _die_in_batch(cache, stream, p, first, rows, count, die[0])
        writer.offer_many(first, rows, count)
        if pause:
            time.sleep(pause * count)
    if stop is not None:
        writer.close()
        print(f"stored {writer.stored}", flush=True)
        return
    state = writer.finish(length)
    print(f"stored {writer.stored}", flush=True)
    print(f"ended {int(state.ended)}", flush=True)


def _die_in_batch(cache: Any, stream: Any, p: int, first: int, rows: dict[str, Any], count: int, mode: str) -> None:
    """Do what ``offer_many`` does for the batch at ``first`` up to the point ``mode`` names, then die."""
    assert int(stream.stored[p]) == first, "the batch is next"
    slots = stream.allocate(count)
    stream.reserve(slots, p)
    half = count // 2
    if mode == "batch-half-filled":
        assert (
            writer_of(cache).put_run(slots.start, {name: values[:half] for name, values in rows.items()}, half) == half
        )
        _die()
    assert writer_of(cache).put_run(slots.start, rows, count) == count
    if mode == "batch-filled":
        _die()
    assert mode in ("batch-recording", "batch-counting")
    last = first + count - 1
    stream.pending_element[p] = last  # the run is announced, as StreamRegion.count does
    stream.pending_slot[p] = slots.stop
    recorded = count if mode == "batch-counting" else half
    stream.element[slots.start : slots.start + recorded] = np.arange(first, first + recorded)
    stream.partition[slots.start : slots.start + recorded] = p
    _die()  # before ``stored`` moved


def main(argv: list[str]) -> None:
    path, rank, ranks, worker, workers, length = Path(argv[0]), *map(int, argv[1:6])
    rest = argv[6:]
    die = None
    pause = 0.0
    batch, stop = 0, None
    while rest:
        if rest[0] == "--die":
            die, rest = (rest[1], int(rest[2])), rest[3:]
        elif rest[0] == "--pause":
            pause, rest = float(rest[1]), rest[2:]
        elif rest[0] == "--batch":
            batch, rest = int(rest[1]), rest[2:]
        elif rest[0] == "--stop":
            stop, rest = int(rest[1]), rest[2:]
        else:
            raise SystemExit(f"unknown argument {rest[0]}")
    run(path, Partition(rank, ranks, worker, workers), length, die, pause, batch, stop)


if __name__ == "__main__":
    main(sys.argv[1:])
