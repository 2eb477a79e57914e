"""Cold reads from a cache on a disk (node-local NVMe; here the root file system under /var/tmp).

Every figure is a same-run ratio, the median over rounds; each variant of a
round starts from a file evicted from the page cache (``fsync``, no mapping
alive, ``POSIX_FADV_DONTNEED``) and opened afresh.

* **get_many** — ``cache.get_many(256 random rows)`` of 147 KB rows (3x224x224
  uint8) against 32 threads of ``os.preadv`` of the same rows into a
  preallocated buffer (target: >= 0.6x its throughput), and against the old
  path (``MMAPCACHE_READAHEAD=0``: a page fault per 4 KiB).
* **get** — one cold ``cache.get(i)``, hinted against the old path.
* **loader** — a cold epoch (1,536 random samples; 512 with ``--quick``) through
  ``CachedDataset.loader(batch_size=64, num_workers=2)``, against the old path
  (target: >= 5x).
* **fill** — ``put_many`` of the whole cache plus ``Cache.sync()`` against a
  sequential ``write`` of the same bytes into a preallocated file plus
  ``fdatasync`` (what ``dd conv=fdatasync`` does).
* **reboot check** — the open after a (simulated) reboot of a cache never
  synced: every filled slot read back and compared with its checksum; GB/s,
  and what that makes for 100 GB.
* **fill stalls** — a reader process reads rows filled earlier (``get_many``
  of 16, ``get``; in memory) and rows of another cache never read before
  (``get_many`` of 4, from the disk), 2 ms apart, and records every call's
  latency: alone, while this process fills 3 GB more of the cache (more than
  ``vm.dirty_background_ratio`` of memory here) with ``put_many`` + ``sync()``,
  and while it writes the same bytes sequentially + ``fdatasync``. p50/p99/max
  per phase, and the fill's throughput against the write's.

The device's read-ahead window (``read_ahead_kb``) decides how much a page
fault of the old path reads: ``--read-ahead-kb 8192,128`` runs get_many and
the loader at each setting (root; the setting is restored afterwards, also on
SIGTERM). The device, its settings and the ``vm.dirty_*`` limits are recorded
in the JSON under ``device``.

/dev/shm figures come from ``benchmarks/bench_read.py`` (run it before and
after a change; the memory path does not change here).

Run ``python benchmarks/bench_cold.py`` (about 5 minutes; 1.2 GB and 3 GB on
/var/tmp; as root it also measures at ``read_ahead_kb`` 128) or ``--quick``
(about a minute, 300 MB and 1 GB, the device as it is); ``--only PART``
runs parts alone; ``--json PATH`` writes the figures. Everything it creates
is removed at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
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


def read_ahead_file(directory: Path) -> Path | None:
    """The ``read_ahead_kb`` file of the block device holding ``directory`` (a partition's is its disk's)."""
    st = os.stat(directory)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (dev / "queue", dev / ".." / "queue"):
        if (queue / "read_ahead_kb").is_file():
            return (queue / "read_ahead_kb").resolve()
    return None


def device_info(directory: Path) -> dict[str, Any]:
    """The block device behind ``directory`` and the kernel settings that shape its reads and writeback."""
    info: dict[str, Any] = {}
    knob = read_ahead_file(directory)
    if knob is not None:
        queue = knob.parent
        info["device"] = queue.parent.name
        for name in ("read_ahead_kb", "rotational", "scheduler", "nr_requests", "max_sectors_kb"):
            with_name = queue / name
            info[name] = with_name.read_text().strip() if with_name.is_file() else None
    for name in ("dirty_background_ratio", "dirty_ratio", "dirty_background_bytes", "dirty_bytes"):
        info[f"vm.{name}"] = Path(f"/proc/sys/vm/{name}").read_text().strip()
    return info


@contextmanager
def read_ahead_kb(directory: Path, kb: int | None) -> Iterator[int | None]:
    """The device behind ``directory`` reads ahead ``kb`` KiB inside (None: as it is); restored on the way out.

    Files opened inside see the setting (a file takes its window when it is
    opened). Changing it takes root; SIGTERM restores it too.
    """
    knob = read_ahead_file(directory)
    before = int(knob.read_text()) if knob is not None else None
    if kb is None or kb == before:
        yield before
        return
    if knob is None:
        raise OSError(f"no read_ahead_kb for the device behind {directory}")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        knob.write_text(str(kb))
        yield kb
    finally:
        knob.write_text(str(before))
        signal.signal(signal.SIGTERM, previous)


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
            os.pwrite(fd, chunk.data[: min(len(chunk), nbytes - offset)], offset)
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
        list(pool.map(lambda k: os.preadv(fd, [out[k].data], offsets[k]), range(len(offsets))))
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
        ds = CachedDataset(_Rows(n), path, key=KEY)
        sampler = torch.utils.data.SubsetRandomSampler(
            np.random.default_rng(seed).choice(n, epoch, replace=False).tolist()
        )
        loader = ds.loader(batch_size=64, sampler=sampler, num_workers=2)
        start = time.perf_counter()
        for batch in loader:
            assert batch.shape[1:] == SHAPE
        elapsed = time.perf_counter() - start
        assert ds.stats()["total_misses"] == 0, "a sample was read from the dataset: the cache should hold it"
        ds.close()
    return elapsed


class _Rows:
    """The dataset behind the full cache: sample ``i`` is what :func:`fill` stored in slot ``i``.

    CachedDataset reads a few samples when it opens the file (the schema, a
    check that the cache is not stale); every other read would be a miss,
    which this benchmark must not have (``total_misses`` stays 0).
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(row(i % 64))


