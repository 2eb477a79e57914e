"""Shared helpers of the benchmarks: interleaved timing, ratios, tables, machine facts, results files.

The machines these run on are noisy (two cores shared with other jobs), so no
benchmark trusts an absolute time on its own: every variant is timed in
*rounds*, each round running every variant once in a rotated order, and the
figures reported are medians over rounds of per-round ratios against a
baseline measured in the same round. Raw per-round times are kept in the JSON
results too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

__all__ = [
    "HERE",
    "RESULTS",
    "add_json_arg",
    "bench_parser",
    "fmt_bytes",
    "index_sets",
    "machine_info",
    "meminfo",
    "offset_buffer",
    "ratio",
    "ratio_of_mins",
    "rotated",
    "run_interleaved",
    "run_rounds",
    "spread",
    "table",
    "time_round",
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
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(-warmup, rounds):
        measured = time_round(variants, inputs(r), r, ops=ops)
        if r >= 0:
            for name, t in measured.items():
                times[name].append(t)
    return times


def rotated(names: Sequence[str], r: int) -> list[str]:
    """``names`` rotated by ``r``: round ``r``'s order."""
    shift = r % len(names)
    return [*names[shift:], *names[:shift]]


def time_round(
    variants: dict[str, Callable[[Any], object]], batch: Sequence[Any], r: int, *, ops: dict[str, int] | None = None
) -> dict[str, float]:
    """Round ``r`` of :func:`run_interleaved`: each variant's median call time over ``batch`` / its ops."""
    _freeze()
    out: dict[str, float] = {}
    for name in rotated(list(variants), r):
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
        out[name] = statistics.median(calls) / (ops or {}).get(name, 1)
    return out


def _freeze() -> None:
    """Move every object alive now out of the collector's sight (``gc.freeze``).

    With torch imported a full ``gc.collect()`` takes ~0.15 s; the collections
    between timed calls then only look at what the benchmark made since.
    """
    gc.collect()
    gc.freeze()


def run_rounds(variants: dict[str, Callable[[int], float]], *, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Like :func:`run_interleaved` for variants that time themselves: ``fn(r)`` returns its own seconds.

    For work whose setup or teardown must stay out of the figure (creating a
    file, starting processes): one call per variant per round, rotated order.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    _freeze()
    for r in range(-warmup, rounds):
        for name in rotated(list(variants), r):
            gc.collect()
            seconds = variants[name](r)
            if r >= 0:
                times[name].append(seconds)
    return times


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and range of per-round values (ratios, times), and the values themselves."""
    values = list(xs)
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "rounds": values}


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


PAGE = 4096


def offset_buffer(shape: tuple[int, ...], offset: int | None) -> Any:
    """An uninitialised uint8 array starting ``offset`` bytes past a page boundary (None: wherever numpy puts it).

    Where an output buffer starts matters: a gather into one a few bytes past a
    page boundary (where glibc puts large allocations: +16 B) runs many times
    slower (4K aliasing against page-aligned source rows).
    """
    import numpy as np

    nbytes = int(np.prod(shape))
    if offset is None:
        return np.empty(shape, np.uint8)
    raw = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = -raw.__array_interface__["data"][0] % PAGE + offset
    return raw[start : start + nbytes].reshape(shape)


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


def meminfo(key: str) -> int:
    """A /proc/meminfo figure in KiB (0 if absent)."""
    return next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith(key + ":")), 0)


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (kept beside them in every results file)."""
    cpu = "?"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = meminfo("MemTotal")
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "memory_available_gib": round(meminfo("MemAvailable") / 2**20, 1),
        "kernel": platform.release(),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "python": platform.python_version(),
        "loadavg_start": _read("/proc/loadavg"),
    }
    info["filesystems"] = filesystems(["/dev/shm", tempfile.gettempdir(), "/var/tmp", str(HERE)])
    for module in ("numpy", "torch", "PIL", "tensordict", "matplotlib"):
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


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    """The ``--json PATH`` option every benchmark takes (where ``benchmarks/run.py`` wants its results)."""
    parser.add_argument("--json", type=Path, help="write the results here (default results/<name>[-quick].json)")


def filesystems(paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """For each path: the mount it is on (device, type), its size and free bytes (from /proc/mounts, statvfs)."""
    mounts = []
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            mounts.append((parts[1], parts[0], parts[2]))
    found: dict[str, dict[str, Any]] = {}
    for path in paths:
        real = os.path.realpath(path)
        mount = max(
            (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")), key=lambda m: len(m[0])
        )
        try:
            st = os.statvfs(real)
        except OSError:
            continue
        found[path] = {
            "mount": mount[0],
            "device": mount[1],
            "type": mount[2],
            "size_gib": round(st.f_blocks * st.f_frsize / 2**30, 1),
            "free_gib": round(st.f_bavail * st.f_frsize / 2**30, 1),
        }
    return found


def bench_parser(doc: str, *, quick: str, rounds: tuple[int, int]) -> argparse.ArgumentParser:
    """The options every benchmark on temporary files takes: ``--quick``, ``--json``, ``--rounds``, ``--dir``.

    ``doc`` is the script's docstring (its first paragraph describes it), ``quick``
    what ``--quick`` does, ``rounds`` the default rounds of the full and the quick run.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    add_json_arg(parser)
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {rounds[0]}, quick {rounds[1]})")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the temporary files go")
    return parser


def _rounded(value: Any) -> Any:
    """``value`` with every float cut to 6 significant digits (timings are not that precise; the files stay small)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _dumps(payload: dict[str, Any]) -> str:
    """Indented JSON, with each list of numbers on one line (the raw rounds)."""
    text = json.dumps(payload, indent=1)
    return re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def write_results(name: str, payload: dict[str, Any], *, quick: bool, path: Path | None = None) -> Path:
    """Write ``path`` (default ``results/<name>.json``, ``<name>-quick.json`` for ``--quick``); return it."""
    payload = _rounded({**payload, "loadavg_end": _read("/proc/loadavg")})
    path = path or RESULTS / f"{name}{'-quick' if quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_dumps(payload))
    tmp.replace(path)
    return path
