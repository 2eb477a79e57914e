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

The same names declare the schema with ``fields=`` when samples vary in
shape: ``(tokens, label)`` with ``fields={"0": Field((None,), "int64"),
"1": Field((), "int64")}``. A variable leaf comes back as a tensor of its own
shape; :func:`pad_collate` makes batches of them (a :class:`Padded` tensor
plus lengths).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ._batches import (
    Batched,
    Deferred,
    Padded,
    adopt,
    as_is,
    collate_tree,
    install_collate,
    new_batch,
    pad_collate,
)
from ._errors import CacheError, CacheInUseError, SchemaMismatchError, StaleCacheError
from ._field import Field, FieldsLike, normalize_fields
from ._file import remove
from ._format import indices_digest, slot_nbytes
from ._paths import default_dir
from ._sampler import NodeShardSampler
from ._slots import STRONGLY_ORDERED
from ._structure import Structure, name_leaves
from ._testing_compare import difference
from ._torch_values import (
    SUPPORTED,
    LeafShapeError,
    as_text,
    check_declared,
    check_leaf,
    convert_leaf,
    is_leaf,
    leaf_field,
    leaf_hint,
    leaf_shape,
    torch_dtype,
    variable_column,
    write_column,
)
from ._values import coerce_value
from ._variable import text_value
from .cache import Cache

__all__ = ["CachedDataset", "CachedStream", "NodeShardSampler", "Padded", "pad_collate"]

log = logging.getLogger("mmapcache")

install_collate()  # default_collate returns adopted batch rows without a second copy (see _batches)


def infer_fields(sample: Any) -> dict[str, Field]:
    """The cache fields for ``sample``, named by their place in it (see the module docstring)."""
    leaves = name_leaves(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)
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
        # Variable fields are read as one array per sample; the batch tricks are for fixed ones only.
        self.variable = tuple(field.variable for field in fields.values())
        self.fixed = [name for name, field in fields.items() if not field.variable]
        self.ragged = any(self.variable)
        self.texts = tuple(field.text for field in fields.values())

    def to_tensor(self, array: Any, position: int) -> Any:
        """A storage array of the field at ``position`` as a tensor of its torch dtype, sharing memory.

        A text field's value is its ``str``/``bytes`` (decoded here when given as stored bytes).
        """
        kind = self.texts[position]
        if kind is not None:
            return array if isinstance(array, (str, bytes)) else text_value(kind, array)
        tensor = torch.from_numpy(array)
        dtype = self.dtypes[position]
        return tensor if dtype is None else tensor.view(dtype)

    def to_tensors(self, arrays: Iterable[np.ndarray[Any, Any]]) -> list[torch.Tensor]:
        """Storage arrays (one per field) as tensors of the fields' torch dtypes, sharing memory."""
        return [self.to_tensor(array, k) for k, array in enumerate(arrays)]

    def flatten(self, sample: Any) -> list[Any]:
        """``sample``'s leaves in field order; ValueError/TypeError naming the first part that does not fit."""
        return self.structure.flatten(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)


# -- the dataset -----------------------------------------------------------------


