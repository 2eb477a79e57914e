"""The recipes' claims, with the real libraries, in fresh processes, through DataLoader workers.

Each case runs a script in a new interpreter (what a user's job is) whose
DataLoader uses spawned workers (fresh interpreters too, which unpickle the
dataset and its transform), then a second fresh process where the recipe
promises a warm cache. torchvision is not installed for the tests (no CPU
build matches the pinned torch): its recipe is checked with Pillow alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A table like a Hugging Face image-classification dataset: uint8 pixels (upcast to int64 by the torch
# and numpy formats), a label, a caption (a string column) and a PNG Image() column of varying sizes.
TABLE = """
import io, json, sys
import datasets, numpy as np, torch
from PIL import Image
from torch.utils.data import DataLoader
import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset

datasets.disable_progress_bars()
folder = sys.argv[1]
try:
    table = datasets.load_from_disk(folder)
except FileNotFoundError:
    def png(i):
        buffer = io.BytesIO()
        Image.fromarray(np.full((10 + i % 4, 12, 3), i, np.uint8)).save(buffer, format="PNG")
        return buffer.getvalue()

    features = datasets.Features({
        "pixels": datasets.Array3D((3, 8, 8), "uint8"),
        "label": datasets.ClassLabel(names=["a", "b", "c"]),
        "caption": datasets.Value("string"),
        "image": datasets.Image(),
    })
    datasets.Dataset.from_dict({
        "pixels": [np.full((3, 8, 8), (7 * i) % 256, np.uint8) for i in range(48)],
        "label": [i % 3 for i in range(48)],
        "caption": [f"caption {i} \N{SNOWMAN}" for i in range(48)],
        "image": [{"bytes": png(i), "path": None} for i in range(48)],
    }, features=features).save_to_disk(folder)
    table = datasets.load_from_disk(folder)
"""


def run(script: str, *args: str, cwd: Path) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter; it prints one JSON object last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=cwd,
        # The examples' modules, and modules a test writes into its directory, for the spawned workers.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(cwd), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    last: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return last


@pytest.mark.timeout(300)
def test_hf_torch_format_uint8_pixels_and_strings_through_spawned_workers(cache_dir: Path) -> None:
    script = (
        TABLE
        + """
rows = table.remove_columns("image").with_format("torch")
ds = CachedDataset(rows, sys.argv[2], key="hf/pixels/v1", dtypes={"pixels": torch.uint8})
loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context="spawn")
seen = {}
for batch in loader:
    assert batch["pixels"].dtype == torch.uint8, batch["pixels"].dtype
    assert isinstance(batch["caption"], list) and all(isinstance(c, str) for c in batch["caption"])
    for label, caption, pixels in zip(batch["label"].tolist(), batch["caption"], batch["pixels"]):
        i = int(caption.split()[1])
        assert label == i % 3 and torch.equal(pixels, torch.full((3, 8, 8), (7 * i) % 256, dtype=torch.uint8))
        seen[i] = caption
assert rows[0]["pixels"].dtype == torch.int64  # what datasets gives: the cache stores uint8 instead
stats = ds.stats()
print(json.dumps({"seen": len(seen), "caption": seen[5], "misses": stats["total_misses"],
                  "hits": stats["total_hits"], "written": stats["total_written"],
                  "field": str(ds.cache.fields["pixels"]),
                  "text": str(ds.cache.fields["caption"])}))
ds.close()
"""
    )
    path = str(cache_dir / "hf.mmc")
    cold = run(script, str(cache_dir / "table"), path, cwd=cache_dir)
    assert cold["seen"] == 48
    assert cold["caption"] == "caption 5 \N{SNOWMAN}"
    assert cold["written"] == 48  # the captions' room is sized from every row (fewer than 64): all stored
    assert cold["misses"] + cold["hits"] >= 48
    assert cold["field"] == "Field((3, 8, 8), 'uint8')"
    warm = run(script, str(cache_dir / "table"), path, cwd=cache_dir)
    assert warm["seen"] == 48
    assert warm["misses"] == cold["misses"], "the second process loaded samples from the table"
    assert warm["hits"] == cold["hits"] + 48


@pytest.mark.timeout(300)
def test_hf_image_column_and_numpy_format(cache_dir: Path) -> None:
    script = (
        TABLE
        + """
