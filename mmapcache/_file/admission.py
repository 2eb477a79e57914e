"""Admission of a new file against its directory's byte budget (:mod:`.budgets`), and reclaim.

Admission (:func:`admitted`, the one function every creation path calls where the file size is
decided: ``open_or_create`` for ``Cache.open``, ``CachedDataset`` and ``CachedStream``, and
``resize``) runs under the directory's lock, an exclusive ``flock`` on the directory itself
(never deleted while a cache is in it): two creators never both take the last bytes. A file
that does not fit is planned smaller — fewer slots, a smaller variable region, so the first
indices are cached — with one warning; when not even a header and one slot (and one page of
variable region) fit, :class:`CacheSpaceError`.
With ``reclaim_unused_after`` set, caches that nobody has open and that were last opened longer
ago than that are removed first, least recently used first; a cache in use is never removed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CacheError, CacheSpaceError
from .._format import Header, compute_layout, extent_size_for, format_age, format_bytes, new_header
from .budgets import (
    BUDGET_ENV,
    PAGE,
    RECLAIM_GRACE,
    Budget,
    CacheShare,
    directory_lock,
    ledger_of,
    limit_of,
    release,
    remove_dead_temps,
    reserve,
    settings_of,
)
from .paths import filesystem_type, is_memory_filesystem
from .removal import remove

__all__ = ["Admission", "admitted"]

log = logging.getLogger("mmapcache")


# -- admission -------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """What admission let a new file be: its ``header`` (smaller than asked when ``shrunk``), what it removed."""

    header: Header
    shrunk: bool = False
    removed: tuple[CacheShare, ...] = ()
    budget: Budget | None = field(default=None, compare=False)


@contextmanager
def admitted(path: Path, header: Header, *, timeout: float, floor: Header | None = None) -> Iterator[Admission]:
    """Reserve the bytes of the file ``header`` plans at ``path`` against its directory's budget.

    Yields the header to create (the one asked for, or a smaller one that
    fits), with the reservation held until the body ends: the body allocates
    the file and gives it its name. ``floor``: the smallest the file may be
    (``resize`` never shrinks a cache); without one, a header and one slot.
    """
    directory = path.parent
    settings = settings_of(directory)
    limit = limit_of(directory, settings)
    if limit[0] is None:
        yield Admission(header)
        return
    wanted = _allocated(compute_layout(header).file_size)
    with directory_lock(directory, timeout):
        remove_dead_temps(directory)
        reclaim = isinstance(settings.get("reclaim_unused_after"), (int, float))
        ledger = ledger_of(directory, settings, collect=True, probe=reclaim, limit=limit)
        removed: tuple[CacheShare, ...] = ()
        if wanted > _room(ledger) and ledger.reclaim_unused_after is not None:
            removed = _reclaim(ledger, wanted - _room(ledger), ledger.reclaim_unused_after, path)
            if removed:
                ledger = ledger_of(directory, settings, collect=True, probe=True, limit=limit)
        room = _room(ledger)
        chosen = header if wanted <= room else _smaller(header, room, floor, directory)
        if chosen is None:
            raise _no_budget(path, wanted, ledger, grow=floor is not None)
        size = _allocated(compute_layout(chosen).file_size)
        reservation = reserve(directory, path, size)
    try:
        admission = Admission(chosen, chosen is not header, removed, ledger)
        if admission.shrunk:
            message = _shrunk_message(path, header, chosen, ledger, removed)
            warnings.warn(message, RuntimeWarning, stacklevel=_outside_level())
        elif removed:
            log.warning("made room for %s under %s", path, ledger.describe() + _removed_text(removed))
        yield admission
    finally:
        release(reservation, directory)


def _outside_level() -> int:
    """The ``stacklevel`` of the first caller outside mmapcache (and contextlib), for a warning of the caller."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level


def _room(ledger: Budget) -> int:
    """What a new file may take: what is free, less the page of the reservation file that admits it."""
    assert ledger.limit is not None
    return ledger.limit - ledger.used - ledger.reserved - PAGE


