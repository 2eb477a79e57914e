"""A Hypothesis state machine driving several real processes that share one cache, at the protocol level.

The user-level property -- every sample a dataset over the cache returns,
whatever its processes do, equals the truth -- is checked by
``mmapcache.testing.check_concurrent_access``: the last tests here run it on
a dataset over ``Cache``, tests/testing/test_testing.py on ``CachedDataset``. This machine checks what
only the protocol can tell, with a model of which writer won each slot:

three spawned worker processes (see ``_procs.py``) open, fill, read, verify,
clear, close and reopen one cache file while Hypothesis picks the operations;
some rules make two workers write the same slots at the same instant, and
some SIGKILL a worker -- idle, or in the middle of a ``put_many``. The test
keeps a model: which slots are READY and which writer tag won each. After
every step the invariants check, from the test process (a third party to
every write), that

* exactly the model's slots are READY, and each reads back exactly the bytes
  its winning ``put`` stored (no torn, lost or phantom samples);
* ``filled`` agrees, and ``mmapcache.in_use`` is true exactly while some
  worker has the cache open.

A killed writer may leave the slot it was writing not READY; that slot must
then be refilled by the next ``put`` with no repair step, and ``verify``
may report it only as "stuck".
"""

from __future__ import annotations

import collections
import itertools
import os
import time
from pathlib import Path
from typing import Any

import pytest
from _procs import Worker, sample_data, stop_all
from _testing_caches import CacheBacked, cache_sample
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import mmapcache
from mmapcache import Cache, CacheInUseError
from mmapcache.testing import check_concurrent_access

NBYTES = 256 * 1024
LENGTH, CAPACITY = 24, 20  # indices 20..23 are valid but never cacheable
WORKERS = 3

_names = itertools.count()
STATS: collections.Counter[str] = collections.Counter()  # what the runs did, for the report

indices = st.integers(0, LENGTH - 1)
index_lists = st.lists(indices, min_size=1, max_size=8)
tags = st.integers(1, 1000)


