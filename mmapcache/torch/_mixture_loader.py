"""``Mixture.loader()``: global positions dealt to the ranks a step at a time, each source gathered once a batch.

The run is a sequence of global positions. Step ``t`` from the position
``f`` the loader reached reads positions ``f .. f + W·B - 1`` (``W`` ranks, batch
size ``B``); rank ``r`` takes ``f + r·B .. f + (r + 1)·B - 1``. The last step of a
pass with fewer positions left splits them into ``W`` near-equal parts. Every
rank is at the same step when it hands out a batch (DDP's collectives make it
so), so the position after the step is the frontier of the whole job: a state
saved as that one number resumes on any number of ranks, which deal what is
left among themselves.

A batch's positions are grouped by source, so that each cached source is read
with one gather from its file straight into its rows of the batch tensors
(:class:`MixtureBatches`). In a DataLoader worker, the batch's misses are loaded
and stored and only its positions cross to the main process, which gathers
them (:class:`Pending`), as ``CachedDataset.loader()`` does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.utils.data

from .._region import take_parts
from ..cache import fixed_rows_of
from ._collate import as_is, collate_tree
from ._columns import as_tensors, new_batch
from ._dataset import CachedDataset
from ._loader import InProcess, Loader
from ._mixture import Mixture
from ._recycled import Recycled
from ._sampler import checked_integer, node_topology
from ._session import Session

__all__ = ["Drawn", "MixtureBatches", "MixtureLoader", "Pending", "StepSampler", "make_loader"]

STATE_VERSION = 1
_END = 2**63  # a pass without end
_AHEAD = 1 << 16  # positions drawn at once ahead of the batches that read them (1 MiB of draws)...
_AHEAD_STEPS = 16  # ...when they hold this many steps or more: beyond, the other ranks' draws would cost more


class Frontier:
    """Where a loader's run is: the next global position to read and where the current pass ends."""

    __slots__ = ("end", "position")

    def __init__(self) -> None:
        self.position = 0
        self.end: int | None = 0  # no pass started yet


