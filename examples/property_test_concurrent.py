"""Property-test your cached dataset under concurrent access, with mmapcache.testing.

    python examples/property_test_concurrent.py                 # the default budget: 10-20 s on 2 cores
    python examples/property_test_concurrent.py --examples 200  # a longer search
    pytest examples/property_test_concurrent.py                 # the same, as a pytest test

The property a cached dataset must have is simple to state: *whatever the
processes do -- load the same samples at the same time, close, reopen, die
with kill -9 in the middle of a write -- every sample any of them gets equals
what your uncached dataset returns*, and a sample, once stored, stays stored.

``check_concurrent_access`` lets Hypothesis choose those events for real
processes sharing the cache, checks the property after every step, and on a
failure raises ``AssertionError`` with the shrunk sequence of steps (see
docs/testing.md). To test your own dataset, replace ``Decoded`` with it (the
oracle is its ``__getitem__``), or pass a ``make_dataset`` that builds your own
cache around a file path.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import numpy as np
import torch

from mmapcache.testing import check_concurrent_access
from mmapcache.torch import CachedDataset


class Decoded(torch.utils.data.Dataset[Any]):
    """Stands in for your JPEG decode + resize: deterministic, so the same index gives the same sample."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        return torch.from_numpy(rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)), index % 10


def check(examples: int, processes: int = 3, seed: int | None = None) -> str:
    make_dataset = functools.partial(CachedDataset, Decoded(), key="decoded/v1")  # called with each fresh path
    summary = check_concurrent_access(
        make_dataset, Decoded().__getitem__, processes=processes, max_examples=examples, seed=seed
    )
    return str(summary)


def test_concurrent_access() -> None:
    """The same check, for ``pytest examples/property_test_concurrent.py``."""
    check(examples=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=25, help="runs for Hypothesis to try (default 25)")
    parser.add_argument("--processes", type=int, default=3, help="processes sharing the cache (default 3)")
    parser.add_argument("--seed", type=int, default=None, help="repeat the same steps (not their timing)")
    args = parser.parse_args()
    print(f"ok: {check(args.examples, args.processes, args.seed)}; every sample equal to Decoded()'s, nothing lost")


if __name__ == "__main__":
    main()
