"""The cost of the write-once slot protocol on the hot paths, with and without it, in one run.

For each sample size (64 B, 12 KB, 150 KB uint8) and in interleaved rounds:

* **put** — ``cache.put(i, sample)`` into an empty slot, against the same work
  without the protocol, written straight into the cache's mapped arrays:
  a raw row copy; copy + checksum (XXH3); copy + checksum + its store and the state stores (the
  protocol without the kernel lock, i.e. what ``put`` does minus the claim);
  and the protocol without the API layer (``_writer._fill``: lock + copy + checksum +
  publish, no index checks or value coercion). Also the cost of the pieces on
  their own (one kernel claim + release; one checksum) and of ``put`` on a slot
  that is already filled (which should cost a state read).
* **get** — ``cache.get(i)`` with ``verify=False`` and ``verify=True`` against a raw
  ``array[i].copy()`` and a raw state check + copy.
* **get_many** — ``cache.get_many(256 random indices)`` with ``verify=False`` and
  ``verify=True`` against the raw gather (page-aligned output, no state check),
  the raw state check + gather, and plain allocating ``np.take``.
* **put_many** — ``cache.put_many`` of 64 rows into empty slots against a raw
  ``array[idx] = batch`` and a raw per-row copy + checksum + state loop.

Run ``python benchmarks/bench_protocol.py`` (about 1 minute) or ``--quick``.
Results go to ``benchmarks/results/bench_protocol[-quick].json``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_parser, index_sets, machine_info, ratio, ratio_of_mins, run_interleaved, table, write_results

import mmapcache
from mmapcache import Cache, Field
from mmapcache._format.digests import checksum
from mmapcache._region.gathers import gather
from mmapcache._region.writer import _fill

SIZES: dict[str, tuple[int, ...]] = {"64B": (64,), "12KB": (3, 64, 64), "150KB": (3, 224, 224)}
EMPTY, READY = 0, 2  # slot state bytes (mmapcache._region.slots)
GET_BATCH = 256
PUT_OPS = 32  # puts per timed call
PUT_MANY_ROWS = 64
POOL = 64  # distinct source samples that puts copy from

Times = dict[str, list[float]]
Variant = Callable[[Any], object]


class Blocks:
    """Disjoint runs of empty slots, one per write variant per call, reset between rounds.

    A put needs an empty slot, so every timed call of every write variant gets
    its own shuffled run of slots; before each round all of them are marked
    EMPTY again (state bytes only: the data pages stay mapped and faulted in).
    """

    def __init__(self, cache: Cache, names: list[str], calls: int, per_call: int, seed: int = 0) -> None:
        self.cache, self.calls, self.per_call = cache, calls, per_call
        self.names = names
        self.rng = np.random.default_rng(seed)
        self.need = len(names) * calls * per_call
        self.next: dict[str, int] = {}
        self.slots: dict[str, np.ndarray[Any, Any]] = {}

    def reset(self) -> None:
        self.cache._mapped.slots.states[: self.need] = EMPTY
        perm = self.rng.permutation(self.need)
        size = self.calls * self.per_call
        for k, name in enumerate(self.names):
            self.slots[name] = perm[k * size : (k + 1) * size]
            self.next[name] = 0

    def take(self, name: str) -> np.ndarray[Any, Any]:
        start = self.next[name]
        self.next[name] = start + self.per_call
        return self.slots[name][start : start + self.per_call]


def open_cache(directory: Path, name: str, shape: tuple[int, ...], n: int, *, verify: bool = False) -> Cache:
    return Cache.open(directory / name, {"image": Field(shape, "uint8")}, length=n, key="bench_protocol", verify=verify)


def bench_put(cache: Cache, pool: np.ndarray[Any, Any], rounds: int, reps: int) -> Times:
    array = cache._mapped.arrays["image"]
    raw = cache._mapped.raws[0]
    slots = cache._mapped.slots
    states, checksums, locks = slots.states, slots.checksums, slots.locks
    lock_base = slots.lock_offset(0)
    record = slots.lock_offset(1) - lock_base
    write_lock = cache._handle.write_lock
    samples = [{"image": row} for row in pool]
    arrays = [[row] for row in pool]
    names = [
        "Cache.put",
        "protocol only (_writer._fill)",
        "raw copy+checksum+state (no lock)",
        "raw copy+checksum",
        "raw copy",
    ]
    blocks = Blocks(cache, [*names, "filled"], reps, PUT_OPS)

    def put(x: Any) -> None:
        for k, i in enumerate(blocks.take("Cache.put").tolist()):
            cache.put(i, samples[k % POOL])

    def fill(x: Any) -> None:
        for k, i in enumerate(blocks.take("protocol only (_writer._fill)").tolist()):
            with write_lock:
                _fill(cache._mapped, i, arrays[k % POOL], None)

    def copy_checksum_state(x: Any) -> None:
        for k, i in enumerate(blocks.take("raw copy+checksum+state (no lock)").tolist()):
            states[i] = 1
            array[i] = pool[k % POOL]
            checksums[i] = checksum((raw[i],))
            states[i] = READY

    def copy_checksum(x: Any) -> None:
        for k, i in enumerate(blocks.take("raw copy+checksum").tolist()):
            array[i] = pool[k % POOL]
            checksum((raw[i],))

    def copy(x: Any) -> None:
        for k, i in enumerate(blocks.take("raw copy").tolist()):
            array[i] = pool[k % POOL]

    def lock_pair(x: Any) -> None:
        for i in blocks.take("filled").tolist():
            offset = lock_base + i * record
            locks.try_claim(offset)
            locks.release(offset)

    def checksum_only(x: Any) -> None:
        for k in range(PUT_OPS):
            checksum((pool[k % POOL],))

    filled = np.arange(blocks.need, blocks.need + PUT_OPS)  # slots past the blocks: filled once, never reset
    cache.put_many(filled, {"image": pool[np.arange(PUT_OPS) % POOL]})

    def put_filled(x: Any) -> None:
        for k, i in enumerate(filled.tolist()):
            cache.put(i, samples[k % POOL])

    variants: dict[str, Variant] = {
        "Cache.put": put,
        "protocol only (_writer._fill)": fill,
        "raw copy+checksum+state (no lock)": copy_checksum_state,
        "raw copy+checksum": copy_checksum,
        "raw copy": copy,
        "kernel claim+release only": lock_pair,
        "checksum only": checksum_only,
        "Cache.put, slot already filled": put_filled,
    }

    def inputs(r: int) -> list[None]:
        blocks.reset()
        return [None] * reps

    return run_interleaved(variants, inputs, rounds=rounds, ops=dict.fromkeys(variants, PUT_OPS))


def bench_get(cache: Cache, checked: Cache, n: int, rounds: int, reps: int) -> Times:
    array = cache._mapped.arrays["image"]
    states = cache._mapped.states
    sums = cache._mapped.slots.checksums

    def loop(fn: Callable[[int], object]) -> Variant:
        def run(x: Any) -> None:
            for i in x[1]:
                fn(i)

        return run

    def state_copy(i: int) -> object:
        if states[i] == READY:
            return array[i].copy()
        return None

    def copy_checksum(i: int) -> object:
        out = array[i].copy()
        return checksum((out,)) == sums[i]

    variants: dict[str, Variant] = {
        "Cache.get": loop(cache.get),
        "Cache.get verify=True": loop(checked.get),
        "raw state check+copy": loop(state_copy),
        "raw copy+checksum check": loop(copy_checksum),
        "raw copy": loop(lambda i: array[i].copy()),
    }
    return run_interleaved(
        variants, index_sets(n, reps, GET_BATCH), rounds=rounds, ops=dict.fromkeys(variants, GET_BATCH)
    )


def bench_get_many(cache: Cache, checked: Cache, n: int, rounds: int, reps: int) -> Times:
    array = cache._mapped.arrays["image"]
    states = cache._mapped.slots.states

    def state_gather(x: Any) -> object:
        if not (states[x[0]] == READY).all():
            raise KeyError
        return gather(array, x[0])

    variants: dict[str, Variant] = {
        "Cache.get_many": lambda x: cache.get_many(x[0]),
        "Cache.get_many verify=True": lambda x: checked.get_many(x[0]),
        "raw state check+gather": state_gather,
        "raw gather (aligned out=)": lambda x: gather(array, x[0]),
        "np.take (allocating)": lambda x: np.take(array, x[0], axis=0),
    }
    return run_interleaved(variants, index_sets(n, reps, GET_BATCH), rounds=rounds)


def bench_put_many(cache: Cache, pool: np.ndarray[Any, Any], rounds: int, reps: int) -> Times:
    array = cache._mapped.arrays["image"]
    raw = cache._mapped.raws[0]
    states, checksums = cache._mapped.slots.states, cache._mapped.slots.checksums
    rows = np.arange(PUT_MANY_ROWS) % POOL
    batch = pool[rows]
    names = ["Cache.put_many", "raw per-row copy+checksum+state", "raw array[idx] = batch"]
    blocks = Blocks(cache, names, reps, PUT_MANY_ROWS, seed=1)

    def put_many(x: Any) -> None:
        cache.put_many(blocks.take("Cache.put_many"), {"image": batch})

    def per_row(x: Any) -> None:
        for k, i in enumerate(blocks.take("raw per-row copy+checksum+state").tolist()):
            states[i] = 1
            array[i] = batch[k]
            checksums[i] = checksum((raw[i],))
            states[i] = READY

    def fancy(x: Any) -> None:
        array[blocks.take("raw array[idx] = batch")] = batch

    variants: dict[str, Variant] = {
        "Cache.put_many": put_many,
        "raw per-row copy+checksum+state": per_row,
        "raw array[idx] = batch": fancy,
    }

    def inputs(r: int) -> list[None]:
        blocks.reset()
        return [None] * reps

    return run_interleaved(variants, inputs, rounds=rounds, ops=dict.fromkeys(variants, PUT_MANY_ROWS))


def summarize(times: Times, baselines: list[str], row_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for name, ts in times.items():
        med = float(np.median(ts))
        rows.append(
            {
                "variant": name,
                "median_us": med * 1e6,
                "min_us": min(ts) * 1e6,
                "max_us": max(ts) * 1e6,
                "gb_per_s": row_bytes / med / 1e9,
                **{f"time_vs[{b}]": ratio(times, name, b) for b in baselines},
                **{f"time_vs_of_mins[{b}]": ratio_of_mins(times, name, b) for b in baselines},
                "rounds_us": [t * 1e6 for t in ts],
            }
        )
    return rows


def print_rows(title: str, rows: list[dict[str, Any]], baselines: list[str]) -> None:
    print(f"\n{title}")
    headers = ["variant", "median µs", "GB/s", *[f"time / {b}" for b in baselines]]
    print(
        table(
            headers,
            [[r["variant"], r["median_us"], r["gb_per_s"], *[r[f"time_vs[{b}]"] for b in baselines]] for r in rows],
        )
    )


def main() -> None:
    parser = bench_parser(__doc__, quick="few rounds (< 1 minute)", rounds=(15, 5))
    args = parser.parse_args()
    quick: bool = args.quick
    rounds = args.rounds or (5 if quick else 15)
    reps = 5 if quick else 9
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, kernel {info['kernel']}, numpy {info.get('numpy')}")
    print(f"per-op medians over {rounds} interleaved rounds; ratios are medians of per-round ratios")
    results: dict[str, Any] = {"machine": info, "quick": quick, "rounds": rounds, "sizes": {}}
    directory = Path(tempfile.mkdtemp(prefix="mmapcache-bench-", dir=args.dir))
    try:
        for label, shape in SIZES.items():
            row_bytes = int(np.prod(shape))
            # Enough empty slots for every write variant's calls, plus data to read that is not all in cache.
            writes = max(9 * reps * PUT_OPS + PUT_OPS, 4 * reps * PUT_MANY_ROWS)
            n = max(writes, (64 if quick else 128) * 2**20 // row_bytes)
            rng = np.random.default_rng(0)
            pool = np.frombuffer(rng.bytes(POOL * row_bytes), np.uint8).reshape(POOL, *shape)
            path = directory / f"{label}.mmc"
            size: dict[str, Any] = {"shape": shape, "row_bytes": row_bytes, "slots": n}
            with open_cache(directory, path.name, shape, n) as cache:
                print(f"\n=== {label} samples {shape}, {n} slots")
                base = ["raw copy+checksum+state (no lock)", "raw copy"]
                size["put"] = summarize(bench_put(cache, pool, rounds, reps), base, row_bytes)
                print_rows(f"[{label}] put, µs per sample", size["put"], base)
                base = ["raw per-row copy+checksum+state", "raw array[idx] = batch"]
                size["put_many"] = summarize(bench_put_many(cache, pool, rounds, reps), base, row_bytes)
                print_rows(f"[{label}] put_many of {PUT_MANY_ROWS} rows, µs per sample", size["put_many"], base)
                # Fill every slot for the reads.
                cache.clear()
                for start in range(0, n, 1024):
                    idx = np.arange(start, min(n, start + 1024))
                    cache.put_many(idx, {"image": pool[idx % POOL]})
                with open_cache(directory, path.name, shape, n, verify=True) as checked:
                    base = ["raw copy", "raw state check+copy"]
                    size["get"] = summarize(bench_get(cache, checked, n, rounds, reps), base, row_bytes)
                    print_rows(f"[{label}] get, µs per sample", size["get"], base)
                    base = ["raw gather (aligned out=)", "raw state check+gather"]
                    times = bench_get_many(cache, checked, n, rounds, reps)
                    size["get_many"] = summarize(times, base, GET_BATCH * row_bytes)
                    print_rows(f"[{label}] get_many of {GET_BATCH} rows, µs per call", size["get_many"], base)
            mmapcache.remove(path)
            results["sizes"][label] = size
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print_summary(results)
    print(f"\nresults: {write_results('bench_protocol', results, quick=quick, path=args.json)}")


def print_summary(results: dict[str, Any]) -> None:
    print("\nProtocol overhead (time with / time without, same run)")
    rows = []
    for label, size in results["sizes"].items():

        def pick(section: str, variant: str, size: dict[str, Any] = size) -> dict[str, Any]:
            found: dict[str, Any] = {r["variant"]: r for r in size[section]}[variant]
            return found

        put = pick("put", "Cache.put")
        no_lock = put["time_vs[raw copy+checksum+state (no lock)]"]
        rows.append([label, "put vs raw copy+checksum+state", put["median_us"], no_lock])
        rows.append([label, "put vs raw copy", put["median_us"], put["time_vs[raw copy]"]])
        get = pick("get", "Cache.get")
        rows.append([label, "get vs raw state check+copy", get["median_us"], get["time_vs[raw state check+copy]"]])
        checked = pick("get", "Cache.get verify=True")
        rows.append([label, "get verify=True vs raw copy", checked["median_us"], checked["time_vs[raw copy]"]])
        gm = pick("get_many", "Cache.get_many")
        rows.append([label, "get_many vs raw gather", gm["median_us"], gm["time_vs[raw gather (aligned out=)]"]])
        gmv = pick("get_many", "Cache.get_many verify=True")
        rows.append(
            [label, "get_many verify=True vs raw gather", gmv["median_us"], gmv["time_vs[raw gather (aligned out=)]"]]
        )
    print(table(["size", "comparison", "µs (mmapcache)", "time ratio"], rows))


if __name__ == "__main__":
    main()
