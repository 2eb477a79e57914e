"""``PackedSequences``: fixed-length sequences packed from the cached documents of a variable token field.

The plan (:mod:`._packing_plan`) is computed once from the documents' lengths
as the file records them (``Cache.lengths``: no token is read) and kept in a
file beside the cache (:mod:`._plan_file`); later runs and other processes map
it. A batch of sequences is read by one gather of parts of the token field's
values (``VariableColumn.fragments``: the compiled gather, or its numpy twin):
one part per fragment (its document's slot, first token and length) and one gap
per padding run, so the tokens land straight in the ``(batch, seq_len)`` array,
and the gather's offsets are the batch's ``cu_seqlens``.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._errors import CacheError
from .._region import empty_aligned
from ..cache import Cache, column_of
from ._collate import as_is
from ._dataset import CachedDataset
from ._loader import Loader
from ._packing_plan import LONG_DOCS, MODES, Plan, make_plan
from ._plan_file import open_or_make, plan_key
from ._stream import CachedStream

__all__ = ["PackedSequences"]

log = logging.getLogger("mmapcache")


class _Source:
    """One process's view of the documents: the cache, each document's slot, the token field's column."""

    def __init__(self, docs: Any, field: str) -> None:
        cache, slots, count = _cached_documents(docs)
        self.cache, self.slots, self.count = cache, slots, count  # slots None: document d is slot d
        variable = cache.fields.get(field)
        if variable is None or not variable.variable or len(variable.shape) != 1:
            choices = [name for name, f in cache.fields.items() if f.variable and len(f.shape) == 1]
            raise ValueError(
                f"field={field!r} must be a one-dimensional variable field (Field((None,), dtype)) of {cache.path}; "
                f"its fields of that kind: {choices}"
            )
        self.column = column_of(cache, field)  # its descriptors and the region its parts are gathered from
        self.dtype = variable.dtype
        lengths = cache.lengths(field)
        self.lengths = lengths[: self.count] if slots is None else lengths[slots]


Slots = tuple[Cache, "np.ndarray[Any, np.dtype[np.int64]] | None", int]


def _cached_documents(docs: Any) -> Slots:
    """The cache holding every document of ``docs``, the slot of each (None: its index), their number.

    Documents not cached yet are loaded first.
    """
    if isinstance(docs, CachedDataset):
        return _dataset_documents(docs)
    if isinstance(docs, CachedStream):
        return _stream_documents(docs)
    raise TypeError(f"docs must be a CachedDataset or a CachedStream, not {type(docs).__name__}")


def _dataset_documents(docs: CachedDataset) -> Slots:
    if docs.cached_indices is not None:
        raise ValueError(
            "PackedSequences packs every document of docs, but this CachedDataset caches only its cached_indices; "
            "make one without cached_indices (each node may read its share through NodeShardSampler instead)"
        )
    cache = docs.cache
    count = len(docs)
    if cache.capacity < count:
        raise ValueError(
            f"PackedSequences reads every document from the file, but {cache.path} caches only the first "
            f"{cache.capacity} of {count}: remove it and make the CachedDataset with room for all (max_bytes=)"
        )
    if cache.filled < count:  # the capacity is the count: every slot holds a document
        log.info("loading the %d documents not cached yet before planning", count - cache.filled)
        docs.fill(progress=False)
        missing = np.flatnonzero(~cache.contains_many(np.arange(count)))
        if len(missing):
            raise CacheError(
                f"{len(missing)} documents (such as {missing[:5].tolist()}) did not fit in {cache.path} "
                "(its variable region is full): remove it and make the CachedDataset with a larger max_bytes",
                path=cache.path,
            )
    return cache, None, count