def _default_path(key: str, shard: np.ndarray[Any, Any] | None = None) -> Path:
    """``default_dir()/<key>-<hash>.mmc``; a shard's hash covers its index set too, so each shard has its own file."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._-")[:80] or "cache"
    named = hashlib.sha256(key.encode("utf-8"))
    if shard is not None:
        named.update(b"\0" + indices_digest(shard).encode("ascii"))
    return default_dir() / f"{safe}-{named.hexdigest()[:12]}.mmc"


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
    whose samples are tensors, numpy arrays, Python bool/int/float/str/bytes,
    or a tuple/list/dict of those nested one level. ``ds[i]`` returns the
    structure ``dataset[i]`` has, with every leaf a torch tensor (Python
    scalars become 0-d tensors; dtypes are kept) except ``str`` and
    ``bytes``, which come back as themselves (``default_collate`` makes
    lists of them). ``dtypes`` (``{field name: dtype}``, torch or numpy)
    sets the storage dtype of those fields: values are converted when stored
    and must convert exactly (else ``ValueError``/``TypeError`` naming the
    field and the value), and reads return the storage dtype.

    Without ``fields`` every leaf keeps the shape and dtype of the first
    sample. ``fields`` declares them instead, by the leaves' field names (see
    the module docstring), and may give dimensions that vary from sample to
    sample as ``None``: for ``(tokens, label)`` samples,
    ``fields={"0": Field((None,), "int64"), "1": Field((), "int64")}``. Such
    a cache needs ``max_bytes`` (it sizes the room for the variable values).

    ``key`` names the cached content: the dataset and its deterministic
    preprocessing. Change it whenever they change: a cache is reused whenever
    the key matches. ``path`` defaults to ``default_dir()/<key>-<hash>.mmc``
    (with ``cached_indices``, the hash covers the index set too).
    The file is opened, or created with the schema of the first sample
    fetched, on first use, in whichever process gets there first: no rank
    detection. ``max_bytes``/``capacity`` cache only the first indices
    (the rest are read from ``dataset`` every time); they apply when the file
    is created.

    ``check`` guards against stale and random data: when a process first
    uses an existing cache it compares ``check`` cached samples with fresh
    ones from ``dataset`` (:class:`~mmapcache.StaleCacheError` when one
    differs), and the first miss of a process loads its sample twice (a
    :class:`~mmapcache.CacheError` when the two differ: random augmentation
    belongs in ``transform``). It costs ``check + 1`` sample loads per
    process; ``check=0`` turns both checks off.

    ``transform`` runs after the cache on every access (random augmentation).
    ``copy=False`` returns zero-copy tensors over a read-only mapping of the
    file (an in-place write to one crashes the process with SIGSEGV rather
    than corrupting the shared cache; a ``transform`` that writes to its
    input is refused with a ``ValueError`` first); the default returns fresh
    tensors.
    ``verify=True`` checks each read against its slot checksum.

    ``cached_indices`` caches only those indices of ``dataset`` — one node's
    shard in a job spanning many nodes (see :class:`NodeShardSampler` and
    its ``node_indices``): the file holds ``len(cached_indices)`` slots and
    keeps the index set, ``ds[i]`` for any other ``i`` is read from
    ``dataset`` every time, uncached, and ``len(ds)`` stays
    ``len(dataset)``. Opening a file made for another index set (another
    node's shard, another node count) raises :class:`SchemaMismatchError`.

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
        fields: FieldsLike | None = None,
        cached_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
        dtypes: Mapping[str, Any] | None = None,
        check: int = 2,
    ) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a string naming the cached content, not {type(key).__name__}")
        if not key:
            raise ValueError("key must not be empty: it names the cached content (dataset + preprocessing)")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"dataset must be map-style (define __len__ and __getitem__); got {type(dataset).__name__}")
        declared = _declared_fields(fields) if fields is not None else None
        variable = declared is not None and any(field.variable for field in declared.values())
        if capacity is not None and max_bytes is not None and not variable:
            raise ValueError("give capacity= or max_bytes=, not both")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not {type(transform).__name__}")
        if dtypes is not None and fields is not None:
            raise ValueError("give dtypes= or fields=, not both: fields= declares every field's dtype already")
        if isinstance(check, bool) or not isinstance(check, int) or check < 0:
            raise ValueError(f"check must be a number of samples (0 disables the check), not {check!r}")
        self.dtypes = None if dtypes is None else _storage_dtypes(dtypes)
        self.check = check
        self.dataset = dataset
        self.fields = declared
        self.key = key
        self.cached_indices = None if cached_indices is None else _index_set(cached_indices, len(dataset))
        self.path = (
            Path(os.path.abspath(os.fspath(path))) if path is not None else _default_path(key, self.cached_indices)
        )
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
        self._deterministic = False  # the dataset gave the same sample twice (checked once per process)
        self._transform_checked = False  # copy=False: the transform was seen not to write to its input
        self._views: list[torch.Tensor | None] | None = None  # copy=False: tensors over a read-only mapping
        self._readonly: Cache | None = None
        self._lock = threading.Lock()
        self._reset_stats()
        _LIVE.add(self)

    def _reset_stats(self) -> None:
        self._hits = self._misses = self._written = 0

    # -- pickling: the path and the arguments, never the data -------------------

    def __getstate__(self) -> dict[str, Any]:
        keep = (
            "dataset",
            "key",
            "path",
            "transform",
            "max_bytes",
            "capacity",
            "copy",
            "verify",
            "fields",
            "cached_indices",
            "dtypes",
            "check",
        )
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
            self._load([0], counted=False)
            cache = self._cache
            assert cache is not None
        return cache

    def _opened(self) -> Cache | None:
        # `is None`, not truthiness: a Cache has a __len__.
        return self._cache if self._cache is not None else self._open_existing()

    def _open_existing(self) -> Cache | None:
        """Open the file if it exists (schema from its header); None if nobody created it yet.

        The first open in a process compares ``check`` cached samples with fresh ones.
        """
        with self._lock:
            if self._cache is not None:
                return self._cache
            cache = self._open_file()
            if cache is None:
                return None
            self._check_opened(cache)
            self._adopt(cache, checked=False)
        if self.check:
            self._check_content(cache)
        return self._cache

    def _open_file(self) -> Cache | None:
        """The existing file, or None: missing, or refuted (removed here, to be created anew)."""
        deadline = time.monotonic() + _REFUTED_WAIT
        while True:
            try:
                cache = Cache.open(
                    self.path,
                    length=self._cache_length(),
                    key=self.key,
                    verify=self.verify,
                    dataset_indices=self.cached_indices,
                )
            except FileNotFoundError:
                return None
            if not (cache.refuted and self.fields is None):
                return cache
            # A first try created it from a sample whose shapes the rest of the dataset does not share.
            cache.close()
            try:
                remove(self.path)
            except FileNotFoundError:
                return None
            except CacheInUseError as error:
                if time.monotonic() > deadline:
                    raise SchemaMismatchError(
                        f"the cache at {self.path} (key {self.key!r}) was created with fields that do not fit the "
                        f"dataset (a first try inferred them from one sample), and it is still open in processes "
                        f"{error.pids}. Stop them (or close their datasets); the next use replaces it",
                        path=self.path,
                    ) from None
                time.sleep(0.05)
                continue
            log.warning("removed %s: its fields were found not to fit the dataset; creating it anew", self.path)
            return None

    def _check_opened(self, cache: Cache) -> None:
        """An opened file must be what this dataset makes: its shard, its declared fields and dtypes."""
        problem: tuple[str, dict[str, tuple[Any, Any]]] | None = None
        if self.cached_indices is None and cache.dataset_indices is not None:
            problem = (
                f"holds {cache.length} chosen indices of a dataset (one node's shard), but this CachedDataset "
                "caches the whole dataset. Pass the same cached_indices= as its creator, or use another path or "
                "key for the whole dataset",
                {"dataset_indices": (None, "an index table")},
            )
        elif self.fields is not None and cache.fields != self.fields:
            problem = (
                f"holds samples with fields {_describe(cache.fields)}, but fields= declares "
                f"{_describe(self.fields)}. If the data or its preprocessing changed, change the key; if the old "
                f"cache is stale, remove it (`mmapcache rm {self.path}`)",
                {"fields": (self.fields, cache.fields)},
            )
        elif self.dtypes is not None:
            wanted = {name: Field((), dtype).dtype_name for name, dtype in self.dtypes.items()}
            found = {name: cache.fields[name].dtype_name if name in cache.fields else None for name in wanted}
            if found != wanted:
                problem = (
                    f"stores the fields {found}, but dtypes= asks for {wanted}. Change the key for the new "
                    f"storage dtypes, or remove the old cache (`mmapcache rm {self.path}`)",
                    {"dtypes": (wanted, found)},
                )
        if problem is not None:
            cache.close()
            raise SchemaMismatchError(
                f"the cache at {self.path} (key {self.key!r}) {problem[0]}", path=self.path, differences=problem[1]
            )

    def _check_content(self, cache: Cache) -> None:
        """Compare up to ``check`` cached samples with fresh ones from the dataset: a stale cache is refused.

        Costs ``check`` sample loads per process (one more for the first, loaded twice:
        a dataset that is not deterministic is refused too).
        """
        positions = _some_ready(cache, self.check)
        if not positions:
            return
        raw = self._fetch(positions)
        indices = self._sources(positions)
        if not self._deterministic:
            self._check_deterministic(indices[0], raw[0])
        if not self._checked:
            try:
                self._check_schema(raw[0], indices[0])
            except SchemaMismatchError as error:
                raise StaleCacheError(
                    str(error), path=self.path, differences=error.differences, index=indices[0]
                ) from None
        schema = self._schema
        assert schema is not None
        fresh = self._build(schema, self._columns(schema, positions, raw))
        read, hits = cache.read_many(np.asarray(positions, np.intp), count=False)
        for row, (index, sample) in enumerate(zip(indices, fresh, strict=True)):
            if not hits[row]:
                continue
            values = [
                read[name][row] if schema.variable[k] else read[name][row, ...] for k, name in enumerate(schema.names)
            ]
            cached = schema.build([[schema.to_tensor(value, k)] for k, value in enumerate(values)])[0]
            found = difference(cached, sample)
            if found is not None:
                field = _field_of(found)
                raise StaleCacheError(
                    f"the cache at {self.path} (key {self.key!r}) is stale: its dataset[{index}] differs from what "
                    f"the dataset gives now ({found.replace('sample', 'cached sample', 1)}). The data or its "
                    "preprocessing changed but the key did not: change the key (e.g. add a version: "
                    f"'{self.key}/v2'), or remove the old cache (`mmapcache rm {self.path}`). "
                    "CachedDataset(check=0) skips this check",
                    path=self.path,
                    index=index,
                    field=field,
                    differences={"content": (index, field)},
                )

    def _create(self, fields: dict[str, Field], text_bytes: int | None = None) -> Cache:
        """Open the file, creating it with ``fields`` if it is missing.

        ``text_bytes``: room for text values when ``max_bytes`` was not given (see :func:`_text_budget`).
        """
        with self._lock:
            if self._cache is None:
                cache = Cache.open(
                    self.path,
                    fields,
                    self._cache_length(),
                    key=self.key,
                    capacity=self.capacity,
                    max_bytes=self.max_bytes if self.max_bytes is not None else text_bytes,
                    verify=self.verify,
                    dataset_indices=self.cached_indices,
                )
                self._adopt(cache, checked=True)
            assert self._cache is not None
            return self._cache

    def _cache_length(self) -> int:
        """Positions in the file: the dataset's length, or the number of ``cached_indices``."""
        return len(self.dataset) if self.cached_indices is None else len(self.cached_indices)

    def _positions(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, np.dtype[np.intp]] | None:
        """Where dataset indices ``idx`` sit in the file; ``None`` when one of them is not cached there."""
        shard = self.cached_indices
        if shard is None:
            return idx
        at = np.searchsorted(shard, idx)
        if at.size and (int(at.max()) >= len(shard) or not np.array_equal(shard[at], idx)):
            return None
        return at.astype(np.intp)

    def _sources(self, positions: list[int]) -> list[int]:
        """The dataset indices that file positions cache."""
        shard = self.cached_indices
        return positions if shard is None else shard[positions].tolist()

    def _adopt(self, cache: Cache, *, checked: bool) -> None:
        self._schema = _Schema(cache.fields, self.path)
        self._checked = checked
        if not self.copy:
            self._readonly = Cache.open(self.path, readonly=True)
            views = self._readonly.views
            with warnings.catch_warnings():
                # The mapping is PROT_READ: torch cannot make a tensor read-only,
                # but the kernel refuses the write. That is the point of copy=False.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
                # Variable fields have no such view: they are read as copies (None here).
                self._views = [
                    None if self._schema.variable[k] else self._schema.to_tensor(views[name], k)
                    for k, name in enumerate(self._schema.names)
                ]
        self._cache = cache

    def _check_schema(self, sample: Any, index: int) -> None:
        """The first sample this process fetches for an opened cache must fit its fields.

        With ``fields=`` the file holds exactly the declared fields (checked
        when it was opened) and the sample is checked against the declaration;
        otherwise a sample that does not fit the file's fields means a stale
        cache.
        """
        assert self._cache is not None
        found = self._cache.fields
        if self.fields is not None:
            _check_declared_sample(sample, index, found)
        else:
            fields = self._inferred(sample, index)
            if fields != found and _misfit(sample, found) is not None:
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
        shard = self.cached_indices
        if shard is not None:  # a shard: its position in the file, if it is one of them
            at = int(shard.searchsorted(i))
            if at == len(shard) or shard[at] != i:  # not one of cached_indices: read from the dataset every time
                return self._uncached(np.array([i], np.intp))[0]
            i = at
        cache = self._opened()
        sample: Any = None
        counted = False  # whether Cache.get counted a miss already
        if cache is not None:
            schema = self._schema
            assert schema is not None
            views = self._views
            if views is None:
                stored = cache.get(i)
                if stored is not None:
                    sample = schema.build([[t] for t in schema.to_tensors(stored[n] for n in schema.names)])[0]
                counted = True
            elif i in cache:
                if not self._check_reads and not schema.ragged:
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
                counted = True
        if sample is None:
            sample = self._load([i], counted=counted)[0]
        else:
            self._hits += 1
        if self.transform is None:
            return sample
        if not self._transform_checked and self._views is not None:
            self._check_transform(sample)
        return self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``: one vectorized read for the hits, one batch write for the misses.

        torch's DataLoader calls this with each batch of indices when it is
        defined; ``default_collate`` then makes the batch (for a batch read
        here it hands back the gathered rows instead of stacking a copy).
        """
        if len(indices) == 0:
            return []
        given = self._indices(indices)
        idx = self._positions(given)
        if idx is None:  # some are not among cached_indices: read those from the dataset
            return self._partly_cached(given)
        cache = self._opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            samples = self._load(idx.tolist(), counted=False)
        elif self._views is None:
            schema = self._schema
            assert schema is not None
            columns = self._gather(cache, idx)
            # default_collate may return these rows as the batch (see mmapcache._batches).
            adopt([column for column in columns if isinstance(column, torch.Tensor)])
            samples = schema.build([_rows(column) for column in columns])
        else:
            samples = self._read_views(cache, idx)
        if self.transform is not None:
            transform = self.transform
            if not self._transform_checked and self._views is not None:
                self._check_transform(samples[0])
            samples = [transform(sample) for sample in samples]
        return samples

    def _check_transform(self, sample: Any) -> None:
        """``copy=False``: run the transform once on a writable copy; one that writes to its input is refused.

        Zero-copy samples are read-only views of the shared file: an in-place
        transform would crash the process with SIGSEGV. torch's version counters
        tell whether the transform wrote to any tensor of the sample.
        """
        assert self.transform is not None
        copy = _clone(sample)
        tensors = list(_tensors(copy))
        versions = [t._version for t in tensors]
        self.transform(copy)
        written = [k for k, (t, v) in enumerate(zip(tensors, versions, strict=True)) if t._version != v]
        if written:
            raise ValueError(
                f"transform {self.transform!r} writes to its input in place (e.g. Normalize(inplace=True), "
                "tensor.mul_(), x[...] = ...), but with copy=False the samples are read-only views of the shared "
                "cache file: the write would kill the process with SIGSEGV. Use CachedDataset(..., copy=True) "
                "(the default), or make the transform out of place (e.g. Normalize(inplace=False))"
            )
        self._transform_checked = True

    def _uncached(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """Samples of indices outside ``cached_indices``: from the dataset, as a cached read returns them."""
        self._misses += len(idx)
        raw = self._fetch_indices(idx.tolist())
        cache = self.cache  # its schema converts them (creating it from the first cached index if needed)
        cache.count(misses=len(idx))
        assert self._schema is not None
        samples = self._build(self._schema, self._columns(self._schema, idx.tolist(), raw, positions=False))
        return samples if self.transform is None else [self.transform(sample) for sample in samples]

    def _partly_cached(self, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """``__getitems__`` for indices of which some are outside ``cached_indices``; the order kept."""
        assert self.cached_indices is not None
        member = np.isin(idx, self.cached_indices)
        out: list[Any] = [None] * len(idx)
        rows = np.flatnonzero(member)
        if rows.size:
            for row, sample in zip(rows.tolist(), self.__getitems__(idx[rows].tolist()), strict=True):
                out[row] = sample
        others = np.flatnonzero(~member)
        for row, sample in zip(others.tolist(), self._uncached(idx[others]), strict=True):
            out[row] = sample
        return out

    def _gather(
        self,
        cache: Cache,
        idx: np.ndarray[Any, np.dtype[np.intp]],
        rows: Sequence[int] = (),
        leaves: Sequence[list[Any]] = (),
        *,
        counted: bool = False,
    ) -> list[Any]:
        """One column per field holding samples ``idx``: hits read from the file, misses loaded.

        A fixed field's column is one fresh batch tensor (in a DataLoader worker, in shared
        memory); a variable field's is a list of fresh tensors, one per sample, each of its own
        shape. ``rows``/``leaves``: samples a worker already loaded and could not store;
        ``counted``: the reads were counted in the file already (by that worker).
        """
        schema = self._schema
        assert schema is not None
        fixed = [schema.fields[name] for name in schema.fixed]
        tensors, arrays = new_batch(
            [(len(idx), *field.fixed_shape) for field in fixed],
            [field.dtype for field in fixed],
            [schema.dtypes[schema.names.index(name)] for name in schema.fixed],
        )
        out = dict(zip(schema.fixed, arrays, strict=True))
        read, hits = cache.read_many(idx, out=out, count=not counted)  # variable fields: lists
        self._hits += int(np.count_nonzero(hits))
        batch = iter(tensors)
        columns: list[Any] = [
            [None if a is None else schema.to_tensor(a, k) for a in read[name]] if schema.variable[k] else next(batch)
            for k, name in enumerate(schema.names)
        ]
        for row, given in zip(rows, leaves, strict=True):
            if not hits[row]:
                _set_row(columns, row, given)
                hits[row] = True
        if not hits.all():
            missing = np.flatnonzero(~hits)
            for row, sample in zip(missing.tolist(), self._load(idx[missing].tolist(), counted=True), strict=True):
                _set_row(columns, row, schema.flatten(sample))
        return columns

    def _read_views(self, cache: Cache, idx: np.ndarray[Any, np.dtype[np.intp]]) -> list[Any]:
        """``copy=False``: hits as views of the read-only mapping, misses loaded; the order kept.

        Variable fields have no such views: their values are read as fresh copies.
        """
        schema, views = self._schema, self._views
        assert schema is not None
        assert views is not None
        read: dict[str, Any] = {}
        if self._check_reads or schema.ragged:
            read, hits = cache.read_many(idx)  # checks every slot; the copies of fixed fields are dropped
        else:
            hits = cache.contains_many(idx)
            ready = int(np.count_nonzero(hits))
            cache.count(hits=ready, misses=len(idx) - ready)
        found_rows = np.flatnonzero(hits)
        self._hits += len(found_rows)
        found = idx[found_rows].tolist()
        columns = [
            list(map(view.__getitem__, found))
            if view is not None
            else [schema.to_tensor(read[name][row], k) for row in found_rows.tolist()]
            for k, (name, view) in enumerate(zip(schema.names, views, strict=True))
        ]
        cached = schema.build(columns)
        if len(found_rows) == len(idx):
            return cached
        out: list[Any] = [None] * len(idx)
        for row, sample in zip(found_rows.tolist(), cached, strict=True):
            out[row] = sample
        missing = np.flatnonzero(~hits)
        for row, sample in zip(missing.tolist(), self._load(idx[missing].tolist(), counted=True), strict=True):
            out[row] = sample
        return out

    # -- misses ----------------------------------------------------------------------

    def _fetch(self, positions: list[int]) -> list[Any]:
        """Raw samples for file positions, from the wrapped dataset."""
        return self._fetch_indices(self._sources(positions))

    def _fetch_indices(self, indices: list[int]) -> list[Any]:
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
        samples = self._store(indices, self._fetch(indices), first_miss=not self._deterministic and bool(self.check))
        if not counted and self._cache is not None:
            self._cache.count(misses=len(indices))
        return samples

    def _check_deterministic(self, index: int, sample: Any) -> None:
        """The first miss of a process loads its sample twice: a random dataset must not be frozen in the cache."""
        again = self._fetch_indices([index])[0]
        found = difference(again, sample)
        if found is not None:
            raise CacheError(
                f"the dataset is not deterministic: dataset[{index}] gave two different samples when loaded twice "
                f"({found.replace('sample', 'the second', 1)}). A cache would freeze one of them forever (one "
                "random augmentation per sample). Move random augmentation into CachedDataset(..., transform=...), "
                "which runs after the cache on every access, and keep only the deterministic part (decode, resize, "
                "tokenize) in the wrapped dataset",
                path=self.path,
            )
        self._deterministic = True

    def _store(self, indices: list[int], raw: list[Any], *, first_miss: bool = False) -> list[Any]:
        """Store freshly loaded samples (checked against the schema first); return them as a read would.

        ``first_miss``: once the batch passed the schema checks, its first sample is loaded once
        more and compared, before anything is created or stored.
        """
        first = self._sources(indices[:1])[0]
        cache = self._opened()
        if cache is None:
            # Nobody created the file yet: the whole batch is checked against the schema first,
            # so a batch whose shapes vary (without fields=) leaves no file behind.
            fields = self._first_fields(raw[0], first)
            schema = _Schema(fields, self.path)
            columns = self._columns(schema, indices, raw)
            if first_miss:
                self._check_deterministic(first, raw[0])
            cache = self._create(fields, _text_budget(schema, columns, self._cache_length()))
            assert self._schema is not None
            if self._schema.names != schema.names:  # another process created it, its fields in another order
                schema = self._schema
                columns = self._columns(schema, indices, raw)
        else:
            if not self._checked:
                self._check_schema(raw[0], first)
            assert self._schema is not None
            schema = self._schema
            columns = self._columns(schema, indices, raw)
            if first_miss:
                self._check_deterministic(first, raw[0])
        stored = cache.put_many(indices, dict(zip(schema.names, columns, strict=True)))
        self._written += int(np.count_nonzero(stored))
        return self._build(schema, columns)

    @staticmethod
    def _build(schema: _Schema, columns: list[Any]) -> list[Any]:
        """Samples, as a read returns them, from the columns :meth:`_columns` made."""
        return schema.build(
            [
                [schema.to_tensor(a, k) for a in column]
                if schema.variable[k]
                else schema.to_tensor(column, k).unbind(0)
                for k, column in enumerate(columns)
            ]
        )

    def _first_fields(self, sample: Any, index: int) -> dict[str, Field]:
        """The fields to create the file with: ``fields=`` (checked against ``sample``) or ``sample``'s own.

        ``dtypes=`` sets the storage dtype of the fields it names.
        """
        if self.fields is None:
            return self._inferred(sample, index)
        _check_declared_sample(sample, index, self.fields)
        # The sample's order (dict keys keep theirs).
        order = name_leaves(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)
        return {name: self.fields[name] for name in order}

    def _inferred(self, sample: Any, index: int) -> dict[str, Field]:
        """``sample``'s own fields, with the storage dtypes ``dtypes=`` sets."""
        fields = infer_fields(sample)
        for name, dtype in (self.dtypes or {}).items():
            if name not in fields:
                raise ValueError(
                    f"dtypes= names the field {name!r}, but dataset[{index}] has the fields {list(fields)} "
                    "(named by their place in the sample: see mmapcache.torch)"
                )
            if fields[name].text is not None:
                raise TypeError(f"dtypes= gives field {name!r} a dtype, but it holds {fields[name].text} values")
            fields[name] = Field(fields[name].shape, dtype)
        return fields

    def _columns(self, schema: _Schema, indices: list[int], raw: list[Any], *, positions: bool = True) -> list[Any]:
        """The batch ``put_many`` stores: per field, the rows stacked (fixed) or a list of arrays (variable).

        ``indices`` (file positions, or dataset indices when not ``positions``) name samples in errors.

        Each leaf is checked against its field (one policy: tensors and arrays keep its
        dtype exactly and fit its shape, Python scalars cast as Cache.put casts them), then
        copied once: into its row of a fixed field's batch array, or into its own array.
        """
        fields = list(schema.fields.items())
        columns: list[list[Any]] = [[] for _ in fields]
        for index, sample in zip(self._sources(indices) if positions else indices, raw, strict=True):
            try:
                leaves = schema.flatten(sample)
                for column, leaf, (name, field) in zip(columns, leaves, fields, strict=True):
                    if self.dtypes is not None and name in self.dtypes:
                        try:
                            leaf = convert_leaf(leaf, field, name)
                        except (TypeError, ValueError) as error:
                            raise _ConversionError(type(error), f"dataset[{index}]: {error}") from None
                    if field.text is not None:
                        column.append(coerce_value(_text_or_leaf(leaf), field, name))
                    elif isinstance(leaf, (torch.Tensor, np.ndarray, np.generic)):
                        column.append(check_leaf(leaf, field, name))
                    else:
                        column.append(coerce_value(leaf, field, name))
            except LeafShapeError as error:
                if self.fields is not None:
                    raise ValueError(f"dataset[{index}]: {error}, which fields= declares") from None
                raise ValueError(self._varying_shapes(schema, index, error, raw)) from None
            except _ConversionError as error:
                raise error.kind(error.message) from None
            except (TypeError, ValueError) as error:
                origin = "as fields= declares" if self.fields is not None else "from the first sample"
                raise type(error)(
                    f"dataset[{index}]: {error}. mmapcache caches samples of one structure and dtype per field "
                    f"({_describe(schema.fields)}, {origin}); convert them before the cache, or in transform"
                ) from None
        return [
            variable_column(column, field) if field.variable else write_column(column, field)
            for column, (_, field) in zip(columns, fields, strict=True)
        ]

    def _refute(self) -> str:
        """Mark the file as not fitting the dataset, and remove it now if nobody else has it open; say which."""
        cache = self._cache
        if cache is None or cache.readonly:
            return f"remove it (`mmapcache rm {self.path}`) before the next try."
        cache.refute()
        self.close()
        try:
            remove(self.path)
        except CacheInUseError:
            return (
                "it is marked as not fitting the dataset, and the next try replaces it once the processes using "
                "it now have let go (nothing to remove by hand)."
            )
        except FileNotFoundError:
            pass
        return "it was removed, so the next try starts afresh."

    def _varying_shapes(self, schema: _Schema, index: int, error: LeafShapeError, raw: list[Any]) -> str:
        """The message for a sample whose shape differs from the first one's, when ``fields=`` was not given."""
        name, shape, field = error.name, error.shape, error.field
        if self._cache is None:  # nothing was created: the schema is the first sample's of this batch
            where, exists = f"the first sample's is {field.shape}", ""
        else:
            where = f"the cache's field has the fixed shape {field.shape}"
            exists = f" The cache at {self.path} was made with fixed shapes: {self._refute()}"
        if len(shape) != len(field.shape):
            return (
                f"dataset[{index}]: field {name!r} has shape {shape}, but {where}: a field has a fixed number of "
                "dimensions; only their sizes may vary (declared as None with fields=). Reshape or pad before the "
                f"cache, or move that part into transform.{exists}"
            )
        return (
            f"dataset[{index}]: field {name!r} has shape {shape}, but {where}: without fields=, every field keeps "
            "the fixed shape of the first sample. To cache samples whose shapes vary, declare the fields with None "
            "for each dimension that varies, and a max_bytes= budget for the values: "
            f"CachedDataset(..., fields={_declaration(schema, raw)}, max_bytes=...), with Field from mmapcache. "
            f"Or pad, crop or resize before the cache.{exists}"
        )

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
        idx = self._positions(self._indices(indices))
        cache = self._opened()
        if idx is None or cache is None or (self._schema is not None and self._schema.ragged):
            # Indices outside cached_indices, or nobody created the file yet (this batch creates
            # it), or variable fields — collated by torch, which may refuse shapes that differ:
            # the batch is made here, and so is any error, as DataLoader(ds) makes them.
            return self._read_batch(indices)
        ready = cache.contains_many(idx)
        cache.count(hits=int(np.count_nonzero(ready)))  # the main process gathers without counting
        # On a disk, the reads of this batch start now, while the main process gathers earlier ones.
        cache.prefetch(idx[ready], background=False)
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
        reads; ``rows``/``leaves`` are samples it loaded but could not store; ``indices`` are then
        file positions (they are dataset indices otherwise).
        """
        if self.transform is not None or len(indices) == 0:
            return torch.utils.data.default_collate(self.__getitems__(indices))
        idx = self._indices(indices) if deferred else self._positions(self._indices(indices))
        if idx is None:  # some are not among cached_indices
            return torch.utils.data.default_collate(self.__getitems__(indices))
        cache = self._opened()
        if cache is None:  # nobody created the file yet: this batch creates it
            return torch.utils.data.default_collate(self._load(idx.tolist(), counted=False))
        schema = self._schema
        assert schema is not None
        columns = self._gather(cache, idx, rows, leaves, counted=deferred)
        if schema.ragged:
            # As default_collate does with the samples' tensors: stacked when their shapes agree, else its error.
            collate = torch.utils.data.default_collate
            columns = [collate(c) if variable else c for c, variable in zip(columns, schema.variable, strict=True)]
        return collate_tree(schema.tree, columns)

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
        ``progress`` shows a tqdm bar when tqdm is installed. When it filled
        anything it ends with :meth:`Cache.sync` (for a cache on a disk, the
        open after a crash then has nothing of this fill to check).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        before = self._written
        if self._opened() is None and len(self):
            # Create the file from a whole first chunk: samples whose shapes vary are found before it exists.
            first = list(range(min(batch_size, self._cache_length())))
            self._store(first, self._fetch(first))
        missing = self._missing()
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
        if filled:
            self.cache.sync()  # on a disk: a reboot need not check what this fill wrote (see Cache.sync)
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


class _ConversionError(Exception):
    """A leaf that ``dtypes=`` cannot convert without loss: the error to raise (its message is complete)."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


