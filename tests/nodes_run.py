"""One "node" of a simulated multi-node job: NodeShardSampler + CachedDataset(cached_indices=...).

Launched twice by tests/torch/test_many_nodes.py, as ``torchrun --nnodes 2 --node-rank {0,1}
--nproc-per-node 2 ... tests/nodes_run.py --out DIR`` on loopback (gloo), each launch
with its own ``MMAPCACHE_DIR`` (its node's local cache directory). ``--lightning`` runs
the same job through ``Trainer(num_nodes=2, use_distributed_sampler=False)``.

Every rank appends one JSON line per epoch to ``DIR/epochs``: its node, rank and the
indices it received in that epoch (checked against the reference as they arrive).
``torch_helpers.Recorded`` logs every load from the wrapped dataset to ``DIR/accesses``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch_helpers import Recorded, check_batch  # next to this file: the caller puts tests/ on PYTHONPATH

from mmapcache.torch import CachedDataset, NodeShardSampler


def record(out: Path, epoch: int, indices: list[int], sampler: NodeShardSampler) -> None:
    line = {
        "node": sampler.node_rank,
        "local_rank": sampler.local_rank,
        "rank": dist.get_rank(),
        "epoch": epoch,
        "indices": indices,
        "node_indices": sampler.node_indices.tolist(),
        "pid": os.getpid(),
    }
    with open(out / "epochs", "a") as file:
        file.write(json.dumps(line) + "\n")


def make(args: argparse.Namespace) -> tuple[CachedDataset, NodeShardSampler]:
    base = Recorded(args.length, Path(args.out) / "accesses")
    sampler = NodeShardSampler(base, seed=3)  # topology from torchrun: GROUP_RANK, LOCAL_WORLD_SIZE, ...
    dataset = CachedDataset(base, key="nodes/v1", cached_indices=sampler.node_indices, check=0)
    return dataset, sampler


def loader(args: argparse.Namespace, dataset: CachedDataset, sampler: NodeShardSampler) -> DataLoader[Any]:
    if args.batched:
        return dataset.loader(batch_size=4, sampler=sampler, num_workers=1)
    return DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1)


def plain(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    dataset, sampler = make(args)
    data = loader(args, dataset, sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen: list[int] = []
        for batch in data:
            seen += check_batch(batch)
        record(Path(args.out), epoch, seen, sampler)
        dist.barrier()  # as a gradient all-reduce would: no rank runs an epoch ahead
    dist.destroy_process_group()


def lightning(args: argparse.Namespace) -> None:
    from lightning import LightningModule, Trainer

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3 * 8 * 8, 1)
            self.seen: list[int] = []

        def train_dataloader(self) -> DataLoader[Any]:
            # Under the Trainer, torch.distributed is up: the sampler reads the topology from it and torchrun.
            self.dataset, self.sampler = make(args)
            return loader(args, self.dataset, self.sampler)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen += check_batch(batch)
            loss: torch.Tensor = self.layer(batch[0].flatten(1).float() / 255).pow(2).mean()
            return loss

        def on_train_epoch_end(self) -> None:
            # Lightning called sampler.set_epoch(epoch) before the epoch, as for its own samplers.
            assert self.sampler.epoch == self.current_epoch
            record(Path(args.out), self.current_epoch, self.seen, self.sampler)
            self.seen = []

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    warnings.filterwarnings("ignore")  # Lightning's advice about workers and logging
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy="ddp",
        use_distributed_sampler=False,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lightning", action="store_true")
    parser.add_argument("--batched", action="store_true", help="read through CachedDataset.loader()")
    args = parser.parse_args()
    (lightning if args.lightning else plain)(args)


if __name__ == "__main__":
    main()