def _stream_documents(docs: CachedStream) -> Slots:
    from .._streams import checked_records, stream_status

    cache = docs.cache
    if cache is None or not stream_status(cache).complete:
        log.info("reading the stream once to cache it before planning")
        for _ in docs:
            pass
        cache = docs.cache
    status = None if cache is None else stream_status(cache)
    if cache is None or status is None or not status.complete or status.full:
        raise ValueError(
            "PackedSequences needs a CachedStream cached whole (complete, not full): read it to its end in every "
            "partition first (one epoch of every rank and worker), with a max_bytes that holds all of it"
        )
    slots = np.asarray(checked_records(cache), np.int64)
    return cache, slots, len(slots)


def _check_pad_id(pad_id: int, dtype: np.dtype[Any]) -> None:
    """``ValueError`` unless ``pad_id`` is a value of ``dtype`` exactly."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        fits = int(info.min) <= pad_id <= int(info.max)
    else:
        fits = bool(np.asarray(pad_id).astype(dtype) == pad_id)
    if not fits:
        raise ValueError(f"pad_id={pad_id} is not a value of the field's dtype {dtype}; pass a token id that is")


class PackedSequences(torch.utils.data.Dataset[dict[str, Any]]):
    """Fixed-length sequences of ``seq_len`` tokens packed from the documents of ``docs``.

    ``docs`` is a :class:`CachedDataset` or a complete :class:`CachedStream`
    whose ``field`` is a variable token field (``Field((None,), dtype)``).
    Item ``i`` is a dict of

    * ``input_ids``: ``(seq_len,)`` in the field's dtype, padded with ``pad_id``;
    * ``position_ids``: ``(seq_len,)`` int64, from 0 at the start of every document fragment;
    * ``doc_ids``: ``(seq_len,)`` int64, the document's index in ``docs`` (-1 on padding);
    * ``cu_seqlens``: int32, where each fragment starts, then ``seq_len``
      (a padding run counts as one fragment);
    * ``max_seqlen``: the longest fragment (an ``int``).

    ``mode="concat"`` puts the documents end to end in their order and cuts
    every ``seq_len`` tokens (a document may span sequences; only the last
    sequence is padded). ``mode="bfd"`` packs whole documents best-fit
    decreasing (sequences come out longest documents first: shuffle them); a
    document longer than ``seq_len`` is cut into ``seq_len`` pieces and its
    remainder (``long_docs="split"``) or to its first ``seq_len`` tokens
    (``"truncate"``, which ``"concat"`` applies too). Empty documents
    contribute nothing.

    The plan is computed from the documents' lengths as the file records them
    (no token read; documents not cached yet are loaded through ``docs``
    first) and stored beside the cache (``<cache>.plan-<hex>``, see
    docs/format.md), keyed by the cache's ``uuid``, the lengths and the
    arguments: later runs and other processes reopen it, and a plan made for
    another cache, other documents or other arguments is never used.
    ``mmapcache.remove`` deletes it with the cache; ``mmapcache gc`` deletes
    plans whose cache is gone. It pickles as its arguments.

    :meth:`loader` gives whole batches, each read with one gather.
    """

    def __init__(
        self,
        docs: Any,
        seq_len: int,
        *,
        field: str = "input_ids",
        mode: str = "bfd",
        long_docs: str = "split",
        pad_id: int = 0,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if int(seq_len) > 2**31 - 1:
            raise ValueError(f"seq_len must be below 2**31 (cu_seqlens are int32), got {seq_len}")
        if not isinstance(field, str):
            raise TypeError(f"field must be a field name (str), not {type(field).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if long_docs not in LONG_DOCS:
            raise ValueError(f"long_docs must be one of {LONG_DOCS}, got {long_docs!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
            raise TypeError(f"pad_id must be an integer token id, not {pad_id!r}")
        self.docs: Any = docs
        self.seq_len: int = int(seq_len)
        self.field: str = field
        self.mode: str = mode
        self.long_docs: str = long_docs
        self.pad_id: int = int(pad_id)
        self._source: _Source | None = None
        self._plan: Plan | None = None
        self.made: bool = False  # whether this process made the plan (False: it was read from its file)
        self._opened()

    # -- pickling: the arguments --------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {name: self.__dict__[name] for name in ("docs", "seq_len", "field", "mode", "long_docs", "pad_id")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._source, self._plan, self.made = None, None, False

    # -- the plan -----------------------------------------------------------------

    def _opened(self) -> tuple[_Source, Plan]:
        source, plan = self._source, self._plan
        if source is not None and plan is not None and not source.cache.closed:
            return source, plan
        source = _Source(self.docs, self.field)
        _check_pad_id(self.pad_id, source.dtype)
        key = plan_key(
            uuid=source.cache.uuid,
            field=self.field,
            lengths=source.lengths,
            seq_len=self.seq_len,
            mode=self.mode,
            long_docs=self.long_docs,
        )

        def make() -> Plan:
            return make_plan(source.lengths, self.seq_len, self.mode, self.long_docs)

        plan, self.made = open_or_make(source.cache.path, key, make, timeout=60.0)
        self._source, self._plan = source, plan
        return source, plan

    @property
    def plan(self) -> Plan:
        """The packing plan: ``fragments`` (document, first token, length) and each sequence's ``bounds``."""
        return self._opened()[1]

    @property
    def padding(self) -> float:
        """The share of padding among the tokens of all sequences (0 for none)."""
        plan = self.plan
        return float(plan.padding / max(1, len(plan) * self.seq_len))

    def __len__(self) -> int:
        return len(self.plan)

    # -- reading ------------------------------------------------------------------

    def __getitem__(self, index: int) -> dict[str, Any]:
        count = len(self)
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"PackedSequences indices must be integers, not {type(index).__name__}")
        i = int(index) + count if index < 0 else int(index)
        if not 0 <= i < count:
            raise IndexError(f"sequence {index} is out of range for {count} sequences")
        batch = self.batch([i])
        return {
            name: value[0] if name in ("input_ids", "position_ids", "doc_ids") else value
            for name, value in batch.items()
        }

    def batch(self, indices: Any) -> dict[str, Any]:
        """Sequences ``indices`` as one batch: ``(B, seq_len)`` tensors and the whole batch's ``cu_seqlens``."""
        source, plan = self._opened()
        seqs = np.asarray(indices, np.int64).reshape(-1)
        if len(seqs) and (int(seqs.min()) < -len(plan) or int(seqs.max()) >= len(plan)):
            raise IndexError(f"sequence indices must lie in [0, {len(plan)}), got {seqs.min()}..{seqs.max()}")
        seqs = np.where(seqs < 0, seqs + len(plan), seqs)
        return _read(source, plan, seqs, self.pad_id)

    def loader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = False,
        *,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        stateful: bool = False,
        **dataloader_kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A DataLoader of whole batches of sequences, each read with one gather.

        A batch is a dict: ``input_ids``, ``position_ids`` and ``doc_ids``
        ``(batch_size, seq_len)``; ``cu_seqlens`` (int32) the fragments of the
        whole batch flattened, as a varlen attention kernel takes them (the
        rows end to end: the last entry is ``batch_size * seq_len``) and
        ``max_seqlen`` the longest fragment (an ``int``). ``batch_size=None``
        gives single items. Samplers (``NodeShardSampler`` over this dataset,
        ``DistributedSampler``) and the other DataLoader arguments pass
        through; with workers, each worker reads its batches and hands them
        over in shared memory. ``stateful=True`` returns torchdata's
        ``StatefulDataLoader`` (see :meth:`CachedDataset.loader`): a job that
        loads a saved ``state_dict()`` yields exactly the batches left in the
        epoch; shuffle with a seeded ``generator=`` or a ``NodeShardSampler``.
        """
        if not isinstance(stateful, bool):
            raise TypeError(f"stateful must be True or False, not {stateful!r}")
        if "collate_fn" in dataloader_kwargs:
            raise TypeError("PackedSequences.loader() makes its batches itself: pass no collate_fn")
        kind: type[Loader] = Loader
        if stateful:
            from ._stateful import StatefulLoader

            kind = StatefulLoader
        return kind(
            _Batches(self),
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=as_is,
            **dataloader_kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"PackedSequences({self.docs!r}, seq_len={self.seq_len}, field={self.field!r}, mode={self.mode!r}, "
            f"long_docs={self.long_docs!r}, pad_id={self.pad_id})"
        )


class _Batches(torch.utils.data.Dataset[dict[str, Any]]):
    """What ``loader()`` hands DataLoader: ``__getitems__`` returns the finished batch."""

    def __init__(self, packed: PackedSequences) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.packed[index]

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        return self.packed.batch(indices)


_COUNTING = np.arange(0, dtype=np.int64)


def _counting(n: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``np.arange(n)`` as a read-only view of one array kept between batches."""
    global _COUNTING
    if len(_COUNTING) < n:
        _COUNTING = np.arange(max(n, 2 * len(_COUNTING)), dtype=np.int64)
        _COUNTING.flags.writeable = False
    return _COUNTING[:n]