class StepSampler:
    """The batch sampler: this rank's positions of each step from the frontier on, grouped by source."""

    def __init__(
        self, mixture: Mixture, batch_size: int, *, num_samples: int | None, rank: int, world_size: int
    ) -> None:
        self.mixture, self.batch_size, self.num_samples = mixture, batch_size, num_samples
        self.rank, self.world_size = rank, world_size
        self.frontier = Frontier()

    def begin(self) -> tuple[int, int]:
        """The positions the next iterator reads: the rest of the current pass, or the next pass."""
        frontier = self.frontier
        if frontier.end is None or frontier.position < frontier.end:
            return frontier.position, _END if frontier.end is None else frontier.end
        frontier.end = None if self.num_samples is None else frontier.position + self.num_samples
        return frontier.position, _END if frontier.end is None else frontier.end

    def steps(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(first, last + 1, step's end)``: this rank's share of each step from ``start`` to ``stop``."""
        width = self.world_size * self.batch_size
        f = start
        while f < stop:
            size = min(width, stop - f)
            if size == width:
                lo = f + self.rank * self.batch_size
                yield lo, lo + self.batch_size, f + size
            else:
                yield f + self.rank * size // self.world_size, f + (self.rank + 1) * size // self.world_size, f + size
            f += size

    def __iter__(self) -> Iterator[Drawn]:
        start, stop = self.begin()
        width = self.world_size * self.batch_size
        ahead = _AHEAD if width <= _AHEAD // _AHEAD_STEPS else 0  # wide steps: each rank draws its own part
        mixture = self.mixture
        for spans in self.stretches(start, stop, ahead):
            if ahead:
                mixture.draw_ahead(spans[0][0], min(stop, max(spans[-1][1], spans[0][0] + ahead)))
            yield from grouped(mixture, spans)

    def stretches(self, start: int, stop: int, ahead: int) -> Iterator[list[tuple[int, int]]]:
        """This rank's batches (``(first, last + 1)``, none empty), in runs that lie within ``ahead``
        positions of their first (one batch a run for ``ahead=0``): each run is drawn and grouped at once."""
        run: list[tuple[int, int]] = []
        for lo, hi, _ in self.steps(start, stop):
            if hi <= lo:
                continue
            if run and hi > run[0][0] + ahead:
                yield run
                run = []
            run.append((lo, hi))
        if run:
            yield run

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("a mixture loader without num_samples has no end, and no len()")
        frontier = self.frontier
        if frontier.end is not None and frontier.position < frontier.end:
            left = frontier.end - frontier.position
        else:
            left = self.num_samples
        width, rank = self.world_size * self.batch_size, self.rank
        full, rest = divmod(left, width)
        return full + int((rank + 1) * rest // self.world_size > rank * rest // self.world_size)


def grouped(mixture: Mixture, spans: list[tuple[int, int]]) -> Iterator[Drawn]:
    """The batches of positions ``lo .. hi - 1`` of each span, grouped by source (in the order of
    ``datasets``), in order within each: one grouping pass for them all (:meth:`Mixture.by_sources`)."""
    los, his = zip(*spans, strict=True)
    positions, counts, indices = mixture.by_sources(los, his)
    start = 0
    for (lo, hi), count in zip(spans, counts.tolist(), strict=True):
        stop = start + hi - lo
        yield Drawn(positions[start:stop], count, indices[start:stop])
        start = stop


class Drawn(Sequence[int]):
    """A batch's positions grouped by source, with their draws: how many each source has, and the indices.

    The batch sampler's batches (a sequence of positions, held as an array): the batch's
    reader (in a worker or not) reads the draws instead of drawing them again.
    """

    __slots__ = ("counts", "indices", "positions")

    def __init__(
        self,
        positions: np.ndarray[Any, np.dtype[np.int64]],
        counts: list[int],
        indices: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        self.positions, self.counts, self.indices = positions, counts, indices

    def __len__(self) -> int:
        return len(self.positions)

    def __iter__(self) -> Iterator[int]:
        return iter(self.positions.tolist())

    def __getitem__(self, k: Any) -> Any:
        found = self.positions[k]
        return found.tolist() if isinstance(k, slice) else int(found)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        return self.positions if dtype is None else self.positions.astype(dtype)

    def __reduce__(self) -> tuple[Any, ...]:  # to a DataLoader worker, and back in a Pending: the arrays
        return (Drawn, (self.positions, self.counts, self.indices))

    def __repr__(self) -> str:
        return f"Drawn({self.positions.tolist()})"


Positions = Sequence[int]  # a batch's positions: the batch sampler's (a Drawn), or a list of anyone's


class Pending:
    """A batch a worker made ready in the files (misses stored): the main process gathers its positions."""

    __slots__ = ("positions",)

    def __init__(self, positions: Positions) -> None:
        self.positions = positions  # a Drawn crosses with its draws: the main process does not draw again

    def __getstate__(self) -> Positions:
        return self.positions

    def __setstate__(self, state: Positions) -> None:
        self.positions = state

    def __repr__(self) -> str:
        return f"Pending({len(self.positions)} mixture positions to gather in the main process)"


class _Source:
    """How a batch reads one source: from a :class:`CachedDataset`'s file (through a ``Subset``'s indices), or not."""

    __slots__ = ("direct", "lookup", "session")

    def __init__(self, dataset: Any) -> None:
        self.lookup: np.ndarray[Any, np.dtype[np.intp]] | None = None
        if isinstance(dataset, torch.utils.data.Subset) and isinstance(dataset.dataset, CachedDataset):
            self.lookup = np.asarray(dataset.indices, dtype=np.intp)
            dataset = dataset.dataset
        cached = isinstance(dataset, CachedDataset) and dataset.transform is None
        session: Session | None = dataset._session if cached else None
        self.session = session
        # A source's indices are its file positions (no Subset, no cached_indices): read as they are.
        self.direct = session is not None and self.lookup is None and session.settings.cached_indices is None

    def positions(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.intp]] | None:
        """The file positions of the source's ``indices``; ``None`` when they are not one gather from a file."""
        session = self.session
        if session is None or (session.cache is None and session.opened() is None):
            return None
        schema = session.schema
        if schema is None or schema.ragged:
            return None
        if self.direct:
            direct: np.ndarray[Any, np.dtype[np.intp]] = indices.astype(np.intp, copy=False)
            return direct
        idx = indices.astype(np.intp, copy=False) if self.lookup is None else self.lookup[indices]
        return session.settings.positions(idx)


_Part = tuple[int, np.ndarray[Any, np.dtype[np.intp]], int, int]  # source code, file positions, rows start, stop


class MixtureBatches(torch.utils.data.Dataset[Any]):
    """A :class:`Mixture` as its loader shows it to DataLoader: ``__getitems__`` returns finished batches.

    With a ``collate_fn`` of the user's (``collated=False``) it returns the samples instead.
    """

    def __init__(self, mixture: Mixture, *, collated: bool) -> None:
        self.mixture, self.collated = mixture, collated
        self._sources: list[_Source] | None = None  # made in each process on first use
        self._sessions: list[Any] = []  # the cached sources' sessions, by source code (None: not cached)
        self._layout: _Layout | None = None  # the batch arrays of the last schema read
        self._alike: set[int] = set()  # sources whose fields were found those of the first source
        self.recycled = Recycled()  # the buffers of batches nothing refers to any more, read into again

    def __getstate__(self) -> dict[str, Any]:
        return {"mixture": self.mixture, "collated": self.collated}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mixture"], collated=state["collated"])  # type: ignore[misc]

    def __getitem__(self, position: int) -> Any:
        return self.mixture[position]

    def __getitems__(self, positions: Sequence[int]) -> Any:
        if not self.collated:
            return self.mixture.__getitems__(positions)
        if type(positions) is not Drawn:
            positions = list(positions)
        if torch.utils.data.get_worker_info() is not None:
            return self.in_worker(positions)
        return self.batch(positions, in_worker=False)

    def _parts(self, positions: Positions) -> list[_Part] | None:
        """The batch's sources as runs of rows read from files; ``None`` when that is not how it is read."""
        mixture = self.mixture
        sources = self._sources
        if sources is None:
            sources = self._sources = [_Source(mixture.datasets[name]) for name in mixture.names]
            self._sessions = [source.session for source in sources]
        if type(positions) is Drawn:  # never empty
            indices = positions.indices
            runs = [(code, count) for code, count in enumerate(positions.counts) if count]
        elif not positions:
            return None
        else:
            codes, indices = mixture.draws_at(positions)
            edges = np.flatnonzero(codes[1:] != codes[:-1])
            edges += 1
            bounds = [0, *edges.tolist(), len(codes)]
            runs = [(int(codes[a]), b - a) for a, b in itertools.pairwise(bounds)]
            if len({code for code, _ in runs}) != len(runs):
                return None  # a source in two runs: not grouped by source
        parts: list[_Part] = []
        start = 0
        for code, count in runs:
            stop = start + count
            idx = sources[code].positions(indices[start:stop])
            if idx is None:
                return None
            parts.append((code, idx, start, stop))
            start = stop
        return parts

    def batch(self, positions: Positions, *, in_worker: bool | None = None) -> Any:
        """The batch ``default_collate`` makes of the samples at ``positions``; one gather per cached source.

        ``in_worker``: whether this is a DataLoader worker (``None``: found out).
        """
        parts = self._parts(positions)
        if parts is None:
            return torch.utils.data.default_collate(self.mixture.__getitems__(positions))
        if in_worker is None:
            in_worker = torch.utils.data.get_worker_info() is not None
        return self._gathered(parts, parts[-1][3], recycled=not in_worker)

    def in_worker(self, positions: Positions) -> Any:
        """In a worker: store the batch's misses in the files and leave the gather to the main process."""
        parts = self._parts(positions)
        if parts is None:
            return self.batch(positions)
        for code, idx, _, _ in parts:
            session = self._session(code)
            cache = session.opened()
            assert cache is not None
            ready = cache.contains_many(idx)
            if not ready.all():
                session.load(idx[~ready].tolist())
                if not cache.contains_many(idx).all():  # beyond the capacity, or being written
                    return self.batch(positions)
        return Pending(positions)

    def _session(self, code: int) -> Any:
        session = self._sessions[code]
        assert session is not None
        return session

    def _gathered(self, parts: list[_Part], size: int, *, recycled: bool) -> Any:
        """The batch of ``size`` rows: each part's rows gathered from its file straight into the batch tensors.

        ``recycled``: into this process's memory, an earlier batch's once nothing refers to it
        (``._recycled``); else (a worker's batch, handed to the main process) fresh shared memory.
        """
        sessions = self._sessions
        schema = sessions[parts[0][0]].schema
        for code, _, _, _ in parts[1:]:
            if code not in self._alike:
                self._check_alike(parts[0][0], code)
        layout = self._layout
        if layout is None or layout.schema is not schema:
            layout = self._layout = _Layout(schema)
        if recycled:
            arrays = self.recycled.take(layout, size, layout.private)
            tensors = as_tensors(arrays, layout.dtypes)
        else:
            tensors, arrays = new_batch(layout.shapes(size), layout.storage, layout.dtypes)
        reads, found = [], []  # one pass reads every part read from memory (states and rows), as loader() reads
        for code, idx, start, _ in parts:
            cache = sessions[code].cache
            rows = fixed_rows_of(cache)
            if rows is None:
                break
            reads.append((rows, idx, len(cache), start))
        else:
            found = take_parts(reads, arrays)
        for k, (code, idx, start, stop) in enumerate(parts):
            session = sessions[code]
            cache = session.cache
            if found:
                hits = found[k]
            else:  # a part read otherwise (verify, read-ahead): each through its cache
                out = {name: array[start:stop] for name, array in zip(schema.fixed, arrays, strict=True)}
                hits = int(np.count_nonzero(cache.read_many(idx, out=out, count=False)[1]))
            if hits == len(idx):
                session.hits += hits
                cache.count(hits=hits)
                continue
            columns = session.gather(cache, idx)  # loads and stores the misses, counts the reads
            for array, column in zip(arrays, columns, strict=True):
                array[start:stop] = column.numpy()
        batch = collate_tree(schema.tree, tensors)
        if recycled:
            self.recycled.keep(layout, arrays)
        return batch

    def _check_alike(self, first: int, code: int) -> None:
        ours, theirs = self._session(first).schema, self._session(code).schema
        if theirs.fields != ours.fields:
            names = self.mixture.names
            raise ValueError(
                f"the sources of a mixture batch give samples of different fields: {names[first]!r} has "
                f"{_described(ours.fields)} and {names[code]!r} {_described(theirs.fields)}; a batch stacks "
                "samples of one structure, shape and dtype"
            )
        self._alike.add(code)

    def __repr__(self) -> str:
        return f"MixtureBatches({self.mixture!r})"


class _Layout:
    """A batch's arrays for the fixed fields of ``schema``: how to make them, and their tensors' dtypes."""

    __slots__ = ("dtypes", "fixed", "schema", "storage")

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.fixed = [schema.fields[name] for name in schema.fixed]
        self.storage = [field.dtype for field in self.fixed]
        self.dtypes = [schema.dtypes[schema.names.index(name)] for name in schema.fixed]

    def shapes(self, count: int) -> list[tuple[int, ...]]:
        return [(count, *field.fixed_shape) for field in self.fixed]

    def private(self, count: int) -> list[np.ndarray[Any, Any]]:
        """New arrays of ``count`` rows in this process's memory."""
        return new_batch(self.shapes(count), self.storage, self.dtypes, private=True)[1]


def _described(fields: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{name}: {field}" for name, field in fields.items()) + "}"


class MixtureLoader(Loader):
    """What ``Mixture.loader()`` returns: a DataLoader whose state is the position its run reached.

    Its iterators advance the position as they hand out batches, and gather the
    batches its workers left in the files (:class:`Pending`).
    """

    def _parts(self) -> tuple[StepSampler, MixtureBatches]:
        return cast(StepSampler, self.batch_sampler), cast(MixtureBatches, self.dataset)

    def _get_iterator(self) -> Any:
        if type(self) is MixtureLoader and self.num_workers == 0 and self.collate_fn is as_is and self._auto_collation:
            return InProcess(self)  # the batches come finished: no fetcher, no collate call (as loader()'s)
        return super()._get_iterator()

    def __iter__(self) -> Any:
        sampler, batches = self._parts()
        start, stop = sampler.begin()
        return _Stepping(super().__iter__(), batches, sampler, sampler.steps(start, stop))

    def state_dict(self) -> dict[str, Any]:
        """Where the run is: the next global position, the end of the pass it is in, and what fixes the draws."""
        sampler, batches = self._parts()
        mixture = batches.mixture
        return {
            "version": STATE_VERSION,
            "position": sampler.frontier.position,
            "end": sampler.frontier.end,
            "seed": mixture.seed,
            "sources": list(mixture.names),
            "replacement": mixture.replacement,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position, on this loader's ranks (any number of them).

        Raises ``ValueError`` for a state of another seed, other sources or
        replacement (its positions would draw other samples), and changes nothing then.
        """
        if not isinstance(state, Mapping) or "position" not in state or "sources" not in state:
            raise ValueError(f"not the state of a mixture loader (Mixture.loader().state_dict()): {state!r}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"the state is of version {state.get('version')!r}, and this mmapcache reads version {STATE_VERSION}"
            )
        sampler, batches = self._parts()
        mixture = batches.mixture
        here = {"seed": mixture.seed, "sources": list(mixture.names), "replacement": mixture.replacement}
        differ = {key: (state.get(key), value) for key, value in here.items() if state.get(key) != value}
        if differ:
            said = "; ".join(f"{key} {old!r} there, {new!r} here" for key, (old, new) in differ.items())
            raise ValueError(
                f"the state was saved by a loader of another mixture ({said}): its position would draw other "
                "samples. Resume with the same sources, seed and replacement"
            )
        position = checked_integer("the state's position", state["position"], _END)
        end = state.get("end")
        frontier = sampler.frontier
        frontier.position = position
        frontier.end = None if end is None else checked_integer("the state's end", end, _END)


class _Stepping:
    """A mixture loader's iterator: the DataLoader's, advancing the frontier as batches are handed out."""

    def __init__(
        self, inner: Any, batches: MixtureBatches, sampler: StepSampler, steps: Iterator[tuple[int, int, int]]
    ) -> None:
        self.inner, self.batches, self.sampler, self.steps = inner, batches, sampler, steps

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            for _ in self.steps:  # the steps that gave this rank nothing (a short last step)
                pass
            frontier = self.sampler.frontier
            if frontier.end is not None:
                frontier.position = frontier.end
            raise
        for lo, hi, end in self.steps:
            self.sampler.frontier.position = end
            if hi > lo:
                break
        if type(batch) is Pending:
            batch = self.batches.batch(batch.positions, in_worker=False)
        return batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_stateful: type[MixtureLoader] | None = None


def _stateful_kind() -> type[MixtureLoader]:
    global _stateful
    if _stateful is None:
        from ._stateful import StatefulLoader

        _stateful = type("StatefulMixtureLoader", (MixtureLoader, StatefulLoader), {"__module__": __name__})
    assert _stateful is not None
    return _stateful


def make_loader(
    mixture: Mixture,
    batch_size: int,
    *,
    num_samples: int | None,
    rank: int | None,
    world_size: int | None,
    num_workers: int,
    stateful: bool,
    **dataloader_kwargs: Any,
) -> MixtureLoader:
    """The loader :meth:`Mixture.loader` describes."""
    batch_size = checked_integer("batch_size", batch_size, _END, start=1)
    if num_samples is not None:
        num_samples = checked_integer("num_samples", num_samples, _END, start=1)
    if not isinstance(stateful, bool):
        raise TypeError(f"stateful must be True or False, not {stateful!r}")
    for name in ("batch_size", "batch_sampler", "sampler", "shuffle", "drop_last"):
        if name in dataloader_kwargs:
            raise TypeError(
                f"Mixture.loader() takes no {name}=: the mixture deals its positions to the ranks itself "
                "(batch_size is its first argument)"
            )
    rank, world_size = _ranks(rank, world_size)
    collate_fn = dataloader_kwargs.pop("collate_fn", None)
    sampler = StepSampler(mixture, batch_size, num_samples=num_samples, rank=rank, world_size=world_size)
    kind = _stateful_kind() if stateful else MixtureLoader
    return kind(
        MixtureBatches(mixture, collated=collate_fn is None),
        batch_sampler=cast(Iterable[list[int]], sampler),  # its batches are Drawn: sequences of positions
        num_workers=num_workers,
        collate_fn=as_is if collate_fn is None else collate_fn,
        **dataloader_kwargs,
    )


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else the launcher's (one rank when not distributed)."""
    if rank is None or world_size is None:
        num_nodes, node_rank, local_world_size, local_rank = node_topology()
        world_size = num_nodes * local_world_size if world_size is None else world_size
        rank = node_rank * local_world_size + local_rank if rank is None else rank
    world_size = checked_integer("world_size", world_size, _END, start=1)
    rank = checked_integer("rank", rank, world_size)
    return rank, world_size
