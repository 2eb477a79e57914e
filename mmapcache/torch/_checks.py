"""The checks a CachedDataset makes once per process: the right file, fresh content, a deterministic dataset.

Each is a function of what it checks, raising the error that says what to do;
the session (:mod:`._session`) decides when to call them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .._compare import difference
from .._errors import CacheError, SchemaMismatchError, StaleCacheError
from .._field import Field
from ..cache import Cache
from ._leaves import misfit
from ._schema import check_declared_sample, describe, sample_fields
from ._settings import Settings

__all__ = [
    "check_deterministic",
    "check_file",
    "check_sample",
    "check_stale",
    "some_ready",
]


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
    elif settings.fields is not None and cache.fields != settings.fields:
        problem = (
            f"holds samples with fields {describe(cache.fields)}, but fields= declares "
            f"{describe(settings.fields)}. If the data or its preprocessing changed, change the key; if the old "
            f"cache is stale, remove it (`mmapcache rm {path}`)",
            {"fields": (settings.fields, cache.fields)},
        )
    elif settings.dtypes is not None:
        wanted = {name: Field((), dtype).dtype_name for name, dtype in settings.dtypes.items()}
        found = {name: cache.fields[name].dtype_name if name in cache.fields else None for name in wanted}
        if found != wanted:
            problem = (
                f"stores the fields {found}, but dtypes= asks for {wanted}. Change the key for the new "
                f"storage dtypes, or remove the old cache (`mmapcache rm {path}`)",
                {"dtypes": (wanted, found)},
            )
    if problem is not None:
        cache.close()
        raise SchemaMismatchError(
            f"the cache at {path} (key {settings.key!r}) {problem[0]}", path=path, differences=problem[1]
        )


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
