"""Sizing a new file with variable fields and no ``max_bytes``: its byte budget, from a spread sample."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from .._file import VARIABLE_HEADROOM, free_bytes, variable_budget
from .._format import format_bytes
from .._region import place
from ._columns import columns
from ._schema import Schema
from ._settings import Settings

__all__ = ["SIZING_HEADROOM", "SIZING_SAMPLES", "Sized", "fits", "size_variable"]

log = logging.getLogger("mmapcache")

SIZING_SAMPLES = 64  # samples a new file with variable fields and no max_bytes is sized from
SIZING_HEADROOM = VARIABLE_HEADROOM  # room for the variable values: this many times the sample's mean


class Sized(NamedTuple):
    """A budget sized from a spread sample, and the samples loaded for it (stored once the file exists)."""

    budget: int
    positions: list[int]
    columns: list[Any]
    indices: list[int]
    raw: list[Any]


def size_variable(
    settings: Settings,
    schema: Schema,
    positions: list[int],
    stored: list[Any],
    *,
    fetch: Callable[[list[int]], list[Any]],
    columns_of: Callable[[Schema, list[int], list[Any]], list[Any]],
) -> Sized | None:
    """The byte budget of a new file with variable fields and no ``max_bytes``, from a spread sample.

    ``SIZING_SAMPLES`` positions spread evenly over the file (the middles of as
    many equal parts; the first batch's rows among them are not loaded again)
    are loaded, checked and measured: the budget is the core's one sizing
    policy (:func:`mmapcache._file.planning.variable_budget`) for the mean bytes of a
    sample's variable values — the fixed parts of every slot, plus
    ``SIZING_HEADROOM`` times that mean per slot, plus 1 MiB (writers claim the
    region in extents). It is capped by the file system's free space (a warning
    says so, and what to do). The loaded samples are returned, to be stored.
    """
    if settings.max_bytes is not None or not schema.ragged:
        return None
    slots = settings.length if settings.capacity is None else min(settings.capacity, settings.length)
    drawn = min(slots, SIZING_SAMPLES)
    spread = sorted({int((j + 0.5) * slots / drawn) for j in range(drawn)})  # the middles of equal parts
    extra = sorted(set(spread) - set(positions))
    loaded = fetch(extra) if extra else []  # loads the user pays once, at creation (stored below)
    # A sample that does not fit the fields is left out: it raises when it is read, as it would have.
    fitting = [(p, sample) for p, sample in zip(extra, loaded, strict=True) if fits(settings, schema, p, sample)]
    extra = [p for p, _ in fitting]
    indices, raw = settings.sources(extra), [sample for _, sample in fitting]
    columns = columns_of(schema, indices, raw) if extra else [[] for _ in schema.names]
    variable = [k for k, v in enumerate(schema.variable) if v]
    # The mean over the spread sample only: the first batch (often the dataset's first samples) is
    # no sample of the dataset; those of its rows that are in the spread sample count.
    rows = {position: row for row, position in enumerate(positions)}
    mine = [rows[p] for p in spread if p in rows] if extra else list(range(len(positions)))
    values = [place(value.nbytes) for k in variable for value in columns[k]]
    values += [place(stored[k][row].nbytes) for k in variable for row in mine]
    measured = len(extra) + len(mine)
    mean = sum(values) / max(measured, 1)
    budget = variable_budget(schema.fields, slots, mean)
    free = free_bytes(settings.path.parent)
    if free is not None and budget > free * 0.9:
        capped = int(free * 0.9)
        names = [schema.names[k] for k in variable]
        log.warning(
            "%s: the values of the variable fields %s take %s a sample on average (%d samples drawn), "
            "so caching all %d samples needs about %s, but %s has only %s free: the cache is made with "
            "%s, and samples whose values find no room are read from the dataset every time (see "
            "stats()['variable_free'] and `mmapcache info`). Give max_bytes= to choose the size, or set "
            "MMAPCACHE_DIR to a larger file system",
            settings.path,
            names,
            format_bytes(int(mean)),
            measured,
            slots,
            format_bytes(budget),
            settings.path.parent,
            format_bytes(free),
            format_bytes(capped),
        )
        budget = capped
    return Sized(budget, extra, columns, indices, raw)


def fits(settings: Settings, schema: Schema, position: int, sample: Any) -> bool:
    """Whether the sample at file position ``position`` can be stored with ``schema``."""
    try:
        columns(schema, settings.sources([position]), [sample], settings.dtypes, declared=True)
    except (TypeError, ValueError):
        return False
    return True
