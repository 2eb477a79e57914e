"""Object detection: images at their own size, and a different number of boxes in each, in one cache.

    python examples/detection_boxes.py                   # 2 000 synthetic images, 2 workers
    python examples/detection_boxes.py --count 200 --workers 1 --keep

Each sample is a dict: ``image`` (uint8, 3 x H x W, every image its own size,
decoded and kept at native resolution), ``boxes`` (float32, N x 4, as
x0, y0, x1, y1 in pixels) and ``labels`` (int64, N), where N is the number of
objects in the image, 0 included. None of them has a fixed shape, so the
cache is declared with ``fields=`` and ``None`` dimensions, plus a
``max_bytes`` budget for the values. Random flips run after the cache, on
every access, boxes flipped with their image. Batches keep each field as a
list of per-image tensors (the usual detection collate): a model takes
images of different sizes. The first epoch fills the cache, the second reads
only the file. At the end the cache is removed, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset

# The sample is a dict, so the fields are named by its keys.
FIELDS = {
    "image": Field((3, None, None), "uint8"),  # any height and width
    "boxes": Field((None, 4), "float32"),  # any number of boxes, 4 coordinates each
    "labels": Field((None,), "int64"),  # one label per box
}
CLASSES = 5


class Shapes(Dataset[dict[str, Any]]):
    """Stands in for decoding images and their annotations: the deterministic part, cached as it is."""

    def __init__(self, count: int, max_side: int) -> None:
        self.count, self.max_side = count, max_side

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(index)
        h, w = (int(side) for side in rng.integers(self.max_side // 2, self.max_side + 1, 2))
        # A smooth background, computed pixel by pixel: stands in for the cost of decoding a JPEG.
        y, x = np.mgrid[0:h, 0:w] / self.max_side
        a, b = rng.uniform(2, 9, 2)
        image = np.stack([np.sin(a * x + c) * np.cos(b * y - c) for c in (0.0, 1.0, 2.0)], axis=-1)
        image = ((image + 1) * 40).astype(np.uint8)
        objects = int(rng.integers(0, 6))
        boxes = np.empty((objects, 4), np.float32)
        labels = rng.integers(0, CLASSES, objects)
        for k in range(objects):
            x0, y0 = int(rng.integers(0, w - 4)), int(rng.integers(0, h - 4))
            x1, y1 = int(rng.integers(x0 + 4, w + 1)), int(rng.integers(y0 + 4, h + 1))
            image[y0:y1, x0:x1] = 100 + 30 * labels[k]  # a box of its class's colour
            boxes[k] = (x0, y0, x1, y1)
        chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        return {"image": chw, "boxes": torch.from_numpy(boxes), "labels": torch.from_numpy(labels)}


def random_flip(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Augmentation after the cache: flip the image left-right half of the time, and its boxes with it."""
    if torch.rand(()) < 0.5:
        width = sample["image"].shape[-1]
        boxes = sample["boxes"].clone()
        boxes[:, [0, 2]] = width - sample["boxes"][:, [2, 0]]
        sample = {**sample, "image": sample["image"].flip(-1), "boxes": boxes}
    return sample


def keep_lists(batch: list[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """The detection collate: each field a list with one tensor per image (images differ in size)."""
    return {key: [sample[key] for sample in batch] for key in batch[0]}


def check(batch: dict[str, list[torch.Tensor]]) -> int:
    """Stands in for the training step: every image has its boxes and labels, each box inside it."""
    objects = 0
    for image, boxes, labels in zip(batch["image"], batch["boxes"], batch["labels"], strict=True):
        _, height, width = image.shape
        assert boxes.shape == (len(labels), 4)
        assert bool((boxes[:, 2] <= width).all())
        assert bool((boxes[:, 3] <= height).all())
        objects += len(labels)
    return objects


def epoch(loader: DataLoader[Any]) -> tuple[float, int, int]:
    start = time.perf_counter()
    images = objects = 0
    for batch in loader:
        objects += check(batch)
        images += len(batch["image"])
    return time.perf_counter() - start, images, objects


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2_000, help="images in the dataset")
    parser.add_argument("--max-side", type=int, default=320, help="images are max-side/2 to max-side pixels a side")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the cache for `mmapcache ls`")
    args = parser.parse_args()

    source = Shapes(args.count, args.max_side)
    # The budget: at most 3 x side x side bytes per image, and a few boxes; the fixed part of each slot on top.
    budget = args.count * (3 * args.max_side**2 + 256) + 2**20
    ds = CachedDataset(
        source,
        key=f"detection-boxes-example/{args.count}/{args.max_side}px/v1",
        fields=FIELDS,
        max_bytes=budget,
        transform=random_flip,
    )
    print(f"{len(ds)} images of {args.max_side // 2} to {args.max_side} px a side; cache {ds.path}")

    def loader(dataset: Dataset[Any]) -> DataLoader[Any]:
        return DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, collate_fn=keep_lists
        )

    try:
        seconds, images, objects = epoch(loader(source))
        print(f"uncached epoch: {images} images, {objects} boxes in {seconds:.2f} s")
        cached = loader(ds)
        loaded = 0
        for number in (1, 2):
            seconds, images, objects = epoch(cached)
            total = ds.stats()["total_misses"]  # counted in the file by every process: the workers here
            what = "fills the cache" if number == 1 else "warm"
            print(
                f"cached epoch {number} ({what}): {images} images, {objects} boxes in {seconds:.2f} s, "
                f"{total - loaded} loaded from the dataset"
            )
            loaded = total
        batch = next(iter(cached))
        sizes = [tuple(image.shape) for image in batch["image"][:3]]
        print(
            f"a batch: {len(batch['image'])} images of their own sizes {sizes}..., boxes per image "
            f"{[len(boxes) for boxes in batch['boxes']]}"
        )
        plain = CachedDataset(source, ds.path, key=ds.key)  # the same file, without the random flips
        for i in (0, len(ds) - 1):  # what the cache holds is what the dataset gives
            cached_sample, original = plain[i], source[i]
            assert torch.equal(cached_sample["image"], original["image"])
            assert torch.equal(cached_sample["boxes"], original["boxes"])
            assert torch.equal(cached_sample["labels"], original["labels"])
        plain.close()
        region = ds.cache.variable_region
        used = f", {region.used / 2**20:.1f} of {region.size / 2**20:.1f} MiB of values" if region else ""
        print(f"cache: {ds.stats()['filled']}/{len(ds)} images{used}")
    finally:
        ds.close()
        if args.keep:
            print(f"kept the cache: {ds.path} (`mmapcache rm {ds.path}` removes it)")
        elif ds.path.exists():
            mmapcache.remove(ds.path)
            print(f"removed {ds.path}")


if __name__ == "__main__":
    main()
