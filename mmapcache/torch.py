"""PyTorch binding: the only public module of mmapcache that imports torch.

:class:`CachedDataset` wraps a map-style dataset and keeps its samples in one
:class:`~mmapcache.Cache` file that every process on the node opens by path:
DataLoader workers, DDP ranks, other jobs, the next run.

How a sample maps to the file
-----------------------------
A sample is a leaf (tensor, ndarray, numpy scalar, Python bool/int/float) or a
tuple, list or dict of leaves, nested one level. Each leaf is one cache field,
named by its place in the sample, so that a process that opens a warm cache
rebuilds the structure from the field names alone, without asking the dataset:

=====================  ==============  ======================================
sample                 field names     note
=====================  ==============  ======================================
``x``                  ``.``           a bare leaf
``(x, y)``             ``0``, ``1``    tuple positions are digits
``[x, y]``             ``[0]``, ``[1]``
``{"image": x}``       ``image``       keys ``[A-Za-z_][A-Za-z0-9_.-]*`` as is,
``{"a b": x}``         ``"a b"``       other keys JSON-quoted
``(x, {"m": y})``      ``0``, ``1/m``  one level of nesting, joined by ``/``
=====================  ==============  ======================================
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ._batches import Batched, Deferred, adopt, as_is, collate_tree, install_collate, new_batch
from ._errors import SchemaMismatchError
from ._field import Field
from ._paths import default_dir
from ._slots import STRONGLY_ORDERED
from ._structure import Structure, name_leaves
from ._torch_values import SUPPORTED, check_leaf, is_leaf, leaf_field, torch_dtype, write_column
from ._values import coerce_value
from .cache import Cache

__all__ = ["CachedDataset"]

log = logging.getLogger("mmapcache")

install_collate()  # default_collate returns adopted batch rows without a second copy (see _batches)


def infer_fields(sample: Any) -> dict[str, Field]:
    """The cache fields for ``sample``, named by their place in it (see the module docstring)."""
    leaves = name_leaves(sample, is_leaf, supported=SUPPORTED)
    return {name: leaf_field(leaf, name) for name, leaf in leaves.items()}


class _Schema:
    """The fields of the cache, and how to go between samples and per-field leaves."""

    def __init__(self, fields: dict[str, Field], path: Path) -> None:
        self.fields = dict(fields)
        self.names = tuple(fields)
        try:
            self.structure = Structure(self.names)
        except ValueError:
            raise SchemaMismatchError(
                f"the fields {list(self.names)} of the cache at {path} were not laid out by CachedDataset "
                "(see mmapcache.torch's docstring for the naming); use another key or path",
                path=path,
                differences={"fields": (None, list(self.names))},
            ) from None
        self.tree = self.structure.tree
        self.dtypes = tuple(torch_dtype(f) if f.torch_dtype is not None else None for f in fields.values())
        self.build = self.structure.build

    def to_tensors(self, arrays: Iterable[np.ndarray[Any, Any]]) -> list[torch.Tensor]:
        """Storage arrays (one per field) as tensors of the fields' torch dtypes, sharing memory."""
        tensors = []
        for array, dtype in zip(arrays, self.dtypes, strict=True):
            tensor = torch.from_numpy(array)
            tensors.append(tensor if dtype is None else tensor.view(dtype))
        return tensors

    def flatten(self, sample: Any) -> list[Any]:
        """``sample``'s leaves in field order; ValueError/TypeError naming the first part that does not fit."""
        return self.structure.flatten(sample, is_leaf, supported=SUPPORTED)


# -- the dataset -----------------------------------------------------------------


