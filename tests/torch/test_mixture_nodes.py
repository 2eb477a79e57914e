"""A mixture over node-sharded caches, on two simulated nodes: each node caches and reads only its shards.

Two ``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2`` launches on loopback (gloo), each
"node" with its own cache directory, run ``mixture_run.py --nodes 2``: every corpus is dealt into node
shards by ``NodeShardSampler``, each node caches its shard of every corpus
(``CachedDataset(cached_indices=...)``) and mixes ``Subset``s of them, its two ranks dealing the node's
positions between them.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _nodes import launch_nodes
from mixture_run import BATCH, SIZES, node_mixture

from mmapcache import Cache

pytestmark = pytest.mark.xdist_group("ports")  # the rendezvous takes a port (tests/_nodes.py)
NODES = 2
SAMPLES = 320  # per node: 20 steps of 2 ranks x 8


def _launch(out: Path, node_dirs: list[Path]) -> None:
    arguments = ["--dir", "{dir}", "--out", str(out / "node{node}"), "--samples", str(SAMPLES), "--nodes", str(NODES)]
    launch_nodes(out, "mixture_run.py", arguments, node_dirs, timeout=400)


def _ids(mixture: Any, codes: np.ndarray[Any, Any], places: np.ndarray[Any, Any]) -> list[int]:
    """Sample ids of draws from a node's mixture: a draw's index is a place in the node's shard."""
    shards = [np.asarray(mixture.datasets[name].indices) for name in mixture.names]
    return [
        code * 10**6 + int(shards[code][place]) for code, place in zip(codes.tolist(), places.tolist(), strict=True)
    ]


def test_two_nodes_each_cache_and_read_only_their_shards_of_every_corpus(cache_dir: Path) -> None:
    out = cache_dir / "out"
    out.mkdir()
    nodes = [cache_dir / f"node{k}" for k in range(NODES)]
    for directory in nodes:
        directory.mkdir(mode=0o700)
    _launch(out, nodes)
    seen: list[set[int]] = []
    for node, directory in enumerate(nodes):
        lines = [json.loads(line) for line in (out / f"node{node}").read_text().splitlines()]
        assert {line["node"] for line in lines} == {node}
        reference = node_mixture(None, node, NODES, cached=False)
        # The node read exactly its mixture's positions 0 .. SAMPLES - 1, each rank its share of each step.
        got = Counter(i for line in lines for i in line["ids"])
        assert got == Counter(_ids(reference, *reference.draws(0, SAMPLES)))
        for rank in range(2):
            loader = reference.loader(BATCH, num_samples=SAMPLES, rank=rank, world_size=2)
            want = [batch["id"].tolist() for batch in loader]
            mine = [line["ids"] for line in sorted(lines, key=lambda x: x["step"]) if line["rank"] == rank]
            assert mine == want
        seen.append(set(got))
        # The node's files hold its shard of every corpus, and nothing else.
        for name in SIZES:
            with Cache(directory / f"{name}.mmc") as cache:
                shard = reference.datasets[name].indices
                assert cache.dataset_indices is not None
                assert cache.dataset_indices.tolist() == sorted(shard)
                assert cache.length == len(shard) < SIZES[name]
    assert not seen[0] & seen[1], "no sample is read on both nodes"
