"""Many processes, one cache: concurrent fill, crash fuzz, concurrent creators, in-use tracking.

Every test here uses real processes (spawned, or forked where the test is
about fork), real files in /dev/shm and real kernel locks; processes are
killed with SIGKILL, never asked to stop. Sample bytes are a pure function of
(index, writer tag) -- see ``_procs.py`` -- so any process can check any
sample it reads, and a slot mixing two writers' bytes cannot pass.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data as torch_data
from _procs import (
    SPAWN,
    Worker,
    WorkerPool,
    check_sample,
    make_batch,
    make_fields,
    sample_data,
    sleep_until,
    stop_all,
)

import mmapcache
from mmapcache import Cache, CacheInUseError

FORK = multiprocessing.get_context("fork")


def _check_every_ready_slot(cache: Cache, tags: set[int]) -> np.ndarray[Any, Any]:
    """Every READY slot holds exactly the bytes of one writer; returns the READY indices."""
    ready = np.flatnonzero(cache.contains_many(range(cache.capacity)))
    if len(ready):
        batch = cache.get_many(ready)
        for i, data, tag in zip(ready.tolist(), batch["data"], batch["tag"], strict=True):
            assert int(tag) in tags, f"slot {i} holds the unknown writer tag {int(tag)}"
            assert check_sample(i, data, int(tag)), f"slot {i} is READY but its bytes are not writer {int(tag)}'s"
    return ready


# -- concurrent fill --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_spawned_writers_fill_overlapping_ranges_while_readers_read(cache_dir: Path) -> None:
    """4 spawned writers fill overlapping ranges (racing on the overlaps) while 2 readers check every hit."""
    writers, readers, length, nbytes = 4, 2, 2048, 16384
    path = cache_dir / "fill.mmc"
    Cache.open(path, make_fields(nbytes), length).close()
    procs = [Worker() for _ in range(writers + readers)]
    try:
        for w in procs:
            w.call("open", str(path), nbytes, length, {})
        for seed, reader in enumerate(procs[writers:]):
            reader.send("read_random", length, seed)
            reader.wait_started()
        # Writer k fills [k, k+2) fifths of the range. Even writers go down from
        # the top, odd ones up from the bottom, so neighbours start on the same
        # overlap and race slot by slot; half of them use put_many.
        fifth = length // (writers + 1)
        plans: dict[int, list[int]] = {}
        for k, w in enumerate(procs[:writers]):
            span = list(range(k * fifth, length if k == writers - 1 else (k + 2) * fifth))
            plans[k + 1] = span[::-1] if k % 2 == 0 else span
            w.send("fill", plans[k + 1], k + 1, 1 if k < 2 else 8)
        for w in procs[:writers]:
            w.wait_started()
        stored = {k + 1: set(w.recv()) for k, w in enumerate(procs[:writers])}
        for reader in procs[writers:]:
            reader.send("stop")
        reports = [reader.recv() for reader in procs[writers:]]
    finally:
        stop_all(procs)

    # First writer wins: every slot was stored by exactly one put.
    winners: dict[int, int] = {}
    for tag, indices in stored.items():
        assert indices <= set(plans[tag])
        for i in indices:
            assert i not in winners, f"slot {i}: both writer {winners[i]} and writer {tag} got True from put"
            winners[i] = tag
    assert sorted(winners) == list(range(length))
    with Cache.open(path) as cache:
        assert cache.filled == length
        batch = cache.get_many(range(length))
        for i in range(length):
            assert int(batch["tag"][i]) == winners[i], f"slot {i} holds another writer's sample than put said"
            assert check_sample(i, batch["data"][i], winners[i])
        assert cache.verify() == []
    for report in reports:
        assert report["bad"] == [], f"readers saw torn or wrong samples at {report['bad'][:10]}"
        assert report["checked"] > 0
    # The readers really ran during the fill: they saw it partly done.
    assert sum(r["partial"] for r in reports) > 0
    print(
        f"fill: {sum(len(p) for p in plans.values())} puts by {writers} writers, "
        f"{sum(r['reads'] for r in reports)} reads ({sum(r['checked'] for r in reports)} hits checked) by {readers}"
    )


class _ForkWriterDataset(torch_data.Dataset[tuple[int, int, bool]]):
    """A map-style dataset that fills the cache it inherited, DataLoader-worker style.

    ``__getitem__`` puts the sample (tagged with the worker id) and reports
    whether this put won the slot.
    """

    def __init__(self, cache: Cache, nbytes: int) -> None:
        self.cache, self.nbytes = cache, nbytes

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> tuple[int, int, bool]:
        info = torch_data.get_worker_info()
        tag = 0 if info is None else info.id + 1
        sample = {"data": sample_data(index, tag, self.nbytes), "tag": tag}
        return index, tag, self.cache.put(index, sample)


def _no_collate(batch: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    return batch


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 cores, on purpose
def test_dataloader_fork_workers_write_through_the_inherited_handle(cache_dir: Path) -> None:
    """3 forked DataLoader workers put the same slots at once through the parent's handle: one wins each."""
    length, nbytes, batch_size, workers = 768, 32768, 16, 3
    with Cache.open(cache_dir / "fork.mmc", make_fields(nbytes), length) as cache:
        assert cache.put(0, {"data": sample_data(0, 0, nbytes), "tag": 0})  # the parent wrote before forking
        # Each run of `batch_size` indices appears `workers` times in a row, so
        # the batches go to the workers round-robin and they race on every slot.
        order = [
            i
            for start in range(0, length, batch_size)
            for _ in range(workers)
            for i in range(start, start + batch_size)
        ]
        loader: torch_data.DataLoader[tuple[int, int, bool]] = torch_data.DataLoader(
            _ForkWriterDataset(cache, nbytes),
            batch_size=batch_size,
            sampler=order,
            num_workers=workers,
            multiprocessing_context="fork",
            collate_fn=_no_collate,
            prefetch_factor=4,
        )
        wins: dict[int, list[int]] = {}
        for batch in loader:
            for index, tag, won in batch:
                if won:
                    wins.setdefault(index, []).append(tag)
        doubles = {i: tags for i, tags in wins.items() if len(tags) > 1}
        assert not doubles, f"several forked workers won the same slots: {dict(list(doubles.items())[:5])}"
        assert sorted(wins) == list(range(1, length))
        assert cache.filled == length
        for i in range(length):
            sample = cache[i]
            want = 0 if i == 0 else wins[i][0]
            assert int(sample["tag"]) == want
            assert check_sample(i, sample["data"], want)
        assert cache.verify() == []


