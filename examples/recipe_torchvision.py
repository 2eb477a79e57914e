"""An ImageFolder pipeline split in two: decode + resize cached, random crop + flip in ``transform=``.

    python examples/recipe_torchvision.py                  # writes a few hundred small JPEGs to a temp dir
    python examples/recipe_torchvision.py --root ~/data/train --short-side 256 --crop 224 --workers 8

The deterministic part of each sample — decode the JPEG, resize its short
side — is what the cache keeps, as a uint8 ``3 x H x W`` tensor (what
torchvision's ``PILToTensor()`` gives; ``ToTensor()`` would store float32,
4x the bytes). Images keep their aspect ratio, so the cache declares the
height and width as varying (``Field((3, None, None), "uint8")``). The
random part — a random resized crop and a flip — runs in ``transform=``,
after the cache, on every access, so every epoch sees new crops.

Cache the resized image, not a crop of it: a cached centre crop would leave
``RandomResizedCrop`` only the centre to sample from, every epoch.

This script needs only Pillow and torch: ``DecodeResize`` does what
``ImageFolder(root, transform=Compose([Resize(s), PILToTensor()]))`` does and
``RandomResizedCrop`` what torchvision's does, wrapped like a v1 transform
(it takes the image; ``OnImage`` applies it to the ``(image, label)`` sample).
docs/recipes.md shows the same split written with torchvision. The workers
are spawned (Python 3.14's default start method is forkserver, which pickles
the dataset the same way): the transform is a module-level class, because a
lambda does not pickle.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset

Sample = tuple[torch.Tensor, int]


class DecodeResize(Dataset[Sample]):
    """``<root>/<class>/<image>.jpg``, decoded and resized to a short side of ``short_side``, as uint8 CHW.

    The same samples as ``ImageFolder(root, transform=Compose([Resize(short_side), PILToTensor()]))``.
    """

    def __init__(self, root: Path, short_side: int) -> None:
        self.files = sorted(p for p in root.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
        if not self.files:
            raise SystemExit(f"no images under {root}")
        self.classes = sorted({p.parent.name for p in self.files})
        self.short_side = short_side

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Sample:
        path = self.files[index]
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        w, h = rgb.size
        scale = self.short_side / min(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        resized = rgb.resize(size, Image.Resampling.BILINEAR, reducing_gap=None)
        chw = torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1).contiguous()  # PILToTensor
        return chw, self.classes.index(path.parent.name)


class RandomResizedCrop:
    """A crop of random area (8 to 100%) and aspect ratio (3/4 to 4/3), resized to ``size``, flipped half the time.

    Takes a uint8 image, returns float32 in [0, 1] — the end of a training pipeline.
    """

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0)) -> None:
        self.size, self.scale = size, scale

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, h, w = image.shape
        top, left, ch, cw = 0, 0, h, w
        for _ in range(10):
            area = h * w * random.uniform(*self.scale)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                top, left = random.randint(0, h - ch), random.randint(0, w - cw)
                break
        else:
            ch = cw = min(h, w)
            top, left = (h - ch) // 2, (w - cw) // 2
        crop = image[None, :, top : top + ch, left : left + cw].float() / 255
        out = torch.nn.functional.interpolate(crop, size=(self.size, self.size), mode="bilinear", antialias=True)[0]
        return out.flip(-1) if random.random() < 0.5 else out


class OnImage:
    """Apply an image transform to the image of an ``(image, label)`` sample (torchvision v1 transforms take the image).

    A module-level class, not a lambda: spawn and forkserver workers unpickle the transform.
    """

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.transform = transform

    def __call__(self, sample: Sample) -> Sample:
        image, label = sample
        return self.transform(image), label


def write_images(root: Path, count: int, side: int) -> None:
    """``count`` JPEGs of varying aspect ratios in 4 class folders."""
    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = int(side * rng.uniform(0.75, 1.5)), int(side * rng.uniform(0.75, 1.5))
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        pixels = np.kron(base, np.ones((8, 8, 1), np.uint8))[:h, :w]  # blocky: compresses like a photo
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def epoch(loader: DataLoader[Sample]) -> tuple[float, int]:
    start, seen = time.perf_counter(), 0
    for images, labels in loader:
        assert images.dtype == torch.float32
        assert labels.dtype == torch.int64
        seen += len(labels)
    return time.perf_counter() - start, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, help="an ImageFolder tree (default: generate one)")
    parser.add_argument("--count", type=int, default=400, help="images to generate without --root")
    parser.add_argument("--short-side", type=int, default=80)
    parser.add_argument("--crop", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the cache (and the generated images)")
    args = parser.parse_args()

    scratch = None
    root = args.root
    if root is None:
        scratch = Path(tempfile.mkdtemp(prefix="recipe-torchvision-"))
        root = scratch / "train"
        write_images(root, args.count, args.short_side + args.short_side // 4)
    decoded = DecodeResize(root, args.short_side)
    # Each resized image is 3 x short_side x (its long side): budget 2x the short side for the long one.
    budget = len(decoded) * 3 * args.short_side * 2 * args.short_side
    ds = CachedDataset(
        decoded,
        key=f"recipe-torchvision/{root.resolve()}/short{args.short_side}/v1",
        fields={"0": Field((3, None, None), "uint8"), "1": Field((), "int64")},
        max_bytes=budget,
        transform=OnImage(RandomResizedCrop(args.crop)),
    )
    context = "spawn" if args.workers else None
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        multiprocessing_context=context,
        persistent_workers=args.workers > 0,
    )
    try:
        image, _label = decoded[0]
        print(
            f"{len(ds)} images; sample 0: {tuple(image.shape)} uint8 = {image.nbytes} bytes cached "
            f"(float32 would be {image.float().nbytes}: 4x)"
        )
        for e in range(args.epochs):
            seconds, seen = epoch(loader)
            print(f"epoch {e}: {seen} random {args.crop}px crops in {seconds:.2f} s; {ds.cache.filled} cached")
        # The cache holds exactly what the decoding dataset gives (the crops are new every epoch).
        untransformed = CachedDataset(decoded, ds.path, key=ds.key, fields=ds.fields, max_bytes=budget)
        for i in (0, len(ds) // 2, len(ds) - 1):
            assert torch.equal(untransformed[i][0], decoded[i][0])
        untransformed.close()
    finally:
        del loader
        ds.close()
        if not args.keep:
            mmapcache.remove(ds.path)
            if scratch is not None:
                shutil.rmtree(scratch)
    print("removed the cache" if not args.keep else f"kept {ds.path}")


if __name__ == "__main__":
    main()
