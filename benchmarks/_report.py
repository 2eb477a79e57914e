"""The headline tables of docs/benchmarks.md as Markdown, from the results files alone (``results/summary.md``).

Every cell is a median over rounds of a per-round ratio to a baseline measured
in the same process and round, with the quartiles in brackets where they matter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _common import fmt_bytes

Results = dict[str, Any]
# bench_peers' variants by table (and plot panel), mmapcache first, the limits last.
BATCH_READS = [
    "mmapcache get_many",
    "mmapcache get_many(out=)",
    "stocaching stack(get_slot)",
    "tensordict mmt[idx]",
    "tensordict index_select(mmt)",
    "np.memmap[idx]",
    "np.take (in RAM)",
    "memcpy (in RAM)",
]
SAMPLE_READS = [
    "mmapcache get",
    "stocaching get_slot(i).clone()",
    "tensordict mmt[i].clone()",
    "np.array(memmap[i])",
    "ndarray[i].copy() (in RAM)",
]
FILLS = [
    "mmapcache put_many",
    "mmapcache put",
    "mmapcache create only",
    "stocaching set_slot",
    "tensordict mmt[idx] = rows",
    "np.memmap[idx] = rows",
    "np.empty (in RAM)",
]

__all__ = ["BATCH_READS", "FILLS", "SAMPLE_READS", "summary"]


def _md(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _q(s: dict[str, Any] | None, digits: int = 3) -> str:
    if not s:
        return "—"
    return f"{s['median']:.{digits}g} [{s['q1']:.{digits}g}..{s['q3']:.{digits}g}]"


def _by_size(peers: Results, part: str, baseline: str, names: list[str]) -> str:
    sizes = peers["sizes"]
    names = [name for name in names if any(name in s[part] for s in sizes)]
    rows = []
    for name in names:
        cells = []
        for s in sizes:
            entry = s[part].get(name)
            speed = entry.get(f"speed_vs[{baseline}]") if entry else None
            cells.append(f"{speed['median']:.3g}" if speed else "—")
        rows.append([name, *cells])
    # The baseline's own speed in each process: the two ratios compare only if these agree.
    bases = (baseline, f"{baseline} [stocaching's process]") if baseline in names else ()
    gb = [
        [f"{name} GB/s", *[f"{s[part][name]['gb_per_s']:.3g}" if name in s[part] else "—" for s in sizes]]
        for name in bases
        if any(name in s[part] for s in sizes)
    ]
    return _md(["speed vs " + baseline, *[fmt_bytes(s["row"]) for s in sizes]], [*rows, *gb])


def peers_tables(peers: Results) -> str:
    take, empty = "np.take (in RAM)", "np.empty (in RAM)"
    return (
        "Batched reads: speed vs `np.take` on an in-RAM array (same process, same round; > 1 is faster)\n\n"
        + _by_size(peers, "read", take, BATCH_READS)
        + "\n\nOne sample per call: speed vs the same `np.take`\n\n"
        + _by_size(peers, "read", take, SAMPLE_READS)
        + "\n\nFills of a fresh container: speed vs `np.empty` + assignment (same process, same round)\n\n"
        + _by_size(peers, "fill", empty, FILLS)
    )


def epochs_table(dl: Results) -> str:
    rows = [
        [
            r["variant"],
            r["workers"],
            f"{r['cpu_s'] * 1e3:.3g}" if r["cpu_s"] < 1 else f"{r['cpu_s'] * 1e3:.0f}",
            _q(r.get("cpu_speed_vs_stocaching")),
            f"{r['speedup_vs_uncached']:.3g}",
        ]
        for r in dl["epochs"]
    ]
    return _md(["variant", "workers", "CPU ms / warm epoch", "CPU speed vs stocaching", "x uncached (wall)"], rows)


def memory_table(dl: Results) -> str:
    rows = []
    for lib, res in dl.get("ddp", {}).items():
        mem = res["memory"]["smaps_rollup_sum"]
        decodes = [rank["epochs"][1]["decodes"] for rank in res["ranks"]]
        rows.append(
            [
                lib,
                fmt_bytes(res["cache_bytes"]),
                f"{res['cache_vs_data']:.2f}",
                fmt_bytes(mem["Pss"]),
                str(decodes),
            ]
        )
    return _md(["library", "cache memory in /dev/shm", "x data", "sum of PSS, 4 processes", "epoch-1 decodes"], rows)


def scale_tables(scale: Results) -> str:
    readers = scale["readers"]
    rows = [
        [name, f"{r['gb_per_s_x1']['median']:.3g}", f"{r['gb_per_s_x2']['median']:.3g}", _q(r["scaling_2_vs_1"])]
        for name, r in readers.items()
        if isinstance(r, dict) and "scaling_2_vs_1" in r
    ]
    text = _md(["reader", "1 process GB/s", "2 processes GB/s", "2 / 1"], rows)
    opened = scale["open"]["sizes"]
    if opened:
        names = [k for k, v in opened[0].items() if isinstance(v, dict)]
        rows = [
            [
                fmt_bytes(r["size"]),
                r["slots"],
                f"{r['create_s']:.3g}",
                *[f"{r[k]['us']['median']:.3g}" for k in names],
                _q(r[names[0]]["time_vs_mmap"]),
            ]
            for r in opened
        ]
        headers = ["size", "slots", "create s", *[f"{k} µs" for k in names], f"{names[0]} / mmap"]
        text += "\n\n" + _md(headers, rows)
    for size, why in scale["open"].get("skipped", {}).items():
        text += f"\n\nSkipped {size}: {why}."
    return text


def variable_table(var: Results) -> str:
    """bench_variable's headline: reads, space and fill of variable fields against a fixed twin of the same bytes."""
    from _common import spread

    rows = []
    for r in var["read"]:
        label = f"{r['dataset']} ({fmt_bytes(r['mean_sample_bytes'])} mean)"
        rows.append([label, "`get_many` speed vs fixed", _q(spread(r["per_round_get_many_speed"]))])
        if "per_round_get_many_numpy_speed" in r:  # the same, through the numpy fallback
            fallback = _q(spread(r["per_round_get_many_numpy_speed"]))
            rows.append([label, "`get_many` speed vs fixed, numpy fallback", fallback])
        rows.append([label, "`get` time vs fixed", _q(spread(r["per_round_get_time"]))])
    space = var["space"]
    what = f"tokens {space.get('dtype', 'int32')}"
    rows.append([what, "file / (payload + records) at a 1.05x budget", f"{space['at_bound_ratio']:.3f}"])
    if space.get("smallest_ratio") is not None:
        rows.append([what, "smallest file that stores every sample", f"{space['smallest_ratio']:.3f}"])
    rows.append([what, "padded to the longest document instead", f"{space['padded_ratio']:.1f}"])
    fill = var["fill"]
    rows.append(["tokens", "fill throughput, 2 processes / 1", _q(spread(fill["variable_speedup"]))])
    rows.append(["fixed twin", "fill throughput, 2 processes / 1", _q(spread(fill["fixed_speedup"]))])
    return _md(["data", "figure", "median [quartiles]"], rows)


SECTIONS: dict[str, tuple[str, Callable[[Results], str]]] = {
    "bench_peers": ("Reads and fills by sample size", peers_tables),
    "bench_scale": ("Readers and open time", scale_tables),
    "bench_dataloader": ("Warm epochs", epochs_table),
    "bench_variable": ("Variable-shape fields", variable_table),
}


def summary(results: dict[str, Results]) -> str:
    """The tables of every benchmark present in ``results``, as one Markdown document."""
    parts = []
    for name, (title, render) in SECTIONS.items():
        if name in results:
            parts.append(f"## {title} ({name})\n\n{render(results[name])}")
    if "bench_dataloader" in results and "ddp" in results["bench_dataloader"]:
        parts.append(f"## Node memory, 2 DDP ranks (bench_dataloader)\n\n{memory_table(results['bench_dataloader'])}")
    return "\n\n".join(parts) + "\n"
