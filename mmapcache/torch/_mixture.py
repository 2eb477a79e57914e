"""``Mixture``: weighted mixtures of map-style datasets whose every draw is a function of (seed, position).

A mixture is a map-style dataset over global sample positions ``0, 1, 2, ...``
without end: position ``p`` holds a sample of the source drawn for ``p``
(:mod:`._draws`: an evenly spread, seeded sequence cut by the weights in force
at ``p``). The ``k``-th draw of a source of ``n`` samples reads, without
replacement, place ``k mod n`` of the source's permutation for pass ``k // n``
(a permutation seeded by the seed, the source's name and the pass); with
replacement, an index drawn from ``(seed, name, k)``. The number of draws of
each source before ``p`` is computed, not counted, so any position is reached
in ``O(log)`` time: a run's whole state is the position it reached.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.utils.data

from . import _draws
from ._draws import BLOCK, Ints
from ._sampler import SEEDS, checked_integer, seed_words, seeded_permutation

__all__ = ["Mixture", "Weights"]

Weights = Mapping[str, float] | Callable[[int], Mapping[str, float]]

_PHASE_KEY = 0x70686173  # spawn-key words: what each seeded draw is for
_ORDER_KEY = 0x6F726472
_DRAWS_KEY = 0x64726177
_KEPT_PASSES = 2  # permutations kept per source: the pass being read and the next (a batch can straddle both)
_RECENT_BLOCKS = 64  # a schedule's blocks whose thresholds are kept
_COUNTED = 1 << 13  # positions after the last range drawn that are counted rather than computed (beyond: floor sums)
_PER_POSITION = 4  # a spread of positions up to this many times their number is drawn as one range

_U64 = np.uint64
_GOLDEN64 = _U64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)


class Mixture(torch.utils.data.Dataset[Any]):
    """A weighted mixture of map-style datasets, indexed by the global sample position.

    ``datasets`` maps a name to a map-style dataset (a :class:`CachedDataset`
    or any other with ``len`` and ``[]``); ``weights`` maps names to
    non-negative weights (names left out weigh 0; they need not sum to 1), or
    is a *schedule*: a pure function from a global position to such a mapping,
    read at the first position of every block of :data:`BLOCK` (1024)
    positions. ``mixture[p]`` is the sample drawn for position ``p`` and
    :meth:`source` says which: ``(name, index)``.

    Without ``replacement`` each source is read in a fresh permutation per pass
    of its own (seeded by ``seed``, its name and the pass number) and starts its
    next pass when it is exhausted; with it, indices are drawn uniformly. The
    draw for every position is a function of ``(seed, position)`` and the
    weights, so a run is resumed from a position alone (:meth:`loader`).
    Positions have no end: ``len()`` is not defined.
    """

    def __init__(
        self, datasets: Mapping[str, Any], weights: Weights, *, seed: int = 0, replacement: bool = False
    ) -> None:
        if not isinstance(datasets, Mapping) or not datasets:
            raise TypeError(f"datasets must be a non-empty mapping of names to datasets, not {datasets!r}")
        for name in datasets:
            if not isinstance(name, str):
                raise TypeError(f"source names must be strings, not {name!r} ({type(name).__name__})")
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be True or False, not {replacement!r}")
        self.datasets: dict[str, Any] = dict(datasets)
        self.names: tuple[str, ...] = tuple(self.datasets)
        self.lengths: tuple[int, ...] = tuple(len(ds) for ds in self.datasets.values())
        self.seed = checked_integer("seed", seed, SEEDS)
        self.replacement = replacement
        self.weights = weights
        self.schedule: Callable[[int], Mapping[str, float]] | None = None
        if callable(weights) and not isinstance(weights, Mapping):
            self.schedule = weights
            self._static: Ints | None = None
        elif isinstance(weights, Mapping):
            self._static = self._cuts_of(weights, None)
        else:
            raise TypeError(
                f"weights must map source names to weights, or be a function of the position, not {weights!r}"
            )
        offset = np.random.SeedSequence(self.seed, spawn_key=(_PHASE_KEY,)).generate_state(1, np.uint64)[0]
        self.offset = int(offset) % _draws.MODULUS
        self._keys = [_name_words(name) for name in self.names]
        self._draw_keys = [
            _U64(np.random.SeedSequence(self.seed, spawn_key=(_DRAWS_KEY, *key)).generate_state(1, np.uint64)[0])
            for key in self._keys
        ]
        self._orders: dict[tuple[int, int], Callable[[Ints | slice], Ints]] = {}
        self._cumulative: list[Ints] = [np.zeros(len(self.names), dtype=np.int64)]  # schedules: draws before block b
        self._recent: dict[int, Ints] = {}  # schedules: the thresholds of blocks read lately
        self._anchor: tuple[int, Ints] = (0, np.zeros(len(self.names), dtype=np.int64))  # draws before a position
        self._window: _Window | None = None  # positions drawn ahead (draw_ahead)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_remake, (self.datasets, self.weights, self.seed, self.replacement))

    def __repr__(self) -> str:
        weights = "a schedule" if self.schedule is not None else dict(cast(Mapping[str, float], self.weights))
        return (
            f"Mixture({dict(zip(self.names, self.lengths, strict=True))} samples, weights {weights}, seed {self.seed})"
        )

    # -- the weights -----------------------------------------------------------------

    def weights_at(self, position: int) -> dict[str, float]:
        """The weights in force at ``position``, normalised to sum to 1 (a schedule's, for its block)."""
        position = _position(position)
        cuts = self._cuts(position // BLOCK)
        return {
            name: float(hi - lo) / _draws.MODULUS for name, lo, hi in zip(self.names, cuts[:-1], cuts[1:], strict=True)
        }

    def _cuts(self, block: int) -> Ints:
        """The thresholds of block ``block`` (a schedule's remembered for the last few blocks read)."""
        if self._static is not None:
            return self._static
        cuts = self._recent.get(block)
        if cuts is None:
            assert self.schedule is not None
            cuts = self._cuts_of(self.schedule(block * BLOCK), block * BLOCK)
            if len(self._recent) >= _RECENT_BLOCKS:
                del self._recent[next(iter(self._recent))]
            self._recent[block] = cuts
        return cuts

    def _cuts_of(self, weights: Any, position: int | None) -> Ints:
        where = "" if position is None else f" (the schedule's, at position {position})"
        if not isinstance(weights, Mapping):
            raise TypeError(f"the weights{where} must map source names to weights, not {weights!r}")
        unknown = [name for name in weights if name not in self.datasets]
        if unknown:
            raise ValueError(f"the weights{where} name sources {unknown} that are not among {list(self.names)}")
        values: list[float] = []
        for name, size in zip(self.names, self.lengths, strict=True):
            value = weights.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise TypeError(f"the weight of {name!r}{where} must be a number, not {value!r}")
            value = float(value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"the weight of {name!r}{where} must be finite and >= 0, not {value}")
            if value > 0 and size == 0:
                raise ValueError(f"source {name!r} has no samples, yet its weight{where} is {value}")
            values.append(value)
        if sum(values) <= 0:
            raise ValueError(f"the weights{where} are all 0: give at least one source a positive weight")
        return _draws.thresholds(values)

    # -- draws -----------------------------------------------------------------------

    def _before(self, position: int) -> Ints:
        """How many times each source was drawn at positions ``0 .. position - 1``.

        Counted from the end of the last range drawn when ``position`` is a little after it (a
        loader's next batch), else computed (floor sums; a schedule's blocks, remembered).
        """
        anchor, counted = self._anchor
        if anchor <= position <= anchor + _COUNTED:
            walked: Ints = counted + _draws.tally(self._codes(anchor, position), len(self.names))
            return walked
        if self._static is not None:
            return _draws.counts(position, self.offset, self._static)
        block, within = divmod(position, BLOCK)
        cumulative = self._cumulative
        while len(cumulative) <= block:
            b = len(cumulative) - 1
            cumulative.append(cumulative[b] + self._block_counts(b, BLOCK))
        before = cumulative[block]
        return before + self._block_counts(block, within) if within else before

    def _block_counts(self, block: int, n: int) -> Ints:
        return _draws.counts(n, _draws.phase(self.offset, block * BLOCK), self._cuts(block))

    def codes(self, start: int, stop: int) -> Ints:
        """The source drawn (its place in :attr:`names`) for each position ``start .. stop - 1``."""
        start, stop = _position(start), _position(stop)
        return self._codes(start, stop) if stop > start else np.empty(0, np.int64)

    def _codes(self, start: int, stop: int) -> Ints:
        if stop <= start:
            return np.empty(0, np.int64)
        if self._static is not None:
            return _draws.codes(_draws.phase(self.offset, start), stop - start, self._static)
        parts = []
        for block in range(start // BLOCK, (stop - 1) // BLOCK + 1):
            lo, hi = max(start, block * BLOCK), min(stop, (block + 1) * BLOCK)
            parts.append(_draws.codes(_draws.phase(self.offset, lo), hi - lo, self._cuts(block)))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def draws(self, start: int, stop: int) -> tuple[Ints, Ints]:
        """``(codes, indices)`` of positions ``start .. stop - 1``: each one's source (its place in
        :attr:`names`) and the index drawn from it, computed at once."""
        start, stop = _position(start), _position(stop)
        codes, indices = self._drawn(start, stop)
        if _holds(self._window, start, stop):
            return codes.copy(), indices.copy()  # the window's own arrays stay the window's
        return codes, indices

    def _drawn(self, start: int, stop: int) -> tuple[Ints, Ints]:
        """:meth:`draws` of positions already checked: views of the window when it holds them."""
        if stop <= start:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        window = self._window
        if _holds(window, start, stop):
            assert window is not None
            lo, hi = start - window.start, stop - window.start
            return window.codes[lo:hi], window.indices[lo:hi]
        codes = self._codes(start, stop)
        counts = _draws.tally(codes, len(self.names))
        before = self._before(start)
        empty = np.empty(0, np.int64)
        draws = [
            self._indices(code, int(before[code]), count) if count else empty
            for code, count in enumerate(counts.tolist())
        ]
        indices = _draws.deal(codes, draws)
        self._anchor = (stop, before + counts)
        return codes, indices

    def draw_ahead(self, start: int, stop: int) -> None:
        """Draw positions ``start .. stop - 1`` at once for the :meth:`by_source` calls that follow.

        A loader calls it with the positions of its next steps: each batch then slices
        what was drawn instead of drawing its few hundred positions on its own (the
        draws are a function of ``(seed, position)``, so this changes no draw).
        """
        start, stop = _position(start), _position(stop)
        if _holds(self._window, start, stop):
            return
        self._window = None
        self._window = _Window(start, stop, *self._drawn(start, stop))

    def by_source(self, start: int, stop: int) -> tuple[Ints, Ints, Ints]:
        """Positions ``start .. stop - 1`` grouped by source: ``(positions, counts, indices)``.

        ``positions`` are grouped by source (in the order of :attr:`names`), each source's in
        position order; ``counts`` says how many each source has; ``indices`` are the indices
        drawn for ``positions``.
        """
        positions, counts, indices = self.by_sources([_position(start)], [_position(stop)])
        return positions, counts[0], indices

    def by_sources(self, starts: Sequence[int], stops: Sequence[int]) -> tuple[Ints, Ints, Ints]:
        """:meth:`by_source` of the ranges ``starts[k] .. stops[k] - 1`` at once, one after another.

        ``(positions, counts, indices)``: range ``k`` is ``positions[o : o + sum(counts[k])]`` (``o``:
        the sizes of the ranges before it), grouped by source; ``counts`` has a row per range. A
        loader groups the batches of a stretch drawn ahead in one pass instead of one sort a batch.
        """
        los, his = np.asarray(starts), np.asarray(stops)
        if (
            los.ndim != 1
            or los.shape != his.shape
            or not los.size
            or not {los.dtype.kind, his.dtype.kind} <= {"i", "u"}
        ):
            raise TypeError(f"starts and stops must be as many integer positions, not {starts!r} and {stops!r}")
        los, his = los.astype(np.int64, copy=False), his.astype(np.int64, copy=False)
        if int(los.min()) < 0:
            raise IndexError(f"mixture positions are >= 0 (they have no end to count from), not {int(los.min())}")
        sizes = np.maximum(his - los, 0)  # a range that stops before it starts is empty
        his = los + sizes
        codes, drawn, positions = self._ranges(los, his, sizes)
        order, indices, counts = _draws.group(codes, drawn, sizes, len(self.names))
        if positions is None:  # one stretch from los[0] on
            order += int(los[0])
            return order, counts, indices
        grouped: Ints = positions[order]
        return grouped, counts, indices

    def _ranges(self, los: Ints, his: Ints, sizes: Ints) -> tuple[Ints, Ints, Ints | None]:
        """``(codes, indices, positions)`` of the ranges ``los[k] .. his[k] - 1``, one after another
        (positions ``None`` when they are one stretch from ``los[0]`` on)."""
        if len(los) == 1 or (los[1:] == his[:-1]).all():  # one stretch of positions
            codes, drawn = self._drawn(int(los[0]), int(his[-1]))
            return codes, drawn, None
        lo, hi, total = int(los.min()), int(his.max()), int(sizes.sum())
        positions = np.repeat(los - np.cumsum(sizes) + sizes, sizes)
        positions += np.arange(total, dtype=np.int64)
        if hi - lo <= _PER_POSITION * total + BLOCK:  # near one another: one stretch, drawn at once
            codes, drawn = self._drawn(lo, hi)
            return codes[positions - lo], drawn[positions - lo], positions
        parts = [self._drawn(int(a), int(b)) for a, b in zip(los.tolist(), his.tolist(), strict=True)]
        return np.concatenate([c for c, _ in parts]), np.concatenate([d for _, d in parts]), positions

    def draws_at(self, positions: Sequence[int] | Ints) -> tuple[Ints, Ints]:
        """``(codes, indices)`` of any positions, in their order (as :meth:`draws`)."""
        at = np.asarray(positions)
        if at.ndim != 1 or (at.size and at.dtype.kind not in "iu"):
            return self._one_by_one(positions)
        at = at.astype(np.int64, copy=False)
        if not at.size:
            return at.copy(), at.copy()
        lo, hi = int(at.min()), int(at.max())
        if lo < 0:
            raise IndexError(f"mixture positions are >= 0, not {lo}")
        if hi - lo < _PER_POSITION * len(at) + BLOCK:
            codes, indices = self.draws(lo, hi + 1)
            return codes[at - lo], indices[at - lo]
        return self._one_by_one(at.tolist())

    def _one_by_one(self, positions: Sequence[int] | Ints) -> tuple[Ints, Ints]:
        pairs = [self.draws(p, p + 1) for p in map(_position, positions)]
        codes = np.array([int(c[0]) for c, _ in pairs], np.int64)
        return codes, np.array([int(i[0]) for _, i in pairs], np.int64)

    def _indices(self, code: int, first: int, count: int) -> Ints:
        """The indices source ``code``'s draws number ``first .. first + count - 1`` read."""
        n = self.lengths[code]
        if self.replacement:
            ks = np.arange(first, first + count, dtype=np.uint64)
            drawn: Ints = (_mix64(ks * _GOLDEN64 + self._draw_keys[code]) % _U64(n)).astype(np.int64)
            return drawn
        out = np.empty(count, np.int64)
        k, end = first, first + count
        while k < end:  # a pass at a time (a run of draws spans two passes at most, but for tiny sources)
            number, place = divmod(k, n)
            take = min(end - k, n - place)
            out[k - first : k - first + take] = self._order(code, number)(slice(place, place + take))
            k += take
        return out

    def _order(self, code: int, number: int) -> Callable[[Ints | slice], Ints]:
        """Source ``code``'s permutation for pass ``number`` (the last few kept)."""
        order = self._orders.get((code, number))
        if order is None:
            key = np.random.SeedSequence(self.seed, spawn_key=(_ORDER_KEY, *self._keys[code], *seed_words(number)))
            order = seeded_permutation(self.lengths[code], key)
            stale = [k for k in self._orders if k[0] == code and not number - _KEPT_PASSES < k[1] <= number]
            for k in stale:
                del self._orders[k]
            self._orders[(code, number)] = order
        return order

    # -- as a dataset ----------------------------------------------------------------

    def source(self, position: int) -> tuple[str, int]:
        """``(name, index)``: the source drawn for ``position`` and the index of the sample read from it."""
        position = _position(position)
        codes, indices = self.draws(position, position + 1)
        return self.names[int(codes[0])], int(indices[0])

    def __getitem__(self, position: int) -> Any:
        name, index = self.source(position)
        return self.datasets[name][index]

    def __getitems__(self, positions: Sequence[int]) -> list[Any]:
        """The samples at ``positions``, in their order: one batch read (``__getitems__``) per source."""
        codes, indices = self.draws_at(positions)
        out: list[Any] = [None] * len(codes)
        for code in np.unique(codes).tolist():
            rows = np.flatnonzero(codes == code)
            samples = read_samples(self.datasets[self.names[code]], indices[rows].tolist())
            for row, sample in zip(rows.tolist(), samples, strict=True):
                out[row] = sample
        return out

    def loader(
        self,
        batch_size: int,
        *,
        num_samples: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        stateful: bool = False,
        **dataloader_kwargs: Any,
    ) -> Any:
        """A DataLoader over the mixture's positions, dealt to the ranks a step at a time; resumable anywhere.

        Step ``t`` of a run reads the next ``world_size x batch_size`` global
        positions; rank ``r`` takes the ``r``-th ``batch_size`` of them. One
        pass over the loader reads ``num_samples`` positions (all ranks
        together; ``None``: without end) and the next pass continues with the
        positions after them. ``rank`` and ``world_size`` default to the
        launcher's (torchrun, Lightning, SLURM, ``torch.distributed``).

        A batch holds its rank's positions of the step grouped by source (in
        the order of ``datasets``), each source's in position order, so that
        each source is read with one gather per batch straight into the batch
        (a :class:`CachedDataset` through its file; any other dataset sample by
        sample, then collated). All sources must give samples of one structure.
        A ``collate_fn`` of yours receives the samples instead.

        ``state_dict()`` is the position the run reached (after the last batch
        handed out, whatever the workers prefetched); ``load_state_dict()``
        continues from it — with the same world size, batch for batch; with
        another, the remaining positions dealt to the new ranks, none read twice
        and none skipped. Ranks must step together (as DDP's collectives make
        them): rank 0's state resumes every rank. ``stateful=True`` makes the
        loader a torchdata ``StatefulDataLoader`` too (for code that asks for one).
        """
        from ._mixture_loader import make_loader

        return make_loader(
            self,
            batch_size,
            num_samples=num_samples,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            stateful=stateful,
            **dataloader_kwargs,
        )


class _Window:
    """The draws of positions ``start .. stop - 1``, made at once ahead of the batches that read them."""

    __slots__ = ("codes", "indices", "start", "stop")

    def __init__(self, start: int, stop: int, codes: Ints, indices: Ints) -> None:
        self.start, self.stop, self.codes, self.indices = start, stop, codes, indices


def _holds(window: _Window | None, start: int, stop: int) -> bool:
    return window is not None and window.start <= start and stop <= window.stop


def read_samples(dataset: Any, indices: list[int]) -> list[Any]:
    """``indices`` of ``dataset``: one ``__getitems__`` when it has one, else one ``[i]`` each."""
    if not indices:
        return []
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(indices))
    return [dataset[i] for i in indices]


def _remake(datasets: Mapping[str, Any], weights: Weights, seed: int, replacement: bool) -> Mixture:
    return Mixture(datasets, weights, seed=seed, replacement=replacement)


def _position(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"a mixture position is an integer >= 0, not {value!r} ({type(value).__name__})")
    position = operator.index(value)
    if position < 0:
        raise IndexError(f"mixture positions are >= 0 (they have no end to count from), not {position}")
    return position


def _name_words(name: str) -> tuple[int, int]:
    """A source's name as two 32-bit words of a spawn key: its permutations depend on its name, not its place."""
    return seed_words(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _mix64(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """splitmix64's finalizer, element-wise (uint64 arithmetic wraps)."""
    x = x ^ (x >> _U64(30))
    x *= _MIX1
    x ^= x >> _U64(27)
    x *= _MIX2
    x ^= x >> _U64(31)
    return x
