"""Reads and fills by sample size, against what a user would use instead: peers and the limits, in one run.

For each sample size (64 B ... 1 MiB of uint8, one row per sample), in interleaved rounds:

* **hit path** — a batch of random indices read by ``Cache.get_many``, by
  ``get_many(out=)`` into one reused buffer, by fancy indexing of an
  ``np.memmap`` of a raw file, by indexing a tensordict ``MemoryMappedTensor``
  (``mmt[idx]``, and ``torch.index_select``) and by stocaching as ``DataLoader`` uses it (``get_slot`` per sample, then
  ``torch.stack``); and the same indices one sample at a time (``Cache.get``,
  ``np.array(memmap[i])``, ``mmt[i].clone()``, ``get_slot(i).clone()``). The
  limits: ``np.take`` on an in-RAM array (allocating its output, as every
  reader above does) and ``memcpy`` (``np.copyto`` of the same number of
  contiguous rows into a reused buffer: DRAM bandwidth).
* **fill path** — a fresh container filled with ``m`` samples in a random
  order, 64 a call: ``Cache.open`` + ``put_many``, ``put`` per sample, a new
  ``np.memmap`` / ``MemoryMappedTensor`` assigned by index, stocaching's
  ``SharedCache`` + ``set_slot``; the limit is ``np.empty`` + assignment.
  Creating the container is part of the figure (and mmapcache's creation,
  which preallocates the file, is also timed on its own); closing and
  removing it is not.

Every figure is seconds per sample; the headline is each variant's speed
against ``np.take`` (hit) or ``np.empty`` (fill) in the same process and round,
median over rounds with quartiles. stocaching pins numpy<2, so its side runs in
a child in its venv (``benchmarks/.venv-stocaching``) that times the same
limits itself; parent and child alternate round by round. Without the venv or
tensordict those sides are skipped, and the output says so.

Run ``python benchmarks/bench_peers.py`` (about 3 minutes) or ``--quick``.
Results go to ``benchmarks/results/bench_peers[-quick].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _child import Child, reply
from _common import (
    bench_parser,
    fmt_bytes,
    index_sets,
    machine_info,
    offset_buffer,
    rotated,
    spread,
    table,
    time_round,
    write_results,
)
from _peers import STOCACHING_PYTHON, stocaching_ready, tensordict_version

SCRIPT = Path(__file__).resolve()
SIZES = [64, 256, 1024, 4096, 16384, 65536, 262144, 1048576]
QUICK_SIZES = [64, 16384, 1048576]
CHUNK = 64  # samples per fill call
TAKE, MEMCPY, COPY, EMPTY = "np.take (in RAM)", "memcpy (in RAM)", "ndarray[i].copy() (in RAM)", "np.empty (in RAM)"
LIMITS = (TAKE, MEMCPY, COPY, EMPTY)
Variant = Callable[[Any], object]
Filler = Callable[[int], float]


@dataclass(frozen=True)
class Plan:
    """The shape of one sample size's measurement (the same in parent and child)."""

    row: int
    rows: int  # samples in the read containers
    batch: int  # indices per read call
    fill_rows: int  # samples per fill
    reps: int  # calls per variant per round
    seed: int = 0

    def data(self) -> np.ndarray[Any, Any]:
        rng = np.random.default_rng(self.seed)
        rows: np.ndarray[Any, Any] = np.frombuffer(rng.bytes(self.rows * self.row), np.uint8).copy()
        return rows.reshape(self.rows, self.row)

    def fill_chunks(self, r: int) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
        """Round ``r``'s fill: (indices, rows) of ``CHUNK`` samples each, indices in a random order."""
        rng = np.random.default_rng(2000 + r)
        order = rng.permutation(self.fill_rows).astype(np.intp)
        src = np.frombuffer(rng.bytes(self.fill_rows * self.row), np.uint8).reshape(self.fill_rows, self.row)
        return [(order[k : k + CHUNK], src[order[k : k + CHUNK]]) for k in range(0, self.fill_rows, CHUNK)]


