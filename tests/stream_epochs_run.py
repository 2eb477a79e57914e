"""Epochs of a CachedStream read by one rank of a job: under torchrun, or under Lightning ``ddp``.

``python tests/stream_epochs_run.py PATH --out FILE [--lightning] [--workers W] [--persistent] [--set-epoch]``
(tests/ on PYTHONPATH). Every element a rank trains on appends ``rank epoch label`` to ``--out``. Under torchrun
the script is each rank; Lightning's ``strategy="ddp"`` starts rank 1 by running this file again. Neither
calls ``set_epoch`` unless ``--set-epoch`` (Lightning calls it on samplers only).
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from stream_sources import WithLength, rank_and_world  # next to this file
from torch.utils.data import DataLoader

from mmapcache.torch import CachedStream


def _loader(ds: CachedStream, args: argparse.Namespace) -> DataLoader[Any]:
    persistent = args.persistent and args.workers > 0
    return DataLoader(ds, batch_size=4, num_workers=args.workers, persistent_workers=persistent)


def _record(out: str, rank: int, epoch: int, labels: list[int]) -> None:
    with open(out, "a") as file:
        file.writelines(f"{rank} {epoch} {label}\n" for label in labels)


def torchrun(ds: CachedStream, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, _ = rank_and_world()
    loader = _loader(ds, args)
    for epoch in range(args.epochs):
        if args.set_epoch:
            ds.set_epoch(epoch)
        labels = [label for batch in loader for label in batch["label"].tolist()]
        _record(args.out, rank, epoch, labels)
        dist.barrier()  # as the gradient all-reduce of every step would
    dist.destroy_process_group()


def lightning(ds: CachedStream, args: argparse.Namespace) -> None:
    from lightning import LightningModule, Trainer

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def train_dataloader(self) -> DataLoader[Any]:
            return _loader(ds, args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            _record(args.out, self.global_rank, self.current_epoch, batch["label"].tolist())
            loss: torch.Tensor = self.layer(batch["x"].float()).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    warnings.filterwarnings("ignore")
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Model())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--out", required=True)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--set-epoch", action="store_true")
    parser.add_argument("--lightning", action="store_true")
    args = parser.parse_args()
    ds = CachedStream(WithLength(args.length, kind="fixed"), args.path, key="epochs-run")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    (lightning if args.lightning else torchrun)(ds, args)


if __name__ == "__main__":
    main()