LOADER_VARIANTS: dict[str, dict[str, Any]] = {
    "loader": {"hints": True},
    "loader, no hints": {"hints": False},
}


def spread(ratios: list[float]) -> dict[str, float]:
    """Same-run ratios of the rounds: their median and range."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def bench_loader(path: Path, n: int, epoch: int, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in LOADER_VARIANTS}
    names = list(LOADER_VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # a rotated order each round
            times[name].append(cold_epoch(path, n, epoch, seed=r, **LOADER_VARIANTS[name]))

    return {
        "samples": epoch,
        "seconds": {name: statistics.median(ts) for name, ts in times.items()},
        "MB/s": {name: epoch * ROW / statistics.median(ts) / 1e6 for name, ts in times.items()},
        "speedup over old path": spread(
            [o / t for t, o in zip(times["loader"], times["loader, no hints"], strict=True)]
        ),
        "raw_seconds": times,
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
        "fill / sequential write": spread([w / f for f, w in zip(fills, writes, strict=True)]),
        "raw_seconds": {"fill": fills, "sequential write": writes},
    }


# -- fill stalls: readers while another process fills a large cache ---------------------

HOT = 256  # rows filled before the fill starts: the reader's warm rows
COLD = 4  # rows of one cold read (another cache, evicted: each row read once, from the disk)
PAUSE = 0.002  # seconds between two rounds of reads: a training step does some work per batch


def _reader(hot: str, cold: str, cold_rows: int, seed: int, started: Any, stop: Any, results: Any) -> None:
    """In a process of its own: read until told to stop; the seconds of every call, by kind of read.

    ``get_many`` (16 rows) and ``get`` read rows of ``hot`` filled before the
    fill started (in memory); ``cold get_many`` reads rows of ``cold`` never
    read before (from the disk). Writable handles, as a training job has.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(cold_rows)
    times: dict[str, list[float]] = {"get_many": [], "get": [], "cold get_many": []}
    with Cache(hot) as warm, Cache(cold) as disk:
        warm.get_many(np.arange(HOT))  # every page of them mapped: later calls take no fault
        started.set()
        k = 0
        clock = time.perf_counter
        while not stop.is_set():
            idx = rng.choice(HOT, 16, replace=False)
            t0 = clock()
            warm.get_many(idx)
            t1 = clock()
            warm.get(int(idx[0]))
            t2 = clock()
            times["get_many"].append(t1 - t0)
            times["get"].append(t2 - t1)
            if k + COLD <= cold_rows:
                t3 = clock()
                disk.get_many(order[k : k + COLD])
                times["cold get_many"].append(clock() - t3)
                k += COLD
            time.sleep(PAUSE)
    results.put(times)


