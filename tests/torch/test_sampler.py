"""NodeShardSampler: disjoint node shards, per-node shuffles, equal lengths, the launcher's topology."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from mmapcache.torch import NodeShardSampler
from mmapcache.torch._sampler import EXACT_MAX, _Bijection


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


@pytest.mark.parametrize(("n", "nodes", "per_node"), [(1, 4, 2), (3, 4, 2), (5, 8, 1), (2, 3, 3)])
def test_with_fewer_samples_than_nodes_every_rank_still_draws_its_len(n: int, nodes: int, per_node: int) -> None:
    """A node whose shard is empty must draw as many indices as the others, or DDP's collectives hang."""
    for epoch in range(2):
        drawn = job(n, nodes, per_node, epoch)  # asserts len(list(sampler)) == len(sampler) on every rank
        assert {len(v) for v in drawn.values()} == {1}
        assert set(i for v in drawn.values() for i in v) == set(range(n)), "one epoch still covers the dataset"
        assert all(0 <= i < n for v in drawn.values() for i in v)
    empty = NodeShardSampler(Sized(n), num_nodes=nodes, node_rank=nodes - 1, local_world_size=1, local_rank=0)
    assert empty.node_indices.tolist() == []
    assert empty.node_indices.dtype == np.int64
    with pytest.raises(ValueError, match="drop_last=True"):
        NodeShardSampler(Sized(n), num_nodes=nodes, node_rank=0, local_world_size=1, local_rank=0, drop_last=True)
    assert job(0, nodes, per_node) == {key: [] for key in job(0, nodes, per_node)}, "no samples: nothing, everywhere"


def test_up_to_exact_max_the_shards_are_those_of_0_3_0() -> None:
    """0.3.0 dealt numpy's seeded permutation of the whole dataset; its node caches stay warm."""
    for n, nodes, seed in [(10, 3, 0), (1000, 4, 7), (EXACT_MAX, 8, 2**64 - 1)]:
        order = np.random.default_rng(seed).permutation(n)
        for node in range(nodes):
            sampler = NodeShardSampler(
                Sized(n), num_nodes=nodes, node_rank=node, local_world_size=1, local_rank=0, seed=seed
            )
            assert sampler.node_indices.tolist() == np.sort(order[node::nodes]).tolist()


