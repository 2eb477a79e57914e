"""`Cache`: a file-backed, memory-mapped dataset cache that any process opens by path."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

import numpy as np

from ._errors import CacheMissError, ReadonlyCacheError
from ._field import Field, FieldsLike
from ._file import OpenedFile, open_or_create, plan, remove
from ._format import Header, Layout
from ._region import (
    READY,
    REFUTED,
    STRONGLY_ORDERED,
    WAIT_TIMEOUT,
    Claims,
    Counts,
    FixedRows,
    Flight,
    Mapped,
    Problem,
    SingleFlight,
    Usage,
    VariableColumn,
    VariableRegion,
    Writer,
    as_given,
    attach,
    check_index,
    check_out,
    clear_cache,
    closed_error,
    empty_aligned,
    gather,
    index_array,
    readonly_error,
    sync_cache,
    verify_cache,
)

_INTP = np.dtype(np.intp)

__all__ = ["Cache", "Problem"]

log = logging.getLogger("mmapcache")

_MISSING: Any = object()


_P = ParamSpec("_P")


def _parameters_of(init: Callable[Concatenate[Any, _P], None]) -> Callable[[Callable[..., Cache]], Callable[_P, Cache]]:
    """Give a function ``init``'s parameters (less ``self``) for type checkers and ``help()``: one list, not two."""

    def decorate(function: Callable[..., Cache]) -> Callable[_P, Cache]:
        parameters = list(inspect.signature(init).parameters.values())[1:]
        function.__signature__ = inspect.Signature(parameters, return_annotation="Cache")  # type: ignore[attr-defined]
        return function

    return decorate


