"""A Lightning DataModule that fills the node's cache in ``prepare_data``, with worker processes, before training.

    python examples/recipe_lightning.py                 # 2 CPU ranks (strategy="ddp"), 2 workers each
    python examples/recipe_lightning.py --devices 1 --length 20000 --workers 4

Lightning calls ``prepare_data`` in one process per node (local rank 0,
``prepare_data_per_node=True``, the default) while the other ranks wait:
there ``CachedDataset.fill(num_workers=...)`` loads every sample in
parallel worker processes and writes it into the node's cache file. Then
every rank's ``setup`` wraps the same dataset with the same key — it opens
the full file — and training reads only the cache, from the first epoch
on. Random augmentation stays in ``transform=``.

The training runs in a child process (Lightning's ``ddp`` starts each
further rank by running that command again); this script then reports how
many samples each phase loaded from the dataset and removes the cache.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache.torch import CachedDataset

KEY = "recipe-lightning/decoded-32px/v1"
Sample = tuple[torch.Tensor, int]


class Decoded(Dataset[Sample]):
    """Stands in for decode + resize: deterministic, about a millisecond a sample.

    Every load appends one byte to ``loads`` (any process may load), so the
    driver can count what each phase read from the dataset.
    """

    def __init__(self, length: int, loads: Path) -> None:
        self.length, self.loads = length, loads

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Sample:
        with open(self.loads, "ab") as log:
            log.write(b"+")
        time.sleep(0.001)
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g), index % 10


class RandomFlip:
    """Random augmentation, after the cache (a module-level class: workers may unpickle it)."""

    def __call__(self, sample: Sample) -> Sample:
        image, label = sample
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


class CachedImages(LightningDataModule):
    def __init__(self, decoded: Decoded, workers: int, batch_size: int) -> None:
        super().__init__()
        self.decoded, self.workers, self.batch_size = decoded, workers, batch_size
        self.train_set: CachedDataset | None = None

    def cached(self) -> CachedDataset:
        return CachedDataset(self.decoded, key=KEY, transform=RandomFlip())

    def prepare_data(self) -> None:
        # One process per node; set no state here (the other ranks do not run it).
        ds = self.cached()
        filled = ds.fill(num_workers=self.workers, progress=False)
        ds.close()
        self.decoded.loads.with_name("prepared").write_text(f"{filled} {self.decoded.loads.stat().st_size}")

    def setup(self, stage: str) -> None:
        self.train_set = self.cached()

    def train_dataloader(self) -> DataLoader[Sample]:
        assert self.train_set is not None
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,  # Lightning puts a DistributedSampler in under DDP
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
        )

    def teardown(self, stage: str) -> None:
        if self.train_set is not None:
            self.train_set.close()


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss: torch.Tensor = torch.nn.functional.cross_entropy(self.net(images.float() / 255), labels)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", module="lightning")  # advice about workers and logging
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = CachedImages(Decoded(args.length, Path(args.scratch, "loads")), args.workers, args.batch_size)
    trainer.fit(Classifier(), datamodule=data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--devices", type=int, default=2, help="CPU ranks")
    parser.add_argument("--workers", type=int, default=2, help="fill workers, and DataLoader workers per rank")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)  # set for the training run
    args = parser.parse_args()
    if args.scratch:
        train(args)
        return

    path = CachedDataset(Decoded(args.length, Path()), key=KEY).path  # where every rank finds it
    with tempfile.TemporaryDirectory() as scratch:
        try:
            start = time.perf_counter()
            child = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--scratch", scratch], capture_output=True, text=True
            )
            if child.returncode != 0:
                raise SystemExit(f"training failed:\n{child.stdout}{child.stderr}")
            filled, prepared = map(int, Path(scratch, "prepared").read_text().split())
            total = Path(scratch, "loads").stat().st_size
            print(
                f"prepare_data filled {filled} of {args.length} samples with {args.workers} workers; "
                f"{args.devices} ranks x {args.epochs} epochs then loaded {total - prepared} samples from the "
                f"dataset (a few per process: the checks on opening a cache); "
                f"{time.perf_counter() - start:.1f} s in all"
            )
            if filled != args.length or total - prepared > args.length // 4:
                raise SystemExit("training did not read from the filled cache")
        finally:
            if path.exists():
                mmapcache.remove(path)


if __name__ == "__main__":
    main()