def _fork_child_puts(cache: Cache, indices: list[int], tag: int, conn: multiprocessing.connection.Connection) -> None:
    nbytes = cache.fields["data"].fixed_shape[0]
    conn.send([i for i in indices if cache.put(i, {"data": sample_data(i, tag, nbytes), "tag": tag})])


@pytest.mark.timeout(120)
def test_forked_children_and_parent_race_for_the_same_slots(cache_dir: Path) -> None:
    """Parent and 2 fork children put the same indices in the same order: exactly one put wins each slot."""
    length, nbytes = 1024, 32768
    with Cache.open(cache_dir / "race.mmc", make_fields(nbytes), length) as cache:
        indices = list(range(length))
        pipes, children = [], []
        for tag in (1, 2):
            parent_end, child_end = FORK.Pipe()
            child = FORK.Process(target=_fork_child_puts, args=(cache, indices, tag, child_end))
            child.start()
            pipes.append(parent_end)
            children.append(child)
        mine = [i for i in indices if cache.put(i, {"data": sample_data(i, 0, nbytes), "tag": 0})]
        theirs = [pipe.recv() for pipe in pipes]
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        winners: dict[int, int] = {}
        for tag, won in enumerate([mine, *theirs]):
            for i in won:
                assert i not in winners, f"slot {i} won by both tag {winners[i]} and tag {tag}"
                winners[i] = tag
        assert sorted(winners) == indices
        assert sum(1 for w in winners.values() if w != 0) > 0, "the children never won a slot: no race happened"
        batch = cache.get_many(indices)
        for i in indices:
            assert int(batch["tag"][i]) == winners[i]
            assert check_sample(i, batch["data"][i], winners[i])


