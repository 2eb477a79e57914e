"""A byte budget per cache directory: admission, the ledger, reclaim, with real processes and files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmapcache
from mmapcache import Cache, CacheSpaceError, Field
from mmapcache._file.budgets import BUDGET_ENV, DEFAULT_CGROUP_FRACTION, RECLAIM_GRACE, default_limit
from mmapcache._file.names import BUDGET_NAME, is_reservation_name
from mmapcache._file.paths import memory_limit

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parents[1] / "_budget_procs.py"
ROW = 4096
FIELDS = {"x": Field((ROW,), "uint8")}
MiB = 2**20


def allocated(directory: Path) -> int:
    """The bytes the files in ``directory`` have allocated (each inode once): what the budget holds."""
    seen, total = set(), 0
    with os.scandir(directory) as listing:
        for entry in listing:
            try:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def file_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


class Sampler(threading.Thread):
    """The peak of :func:`allocated`, sampled every 10 ms until stopped."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory, self.peak, self.samples = directory, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, allocated(self.directory))
            self.samples += 1
            self._stop_event.wait(0.01)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def helper(*arguments: object) -> list[str]:
    return [sys.executable, str(HELPER), *map(str, arguments)]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != BUDGET_ENV}, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; any still running at its end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def start(command: list[str], procs: list[Any], **kwargs: Any) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=kwargs.pop("env", env()), **kwargs
    )
    procs.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)


def fill(cache: Cache, indices: range) -> None:
    for i in indices:
        cache.put(i, {"x": np.full(ROW, i % 251, np.uint8)})


# -- the API and the ledger ---------------------------------------------------------------


def test_a_set_budget_is_kept_in_the_directory_and_read_back(cache_dir: Path) -> None:
    found = mmapcache.set_budget(cache_dir, "8MiB", reclaim_unused_after="7d")
    assert (found.limit, found.reserved, found.caches) == (8 * MiB, 0, ())
    assert found.reclaim_unused_after == 7 * 86400
    assert found.free == 8 * MiB - found.used
    assert (cache_dir / BUDGET_NAME).is_file()
    again = mmapcache.budget(cache_dir)
    assert (again.limit, again.reclaim_unused_after) == (8 * MiB, 7 * 86400)
    assert mmapcache.set_budget(cache_dir, None).limit == default_limit(cache_dir)
    assert not (cache_dir / BUDGET_NAME).exists()