class Cache:
    """A dataset cache in one memory-mapped file, shared by every process that opens it.

    ``Cache(...)`` and ``Cache.open(...)`` are the same: open the file at
    ``path``, or create it if it is missing and ``fields`` and ``length`` are
    given. See :meth:`open`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: FieldsLike | None = None,
        length: int | None = None,
        *,
        key: str | None = None,
        capacity: int | None = None,
        max_bytes: int | str | None = None,
        readonly: bool = False,
        timeout: float = 60.0,
        verify: bool = False,
        dataset_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> None:
        self._closed = True
        target = Path(os.path.abspath(os.fspath(path)))
        planned = plan(
            fields,
            length,
            key=key,
            capacity=capacity,
            max_bytes=max_bytes,
            readonly=readonly,
            dataset_indices=dataset_indices,
        )
        try:
            opened = open_or_create(target, planned.expected, planned.new, readonly=readonly, timeout=float(timeout))
        except FileNotFoundError:
            if planned.unplannable is not None:
                raise planned.unplannable from None
            raise
        self._attach(target, opened, readonly=readonly, verify=verify, timeout=float(timeout))

    @staticmethod
    @_parameters_of(__init__)
    def open(*args: Any, **kwargs: Any) -> Cache:
        """Open the cache at ``path``, creating it first if it is missing.

        * The file exists: it is validated, and any of ``fields``, ``length``,
          ``key`` given must equal what it holds, else
          :class:`SchemaMismatchError` lists every difference. A failed open
          never modifies the file.
        * It is missing, ``fields`` and ``length`` are given and ``readonly``
          is false: exactly one of any number of concurrent callers creates
          it; all of them end up on the same file.
        * Otherwise: ``FileNotFoundError``.

        ``fields`` maps names to :class:`Field` or ``(shape, dtype)``.
        ``capacity`` or ``max_bytes`` (an int or ``"8GiB"``/``"500MB"``)
        limit the cacheable slots to indices ``< capacity`` (default: all
        ``length``); ``max_bytes`` budgets the per-slot data and slot records,
        the header and page padding come on top. They only apply when the file
        is created. ``timeout`` bounds a wait for another process that
        creates, removes or clears the file and makes no progress; a check
        after a reboot in another process (a cache on a disk) is waited for
        while it advances, and the wait is logged with its progress.
        ``verify=True`` checks every read against the slot's checksum and
        treats a mismatch as a miss.

        ``dataset_indices`` (strictly increasing, non-negative integers) makes
        a cache of a chosen part of a larger dataset — one node's shard:
        position ``i`` holds the dataset's sample ``dataset_indices[i]``,
        ``length`` is their number, and the file keeps the list (see
        :attr:`dataset_indices`). An existing file must hold the same list,
        else :class:`SchemaMismatchError`.
        """
        return Cache(*args, **kwargs)

    def _attach(self, path: Path, opened: OpenedFile, *, readonly: bool, verify: bool, timeout: float) -> None:
        header, layout = opened.header, opened.layout
        reopen = functools.partial(_reopen_writable, path, timeout)
        handle, mapped = attach(path, opened, readonly=readonly, timeout=timeout, reopen=reopen)
        self._path = path
        self._readonly = readonly
        self._user_verify = verify
        # Weakly ordered CPUs verify every read: see the argument in _region/slots.py.
        self._verify = verify or not STRONGLY_ORDERED
        self._timeout = timeout
        self._header: Header = header
        self._layout: Layout = layout
        self._fields = header.fields
        self._length = header.length
        self._capacity = header.capacity
        self._handle = handle
        self._board = handle.board
        self._mapped: Mapped | None = mapped
        # Every store goes through the writer, single flight's too; both are dropped on close.
        self._writer: Writer | None = Writer(
            handle, mapped, header.fields, length=header.length, capacity=header.capacity, readonly=readonly
        )
        self._holds = Flight()  # which thread holds which slot, the mean load time: outlives a close
        self._single: SingleFlight | None = SingleFlight(self._holds, self._writer, verify=self._verify)
        self._finalizer = weakref.finalize(self, handle.close)
        self._closed = False

    # -- properties -----------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def fields(self) -> dict[str, Field]:
        return dict(self._fields)

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def key(self) -> str:
        return self._header.key

    @property
    def dataset_indices(self) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
        """The dataset index each position caches (read-only, increasing), or ``None`` for a whole dataset.

        Set when the file was created with ``dataset_indices=``: position ``i``
        holds the dataset's sample ``dataset_indices[i]``. A zero-copy view of
        the file's index table.
        """
        return self._live().indices

    @property
    def replaced(self) -> bool:
        """Whether the path names another file now than the one this handle opened.

        ``resize`` builds a new file and renames it over the old one; a handle
        opened before keeps the old file (still valid: what it fills stays
        there). Reopen (``Cache.open(cache.path)``) to use the new one —
        ``CachedDataset`` does on its next miss. One ``stat`` of the path.
        """
        self._live()
        return self._handle.replaced()

    @property
    def refuted(self) -> bool:
        """Whether a process found that this file's inferred fields do not fit its dataset (see :meth:`refute`)."""
        self._live()
        return bool(self._board.flags() & REFUTED)

    def refute(self) -> None:
        """Record in the file that its fields, inferred from a first sample, do not fit the dataset.

        For bindings that infer the fields (``CachedDataset`` without
        ``fields=``): a later run may then remove the file, once nobody has it
        open, and create it with the right fields. Never undone.
        """
        self._live()
        if self._readonly:
            raise self._readonly_error("refute()")
        self._board.set_flag(REFUTED)

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def nbytes(self) -> int:
        """The size of the file in bytes (header, slot table and data)."""
        return self._layout.file_size

    @property
    def created(self) -> dict[str, Any]:
        """Who created the file and when (informational metadata from the header)."""
        return dict(self._header.created)

    @property
    def uuid(self) -> str:
        """The file's identity: 16 random bytes drawn when it was created (hex), never reused by another file.

        Two handles with the same ``uuid`` have the same file open; a cache removed
        and created again at the same path (or replaced by ``mmapcache.resize``)
        has a new one.
        """
        return self._header.uuid.hex()

    @property
    def counts(self) -> Counts:
        """This handle's own counts (hits, misses, slots written) so far, without reading other processes'."""
        self._live()
        return self._board.mine()

    @property
    def filled(self) -> int:
        """Slots READY now, counting every process's writes."""
        return self._live().slots.count_ready()

    @property
    def views(self) -> dict[str, np.ndarray[Any, Any]]:
        """Zero-copy, read-only views of every field: ``{name: array of shape (capacity, *shape)}``.

        Row ``i`` holds sample ``i`` only while ``i in cache``; other rows are
        zeros or a write in progress. The views keep the mapping alive after
        :meth:`close`. Write through :meth:`put`, never through a view.
        """
        views = {}
        for name, array in self._live().items:
            view = array.view()
            view.flags.writeable = False
            views[name] = view
        return views

    def __len__(self) -> int:
        return self._length

    __iter__ = None  # a cache has holes; iterating indices would raise KeyError midway

    def __repr__(self) -> str:
        fields = ", ".join(f"{name!r}: {field!r}" for name, field in self._fields.items())
        mapped = self._mapped
        if mapped is None:
            return f"<Cache {str(self._path)!r} fields={{{fields}}} closed>"
        return f"<Cache {str(self._path)!r} fields={{{fields}}} filled={mapped.slots.count_ready()}/{self._capacity}>"

    # -- reading --------------------------------------------------------------

    def get(self, index: int, default: Any = None) -> Any:
        """The sample at ``index`` as ``{field: numpy array}`` (fresh copies), or ``default`` if not cached."""
        i = index if type(index) is int and 0 <= index < self._length else check_index(index, self._length)
        mapped = self._mapped
        if mapped is None:
            raise closed_error(self._path)
        if i < self._capacity and mapped.states[i] == READY:
            if mapped.readahead is not None:  # a file on a disk: one request for the row, not a fault per page
                mapped.readahead.before_read_one(i)
            if mapped.variables:
                found = mapped.sample(i, self._verify)
                if found is not None:
                    self._board.add(hits=1)
                    return found
                self._board.add(misses=1)
                return default
            # A loop, not a dict comprehension: on Python < 3.12 the comprehension's
            # own frame costs ~0.2 µs a call (benchmarks/bench_read.py, "get overhead").
            sample: dict[str, np.ndarray[Any, Any]] = {}
            for name, array in mapped.items:
                sample[name] = array[i, ...].copy()
            if not self._verify or mapped.intact(i, sample.values()):
                self._board.add(hits=1)
                return sample
        self._board.add(misses=1)
        return default

    def __getitem__(self, index: int) -> dict[str, np.ndarray[Any, Any]]:
        sample = self.get(index, _MISSING)
        if sample is _MISSING:
            raise KeyError(index)
        result: dict[str, np.ndarray[Any, Any]] = sample
        return result

    def __contains__(self, index: object) -> bool:
        i = index if type(index) is int and 0 <= index < self._length else check_index(index, self._length)
        mapped = self._live()
        return i < self._capacity and bool(mapped.states[i] == READY)

    def get_many(
        self, indices: Any, out: dict[str, np.ndarray[Any, Any]] | None = None
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Stacked samples ``{field: array of shape (len(indices), *shape)}``, one gather per field.

        A variable-shape field comes back as a :class:`Jagged`: a read-only
        sequence of its rows (``len``, indexing, iteration, as a list of
        arrays) held as one contiguous ``values`` array and ``offsets``,
        filled by one gather; a text field as a list of ``str`` (``bytes``).

        With ``out`` — ``{field: ndarray}`` of shape ``(len(indices), *shape)``,
        the field's dtype, C-contiguous and writable, for every field — the
        rows are written into those buffers (nothing is allocated) and ``out``
        is returned; a wrong buffer raises ``ValueError`` before anything is
        read. Raises ``KeyError`` (with ``.missing``, the indices not cached)
        if any index is not cached; ``out`` is then left untouched (with
        ``verify``, a row that fails its checksum raises after the gather).
        """
        mapped = self._mapped
        if mapped is None:
            raise closed_error(self._path)
        if out is None and not (mapped.variables or mapped.readahead or self._verify):
            # Fixed fields in memory: one pass checks the indices and each slot's state and copies its rows.
            plain = type(indices) is np.ndarray and indices.dtype == _INTP and indices.ndim == 1
            idx = indices if plain else index_array(indices, self._length)
            fixed = mapped.fixed
            rows, ready, found = fixed.take(idx, self._length, hits=False)  # no mask: the hits are the rule
            if 0 <= found < len(idx):  # which ones miss: read again with the mask (some may be there now)
                rows, ready, found = fixed.take(idx, self._length)
            if found == len(idx):
                self._board.add(hits=found)
                if len(rows) == 1:
                    return {fixed.names[0]: rows[0]}
                return dict(zip(fixed.names, rows, strict=True))
            if found < 0:
                idx = index_array(indices, self._length)  # raises for the index out of range
            assert ready is not None
            self._board.add(misses=len(idx) - found)
            raise _missing_error(self._path, as_given(indices, idx)[~ready], len(idx))
        idx = index_array(indices, self._length)
        if out is not None:
            check_out(out, self._fields, len(idx))
        ready = mapped.slots.ready_mask(idx, self._capacity, self._length)
        if not ready.all():
            self._board.add(misses=len(idx) - int(np.count_nonzero(ready)))
            raise _missing_error(self._path, as_given(indices, idx)[~ready], len(idx))
        if mapped.readahead is not None:
            mapped.readahead.before_read(idx)
        if out is None:
            out = {name: gather(array, idx) for name, array in mapped.items}
        else:
            for name, array in mapped.items:
                # mode="clip": numpy buffers take(out=) in mode="raise" (see _region/gathers.py).
                np.take(array, idx, axis=0, out=out[name], mode="clip")
        out, bad = mapped.checked(idx, out, np.arange(len(idx)), self._verify)
        if len(bad):
            self._board.add(misses=len(bad))
            why = "failed their checks" if mapped.variables else "failed their checksum"
            raise _missing_error(self._path, idx[bad], len(idx), why=why)
        self._board.add(hits=len(idx))
        return out

    def read_many(
        self, indices: Any, out: dict[str, np.ndarray[Any, Any]] | None = None, *, count: bool = True
    ) -> tuple[dict[str, np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.bool_]]]:
        """Read what is cached of ``indices``, without raising for what is not: ``(arrays, hits)``.

        ``arrays`` maps each field to ``(len(indices), *shape)`` rows (``out``
        when given, see :meth:`get_many`); ``hits[k]`` says whether row ``k``
        holds sample ``indices[k]``. Rows of misses are left as they were
        (uninitialised in a fresh buffer); in a variable field's
        :class:`Jagged` (or a text field's list) they are ``None``. With ``verify``, a row that fails
        its checksum is a miss. A cold epoch's batch is an ordinary partial
        hit, so this is the read for callers that fill misses themselves.
        ``count=False`` leaves the usage counters alone (for a caller that
        counted these reads already, e.g. in another process).
        """
        mapped = self._mapped
        if mapped is None:
            raise closed_error(self._path)
        plain = type(indices) is np.ndarray and indices.dtype == _INTP and indices.ndim == 1
        if plain and out is None and not (mapped.variables or mapped.readahead or self._verify):
            # Fixed fields in memory, indices as an array: the one pass checks their range too.
            rows, read, found = mapped.fixed.take(indices, self._length)
            if found >= 0:
                assert read is not None
                if count:
                    self._board.add(hits=found, misses=len(indices) - found)
                return dict(zip(mapped.fixed.names, rows, strict=True)), read
        idx = index_array(indices, self._length)  # raises for an index out of range
        if out is not None:
            check_out(out, self._fields, len(idx))
        if not (mapped.variables or mapped.readahead or self._verify):  # fixed fields in memory: one pass
            outs = None if out is None else [out[name] for name in mapped.arrays]
            taken, hits, _ = mapped.fixed.take(idx, self._length, outs)
            assert hits is not None
            if count:
                found = int(np.count_nonzero(hits))
                self._board.add(hits=found, misses=len(idx) - found)
            return (out if out is not None else dict(zip(mapped.arrays, taken, strict=True))), hits
        if out is None:
            out = {name: empty_aligned((len(idx), *array.shape[1:]), array.dtype) for name, array in mapped.items}
        out, hits = mapped.read(idx, out, self._capacity, self._length, self._verify)
        if count:
            found = int(np.count_nonzero(hits))
            self._board.add(hits=found, misses=len(idx) - found)
        return out, hits

    def prefetch(self, indices: Any, *, background: bool = True) -> None:
        """Ask for the cached samples among ``indices`` to be read into memory soon, without waiting.

        A hint for a cache on a disk: a background thread asks the kernel to
        read those slots' bytes (after probing whether they are in memory
        already), so that a later :meth:`get_many` of them finds them there.
        Indices that are not cached are ignored; on a memory file system
        (``/dev/shm``) it does nothing. Hints are dropped when too many are
        waiting already. ``background=False`` asks in the calling thread,
        which returns once the kernel has queued the reads (not when they are
        done). Bad indices raise as in :meth:`get_many`.
        """
        mapped = self._live()
        mapped.prefetch(index_array(indices, self._length), self._capacity, self._length, background=background)

    def contains_many(self, indices: Any) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which of ``indices`` are cached, as a bool array (from the state bytes; see ``verify``)."""
        mapped = self._live()
        return mapped.slots.ready_mask(index_array(indices, self._length), self._capacity, self._length)

    def count(self, *, hits: int = 0, misses: int = 0) -> None:
        """Add reads served outside :meth:`get`/:meth:`get_many` (e.g. through :attr:`views`) to the counters."""
        if self._mapped is None:
            raise closed_error(self._path)
        self._board.add(hits=hits, misses=misses)

    def usage(self) -> Usage:
        """How this cache has been used: this process's, every live process's and all-time counts.

        :meth:`get` and :meth:`get_many` count hits and misses, :meth:`put`
        and :meth:`put_many` the slots they filled, in the file: DataLoader
        workers, DDP ranks and other jobs count where everyone sees it. A
        readonly handle counts only in its own process. For the hit rate of
        one epoch, subtract the ``total`` before it from the one after.
        """
        self._live()
        return self._board.usage()

    # -- writing --------------------------------------------------------------

    def put(self, index: int, sample: Mapping[str, Any]) -> bool:
        """Store ``sample`` at ``index``; False (nothing stored) if it is not cacheable or already filled.

        The first writer of a slot wins, across all processes: a slot being
        filled by another process at the same time also returns False.
        """
        i = index if type(index) is int and 0 <= index < self._length else check_index(index, self._length)
        return self._store().put(i, sample)

    def put_many(self, indices: Any, batch: Mapping[str, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Store row ``k`` of every field of ``batch`` at ``indices[k]``; which rows were stored."""
        writer = self._store()
        return writer.put_many(index_array(indices, self._length), batch)

    # -- single flight: one load per sample per node (see _region/flight.py) ----------

    def get_or_load_many(
        self,
        indices: Any,
        load: Callable[[list[int]], Any],
        *,
        out: dict[str, np.ndarray[Any, Any]] | None = None,
        timeout: float = WAIT_TIMEOUT,
        wait: bool | None = None,
        chunk: int | None = None,
    ) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]]]:
        """The samples at ``indices``, each missing one loaded by ``load`` once per node: ``(batch, loaded)``.

        ``batch`` is what :meth:`read_many` returns, every row filled;
        ``loaded[k]`` says whether row ``k`` was loaded by this call (else it
        came from the cache). ``load(indices)`` gets a list of cache indices
        and returns their samples: a batch as :meth:`put_many` takes it, or a
        list of samples ``{field: value}`` in the same order. What it returns
        is stored, and returned as a read would return it.

        A missing slot is held (the kernel lock a fill takes) before it is
        loaded and let go as soon as it is stored, a few slots at a time
        (``chunk``: by default about 10 ms of loading). A slot that another
        process — or another thread — is loading is waited for rather than
        loaded again, once this call holds nothing: up to ``timeout`` seconds
        in all (default 10), after which the call loads what is left itself.
        If that holder dies or its ``load`` raises, the waiter loads the slot.
        ``wait=None`` waits only when it pays: not when this handle's mean
        load time (:attr:`mean_load_time`) is under half a millisecond per
        sample; ``wait=False`` never waits, ``wait=True`` always does.

        An exception from ``load`` lets go of the slots it held and
        propagates. A readonly cache loads every miss itself and stores
        nothing. Usage counts a row read from the cache (waited for or not)
        as a hit and a row loaded here as a miss.
        """
        return self._flight().get_or_load_many(indices, load, out=out, timeout=timeout, wait=wait, chunk=chunk)

    def get_or_load(
        self, index: int, load: Callable[[int], Any], *, timeout: float = WAIT_TIMEOUT, wait: bool | None = None
    ) -> dict[str, Any]:
        """The sample at ``index``: from the cache, or ``load(index)`` once per node (see :meth:`get_or_load_many`)."""
        return self._flight().get_or_load(index, load, timeout=timeout, wait=wait)

    def claim_many(self, indices: Any) -> Claims:
        """Hold, without waiting, every slot among ``indices`` that is cacheable, not cached and free.

        Returns :class:`Claims` (a context manager): its ``indices`` are the
        slots now held by this thread — load them and store them with
        ``claims.put_many``; leaving the ``with`` block lets go of the rest.
        Its ``held`` are the slots another process or thread is loading: wait
        for them with :meth:`wait_for`, once you hold nothing.
        """
        return self._flight().claim_many(indices)

    def wait_for(self, indices: Any, *, timeout: float = WAIT_TIMEOUT) -> Claims:
        """Wait until every one of ``indices`` is cached, or until one of them is left to this thread.

        Returns :class:`Claims` holding one slot when its holder gave it up
        unstored (it died, or its load raised): load and store it, then wait
        for the rest. Otherwise the claims hold nothing, and their ``held``
        lists the slots still being loaded elsewhere after ``timeout`` seconds
        (load those yourself: storing them is refused while their holder
        lives). Waits only while this thread holds no slot (else
        ``RuntimeError``): waiting while holding could deadlock.
        """
        return self._flight().wait_for(indices, timeout=timeout)

    @property
    def mean_load_time(self) -> float | None:
        """Seconds per sample that :meth:`get_or_load_many`'s loads took through this handle (``None``: none yet)."""
        return self._holds.mean_load_time()

    @property
    def variable_region(self) -> VariableRegion | None:
        """How full the variable region is (``None`` without variable fields); see :class:`VariableRegion`."""
        return self._live().variable_region()

    def clear(self) -> None:
        """Mark every slot empty. Refuses with :class:`CacheInUseError` while any other handle is open."""
        mapped = self._live()
        if self._readonly:
            raise self._readonly_error("clear")
        clear_cache(self._path, self._handle, mapped, timeout=self._timeout)

    def sync(self) -> int:
        """Make what is cached durable: ``fdatasync`` the file and mark its filled slots synced.

        For a cache on a disk (format version 5): after a crash or power loss,
        the first open checks the filled slots that were not synced against
        their checksums, reading them from the disk (see "Caches on NVMe" in
        docs/operating.md), so syncing after a fill keeps that check short.
        Blocks until the kernel has written the file's dirty pages. Returns
        how many slots it marked (0 on a memory file system, where a reboot
        takes the file with it). Every process's writes count, not only ours.
        """
        mapped = self._live()
        if self._readonly:
            raise self._readonly_error("sync")
        return sync_cache(self._handle, mapped)

    # -- checking -------------------------------------------------------------

    def verify(self, fix: bool = False) -> list[Problem]:
        """Check the header and every slot; return the problems found.

        Finds READY slots whose bytes do not match their checksum, WRITING
        slots whose writer is gone, invalid state bytes, and a dataset index
        table that does not match its digest. With ``fix=True``
        each bad slot is reset to EMPTY (so it is filled again); slots a live
        writer holds are left alone. Header problems are reported, never fixed.
        """
        mapped = self._live()
        if fix and self._readonly:
            raise self._readonly_error("verify(fix=True)")
        return verify_cache(self._path, self._header, self._handle, mapped, fix=fix)

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Release the file. Idempotent; later use raises ``ValueError``.

        Safe while other threads use the handle: each of their calls completes
        or raises ``ValueError``. The descriptor and its locks are released at
        once (after a write in progress finishes); the memory stays mapped
        while arrays over it (:attr:`views`, zero-copy tensors) are alive.
        """
        if self._closed:
            return
        self._closed = True
        self._mapped = self._writer = self._single = None
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Cache:
        self._live()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # A handle pickles as its path and mode: the receiving process maps the
        # same file instead of receiving a copy of the data.
        return (_reopen_cache, (str(self._path), self._readonly, self._user_verify, self._timeout))

    # -- helpers --------------------------------------------------------------

    def _live(self) -> Mapped:
        """The views of the mapping; ``ValueError`` once the cache is closed."""
        mapped = self._mapped
        if mapped is None:
            raise closed_error(self._path)
        return mapped

    def _store(self) -> Writer:
        """The handle's one writer; ``ValueError`` once the cache is closed."""
        writer = self._writer
        if writer is None:
            raise closed_error(self._path)
        return writer

    def _flight(self) -> SingleFlight:
        """The handle's single flight; ``ValueError`` once the cache is closed."""
        single = self._single
        if single is None:
            raise closed_error(self._path)
        return single

    def lengths(self, field: str) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The length of every slot's value of the variable field ``field``, as the file records it.

        int64, one per slot (``capacity`` of them), read from the slots'
        descriptors without reading a value: the number of units of the
        field's fixed tail the value holds (for ``Field((None,), ...)``, its
        token count; see :class:`Jagged`). A slot that is not cached reads 0.
        ``ValueError`` if ``field`` is not a variable field of the cache.
        """
        mapped = self._live()
        column = next((c for c in mapped.variables if c.name == field), None)
        if column is None:
            names = [c.name for c in mapped.variables]
            raise ValueError(f"{field!r} is not a variable field of {self._path}; its variable fields: {names}")
        head = max((axis + 1 for axis, d in enumerate(column.field.shape) if d is None), default=0)
        dims = column.dims[:, :head].astype(np.int64)
        lengths: np.ndarray[Any, np.dtype[np.int64]] = dims[:, 0] if head == 1 else dims.prod(axis=1)
        lengths[mapped.slots.states != READY] = 0
        return lengths

    def _readonly_error(self, what: str) -> ReadonlyCacheError:
        return readonly_error(self._path, what)


def writer_of(cache: Cache) -> Writer:
    """The one writer of an open cache: for the core's own writers that are not ``put`` (a stream's fill)."""
    return cache._store()


def column_of(cache: Cache, field: str) -> VariableColumn:
    """A variable field's column in an open cache's mapping: for readers of parts of its values (packed sequences)."""
    return next(column for column in cache._live().variables if column.name == field)


def fixed_rows_of(cache: Cache) -> FixedRows | None:
    """An open cache's one-pass read of its fixed fields, when a batch read is that pass alone (fields fixed,
    in memory, no ``verify``): for the torch layer's gathers into buffers of its own (mixtures, a loader's
    recycled batches).
    ``take(idx, len(cache), outs)`` reads rows into ``outs`` and counts nothing (see :meth:`Cache.count`)."""
    mapped = cache._mapped  # Cache._live, inline: loader() asks for every batch
    if mapped is None:
        raise closed_error(cache._path)
    if mapped.variables or mapped.readahead or cache._verify:
        return None
    return mapped.fixed


def flight_of(cache: Cache) -> SingleFlight:
    """The single flight of an open cache: for a caller that hands on the read it made (``CachedDataset``'s misses)."""
    return cache._flight()

    # -- a variable field's lengths ---------------------------------------------


def open_unrefuted(path: Path, opener: Callable[[], Cache], *, timeout: float) -> Cache | None:
    """``opener()``'s cache at ``path``, or None: missing, or refuted (removed here, to be created anew).

    A first try created it with fields inferred from a first sample that the
    rest of the data does not fit (:meth:`Cache.refute`): it is never used
    again, so it is replaced even while processes of that try still hold it
    (they keep their nameless copy). mmapcache never links a removed file
    again, so the name held the opened file if it names the same one before
    and after the open; only that one is removed — another process may have
    replaced it already.
    """
    while True:
        try:
            named: os.stat_result | None = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError:
            named = None  # the opener says what is wrong, in its words
        try:
            cache = opener()
        except FileNotFoundError:
            return None
        if named is None or not cache.refuted:
            return cache
        cache.close()
        try:
            if not os.path.samestat(named, os.stat(path, follow_symlinks=False)):
                continue
            remove(path, force=True, timeout=timeout, same_as=named)
        except FileNotFoundError:
            continue  # replaced or removed meanwhile: open what the name holds now
        log.warning("removed %s: its fields were found not to fit the data; creating it anew", path)
        return None


def attach_opened(path: Path, opened: OpenedFile, *, timeout: float) -> Cache:
    """A writable cache over a file :func:`open_or_create` opened: for files ``Cache()`` does not create (streams)."""
    cache = Cache.__new__(Cache)
    cache._closed = True
    cache._attach(path, opened, readonly=False, verify=False, timeout=timeout)
    return cache


def _reopen_writable(path: Path, timeout: float) -> None:
    Cache(path, timeout=timeout).close()


def _reopen_cache(path: str, readonly: bool, verify: bool, timeout: float) -> Cache:
    return Cache(path, readonly=readonly, verify=verify, timeout=timeout)


def _missing_error(
    path: Path, missing: np.ndarray[Any, Any], total: int, why: str = "are not cached"
) -> CacheMissError:
    shown = missing[:10].tolist()
    more = ", ..." if len(missing) > 10 else ""
    return CacheMissError(
        f"{len(missing)} of {total} indices {why}: {str(shown)[1:-1]}{more}", path=path, missing=missing
    )
