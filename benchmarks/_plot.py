"""The published plots, drawn from the results files alone (``benchmarks/run.py`` calls :func:`plot_all`).

Each function takes the parsed JSON of one benchmark and a directory, writes
one PNG and returns its path. Every point is a median over rounds; error bars
span the quartiles of the rounds. Colours are fixed per library, dashed grey
lines are the limits the machine allows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from _report import BATCH_READS, FILLS, SAMPLE_READS
from matplotlib.axes import Axes
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

Results = dict[str, Any]
COLOURS = {"mmapcache": "#1f5fbf", "stocaching": "#e07b00", "tensordict": "#2a9d4b", "memmap": "#8e44ad"}
LIMIT = "#777777"
FALLBACK = "#8fb3e8"  # mmapcache's numpy fallback: a lighter mmapcache blue
GET = "#4a4a8a"
__all__ = ["plot_all"]


def _colour(name: str) -> str:
    return next((c for lib, c in COLOURS.items() if lib in name), LIMIT)


def _style(name: str) -> dict[str, Any]:
    if "out=" in name or name.endswith(" put") or "index_select" in name:
        return {"linestyle": ":", "marker": "s"}
    if _colour(name) == LIMIT:
        return {"linestyle": "-." if name.startswith("memcpy") else "--", "marker": None}
    return {"linestyle": "-", "marker": "o"}


def _size_label(n: float, _: object = None) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _size_axis(ax: Axes, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))


def _save(fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _throughput_lines(ax: Axes, sizes: list[Results], part: str, names: list[str]) -> None:
    """GB/s by sample size, medians with quartile bars, from seconds per sample (higher is faster)."""
    for name in names:
        points = [(s["row"], s[part][name]) for s in sizes if name in s[part]]
        if not points:
            continue
        rows = [row for row, _ in points]
        med = [row / e["us_per_sample"]["median"] / 1e3 for row, e in points]
        low = [m - row / e["us_per_sample"]["q3"] / 1e3 for m, (row, e) in zip(med, points, strict=True)]
        high = [row / e["us_per_sample"]["q1"] / 1e3 - m for m, (row, e) in zip(med, points, strict=True)]
        ax.errorbar(rows, med, yerr=[low, high], label=name, color=_colour(name), capsize=2, **_style(name))
    ax.set_yscale("log")
    _size_axis(ax, [s["row"] for s in sizes])
    ax.set_xlabel("sample size")
    ax.set_ylabel("GB/s (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_throughput(peers: Results, out: Path) -> Path:
    sizes = peers["sizes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    batch = sizes[0]["plan"]["batch"]
    _throughput_lines(left, sizes, "read", BATCH_READS)
    left.set_title(f"a batch of random indices (up to {batch}, ≤ 32 MiB) per call", fontsize=9)
    _throughput_lines(right, sizes, "read", SAMPLE_READS)
    right.set_title("one sample per call", fontsize=9)
    return _save(fig, out / "throughput.png", "Reads of cached samples by sample size (higher is faster)")


def plot_fill(peers: Results, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _throughput_lines(ax, peers["sizes"], "fill", [name for name in FILLS if name != "mmapcache create only"])
    ax.set_title("a fresh container filled in random order, 64 samples a call", fontsize=9)
    return _save(fig, out / "fill.png", "Filling by sample size (higher is faster)")


def _bars(ax: Axes, labels: list[str], values: list[float], errors: list[tuple[float, float]] | None = None) -> None:
    colours = [_colour(label) for label in labels]
    yerr = (
        None
        if errors is None
        else [
            [v - lo for v, (lo, _) in zip(values, errors, strict=True)],
            [hi - v for v, (_, hi) in zip(values, errors, strict=True)],
        ]
    )
    ax.bar(range(len(values)), values, color=colours, yerr=yerr, capsize=3)
    ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    import statistics

    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def plot_epochs(dataloader: Results, out: Path, *, name: str = "epochs.png", what: str = "") -> Path:
    workers = sorted({r["workers"] for r in dataloader["epochs"]})
    fig, axes = plt.subplots(1, len(workers), figsize=(5.2 * len(workers), 4.4), squeeze=False)
    for ax, w in zip(axes[0], workers, strict=True):
        rows = [r for r in dataloader["epochs"] if r["workers"] == w]
        labels = [r["variant"] for r in rows]
        stats = [_quartiles([c * 1e3 for c in dataloader["rounds_raw"][f"{v} w={w}"]["cpu"]]) for v in labels]
        _bars(ax, labels, [s[1] for s in stats], [(s[0], s[2]) for s in stats])
        for k, r in enumerate(rows):
            speed = r.get("cpu_speed_vs_stocaching")
            if speed and r["variant"] != "uncached":
                ax.annotate(f"{speed['median']:.2f}x", (k, stats[k][1]), ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("CPU ms per warm epoch (log)")
        ax.set_title(f"num_workers={w}", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    title = (
        f"Warm epochs through DataLoader{what}: {dataloader['n']} JPEGs → uint8 {dataloader['image']}, "
        f"batch {dataloader['batch']}\n(lower is better; x = speed vs stocaching)"
    )
    return _save(fig, out / name, title)


def plot_transform_epochs(dataloader: Results, out: Path) -> Path:
    """``bench_dataloader.py --transform crop-flip``: every variant with the same per-sample crop + flip."""
    return plot_epochs(dataloader, out, name="epochs_transform.png", what=", random crop + flip")


def plot_limit(limit: Results, out: Path) -> Path:
    """``bench_torch_layer.py --limit``: loader() epochs and get_many as a fraction of np.take's speed."""
    keys = [k for k in limit if k.startswith(("loader ", "get_many "))]
    values = [limit[k]["speed_vs_limit" if k.startswith("loader") else "speed"] for k in keys]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    labels = [k.replace("np.take ", "").replace("get_many ", "get_many ").replace(" vs ", "\nvs ") for k in keys]
    ax.bar(
        range(len(keys)),
        [v["median"] for v in values],
        color=COLOURS["mmapcache"],
        yerr=[[v["median"] - v["q1"] for v in values], [v["q3"] - v["median"] for v in values]],
        capsize=3,
    )
    ax.set_xticks(range(len(keys)), labels, rotation=20, ha="right", fontsize=7)
    ax.axhline(1.0, color=LIMIT, linestyle="--")
    ax.set_ylabel("speed vs np.take (1 = the limit)")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out / "limit.png", "Warm reads against np.take into fresh arrays (higher is faster)")


