"""Two jobs on one node share one cache: what one of them loads, the other reads.

    python examples/concurrent_jobs.py           # starts two jobs at once, then cleans up
    python examples/concurrent_jobs.py --keep    # leaves the cache for `mmapcache ls`

Think of two runs of a hyperparameter sweep started together. Each job is its
own Python process (started here with ``subprocess``; in real life, by your
scheduler) and wraps the same dataset in ``CachedDataset`` with the same key,
so both open the same file in ``mmapcache.default_dir()``. Neither knows about
the other: whichever needs a sample first loads it and stores it, and every
sample is stored once. Each job prints its own counters; together they loaded
each sample about once, where two private caches would have loaded it twice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache.torch import CachedDataset

KEY = "concurrent-jobs-example/synthetic-32px/v1"


class SlowDecode(Dataset[tuple[torch.Tensor, int]]):
    """Stands in for an expensive, deterministic load (JPEG decode, a network fetch): ~1 ms a sample."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.001)
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g), index % 10


def job(name: str, length: int, epochs: int) -> dict[str, Any]:
    """One training job: a few epochs over the cached dataset, then its counters."""
    source = SlowDecode(length)
    ds = CachedDataset(source, key=KEY)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for images, _labels in DataLoader(ds, batch_size=64, shuffle=True):
            images.float().mean()  # stands in for the training step
        times.append(round(time.perf_counter() - start, 2))
    image, _ = source[123]
    assert torch.equal(ds[123][0], image), "the shared cache returns what the dataset gives"
    stats = ds.stats()
    ds.close()
    return {"job": name, "epoch_seconds": times, **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=3000, help="samples in the dataset")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the cache")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # set in the job processes
    args = parser.parse_args()
    if args.job:
        print(json.dumps(job(args.job, args.length, args.epochs)))
        return

    path = CachedDataset(SlowDecode(args.length), key=KEY).path
    print(f"both jobs use {path}")
    command = [sys.executable, __file__, "--length", str(args.length), "--epochs", str(args.epochs)]
    try:
        jobs = [subprocess.Popen([*command, "--job", name], stdout=subprocess.PIPE, text=True) for name in "AB"]
        results = []
        for process in jobs:
            out, _ = process.communicate()
            if process.returncode != 0:
                raise SystemExit(f"a job failed (exit code {process.returncode})")
            results.append(json.loads(out))
        for r in results:
            print(
                f"job {r['job']}: epochs {r['epoch_seconds']} s; loaded {r['misses']} samples from the dataset, "
                f"stored {r['written']}, read {r['hits']} from the cache"
            )
        loaded = sum(r["misses"] for r in results)
        stored = sum(r["written"] for r in results)
        print(
            f"together: {stored} samples stored (each once), {loaded} loads for {args.length} samples "
            f"(private caches: {2 * args.length}); the file holds {results[0]['filled']}/{args.length}"
        )
    finally:
        if args.keep:
            print(f"kept {path}")
        elif path.exists():
            mmapcache.remove(path)


if __name__ == "__main__":
    main()
