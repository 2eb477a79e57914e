"""Claims held in runs (mmapcache/_region/slots.py, flight.py): consecutive slots share one kernel record lock.

Real processes, real files and the kernel's own record of the locks (/proc/locks).
"""

from __future__ import annotations

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
    hold_then_sleep,
    load_batch,
    loads,
    logged_load,
    sample,
    start,
    wait_for_file,
    wrong_rows,
)

from mmapcache import Cache
from mmapcache._file import SlotLocks

SLOTS = 512


@pytest.fixture
def path(tmp_path: Path) -> Path:
    with Cache.open(tmp_path / "c.mmc", FIXED, SLOTS):
        pass
    return tmp_path / "c.mmc"


def table_of(cache: Cache) -> tuple[int, int]:
    """Where the slot table starts, and the bytes of one slot's record."""
    slots = cache._mapped.slots  # type: ignore[union-attr]
    return slots.lock_offset(0), slots.lock_offset(1) - slots.lock_offset(0)


def slot_lock_entries(path: Path) -> list[tuple[int, int]]:
    """The kernel's record-lock entries on ``path`` inside its slot table: (first byte, last byte) each."""
    with Cache.open(path) as cache:
        base, size = table_of(cache)
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    entries = []
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "->" in parts:  # a blocked waiter, not a lock held
            continue
        if len(parts) >= 8 and parts[1] in ("OFDLCK", "POSIX") and parts[5] == inode:
            first, last = int(parts[6]), int(parts[7])
            if base <= first < base + SLOTS * size:
                entries.append((first, last))
    return sorted(entries)


def batch_of(indices: Any) -> dict[str, Any]:
    rows = [sample(int(i)) for i in indices]
    return {"x": [row["x"] for row in rows], "i": [row["i"] for row in rows]}


def test_claims_of_consecutive_slots_asked_in_any_order_are_one_kernel_lock(path: Path) -> None:
    order = np.random.default_rng(0).permutation(300)
    with Cache.open(path) as cache, cache.claim_many(order) as claims:
        assert sorted(claims.indices.tolist()) == list(range(300))
        assert claims.indices.tolist() == order.tolist()  # in the order asked for
        base, size = table_of(cache)
        assert slot_lock_entries(path) == [(base, base + 300 * size - 1)]
        with Cache.open(path) as other:  # another open file description: every one of them is held
            elsewhere = other.claim_many(range(SLOTS))
            assert elsewhere.held.tolist() == list(range(300))
            assert elsewhere.indices.tolist() == list(range(300, SLOTS))
            elsewhere.release()
        for part in np.array_split(order[:150], 5):  # stored in scattered batches: the lock is not split
            claims.put_many(part, batch_of(part))
            assert slot_lock_entries(path) == [(base, base + 300 * size - 1)]
        assert all(int(i) in cache for i in order[:150])
    assert slot_lock_entries(path) == []


def test_claims_store_only_their_own_slots_and_let_go_of_a_run_once_all_of_it_is_stored(path: Path) -> None:
    with Cache.open(path) as cache:
        base, size = table_of(cache)
        first, second = cache.claim_many(range(10)), cache.claim_many(range(10, 20))
        assert slot_lock_entries(path) == [(base, base + 20 * size - 1)]  # one entry for both
        with pytest.raises(ValueError, match="not held by these claims"):
            first.put_many([12], batch_of([12]))
        first.put_many(range(5), batch_of(range(5)))
        assert slot_lock_entries(path) == [(base, base + 20 * size - 1)]  # 0..4 kept until 5..9 are stored
        with Cache.open(path) as other:
            elsewhere = other.claim_many(range(20))
            assert elsewhere.held.tolist() == list(range(5, 20))  # 0..4 are READY: nobody waits for them
            assert len(elsewhere) == 0
        first.put_many(range(5, 10), batch_of(range(5, 10)))
        assert slot_lock_entries(path) == [(base + 10 * size, base + 20 * size - 1)]
        second.put_many([15], batch_of([15]))
        second.release()  # the unstored ones and the kept one
        assert slot_lock_entries(path) == []
        assert [i for i in range(20) if i in cache] == [*range(10), 15]


