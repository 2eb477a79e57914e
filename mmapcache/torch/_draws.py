"""Which source a mixture draws for a global position, and how many draws of each source precede it.

Pure integer arithmetic, no state: everything here is a function of the seed,
the position and the weights in force there.

The sources of positions. Position ``q`` has the *phase* ``u(q) = (C + q·A) mod
M``, with ``M = F(46) = 1836311903`` and ``A = F(45)`` consecutive Fibonacci
numbers (``A / M`` is the golden ratio's fractional part to 18 digits) and
``C`` drawn from the seed. The weights in force, normalised, cut ``0 .. M``
into one interval per source in the order of ``datasets`` (``thresholds``:
``T[0] = 0 <= T[1] <= ... <= T[S] = M``, each the rounded cumulative weight
times ``M``); position ``q`` draws the source whose interval holds ``u(q)``. The
golden-ratio sequence is the most evenly spread of all (three-distance
theorem): among any ``N`` consecutive positions, a source of weight ``w`` is
drawn ``N·w`` times to within a few draws (``O(log N)``), not the ``±√(N·w(1-w))``
of independent draws.

How many draws precede a position. The number of ``q < n`` (offset ``c``) whose
phase is at least ``t`` is ``Σ floor((q·A + c + M - t) / M) - floor((q·A + c) / M)``,
two floor sums of a line, each computed in ``O(log M)`` steps (Euclid's
algorithm on ``(A, M)``). A source's draws before a position are thus known
without walking the positions before it.

A schedule (weights as a function of the position) is read once per block of
:data:`BLOCK` positions, at the block's first position: the thresholds are those
of ``weights(b·BLOCK)`` for the whole block ``b``, and the draws before a position
add up the blocks before it (remembered once computed) and the part of its own.

Dealing and grouping. :func:`deal` hands each position of a range the next
index drawn from its source, and :func:`group` sorts ranges of positions by
source (a loader's batches): the compiled ``deal`` and ``group`` of
``_cgather.c`` in one pass, else their numpy twins here (the same result).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._region import compiled

__all__ = ["BLOCK", "MODULUS", "STEP", "above", "codes", "counts", "deal", "group", "phase", "tally", "thresholds"]

MODULUS = 1836311903  # F(46): below 2**31, so a phase times STEP fits in an int64
STEP = 1134903170  # F(45)
BLOCK = 1024
"""A schedule's weights hold for blocks of this many positions, read at each block's first position."""

Ints = np.ndarray[Any, np.dtype[np.int64]]
_CHUNK = 1 << 24  # positions whose phases are computed at once
_TALLIED = 8  # sources counted a comparison each (beyond: bincount)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``Σ_{i<n} floor((a·i + b) / m)`` for ``n, a, b >= 0`` and ``m > 0``, in ``O(log m)`` steps."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            return total
        n, b = divmod(top, m)
        m, a = a, m


def phase(offset: int, position: int) -> int:
    """``u(position)`` for the phase offset ``offset`` (the ``C`` of the module docstring)."""
    return (offset + position % MODULUS * STEP) % MODULUS


def above(n: int, start_phase: int, threshold: int) -> int:
    """How many of ``n`` consecutive positions, the first of phase ``start_phase``, have a phase ``>= threshold``."""
    return floor_sum(n, MODULUS, STEP, start_phase + MODULUS - threshold) - floor_sum(n, MODULUS, STEP, start_phase)


def counts(n: int, start_phase: int, cuts: Ints) -> Ints:
    """The draws of each source among ``n`` consecutive positions (the first of phase ``start_phase``)."""
    base = floor_sum(n, MODULUS, STEP, start_phase)  # the term every threshold's count shares
    tails = [n]  # T[0] = 0: every phase is >= 0
    for t in cuts[1:-1].tolist():
        tails.append(floor_sum(n, MODULUS, STEP, start_phase + MODULUS - t) - base if t else n)
    tails.append(0)  # T[S] = M: no phase is >= M
    ends = np.array(tails, dtype=np.int64)
    out: Ints = ends[:-1] - ends[1:]
    return out


def codes(start_phase: int, n: int, cuts: Ints) -> Ints:
    """The source (its place in ``datasets``) of ``n`` consecutive positions, the first of phase ``start_phase``."""
    native = compiled()
    if native is not None:  # the same, one pass
        out = np.empty(n, np.int64)
        native.codes(start_phase, STEP, MODULUS, _int64s(cuts), out)
        return out
    if n > _CHUNK:  # an arange of phases stays below 2**63 for n < 2**33: longer ranges a chunk at a time
        parts = [codes((start_phase + k * STEP) % MODULUS, min(_CHUNK, n - k), cuts) for k in range(0, n, _CHUNK)]
        return np.concatenate(parts)
    phases = np.arange(start_phase, start_phase + n * STEP, STEP, dtype=np.int64)[:n]
    phases %= MODULUS
    # The number of interval ends T[1..S] at or below a phase is the place of the interval that holds it.
    found: Ints = np.searchsorted(cuts[1:], phases, side="right")
    return found


def thresholds(weights: list[float]) -> Ints:
    """``T[0] = 0 <= ... <= T[S] = M``: the phases where each source's interval ends, from non-negative weights."""
    total = float(sum(weights))
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)) / total
    cuts = np.empty(len(weights) + 1, dtype=np.int64)
    cuts[0] = 0
    cuts[1:] = np.rint(cumulative * MODULUS).astype(np.int64)
    cuts[-1] = MODULUS
    np.maximum.accumulate(cuts, out=cuts)  # rounding never makes an interval negative
    return cuts