def _fork_child_fills_forever(cache: Cache, conn: multiprocessing.connection.Connection) -> None:
    nbytes = cache.fields["data"].fixed_shape[0]
    conn.send("started")
    for i in range(cache.capacity):
        cache.put(i, {"data": sample_data(i, 1, nbytes), "tag": 1})
    conn.send("done")
    time.sleep(60)


@pytest.mark.timeout(120)
def test_killed_fork_child_leaves_its_slot_reclaimable_by_others(cache_dir: Path) -> None:
    """A fork child killed mid-put must not keep a claim alive through the parent's descriptor."""
    nbytes, length = 1 << 20, 96
    path = cache_dir / "forkkill.mmc"
    other = Worker()
    try:
        stuck: list[int] = []
        with Cache.open(path, make_fields(nbytes), length) as cache:
            for attempt in range(20):
                cache.clear()
                parent_end, child_end = FORK.Pipe()
                child = FORK.Process(target=_fork_child_fills_forever, args=(cache, child_end))
                child.start()
                assert parent_end.recv() == "started"
                time.sleep(random.Random(attempt).uniform(0.002, 0.03))
                os.kill(child.pid or 0, signal.SIGKILL)
                child.join(10)
                stuck = [p.index for p in cache.verify() if p.kind == "stuck" and p.index is not None]
                if stuck:
                    break
            assert stuck, "no kill landed while the child was writing a slot"
            # Another process (which shares no descriptor with us) can refill it while we keep ours open.
            other.call("open", str(path), None, None, {})
            assert other.call("put", stuck, 7) == [True]
            assert check_sample(stuck[0], cache[stuck[0]]["data"], 7)
            assert cache.verify() == []
    finally:
        other.stop()


@pytest.mark.timeout(120)
def test_verify_while_writers_fill_finds_nothing_and_loses_nothing(cache_dir: Path) -> None:
    """verify() / verify(fix=True) racing live writers: no writer died, so any finding is a false alarm.

    Regression: a slot WRITING in verify's snapshot whose live writer published
    and let go before the lock probe was reported "stuck", and fix=True then
    reset that good, READY slot to EMPTY (found by this test: ~100 false
    findings and a few lost slots in 8 s).
    """
    nbytes, length = 16384, 256
    workers = [Worker(), Worker()]
    findings: list[str] = []
    calls = rounds = 0
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline or rounds < 3:
            path = cache_dir / f"verify-{rounds}.mmc"
            with Cache.open(path, make_fields(nbytes), length) as cache:
                for w in workers:
                    w.call("open", str(path), None, None, {})
                workers[0].send("fill", list(range(length)), 1, 1)
                workers[1].send("fill", list(range(length))[::-1], 2, 1)
                for w in workers:
                    w.wait_started()
                while not all(w.conn.poll() for w in workers):
                    findings += [str(p) for p in cache.verify(fix=calls % 2 == 1)]
                    calls += 1
                stored = [set(w.recv()) for w in workers]
                assert stored[0] | stored[1] == set(range(length))
                missing = set(range(length)) - set(np.flatnonzero(cache.contains_many(range(length))).tolist())
                assert not missing, f"verify(fix=True) threw away stored slots {sorted(missing)[:10]}"
                for w in workers:
                    w.call("close")
            mmapcache.remove(path)
            rounds += 1
    finally:
        stop_all(workers)
    assert not findings, f"{len(findings)} false findings in {calls} verify calls, e.g. {findings[:3]}"
    print(f"verify while filling: {rounds} rounds, {calls} verify calls")


# -- crash fuzz -------------------------------------------------------------------


@dataclass
class _CrashStats:
    rounds: int = 0
    kills: int = 0  # writers SIGKILLed before they finished
    mid_slot: int = 0  # kills that left a slot WRITING (the kill landed inside a put)
    finished: int = 0  # writers that finished before their kill time
    refilled: int = 0  # slots the test filled after the kills (killed slots among them)
    window: float = 0.03  # kill times are drawn from [0, window) s after the writers start
    seconds: float = 0.0


