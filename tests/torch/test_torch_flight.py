"""CachedDataset's misses go through single flight, and its spot checks run once per job.

Real processes (spawned jobs, DataLoader workers under fork and spawn), a real
file, loads counted across processes from a shared log (see ``_torch_flight_procs``).
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _testing_caches import Images
from _torch_flight_procs import SPAWN, Slow, read_epochs, read_pickled, read_pickled_orphaned
from torch_helpers import accesses, check_batch

from mmapcache import Cache
from mmapcache.testing import check_concurrent_access
from mmapcache.torch import CachedDataset

N = 96


def run_jobs(procs: list[Any], count: int, *args: Any, options: dict[str, Any]) -> list[dict[str, Any]]:
    """``count`` jobs of :func:`read_epochs` started together; their reports."""
    barrier, results = SPAWN.Barrier(count), SPAWN.Queue()
    for _ in range(count):
        proc = SPAWN.Process(target=read_epochs, args=(*args, barrier, results, dict(options)))
        proc.start()
        procs.append(proc)
    reports = [results.get(timeout=240) for _ in range(count)]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return reports


def loads(log: Path) -> Counter[int]:
    return Counter(index for _, _, index in accesses(log))


# -- one load per sample per node --------------------------------------------------------------


def test_two_jobs_reading_the_same_order_load_each_sample_once(cache_dir: Path, procs: list[Any]) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    CachedDataset(Slow(N), path, key="slow/v1", check=0)[0]  # the file exists: no race to create it
    order = np.random.default_rng(0).permutation(N).tolist()
    a, b = run_jobs(procs, 2, str(path), N, str(log), 0.005, order, options={"batch_size": 8})
    assert loads(log) == Counter(i for i in range(N) if i != 0), "every missing sample loaded exactly once"
    assert sorted(a["seen"]) == sorted(b["seen"]) == list(range(N))
    assert a["misses"] + b["misses"] == N - 1
    assert a["written"] + b["written"] == N - 1, "every slot stored once, by one of the jobs"
    assert a["waited"] + b["waited"] > 0, "a job waited for samples the other was loading"
    assert a["hits"] + a["misses"] == b["hits"] + b["misses"] == N
    with Cache(path) as cache:
        assert cache.filled == N
        assert cache.usage().total.written == N


def test_two_jobs_with_two_workers_each_load_each_sample_once_and_check_once_per_job(
    cache_dir: Path, procs: list[Any]
) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    CachedDataset(Slow(N), path, key="slow/v1", check=0)[0]
    order = np.random.default_rng(1).permutation(N).tolist()
    options = {"batch_size": 8, "workers": 2, "context": "fork", "check": 2}
    run_jobs(procs, 2, str(path), N, str(log), 0.005, order, options=options)
    counts = loads(log)
    # Sample 0 was the only one cached when the jobs started: each job's main process compared it with a
    # fresh load (the stale check) and loaded it once more (the determinism check); its workers did neither.
    assert counts.pop(0) == 2 * 2
    assert counts == Counter(range(1, N))
    with Cache(path) as cache:
        assert cache.usage().total.written == N


def test_three_jobs_of_one_seed_starting_before_the_file_exists_load_the_dataset_about_once(
    cache_dir: Path, procs: list[Any]
) -> None:
    """A sweep: every worker of every job starts on a missing file; their first batches go through single flight."""
    n = 1024
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    order = np.random.default_rng(2).permutation(n).tolist()
    options = {"batch_size": 32, "workers": 2, "context": "fork", "check": 0}
    reports = run_jobs(procs, 3, str(path), n, str(log), 0.0005, order, options=options)
    assert all(sorted(report["seen"]) == list(range(n)) for report in reports)
    with Cache(path) as cache:
        total = cache.usage().total
    assert total.written == n
    # Each of the six workers may load the one sample that creates the file (or finds it just created).
    assert total.misses <= 1.01 * n, f"{total.misses} loads for {n} samples"
    assert sum(loads(log).values()) <= 1.01 * n


def test_a_holder_killed_mid_load_leaves_its_samples_to_the_waiting_job(cache_dir: Path, procs: list[Any]) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    CachedDataset(Slow(8), path, key="slow/v1", check=0)[0]
    order = list(range(1, 8))
    # A slow holder (2 s a sample) takes the whole batch; the other job finds it held and waits.
    unheard = SPAWN.Queue()  # the holder never reports: it is killed (kept alive here until it has started)
    holder = SPAWN.Process(
        target=read_epochs, args=(str(path), 8, str(log), 2.0, order, None, unheard, {"batch_size": 7})
    )
    holder.start()
    procs.append(holder)
    deadline = time.monotonic() + 60
    while not loads(log) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loads(log), "the holder never started loading"
    results = SPAWN.Queue()
    # The waiter's own loads are slow too, so it waits rather than loading again.
    waiter = SPAWN.Process(
        target=read_epochs, args=(str(path), 8, str(log), 0.05, order, None, results, {"batch_size": 7})
    )
    waiter.start()
    procs.append(waiter)
    time.sleep(1.0)
    holder.kill()
    holder.join()
    report = results.get(timeout=60)
    waiter.join(30)
    assert waiter.exitcode == 0
    assert report["seen"] == order
    with Cache(path) as cache:
        assert cache.filled == 8


def test_check_concurrent_access_passes_a_slow_cached_dataset_with_kills_of_holders() -> None:
    summary = check_concurrent_access(
        functools.partial(CachedDataset, SlowImages(), key="slow-images"),
        Images().__getitem__,
        max_examples=6,
        kill=True,
        seed=5,
    )
    assert summary.kills_mid_load > 0


class SlowImages(Images):
    """``Images`` at 3 ms a sample: slow enough that single flight waits for a held sample."""

    def __getitem__(self, index: int) -> Any:
        time.sleep(0.003)
        return super().__getitem__(index)


# -- the spot checks: once per job -------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_warm_epochs_with_fresh_workers_load_no_sample_after_the_jobs_checks(context: str, cache_dir: Path) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    CachedDataset(Slow(N), path, key="slow/v1").fill(progress=False)
    ds = CachedDataset(Slow(N, log), path, key="slow/v1", check=2)  # a new job over a warm cache
    loader = ds.loader(batch_size=16, shuffle=True, num_workers=2, multiprocessing_context=context)
    checks = None
    for epoch in range(3):  # persistent_workers=False: fresh workers every epoch
        seen = [i for batch in loader for i in check_batch(batch)]
        assert sorted(seen) == list(range(N))
        if epoch == 0:
            checks = accesses(log)
    assert checks is not None
    assert len(checks) == 3, "check=2: two samples compared, the first loaded once more"
    assert {pid for pid, _, _ in checks} == {os.getpid()}, "the job's main process checked"
    assert accesses(log) == checks, "no worker loaded anything, in any epoch"


def test_a_plain_dataloader_worker_inherits_the_verdict_of_a_main_process_that_opened_the_cache(
    cache_dir: Path,
) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    CachedDataset(Slow(N), path, key="slow/v1").fill(progress=False)
    ds = CachedDataset(Slow(N, log), path, key="slow/v1", check=2)
    assert ds.stats()["filled"] == N  # opens the cache here: the checks run once
    for _ in range(2):
        loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="spawn")
        assert sorted(i for batch in loader for i in check_batch(batch)) == list(range(N))
    assert len(accesses(log)) == 3


def test_a_process_of_another_job_checks_again(cache_dir: Path) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    ds = CachedDataset(Slow(N, log), path, key="slow/v1", check=2)
    ds.fill(progress=False)
    ds.close()
    ds[5]  # reopened: this job's verdict holds, nothing is checked again
    pickled = cache_dir / "ds.pkl"
    pickled.write_bytes(pickle.dumps(ds))
    before = len(accesses(log))
    child = SPAWN.Process(target=read_pickled, args=(str(pickled), [5], str(cache_dir / "child")))
    child.start()
    child.join(60)
    assert (cache_dir / "child").read_text() == "ok"
    assert len(accesses(log)) == before, "a process this job started trusts the job's verdict"
    orphan = SPAWN.Process(target=read_pickled_orphaned, args=(str(pickled), [5], str(cache_dir / "orphan")))
    orphan.start()
    orphan.join(60)
    deadline = time.monotonic() + 60
    while not (cache_dir / "orphan").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (cache_dir / "orphan").read_text() == "ok"
    assert len(accesses(log)) == before + 3, "a process of no job of ours checked the file itself"


def test_a_verdict_does_not_cover_a_file_replaced_since(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    ds = CachedDataset(Slow(N), path, key="slow/v1", check=2)
    ds.fill(progress=False)
    pickled = cache_dir / "ds.pkl"
    pickled.write_bytes(pickle.dumps(ds))
    ds.close()
    # The file is replaced by one of the same key holding other content (another version of the data).
    path.unlink()
    stale = CachedDataset(Shifted(N), path, key="slow/v1", check=0)
    stale.fill(progress=False)
    stale.close()
    child = SPAWN.Process(target=read_pickled, args=(str(pickled), [5], str(cache_dir / "child")))
    child.start()
    child.join(60)
    assert (cache_dir / "child").read_text().startswith("StaleCacheError: ")


class Shifted(Slow):
    """``Slow`` whose images are all shifted by one: what a changed preprocessing gives."""

    def __getitem__(self, index: int) -> Any:
        image, label, extra = super().__getitem__(index)
        return image + 1, label, extra