def test_the_environment_overrides_the_directory_s_budget(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mmapcache.set_budget(cache_dir, "8MiB")
    monkeypatch.setenv(BUDGET_ENV, "2MiB")
    found = mmapcache.budget(cache_dir)
    assert found.limit == 2 * MiB
    assert BUDGET_ENV in found.source


def test_a_tmpfs_without_a_budget_gets_the_smaller_of_its_size_and_half_the_cgroup_limit(cache_dir: Path) -> None:
    st = os.statvfs(cache_dir)
    cgroup = memory_limit()
    size = st.f_blocks * st.f_frsize
    expected = size if cgroup is None else min(size, int(cgroup * DEFAULT_CGROUP_FRACTION))
    assert mmapcache.budget(cache_dir).limit == expected
    assert "default" in mmapcache.budget(cache_dir).source


def test_a_disk_directory_without_a_budget_has_none_and_admits_everything(disk_dir: Path) -> None:
    found = mmapcache.budget(disk_dir)
    assert (found.limit, found.free) == (None, None)
    with Cache.open(disk_dir / "a.mmc", FIELDS, length=16) as cache:
        assert cache.capacity == 16


def test_the_ledger_lists_each_cache_with_its_bytes_use_and_last_use(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "4MiB")
    with Cache.open(cache_dir / "a.mmc", FIELDS, length=64):
        Cache.open(cache_dir / "b.mmc", FIELDS, length=32).close()
        found = mmapcache.budget(cache_dir)
    by_name = {share.path.name: share for share in found.caches}
    assert set(by_name) == {"a.mmc", "b.mmc"}
    assert by_name["a.mmc"].in_use
    assert not by_name["b.mmc"].in_use
    assert by_name["a.mmc"].bytes == file_bytes(cache_dir / "a.mmc")
    assert abs(by_name["b.mmc"].last_used - time.time()) < 60
    assert found.used == allocated(cache_dir)
    assert found.free == 4 * MiB - found.used


def test_gc_and_ls_pass_by_the_budget_files(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "4MiB")
    (cache_dir / ".mmapcache-reserve-1-deadbeef").write_text("{}")  # a dead creator's reservation
    report = mmapcache.gc(cache_dir, older_than=0)
    assert (tuple(report.removed), tuple(report.kept)) == ((), ())
    assert mmapcache.list_caches(cache_dir) == []
    assert (cache_dir / BUDGET_NAME).exists()


# -- admission -----------------------------------------------------------------------------


def test_a_cache_that_does_not_fit_is_made_smaller_with_one_warning(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "1MiB")
    with pytest.warns(RuntimeWarning) as caught:
        cache = Cache.open(cache_dir / "a.mmc", FIELDS, length=1000)
    with cache:
        assert len(caught) == 1
        message = str(caught[0].message)
        assert 0 < cache.capacity < 1000
        assert f"{cache.capacity} of the 1000 slots" in message
        assert f"the first {cache.capacity} indices are cached" in message
        assert "the budget of" in message
        assert "1.0 MiB" in message
        assert BUDGET_NAME in message
        assert f"mmapcache budget {cache_dir} --set SIZE" in message
        assert allocated(cache_dir) <= 1 * MiB
        assert allocated(cache_dir) > 1 * MiB - 3 * (ROW + 64)  # the whole room, to a slot
        fill(cache, range(cache.capacity))
        assert cache.get(cache.capacity - 1) is not None


def test_a_cache_whose_header_and_one_slot_do_not_fit_raises_saying_what_holds_the_budget(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "64KiB")
    with pytest.raises(CacheSpaceError, match=r"not even its header and one slot fit the budget of .*64\.0 KiB"):
        Cache.open(cache_dir / "a.mmc", {"x": Field((2**20,), "uint8")}, length=4)
    assert not (cache_dir / "a.mmc").exists()
    assert [name for name in os.listdir(cache_dir) if is_reservation_name(name)] == []


def test_variable_fields_get_a_smaller_region_and_fewer_slots(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "1MiB")
    fields = {"t": Field((None,), "uint8")}
    with pytest.warns(RuntimeWarning, match="variable region"):
        cache = Cache.open(cache_dir / "v.mmc", fields, length=1000, max_bytes="4MiB")
    with cache:
        assert cache.capacity < 1000
        assert cache.variable_region is not None
        assert 4096 <= cache.variable_region.size < 3 * MiB
    assert allocated(cache_dir) <= 1 * MiB


def test_a_stream_cache_is_made_with_fewer_slots(cache_dir: Path) -> None:
    pytest.importorskip("torch")
    from mmapcache.torch import CachedStream

    mmapcache.set_budget(cache_dir, "512KiB")
    stream = CachedStream(
        [np.full(ROW, i % 251, np.uint8) for i in range(400)], path=cache_dir / "s.mmc", key="s", max_bytes="4MiB"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = [int(element[0]) for element in stream]
    assert sorted(seen) == sorted(i % 251 for i in range(400))
    assert any("the budget of" in str(w.message) for w in caught)
    assert allocated(cache_dir) <= 512 * 1024
    stream.close()


def test_resize_grows_within_the_budget_only(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "1MiB")
    with Cache.open(cache_dir / "a.mmc", FIELDS, length=1000, capacity=20) as cache:
        fill(cache, range(20))
    with pytest.warns(RuntimeWarning, match="the budget of"):
        done = mmapcache.resize(cache_dir / "a.mmc", max_bytes="4MiB")
    assert 20 < done.new_capacity < 1000
    assert done.kept == 20
    assert allocated(cache_dir) <= 1 * MiB
    with pytest.raises(CacheSpaceError, match="no room to grow"):
        mmapcache.resize(cache_dir / "a.mmc", max_bytes="8MiB")


# -- many processes ---------------------------------------------------------------------


def run_jobs(directory: Path, procs: list[Any], *, length: int, budget: int) -> tuple[Sampler, list[dict[str, Any]]]:
    """3 caches x 2 jobs made and filled at once under ``budget``, caches held open until all reported."""
    mmapcache.set_budget(directory, budget, reclaim_unused_after=0)  # reclaim on: still no cache in use goes
    stop = directory.parent / f"{directory.name}-stop"
    go = directory.parent / f"{directory.name}-go"
    sampler = Sampler(directory)
    sampler.start()
    try:
        jobs = [
            start(helper("job", directory, f"c{k}.mmc", length, ROW, role, stop, go), procs)
            for k in range(3)
            for role in (0, 1)
        ]
        for proc in jobs:  # every interpreter started: then all open at once
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        go.touch()
        reports = []
        for proc in jobs:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, proc.communicate(timeout=60)
            reports.append(json.loads(line))
        assert sorted(os.listdir(directory)).count("c0.mmc") == 1
        assert all((directory / f"c{k}.mmc").exists() for k in range(3))  # none removed while in use
        stop.touch()
        for proc in jobs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
    finally:
        sampler.stop()
        stop.unlink(missing_ok=True)
        go.unlink(missing_ok=True)
    return sampler, reports


def test_concurrent_jobs_never_allocate_past_the_budget(cache_dir: Path, procs: list[Any]) -> None:
    budget = 6 * MiB
    sampler, reports = run_jobs(cache_dir, procs, length=600, budget=budget)  # 3 x 2.4 MiB asked
    assert sampler.samples > 5
    assert sampler.peak <= budget
    assert all(report["bad"] == 0 and report["capacity"] > 0 for report in reports)
    assert sum(report["capacity"] for report in reports) / 2 < 3 * 600  # some were made smaller
    assert all((cache_dir / f"c{k}.mmc").exists() for k in range(3))


@pytest.mark.slow
def test_concurrent_jobs_never_allocate_past_the_budget_many_rounds(cache_dir: Path, procs: list[Any]) -> None:
    for round_ in range(10):
        directory = cache_dir / f"round{round_}"
        directory.mkdir()
        budget = random.randint(8, 40) * MiB
        rows = budget // ROW  # 3 caches asking for 0.75 to 1.2 budgets in all: each gets some
        sampler, reports = run_jobs(directory, procs, length=random.randint(rows // 4, rows * 2 // 5), budget=budget)
        assert sampler.peak <= budget, round_
        assert all(report["bad"] == 0 and report["capacity"] > 0 for report in reports)
        shutil.rmtree(directory)


def kill_creators(directory: Path, procs: list[Any], rounds: int, *, until: int = 0, most: int = 60) -> int:
    """Creators SIGKILLed at random points, two at a time; how many died before their cache was made.

    ``rounds`` rounds, and more (up to ``most``) until ``until`` of them died unfinished: how many kills land
    mid-creation depends on the machine's load, so the test counts the kills it needs rather than a share.
    """
    unfinished = 0
    round_ = 0
    while round_ < rounds or (unfinished < until and round_ < most):
        round_ += 1
        pair = [
            start(helper("create", directory, f"k{round_}{side}.mmc", random.randint(2, 10) * 256, ROW), procs)
            for side in "ab"
        ]
        for proc in pair:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "ready\n", proc.communicate(timeout=60)
        time.sleep(random.uniform(0, 0.04))
        for proc in pair:
            proc.send_signal(signal.SIGKILL)
        for proc in pair:
            out, _ = proc.communicate(timeout=60)
            unfinished += "done" not in out
    return unfinished


def check_nothing_leaked(directory: Path, budget: int) -> None:
    found = mmapcache.budget(directory)
    assert found.reserved == 0
    assert found.used == allocated(directory)
    # The next creation gets the whole free budget (and what dead creators' temp files held).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with Cache.open(directory / "next.mmc", FIELDS, length=budget // ROW) as cache:
            got = file_bytes(cache.path)
    assert got >= found.free - 2 * (ROW + 64) - 4096
    assert [name for name in os.listdir(directory) if is_reservation_name(name)] == []
    assert allocated(directory) <= budget


def test_creators_killed_at_random_points_leak_nothing(cache_dir: Path, procs: list[Any]) -> None:
    budget = 128 * MiB
    mmapcache.set_budget(cache_dir, budget)
    unfinished = kill_creators(cache_dir, procs, rounds=6, until=1)
    assert unfinished >= 1  # some died mid-creation (the check below is about them)
    check_nothing_leaked(cache_dir, budget)


@pytest.mark.slow
def test_creators_killed_at_random_points_leak_nothing_many_rounds(cache_dir: Path, procs: list[Any]) -> None:
    budget = 1024 * MiB
    mmapcache.set_budget(cache_dir, budget)
    assert kill_creators(cache_dir, procs, rounds=60, until=10, most=200) >= 10
    check_nothing_leaked(cache_dir, budget)


# -- a memory cgroup ----------------------------------------------------------------------


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A fresh cgroup v1 memory group inside this process's own, removed afterwards (skip without one)."""
    root = Path("/sys/fs/cgroup/memory")
    ours = next(
        (line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line),
        None,
    )
    parent = root / (ours or "/").lstrip("/")
    if os.geteuid() != 0 or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller to use here (needs root and /sys/fs/cgroup/memory)")
    group = parent / f"mmapcache-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a memory cgroup: {error}")
    try:
        yield group
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                with_suppress_write(group / "memory.force_empty", "0")
                time.sleep(0.1)


def with_suppress_write(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        path.write_text(text)


def fill_in_cgroup(group: Path, directory: Path, *, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    """Fill three 128 MiB caches from a process in ``group``; (exit status, stderr)."""
    command = helper("fill", directory, 2048, 65536, "a.mmc", "b.mmc", "c.mmc")
    script = f"echo $$ > {group}/cgroup.procs && exec " + " ".join(command)
    result = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, env={**env(), **(extra_env or {})}, timeout=300
    )
    return result.returncode, result.stderr


def oom_kills(group: Path) -> int:
    found = re.search(r"oom_kill (\d+)", (group / "memory.oom_control").read_text())
    return int(found.group(1)) if found else 0


def empty(directory: Path) -> None:
    for path in directory.iterdir():
        path.unlink()


@pytest.mark.timeout(600)
def test_filling_every_cache_to_the_budget_triggers_no_oom_kill(cache_dir: Path, memory_cgroup: Path) -> None:
    budget = 256 * MiB
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(budget * 5 // 4))
    # The test bites: three full caches (384 MiB) past the limit get the filler OOM-killed.
    status, _ = fill_in_cgroup(memory_cgroup, cache_dir, extra_env={BUDGET_ENV: "1TiB"})
    assert status == -signal.SIGKILL
    assert oom_kills(memory_cgroup) >= 1
    empty(cache_dir)
    before = oom_kills(memory_cgroup)
    mmapcache.set_budget(cache_dir, budget)
    status, err = fill_in_cgroup(memory_cgroup, cache_dir)
    assert status == 0, err
    assert oom_kills(memory_cgroup) == before
    assert allocated(cache_dir) <= budget
    assert "does not fit the budget of" in err  # the caches that did not fit were made smaller, and said so
    empty(cache_dir)
    # Without a budget set, the default (half the cgroup's limit here) keeps the filler alive too.
    status, err = fill_in_cgroup(memory_cgroup, cache_dir)
    assert status == 0, err
    assert oom_kills(memory_cgroup) == before
    empty(cache_dir)


# -- partial caching ----------------------------------------------------------------------


class Rows:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return np.full(ROW, index % 251, np.uint8)


def test_partial_caching_at_40_percent_keeps_the_hit_rate_at_40_percent(cache_dir: Path) -> None:
    pytest.importorskip("torch")
    from mmapcache.torch import CachedDataset

    n = 1000
    with Cache.open(cache_dir / "probe.mmc", FIELDS, length=n) as probe:
        full = probe.nbytes
    mmapcache.remove(cache_dir / "probe.mmc")
    mmapcache.set_budget(cache_dir, int(0.4 * full) + 4096)  # the budget's own file takes a page
    ds = CachedDataset(Rows(n), cache_dir / "d.mmc", key="rows", check=0)
    with pytest.warns(RuntimeWarning, match="the budget of"):
        ds[0]  # creates the file
    rng = np.random.default_rng(0)
    for i in range(n):  # the first epoch fills what fits
        ds[i]
    for _ in range(5):
        before = ds.stats()["hits"]
        for i in rng.permutation(n):
            assert int(ds[int(i)][0]) == i % 251
        rate = (ds.stats()["hits"] - before) / n
        assert 0.38 <= rate <= 0.42, rate
    ds.close()


# -- reclaim ------------------------------------------------------------------------------


def three_caches(directory: Path, *, reclaim: str | None) -> list[Path]:
    mmapcache.set_budget(directory, "3MiB", reclaim_unused_after=reclaim)
    paths = [directory / f"c{k}.mmc" for k in range(3)]
    for k, path in enumerate(paths):
        Cache.open(path, FIELDS, length=230).close()
        old = time.time() - 86400 * (10 - k)  # c0 is the least recently used
        os.utime(path, (old, old))
    return paths


def test_reclaim_removes_the_least_recently_used_unused_cache(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = three_caches(cache_dir, reclaim="7d")
    with caplog.at_level(logging.WARNING, logger="mmapcache"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # admitted whole: no warning
        with Cache.open(cache_dir / "new.mmc", FIELDS, length=230) as cache:
            assert cache.capacity == 230
    assert not paths[0].exists()
    assert paths[1].exists()
    assert paths[2].exists()
    assert f"removed {paths[0]}" in caplog.text
    assert "last used 1w ago" in caplog.text
    assert "after removing the unused caches c0.mmc" in caplog.text  # listed by the call that made room


def test_reclaim_never_removes_a_cache_in_use_and_admits_the_new_one_smaller(cache_dir: Path, procs: list[Any]) -> None:
    paths = three_caches(cache_dir, reclaim="7d")
    stop = cache_dir.parent / f"{cache_dir.name}-stop"
    holders = [start(helper("job", cache_dir, path.name, 230, ROW, 0, stop), procs) for path in paths]
    try:
        for proc in holders:
            assert proc.stdout is not None
            assert proc.stdout.readline()
        for path in paths:
            old = time.time() - 30 * 86400
            os.utime(path, (old, old))
        with pytest.warns(RuntimeWarning, match="does not fit the budget") as caught:
            cache = Cache.open(cache_dir / "new.mmc", FIELDS, length=230)
        with cache:
            assert cache.capacity < 230
        assert "(in use)" in str(caught[0].message)
        assert all(path.exists() for path in paths)
    finally:
        stop.touch()
        for proc in holders:
            proc.communicate(timeout=60)
        stop.unlink()


def test_reclaim_is_off_unless_asked(cache_dir: Path) -> None:
    paths = three_caches(cache_dir, reclaim=None)
    with pytest.warns(RuntimeWarning, match="--reclaim-unused-after 7d"):
        Cache.open(cache_dir / "new.mmc", FIELDS, length=230).close()
    assert all(path.exists() for path in paths)


def test_a_cache_opened_within_the_grace_period_is_never_reclaimed(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "2MiB", reclaim_unused_after=0)
    Cache.open(cache_dir / "fresh.mmc", FIELDS, length=230).close()
    assert RECLAIM_GRACE > 1
    with pytest.warns(RuntimeWarning, match="does not fit"):
        Cache.open(cache_dir / "new.mmc", FIELDS, length=460).close()
    assert (cache_dir / "fresh.mmc").exists()


# -- the documentation -------------------------------------------------------------------


def budget_example() -> str:
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    section = text[text.index("## A byte budget") :]
    found = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert found is not None
    return found.group(1)


def test_the_operating_guide_s_budget_example_prints_what_it_says(tmp_path: Path) -> None:
    script = budget_example()
    expected = [line.removeprefix("# ") for line in script.splitlines() if line.startswith("# ")]
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected
