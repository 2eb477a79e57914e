"""CachedDataset.loader(): the batches DataLoader(ds) yields, with one copy from the file to the batch.

Tests that count loads from the dataset pass ``check=0``: the stale and determinism checks load a few
samples more per process (tests/torch/test_pipelines.py tests them).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, Subset, default_collate
from torch_helpers import Recorded, accesses, as_collated, check_batch, same

from mmapcache.torch import CachedDataset, collate
from mmapcache.torch._loader import Batched, WorkerBatch

N = 50


def batches(loader: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator here
        return list(loader)


def both(ds: CachedDataset, seed: int = 0, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """The batches of ``DataLoader(ds, ...)`` and ``ds.loader(...)`` for the same arguments and shuffle seed."""
    plain = batches(DataLoader(ds, generator=torch.Generator().manual_seed(seed), **kwargs))
    fast = batches(ds.loader(generator=torch.Generator().manual_seed(seed), **kwargs))
    return plain, fast


def assert_same_batches(plain: list[Any], fast: list[Any]) -> None:
    assert len(plain) == len(fast)
    for a, b in zip(plain, fast, strict=True):
        assert same(a, b), "loader() must yield what DataLoader(ds) yields"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_dataloader_cold_and_warm(workers: int, drop_last: bool, cache_dir: Path) -> None:
    log = cache_dir / "log"
    ds = CachedDataset(Recorded(N, log), cache_dir / "c.mmc", key="loader", check=0)
    # Cold: loader() first, so it fills the cache itself (misses are loaded, stored and batched).
    fast = batches(
        ds.loader(
            batch_size=8,
            shuffle=True,
            num_workers=workers,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(1),
        )
    )
    plain = batches(
        DataLoader(
            Recorded(N),
            batch_size=8,
            shuffle=True,
            num_workers=0,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(1),
        )
    )
    for a, b in zip(plain, fast, strict=True):
        assert same(check_batch(b), check_batch(a))
    assert sorted(i for _, _, i in accesses(log)) == sorted(i for b in fast for i in check_batch(b))
    # Warm: every batch is a hit, and equals the plain DataLoader's, structure and dtypes included.
    assert_same_batches(*both(ds, 2, batch_size=8, shuffle=True, num_workers=workers, drop_last=drop_last))
    loaded = [i for _, _, i in accesses(log)]
    assert len(loaded) == len(set(loaded)), "no sample is loaded twice"


def test_structures_and_dtypes_match_default_collate(cache_dir: Path) -> None:
    class Shapes(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> Any:
            g = torch.Generator().manual_seed(i)
            return {
                "image": torch.randint(0, 255, (2, 3), dtype=torch.uint8, generator=g),
                "bf16": torch.randn(3, generator=g).to(torch.bfloat16),
                "flag": bool(i % 2),
                "label": i,
                "score": i / 7,
                "pair": [np.float32(i), torch.tensor([i, -i], dtype=torch.int16)],
            }

    for kind, wrap in [("dict", lambda s: s), ("tuple", lambda s: tuple(s.values())), ("bare", lambda s: s["image"])]:

        class Wrapped(Shapes):
            def __getitem__(self, i: int, wrap: Any = wrap) -> Any:
                return wrap(super().__getitem__(i))

        ds = CachedDataset(Wrapped(), cache_dir / f"{kind}.mmc", key=kind)
        ds.fill(progress=False)
        plain, fast = both(ds, batch_size=6, shuffle=True)
        assert_same_batches(plain, fast)
        assert type(fast[0]) is type(plain[0])


def test_a_batch_mixing_hits_and_misses(cache_dir: Path) -> None:
    log = cache_dir / "log"
    ds = CachedDataset(Recorded(N, log), cache_dir / "c.mmc", key="mixed", check=0)
    ds.__getitems__([1, 3, 5])
    (batch,) = batches(ds.loader(batch_size=6, sampler=[0, 1, 2, 3, 4, 5]))
    assert check_batch(batch) == [0, 1, 2, 3, 4, 5]
    assert sorted(i for _, _, i in accesses(log)) == [0, 1, 2, 3, 4, 5]
    stats = ds.stats()
    assert (stats["hits"], stats["misses"]) == (3, 6)


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_fill_misses_and_the_main_process_gathers(context: str, cache_dir: Path) -> None:
    log = cache_dir / "log"
    ds = CachedDataset(Recorded(N, log), cache_dir / "c.mmc", key="workers", capacity=30, check=0)
    ds[0]  # the file exists, so every worker batch is a deferred one
    for _ in range(2):
        seen = []
        for batch in batches(ds.loader(batch_size=10, shuffle=True, num_workers=2, multiprocessing_context=context)):
            seen += check_batch(batch)
            # Gathered here from the file, not shipped through a shared-memory segment.
            assert not batch[0].is_shared()
        assert sorted(seen) == list(range(N))
    loaded = Counter(i for _, _, i in accesses(log))
    assert all(loaded[i] == 1 for i in range(30)), "cacheable samples are loaded once"
    assert all(loaded[i] == 2 for i in range(30, N)), "beyond the capacity: loaded by a worker every epoch"
    stats = ds.stats()
    # Every read counted once: epoch 1 loaded all but sample 0, epoch 2 read 30 from the cache.
    assert (stats["total_hits"], stats["total_misses"]) == (1 + 30, 1 + (N - 1) + (N - 30))


def test_a_worker_batch_pickles_as_positions_and_the_main_process_gathers_it(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="deferred")
    ds.fill(progress=False)
    batched = ds.loader(batch_size=4).dataset
    assert isinstance(batched, Batched)
    sent = batched.in_worker([1, 2])
    assert isinstance(sent, WorkerBatch)
    assert len(pickle.dumps(sent)) < 600, "a worker sends positions, not data"
    assert check_batch(batched.gather(pickle.loads(pickle.dumps(sent)))) == [1, 2]


def test_samplers_and_dataloader_options_pass_through(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="options")
    ds.fill(progress=False)
    for rank in (0, 1):
        sampler: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(4)
        plain = batches(DataLoader(ds, batch_size=7, sampler=sampler))
        assert_same_batches(plain, batches(ds.loader(batch_size=7, sampler=sampler)))
    loader = ds.loader(
        batch_size=5, shuffle=False, pin_memory=True, persistent_workers=True, prefetch_factor=3, num_workers=2
    )
    assert loader.persistent_workers
    assert loader.prefetch_factor == 3
    for _ in range(2):  # the persistent workers serve both epochs
        assert [i for b in batches(loader) for i in check_batch(b)] == list(range(N))
    assert_same_batches(*both(ds, batch_size=5, sampler=SequentialSampler(range(N))))
    assert_same_batches(*both(ds, batch_size=None, shuffle=True))  # no batching: samples as they are


def test_transform_and_collate_fn_keep_their_meaning(cache_dir: Path) -> None:
    def flip(sample: Any) -> Any:
        image, label, extra = sample
        return image.flip(-1), label, extra

    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="transform", transform=flip)
    ds.fill(progress=False)
    assert_same_batches(*both(ds, batch_size=8, shuffle=True))
    plain = batches(DataLoader(ds, batch_size=4, collate_fn=len))
    assert plain == batches(ds.loader(batch_size=4, collate_fn=len)) == [4] * (N // 4) + [N % 4]


def test_copy_false_and_subsets(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    CachedDataset(Recorded(N), path, key="views").fill(progress=False)
    ds = CachedDataset(Recorded(N), path, key="views", copy=False)
    plain, fast = both(ds, batch_size=9, shuffle=True)
    assert_same_batches(plain, fast)
    first = fast[0][0]
    first.zero_()  # a batch is the caller's own memory, never a view of the file
    assert same(ds[check_batch(plain[0])[0]], as_collated(check_batch(plain[0])[0]))
    assert check_batch(batches(DataLoader(Subset(ds, [4, 2]), batch_size=2))[0]) == [4, 2]


def test_negative_and_numpy_indices_read_like_ds_getitem(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="indices")
    ds.fill(progress=False)
    batched = ds.loader(batch_size=3).dataset
    assert isinstance(batched, Batched)
    assert check_batch(batched.batch([-1, np.int64(3), -N])) == [N - 1, 3, 0]
    with pytest.raises(IndexError):
        batched.batch([N])
    with pytest.raises(TypeError):
        batched.batch([1.5])


# -- the default path: DataLoader(ds) with default_collate ------------------------------------


def test_importing_mmapcache_torch_leaves_default_collate_alone() -> None:
    script = textwrap.dedent(
        """
        from torch.utils.data._utils.collate import default_collate_fn_map
        import torch
        before = dict(default_collate_fn_map)
        import mmapcache.torch
        assert dict(default_collate_fn_map) == before, "torch's collation is not mmapcache's to change"
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert run.stdout.strip() == "ok", run.stderr


