"""The dataset: :class:`CachedDataset`'s arguments, pickling and public verbs.

Everything a process does with the file lives in its :class:`~._session.Session`;
this class checks the arguments (:class:`~._settings.Settings`), applies the
``transform``, and hands out the loader, the fill and the statistics.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._field import FieldsLike
from ..cache import Cache
from ._checks import Verdict
from ._collate import Then, as_is
from ._fill import fill
from ._loader import Batched, Loader
from ._ragged import check_ragged
from ._session import Session
from ._settings import Settings

__all__ = ["CachedDataset"]

# What a CachedDataset pickles: its arguments (0.3.0 pickles hold exactly these).
_ARGUMENTS = (
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
    "timeout",
)
# For a pickle that lacks some of them (made before they existed).
_DEFAULTS: dict[str, Any] = {
    "transform": None,
    "max_bytes": None,
    "capacity": None,
    "copy": True,
    "verify": False,
    "fields": None,
    "cached_indices": None,
    "dtypes": None,
    "check": 2,
    "timeout": 60.0,
}


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
    ``fields={"0": Field((None,), "int64"), "1": Field((), "int64")}``.
    ``max_bytes`` sizes the room for the values of such fields (text
    included); without it, 64 samples spread over the dataset are loaded
    (and stored) before the file is created, and it gets room for 1.25
    times their mean size per sample, capped by the free space (see
    docs/torch.md).

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
    job: the processes a checking process starts (DataLoader workers,
    spawned ranks) inherit its verdict with the dataset, and :meth:`loader`
    checks in the main process before its workers start; ``check=0`` turns
    both checks off.

    A miss is loaded once per node: a sample another process (a worker,
    another job) is loading is waited for and read from the file rather than
    loaded again (single flight, see ``Cache.get_or_load_many``).

    ``transform`` runs after the cache on every access (random augmentation).
    ``copy=False`` returns zero-copy tensors over a read-only mapping of the
    file (an in-place write to one crashes the process with SIGSEGV rather
    than corrupting the shared cache); the default returns fresh tensors.
    With a ``transform``, the transform always receives fresh, writable
    tensors (``copy=False`` then copies each sample before it, as
    ``copy=True`` does): whatever it writes stays in its own copy.
    ``verify=True`` checks each read against its slot checksum.

    ``timeout`` (seconds, default 60) bounds each wait for another process
    that holds the file's creation lock — creating or removing the file, or
    checking a disk cache after a reboot (that wait lasts as long as the
    check advances: see :meth:`Cache.open`) — before
    :class:`~mmapcache.CacheTimeoutError`.

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
        timeout: float = 60.0,
    ) -> None:
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not {type(transform).__name__}")
        settings = Settings.checked(
            dataset,
            path,
            key=key,
            max_bytes=max_bytes,
            capacity=capacity,
            copy=copy,
            verify=verify,
            fields=fields,
            cached_indices=cached_indices,
            dtypes=dtypes,
            check=check,
            timeout=timeout,
        )
        self.transform = transform
        self._start(settings)

    def _start(self, settings: Settings, verdict: Verdict | None = None) -> None:
        self._settings = settings
        self._session = Session(settings, verdict)
        # The arguments, as attributes (and for pickling).
        self.dataset, self.key, self.path = settings.dataset, settings.key, settings.path
        self.max_bytes, self.capacity = settings.max_bytes, settings.capacity
        self.copy, self.verify, self.check = settings.copy, settings.verify, settings.check
        self.timeout = settings.timeout
        self.fields, self.cached_indices, self.dtypes = settings.fields, settings.cached_indices, settings.dtypes

    # -- pickling: the path and the arguments, never the data -------------------

    def __getstate__(self) -> dict[str, Any]:
        # The spot checks' verdict travels too: a process this one starts (a worker, a spawned rank) trusts it.
        verdict = self._session.verdict()
        return {**{name: self.__dict__[name] for name in _ARGUMENTS}, "verdict": verdict and verdict.state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        given = {**_DEFAULTS, **state}
        self.transform = given["transform"]
        settings = Settings(**{name: given[name] for name in _ARGUMENTS if name != "transform"})
        self._start(settings, Verdict.of(given.get("verdict")))

    # -- the cache ---------------------------------------------------------------

    @property
    def cache(self) -> Cache:
        """The :class:`~mmapcache.Cache`, opened now if needed (created from ``dataset[0]`` if missing)."""
        return self._session.handle()

    def close(self) -> None:
        """Release the file in this process (reopened on next use). Zero-copy tensors stay valid.

        After ``close()``, :meth:`stats` reads the file without keeping it open:
        :func:`mmapcache.remove` of a closed dataset's file needs no ``force=True``.
        """
        self._session.close()

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if self.transform is None:
            return self._session.get(index)
        return self._transformed([self._session.get(index, fresh=True)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``: one vectorized read for the hits, one batch write for the misses.

        torch's DataLoader calls this with each batch of indices when it is
        defined (``default_collate`` then stacks the samples into the batch;
        :meth:`loader` gathers the batch itself, with one copy).
        """
        if len(indices) == 0:
            return []
        if self.transform is None:
            return self._session.get_many(indices)
        return self._transformed(self._session.get_many(indices, fresh=True))

    def _transformed(self, samples: list[Any]) -> list[Any]:
        # The samples are fresh tensors even with copy=False (fresh=True above): a transform may write to
        # its input (in place, through .data, on some calls only), and a write to a view of the read-only
        # mapping of the shared file would kill the process with SIGSEGV.
        transform = self.transform
        assert transform is not None
        return [transform(sample) for sample in samples]

    # -- whole batches -------------------------------------------------------------

    def loader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = False,
        *,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        ragged: str = "pad",
        padding_value: float = 0,
        stateful: bool = False,
        batch_transform: Callable[[Any], Any] | None = None,
        **dataloader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A DataLoader over this dataset that reads each batch of hits with one gather per field.

        Its batches have the structure, dtypes and values ``DataLoader(ds,
        batch_size, shuffle, sampler=sampler, num_workers=num_workers,
        drop_last=drop_last, **dataloader_kwargs)`` with the default collate
        gives, but a batch of cached samples is gathered field by field
        straight into the tensors the training loop receives (with workers,
        the workers load and store the misses and the main process gathers
        from the file: one copy, no shared-memory hand-off). Misses are loaded
        from ``dataset`` and stored as usual. With a ``transform`` (it runs per
        sample) the hits are still gathered once, into memory of the process
        that runs the transform; the transform receives writable rows of that
        batch (they are its own: no copy is made for it) and what it returns
        is collated.

        ``batch_transform`` (augmentation on whole batches: see
        docs/recipes.md) is called with each finished batch and returns the
        batch the loop receives. A gathered batch is fresh memory nobody else
        holds, so it may work in place; it runs where the batch is finished
        (the main process for gathered batches, with workers too; a worker
        for a batch collated there from samples: with a ``transform``, a
        ``collate_fn``, or indices the file does not cache), before
        ``pin_memory`` pins the result. It must pickle with spawn workers.

        ``ragged`` says how a variable-shape field appears in a batch (its
        batch is gathered once, as one :class:`~mmapcache.Jagged`):

        * ``"pad"`` (default): a :class:`Padded` ``(data, lengths)``, as
          :func:`pad_collate` makes it, padded with ``padding_value``;
        * ``"nested"``: a jagged-layout nested tensor viewing the gathered values;
        * ``"packed"``: a :class:`Packed` ``(values, cu_seqlens, max_seqlen)``,
          the samples end to end (what varlen attention kernels take);
        * ``"list"``: a list of one tensor per sample, each its own shape.

        ``"nested"`` and ``"packed"`` need fields that vary in their first
        dimension only. Text fields are lists of ``str``/``bytes`` (as
        ``default_collate`` makes them). A ``collate_fn`` of yours overrides
        all this: it receives the samples, as ``DataLoader(ds)``'s does.
        Any other DataLoader argument (``pin_memory``, ``persistent_workers``,
        ``prefetch_factor``, ``multiprocessing_context``, ...) passes
        through, and samplers — ``DistributedSampler`` included — work as with
        ``DataLoader(ds)``.

        ``stateful=True`` returns torchdata's ``StatefulDataLoader`` instead
        (``pip install torchdata``; it then also takes ``snapshot_every_n_steps``):
        save ``loader.state_dict()`` with a checkpoint, and a loader made the same
        way and loads it with ``load_state_dict()`` yields exactly the batches that were
        left in the epoch — with workers or without, over a full cache or one
        still filling. Shuffle with a seeded ``generator=`` or a
        ``NodeShardSampler`` so that a resumed job draws the same order.
        """
        ragged = check_ragged(ragged)
        if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
            raise TypeError(f"padding_value must be a number, not {type(padding_value).__name__}")
        if not isinstance(stateful, bool):
            raise TypeError(f"stateful must be True or False, not {stateful!r}")
        if batch_transform is not None and not callable(batch_transform):
            raise TypeError(f"batch_transform must be callable, not {type(batch_transform).__name__}")
        collate_fn = dataloader_kwargs.pop("collate_fn", None)
        batching = batch_size is not None or dataloader_kwargs.get("batch_sampler") is not None
        if batch_transform is not None and not batching:
            raise ValueError(
                "batch_transform needs batches, and batch_size=None yields samples: give a batch_size "
                "(or a batch_sampler), or use transform= for a per-sample transform"
            )
        if collate_fn is None:
            # Without batching DataLoader converts each sample with default_convert, so do we.
            collate_fn = as_is if batching else torch.utils.data.default_convert
            collated = batching
        else:
            collated = False
            if batch_transform is not None:  # the user's collate finishes the batch, in whichever process
                collate_fn, batch_transform = Then(collate_fn, batch_transform), None
        if stateful:
            from ._stateful import StatefulLoader

            kind: type[Loader] = StatefulLoader
        else:
            kind = Loader
        return kind(
            _batched(self, collated, ragged, padding_value, batch_transform),
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            **dataloader_kwargs,
        )

    # -- filling and statistics ----------------------------------------------------

    def fill(self, num_workers: int = 0, batch_size: int = 64, progress: bool = True) -> int:
        """Fill every missing cacheable slot; return how many slots this call filled.

        ``num_workers > 0`` loads batches in that many worker processes
        (through a DataLoader, so ``dataset`` must pickle under its
        multiprocessing context); each worker writes straight into the file.
        ``progress`` shows a tqdm bar when tqdm is installed. When it filled
        anything it ends with :meth:`Cache.sync` (for a cache on a disk, the
        open after a crash then has nothing of this fill to check).
        """
        return fill(self._session, num_workers=num_workers, batch_size=batch_size, progress=progress)

    def stats(self) -> dict[str, int]:
        """How the cache is used, by this process and by every process that uses the file.

        ``hits``, ``misses`` (reads that went to ``dataset``) and ``written``
        (slots filled) count this process, and ``waited`` the hits among them
        that were missing when this process looked and that it read once
        another process — a worker, another job — had loaded them (single
        flight: each sample is loaded once per node); ``total_hits``, ``total_misses``
        and ``total_written`` count every process that ever used the file —
        DataLoader workers, DDP ranks, other jobs — since it was created
        (they are kept in the file); ``processes`` is how many processes
        count into it now; ``filled``, ``capacity`` and ``length`` describe
        the file. For one epoch's hit rate across workers, subtract the totals
        before it from those after it. A cache with variable-shape fields
        adds its variable region (see :class:`~mmapcache.VariableRegion`):
        ``variable_bytes`` in all, ``variable_claimed`` handed out to writers,
        ``variable_used`` held by filled slots' values, ``variable_free``, and
        ``variable_refused``: stores turned away for lack of room, by every
        process (samples whose values find no room are served uncached).

        A dataset that has the file open (it read, filled or opened it since its
        last :meth:`close`) keeps it open. One that does not — closed, or not yet
        used in this process — opens the file for this call only and releases it
        again, so ``stats()`` after ``close()`` never keeps a later
        :func:`mmapcache.remove` from deleting it; the file is created from
        ``dataset[0]`` if missing.
        """
        session = self._session
        if session.cache is not None:
            return self._stats(session.handle())
        try:
            return self._stats(session.handle())
        finally:
            session.close()

    def _stats(self, cache: Cache) -> dict[str, int]:
        session = self._session
        usage = cache.usage()
        region = cache.variable_region
        variable = (
            {}
            if region is None
            else {
                "variable_bytes": region.size,
                "variable_claimed": region.claimed,
                "variable_used": region.used,
                "variable_free": region.free,
                "variable_refused": region.refused,
            }
        )
        return {
            "hits": session.hits,
            "misses": session.misses,
            "written": session.written,
            "waited": session.waited,
            "total_hits": usage.total.hits,
            "total_misses": usage.total.misses,
            "total_written": usage.total.written,
            "processes": len(usage.processes),
            "filled": cache.filled,
            "capacity": cache.capacity,
            "length": cache.length,
            **variable,
        }

    def __repr__(self) -> str:
        return f"CachedDataset({type(self.dataset).__name__}, {str(self.path)!r}, key={self.key!r})"


def _batched(
    dataset: CachedDataset,
    collated: bool,
    ragged: str = "pad",
    padding_value: float = 0,
    batch_transform: Callable[[Any], Any] | None = None,
) -> Batched:
    """The view of ``dataset`` that ``loader()`` gives DataLoader (also how it unpickles in a worker)."""
    return Batched(
        dataset,
        dataset._session,
        collated=collated,
        ragged=ragged,
        padding_value=padding_value,
        batch_transform=batch_transform,
        remake=_batched,
    )
