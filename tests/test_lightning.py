"""A real Lightning run: 2 CPU processes (gloo), DataLoader workers, one cache file for the node.

Each ``Trainer.fit`` runs in its own Python process (``lightning_run.py``), so
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

pytest.importorskip("lightning")

HERE = Path(__file__).resolve().parent
LENGTH = 64


def _fit(strategy: str, log: Path, ranks: Path) -> None:
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
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _rank_pids(ranks: Path) -> dict[int, int]:
    pids = {}
    for line in ranks.read_text().splitlines():
        rank, pid = map(int, line.split())
        pids[pid] = rank
    return pids


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_shares_one_cache_and_the_next_run_is_warm(strategy: str, cache_dir: Path) -> None:
    log, ranks = cache_dir / "accesses", cache_dir / "ranks"
    _fit(strategy, log, ranks)

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

    # A second fit in a new process: the whole node starts warm.
    _fit(strategy, log, ranks)
    assert accesses(log) == first, "the second run must have zero misses"
    assert len(list(default_dir().glob("*.mmc"))) == 1
