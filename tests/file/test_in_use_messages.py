"""CacheInUseError says who holds the cache — this process, its DataLoader workers, other jobs — and what to do.

Every holder is a real process with a real open handle: this test process,
DataLoader workers under each start method (forkserver workers are
grandchildren), a forked child with a hostile process name, and a process
that is no descendant of ours (a double-forked daemon, reparented away).
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mmapcache
from mmapcache import Cache, CacheInUseError, Field
from mmapcache.torch import CachedDataset

FIELDS = {"x": Field((4,), "uint8")}
FORK = multiprocessing.get_context("fork")


def _make(path: Path) -> None:
    with Cache.open(path, FIELDS, 8) as cache:
        cache.put(0, {"x": np.arange(4, dtype=np.uint8)})


def _message(error: pytest.ExceptionInfo[CacheInUseError]) -> str:
    return str(error.value)


@pytest.fixture
def other_job(cache_dir: Path) -> Iterator[Any]:
    """Start a holder that is not a descendant of this process: it forks, its parent exits, it is reparented."""
    started: list[tuple[subprocess.Popen[str], int]] = []

    def start(path: Path) -> int:
        script = textwrap.dedent(
            f"""
            import os, sys
            from mmapcache import Cache
            if os.fork():
                os._exit(0)
            os.setsid()
            cache = Cache.open({str(path)!r})
            print(os.getpid(), flush=True)
            sys.stdin.read()  # until the test closes our stdin
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        assert proc.wait(30) == 0  # the intermediate parent is gone: pid is reparented away from us
        started.append((proc, pid))
        return pid

    yield start
    for proc, pid in started:
        assert proc.stdin is not None
        proc.stdin.close()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)


def test_remove_while_this_process_holds_it_says_close_the_handle(cache_dir: Path) -> None:
    path = cache_dir / "mine.mmc"
    _make(path)
    cache = Cache.open(path)
    with pytest.raises(CacheInUseError) as error:
        mmapcache.remove(path)
    message = _message(error)
    assert error.value.pids == [os.getpid()]
    assert f"in use by this process (pid {os.getpid()});" in message
    assert "cache.close()" in message
    assert "ds.close()" in message
    assert "stop the jobs" not in message
    assert "DataLoader workers" not in message
    assert "force=True" in message
    cache.close()
    mmapcache.remove(path)
    assert os.listdir(cache_dir) == []


def test_remove_while_a_dataset_of_this_process_holds_it(cache_dir: Path) -> None:
    data = TensorDataset(torch.arange(24, dtype=torch.uint8).reshape(6, 4))
    ds = CachedDataset(data, cache_dir / "ds.mmc", key="in-use/dataset")
    assert torch.equal(ds[2][0], torch.arange(8, 12, dtype=torch.uint8))
    with pytest.raises(CacheInUseError, match=r"in use by this process \(pid \d+\); close this process's handles"):
        mmapcache.remove(ds.path)
    ds.close()
    mmapcache.remove(ds.path)


def worker_pid(sample: Any) -> Any:
    """The transform of the worker test: the sample plus the pid of the process that produced it."""
    return sample, os.getpid()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_remove_while_dataloader_workers_hold_it_says_delete_the_iterator(context: str, cache_dir: Path) -> None:
    data = TensorDataset(torch.arange(64, dtype=torch.uint8).reshape(16, 4))
    ds = CachedDataset(data, cache_dir / "workers.mmc", key="in-use/workers", transform=worker_pid)
    loader = DataLoader(
        ds, batch_size=2, num_workers=2, multiprocessing_context=context, persistent_workers=True, shuffle=False
    )
    workers = {int(pid) for _, pids in loader for pid in pids}
    assert len(workers) == 2
    assert os.getpid() not in workers
    ds.close()  # this process never opened it: only the workers hold it
    with pytest.raises(CacheInUseError) as error:
        mmapcache.remove(ds.path)
    message = _message(error)
    assert set(error.value.pids) == workers
    listed = ", ".join(map(str, sorted(workers)))
    assert f"in use by this process's DataLoader workers or other child processes (pids {listed});" in message
    assert "delete the DataLoader iterators" in message
    assert "persistent_workers=True" in message
    assert "this process (pid" not in message
    assert "stop the" not in message
    del loader  # persistent workers live as long as the loader: this ends them
    gc.collect()
    mmapcache.remove(ds.path)
    assert os.listdir(cache_dir) == []