def _default_path(key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._-")[:80] or "cache"
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    return default_dir() / f"{safe}-{digest}.mmc"


_LIVE: weakref.WeakSet[CachedDataset] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Counters are per process; a lock held by another thread at fork time would never be released.
    for dataset in list(_LIVE):
        dataset._reset_stats()
        dataset._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class CachedDataset(torch.utils.data.Dataset[Any]):
    """``dataset`` with every sample cached in one file that all processes on the node share.

    >>> ds = CachedDataset(decoded, key="imagenet-train/resize256/v1", transform=augment)  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)  # doctest: +SKIP

    ``dataset`` is any map-style dataset (``__len__`` and ``__getitem__``)
    whose samples are tensors, numpy arrays, Python bool/int/float, or a
    tuple/list/dict of those nested one level, each of a fixed shape and
    dtype. ``ds[i]`` returns the structure ``dataset[i]`` has, with every leaf
    a torch tensor (Python scalars become 0-d tensors; dtypes are kept).

    ``key`` names the cached content: the dataset and its deterministic
    preprocessing. Change it whenever they change: a cache is reused whenever
    the key matches. ``path`` defaults to ``default_dir()/<key>-<hash>.mmc``.
    The file is opened, or created with the schema of the first sample
    fetched, on first use, in whichever process gets there first: no rank
    detection. ``max_bytes``/``capacity`` cache only the first indices
    (the rest are read from ``dataset`` every time); they apply when the file
    is created.

    ``transform`` runs after the cache on every access (random augmentation).
    ``copy=False`` returns zero-copy tensors over a read-only mapping of the
    file (an in-place write to one crashes the process with SIGSEGV rather
    than corrupting the shared cache); the default returns fresh tensors.
    ``verify=True`` checks each read against its slot checksum.

    It pickles as its path and arguments (plus ``dataset`` and ``transform``),
    never the cached data, so spawn/forkserver workers and ``ddp_spawn``
    receive it cheaply and reopen the file.
    """

    def __init__(
        self,
        dataset: Any,
        path: str | os.PathLike[str] | None = None,
        *,
        key: str,
        transform: Callable[[Any], Any] | None = None,
        max_bytes: int | str | None = None,
        capacity: int | None = None,
        copy: bool = True,
        verify: bool = False,
    ) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a string naming the cached content, not {type(key).__name__}")
        if not key:
            raise ValueError("key must not be empty: it names the cached content (dataset + preprocessing)")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"dataset must be map-style (define __len__ and __getitem__); got {type(dataset).__name__}")
        if capacity is not None and max_bytes is not None:
            raise ValueError("give capacity= or max_bytes=, not both")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not {type(transform).__name__}")
        self.dataset = dataset
        self.key = key
        self.path = Path(os.path.abspath(os.fspath(path))) if path is not None else _default_path(key)
        self.transform = transform
        self.max_bytes = max_bytes
        self.capacity = capacity
        self.copy = bool(copy)
        self.verify = bool(verify)
        self._init_process_state()

    def _init_process_state(self) -> None:
        # Weakly ordered CPUs check every read (see mmapcache._slots); zero-copy views too.
        self._check_reads = self.verify or not STRONGLY_ORDERED
        self._cache: Cache | None = None
        self._schema: _Schema | None = None
        self._checked = False  # a sample from `dataset` was compared with the cache's fields
        self._views: list[torch.Tensor] | None = None  # copy=False: tensors over a read-only mapping
        self._readonly: Cache | None = None
        self._lock = threading.Lock()
        self._reset_stats()
        _LIVE.add(self)

    def _reset_stats(self) -> None:
        self._hits = self._misses = self._written = 0

    # -- pickling: the path and the arguments, never the data -------------------

    def __getstate__(self) -> dict[str, Any]:
        keep = ("dataset", "key", "path", "transform", "max_bytes", "capacity", "copy", "verify")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # -- the cache ---------------------------------------------------------------

    @property
    def cache(self) -> Cache:
        """The :class:`~mmapcache.Cache`, opened now if needed (created from ``dataset[0]`` if missing)."""
        cache = self._opened()
        if cache is None:
            if len(self) == 0:
                raise ValueError("cannot create a cache for an empty dataset")
            sample = self._fetch([0])
            self._store([0], sample)
            cache = self._cache
            assert cache is not None
        return cache

    def _opened(self) -> Cache | None:
        # `is None`, not truthiness: a Cache has a __len__.
        return self._cache if self._cache is not None else self._open_existing()

    def _open_existing(self) -> Cache | None:
        """Open the file if it exists (schema from its header); None if nobody created it yet."""
        with self._lock:
            if self._cache is None:
                try:
                    cache = Cache.open(self.path, length=len(self.dataset), key=self.key, verify=self.verify)
                except FileNotFoundError:
                    return None
                self._adopt(cache, checked=False)
            return self._cache

    def _create(self, sample: Any) -> Cache:
        """Open the file, creating it with the fields of ``sample`` if it is missing."""
        fields = infer_fields(sample)
        with self._lock:
            if self._cache is None:
                cache = Cache.open(
                    self.path,
                    fields,
                    len(self.dataset),
                    key=self.key,
                    capacity=self.capacity,
                    max_bytes=self.max_bytes,
                    verify=self.verify,
                )
                self._adopt(cache, checked=True)
            assert self._cache is not None
            return self._cache

    def _adopt(self, cache: Cache, *, checked: bool) -> None:
        self._schema = _Schema(cache.fields, self.path)
        self._checked = checked
        if not self.copy:
            self._readonly = Cache.open(self.path, readonly=True)
            with warnings.catch_warnings():
                # The mapping is PROT_READ: torch cannot make a tensor read-only,
                # but the kernel refuses the write. That is the point of copy=False.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
                self._views = self._schema.to_tensors(self._readonly.views.values())
        self._cache = cache

    def _check_schema(self, sample: Any, index: int) -> None:
        """The first sample this process fetches for an opened cache must fit its fields exactly."""
        assert self._cache is not None
        fields = infer_fields(sample)
        found = self._cache.fields
        if fields != found:
            raise SchemaMismatchError(
                f"the cache at {self.path} (key {self.key!r}) holds samples with fields "
                f"{_describe(found)}, but dataset[{index}] has {_describe(fields)}. If the data or its "
                "preprocessing changed, change the key; if the old cache is stale, remove it "
                f"(`mmapcache rm {self.path}`)",
                path=self.path,
                differences={"fields": (fields, found)},
            )
        self._checked = True

    def close(self) -> None:
        """Release the file in this process (reopened on next use). Zero-copy tensors stay valid."""
        with self._lock:
            for cache in (self._cache, self._readonly):
                if cache is not None:
                    cache.close()
            self._cache = self._readonly = None
            self._views = None
            self._schema = None

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        i = self._index(index)
        cache = self._opened()
        sample: Any = None
        counted = False  # whether Cache.get counted a miss already
        if cache is not None:
            schema = self._schema
            assert schema is not None
            if self._views is None:
                stored = cache.get(i)
                if stored is not None:
                    sample = schema.build([[t] for t in schema.to_tensors(stored.values())])[0]
                counted = True
            elif i in cache:
                if not self._check_reads:
                    cache.count(hits=1)
                    sample = schema.build([[view[i]] for view in self._views])[0]
                elif cache.get(i) is not None:
                    sample = schema.build([[view[i]] for view in self._views])[0]
                counted = True
        if sample is None:
            sample = self._load([i], counted=counted)[0]
        else:
            self._hits += 1
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``: one vectorized read for the hits, one batch write for the misses.

        torch's DataLoader calls this with each batch of indices when it is
        defined; ``default_collate`` then makes the batch (for a batch read
        here it hands back the gathered rows instead of stacking a copy).
        """
        if len(indices) == 0:
            return []
        idx = self._indices(indices)
        cache = self._opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            samples = self._load(idx.tolist(), counted=False)
        elif self._views is None:
            schema = self._schema
            assert schema is not None
            tensors = self._gather(cache, idx)
            adopt(tensors)  # default_collate may return these rows as the batch (see mmapcache._batches)
            samples = schema.build([tensor.unbind(0) for tensor in tensors])
        else:
            samples = self._read_views(cache, idx)
        if self.transform is not None:
            transform = self.transform
            samples = [transform(sample) for sample in samples]
        return samples

    def _gather(
        self,
        cache: Cache,
        idx: np.ndarray[Any, np.dtype[np.intp]],
        rows: Sequence[int] = (),
        leaves: Sequence[list[Any]] = (),
        *,
        counted: bool = False,
    ) -> list[torch.Tensor]:
        """One batch tensor per field holding samples ``idx``: hits gathered from the file, misses loaded.

        The tensors are fresh (in a DataLoader worker, in shared memory). ``rows``/``leaves``:
        samples a worker already loaded and could not store; ``counted``: the reads were counted
        in the file already (by that worker).
        """
        schema = self._schema
        assert schema is not None
        fields = list(schema.fields.values())
        tensors, arrays = new_batch(
            [(len(idx), *field.shape) for field in fields], [field.dtype for field in fields], schema.dtypes
        )
        _, hits = cache.read_many(idx, out=dict(zip(schema.names, arrays, strict=True)), count=not counted)
        self._hits += int(np.count_nonzero(hits))
        for row, given in zip(rows, leaves, strict=True):
            if not hits[row]:
                for tensor, leaf in zip(tensors, given, strict=True):
                    tensor[row] = leaf
                hits[row] = True
        if not hits.all():
            missing = np.flatnonzero(~hits)
            for row, sample in zip(missing.tolist(), self._load(idx[missing].tolist(), counted=True), strict=True):
                for tensor, leaf in zip(tensors, schema.flatten(sample), strict=True):
                    tensor[row] = leaf
        return tensors

    def _read_views(self, cache: Cache, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """``copy=False``: hits as views of the read-only mapping, misses loaded; the order kept."""
        schema, views = self._schema, self._views
        assert schema is not None
        assert views is not None
        if self._check_reads:
            _, hits = cache.read_many(idx)  # checks every slot's checksum; the copy is dropped
        else:
            hits = cache.contains_many(idx)
            ready = int(np.count_nonzero(hits))
            cache.count(hits=ready, misses=len(idx) - ready)
        found_rows = np.flatnonzero(hits)
        self._hits += len(found_rows)
        if len(found_rows) == len(idx):
            return schema.build([list(map(view.__getitem__, idx.tolist())) for view in views])
        out: list[Any] = [None] * len(idx)
        cached = schema.build([list(map(view.__getitem__, idx[found_rows].tolist())) for view in views])
        for row, sample in zip(found_rows.tolist(), cached, strict=True):
            out[row] = sample
        missing = np.flatnonzero(~hits)
        for row, sample in zip(missing.tolist(), self._load(idx[missing].tolist(), counted=True), strict=True):
            out[row] = sample
        return out

    # -- misses ----------------------------------------------------------------------

    def _fetch(self, indices: list[int]) -> list[Any]:
        """Raw samples from the wrapped dataset (through its ``__getitems__`` when it has one)."""
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None and len(indices) > 1:
            samples = list(getitems(indices))
            if len(samples) != len(indices):
                raise ValueError(f"dataset.__getitems__ returned {len(samples)} samples for {len(indices)} indices")
            return samples
        return [self.dataset[i] for i in indices]

    def _load(self, indices: list[int], *, counted: bool) -> list[Any]:
        """Misses: fetch from the dataset, write them back in one batch, return them as a hit would be.

        ``counted``: the cache already counted these misses in the file.
        """
        self._misses += len(indices)
        samples = self._store(indices, self._fetch(indices))
        if not counted and self._cache is not None:
            self._cache.count(misses=len(indices))
        return samples

    def _store(self, indices: list[int], raw: list[Any]) -> list[Any]:
        cache = self._opened()
        if cache is None:
            cache = self._create(raw[0])
        if not self._checked:
            self._check_schema(raw[0], indices[0])
        schema = self._schema
        assert schema is not None
        # Each leaf is checked against the first sample's field (one policy: tensors and
        # arrays keep its dtype exactly, Python scalars cast as Cache.put casts them),
        # then copied once, into its row of the batch arrays that put_many stores as is.
        fields = list(schema.fields.items())
        columns: list[list[Any]] = [[] for _ in fields]
        for index, sample in zip(indices, raw, strict=True):
            try:
                leaves = schema.flatten(sample)
                for column, leaf, (name, field) in zip(columns, leaves, fields, strict=True):
                    if isinstance(leaf, (torch.Tensor, np.ndarray, np.generic)):
                        column.append(check_leaf(leaf, field, name))
                    else:
                        column.append(coerce_value(leaf, field, name))
            except (TypeError, ValueError) as error:
                raise type(error)(
                    f"dataset[{index}]: {error}. mmapcache caches samples of one fixed structure, shapes "
                    f"and dtypes ({_describe(schema.fields)}, from the first sample); pad, crop or resize "
                    "before the cache, or move variable parts into transform"
                ) from None
        arrays = [write_column(column, field) for column, (_, field) in zip(columns, fields, strict=True)]
        stored = cache.put_many(indices, dict(zip(schema.names, arrays, strict=True)))
        self._written += int(np.count_nonzero(stored))
        return schema.build([t.unbind(0) for t in schema.to_tensors(arrays)])

    # -- whole batches -------------------------------------------------------------

    def loader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = False,
        *,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        **dataloader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A DataLoader over this dataset that reads each batch of hits with one copy.

        It yields exactly what ``DataLoader(ds, batch_size, shuffle,
        sampler=sampler, num_workers=num_workers, drop_last=drop_last,
        **dataloader_kwargs)`` with the default collate yields — the same
        structure, dtypes and values — but a batch of cached samples is
        gathered field by field straight into the tensors the training loop
        receives (inside workers, into shared memory, so the hand-off to the
        main process copies nothing). Misses are loaded from ``dataset`` and
        stored as usual. With a ``transform`` (it runs per sample) or a
        ``collate_fn`` of yours, batches are built from samples as
        ``DataLoader(ds)`` builds them. Any other DataLoader argument
        (``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
        ``multiprocessing_context``, ...) passes through, and samplers —
        ``DistributedSampler`` included — work as with ``DataLoader(ds)``.
        """
        collate_fn = dataloader_kwargs.pop("collate_fn", None)
        batching = batch_size is not None or dataloader_kwargs.get("batch_sampler") is not None
        if collate_fn is None:
            # Without batching DataLoader converts each sample with default_convert, so do we.
            collate_fn = as_is if batching else torch.utils.data.default_convert
            collated = batching
        else:
            collated = False
        token = uuid.uuid4().hex
        _LOADING[token] = self
        return torch.utils.data.DataLoader(
            Batched(self, collated=collated, token=token),
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            **dataloader_kwargs,
        )

    def _batch_in_worker(self, indices: Sequence[int], token: str) -> Any:
        """In a DataLoader worker: store the batch's misses, and leave the gather to the main process.

        Returns a :class:`~mmapcache._batches.Deferred` that pickles as the
        indices plus the leaves of samples that could not be stored (beyond
        the capacity, or being written by another process right now).
        """
        if self.transform is not None or len(indices) == 0:
            return self._read_batch(indices)
        idx = self._indices(indices)
        cache = self._opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            return self._read_batch(idx)
        ready = cache.contains_many(idx)
        cache.count(hits=int(np.count_nonzero(ready)))  # the main process gathers without counting
        rows: list[int] = []
        leaves: list[list[Any]] = []
        if not ready.all():
            todo = np.flatnonzero(~ready)
            samples = self._load(idx[todo].tolist(), counted=False)
            stored = cache.contains_many(idx[todo])
            schema = self._schema
            assert schema is not None
            for row, sample, cached in zip(todo.tolist(), samples, stored.tolist(), strict=True):
                if not cached:
                    rows.append(row)
                    leaves.append(schema.flatten(sample))
        return Deferred(_gather_deferred, token, str(self.path), idx, rows, leaves)

    def _read_batch(
        self, indices: Any, rows: Sequence[int] = (), leaves: Sequence[list[Any]] = (), *, deferred: bool = False
    ) -> Any:
        """The batch ``default_collate(self.__getitems__(indices))`` is, with one copy for the hits.

        ``deferred``: a worker prepared this batch (see :meth:`_batch_in_worker`) and counted its
        reads; ``rows``/``leaves`` are samples it loaded but could not store.
        """
        if self.transform is not None or len(indices) == 0:
            return torch.utils.data.default_collate(self.__getitems__(indices))
        idx = self._indices(indices)
        cache = self._opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            return torch.utils.data.default_collate(self._load(idx.tolist(), counted=False))
        schema = self._schema
        assert schema is not None
        return collate_tree(schema.tree, self._gather(cache, idx, rows, leaves, counted=deferred))

    def _indices(self, indices: Any) -> np.ndarray[Any, np.dtype[np.intp]]:
        """``indices`` validated like ``ds[i]`` (negative ones count from the end), as one array."""
        given = np.asarray(indices)
        n = len(self.dataset)
        if given.ndim != 1 or given.dtype.kind not in "iu" or (given.size and int(given.max()) >= n):
            return np.fromiter((self._index(i) for i in indices), np.intp, len(indices))
        idx = given.astype(np.intp)
        if idx.size and int(idx.min()) < 0:
            idx = np.where(idx < 0, idx + n, idx)
            if int(idx.min()) < 0:
                return np.fromiter((self._index(i) for i in indices), np.intp, len(indices))
        return idx

    # -- filling and statistics ----------------------------------------------------

    def stats(self) -> dict[str, int]:
        """How the cache is used, by this process and by every process that uses the file.

        ``hits``, ``misses`` (reads that went to ``dataset``) and ``written``
        (slots filled) count this process; ``total_hits``, ``total_misses``
        and ``total_written`` count every process that ever used the file —
        DataLoader workers, DDP ranks, other jobs — since it was created
        (they are kept in the file); ``processes`` is how many processes
        count into it now; ``filled``, ``capacity`` and ``length`` describe
        the file. For one epoch's hit rate across workers, subtract the totals
        before it from those after it.

        Opens the cache (creating it from ``dataset[0]`` if missing).
        """
        cache = self.cache
        usage = cache.usage()
        return {
            "hits": self._hits,
            "misses": self._misses,
            "written": self._written,
            "total_hits": usage.total.hits,
            "total_misses": usage.total.misses,
            "total_written": usage.total.written,
            "processes": len(usage.processes),
            "filled": cache.filled,
            "capacity": cache.capacity,
            "length": cache.length,
        }

    def _missing(self) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The cacheable indices (``< capacity``) not filled yet (creates the file if needed)."""
        cache = self.cache
        everything = np.arange(cache.capacity, dtype=np.intp)
        missing: np.ndarray[Any, np.dtype[np.intp]] = everything[~cache.contains_many(everything)]
        return missing

    def fill(self, num_workers: int = 0, batch_size: int = 64, progress: bool = True) -> int:
        """Fill every missing cacheable slot; return how many slots this call filled.

        ``num_workers > 0`` loads batches in that many worker processes
        (through a DataLoader, so ``dataset`` must pickle under its
        multiprocessing context); each worker writes straight into the file.
        ``progress`` shows a tqdm bar when tqdm is installed.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        before = self._written
        missing = self._missing()  # may create the file, storing dataset[0]
        chunks = [missing[start : start + batch_size] for start in range(0, len(missing), batch_size)]
        bar = _progress(len(missing), f"filling {self.path.name}", enabled=progress)
        filled = self._written - before
        try:
            if num_workers > 0 and chunks:
                loader = torch.utils.data.DataLoader(
                    _FillTasks(self, chunks), batch_size=None, num_workers=num_workers, collate_fn=_identity
                )
                for done, wrote in loader:
                    filled += wrote
                    if bar is not None:
                        bar.update(done)
            else:
                for chunk in chunks:
                    done, wrote = self._fill_chunk(chunk)
                    filled += wrote
                    if bar is not None:
                        bar.update(done)
        finally:
            if bar is not None:
                bar.close()
        return filled

    def _fill_chunk(self, chunk: np.ndarray[Any, Any]) -> tuple[int, int]:
        """Load and store ``chunk``'s slots still missing; (slots handled, slots this call wrote)."""
        cache = self.cache
        todo = chunk[~cache.contains_many(chunk)].tolist()
        before = self._written
        if todo:
            self._store(todo, self._fetch(todo))
        return len(chunk), self._written - before

    def __repr__(self) -> str:
        return f"CachedDataset({type(self.dataset).__name__}, {str(self.path)!r}, key={self.key!r})"

    def _index(self, index: Any) -> int:
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


