"""Warm throughput of ``Mixture.loader()`` over three caches against one ``CachedDataset.loader()``, same bytes.

Three warm caches in /dev/shm (``web``, ``code``, ``math``: 70 / 20 / 10 % of
``--n`` samples of ``--row`` bytes each, uint8 plus an int64 label) are mixed
0.7 / 0.2 / 0.1 and read through ``mixture.loader(batch)``; the baseline is one
warm cache of all ``--n`` samples (the same bytes) read through
``ds.loader(batch, shuffle=True)``: the baseline's ``--n`` samples against one pass of
``mixture.loader(batch, num_samples=n)`` (``n`` positions), after one pass over every
cache in the measuring process (a warm process: no first-touch page faults). With 0
workers a round reads one epoch of each batch by batch in turn, each batch timed
(``_interleaved``: the two meet the same machine at the same moments); with 2
(persistent) a round times one epoch of each right after an untimed epoch of the same
loader (``_epoch``), in rotated order. Reported: the median over ``--rounds`` rounds of
the per-round throughput ratio mixture / baseline (target >= 0.95), and the seconds of
each; and, with 0 workers, the same ratio between the baseline and a loader over the same
rows in another file (A/A: how far two files alike read apart on this machine).

``python benchmarks/bench_mixture.py [--quick] [--json PATH] [--rounds R] [--n N] [--row BYTES]``
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data
from _common import bench_parser, machine_info, run_rounds, spread, table, write_results

from mmapcache.torch import CachedDataset, Mixture

WEIGHTS = {"web": 0.7, "code": 0.2, "math": 0.1}


class Rows(torch.utils.data.Dataset[Any]):
    """``(uint8 row of `row` bytes, int64 label)``: sample ``i`` of corpus ``code``."""

    def __init__(self, code: int, length: int, row: int) -> None:
        self.code, self.length, self.row = code, length, row

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return torch.full((self.row,), (self.code * 7 + index) % 251, dtype=torch.uint8), self.code * 10**6 + index


def _epoch(loader: Any) -> Callable[[int], float]:
    """Seconds to read one epoch of ``loader`` (a mixture's: its next pass) right after another of its epochs.

    An epoch read right after the other loader's ran 4-9 % slower than one read after its own (either
    loader): with two variants in rotated order, each round's first variant ran after itself and its
    second after the other, and the per-round ratios alternated by that much. Training reads epoch after
    epoch of one loader, so each variant is timed on its second epoch in a row.
    """

    def run(_: int) -> float:
        for _batch in loader:  # not timed: the epoch before, of the same loader
            pass
        start = time.perf_counter()
        for _batch in loader:
            pass
        return time.perf_counter() - start

    return run


def _interleaved(baseline: Any, mixed: Any, rounds: int) -> dict[str, list[float]]:
    """Per round, one epoch of each read batch by batch in turn (who goes first alternates), each batch timed.

    The epochs' sums of batch times, a round each: the two loaders meet the same machine at the
    same moments (the memory bandwidth left by other jobs drifts by 5-10 % between epochs here).
    """
    times: dict[str, list[float]] = {"one CachedDataset.loader()": [], "Mixture.loader()": []}
    for _ in range(rounds + 1):  # the first round warms up
        gc.collect()
        spent = [0.0, 0.0]
        iterators = [iter(baseline), iter(mixed)]
        done = [False, False]
        turn = 0
        while not all(done):
            for k in (turn, 1 - turn):
                if done[k]:
                    continue
                start = time.perf_counter()
                try:
                    next(iterators[k])
                except StopIteration:
                    done[k] = True
                spent[k] += time.perf_counter() - start
            turn = 1 - turn
        for name, seconds in zip(times, spent, strict=True):
            times[name].append(seconds)
    return {name: values[1:] for name, values in times.items()}


def main() -> None:
    parser = bench_parser(__doc__ or "", quick="fewer, smaller samples and rounds", rounds=(15, 3))
    parser.add_argument("--n", type=int, help="samples over the three caches (default 40000, quick 8000)")
    parser.add_argument("--row", type=int, default=12 * 1024, help="bytes per sample (default 12 KiB)")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    n = args.n or (8000 if args.quick else 40_000)
    rounds = args.rounds or (3 if args.quick else 15)
    directory = Path(tempfile.mkdtemp(prefix="bench-mixture-", dir=args.dir))
    results: dict[str, Any] = {"machine": machine_info(), "quick": args.quick, "n": n, "row": args.row}
    try:
        sizes = {name: int(n * weight) for name, weight in WEIGHTS.items()}
        sources = {
            name: CachedDataset(Rows(code, size, args.row), directory / f"{name}.mmc", key=name, check=0)
            for code, (name, size) in enumerate(sizes.items())
        }
        one = CachedDataset(Rows(9, sum(sizes.values()), args.row), directory / "one.mmc", key="one", check=0)
        # The same rows in another file: the A/A comparison says how far two files alike read apart here.
        other = CachedDataset(Rows(9, sum(sizes.values()), args.row), directory / "other.mmc", key="other", check=0)
        for ds in (*sources.values(), one, other):
            ds.fill()
            for _ in ds.loader(1024):  # every page touched in this process: the warm epochs of a long run
                pass
        mixture = Mixture(sources, WEIGHTS, seed=0)
        rows = []
        for workers in (0, 2):
            extra: dict[str, Any] = {"num_workers": workers}
            if workers:
                extra |= {"persistent_workers": True, "multiprocessing_context": "fork"}
            baseline = one.loader(args.batch, shuffle=True, generator=torch.Generator().manual_seed(0), **extra)
            mixed = mixture.loader(args.batch, num_samples=len(one), **extra)
            if workers:
                times = run_rounds(
                    {"one CachedDataset.loader()": _epoch(baseline), "Mixture.loader()": _epoch(mixed)},
                    rounds=rounds,
                )
            else:
                times = _interleaved(baseline, mixed, rounds)
            ratios = [
                b / m for b, m in zip(times["one CachedDataset.loader()"], times["Mixture.loader()"], strict=True)
            ]
            results[f"workers_{workers}"] = {
                "ratio": spread(ratios),
                "seconds": {name: spread(values) for name, values in times.items()},
            }
            gbps = n * args.row / min(times["Mixture.loader()"]) / 1e9
            rows.append([workers, float(np.median(ratios)), min(ratios), max(ratios), gbps])
            if not workers:  # A/A: one CachedDataset.loader() against another over the same rows in another file
                again = other.loader(args.batch, shuffle=True, generator=torch.Generator().manual_seed(1))
                pair = _interleaved(baseline, again, rounds)
                alike = [a / b for a, b in zip(*pair.values(), strict=True)]
                results["a_a_0_workers"] = {"ratio": spread(alike)}
                rows.append(["0, A/A", float(np.median(alike)), min(alike), max(alike), float("nan")])
        print(f"{n} samples of {args.row} B, batch {args.batch}, one epoch of each a round, {rounds} rounds")
        print(table(["workers", "mixture/one (median)", "min", "max", "mixture GB/s (best)"], rows))
        print(f"load average at the end: {os.getloadavg()}")
        path = write_results("bench_mixture", results, quick=args.quick, path=args.json)
        print(f"results: {path}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
