"""Epochs of a DataLoader over a CachedStream, in a process of its own (under torchrun, or killed by a test).

``python tests/stream_run.py PATH --length N --epochs E --workers W --out FILE [--delay S] [--kind large]`` (tests/ on
PYTHONPATH). Each yielded element appends ``rank epoch label`` to ``--out`` (flushed, so a killed run leaves
what it yielded); at the end each rank appends ``stats rank <json>``.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from stream_sources import Numbers, rank_and_world  # next to this file
from torch.utils.data import DataLoader

from mmapcache import Field
from mmapcache.torch import CachedStream, pad_collate

FIELDS = {
    "x": Field((4,), "int64"),
    "label": Field((), "int64"),
    "caption": Field((None,), "str"),
    "tokens": Field((None,), "int32"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--kind", default="numbered", help="numbered (small rows) or large (16 KiB images)")
    args = parser.parse_args()
    if args.ddp:
        dist.init_process_group("gloo")
    rank, _ = rank_and_world()
    large = args.kind == "large"  # rows stored by the thread beside the stream
    ds = CachedStream(
        Numbers(args.length, kind=args.kind, delay=args.delay),
        args.path,
        key="stream-run",
        fields=None if large else FIELDS,
        max_bytes="16MiB" if large else "4MiB",
    )
    loader = DataLoader(ds, batch_size=4, num_workers=args.workers, collate_fn=None if large else pad_collate)
    with open(args.out, "a") as out:
        for epoch in range(args.epochs):
            ds.set_epoch(epoch)
            for batch in loader:
                for label in batch["label"].tolist():
                    out.write(f"{rank} {epoch} {label}\n")
                out.flush()
            if args.ddp:
                dist.barrier()
        out.write(f"stats {rank} {json.dumps(ds.stats())}\n")
    if args.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