def while_reading(hot: Path, cold: Path, cold_rows: int, seed: int, work: Callable[[], float]) -> tuple[float, Any]:
    """Run ``work`` (it returns its seconds) while a reader process reads; its seconds and the reader's times."""
    ctx = multiprocessing.get_context("spawn")
    started, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    evict(cold)
    reader = ctx.Process(target=_reader, args=(str(hot), str(cold), cold_rows, seed, started, stop, results))
    reader.start()
    try:
        if not started.wait(60):
            raise RuntimeError("the reader process did not start")
        seconds = work()
        stop.set()
        times = results.get(timeout=60)
    finally:
        stop.set()
        reader.join(60)
    return seconds, times


def _pause(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def fill_rest(path: Path, n: int) -> float:
    """put_many of slots HOT..n in batches of 64, then sync: seconds."""
    batch = np.stack([row(i) for i in range(64)])
    start = time.perf_counter()
    with Cache(path) as cache:
        for s in range(HOT, n, 64):
            idx = np.arange(s, min(s + 64, n))
            cache.put_many(idx, {FIELD: batch[: len(idx)]})
        cache.sync()
    return time.perf_counter() - start


def latency(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {
        "calls": len(ms),
        "p50 ms": float(np.percentile(ms, 50)),
        "p99 ms": float(np.percentile(ms, 99)),
        "max ms": float(ms.max()),
    }


def bench_fill_stalls(directory: Path, n: int, rounds: int, quiet_seconds: float) -> dict[str, Any]:
    """Latency of reads in one process while another fills a cache larger than the dirty thresholds, and not.

    Per round: the reader alone (``quiet``), during ``fill`` (put_many of the
    rest of the cache + sync), during ``dd`` (a sequential write + fdatasync
    of the same bytes, the device's own figure).
    """
    cold = directory / "stall-cold.mmc"
    cold_rows = 4000
    with Cache(cold, {FIELD: (SHAPE, "u1")}, cold_rows, key=KEY) as cache:
        for s in range(0, cold_rows, 64):
            cache.put_many(
                np.arange(s, min(s + 64, cold_rows)),
                {FIELD: np.stack([row(i) for i in range(64)])[: min(64, cold_rows - s)]},
            )
        cache.sync()
    nbytes = (n - HOT) * ROW
    phases: dict[str, dict[str, list[float]]] = {p: {} for p in ("quiet", "fill", "dd")}
    fills: list[float] = []
    writes: list[float] = []
    for r in range(rounds):
        hot = directory / f"stall-{r}.mmc"
        with Cache(hot, {FIELD: (SHAPE, "u1")}, n, key=KEY) as cache:
            cache.put_many(np.arange(HOT), {FIELD: np.stack([row(i) for i in range(HOT)])})
            cache.sync()
        work: dict[str, Callable[[], float]] = {
            "quiet": lambda: _pause(quiet_seconds),
            "fill": lambda: fill_rest(hot, n),  # noqa: B023 - called within the iteration
            "dd": lambda: sequential_write(directory / "stall-dd", nbytes),
        }
        for phase, job in work.items():
            seconds, times = while_reading(hot, cold, cold_rows, r, job)
            for kind, ts in times.items():
                phases[phase].setdefault(kind, []).extend(ts)
            (fills if phase == "fill" else writes if phase == "dd" else []).append(seconds)
        os.unlink(hot)
    os.unlink(cold)
    return {
        "bytes filled": nbytes,
        "MB/s": {
            "fill + sync": statistics.median(nbytes / t / 1e6 for t in fills),
            "sequential write + fdatasync": statistics.median(nbytes / t / 1e6 for t in writes),
        },
        "fill / sequential write": spread([w / f for f, w in zip(fills, writes, strict=True)]),
        "latency": {phase: {kind: latency(ts) for kind, ts in kinds.items()} for phase, kinds in phases.items()},
        "raw_seconds": {"fill": fills, "sequential write": writes},
    }


PARTS = ("fill", "get_many", "loader", "reboot-check", "fill-stalls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller cache and fewer rounds (< 1 minute)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--dir", type=Path, default=DISK, help="a directory on the disk to test (default /var/tmp)")
    parser.add_argument(
        "--read-ahead-kb",
        default=None,
        help="comma-separated read_ahead_kb settings of the device to run get_many and the loader at, e.g. "
        "'8192,128' (needs root; restored afterwards); default: as it is, and 128 too when root (not --quick)",
    )
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    args = parser.parse_args()
    n, rounds, epoch = (2000, 3, 512) if args.quick else (8000, 7, 1536)
    settings = read_ahead_settings(args.dir, args.read_ahead_kb, quick=args.quick)
    directory = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=args.dir))
    try:
        results = run_all(directory, n, rounds, epoch, settings, args.only or PARTS, quick=args.quick)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(results)
    print(f"results: {write_results('bench_cold', results, quick=args.quick, path=args.json)}")