@pytest.mark.parametrize("n", [*range(1, 70), 127, 128, 129, 1000, 4097])
def test_the_keyed_bijection_is_a_permutation_of_any_range(n: int) -> None:
    for key in range(3):
        keys = np.random.SeedSequence(key).generate_state(6, np.uint64).tolist()
        values = _Bijection(n, keys)(np.arange(n, dtype=np.int64))
        assert sorted(values.tolist()) == list(range(n))
        assert _Bijection(n, keys)(slice(n // 3, n)).tolist() == values[n // 3 :].tolist(), "a slice of positions"
    with pytest.raises(ValueError, match="odd number of rounds"):
        _Bijection(10, [1, 2, 3])


BIG = EXACT_MAX * 2 + 12_345  # above EXACT_MAX: shards and epoch orders come from the keyed bijection


def test_above_exact_max_the_shards_still_partition_the_dataset_evenly() -> None:
    nodes = 7
    shards = [
        NodeShardSampler(
            Sized(BIG), num_nodes=nodes, node_rank=k, local_world_size=1, local_rank=0, seed=5
        ).node_indices
        for k in range(nodes)
    ]
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    everything = np.concatenate(shards)
    everything.sort()
    assert np.array_equal(everything, np.arange(BIG)), "disjoint, and together the whole dataset"
    for shard in shards:
        assert np.all(np.diff(shard) > 0), "sorted"
        # A fair sample: as many of each sixteenth of the dataset as chance gives (binomial, 6 sigma).
        counts = np.bincount(shard * 16 // BIG, minlength=16)
        expected = len(shard) / 16
        assert np.all(np.abs(counts - expected) < 6 * np.sqrt(expected)), counts


def test_above_exact_max_an_epoch_is_a_fresh_permutation_of_the_shard() -> None:
    ranks = 3
    epochs = []
    for epoch in range(2):
        orders = []
        for local in range(ranks):
            sampler = NodeShardSampler(Sized(BIG), num_nodes=1, node_rank=0, local_world_size=ranks, local_rank=local)
            sampler.set_epoch(epoch)
            orders.append(np.fromiter(iter(sampler), np.int64, count=len(sampler)))
        drawn = np.stack(orders, 1).ravel()  # the node's sequence: rank r holds places r, r + ranks, ...
        assert np.array_equal(np.sort(drawn[:BIG]), np.arange(BIG)), "each index once, then padding"
        assert np.array_equal(drawn[BIG:], drawn[: len(drawn) - BIG]), "padding repeats the start"
        epochs.append(drawn[:BIG])
    place = [np.argsort(order) for order in epochs]
    for order in epochs:  # no trace of the index order in the epoch's order
        assert abs(np.corrcoef(np.arange(BIG), order)[0, 1]) < 0.01
    assert abs(np.corrcoef(place[0], place[1])[0, 1]) < 0.01, "epochs are independent"
    assert abs(np.abs(place[1] - place[0]).mean() / BIG - 1 / 3) < 0.01, "a sample moves a third of an epoch"


def test_a_rank_builds_its_shard_in_memory_and_time_proportional_to_the_shard() -> None:
    """0.3.0 permuted the whole dataset in every rank: 2**27 samples took 1 GiB there, whatever the node count."""
    n, nodes = 2**27, 256
    tracemalloc.start()
    try:
        sampler = NodeShardSampler(Sized(n), num_nodes=nodes, node_rank=nodes - 1, local_world_size=8, local_rank=7)
        first = next(iter(sampler))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    shard = sampler.node_indices.nbytes  # 4 MiB
    assert shard == n // nodes * 8
    assert peak < 2 * shard + 8 * 2**20, f"peak {peak / 2**20:.0f} MiB for a shard of {shard / 2**20:.0f} MiB"
    assert first in set(sampler.node_indices.tolist())


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"seed": -1}, ValueError, r"seed must be an integer from 0 to 2\*\*64 - 1, not -1"),
        ({"seed": 2**64}, ValueError, r"seed must be an integer from 0 to 2\*\*64 - 1, not 18446744073709551616"),
        ({"seed": 1.0}, TypeError, r"seed must be an integer .* not 1\.0 \(float\)"),
        ({"seed": "0"}, TypeError, r"seed must be an integer"),
        ({"num_nodes": 2.5}, TypeError, r"num_nodes must be an integer, not 2\.5 \(float\)"),
        ({"node_rank": 1.0}, TypeError, r"node_rank must be an integer, not 1\.0"),
        ({"local_world_size": "2"}, TypeError, r"local_world_size must be an integer, not '2'"),
        ({"local_rank": True}, TypeError, r"local_rank must be an integer, not True \(bool\)"),
        ({"num_nodes": 0}, ValueError, r"num_nodes \(0\) and local_world_size \(2\) must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_name_with_the_accepted_range(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    topology: dict[str, Any] = {"num_nodes": 2, "node_rank": 1, "local_world_size": 2, "local_rank": 0}
    with pytest.raises(error, match=message):
        NodeShardSampler(Sized(10), **{**topology, **arguments})


def test_set_epoch_takes_the_integers_a_seed_takes() -> None:
    sampler = NodeShardSampler(Sized(10), seed=2**64 - 1)
    sampler.set_epoch(np.uint64(2**64 - 1))  # numpy integers are integers
    assert sampler.epoch == 2**64 - 1
    assert sorted(sampler) == list(range(10))
    for epoch, error in [(2**64, ValueError), (-1, ValueError), (1.5, TypeError), ("1", TypeError)]:
        with pytest.raises(error, match="epoch must be an integer from 0 to 2\\*\\*64 - 1"):
            sampler.set_epoch(epoch)  # type: ignore[arg-type]
    assert sampler.epoch == 2**64 - 1, "a refused epoch changes nothing"


def test_bad_topologies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"node_rank 2 is not in 0\.\.1"):
        NodeShardSampler(Sized(10), num_nodes=2, node_rank=2, local_world_size=1, local_rank=0)
    with pytest.raises(ValueError, match="local_rank 3"):
        NodeShardSampler(Sized(10), num_nodes=1, node_rank=0, local_world_size=2, local_rank=3)


LAUNCHED = """
import json, os, sys
from mmapcache.torch import NodeShardSampler
class Sized:
    def __len__(self): return 10
base = dict(os.environ)
for env in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update({**base, **env})
    try:
        s = NodeShardSampler(Sized())
    except ValueError as error:
        print(json.dumps(str(error)))
        continue
    print(json.dumps([s.num_nodes, s.node_rank, s.local_world_size, s.local_rank]))
"""


def launched(*envs: dict[str, str]) -> list[Any]:
    """What NodeShardSampler finds under each launcher's environment: one process (torch imported once) for all."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "LOCAL_", "GROUP_", "NODE_", "WORLD_", "RANK"))
    }
    run = subprocess.run(
        [sys.executable, "-c", LAUNCHED, json.dumps(envs)], env=clean, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    found = [json.loads(line) for line in run.stdout.splitlines()]
    return [tuple(got) if isinstance(got, list) else got for got in found]


def test_the_topology_comes_from_the_launcher() -> None:
    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    slurm = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4(x3)"}
    alone, by_torchrun, by_slurm, partial = launched({}, torchrun, slurm, {"WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    assert alone == (1, 0, 1, 0), "not distributed: one node, one rank"
    assert by_torchrun == (2, 1, 2, 1)
    assert by_slurm == (3, 2, 4, 0)
    assert "cannot tell" in partial
    assert "num_nodes=" in partial


# -- resuming mid-epoch: state_dict / load_state_dict ---------------------------------------------


def epoch_of(sampler: NodeShardSampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


def topology(n: int, *, node: int = 1, local: int = 1, **kwargs: Any) -> NodeShardSampler:
    return NodeShardSampler(Sized(n), num_nodes=2, node_rank=node, local_world_size=2, local_rank=local, **kwargs)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n", [203, BIG])
def test_a_loaded_state_resumes_the_epoch_where_it_stopped(n: int, shuffle: bool) -> None:
    """The resumed iterator continues the same order: no replay, whatever the position (chunk edges too)."""
    full = epoch_of(topology(n, shuffle=shuffle), 3)
    for k in sorted({0, 1, 2**16 - 1, 2**16, 2**16 + 1, len(full) // 2, len(full) - 1}):
        if k >= len(full):
            continue
        sampler = topology(n, shuffle=shuffle)
        sampler.set_epoch(3)
        drawn = iter(sampler)
        for _ in range(k):
            next(drawn)
        state = sampler.state_dict()
        assert (state["epoch"], state["position"]) == (3, k)
        again = topology(n, shuffle=shuffle)
        again.load_state_dict(state)
        assert again.epoch == 3
        assert again.state_dict() == state, "a loaded state is the state until the next iterator moves"
        assert list(again) == full[k:], f"resumed at {k}"
        assert len(again) == len(full), "len() is still the whole epoch's"
        if k == 1:
            assert list(again) == full, "only the next iterator resumes; the one after draws the whole epoch"


def test_a_resumed_iterator_computes_from_its_position_on_without_replaying_the_epoch() -> None:
    sampler = NodeShardSampler(Sized(BIG), num_nodes=1, node_rank=0, local_world_size=1, local_rank=0)
    state = {**sampler.state_dict(), "position": BIG - 5}
    computed: list[tuple[int, int]] = []
    original = sampler._indices

    def recorded(order: Any, start: int, stop: int) -> Any:
        computed.append((start, stop))
        return original(order, start, stop)

    sampler._indices = recorded  # type: ignore[method-assign]
    sampler.load_state_dict(state)
    assert len(list(sampler)) == 5
    assert computed == [(BIG - 5, BIG)]


def test_one_ranks_state_resumes_every_rank() -> None:
    """Ranks step in lockstep: rank 0's checkpoint (what Lightning saves) resumes every rank at its own place."""
    ranks = [topology(500, node=node, local=local) for node in range(2) for local in range(2)]
    fulls = [epoch_of(sampler, 1) for sampler in ranks]
    first = ranks[0]
    first.set_epoch(1)
    drawn = iter(first)
    for _ in range(40):
        next(drawn)
    state = first.state_dict()
    for node in range(2):
        for local in range(2):
            resumed = topology(500, node=node, local=local)
            resumed.load_state_dict(state)
            assert list(resumed) == fulls[node * 2 + local][40:]


def test_a_state_saved_at_the_end_of_an_epoch_resumes_at_the_start_of_the_next() -> None:
    sampler = topology(203)
    sampler.set_epoch(4)
    list(sampler)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (4, len(sampler))
    resumed = topology(203)
    resumed.set_epoch(5)  # a training loop that saved "next epoch: 5" sets it before the loader loads the state
    resumed.load_state_dict(state)
    assert resumed.epoch == 5
    assert list(resumed) == epoch_of(topology(203), 5)


def test_a_state_is_where_the_sampler_will_draw_next() -> None:
    sampler = topology(203)
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["position"]) == (0, 0)
    drawn = iter(sampler)
    next(drawn)
    next(drawn)
    assert sampler.state_dict()["position"] == 2
    sampler.set_epoch(1)  # the training loop moved on: the old iterator no longer says where the sampler is
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["position"]) == (1, 0)
    resumed = topology(203)
    resumed.load_state_dict({**sampler.state_dict(), "epoch": 0, "position": 2})
    resumed.set_epoch(2)  # another epoch than the state's: it starts afresh
    assert list(resumed) == epoch_of(topology(203), 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 1}, "seed=0, but this one has seed=1"),
        ({"n": 204}, "length=203, but this one has length=204"),
        ({"num_nodes": 3}, "num_nodes=2, but this one has num_nodes=3"),
        ({"local_world_size": 4}, "local_world_size=2, but this one has local_world_size=4"),
        ({"shuffle": False}, "shuffle=True, but this one has shuffle=False"),
        ({"drop_last": True}, "drop_last=False, but this one has drop_last=True"),
    ],
)
def test_a_state_of_another_dataset_seed_or_topology_is_refused(change: dict[str, Any], message: str) -> None:
    saved = topology(203)
    saved.set_epoch(2)
    drawn = iter(saved)
    next(drawn)
    state = saved.state_dict()
    arguments: dict[str, Any] = {"num_nodes": 2, "node_rank": 0, "local_world_size": 2, "local_rank": 0, **change}
    n = arguments.pop("n", 203)
    other = NodeShardSampler(Sized(n), **arguments)
    other.set_epoch(7)
    before = other.state_dict()
    with pytest.raises(ValueError, match=message) as caught:
        other.load_state_dict(state)
    assert "start the epoch afresh" in str(caught.value)
    assert other.state_dict() == before, "a refused state changes nothing"
    assert list(other) == epoch_of(NodeShardSampler(Sized(n), **arguments), 7)


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (None, ValueError, r"not a NodeShardSampler state: it lacks \['version', 'position'"),
        ({"version": 2}, ValueError, "the state is of version 2, and this mmapcache reads version 1"),
        ({"position": 52}, ValueError, r"the state's position must be an integer from 0 to 51, not 52"),
        ({"position": -1}, ValueError, r"the state's position must be an integer from 0 to 51"),
        ({"epoch": 2**64}, ValueError, r"the state's epoch must be an integer from 0 to 2\*\*64 - 1"),
        ({"position": 1.5}, TypeError, r"the state's position must be an integer"),
    ],
)
def test_a_damaged_state_is_refused_with_what_is_wrong(
    state: dict[str, Any] | None, error: type[Exception], message: str
) -> None:
    sampler = topology(203)
    good = sampler.state_dict()
    given = {"epoch": 1} if state is None else {**good, **state}
    with pytest.raises(error, match=message):
        sampler.load_state_dict(given)
    with pytest.raises(TypeError, match="is a dict from state_dict"):
        sampler.load_state_dict([("epoch", 1)])  # type: ignore[arg-type]
    assert sampler.state_dict() == good


