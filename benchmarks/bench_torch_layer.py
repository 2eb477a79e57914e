"""The torch layer's warm paths, this checkout against another version of mmapcache, in one run.

``ds[i]``, ``ds.__getitems__(batch)`` and one ``ds.loader()`` epoch (no
workers) over a filled cache of image-like samples (uint8 3x32x32 + an int
label), timed interleaved round by round (``_common.run_interleaved``) for
this checkout's ``CachedDataset`` and for one from ``--baseline``: a source
tree of mmapcache (e.g. ``git archive cffe973 mmapcache | tar -x -C /tmp/old``),
imported in the same process under another package name. Reported: each
path's time as a ratio to the baseline's (median over rounds, with quartiles);
1.00 is unchanged, above 1 slower.

``--copy-false`` measures ``CachedDataset(copy=False)``, ``--transform flip``
(an out-of-place horizontal flip) or ``--transform float`` (``image.float() / 255``)
adds a transform.

Run ``PYTHONPATH=$PWD python benchmarks/bench_torch_layer.py --baseline /tmp/old``
(about a minute) or ``--quick``.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import ratio, run_interleaved, spread, table

LENGTH = 2048
BATCH = 64


class Images:
    """A deterministic map-style dataset: a uint8 3x32x32 image and an int label."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 32, 32), i % 251, dtype=torch.uint8), i


def flip(sample: Any) -> Any:
    """An out-of-place transform that costs little: the share of a copy before it shows."""
    image, label = sample
    return image.flip(-1), label


def to_float(sample: Any) -> Any:
    """An out-of-place transform of the usual kind: uint8 pixels to float32 in [0, 1]."""
    image, label = sample
    return image.float() / 255, label


TRANSFORMS = {"none": None, "flip": flip, "float": to_float}


def load_baseline(source: Path, scratch: Path) -> Any:
    """The ``mmapcache`` package under ``source``, imported as ``mmapcache_baseline`` (its imports are relative)."""
    shutil.copytree(source / "mmapcache", scratch / "mmapcache_baseline")
    sys.path.insert(0, str(scratch))
    return importlib.import_module("mmapcache_baseline.torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a source tree holding mmapcache/")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--copy-false", action="store_true", help="CachedDataset(copy=False)")
    parser.add_argument("--transform", choices=sorted(TRANSFORMS), default="none")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    import mmapcache.torch as current

    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        baseline = load_baseline(args.baseline, scratch)
        datasets = {}
        for name, module in (("before", baseline), ("after", current)):
            ds = module.CachedDataset(
                Images(),
                scratch / f"{name}.mmc",
                key="bench-torch-layer",
                copy=not args.copy_false,
                transform=TRANSFORMS[args.transform],
            )
            ds.fill(progress=False)
            datasets[name] = ds
        rng = np.random.default_rng(0)

        def inputs(r: int) -> list[Any]:
            return [rng.integers(0, LENGTH, BATCH).tolist() for _ in range(40)]

        def loader_epoch(ds: Any) -> None:
            for _ in ds.loader(batch_size=BATCH, shuffle=True):
                pass

        variants: dict[str, Any] = {}
        for name, ds in datasets.items():
            variants[f"ds[i] {name}"] = lambda batch, ds=ds: [ds[i] for i in batch]
            variants[f"__getitems__ {name}"] = lambda batch, ds=ds: ds.__getitems__(batch)
        ops = {f"ds[i] {name}": BATCH for name in datasets}  # ds[i]: per sample
        times = run_interleaved(variants, inputs, rounds=rounds, ops=ops)
        epochs = run_interleaved(
            {f"loader() epoch {name}": lambda _, ds=ds: loader_epoch(ds) for name, ds in datasets.items()},
            lambda r: [None] * 10,
            rounds=rounds,
        )
        times.update(epochs)
        rows = []
        for path in ("ds[i]", "__getitems__", "loader() epoch"):
            after, before = f"{path} after", f"{path} before"
            per = [a / b for a, b in zip(times[after], times[before], strict=True)]
            quartiles = spread(per)
            rows.append(
                [
                    path,
                    f"{np.median(times[before]) * 1e6:.2f} µs",
                    f"{np.median(times[after]) * 1e6:.2f} µs",
                    f"{ratio(times, after, before):.3f}",
                    f"{quartiles['q1']:.3f}-{quartiles['q3']:.3f}",
                ]
            )
        setting = f"copy={not args.copy_false}, transform={args.transform}"
        print(f"{rounds} rounds, {setting}; time after / time before (1.00: unchanged)")
        print(table(["path", "before", "after", "after/before", "quartiles"], rows))
        for ds in datasets.values():
            ds.close()


if __name__ == "__main__":
    main()
