"""``mmapcache`` (and ``python -m mmapcache``): see, check and clean up caches from a shell.

The one module that prints. Each command calls a library function that returns
data (``mmapcache._admin``, ``Cache.verify``, ``mmapcache.remove``) and formats
it here. Errors the user can act on print ``ErrorName: message`` on stderr,
without a traceback, and exit with ``EXIT_PROBLEMS``.

``EXIT_STATUSES`` below is the one statement of what each exit status means:
``mmapcache --help``, the end of this docstring and docs/operating.md's table
are made from it (tests/test_cli.py checks the table).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._admin import (
    DEFAULT_GC_AGE,
    CacheInfo,
    DiskUsage,
    GcReport,
    disk_usage,
    error_message,
    gc,
    info,
    is_lock_name,
    list_caches,
    orphan_lock,
    remove_orphan_lock,
)
from ._errors import CacheError, CacheFormatError
from ._file import remove
from ._holders import spelled_pids
from ._names import LOCK_SUFFIX, SUFFIX, TEMP_MARK
from ._paths import default_dir
from ._resize import resize
from ._sizes import format_age, format_bytes, parse_duration
from ._stream import describe as describe_stream
from ._times import iso_time
from ._version import __version__
from .cache import Cache, Problem

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STATUSES: dict[int, str] = {
    EXIT_OK: "success; verify: the cache is clean; gc: also when it kept caches in use or files it "
    "may not remove (it lists them), so that a nightly cron job does not fail because a training "
    "run holds an old cache",
    EXIT_PROBLEMS: "verify found problems; rm left a file in place (in use, not a cache file); "
    "or an error, printed on stderr as `ErrorName: message`",
    EXIT_USAGE: "wrong command line (usage error)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_status_text(width: int = 79) -> str:
    """``EXIT_STATUSES`` as the indented, wrapped list that ``--help`` and this module's docstring show."""
    lines = []
    for status, meaning in EXIT_STATUSES.items():
        head = f"  {status:<5}"
        lines += textwrap.wrap(meaning, width, initial_indent=head, subsequent_indent=" " * len(head))
    return "\n".join(lines)


__doc__ = f"{__doc__ or ''}\nExit status:\n\n{exit_status_text()}\n"
# verify lists at most this many problems one by one, then counts the rest.
MAX_PROBLEMS_SHOWN = 20

Command = Callable[[argparse.Namespace], int]


# -- formatting (pure: strings in, strings out) ---------------------------------------------


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


def _ls_row(item: CacheInfo, base: Path, now: float) -> list[str]:
    name, size, used = _name(item.path, base), format_bytes(item.nbytes), _age(item.last_used, now)
    if item.ok:
        return [name, size, _fill(item), used, _in_use(item), repr(item.key), _fields(item)]
    return [name, size, item.status.upper(), used, _in_use(item), "", ""]


def _ls_footer(caches: Sequence[CacheInfo], base: Path) -> str:
    where = caches[0]
    space = f", {format_bytes(where.free)} free" if where.free is not None else ""
    fs = f" ({where.filesystem}{space})" if where.filesystem else ""
    broken = sum(not item.ok for item in caches)
    damaged = f", {broken} damaged" if broken else ""
    plural = "s" if len(caches) != 1 else ""
    total = format_bytes(sum(item.nbytes for item in caches))
    return f"{len(caches)} cache{plural}{damaged}, {total} in {base}{fs}"


def format_ls(caches: Sequence[CacheInfo], base: Path, now: float) -> str:
    """The ``ls`` table: one row per cache; under a damaged file's row, what is wrong with it."""
    if not caches:
        return f"no caches (*.mmc) in {base}"
    header = ["NAME", "SIZE", "FILLED", "LAST USED", "IN USE", "KEY", "FIELDS"]
    lines = _table(header, [_ls_row(item, base, now) for item in caches])
    out = [lines[0]]
    for item, line in zip(caches, lines[1:], strict=True):
        out.append(line)
        if item.error is not None:
            out.append(f"  {item.error}")
    out.append(_ls_footer(caches, base))
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


