"""A Hugging Face ``datasets`` table through CachedDataset: uint8 kept uint8, strings passed through, images cached.

    python examples/recipe_hf_datasets.py                # builds a small dataset in a temp dir
    python examples/recipe_hf_datasets.py --count 5000 --workers 4

``with_format("torch")`` (and ``"numpy"``) turn an ``Array3D(dtype="uint8")``
column into int64 tensors: 8 bytes a pixel. ``dtypes={"pixels": torch.uint8}``
stores the field as uint8 (the conversion is checked to be lossless) and
reads return uint8. String columns (a caption, a file name) are cached as
``str`` and come back as ``str``; the DataLoader's default collate makes
lists of them, as without the cache. An ``Image()`` column in the torch
format decodes to a uint8 ``3 x H x W`` tensor per row, with each image's
own size: declare ``Field((3, None, None), "uint8")`` and a byte budget.

The dataset is saved with ``save_to_disk`` and reloaded, as a real one
comes from ``load_dataset`` or ``load_from_disk``: its rows then live in
memory-mapped Arrow files, so the spawned DataLoader workers that unpickle
it do not copy the table.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset


def build(folder: Path, count: int, side: int) -> datasets.Dataset:
    """A table like an image-classification dataset: pixels, a label, a caption, a PNG image of its own size."""
    rng = np.random.default_rng(0)

    def png(i: int) -> bytes:
        h, w = side + i % 7, side + i % 5
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, format="PNG")
        return buffer.getvalue()

    features = datasets.Features(
        {
            "pixels": datasets.Array3D((3, side, side), "uint8"),
            "label": datasets.ClassLabel(names=["cat", "dog", "fox"]),
            "caption": datasets.Value("string"),
            "image": datasets.Image(),
        }
    )
    table = datasets.Dataset.from_dict(
        {
            "pixels": [rng.integers(0, 256, (3, side, side), dtype=np.uint8) for _ in range(count)],
            "label": [i % 3 for i in range(count)],
            "caption": [f"photo {i}: a {('cat', 'dog', 'fox')[i % 3]}" for i in range(count)],
            "image": [{"bytes": png(i), "path": None} for i in range(count)],
        },
        features=features,
    )
    table.save_to_disk(str(folder))
    return datasets.load_from_disk(str(folder))


def epoch(loader: DataLoader[Any]) -> float:
    start = time.perf_counter()
    for batch in loader:
        assert batch["pixels"].dtype == torch.uint8
        assert isinstance(batch["caption"], list)
        assert isinstance(batch["caption"][0], str)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    datasets.disable_progress_bars()
    scratch = Path(tempfile.mkdtemp(prefix="recipe-hf-"))
    caches: list[CachedDataset] = []
    try:
        table = build(scratch / "table", args.count, args.side)
        torch_rows = table.remove_columns("image").with_format("torch")
        print(f"datasets {datasets.__version__} gives pixels as {torch_rows[0]['pixels'].dtype}")

        # 1. Pixels stored as uint8, captions as str.
        budget = args.count * (3 * args.side * args.side + 256) + (1 << 20)  # pixels, captions, slack
        ds = CachedDataset(torch_rows, key="recipe-hf/pixels/v1", dtypes={"pixels": torch.uint8}, max_bytes=budget)
        caches.append(ds)
        sample = ds[0]
        assert sample["pixels"].dtype == torch.uint8
        assert isinstance(sample["caption"], str)
        assert torch.equal(sample["pixels"], torch_rows[0]["pixels"].to(torch.uint8))
        loader = DataLoader(
            ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
            multiprocessing_context="spawn" if args.workers else None, persistent_workers=args.workers > 0,
        )  # fmt: skip
        cold, warm = epoch(loader), epoch(loader)
        del loader  # its persistent workers hold the cache open until then
        stored = ds.cache.fields["pixels"].nbytes
        print(
            f"pixels cached as uint8: {stored} bytes a sample (int64: {8 * stored}); "
            f"epoch 0 {cold:.2f} s (fills), epoch 1 {warm:.2f} s; {ds.cache.filled} of {len(ds)} cached"
        )

        # 2. The same rows through with_format("numpy"): a numpy dtype works the same.
        numpy_rows = table.select_columns(["pixels", "label"]).with_format("numpy")
        as_numpy = CachedDataset(numpy_rows, key="recipe-hf/pixels-numpy/v1", dtypes={"pixels": np.uint8})
        caches.append(as_numpy)
        assert torch.equal(as_numpy[1]["pixels"], ds[1]["pixels"])

        # 3. An Image() column: uint8 3 x H x W tensors of each image's own size.
        images = table.select_columns(["image", "label"]).with_format("torch")
        pictures = CachedDataset(
            images,
            key="recipe-hf/images/v1",
            fields={"image": Field((3, None, None), "uint8"), "label": Field((), "int64")},
            max_bytes=args.count * (3 * (args.side + 7) * (args.side + 5) + 256) + (1 << 20),
        )
        caches.append(pictures)
        filled = pictures.fill(num_workers=0, progress=False)
        shapes = {tuple(pictures[i]["image"].shape) for i in range(min(len(pictures), 12))}
        assert torch.equal(pictures[5]["image"], images[5]["image"])
        print(f"Image column: filled {filled} images of {len(shapes)} different shapes, e.g. {sorted(shapes)[:2]}")
    finally:
        for cached in caches:
            cached.close()
            mmapcache.remove(cached.path)
        shutil.rmtree(scratch)
    print("removed the caches")


if __name__ == "__main__":
    main()
