"""A miss batch and a warm batch of ``CachedDataset.__getitems__``, this checkout against another version, in one run.

A *miss* batch is 32 samples that no process cached yet (image-like uint8
3x32x32 + an int label, each loaded from the dataset, converted, stored
through single flight and returned); a *warm* batch is 32 cached ones. Both
are timed interleaved round by round (``_common.run_interleaved``) for this
checkout's ``CachedDataset`` and for one from ``--baseline``: a source tree of
mmapcache (e.g. ``git archive HEAD mmapcache | tar -x -C /tmp/old``), imported
in the same process under another package name (see ``bench_torch_layer.py``).
Every miss batch of a round asks for indices that neither file holds yet, the
same ones for both versions. Reported: each path's time as a ratio to the
baseline's (median over rounds, with quartiles); 1.00 is unchanged, above 1
slower.

Run ``PYTHONPATH=$PWD python benchmarks/bench_misses.py --baseline /tmp/old``
(about half a minute), or ``--quick``.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import ratio, run_interleaved, spread, table
from bench_torch_layer import Images, load_baseline

BATCH = 32
CALLS = 10  # batches per variant and round


class ManyImages(Images):
    """:class:`Images`, enough of them for every round's fresh misses."""

    def __len__(self) -> int:
        return 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a source tree holding mmapcache/")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    import mmapcache.torch as current

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as directory:
        scratch = Path(directory)
        baseline = load_baseline(Path(args.baseline), scratch)
        warm, cold = {}, {}
        for name, module in (("before", baseline), ("after", current)):
            warm[name] = module.CachedDataset(Images(), scratch / f"warm-{name}.mmc", key="bench-misses")
            warm[name].fill(progress=False)
            cold[name] = module.CachedDataset(ManyImages(), scratch / f"cold-{name}.mmc", key="bench-misses")
            cold[name].__getitems__([0, 1])  # creates the file; the once-per-process checks run here
        rng = np.random.default_rng(0)
        fresh = itertools.count(2)
        length = len(ManyImages())
        needed = (rounds + 1) * CALLS * BATCH
        if needed + 2 > length:
            parser.error(f"{rounds} rounds need {needed} fresh samples; the dataset has {length}")

        def inputs(r: int) -> list[Any]:
            return [
                ([next(fresh) for _ in range(BATCH)], rng.integers(0, len(Images()), BATCH).tolist())
                for _ in range(CALLS)
            ]

        variants: dict[str, Any] = {}
        for name in ("before", "after"):
            variants[f"miss {name}"] = lambda batch, ds=cold[name]: ds.__getitems__(batch[0])
            variants[f"warm {name}"] = lambda batch, ds=warm[name]: ds.__getitems__(batch[1])
        times = run_interleaved(variants, inputs, rounds=rounds)
        rows = []
        for path in ("miss", "warm"):
            after, before = f"{path} after", f"{path} before"
            per = [a / b for a, b in zip(times[after], times[before], strict=True)]
            quartiles = spread(per)
            rows.append(
                [
                    f"{path} batch of {BATCH}",
                    f"{np.median(times[before]) * 1e6:.1f} µs",
                    f"{np.median(times[after]) * 1e6:.1f} µs",
                    f"{ratio(times, after, before):.3f}",
                    f"{quartiles['q1']:.3f}-{quartiles['q3']:.3f}",
                ]
            )
        print(f"{rounds} rounds of {CALLS} batches; time after / time before (1.00: unchanged)")
        print(table(["path", "before", "after", "after/before", "quartiles"], rows))
        for ds in (*warm.values(), *cold.values()):
            ds.close()


if __name__ == "__main__":
    main()
