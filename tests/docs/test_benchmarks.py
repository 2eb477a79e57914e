"""The benchmarks' one command, ``benchmarks/run.py --quick``, as a smoke test: every benchmark runs and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plots need the bench extra: pip install -e '.[bench]'")

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"
BENCHMARKS = ["bench_peers", "bench_scale", "bench_read", "bench_protocol", "bench_variable", "bench_dataloader"]
PLOTS = ["throughput.png", "fill.png", "epochs.png", "memory.png", "open_time.png", "readers.png", "variable.png"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    results = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        # bench_cold reads hundreds of MB cold from disk and has tests of its own: it would double this one.
        [sys.executable, str(RUN), "--quick", "--no-setup", "--skip", "bench_cold", "--results", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    return done, results


def test_quick_mode_runs_every_benchmark_and_exits_zero(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, results = quick_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((results / "run-quick.json").read_text())
    assert {name: record["steps"][name]["status"] for name in BENCHMARKS} == dict.fromkeys(BENCHMARKS, "ok")
    for name in BENCHMARKS:
        assert json.loads((results / f"{name}-quick.json").read_text())["quick"] is True


def test_quick_mode_records_the_machine(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, results = quick_run
    machine = json.loads((results / "run-quick.json").read_text())["machine"]
    assert {"cpu", "cores", "memory_gib", "kernel", "python", "numpy", "torch", "filesystems"} <= set(machine)
    assert machine["filesystems"]["/dev/shm"]["type"] == "tmpfs"


def test_quick_mode_draws_every_plot_and_says_which_peers_it_skipped(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, results = quick_run
    for png in PLOTS:
        assert (results / "img-quick" / png).stat().st_size > 10_000, png
    peers = json.loads((results / "run-quick.json").read_text())["peers"]
    for name in ("stocaching", "tensordict"):
        if not peers[name]:
            assert f"{name} side skipped" in done.stdout


def test_plot_only_redraws_from_saved_results(
    quick_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    _, results = quick_run
    redrawn = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--plot-only", "--results", str(results), "--img", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert redrawn.returncode == 0, redrawn.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(PLOTS)