def _read(source: _Source, plan: Plan, seqs: np.ndarray[Any, Any], pad_id: int) -> dict[str, Any]:
    """The batch of sequences ``seqs`` (see :meth:`PackedSequences.batch`)."""
    seq_len = plan.seq_len
    count = len(seqs)
    lo, hi = plan.bounds[seqs], plan.bounds[seqs + 1]
    per_seq = hi - lo
    total = int(per_seq.sum())
    # The fragments of the batch, sequence after sequence, and after each sequence its padding run (if any).
    fragments = plan.fragments[np.repeat(lo - np.cumsum(per_seq) + per_seq, per_seq) + _counting(total)]
    docs, starts, lengths = fragments[:, 0], fragments[:, 1], fragments[:, 2]
    seq_of = np.repeat(_counting(count), per_seq)
    used = np.bincount(seq_of, lengths, count).astype(np.int64) if total else np.zeros(count, np.int64)
    pads = seq_len - used
    padded = np.flatnonzero(pads)
    where = _counting(total) + np.searchsorted(padded, seq_of)  # each fragment's row in the descriptors
    pad_at = np.cumsum(per_seq)[padded] + _counting(len(padded))
    described = total + len(padded)
    slots = np.full(described, -1, np.int64)  # -1: a padding run, written with pad_id below
    slots[where] = docs if source.slots is None else source.slots[docs]
    starts_of = np.zeros(described, np.int64)
    starts_of[where] = starts
    lengths_of = np.empty(described, np.int64)
    lengths_of[where] = lengths
    lengths_of[pad_at] = pads[padded]
    doc_of = np.full(described, -1, np.int64)
    doc_of[where] = docs
    out = empty_aligned((count, seq_len), source.dtype)
    offsets, bad = source.column.fragments(slots, starts_of, lengths_of, out.reshape(-1))
    if len(bad):
        raise CacheError(
            f"the descriptors of {len(bad)} fragments of {source.cache.path} point outside its variable region: "
            "the file was damaged or written by something else; run `mmapcache verify` on it",
            path=source.cache.path,
        )
    for row, start in zip(padded.tolist(), used[padded].tolist(), strict=True):
        out[row, start:] = pad_id
    runs = offsets[1:] - offsets[:-1]
    position_ids = np.repeat(offsets[:-1], runs)
    np.subtract(_counting(count * seq_len), position_ids, out=position_ids)
    doc_ids = np.repeat(doc_of, runs)
    return {
        "input_ids": torch.from_numpy(out),
        "position_ids": torch.from_numpy(position_ids.reshape(count, seq_len)),
        "doc_ids": torch.from_numpy(doc_ids.reshape(count, seq_len)),
        "cu_seqlens": torch.from_numpy(offsets.astype(np.int32)),
        "max_seqlen": int(runs.max()) if len(runs) else 0,
    }