def _crash_round(directory: Path, pool: WorkerPool[Worker], rng: random.Random, stats: _CrashStats) -> None:
    """One round: a fresh cache, 3 writers filling it, each SIGKILLed at a random instant mid-fill."""
    nbytes, length, writers = 256 * 1024, 96, 3
    path = directory / f"crash-{stats.rounds}.mmc"
    tags = set(range(1, writers + 1))
    # The test keeps a handle open throughout: recovery must work while others have the cache open.
    parent = Cache.open(path, make_fields(nbytes), length)
    workers = pool.take(writers)
    try:
        for w in workers:
            w.call("open", str(path), None, None, {})
        for tag, w in enumerate(workers, 1):
            order = list(range(length))
            rng.shuffle(order)
            w.send("fill", order, tag, rng.choice((1, 1, 4)))
        for w in workers:
            w.wait_started()
        start = time.monotonic()
        # Three writers fill 96 slots of 256 KiB in about 20-40 ms here; kill
        # times spread over that window, so most kills land mid-fill. The
        # window shrinks when writers finish first (a faster machine).
        for when, w in sorted(((start + rng.uniform(0.0, stats.window), w) for w in workers), key=lambda p: p[0]):
            sleep_until(when)
            if w.conn.poll():
                stats.finished += 1
                stats.window *= 0.8
            else:
                stats.kills += 1
            w.sigkill()  # at its instant: reaping it first would delay the next writer's kill by ~1 ms
        for w in workers:
            w.kill()
    finally:
        stop_all(workers)

    try:
        problems = parent.verify()
        assert all(p.kind == "stuck" for p in problems), [str(p) for p in problems]
        stuck = sorted(p.index for p in problems if p.index is not None)
        # A writer fills one slot at a time, so each death leaves at most one slot WRITING.
        assert len(stuck) <= writers
        stats.mid_slot += len(stuck)
        ready = _check_every_ready_slot(parent, tags)
        assert not set(stuck) & set(ready.tolist())
        # The next open succeeds and sees the same slots.
        with Cache.open(path, make_fields(nbytes), length) as again:
            assert again.filled == len(ready)
            todo = [i for i in range(length) if i not in set(ready.tolist())]
            # Killed slots refill without any repair step: a WRITING slot whose claim the kernel dropped is free.
            stored = again.put_many(todo, make_batch(todo, 9, nbytes))
            assert stored.all(), f"slots {np.asarray(todo)[~stored].tolist()} could not be refilled"
            stats.refilled += len(todo)
        assert parent.filled == length
        assert parent.verify() == []
        _check_every_ready_slot(parent, {*tags, 9})
    finally:
        parent.close()
    # The killed writers hold nothing: the cache can be removed right away.
    mmapcache.remove(path)
    assert not path.exists()
    stats.rounds += 1


