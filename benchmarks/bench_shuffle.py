"""Shuffle quality of NodeShardSampler against DistributedSampler, and what a rank pays to build it.

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

NodeShardSampler is measured twice: as it runs at that size (numpy's seeded permutations,
up to ``EXACT_MAX`` = 2**21 samples) and forced onto the keyed bijection that deals and
shuffles larger datasets.

**Cost per rank** (``--cost-n``, default 1e8 samples; 8 nodes x 8 ranks): one rank builds its
sampler (its node's shard) and draws one epoch, in a fresh process, against 0.3.0's
algorithm (a permutation of the whole dataset in every rank, then ``torch.randperm`` of the
shard each epoch) in the same run, in rotated order over ``--rounds`` rounds: seconds, the
growth of the process's peak RSS over what it held before (the peak is reset through
``/proc/self/clear_refs``), and what the sampler still holds once built.

``python benchmarks/bench_shuffle.py [--quick] [--json PATH] [--cost-n N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import machine_info, rotated
from torch.utils.data.distributed import DistributedSampler

import mmapcache.torch._sampler
from mmapcache.torch import NodeShardSampler

COST_TOPOLOGY = (8, 8)  # nodes, ranks per node


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


class _Sampler030:
    """0.3.0's NodeShardSampler, the baseline of the cost: every rank permutes the whole dataset."""

    def __init__(self, n: int, nodes: int, node: int, ranks: int, rank: int, seed: int = 0) -> None:
        order = np.random.default_rng(seed).permutation(n)
        self.node_indices = np.sort(order[node::nodes])
        self.seed, self.epoch, self.ranks, self.rank = seed, 0, ranks, rank
        self.num_samples = math.ceil(-(-n // nodes) / ranks)

    def __iter__(self) -> Any:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        indices = self.node_indices[torch.randperm(len(self.node_indices), generator=generator).numpy()]
        total = self.num_samples * self.ranks
        indices = np.resize(indices, total) if len(indices) < total else indices
        return iter(indices[:total][self.rank :: self.ranks].tolist())


def _status_kib(key: str) -> int:
    """A figure of /proc/self/status in KiB (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise LookupError(key)


def _reset_peak() -> int:
    """Reset the process's peak RSS to what it holds now (``clear_refs`` 5); return that, in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def cost_child(kind: str, n: int) -> dict[str, float]:
    """In a fresh process: build one rank's sampler (the last rank of the last node) and draw one epoch."""
    nodes, ranks = COST_TOPOLOGY
    base = _reset_peak()
    start = time.perf_counter()
    if kind == "0.3.0":
        sampler: Any = _Sampler030(n, nodes, nodes - 1, ranks, ranks - 1)
    else:
        sampler = NodeShardSampler(
            _Sized(n), num_nodes=nodes, node_rank=nodes - 1, local_world_size=ranks, local_rank=ranks - 1
        )
    built = time.perf_counter() - start
    built_peak = _status_kib("VmHWM") - base
    held = _reset_peak()
    start = time.perf_counter()
    drawn = sum(1 for _ in sampler)
    epoch = time.perf_counter() - start
    epoch_peak = _status_kib("VmHWM") - held
    return {
        "build_s": built,
        "epoch_s": epoch,
        "build_peak_mib": built_peak / 1024,
        "held_mib": (held - base) / 1024,
        "epoch_peak_mib": epoch_peak / 1024,
        "drawn": drawn,
        "shard_mib": sampler.node_indices.nbytes / 2**20,
    }


def measure_cost(n: int, rounds: int) -> dict[str, Any]:
    """Each kind in its own fresh process per round, in rotated order; medians and per-round ratios."""
    kinds = ["0.3.0", "now"]
    raw: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in rotated(kinds, r):
            run = subprocess.run(
                [sys.executable, __file__, "--cost-child", kind, "--cost-n", str(n)],
                capture_output=True,
                text=True,
                check=True,
            )
            raw[kind].append(json.loads(run.stdout))
    out: dict[str, Any] = {"n": n, "nodes": COST_TOPOLOGY[0], "ranks_per_node": COST_TOPOLOGY[1], "rounds": raw}
    for key in ("build_s", "epoch_s", "build_peak_mib", "held_mib", "epoch_peak_mib"):
        out[key] = {kind: statistics.median(x[key] for x in raw[kind]) for kind in kinds}
        out[key]["ratio"] = statistics.median(
            new[key] / old[key] if old[key] else float("nan") for new, old in zip(raw["now"], raw["0.3.0"], strict=True)
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller dataset (seconds)")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--cost-n", type=float, help="samples for the cost per rank (default 1e8, quick 1e6)")
    parser.add_argument("--rounds", type=int, help="rounds of the cost per rank (default 3, quick 1)")
    parser.add_argument("--cost-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cost_n = int(args.cost_n or (1e6 if args.quick else 1e8))
    if args.cost_child:
        print(json.dumps(cost_child(args.cost_child, cost_n)))
        return 0
    n, nodes, ranks, epochs, batch = (20_000, 4, 2, 4, 32) if args.quick else (200_000, 4, 8, 8, 32)
    result: dict[str, Any] = {"n": n, "nodes": nodes, "ranks_per_node": ranks, "epochs": epochs, "batch": batch}
    result["quick"] = args.quick
    result["machine"] = machine_info()
    names = ("DistributedSampler", "NodeShardSampler", "NodeShardSampler, keyed bijection")
    for kind, name in zip(("dist", "node", "node"), names, strict=True):
        exact = mmapcache.torch._sampler.EXACT_MAX
        if name.endswith("bijection"):
            mmapcache.torch._sampler.EXACT_MAX = 0  # the path of datasets above 2**21 samples, at this size
        try:
            result[name] = measure(kind, n, nodes, ranks, epochs, batch)
        finally:
            mmapcache.torch._sampler.EXACT_MAX = exact
    print(f"{n} samples, {nodes} nodes x {ranks} ranks, {epochs} epochs, batch {batch} per rank")
    print(f"{'':34}{'displacement':>14}{'rank corr.':>12}{'ranks visited':>15}{'class share sd':>16}")
    for name in names:
        r = result[name]
        print(
            f"{name:34}{r['displacement']:14.3f}{r['rank_correlation']:12.3f}"
            f"{r['ranks_visited']:15.2f}{r['class_share_std']:16.4f}"
        )
    cost = result["cost"] = measure_cost(cost_n, args.rounds or (1 if args.quick else 3))
    print(f"\ncost per rank, {cost_n:.3g} samples, {COST_TOPOLOGY[0]} nodes x {COST_TOPOLOGY[1]} ranks (medians)")
    print(f"{'':30}{'0.3.0':>10}{'now':>10}{'now / 0.3.0':>13}")
    for key, label in (
        ("build_s", "build (s)"),
        ("build_peak_mib", "build: peak RSS growth (MiB)"),
        ("held_mib", "held after (MiB)"),
        ("epoch_s", "one epoch (s)"),
        ("epoch_peak_mib", "epoch: peak RSS growth (MiB)"),
    ):
        c = cost[key]
        print(f"{label:30}{c['0.3.0']:10.3g}{c['now']:10.3g}{c['ratio']:13.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
