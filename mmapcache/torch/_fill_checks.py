"""The checks of a stream's first epoch: the order and content of the stream must not change between passes.

A stream is cached by position: element ``j`` of a partition is stored once,
by the first pass that reaches it, and a pass that continues an interrupted
first epoch stores from the first element missing. That is right only for a
stream that gives the same elements in the same order on every pass. Two
checks guard it, both cheap beside the stream:

* :class:`StoredCheck` — a pass that continues a fill reads back what earlier
  passes stored of its partition, a chunk at a time, and compares each with
  the element the stream gives now (exactly: :func:`mmapcache._compare.difference`);
  the first that differs stops the pass with a :class:`StaleCacheError`.
* :class:`RepeatCheck` — within a pass, a digest of each element stored (its
  bytes; of a large value, 4 KiB spread over it) is kept in a bounded sample;
  a repeated ``__key__`` (WebDataset's sample names) stops the pass with a
  :class:`CacheError`, and repeated contents, once they are a noticeable part
  of the pass, are logged as a warning (real corpora hold some duplicates:
  empty documents, boilerplate).

Both errors name the idioms that cause them — a shuffle buffer, WebDataset's
``resampled=True``, changed preprocessing under the same key — and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._compare import difference
from .._errors import CacheError, StaleCacheError
from .._streams import region
from ..cache import Cache
from ._schema import Schema

__all__ = ["KEY_FIELD", "RepeatCheck", "StoredCheck"]

log = logging.getLogger("mmapcache")

KEY_FIELD = "__key__"  # WebDataset's name of a sample: unique within an epoch of a stream that does not resample
_CHUNK = 64  # stored elements read back at a time
_SAMPLE = 1 << 16  # digests a pass keeps at most (the sample thins out by halves beyond)
_WHOLE = 4096  # values up to this many bytes are digested whole; larger ones by _BLOCKS blocks spread over them
_BLOCKS = 64
_SMALL = 64  # elements of fewer bytes repeat naturally (empty documents): not counted as repeats
_WARN_COUNT, _WARN_SHARE = 16, 0.05  # repeats that make a warning: at least this many, and this share

_CHANGES = (
    "a shuffle buffer, WebDataset's resampled=True (shards drawn with replacement), a random order, or "
    "changed preprocessing under the same key"
)
_REPEATS = "WebDataset's resampled=True (shards drawn with replacement), .repeat(), a sampler with replacement"


def _fix(key: str, path: Path) -> str:
    return (
        "Give the cache a stream of a fixed order and content (no shuffle buffer or resampling before the cache: "
        "CachedStream shuffles every later epoch itself, and WebDataset's with_epoch() bounds an epoch without "
        f"resampled=True), and start again under a new key (e.g. {key + '/v2'!r}) or after removing the cache "
        f"(`mmapcache rm {path}`)"
    )


class StoredCheck:
    """What earlier passes stored of partition ``p``, compared with the elements a pass that continues it yields."""

    def __init__(self, cache: Cache, schema: Schema, p: int, *, key: str) -> None:
        self.cache, self.schema, self.p, self.key = cache, schema, p, key
        self.slots = region(cache).elements_of(p)
        self.start = self.count = 0
        self.columns: list[Any] = []

    def __len__(self) -> int:
        return len(self.slots)

    def check(self, j: int, arrays: list[Any], element: Any) -> None:
        """Element ``j`` as the stream gives it now — its storage ``arrays`` and ``element`` as a read returns it —
        against what is stored: raise if they differ.

        The bytes decide (one comparison per field); :func:`~mmapcache._compare.difference` of the
        elements confirms a difference and words it.
        """
        if j >= len(self.slots):
            return
        if not 0 <= j - self.start < self.count:
            self._read(j)
        row = j - self.start
        if all(_same(column[row], array) for column, array in zip(self.columns, arrays, strict=True)):
            return
        stored = self.schema.samples([column[row : row + 1] for column in self.columns])[0]
        found = difference(stored, element)
        if found is None:  # the same values in other bytes: NaNs of another payload
            return
        path = self.cache.path
        raise StaleCacheError(
            f"the stream cache at {path} (key {self.key!r}) holds another element {j} of partition {self.p} than "
            f"the stream gives now ({found.replace('sample', 'the stored element', 1)}): the stream's order or "
            f"content changed since an earlier pass stored it — {_CHANGES}. A stream is cached by position, so "
            f"an interrupted first epoch is continued only by a stream that gives the same elements in the same "
            f"order. {_fix(self.key, path)}",
            path=path,
            index=j,
            field=None,
            differences={"content": (j, None)},
        )

    def _read(self, j: int) -> None:
        """The stored elements ``j ..`` (a chunk), as storage columns: an array per fixed field, a list per other."""
        schema, slots = self.schema, self.slots[j : j + _CHUNK]
        read, hits = self.cache.read_many(slots, count=False)
        count = int(np.argmin(hits)) if not hits.all() else len(slots)  # a file cleared or damaged under us
        self.start, self.count = j, count
        self.columns = [read[name][:count] if not schema.variable[k] else list(read[name])[:count]
                        for k, name in enumerate(schema.names)]  # fmt: skip


def _same(stored: Any, fresh: Any) -> bool:
    """Whether a stored value (a storage array; ``str``/``bytes`` for text) has the bytes of a fresh storage array."""
    if isinstance(stored, str):
        return bool(stored.encode("utf-8", "surrogatepass") == fresh.tobytes())
    if isinstance(stored, bytes):
        return bool(stored == fresh.tobytes())
    return bool(stored.shape == fresh.shape and stored.tobytes() == fresh.tobytes())


class RepeatCheck:
    """Elements repeated within one pass over a partition: a bounded sample of their digests, with counts.

    A digest is kept when its low ``level`` bits are 0; when more than
    ``_SAMPLE`` are kept, ``level`` grows by one and half of them go. A
    repeated element has the digest of the first, so it is in the sample
    exactly when that one is: the share of repeats in the sample is the
    share in the pass.
    """

    def __init__(self, fields: Sequence[str], p: int, *, key: str, path: Path) -> None:
        self.p, self.key, self.path = p, key, path
        self.by_key = KEY_FIELD in fields
        self.column = list(fields).index(KEY_FIELD) if self.by_key else -1
        self.level = 0
        self.counts: dict[int, int] = {}
        self.seen = self.repeats = 0  # in the sample
        self.warned = False

    def add(self, first: int, digests: Sequence[int | None]) -> None:
        """The digests of the pass's elements ``first, first + 1, ...`` (``None``: too small to count)."""
        for offset, digest in enumerate(digests):
            if digest is None or digest & ((1 << self.level) - 1):
                continue
            seen = self.counts.get(digest, 0)
            self.counts[digest] = seen + 1
            self.seen += 1
            if seen:
                self.repeats += 1
                if self.by_key:
                    self._repeated_key(first + offset)
            elif len(self.counts) > _SAMPLE:
                self._thin()
        if not self.warned and self.repeats >= _WARN_COUNT and self.repeats >= _WARN_SHARE * self.seen:
            self.warned = True
            log.warning(
                "partition %d of the stream cached at %s repeats elements: %d of the %d elements sampled so far "
                "equal an earlier one of this pass. If the stream draws with replacement or repeats itself (%s), "
                "the cache stores those draws, duplicates included, and later epochs read them as the whole "
                "stream. %s",
                self.p,
                self.path,
                self.repeats,
                self.seen,
                _REPEATS,
                _fix(self.key, self.path),
            )

    def _repeated_key(self, j: int) -> None:
        raise CacheError(
            f"element {j} of partition {self.p} of the stream repeats the {KEY_FIELD} of an earlier element of this "
            f"pass: the stream draws its samples with replacement or repeats itself ({_REPEATS}), and a cache "
            f"would store the draws, duplicates included, as the whole stream for every later epoch. "
            f"{_fix(self.key, self.path)}",
            path=self.path,
        )

    def _thin(self) -> None:
        self.level += 1
        mask = (1 << self.level) - 1
        self.counts = {digest: n for digest, n in self.counts.items() if not digest & mask}
        self.seen = sum(self.counts.values())
        self.repeats = self.seen - len(self.counts)

    def digests(self, fixed: Sequence[Any], values: Sequence[list[Any]], count: int) -> list[int | None]:
        """A digest per row of a batch: ``fixed`` columns (arrays, or ``None`` for a variable field), ``values``."""
        if self.by_key:
            return self._key_digests(fixed[self.column], values[self.column], count)
        per_field: list[list[int]] = []
        fixed_size = 0
        sizes = [0] * count
        for column, arrays in zip(fixed, values, strict=True):
            if column is not None:
                rows = np.ascontiguousarray(column[:count]).reshape(count, -1).view(np.uint8)
                fixed_size += rows.shape[1]
                per_field.append(_row_digests(rows))
            else:
                sizes = [size + a.nbytes for size, a in zip(sizes, arrays, strict=True)]
                per_field.append([_value_digest(a) for a in arrays])
        small = _SMALL - fixed_size
        by_row = zip(*per_field, strict=True)
        return [hash(parts) if size >= small else None for parts, size in zip(by_row, sizes, strict=True)]

    @staticmethod
    def _key_digests(column: Any, arrays: list[Any], count: int) -> list[int | None]:
        if column is not None:
            return list(_row_digests(np.ascontiguousarray(column[:count]).reshape(count, -1).view(np.uint8)))
        return [_value_digest(a) for a in arrays]


