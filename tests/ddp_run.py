"""Plain torch DDP under torchrun: each rank reads its shard of a CachedDataset through DataLoader workers.

``torchrun --standalone --nproc_per_node=2 tests/ddp_run.py --access-log L --rank-log R`` (tests/ on PYTHONPATH).
Each rank appends ``rank pid`` to ``--rank-log``; ``torch_helpers.Recorded`` logs every load to ``--access-log``.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_helpers import Recorded, check_batch  # next to this file: the caller puts tests/ on PYTHONPATH

from mmapcache.torch import CachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--access-log", required=True)
    parser.add_argument("--rank-log", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    with open(args.rank_log, "a") as file:
        file.write(f"{dist.get_rank()} {os.getpid()}\n")
    ds = CachedDataset(Recorded(args.length, args.access_log), key="torchrun/v1", check=0)
    sampler: DistributedSampler[int] = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            check_batch(batch)
        # Real training syncs the ranks at every step (gradient all-reduce); without
        # it, a fast rank could reach epoch 2 and miss on a sample the other rank
        # is still loading in epoch 1 — loading it twice, correctly but not "once".
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
