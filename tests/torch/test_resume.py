"""Resume mid-epoch: ``ds.loader(stateful=True)`` killed after saving its state at batch k, then resumed.

Each run is a real process (``tests/resume_run.py``) killed with SIGKILL — with
its DataLoader workers, its whole process group — once it saved a checkpoint
after batch k. A fresh process loads that checkpoint and reads the rest of the
epoch. The first k batches of the killed run followed by the resumed run's
must equal an uninterrupted run's, batch by batch: with 0 and 2 workers, over
a full cache and one still filling, shuffled by a seeded generator or by a
``NodeShardSampler``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resume_run import LENGTH, make_loader
from torch_helpers import Recorded, accesses, check_batch

from mmapcache.torch import CachedDataset

pytest.importorskip("torchdata", reason="ds.loader(stateful=True) needs torchdata: pip install torchdata")

HERE = Path(__file__).resolve().parents[1]
K = 4  # batches read before the checkpoint


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    return env


def _run(args: list[str], *, kill_after: Path | None = None) -> None:
    """``resume_run.py args`` to its end, or — ``kill_after`` — SIGKILLed with its workers once that file appears."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "resume_run.py"), *args], env=_env(), start_new_session=True, stderr=subprocess.PIPE
    )
    try:
        if kill_after is None:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()[-3000:]
            return
        deadline = time.monotonic() + 240
        while not kill_after.exists():
            assert proc.poll() is None, f"the run ended before its checkpoint: {proc.stderr.read().decode()[-3000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, "the run was still going when it was killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()


def _batches(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Always on: every pair of two settings' values, in 4 runs; the rest of the 8 is opt-in.
@pytest.mark.parametrize(
    ("workers", "fill", "sampler"),
    [
        (0, "warm", "shuffle"),
        (0, "mid-fill", "node"),
        (2, "warm", "node"),
        (2, "mid-fill", "shuffle"),
        *(
            pytest.param(*values, marks=pytest.mark.slow)
            for values in [
                (0, "warm", "node"),
                (0, "mid-fill", "shuffle"),
                (2, "warm", "shuffle"),
                (2, "mid-fill", "node"),
            ]
        ),
    ],
)
def test_a_run_killed_after_batch_k_resumes_with_exactly_the_remaining_batches(
    workers: int, fill: str, sampler: str, cache_dir: Path
) -> None:
    path, log = cache_dir / "c.mmc", cache_dir / "loads"
    common = ["--path", str(path), "--log", str(log), "--workers", str(workers), "--sampler", sampler]
    # The uninterrupted run, on a cache of its own.
    whole = make_loader(
        argparse.Namespace(path=str(cache_dir / "whole.mmc"), log=None, workers=workers, sampler=sampler)
    )
    expected = [check_batch(batch) for batch in whole]
    assert len(expected) > K + 2
    if fill == "warm":
        CachedDataset(Recorded(LENGTH), path, key="resume/v1").fill(progress=False)
    checkpoint, saved = cache_dir / "state.pt", cache_dir / "saved"
    killed, resumed = cache_dir / "killed.jsonl", cache_dir / "resumed.jsonl"
    extra = ["--checkpoint", str(checkpoint), "--saved", str(saved)]
    _run([*common, *extra, "--out", str(killed), "--save-at", str(K)], kill_after=saved)
    if fill == "mid-fill":
        filled = CachedDataset(Recorded(LENGTH), path, key="resume/v1", check=0).stats()["filled"]
        assert 0 < filled < LENGTH, "the run was killed with the cache part-filled"
    _run([*common, *extra, "--out", str(resumed), "--resume"])
    assert _batches(killed)[:K] + _batches(resumed) == expected
    if fill == "warm":
        loads = [index for _, _, index in accesses(log)]
        assert len(loads) == 2 * 3, "over a full cache each run loads only its check samples, once per job"


def test_stateful_false_is_a_plain_loader_and_a_bad_value_is_refused(cache_dir: Path) -> None:
    ds = CachedDataset(Recorded(8), cache_dir / "c.mmc", key="r")
    assert not hasattr(ds.loader(batch_size=2), "state_dict")
    assert hasattr(ds.loader(batch_size=2, stateful=True), "state_dict")
    with pytest.raises(TypeError, match="stateful must be True or False"):
        ds.loader(batch_size=2, stateful="yes")  # type: ignore[arg-type]


def test_without_torchdata_stateful_says_what_to_install(cache_dir: Path) -> None:
    code = (
        "import sys; sys.modules['torchdata'] = None\n"
        "from torch_helpers import Recorded\n"
        "from mmapcache.torch import CachedDataset\n"
        f"ds = CachedDataset(Recorded(8), {str(cache_dir / 'c.mmc')!r}, key='r')\n"
        "ds.loader(batch_size=2)\n"
        "try:\n"
        "    ds.loader(batch_size=2, stateful=True)\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install torchdata" in done.stdout
