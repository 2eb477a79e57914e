"""Cold reads from a cache on a disk (node-local NVMe; here the root file system under /var/tmp).

Every figure is a same-run ratio, the median over rounds; each variant of a
round starts from a file evicted from the page cache (``fsync``, no mapping
alive, ``POSIX_FADV_DONTNEED``) and opened afresh.

* **get_many** — ``cache.get_many(256 random rows)`` of 147 KB rows (3x224x224
  uint8) against 32 threads of ``os.preadv`` of the same rows into a
  preallocated buffer (target: >= 0.6x its throughput), and against the old
  path (``MMAPCACHE_READAHEAD=0``: a page fault per 4 KiB).
* **get** — one cold ``cache.get(i)``, hinted against the old path.
* **loader** — a cold epoch (``--epoch`` random samples) through
  ``CachedDataset.loader(batch_size=64, num_workers=2)``, against the old path
  (target: >= 5x).
* **fill** — ``put_many`` of the whole cache plus ``Cache.sync()`` against a
  sequential ``write`` of the same bytes into a preallocated file plus
  ``fdatasync`` (what ``dd conv=fdatasync`` does).
* **reboot check** — the open after a (simulated) reboot of a cache never
  synced: every filled slot read back and compared with its checksum; GB/s,
  and what that makes for 100 GB.

/dev/shm figures come from ``benchmarks/bench_read.py`` (run it before and
after a change; the memory path does not change here).

Run ``python benchmarks/bench_cold.py`` (about 3 minutes, 1.2 GB on /var/tmp)
or ``--quick`` (< 1 minute, 300 MB); ``--json PATH`` writes the figures.
Everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from _common import machine_info, table, write_results

from mmapcache import Cache

SHAPE = (3, 224, 224)
ROW = int(np.prod(SHAPE))
BATCH = 256
THREADS = 32
DISK = Path("/var/tmp")
FIELD, KEY = ".", "bench-cold"  # the field CachedDataset names a sample that is one tensor, and its key


@contextmanager
def readahead(on: bool) -> Iterator[None]:
    """Handles opened inside see hints turned on or off (``MMAPCACHE_READAHEAD``)."""
    before = os.environ.get("MMAPCACHE_READAHEAD")
    os.environ["MMAPCACHE_READAHEAD"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MMAPCACHE_READAHEAD"]
        else:
            os.environ["MMAPCACHE_READAHEAD"] = before


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def row(i: int) -> np.ndarray[Any, Any]:
    return np.full(SHAPE, i % 251, np.uint8)


def fill(path: Path, n: int) -> float:
    """Create and fill the cache with put_many in batches of 64, then sync; seconds."""
    start = time.perf_counter()
    with Cache(path, {FIELD: (SHAPE, "u1")}, n, key=KEY) as cache:
        batch = np.stack([row(i) for i in range(64)])
        for s in range(0, n, 64):
            idx = np.arange(s, min(s + 64, n))
            cache.put_many(idx, {FIELD: batch[: len(idx)]})
        cache.sync()
    return time.perf_counter() - start


def sequential_write(path: Path, nbytes: int) -> float:
    """Write ``nbytes`` sequentially into a preallocated file, then fdatasync (dd conv=fdatasync); seconds."""
    chunk = np.full(8 * 2**20, 7, np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        start = time.perf_counter()
        for offset in range(0, nbytes, len(chunk)):
            os.pwrite(fd, memoryview(chunk)[: min(len(chunk), nbytes - offset)], offset)
        os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def cold_get_many(path: Path, idx: np.ndarray[Any, Any], *, hints: bool) -> float:
    evict(path)
    with readahead(hints), Cache(path, readonly=True) as cache:
        cache.contains_many(idx)  # the slot table, as any reader has read it before
        start = time.perf_counter()
        cache.get_many(idx)
        return time.perf_counter() - start


def cold_get(path: Path, i: int, *, hints: bool) -> float:
    evict(path)
    with readahead(hints), Cache(path, readonly=True) as cache:
        i in cache  # noqa: B015 - the slot table page, read before timing
        start = time.perf_counter()
        cache.get(i)
        return time.perf_counter() - start


def cold_preadv(path: Path, offsets: list[int], pool: ThreadPoolExecutor) -> float:
    """32 threads of preadv of the same rows into a preallocated buffer."""
    evict(path)
    out = np.empty((len(offsets), ROW), np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        list(pool.map(lambda k: os.preadv(fd, [out[k]], offsets[k]), range(len(offsets))))
        return time.perf_counter() - start
    finally:
        os.close(fd)


def bench_get_many(path: Path, n: int, rounds: int) -> dict[str, Any]:
    with Cache(path, readonly=True) as cache:
        base = cache._layout.field_offsets[FIELD]
    rng = np.random.default_rng(7)
    times: dict[str, list[float]] = {"get_many": [], "preadv x32": [], "get_many, no hints": []}
    single: dict[str, list[float]] = {"get": [], "get, no hints": []}
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(rounds):
            idx = rng.choice(n, BATCH, replace=False)
            times["get_many"].append(cold_get_many(path, idx, hints=True))
            times["preadv x32"].append(cold_preadv(path, [base + i * ROW for i in idx.tolist()], pool))
            times["get_many, no hints"].append(cold_get_many(path, idx, hints=False))
            i = int(rng.integers(n))
            single["get"].append(cold_get(path, i, hints=True))
            single["get, no hints"].append(cold_get(path, i, hints=False))
    mbs = {name: statistics.median(BATCH * ROW / t / 1e6 for t in ts) for name, ts in times.items()}
    return {
        "MB/s": mbs,
        "get_many / preadv x32": statistics.median(
            p / g for g, p in zip(times["get_many"], times["preadv x32"], strict=True)
        ),
        "get_many / old path": statistics.median(
            o / g for g, o in zip(times["get_many"], times["get_many, no hints"], strict=True)
        ),
        "get ms": {name: statistics.median(ts) * 1e3 for name, ts in single.items()},
        "get / old path": statistics.median(o / g for g, o in zip(single["get"], single["get, no hints"], strict=True)),
        "raw_seconds": {**times, **single},
    }


def cold_epoch(path: Path, n: int, epoch: int, *, hints: bool, seed: int) -> float:
    import torch

    from mmapcache.torch import CachedDataset

    evict(path)
    with readahead(hints):
        ds = CachedDataset(_Never(n), path, key=KEY)
        sampler = torch.utils.data.SubsetRandomSampler(
            np.random.default_rng(seed).choice(n, epoch, replace=False).tolist()
        )
        loader = ds.loader(batch_size=64, sampler=sampler, num_workers=2)
        start = time.perf_counter()
        for batch in loader:
            assert batch.shape[1:] == SHAPE
        elapsed = time.perf_counter() - start
        ds.close()
    return elapsed


class _Never:
    """The dataset behind a full cache: never read (a read would be a miss, which this benchmark must not have)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        if i == 0:  # the schema: CachedDataset looks at the first sample when the file exists
            return torch.from_numpy(row(0))
        raise AssertionError(f"sample {i} was read from the dataset: the cache should hold it")


