"""Quick start: create a cache in the default location, fill it, read it from a second process.

Run it with ``python examples/quickstart.py``. It prints what it does and
removes the cache at the end (pass ``--keep`` to leave it for ``mmapcache ls``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time

import numpy as np

import mmapcache
from mmapcache import Cache, Field

FIELDS = {"image": Field((3, 32, 32), "uint8"), "label": Field((), "int64")}
LENGTH = 5_000


def decode(index: int) -> dict[str, np.ndarray]:
    """Stands in for the expensive, deterministic part of loading a sample."""
    rng = np.random.default_rng(index)
    return {"image": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8), "label": np.int64(index % 10)}


def second_process(path: str) -> None:
    # Another process (a DataLoader worker, a DDP rank, another job) opens the
    # same file by its path and sees everything the first one stored.
    with Cache.open(path, readonly=True) as cache:
        batch = cache.get_many(np.arange(0, LENGTH, 7))
        expected = np.stack([decode(i)["image"] for i in range(0, LENGTH, 7)])
        assert np.array_equal(batch["image"], expected)
        print(f"[second process] opened {cache.path} by path: {cache.filled}/{cache.capacity} samples filled,")
        print(f"[second process] read {len(batch['label'])} of them in one get_many; all equal the originals")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the cache file in place")
    args = parser.parse_args()

    path = mmapcache.default_dir() / "quickstart.mmc"
    print(f"default location: {mmapcache.default_dir()}")
    with Cache.open(path, FIELDS, length=LENGTH, key="quickstart/v1") as cache:
        print(f"opened {cache.path}: {cache.nbytes / 2**20:.1f} MiB, {cache.filled}/{cache.capacity} filled")
        start = time.perf_counter()
        stored = sum(cache.put(i, decode(i)) for i in range(LENGTH))
        print(f"filled {stored} samples in {time.perf_counter() - start:.2f} s")

        start = time.perf_counter()
        for i in range(LENGTH):
            cache.get(i)
        print(f"read them back one by one in {time.perf_counter() - start:.3f} s (warm)")

        child = mp.get_context("spawn").Process(target=second_process, args=(str(path),))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"the second process failed (exit code {child.exitcode})")

    if args.keep:
        print(f"kept {path}; list caches with `mmapcache ls`, delete with `mmapcache rm {path}`")
    else:
        mmapcache.remove(path)  # the file and its lock file
        print(f"removed {path}")
        with contextlib.suppress(OSError):  # the directory default_dir() made, unless other caches live there
            path.parent.rmdir()  # (default_dir() makes it again when needed)
            print(f"removed the empty {path.parent}")


if __name__ == "__main__":
    main()
