"""``mmapcache`` (and ``python -m mmapcache``): see, check and clean up caches from a shell.

The one module that prints. Each command calls a library function that returns
data (``mmapcache._admin.listing``, ``_collect``, ``_disk_usage``, ``Cache.verify``, ``mmapcache.remove``) and formats
it here. Errors the user can act on print ``ErrorName: message`` on stderr,
without a traceback, and exit with ``EXIT_PROBLEMS``.

``EXIT_STATUSES`` below is the one statement of what each exit status means:
``mmapcache --help``, the end of this docstring and docs/operating.md's table
are made from it (tests/admin/test_cli.py checks the table).
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
    disk_usage,
    error_message,
    format_budget,
    format_df,
    format_gc,
    format_info,
    format_ls,
    format_problems,
    gc,
    info,
    is_lock_name,
    list_caches,
    orphan_lock,
    remove_orphan_lock,
    resize,
)
from ._errors import CacheError, CacheFormatError
from ._file import LOCK_SUFFIX, SUFFIX, TEMP_MARK, budget, default_dir, remove, set_budget
from ._format import format_bytes, parse_bytes, parse_duration
from ._region import accelerated
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
Command = Callable[[argparse.Namespace], int]


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
    if args.json:
        print(_json([item.to_dict() for item in caches]))
    else:
        shown = None if args.recursive else budget(base)
        print(format_ls(caches, base, time.time(), budget=shown))
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
        stream = False
    else:
        with cache:
            problems = cache.verify(fix=args.fix)
            stream = cache._header.stream is not None
    print(format_problems(path, problems, fix=args.fix, stream=stream))
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


def _cmd_budget(args: argparse.Namespace) -> int:
    base = Path(os.path.abspath(args.dir)) if args.dir else default_dir()
    if args.set is not None or args.unset:
        found = set_budget(base, None if args.unset else args.set, reclaim_unused_after=args.reclaim_unused_after)
    else:
        if args.reclaim_unused_after is not None:
            raise CacheError("--reclaim-unused-after is set together with the budget: give --set SIZE too")
        found = budget(base)
    print(_json(found.to_dict()) if args.json else format_budget(found, time.time()))
    return EXIT_OK


# -- the parser -----------------------------------------------------------------------------


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _size(text: str) -> int:
    try:
        return parse_bytes(text, name="SIZE")
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
  mmapcache df
  mmapcache budget --set 8GiB"""

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
    (
        "budget",
        "show or set the byte budget of a cache directory",
        """\
Show the byte budget of DIR (default: the default cache directory): its limit
and where it comes from (--set, MMAPCACHE_BUDGET, or on a tmpfs the default:
the smaller of its size and half the memory cgroup's limit), what the files
there take, what live creators reserved, what is free, and each cache's share.
--set SIZE keeps a budget in the directory: every new cache there is admitted
against it, and one that does not fit is made smaller (the first indices are
cached). --reclaim-unused-after AGE lets a new cache remove caches that no
process has open and none has opened for AGE, least recently used first.
--unset removes the budget.

examples:
  mmapcache budget
  mmapcache budget /dev/shm/caches --set 8GiB --reclaim-unused-after 7d
  mmapcache budget /dev/shm/caches --json""",
        _cmd_budget,
    ),
]


def _add_arguments(name: str, sub: argparse.ArgumentParser) -> None:
    if name in ("ls", "gc", "df", "budget"):
        sub.add_argument(
            "dir", nargs="?", metavar="DIR", help="directory to look in (default: the default cache directory)"
        )
        if name != "budget":
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
    if name == "budget":
        change = sub.add_mutually_exclusive_group()
        change.add_argument("--set", type=_size, metavar="SIZE", help="keep this budget in DIR: 8GiB, 500MB, bytes")
        change.add_argument("--unset", action="store_true", help="remove the budget kept in DIR")
        sub.add_argument(
            "--reclaim-unused-after",
            type=_duration,
            metavar="AGE",
            help="with --set: new caches may remove caches unused for this long (90s, 30m, 12h, 7d, 2w)",
        )
    if name in ("ls", "info", "gc", "df", "resize", "budget"):
        sub.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmapcache",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compiled = "yes" if accelerated else "no"
    parser.add_argument("--version", action="version", version=f"mmapcache {__version__} (compiled gather: {compiled})")
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
