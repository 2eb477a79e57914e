"""Caches of a chosen set of a dataset's indices: Cache(dataset_indices=...), CachedDataset(cached_indices=...)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch_helpers import Recorded, accesses, as_collated, check_batch, same

from mmapcache import Cache, SchemaMismatchError, info
from mmapcache._format.header import unpack_header
from mmapcache._format.spec import INDEX_ITEMSIZE
from mmapcache.torch import CachedDataset, NodeShardSampler

FIELDS = {"x": ((3,), "float32")}
HERE = Path(__file__).resolve().parents[1]


# -- the file: Cache(dataset_indices=...) ----------------------------------------------------


def test_the_file_keeps_the_index_set(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"  # on tmpfs: the lowest version with an index table (a disk takes 5, with a boot page)
    with Cache(path, FIELDS, dataset_indices=[2, 5, 9, 11], key="k") as cache:
        assert (cache.length, cache.capacity) == (4, 4)
        assert cache.dataset_indices is not None
        assert cache.dataset_indices.tolist() == [2, 5, 9, 11]
        assert not cache.dataset_indices.flags.writeable
        cache.put(1, {"x": [1, 2, 3]})
    header = unpack_header(path.read_bytes()[:4096], path=str(path))
    assert header.version == 4
    with Cache.open(path) as cache:  # any reader sees the table without being told
        assert cache.dataset_indices is not None
        assert cache.dataset_indices.tolist() == [2, 5, 9, 11]
        assert cache.get(1)["x"].tolist() == [1, 2, 3]
    with Cache.open(path, dataset_indices=np.array([2, 5, 9, 11], np.uint32)) as cache:
        assert cache.filled == 1
    assert info(path).indices_digest == header.indices_digest


def test_a_whole_dataset_cache_has_no_table_and_keeps_its_version(cache_dir: Path) -> None:
    with Cache(cache_dir / "c.mmc", FIELDS, 10) as cache:
        assert cache.dataset_indices is None
    assert unpack_header((cache_dir / "c.mmc").read_bytes()[:4096], path="c").version == 2


def test_another_index_set_is_another_cache(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    Cache(path, FIELDS, dataset_indices=[1, 3, 5]).close()
    before = path.read_bytes()
    with pytest.raises(SchemaMismatchError, match="another node's shard") as caught:
        Cache.open(path, FIELDS, dataset_indices=[1, 3, 6])
    assert "dataset_indices" in caught.value.differences
    assert path.read_bytes() == before, "a failed open changes nothing"


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        ([3, 2], ValueError, "strictly increasing"),
        ([1, 1], ValueError, "strictly increasing"),
        ([-1, 2], ValueError, "negative"),
        ([], ValueError, "empty"),
        ([0.5, 1.0], TypeError, "integers"),
        ([[1, 2]], TypeError, "sequence of integers"),
    ],
)
def test_bad_index_sets_are_refused(tmp_path: Path, given: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Cache(tmp_path / "c.mmc", FIELDS, dataset_indices=given)
    assert not any(tmp_path.iterdir()), "nothing was created"


def test_length_must_agree_with_the_index_set(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must agree"):
        Cache(tmp_path / "c.mmc", FIELDS, 5, dataset_indices=[1, 2, 3])


def test_verify_finds_a_damaged_table(tmp_path: Path) -> None:
    path = tmp_path / "c.mmc"
    with Cache(path, FIELDS, dataset_indices=[4, 8, 15, 16, 23, 42]) as cache:
        offset = cache._layout.indices_offset
    with open(path, "r+b") as file:
        file.seek(offset + 2 * INDEX_ITEMSIZE)
        file.write((99).to_bytes(INDEX_ITEMSIZE, "little"))
    with Cache(path) as cache:
        problems = cache.verify()
    assert [p.kind for p in problems] == ["header"]
    assert "index table" in problems[0].message


# -- CachedDataset(cached_indices=...) ----------------------------------------------------------


def shard_dataset(tmp_path: Path, indices: Any, **kwargs: Any) -> tuple[CachedDataset, Path]:
    log = tmp_path / "accesses"
    path = kwargs.pop("path", tmp_path / "shard.mmc")
    return CachedDataset(Recorded(20, log), path, key="shard/v1", cached_indices=indices, **kwargs, check=0), log


def test_only_the_chosen_indices_are_cached(tmp_path: Path) -> None:
    ds, log = shard_dataset(tmp_path, [15, 3, 7, 11])  # any order: the set is what counts
    assert len(ds) == 20
    for i in range(20):
        assert same(ds[i], as_collated(i))
    assert ds.cache.length == ds.cache.capacity == ds.cache.filled == 4
    for _ in range(2):  # indices outside the shard are read from the dataset every time
        assert same(ds[4], as_collated(4))
    loads = [index for _, _, index in accesses(log)]
    assert sorted(set(loads)) == list(range(20))
    assert loads.count(4) == 3
    assert all(loads.count(i) == 1 for i in (3, 7, 11, 15))
    mixed = ds.__getitems__([11, 0, 3, -1])
    assert all(same(got, as_collated(i)) for got, i in zip(mixed, [11, 0, 3, 19], strict=True))
    stats = ds.stats()
    assert stats["filled"] == 4
    assert stats["misses"] == 20 + 2 + 2


def test_fill_and_loader_read_the_shard(tmp_path: Path) -> None:
    ds, log = shard_dataset(tmp_path, range(0, 20, 3))
    assert ds.fill(progress=False) == 7
    assert sorted(index for _, _, index in accesses(log)) == list(range(0, 20, 3))
    log.unlink()
    sampler = NodeShardSampler(ds, num_nodes=3, node_rank=0, local_world_size=1, local_rank=0, shuffle=False)
    for workers in (0, 2):
        got = [
            i
            for batch in ds.loader(batch_size=3, sampler=list(range(0, 20, 3)), num_workers=workers)
            for i in check_batch(batch)
        ]
        assert got == list(range(0, 20, 3))
    assert not log.exists(), "every read was a hit"
    # A batch holding indices outside the shard is still exact, in order.
    batches = list(ds.loader(batch_size=4, num_workers=2))
    assert [i for batch in batches for i in check_batch(batch)] == list(range(20))
    assert sampler.node_indices.tolist() == sorted(sampler.node_indices.tolist())


def test_a_whole_dataset_and_a_shard_never_share_a_file(tmp_path: Path) -> None:
    ds, _ = shard_dataset(tmp_path, [1, 2, 3])
    ds.fill(progress=False)
    whole = CachedDataset(Recorded(20), tmp_path / "shard.mmc", key="shard/v1")
    with pytest.raises(SchemaMismatchError):
        whole[0]
    other, _ = shard_dataset(tmp_path, [1, 2, 4])
    with pytest.raises(SchemaMismatchError, match="another node's shard"):
        other[1]


def test_bad_cached_indices_are_refused(tmp_path: Path) -> None:
    with pytest.raises(IndexError, match="out of range for a dataset of length 20"):
        shard_dataset(tmp_path, [3, 20])
    with pytest.raises(TypeError, match="node_indices"):
        shard_dataset(tmp_path, ["a"])


def test_an_empty_shard_reads_every_sample_uncached_and_makes_no_file(tmp_path: Path) -> None:
    """With fewer samples than nodes a node's shard is empty; its ranks still draw (and read) a sample each."""
    sampler = NodeShardSampler(Recorded(20), num_nodes=25, node_rank=24, local_world_size=2, local_rank=1)
    assert sampler.node_indices.tolist() == []
    ds, log = shard_dataset(tmp_path, sampler.node_indices)
    assert len(ds) == 20
    assert same(ds[7], as_collated(7))
    assert all(same(got, as_collated(i)) for got, i in zip(ds.__getitems__([3, 0, 19]), [3, 0, 19], strict=True))
    drawn = list(sampler)
    assert len(drawn) == len(sampler) == 1
    for workers in (0, 2):
        plain = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=workers)
        assert [i for batch in plain for i in check_batch(batch)] == drawn
        batched = ds.loader(batch_size=2, sampler=sampler, num_workers=workers)
        assert [i for batch in batched for i in check_batch(batch)] == drawn
    assert ds.fill(progress=False) == 0
    with pytest.raises(ValueError, match="cached_indices empty"):
        _ = ds.cache
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accesses"], "no cache file"
    assert [index for _, _, index in accesses(log)] == [7, 3, 0, 19] + drawn * 4, "every read went to the dataset"


