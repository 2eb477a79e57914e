"""Does it scale? Two reader processes against one, and the time to open a cache against its size.

* **readers** — ``get_many`` of 256 random 12 KB samples in a loop, by one
  process and by two processes at once on the same cache file (each opens it
  by path and touches its pages before the clock starts), against the same
  loop of ``np.take`` on a raw /dev/shm mapping of the same bytes (the limit
  the machine allows). The figure is aggregate throughput, 2 processes / 1,
  per round.
* **open** — ``Cache.open(path)`` + ``close()`` of an existing cache of 8 MiB
  ... 8 GiB (4 KiB samples, so 2 Ki ... 2 Mi slots), against what the
  operating system costs (``os.open`` + ``mmap`` + ``close``), ``np.memmap`` of
  the same file and tensordict's ``MemoryMappedTensor.from_filename``. It must
  stay flat. One file exists at a time (created, timed, removed); sizes that
  do not fit in the free space of the directory or in available memory, with
  2 GiB to spare, are skipped and reported.

Run ``python benchmarks/bench_scale.py`` (about 2 minutes) or ``--quick``.
Results go to ``benchmarks/results/bench_scale[-quick].json``.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    bench_parser,
    fmt_bytes,
    index_sets,
    machine_info,
    meminfo,
    run_interleaved,
    run_rounds,
    spread,
    table,
    write_results,
)
from _peers import tensordict_version

import mmapcache
from mmapcache import Cache, Field

FORK = multiprocessing.get_context("fork")
BATCH = 256
READER_SHAPE = (3, 64, 64)
OPEN_SIZES = [8 * 2**20, 64 * 2**20, 512 * 2**20, 4 * 2**30, 8 * 2**30]
QUICK_OPEN_SIZES = [8 * 2**20, 64 * 2**20, 512 * 2**20]
OPEN_ROW = 4096
SPARE = 2 * 2**30


# -- readers ----------------------------------------------------------------------------


def _reader(kind: str, path: str, n: int, calls: int, seed: int, barrier: Any, conn: Any) -> None:
    """One reader process: open by path, touch every page, wait for the others, time ``calls`` gathers."""
    if kind == "mmapcache":
        cache = Cache.open(path)
        array = cache.views["x"]
        read: Callable[[Any], object] = cache.get_many
    else:
        fd = os.open(path, os.O_RDONLY)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        os.close(fd)
        array = np.ndarray((n, *READER_SHAPE), np.uint8, buffer=mm)

        def read(idx: Any) -> object:
            return np.take(array, idx, axis=0)

    int(array.reshape(-1)[::4096].sum())  # first-touch faults stay out of the figure
    batches = [x[0] for x in index_sets(n, calls, BATCH)(seed)]
    barrier.wait()
    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable between processes
    for idx in batches:
        read(idx)
    conn.send((start, time.perf_counter()))


def readers_once(kind: str, path: Path, n: int, procs: int, calls: int, r: int) -> float:
    """Seconds per sample, all processes together (wall clock from the first start to the last end)."""
    barrier = FORK.Barrier(procs)
    pipes, workers = [], []
    try:
        for k in range(procs):
            parent, child = FORK.Pipe()
            args = (kind, str(path), n, calls, 100 * r + k + 1000, barrier, child)
            w = FORK.Process(target=_reader, args=args)
            w.start()
            child.close()
            pipes.append(parent)
            workers.append(w)
        spans = [p.recv() for p in pipes]
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
                w.join()
    span: float = max(s[1] for s in spans) - min(s[0] for s in spans)
    return span / (procs * calls * BATCH)


def bench_readers(directory: Path, total: int, calls: int, rounds: int) -> dict[str, Any]:
    row = int(np.prod(READER_SHAPE))
    n = total // row
    rng = np.random.default_rng(0)
    data = np.frombuffer(rng.bytes(n * row), np.uint8).reshape(n, *READER_SHAPE)
    cache_path, raw_path = directory / "readers.mmc", directory / "readers.bin"
    with Cache.open(cache_path, {"x": Field(READER_SHAPE, "uint8")}, length=n, key="bench_scale") as cache:
        for start in range(0, n, 4096):
            cache.put_many(np.arange(start, min(n, start + 4096)), {"x": data[start : start + 4096]})
    raw_path.write_bytes(data.tobytes())
    del data
    paths = {"mmapcache get_many": ("mmapcache", cache_path), "np.take on a raw mapping": ("raw", raw_path)}

    def variant(name: str, procs: int) -> Callable[[int], float]:
        kind, path = paths[name]
        return lambda r: readers_once(kind, path, n, procs, calls, r)

    try:
        times = run_rounds({f"{name} x{p}": variant(name, p) for name in paths for p in (1, 2)}, rounds=rounds)
    finally:
        mmapcache.remove(cache_path)
        raw_path.unlink()
    out: dict[str, Any] = {"samples": n, "row_bytes": row, "calls_per_process": calls, "batch": BATCH}
    for name in paths:
        one, two = times[f"{name} x1"], times[f"{name} x2"]
        out[name] = {
            "gb_per_s_x1": spread([row / t / 1e9 for t in one]),
            "gb_per_s_x2": spread([row / t / 1e9 for t in two]),
            "scaling_2_vs_1": spread([a / b for a, b in zip(one, two, strict=True)]),
        }
    return out


# -- open time --------------------------------------------------------------------------


def room_for(directory: Path, size: int) -> str | None:
    """Why a file of ``size`` should not be made in ``directory`` now (None: it fits, with SPARE to spare)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    available = meminfo("MemAvailable") * 1024
    if free < size + SPARE:
        return f"{fmt_bytes(free)} free in {directory}"
    on_tmpfs = os.statvfs("/dev/shm").f_fsid == st.f_fsid
    if on_tmpfs and available < size + SPARE:
        return f"{fmt_bytes(available)} of memory available"
    return None