def bench_loader(path: Path, n: int, epoch: int, rounds: int) -> dict[str, Any]:
    new: list[float] = []
    old: list[float] = []
    for r in range(rounds):
        new.append(cold_epoch(path, n, epoch, hints=True, seed=r))
        old.append(cold_epoch(path, n, epoch, hints=False, seed=r))
    return {
        "samples": epoch,
        "seconds": {"loader": statistics.median(new), "loader, no hints": statistics.median(old)},
        "MB/s": {"loader": epoch * ROW / statistics.median(new) / 1e6},
        "speedup over old path": statistics.median(o / t for t, o in zip(new, old, strict=True)),
        "raw_seconds": {"loader": new, "loader, no hints": old},
    }


def bench_reboot_check(path: Path, n: int) -> dict[str, Any]:
    """Forget the boot id (as after a reboot) and unsync every slot, evict, open: the check reads all of it."""
    with Cache(path) as cache:
        assert cache._mapped is not None
        assert cache._mapped.boot is not None
        cache._mapped.slots.synced[:] = 0
        offset = cache._layout.boot_offset
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(16), offset)
    finally:
        os.close(fd)
    evict(path)
    start = time.perf_counter()
    Cache(path).close()
    seconds = time.perf_counter() - start
    gbs = n * ROW / seconds / 1e9
    return {"slots": n, "seconds": seconds, "GB/s": gbs, "100 GB, seconds": 100 / gbs}


