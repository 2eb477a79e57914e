"""CachedDataset: real DataLoaders (fork, spawn, forkserver workers), real processes, real files.

Tests that count loads from the dataset pass ``check=0``: the stale and determinism checks load a few
samples more per process (tests/torch/test_pipelines.py tests them).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset
from torch_helpers import NoGetitems, Recorded, accesses, as_collated, check_batch, identity, reference, same

from mmapcache import Cache, CacheTimeoutError, SchemaMismatchError, StaleCacheError, default_dir
from mmapcache.torch import CachedDataset

HERE = Path(__file__).resolve().parents[1]
N = 96


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    return env


# -- DataLoader workers under each start method ---------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_dataloader_workers(context: str, cache_dir: Path) -> None:
    log = cache_dir / "accesses"
    ds = CachedDataset(Recorded(N, log), cache_dir / "c.mmc", key="recorded/v1", check=0)

    def loader(**kwargs: Any) -> DataLoader[Any]:
        return DataLoader(ds, num_workers=2, multiprocessing_context=context, **kwargs)

    # Epoch 1, batched through __getitems__: every sample is loaded and cached exactly once.
    seen = [i for batch in loader(batch_size=8, shuffle=True) for i in check_batch(batch)]
    assert sorted(seen) == list(range(N))
    first = accesses(log)
    assert Counter(i for _, _, i in first) == Counter(range(N))
    assert len({pid for pid, _, _ in first}) == 2, "both workers should have loaded samples"
    assert os.getpid() not in {pid for pid, _, _ in first}, "only the workers touch the dataset"
    with Cache(cache_dir / "c.mmc") as cache:
        assert cache.filled == N

    # Epoch 2, new workers, a custom batch sampler: zero misses.
    batches = list(BatchSampler(SequentialSampler(range(N)), batch_size=12, drop_last=False))[::-1]
    seen = [i for batch in loader(batch_sampler=batches) for i in check_batch(batch)]
    assert sorted(seen) == list(range(N))

    # Epoch 3, batch_size=None: DataLoader calls ds[i] per sample, no collation.
    reverse = range(N - 1, -1, -1)
    for index, sample in zip(reverse, loader(batch_size=None, sampler=reverse, collate_fn=identity), strict=True):
        assert same(sample, as_collated(index))
    assert accesses(log) == first, "a warm cache must not touch the dataset"


def test_dataloader_without_getitems(cache_dir: Path) -> None:
    """The per-sample path (no __getitems__) fills and serves the same samples."""
    log = cache_dir / "accesses"
    ds = NoGetitems(Recorded(N, log), key="recorded/v1", check=0)
    for _ in range(2):
        seen = [i for batch in DataLoader(ds, batch_size=8, shuffle=True, num_workers=2) for i in check_batch(batch)]
        assert sorted(seen) == list(range(N))
    assert sorted(i for _, _, i in accesses(log)) == list(range(N))
    # The same file serves the batched path too.
    assert ds.cache.filled == N
    fast = CachedDataset(Recorded(N, log), key="recorded/v1", check=0)
    assert fast.path == ds.path
    for batch in DataLoader(fast, batch_size=32):
        check_batch(batch)
    assert fast.stats()["misses"] == 0


def test_subset_and_concat(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="recorded/v1")
    part = Subset(ds, list(range(10, 30)))
    for batch in DataLoader(part, batch_size=7):
        assert check_batch(batch)
    both = ds + ds
    assert same(both[N + 13], as_collated(13))
    assert ds.stats()["misses"] == 20


# -- samples in, the same samples out ------------------------------------------------------


class Structured(torch.utils.data.Dataset[Any]):
    """Samples of one of several shapes of structure."""

    def __init__(self, kind: str, length: int = 20) -> None:
        self.kind, self.length = kind, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
        samples: dict[str, Any] = {
            "bare": x,
            "bare-int": i,
            "ndarray": np.full((4,), i, np.int16),
            "tuple": (x, i, float(i) / 7, i % 2 == 0),
            "list": [x, np.float32(i)],
            "dict": {"image": x, "label": i, "a key/with spaces": np.uint8(i)},
            "nested": (x, {"mask": x > i + 2, "n": i}, [np.int32(i), x.double()]),
            "list-of-dicts": [{"a": x}, {"a": x * 2}],
        }
        return samples[self.kind]


def _expected(value: Any) -> Any:
    """What CachedDataset turns a dataset value into: tensors everywhere, containers kept."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(value))
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)  # as default_collate does
    if isinstance(value, (bool, int)):
        return torch.tensor(value)
    if isinstance(value, tuple):
        return tuple(_expected(v) for v in value)
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return {k: _expected(v) for k, v in value.items()}


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("kind", ["bare", "bare-int", "ndarray", "tuple", "list", "dict", "nested", "list-of-dicts"])
def test_structure_roundtrip(kind: str, copy: bool, cache_dir: Path) -> None:
    source = Structured(kind)
    ds = CachedDataset(source, cache_dir / "c.mmc", key=kind, copy=copy)
    order = [5, 1, 5, 19, 0]
    cold = ds.__getitems__(order)  # misses, including a duplicate
    single = [ds[i] for i in order]  # hits, one at a time
    warm = ds.__getitems__(order)  # hits, batched
    mixed = ds.__getitems__([2, 5, 3, 19])  # half and half
    for got in (cold, single, warm):
        for i, sample in zip(order, got, strict=True):
            assert same(sample, _expected(source[i])), (kind, i, sample)
    for i, sample in zip([2, 5, 3, 19], mixed, strict=True):
        assert same(sample, _expected(source[i]))
    assert ds.__getitems__([]) == []
    # A new process view of the file (reopened by path) rebuilds the structure from field names alone.
    again = pickle.loads(pickle.dumps(CachedDataset(source, ds.path, key=kind)))
    assert same(again[19], _expected(source[19]))
    assert again.stats()["misses"] == 0


