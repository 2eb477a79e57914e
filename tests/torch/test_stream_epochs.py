"""The later epochs of a CachedStream: a new order every epoch in every setup, split evenly, read by whoever asks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from mmapcache.torch import CachedStream

HERE = Path(__file__).parents[1]
sys.path.insert(0, str(HERE))
from stream_sources import Numbers, WithLength  # noqa: E402

LENGTH = 48


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}


def _epoch(loader: Any) -> list[int]:
    return [label for batch in loader for label in batch["label"].tolist()]


def _stream(path: Path, length: int = LENGTH) -> CachedStream:
    return CachedStream(WithLength(length, kind="fixed"), path, key="k")


SETUPS: dict[str, dict[str, Any]] = {
    "no workers": {"num_workers": 0},
    "fresh workers": {"num_workers": 2},
    "persistent workers": {"num_workers": 2, "persistent_workers": True},
    "spawned workers": {"num_workers": 1, "multiprocessing_context": "spawn"},
}


# Every setup with and without set_epoch; spawned workers with it only (one spawned run is enough: spawning is slow).
CASES = [
    (setup, set_epoch) for setup in SETUPS for set_epoch in (True, False) if set_epoch or setup != "spawned workers"
]


@pytest.mark.parametrize(
    ("setup", "set_epoch"), CASES, ids=[f"{setup}-{'set_epoch' if on else 'no set_epoch'}" for setup, on in CASES]
)
def test_consecutive_epochs_differ_in_every_setup(tmp_path: Path, setup: str, set_epoch: bool) -> None:
    ds = _stream(tmp_path / "s.mmc")
    loader = DataLoader(ds, batch_size=4, **SETUPS[setup])
    orders = []
    for epoch in range(4):
        if set_epoch:
            ds.set_epoch(epoch)
        orders.append(_epoch(loader))
    assert sorted(orders[0]) == list(range(LENGTH))  # the stream, read once and stored
    for before, after in itertools.pairwise(orders[1:]):
        assert sorted(after) == list(range(LENGTH))
        assert after != before, f"{setup}: an epoch repeated the order of the one before"


def test_set_epoch_sets_the_next_pass_and_later_passes_count_on(tmp_path: Path) -> None:
    ds = _stream(tmp_path / "s.mmc")
    list(ds)  # the first epoch fills the cache
    ds.set_epoch(5)
    five, six = [int(e["label"]) for e in ds], [int(e["label"]) for e in ds]
    again = _stream(tmp_path / "s.mmc")  # another rank, or a rerun: the same epochs, the same orders
    again.set_epoch(5)
    assert [int(e["label"]) for e in again] == five
    assert [int(e["label"]) for e in again] == six
    assert five != six


def _rank_epochs(out: Path) -> dict[tuple[int, int], list[int]]:
    seen: dict[tuple[int, int], list[int]] = defaultdict(list)
    for line in out.read_text().splitlines():
        rank, epoch, label = map(int, line.split())
        seen[rank, epoch].append(label)
    return seen


def _check_job(out: Path, epochs: int) -> None:
    """Every epoch covers the stream exactly once across the two ranks; no rank repeats an epoch's order."""
    seen = _rank_epochs(out)
    for epoch in range(epochs):
        both = seen[0, epoch] + seen[1, epoch]
        assert sorted(both) == list(range(LENGTH)), f"epoch {epoch}: the ranks disagree on the permutation"
    for rank in (0, 1):
        for epoch in range(2, epochs):
            assert seen[rank, epoch] != seen[rank, epoch - 1], f"rank {rank} repeated an order in epoch {epoch}"


