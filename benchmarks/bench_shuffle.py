"""Shuffle quality of NodeShardSampler against DistributedSampler (no timing: what the orders look like).

For N samples on `nodes` x `ranks` ranks, over several epochs, both samplers give every
rank its indices; a sample's *position* in an epoch is the global step at which it is
read, as a fraction of the epoch. Reported per sampler:

- displacement: mean |position in epoch e+1 - position in epoch e| (independent uniform
  positions give 1/3);
- rank correlation of positions between consecutive epochs (0 for independent orders);
- distinct ranks a sample visits over the epochs (DistributedSampler: any rank of the job;
  NodeShardSampler: only the ranks of its node — the point of it);
- class balance: the standard deviation of one class's share of a global batch, for labels
  drawn uniformly from 10 classes (a biased sampler would show a larger spread).

``python benchmarks/bench_shuffle.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from mmapcache.torch import NodeShardSampler


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _orders(kind: str, n: int, nodes: int, ranks: int, epoch: int) -> list[np.ndarray[Any, Any]]:
    """Each rank's indices for one epoch, rank r = node * ranks + local rank."""
    out = []
    for node in range(nodes):
        for local in range(ranks):
            if kind == "node":
                sampler: Any = NodeShardSampler(
                    _Sized(n), num_nodes=nodes, node_rank=node, local_world_size=ranks, local_rank=local, seed=1
                )
            else:
                sampler = DistributedSampler(_Sized(n), num_replicas=nodes * ranks, rank=node * ranks + local, seed=1)
            sampler.set_epoch(epoch)
            out.append(np.fromiter(iter(sampler), np.int64))
    return out


def _positions(
    orders: list[np.ndarray[Any, Any]], n: int, batch: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Each sample's global step (fraction of the epoch) and the rank that read it."""
    steps = len(orders[0]) // batch
    position = np.full(n, np.nan)
    rank_of = np.full(n, -1)
    for rank, order in enumerate(orders):
        step = np.arange(len(order)) // batch
        position[order] = step / max(steps, 1)
        rank_of[order] = rank
    return position, rank_of


def _spearman(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(kind: str, n: int, nodes: int, ranks: int, epochs: int, batch: int) -> dict[str, float]:
    labels = np.random.default_rng(7).integers(0, 10, n)
    positions: list[np.ndarray[Any, Any]] = []
    shares: list[float] = []
    rank_sets = np.zeros((n, nodes * ranks), bool)
    for epoch in range(epochs):
        orders = _orders(kind, n, nodes, ranks, epoch)
        position, rank_of = _positions(orders, n, batch)
        positions.append(position)
        rank_sets[np.arange(n), rank_of] = True
        for step in range(len(orders[0]) // batch):
            members = np.concatenate([order[step * batch : (step + 1) * batch] for order in orders])
            shares.append(float(np.mean(labels[members] == 0)))
    moves = [np.abs(b - a).mean() for a, b in itertools.pairwise(positions)]
    correlations = [_spearman(a, b) for a, b in itertools.pairwise(positions)]
    return {
        "displacement": float(np.mean(moves)),
        "rank_correlation": float(np.mean(correlations)),
        "ranks_visited": float(rank_sets.sum(1).mean()),
        "class_share_std": float(np.std(shares)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller dataset (seconds)")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    n, nodes, ranks, epochs, batch = (20_000, 4, 2, 4, 32) if args.quick else (200_000, 4, 8, 8, 32)
    result: dict[str, Any] = {"n": n, "nodes": nodes, "ranks_per_node": ranks, "epochs": epochs, "batch": batch}
    for kind, name in (("dist", "DistributedSampler"), ("node", "NodeShardSampler")):
        result[name] = measure(kind, n, nodes, ranks, epochs, batch)
    print(f"{n} samples, {nodes} nodes x {ranks} ranks, {epochs} epochs, batch {batch} per rank")
    print(f"{'':22}{'displacement':>14}{'rank corr.':>12}{'ranks visited':>15}{'class share sd':>16}")
    for name in ("DistributedSampler", "NodeShardSampler"):
        r = result[name]
        print(
            f"{name:22}{r['displacement']:14.3f}{r['rank_correlation']:12.3f}"
            f"{r['ranks_visited']:15.2f}{r['class_share_std']:16.4f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
