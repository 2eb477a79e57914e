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

``--limit`` measures this checkout alone against the limit instead: a warm
``ds.loader(batch_size=256, shuffle=True)`` epoch (no workers) of uint8 rows of
1 KB, 12 KB and 147 KB plus an int64 label, against the same shuffled batches
gathered by ``np.take`` from in-RAM arrays into tensors (both allocate their
batches), and ``get_many`` of 256 random rows of 64 B and 12 KB against
``np.take`` from an in-RAM array and from a raw mapping of a /dev/shm file
holding the same rows; and a ``ds.loader(batch_size=64)`` epoch with a per-sample
crop + flip ``transform=`` against the same transform over the images held in RAM,
stacked (the floor of any loader that applies a per-sample transform). Reported:
GB/s and the ratio to the limit per round (median, quartiles); results in
``results/bench_torch_layer-limit.json``.
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


class Rows:
    """``n`` rows of ``row`` uint8 bytes (a pattern of the index) and an int64 label."""

    def __init__(self, n: int, row: int) -> None:
        self.n, self.row = n, row

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((self.row,), i % 251, dtype=torch.uint8), i


LIMIT_ROWS = {"1KB": 1024, "12KB": 12 * 1024, "147KB": 147 * 1024}
LIMIT_BATCH = 256
LIMIT_BYTES = 96 * 2**20  # data per row size: well past the CPU caches


