"""Single flight (mmapcache/_region/flight.py): each missing sample loaded once per node, real processes and locks."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _flight_procs import (
    FIXED,
    SPAWN,
    VARIABLE,
    FlightDataset,
    hold_then_sleep,
    hold_then_store,
    load_batch,
    loads,
    logged_load,
    sample,
    start,
    truth,
    wait_for_file,
    wrong_rows,
)

from mmapcache import Cache, Claims, Field, Jagged
from mmapcache._region.flight import CHEAP_LOAD, MAX_CHUNK, WAIT_TIMEOUT

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    with Cache.open(tmp_path / "c.mmc", FIXED, 64):
        pass
    return tmp_path / "c.mmc"


def mine_of(cache: Cache) -> Any:
    return cache.usage().processes[os.getpid()]


def results_of(queue: Any, count: int) -> list[dict[str, Any]]:
    return [queue.get(timeout=120) for _ in range(count)]


# -- one load per sample -----------------------------------------------------------------------


def test_two_processes_missing_the_same_indices_load_each_exactly_once(path: Path, procs: list[Any]) -> None:
    log = path.with_name("loads.log")
    barrier, results = SPAWN.Barrier(2), SPAWN.Queue()
    indices = list(range(40))
    for _ in range(2):
        start(procs, load_batch, str(path), indices, str(log), 0.005, barrier, results, {})
    reports = results_of(results, 2)
    assert [r["wrong"] for r in reports] == [[], []]
    assert loads(log) == dict.fromkeys(indices, 1)
    assert sum(r["loaded"] for r in reports) == 40
    assert min(r["loaded"] for r in reports) > 0, "the two processes share the batch"
    with Cache.open(path) as cache:
        total = cache.usage().total
        assert (total.hits, total.misses, total.written) == (40, 40, 40)
        assert cache.filled == 40


def test_variable_and_text_fields_are_loaded_once_and_read_back_exactly(tmp_path: Path, procs: list[Any]) -> None:
    path, log = tmp_path / "v.mmc", tmp_path / "loads.log"
    Cache.open(path, VARIABLE, 30, max_bytes="1MiB").close()
    barrier, results = SPAWN.Barrier(3), SPAWN.Queue()
    indices = list(range(30))
    for _ in range(3):
        start(procs, load_batch, str(path), indices, str(log), 0.003, barrier, results, {"variable": True})
    assert [r["wrong"] for r in results_of(results, 3)] == [[], [], []]
    assert loads(log) == dict.fromkeys(indices, 1)
    with Cache.open(path) as cache:
        batch, loaded = cache.get_or_load_many(indices, logged_load(str(log), 0, variable=True))
        assert not loaded.any()
        assert wrong_rows(batch, indices, variable=True) == []
        assert isinstance(batch["text"][4], str)


def test_a_partly_cached_variable_batch_comes_back_as_one_jagged_per_field(tmp_path: Path) -> None:
    indices = [5, 2, 9, 5, 0, 7]  # 2 and 7 cached, 5 twice, 0 an empty row
    with Cache.open(tmp_path / "v.mmc", VARIABLE, 12, max_bytes="1MiB") as cache:
        cache.put_many(
            [2, 7], {name: [sample(2, variable=True)[name], sample(7, variable=True)[name]] for name in VARIABLE}
        )
        batch, loaded = cache.get_or_load_many(indices, lambda idx: [sample(i, variable=True) for i in idx])
        assert loaded.tolist() == [True, False, True, True, True, False]
        assert isinstance(batch["tokens"], Jagged)
        assert batch["tokens"].present.all()
        assert isinstance(batch["text"], list)
        assert wrong_rows(batch, indices, variable=True) == []
        again, loaded = cache.get_or_load_many(indices, lambda idx: pytest.fail(f"{idx} loaded twice"))
        assert not loaded.any()
        assert again["tokens"] == batch["tokens"]


def test_threads_sharing_one_handle_load_each_sample_once(path: Path) -> None:
    log = path.with_name("loads.log")
    wrong: list[int] = []
    with Cache.open(path) as cache:

        def run() -> None:
            batch, _ = cache.get_or_load_many(range(32), logged_load(str(log), 0.004))
            wrong.extend(wrong_rows(batch, range(32)))

        threads = [threading.Thread(target=run) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert wrong == []
    assert loads(log) == dict.fromkeys(range(32), 1)


def test_overlapping_batches_in_opposite_orders_finish_without_deadlock(path: Path, procs: list[Any]) -> None:
    # Each holds slots from its own end while the other holds from the other end; they meet in the
    # middle, each holding slots the other wants. Neither waits while it holds (the rule), so both
    # finish well inside the wait bound, and nothing is loaded twice.
    log = path.with_name("loads.log")
    barrier, results = SPAWN.Barrier(2), SPAWN.Queue()
    forward = list(range(48))
    options = {"chunk": 4, "timeout": 30.0, "wait": True}
    start(procs, load_batch, str(path), forward, str(log), 0.01, barrier, results, dict(options))
    start(procs, load_batch, str(path), forward[::-1], str(log), 0.01, barrier, results, dict(options))
    reports = results_of(results, 2)
    assert [r["wrong"] for r in reports] == [[], []]
    assert loads(log) == dict.fromkeys(forward, 1)
    assert max(r["seconds"] for r in reports) < 15.0  # a deadlock would sit out the 30 s bound


def test_a_thread_holding_claims_may_not_wait(path: Path) -> None:
    with Cache.open(path) as cache, cache.claim_many([1, 2]) as claims:
        assert claims.indices.tolist() == [1, 2]
        with pytest.raises(RuntimeError, match=r"holds 2 slot.*deadlock"):
            cache.wait_for([3])
        with pytest.raises(RuntimeError, match="may not wait"):
            # The free slot 3 is loaded here; slot 1 is held by this very thread.
            cache.get_or_load_many([3, 1], logged_load(str(path.with_name("l.log")), 0), wait=True)


# -- holders that die, get stuck, or are slow --------------------------------------------------


def test_a_holder_killed_mid_load_leaves_its_slots_to_the_waiter(path: Path, procs: list[Any]) -> None:
    started = path.with_name("started")
    holder = start(procs, hold_then_sleep, str(path), [5, 6, 7], str(started), 120.0)
    wait_for_file(started)
    threading.Timer(0.5, os.kill, (holder.pid, signal.SIGKILL)).start()
    log = path.with_name("loads.log")
    with Cache.open(path) as cache:
        begin = time.monotonic()
        batch, loaded = cache.get_or_load_many([4, 5, 6, 7], logged_load(str(log), 0.001), wait=True, timeout=60)
        waited = time.monotonic() - begin
        assert 0.4 < waited < 10.0
        assert loaded.tolist() == [True, True, True, True]
        assert wrong_rows(batch, [4, 5, 6, 7]) == []
        assert all(i in cache for i in (4, 5, 6, 7))
        assert cache.usage().total.written == 4  # each stored once
    assert loads(log) == {4: 1, 5: 1, 6: 1, 7: 1}


def test_a_stuck_holder_is_waited_for_at_most_timeout_then_the_waiter_loads_itself(
    path: Path, procs: list[Any]
) -> None:
    started = path.with_name("started")
    holder = start(procs, hold_then_sleep, str(path), [9], str(started), 120.0)
    wait_for_file(started)
    with Cache.open(path) as cache:
        begin = time.monotonic()
        batch, loaded = cache.get_or_load_many([9], logged_load(str(path.with_name("l.log")), 0.001), timeout=0.5)
        waited = time.monotonic() - begin
        assert 0.5 <= waited < 5.0
        assert loaded.tolist() == [True]
        assert wrong_rows(batch, [9]) == []
        assert 9 not in cache  # the live holder keeps the slot: nothing is stored twice
        holder.kill()
        holder.join(10)
        assert cache.put(9, sample(9))  # its holder gone, the slot is free again


def test_a_slow_holder_is_waited_for_and_its_sample_read(path: Path, procs: list[Any]) -> None:
    started = path.with_name("started")
    start(procs, hold_then_store, str(path), [3], str(started), 0.5)
    wait_for_file(started)
    log = path.with_name("loads.log")
    with Cache.open(path) as cache:
        batch, loaded = cache.get_or_load_many([3], logged_load(str(log), 0.001), wait=True)
        assert loaded.tolist() == [False]
        assert wrong_rows(batch, [3]) == []
        assert mine_of(cache).hits == 1
    assert loads(log) == {}


def test_cheap_loads_are_loaded_again_rather_than_waited_for(path: Path, procs: list[Any]) -> None:
    started = path.with_name("started")
    start(procs, hold_then_sleep, str(path), [20], str(started), 120.0)
    wait_for_file(started)
    with Cache.open(path) as cache:
        cache.get_or_load_many(range(10), lambda idx: [sample(i) for i in idx])  # measures: microseconds
        mean = cache.mean_load_time
        assert mean is not None
        assert mean < CHEAP_LOAD
        begin = time.monotonic()
        batch, loaded = cache.get_or_load_many([20], lambda idx: [sample(i) for i in idx], timeout=30)
        assert time.monotonic() - begin < 1.0
        assert loaded.tolist() == [True]
        assert wrong_rows(batch, [20]) == []
        begin = time.monotonic()
        cache.get_or_load_many([20], lambda idx: [sample(i) for i in idx], timeout=0.3, wait=True)
        assert time.monotonic() - begin >= 0.3  # wait=True waits all the same


def test_a_batch_mixes_cached_held_and_free_slots(path: Path, procs: list[Any]) -> None:
    with Cache.open(path) as cache:
        for i in (0, 1):
            cache.put(i, sample(i))
    started = path.with_name("started")
    start(procs, hold_then_store, str(path), [2, 3], str(started), 0.4)
    wait_for_file(started)
    log = path.with_name("loads.log")
    indices = [4, 2, 0, 5, 3, 1, 4]
    with Cache.open(path) as cache:
        before = mine_of(cache)
        batch, loaded = cache.get_or_load_many(indices, logged_load(str(log), 0.002), wait=True)
        assert wrong_rows(batch, indices) == []
        assert loaded.tolist() == [True, False, False, True, False, False, True]
        mine = mine_of(cache) - before
        assert (mine.hits, mine.misses, mine.written) == (4, 3, 2)
    assert loads(log) == {4: 1, 5: 1}


# -- errors, modes, fork -----------------------------------------------------------------------


def test_an_error_in_load_lets_go_of_the_slots_and_propagates(path: Path, procs: list[Any]) -> None:
    def failing(indices: list[int]) -> Any:
        raise OSError("the disk went away")

    with Cache.open(path) as cache:
        with pytest.raises(OSError, match="went away"):
            cache.get_or_load_many([1, 2, 3], failing, chunk=3)
        assert cache._holds.holding() == 0
        assert not any(i in cache for i in (1, 2, 3))
        # Another process can hold them at once: the kernel locks are gone too.
        started = path.with_name("started")
        holder = start(procs, hold_then_sleep, str(path), [1, 2, 3], str(started), 0.0)
        wait_for_file(started)
        holder.join(30)
        assert holder.exitcode == 0


def test_a_readonly_cache_loads_its_misses_without_storing(path: Path) -> None:
    with Cache.open(path, readonly=True) as cache:
        batch, loaded = cache.get_or_load_many([1, 2], lambda idx: [sample(i) for i in idx])
        assert loaded.all()
        assert wrong_rows(batch, [1, 2]) == []
        assert cache.filled == 0
        with pytest.raises(Exception, match="readonly"):
            cache.claim_many([1])


def test_a_claim_inherited_over_fork_is_not_used_by_the_child(path: Path) -> None:
    with Cache.open(path) as cache:
        claims = cache.claim_many([3, 4])
        assert claims.indices.tolist() == [3, 4]
        reader, writer = FORK.Pipe(duplex=False)

        def child() -> None:
            report: dict[str, Any] = {}
            try:
                claims.put_many([3], {"x": [sample(3)["x"]], "i": [3]})
            except RuntimeError as error:
                report["put"] = str(error)
            claims.release()  # a no-op here: the parent still holds them
            again = cache.claim_many([3, 4, 5])
            report["claimed"], report["held"] = again.indices.tolist(), again.held.tolist()
            again.release()
            begin = time.monotonic()
            batch, loaded = cache.get_or_load_many([3], lambda idx: [sample(i) for i in idx], timeout=0.3, wait=True)
            report["waited"] = time.monotonic() - begin
            report["loaded"], report["ok"] = loaded.tolist(), wrong_rows(batch, [3]) == []
            report["stored"] = 3 in cache
            writer.send(report)

        proc = FORK.Process(target=child)
        proc.start()
        report = reader.recv() if reader.poll(60) else {}
        proc.join(30)
        assert "taken by process" in report["put"]
        assert report["claimed"] == [5]
        assert report["held"] == [3, 4]
        assert report["waited"] >= 0.3
        assert report["loaded"] == [True]
        assert report["ok"]
        assert not report["stored"]
        with claims:  # the parent's claims survived the child
            assert claims.put_many([3, 4], {"x": [sample(3)["x"], sample(4)["x"]], "i": [3, 4]}).all()
        assert 3 in cache
        assert 4 in cache


def test_claims_store_only_their_own_slots_and_let_go_when_the_block_ends(path: Path) -> None:
    with Cache.open(path) as cache:
        with cache.claim_many([1, 1, 2]) as claims:
            assert isinstance(claims, Claims)
            assert claims.indices.tolist() == [1, 2]
            with pytest.raises(ValueError, match=r"\[7\] are not held"):
                claims.put_many([7], {"x": [sample(7)["x"]], "i": [7]})
            assert claims.put_many([1], {"x": [sample(1)["x"]], "i": [1]}).tolist() == [True]
        assert cache._holds.holding() == 0
        with cache.claim_many([1, 2]) as again:
            assert again.indices.tolist() == [2]  # 1 is cached, 2 free again
        assert cache.wait_for([1], timeout=0).indices.tolist() == []


def test_get_or_load_returns_one_sample_as_get_does(path: Path) -> None:
    with Cache.open(path) as cache:
        got = cache.get_or_load(6, sample)
        assert got["i"].shape == ()
        assert np.array_equal(got["x"], sample(6)["x"])
        assert got.keys() == cache.get(6).keys()
        assert cache.get_or_load(6, lambda i: pytest.fail("cached: no load")) is not None


def test_bad_arguments_say_what_was_wrong(path: Path) -> None:
    with Cache.open(path) as cache:
        load = functools.partial(logged_load(str(path.with_name("l.log")), 0))
        for timeout in (-1, float("inf"), float("nan"), None, True):
            with pytest.raises(ValueError, match="timeout must be"):
                cache.get_or_load_many([1], load, timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="wait must be"):
            cache.get_or_load_many([1], load, wait=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="chunk must be"):
            cache.get_or_load_many([1], load, chunk=0)
        with pytest.raises(TypeError, match="load must be"):
            cache.get_or_load_many([1], None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="returned 1 samples for 2 indices"):
            cache.get_or_load_many([1, 2], lambda idx: [sample(1)], chunk=2)
        with pytest.raises(ValueError, match="fields"):
            cache.get_or_load_many([1], lambda idx: [{"x": sample(1)["x"]}])
        assert cache._holds.holding() == 0
        assert cache.claim_many([1, 2]).indices.tolist() == [1, 2]  # nothing was left held


def test_the_default_wait_bound_is_documented() -> None:
    assert WAIT_TIMEOUT == 10.0
    assert "default 10" in (Cache.get_or_load_many.__doc__ or "")


def test_check_concurrent_access_passes_a_dataset_loading_through_get_or_load_many_with_kills() -> None:
    from mmapcache.testing import check_concurrent_access

    summary = check_concurrent_access(FlightDataset, truth, max_examples=6, kill=True, seed=3)
    assert summary.kills_mid_load > 0


@pytest.mark.slow
def test_check_concurrent_access_passes_get_or_load_many_over_many_examples() -> None:
    from mmapcache.testing import check_concurrent_access

    summary = check_concurrent_access(FlightDataset, truth, processes=4, max_examples=60, kill=True)
    assert summary.kills_mid_load > 0


def test_a_dimension_beyond_the_format_is_refused_by_every_store_path_before_a_slot_is_claimed(
    tmp_path: Path,
) -> None:
    grid = {"v": Field((None, None), "uint8"), "label": Field((), "int64")}
    huge = np.zeros((2**32, 0), np.uint8)  # no bytes, but a dimension a uint32 cannot describe
    small = np.zeros((1, 1), np.uint8)
    with Cache.open(tmp_path / "g.mmc", grid, length=4, max_bytes="1MiB") as cache:
        with pytest.raises(ValueError, match=r"'v'.*4294967296"):
            cache.get_or_load_many([0, 1], lambda idx: [{"v": huge, "label": i} for i in idx])
        with pytest.raises(ValueError, match=r"'v'.*4294967296"):
            cache.get_or_load(2, lambda i: {"v": huge, "label": i})
        with cache.claim_many([3]) as claims, pytest.raises(ValueError, match=r"'v'.*4294967296"):
            claims.put_many([3], {"v": [huge], "label": [3]})
        assert cache._mapped is not None
        assert cache._mapped.slots.states.tolist() == [0, 0, 0, 0], "no slot was claimed, none is left WRITING"
        assert cache.verify() == []
        _, loaded = cache.get_or_load_many([0, 1], lambda idx: [{"v": small, "label": i} for i in idx])
        assert loaded.tolist() == [True, True]
        assert cache.filled == 2


def test_cheap_loads_of_a_large_batch_hold_a_bounded_number_of_slots_at_once(tmp_path: Path) -> None:
    """Every kernel lock call walks the locks held on the file: a batch of cheap loads must not hold thousands."""
    most = []
    with Cache.open(tmp_path / "c.mmc", {"x": Field((4,), "uint8")}, length=3000) as cache:

        def load(idx: list[int]) -> dict[str, Any]:
            most.append(cache._holds.holding())
            return {"x": np.ones((len(idx), 4), np.uint8)}

        _, loaded = cache.get_or_load_many(np.arange(3000), load)
        assert loaded.all()
        assert cache.filled == 3000
    assert max(most) <= MAX_CHUNK == 64, max(most)
