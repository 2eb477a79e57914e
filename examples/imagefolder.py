"""A folder of JPEGs, decoded with Pillow: epoch times uncached vs cached with CachedDataset.

    python examples/imagefolder.py                 # generates 3000 JPEGs in a temp dir
    python examples/imagefolder.py --root ~/data/train --size 224 --workers 4

``--root`` is a folder of ``<class>/<image>.jpg`` (any depth; the parent folder
names the class). Without it, the example writes a few thousand small JPEGs
to a temporary directory first. It times one epoch of the plain decoding
dataset, then the cached one: the first cached epoch fills the cache, later
ones read only from it (random flips still run on every access, after the
cache). At the end it removes the cache and the generated images, unless
``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache.torch import CachedDataset


class JPEGFolder(Dataset[tuple[torch.Tensor, int]]):
    """Decode and resize each JPEG: the deterministic, expensive part worth caching."""

    def __init__(self, root: Path, size: int) -> None:
        self.files = sorted(p for p in root.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg"})
        if not self.files:
            raise SystemExit(f"no .jpg files under {root}")
        classes = sorted({p.parent.name for p in self.files})
        self.labels = {name: i for i, name in enumerate(classes)}
        self.size = size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.files[index]
        with Image.open(path) as image:
            pixels = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
        chw = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous()  # uint8, 3 x size x size
        return chw, self.labels[path.parent.name]


def random_flip(sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmentation: runs after the cache, on every access."""
    image, label = sample
    if torch.rand(()) < 0.5:
        image = image.flip(-1)
    return image, label


def generate(root: Path, count: int, side: int) -> None:
    """Write ``count`` photo-sized JPEGs in 10 class folders: shifted, tinted copies of a few colour fields."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side] / side
    bases = []
    for _ in range(8):
        a, b, c = rng.uniform(1, 8, 3)
        rgb = np.stack([np.sin(a * x + b * y), np.cos(b * x * y * 3 + c), np.sin(c * x - a * y)], axis=-1)
        bases.append(((rgb + rng.normal(0, 0.1, rgb.shape) + 1) * 110).clip(0, 230).astype(np.uint8))
    for i in range(count):
        pixels = np.roll(bases[i % 8], tuple(rng.integers(0, side, 2)), axis=(0, 1)) + rng.integers(0, 25, 3, np.uint8)
        folder = root / f"class{i % 10}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def epoch(loader: DataLoader[Any]) -> float:
    start = time.perf_counter()
    for images, _labels in loader:
        images.float().mean()  # stands in for the training step
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, help="a folder of JPEGs (default: generate some)")
    parser.add_argument("--count", type=int, default=3000, help="JPEGs to generate without --root")
    parser.add_argument("--side", type=int, default=400, help="side of the generated JPEGs in pixels")
    parser.add_argument("--size", type=int, default=112, help="decode and resize to size x size")
    parser.add_argument("--epochs", type=int, default=3, help="cached epochs (the first fills the cache)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the cache (and generated images)")
    args = parser.parse_args()

    generated: Path | None = None
    root: Path = args.root
    if root is None:
        root = generated = Path(tempfile.mkdtemp(prefix="mmapcache-jpegs-"))
        start = time.perf_counter()
        generate(generated, args.count, args.side)
        print(f"generated {args.count} {args.side} px JPEGs in {generated} ({time.perf_counter() - start:.1f} s)")
    root = root.resolve()
    decoded = JPEGFolder(root, args.size)
    # The key names the content: which images, decoded how. Change it when either changes.
    key = f"imagefolder/{hashlib.sha256(str(root).encode()).hexdigest()[:8]}/{len(decoded)}/{args.size}px/v1"
    ds = CachedDataset(decoded, key=key, transform=random_flip)
    print(f"{len(decoded)} images, {args.size} px, batch {args.batch_size}, {args.workers} workers; cache {ds.path}")

    try:
        compare(decoded, ds, args)
    finally:
        ds.close()
        if generated is not None and not args.keep:
            shutil.rmtree(generated)
        if args.keep:
            print(f"kept the cache: {ds.path}" + (f" and the images: {generated}" if generated else ""))
        elif ds.path.exists():
            try:
                mmapcache.remove(ds.path)
            except mmapcache.CacheInUseError as error:
                print(f"not removed: {error}; `mmapcache rm {ds.path}` removes it later")


def compare(decoded: JPEGFolder, ds: CachedDataset, args: argparse.Namespace) -> None:
    """Time an uncached epoch, then cached ones; the loaders (and their workers) end with this function."""

    def loader(dataset: Dataset[Any], workers: int = args.workers) -> DataLoader[Any]:
        return DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0
        )

    def report(what: str, seconds: float) -> None:
        print(f"{what:34s} {seconds:6.2f} s  {seconds / len(ds) * 1e6:7.1f} us/sample")

    plain = epoch(loader(decoded))
    report("uncached epoch", plain)
    cached = loader(ds)  # persistent workers keep the cache mapped from one epoch to the next
    times = []
    for number in range(1, args.epochs + 1):
        times.append(epoch(cached))
        report(f"cached epoch {number} ({'fills the cache' if number == 1 else 'warm'})", times[-1])
    inline = epoch(loader(ds, workers=0))
    report("warm epoch, num_workers=0", inline)
    print(f"cache: {ds.cache.filled}/{len(ds)} samples, {ds.cache.nbytes / 2**20:.1f} MiB in {ds.path.parent}")
    if len(times) > 1:
        warm = min(times[1:])
        print(f"speedup of a warm epoch over an uncached one: {plain / warm:.1f}x ({args.workers} workers)")
        print(f"  and with num_workers=0 once warm: {plain / inline:.1f}x")


if __name__ == "__main__":
    main()
