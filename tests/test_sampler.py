"""NodeShardSampler: disjoint node shards, per-node shuffles, equal lengths, the launcher's topology."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from mmapcache.torch import NodeShardSampler


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def job(n: int, nodes: int, per_node: int, epoch: int = 0, **kwargs: Any) -> dict[tuple[int, int], list[int]]:
    """What every rank of a simulated job draws in ``epoch``: ``{(node, local rank): indices}``."""
    out = {}
    for node in range(nodes):
        for local in range(per_node):
            sampler = NodeShardSampler(
                Sized(n), num_nodes=nodes, node_rank=node, local_world_size=per_node, local_rank=local, **kwargs
            )
            sampler.set_epoch(epoch)
            out[node, local] = list(sampler)
            assert len(out[node, local]) == len(sampler)
    return out


@pytest.mark.parametrize(("n", "nodes", "per_node"), [(100, 2, 2), (101, 2, 2), (97, 3, 2), (10, 4, 3), (1000, 1, 4)])
def test_node_shards_are_disjoint_and_each_epoch_covers_the_dataset(n: int, nodes: int, per_node: int) -> None:
    shards = [
        NodeShardSampler(Sized(n), num_nodes=nodes, node_rank=k, local_world_size=1, local_rank=0) for k in range(nodes)
    ]
    sizes = [len(s.node_indices) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(i for s in shards for i in s.node_indices.tolist()) == list(range(n))
    for epoch in range(3):
        drawn = job(n, nodes, per_node, epoch)
        assert len({len(v) for v in drawn.values()}) == 1, "every rank of the job draws as many indices"
        counts = Counter(i for v in drawn.values() for i in v)
        assert set(counts) == set(range(n)), "one epoch covers the dataset"
        assert max(counts.values()) <= 2, "padding repeats at most once"
        for (node, _), indices in drawn.items():
            assert set(indices) <= set(shards[node].node_indices.tolist()), "a rank reads its node's shard only"


def test_epochs_are_reshuffled_within_the_node_and_deterministic() -> None:
    first, again, second = job(1000, 2, 2, 0), job(1000, 2, 2, 0), job(1000, 2, 2, 1)
    assert first == again
    assert first != second
    for key in first:
        node_first = sorted(first[key[0], 0] + first[key[0], 1])
        node_second = sorted(second[key[0], 0] + second[key[0], 1])
        assert node_first == node_second, "a node keeps its shard from epoch to epoch"
    assert job(1000, 2, 2, 0, seed=1) != first


def test_drop_last_and_no_shuffle() -> None:
    drawn = job(103, 2, 2, drop_last=True)
    assert {len(v) for v in drawn.values()} == {25}  # the smaller shard (51) split 2 ways, rest dropped
    assert len(set(i for v in drawn.values() for i in v)) == 100
    plain = job(10, 2, 1, shuffle=False)
    assert plain == {(0, 0): [0, 2, 4, 6, 8], (1, 0): [1, 3, 5, 7, 9]}
    with pytest.raises(ValueError, match="drop_last=True"):
        NodeShardSampler(Sized(3), num_nodes=2, node_rank=0, local_world_size=4, local_rank=0, drop_last=True)


def test_bad_topologies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"node_rank 2 is not in 0\.\.1"):
        NodeShardSampler(Sized(10), num_nodes=2, node_rank=2, local_world_size=1, local_rank=0)
    with pytest.raises(ValueError, match="local_rank 3"):
        NodeShardSampler(Sized(10), num_nodes=1, node_rank=0, local_world_size=2, local_rank=3)


LAUNCHED = """
import json
from mmapcache.torch import NodeShardSampler
class Sized:
    def __len__(self): return 10
s = NodeShardSampler(Sized())
print(json.dumps([s.num_nodes, s.node_rank, s.local_world_size, s.local_rank]))
"""


def launched(env: dict[str, str]) -> Any:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "LOCAL_", "GROUP_", "NODE_", "WORLD_", "RANK"))
    }
    run = subprocess.run(
        [sys.executable, "-c", LAUNCHED], env={**clean, **env}, capture_output=True, text=True, check=False
    )
    if run.returncode:
        return run.stderr.strip().splitlines()[-1]
    return tuple(__import__("json").loads(run.stdout))


def test_the_topology_comes_from_the_launcher() -> None:
    assert launched({}) == (1, 0, 1, 0), "not distributed: one node, one rank"
    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    assert launched(torchrun) == (2, 1, 2, 1)
    slurm = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4(x3)"}
    assert launched(slurm) == (3, 2, 4, 0)
    partial = launched({"WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    assert "cannot tell" in partial
    assert "num_nodes=" in partial
