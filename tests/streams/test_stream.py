"""The cache of a stream (format version 8): each element stored once, whatever the processes, kills and runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mmapcache import Cache, CacheInUseError, Field, SchemaMismatchError, StaleCacheError
from mmapcache._file import variable_room
from mmapcache._format import align
from mmapcache._format.spec import FORMAT_VERSION
from mmapcache._region import place
from mmapcache._streams.stream_cache import (
    Partition,
    PartitionWriter,
    checked_records,
    epoch_slots,
    open_stream,
    plan_stream,
    region,
    stream_status,
)

sys.path.insert(0, str(Path(__file__).parents[1]))
from _stream_procs import FIELDS, KEY, element, plan

SCRIPT = Path(__file__).parents[1] / "_stream_procs.py"


def _start(path: Path, partition: Partition, length: int, *extra: str) -> subprocess.Popen[str]:
    args = [str(path), *map(str, (partition.rank, partition.ranks, partition.worker, partition.workers, length))]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _run(path: Path, partition: Partition, length: int, *extra: str) -> dict[str, int]:
    process = _start(path, partition, length, *extra)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return {line.split()[0]: int(line.split()[1]) for line in out.splitlines()}


def _killed(path: Path, partition: Partition, length: int, *extra: str) -> None:
    process = _start(path, partition, length, *extra)
    _, err = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL, err


def _open(path: Path, partition: Partition | None = None) -> Cache:
    partition = partition or Partition()
    cache = open_stream(path, key=KEY, fields=FIELDS, partition=partition, plan=None)
    assert cache is not None
    return cache


def _elements(cache: Cache) -> list[tuple[int, int]]:
    """(partition, element) of every stored element, read from its slot, checked against the stream."""
    found = []
    for slot in checked_records(cache):
        sample = cache[int(slot)]
        p, j = int(sample["value"][0]), int(sample["value"][1])
        expected = element(p, j)
        np.testing.assert_array_equal(sample["value"], expected["value"])
        np.testing.assert_array_equal(sample["tokens"], expected["tokens"])
        found.append((p, j))
    return found


def _whole(partitions: int, length: int) -> list[tuple[int, int]]:
    return [(p, j) for p in range(partitions) for j in range(length)]


def test_a_single_pass_stores_every_element_once_and_completes_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    assert _run(path, Partition(), 50) == {"stored": 50, "ended": 1}
    with _open(path) as cache:
        status = stream_status(cache)
        assert (status.complete, status.cached, status.full) == (True, True, False)
        assert (status.stored, status.total, status.partitions_ended) == (50, 50, 1)
        assert _elements(cache) == _whole(1, 50)  # canonical order: by partition, then element


def test_the_file_is_format_version_8_and_records_the_partitioning(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _run(path, Partition(1, 2, 0, 3), 5)
    with _open(path, Partition(1, 2, 0, 3)) as cache:
        assert cache._header.version == FORMAT_VERSION == 8
        assert cache._header.stream == (2, 3)
        assert stream_status(cache).partitions_ended == 1  # one of six partitions was read
        assert not stream_status(cache).complete


def test_every_partition_of_a_job_stores_its_own_elements_and_the_last_one_completes_the_cache(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.mmc"
    partitions = [Partition(rank, 2, worker, 2) for rank in range(2) for worker in range(2)]
    processes = [_start(path, partition, 40) for partition in partitions]
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
    with _open(path, partitions[0]) as cache:
        assert stream_status(cache).cached
        assert _elements(cache) == _whole(4, 40)


def test_two_jobs_streaming_the_same_partition_at_once_store_each_element_once(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    jobs = [_start(path, Partition(), 300, "--pause", "0.001") for _ in range(3)]
    outputs = []
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        outputs.append(out)
    stored = [int(out.split()[1]) for out in outputs]
    assert sum(stored) == 300  # between them, not each
    with _open(path) as cache:
        assert stream_status(cache).cached
        assert _elements(cache) == _whole(1, 300)


def test_a_run_killed_mid_fill_leaves_an_incomplete_cache_that_the_next_run_continues(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    process = _start(path, Partition(), 10_000, "--pause", "0.002")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists():
            with _open(path) as cache:
                if stream_status(cache).stored >= 20:
                    break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    with _open(path) as cache:
        status = stream_status(cache)
        assert not status.complete
        assert status.total is None
        assert 20 <= status.stored < 10_000
        already = status.stored
    result = _run(path, Partition(), 10_000)  # no stale lock: the kernel dropped the dead writer's
    assert result == {"stored": 10_000 - already, "ended": 1}
    with _open(path) as cache:
        assert _elements(cache) == _whole(1, 10_000)


@pytest.mark.parametrize("moment", ["before-store", "after-publish", "after-count"])
def test_a_writer_killed_at_any_step_of_storing_an_element_leaves_it_stored_exactly_once(
    tmp_path: Path, moment: str
) -> None:
    path = tmp_path / "s.mmc"
    _killed(path, Partition(), 30, "--die", moment, "12")
    with _open(path) as cache:
        status = stream_status(cache)
        assert not status.complete
        counted = 13 if moment == "after-count" else 12
        assert status.stored == counted
    _run(path, Partition(), 30)
    with _open(path) as cache:
        status = stream_status(cache)
        assert status.cached
        assert _elements(cache) == _whole(1, 30)
        stream = region(cache)
        ready = np.count_nonzero(stream.states[: status.slots_used] == 2)
        assert ready == status.stored == 30  # no READY slot outside the count: nothing served twice


def _counted_ready(cache: Cache, slots_used: int) -> int:
    """READY slots that name a partition (a batch killed before counting leaves READY slots that name none)."""
    stream = region(cache)
    ready = stream.states[:slots_used] == 2
    return int(np.count_nonzero(ready & (stream.partition[:slots_used] < len(stream.stored))))


@pytest.mark.parametrize(
    ("moment", "counted", "recovered"),
    [("batch-half-filled", 12, 12), ("batch-filled", 12, 12), ("batch-recording", 12, 12), ("batch-counting", 12, 18)],
)
def test_a_writer_killed_in_the_middle_of_storing_a_batch_leaves_each_element_counted_once(
    tmp_path: Path, moment: str, counted: int, recovered: int
) -> None:
    path = tmp_path / "s.mmc"
    _killed(path, Partition(), 40, "--batch", "6", "--die", moment, "12")  # elements 12-17, one run
    with _open(path) as cache:
        status = stream_status(cache)
        assert not status.complete
        assert status.stored == counted  # a run is counted whole or not at all
        assert [j for _, j in _elements(cache)] == list(range(counted))
    result = _run(path, Partition(), 40, "--batch", "7")  # rolls forward only a run recorded in full
    assert result == {"stored": 40 - recovered, "ended": 1}
    with _open(path) as cache:
        status = stream_status(cache)
        assert status.cached
        assert _elements(cache) == _whole(1, 40)
        assert _counted_ready(cache, status.slots_used) == status.stored == 40  # the killed batch's rest: holes


def test_jobs_with_batches_at_different_offsets_on_one_partition_store_each_element_once(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    first = _run(path, Partition(), 200, "--batch", "16", "--stop", "45")  # gives up in its third batch
    assert first == {"stored": 45}
    jobs = [_start(path, Partition(), 200, "--batch", str(size), "--pause", "0.0005") for size in (5, 7, 11)]
    stored = []
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        stored.append(int(out.split()[1]))
    assert sum(stored) == 200 - 45  # between them, each from where the partition stood when it took it
    with _open(path) as cache:
        status = stream_status(cache)
        assert status.cached
        assert _elements(cache) == _whole(1, 200)
        assert _counted_ready(cache, status.slots_used) == 200


def test_a_complete_cache_is_read_in_a_fresh_permutation_each_epoch_split_evenly_across_ranks_and_workers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.mmc"
    _run(path, Partition(), 103)
    with _open(path, Partition(0, 4, 0, 3)) as cache:  # any partitioning reads a complete cache
        records = checked_records(cache)
        epochs = []
        for epoch in (0, 1):
            shares = [
                epoch_slots(records, epoch=epoch, seed=5, shuffle=True, rank=r, ranks=4, worker=w, workers=3)
                for r in range(4)
                for w in range(3)
            ]
            per_rank = [sum(len(shares[r * 3 + w]) for w in range(3)) for r in range(4)]
            assert per_rank == [26, 26, 26, 26]  # 103 padded to 104: the same count on every rank
            merged = np.concatenate(shares)
            assert set(merged.tolist()) == set(records.tolist())
            epochs.append(np.concatenate([epoch_slots(records, epoch=epoch, seed=5, shuffle=True)]))
        assert not np.array_equal(epochs[0], epochs[1])
        again = epoch_slots(records, epoch=1, seed=5, shuffle=True)
        np.testing.assert_array_equal(again, epochs[1])  # the same in every process
        np.testing.assert_array_equal(epoch_slots(records, epoch=3, seed=5, shuffle=False), records)


def test_a_stream_larger_than_the_file_is_admitted_until_full_then_marked_full(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    partition = Partition()
    small = plan_stream(FIELDS, max_bytes=None, length=100, partitions=1)
    cache = open_stream(path, key=KEY, fields=FIELDS, partition=partition, plan=lambda: small)
    assert cache is not None
    with cache:
        writer = PartitionWriter(cache, partition)
        stored = [writer.offer(j, element(0, j)) for j in range(500)]
        state = writer.finish(500)
        assert (state.ended, state.full, state.total) == (True, True, 500)
        assert stored == [True] * state.stored + [False] * (500 - state.stored)  # a prefix, nothing after
        status = stream_status(cache)
        assert (status.complete, status.full, status.cached) == (True, True, False)
        assert status.stored == state.stored < 500
        assert _elements(cache) == _whole(1, state.stored)


def test_a_stream_without_a_budget_gets_the_variable_region_the_one_sizing_rule_gives(tmp_path: Path) -> None:
    fields = {"tokens": Field((None,), "int32"), "label": Field((), "int64")}
    for length, value_bytes in ((100, 40), (10_000, 4_000), (3, 1)):
        plan = plan_stream(fields, max_bytes=None, length=length, partitions=2, value_bytes=value_bytes)
        slots = length + max(16, length // 100) + 32  # every element, and room for the holes of killed writers
        assert plan.slots == slots
        # The rule a CachedDataset without max_bytes is sized by, for the measured value (placed: 16-byte steps).
        assert plan.variable_size == align(variable_room(slots, place(max(value_bytes, 16))))
        assert plan.variable_size >= 1.25 * slots * value_bytes + 2**20
    cache = open_stream(tmp_path / "s.mmc", key=KEY, fields=fields, partition=Partition(), plan=lambda: plan)
    assert cache is not None
    with cache:
        region = cache.variable_region
        assert region is not None
        assert region.size == plan.variable_size


def test_values_that_overflow_the_variable_region_stop_the_fill_of_the_partition(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    fields = {"tokens": Field((None,), "uint8")}
    tight = plan_stream(fields, max_bytes=64 * 1024, length=None, partitions=1, value_bytes=100)
    cache = open_stream(path, key=KEY, fields=fields, partition=Partition(), plan=lambda: tight)
    assert cache is not None
    with cache:
        writer = PartitionWriter(cache, Partition())
        sizes = [100] * 50 + [200_000] + [10] * 20  # the big one cannot fit
        stored = [writer.offer(j, {"tokens": np.full(n, j % 256, np.uint8)}) for j, n in enumerate(sizes)]
        assert stored == [True] * 50 + [False] * 21
        state = writer.finish(len(sizes))
        assert (state.full, state.ended, state.stored) == (True, True, 50)


def test_another_partitioning_restarts_an_incomplete_fill_when_nobody_else_uses_it(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _killed(path, Partition(), 30, "--die", "before-store", "10")
    with Cache(path, readonly=True) as old:
        before = old.uuid
    assert _run(path, Partition(0, 1, 0, 2), 30) == {"stored": 30, "ended": 1}  # a run with two workers
    with Cache(path, readonly=True) as new:
        assert new.uuid != before  # a new file (its inode number may be the old one's, freed meanwhile)
    with _open(path, Partition(0, 1, 0, 2)) as cache:
        assert cache._header.stream == (1, 2)
        assert stream_status(cache).stored == 30


def test_another_partitioning_is_refused_while_another_job_fills_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _killed(path, Partition(), 30, "--die", "before-store", "10")
    holder = _open(path)
    try:
        with pytest.raises(CacheInUseError, match=r"filled by 1 rank\(s\) x 1 worker\(s\), this run is 2 rank"):
            open_stream(path, key=KEY, fields=FIELDS, partition=Partition(0, 2, 0, 1), plan=lambda: plan(30, 2))
        assert stream_status(holder).stored == 10  # untouched
    finally:
        holder.close()


def test_a_complete_cache_is_kept_whatever_the_partitioning_of_later_runs(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _run(path, Partition(), 20)
    inode = path.stat().st_ino
    cache = open_stream(path, key=KEY, fields=FIELDS, partition=Partition(1, 2, 1, 4), plan=lambda: plan(20, 8))
    assert cache is not None
    cache.close()
    assert path.stat().st_ino == inode


def test_an_incomplete_fill_begun_before_a_reboot_is_restarted(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _killed(path, Partition(), 30, "--die", "before-store", "10")
    with _open(path) as cache:
        region(cache).boot_id[:] = 1  # as if the file came from an earlier boot
    assert _run(path, Partition(), 30) == {"stored": 30, "ended": 1}


def test_a_stream_that_changed_length_is_reported_as_stale(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _run(path, Partition(0, 1, 0, 2), 20)  # one of two partitions: not complete
    cache = _open(path, Partition(0, 1, 0, 2))
    with cache, pytest.raises(StaleCacheError, match=r"gave 15 elements, but the cache .* holds 20"):
        PartitionWriter(cache, Partition(0, 1, 0, 2)).finish(15)


def test_a_dataset_cache_is_not_taken_for_a_stream_cache(tmp_path: Path) -> None:
    path = tmp_path / "d.mmc"
    Cache(path, FIELDS, 10, key=KEY, max_bytes=2**20).close()
    with pytest.raises(SchemaMismatchError, match="not the cache of a stream"):
        open_stream(path, key=KEY, fields=FIELDS, partition=Partition(), plan=lambda: plan(10, 1))


def test_clearing_a_stream_cache_forgets_the_fill(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    _run(path, Partition(), 20)
    with _open(path) as cache:
        cache.clear()
        status = stream_status(cache)
        assert (status.complete, status.stored, status.slots_used) == (False, 0, 0)
    assert _run(path, Partition(), 20) == {"stored": 20, "ended": 1}


def test_a_stream_without_length_or_budget_is_refused_with_what_to_pass() -> None:
    with pytest.raises(ValueError, match="pass max_bytes="):
        plan_stream(FIELDS, max_bytes=None, length=None, partitions=1)


def test_info_says_how_far_the_fill_of_a_stream_got(tmp_path: Path) -> None:
    import time as clock

    from mmapcache import info
    from mmapcache._admin.reports import format_info

    path = tmp_path / "s.mmc"
    _run(path, Partition(0, 1, 0, 2), 20)
    item = info(path)
    assert item.stream is not None
    assert (item.stream.complete, item.stream.stored, item.stream.partitions_ended) == (False, 20, 1)
    assert "filling: 20 elements stored, 1 of 2 partitions ended (1 rank(s) x 2 worker(s))" in format_info(
        item, clock.time()
    )
    _run(path, Partition(0, 1, 1, 2), 5)
    assert info(path).to_dict()["stream"]["complete"] is True
    assert "complete: 25 elements" in format_info(info(path), clock.time())


def test_verify_finds_a_stream_whose_counts_and_records_disagree(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    assert _run(path, Partition(0, 1, 0, 2), 40) == {"stored": 40, "ended": 1}
    assert _run(path, Partition(0, 1, 1, 2), 40) == {"stored": 40, "ended": 1}
    with _open(path, Partition(0, 1, 0, 2)) as cache:
        assert cache.verify() == []  # a whole fill, two partitions
        stream = region(cache)
        slots = checked_records(cache)
        a, b = int(slots[3]), int(slots[4])
        stream.element[b] = stream.element[a]  # element 3 of partition 0 twice, element 4 in no slot
        found = [str(problem) for problem in cache.verify()]
        assert any(f"element 3 of partition 0 is in slots [{a}, {b}]" in text for text in found), found
        assert any("1 of them are in no READY slot (the first: element 4)" in text for text in found), found
        stream.element[b] = 4
        stream.partition[a] = 7  # a partition the file does not have
        stream.total[1] = 3  # partition 1 ended with fewer than it stores
        found = [str(problem) for problem in cache.verify()]
        assert any(f"slot {a} names partition 7 of 2" in text for text in found), found
        assert any("partition 1 ended with 3 elements, but 40 are stored" in text for text in found), found
        assert all(problem.kind == "stream" and not problem.fixed for problem in cache.verify(fix=True))