def plot_memory(dataloader: Results, out: Path) -> Path:
    ddp = dataloader["ddp"]
    data_mib = dataloader["data_bytes"] / 2**20
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    libs = list(ddp)
    values = [ddp[lib]["cache_bytes"] / 2**20 for lib in libs]
    _bars(ax, libs, values)
    for k, lib in enumerate(libs):
        decodes = sum(rank["epochs"][1]["decodes"] for rank in ddp[lib]["ranks"])
        text = f"{values[k] / data_mib:.2f}x data\nepoch 1: {decodes} decodes"
        ax.annotate(text, (k, values[k]), ha="center", va="bottom", fontsize=8)
    ax.axhline(data_mib, color=LIMIT, linestyle="--", label=f"the data: {data_mib:.1f} MiB")
    ax.set_ylim(0, max(values) * 1.3)
    ax.set_ylabel("cache memory in /dev/shm, MiB")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out / "memory.png", "Node memory of 2 DDP ranks (+1 DataLoader worker each)")


def plot_open(scale: Results, out: Path) -> Path:
    rows = scale["open"]["sizes"]
    names = [k for k, v in rows[0].items() if isinstance(v, dict)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sizes = [r["size"] for r in rows]
    for name in names:
        med = [r[name]["us"]["median"] for r in rows]
        low = [m - r[name]["us"]["q1"] for m, r in zip(med, rows, strict=True)]
        high = [r[name]["us"]["q3"] - m for m, r in zip(med, rows, strict=True)]
        ours = name.startswith("Cache")
        colour = COLOURS["mmapcache"] if ours else _colour(name)
        style = {"linestyle": "-", "marker": "o"} if ours else _style("limit" if name.startswith("os.") else name)
        ax.errorbar(sizes, med, yerr=[low, high], label=name, color=colour, capsize=2, **style)
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    ax.set_xlabel("cache size (4 KiB samples)")
    ax.set_ylabel("µs per open + close (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "open_time.png", "Opening an existing file, by its size (flat is the goal)")


def plot_readers(scale: Results, out: Path) -> Path:
    readers = scale["readers"]
    labels, values, errors = [], [], []
    for name in ("mmapcache get_many", "np.take on a raw mapping"):
        for procs in (1, 2):
            s = readers[name][f"gb_per_s_x{procs}"]
            scaling = f"\n2/1: {readers[name]['scaling_2_vs_1']['median']:.2f}x" if procs == 2 else ""
            labels.append(f"{name}\n{procs} process{'es' if procs > 1 else ''}{scaling}")
            values.append(s["median"])
            errors.append((s["q1"], s["q3"]))
    fig, ax = plt.subplots(figsize=(7, 4.4))
    _bars(ax, labels, values, errors)
    ax.set_xticks(range(len(labels)), labels, rotation=0, ha="center", fontsize=7)
    ax.set_ylabel("aggregate GB/s (12 KB samples, 256 a call)")
    return _save(fig, out / "readers.png", "One reader process vs two on the same file")


def plot_variable(var: Results, out: Path) -> Path:
    """Variable fields against a fixed twin of the same bytes: read speed per dataset (1 = as fast).

    ``get_many`` through the compiled gather and, where the run measured it,
    through the numpy fallback (an install without a C compiler); ``get``.
    """
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    labels, values, errors, colours = [], [], [], []
    reads = (
        ("per_round_get_many_speed", "get_many", COLOURS["mmapcache"]),
        ("per_round_get_many_numpy_speed", "get_many\nnumpy", FALLBACK),
        ("per_round_get_time", "get", GET),
    )
    for r in var["read"]:
        for key, what, colour in reads:
            if key not in r:
                continue
            q1, q2, q3 = _quartiles(r[key])
            # get is reported as a time ratio: drawn as a speed (its inverse), like get_many.
            speed = (1 / q2, 1 / q3, 1 / q1) if what == "get" else (q2, q1, q3)
            labels.append(f"{r['dataset']}\n{what}")
            values.append(speed[0])
            errors.append((speed[1], speed[2]))
            colours.append(colour)
    _bars(ax, labels, values, errors)
    ax.set_xticks(range(len(labels)), labels, rotation=0, fontsize=7)
    for bar, colour in zip(ax.patches, colours, strict=True):
        bar.set_color(colour)
    ax.axhline(1, color=LIMIT, linestyle="--", label="a fixed field of the same bytes")
    ax.axhline(0.8, color=LIMIT, linestyle=":", label="get_many target, rows of 64 B-4 KiB")
    handles = [Patch(color=c, label=w.replace("\n", " ")) for _, w, c in reads]
    ax.set_ylabel("speed vs the fixed field (1 = as fast)")
    ax.legend(handles=[*ax.get_legend_handles_labels()[0], *handles], fontsize=7, loc="upper left")
    title = "Variable-shape fields: reads against a fixed field of the same bytes"
    return _save(fig, out / "variable.png", title)


def plot_cold(cold: Results, out: Path) -> Path | None:
    """Cold-read (and fill) throughput of a disk-backed cache next to what the device does, from bench_cold."""
    bars = [bar for name, section in cold.items() if name != "machine" for bar in _cold_bars(section, name)]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(bars) + 1.5))
    labels = [b[0] for b in bars]
    med = [b[1] for b in bars]
    err = [[m - b[2][0] for m, b in zip(med, bars, strict=True)], [b[2][1] - m for m, b in zip(med, bars, strict=True)]]
    colours = [_cold_colour(label) for label in labels]
    ax.barh(range(len(bars)), med, xerr=err, color=colours, capsize=3)
    ax.set_yticks(range(len(bars)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("MB/s (log; median, bars: quartiles of the rounds)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    where = cold.get("machine", {}).get("filesystems", {}).get("/var/tmp", {})
    device = f" ({where.get('device')}, {where.get('type')})" if where else ""
    return _save(fig, out / "cold.png", f"Cold reads from a cache on disk{device} vs the device")


def _cold_colour(label: str) -> str:
    if "preadv" in label or "sequential" in label:
        return LIMIT
    if "no hints" in label or "old path" in label:
        return "#9dbce8"
    return COLOURS["mmapcache"]


def _cold_bars(section: Any, name: str) -> list[tuple[str, float, tuple[float, float]]]:
    """(label, median MB/s, quartiles) of every variant under ``section`` that reports ``MB/s``.

    Sections may nest (a section per read-ahead setting): labels carry the path.
    Quartiles come from the variant's raw seconds when bench_cold kept them: a
    variant moves the same bytes every round, so its MB/s in a round is
    (median MB/s x median seconds) / seconds.
    """
    if not isinstance(section, dict):
        return []
    if "MB/s" not in section:
        return [bar for key, sub in section.items() for bar in _cold_bars(sub, f"{name} [{key}]")]
    bars = []
    raw = section.get("raw_seconds", {})
    for variant, mbs in section["MB/s"].items():
        ts = raw.get(variant)
        q1, q2, q3 = _quartiles(ts) if ts else (1.0, 1.0, 1.0)
        bars.append((f"{name}: {variant}", mbs, (mbs * q2 / q3, mbs * q2 / q1)))
    return bars


def plot_tokens(tokens: Results, out: Path) -> Path:
    """Warm epochs over tokenized documents: mmapcache's loader against HF Arrow, LitData and the flat-memmap limit."""
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    names = [name for name, ts in tokens["seconds"].items() if ts]
    stats = [_quartiles([t * 1e3 for t in tokens["seconds"][name]]) for name in names]
    labels = [
        name.replace("mmapcache loader(ragged=", "mmapcache\nragged=")
        .rstrip(")")
        .replace(" + ", "\n+ ")
        .replace(": ", ":\n")
        .replace(" StreamingDataset", "\nStreamingDataset")
        for name in names
    ]
    _bars(ax, labels, [s[1] for s in stats], [(s[0], s[2]) for s in stats])
    ax.set_xticks(range(len(labels)), labels, rotation=0, fontsize=7)
    for bar, name in zip(ax.patches, names, strict=True):
        bar.set_color(COLOURS["mmapcache"] if name.startswith("mmapcache") else LIMIT if "limit" in name else "#e07b00")
    for k, name in enumerate(names):
        ratio = tokens["ratios"].get(name, {}).get("speed_of_mmapcache_vs_it", {}).get("median")
        if ratio is not None and not name.startswith("mmapcache"):
            ax.annotate(f"{ratio:.2f}x", (k, stats[k][1]), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per warm epoch (log; x = pad speed vs it)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    title = f"Warm epochs over {tokens['n']} tokenized documents, batch {tokens['batch']}, padded (lower is better)"
    return _save(fig, out / "tokens.png", title)


PLOTS: dict[str, list[Callable[[Results, Path], Path | None]]] = {
    "bench_peers": [plot_throughput, plot_fill],
    "bench_dataloader": [plot_epochs, plot_memory],
    "bench_scale": [plot_open, plot_readers],
    "bench_variable": [plot_variable],
    "bench_cold": [plot_cold],
    "bench_tokens": [plot_tokens],
    "bench_dataloader-transform": [plot_transform_epochs],
    "bench_torch_layer-limit": [plot_limit],
}


def plot_all(results: dict[str, Results], out: Path) -> dict[str, str]:
    """Every plot whose results are present; ``{png name or benchmark: what happened}``."""
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, str] = {}
    for name, plots in PLOTS.items():
        if name not in results:
            done[name] = "no results: not plotted"
            continue
        for plot in plots:
            path = plot(results[name], out)
            done[plot.__name__] = str(path) if path else "nothing to plot in these results"
    return done
