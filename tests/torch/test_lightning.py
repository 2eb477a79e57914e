"""Real DDP on the CPU (gloo), 2 ranks with DataLoader workers: one cache file for the node.

Lightning ``ddp`` and ``ddp_spawn``, and plain torch DDP under ``torchrun``.
Each run is its own Python process (``lightning_run.py``, ``ddp_run.py``), so
the pytest process never initialises torch.distributed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from torch_helpers import accesses

from mmapcache import Cache, default_dir

HERE = Path(__file__).resolve().parents[1]
LENGTH = 64


def _fit(strategy: str, log: Path, ranks: Path, *, loader: bool = False) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(HERE / "lightning_run.py"),
            "--strategy",
            strategy,
            "--length",
            str(LENGTH),
            "--workers",
            "1",
            "--log",
            str(log),
            "--ranks",
            str(ranks),
            *(["--loader"] if loader else []),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def _rank_pids(ranks: Path) -> dict[int, int]:
    pids = {}
    for line in ranks.read_text().splitlines():
        rank, pid = map(int, line.split())
        pids[pid] = rank
    return pids


def _check_first_run(log: Path, ranks: Path) -> list[tuple[int, int, int]]:
    files = list(default_dir().glob("*.mmc"))
    assert len(files) == 1, f"one cache file for the node, found {files}"
    with Cache(files[0]) as cache:
        assert cache.filled == LENGTH
    first = accesses(log)
    assert Counter(index for _, _, index in first) == Counter(range(LENGTH)), "each sample loaded exactly once"
    rank_of = _rank_pids(ranks)
    assert sorted(rank_of.values()) == [0, 1]
    # The workers (children of the rank processes) loaded and wrote the samples.
    writers = Counter(rank_of.get(ppid) for _, ppid, _ in first)
    assert writers[0] > 0, "rank 0 wrote"
    assert writers[1] > 0, "rank 1 wrote"
    assert sum(writers.values()) == LENGTH
    assert None not in writers
    return first


@pytest.mark.parametrize(
    ("strategy", "then", "loader"),
    [
        # Always on: each strategy fills a node's cache once, and a run of the other finds it warm.
        ("ddp_spawn", "ddp", False),
        ("ddp", "ddp", True),
        # Each strategy warm after itself: Lightning's start-up is most of a minute per pair of fits.
        pytest.param("ddp", "ddp", False, marks=pytest.mark.slow),
        pytest.param("ddp_spawn", "ddp_spawn", False, marks=pytest.mark.slow),
    ],
)
def test_ddp_shares_one_cache_and_the_next_run_is_warm(strategy: str, then: str, loader: bool, cache_dir: Path) -> None:
    """A fit with ``strategy``, then one with ``then``; with ``loader=True`` through ``CachedDataset.loader()``."""
    log, ranks = cache_dir / "accesses", cache_dir / "ranks"
    _fit(strategy, log, ranks, loader=loader)
    first = _check_first_run(log, ranks)

    # A second fit in a new process: the whole node starts warm.
    _fit(then, log, ranks, loader=loader)
    assert accesses(log) == first, "the second run must have zero misses"
    assert len(list(default_dir().glob("*.mmc"))) == 1


def test_torchrun(cache_dir: Path) -> None:
    """Plain DDP: torchrun sets RANK/WORLD_SIZE; CachedDataset still needs none of them."""
    log, ranks = cache_dir / "accesses", cache_dir / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(HERE / "ddp_run.py"), "--length", str(LENGTH), "--access-log", str(log), "--rank-log", str(ranks)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _check_first_run(log, ranks)  # two epochs ran: the second one loaded nothing
