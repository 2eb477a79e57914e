"""Usage counters in the file: every process counts where everyone sees it, killed ones included."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from _procs import Worker, make_batch, make_fields, stop_all

from mmapcache import Cache, Field
from mmapcache._region.counters import Counts

NBYTES = 64


def test_counts_land_in_the_record_the_spec_describes(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as cache:
        cache.put_many([0, 1, 2], {"x": np.ones((3, 4), np.uint8)})
        cache.get(0), cache.get(7), cache.get_many([1, 2])
        layout = cache._layout
        raw = path.read_bytes()
        record = struct.unpack_from("<4Q", raw, layout.counters_offset + 32)  # the first owner takes record 1
        assert record == (os.getpid(), 3, 1, 3)
        assert struct.unpack_from("<4Q", raw, layout.counters_offset) == (0, 0, 0, 0)
    # On close the counts move to record 0, which keeps the sums of owners that are gone.
    raw = path.read_bytes()
    assert struct.unpack_from("<4Q", raw, layout.counters_offset)[1:] == (3, 1, 3)
    assert struct.unpack_from("<4Q", raw, layout.counters_offset + 32)[1:] == (0, 0, 0)


def test_every_process_counts_into_the_file_and_the_dead_keep_their_counts(cache_dir: Path) -> None:
    path = str(cache_dir / "c.mmc")
    workers = [Worker() for _ in range(3)]
    try:
        for worker in workers:
            worker.call("open", path, NBYTES, 64, {})
        workers[0].call("put_many", list(range(32)), 1)
        workers[1].call("read", list(range(40)))  # 32 hits, 8 misses
        workers[2].call("read_many", list(range(16)))  # 16 hits
        with Cache.open(path) as cache:
            usage = cache.usage()
            assert usage.processes[workers[0].pid] == Counts(0, 0, 32)
            assert usage.processes[workers[1].pid] == Counts(32, 8, 0)
            assert usage.processes[workers[2].pid] == Counts(16, 0, 0)
            assert usage.total == Counts(48, 8, 32)
            assert usage.total.hit_rate == 48 / 56
            workers[1].kill()  # SIGKILL: no chance to hand its counts over
            workers[2].stop()  # a clean exit closes the cache
            usage = cache.usage()
            assert set(usage.processes) == {workers[0].pid, os.getpid()}
            assert usage.total == Counts(48, 8, 32), "the counts of processes that are gone stay in the total"
        # A newcomer reclaims the dead worker's record without losing its counts.
        extra = [Worker() for _ in range(2)]
        workers += extra
        for worker in extra:
            worker.call("open", path, NBYTES, 64, {})
            worker.call("read", [0])
        with Cache.open(path) as cache:
            assert cache.usage().total == Counts(50, 8, 32)
    finally:
        stop_all(workers)


def test_a_forked_child_counts_in_a_record_of_its_own(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", make_fields(NBYTES), length=16) as cache:
        cache.put_many([0, 1], make_batch([0, 1], 1, NBYTES))
        cache.get(0)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            ok = cache.usage().processes[os.getpid()] == Counts()
            cache.get(1), cache.get(1), cache.get(5)
            ok = ok and cache.usage().processes[os.getpid()] == Counts(2, 1, 0)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        usage = cache.usage()
        assert usage.processes == {os.getpid(): Counts(1, 0, 2)}
        assert usage.total == Counts(3, 1, 2)


def test_a_readonly_handle_counts_in_its_process_only(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, make_fields(NBYTES), length=16) as writer:
        writer.put_many([0], make_batch([0], 1, NBYTES))
    with Cache.open(path, readonly=True) as reader:
        reader.get(0), reader.get(1)
        usage = reader.usage()
        assert usage.processes[os.getpid()] == Counts(1, 1, 0)
        assert usage.total == Counts(1, 1, 1)
    with Cache.open(path) as again:
        assert again.usage().total == Counts(0, 0, 1)


def test_count_adds_reads_served_through_views(cache_dir: Path) -> None:
    with Cache.open(cache_dir / "c.mmc", {"x": Field((2,), "u1")}, length=4) as cache:
        cache.count(hits=5, misses=2)
        assert cache.usage().processes[os.getpid()] == Counts(5, 2, 0)
        assert Counts(5, 2, 0).to_dict() == {"hits": 5, "misses": 2, "written": 0, "hit_rate": 5 / 7}
        assert Counts().hit_rate is None


def test_a_handle_beyond_the_last_record_adds_its_counts_to_the_totals_when_it_closes(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as first:
        first.put(0, {"x": [1] * 4})
        others = [Cache.open(path) for _ in range(first._layout.counter_records - 2)]  # every record taken
        try:
            extra = Cache.open(path)
            assert not extra._board.shared, "no record left for it"
            extra.get(0), extra.get(5), extra.get(6)
            assert extra.usage().total == Counts(1, 2, 1), "it sees its own counts in the totals"
            extra.close()
            assert first.usage().total == Counts(1, 2, 1), "its counts joined the totals when it closed"
        finally:
            for other in others:
                other.close()
