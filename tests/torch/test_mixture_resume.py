"""A mixture run killed with SIGKILL after saving its loader state, then resumed: nothing read twice or skipped.

Each run is a real job (``tests/mixture_run.py``: one process, or a torchrun
launch of W ranks on gloo) killed with its workers — its whole process group —
once rank 0 saved a checkpoint after step k. A fresh job, with the same number of
ranks or another, loads it and reads the rest of the run. The samples of steps
1..k of the killed job plus the resumed job's must be exactly the uninterrupted
run's (the draws of positions ``0 .. samples - 1``), and with an unchanged world
size the resumed job's batches are those the uninterrupted run hands out after
step k. The caches are cold when the first job starts: they fill during it, and
a kill can land mid-write.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from mixture_run import BATCH, expected_ids, make_mixture

pytest.importorskip("torchdata", reason="the mixture loader's stateful=True needs torchdata: pip install torchdata")

HERE = Path(__file__).resolve().parents[1]


@pytest.fixture
def dirs(cache_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Where the caches go (memory) and where the jobs write what they read and their checkpoint."""
    return cache_dir, tmp_path


RUN = HERE / "mixture_run.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    return env


def _command(world: int) -> list[str]:
    if world == 0:  # one process, no torchrun
        return [sys.executable, str(RUN)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(RUN)]


def _run(world: int, args: list[str], *, kill_after: Path | None = None) -> None:
    """The job to its end, or — ``kill_after`` — SIGKILLed with every process it started once that file appears."""
    proc = subprocess.Popen(
        [*_command(world), *args],
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        if kill_after is None:
            _, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err.decode()[-4000:]
            return
        deadline = time.monotonic() + 400
        while not kill_after.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the job ended before its checkpoint: {proc.stderr.read().decode()[-4000:]}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint within 400 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        assert proc.returncode == -signal.SIGKILL, "the job was still going when it was killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        if proc.stderr is not None:
            proc.stderr.close()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _uninterrupted(world: int, samples: int, *, scheduled: bool) -> dict[int, list[list[int]]]:
    """Each rank's batches of the whole run, computed in this process on plain sources (no files)."""
    mixture = make_mixture(None, cached=False, scheduled=scheduled)
    ranks = max(world, 1)
    out = {}
    for rank in range(ranks):
        loader = mixture.loader(BATCH, num_samples=samples, rank=rank, world_size=ranks)
        out[rank] = [batch["id"].tolist() for batch in loader]
    return out


def _kill_and_resume(
    dirs: tuple[Path, Path],
    before: int,
    after: int,
    *,
    samples: int,
    save_at: int,
    workers: int = 0,
    scheduled: bool = False,
) -> None:
    """A job of ``before`` ranks (0: no torchrun) killed after step ``save_at``, resumed on ``after``."""
    caches, tmp = dirs
    killed, resumed = tmp / "killed", tmp / "resumed"
    common = ["--dir", str(caches), "--samples", str(samples), "--workers", str(workers)]
    common += ["--checkpoint", str(tmp / "state.pt")] + (["--scheduled"] if scheduled else [])
    saved = tmp / "saved"
    _run(before, [*common, "--out", str(killed), "--save-at", str(save_at), "--saved", str(saved)], kill_after=saved)
    _run(after, [*common, "--out", str(resumed), "--resume"])
    first = [line for line in _lines(killed) if line["step"] <= save_at]
    assert len(first) == save_at * max(before, 1), "every rank recorded steps 1..k before the kill"
    second = _lines(resumed)
    seen = Counter(i for line in first + second for i in line["ids"])
    expected = Counter(expected_ids(samples, scheduled=scheduled))
    assert seen == expected, (
        f"twice: {list((seen - expected).items())[:5]}, skipped: {list((expected - seen).items())[:5]}"
    )
    if before == after:
        whole = _uninterrupted(after, samples, scheduled=scheduled)
        for rank, batches in whole.items():
            got = [line["ids"] for line in sorted(second, key=lambda x: x["step"]) if line["rank"] == rank]
            assert got == batches[save_at:], f"rank {rank}'s batches after the resume"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_killed_mid_pass_resumes_with_exactly_the_remaining_batches(
    dirs: tuple[Path, Path], workers: int
) -> None:
    _kill_and_resume(dirs, 0, 0, samples=400, save_at=random.Random(workers).randint(3, 20), workers=workers)


def test_a_run_killed_after_a_source_finished_its_first_pass_resumes_exactly(dirs: tuple[Path, Path]) -> None:
    # math (30 samples, weight 0.1) ends its first pass near position 300, step 38 of 8 samples.
    save_at = random.Random(7).randint(45, 70)
    _kill_and_resume(dirs, 0, 0, samples=800, save_at=save_at, workers=2, scheduled=True)


def test_a_torchrun_job_of_4_ranks_resumes_on_2(dirs: tuple[Path, Path]) -> None:
    _kill_and_resume(dirs, 4, 2, samples=640, save_at=random.Random(42).randint(3, 15))


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 4), (2, 2), (4, 4)])
def test_a_torchrun_job_resumes_on_another_or_the_same_number_of_ranks(
    dirs: tuple[Path, Path], before: int, after: int
) -> None:
    _kill_and_resume(dirs, before, after, samples=1280, save_at=random.Random(before * 10 + after).randint(3, 30))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_kills_at_random_steps_resume_exactly(dirs: tuple[Path, Path], seed: int) -> None:
    rng = random.Random(seed)
    workers = rng.choice([0, 2])
    _kill_and_resume(dirs, 0, 0, samples=1600, save_at=rng.randint(1, 150), workers=workers, scheduled=True)