def test_runs_partly_held_elsewhere_are_split_around_what_holds_them(path: Path) -> None:
    with Cache.open(path) as cache:
        base, size = table_of(cache)
        fd = os.open(path, os.O_RDWR)
        try:
            theirs = SlotLocks(fd)  # another description, as another process's
            assert theirs.try_claim(base + 10 * size, 10 * size)  # slots 10..19 in one lock
            assert theirs.try_claim(base + 50 * size, 1)  # slot 50's state byte: a one-byte claim
            assert theirs.try_claim(base + 99 * size + 3, 1)  # a byte inside slot 99's record
            with cache.claim_many(range(100)) as claims:
                assert claims.held.tolist() == [*range(10, 20), 50, 99]
                assert claims.indices.tolist() == [i for i in range(100) if not 10 <= i < 20 and i not in (50, 99)]
                for i in (9, 20, 49, 51, 98):  # every slot held here is refused to the other description
                    assert not theirs.try_claim(base + i * size, 1)
        finally:
            os.close(fd)


def test_a_get_or_load_many_of_a_large_batch_keeps_the_lock_list_short(path: Path) -> None:
    seen: list[int] = []

    def load(indices: list[int]) -> dict[str, Any]:
        seen.append(len(slot_lock_entries(path)))
        return batch_of(indices)

    with Cache.open(path) as cache:
        batch, loaded = cache.get_or_load_many(range(SLOTS), load, chunk=64)
        assert loaded.all()
        assert wrong_rows(batch, list(range(SLOTS))) == []
        assert seen == [1] * (SLOTS // 64)  # each chunk of 64 consecutive slots: one entry
        shuffled = np.random.default_rng(1).permutation(SLOTS)
        cache.clear()
        seen.clear()
        batch, loaded = cache.get_or_load_many(shuffled, load, chunk=64)
        assert loaded.all()
        assert wrong_rows(batch, shuffled.tolist()) == []
        assert max(seen) <= 64
    assert slot_lock_entries(path) == []


def test_claims_held_in_runs_are_taken_over_when_the_holder_is_killed(path: Path, procs: list[Any]) -> None:
    started = path.with_name("started")
    held = [*range(100, 200), *range(300, 350)]
    holder = start(procs, hold_then_sleep, str(path), held[::-1], str(started), 120.0)
    wait_for_file(started)
    assert len(slot_lock_entries(path)) == 2  # two runs, two locks
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    assert slot_lock_entries(path) == []  # the kernel dropped them with the process
    with Cache.open(path) as cache, cache.claim_many(range(SLOTS)) as claims:
        assert claims.held.tolist() == []
        assert len(claims) == SLOTS
        claims.put_many(claims.indices, batch_of(claims.indices))
        assert cache.filled == SLOTS


def test_a_loader_killed_mid_load_leaves_its_run_to_a_waiting_process(path: Path, procs: list[Any]) -> None:
    started, log = path.with_name("started"), path.with_name("loads.log")
    indices = list(range(128))
    options = {"chunk": 64, "started": str(started)}
    results = SPAWN.Queue()  # kept alive: the child unpickles it
    start(procs, load_batch, str(path), indices, str(log), 120.0, None, results, options)
    wait_for_file(started)  # it holds 0..63 (one run) and is loading them
    assert len(slot_lock_entries(path)) == 1
    holder = procs[-1]
    threading.Timer(0.5, os.kill, (holder.pid, signal.SIGKILL)).start()
    with Cache.open(path) as cache:
        begin = time.monotonic()
        batch, loaded = cache.get_or_load_many(indices, logged_load(str(log), 0.0), wait=True, timeout=60)
        assert time.monotonic() - begin < 30
        assert loaded.all()
        assert wrong_rows(batch, indices) == []
        assert all(i in cache for i in indices)
        assert cache.usage().total.written == 128
    counts = loads(log)
    assert set(counts) == set(indices)
    assert counts[0] == 2
    assert all(counts[i] == 1 for i in indices[1:])
    assert slot_lock_entries(path) == []
