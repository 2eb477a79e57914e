"""Packing plans: which token spans of which documents make up each fixed-length sequence (pure numpy).

A plan is computed from the documents' lengths alone and holds, for ``n``
sequences of ``seq_len`` tokens:

* ``fragments``: int64 ``(m, 3)``, one row per fragment (a run of consecutive
  tokens of one document): the document's index, the fragment's first token
  within the document, its length (>= 1);
* ``bounds``: int64 ``(n + 1,)`` from 0: sequence ``s`` is the fragments
  ``bounds[s]:bounds[s + 1]``, laid end to end; what they leave of
  ``seq_len`` is padding, at the end of the sequence.

Two ways to plan (``mode``):

* ``"concat"``: the documents end to end in their order, cut every
  ``seq_len`` tokens; a document may span sequences, and only the last
  sequence is padded (when the token count is not a multiple of ``seq_len``).
* ``"bfd"``: whole documents packed best-fit decreasing: longest first, each
  into the sequence with the least room that still holds it, else into a new
  one. A document longer than ``seq_len`` is first cut into ``seq_len``-token
  pieces and its remainder (``long_docs="split"``), or to its first
  ``seq_len`` tokens (``"truncate"``, which ``"concat"`` applies too).

Empty documents contribute nothing. :func:`best_fit_decreasing` places the
items one *size* at a time rather than one item at a time: all items of one
size go, in a few array operations, into the open sequences with the least
room first (a sequence with room ``c`` takes ``c // size`` of them), then into
new sequences. That is exactly best-fit decreasing (a sequence that took an
item keeps the least room that still fits the next item of that size, so it
takes the next one too), in O(distinct sizes x open sequences) array work
instead of a Python step per item.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LONG_DOCS", "MODES", "Plan", "best_fit_decreasing", "make_plan"]

MODES = ("bfd", "concat")
LONG_DOCS = ("split", "truncate")

Int64s = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True)
class Plan:
    """The fragments of every sequence (see the module docstring)."""

    fragments: np.ndarray[Any, Any]
    bounds: np.ndarray[Any, Any]
    seq_len: int

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def tokens(self) -> int:
        """Document tokens the plan places."""
        return int(self.fragments[:, 2].sum())

    @property
    def padding(self) -> int:
        """Padding tokens of all sequences."""
        return len(self) * self.seq_len - self.tokens


def make_plan(lengths: Int64s, seq_len: int, mode: str, long_docs: str) -> Plan:
    """The plan of documents of ``lengths`` (int64, in document order) into sequences of ``seq_len``."""
    lengths = np.asarray(lengths, np.int64)
    if long_docs == "truncate":
        lengths = np.minimum(lengths, seq_len)
    if mode == "concat":
        return _concat(lengths, seq_len)
    docs, starts, sizes = _pieces(lengths, seq_len)
    bins = best_fit_decreasing(sizes, seq_len)
    placed = np.argsort(-sizes, kind="stable")  # the order best_fit_decreasing places the pieces in
    order = placed[np.argsort(bins[placed], kind="stable")]  # each sequence's pieces in the order placed
    fragments = np.stack([docs[order], starts[order], sizes[order]], axis=1)
    count = int(bins.max()) + 1 if len(bins) else 0
    bounds = np.zeros(count + 1, np.int64)
    np.cumsum(np.bincount(bins, minlength=count), out=bounds[1:])
    return Plan(np.ascontiguousarray(fragments, np.int64), bounds, seq_len)


def _concat(lengths: Int64s, seq_len: int) -> Plan:
    """Documents end to end, cut every ``seq_len`` tokens: a document's fragments lie between sequence edges."""
    edges = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=edges[1:])
    count = -(-int(edges[-1]) // seq_len)
    docs = np.flatnonzero(lengths)
    first, last = edges[docs], edges[docs + 1]
    seq = first // seq_len
    per_doc = (last - 1) // seq_len - seq + 1  # the sequences each document's tokens reach
    frag_docs = np.repeat(docs, per_doc)
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum(per_doc, out=offsets[1:])
    frag_seq = np.repeat(seq, per_doc) + np.arange(len(frag_docs), dtype=np.int64) - np.repeat(offsets[:-1], per_doc)
    begins = np.maximum(frag_seq * seq_len, edges[frag_docs])
    ends = np.minimum((frag_seq + 1) * seq_len, edges[frag_docs + 1])
    fragments = np.stack([frag_docs, begins - edges[frag_docs], ends - begins], axis=1)
    bounds = np.searchsorted(frag_seq, np.arange(count + 1, dtype=np.int64))
    return Plan(np.ascontiguousarray(fragments, np.int64), bounds.astype(np.int64), seq_len)


def _pieces(lengths: Int64s, seq_len: int) -> tuple[Int64s, Int64s, Int64s]:
    """``(doc, start, size)`` of the pieces to pack: documents cut into ``seq_len`` pieces and a remainder."""
    full, rest = np.divmod(lengths, seq_len)
    per_doc = full + (rest > 0)
    docs = np.repeat(np.arange(len(lengths), dtype=np.int64), per_doc)
    firsts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(per_doc, out=firsts[1:])
    within = np.arange(len(docs), dtype=np.int64) - np.repeat(firsts[:-1], per_doc)  # piece k of its doc
    starts = within * seq_len
    sizes = np.minimum(lengths[docs] - starts, seq_len)
    return docs, starts, sizes


def best_fit_decreasing(sizes: Int64s, capacity: int) -> Int64s:
    """The bin (0, 1, ... in the order bins open) of each item, packed best-fit decreasing (see the docstring).

    ``sizes`` are int64 in ``[1, capacity]``. Ties (bins with equal room) go to the bin opened first.
    """
    sizes = np.asarray(sizes, np.int64)
    order = np.argsort(-sizes, kind="stable")  # longest first; equal sizes in document order
    sorted_sizes = sizes[order]
    bins_sorted = np.empty(len(sizes), np.int64)
    room = np.empty(len(sizes), np.int64)  # room left in each open bin
    opened = 0
    firsts = np.flatnonzero(np.diff(sorted_sizes, prepend=-1) != 0)  # where each run of one size starts
    counts = np.diff(firsts, append=len(sizes))
    groups = sorted_sizes[firsts]
    for size, first, count in zip(groups.tolist(), firsts.tolist(), counts.tolist(), strict=True):
        placed = _into_open(room[:opened], size, count)
        taken = len(placed)
        bins_sorted[first : first + taken] = placed
        left = count - taken
        if left:
            per_bin = capacity // size
            new = -(-left // per_bin)
            ids = np.repeat(np.arange(opened, opened + new, dtype=np.int64), per_bin)[:left]
            bins_sorted[first + taken : first + count] = ids
            room[opened : opened + new] = capacity - per_bin * size
            room[opened + new - 1] = capacity - (left - (new - 1) * per_bin) * size
            opened += new
    bins = np.empty(len(sizes), np.int64)
    bins[order] = bins_sorted
    return bins


def _into_open(room: Int64s, size: int, count: int) -> Int64s:
    """Place up to ``count`` items of ``size`` into the open bins with the least room first; their bins.

    ``room`` is updated in place. A bin with room ``c`` takes ``c // size`` items.
    """
    fits = np.flatnonzero(room >= size)
    if not len(fits):
        return np.zeros(0, np.int64)
    # The least room first; equal room: the bin opened first (argsort is stable over increasing ids).
    fits = fits[np.argsort(room[fits], kind="stable")]
    takes = room[fits] // size
    total = np.cumsum(takes)
    if total[-1] > count:
        last = int(np.searchsorted(total, count))  # the bin that takes the last item
        fits, takes = fits[: last + 1], takes[: last + 1].copy()
        takes[last] -= int(total[last]) - count
    room[fits] -= takes * size
    return np.repeat(fits, takes)
