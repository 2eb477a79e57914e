"""Epochs of a DataLoader over a CachedStream, in a process of its own (under torchrun, or killed by a test).

``python tests/stream_run.py PATH --length N --epochs E --workers W --out FILE [--delay S] [--kind large]`` (tests/ on
PYTHONPATH). Each yielded element appends ``rank epoch label`` to ``--out`` (flushed, so a killed run leaves
what it yielded); at the end each rank appends ``stats rank <json>``.

``--sized``: the stream has a ``len()`` and no ``max_bytes`` (the file is sized from it, with little room to
spare). ``--kill-in-store K``: the process SIGKILLs itself inside its ``K``-th batch store, once the batch's
rows are in their slots and before they are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch.distributed as dist
from stream_sources import Numbers, WithLength, rank_and_world  # next to this file
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
    parser.add_argument("--kind", default="numbered", help="numbered, fixed (small rows) or large (16 KiB images)")
    parser.add_argument("--sized", action="store_true")
    parser.add_argument("--kill-in-store", type=int, default=0)
    args = parser.parse_args()
    if args.kill_in_store:
        _kill_in_store(args.kill_in_store)
    if args.ddp:
        dist.init_process_group("gloo")
    rank, _ = rank_and_world()
    numbered = args.kind == "numbered"  # else fixed rows, or rows stored by the thread beside the stream (large)
    ds = CachedStream(
        (WithLength if args.sized else Numbers)(args.length, kind=args.kind, delay=args.delay),
        args.path,
        key="stream-run",
        fields=FIELDS if numbered else None,
        max_bytes=None if args.sized else "16MiB" if args.kind == "large" else "4MiB",
    )
    loader = DataLoader(ds, batch_size=4, num_workers=args.workers, collate_fn=pad_collate if numbered else None)
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


def _kill_in_store(k: int) -> None:
    """SIGKILL this process inside its ``k``-th batch store: the rows in their slots, the run not counted."""
    from mmapcache._region.writer import Writer

    put_run, calls = Writer.put_run, [0]

    def storing(self: Writer, *args: Any, **kwargs: Any) -> int:
        stored = put_run(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return stored

    Writer.put_run = storing  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
