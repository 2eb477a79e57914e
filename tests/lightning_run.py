"""One Lightning ``Trainer.fit`` over a CachedDataset on 2 CPU processes (gloo).

A script, not a module: Lightning's ``strategy="ddp"`` starts rank 1 by running
this file again. Each rank appends ``rank pid`` to ``--ranks``; the dataset logs
every sample it produces to ``--log`` (see ``torch_helpers.Recorded``), so the
test can tell which rank's workers filled which slot. ``training_step`` checks
every sample against the reference.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
from lightning import LightningModule, Trainer
from torch.utils.data import DataLoader
from torch_helpers import Recorded, check_batch  # next to this file: the caller puts tests/ on PYTHONPATH

from mmapcache.torch import CachedDataset


class Model(LightningModule):
    def __init__(self, dataset: CachedDataset, workers: int, ranks: str, *, batched: bool = False) -> None:
        super().__init__()
        self.dataset, self.workers, self.ranks, self.batched = dataset, workers, ranks, batched
        self.layer = torch.nn.Linear(3 * 8 * 8, 1)

    def on_fit_start(self) -> None:
        with open(self.ranks, "a") as file:
            file.write(f"{self.global_rank} {os.getpid()}\n")

    def train_dataloader(self) -> DataLoader[Any]:
        if self.batched:  # Lightning swaps in a DistributedSampler, as for a plain DataLoader
            return self.dataset.loader(batch_size=8, shuffle=True, num_workers=self.workers)
        return DataLoader(self.dataset, batch_size=8, shuffle=True, num_workers=self.workers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        check_batch(batch)
        image = batch[0]
        loss: torch.Tensor = self.layer(image.flatten(1).float() / 255).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "ddp_spawn"], required=True)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--key", default="lightning/v1")
    parser.add_argument("--log", required=True)
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--loader", action="store_true", help="read through CachedDataset.loader()")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and logging
    # check=0: the test counts every load from the dataset; the checks' extra loads are tested elsewhere.
    dataset = CachedDataset(Recorded(args.length, args.log), key=args.key, check=0)  # the default location
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
    trainer.fit(Model(dataset, args.workers, args.ranks, batched=args.loader))


if __name__ == "__main__":
    main()
