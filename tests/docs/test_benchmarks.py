"""The benchmarks' one command, ``benchmarks/run.py --quick``, as a smoke test: the benchmarks run and plot.

Always on: ``--quick --only bench_scale`` (one benchmark, two plots) goes through all of run.py (the
steps, the machine record, the plots, ``--plot-only``). Every benchmark's quick run takes minutes
on 2 cores: opt in with ``--run-slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plots need the bench extra: pip install -e '.[bench]'")

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"
BENCHMARKS = ["bench_peers", "bench_scale", "bench_read", "bench_protocol", "bench_variable", "bench_dataloader"]
PLOTS = ["throughput.png", "fill.png", "epochs.png", "memory.png", "open_time.png", "readers.png", "variable.png"]


@dataclass(frozen=True)
class Run:
    """One ``run.py --quick``: which benchmarks it ran, the plots they draw, its output and results."""

    benchmarks: list[str]
    plots: list[str]
    done: subprocess.CompletedProcess[str]
    results: Path


SUBSET = (["bench_scale"], ["open_time.png", "readers.png"], ["--only", "bench_scale"])
# bench_cold reads hundreds of MB cold from disk (minutes): it runs with the published figures only.
EVERY = (BENCHMARKS, PLOTS, ["--skip", "bench_cold"])


@pytest.fixture(
    scope="module",
    params=[pytest.param(SUBSET, id="bench_scale"), pytest.param(EVERY, id="every", marks=pytest.mark.slow)],
)
def quick_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    benchmarks, plots, which = request.param
    results = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--no-setup", *which, "--results", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    return Run(benchmarks, plots, done, results)


def test_quick_mode_runs_the_benchmarks_asked_for_and_exits_zero(quick_run: Run) -> None:
    done, results = quick_run.done, quick_run.results
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((results / "run-quick.json").read_text())
    steps = {name: record["steps"][name]["status"] for name in quick_run.benchmarks}
    assert steps == dict.fromkeys(quick_run.benchmarks, "ok")
    if quick_run.benchmarks == SUBSET[0]:
        assert list(record["steps"]) == SUBSET[0], "--only runs nothing else"
    for name in quick_run.benchmarks:
        assert json.loads((results / f"{name}-quick.json").read_text())["quick"] is True


def test_quick_mode_records_the_machine(quick_run: Run) -> None:
    machine = json.loads((quick_run.results / "run-quick.json").read_text())["machine"]
    assert {"cpu", "cores", "memory_gib", "kernel", "python", "numpy", "torch", "filesystems"} <= set(machine)
    assert machine["filesystems"]["/dev/shm"]["type"] == "tmpfs"


def test_quick_mode_draws_its_plots_and_says_which_peers_it_skipped(quick_run: Run) -> None:
    done, results = quick_run.done, quick_run.results
    for png in quick_run.plots:
        assert (results / "img-quick" / png).stat().st_size > 10_000, png
    peers = json.loads((results / "run-quick.json").read_text())["peers"]
    missing = [name for name in ("stocaching", "tensordict") if not peers[name]]
    if missing:
        assert f"peers not set up, skipped in this run: {', '.join(missing)}" in done.stdout
    for name in missing if "bench_peers" in quick_run.benchmarks else []:
        assert f"{name} side skipped" in done.stdout


def test_plot_only_redraws_from_saved_results(quick_run: Run, tmp_path: Path) -> None:
    results = quick_run.results
    redrawn = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--plot-only", "--results", str(results), "--img", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert redrawn.returncode == 0, redrawn.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(quick_run.plots)
