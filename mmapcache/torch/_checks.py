"""The checks a CachedDataset makes: the right file, fresh content, a deterministic dataset.

Each is a function of what it checks, raising the error that says what to do;
the session (:mod:`._session`) decides when to call them. The two spot checks
that load samples (stale content, a deterministic dataset) run once per job:
their outcome is a :class:`Verdict` that travels with the dataset to the
processes it starts (DataLoader workers, spawned ranks), which trust it only
while the process that reached it is one of their ancestors and the file is
the one it checked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._compare import difference
from .._errors import CacheError, SchemaMismatchError, StaleCacheError
from .._field import Field
from ..cache import Cache
from ._leaves import misfit
from ._schema import Schema, check_declared_sample, describe, sample_fields
from ._settings import Settings

__all__ = [
    "Verdict",
    "check_deterministic",
    "check_file",
    "check_sample",
    "check_stale",
    "check_stale_rows",
    "file_identity",
    "schema_problem",
    "some_ready",
]

# How far up the process tree a verdict is looked for: a rank's DataLoader worker of a launcher is 3 levels down.
_MAX_GENERATIONS = 32


@dataclass(frozen=True)
class Verdict:
    """What the spot checks found in one process, for the processes it starts.

    ``process`` is that process (pid and start time: a pid alone is reused);
    ``file`` the identity (:func:`file_identity`) of the file whose content it
    found fresh, ``None`` if it checked none; ``deterministic`` whether it saw
    the dataset give one sample twice, the same.
    """

    process: tuple[int, int]
    file: str | None
    deterministic: bool

    @staticmethod
    def here(file: str | None, *, deterministic: bool) -> Verdict | None:
        """This process's verdict; ``None`` when it found nothing to pass on (or cannot name itself)."""
        me = _process(os.getpid())
        if me is None or (file is None and not deterministic):
            return None
        return Verdict(me, file, deterministic)

    def state(self) -> tuple[Any, ...]:
        """The verdict as plain values (what a pickled dataset carries: no private class names)."""
        return (*self.process, self.file, self.deterministic)

    @staticmethod
    def of(state: Any) -> Verdict | None:
        """The verdict :meth:`state` gave (``None`` for ``None`` or anything else)."""
        if not (isinstance(state, tuple) and len(state) == 4):
            return None
        pid, start, file, deterministic = state
        return Verdict((pid, start), file, bool(deterministic))

    def inherited(self) -> bool:
        """Whether this process descends from the one that reached the verdict (a process of the same job)."""
        pid = os.getpid()
        for _ in range(_MAX_GENERATIONS):
            parent = _parent(pid)
            if parent is None or parent <= 0:
                return False
            if parent == self.process[0]:
                return _process(parent) == self.process
            pid = parent
        return False


def file_identity(cache: Cache) -> str:
    """Which file ``cache`` is, across processes and path reuse: the random id drawn when it was created."""
    return cache.uuid


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the 3rd field on), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _process(pid: int) -> tuple[int, int] | None:
    """``(pid, start time in clock ticks since boot)``: names one process for as long as the machine runs."""
    fields = _stat(pid)
    return (pid, int(fields[19])) if fields else None


def check_file(cache: Cache, settings: Settings) -> None:
    """An opened file must be what this dataset makes: its shard, its declared fields and dtypes.

    Closes ``cache`` and raises :class:`SchemaMismatchError` when it is not.
    """
    problem: tuple[str, dict[str, tuple[Any, Any]]] | None = None
    path = settings.path
    if settings.cached_indices is None and cache.dataset_indices is not None:
        problem = (
            f"holds {cache.length} chosen indices of a dataset (one node's shard), but this CachedDataset "
            "caches the whole dataset. Pass the same cached_indices= as its creator, or use another path or "
            "key for the whole dataset",
            {"dataset_indices": (None, "an index table")},
        )
    else:
        problem = schema_problem(cache.fields, settings.fields, settings.dtypes, path)
    if problem is not None:
        cache.close()
        raise SchemaMismatchError(
            f"the cache at {path} (key {settings.key!r}) {problem[0]}", path=path, differences=problem[1]
        )


def schema_problem(
    found: dict[str, Field], fields: dict[str, Field] | None, dtypes: Mapping[str, Any] | None, path: Path
) -> tuple[str, dict[str, tuple[Any, Any]]] | None:
    """How a file's fields ``found`` differ from what ``fields=`` / ``dtypes=`` declare (``None``: they agree).

    ``(what the file holds against the declaration, differences)``, the words of a :class:`SchemaMismatchError`.
    """
    if fields is not None and found != fields:
        return (
            f"holds samples with fields {describe(found)}, but fields= declares "
            f"{describe(fields)}. If the data or its preprocessing changed, change the key; if the old "
            f"cache is stale, remove it (`mmapcache rm {path}`)",
            {"fields": (fields, found)},
        )
    if dtypes is not None:
        wanted = {name: Field((), dtype).dtype_name for name, dtype in dtypes.items()}
        stored = {name: found[name].dtype_name if name in found else None for name in wanted}
        if stored != wanted:
            return (
                f"stores the fields {stored}, but dtypes= asks for {wanted}. Change the key for the new "
                f"storage dtypes, or remove the old cache (`mmapcache rm {path}`)",
                {"dtypes": (wanted, stored)},
            )
    return None