_REFUTED_WAIT = 10.0  # seconds to wait for the holders of a refuted file to let go


def _clone(sample: Any) -> Any:
    """``sample`` with every tensor cloned (writable), its structure kept."""
    if isinstance(sample, torch.Tensor):
        return sample.clone()
    if isinstance(sample, dict):
        return {key: _clone(value) for key, value in sample.items()}
    if isinstance(sample, (tuple, list)):
        return type(sample)(_clone(value) for value in sample)
    return sample


def _tensors(sample: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``sample``."""
    if isinstance(sample, torch.Tensor):
        yield sample
    elif isinstance(sample, dict):
        for value in sample.values():
            yield from _tensors(value)
    elif isinstance(sample, (tuple, list)):
        for value in sample:
            yield from _tensors(value)


def _text_or_leaf(leaf: Any) -> Any:
    """A numpy string scalar (or 0-d string array) as the ``str``/``bytes`` it holds; other leaves as they are."""
    text = as_text(leaf)
    return leaf if text is None else text


def _some_ready(cache: Cache, count: int) -> list[int]:
    """Up to ``count`` READY positions, drawn at random (this process's own draw).

    A few random probes find them in a well-filled cache; a sparse one is scanned (a byte per slot).
    """
    rng = np.random.default_rng()
    probe = rng.choice(cache.length, size=min(cache.length, 16 * count), replace=False)
    ready = probe[cache.contains_many(probe)]
    if len(ready) < count and len(probe) < cache.length:
        everything = np.arange(cache.length)
        filled = everything[cache.contains_many(everything)]
        ready = rng.choice(filled, size=min(count, len(filled)), replace=False) if len(filled) else filled
    return sorted(int(i) for i in ready[:count])


def _field_of(found: str) -> str | None:
    """The field a :func:`difference` message names (``sample[0]`` -> ``"0"``), if it names one."""
    match = re.match(r"sample((?:\[[^\]]*\])*)", found)
    parts = re.findall(r"\[([^\]]*)\]", match.group(1)) if match else []
    return "/".join(part.strip("'\"") for part in parts) or None


def _storage_dtypes(dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """``dtypes=`` checked: field names to dtypes numpy or torch understand (kept as given, for pickling)."""
    if not isinstance(dtypes, Mapping):
        raise TypeError(
            f"dtypes must map field names to dtypes, e.g. {{'0': torch.uint8}}, not {type(dtypes).__name__}"
        )
    for name, dtype in dtypes.items():
        if not isinstance(name, str):
            raise TypeError(f"dtypes= keys are field names (strings such as '0' or 'image'), not {name!r}")
        field = Field((), dtype)
        check_declared(field, name)
    return dict(dtypes)


def _text_budget(schema: _Schema, columns: list[Any], length: int) -> int | None:
    """Bytes for a new file whose only variable fields are text and which got no ``max_bytes``.

    The fixed parts of every slot, plus room for text values twice the mean size of the
    first batch's (each value padded to 16 bytes), and 1 MiB: text found longer later may not
    fit, and such samples are served uncached rather than failing.
    """
    variable = [k for k, v in enumerate(schema.variable) if v]
    if not variable or any(schema.texts[k] is None for k in variable):
        return None
    count = max(len(columns[variable[0]]), 1)
    mean = sum(len(value) + 16 for k in variable for value in columns[k]) / count
    return length * slot_nbytes(schema.fields) + int(2 * mean * length) + 2**20


def _index_set(indices: Any, length: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``cached_indices`` checked against the dataset's length: sorted, without repeats."""
    given = np.asarray(indices)
    if given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
        raise TypeError(
            "cached_indices must be a sequence of integer indices (e.g. NodeShardSampler(...).node_indices), "
            f"not {type(indices).__name__} of {given.dtype} with shape {given.shape}"
        )
    if given.size == 0:
        raise ValueError("cached_indices is empty: give the indices this cache holds, or None for all of them")
    bad = given[(given < 0) | (given >= length)]
    if bad.size:
        raise IndexError(
            f"cached_indices holds {int(bad[0])}, out of range for a dataset of length {length} "
            "(indices from 0 to len(dataset) - 1)"
        )
    return np.unique(given.astype(np.int64))


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


def _rows(column: Any) -> Any:
    """A column of :meth:`CachedDataset._gather` as one leaf per sample."""
    return column.unbind(0) if isinstance(column, torch.Tensor) else column


def _set_row(columns: list[Any], row: int, leaves: Sequence[Any]) -> None:
    """Put one sample's leaves into ``row`` of the columns of :meth:`CachedDataset._gather`."""
    for column, leaf in zip(columns, leaves, strict=True):
        column[row] = leaf


def _declared_fields(fields: FieldsLike) -> dict[str, Field]:
    """``fields=`` of a CachedDataset, checked for what does not depend on the samples."""
    declared = normalize_fields(fields)
    try:
        Structure(declared)
    except ValueError as error:
        raise ValueError(
            f"fields= names {list(declared)} do not describe a sample ({error}). The names are the places of "
            "the leaves in a sample: '.' for a bare leaf; '0', '1' for a tuple's elements; '[0]', '[1]' for a "
            "list's; 'image' for a dict key; '1/m' one level down (see mmapcache.torch)"
        ) from None
    for name, field in declared.items():
        check_declared(field, name)
    return declared


def _misfit(sample: Any, fields: Mapping[str, Field]) -> tuple[type[Exception], str] | None:
    """Why ``sample`` does not fit ``fields`` (an error type and a message naming the field), or None."""
    try:
        leaves = name_leaves(sample, is_leaf, supported=SUPPORTED, hint=leaf_hint)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    if list(leaves) != list(fields) and set(leaves) != set(fields):
        missing = [name for name in fields if name not in leaves]
        extra = [name for name in leaves if name not in fields]
        parts = []
        if missing:
            parts.append(f"the sample has no {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"no field is given for {', '.join(map(repr, extra))}")
        return ValueError, (
            f"the sample's leaves are {list(leaves)} (named by their place in it, see mmapcache.torch), "
            f"the fields {list(fields)}: {'; '.join(parts)}"
        )
    for name, leaf in leaves.items():
        field = fields[name]
        if isinstance(leaf, (torch.Tensor, np.ndarray, np.generic)):
            got = str(leaf.dtype).removeprefix("torch.")
            if isinstance(leaf, torch.Tensor):
                fits_dtype = leaf.dtype == torch_dtype(field)
            else:
                fits_dtype = field.torch_dtype is None and leaf.dtype.newbyteorder("=") == field.dtype
            if not fits_dtype:
                return TypeError, f"field {name!r} holds {field.dtype_name} values, the sample has {got} values"
            if not field.fits(leaf_shape(leaf)):
                shape = leaf_shape(leaf)
                return ValueError, f"field {name!r} has shape {field.shape} (None: any size), the sample's is {shape}"
        else:
            try:
                coerce_value(leaf, field, name)
            except (TypeError, ValueError) as error:
                return type(error), str(error)
    return None


def _check_declared_sample(sample: Any, index: int, fields: Mapping[str, Field]) -> None:
    """TypeError/ValueError naming the field unless ``sample`` fits ``fields=``."""
    problem = _misfit(sample, fields)
    if problem is not None:
        kind, message = problem
        raise kind(f"dataset[{index}] does not fit fields=: {message}")


def _declaration(schema: _Schema, samples: list[Any]) -> str:
    """``fields=`` as Python source: the schema, with None where ``samples`` differ in size."""
    shapes = {name: list(field.shape) for name, field in schema.fields.items()}
    for sample in samples:
        try:
            leaves = schema.flatten(sample)
        except (TypeError, ValueError):
            continue
        for name, leaf in zip(schema.names, leaves, strict=True):
            shape, seen = leaf_shape(leaf), shapes[name]
            if len(shape) == len(seen):
                shapes[name] = [None if old != new else old for old, new in zip(seen, shape, strict=True)]
    entries = [
        f"{json.dumps(name)}: Field({tuple(shapes[name])!r}, {json.dumps(field.dtype_name)})"
        for name, field in schema.fields.items()
    ]
    return "{" + ", ".join(entries) + "}"


from ._torch_stream import CachedStream  # noqa: E402  (it builds on this module's helpers)
