"""`NodeShardSampler`: every sample stays on one node for the whole run; shuffling happens within the node.

With ``DistributedSampler`` every rank draws from the whole dataset each
epoch, so every node ends up caching all of it. Here the dataset's indices are
split once into ``num_nodes`` disjoint shards (a permutation seeded by
``seed``, dealt round-robin, so sizes differ by at most one and every shard
is a fair sample of the dataset), and the ranks of a node draw a fresh
permutation of their node's shard each epoch, split among the node's local
ranks as ``DistributedSampler`` splits among all ranks. Every rank of the job
gets the same number of indices (padding by repeating, or dropping with
``drop_last``), as collective operations in DDP need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed
import torch.utils.data

__all__ = ["NodeShardSampler", "node_topology"]


class NodeShardSampler(torch.utils.data.Sampler[int]):
    """A distributed sampler that keeps each sample on one node: the job's caches hold the dataset once.

    ``num_nodes``, ``node_rank``, ``local_world_size`` and ``local_rank``
    default to what the launcher says (see :func:`node_topology`). Call
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_nodes: int | None = None,
        node_rank: int | None = None,
        local_world_size: int | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.num_nodes, self.node_rank, self.local_world_size, self.local_rank = node_topology(
            num_nodes=num_nodes, node_rank=node_rank, local_world_size=local_world_size, local_rank=local_rank
        )
        self.length = len(dataset)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        order = np.random.default_rng(self.seed).permutation(self.length) if self.shuffle else np.arange(self.length)
        self.node_indices: np.ndarray[Any, np.dtype[np.int64]] = np.sort(order[self.node_rank :: self.num_nodes])
        # Equal for every rank of the job (collectives need it): from the smallest or largest shard.
        smallest, largest = self.length // self.num_nodes, -(-self.length // self.num_nodes)
        if self.drop_last:
            self.num_samples = smallest // self.local_world_size
        else:
            self.num_samples = math.ceil(largest / self.local_world_size)
        if self.num_samples == 0 and self.length:
            raise ValueError(
                f"with drop_last=True, a node's shard of {smallest} samples leaves nothing for each of its "
                f"{self.local_world_size} ranks; use drop_last=False or fewer ranks"
            )

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation :meth:`__iter__` draws (the same on every rank of a node)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        indices = self.node_indices
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = indices[torch.randperm(len(indices), generator=generator).numpy()]
        total = self.num_samples * self.local_world_size
        if len(indices) < total:  # pad by repeating the node's own indices, as DistributedSampler does
            indices = np.resize(indices, total) if len(indices) else indices
        mine = indices[:total][self.local_rank :: self.local_world_size]
        return iter(mine.tolist())

    def __repr__(self) -> str:
        return (
            f"NodeShardSampler(node {self.node_rank} of {self.num_nodes}, local rank {self.local_rank} of "
            f"{self.local_world_size}, {len(self.node_indices)} indices on the node, {self.num_samples} per rank)"
        )


def node_topology(
    *,
    num_nodes: int | None = None,
    node_rank: int | None = None,
    local_world_size: int | None = None,
    local_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[int, int, int, int]:
    """``(num_nodes, node_rank, local_world_size, local_rank)``: the arguments given, else the launcher's word.

    Read, in order: torchrun (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``WORLD_SIZE``), Lightning (``LOCAL_RANK``,
    ``NODE_RANK``), SLURM (``SLURM_NNODES``, ``SLURM_NODEID``,
    ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``), then an initialised
    ``torch.distributed`` group (world size and rank). A process with none of
    these is one node of one rank. Raises ``ValueError`` naming the arguments
    to pass when what it finds does not add up.
    """
    env = os.environ if environ is None else environ
    world, rank = _world()
    world = world if world is not None else _int(env, "WORLD_SIZE")
    local_world_size = _first(local_world_size, _int(env, "LOCAL_WORLD_SIZE"), _tasks_per_node(env))
    local_rank = _first(local_rank, _int(env, "LOCAL_RANK"), _int(env, "SLURM_LOCALID"))
    num_nodes = _first(num_nodes, _int(env, "SLURM_NNODES"))
    node_rank = _first(node_rank, _int(env, "GROUP_RANK"), _int(env, "NODE_RANK"), _int(env, "SLURM_NODEID"))
    if world is None and all(v is None for v in (num_nodes, node_rank, local_world_size, local_rank)):
        return 1, 0, 1, 0  # not distributed: one node, one rank
    if local_world_size is None and world is not None and num_nodes:
        local_world_size = world // num_nodes
    if num_nodes is None and world is not None and local_world_size:
        num_nodes = world // local_world_size
    if node_rank is None and rank is not None and local_world_size:
        node_rank = rank // local_world_size
    if local_rank is None and rank is not None and local_world_size:
        local_rank = rank % local_world_size
    if num_nodes is None and node_rank is None and world is None:
        num_nodes, node_rank = 1, 0  # local ranks only (one node)
    found = {
        "num_nodes": num_nodes,
        "node_rank": node_rank,
        "local_world_size": local_world_size,
        "local_rank": local_rank,
    }
    unknown = [name for name, value in found.items() if value is None]
    if unknown:
        raise ValueError(
            f"NodeShardSampler cannot tell {', '.join(unknown)} from the launcher (found {found}, world size "
            f"{world}); pass {', '.join(f'{name}=' for name in unknown)} (e.g. from your job script's node count "
            "and node index)"
        )
    return _checked(int(num_nodes or 0), int(node_rank or 0), int(local_world_size or 0), int(local_rank or 0))


def _checked(num_nodes: int, node_rank: int, local_world_size: int, local_rank: int) -> tuple[int, int, int, int]:
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be at least 1")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank {node_rank} is not in 0..{num_nodes - 1} (num_nodes={num_nodes})")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local_rank {local_rank} is not in 0..{local_world_size - 1} (local_world_size={local_world_size})"
        )
    return num_nodes, node_rank, local_world_size, local_rank


def _world() -> tuple[int | None, int | None]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return None, None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    """SLURM's ``SLURM_NTASKS_PER_NODE``: ``"4"``, or ``"4(x2)"`` for 2 nodes of 4 tasks."""
    value = env.get("SLURM_NTASKS_PER_NODE")
    if not value:
        return None
    first = value.split(",")[0].split("(")[0]
    return int(first) if first.isdigit() else None


def _first(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)
