"""Shared helpers of the benchmarks: interleaved timing, ratios, tables, machine facts, results files.

The machines these run on are noisy (two cores shared with other jobs), so no
benchmark trusts an absolute time on its own: every variant is timed in
*rounds*, each round running every variant once in a rotated order, and the
figures reported are medians over rounds of per-round ratios against a
baseline measured in the same round. Raw per-round times are kept in the JSON
results too.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

__all__ = [
    "HERE",
    "RESULTS",
    "fmt_bytes",
    "machine_info",
    "ratio",
    "ratio_of_mins",
    "run_interleaved",
    "table",
    "write_results",
]


def run_interleaved(
    variants: dict[str, Callable[[Any], object]],
    inputs: Callable[[int], Sequence[Any]],
    *,
    rounds: int,
    ops: dict[str, int] | None = None,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Time every variant in ``rounds`` interleaved rounds; seconds per op, one median per round.

    In round ``r`` every variant is called once per element of ``inputs(r)``
    (the same inputs for all variants of that round), in an order rotated
    from round to round so that no variant always runs first or last; its
    figure for the round is the median call time divided by ``ops[name]``
    (the number of operations one call performs, default 1). The garbage
    collector is off while timing.
    """
    names = list(variants)
    per_op = {name: (ops or {}).get(name, 1) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(-warmup, rounds):
        batch = inputs(r)
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            fn = variants[name]
            calls: list[float] = []
            gc.collect()
            gc.disable()
            try:
                for item in batch:
                    start = time.perf_counter()
                    fn(item)
                    calls.append(time.perf_counter() - start)
            finally:
                gc.enable()
            if r >= 0:
                times[name].append(statistics.median(calls) / per_op[name])
    return times


def index_sets(n: int, reps: int, size: int) -> Callable[[int], list[tuple[Any, list[int]]]]:
    """Per round: ``reps`` random index batches of ``size`` in ``[0, n)``, as an array and a list (same per round)."""
    import numpy as np

    def make(r: int) -> list[tuple[Any, list[int]]]:
        rng = np.random.default_rng(1000 + r)
        out = []
        for _ in range(reps):
            idx = rng.integers(0, n, size).astype(np.intp)
            out.append((idx, idx.tolist()))
        return out

    return make


def ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of ``time(name) / time(baseline)`` (> 1: slower than the baseline)."""
    return statistics.median(t / b for t, b in zip(times[name], times[baseline], strict=True))


def ratio_of_mins(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """``min(time(name)) / min(time(baseline))``: the least-disturbed rounds, a check on :func:`ratio`."""
    return min(times[name]) / min(times[baseline])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats are printed with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(row[k]) for row in text)) if text else len(h) for k, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in text:
        lines.append(
            "  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError  # pragma: no cover


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (kept beside them in every results file)."""
    cpu = "?"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), 0
    )
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "python": platform.python_version(),
        "loadavg_start": _read("/proc/loadavg"),
    }
    for module in ("numpy", "torch", "PIL"):
        mod = sys.modules.get(module)
        if mod is not None:
            info[module] = getattr(mod, "__version__", "?")
    try:
        info["git"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git"] = "?"
    return info


def write_results(name: str, payload: dict[str, Any], *, quick: bool) -> Path:
    """Write ``results/<name>.json`` (``<name>-quick.json`` for ``--quick`` runs) and return its path."""
    RESULTS.mkdir(exist_ok=True)
    payload = {**payload, "loadavg_end": _read("/proc/loadavg")}
    path = RESULTS / f"{name}{'-quick' if quick else ''}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path
