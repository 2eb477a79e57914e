"""One training run over a CachedDataset through ``ds.loader(stateful=True)``, for tests/torch/test_resume.py.

Run as a script: reads one epoch and appends each batch's sample indices, one
JSON line per batch, to ``--out``. ``--save-at k`` saves the loader's state
(``torch.save``) to ``--checkpoint`` after the k-th batch, says so by writing
``--saved``, then keeps going slowly until the test kills it (SIGKILL).
``--resume`` loads that checkpoint first and reads what is left of the epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch_helpers import Recorded, check_batch

from mmapcache.torch import CachedDataset, NodeShardSampler

LENGTH = 160
BATCH = 4


def make_loader(args: argparse.Namespace) -> Any:
    ds = CachedDataset(Recorded(LENGTH, args.log), args.path, key="resume/v1")
    options: dict[str, Any] = {"batch_size": BATCH, "num_workers": args.workers, "stateful": True}
    if args.workers:
        options["multiprocessing_context"] = "fork"
    if args.sampler == "node":
        # Rank 1 of 2 on node 1 of 2, with its seeded shuffle: the order comes from the sampler's state.
        sampler = NodeShardSampler(range(LENGTH), num_nodes=2, node_rank=1, local_rank=1, local_world_size=2, seed=7)
        sampler.set_epoch(3)
        options["sampler"] = sampler
    else:
        options["shuffle"] = True
        options["generator"] = torch.Generator().manual_seed(11)
    return ds.loader(**options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--sampler", choices=("shuffle", "node"), default="shuffle")
    parser.add_argument("--checkpoint")
    parser.add_argument("--saved")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    loader = make_loader(args)
    if args.resume:
        loader.load_state_dict(torch.load(args.checkpoint, weights_only=False))
    with open(args.out, "a") as out:
        for k, batch in enumerate(loader, start=1):
            out.write(json.dumps(check_batch(batch)) + "\n")
            out.flush()
            if args.save_at is not None and k == args.save_at:
                torch.save(loader.state_dict(), args.checkpoint)
                Path(args.saved).write_text(str(os.getpid()))
            if args.save_at is not None and k >= args.save_at:
                time.sleep(0.2)  # still training when the test kills it


if __name__ == "__main__":
    main()