def test_default_collate_stacks_samples_into_a_batch_of_their_own(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="default")
    ds.fill(progress=False)
    samples = ds.__getitems__([7, 3, 9])
    batch = default_collate(samples)
    assert check_batch(batch) == [7, 3, 9]
    assert batch[2]["bf16"].dtype == torch.bfloat16
    # A batch is the caller's own: writing into it reaches neither the samples nor the cache.
    batch[0].zero_()
    assert same(samples[0], as_collated(7))
    assert same(ds[7], as_collated(7))


def test_default_collate_of_other_tensors_is_unchanged() -> None:
    data = torch.arange(12).reshape(4, 3)
    stacked = default_collate(list(data.unbind(0)))  # consecutive rows of a tensor of the user's
    assert torch.equal(stacked, data)
    assert stacked.data_ptr() != data.data_ptr(), "only mmapcache's own gather buffers are returned as views"


# -- collate: default_collate without the second copy, when asked for ----------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_gives_what_default_collate_gives(workers: int, cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="collate")
    ds.__getitems__(list(range(0, N, 3)))  # a third cached: batches mix hits and misses
    for _ in range(2):  # cold, then warm
        gen = torch.Generator().manual_seed(4)
        ours = batches(
            DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers, collate_fn=collate, generator=gen)
        )
        gen = torch.Generator().manual_seed(4)
        plain = batches(DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers, generator=gen))
        assert same(ours, plain)
        assert ours[0][2]["bf16"].dtype == torch.bfloat16


