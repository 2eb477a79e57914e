"""A mixture over node-sharded caches, on two simulated nodes: each node caches and reads only its shards.

Two ``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2`` launches on loopback (gloo), each
"node" with its own cache directory, run ``mixture_run.py --nodes 2``: every corpus is dealt into node
shards by ``NodeShardSampler``, each node caches its shard of every corpus
(``CachedDataset(cached_indices=...)``) and mixes ``Subset``s of them, its two ranks dealing the node's
positions between them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from mixture_run import BATCH, SIZES, node_mixture

from mmapcache import Cache

HERE = Path(__file__).resolve().parents[1]
NODES = 2
SAMPLES = 320  # per node: 20 steps of 2 ranks x 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _launch(out: Path, node_dirs: list[Path]) -> None:
    port = _free_port()
    runs = []
    for node, directory in enumerate(node_dirs):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--node-rank={node}"]
        command += ["--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
        command += [str(HERE / "mixture_run.py"), "--dir", str(directory), "--out", str(out / f"node{node}")]
        command += ["--samples", str(SAMPLES), "--nodes", str(NODES)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        runs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    failures = []
    for node, (run, log) in enumerate(runs):
        try:
            code = run.wait(timeout=400)
        except subprocess.TimeoutExpired:
            run.kill()
            code = run.wait()
        log.close()
        if code != 0:
            failures.append(f"node {node} exited {code}:\n{(out / f'node{node}.log').read_text()[-3000:]}")
    assert not failures, "\n".join(failures)


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