# The datasets whose loader() may send Deferred batches, by the token their workers carry.
_LOADING: weakref.WeakValueDictionary[str, CachedDataset] = weakref.WeakValueDictionary()


def _gather_deferred(token: str, path: str, indices: Any, rows: list[int], leaves: list[list[Any]]) -> Any:
    """Unpickling a worker's Deferred batch: gather it here, from this process's handle of the file."""
    dataset = _LOADING.get(token)
    if dataset is None:
        raise RuntimeError(
            f"a batch of the mmapcache loader over {path} arrived in a process that did not create that "
            "loader; iterate a loader() in the process that called loader()"
        )
    return dataset._read_batch(indices, rows, leaves, deferred=True)


class _FillTasks(torch.utils.data.Dataset[tuple[int, int]]):
    """fill()'s work items for DataLoader workers: each loads and stores one chunk of indices."""

    def __init__(self, dataset: CachedDataset, chunks: list[np.ndarray[Any, Any]]) -> None:
        self.dataset, self.chunks = dataset, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> tuple[int, int]:
        return self.dataset._fill_chunk(self.chunks[k])


def _identity(value: Any) -> Any:
    return value


def _progress(total: int, description: str, *, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        log.info("%s: %d samples (install tqdm for a progress bar)", description, total)
        return None
    return tqdm(total=total, desc=description, unit="sample")


def _describe(fields: Mapping[str, Field]) -> str:
    return "{" + ", ".join(f"{name!r}: {field.shape} {field.dtype_name}" for name, field in fields.items()) + "}"
