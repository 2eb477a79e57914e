"""Run every benchmark, record the machine, and draw the published plots: ``python benchmarks/run.py``.

* ``python benchmarks/run.py`` — the published figures (about 25 minutes on 2
  cores): sets up the peers first (stocaching's virtualenv,
  ``benchmarks/.venv-stocaching``; tensordict in this interpreter, with torch
  pinned to its installed build), runs every ``bench_*.py`` with its full
  settings, writes ``benchmarks/results/<name>.json`` and ``run.json`` (the
  machine, the versions, each step's wall time), and draws ``docs/img/*.png``.
* ``--quick`` — every benchmark on small data with few rounds (about a minute):
  a smoke test, not figures. It sets up nothing: peers that are not set up are
  skipped, and the output says so. Results go to ``<name>-quick.json`` and the
  plots to ``benchmarks/results/img-quick/`` (neither is committed).
* ``--plot-only`` — redraw the plots from the saved results, running nothing.

Each benchmark runs as its own process on this checkout (``PYTHONPATH`` starts
with the repository), one after the other; a benchmark that fails is reported
and the others still run; the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import HERE, RESULTS, machine_info, table, write_results

REPO = HERE.parent
IMG = REPO / "docs" / "img"


@dataclass(frozen=True)
class Step:
    """One benchmark script, with the arguments of its quick mode (the full mode passes none)."""

    name: str
    quick: tuple[str, ...] = ("--quick",)
    optional: bool = False  # skipped, with a note, when the script does not exist in this checkout

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"


STEPS = [
    Step("bench_peers"),
    Step("bench_scale"),
    Step("bench_read", ("--quick", "--rounds", "2")),
    Step("bench_protocol", ("--quick", "--rounds", "1")),
    Step("bench_variable", ("--quick", "--rounds", "1", "--mib", "8")),
    Step("bench_dataloader", ("--quick", "--n", "256", "--rounds", "2")),
    Step("bench_cold", ("--quick",), optional=True),
    Step("bench_shuffle", ("--quick",), optional=True),
    Step("bench_singleflight", ("--quick",), optional=True),
    Step("bench_stream", ("--quick", "--rounds", "1"), optional=True),
    Step("bench_tokens", ("--quick",), optional=True),
    Step("bench_packed", ("--quick",), optional=True),
    Step("bench_mixture", ("--quick",), optional=True),
]


def results_path(results: Path, name: str, quick: bool) -> Path:
    return results / f"{name}{'-quick' if quick else ''}.json"


def setup_peers(quick: bool, setup: bool) -> dict[str, Any]:
    """Set up stocaching's venv and tensordict when asked (the default of the full run); what is available."""
    from _peers import STOCACHING_PYTHON, setup_stocaching, setup_tensordict, stocaching_ready, tensordict_version

    if setup and not stocaching_ready():
        setup_stocaching()
    td = setup_tensordict() if setup else tensordict_version()
    peers: dict[str, Any] = {"stocaching": stocaching_ready(), "tensordict": td}
    missing = [name for name, ok in peers.items() if not ok]
    if missing:
        how = "run without --quick, or once with --setup" if quick else "run with --setup"
        print(f"peers not set up, skipped in this run: {', '.join(missing)} ({how})", flush=True)
    if peers["stocaching"]:
        probe = (
            "import numpy, torch, importlib.metadata as m; "
            "print(numpy.__version__, torch.__version__, m.version('stocaching'))"
        )
        got = subprocess.run([str(STOCACHING_PYTHON), "-c", probe], capture_output=True, text=True, check=False)
        if got.returncode == 0:
            numpy, torch, stocaching = got.stdout.split()
            peers["stocaching_venv"] = {"numpy": numpy, "torch": torch, "stocaching": stocaching}
    return peers


def run_step(step: Step, quick: bool, results: Path) -> dict[str, Any]:
    """Run one benchmark as a child process; its wall time and exit status."""
    if not step.script.exists():
        note = "not in this checkout" if step.optional else "MISSING"
        print(f"\n=== {step.name}: skipped ({note})", flush=True)
        return {"status": "skipped", "why": note}
    argv = [*step.quick] if quick else []
    argv += ["--json", str(results_path(results, step.name, quick))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print(f"\n=== {step.name} {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(step.script), *argv], cwd=REPO, env=env)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: let the benchmark remove its files, as on its own SIGTERM
            proc.terminate()
            proc.wait()
    seconds = time.perf_counter() - start
    print(f"=== {step.name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s", flush=True)
    return {"status": "ok" if code == 0 else "failed", "exit": code, "seconds": round(seconds, 1)}


def load_results(results: Path, quick: bool) -> dict[str, Any]:
    """Every benchmark's saved results of this mode, by benchmark name."""
    found = {}
    for step in STEPS:
        path = results_path(results, step.name, quick)
        if path.exists():
            found[step.name] = json.loads(path.read_text())
    return found


def plot(results: Path, img: Path, quick: bool) -> dict[str, str]:
    """Draw every plot into ``img`` and write the Markdown tables (``summary[-quick].md``) beside the results."""
    from _plot import plot_all
    from _report import summary

    found = load_results(results, quick)
    tables = results / f"summary{'-quick' if quick else ''}.md"
    tables.write_text(summary(found))
    print(f"\ntables: {tables}")
    drawn = plot_all(found, img)
    print(f"\nplots in {img}:")
    for name, what in drawn.items():
        print(f"  {name}: {what}")
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, few rounds (about a minute): a smoke test")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plots from saved results, run nothing")
    parser.add_argument("--only", help="run only these benchmarks (comma separated names, e.g. bench_peers)")
    parser.add_argument("--skip", default="", help="do not run these benchmarks (comma separated names)")
    setup = parser.add_mutually_exclusive_group()
    setup.add_argument("--setup", action="store_true", help="set up the peers also in --quick mode")
    setup.add_argument("--no-setup", action="store_true", help="never set up peers (skip those that are missing)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    parser.add_argument("--img", type=Path, help=f"plot directory (default {IMG}; quick: <results>/img-quick)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally clauses: no orphaned benchmark
    quick: bool = args.quick
    img: Path = args.img or (args.results / "img-quick" if quick else IMG)
    if args.plot_only:
        plot(args.results, img, quick)
        return 0
    wanted = set(args.only.split(",")) if args.only else {step.name for step in STEPS}
    wanted -= set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    peers = setup_peers(quick, setup=args.setup or (not quick and not args.no_setup))
    import matplotlib
    import numpy
    import torch

    del matplotlib, numpy, torch  # imported so that machine_info records their versions
    record: dict[str, Any] = {"machine": machine_info(), "quick": quick, "peers": peers, "steps": {}}
    for step in STEPS:
        if step.name in wanted:
            record["steps"][step.name] = run_step(step, quick, args.results)
    record["plots"] = plot(args.results, img, quick)
    record["seconds"] = round(time.perf_counter() - started, 1)
    path = write_results("run", record, quick=quick, path=results_path(args.results, "run", quick))
    rows = [[name, s["status"], s.get("seconds", "-")] for name, s in record["steps"].items()]
    print("\n" + table(["benchmark", "status", "seconds"], rows))
    print(f"\nall done in {record['seconds']:.0f} s; the run's record: {path}")
    return 1 if any(s["status"] == "failed" for s in record["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