# -- torchdata's StatefulDataLoader: killed after a checkpoint, resumed in a fresh process ----------

STATEFUL = """
import os, pickle, signal, sys
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from mmapcache.torch import CachedDataset, NodeShardSampler

kind, workers, checkpoint, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 203

    def __getitem__(self, i):
        return torch.full((3,), i), i


base = Numbers()
sampler = NodeShardSampler(base, seed=11, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1)
dataset = base if kind == "plain" else CachedDataset(base, key="resume/v1", cached_indices=sampler.node_indices)
loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
first = 0
if stop == "resume":
    with open(checkpoint, "rb") as file:
        saved = pickle.load(file)
    first = saved["next_epoch"]  # the training loop's own record
    loader.load_state_dict(saved["loader"])
since = None  # batches since the checkpoint
for epoch in range(first, 3):
    sampler.set_epoch(epoch)
    for step, (values, labels) in enumerate(loader):
        assert values[:, 0].tolist() == labels.tolist()
        print(*labels.tolist(), flush=True)
        if since is not None:
            since += 1
            if since == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # two batches after the checkpoint, workers prefetching
        if stop == f"{epoch}:{step}":
            state = {"next_epoch": epoch + (step == len(loader) - 1), "loader": loader.state_dict()}
            with open(checkpoint, "wb") as file:
                pickle.dump(state, file)
            since = 0
"""