def test_collate_returns_a_warm_batch_as_gathered_instead_of_a_copy(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="collate")
    ds.fill(progress=False)
    samples = ds.__getitems__([7, 3, 9])
    batch = collate(samples)
    assert check_batch(batch) == [7, 3, 9]
    assert batch[0].data_ptr() == samples[0][0].data_ptr(), "the rows the samples view, not a copy"
    assert batch[2]["bf16"].data_ptr() == samples[0][2]["bf16"].data_ptr()
    assert batch[2]["bf16"].dtype == torch.bfloat16
    # Anything but those rows, whole and in order, is stacked as default_collate stacks it.
    assert collate(samples[::-1])[0].data_ptr() != samples[2][0].data_ptr()
    assert check_batch(collate(samples[1:])) == [3, 9]
    data = torch.arange(12).reshape(4, 3)
    assert collate(list(data.unbind(0))).data_ptr() != data.data_ptr(), "a user's tensor is never aliased"
    batch[0].zero_()
    assert same(ds[7], as_collated(7)), "the batch is fresh memory, never the cache"


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_default_path_batches_are_exact(workers: int, cache_dir: Path) -> None:
    log = cache_dir / "log"
    ds = CachedDataset(Recorded(N, log), cache_dir / "c.mmc", key="exact", check=0)
    ds.__getitems__(list(range(0, N, 3)))  # a third cached: batches mix hits and misses
    for epoch in range(2):
        seen = []
        for batch in batches(DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers)):
            seen += check_batch(batch)
            if workers and epoch:
                assert batch[0].is_shared(), "gathered in the worker's shared memory"
        assert sorted(seen) == list(range(N))
    assert len(accesses(log)) == N