images = table.select_columns(["image", "label"]).with_format("torch")
pictures = CachedDataset(
    images, sys.argv[2], key="hf/images/v1",
    fields={"image": Field((3, None, None), "uint8"), "label": Field((), "int64")}, max_bytes="4MiB",
)
filled = pictures.fill(num_workers=2, progress=False)
shapes = sorted({tuple(pictures[i]["image"].shape) for i in range(8)})
assert all(torch.equal(pictures[i]["image"], images[i]["image"]) for i in range(len(images)))
pictures.close()

as_numpy = table.select_columns(["pixels", "label"]).with_format("numpy")
assert as_numpy[0]["pixels"].dtype == np.int64
numbers = CachedDataset(as_numpy, sys.argv[3], key="hf/numpy/v1", dtypes={"pixels": np.uint8})
loader = DataLoader(numbers, batch_size=16, num_workers=2, multiprocessing_context="spawn")
batches = list(loader)
assert all(b["pixels"].dtype == torch.uint8 for b in batches)
assert torch.equal(batches[0]["pixels"][3], torch.full((3, 8, 8), 21, dtype=torch.uint8))
print(json.dumps({"filled": filled, "shapes": shapes, "stored": str(numbers.cache.fields["pixels"])}))
numbers.close()
"""
    )
    result = run(script, str(cache_dir / "table"), str(cache_dir / "i.mmc"), str(cache_dir / "n.mmc"), cwd=cache_dir)
    assert result["filled"] == 48
    assert result["shapes"] == [[3, h, 12] for h in (10, 11, 12, 13)]
    assert result["stored"] == "Field((3, 8, 8), 'uint8')"


@pytest.mark.timeout(300)
def test_dtypes_refuses_a_lossy_conversion_in_a_worker_and_leaves_no_file(cache_dir: Path) -> None:
    script = (
        TABLE
        + """
rows = table.select_columns(["pixels", "label"]).with_format("torch")
ds = CachedDataset(rows, sys.argv[2], key="hf/int8/v1", dtypes={"pixels": torch.int8})
try:
    list(DataLoader(ds, batch_size=48, num_workers=1, multiprocessing_context="spawn"))
except ValueError as error:
    print(json.dumps({"error": str(error)}))
"""
    )
    path = cache_dir / "lossy.mmc"
    result = run(script, str(cache_dir / "table"), str(path), cwd=cache_dir)
    assert "'pixels'" in result["error"]
    assert not path.exists()


# The stocaching migration: a dataset with its augmentation still inside, wrapped as it is.
OLD_STYLE = """
import json, sys
import torch
from torch.utils.data import DataLoader
import mmapcache
from mmapcache.torch import CachedDataset
from recipe_from_stocaching import Augment, Decoded, OldStyle

