"""A Loader's batches of indices as arrays: the sampler's own order and draws, batch for batch."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torch_helpers import Recorded, check_batch, same

from mmapcache.torch import CachedDataset
from mmapcache.torch._index_batches import IndexBatch, IndexBatches

N = 50


def drawn(batches: Any, generator: torch.Generator | None) -> list[Any]:
    """The batches, with a draw from ``generator`` (or torch's) after each: the sampler's draws must interleave."""
    out = []
    for batch in batches:
        out.append(batch.indices.tolist() if isinstance(batch, IndexBatch) else list(batch))
        out.append(torch.randint(0, 1000, (1,), generator=generator).item())
    return out


@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global seed"])
@pytest.mark.parametrize("num_samples", [None, 7, 120])
@pytest.mark.parametrize(("size", "drop_last"), [(8, False), (8, True), (10, False), (10, True), (64, False)])
def test_a_random_sampler_s_batches_are_its_own_draws_as_arrays(
    seeded: bool, num_samples: int | None, size: int, drop_last: bool
) -> None:
    def sampler() -> RandomSampler:
        generator = torch.Generator().manual_seed(5) if seeded else None
        return RandomSampler(range(N), num_samples=num_samples, generator=generator)

    results = []
    for arrays in (False, True):
        torch.manual_seed(11)
        source = sampler()
        batch_sampler = BatchSampler(source, size, drop_last)
        batches = IndexBatches(batch_sampler, N) if arrays else batch_sampler
        assert len(batches) == len(batch_sampler)
        results.append((drawn(batches, source.generator), torch.get_rng_state()))
    (lists, state), (arrays, array_state) = results
    assert arrays == lists
    assert torch.equal(state, array_state)


@pytest.mark.parametrize("size", [7, 10])
@pytest.mark.parametrize("drop_last", [False, True])
def test_orders_that_exist_already_are_read_whole_and_batched_as_arrays(size: int, drop_last: bool) -> None:
    samplers: list[Any] = [
        SequentialSampler(range(N)),
        DistributedSampler(range(N), num_replicas=3, rank=1, shuffle=True, seed=3),
        [4, 0, 49, 3],
        range(N - 1, -1, -1),
    ]
    for sampler in samplers:
        plain = list(BatchSampler(sampler, size, drop_last))
        batches = list(IndexBatches(BatchSampler(sampler, size, drop_last), N))
        assert all(type(batch) is IndexBatch for batch in batches)
        assert [batch.indices.tolist() for batch in batches] == plain


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("size", "drop_last"), [(7, False), (7, True), (16, False), (64, False)])
def test_a_node_shard_sampler_s_batches_are_its_order_as_arrays_and_its_state_counts_them(
    shuffle: bool, size: int, drop_last: bool
) -> None:
    """Every node and local rank, two epochs, a resume mid-epoch: the BatchSampler's batches, a state at each."""
    from mmapcache.torch import NodeShardSampler

    def sampler(node: int, rank: int) -> NodeShardSampler:
        return NodeShardSampler(
            range(N), shuffle=shuffle, seed=4, drop_last=drop_last, num_nodes=2, node_rank=node, local_world_size=2,
            local_rank=rank,
        )  # fmt: skip

    for node, rank in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        plain, ours = sampler(node, rank), sampler(node, rank)
        for epoch in (0, 3):
            plain.set_epoch(epoch)
            ours.set_epoch(epoch)
            taken = 0
            for want, got in zip(
                BatchSampler(plain, size, drop_last), IndexBatches(BatchSampler(ours, size, drop_last), N), strict=True
            ):
                assert type(got) is IndexBatch
                assert got.indices.tolist() == want
                taken += len(want)
                assert ours.state_dict() == plain.state_dict(), "the state counts the batches taken"
                assert ours.state_dict()["position"] >= taken
        state = plain.state_dict() | {"epoch": 3, "position": 5}  # a resume in the middle of epoch 3
        plain.load_state_dict(state)
        ours.load_state_dict(state)
        want = list(BatchSampler(plain, size, drop_last))
        assert [batch.indices.tolist() for batch in IndexBatches(BatchSampler(ours, size, drop_last), N)] == want
    with pytest.raises(ValueError, match="size"):
        next(sampler(0, 0).batches(0))


def test_a_sampler_that_draws_while_it_is_iterated_keeps_dataloader_s_lists() -> None:
    def replacing() -> RandomSampler:
        return RandomSampler(range(N), replacement=True, num_samples=45, generator=torch.Generator().manual_seed(2))

    def generated() -> Any:
        yield from (3, 1, 4, 1, 5, 9, 2, 6)

    for make in (replacing, generated):
        plain = list(BatchSampler(make(), 4, False))  # type: ignore[arg-type]
        batches = list(IndexBatches(BatchSampler(make(), 4, False), N))  # type: ignore[arg-type]
        assert batches == plain
        assert all(type(batch) is list for batch in batches)


def test_an_index_out_of_range_raises_what_dataloader_ds_raises(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="range")
    ds.fill(progress=False)
    for sampler in ([0, N], [3, -N - 1], SequentialSampler(range(N + 1))):
        with pytest.raises(IndexError) as plain:
            list(DataLoader(ds, batch_size=4, sampler=sampler))
        with pytest.raises(IndexError) as fast:
            list(ds.loader(batch_size=4, sampler=sampler))
        assert str(fast.value) == str(plain.value)


def test_a_loader_reads_arrays_and_lightning_s_rebuilt_loader_too(cache_dir: Path) -> None:
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="lightning")
    ds.fill(progress=False)
    loader = ds.loader(batch_size=8, shuffle=True)
    assert isinstance(loader._index_sampler, IndexBatches)
    assert type(loader.batch_sampler) is BatchSampler  # what Lightning looks for before it injects a sampler
    sampler: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=4)
    rebuilt = _update_dataloader(loader, sampler)
    assert type(rebuilt) is type(loader)
    assert isinstance(rebuilt._index_sampler, IndexBatches)
    plain = list(DataLoader(ds, batch_size=8, sampler=sampler))
    got = list(rebuilt)
    assert len(got) == len(plain)
    assert all(same(a, b) for a, b in zip(plain, got, strict=True))
    assert sorted(i for b in got for i in check_batch(b)) == sorted(sampler)


def test_without_workers_each_batch_is_still_a_dataloader_range_under_the_profiler(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="profiled")
    ds.fill(progress=False)
    loader = ds.loader(batch_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's own warnings on a machine without accelerators
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            got = list(loader)
    names = [event.name for event in profile.events()]
    assert sum("enumerate(DataLoader)" in name for name in names) >= len(got) == 5
    assert [i for b in got for i in check_batch(b)] == list(range(N))