def uninterrupted() -> list[list[int]]:
    """Every batch of epochs 0-2, from a plain DataLoader in this process."""
    dataset = Sized(203)
    sampler = NodeShardSampler(dataset, seed=11, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1)
    batches = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches += [batch.tolist() for batch in torch.utils.data.DataLoader(range(203), batch_size=4, sampler=sampler)]
    return batches


def stateful_run(kind: str, workers: int, checkpoint: Path, stop: str, caches: Path) -> tuple[int, list[list[int]]]:
    env = {**os.environ, "MMAPCACHE_DIR": str(caches)}
    run = subprocess.run(
        [sys.executable, "-c", STATEFUL, kind, str(workers), str(checkpoint), stop],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode in (0, -signal.SIGKILL), run.stderr[-3000:]
    return run.returncode, [[int(i) for i in line.split()] for line in run.stdout.splitlines()]


@pytest.mark.parametrize(
    ("kind", "workers", "stop"),
    [("plain", 0, "1:4"), ("plain", 2, "1:4"), ("cached", 0, "1:4"), ("cached", 2, "1:4"), ("plain", 2, "0:12")],
)
def test_a_stateful_dataloader_killed_after_a_checkpoint_resumes_with_exactly_the_remaining_batches(
    tmp_path: Path, kind: str, workers: int, stop: str
) -> None:
    """StatefulDataLoader saves the sampler's state as of the last batch it returned, not of its prefetch."""
    full = uninterrupted()
    per_epoch = len(full) // 3
    assert per_epoch == 13
    epoch, step = map(int, stop.split(":"))
    done = epoch * per_epoch + step + 1
    checkpoint, caches = tmp_path / "checkpoint", tmp_path / "caches"  # a cold cache, filled partly before the kill
    caches.mkdir(mode=0o700)
    code, before = stateful_run(kind, workers, checkpoint, stop, caches)
    assert code == -signal.SIGKILL
    assert before == full[: done + 2]
    code, after = stateful_run(kind, workers, checkpoint, "resume", caches)
    assert code == 0
    assert after == full[done:], "the resumed run yields exactly the batches after the checkpoint"
