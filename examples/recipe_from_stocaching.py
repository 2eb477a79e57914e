"""Coming from stocaching: the cache moves out of ``__getitem__``; random augmentation moves into ``transform=``.

    python examples/recipe_from_stocaching.py
    python examples/recipe_from_stocaching.py --length 20000 --workers 4

A stocaching dataset keeps a ``SharedCache`` and does everything in its
``__getitem__``::

    class MyDataset(Dataset):
        def __init__(self):
            self.cache = SharedCache(size_limit_gib=32, dataset_len=N, data_dims=(3, 32, 32), dtype=torch.uint8)

        def __getitem__(self, idx):
            x = self.cache.get_slot(idx)
            if x is None:
                x = decode(idx)                # deterministic: worth caching
                self.cache.set_slot(idx, x)
            return augment(x), labels[idx]    # random: every access

With mmapcache the dataset keeps only the deterministic part, and
``CachedDataset`` does the caching, shared by path across DDP ranks, their
workers and later runs (``Decoded`` and ``CachedDataset(...,
transform=Augment())`` below). Wrapping the old dataset as it is would
cache its augmented output — one random version of each sample, frozen
forever. ``CachedDataset`` catches that: the first sample a process loads
is loaded twice, and when the two differ it raises a ``CacheError`` saying
that the dataset is not deterministic. This script shows that error, then
runs the migrated version for two epochs.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache.torch import CachedDataset

Sample = tuple[torch.Tensor, int]


def decode(index: int) -> torch.Tensor:
    """Stands in for reading and decoding a file: deterministic, about half a millisecond."""
    time.sleep(0.0005)
    g = torch.Generator().manual_seed(index)
    return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g)


class Augment:
    """A random crop of the image padded by 4 pixels, then a random flip (on every access, after the cache)."""

    def __call__(self, sample: Sample) -> Sample:
        image, label = sample
        padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
        top, left = (int(v) for v in torch.randint(0, 9, (2,)))
        image = padded[:, top : top + 32, left : left + 32]
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


class OldStyle(Dataset[Sample]):
    """The stocaching dataset with its SharedCache taken out: the augmentation is still inside."""

    def __init__(self, length: int) -> None:
        self.length, self.augment = length, Augment()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Sample:
        return self.augment((decode(index), index % 10))


class Decoded(Dataset[Sample]):
    """The deterministic part only: what the cache keeps."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Sample:
        return decode(index), index % 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)  # the augmentation's draws, in this process and (through their seeds) in the workers

    # The pitfall: the old dataset wrapped as it is. The random crop would be frozen into the cache.
    frozen = CachedDataset(OldStyle(args.length), key="recipe-stocaching/old-style/v1")
    try:
        frozen[0]
        raise SystemExit("a dataset with random augmentation inside was cached without a word")
    except mmapcache.CacheError as error:
        print(f"wrapping the old dataset as it is: {type(error).__name__}: {str(error)[:90]}...")
    finally:
        frozen.close()
    assert not frozen.path.exists(), "nothing was cached"

    # The migration: the deterministic part in the dataset, the random part in transform=.
    ds = CachedDataset(Decoded(args.length), key="recipe-stocaching/decoded/v1", transform=Augment())
    loader = DataLoader(
        ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0
    )
    try:
        for epoch in range(2):
            start = time.perf_counter()
            for images, _labels in loader:
                assert images.shape[1:] == (3, 32, 32)
                assert images.dtype == torch.uint8
            stats = ds.stats()
            print(
                f"epoch {epoch}: {time.perf_counter() - start:.2f} s; "
                f"{stats['total_misses']} loads from the dataset so far, {stats['filled']} of {len(ds)} cached"
            )
    finally:
        del loader  # its persistent workers keep the cache open until then
        ds.close()
        mmapcache.remove(ds.path)
    print("removed the cache")


if __name__ == "__main__":
    main()