def test_remove_while_only_another_job_holds_it_says_stop_the_jobs(cache_dir: Path, other_job: Any) -> None:
    path = cache_dir / "theirs.mmc"
    _make(path)
    pid = other_job(path)
    with pytest.raises(CacheInUseError) as error:
        mmapcache.remove(path)
    assert error.value.pids == [pid]
    assert _message(error) == (
        f"{path} is in use (process ids: {pid}); close every handle first (stop the jobs using it), "
        "or pass force=True / --force to delete it anyway"
    )


def test_remove_held_here_and_by_another_job_names_both(cache_dir: Path, other_job: Any) -> None:
    path = cache_dir / "both.mmc"
    _make(path)
    pid = other_job(path)
    with Cache.open(path), pytest.raises(CacheInUseError) as error:
        mmapcache.remove(path)
    message = _message(error)
    assert sorted(error.value.pids) == sorted([os.getpid(), pid])
    assert f"in use by this process (pid {os.getpid()}) and other processes (pid {pid});" in message
    assert "cache.close()" in message
    assert message.endswith("; stop the other jobs using it, or pass force=True / --force to delete it anyway")


def test_cli_rm_started_by_the_holder_calls_its_parent_another_job(cache_dir: Path) -> None:
    path = cache_dir / "cli.mmc"
    _make(path)
    script = Path(sys.executable).with_name("mmapcache")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mmapcache"]
    with Cache.open(path):
        result = subprocess.run([*command, "rm", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.startswith(f"CacheInUseError: {path} is in use (process ids: {os.getpid()}); ")
    assert "stop the jobs using it" in result.stderr
    assert "this process" not in result.stderr
    mmapcache.remove(path)


def test_clear_with_another_handle_in_this_process_says_close_it(cache_dir: Path) -> None:
    path = cache_dir / "two-handles.mmc"
    _make(path)
    with Cache.open(path) as first, Cache.open(path) as second:
        with pytest.raises(CacheInUseError) as error:
            first.clear()
        assert error.value.pids == []  # clear lists only the other processes
        assert _message(error) == (
            f"cannot clear {path}: it is in use by this process (pid {os.getpid()}); close this process's "
            "other handles of it first (ds.close() on a CachedDataset, cache.close() on a Cache)"
        )
        second.close()
        first.clear()
        assert first.filled == 0
    mmapcache.remove(path)


def _hold_as_odd_name(path: str, conn: multiprocessing.connection.Connection) -> None:
    # /proc/<pid>/stat shows the name in parentheses: ") (" inside it must not shift the fields.
    with open("/proc/self/comm", "w", encoding="ascii") as comm:
        comm.write("x) 1 (y z")
    cache = Cache.open(path)
    conn.send("ready")
    conn.recv()
    cache.close()


@pytest.mark.timeout(60)
def test_clear_and_remove_while_a_child_holds_it_name_the_child(cache_dir: Path, other_job: Any) -> None:
    path = cache_dir / "child.mmc"
    _make(path)
    parent_end, child_end = FORK.Pipe()
    child = FORK.Process(target=_hold_as_odd_name, args=(str(path), child_end))
    child.start()
    try:
        assert parent_end.recv() == "ready"
        with open(f"/proc/{child.pid}/comm", encoding="ascii") as comm:
            assert comm.read().strip() == "x) 1 (y z"
        with Cache.open(path) as cache, pytest.raises(CacheInUseError) as error:
            cache.clear()
        assert error.value.pids == [child.pid]
        assert _message(error).startswith(
            f"cannot clear {path}: it is in use by this process's DataLoader workers or other child processes "
            f"(pid {child.pid}); delete the DataLoader iterators"
        )
        pid = other_job(path)
        with pytest.raises(CacheInUseError) as error:
            mmapcache.remove(path)
        message = _message(error)
        assert f"child processes (pid {child.pid}) and other processes (pid {pid});" in message
        assert "this process (pid" not in message
        assert "stop the other jobs using it" in message
    finally:
        parent_end.send("exit")
        child.join(10)
    assert child.exitcode == 0
