"""Lightning DDP on 2 CPU processes sharing one cache in the default location; the second run is warm.

    python examples/lightning_ddp.py            # runs training twice, each in a new process
    python examples/lightning_ddp.py --keep     # ... and leaves the cache for the next time

Every rank wraps the same dataset in ``CachedDataset`` with the same key. No
rank detection: whichever process (a rank, or one of its DataLoader workers)
needs a sample first creates the file in ``mmapcache.default_dir()``; all the
others open it. Each rank's workers fill the slots of that rank's shard, so
after one epoch the node holds one copy of the whole dataset, and the next run
- a new process, as after a restart or in a hyperparameter sweep - loads
nothing from the dataset.

``--strategy ddp_spawn`` works the same way: the dataset pickles as its path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache.torch import CachedDataset

KEY = "lightning-ddp-example/synthetic-64px/v1"


class SlowDecode(Dataset[tuple[torch.Tensor, int]]):
    """Stands in for an expensive, deterministic load (JPEG decode, a network fetch): ~2 ms a sample.

    It counts its loads in ``counter`` (one byte appended per load, from any process).
    """

    def __init__(self, length: int, counter: str) -> None:
        self.length, self.counter = length, counter

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.002)
        fd = os.open(self.counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g), index % 10


class Classifier(LightningModule):
    def __init__(self, dataset: Dataset[Any], workers: int, report: str) -> None:
        super().__init__()
        self.dataset, self.workers, self.report = dataset, workers, report
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 10))
        self.started = 0.0

    def on_train_epoch_start(self) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            Path(self.report).write_text(f"{time.perf_counter() - self.started:.2f}")

    def train_dataloader(self) -> DataLoader[Any]:
        # Lightning adds a DistributedSampler: each rank reads (and fills) its own half.
        return DataLoader(self.dataset, batch_size=64, shuffle=True, num_workers=self.workers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss: torch.Tensor = torch.nn.functional.cross_entropy(self.net(images.float() / 255), labels)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train(args: argparse.Namespace) -> None:
    """One training run (Lightning's ``ddp`` runs this script again for rank 1)."""
    warnings.filterwarnings("ignore", module="lightning")  # advice about workers and logging
    dataset = CachedDataset(SlowDecode(args.length, args.counter), key=KEY)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(dataset, args.workers, args.counter + ".epoch"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn"])
    parser.add_argument("--length", type=int, default=2048, help="samples in the dataset")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--keep", action="store_true", help="keep the cache for the next run")
    parser.add_argument("--counter", help=argparse.SUPPRESS)  # set for the training runs
    args = parser.parse_args()
    if args.counter:
        train(args)
        return

    path = CachedDataset(SlowDecode(args.length, ""), key=KEY).path  # where every rank will find it
    print(f"cache: {path}")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for run in (1, 2):
                counter = Path(scratch, f"loads-{run}")
                start = time.perf_counter()
                child = subprocess.run(
                    [sys.executable, __file__, *sys.argv[1:], "--counter", str(counter)], capture_output=True, text=True
                )
                if child.returncode != 0:
                    raise SystemExit(f"training run {run} failed:\n{child.stdout}{child.stderr}")
                seconds = time.perf_counter() - start
                epoch = float(Path(f"{counter}.epoch").read_text())
                misses = counter.stat().st_size if counter.exists() else 0
                print(
                    f"run {run}: {seconds:4.1f} s in all, epoch {epoch:5.2f} s; "
                    f"samples loaded from the dataset: {misses} of {args.length} (misses, and the spot checks: "
                    "check=2 samples per process that opens the file)"
                )
            with mmapcache.Cache(path) as cache:
                print(f"one cache file on the node: {cache.filled}/{cache.length} samples, {cache.nbytes >> 20} MiB")
        finally:
            if not args.keep and path.exists():
                mmapcache.remove(path)
            elif args.keep:
                print(f"kept {path} (remove it with `mmapcache rm {path}`)")


if __name__ == "__main__":
    main()
