"""Streams for the CachedStream tests: a plain generator IterableDataset that shards itself like real ones do.

Importable by the test processes (``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def numbered(i: int) -> dict[str, Any]:
    """Stream element ``i``: fixed fields, a caption (text) and tokens of a varying length."""
    return {
        "x": torch.tensor([i, 2 * i, 3 * i, 7], dtype=torch.int64),
        "label": i,
        "caption": f"element {i} " + "ab" * (i % 5),
        "tokens": torch.arange(i % 7 + 1, dtype=torch.int32) + i,
    }


def fixed(i: int) -> dict[str, Any]:
    return {"x": torch.tensor([i, 2 * i, 3 * i, 7], dtype=torch.int64), "label": i}


def large(i: int) -> dict[str, Any]:
    """An element with a 16 KiB image: rows this large are stored by a thread beside the stream."""
    image = (torch.arange(4 * 64 * 64, dtype=torch.int64).reshape(4, 64, 64) * (i + 1) % 251).to(torch.uint8)
    return {"image": image, "label": i}


class Numbers(torch.utils.data.IterableDataset[Any]):
    """Elements ``0 .. length - 1`` (``numbered`` or ``fixed``), split across ranks, then DataLoader workers.

    ``delay`` seconds per element; ``passes``, when given, is a file that gets a line per pass over a shard.
    """

    def __init__(self, length: int, *, kind: str = "numbered", delay: float = 0.0, passes: str | None = None) -> None:
        self.length, self.kind, self.delay, self.passes = length, kind, delay, passes

    def __iter__(self) -> Iterator[Any]:
        rank, world = rank_and_world()
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.passes is not None:
            with open(self.passes, "a") as file:
                file.write(f"{rank} {worker}\n")
        make = {"numbered": numbered, "fixed": fixed, "large": large}[self.kind]
        for i in range(rank * workers + worker, self.length, world * workers):
            if self.delay:
                time.sleep(self.delay)
            yield make(i)


class WithLength(Numbers):
    def __len__(self) -> int:
        return self.length


class LastRankLate(WithLength):
    """``fixed`` elements, whose last rank holds back its last element until the file ``signal`` exists, then
    ``late`` seconds more: its part of the stream ends after every other rank's has."""

    def __init__(self, length: int, *, signal: str, late: float) -> None:
        super().__init__(length, kind="fixed")
        self.signal, self.late = signal, late

    def __iter__(self) -> Iterator[Any]:
        rank, world = rank_and_world()
        elements = list(super().__iter__())
        for k, element in enumerate(elements):
            if rank == world - 1 and k == len(elements) - 1:
                while not os.path.exists(self.signal):
                    time.sleep(0.01)
                time.sleep(self.late)
            yield element