def make_plan(row: int, *, quick: bool) -> Plan:
    """Batches of up to 256 samples and 32 MiB (quick: 4 MiB); 256 MiB of data to read from (16 MiB)."""
    batch = max(8, min(256, (4 if quick else 32) * 2**20 // row))
    total, cap = (16 * 2**20, 2**16) if quick else (256 * 2**20, 2**19)
    fill_total, fill_cap = (4 * 2**20, 1024) if quick else (32 * 2**20, 8192)
    return Plan(
        row=row,
        rows=max(4 * batch, min(cap, total // row)),
        batch=batch,
        fill_rows=max(16, min(fill_cap, fill_total // row)),
        reps=3 if quick else 7,
    )


def per_sample(fn: Callable[[int], object]) -> Variant:
    """A variant reading the round's indices one at a time (``x[1]`` is the index list)."""

    def run(x: Any) -> None:
        for i in x[1]:
            fn(i)

    return run


def limit_variants(ram: np.ndarray[Any, Any], batch: int) -> dict[str, Variant]:
    """The limits, timed the same way in parent and child: gather, contiguous copy, per-sample copy."""
    dst = offset_buffer((batch, ram.shape[1]), 0)  # page-aligned, like the rows it copies
    dst.fill(0)
    last = len(ram) - batch

    def memcpy(x: Any) -> None:
        start = int(x[0][0]) % last
        np.copyto(dst, ram[start : start + batch])

    return {
        TAKE: lambda x: np.take(ram, x[0], axis=0),
        MEMCPY: memcpy,
        COPY: per_sample(lambda i: ram[i].copy()),
    }


def assigning_filler(
    plan: Plan, create: Callable[[], Any], dispose: Callable[[], None] = lambda: None, *, tensors: bool = False
) -> Filler:
    """A fill that creates its container, assigns it chunk by chunk (``target[idx] = rows``), then disposes of it.

    Creating is timed, disposing is not; ``tensors`` hands the chunks over as torch tensors.
    """

    def fill(r: int) -> float:
        chunks: list[tuple[Any, Any]] = plan.fill_chunks(r)
        if tensors:
            import torch

            chunks = [(torch.from_numpy(idx), torch.from_numpy(rows)) for idx, rows in chunks]
        start = time.perf_counter()
        target = create()
        for idx, rows in chunks:
            target[idx] = rows
        seconds = time.perf_counter() - start
        del target
        dispose()
        return seconds / plan.fill_rows

    return fill


def ram_filler(plan: Plan) -> Filler:
    return assigning_filler(plan, lambda: np.empty((plan.fill_rows, plan.row), np.uint8))


# -- the parent's containers ------------------------------------------------------------


@dataclass
class Stores:
    """The same bytes in every container the parent reads: RAM, mmapcache, np.memmap, MemoryMappedTensor."""

    ram: np.ndarray[Any, Any]
    cache: Any
    memmap: np.memmap[Any, Any]
    mmt: Any  # None without tensordict


@contextlib.contextmanager
def stores(plan: Plan, directory: Path, with_tensordict: bool) -> Iterator[Stores]:
    import mmapcache
    from mmapcache import Cache, Field

    ram = plan.data()
    cache_path, raw_path, td_path = directory / "peers.mmc", directory / "raw.bin", directory / "td.bin"
    cache = Cache.open(cache_path, {"x": Field((plan.row,), "uint8")}, length=plan.rows, key="bench_peers")
    for start in range(0, plan.rows, 4096):
        stop = min(plan.rows, start + 4096)
        cache.put_many(np.arange(start, stop), {"x": ram[start:stop]})
    raw_path.write_bytes(ram.tobytes())
    memmap = np.memmap(raw_path, np.uint8, "r", shape=(plan.rows, plan.row))
    mmt = None
    if with_tensordict:
        import torch
        from tensordict import MemoryMappedTensor

        mmt = MemoryMappedTensor.from_tensor(torch.from_numpy(ram), filename=str(td_path))
    for container in (cache.views["x"], memmap, *(() if mmt is None else (mmt.numpy(),))):
        int(container.reshape(-1)[::4096].sum())  # fault every page in
    try:
        yield Stores(ram, cache, memmap, mmt)
    finally:
        cache.close()
        del memmap, mmt
        mmapcache.remove(cache_path)
        for path in (raw_path, td_path):
            path.unlink(missing_ok=True)


def parent_variants(s: Stores, plan: Plan) -> dict[str, Variant]:
    out = {"x": offset_buffer((plan.batch, plan.row), 0)}  # page-aligned: see offset_buffer
    out["x"].fill(0)
    cache, memmap, mmt = s.cache, s.memmap, s.mmt
    variants: dict[str, Variant] = {
        "mmapcache get_many": lambda x: cache.get_many(x[0]),
        "mmapcache get_many(out=)": lambda x: cache.get_many(x[0], out=out),
        "np.memmap[idx]": lambda x: memmap[x[0]],
        "mmapcache get": per_sample(cache.get),
        "np.array(memmap[i])": per_sample(lambda i: np.array(memmap[i])),
    }
    if mmt is not None:
        import torch

        variants["tensordict mmt[idx]"] = lambda x: mmt[torch.from_numpy(x[0])]
        # torch's advanced indexing copies a uint8 row element by element; index_select copies rows.
        variants["tensordict index_select(mmt)"] = lambda x: torch.index_select(mmt, 0, torch.from_numpy(x[0]))
        variants["tensordict mmt[i].clone()"] = per_sample(lambda i: mmt[i].clone())
    return {**variants, **limit_variants(s.ram, plan.batch)}


def parent_fillers(plan: Plan, directory: Path, with_tensordict: bool) -> dict[str, Filler]:
    import mmapcache
    from mmapcache import Cache, Field

    path = directory / "fill.bin"
    fields = {"x": Field((plan.row,), "uint8")}

    def cache_fill(per_row: bool) -> Filler:
        def fill(r: int) -> float:
            chunks = plan.fill_chunks(r)
            start = time.perf_counter()
            cache = Cache.open(path, fields, length=plan.fill_rows)
            for idx, rows in chunks:
                if per_row:
                    for i, row in zip(idx.tolist(), rows, strict=True):
                        cache.put(i, {"x": row})
                else:
                    cache.put_many(idx, {"x": rows})
            seconds = time.perf_counter() - start
            cache.close()
            mmapcache.remove(path)
            return seconds / plan.fill_rows

        return fill

    def cache_create(r: int) -> float:  # the part of both fills above that is creating the file
        start = time.perf_counter()
        Cache.open(path, fields, length=plan.fill_rows).close()
        seconds = time.perf_counter() - start
        mmapcache.remove(path)
        return seconds / plan.fill_rows

    fillers: dict[str, Filler] = {
        "mmapcache put_many": cache_fill(per_row=False),
        "mmapcache create only": cache_create,
        "mmapcache put": cache_fill(per_row=True),
        "np.memmap[idx] = rows": assigning_filler(
            plan, lambda: np.memmap(path, np.uint8, "w+", shape=(plan.fill_rows, plan.row)), path.unlink
        ),
    }
    if with_tensordict:
        import torch
        from tensordict import MemoryMappedTensor

        def mmt() -> Any:
            return MemoryMappedTensor.empty((plan.fill_rows, plan.row), dtype=torch.uint8, filename=str(path))

        fillers["tensordict mmt[idx] = rows"] = assigning_filler(plan, mmt, path.unlink, tensors=True)
    return {**fillers, EMPTY: ram_filler(plan)}


# -- the stocaching child ---------------------------------------------------------------


class StocachingSide:
    """stocaching's ``SharedCache`` holding the plan's data, with the limits timed in the same process."""

    def __init__(self, plan: Plan) -> None:
        import torch
        from stocaching import SharedCache

        self.plan = plan
        self.ram = plan.data()
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per cache
            self.cache = SharedCache(size_limit_gib=64, dataset_len=plan.rows, data_dims=(plan.row,))
        # Setup, not measured: the array and its "cached" flags written directly (1 = SlotState.SET).
        self.cache.array.copy_(torch.from_numpy(self.ram))
        self.cache.aux_array[:] = 1
        get_slot = self.cache.get_slot
        self.variants: dict[str, Variant] = {
            "stocaching stack(get_slot)": lambda x: torch.stack([get_slot(i) for i in x[1]]),
            "stocaching get_slot(i).clone()": per_sample(lambda i: get_slot(i).clone()),
            **limit_variants(self.ram, plan.batch),
        }
        self.fillers: dict[str, Filler] = {"stocaching set_slot": self.fill, EMPTY: ram_filler(plan)}

    def fill(self, r: int) -> float:
        import torch
        from stocaching import SharedCache

        plan = self.plan
        chunks = [(idx.tolist(), torch.from_numpy(rows)) for idx, rows in plan.fill_chunks(r)]
        with contextlib.redirect_stdout(io.StringIO()):
            start = time.perf_counter()
            cache = SharedCache(size_limit_gib=64, dataset_len=plan.fill_rows, data_dims=(plan.row,))
            for idx, rows in chunks:
                for i, row in zip(idx, rows, strict=True):
                    cache.set_slot(i, row)
            seconds = time.perf_counter() - start
        del cache
        return seconds / plan.fill_rows


def serve() -> None:
    """The child: answers "plan", "read" (one round) and "fill" (one round) commands."""
    import json

    import stocaching
    import torch

    torch.set_num_threads(1)
    version = getattr(stocaching, "__version__", None) or _dist_version("stocaching")
    reply({"pid": os.getpid(), "numpy": np.__version__, "torch": torch.__version__, "stocaching": version})
    side: StocachingSide | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "plan":
            side = None
            side = StocachingSide(Plan(**cmd["plan"]))
            reply({"ok": True})
        elif cmd["cmd"] == "read":
            assert side is not None
            r, plan = cmd["round"], side.plan
            batch = index_sets(plan.rows, plan.reps, plan.batch)(r)
            reply(time_round(side.variants, batch, r, ops=dict.fromkeys(side.variants, plan.batch)))
        elif cmd["cmd"] == "fill":
            assert side is not None
            reply(fill_round(side.fillers, cmd["round"]))
    reply({"bye": True})


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# -- the parent -------------------------------------------------------------------------


def measure_size(plan: Plan, directory: Path, rounds: int, child: Child | None, tensordict: bool) -> dict[str, Any]:
    """One sample size: read rounds, then fill rounds, parent and child alternating; raw seconds per sample."""
    from dataclasses import asdict

    if child is not None:
        child.call(cmd="plan", plan=asdict(plan))
    with stores(plan, directory, tensordict) as s:
        variants = parent_variants(s, plan)
        ops = dict.fromkeys(variants, plan.batch)

        def read_round(r: int) -> dict[str, float]:
            return time_round(variants, index_sets(plan.rows, plan.reps, plan.batch)(r), r, ops=ops)

        reads = alternate(rounds, read_round, child, "read")
    fillers = parent_fillers(plan, directory, tensordict)
    return {"read": reads, "fill": alternate(rounds, lambda r: fill_round(fillers, r), child, "fill")}


def alternate(
    rounds: int, own: Callable[[int], dict[str, float]], child: Child | None, cmd: str
) -> dict[str, dict[str, list[float]]]:
    """Rounds -1 (a warm-up) to ``rounds - 1`` of ``own`` here and ``cmd`` in the child, taking turns going first."""
    raw: dict[str, dict[str, list[float]]] = {}
    for r in range(-1, rounds):
        for side in ("parent", "child") if r % 2 else ("child", "parent"):
            if side == "parent":
                measured = own(r)
            elif child is not None:
                measured = child.call(cmd=cmd, round=r)
            else:
                continue
            if r >= 0:
                _record(raw, side, measured)
    return raw


def fill_round(fillers: dict[str, Filler], r: int) -> dict[str, float]:
    """Round ``r`` of the fills: each filler once, in a rotated order; seconds per sample."""
    out = {}
    for name in rotated(list(fillers), r):
        gc.collect()
        out[name] = fillers[name](r)
    return out


def _record(into: dict[str, dict[str, list[float]]], side: str, measured: dict[str, float]) -> None:
    for name, t in measured.items():
        into.setdefault(side, {}).setdefault(name, []).append(t)


def summarize(raw: dict[str, dict[str, list[float]]], row: int, baselines: tuple[str, ...]) -> dict[str, Any]:
    """Per variant: seconds per sample and GB/s (medians), and its speed vs each baseline of its own process."""
    out: dict[str, Any] = {}
    for side, times in raw.items():
        for name, ts in times.items():
            key = f"{name} [stocaching's process]" if side == "child" and name in LIMITS else name
            entry: dict[str, Any] = {
                "process": side,
                "us_per_sample": spread([t * 1e6 for t in ts]),
                "gb_per_s": row / float(np.median(ts)) / 1e9,
            }
            for base in baselines:
                if base in times:
                    ratios = spread([b / t for t, b in zip(ts, times[base], strict=True)])
                    del ratios["rounds"]  # derivable from the raw rounds kept once, in us_per_sample
                    entry[f"speed_vs[{base}]"] = ratios
            out[key] = entry
    return out


def print_summary(sizes: list[dict[str, Any]], part: str, baseline: str) -> None:
    names = list(dict.fromkeys(name for size in sizes for name in size[part]))
    headers = ["variant", *[fmt_bytes(size["row"]) for size in sizes]]
    gbs = [[name, *[size[part].get(name, {}).get("gb_per_s", "-") for size in sizes]] for name in names]
    speed = [
        [name, *[size[part].get(name, {}).get(f"speed_vs[{baseline}]", {}).get("median", "-") for size in sizes]]
        for name in names
    ]
    print(f"\n[{part}] GB/s (median over rounds)")
    print(table(headers, gbs))
    print(f"\n[{part}] speed vs {baseline} in the same process and round (median of per-round ratios)")
    print(table(headers, speed))


def start_child(python: str) -> Child | None:
    if not stocaching_ready(python):
        print(f"stocaching side skipped: no set-up {python} (run benchmarks/run.py, or --setup-stocaching)")
        return None
    return Child(python, SCRIPT, ["--serve"])


def main() -> None:
    parser = bench_parser(__doc__, quick="3 sizes, small data, 3 rounds (a smoke test)", rounds=(11, 3))
    parser.add_argument("--sizes", help="sample sizes in bytes, comma separated (default 64 B ... 1 MiB)")
    parser.add_argument("--stocaching-python", default=str(STOCACHING_PYTHON), help="python of the stocaching venv")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM runs the cleanup below too
    quick: bool = args.quick
    rounds = args.rounds or (3 if quick else 11)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if quick else SIZES)
    td = tensordict_version()
    if td is not None:
        import torch

        # One intra-op thread, as in DataLoader workers (and stocaching's child): with two threads on
        # a busy 2-core machine, torch's advanced indexing took ~8 ms a call whatever the size.
        torch.set_num_threads(1)
    else:
        print("tensordict side skipped: tensordict is not installed (run benchmarks/run.py, or pip install tensordict)")
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load {info['loadavg_start']}")
    results: dict[str, Any] = {"machine": info, "quick": quick, "rounds": rounds, "chunk": CHUNK, "sizes": []}
    directory = Path(tempfile.mkdtemp(prefix="mmapcache-bench-", dir=args.dir))
    child = start_child(args.stocaching_python)
    results["peers"] = {"tensordict": td, "stocaching": None if child is None else child.hello}
    try:
        for row in sizes:
            plan = make_plan(row, quick=quick)
            t0 = time.perf_counter()
            raw = measure_size(plan, directory, rounds, child, td is not None)
            entry = {
                "row": row,
                "plan": plan.__dict__,
                "read": summarize(raw["read"], row, (TAKE, MEMCPY, COPY)),
                "fill": summarize(raw["fill"], row, (EMPTY,)),
            }
            results["sizes"].append(entry)
            print(f"{fmt_bytes(row)}: {plan.rows} samples, batch {plan.batch}, {time.perf_counter() - t0:.1f} s")
    finally:
        if child is not None:
            child.close()
        shutil.rmtree(directory, ignore_errors=True)
    print_summary(results["sizes"], "read", TAKE)
    print_summary(results["sizes"], "fill", EMPTY)
    print(f"\nresults: {write_results('bench_peers', results, quick=quick, path=args.json)}")


if __name__ == "__main__":
    main()