def bench_fill(directory: Path, n: int, rounds: int) -> dict[str, Any]:
    fills: list[float] = []
    writes: list[float] = []
    for r in range(rounds):
        path = directory / f"fill-{r}.mmc"
        fills.append(fill(path, n))
        Cache(path).close()
        os.unlink(path)
        writes.append(sequential_write(directory / f"dd-{r}", n * ROW))
    return {
        "MB/s": {
            "fill + sync": statistics.median(n * ROW / t / 1e6 for t in fills),
            "sequential write + fdatasync": statistics.median(n * ROW / t / 1e6 for t in writes),
        },
        "fill / sequential write": statistics.median(w / f for f, w in zip(fills, writes, strict=True)),
        "raw_seconds": {"fill": fills, "sequential write": writes},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller cache and fewer rounds (< 1 minute)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--dir", type=Path, default=DISK, help="a directory on the disk to test (default /var/tmp)")
    args = parser.parse_args()
    n, rounds, epoch = (2000, 3, 512) if args.quick else (8000, 7, 1536)
    directory = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=args.dir))
    try:
        results = run_all(directory, n, rounds, epoch)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(results)
    print(f"results: {write_results('bench_cold', results, quick=args.quick, path=args.json)}")


def run_all(directory: Path, n: int, rounds: int, epoch: int) -> dict[str, Any]:
    path = directory / "cold.mmc"
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "fill": lambda: bench_fill(directory, n // 2, max(2, rounds // 2)),
        "get_many": lambda: bench_get_many(path, n, rounds),
        "loader": lambda: bench_loader(path, n, epoch, max(2, rounds // 2)),
        "reboot check": lambda: bench_reboot_check(path, n),
    }
    results: dict[str, Any] = {"machine": machine_info(), "cache": {"slots": n, "row_bytes": ROW}}
    results["cache"]["fill seconds"] = fill(path, n)
    for name, step in steps.items():
        results[name] = step()
    return results


def report(results: dict[str, Any]) -> None:
    gm, ld, fl, rb = results["get_many"], results["loader"], results["fill"], results["reboot check"]
    rows = [
        [
            "cold get_many, 256 x 147 KB",
            f"{gm['MB/s']['get_many']:.0f} MB/s",
            "preadv x32",
            f"{gm['get_many / preadv x32']:.2f}x",
        ],
        ["", "", "old path", f"{gm['get_many / old path']:.1f}x faster"],
        ["cold get, 147 KB", f"{gm['get ms']['get']:.2f} ms", "old path", f"{gm['get / old path']:.1f}x faster"],
        [
            "cold loader epoch, 2 workers",
            f"{ld['MB/s']['loader']:.0f} MB/s",
            "old path",
            f"{ld['speedup over old path']:.1f}x faster",
        ],
        [
            "fill + sync",
            f"{fl['MB/s']['fill + sync']:.0f} MB/s",
            "sequential write",
            f"{fl['fill / sequential write']:.2f}x",
        ],
        ["reboot check (never synced)", f"{rb['GB/s']:.2f} GB/s", "100 GB", f"{rb['100 GB, seconds']:.0f} s"],
    ]
    print(table(["what", "figure", "against", "ratio"], rows))


if __name__ == "__main__":
    main()