def open_variants(path: Path, nbytes: int, with_tensordict: bool) -> dict[str, Callable[[Any], object]]:
    def raw(_: Any) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            mmap.mmap(fd, 0, access=mmap.ACCESS_READ).close()
        finally:
            os.close(fd)

    def memmap(_: Any) -> None:
        m = np.memmap(path, np.uint8, "r", shape=(nbytes,))
        del m

    variants: dict[str, Callable[[Any], object]] = {
        "Cache.open + close": lambda _: Cache.open(path).close(),
        "os.open + mmap + close": raw,
        "np.memmap": memmap,
    }
    if with_tensordict:
        import torch
        from tensordict import MemoryMappedTensor

        def tensordict(_: Any) -> None:
            t = MemoryMappedTensor.from_filename(str(path), dtype=torch.uint8, shape=torch.Size([nbytes]))
            del t

        variants["tensordict from_filename"] = tensordict
    return variants


def bench_open(directory: Path, sizes: list[int], rounds: int, reps: int) -> dict[str, Any]:
    with_tensordict = tensordict_version() is not None
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    path = directory / "open.mmc"
    for size in sizes:
        why = room_for(directory, size)
        if why is not None:
            skipped[fmt_bytes(size)] = why
            print(f"open time: {fmt_bytes(size)} skipped ({why})")
            continue
        t0 = time.perf_counter()
        Cache.open(path, {"x": Field((OPEN_ROW,), "uint8")}, length=size // OPEN_ROW).close()
        created = time.perf_counter() - t0
        try:
            nbytes = path.stat().st_size
            times = run_interleaved(
                open_variants(path, nbytes, with_tensordict), lambda r: [None] * reps, rounds=rounds
            )
        finally:
            mmapcache.remove(path)
        base = times["os.open + mmap + close"]
        row: dict[str, Any] = {"size": size, "slots": size // OPEN_ROW, "file_bytes": nbytes, "create_s": created}
        for name, ts in times.items():
            row[name] = {
                "us": spread([t * 1e6 for t in ts]),
                "time_vs_mmap": spread([t / b for t, b in zip(ts, base, strict=True)]),
            }
        rows.append(row)
        print(f"open time: {fmt_bytes(size)} created in {created:.2f} s, measured")
    return {"row_bytes": OPEN_ROW, "reps_per_round": reps, "sizes": rows, "skipped": skipped}


def print_results(results: dict[str, Any]) -> None:
    readers = results["readers"]
    print(f"\n[readers] {readers['samples']} samples of 12 KB, get_many of {BATCH}: aggregate GB/s, median [quartiles]")
    rows = []
    for name in ("mmapcache get_many", "np.take on a raw mapping"):
        r = readers[name]
        rows.append([name, r["gb_per_s_x1"]["median"], r["gb_per_s_x2"]["median"], _fmt(r["scaling_2_vs_1"])])
    print(table(["reader", "1 process GB/s", "2 processes GB/s", "2 / 1"], rows))
    opened = results["open"]["sizes"]
    if opened:
        names = [k for k, v in opened[0].items() if isinstance(v, dict)]
        print("\n[open] µs per call (median over rounds), and Cache.open's time / os.open + mmap + close")
        print(
            table(
                ["size", "slots", "create s", *names, "Cache.open / mmap"],
                [
                    [
                        fmt_bytes(r["size"]),
                        r["slots"],
                        r["create_s"],
                        *[r[k]["us"]["median"] for k in names],
                        _fmt(r["Cache.open + close"]["time_vs_mmap"]),
                    ]
                    for r in opened
                ],
            )
        )


def _fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.3g} [{s['q1']:.3g}-{s['q3']:.3g}]"


def main() -> None:
    parser = bench_parser(__doc__, quick="small data, sizes up to 512 MiB, 3 rounds", rounds=(11, 3))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM runs the cleanup below too
    quick: bool = args.quick
    rounds = args.rounds or (3 if quick else 11)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load {info['loadavg_start']}")
    results: dict[str, Any] = {"machine": info, "quick": quick, "rounds": rounds}
    directory = Path(tempfile.mkdtemp(prefix="mmapcache-bench-", dir=args.dir))
    try:
        total = (32 if quick else 256) * 2**20
        results["readers"] = bench_readers(directory, total, 20 if quick else 400, rounds)
        sizes = QUICK_OPEN_SIZES if quick else OPEN_SIZES
        results["open"] = bench_open(directory, sizes, rounds, 10 if quick else 30)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print_results(results)
    print(f"\nresults: {write_results('bench_scale', results, quick=quick, path=args.json)}")


if __name__ == "__main__":
    main()
