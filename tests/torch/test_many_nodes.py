"""A job spanning two nodes, simulated for real on this machine.

Two ``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2`` launches on loopback
(gloo), each "node" with its own cache directory, run ``nodes_run.py``: NodeShardSampler
deals the dataset into node shards and each node's CachedDataset caches only its shard
(``cached_indices=sampler.node_indices``).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _nodes import launch_nodes
from torch_helpers import accesses

from mmapcache import Cache
from mmapcache._format.spec import slot_nbytes

pytestmark = pytest.mark.xdist_group("ports")  # the rendezvous takes a port (tests/_nodes.py)
LENGTH = 64
EPOCHS = 3
NODES = 2


def _launch(out: Path, node_dirs: list[Path], *options: str) -> None:
    """Both nodes' torchrun launches, concurrently; each node's caches go to its own directory."""
    arguments = ["--out", str(out), "--length", str(LENGTH), "--epochs", str(EPOCHS), *options]
    launch_nodes(out, "nodes_run.py", arguments, node_dirs, timeout=300, cache_dir_env=True)


def _epochs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "epochs").read_text().splitlines()]


def _check_job(out: Path, node_dirs: list[Path]) -> None:
    lines = _epochs(out)
    assert len(lines) == EPOCHS * NODES * 2, "every rank of both nodes recorded every epoch"
    shards = {line["node"]: line["node_indices"] for line in lines}
    assert sorted(shards) == [0, 1]
    # Node shards are disjoint, cover the dataset, and differ in size by at most one.
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(LENGTH))
    assert abs(len(shards[0]) - len(shards[1])) <= 1
    for epoch in range(EPOCHS):
        got = [line for line in lines if line["epoch"] == epoch]
        # One epoch across all ranks covers the dataset once.
        assert Counter(i for line in got for i in line["indices"]) == Counter(range(LENGTH)), f"epoch {epoch}"
        for line in got:
            # Each rank reads only its node's shard.
            assert set(line["indices"]) <= set(shards[line["node"]])
    # Epochs are reshuffled: a rank's order differs from one epoch to the next.
    for rank in range(NODES * 2):
        orders = [line["indices"] for line in sorted(lines, key=lambda x: x["epoch"]) if line["rank"] == rank]
        assert all(a != b for a, b in itertools.pairwise(orders)), f"rank {rank} got the same order twice"
    # Each sample was loaded from the wrapped dataset exactly once, in the whole job: none after the first epoch.
    loads = Counter(index for _, _, index in accesses(out / "accesses"))
    assert loads == Counter(range(LENGTH))
    # Each node's file holds its shard only, fully cached, and takes 1/N of the bytes of a full cache.
    for node, directory in enumerate(node_dirs):
        files = list(directory.glob("*.mmc"))
        assert len(files) == 1, f"node {node} has one cache file, found {files}"
        with Cache(files[0]) as cache:
            assert cache.dataset_indices is not None
            assert cache.dataset_indices.tolist() == shards[node]
            assert cache.length == cache.capacity == cache.filled == len(shards[node])
            data = cache.capacity * slot_nbytes(cache.fields)
            full = LENGTH * slot_nbytes(cache.fields)
            assert abs(data - full / NODES) <= slot_nbytes(cache.fields), "per-node bytes are 1/N of the full cache"


@pytest.fixture
def job(cache_dir: Path) -> tuple[Path, list[Path]]:
    out = cache_dir / "out"
    out.mkdir()
    nodes = [cache_dir / f"node{k}" for k in range(NODES)]
    for directory in nodes:
        directory.mkdir(mode=0o700)
    return out, nodes


@pytest.mark.parametrize("batched", [False, True], ids=["DataLoader", "loader"])
def test_torchrun_two_nodes_each_cache_only_their_shard(job: tuple[Path, list[Path]], batched: bool) -> None:
    out, nodes = job
    _launch(out, nodes, *(["--batched"] if batched else []))
    _check_job(out, nodes)


def test_lightning_two_nodes_with_the_node_shard_sampler(job: tuple[Path, list[Path]]) -> None:
    """``Trainer(num_nodes=2, use_distributed_sampler=False)``; Lightning calls the sampler's set_epoch."""
    out, nodes = job
    _launch(out, nodes, "--lightning")
    _check_job(out, nodes)