def test_pickled_shards_reopen_in_spawn_workers(tmp_path: Path) -> None:
    ds, _ = shard_dataset(tmp_path, [2, 4, 6, 8])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    assert [i for batch in loader for i in check_batch(batch)] == list(range(20))
    assert ds.cache.filled == 4


def test_an_elastic_restart_with_another_node_count_gets_new_caches(tmp_path: Path) -> None:
    """Node shards change with the node count; the default path covers the index set, so old caches stay intact."""
    env = {**os.environ, "MMAPCACHE_DIR": str(tmp_path / "caches")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    script = (
        "import sys\n"
        "from torch_helpers import Recorded, check_batch\n"
        "from mmapcache.torch import CachedDataset, NodeShardSampler\n"
        "nodes = int(sys.argv[1])\n"
        "base = Recorded(30, sys.argv[2])\n"
        "s = NodeShardSampler(base, num_nodes=nodes, node_rank=0, local_world_size=1, local_rank=0)\n"
        "ds = CachedDataset(base, key='elastic/v1', cached_indices=s.node_indices, check=0)\n"
        "for epoch in range(2):\n"
        "    s.set_epoch(epoch)\n"
        "    for i in s: check_batch(__import__('torch').utils.data.default_collate([ds[i]]))\n"
        "print(ds.path)\n"
    )
    paths: list[Path] = []
    for nodes in (2, 3, 2):
        log = tmp_path / f"log{nodes}-{len(paths)}"
        run = subprocess.run(
            [sys.executable, "-c", script, str(nodes), str(log)], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-3000:]
        paths.append(Path(run.stdout.split()[-1]))
        loads = [index for _, _, index in accesses(log)]
        assert len(loads) == (len(set(loads)) if len(paths) < 3 else 0), "a new shard loads once; a reuse loads none"
    assert paths[0] != paths[1]
    assert paths[0] == paths[2]
    for path, nodes in zip(paths[:2], (2, 3), strict=True):
        with Cache(path) as cache:
            assert cache.filled == cache.length == len(range(0, 30, nodes))
            assert cache.verify() == []