def _crash_fuzz(directory: Path, min_kills: int, seed: int) -> _CrashStats:
    rng, stats, pool = random.Random(seed), _CrashStats(), WorkerPool(Worker)
    # A good number of kills must land inside a single put. Which share of them does depends on the
    # load of the machine, so the rounds go on until enough did, rather than asking a share of a fixed
    # number of kills (a threshold that failed at load average 10).
    mid_put = max(1, min_kills // 5)
    start = time.monotonic()
    try:
        while stats.kills < min_kills or stats.mid_slot < mid_put:
            assert stats.rounds < 20 * min_kills, f"too few kills landed mid-fill or inside a put: {stats}"
            _crash_round(directory, pool, rng, stats)
    finally:
        pool.close()
    stats.seconds = time.monotonic() - start
    # Most kills must land while the writers were writing (the kill window shrinks when one finished first).
    assert stats.kills >= 2 * stats.finished, stats
    print(f"crash fuzz: {stats}")
    return stats


@pytest.mark.timeout(900)
def test_crash_fuzz_writers_killed_mid_fill(cache_dir: Path) -> None:
    """>= 60 writers SIGKILLed at random instants mid-fill; READY stays valid, killed slots refill."""
    _crash_fuzz(cache_dir, min_kills=60, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_crash_fuzz_long(cache_dir: Path) -> None:
    """The long run: >= 1000 kills."""
    _crash_fuzz(cache_dir, min_kills=1000, seed=int(os.environ.get("MMAPCACHE_FUZZ_SEED", "2")))


# -- concurrent creators ----------------------------------------------------------


@pytest.mark.timeout(900)
def test_concurrent_creators_released_by_a_barrier(cache_dir: Path) -> None:
    """16 spawned processes open-or-create one path at the same instant, several rounds."""
    n = 16
    barrier = SPAWN.Barrier(n)
    workers = [Worker(barrier=barrier) for _ in range(n)]
    pids = {w.pid for w in workers}
    # (file name, nbytes per sample, length): a small file, the same name
    # again after removing it, and a 256 MiB file whose fallocate the other
    # creators must wait out.
    rounds = [("a.mmc", 64, 100), ("a.mmc", 64, 100), ("big.mmc", 1 << 20, 256), ("c.mmc", 4096, 64)]
    try:
        for number, (name, nbytes, length) in enumerate(rounds):
            path = cache_dir / name
            for k, w in enumerate(workers):
                # Different capacities: only the creator's counts, and everyone must agree on it.
                w.send("race_open", str(path), nbytes, length, length - (k % 4))
            results = [w.recv(timeout=120) for w in workers]
            inodes = {r["ino"] for r in results}
            assert inodes == {os.stat(path).st_ino}, f"round {number}: processes ended on different files"
            created = [w.pid for w, r in zip(workers, results, strict=True) if _logged_creation(r["logs"])]
            assert len(created) == 1, f"round {number}: {len(created)} processes created the file"
            assert {r["creator"] for r in results} == {created[0]}
            assert created[0] in pids
            assert len({r["capacity"] for r in results}) == 1
            logs = [m for r in results for m in r["logs"]]
            assert not [m for m in logs if "appeared while" in m], "two creators allocated a file"
            # They all share one mapping: each one's write is seen by all.
            for k, w in enumerate(workers):
                assert w.call("put", [k], k + 1) == [True]
            assert {w.call("filled") for w in workers} == {n}
            for w in workers:
                w.call("close")
            assert not [p for p in os.listdir(cache_dir) if ".tmp-" in p], "a temp file was left behind"
            if number == 0 or name == "big.mmc":
                mmapcache.remove(path)  # the next round with this name creates it again
    finally:
        stop_all(workers)
    assert sorted(os.listdir(cache_dir)) == ["a.mmc", "a.mmc.lock", "c.mmc", "c.mmc.lock"]


@pytest.mark.timeout(120)
def test_remove_racing_openers_and_creators(cache_dir: Path) -> None:
    """One process removes the cache whenever nobody has it open; three open-or-create it in a loop.

    remove() deletes the lock file too, while holding it: a creator that was
    waiting on the deleted inode must not create a second file next to one
    created under the new lock file (filelock retries on st_nlink == 0).
    """
    path = cache_dir / "churn.mmc"
    workers = [Worker() for _ in range(4)]
    try:
        for k, w in enumerate(workers):
            w.send("churn", str(path), 4096, 32, 5.0, k == 0)
        for w in workers:
            w.wait_started()
        results = [w.recv(timeout=60) for w in workers]
    finally:
        stop_all(workers)
    remover, openers = results[0], results[1:]
    logs = [m for r in results for m in r["logs"]]
    assert not [m for m in logs if "appeared while" in m], "two creators made a file for one name"
    created = sum(1 for m in logs if m.startswith("created "))
    # At least two remove-then-create cycles raced the openers (a loaded machine removes less often).
    assert remover["counts"]["removed"] >= 2, remover["counts"]
    assert remover["counts"]["refused"] > 0, remover["counts"]
    # Each removal was followed by at most one creation (the last may not be).
    assert remover["counts"]["removed"] <= created <= remover["counts"]["removed"] + 1
    for r in openers:
        assert r["mismatches"] == []
        assert r["counts"]["opened"] > 10
    assert not [n for n in os.listdir(cache_dir) if ".tmp-" in n]


def _logged_creation(logs: list[str]) -> bool:
    return any(message.startswith("created ") for message in logs)


def _wait_for_temp(directory: Path, deadline: float) -> str | None:
    while time.monotonic() < deadline:
        temps = [n for n in os.listdir(directory) if ".tmp-" in n]
        if temps:
            return temps[0]
        time.sleep(0.0005)
    return None


@pytest.mark.timeout(120)
def test_creator_killed_during_fallocate_leaves_nothing_visible(cache_dir: Path) -> None:
    """A creator SIGKILLed while preallocating 1 GiB: no file, no stuck lock, the temp file is cleaned."""
    free = shutil.disk_usage(cache_dir).free
    if free < 3 << 29:
        pytest.skip(f"needs 1.5 GiB free in {cache_dir}, it has {free >> 20} MiB")
    path = cache_dir / "big.mmc"
    creator = Worker()
    try:
        creator.send("open", str(path), 1 << 20, 1024, {})  # 1 GiB: fallocate takes ~0.3 s here
        temp = _wait_for_temp(cache_dir, time.monotonic() + 30)
        assert temp is not None, "the creator never made its temp file"
        time.sleep(0.02)
        creator.kill()
    finally:
        creator.stop()
    assert not path.exists(), "a half-made cache file became visible"
    assert temp in os.listdir(cache_dir), "the kill did not land mid-creation"
    # No stuck lock: the next creator gets it at once, removes the temp file and creates the file.
    start = time.monotonic()
    with Cache.open(path, make_fields(64), 10, timeout=5) as cache:
        assert cache.put(3, {"data": sample_data(3, 1, 64), "tag": 1})
    assert time.monotonic() - start < 5
    assert sorted(os.listdir(cache_dir)) == ["big.mmc", "big.mmc.lock"]


@pytest.mark.timeout(180)
def test_creators_killed_at_random_instants(cache_dir: Path) -> None:
    """Creators of a 64 MiB file killed at random points of creation: the name is missing or complete."""
    rng = random.Random(3)
    outcomes = {"missing": 0, "complete": 0}
    pool = WorkerPool(Worker)
    try:
        for attempt in range(12):
            path = cache_dir / f"k{attempt}.mmc"
            (creator,) = pool.take(1)
            creator.send("open", str(path), 1 << 20, 64, {})
            temp = _wait_for_temp(cache_dir, time.monotonic() + 30)
            time.sleep(rng.uniform(0, 0.04))
            creator.kill()
            if path.exists():
                outcomes["complete"] += 1
                with Cache.open(path, readonly=True) as cache:  # whatever is visible is a whole, valid file
                    assert cache.capacity == 64
                    assert cache.filled == 0
            else:
                outcomes["missing"] += 1
                assert temp is not None
            with Cache.open(path, make_fields(1 << 20), 64, timeout=5) as cache:
                assert cache.verify() == []
            # The temp file may outlive a kill between link and unlink; removing the cache removes it.
            mmapcache.remove(path)
            assert not [n for n in os.listdir(cache_dir) if n.startswith(path.name + ".tmp-")]
    finally:
        pool.close()
    assert outcomes["missing"] > 0, outcomes


# -- in use -----------------------------------------------------------------------


@pytest.fixture
def holder() -> Iterator[Worker]:
    worker = Worker()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.mark.timeout(60)
def test_remove_and_clear_refused_while_another_process_holds_the_cache(cache_dir: Path, holder: Worker) -> None:
    path = cache_dir / "held.mmc"
    with Cache.open(path, make_fields(64), 10) as cache:
        cache.put(1, {"data": sample_data(1, 1, 64), "tag": 1})
    assert not mmapcache.in_use(path)
    holder.call("open", str(path), None, None, {})
    assert mmapcache.in_use(path)
    with pytest.raises(CacheInUseError) as error:
        mmapcache.remove(path)
    assert holder.pid in error.value.pids
    assert path.exists()
    with Cache.open(path) as cache:
        with pytest.raises(CacheInUseError):
            cache.clear()
        assert cache.filled == 1
        # The failed clear must not have dropped this handle's own shared lock.
        holder.call("close")
        assert mmapcache.in_use(path)
        assert holder.call("in_use", str(path))
        with pytest.raises(CacheInUseError):
            holder.call("remove", str(path), False)
        cache.clear()  # alone now
        assert cache.filled == 0
    assert not mmapcache.in_use(path)
    mmapcache.remove(path)
    assert os.listdir(cache_dir) == []


@pytest.mark.timeout(60)
def test_sigkilled_holder_releases_the_cache(cache_dir: Path, holder: Worker) -> None:
    path = cache_dir / "killed.mmc"
    Cache.open(path, make_fields(1 << 20), 64).close()
    holder.call("open", str(path), None, None, {})
    holder.send("kill_me_in_put_many", list(range(64)), 1)
    holder.wait_started()
    time.sleep(0.005)
    with Cache.open(path) as cache:
        with pytest.raises(CacheInUseError):
            cache.clear()
        holder.kill()
        cache.clear()  # allowed once the holder is dead: the kernel dropped its lock
        assert cache.filled == 0
        assert cache.verify() == []
    assert not mmapcache.in_use(path)
    mmapcache.remove(path)
    assert os.listdir(cache_dir) == []


@pytest.mark.timeout(60)
def test_force_remove_while_held(cache_dir: Path, holder: Worker) -> None:
    path = cache_dir / "forced.mmc"
    Cache.open(path, make_fields(64), 10).close()
    holder.call("open", str(path), None, None, {})
    assert holder.call("put", [2], 5) == [True]
    mmapcache.remove(path, force=True)
    assert not path.exists()
    # The holder keeps reading its now-nameless file; a new opener gets a new file.
    assert holder.call("read", [2])[0] == (5, sample_data(2, 5, 64).tobytes())
    with Cache.open(path, make_fields(64), 10) as fresh:
        assert fresh.filled == 0
    holder.call("close")
    mmapcache.remove(path)


def _fork_child_holds(conn: multiprocessing.connection.Connection) -> None:
    conn.send("ready")
    conn.recv()


@pytest.mark.timeout(60)
def test_forked_child_keeps_the_cache_in_use_after_the_parent_closes(cache_dir: Path) -> None:
    path = cache_dir / "forked.mmc"
    cache = Cache.open(path, make_fields(64), 10)
    parent_end, child_end = FORK.Pipe()
    child = FORK.Process(target=_fork_child_holds, args=(child_end,))
    child.start()
    try:
        assert parent_end.recv() == "ready"
        cache.close()
        assert mmapcache.in_use(path)
        with pytest.raises(CacheInUseError):
            mmapcache.remove(path)
    finally:
        parent_end.send("exit")
        child.join(10)
    assert child.exitcode == 0
    assert not mmapcache.in_use(path)
    mmapcache.remove(path)


@pytest.mark.timeout(30)
def test_in_use_of_a_missing_file_raises(cache_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mmapcache.in_use(cache_dir / "missing.mmc")


def _mapped_by_me(path: Path) -> bool:
    """Whether this process still maps the file ``path`` (a removed file reads ``path (deleted)``)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().split(maxsplit=5)[-1].startswith(str(path)) for line in maps if "/" in line)


@pytest.mark.parametrize("shape", [(4,), (None,)], ids=["fixed", "variable"])
def test_close_unmaps_once_nothing_reads_the_mapping(cache_dir: Path, shape: tuple[int | None]) -> None:
    # close() leaves the unmap to the last reference: a closed handle keeps none of its own,
    # so the memory of a removed file is freed while the Cache object still lives.
    path = cache_dir / "c.mmc"
    cache = Cache(path, fields={"x": mmapcache.Field(shape, "float32")}, length=64, max_bytes="4MiB")
    cache.put(0, {"x": np.arange(4, dtype=np.float32)})
    view = cache.views["x"] if shape == (4,) else None
    cache.close()
    mmapcache.remove(path)
    if view is not None:  # an array over the mapping keeps it: reading it stays safe
        assert _mapped_by_me(path)
        assert view[0].tolist() == [0, 1, 2, 3]
        del view
    assert not _mapped_by_me(path)
    assert cache.closed