def _allocated(size: int) -> int:
    return -(-size // PAGE) * PAGE


def _smaller(header: Header, room: int, floor: Header | None, directory: Path) -> Header | None:
    """The largest header like ``header`` (fewer slots, a smaller variable region) whose file fits ``room``."""
    on_disk = not is_memory_filesystem(filesystem_type(directory))
    top_slots, top_region = header.capacity, header.variable_size
    low_slots = floor.capacity if floor is not None else min(1, top_slots)
    low_region = floor.variable_size if floor is not None else min(PAGE, top_region)

    def made(fraction: float) -> Header:
        slots = low_slots + math.floor((top_slots - low_slots) * fraction)
        region = low_region + (top_region - low_region) * fraction
        region = max(low_region, int(region) // PAGE * PAGE) if top_region else 0
        return new_header(
            header.fields,
            slots if header.stream is not None else header.length,
            slots,
            header.key,
            header.created,
            variable_size=region,
            extent_size=extent_size_for(region) if region else 0,
            indices_digest=header.indices_digest,
            on_disk=on_disk,
            stream=header.stream,
        )

    def fits(candidate: Header) -> bool:
        return _allocated(compute_layout(candidate).file_size) <= room

    smallest = made(0.0)
    if not fits(smallest):
        return None
    # Bisect the fraction of the way from the floor to the plan (the file size grows with both).
    low, high = 0.0, 1.0
    steps = max(1, (top_slots - low_slots).bit_length(), (top_region - low_region).bit_length() - 11)
    for _ in range(min(steps + 2, 64)):
        middle = (low + high) / 2
        if fits(made(middle)):
            low = middle
        else:
            high = middle
    chosen = made(low)
    if floor is not None and (chosen.capacity, chosen.variable_size) == (floor.capacity, floor.variable_size):
        return None  # resize: no room to grow at all
    return chosen


def _shrunk_message(path: Path, asked: Header, chosen: Header, ledger: Budget, removed: Sequence[CacheShare]) -> str:
    what = f"{chosen.capacity} of the {asked.capacity} slots"
    if asked.variable_size:
        what += f" and {format_bytes(chosen.variable_size)} of the {format_bytes(asked.variable_size)} variable region"
    first = "" if asked.stream is not None else f" (the first {chosen.capacity} indices are cached, the rest read"
    first += "" if asked.stream is not None else " from the dataset every time)"
    made, wanted = _allocated(compute_layout(chosen).file_size), _allocated(compute_layout(asked).file_size)
    sizes = (format_bytes(made), format_bytes(wanted))
    if sizes[0] == sizes[1]:
        sizes = (f"{made} bytes", f"{wanted}")
    return (
        f"{path} does not fit {ledger.describe()}{_removed_text(removed)}; it was made with {what}{first}, "
        f"{sizes[0]} instead of {sizes[1]}. {_how_to_raise(ledger)}"
    )


def _no_budget(path: Path, wanted: int, ledger: Budget, *, grow: bool) -> CacheSpaceError:
    what = "no room to grow it in" if grow else "not even its header and one slot fit"
    return CacheSpaceError(
        f"cannot {'resize' if grow else 'create'} {path}: {what} {ledger.describe()}, "
        f"{format_bytes(max(_room(ledger), 0))} left (the whole file takes {format_bytes(wanted)}). "
        + _how_to_raise(ledger),
        path=path,
        needed=wanted,
        free=max(_room(ledger), 0),
    )


def _how_to_raise(ledger: Budget) -> str:
    where = ledger.directory
    text = (
        f"Raise it with `mmapcache budget {where} --set SIZE` (or {BUDGET_ENV}=SIZE for one process), "
        f"remove caches you no longer need (`mmapcache ls {where}`, `mmapcache rm PATH`, `mmapcache gc`)"
    )
    if ledger.reclaim_unused_after is None:
        text += ", or let new caches remove unused ones with `--reclaim-unused-after 7d`"
    return text


def _removed_text(removed: Sequence[CacheShare]) -> str:
    if not removed:
        return ""
    now = time.time()
    names = ", ".join(
        f"{share.path.name} ({format_bytes(share.bytes)}, last used {format_age(now - share.last_used)})"
        for share in removed
    )
    return f", after removing the unused caches {names}"


# -- reclaim ---------------------------------------------------------------------------


def _reclaim(ledger: Budget, needed: int, after: float, path: Path) -> tuple[CacheShare, ...]:
    """Remove unused caches last opened over ``after`` seconds ago, least recently used first, until ``needed``."""
    cutoff = time.time() - after
    removed: list[CacheShare] = []
    freed = 0
    for share in ledger.caches:  # least recently used first
        if freed >= needed:
            break
        if share.in_use or share.last_used > min(cutoff, time.time() - RECLAIM_GRACE) or share.path == path:
            continue
        try:
            st = os.stat(share.path, follow_symlinks=False)
            if st.st_mtime > min(cutoff, time.time() - RECLAIM_GRACE):
                continue  # opened since the ledger was read
            # A creator or resizer of it holds its creation lock: wait for nobody (timeout 0).
            remove(share.path, timeout=0, same_as=st)
        except (CacheError, OSError) as error:
            log.info("kept %s while making room for %s: %s", share.path, path, error)
            continue
        log.warning(
            "removed %s (%s, unused, last used %s) to make room for %s",
            share.path,
            format_bytes(share.bytes),
            format_age(time.time() - share.last_used),
            path,
        )
        removed.append(share)
        freed += share.bytes
    return tuple(removed)
