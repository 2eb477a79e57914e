"""One process's use of a CachedDataset's file: the handle, the counters, the read path and the miss path.

A :class:`Session` is made in every process that uses the dataset (it pickles
as the dataset's :class:`~._settings.Settings` and starts afresh after
unpickling, and its counters and lock start afresh after ``fork``). It opens
the file on first use — or creates it from the first batch that misses —
runs the checks (:mod:`._checks`) at the right moments, reads hits and loads,
checks and stores misses. Samples come back before the dataset's ``transform``.

Misses go through the core's single flight (the rules of
``Cache.get_or_load_many``): a sample that another process — another
DataLoader worker, another job — is loading is waited for and read, not
loaded again. The batch read that found the misses is handed on
(``SingleFlight.load_misses``), and the samples loaded are converted once,
into the storage columns single flight stores as they are
(:func:`~._columns.columns`). The spot checks that load
samples run once per job: a session made from a pickle (a spawned worker) or
inherited over ``fork`` takes its parent's :class:`~._checks.Verdict`.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._errors import CacheInUseError, SchemaMismatchError, StaleCacheError
from .._field import Field
from .._file import remove
from .._region import STRONGLY_ORDERED, SingleFlight
from ..cache import Cache, flight_of
from ._checks import (
    Verdict,
    check_deterministic,
    check_file,
    check_sample,
    check_stale_rows,
    file_identity,
    some_ready,
)
from ._collate import adopt
from ._columns import ShapeVariesError, as_tensors, columns, new_batch
from ._opening import open_existing
from ._schema import Schema, first_fields, varying_shapes
from ._settings import Settings, not_map_style
from ._sizing import size_variable

__all__ = ["Session"]

log = logging.getLogger("mmapcache")

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Counters are per process; a lock held by another thread at fork time would never be released.
    for session in list(_LIVE):
        session.hits = session.misses = session.written = session.waited = 0
        session.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Session:
    """This process's handle of the dataset's file, its counters, and its reads and writes."""

    def __init__(self, settings: Settings, verdict: Verdict | None = None) -> None:
        self.settings = settings
        # Weakly ordered CPUs check every read (see mmapcache._region.slots); zero-copy views too.
        self.check_reads = settings.verify or not STRONGLY_ORDERED
        self.cache: Cache | None = None
        # The cache and its single flight, that misses are loaded through (one attribute: read at once).
        self.flight: tuple[Cache, SingleFlight] | None = None
        self.schema: Schema | None = None
        self.checked = False  # a sample from the dataset was compared with the cache's fields
        self.deterministic = False  # the dataset gave the same sample twice (checked once per job)
        self.fresh: str | None = None  # the file whose content was found fresh (checked once per job)
        if verdict is not None and verdict.inherited():  # a process of the job that checked: trust it
            self.deterministic, self.fresh = verdict.deterministic, verdict.file
        self.views: list[torch.Tensor | None] | None = None  # copy=False: tensors over a read-only mapping
        self.readonly: Cache | None = None
        self.lock = threading.Lock()
        self.hits = self.misses = self.written = 0
        self.waited = 0  # misses read from the file once another process had loaded them (among the hits)
        self._sized_here: set[int] = set()  # positions this process loaded to size the file it made
        _LIVE.add(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Session, (self.settings, self.verdict()))

    def verdict(self) -> Verdict | None:
        """What this process's spot checks found, for the processes it starts (None: nothing yet)."""
        return Verdict.here(self.fresh, deterministic=self.deterministic)

    # -- the file ------------------------------------------------------------------

    def handle(self) -> Cache:
        """The cache, opened now if needed (created from ``dataset[0]`` if missing)."""
        cache = self.opened()
        if cache is None:
            if self.settings.length == 0:
                raise ValueError("cannot create a cache of no samples (an empty dataset, or cached_indices empty)")
            self.load([0])
            cache = self.cache
            assert cache is not None
        return cache

    def opened(self) -> Cache | None:
        """The cache if its file exists (opened now if needed); None if nobody created it yet.

        The first open in a job compares ``check`` cached samples with fresh ones (not in a
        process that inherited the verdict on this file from its parent).
        """
        # `is None`, not truthiness: a Cache has a __len__.
        if self.cache is not None:
            return self.cache
        with self.lock:
            if self.cache is not None:
                return self.cache
            cache = open_existing(self.settings)
            if cache is None:
                return None
            check_file(cache, self.settings)
            self._adopt(cache, checked=False)
        identity = file_identity(cache)
        if self.settings.check and self.fresh != identity:
            self._check_content(cache)
            self.fresh = identity
        return self.cache

    def _create(self, fields: dict[str, Field], text_bytes: int | None = None) -> Cache:
        """Open the file, creating it with ``fields`` if it is missing.

        ``text_bytes``: room for text values when ``max_bytes`` was not given (see :func:`._sizing.size_variable`).
        """
        settings = self.settings
        with self.lock:
            if self.cache is None:
                cache = Cache.open(
                    settings.path,
                    fields,
                    settings.length,
                    key=settings.key,
                    capacity=settings.capacity,
                    max_bytes=settings.max_bytes if settings.max_bytes is not None else text_bytes,
                    verify=settings.verify,
                    dataset_indices=settings.cached_indices,
                    timeout=settings.timeout,
                )
                self._adopt(cache, checked=True)
                self.fresh = file_identity(cache)  # made from this job's samples (or a racing creator's, just now)
            assert self.cache is not None
            return self.cache

    def _adopt(self, cache: Cache, *, checked: bool) -> None:
        self.schema = schema = Schema(cache.fields, self.settings.path)
        self.checked = checked
        if not self.settings.copy:
            self.readonly = Cache.open(self.settings.path, readonly=True, timeout=self.settings.timeout)
            views = self.readonly.views
            with warnings.catch_warnings():
                # The mapping is PROT_READ: torch cannot make a tensor read-only,
                # but the kernel refuses the write. That is the point of copy=False.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
                # Variable fields have no such view: they are read as copies (None here).
                self.views = [
                    None if schema.variable[k] else schema.to_tensor(views[name], k)
                    for k, name in enumerate(schema.names)
                ]
        self.flight = (cache, flight_of(cache))
        self.cache = cache

    def _check_content(self, cache: Cache) -> None:
        """Compare up to ``check`` cached samples with fresh ones from the dataset: a stale cache is refused.

        Costs ``check`` sample loads per job (one more for the first, loaded twice:
        a dataset that is not deterministic is refused too).
        """
        positions = some_ready(cache, self.settings.check)
        if not positions:
            return
        raw = self.fetch(positions)
        indices = self.settings.sources(positions)
        if not self.deterministic:
            self._check_deterministic(indices[0], raw[0])
        if not self.checked:
            try:
                self._check_sample(raw[0], indices[0])
            except SchemaMismatchError as error:
                raise StaleCacheError(
                    str(error), path=self.settings.path, differences=error.differences, index=indices[0]
                ) from None
        schema = self.schema
        assert schema is not None
        fresh = schema.samples(self._columns(schema, indices, raw))
        read, hits = cache.read_many(np.asarray(positions, np.intp), count=False)
        check_stale_rows(schema, read, hits, indices, fresh, self.settings)

    def _check_sample(self, sample: Any, index: int) -> None:
        assert self.cache is not None
        check_sample(sample, index, self.cache.fields, self.settings)
        self.checked = True

    def _check_deterministic(self, index: int, sample: Any) -> None:
        """The first miss of a job loads its sample twice: a random dataset must not be frozen in the cache."""
        check_deterministic(sample, self.fetch_indices([index])[0], index, self.settings)
        self.deterministic = True

    def close(self) -> None:
        """Release the file in this process (reopened on next use). Zero-copy tensors stay valid."""
        with self.lock:
            for cache in (self.cache, self.readonly):
                if cache is not None:
                    cache.close()
            self.cache = self.readonly = self.flight = None
            self.views = None
            self.schema = None

    # -- reading -------------------------------------------------------------------

    def get(self, index: Any, *, fresh: bool = False) -> Any:
        """The sample at dataset index ``index`` (validated like ``ds[i]``), from the file or loaded.

        ``fresh``: fresh tensors even with ``copy=False`` (what a transform gets).
        """
        i = self.settings.index(index)
        shard = self.settings.cached_indices
        if shard is not None:  # a shard: its position in the file, if it is one of them
            at = int(shard.searchsorted(i))
            if at == len(shard) or shard[at] != i:  # not one of cached_indices: read from the dataset every time
                return self.uncached(np.array([i], np.intp))[0]
            i = at
        cache = self.cache if self.cache is not None else self.opened()
        sample: Any = None
        if cache is not None and i in cache:  # a miss is counted by the load (single flight)
            schema = self.schema
            assert schema is not None
            views = None if fresh else self.views
            if views is None:
                stored = cache.get(i)
                if stored is not None:
                    sample = schema.build([[t] for t in schema.to_tensors(stored[n] for n in schema.names)])[0]
            else:
                if not self.check_reads and not schema.ragged:
                    cache.count(hits=1)
                    sample = schema.build([[view[i]] for view in views if view is not None])[0]
                else:
                    stored = cache.get(i)  # verifies the slot; variable fields come from here
                    if stored is not None:
                        leaves = [
                            schema.to_tensor(stored[name], k) if view is None else view[i]
                            for k, (name, view) in enumerate(zip(schema.names, views, strict=True))
                        ]
                        sample = schema.build([[leaf] for leaf in leaves])[0]
        if sample is None:
            return self.load([i])[0]
        self.hits += 1
        return sample

    def get_many(self, indices: Sequence[int], *, fresh: bool = False) -> list[Any]:
        """The samples at ``indices``: one vectorized read for the hits, one batch write for the misses.

        ``fresh``: fresh tensors even with ``copy=False`` (what a transform gets): the rows of one batch
        gathered into this process's memory (in a worker too: what the transform returns is what leaves it).
        """
        given = self.settings.indices(indices)
        idx = self.settings.positions(given)
        if idx is None:  # some are not among cached_indices: read those from the dataset
            return self._partly_cached(given)
        cache = self.cache if self.cache is not None else self.opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            return self.load(idx.tolist())
        schema = self.schema
        assert schema is not None
        if self.views is None or fresh:
            gathered = self.gather(cache, idx, private=fresh)
            for column in gathered:
                if isinstance(column, torch.Tensor):
                    adopt(column)  # collate() may return its rows as the batch, without stacking a copy
            return schema.build(schema.rows(gathered))
        return self._read_views(cache, idx)

    def uncached(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """Samples of indices outside ``cached_indices``: from the dataset, as a cached read returns them."""
        self.misses += len(idx)
        raw = self.fetch_indices(idx.tolist())
        if self.settings.length == 0:  # an empty shard (fewer samples than nodes): no file, every read uncached
            if self.schema is None:
                fields = first_fields(raw[0], int(idx[0]), self.settings.fields, self.settings.dtypes)
                self.schema = Schema(fields, self.settings.path)
        else:
            self.handle().count(misses=len(idx))  # its schema converts them (creating it from a cached index)
        assert self.schema is not None
        return self.schema.samples(self._columns(self.schema, idx.tolist(), raw))

    def _partly_cached(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """``get_many`` for indices of which some are outside ``cached_indices``; the order kept."""
        assert self.settings.cached_indices is not None
        member = np.isin(idx, self.settings.cached_indices)
        out: list[Any] = [None] * len(idx)
        found = np.flatnonzero(member)
        if found.size:
            for row, sample in zip(found.tolist(), self.get_many(idx[found].tolist()), strict=True):
                out[row] = sample
        others = np.flatnonzero(~member)
        for row, sample in zip(others.tolist(), self.uncached(idx[others]), strict=True):
            out[row] = sample
        return out

    def gather(
        self,
        cache: Cache,
        idx: np.ndarray[Any, np.dtype[np.intp]],
        given_rows: Sequence[int] = (),
        leaves: Sequence[list[Any]] = (),
        *,
        counted: bool = False,
        private: bool = False,
        first: tuple[dict[str, Any], np.ndarray[Any, Any]] | None = None,
    ) -> list[Any]:
        """One column per field holding the samples at file positions ``idx``: hits read, misses loaded.

        A fixed field's column is one fresh batch tensor (in a DataLoader worker, in shared
        memory); a numeric variable field's is one :class:`~mmapcache.Jagged` of storage values,
        gathered at once (no object per sample); a text field's a list of ``str``/``bytes``.
        ``given_rows``/``leaves``: samples a worker already loaded and could not store;
        ``counted``: the reads were counted in the file already (by that worker); ``private``: the
        batch tensors in this process's memory even in a worker; ``first``: the caller's
        ``read_many(idx)`` of these positions into fresh arrays (not read again; its fixed arrays
        become the batch tensors). Misses are loaded through :meth:`load` (which counts them).
        """
        schema = self.schema
        assert schema is not None
        count = len(idx)
        if first is None:
            shapes = []  # loops, not comprehensions, in this function: every batch runs it
            for shape in schema.fixed_shapes:
                shapes.append((count, *shape))
            tensors, arrays = new_batch(shapes, schema.fixed_storage, schema.fixed_dtypes, private=private)
            out = dict(zip(schema.fixed, arrays, strict=True))
            read, hits = cache.read_many(idx, out=out, count=False)  # variable fields: Jagged, texts: lists
        else:
            read, hits = first
            tensors = as_tensors(list(map(read.__getitem__, schema.fixed)), schema.fixed_dtypes)
        found = int(np.count_nonzero(hits))
        if found < count and not given_rows and not counted:  # misses: this read is handed on, not made again
            read = self._load_misses(cache, idx, read, hits, found)
            hits[:] = True
        else:
            self.hits += found
            if not counted:
                cache.count(hits=found)
        batch = iter(tensors)
        gathered: list[Any] = []
        for k, name in enumerate(schema.names):
            if not schema.variable[k]:
                gathered.append(next(batch))
            else:
                gathered.append(read[name] if schema.texts[k] is None else list(read[name]))
        loaded: dict[int, list[Any]] = {}
        for row, given in zip(given_rows, leaves, strict=True):
            if not hits[row]:
                loaded[row] = given
                hits[row] = True
        if not hits.all():
            missing = np.flatnonzero(~hits)
            for row, sample in zip(missing.tolist(), self.load(idx[missing].tolist()), strict=True):
                loaded[row] = schema.flatten(sample)
        if loaded:
            gathered = schema.with_rows(gathered, loaded)
        return gathered

    def _read_views(self, cache: Cache, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """``copy=False``: hits as views of the read-only mapping, misses loaded; the order kept.

        Variable fields have no such views: their values are read as fresh copies.
        """
        schema, views = self.schema, self.views
        assert schema is not None
        assert views is not None
        read: dict[str, Any] = {}
        if self.check_reads or schema.ragged:
            read, hits = cache.read_many(idx, count=False)  # checks every slot; the copies of fixed fields are dropped
        else:
            hits = cache.contains_many(idx)
        cache.count(hits=int(np.count_nonzero(hits)))  # the misses are counted by the load
        found_rows = np.flatnonzero(hits)
        self.hits += len(found_rows)
        found = idx[found_rows].tolist()
        leaves = [
            list(map(view.__getitem__, found))
            if view is not None
            else [schema.to_tensor(read[name][row], k) for row in found_rows.tolist()]
            for k, (name, view) in enumerate(zip(schema.names, views, strict=True))
        ]
        cached = schema.build(leaves)
        if len(found_rows) == len(idx):
            return cached
        out: list[Any] = [None] * len(idx)
        for row, sample in zip(found_rows.tolist(), cached, strict=True):
            out[row] = sample
        missing = np.flatnonzero(~hits)
        for row, sample in zip(missing.tolist(), self.load(idx[missing].tolist()), strict=True):
            out[row] = sample
        return out

    # -- misses ----------------------------------------------------------------------

    def fetch(self, positions: list[int]) -> list[Any]:
        """Raw samples for file positions, from the wrapped dataset."""
        return self.fetch_indices(self.settings.sources(positions))

    def fetch_indices(self, indices: list[int]) -> list[Any]:
        """Raw samples from the wrapped dataset (through its ``__getitems__`` when it has one)."""
        dataset = self.settings.dataset
        getitems = getattr(dataset, "__getitems__", None)
        try:
            if getitems is not None and len(indices) > 1:
                samples = list(getitems(indices))
                if len(samples) != len(indices):
                    raise ValueError(f"dataset.__getitems__ returned {len(samples)} samples for {len(indices)} indices")
                return samples
            return list(map(dataset.__getitem__, indices))
        except NotImplementedError as error:
            # A pipeline that only streams (a WebDataset with .with_length()) has a __getitem__ that refuses.
            raise TypeError(
                f"{not_map_style(dataset)} ({type(dataset).__name__}.__getitem__ raised NotImplementedError)"
            ) from error

    def load(self, positions: list[int]) -> list[Any]:
        """Misses: each loaded once per node and stored, then returned as a hit would be; counted in the file.

        Through single flight (:meth:`_load_misses`): a sample another
        process or thread is loading right now is waited for (bounded, and only
        when loads are not cheap) and read from the file — counted as a hit and
        as ``waited`` — instead of being loaded again. The first miss of a job
        also loads its first sample twice (the determinism check). Before the
        file exists, the batch's first sample creates it (:meth:`store`) and
        the rest go through single flight: processes that start together
        (the workers of concurrent jobs) share the first batches too. A rest
        that does not fit the new file refutes it (removed when nobody else
        has it open), so a refused first batch leaves no file behind.
        """
        cache = self.cache if self.cache is not None else self.opened()
        if cache is not None and cache.replaced:
            cache = self._follow()
        if cache is None:
            first = positions[:1]
            self.misses += len(first)
            samples = self.store(first, self.fetch(first), first_miss=self._first_miss())
            assert self.cache is not None
            self.cache.count(misses=len(first))
            if len(positions) == 1:
                return samples
            # Samples of the batch that sizing the new file loaded here are misses of this process, not hits.
            own = sum(1 for p in positions[1:] if p in self._sized_here)
            self._sized_here = set()
            try:
                rest = self.load(positions[1:])
                self.hits, self.waited, self.misses = self.hits - own, self.waited - own, self.misses + own
                return samples + rest
            except ValueError:
                # The rest of the first batch does not fit the file its first sample made (a lossy dtypes=, a
                # shape that varies): the file goes with the error, as when the whole batch was checked first.
                self._refute()
                raise
        schema = self.schema
        assert schema is not None
        idx = np.asarray(positions, np.intp)
        read, hits = cache.read_many(idx, count=False)
        batch = self._load_misses(cache, idx, read, hits, 0)  # all of them misses, as the caller found them
        return schema.samples([batch[name] for name in schema.names])

    def _load_misses(
        self, cache: Cache, idx: np.ndarray[Any, np.dtype[np.intp]], read: dict[str, Any], hits: Any, found: int
    ) -> dict[str, Any]:
        """The misses of a batch read (``read``, ``hits``) loaded through single flight into its rows; counted.

        The read is handed on, its rows filled in place (the fixed fields' in the
        batch tensors it filled). Each missing sample is loaded once per node —
        by :meth:`_load_columns`, converted once into the columns single flight
        stores as they are — or waited for and read (``waited``: among the
        hits, but not among the ``found`` ones the read found).
        """
        adopted = self.flight  # another thread may follow a resized file meanwhile: then ask the cache read
        flight = adopted[1] if adopted is not None and adopted[0] is cache else flight_of(cache)
        try:
            batch, loaded, written = flight.load_misses(idx, read, hits, self._load_columns)
        except _VariesError as varies:  # raised once the held slots were let go: now the file may be refuted
            assert self.schema is not None
            raise ValueError(self._varying_shapes(self.schema, varies.error, varies.raw)) from None
        fresh = int(np.count_nonzero(loaded))
        self.written += written
        self.misses += fresh
        self.hits += len(idx) - fresh
        self.waited += len(idx) - found - fresh
        return batch

    def _follow(self) -> Cache | None:
        """The name names another file (``resize`` renamed a larger one over it): use that one from now on.

        Before any miss is loaded, so that the samples other processes — spawn
        workers, other jobs — stored in the new file are read, not loaded again.
        A resized file keeps the old one's id: its content is not checked again.
        The old handles are dropped, not closed: a call of another thread may
        still read through them, and the last reference closes them.
        """
        with self.lock:
            cache = self.cache
            if cache is not None and cache.replaced:  # not followed by another thread meanwhile
                log.info("%s names a new file (resized): this process reads and fills that one", self.settings.path)
                self.cache = self.readonly = self.flight = None
                self.views = None
        return self.opened()

    def _first_miss(self) -> bool:
        """Whether the next load must also check that the dataset is deterministic (once per job)."""
        return not self.deterministic and bool(self.settings.check)

    def _load_columns(self, positions: list[int]) -> list[Any]:
        """The ``load`` single flight calls for the slots it holds: fetched, checked, as storage columns.

        In field order, in storage form (:func:`~._columns.columns`): single flight stores them as they are.
        """
        settings, schema = self.settings, self.schema
        assert schema is not None
        indices = settings.sources(positions)
        raw = self.fetch_indices(indices)
        if not self.checked:
            self._check_sample(raw[0], indices[0])
        try:
            stored = columns(schema, indices, raw, settings.dtypes, declared=settings.fields is not None)
        except ShapeVariesError as error:
            raise _VariesError(error, raw) from None
        if not self.deterministic and settings.check:  # the first miss of a job (see _first_miss)
            self._check_deterministic(indices[0], raw[0])
        return stored

    def store(self, positions: list[int], raw: list[Any], *, first_miss: bool = False) -> list[Any]:
        """Store freshly loaded samples (checked against the schema first); return them as a read would.

        ``first_miss``: once the batch passed the schema checks, its first sample is loaded once
        more and compared, before anything is created or stored.
        """
        indices = self.settings.sources(positions)
        cache = self.cache if self.cache is not None else self.opened()
        if cache is None:
            # Nobody created the file yet: the whole batch is checked against the schema first,
            # so a batch whose shapes vary (without fields=) leaves no file behind.
            fields = first_fields(raw[0], indices[0], self.settings.fields, self.settings.dtypes)
            schema = Schema(fields, self.settings.path)
            stored = self._columns(schema, indices, raw)
            if first_miss:
                self._check_deterministic(indices[0], raw[0])
            sized = size_variable(self.settings, schema, positions, stored, fetch=self.fetch, columns_of=self._columns)
            cache = self._create(fields, None if sized is None else sized.budget)
            assert self.schema is not None
            if self.schema.names != schema.names:  # another process created it, its fields in another order
                schema = self.schema
                stored = self._columns(schema, indices, raw)
                if sized is not None:
                    sized = sized._replace(columns=self._columns(schema, sized.indices, sized.raw))
            if sized is not None and sized.positions:  # the samples loaded for sizing are stored, not wasted
                batch = dict(zip(schema.names, sized.columns, strict=True))
                wrote = cache.put_many(sized.positions, batch)
                self.written += int(np.count_nonzero(wrote))
                self._sized_here = {p for p, w in zip(sized.positions, np.asarray(wrote).tolist(), strict=True) if w}
        else:
            if not self.checked:
                self._check_sample(raw[0], indices[0])
            assert self.schema is not None
            schema = self.schema
            stored = self._columns(schema, indices, raw)
            if first_miss:
                self._check_deterministic(indices[0], raw[0])
        written = cache.put_many(positions, dict(zip(schema.names, stored, strict=True)))
        self.written += int(np.count_nonzero(written))
        return schema.samples(stored)

    def _columns(self, schema: Schema, indices: list[int], raw: list[Any]) -> list[Any]:
        """:func:`~._columns.columns`, with the advice (and the refuted file) for shapes that vary."""
        try:
            return columns(schema, indices, raw, self.settings.dtypes, declared=self.settings.fields is not None)
        except ShapeVariesError as error:
            raise ValueError(self._varying_shapes(schema, error, raw)) from None

    def _refute(self) -> str:
        """Mark the file as not fitting the dataset, and remove it now if nobody else has it open; say which."""
        cache, path = self.cache, self.settings.path
        if cache is None or cache.readonly:
            return f"remove it (`mmapcache rm {path}`) before the next try."
        cache.refute()
        self.close()
        try:
            remove(path, timeout=self.settings.timeout)
        except CacheInUseError:
            return (
                "it is marked as not fitting the dataset, and the next try replaces it, even while the processes "
                "using it now still hold it (nothing to remove by hand)."
            )
        except FileNotFoundError:
            pass
        return "it was removed, so the next try starts afresh."

    def _varying_shapes(self, schema: Schema, varies: ShapeVariesError, raw: list[Any]) -> str:
        """The message for a sample whose shape differs from the first one's (the file, if any, refuted)."""
        return varying_shapes(schema, varies, raw, self.settings.path, None if self.cache is None else self._refute())


class _VariesError(Exception):
    """A sample whose shape does not fit the file's fields, found inside a single-flight load."""

    def __init__(self, error: ShapeVariesError, raw: list[Any]) -> None:
        super().__init__(str(error))
        self.error, self.raw = error, raw