@pytest.mark.parametrize(
    "options", [["--workers", "1"], ["--workers", "2", "--persistent", "--set-epoch"]], ids=["fresh", "persistent"]
)
def test_torchrun_ranks_agree_on_each_epoch_and_epochs_differ(tmp_path: Path, options: list[str]) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(HERE / "stream_epochs_run.py"), str(tmp_path / "s.mmc"), "--out", str(out)]
    command += ["--epochs", "4", "--length", str(LENGTH)]
    run = subprocess.run(command + options, capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _check_job(out, 4)


def test_lightning_ddp_with_its_default_workers_draws_a_new_order_every_epoch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(HERE / "stream_epochs_run.py"), str(tmp_path / "s.mmc"), "--out", str(out)]
    command += ["--lightning", "--workers", "1", "--epochs", "4", "--length", str(LENGTH)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _check_job(out, 4)


class OneShard(IterableDataset[Any]):
    """A stream of one shard (one JSONL file): the first worker reads it all, the others nothing."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None or info.id == 0:
            for i in range(self.length):
                yield {"label": i, "x": torch.full((4,), i)}


def _tagged(samples: list[Any]) -> tuple[int, Any]:
    info = get_worker_info()
    return (0 if info is None else info.id), default_collate(samples)


@pytest.mark.parametrize("left", [False, True], ids=["new", "over a fill of another partitioning"])
def test_a_single_shard_stream_read_by_two_workers_completes_in_the_first_epoch_and_splits_the_next(
    tmp_path: Path, left: bool
) -> None:
    if left:  # a run without workers stopped after 10 elements: its file is replaced, not waited on
        stopped = CachedStream(OneShard(40), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
        for element in stopped:
            if int(element["label"]) == 9:
                break
        stopped.close()
    ds = CachedStream(OneShard(40), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_tagged)
    first = [label for _, batch in loader for label in batch["label"].tolist()]
    assert first == list(range(40))
    assert ds.stats()["complete"], "the empty partition ends in the first epoch"
    by_worker: dict[int, list[int]] = defaultdict(list)
    for worker, batch in loader:
        by_worker[worker] += batch["label"].tolist()
    assert sorted(by_worker[0] + by_worker[1]) == list(range(40))
    assert len(by_worker[0]) == len(by_worker[1]) == 20, "each worker reads its half"


@pytest.mark.parametrize("rerun", [False, True], ids=["first run", "rerun"])
def test_an_element_read_in_the_main_process_does_not_block_its_workers(tmp_path: Path, rerun: bool) -> None:
    path = tmp_path / "s.mmc"
    if rerun:  # what a run that stopped after its first element leaves: a fill of 1 rank x 1 worker begun
        left = _stream(path)
        next(iter(left))
        left.close()
    ds = _stream(path)
    first = next(iter(ds))
    assert int(first["label"]) == 0
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    assert sorted(_epoch(loader)) == list(range(LENGTH))  # the fill starts again, as 1 rank x 2 workers
    assert ds.stats()["complete"]
    assert sorted(_epoch(loader)) == list(range(LENGTH))


_LEN_AT_THE_END = """
import json, sys, time
from pathlib import Path
from mmapcache.torch import CachedStream
from stream_sources import LastRankLate, rank_and_world
path, signal = Path(sys.argv[1]), Path(sys.argv[2])
ds = CachedStream(LastRankLate(48, signal=str(signal), late=1.0), path / "s.mmc", key="k")
elements = sum(1 for _ in ds)
rank, _ = rank_and_world()
if rank == 0:
    signal.touch()  # the last rank stores its last element a second after this
start = time.monotonic()
length = len(ds)
print(json.dumps({"elements": elements, "len": length, "waited": time.monotonic() - start}))
"""


def test_ranks_that_end_the_first_epoch_a_moment_apart_agree_on_the_next_epochs_length(tmp_path: Path) -> None:
    """Rank 0's part of the stream ends first: its len() waits for the last rank's end, and both count 24 (not 48)."""
    signal = tmp_path / "rank 0 ended"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _LEN_AT_THE_END, str(tmp_path), str(signal)],
            env={**_env(), "RANK": str(rank), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    found = [json.loads(process.communicate(timeout=300)[0].strip().splitlines()[-1]) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0]
    assert [run["elements"] for run in found] == [24, 24]
    assert [run["len"] for run in found] == [24, 24], "both ranks count the complete cache's share"
    assert found[0]["waited"] >= 0.5, "rank 0 waited for the last rank's last element"


def test_len_waits_a_bounded_time_for_a_rank_that_never_ends_then_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 of 2 alone (rank 1 stopped): its len() gives up after the wait, warns, and counts len(stream)."""
    from mmapcache.torch import _stream

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(_stream, "_LEN_WAIT", 0.3)
    ds = _stream.CachedStream(WithLength(LENGTH, kind="fixed"), tmp_path / "s.mmc", key="k")
    assert sum(1 for _ in ds) == LENGTH // 2
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="mmapcache"):
        assert len(ds) == LENGTH
    assert time.monotonic() - started >= 0.3
    assert "another rank's has not" in caplog.text
    ds.close()


@pytest.mark.parametrize("epoch", [-1, 1.5, "3", True, 2**64])
def test_set_epoch_refuses_what_is_not_an_epoch_naming_the_argument(tmp_path: Path, epoch: Any) -> None:
    ds = _stream(tmp_path / "s.mmc")
    with pytest.raises((TypeError, ValueError), match=r"^epoch must be an integer from 0"):
        ds.set_epoch(epoch)


@pytest.mark.parametrize("seed", [-1, 1.5, "3", None])
def test_a_stream_refuses_a_seed_that_is_not_one_naming_the_argument(tmp_path: Path, seed: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"^seed must be an integer from 0"):
        CachedStream(Numbers(4), tmp_path / "s.mmc", key="k", seed=seed)