INDEX_ITEMS = st.integers(-2 * N, 2 * N) | st.sampled_from([True, 1.5, "3", None])


@settings(max_examples=150, deadline=None, database=None)
@given(batch=st.lists(INDEX_ITEMS, max_size=20), as_array=st.booleans())
def test_a_batch_of_indices_is_checked_as_ds_i_checks_each_one(batch: list[Any], as_array: bool) -> None:
    """The sampler's lists of ints take a fast path; it accepts and refuses exactly what ``ds[i]`` does, one by one."""
    from mmapcache.torch._settings import Settings

    checked = Settings.checked(
        list(range(N)), None, key="indices", max_bytes=None, capacity=None, copy=True, verify=False,
        fields=None, cached_indices=None, dtypes=None, check=0,
    )  # fmt: skip
    given_batch: Any = batch
    if as_array and all(type(i) is int for i in batch):
        given_batch = np.array(batch, np.int64)
    try:
        expected: Any = [checked.index(i) for i in batch]
    except (TypeError, IndexError) as error:
        expected = (type(error), str(error))
    try:
        got: Any = checked.indices(given_batch).tolist()
    except (TypeError, IndexError) as error:
        got = (type(error), str(error))
    assert got == expected


# -- per-sample transforms and batch transforms on the one-copy path ----------------------------------------


def inspect_and_flip(sample: Any) -> Any:
    """A transform that writes into its input and reports what it got: a row of which batch, where it lives."""
    image, label, extra = sample
    base = image._base
    image.add_(1)  # in place: the transform's own memory, never the cache's
    report = {
        "base": torch.tensor(-1 if base is None else base.data_ptr()),
        "offset": torch.tensor(-1 if base is None else image.data_ptr() - base.data_ptr()),
        "shared": torch.tensor(image.is_shared()),
    }
    return image.flip(-1), label, {**extra, **report}


@pytest.mark.parametrize("make", ["DataLoader(ds)", "collate_fn=collate", "ds.loader()"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_gets_writable_rows_of_one_batch_gathered_once_in_its_own_process(
    make: str, workers: int, cache_dir: Path
) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="rows", transform=inspect_and_flip)
    ds.fill(progress=False)
    kwargs: dict[str, Any] = {"batch_size": 8, "shuffle": True, "num_workers": workers}
    if make == "ds.loader()":
        loader: Any = ds.loader(**kwargs)
    else:
        loader = DataLoader(ds, collate_fn=collate if make == "collate_fn=collate" else None, **kwargs)
    seen = []
    for image, label, extra in batches(loader):
        rows = len(label)
        # Every sample a consecutive row of one private batch (no copy per sample, no shared segment).
        assert len(set(extra["base"].tolist())) == 1
        assert extra["base"][0] > 0
        assert extra["offset"].tolist() == [k * 3 * 8 * 8 for k in range(rows)]
        assert not extra["shared"].any()
        for row, index in enumerate(extra["index"].tolist()):
            expected = as_collated(index)[0].add(1).flip(-1)
            assert torch.equal(image[row], expected), "the transform's in-place write and its result"
            assert label[row] == index % 10
            seen.append(index)
    assert sorted(seen) == list(range(N))
    with ds.cache as cache:
        assert all(np.array_equal(cache[i]["0"], as_collated(i)[0].numpy()) for i in range(N)), "the file is intact"


def test_a_leaf_the_transform_returns_as_it_got_it_stays_in_the_gathered_batch(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="pass", transform=inspect_and_flip)
    ds.fill(progress=False)
    _image, label, _extra = batches(ds.loader(batch_size=8))[0]
    assert label.tolist() == [i % 10 for i in range(8)]
    assert label._base is not None, "rows of the gathered label column, returned as that column (no stack)"


def add_one(batch: Any) -> Any:
    image, label, extra = batch
    image.add_(1)  # in place: the gathered batch is fresh memory
    return image, label * 2, {**extra, "pid": torch.tensor(os.getpid())}


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_batch_transform_runs_once_on_each_gathered_batch_in_the_main_process(
    workers: int, context: str | None, cache_dir: Path
) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="batch-transform", check=0)
    ds.fill(progress=False)
    kwargs: dict[str, Any] = {"batch_size": 8, "shuffle": True, "num_workers": workers}
    if workers:
        kwargs["multiprocessing_context"] = context
    plain = batches(ds.loader(generator=torch.Generator().manual_seed(4), **kwargs))
    got = batches(ds.loader(generator=torch.Generator().manual_seed(4), batch_transform=add_one, **kwargs))
    assert len(got) == len(plain)
    for (image, label, extra), (image0, label0, _extra0) in zip(got, plain, strict=True):
        assert torch.equal(image, image0 + 1)
        assert torch.equal(label, label0 * 2)
        assert int(extra["pid"]) == os.getpid(), "a gathered batch is finished in the main process"
        assert not image.is_shared()
    with ds.cache as cache:
        assert np.array_equal(cache[3]["0"], as_collated(3)[0].numpy()), "the file is intact"


