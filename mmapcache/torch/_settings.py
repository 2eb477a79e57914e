"""A CachedDataset's arguments, checked once: what every process of the dataset needs to find its file.

:class:`Settings` is immutable and pickles with the dataset (as its arguments,
never the data); it also answers the questions that only depend on them:
where the file is, how many positions it has, which position caches which
dataset index, and whether an index is valid.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._field import Field, FieldsLike
from .._file import SUFFIX, default_dir
from .._format import indices_digest
from ._schema import declared_fields, storage_dtypes, with_dtypes

__all__ = ["Settings", "default_path"]


@dataclass(frozen=True, eq=False)
class Settings:
    """The checked arguments of a :class:`~mmapcache.torch.CachedDataset` (except ``transform``)."""

    dataset: Any
    path: Path
    key: str
    max_bytes: int | str | None
    capacity: int | None
    copy: bool
    verify: bool
    fields: dict[str, Field] | None
    cached_indices: np.ndarray[Any, np.dtype[np.int64]] | None
    dtypes: dict[str, Any] | None
    check: int
    timeout: float = 60.0

    @classmethod
    def checked(
        cls,
        dataset: Any,
        path: str | os.PathLike[str] | None,
        *,
        key: str,
        max_bytes: int | str | None,
        capacity: int | None,
        copy: bool,
        verify: bool,
        fields: FieldsLike | None,
        cached_indices: Sequence[int] | np.ndarray[Any, Any] | None,
        dtypes: Mapping[str, Any] | None,
        check: int,
        timeout: float = 60.0,
    ) -> Settings:
        """The arguments of ``CachedDataset(...)``, each checked; TypeError/ValueError saying what is wrong."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a string naming the cached content, not {type(key).__name__}")
        if not key:
            raise ValueError("key must not be empty: it names the cached content (dataset + preprocessing)")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            raise TypeError(not_map_style(dataset))
        declared = declared_fields(fields) if fields is not None else None
        variable = declared is not None and any(field.variable for field in declared.values())
        if capacity is not None and max_bytes is not None and not variable:
            raise ValueError("give capacity= or max_bytes=, not both")
        storage = None if dtypes is None else storage_dtypes(dtypes)
        if declared is not None and storage is not None:
            declared = with_dtypes(declared, storage, where="fields=")
        if isinstance(check, bool) or not isinstance(check, int) or check < 0:
            raise ValueError(f"check must be a number of samples (0 disables the check), not {check!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
            raise ValueError(
                f"timeout must be a finite number of seconds >= 0, not {timeout!r}: how long to wait for another "
                "process creating, removing or checking the cache file before CacheTimeoutError (default 60)"
            )
        shard = None if cached_indices is None else _index_set(cached_indices, len(dataset))
        return cls(
            dataset=dataset,
            path=Path(os.path.abspath(os.fspath(path))) if path is not None else default_path(key, shard),
            key=key,
            max_bytes=max_bytes,
            capacity=capacity,
            copy=bool(copy),
            verify=bool(verify),
            fields=declared,
            cached_indices=shard,
            dtypes=storage,
            check=check,
            timeout=float(timeout),
        )

    @property
    def length(self) -> int:
        """Positions in the file: the dataset's length, or the number of ``cached_indices``."""
        return len(self.dataset) if self.cached_indices is None else len(self.cached_indices)

    def positions(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, np.dtype[np.intp]] | None:
        """Where dataset indices ``idx`` sit in the file; ``None`` when one of them is not cached there."""
        shard = self.cached_indices
        if shard is None:
            return idx
        at = np.searchsorted(shard, idx)
        if at.size and (int(at.max()) >= len(shard) or not np.array_equal(shard[at], idx)):
            return None
        return at.astype(np.intp)

    def sources(self, positions: list[int]) -> list[int]:
        """The dataset indices that file positions cache."""
        shard = self.cached_indices
        return positions if shard is None else shard[positions].tolist()

    def index(self, index: Any) -> int:
        """``index`` as a valid dataset index (negative ones count from the end); TypeError/IndexError."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            if isinstance(index, torch.Tensor) and index.ndim == 0 and not index.is_floating_point():
                index = int(index)
            else:
                raise TypeError(f"CachedDataset indices must be integers, not {type(index).__name__}")
        n = len(self.dataset)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a dataset of length {n}")
        return i

    def indices(self, indices: Any) -> np.ndarray[Any, np.dtype[np.intp]]:
        """``indices`` validated like ``ds[i]`` (negative ones count from the end), as one array."""
        given = np.asarray(indices)
        n = len(self.dataset)
        if given.ndim != 1 or given.dtype.kind not in "iu":
            return self._one_by_one(indices)
        if isinstance(indices, (list, tuple)) and not _BOOLS.isdisjoint(map(type, indices)):
            return self._one_by_one(indices)  # numpy counts True as 1; ds[i] refuses a bool index
        idx = given.astype(np.intp, copy=False)
        if not idx.size:
            return idx
        # A sampler's batch is a list of ints: the builtins find its extremes in a third of numpy's time.
        lo, hi = (min(indices), max(indices)) if type(indices) is list else (idx.min(), idx.max())
        if hi >= n:
            return self._one_by_one(indices)
        if lo < 0:
            idx = np.where(idx < 0, idx + n, idx)
            if int(idx.min()) < 0:
                return self._one_by_one(indices)
        return idx

    def _one_by_one(self, indices: Any) -> np.ndarray[Any, np.dtype[np.intp]]:
        """``indices`` checked one at a time: the error names the first bad one, as ``ds[i]`` would."""
        return np.fromiter((self.index(i) for i in indices), np.intp, len(indices))


_BOOLS = frozenset({bool, np.bool_})


def not_map_style(dataset: Any) -> str:
    """The message for a dataset that cannot be read by index: a stream is CachedStream's."""
    kind = type(dataset).__name__
    if isinstance(dataset, torch.utils.data.IterableDataset) or hasattr(dataset, "__iter__"):
        what = "an IterableDataset (a stream)" if isinstance(dataset, torch.utils.data.IterableDataset) else "iterable"
        return (
            f"dataset must be map-style (__len__ and a working __getitem__), but {kind} is {what}: cache a stream "
            "with mmapcache.torch.CachedStream, which streams it once into the cache and then reads every epoch "
            "from the file"
        )
    return (
        f"dataset must be map-style (define __len__ and __getitem__); got {kind}. A stream, read by iterating "
        "it, is cached with mmapcache.torch.CachedStream"
    )


def default_path(key: str, shard: np.ndarray[Any, Any] | None = None) -> Path:
    """``default_dir()/<key>-<hash>.mmc``; a shard's hash covers its index set too, so each shard has its own file."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._-")[:80] or "cache"
    named = hashlib.sha256(key.encode("utf-8"))
    if shard is not None:
        named.update(b"\0" + indices_digest(shard).encode("ascii"))
    return default_dir() / f"{safe}-{named.hexdigest()[:12]}{SUFFIX}"


def _index_set(indices: Any, length: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``cached_indices`` checked against the dataset's length: sorted, without repeats."""
    given = np.asarray(indices)
    if given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
        raise TypeError(
            "cached_indices must be a sequence of integer indices (e.g. NodeShardSampler(...).node_indices), "
            f"not {type(indices).__name__} of {given.dtype} with shape {given.shape}"
        )
    bad = given[(given < 0) | (given >= length)]
    if bad.size:
        raise IndexError(
            f"cached_indices holds {int(bad[0])}, out of range for a dataset of length {length} "
            "(indices from 0 to len(dataset) - 1)"
        )
    return np.unique(given.astype(np.int64))