def read_ahead_settings(directory: Path, given: str | None, *, quick: bool) -> list[int | None]:
    """The read_ahead_kb values to measure at (None: the device as it is)."""
    if given:
        return [int(kb) for kb in given.split(",")]
    knob = read_ahead_file(directory)
    if quick or knob is None or not os.access(knob, os.W_OK) or int(knob.read_text()) == 128:
        return [None]
    return [None, 128]


def run_all(
    directory: Path,
    n: int,
    rounds: int,
    epoch: int,
    settings: list[int | None],
    parts: Sequence[str],
    *,
    quick: bool,
) -> dict[str, Any]:
    path = directory / "cold.mmc"
    results: dict[str, Any] = {"machine": machine_info(), "device": device_info(directory)}
    results["cache"] = {"slots": n, "row_bytes": ROW}
    if "fill" in parts:
        results["fill"] = bench_fill(directory, n // 2, max(2, rounds // 2))
    if {"get_many", "loader", "reboot-check"} & set(parts):
        results["cache"]["fill seconds"] = fill(path, n)
    for kb in settings:
        with read_ahead_kb(directory, kb) as now:
            key = f"read_ahead_kb {now}"
            if "get_many" in parts:
                results.setdefault("get_many", {})[key] = bench_get_many(path, n, rounds)
            if "loader" in parts:
                results.setdefault("loader", {})[key] = bench_loader(path, n, epoch, rounds)
    if "reboot-check" in parts:
        results["reboot check"] = bench_reboot_check(path, n)
    if "fill-stalls" in parts:
        size = (2**30 if quick else 3 * 2**30) // ROW
        results["fill stalls"] = bench_fill_stalls(directory, size, 1 if quick else 2, 2.0 if quick else 4.0)
    return results


def fmt_spread(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def report(results: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    for setting, gm in results.get("get_many", {}).items():
        rows += [
            [
                f"cold get_many, 256 x 147 KB ({setting})",
                f"{gm['MB/s']['get_many']:.0f} MB/s",
                "preadv x32",
                f"{gm['get_many / preadv x32']:.2f}x",
            ],
            ["", "", "old path", f"{gm['get_many / old path']:.1f}x faster"],
            [
                f"cold get, 147 KB ({setting})",
                f"{gm['get ms']['get']:.2f} ms",
                "old path",
                f"{gm['get / old path']:.1f}x faster",
            ],
        ]
    for setting, ld in results.get("loader", {}).items():
        ratio = ld["speedup over old path"]
        rows.append(
            [
                f"cold loader epoch, 2 workers ({setting})",
                f"{ld['MB/s']['loader']:.0f} MB/s",
                "old path",
                fmt_spread(ratio),
            ]
        )
    if "fill" in results:
        fl = results["fill"]
        rows.append(
            [
                "fill + sync",
                f"{fl['MB/s']['fill + sync']:.0f} MB/s",
                "sequential write",
                fmt_spread(fl["fill / sequential write"]),
            ]
        )
    if "reboot check" in results:
        rb = results["reboot check"]
        rows.append(
            ["reboot check (never synced)", f"{rb['GB/s']:.2f} GB/s", "100 GB", f"{rb['100 GB, seconds']:.0f} s"]
        )
    if "fill stalls" in results:
        fs = results["fill stalls"]
        rows.append(
            [
                f"fill of {fs['bytes filled'] / 1e9:.1f} GB + sync, a reader beside it",
                f"{fs['MB/s']['fill + sync']:.0f} MB/s",
                "sequential write",
                fmt_spread(fs["fill / sequential write"]),
            ]
        )
        for phase, kinds in fs["latency"].items():
            for kind, lat in kinds.items():
                rows.append(
                    [
                        f"  {kind} during {phase}",
                        f"p50 {lat['p50 ms']:.3g} ms",
                        f"p99 {lat['p99 ms']:.3g} ms",
                        f"max {lat['max ms']:.3g} ms",
                    ]
                )
    print(table(["what", "figure", "against", "ratio"], rows))


if __name__ == "__main__":
    main()