def limit_main(rounds: int) -> None:
    """``--limit``: loader() epochs and get_many against np.take, in interleaved rounds (see the docstring)."""
    import mmap
    import os

    from _common import machine_info, write_results

    import mmapcache
    from mmapcache import Cache, Field
    from mmapcache.torch import CachedDataset

    results: dict[str, Any] = {"machine": machine_info(), "rounds": rounds, "batch": LIMIT_BATCH}
    rows_out = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        scratch = Path(directory)
        for label, row in LIMIT_ROWS.items():
            n = max(2048, LIMIT_BYTES // row)
            ds = CachedDataset(Rows(n, row), scratch / f"rows-{label}.mmc", key=f"limit-{label}", check=0)
            ds.fill(progress=False, batch_size=1024)
            images = np.ascontiguousarray(np.stack([np.full(row, i % 251, np.uint8) for i in range(n)]))
            labels = np.arange(n, dtype=np.int64)
            loader = ds.loader(batch_size=LIMIT_BATCH, shuffle=True)

            def fast(_: Any, loader: Any = loader) -> None:
                for _batch in loader:
                    pass

            def limit(_: Any, images: Any = images, labels: Any = labels, n: int = n) -> None:
                order = torch.randperm(n).numpy()
                for start in range(0, n, LIMIT_BATCH):
                    b = order[start : start + LIMIT_BATCH]
                    torch.from_numpy(np.take(images, b, axis=0)), torch.from_numpy(np.take(labels, b))

            times = run_interleaved({"loader()": fast, "np.take": limit}, lambda r: [None] * 3, rounds=rounds)
            per = [t / f for t, f in zip(times["np.take"], times["loader()"], strict=True)]
            gbps = n * (row + 8) / np.median(times["loader()"]) / 1e9
            results[f"loader {label}"] = {"speed_vs_limit": spread(per), "gb_per_s": gbps, "rows": n}
            rows_out.append([f"loader() epoch, {label} rows", f"{gbps:.2f} GB/s", _fmt(spread(per))])
            ds.close()
            mmapcache.remove(ds.path)
            del images
        results["per-sample transform vs floor"], row_out = _transform_floor(scratch, rounds)
        rows_out.append(row_out)
        for label, row in (("64B", 64), ("12KB", 12 * 1024)):
            n = max(4096, LIMIT_BYTES // row)
            path = scratch / f"get-{label}.mmc"
            cache = Cache.open(path, {"x": Field((row,), "uint8")}, n)
            for start in range(0, n, 1024):
                stop = min(n, start + 1024)
                cache.put_many(range(start, stop), {"x": np.full((stop - start, row), 7, np.uint8)})
            ram = np.full((n, row), 7, np.uint8)
            raw_path = scratch / f"raw-{label}"
            with open(raw_path, "wb") as f:
                f.truncate(n * row)
            fd = os.open(raw_path, os.O_RDWR)
            mm = mmap.mmap(fd, n * row)
            os.close(fd)
            raw = np.ndarray((n, row), np.uint8, buffer=mm)
            raw[:] = 7
            rng = np.random.default_rng(1)

            def inputs(r: int, n: int = n, rng: Any = rng) -> list[Any]:
                return [rng.integers(0, n, LIMIT_BATCH) for _ in range(200)]

            variants = {
                "get_many": lambda idx, cache=cache: cache.get_many(idx),
                "np.take (in RAM)": lambda idx, ram=ram: np.take(ram, idx, axis=0),
                "np.take (raw mapping)": lambda idx, raw=raw: np.take(raw, idx, axis=0),
            }
            times = run_interleaved(variants, inputs, rounds=rounds)
            for limit_name in ("np.take (in RAM)", "np.take (raw mapping)"):
                per = [t / g for t, g in zip(times[limit_name], times["get_many"], strict=True)]
                results[f"get_many {label} vs {limit_name}"] = {
                    "speed": spread(per),
                    "get_many_us": float(np.median(times["get_many"]) * 1e6),
                    "limit_us": float(np.median(times[limit_name]) * 1e6),
                }
                rows_out.append(
                    [
                        f"get_many, 256 rows of {label} vs {limit_name}",
                        f"{np.median(times['get_many']) * 1e6:.2f} vs {np.median(times[limit_name]) * 1e6:.2f} µs",
                        _fmt(spread(per)),
                    ]
                )
            del raw
            mm.close()
            cache.close()
            mmapcache.remove(path)
    print(f"{rounds} interleaved rounds; speed = limit's time / ours, per round: median [quartiles]")
    print(table(["path", "figure", "speed vs limit"], rows_out))
    print(f"results: {write_results('bench_torch_layer-limit', results, quick=False)}")


class Pictures:
    """``n`` uint8 3x112x112 images and their labels: the size bench_dataloader.py's JPEGs decode to."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 112, 112), i % 251, dtype=torch.uint8), i


def _transform_floor(scratch: Path, rounds: int) -> tuple[dict[str, Any], list[str]]:
    """A warm ``ds.loader(64, shuffle=True)`` epoch with bench_dataloader.py's per-sample crop + flip ``transform=``,
    against the same transform over the same images held in RAM as tensors, stacked a batch at a time (what a
    loader that applies a per-sample transform cannot beat: no read, no copy but the stack)."""
    from bench_dataloader import crop_flip

    from mmapcache.torch import CachedDataset

    n = 2000
    ds = CachedDataset(Pictures(n), scratch / "pictures.mmc", key="pictures", check=0, transform=crop_flip)
    ds.fill(progress=False)
    held = [Pictures(n)[i] for i in range(n)]
    loader = ds.loader(batch_size=BATCH, shuffle=True)

    def ours(_: Any) -> None:
        for _batch in loader:
            pass

    def floor(_: Any) -> None:
        order = torch.randperm(n).tolist()
        for start in range(0, n, BATCH):
            samples = [crop_flip(held[i]) for i in order[start : start + BATCH]]
            torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])

    times = run_interleaved(
        {"loader(transform=)": ours, "transform + stack in RAM": floor}, lambda r: [None] * 3, rounds=rounds
    )
    per = [t / o for t, o in zip(times["transform + stack in RAM"], times["loader(transform=)"], strict=True)]
    found = {"speed_vs_floor": spread(per), "ms": {k: float(np.median(v) * 1e3) for k, v in times.items()}}
    ds.close()
    return found, [
        "loader(transform=crop_flip) epoch, 2,000 images of 3x112x112, vs the transform + stack in RAM",
        f"{found['ms']['loader(transform=)']:.1f} vs {found['ms']['transform + stack in RAM']:.1f} ms",
        _fmt(spread(per)),
    ]


def _fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f} [{s['q1']:.2f}-{s['q3']:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a source tree holding mmapcache/")
    parser.add_argument("--limit", action="store_true", help="this checkout against np.take (see the docstring)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--copy-false", action="store_true", help="CachedDataset(copy=False)")
    parser.add_argument("--transform", choices=sorted(TRANSFORMS), default="none")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    if args.limit:
        return limit_main(rounds)
    if args.baseline is None:
        parser.error("--baseline is needed (or --limit)")
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