class SharedCacheMachine(RuleBasedStateMachine):
    """The model: ``ready`` maps each READY slot to the tag of the put that won it."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.path = directory / f"machine-{os.getpid()}-{next(_names)}.mmc"
        self.workers = [Worker() for _ in range(WORKERS)]
        self.opened = [False] * WORKERS
        self.ready: dict[int, int] = {}
        self.maybe_stuck: set[int] = set()  # not READY; a killed writer may have left them WRITING
        self.exists = False

    # -- helpers --------------------------------------------------------------

    def _open_ones(self) -> list[int]:
        return [w for w in range(WORKERS) if self.opened[w]]

    def _closed_ones(self) -> list[int]:
        return [w for w in range(WORKERS) if not self.opened[w]]

    def _expected_put(self, batch: list[int]) -> list[bool]:
        """What put_many (or a run of puts) must return: True for the first put of each new cacheable slot."""
        seen: set[int] = set()
        out = []
        for i in batch:
            out.append(i < CAPACITY and i not in self.ready and i not in seen)
            seen.add(i)
        return out

    def _won(self, batch: list[int], stored: list[bool], tag: int) -> None:
        for i, won in zip(batch, stored, strict=True):
            if won:
                self.ready[i] = tag
                self.maybe_stuck.discard(i)

    def _check_sample(self, index: int, got: tuple[int, bytes] | None) -> None:
        if index not in self.ready:
            assert got is None, f"slot {index} reads as cached, but no put of it succeeded"
            return
        assert got is not None, f"slot {index} was stored (tag {self.ready[index]}) but reads as missing"
        tag, data = got
        assert tag == self.ready[index], f"slot {index} holds tag {tag}, the winning put had {self.ready[index]}"
        assert data == sample_data(index, tag, NBYTES).tobytes(), f"slot {index} holds torn or wrong bytes"

    def _replace(self, w: int) -> None:
        self.workers[w].kill()
        self.workers[w] = Worker()
        self.opened[w] = False

    # -- rules ----------------------------------------------------------------

    @initialize()
    def open_all(self) -> None:
        """Start with every worker holding the cache (the first one creates it)."""
        for w, worker in enumerate(self.workers):
            assert worker.call("open", str(self.path), NBYTES, LENGTH, {"capacity": CAPACITY}) == CAPACITY
            self.opened[w] = True
        self.exists = True

    @precondition(lambda self: not all(self.opened))
    @rule(data=st.data(), verify=st.booleans(), with_schema=st.booleans())
    def open(self, data: st.DataObject, verify: bool, with_schema: bool) -> None:
        STATS["open"] += 1
        w = data.draw(st.sampled_from(self._closed_ones()), label="worker")
        schema = with_schema or not self.exists  # the first open creates the file
        kwargs: dict[str, Any] = {"verify": verify}
        if schema:
            kwargs["capacity"] = CAPACITY
        capacity = self.workers[w].call(
            "open", str(self.path), NBYTES if schema else None, LENGTH if schema else None, kwargs
        )
        assert capacity == CAPACITY
        self.opened[w] = True
        self.exists = True

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        STATS["close"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        self.workers[w].call("close")
        self.opened[w] = False

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), verify=st.booleans())
    def reopen(self, data: st.DataObject, verify: bool) -> None:
        STATS["reopen"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        self.workers[w].call("close")
        assert self.workers[w].call("open", str(self.path), None, None, {"verify": verify}) == CAPACITY

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), batch=index_lists, tag=tags)
    def put(self, data: st.DataObject, batch: list[int], tag: int) -> None:
        STATS["put"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        stored = self.workers[w].call("put", batch, tag)
        assert stored == self._expected_put(batch)
        self._won(batch, stored, tag)

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), batch=index_lists, tag=tags)
    def put_many(self, data: st.DataObject, batch: list[int], tag: int) -> None:
        STATS["put_many"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        stored = self.workers[w].call("put_many", batch, tag)
        assert stored == self._expected_put(batch)
        self._won(batch, stored, tag)

    @precondition(lambda self: sum(self.opened) >= 2)
    @rule(data=st.data(), batch=st.lists(indices, min_size=1, max_size=16), tag=tags)
    def race(self, data: st.DataObject, batch: list[int], tag: int) -> None:
        """Two workers put_many the same slots at the same time: exactly one put wins each new slot."""
        STATS["race"] += 1
        first, second = data.draw(st.permutations(self._open_ones()), label="workers")[:2]
        tag2 = tag + 1000
        self.workers[first].send("put_many", batch, tag)
        self.workers[second].send("put_many", batch, tag2)
        got1, got2 = self.workers[first].recv(), self.workers[second].recv()
        for i in set(batch):
            wins = sum(won for j, won in zip(batch, got1, strict=True) if j == i) + sum(
                won for j, won in zip(batch, got2, strict=True) if j == i
            )
            fresh = i < CAPACITY and i not in self.ready
            assert wins == (1 if fresh else 0), f"slot {i}: {wins} puts won it"
        self._won(batch, got1, tag)
        self._won(batch, got2, tag2)

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), batch=index_lists)
    def get(self, data: st.DataObject, batch: list[int]) -> None:
        STATS["get"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        for i, got in zip(batch, self.workers[w].call("read", batch), strict=True):
            self._check_sample(i, got)

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), batch=index_lists)
    def get_many(self, data: st.DataObject, batch: list[int]) -> None:
        STATS["get_many"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        status, value = self.workers[w].call("read_many", batch)
        missing = sorted(i for i in batch if i not in self.ready)  # KeyError.missing keeps repeats
        if missing:
            assert (status, value) == ("missing", missing)
        else:
            assert status == "ok"
            for i, got in zip(batch, value, strict=True):
                self._check_sample(i, got)

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        """SIGKILL a worker that has the cache open, between operations; a fresh one takes its place."""
        STATS["kill"] += 1
        self._replace(data.draw(st.sampled_from(self._open_ones()), label="worker"))

    @precondition(lambda self: any(self.opened))
    @rule(
        data=st.data(),
        batch=st.lists(st.integers(0, CAPACITY - 1), min_size=4, max_size=16, unique=True),
        tag=tags,
        delay=st.floats(0, 0.002),
    )
    def kill_during_put_many(self, data: st.DataObject, batch: list[int], tag: int, delay: float) -> None:
        """SIGKILL a worker ``delay`` seconds into a put_many; then see what it left."""
        STATS["kill_during_put_many"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        worker = self.workers[w]
        worker.send("kill_me_in_put_many", batch, tag)
        worker.wait_started()
        time.sleep(delay)
        self._replace(w)
        # Each slot of the batch is now READY with this put's bytes, or not READY.
        with Cache.open(self.path, readonly=True) as cache:
            for i in batch:
                if i in self.ready:
                    continue
                sample = cache.get(i)
                if sample is None:
                    self.maybe_stuck.add(i)
                    STATS["slots left unfilled by a killed put_many"] += 1
                else:
                    assert int(sample["tag"]) == tag
                    assert sample["data"].tobytes() == sample_data(i, tag, NBYTES).tobytes()
                    self.ready[i] = tag

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data(), fix=st.booleans())
    def verify(self, data: st.DataObject, fix: bool) -> None:
        STATS["verify"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        for kind, index, fixed in self.workers[w].call("verify", fix):
            assert kind == "stuck", (kind, index)
            assert index in self.maybe_stuck, f"slot {index} reported stuck, but no writer died writing it"
            assert fixed == fix
            STATS["stuck slots verify found"] += 1
            if fix:
                self.maybe_stuck.discard(index)

    @precondition(lambda self: any(self.opened))
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        """clear() succeeds only while no other process has the cache open."""
        STATS["clear"] += 1
        w = data.draw(st.sampled_from(self._open_ones()), label="worker")
        if sum(self.opened) == 1:
            self.workers[w].call("clear")
            self.ready.clear()
            self.maybe_stuck.clear()
        else:
            with pytest.raises(CacheInUseError):
                self.workers[w].call("clear")

    # -- invariants -----------------------------------------------------------

    @invariant()
    def ready_slots_read_back_the_model(self) -> None:
        if not self.exists:
            return
        assert mmapcache.in_use(self.path) == any(self.opened)
        with Cache.open(self.path, readonly=True) as cache:
            assert cache.filled == len(self.ready)
            cached = [bool(c) for c in cache.contains_many(range(LENGTH))]
            assert cached == [i in self.ready for i in range(LENGTH)]
            if self.ready:
                order = sorted(self.ready)
                batch = cache.get_many(order)
                for row, i in enumerate(order):
                    self._check_sample(i, (int(batch["tag"][row]), batch["data"][row].tobytes()))

    def teardown(self) -> None:
        stop_all(self.workers)
        if self.path.exists():
            mmapcache.remove(self.path)  # refused (a failure) if a dead worker still counted as a user


RULES = (
    "open",
    "close",
    "reopen",
    "put",
    "put_many",
    "race",
    "get",
    "get_many",
    "kill",
    "kill_during_put_many",
    "verify",
    "clear",
)


def _run(directory: Path, *, examples: int, steps: int) -> None:
    STATS.clear()
    start = time.monotonic()
    run_state_machine_as_test(  # type: ignore[no-untyped-call]  # hypothesis leaves it unannotated
        lambda: SharedCacheMachine(directory),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,  # no .hypothesis directory left behind
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert os.listdir(directory) == []
    print(f"stateful: {time.monotonic() - start:.1f} s, {sum(STATS[r] for r in RULES)} steps: {dict(STATS)}")
    # Every rule ran, and kills landed inside puts.
    assert all(STATS[r] for r in RULES), STATS


@pytest.mark.timeout(300)
def test_processes_sharing_a_cache_match_the_model(cache_dir: Path) -> None:
    _run(cache_dir, examples=12, steps=30)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_processes_sharing_a_cache_match_the_model_long(cache_dir: Path) -> None:
    _run(cache_dir, examples=100, steps=50)


@pytest.mark.timeout(300)
def test_a_dataset_over_the_cache_passes_the_concurrent_access_check() -> None:
    """Loads, races, kills mid-put, reopens, forks and removes through ``get_many``/``put_many``."""
    summary = check_concurrent_access(CacheBacked, cache_sample)
    print(f"dataset over Cache: {summary}")
    assert summary.kills
    assert summary.races
    assert summary.removes


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_dataset_over_the_cache_passes_a_long_concurrent_access_check() -> None:
    summary = check_concurrent_access(CacheBacked, cache_sample, max_examples=500, processes=4)
    print(f"dataset over Cache, long: {summary}")
