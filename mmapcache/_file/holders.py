"""Who holds a cache open, seen from the process that was refused: itself, its own workers, or other jobs.

:class:`~mmapcache.CacheInUseError` lists the process ids holding the in-use
lock (``/proc/locks``). "Stop the jobs using it" is the wrong advice when the
holder is the caller itself — a ``Cache`` or ``CachedDataset`` it did not
close — or a process it started: DataLoader workers open the cache in their
own processes and keep it open for as long as their iterator lives
(``persistent_workers=True``: for as long as the DataLoader lives).
Forkserver workers are children of the fork server, so a holder counts as
this process's own when this process is among its ancestors, read from the
``ppid`` field of ``/proc/<pid>/stat`` (no psutil).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["held_by", "spelled_pids"]

# A parent chain deeper than this is not a DataLoader's (worker < fork server < us).
_MAX_DEPTH = 32


def held_by(pids: Sequence[int], *, other_handles: bool = False) -> str:
    """The end of a :class:`~mmapcache.CacheInUseError` message: who holds the cache, and what to do.

    ``" by this process (pid 12) and its DataLoader workers ... (pids 13, 14);
    close ...; delete the DataLoader iterators ..."`` when this process or one
    it started is among ``pids``, else ``" (process ids: 13); close every
    handle first (stop the jobs using it)"``. ``other_handles``: the caller's
    own handle does not count (``clear``), only its other ones do.
    """
    me = os.getpid()
    this = me in pids
    children = [pid for pid in pids if pid != me and _descends_from(pid, me)]
    if not this and not children:
        listed = f" (process ids: {', '.join(map(str, pids))})" if pids else ""
        every = "every other handle" if other_handles else "every handle"
        return f"{listed}; close {every} first (stop the jobs using it)"
    handles = "other handles" if other_handles else "handles"
    others = [pid for pid in pids if pid != me and pid not in children]
    who: list[str] = []
    todo: list[str] = []
    if this:
        who.append(f"this process (pid {me})")
        todo.append(
            f"close this process's {handles} of it first (ds.close() on a CachedDataset, cache.close() on a Cache)"
        )
    if children:
        whose = "its" if this else "this process's"
        who.append(f"{whose} DataLoader workers or other child processes ({spelled_pids(children)})")
        todo.append(
            "delete the DataLoader iterators whose workers hold it (del the iterator, or the loader: with "
            "persistent_workers=True the workers keep the cache open for as long as the DataLoader lives), "
            "or end the other child processes using it"
        )
    if others:
        who.append(f"other processes ({spelled_pids(others)})")
        todo.append("stop the other jobs using it")
    return f" by {' and '.join(who)}; {'; '.join(todo)}"


def spelled_pids(pids: Sequence[int]) -> str:
    """``pid 12`` or ``pids 12, 13`` ("" for none), as messages and the command line show them."""
    if not pids:
        return ""
    return f"pid {pids[0]}" if len(pids) == 1 else f"pids {', '.join(map(str, pids))}"


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(_MAX_DEPTH):
        parent = _parent(pid)
        if parent is None or parent <= 1:
            return False
        if parent == ancestor:
            return True
        pid = parent
    return False


def _parent(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/<pid>/stat``; ``None`` if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so
    # the fields start after the last ")".
    fields = text[text.rfind(b")") + 1 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None