def test_python_scalars_collate_like_default_collate(cache_dir: Path) -> None:
    source = Structured("tuple")
    ds = CachedDataset(source, cache_dir / "c.mmc", key="tuple")
    cached = next(iter(DataLoader(ds, batch_size=4)))
    plain = next(iter(DataLoader(source, batch_size=4)))
    assert [t.dtype for t in cached] == [t.dtype for t in plain]  # int64, float64, bool as default_collate
    assert all(torch.equal(a, b) for a, b in zip(cached, plain, strict=True))


def test_half_precision_bits_roundtrip(cache_dir: Path) -> None:
    special = torch.tensor([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-7, 65504.0])

    class Halves(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            g = torch.Generator().manual_seed(i)
            noise = torch.randn(8, generator=g) * 10 ** (i - 2)
            return {"fp16": (special + noise).half(), "bf16": (special * noise).bfloat16()}

    source = Halves()
    ds = CachedDataset(source, cache_dir / "c.mmc", key="halves")
    assert {n: f.dtype_name for n, f in ds.cache.fields.items()} == {"fp16": "float16", "bf16": "bfloat16"}
    for _ in range(2):  # cold, then warm
        for i, sample in enumerate(ds.__getitems__(list(range(4)))):
            assert same(sample, source[i])  # bit-exact, NaN included
        batch = next(iter(DataLoader(ds, batch_size=4)))
        assert batch["bf16"].dtype == torch.bfloat16
        assert batch["fp16"].dtype == torch.float16


class Varied(torch.utils.data.Dataset[Any]):
    """Each sample gives its leaves in another form of the same dtype and shape."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Any:
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + i
        image = [
            base,
            base.clone().requires_grad_(True),  # detached, not refused
            torch.arange(24, dtype=torch.float32).reshape(3, 8)[:, ::2] + i,  # not contiguous
            base.numpy(),  # a numpy array of the same dtype
            base.t().contiguous().t(),  # column-major strides
        ][i]
        z = torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * i
        return {"image": image, "z": z.conj() if i % 2 else z.conj().resolve_conj(), "n": [i, np.int64(i), i][i % 3]}


def _varied_expected(i: int) -> dict[str, torch.Tensor]:
    image = torch.arange(24.0).reshape(3, 8)[:, ::2] if i == 2 else torch.arange(12.0).reshape(3, 4)
    z = (torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * i).conj().resolve_conj()
    return {"image": image + i, "z": z, "n": torch.tensor(i)}


def test_a_miss_stores_each_form_of_a_leaf_by_value(cache_dir: Path) -> None:
    """Views, tensors needing grad, conjugates and arrays of the first sample's dtype are stored by value."""
    ds = CachedDataset(Varied(), cache_dir / "c.mmc", key="varied")
    cold = ds.__getitems__(list(range(5)))
    warm = ds.__getitems__(list(range(5)))
    for i in range(5):
        for got in (cold[i], warm[i], ds[i]):
            assert same(got, _varied_expected(i)), (i, got)
            assert not got["image"].requires_grad
    assert ds.stats()["misses"] == 5


# -- what cannot be cached --------------------------------------------------------------------


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class Bad(torch.utils.data.Dataset[Any]):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        x = torch.zeros(3)
        return {
            "set": (x, {"cat"}),
            "none": {"image": x, "label": None},
            "ragged": (torch.zeros(i + 1), i),
            "deep": (x, ([x],)),
            "namedtuple": Pair(x, i),
            "intkeys": {0: x},
            "empty": (x, ()),
            "object-array": np.array(["a", None], dtype=object),
            "dtype-changes": x if i == 0 else x.long(),
        }[self.kind]


@pytest.mark.parametrize(
    ("kind", "error", "words"),
    [
        ("set", TypeError, ["'1'", "set", "supported"]),
        ("none", TypeError, ["'label'", "NoneType", "supported"]),
        ("ragged", ValueError, ["'0'", "shape", "fixed"]),
        ("deep", TypeError, ["'1/0'", "nested more than one level"]),
        ("namedtuple", TypeError, ["Pair", "plain tuple"]),
        ("intkeys", TypeError, ["strings"]),
        ("empty", ValueError, ["'1'", "empty tuple"]),
        ("object-array", TypeError, ["'.'", "object", "torch"]),
        ("dtype-changes", TypeError, ["'.'", "int64", "float32"]),
    ],
)
def test_uncacheable_values_are_named(kind: str, error: type[Exception], words: list[str], cache_dir: Path) -> None:
    ds = CachedDataset(Bad(kind), cache_dir / "c.mmc", key=kind)
    with pytest.raises(error) as info:
        ds.__getitems__([0, 1, 2])
    for word in words:
        assert word in str(info.value), str(info.value)


# -- the key and the schema ---------------------------------------------------------------------


class Shaped(torch.utils.data.Dataset[Any]):
    def __init__(self, side: int, length: int = 10) -> None:
        self.side, self.length = side, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return torch.full((self.side, self.side), i % 256, dtype=torch.uint8), i


def test_schema_mismatch_tells_what_to_do(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    old = CachedDataset(Shaped(4), path, key="images/v1")
    old.__getitems__([0, 1])
    # Same key, other preprocessing: found when the cache is first used (the content check)...
    with pytest.raises(StaleCacheError, match=r"\(8, 8\)"):
        CachedDataset(Shaped(8), path, key="images/v1")[0]
    # ... or, with check=0, at the first miss.
    new = CachedDataset(Shaped(8), path, key="images/v1", check=0)
    assert same(new[0], old[0])  # a hit: the key says it is the same content
    with pytest.raises(SchemaMismatchError) as info:
        new[5]
    message = str(info.value)
    assert "change the key" in message
    assert "mmapcache rm" in message
    assert "(8, 8)" in message
    # Another key at the same path, or another length: refused when opening.
    with pytest.raises(SchemaMismatchError, match="key"):
        CachedDataset(Shaped(4), path, key="images/v2")[0]
    with pytest.raises(SchemaMismatchError, match="length"):
        CachedDataset(Shaped(4, length=11), path, key="images/v1")[0]
    # Reopened by path in a new process: refused at its first miss too.
    with pytest.raises(SchemaMismatchError):
        pickle.loads(pickle.dumps(CachedDataset(Shaped(8), path, key="images/v1"))).__getitems__([7])


def test_default_path_from_key() -> None:
    ds = CachedDataset(Shaped(4), key="imagenet-train/resize256/v1")
    other = CachedDataset(Shaped(4), key="imagenet-train/resize256/v2")
    weird = CachedDataset(Shaped(4), key="../../etc/passwd ✓")
    assert ds.path.parent == default_dir() == weird.path.parent
    assert ds.path.name.startswith("imagenet-train_resize256_v1-")
    assert ds.path.suffix == ".mmc"
    assert ds.path != other.path
    assert "/" not in weird.path.name
    assert ".." not in weird.path.name
    assert ds.path == CachedDataset(Shaped(8), key="imagenet-train/resize256/v1").path
    with pytest.raises(ValueError, match="empty"):
        CachedDataset(Shaped(4), key="")


# -- partial caching and transforms -------------------------------------------------------------


def test_partial_caching_with_max_bytes(cache_dir: Path) -> None:
    log = cache_dir / "accesses"
    ds = CachedDataset(Recorded(N, log), key="partial", max_bytes="12KiB", check=0)
    for batch in DataLoader(ds, batch_size=10, shuffle=True, num_workers=2):
        check_batch(batch)
    capacity = ds.cache.capacity
    assert 0 < capacity < N
    assert ds.cache.filled == capacity
    first = len(accesses(log))
    assert first == N
    for batch in DataLoader(ds, batch_size=10, shuffle=True, num_workers=2):
        check_batch(batch)
    second = [i for _, _, i in accesses(log)[first:]]
    assert sorted(second) == list(range(capacity, N)), "only the uncacheable tail is loaded again"
    assert ds.fill(progress=False) == 0


def _noisy(sample: Any) -> Any:
    image, label, extra = sample
    image = image.float()
    image.add_(torch.rand(image.shape))  # in place on a fresh tensor
    extra["half"].mul_(2)  # in place on the tensor the cache returned: must not reach the cache
    return image, label, extra


@pytest.mark.parametrize("batched", [True, False])
def test_transform_runs_after_the_cache(batched: bool, cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(16), key="noisy", transform=_noisy)
    ids = list(range(16))

    def epoch() -> list[Any]:
        return ds.__getitems__(ids) if batched else [ds[i] for i in ids]

    one, two = epoch(), epoch()
    assert ds.stats()["misses"] == 16
    assert ds.stats()["hits"] == 16
    for i in ids:
        image, _, extra = reference(i)
        assert not torch.equal(one[i][0], two[i][0])  # random per epoch
        assert torch.all((one[i][0] - image.float()).abs() <= 1)
        assert torch.equal(one[i][2]["half"], extra["half"] * 2)
        assert torch.equal(two[i][2]["half"], extra["half"] * 2)
        stored = ds.cache.get(i)
        assert stored is not None
        assert np.array_equal(stored["0"], image.numpy())  # the cache holds the untransformed sample
        assert np.array_equal(stored["2/half"], extra["half"].numpy())


# -- copy=False --------------------------------------------------------------------------------


def test_copy_false_gives_readonly_views(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    CachedDataset(Recorded(N), path, key="views").fill(progress=False)
    ds = CachedDataset(Recorded(N), path, key="views", copy=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning is handled, not leaked
        a, b = ds[7], ds.__getitems__([7, 8])[0]
        batch = next(iter(DataLoader(ds, batch_size=8)))
    assert a[0].data_ptr() == b[0].data_ptr(), "both are views of the same bytes of the file"
    assert same(a, as_collated(7))
    assert check_batch(batch)
    assert ds.stats()["misses"] == 0
    fresh = CachedDataset(Recorded(N), path, key="views")
    x, y = fresh[7], fresh[7]
    assert x[0].data_ptr() != y[0].data_ptr()
    # Writing through a view is refused by the kernel (the mapping is read-only); the cache stays intact.
    script = textwrap.dedent(
        f"""
        from mmapcache.torch import CachedDataset
        from torch_helpers import Recorded
        ds = CachedDataset(Recorded({N}), {str(path)!r}, key="views", copy=False)
        image = ds[7][0]
        print("read", int(image.sum()), flush=True)
        image.add_(1)
        print("wrote", flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGSEGV, run.stderr
    assert "read" in run.stdout
    assert "wrote" not in run.stdout
    assert same(fresh[7], as_collated(7))


def test_zero_copy_tensors_stay_valid_after_close(cache_dir: Path) -> None:
    # Before the fix, close() unmapped the file under the tensors: float(x[5]) was a SIGSEGV.
    path = cache_dir / "c.mmc"
    CachedDataset(Recorded(N), path, key="views").fill(progress=False)
    script = textwrap.dedent(
        f"""
        import gc
        from mmapcache.torch import CachedDataset
        from torch_helpers import Recorded, as_collated, same
        ds = CachedDataset(Recorded({N}), {str(path)!r}, key="views", copy=False)
        one = ds[3]
        many = ds.__getitems__([5, 6])
        ds.close()
        gc.collect()
        assert same(one, as_collated(3)), "ds[3] after close"
        assert same(many[0], as_collated(5)) and same(many[1], as_collated(6)), "__getitems__ after close"
        float(one[0].flatten()[5])
        assert same(ds[4], as_collated(4)), "the dataset reopens on next use"
        ds.close()
        print("ok", flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


def test_copy_true_tensors_are_fresh(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="fresh")
    ds.fill(progress=False)
    for sample in [ds[3], *ds.__getitems__([3, 4])]:
        sample[0].zero_()
        sample[2]["bf16"].fill_(1)
    assert same(ds[3], as_collated(3))
    assert same(ds.__getitems__([4])[0], as_collated(4))


@pytest.mark.parametrize("copy", [True, False])
def test_verify_treats_a_damaged_slot_as_a_miss(copy: bool, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = cache_dir / "c.mmc"
    CachedDataset(Recorded(N), path, key="damaged").fill(progress=False)
    with Cache(path) as cache:
        cache._mapped.arrays["0"][3, 0, 0, 0] ^= 0xFF  # type: ignore[union-attr]  # flip bits behind the protocol's back
    log = cache_dir / "accesses"
    ds = CachedDataset(Recorded(N, log), path, key="damaged", copy=copy, verify=True, check=0)
    samples = ds.__getitems__([2, 3, 4])
    for i, sample in zip([2, 3, 4], samples, strict=True):
        assert same(sample, as_collated(i))
    assert same(ds[3], as_collated(3))
    assert [i for _, _, i in accesses(log)] == [3, 3], "the damaged slot is loaded from the dataset each time"
    assert ds.stats()["hits"] == 2
    assert "does not match its checksum" in caplog.text


# -- fill, stats, pickling ----------------------------------------------------------------------


def test_fill_in_process_and_with_workers(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = cache_dir / "accesses"
    ds = CachedDataset(Recorded(N, log), key="fill", check=0)
    ds[3]
    assert ds.fill(batch_size=10) == N - 1
    assert "filling" in capsys.readouterr().err  # the tqdm bar
    assert ds.fill() == 0
    assert Counter(i for _, _, i in accesses(log)) == Counter(range(N))
    totals = {"waited": 0, "total_hits": 0, "total_misses": 1, "total_written": N, "processes": 1}
    assert ds.stats() == {"hits": 0, "misses": 1, "written": N, **totals, "filled": N, "capacity": N, "length": N}

    other = CachedDataset(Recorded(N, log), key="fill-workers", check=0)
    before = len(accesses(log))
    assert other.fill(num_workers=2, batch_size=8, progress=False) == N
    filled_by = accesses(log)[before:]
    assert sorted(i for _, _, i in filled_by) == list(range(N))
    assert len({pid for pid, _, _ in filled_by} - {os.getpid()}) == 2, "two worker processes filled it"
    assert other.cache.filled == N
    assert other.fill(num_workers=2, progress=False) == 0
    assert other.stats()["total_written"] == N, "the workers' writes count in the file"


def test_stats_count_this_process_and_every_process_in_the_file(cache_dir: Path) -> None:
    FILE = {"filled": 4, "capacity": N, "length": N}  # noqa: N806
    ds = CachedDataset(Recorded(N), cache_dir / "c.mmc", key="stats")
    ds.__getitems__([0, 1, 2])
    ds.__getitems__([1, 2, 3])
    totals = {"waited": 0, "total_hits": 2, "total_misses": 4, "total_written": 4}
    assert ds.stats() == {"hits": 2, "misses": 4, "written": 4, **totals, "processes": 1} | FILE
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            ds[0]
            os.write(write, json.dumps(ds.stats()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child == {"hits": 1, "misses": 0, "written": 0, **totals, "total_hits": 3, "processes": 2} | FILE
    # The child's counts stay in the file after it exited.
    assert ds.stats() == {"hits": 2, "misses": 4, "written": 4, **totals, "total_hits": 3, "processes": 1} | FILE


def test_pickles_by_path(cache_dir: Path) -> None:
    source = Shaped(64, length=4000)  # 16 MB of samples
    ds = CachedDataset(source, cache_dir / "c.mmc", key="big")
    ds.fill(progress=False)
    ds[5]
    blob = pickle.dumps(ds)
    assert len(blob) < len(pickle.dumps(source)) + 1024  # the path and arguments, not the 16 MB
    clone = pickle.loads(blob)
    assert clone.path == ds.path
    assert same(clone[3999], ds[3999])
    assert clone.stats()["misses"] == 0
    assert clone.stats()["hits"] == 1


def test_timeout_bounds_the_wait_for_a_process_that_holds_the_creation_lock(cache_dir: Path) -> None:
    """``timeout=`` reaches the core's open and create (default 60 s), pickles with the dataset, and is checked."""
    path = cache_dir / "c.mmc"
    holder = subprocess.Popen(  # another process creating (or checking after a reboot) holds the lock
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from mmapcache._file.create import creation_lock\n"
            f"with creation_lock(Path({str(path)!r}), 10):\n"
            "    print('held', flush=True)\n"
            "    sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        ds = CachedDataset(Shaped(4, length=8), path, key="k", timeout=0.5)
        assert pickle.loads(pickle.dumps(ds)).timeout == 0.5
        started = time.monotonic()
        with pytest.raises(CacheTimeoutError, match="timeout="):
            ds[0]
        assert time.monotonic() - started < 10
    finally:
        holder.communicate("", timeout=30)
    assert ds[3] is not None  # the lock is free: the same dataset goes on
    assert CachedDataset(Shaped(4, length=8), path, key="k").timeout == 60.0
    for bad in (-1, float("inf"), float("nan"), "5", True, None):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
            CachedDataset(Shaped(4, length=8), path, key="k", timeout=bad)


def test_core_imports_without_torch(cache_dir: Path) -> None:
    """Without torch the core stores numbers, and the raw bits of dtypes numpy lacks (put as get gives them)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np, mmapcache
        fields = {{"x": ((3,), "float32"), "bf16": ((4,), "bfloat16"), "f8": ((2,), "float8_e4m3fn"),
                   "c32": ((), "complex32")}}
        bits = np.array([0x0000, 0x8000, 0x3FC0, 0x7FC1], np.uint16)  # 0, -0, 1.5, a NaN payload
        with mmapcache.Cache({str(cache_dir / "c.mmc")!r}, fields, 4) as cache:
            assert cache.put(1, {{"x": np.ones(3), "bf16": bits, "f8": np.array([1, 255], np.uint8),
                                 "c32": np.uint32(0x3C003C00)}})
            got = cache.get(1)
            assert got["x"].sum() == 3
            assert got["bf16"].dtype == np.uint16 and got["bf16"].tolist() == bits.tolist()
            assert got["f8"].tolist() == [1, 255] and int(got["c32"]) == 0x3C003C00
            # what get returns, put takes back: bits, byte order normalized
            assert cache.put_many([2, 3], {{"x": np.zeros((2, 3)), "bf16": np.stack([bits, bits]).astype(">u2"),
                                           "f8": np.ones((2, 2), np.uint8), "c32": np.ones(2, np.uint32)}}).all()
            assert cache.get_many([2, 3])["bf16"].tolist() == [bits.tolist()] * 2
            try:  # numbers (not bits) need torch to become bfloat16
                cache.put(0, {{**got, "bf16": np.ones(4, np.float32)}})
            except TypeError as error:
                assert "needs torch" in str(error) and "raw bits" in str(error), error
            else:
                raise AssertionError("float32 values went into a bfloat16 field without torch")
            assert 0 not in cache
        assert "mmapcache.torch" not in sys.modules
        assert "mmapcache._region.tensors" not in sys.modules
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr


def test_core_put_of_a_tensor_leaves_the_torch_layer_unimported(cache_dir: Path) -> None:
    """A tensor put into a core Cache loads only the core's tensor conversions, not mmapcache.torch."""
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        import mmapcache
        fields = {{"x": ((2, 3), torch.float32), "bf16": ((2,), torch.bfloat16)}}
        with mmapcache.Cache({str(cache_dir / "c.mmc")!r}, fields, 4) as cache:
            before = set(sys.modules)
            x, half = torch.arange(6.0).reshape(2, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
            assert cache.put(0, {{"x": x, "bf16": half}})
            assert cache.put_many([1], {{"x": x[None].double(), "bf16": half[None].view(torch.uint16)}}).all()
            for i in (0, 1):
                got = cache[i]
                assert torch.equal(torch.from_numpy(got["x"]), x)
                assert torch.equal(torch.from_numpy(got["bf16"]).view(torch.bfloat16), half)
        new = sorted(set(sys.modules) - before)
        assert new == ["mmapcache._region.tensors"], new
        assert "mmapcache.torch" not in sys.modules
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr


# -- two jobs on one node ------------------------------------------------------------------------


def _run_jobs(cache_dir: Path, count: int, length: int, extra: list[str]) -> list[dict[str, Any]]:
    log, start = cache_dir / "accesses", cache_dir / "go"
    args = ["--length", str(length), "--key", "shared/v1", "--log", str(log), "--start", str(start), *extra]
    jobs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "torch_helpers.py"), *args],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    start.touch()
    results = []
    for job in jobs:
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err
        results.append(json.loads(out))
    paths = {r["path"] for r in results}
    assert len(paths) == 1
    (path,) = paths
    assert [p.name for p in Path(path).parent.glob("*.mmc")] == [Path(path).name]
    with Cache(path) as cache:
        assert cache.filled == length
    assert set(i for _, _, i in accesses(log)) == set(range(length))
    return results


def test_two_concurrent_jobs_share_one_file(cache_dir: Path) -> None:
    a, b = _run_jobs(cache_dir, 2, 400, [])
    assert a["written"] + b["written"] == 400, "every slot was written once, by one of the jobs"
    assert sum(1 for _ in accesses(cache_dir / "accesses")) == a["misses"] + b["misses"]


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_four_jobs_with_workers_share_one_file(context: str, cache_dir: Path) -> None:
    """Four jobs, each with two DataLoader workers: ten processes fill and read one file."""
    _run_jobs(cache_dir, 4, 3000, ["--workers", "2", "--context", context])
