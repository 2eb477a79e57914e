"""A training run over a ``Mixture`` of three corpora, for tests/torch/test_mixture_resume.py.

Run as a script (one process, or each rank of a ``torchrun --nproc-per-node W``
launch on gloo): reads ``--samples`` global positions through
``mixture.loader(BATCH, num_samples=..., stateful=True)`` and appends one JSON
line per batch to ``--out``: ``{"world", "rank", "step", "ids"}`` (a sample's id
is ``code * 10**6 + index``: its source and index). ``--save-at k`` saves rank 0's
loader state (``torch.save``) to ``--checkpoint`` after step k (after an
all-reduce, as training would), writes ``--saved``, then keeps going slowly until
the test kills the job (SIGKILL). ``--resume`` loads the checkpoint first.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from mmapcache.torch import CachedDataset, Mixture, NodeShardSampler

BATCH = 8
SIZES = {"web": 300, "code": 90, "math": 30}  # math's first pass ends after ~300 positions
WEIGHTS = {"web": 0.7, "code": 0.2, "math": 0.1}
SEED = 5


class Corpus(torch.utils.data.Dataset[Any]):
    """Sample ``i`` of corpus ``code``: ``{"id": code * 10**6 + i, "x": 8 bytes of i}``, deterministic."""

    def __init__(self, code: int, length: int) -> None:
        self.code, self.length = code, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return {
            "id": torch.tensor(self.code * 10**6 + index),
            "x": torch.full((8,), index % 251, dtype=torch.uint8),
        }


def sample_id(name: str, index: int) -> int:
    return list(SIZES).index(name) * 10**6 + index


def schedule(position: int) -> dict[str, float]:
    """0.7 / 0.2 / 0.1, then more math from position 2048 on."""
    return WEIGHTS if position < 2048 else {"web": 0.4, "code": 0.2, "math": 0.4}


def make_mixture(directory: str | os.PathLike[str] | None, *, cached: bool = True, scheduled: bool = False) -> Mixture:
    """The three corpora, as CachedDatasets in ``directory`` (``cached``) or as they are."""
    sources: dict[str, Any] = {}
    for code, (name, size) in enumerate(SIZES.items()):
        corpus = Corpus(code, size)
        if cached:
            assert directory is not None
            sources[name] = CachedDataset(corpus, Path(directory) / f"{name}.mmc", key=f"mixture/{name}", check=0)
        else:
            sources[name] = corpus
    return Mixture(sources, schedule if scheduled else WEIGHTS, seed=SEED)


def node_mixture(
    directory: str | os.PathLike[str] | None, node_rank: int, num_nodes: int, *, cached: bool = True
) -> Mixture:
    """Node ``node_rank``'s mixture: every corpus's node shard (cached in ``directory``), mixed as one run is."""
    shards: dict[str, Any] = {}
    for code, (name, size) in enumerate(SIZES.items()):
        corpus = Corpus(code, size)
        node = NodeShardSampler(
            corpus, seed=SEED, num_nodes=num_nodes, node_rank=node_rank, local_world_size=1, local_rank=0
        ).node_indices
        source: Any = corpus
        if cached:
            assert directory is not None
            path = Path(directory) / f"{name}.mmc"
            source = CachedDataset(corpus, path, key=f"mixture/{name}", cached_indices=node, check=0)
        shards[name] = torch.utils.data.Subset(source, node.tolist())
    return Mixture(shards, WEIGHTS, seed=SEED)


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """The batch's sample ids, after checking every sample's bytes are its own."""
    got: list[int] = batch["id"].tolist()
    expected = torch.tensor([i % 10**6 % 251 for i in got], dtype=torch.uint8)
    assert torch.equal(batch["x"], expected[:, None].expand(-1, 8)), "a sample's bytes are not its own"
    return got


def expected_ids(samples: int, *, scheduled: bool = False) -> list[int]:
    """What positions ``0 .. samples - 1`` hold, computed from the draws alone."""
    mixture = make_mixture(None, cached=False, scheduled=scheduled)
    codes, indices = mixture.draws(0, samples)
    return (codes * 10**6 + indices).tolist()  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--scheduled", action="store_true")
    parser.add_argument("--checkpoint")
    parser.add_argument("--saved")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--nodes", type=int, help="each node mixes its shards; its ranks deal its positions")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo")
    options: dict[str, Any] = {"num_samples": args.samples, "num_workers": args.workers, "stateful": True}
    if args.nodes:
        node = int(os.environ["GROUP_RANK"])
        mixture = node_mixture(args.dir, node, args.nodes)
        options |= {"rank": int(os.environ["LOCAL_RANK"]), "world_size": int(os.environ["LOCAL_WORLD_SIZE"])}
    else:
        node = 0
        mixture = make_mixture(args.dir, scheduled=args.scheduled)
    if args.workers:
        options["multiprocessing_context"] = "fork"
    loader = mixture.loader(BATCH, **options)
    rank, world = loader.batch_sampler.rank, loader.batch_sampler.world_size
    if args.resume:
        loader.load_state_dict(torch.load(args.checkpoint, weights_only=False))
    with open(args.out, "a") as out:
        for step, batch in enumerate(loader, start=1):
            got = ids(batch)
            if distributed:
                torch.distributed.all_reduce(
                    torch.zeros(1)
                )  # the ranks step together, as a gradient all-reduce makes them
            out.write(json.dumps({"world": world, "node": node, "rank": rank, "step": step, "ids": got}) + "\n")
            out.flush()
            if args.save_at is not None and step == args.save_at:
                if distributed:
                    torch.distributed.barrier()  # every rank wrote its line of this step
                if rank == 0:
                    torch.save(loader.state_dict(), args.checkpoint)
                    Path(args.saved).write_text(str(os.getpid()))
            if args.save_at is not None and step >= args.save_at:
                time.sleep(0.2)  # still training when the test kills it
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