torch.manual_seed(int(sys.argv[2]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_left_in_the_dataset_is_refused_not_frozen(workers: int, cache_dir: Path) -> None:
    script = (
        OLD_STYLE
        + """
ds = CachedDataset(OldStyle(64), sys.argv[1], key="stocaching/old-style/v1")
workers = int(sys.argv[3])
loader = DataLoader(ds, batch_size=8, num_workers=workers, multiprocessing_context="spawn" if workers else None)
try:
    list(loader)
    print(json.dumps({"error": None}))
except mmapcache.CacheError as error:
    print(json.dumps({"error": str(error), "type": type(error).__name__}))
"""
    )
    path = cache_dir / "old.mmc"
    for seed in (0, 1):
        result = run(script, str(path), str(seed), str(workers), cwd=cache_dir)
        assert result["error"] is not None, "a dataset with random augmentation inside was cached"
        assert result["type"] == "CacheError"
        assert "not deterministic" in result["error"]
        assert "transform=" in result["error"]
        assert not path.exists()


@pytest.mark.timeout(300)
def test_migrated_dataset_warm_in_the_next_process_and_stale_content_caught(cache_dir: Path) -> None:
    # The preprocessing changes, the key does not. (In a module: spawned workers import it.)
    (cache_dir / "changed.py").write_text(
        textwrap.dedent(
            """
            from recipe_from_stocaching import Decoded

            class Brighter(Decoded):
                def __getitem__(self, index):
                    image, label = super().__getitem__(index)
                    return image // 2 + 100, label
            """
        )
    )
    script = (
        OLD_STYLE
        + """
from changed import Brighter

dataset = Brighter(64) if sys.argv[3] == "changed" else Decoded(64)
ds = CachedDataset(dataset, sys.argv[1], key="stocaching/decoded/v1", transform=Augment())
loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context="spawn")
try:
    count = sum(len(labels) for images, labels in loader)
except mmapcache.StaleCacheError as error:
    print(json.dumps({"stale": str(error)}))
    sys.exit(0)
stats = ds.stats()
print(json.dumps({"count": count, "misses": stats["total_misses"], "filled": ds.cache.filled}))
ds.close()
"""
    )
    path = str(cache_dir / "decoded.mmc")
    cold = run(script, path, "0", "same", cwd=cache_dir)
    assert cold == {"count": 64, "misses": cold["misses"], "filled": 64}
    warm = run(script, path, "1", "same", cwd=cache_dir)
    assert warm["count"] == 64
    assert warm["misses"] == cold["misses"], "the next process loaded samples again"
    stale = run(script, path, "2", "changed", cwd=cache_dir)
    assert "stale" in stale, stale
    # Raised in a worker: DataLoader re-raises the type with the message only (error.field is lost there).
    assert "cached sample[0]" in stale["stale"]
    assert "change the key" in stale["stale"]


# The torchvision recipe with Pillow alone: the example's dataset and wrapper, spawned workers.
@pytest.mark.timeout(300)
def test_torchvision_recipe_transform_needs_a_module_level_wrapper_under_spawn(cache_dir: Path) -> None:
    script = """
import json, sys
from pathlib import Path
import numpy as np, torch
from torch.utils.data import DataLoader
from mmapcache import Field
from mmapcache.torch import CachedDataset
from recipe_torchvision import DecodeResize, OnImage, RandomResizedCrop, write_images

root = Path(sys.argv[1])
write_images(root, 24, 40)
decoded = DecodeResize(root, 32)
fields = {"0": Field((3, None, None), "uint8"), "1": Field((), "int64")}

def loader(transform):
    ds = CachedDataset(decoded, sys.argv[2], key="tv/short32/v1", fields=fields, max_bytes="4MiB",
                       transform=transform)
    return ds, DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn")

ds, lam = loader(lambda sample: sample)
try:
    next(iter(lam))
    refused = None
except Exception as error:  # pickling a lambda for the spawned worker
    refused = type(error).__name__
ds.close()
ds, good = loader(OnImage(RandomResizedCrop(24)))
shapes = {tuple(images.shape[1:]) for images, labels in good}
sizes = {tuple(decoded[i][0].shape) for i in range(len(decoded))}
same = all(torch.equal(torch.from_numpy(ds.cache.get(i)["0"]), decoded[i][0]) for i in range(len(decoded)))
print(json.dumps({"refused": refused, "shapes": sorted(shapes), "sizes": len(sizes), "same": same,
                  "filled": ds.cache.filled, "dtype": str(decoded[0][0].dtype)}))
ds.close()
"""
    result = run(script, str(cache_dir / "images"), str(cache_dir / "tv.mmc"), cwd=cache_dir)
    assert result["refused"] in {"PicklingError", "AttributeError"}
    assert result["shapes"] == [[3, 24, 24]]
    assert result["sizes"] > 1, "the cached images keep their aspect ratios"
    assert result["filled"] == 24
    assert result["same"] is True
    assert result["dtype"] == "torch.uint8"