def tally(codes: Ints, sources: int) -> Ints:
    """How many of ``codes`` name each source: a comparison a source for a few (``bincount`` costs
    five times as much for three), ``bincount`` for many."""
    if sources > _TALLIED:
        counted: Ints = np.bincount(codes, minlength=sources)
        return counted
    return np.array([np.count_nonzero(codes == code) for code in range(sources)], np.int64)


def deal(codes: Ints, draws: Sequence[Ints]) -> Ints:
    """Each position's index: ``draws[c]`` read in order by the positions whose code is ``c``.

    ``codes`` are the positions' sources; ``draws[c]`` holds (at least) as many indices as
    ``codes`` holds ``c``, in the order of those positions.
    """
    out = np.empty(len(codes), np.int64)
    native = compiled()
    if native is not None:
        native.deal(_int64s(codes), tuple(_int64s(d) for d in draws), out)
        return out
    for code, drawn in enumerate(draws):
        where = codes == code
        out[where] = drawn[: int(np.count_nonzero(where))]
    return out


def group(codes: Ints, drawn: Ints, sizes: Ints, sources: int) -> tuple[Ints, Ints, Ints]:
    """Ranges of positions, one after another (``sizes`` long each), each grouped by source.

    ``(order, indices, counts)``: ``order`` holds each range's places in ``codes``, by source
    (in the order of their codes), in order within a source; ``indices`` is ``drawn[order]``;
    ``counts`` (a row per range) how many positions of each source a range has.
    """
    order, indices = np.empty(len(codes), np.int64), np.empty(len(codes), np.int64)
    native = compiled()
    if native is not None:
        counts = np.empty((len(sizes), sources), np.int64)
        native.group(_int64s(codes), _int64s(drawn), _int64s(sizes), sources, order, indices, counts)
        return order, indices, counts
    if len(sizes) > 1:  # by (range, source)
        key = np.repeat(np.arange(0, len(sizes) * sources, sources, dtype=np.int64), sizes)
        key += codes
    else:
        key = codes
    narrow = key.astype(np.uint16) if len(sizes) * sources <= 1 << 16 else key  # a radix sort
    order[:] = np.argsort(narrow, kind="stable")
    np.take(drawn, order, out=indices)
    grouped: Ints = np.bincount(key, minlength=len(sizes) * sources).reshape(len(sizes), sources)
    return order, indices, grouped


def _int64s(values: Ints) -> Ints:
    contiguous: Ints = np.ascontiguousarray(values, dtype=np.int64)
    return contiguous