def format_problems(path: Path, problems: Sequence[Problem], *, fix: bool) -> str:
    if not problems:
        return f"{path}: clean"
    plural = "s" if len(problems) != 1 else ""
    lines = [f"{path}: {len(problems)} problem{plural}"]
    lines += [f"  {problem}" for problem in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        lines.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    fixed = sum(problem.fixed for problem in problems)
    if fix:
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
    for item in usage.resident:
        share = f" ({100 * item.resident / item.nbytes:.0f}%)" if item.nbytes else ""
        rows.append((item.path.name, f"{format_bytes(item.resident)} of {format_bytes(item.nbytes)} in memory{share}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}" for label, value in rows]
    lines += [f"warning: {warning}" for warning in usage.warnings]
    return "\n".join(lines)


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)


# -- commands -------------------------------------------------------------------------------


def _candidates(argument: str) -> list[Path]:
    """Where PATH may be: as given, or (a bare name: ``train``, ``train.mmc``) in the default directory."""
    path = Path(argument)
    if os.path.lexists(path) or os.sep in argument:
        return [path]
    base = default_dir()
    return [path, base / argument, base / (argument + SUFFIX)]


def _resolve(argument: str) -> Path:
    """PATH as given if it exists; a bare name (``train`` or ``train.mmc``) is looked up in the default directory."""
    candidates = _candidates(argument)
    for path in candidates:
        if os.path.lexists(path):
            return path
    if len(candidates) == 1:
        return candidates[0]
    raise FileNotFoundError(
        errno.ENOENT,
        f"no cache file {argument!r} here or in {candidates[1].parent}; `mmapcache ls` lists the caches there",
        argument,
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    base = Path(os.path.abspath(args.dir)) if args.dir else default_dir()
    caches = list_caches(base, recursive=args.recursive)
    print(_json([item.to_dict() for item in caches]) if args.json else format_ls(caches, base, time.time()))
    return EXIT_OK


def _cmd_info(args: argparse.Namespace) -> int:
    item = info(_resolve(args.path))
    print(_json(item.to_dict()) if args.json else format_info(item, time.time()))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    path = _resolve(args.path)
    try:
        cache = Cache.open(path, readonly=not args.fix)
    except CacheFormatError as error:
        # A damaged header is what verify is for: report it as a problem.
        problems = [Problem("header", None, str(error))]
    else:
        with cache:
            problems = cache.verify(fix=args.fix)
    print(format_problems(path, problems, fix=args.fix))
    return EXIT_PROBLEMS if problems else EXIT_OK


def _cmd_rm(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for argument in args.paths:
        try:
            print(_rm(argument, force=args.force))
        except (CacheError, OSError) as error:
            _print_error(error)
            status = EXIT_PROBLEMS
    return status


def _rm(argument: str, *, force: bool) -> str:
    """Remove the cache (or the orphan lock file) PATH names; say what was removed."""
    candidates = _candidates(argument)
    if not any(map(os.path.lexists, candidates)):
        # No cache, but maybe the lock file a failed creation left behind.
        lock = next((lock for lock in map(orphan_lock, candidates) if lock is not None), None)
        if lock is not None:
            remove_orphan_lock(lock)
            return f"removed {lock} (the lock file of a cache that does not exist)"
    path = _resolve(argument)
    if is_lock_name(path) and os.path.isfile(path) and not os.path.getsize(path):
        remove_orphan_lock(path)  # refuses while its cache exists
        return f"removed {path} (the lock file of a cache that does not exist)"
    size = os.lstat(path).st_size
    remove(path, force=force)
    return f"removed {path} ({format_bytes(size)})"


def _cmd_resize(args: argparse.Namespace) -> int:
    try:
        done = resize(_resolve(args.path), max_bytes=args.max_bytes)
    except ValueError as error:  # a budget that does not grow the cache, or does not parse
        _print_error(error)
        return EXIT_USAGE
    if args.json:
        print(_json(done.to_dict()))
        return EXIT_OK
    variable = (
        f", variable region {format_bytes(done.old_variable_bytes)} -> {format_bytes(done.new_variable_bytes)}"
        if done.new_variable_bytes
        else f", {done.old_capacity} -> {done.new_capacity} slots"
    )
    dropped = f"; {done.dropped} that failed their checksum were dropped" if done.dropped else ""
    print(
        f"resized {done.path}: {format_bytes(done.old_bytes)} -> {format_bytes(done.new_bytes)}{variable}; "
        f"{done.kept} cached samples kept{dropped}"
    )
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    report = gc(args.dir, older_than=args.older_than, dry_run=args.dry_run, recursive=args.recursive)
    print(_json(report.to_dict()) if args.json else format_gc(report, time.time()))
    # Keeping a cache in use is gc doing its job, not a failure: a nightly cron
    # gc must not fail because a long job still holds an old cache.
    return EXIT_OK


def _cmd_df(args: argparse.Namespace) -> int:
    usage = disk_usage(args.dir, recursive=args.recursive)
    print(_json(usage.to_dict()) if args.json else format_df(usage))
    return EXIT_OK


# -- the parser -----------------------------------------------------------------------------


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_DESCRIPTION = f"""\
See, check and clean up mmapcache cache files (*{SUFFIX}).

Caches live in MMAPCACHE_DIR if set, else in /dev/shm/mmapcache-<your user
name> (RAM). PATH arguments take a path, or a bare name (train or train{SUFFIX})
in that directory."""

_EPILOG = f"""\
exit status:
{exit_status_text()}

examples:
  mmapcache ls
  mmapcache info train.mmc
  mmapcache gc --older-than 7d --dry-run
  mmapcache df"""

_COMMANDS: list[tuple[str, str, str, Command]] = [
    (
        "ls",
        "list the caches in a directory",
        """\
List every *.mmc file in DIR (default: the default cache directory): size,
fill, when it was last used (opened, reads included), whether a process has it
open, key and fields. Damaged or unreadable files are listed as such.

examples:
  mmapcache ls
  mmapcache ls /local/nvme/caches --json""",
        _cmd_ls,
    ),
    (
        "info",
        "show everything about one cache",
        """\
Show the header of a cache in full (format version, fields with shape, dtype
and bytes, length, capacity, key, creator), how full it is, who has it open and
the free space where it lives. Reads the file without changing it.

examples:
  mmapcache info train.mmc
  mmapcache info /dev/shm/mmapcache-$USER/train.mmc --json""",
        _cmd_info,
    ),
    (
        "verify",
        "check a cache's header and every slot against its checksum",
        f"""\
Check the header and every slot: READY slots whose bytes do not match their
checksum, slots left half-written by a writer that died, invalid states.
Exit status {EXIT_OK} when clean, {EXIT_PROBLEMS} when problems were found (they are listed).
--fix resets each bad slot to empty, so that it is filled again; safe while
other processes use the cache.

examples:
  mmapcache verify train.mmc
  mmapcache verify --fix train.mmc""",
        _cmd_verify,
    ),
    (
        "rm",
        "remove caches (refuses one a process has open)",
        f"""\
Remove cache files and their side files. Refuses a cache that a process has
open (exit status {EXIT_PROBLEMS}) and names those processes. --force removes it anyway:
processes that have it open keep their (now nameless) copy until they close
it, and new openers create a new file, so they no longer share.
Also removes the lock file that a failed creation left (PATH names the cache
that does not exist, or its {LOCK_SUFFIX} file); never while a process holds it.

examples:
  mmapcache rm train.mmc
  mmapcache rm /dev/shm/mmapcache-$USER/old-*.mmc""",
        _cmd_rm,
    ),
    (
        "gc",
        "remove caches nobody has used for a while",
        f"""\
Remove the caches in DIR (default: the default cache directory) that no
process has open and none has opened for --older-than (default {DEFAULT_GC_AGE}); opening
read-only counts as use. Never touches a cache in use, however old: it is
reported as kept, with the process ids, and the exit status is still {EXIT_OK}.
Also removes what failed or killed creations left, once as old: temporary
files (*{SUFFIX}{TEMP_MARK}*) and lock files without a cache (*{SUFFIX}{LOCK_SUFFIX}).

examples:
  mmapcache gc --dry-run
  mmapcache gc --older-than 12h
  mmapcache gc /local/nvme/caches --older-than 30d --json""",
        _cmd_gc,
    ),
    (
        "resize",
        "give a cache a larger budget, keeping what it holds",
        """\
Build a copy of the cache at PATH with the budget --max-bytes (read as at
creation: the fixed part of every slot plus the values of variable and text
fields), copy every cached sample into it and put it in the old one's place.
Safe while other processes use the cache: they keep the old file until they
reopen it (what they fill meanwhile stays there). Both files take space until
then. Only grows: a smaller budget is refused.

examples:
  mmapcache resize tokens.mmc --max-bytes 8GiB""",
        _cmd_resize,
    ),
    (
        "df",
        "free space where caches live, and warnings about it",
        """\
Show the size and free space of the file system holding DIR (default: the
default cache directory), what the caches there take, and warnings: a small
/dev/shm (Docker's default is 64 MB: use --shm-size), a nearly full one, a
memory cgroup limit that tmpfs files count against, leftovers to collect.

examples:
  mmapcache df
  mmapcache df /local/nvme/caches --json""",
        _cmd_df,
    ),
]


def _add_arguments(name: str, sub: argparse.ArgumentParser) -> None:
    if name in ("ls", "gc", "df"):
        sub.add_argument(
            "dir", nargs="?", metavar="DIR", help="directory to look in (default: the default cache directory)"
        )
        sub.add_argument("-r", "--recursive", action="store_true", help="also look in subdirectories")
    if name in ("info", "verify", "resize"):
        sub.add_argument("path", metavar="PATH", help="a cache file, or a name in the default directory")
    if name == "resize":
        sub.add_argument("--max-bytes", required=True, metavar="SIZE", help="the new budget: 8GiB, 500MB, bytes")
    if name == "verify":
        sub.add_argument("--fix", action="store_true", help="reset bad slots to empty")
    if name == "rm":
        sub.add_argument("paths", nargs="+", metavar="PATH", help="cache files, or names in the default directory")
        sub.add_argument("-f", "--force", action="store_true", help="remove even while processes have it open")
    if name == "gc":
        sub.add_argument(
            "--older-than",
            type=_duration,
            default=DEFAULT_GC_AGE,
            metavar="AGE",
            help="remove caches not used for this long: 90s, 30m, 12h, 7d, 2w (default: %(default)s)",
        )
        sub.add_argument("-n", "--dry-run", action="store_true", help="show what would be removed, remove nothing")
    if name in ("ls", "info", "gc", "df", "resize"):
        sub.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmapcache",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mmapcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="also log what the library does")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, summary, description, run in _COMMANDS:
        sub = commands.add_parser(
            name,
            help=summary,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_arguments(name, sub)
        sub.set_defaults(run=run)
    return parser


# -- entry point ----------------------------------------------------------------------------


def _print_error(error: BaseException) -> None:
    print(f"{type(error).__name__}: {error_message(error)}", file=sys.stderr)


def _setup_logging(verbose: bool) -> None:
    # Library warnings (e.g. "removing ... although processes ... have it open")
    # reach the user as one plain line each.
    logger = logging.getLogger("mmapcache")
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not any(getattr(h, "name", None) == "mmapcache.cli" for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name("mmapcache.cli")
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mmapcache`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _setup_logging(args.verbose)
    try:
        return run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (`| head`) went away: not an error. Keep Python's exit
        # flush from complaining about the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (CacheError, OSError) as error:
        _print_error(error)
        return EXIT_PROBLEMS