def check_sample(sample: Any, index: int, found: dict[str, Field], settings: Settings) -> None:
    """The first sample a process fetches for an opened cache must fit the file's fields.

    With ``fields=`` the file holds exactly the declared fields (checked when
    it was opened) and the sample is checked against the declaration;
    otherwise a sample that does not fit the file's fields means a stale cache.
    """
    if settings.fields is not None:
        check_declared_sample(sample, index, found)
        return
    fields = sample_fields(sample, index, settings.dtypes)
    if fields != found and misfit(sample, found) is not None:
        raise SchemaMismatchError(
            f"the cache at {settings.path} (key {settings.key!r}) holds samples with fields "
            f"{describe(found)}, but dataset[{index}] has {describe(fields)}. If the data or its "
            "preprocessing changed, change the key; if the old cache is stale, remove it "
            f"(`mmapcache rm {settings.path}`)",
            path=settings.path,
            differences={"fields": (fields, found)},
        )


_SCAN_CHUNK = 1 << 16  # slots whose states one step of the scan reads
_SCAN_LIMIT = 1 << 22  # slots the scan reads at most (~30 ms): the check is a sample, never a sweep


def some_ready(cache: Cache, count: int) -> list[int]:
    """Up to ``count`` READY positions, drawn at random (this process's own draw), in O(``count``) memory.

    Only the first ``capacity`` positions can be READY. ``16 * count`` random
    probes of their states find enough in a well-filled cache; a sparse one
    is then scanned in chunks of states from a random position onwards
    (wrapping around), for at most ``_SCAN_LIMIT`` slots — a cache that sparse
    and that large may be checked on fewer samples, or none.
    """
    slots = cache.capacity
    if count <= 0 or slots == 0:
        return []
    rng = np.random.default_rng()
    probe = np.unique(rng.integers(0, slots, size=min(slots, 16 * count)))
    ready = probe[cache.contains_many(probe)]
    if len(ready) < count and len(probe) < slots:
        start = int(rng.integers(0, slots))
        found = [ready]
        have = len(ready)
        for offset in range(0, min(slots, _SCAN_LIMIT), _SCAN_CHUNK):
            chunk = (start + offset + np.arange(min(_SCAN_CHUNK, slots - offset))) % slots
            hit = chunk[cache.contains_many(chunk)]
            found.append(hit)
            have += len(hit)
            if have >= 16 * count:
                break
        ready = np.unique(np.concatenate(found))
    if len(ready) > count:
        ready = rng.choice(ready, size=count, replace=False)
    return sorted(int(i) for i in ready)


def check_stale(cached: Any, fresh: Any, index: int, settings: Settings) -> None:
    """:class:`StaleCacheError` unless the cached ``dataset[index]`` equals the one the dataset gives now."""
    found = difference(cached, fresh)
    if found is None:
        return
    field = _field_of(found)
    path, key = settings.path, settings.key
    raise StaleCacheError(
        f"the cache at {path} (key {key!r}) is stale: its dataset[{index}] differs from what "
        f"the dataset gives now ({found.replace('sample', 'cached sample', 1)}). The data or its "
        "preprocessing changed but the key did not: change the key (e.g. add a version: "
        f"'{key}/v2'), or remove the old cache (`mmapcache rm {path}`). "
        "CachedDataset(check=0) skips this check",
        path=path,
        index=index,
        field=field,
        differences={"content": (index, field)},
    )


def check_stale_rows(
    schema: Schema, read: dict[str, Any], hits: Any, indices: list[int], fresh: list[Any], settings: Settings
) -> None:
    """:func:`check_stale` for each row a read found (``hits``) against the fresh sample of its dataset index."""
    for row, (index, sample) in enumerate(zip(indices, fresh, strict=True)):
        if hits[row]:
            values = [
                read[name][row] if schema.variable[k] else read[name][row, ...] for k, name in enumerate(schema.names)
            ]
            cached = schema.build([[schema.to_tensor(value, k)] for k, value in enumerate(values)])[0]
            check_stale(cached, sample, index, settings)


def check_deterministic(first: Any, again: Any, index: int, settings: Settings) -> None:
    """A :class:`CacheError` unless ``dataset[index]`` loaded twice gave the same sample.

    A random dataset must not be frozen in the cache (one random augmentation per sample).
    """
    found = difference(again, first)
    if found is not None:
        raise CacheError(
            f"the dataset is not deterministic: dataset[{index}] gave two different samples when loaded twice "
            f"({found.replace('sample', 'the second', 1)}). A cache would freeze one of them forever (one "
            "random augmentation per sample). Move random augmentation into CachedDataset(..., transform=...), "
            "which runs after the cache on every access, and keep only the deterministic part (decode, resize, "
            "tokenize) in the wrapped dataset",
            path=settings.path,
        )


def _field_of(found: str) -> str | None:
    """The field a :func:`difference` message names (``sample[0]`` -> ``"0"``), if it names one."""
    match = re.match(r"sample((?:\[[^\]]*\])*)", found)
    parts = re.findall(r"\[([^\]]*)\]", match.group(1)) if match else []
    return "/".join(part.strip("'\"") for part in parts) or None
