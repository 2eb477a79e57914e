"""What the ``mmapcache`` command prints: the tables and reports of ``ls``, ``info``, ``verify``, ``gc`` and ``df``.

Pure functions, strings in and strings out: each formats what a library call
returned (``_inspect``, ``_collect``, ``_disk_usage``, ``Cache.verify``); ``cli.py`` prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._file import Budget, spelled_pids
from .._format import format_age, format_bytes, iso_time
from .._streams import describe as describe_stream
from ..cache import Problem
from .df import DiskUsage
from .garbage import GcReport
from .listing import CacheInfo

__all__ = [
    "MAX_PROBLEMS_SHOWN",
    "format_budget",
    "format_df",
    "format_gc",
    "format_info",
    "format_ls",
    "format_problems",
]

# verify lists at most this many problems one by one, then counts the rest.
MAX_PROBLEMS_SHOWN = 20


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]
        lines.append("  ".join(cells).rstrip())
    return lines


def _shape(shape: Sequence[int | None]) -> str:
    """``3x224x224``; a variable dimension is ``*`` (``3x*x*``)."""
    return "x".join("*" if d is None else str(d) for d in shape) if shape else "scalar"


def _fields(item: CacheInfo) -> str:
    return ", ".join(f"{f.name} {_shape(f.shape) + ' ' if f.shape else ''}{f.dtype}" for f in item.fields)


def _fill(item: CacheInfo) -> str:
    if item.filled is None or item.capacity is None:
        return "-"
    text = f"{item.filled}/{item.capacity} ({100 * (item.fill or 0):.0f}%)"
    region = item.variable
    if region is not None and region.size:
        text += f", variable {100 * region.claimed / region.size:.0f}% claimed"
    if item.refuted:
        text += ", refuted"
    return text


def _in_use(item: CacheInfo) -> str:
    if not item.in_use:
        return "no"
    return f"yes ({spelled_pids(item.pids)})" if item.pids else "yes"


def _age(timestamp: float, now: float) -> str:
    return format_age(now - timestamp)


def _span(seconds: float) -> str:
    """A duration as given on the command line: ``7d``, ``12h``, ``90s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _name(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _ls_row(item: CacheInfo, base: Path, now: float, budget: Budget | None) -> list[str]:
    name, size, used = _name(item.path, base), format_bytes(item.nbytes), _age(item.last_used, now)
    share = [] if budget is None else [_share(budget, item.path)]
    if item.ok:
        return [name, size, _fill(item), used, _in_use(item), *share, repr(item.key), _fields(item)]
    return [name, size, item.status.upper(), used, _in_use(item), *share, "", ""]


def _share(budget: Budget, path: Path) -> str:
    """A cache's allocated bytes as a percentage of the budget (``-``: not among the budget's caches)."""
    held = [share.bytes for share in budget.caches if share.path == path]
    if not held or not budget.limit:
        return "-"
    return f"{100 * held[0] / budget.limit:.0f}%"


def _budget_line(budget: Budget) -> str:
    """``budget 1.0 GiB (set in DIR/.mmapcache-budget): 600.0 MiB used (60%), 400.0 MiB free``."""
    if budget.limit is None:
        return "no budget (`mmapcache budget DIR --set SIZE` sets one)"
    percent = f" ({100 * budget.used / budget.limit:.0f}%)" if budget.limit else ""
    reserved = f", {format_bytes(budget.reserved)} reserved by creators" if budget.reserved else ""
    return (
        f"budget {format_bytes(budget.limit)} ({budget.source}): {format_bytes(budget.used)} used{percent}"
        f"{reserved}, {format_bytes(budget.free or 0)} free"
    )


def _ls_footer(caches: Sequence[CacheInfo], base: Path) -> str:
    where = caches[0]
    space = f", {format_bytes(where.free)} free" if where.free is not None else ""
    fs = f" ({where.filesystem}{space})" if where.filesystem else ""
    broken = sum(not item.ok for item in caches)
    damaged = f", {broken} damaged" if broken else ""
    plural = "s" if len(caches) != 1 else ""
    total = format_bytes(sum(item.nbytes for item in caches))
    return f"{len(caches)} cache{plural}{damaged}, {total} in {base}{fs}"


def format_ls(caches: Sequence[CacheInfo], base: Path, now: float, *, budget: Budget | None = None) -> str:
    """The ``ls`` table: one row per cache; under a damaged file's row, what is wrong with it.

    With the directory's ``budget`` (one with a limit), a ``BUDGET`` column gives each cache's share
    of it and the last line the budget's use.
    """
    if budget is not None and budget.limit is None:
        budget = None
    if not caches:
        return f"no caches (*.mmc) in {base}" + ("" if budget is None else f"; {_budget_line(budget)}")
    header = ["NAME", "SIZE", "FILLED", "LAST USED", "IN USE", *([] if budget is None else ["BUDGET"]), "KEY", "FIELDS"]
    lines = _table(header, [_ls_row(item, base, now, budget) for item in caches])
    out = [lines[0]]
    for item, line in zip(caches, lines[1:], strict=True):
        out.append(line)
        if item.error is not None:
            out.append(f"  {item.error}")
    out.append(_ls_footer(caches, base) + ("" if budget is None else f"; {_budget_line(budget)}"))
    return "\n".join(out)


def _reads(item: CacheInfo) -> str:
    """All-time hits and misses from the file's counters, and the live processes' share."""
    usage = item.usage
    if usage is None or not usage.shared:
        return "not counted (format version 1)"
    total = usage.total
    rate = "" if total.hit_rate is None else f" ({100 * total.hit_rate:.1f}% hits)"
    text = f"{total.hits} hits, {total.misses} misses{rate}, {total.written} slots written"
    uncounted = item.uncounted_pids
    text += ", by all processes" if not uncounted else ", by the processes that count into the file"
    for pid, counts in sorted(usage.processes.items()):
        text += f"; pid {pid}: {counts.hits} hits, {counts.misses} misses, {counts.written} written"
    if uncounted:
        many = len(uncounted) != 1
        text += (
            f"; {len(uncounted)} more process{'es' if many else ''} {'have' if many else 'has'} it open and "
            f"count{'' if many else 's'} only in {'themselves' if many else 'itself'} ({spelled_pids(uncounted)}: "
            "readonly handles, or all 255 usage records taken; the latter add their counts when they close)"
        )
    return text


_REFUTED = (
    "yes: a process found that the fields, inferred from a first sample, do not fit the dataset; the next "
    "CachedDataset without fields= replaces the file once nobody has it open (or `mmapcache rm` it)"
)


def _filled(item: CacheInfo) -> str:
    text = f"{item.filled} of {item.capacity} slots ({100 * (item.fill or 0):.1f}%)"
    if item.writing:
        text += f", {item.writing} being written (or left half-written by a writer that died)"
    return text


def _capacity(item: CacheInfo) -> str:
    capacity, length = item.capacity or 0, item.length or 0
    if capacity == length:
        reach = "every index"
    else:
        reach = f"indices 0..{capacity - 1} of {length}" if capacity else "no index"
    fixed = [f.nbytes for f in item.fields if f.nbytes is not None]
    per_sample = format_bytes(sum(fixed))
    if len(fixed) < len(item.fields):
        per_sample += " plus variable-shape values"
    return f"{capacity} slots ({reach} cacheable), {per_sample} per sample"


def _per_sample(nbytes: int | None) -> str:
    return "variable" if nbytes is None else format_bytes(nbytes)


def _variable(item: CacheInfo) -> str:
    region = item.variable
    if region is None:
        return ""
    share = 100 * region.claimed / region.size if region.size else 100.0
    return (
        f"{format_bytes(region.claimed)} of {format_bytes(region.size)} claimed ({share:.1f}%), "
        f"{format_bytes(region.used)} in cached values, {format_bytes(region.free)} free"
        + (f"; {region.refused} stores refused for lack of room (grow it: mmapcache resize)" if region.refused else "")
    )


def _created(created: dict[str, Any]) -> str:
    parts = [str(created.get("time", "unknown time"))]
    if "host" in created:
        parts.append(f"on {created['host']}")
    if "pid" in created:
        parts.append(f"by pid {created['pid']}")
    parts.append(f"(uid {created.get('uid', '?')}, mmapcache {created.get('mmapcache', '?')})")
    return " ".join(parts)


def _last_used(timestamp: float, now: float) -> str:
    return f"{_age(timestamp, now)} ({iso_time(timestamp)})"


def format_info(item: CacheInfo, now: float) -> str:
    """``info``: the header in full, the fill, who uses the file, and the space where it lives."""
    fields = _table(
        ["name", "shape", "dtype", "bytes/sample"],
        [
            [f.name, _shape(f.shape), f.dtype, "variable" if f.nbytes is None else format_bytes(f.nbytes)]
            for f in item.fields
        ],
    )
    in_use = (f"yes, by {spelled_pids(item.pids)}" if item.pids else "yes") if item.in_use else "no"
    free = f"{format_bytes(item.free)} free" if item.free is not None else "free space unknown"
    rows = [
        ("path", str(item.path)),
        ("format", f"version {item.version}"),
        ("key", repr(item.key)),
        ("length", f"{item.length} samples"),
        *(
            [("indices", f"a chosen set of dataset indices (index table digest {item.indices_digest})")]
            if item.indices_digest
            else []
        ),
        ("capacity", _capacity(item)),
        ("filled", _filled(item)),
        *([("refuted", _REFUTED)] if item.refuted else []),
        *([("variable region", _variable(item))] if item.variable is not None else []),
        *([("stream", describe_stream(item.stream))] if item.stream is not None else []),
        ("reads", _reads(item)),
        ("fields", fields[0]),
        *(("", line) for line in fields[1:]),
        ("size", f"{format_bytes(item.nbytes)} ({item.nbytes} bytes)"),
        ("created", _created(item.created)),
        ("last used", _last_used(item.last_used, now)),
        ("in use", in_use),
        ("file system", f"{item.filesystem or 'unknown'}, {free}"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}".rstrip() for label, value in rows)


def format_problems(path: Path, problems: Sequence[Problem], *, fix: bool, stream: bool = False) -> str:
    if not problems:
        return f"{path}: clean"
    plural = "s" if len(problems) != 1 else ""
    lines = [f"{path}: {len(problems)} problem{plural}"]
    lines += [f"  {problem}" for problem in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        lines.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    fixed = sum(problem.fixed for problem in problems)
    if fix and stream:
        # A stream's slots hold elements by arrival, counted per partition: no miss ever names a slot.
        lines.append(
            f"fixed {fixed} of {len(problems)}: those slots are empty again, and a stream cache does not refill "
            f"them by itself: `mmapcache rm {path}` and the next run fills it anew, or `mmapcache resize {path} "
            "--max-bytes SIZE` (twice its size: a partition's elements after a missing one are stored again) "
            "keeps the elements before and the next pass stores the rest"
        )
    elif fix:
        lines.append(f"fixed {fixed} of {len(problems)}: those slots are empty again and refill on the next miss")
    elif any(problem.index is not None for problem in problems):
        lines.append(f"run `mmapcache verify --fix {path}` to reset the bad slots")
    return "\n".join(lines)


def format_gc(report: GcReport, now: float) -> str:
    verb = "would remove" if report.dry_run else "removed"
    lines = []
    for item in report.removed:
        if item.kind == "leftover":
            what = "leftover of an unfinished creation"
        elif item.kind == "lock":
            what = f"lock file of a cache that no longer exists (made {_age(item.last_used, now)})"
        elif item.kind == "plan":
            what = "packing plan of a cache that no longer exists"
        elif item.kind == "check":
            what = "directory of an mmapcache.testing check that was killed"
        else:
            what = f"last used {_age(item.last_used, now)}"
        damaged = " (damaged)" if item.kind == "corrupt" else ""
        lines.append(f"{verb} {_name(item.path, report.directory)}{damaged}  {format_bytes(item.nbytes)}  {what}")
    for kept in report.kept:
        why = f"in use by {spelled_pids(kept.pids)}" if kept.in_use and kept.pids else kept.reason
        lines.append(f"kept {_name(kept.path, report.directory)}: {why} (last used {_age(kept.last_used, now)})")
    age = _span(report.older_than)
    if not report.removed:
        lines.append(f"nothing to remove in {report.directory}: no cache there unused for {age}")
    else:
        freed = "would free" if report.dry_run else "freed"
        lines.append(f"{freed} {format_bytes(report.freed)} in {report.directory}")
    return "\n".join(lines)


def format_df(usage: DiskUsage) -> str:
    used = usage.total - usage.free
    percent = f" ({100 * usage.free / usage.total:.0f}%)" if usage.total else ""
    plural = "s" if usage.caches != 1 else ""
    rows = [
        ("location", str(usage.directory)),
        ("file system", usage.filesystem or "unknown"),
        ("size", f"{format_bytes(usage.total)}, {format_bytes(used)} used, {format_bytes(usage.free)} free{percent}"),
        ("caches", f"{usage.caches} file{plural}, {format_bytes(usage.cache_bytes)}"),
    ]
    if usage.leftovers:
        rows.append(("leftovers", f"{usage.leftovers} temporary file(s), {format_bytes(usage.leftover_bytes)}"))
    if usage.memory_limit is not None:
        rows.append(("memory limit", f"{format_bytes(usage.memory_limit)} (memory cgroup; tmpfs files count)"))
    budget = usage.budget if usage.budget is not None and usage.budget.limit is not None else None
    if budget is not None:
        rows.append(("budget", _budget_line(budget).removeprefix("budget ")))
    for item in usage.resident:
        share = f" ({100 * item.resident / item.nbytes:.0f}%)" if item.nbytes else ""
        part = "" if budget is None else f", {_share(budget, item.path)} of the budget"
        rows.append(
            (item.path.name, f"{format_bytes(item.resident)} of {format_bytes(item.nbytes)} in memory{share}{part}")
        )
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}" for label, value in rows]
    lines += [f"warning: {warning}" for warning in usage.warnings]
    return "\n".join(lines)


def format_budget(budget: Budget, now: float) -> str:
    """``mmapcache budget DIR``: the limit, where it comes from, what holds it, and each cache's share."""
    if budget.reclaim_unused_after is None:
        reclaim = "never: a cache that does not fit is made smaller (opt in with --reclaim-unused-after 7d)"
    else:
        reclaim = (
            f"caches nobody has open and unused for {_span(budget.reclaim_unused_after)} are removed, least "
            "recently used first, to admit a new one"
        )
    rows = [("directory", str(budget.directory)), ("budget", _budget_line(budget).removeprefix("budget "))]
    if budget.limit is not None:
        rows.append(("reclaim", reclaim))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}" for label, value in rows]
    if budget.caches:
        table = [
            [
                share.path.name,
                format_bytes(share.bytes),
                _share(budget, share.path),
                "yes" if share.in_use else "no",
                _age(share.last_used, now),
            ]
            for share in budget.caches
        ]
        lines += _table(["NAME", "BYTES", "SHARE", "IN USE", "LAST USED"], table)
    return "\n".join(lines)