def test_batch_transform_after_a_transform_a_collate_fn_and_uncached_indices(cache_dir: Path) -> None:
    def plus(batch: Any) -> Any:
        return [batch[0] + 1, *batch[1:]]

    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="bt-more", transform=identity_sample, capacity=30)
    ds.fill(progress=False)
    for kwargs in ({}, {"collate_fn": default_collate}, {"num_workers": 2}):
        plain = batches(ds.loader(batch_size=8, **kwargs))
        got = batches(ds.loader(batch_size=8, batch_transform=plus, **kwargs))
        assert all(torch.equal(a[0], b[0] + 1) for a, b in zip(got, plain, strict=True)), kwargs
        assert [check_batch([a[0] - 1, *a[1:]]) for a in got] == [check_batch(b) for b in plain]


def identity_sample(sample: Any) -> Any:
    return sample


def test_batch_transform_is_checked(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="bt-checked")
    with pytest.raises(TypeError, match="batch_transform must be callable, not int"):
        ds.loader(batch_size=4, batch_transform=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_transform needs batches"):
        ds.loader(batch_size=None, batch_transform=add_one)


RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def recipe_block(heading: str) -> str:
    """The Python block of the recipe under ``## <heading>`` in docs/recipes.md."""
    text = RECIPES.read_text(encoding="utf-8")
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_batch_crop_flip_recipe_prints_what_it_says(cache_dir: Path) -> None:
    body = recipe_block("Augmenting whole batches: `batch_transform=`")
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True, check=True, timeout=300)
    said = [line.split("# ", 1)[1] for line in body.splitlines() if line.startswith("print(")]
    assert out.stdout.splitlines() == said
    assert list(cache_dir.iterdir()) == [], "the recipe removes what it made"


def test_the_batch_crop_flip_recipe_crops_and_flips_each_sample_on_its_own() -> None:
    body = recipe_block("Augmenting whole batches: `batch_transform=`")
    scope: dict[str, Any] = {}
    exec(body.split("\ndecoded = ", 1)[0], scope)  # the imports and the class, not the run
    images = torch.randint(0, 256, (64, 3, 20, 20), dtype=torch.uint8)
    torch.manual_seed(0)
    out, labels = scope["RandomCropFlip"](12)((images, torch.arange(64)))
    assert out.shape == (64, 3, 12, 12)
    assert torch.equal(labels, torch.arange(64))
    places = set()
    for k in range(64):
        found = [
            (top, left, flip)
            for top in range(9)
            for left in range(9)
            for flip in (False, True)
            if torch.equal(
                out[k],
                images[k, :, top : top + 12, left : left + 12].flip(-1)
                if flip
                else images[k, :, top : top + 12, left : left + 12],
            )
        ]
        assert found, f"sample {k} is not a crop of its own image"
        places.add(found[0])
    assert len(places) > 30, "every sample draws its own crop and flip"
    assert {flip for _, _, flip in places} == {False, True}