def _spread(width: int) -> np.ndarray[Any, np.dtype[np.intp]]:
    """Byte positions of ``_BLOCKS`` blocks spread evenly over a value of ``width`` bytes (> ``_WHOLE``)."""
    block = _WHOLE // _BLOCKS
    starts = np.linspace(0, width - block, _BLOCKS).astype(np.intp)
    positions: np.ndarray[Any, np.dtype[np.intp]] = (starts[:, None] + np.arange(block)).ravel()
    return positions


# Random odd multipliers of a row's 8-byte words: a row's digest is their weighted sum modulo 2**64.
_WEIGHTS = np.random.default_rng(0x6D6D6170).integers(1, 2**63, size=_WHOLE // 8, dtype=np.uint64) | np.uint64(1)


def _row_digests(rows: np.ndarray[Any, Any]) -> list[int]:
    """A digest of each row of bytes (``(rows, width)`` uint8): its 8-byte words, all or ``_WHOLE // 8`` spread ones.

    One vectorized step per batch column (a Python ``hash`` per row would cost a copy and a call each).
    """
    count, width = rows.shape
    if width % 8:
        rows = np.concatenate([rows, np.zeros((count, 8 - width % 8), np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view(np.uint64)
    if words.shape[1] > len(_WEIGHTS):
        words = words[:, np.linspace(0, words.shape[1] - 1, len(_WEIGHTS)).astype(np.intp)]
    digests = (words * _WEIGHTS[: words.shape[1]]).sum(axis=1, dtype=np.uint64) ^ np.uint64(width)
    return [int(d) for d in digests.tolist()]


def _value_digest(array: np.ndarray[Any, Any]) -> int:
    """A digest of one variable value: its shape and its bytes (whole, or by blocks spread over them)."""
    if array.nbytes <= _WHOLE:
        return hash((array.shape, array.tobytes()))
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hash((array.shape, raw[_spread(len(raw))].tobytes()))
