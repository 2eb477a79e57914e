"""Caches on a disk (node-local NVMe; here the root file system): cold reads, memory limits, reboots.

Every test works on real files in a private directory under /var/tmp (not
tmpfs), evicts them from the page cache for real (``fsync``, close every
mapping, ``POSIX_FADV_DONTNEED``) and uses real processes. The memory-limit
and reboot tests need root (a cgroup; a private mount namespace whose
``/proc/sys/kernel/random/boot_id`` is another file) and are skipped without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmapcache import Cache, disk_usage
from mmapcache._file.paths import filesystem_type, is_memory_filesystem
from mmapcache._region.residency import resident_bytes
from mmapcache.cli import main

DISK = Path("/var/tmp")
ROW = (4, 128, 128)  # 64 KiB a sample: sixteen pages, so a cold row is many faults without hints
ROOT = Path(__file__).resolve().parents[2]
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

pytestmark = pytest.mark.skipif(
    not DISK.is_dir() or is_memory_filesystem(filesystem_type(DISK)), reason="needs /var/tmp on a disk"
)


def sample(i: int) -> np.ndarray[Any, Any]:
    """Sample ``i``: every byte ``i % 251``, the first eight the index itself (a misplaced row shows)."""
    row = np.full(ROW, i % 251, np.uint8)
    row.reshape(-1)[:8] = np.frombuffer(np.uint64(i).tobytes(), np.uint8)
    return row


def make_cache(path: Path, n: int, filled: int | None = None) -> None:
    with Cache(path, {"x": (ROW, "u1")}, n) as cache:
        for start in range(0, filled if filled is not None else n, 32):
            idx = np.arange(start, min(start + 32, filled if filled is not None else n))
            cache.put_many(idx, {"x": np.stack([sample(i) for i in idx.tolist()])})


def evict(path: Path) -> None:
    """Write the file back and drop it from the page cache (no mapping of it may be alive)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(code: str, *, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


# -- cold reads --------------------------------------------------------------------------


def test_a_cache_on_a_disk_reads_with_hints_and_survives_reboots(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 4)
    with Cache(path) as cache:
        assert cache._mapped is not None
        assert cache._mapped.readahead is not None
        assert cache._mapped.boot is not None
        assert cache._header.version == 5


def test_a_cache_in_shared_memory_keeps_the_memory_path(cache_dir: Path) -> None:
    if not is_memory_filesystem(filesystem_type(cache_dir)):
        pytest.skip("needs a tmpfs (/dev/shm)")
    with Cache(cache_dir / "c.mmc", {"x": (ROW, "u1")}, 40) as cache:
        cache.put_many(np.arange(40), {"x": np.stack([sample(i) for i in range(40)])})
        assert cache._mapped is not None
        assert cache._mapped.readahead is None
        assert cache._mapped.boot is None
        assert cache._header.version < 5
        idx = np.random.default_rng(0).permutation(40)
        assert np.array_equal(cache.get_many(idx)["x"], np.stack([sample(i) for i in idx.tolist()]))
        cache.prefetch(idx)  # nothing to do in memory, and no error
        assert cache.sync() == 0


def test_cold_reads_after_eviction_return_the_stored_bytes(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    n = 300
    make_cache(path, n, filled=250)
    evict(path)
    assert resident_bytes(path) < os.path.getsize(path) // 10
    rng = np.random.default_rng(1)
    with Cache(path, readonly=True) as cache:
        idx = rng.permutation(250)[:128]
        assert np.array_equal(cache.get_many(idx)["x"], np.stack([sample(i) for i in idx.tolist()]))
        mixed = np.concatenate([rng.permutation(250)[:20], np.arange(250, 260)])
        read, hits = cache.read_many(mixed)
        assert hits.tolist() == [True] * 20 + [False] * 10
        assert np.array_equal(read["x"][:20], np.stack([sample(i) for i in mixed[:20].tolist()]))
        for i in rng.permutation(250)[:20].tolist():
            assert np.array_equal(cache[i]["x"], sample(i))
    assert resident_bytes(path) >= 128 * sample(0).nbytes


def test_reads_stay_correct_without_hints(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 64)
    evict(path)
    result = run(
        f"""
        import os, numpy as np
        os.environ["MMAPCACHE_READAHEAD"] = "0"
        from mmapcache import Cache
        with Cache({str(path)!r}) as cache:
            assert cache._mapped.readahead is None
            print(int(cache.get_many(np.arange(64))["x"].reshape(64, -1)[:, 8:].astype(np.int64).sum()))
        """
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == sum((i % 251) * (sample(0).size - 8) for i in range(64))


def test_prefetch_reads_cached_slots_into_memory_in_the_background(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 200, filled=160)
    evict(path)
    with Cache(path) as cache:
        start = time.perf_counter()
        cache.prefetch(np.arange(200))  # 40 of them are not cached: ignored
        returned = time.perf_counter() - start
        wanted = 160 * sample(0).nbytes
        deadline = time.monotonic() + 10
        while resident_bytes(path) < wanted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert resident_bytes(path) >= wanted
        assert returned < 0.5
        assert np.array_equal(cache.get_many(np.arange(160))["x"][159], sample(159))
        with pytest.raises(IndexError):
            cache.prefetch([200])
        cache.prefetch(np.arange(10), background=False)


def test_df_shows_how_much_of_each_cache_is_in_memory(disk_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 64)
    evict(path)
    (resident,) = disk_usage(disk_dir).resident
    assert (resident.path, resident.nbytes, resident.resident) == (path, os.path.getsize(path), 0)
    with Cache(path) as cache:
        cache.get_many(np.arange(64))
        assert disk_usage(disk_dir).resident[0].resident >= 64 * sample(0).nbytes
    assert main(["df", str(disk_dir)]) == 0
    assert "c.mmc" in capsys.readouterr().out
    assert main(["df", str(disk_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resident"][0]["path"] == str(path)


# -- memory limits -------------------------------------------------------------------------


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory cgroup of our own (root only), removed afterwards."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 memory controller")
    group = CGROUP_V1 / f"mmapcache-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_process_under_a_memory_limit_smaller_than_the_cache_reads_all_of_it(
    disk_dir: Path, memory_cgroup: Path
) -> None:
    path = disk_dir / "big.mmc"
    n = 4096  # 256 MiB of samples
    make_cache(path, n)
    evict(path)
    limit = 128 * 2**20
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(limit))
    procs = memory_cgroup / "cgroup.procs"
    code = f"""
        import numpy as np
        from mmapcache import Cache
        with Cache({str(path)!r}, readonly=True) as cache:
            wrong = 0
            for start in range(0, {n}, 64):
                idx = np.random.default_rng(start).permutation(np.arange(start, start + 64))
                rows = cache.get_many(idx)["x"].reshape(64, -1)
                wrong += int(np.count_nonzero(rows[:, 8:] != (idx % 251)[:, None].astype(np.uint8)))
                wrong += int(np.count_nonzero(rows[:, :8].copy().view(np.uint64)[:, 0] != idx))
        print(wrong)
        """
    result = run(code, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert result.stdout.strip() == "0"
    assert int((memory_cgroup / "memory.max_usage_in_bytes").read_text()) <= limit
    assert int((memory_cgroup / "memory.failcnt").read_text()) > 0  # the limit was reached: pages were reclaimed


# -- reboots ---------------------------------------------------------------------------------

WRITER = """
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    from test_nvme import sample
    from mmapcache import Cache
    cache = Cache({path!r}, {{"x": ({row!r}, "u1")}}, {n})
    for i in range({n}):
        cache.put(i, {{"x": sample(i)}})
        if i == {synced}:
            cache.sync()
        if i >= {announce}:
            print(i, flush=True)
            time.sleep(0.05)
"""

READER = """
    import json, numpy as np
    from mmapcache import Cache
    with Cache({path!r}{readonly}) as cache:
        print(json.dumps({{"boot": cache._mapped.boot.boot_id.hex(), "ready": [i for i in range({n}) if i in cache],
                           "synced": np.asarray(cache._mapped.slots.synced).tolist()}}))
"""


def _fill_and_kill(path: Path, n: int, synced: int, announce: int) -> None:
    """A writer fills slots in order, syncs after slot ``synced``, and is SIGKILLed past ``announce``."""
    code = WRITER.format(
        tests=str(Path(__file__).resolve().parent), path=str(path), row=ROW, n=n, synced=synced, announce=announce
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    try:
        assert int(writer.stdout.readline()) >= announce
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL


def _tear(path: Path, slot: int) -> None:
    """Zero slot ``slot``'s data in the file, as if its state had reached the disk and its data had not."""
    with Cache(path, readonly=True) as cache:
        offset, nbytes = cache._layout.field_offsets["x"], sample(0).nbytes
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(nbytes), offset + slot * nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def _after_reboot(code: str, tmp: Path) -> dict[str, Any]:
    """Run ``code`` (its last line prints JSON) in a process that sees another kernel boot id."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to fake a reboot")
    fake = tmp / "boot_id"
    fake.write_text(str(uuid.uuid4()) + "\n")
    script = tmp / "after_reboot.py"
    script.write_text(textwrap.dedent(code))
    command = f"mount --bind {fake} /proc/sys/kernel/random/boot_id && exec {sys.executable} {script}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def _read_after_reboot(path: Path, n: int, tmp: Path, *, readonly: bool = False) -> dict[str, Any]:
    """Open the cache in a process that sees another kernel boot id (a private mount namespace)."""
    report = _after_reboot(READER.format(path=str(path), n=n, readonly=", readonly=True" * readonly), tmp)
    assert report["boot"] == uuid.UUID((tmp / "boot_id").read_text().strip()).hex
    return report


def test_after_a_reboot_a_slot_whose_data_did_not_reach_the_disk_is_not_served(disk_dir: Path) -> None:
    path, n = disk_dir / "c.mmc", 64
    _fill_and_kill(path, n, synced=9, announce=40)
    _tear(path, 5)  # synced before the crash: trusted, not read again
    _tear(path, 20)  # written after the last sync: checked, found torn
    with Cache(path) as cache:  # same boot: the page cache is the truth, nothing is scanned
        assert 20 in cache
        assert 5 in cache
        ready = [i for i in range(n) if i in cache]
    report = _read_after_reboot(path, n, disk_dir)
    assert report["ready"] == [i for i in ready if i != 20]
    assert report["synced"][:41] == [1] * 20 + [0] + [1] * 20  # checked slots read back intact are synced now
    with Cache(path) as cache:
        for i in report["ready"]:
            expected = np.zeros(ROW, np.uint8) if i == 5 else sample(i)
            assert np.array_equal(cache[i]["x"], expected)
        assert cache.put(20, {"x": sample(20)})  # filled again like any miss
        assert np.array_equal(cache[20]["x"], sample(20))


def test_a_readonly_open_after_a_reboot_has_the_check_done_first(disk_dir: Path) -> None:
    path, n = disk_dir / "c.mmc", 32
    _fill_and_kill(path, n, synced=-1, announce=20)
    _tear(path, 3)
    report = _read_after_reboot(path, n, disk_dir, readonly=True)
    assert 3 not in report["ready"]
    assert 4 in report["ready"]


def test_within_one_boot_open_checks_nothing(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 16)
    _tear(path, 7)  # never synced, torn: yet within this boot no open looks at it
    with Cache(path) as cache:
        assert cache._mapped is not None
        assert cache._mapped.boot is not None
        assert cache._mapped.boot.current()
        assert 7 in cache
        assert not cache._mapped.slots.synced.any()


def test_sync_marks_every_filled_slot_and_a_new_claim_clears_it(disk_dir: Path) -> None:
    path = disk_dir / "c.mmc"
    make_cache(path, 16, filled=10)
    with Cache(path) as cache:
        assert cache._mapped is not None
        assert cache.sync() == 10
        assert cache.sync() == 0
        synced = cache._mapped.slots.synced
        assert synced.tolist() == [1] * 10 + [0] * 6
        cache.verify()
        cache.put(12, {"x": sample(12)})
        assert synced[12] == 0
        cache.clear()
        assert not synced.any()
        with pytest.raises(PermissionError):
            Cache(path, readonly=True).sync()


RAGGED = {"v": ((None,), "u1")}


def ragged(i: int) -> np.ndarray[Any, Any]:
    return np.full(1000 + i, i, np.uint8)


REFILL_AFTER_REBOOT = """
    import json, numpy as np
    from mmapcache import Cache
    with Cache({path!r}) as cache:
        for i in range({half}, {n}):
            cache.put(i, {{"v": np.full(1000 + i, i, np.uint8)}})
        wrong = [i for i in range({n}) if i in cache and not (cache[i]["v"] == i).all()]
        print(json.dumps({{"wrong": wrong, "ready": [i for i in range({n}) if i in cache]}}))
"""


def test_after_a_reboot_new_values_never_reuse_the_bytes_of_values_that_survived(disk_dir: Path) -> None:
    path, n, half = disk_dir / "r.mmc", 16, 8
    with Cache(path, RAGGED, n, max_bytes="1MiB") as cache:
        for i in range(half):
            cache.put(i, {"v": ragged(i)})
        assert cache.sync() == half
        allocator = cache._layout.allocator_offset
    # The crash this models: the slots reached the disk, the allocation page did not.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(8), allocator)
        os.fsync(fd)
    finally:
        os.close(fd)
    report = _after_reboot(REFILL_AFTER_REBOOT.format(path=str(path), n=n, half=half), disk_dir)
    assert report["ready"] == list(range(n))
    assert report["wrong"] == [], "values written after the reboot overwrote values that were served as hits"
    with Cache(path) as cache:
        assert cache.verify() == []


def _dirty(mm: Any, offset: int) -> bool:
    """Whether the page cache page under ``offset`` of the shared mapping ``mm`` is dirty (not yet on the disk)."""
    import ctypes

    mm[offset]  # map it
    anchor = ctypes.c_char.from_buffer(mm, offset)
    address = ctypes.addressof(anchor)
    del anchor
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // 4096 * 8)
        frame = int.from_bytes(pagemap.read(8), "little") & ((1 << 55) - 1)
    with open("/proc/kpageflags", "rb") as flags:
        flags.seek(frame * 8)
        return bool(int.from_bytes(flags.read(8), "little") & (1 << 4))  # KPF_DIRTY


def test_clear_on_a_disk_is_durable_before_anything_reuses_the_space(disk_dir: Path) -> None:
    import mmap

    if os.geteuid() != 0 or not Path("/proc/kpageflags").exists():
        pytest.skip("needs root to read page flags")
    path, n = disk_dir / "r.mmc", 16
    with Cache(path, RAGGED, n, max_bytes="1MiB") as cache:
        for i in range(n):
            cache.put(i, {"v": ragged(i)})
        assert cache.sync() == n  # every slot synced: after a crash they would be trusted unchecked
        layout = cache._layout
        cache.clear()
        # A crash from here on must not find the synced READY records on the disk: the region
        # is about to be reused, and a synced slot is never read back to be checked.
        fd = os.open(path, os.O_RDWR)  # a writable mapping (ctypes needs one); only read through
        try:
            mm = mmap.mmap(fd, layout.file_size)
            try:
                assert not _dirty(mm, layout.table_offset), "the emptied slot table is not on the disk yet"
                assert not _dirty(mm, layout.allocator_offset), "the reset allocation counter is not on the disk yet"
            finally:
                mm.close()
        finally:
            os.close(fd)
        assert cache.put(3, {"v": ragged(3)})


def test_a_cache_made_in_memory_and_used_from_a_disk_warns_that_reboots_go_unchecked(
    disk_dir: Path, cache_dir: Path
) -> None:
    made = cache_dir / "c.mmc"
    make_cache(made, 4)
    moved = disk_dir / "c.mmc"
    shutil.copyfile(made, moved)
    with pytest.warns(RuntimeWarning, match=r"made on a memory file system .*version 2.*mmapcache rm"):
        cache = Cache(moved)
    with cache:
        assert cache._mapped is not None
        assert cache._mapped.boot is None
        assert np.array_equal(cache[3]["x"], sample(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Cache(moved, readonly=True).close()  # once per file and process
        Cache(made).close()  # in memory: nothing to say


CHECKER = """
import os, sys
with open(sys.argv[2], "w") as procs:  # into the throttled cgroup before the first read
    procs.write(str(os.getpid()))
from mmapcache import Cache
Cache(sys.argv[1]).close()
"""

WAITER = """
import json, logging, os, pathlib, sys, time
from mmapcache import Cache
from mmapcache._file.create import read_lock_status
from mmapcache._file.names import lock_path_for
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
lock, deadline = lock_path_for(pathlib.Path(sys.argv[1])), time.monotonic() + 60
while read_lock_status(lock) is None and time.monotonic() < deadline:
    time.sleep(0.01)  # until the checker (slowed by the throttle from its first read) says it is checking
start = time.monotonic()
with Cache(sys.argv[1], timeout=1) as cache:
    print(json.dumps({"waited": time.monotonic() - start, "filled": cache.filled}))
"""

AFTER_REBOOT_TWO = """
import json, subprocess, sys
checker = subprocess.Popen([sys.executable, "-c", {checker!r}, {path!r}, {procs!r}])
waiter = subprocess.run([sys.executable, "-c", {waiter!r}, {path!r}], capture_output=True, text=True)
checker.wait()
print(json.dumps({{"checker": checker.pid, "status": waiter.returncode, "out": waiter.stdout, "err": waiter.stderr}}))
"""


@pytest.fixture
def slow_disk_cgroup() -> Iterator[Path]:
    """A blkio cgroup whose reads from the disk under /var/tmp are throttled to 4 MiB/s."""
    root = Path("/sys/fs/cgroup/blkio")
    if os.geteuid() != 0 or not (root / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs root and the cgroup v1 blkio controller")
    dev = os.stat(DISK).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (block / "partition").exists():  # throttles apply to the whole disk
        block = block.resolve().parent
    group = root / f"mmapcache-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{(block / 'dev').read_text().strip()} {4 * 2**20}")
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_after_a_reboot_other_processes_wait_for_the_check_and_say_how_far_it_is(
    disk_dir: Path, slow_disk_cgroup: Path
) -> None:
    path, n = disk_dir / "c.mmc", 512  # 32 MiB never synced: up to 8 s at 4 MiB/s (less what stayed cached)
    make_cache(path, n)
    evict(path)
    code = AFTER_REBOOT_TWO.format(
        checker=CHECKER, waiter=WAITER, path=str(path), procs=str(slow_disk_cgroup / "cgroup.procs")
    )
    report = _after_reboot(code, disk_dir)
    assert report["status"] == 0, report["err"]
    assert json.loads(report["out"])["filled"] == n
    assert json.loads(report["out"])["waited"] > 1, "the check took longer than the waiter's timeout"
    assert f"pid {report['checker']}" in report["err"]
    assert "after a reboot" in report["err"]
    assert re.search(rf"\d+ of {n} slots", report["err"]), report["err"]
