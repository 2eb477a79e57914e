"""What file to create: the arguments of ``Cache(...)`` checked, and the plan for a new file.

``plan`` turns what the caller gave (fields, length, key, capacity or a byte
budget, a shard's dataset indices) into what an existing file must hold
(:class:`~mmapcache._file.validate.Expected`) and, when creating is allowed, what a
new file gets (:class:`~mmapcache._file.create.NewFile`): its slots, its variable
region, its creation metadata. Malformed arguments raise at once; a budget
that cannot be met is kept (``Plan.unplannable``) and raised only if the
file turns out to be missing, since opening an existing file needs no plan.
The layout math itself is ``_format``'s.
"""

from __future__ import annotations

import math
import operator
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._field import Field, FieldsLike, normalize_fields
from .._format import (
    ALIGNMENT,
    MAX_FILE_SIZE,
    align_down,
    extent_size_for,
    indices_digest,
    iso_time,
    max_slots,
    parse_bytes,
    slot_nbytes,
)
from .create import NewFile
from .validate import Expected

__all__ = [
    "EXTENT_ROOM",
    "VARIABLE_HEADROOM",
    "Plan",
    "check_count",
    "creation_info",
    "index_table",
    "plan",
    "plan_capacity",
    "plan_variable",
    "variable_budget",
    "variable_room",
]


@dataclass(frozen=True)
class Plan:
    """What an existing file must hold, and what a new one would (``None``: this call may not create)."""

    expected: Expected
    new: NewFile | None
    unplannable: ValueError | None  # why a new file could not be planned, raised only if creating is needed


def plan(
    fields: FieldsLike | None,
    length: int | None,
    *,
    key: str | None,
    capacity: int | None,
    max_bytes: int | str | None,
    readonly: bool,
    dataset_indices: Any,
) -> Plan:
    """``Cache(...)``'s arguments checked and planned (see the module docstring)."""
    wanted = normalize_fields(fields) if fields is not None else None
    if length is not None:
        length = check_count("length", length)
    table = None if dataset_indices is None else index_table(dataset_indices)
    if table is not None:
        if length is not None and length != len(table):
            raise ValueError(f"length is {length} but dataset_indices holds {len(table)} indices: they must agree")
        length = len(table)
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a string, not {type(key).__name__}")
    variable = wanted is not None and any(field.variable for field in wanted.values())
    if capacity is not None and max_bytes is not None and not variable:
        raise ValueError("give capacity= or max_bytes=, not both")
    # Malformed arguments are refused whether or not the file exists; only a plan that does
    # not fit (no budget, too small, too large) waits to see whether creating is needed.
    if capacity is not None:
        check_count("capacity", capacity)
    if max_bytes is not None:
        parse_bytes(max_bytes, name="max_bytes")
    new, unplannable = None, None
    if not readonly and wanted is not None and length is not None:
        try:
            if variable:
                slots, variable_size = plan_variable(wanted, length, capacity, max_bytes)
            else:
                slots, variable_size = plan_capacity(wanted, length, capacity, max_bytes), 0
        except ValueError as error:
            # Only creating needs a plan: an existing file is opened (and checked) without one.
            unplannable = error
        else:
            new = NewFile(
                fields=wanted,
                length=length,
                capacity=slots,
                key=key or "",
                created=creation_info(),
                variable_size=variable_size,
                extent_size=extent_size_for(variable_size) if variable_size else 0,
                dataset_indices=table,
            )
    digest = None if table is None else indices_digest(table)
    return Plan(Expected(wanted, length, key, digest), new, unplannable)


MAX_COUNT = 2**64 - 1  # length and capacity are uint64 in the header


def index_table(indices: Any) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """``dataset_indices`` checked (integers, non-negative, strictly increasing, some) as the file's table."""
    given = np.asarray(indices)
    if given.ndim != 1:
        raise TypeError(f"dataset_indices must be a sequence of integers, not an array of shape {given.shape}")
    if given.size == 0:
        raise ValueError("dataset_indices is empty: a cache needs at least one index to hold")
    if given.dtype.kind not in "iu":
        raise TypeError(f"dataset_indices must be integers, not {given.dtype}")
    if int(given.min()) < 0:
        raise ValueError(f"dataset_indices holds the negative index {int(given.min())}")
    table = given.astype("<u8")
    steps = np.diff(table.astype(np.int64)) if int(given.max()) < 2**63 else None
    if steps is None:
        raise ValueError(f"dataset_indices holds {int(given.max())}, beyond the largest index 2**63 - 1")
    if steps.size and int(steps.min()) <= 0:
        at = int(np.flatnonzero(steps <= 0)[0])
        raise ValueError(
            f"dataset_indices must be strictly increasing (sorted, no repeats): {int(table[at])} is followed by "
            f"{int(table[at + 1])} at position {at + 1}; pass sorted(set(indices))"
        )
    return table


def check_count(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{name} must not be negative, got {n}")
    if n > MAX_COUNT:
        raise ValueError(f"{name} must be below 2**64 (the cache format stores it in 64 bits), got {n}")
    return n


def plan_capacity(fields: dict[str, Field], length: int, capacity: int | None, max_bytes: int | str | None) -> int:
    """How many slots a new file gets, from the arguments (the layout math is ``_format``'s)."""
    per_slot = slot_nbytes(fields)
    if max_bytes is not None:
        budget = parse_bytes(max_bytes, name="max_bytes")
        slots = min(length, budget // per_slot)
        if slots == 0 and length > 0:
            record = per_slot - sum(field.nbytes for field in fields.values())
            raise ValueError(
                f"max_bytes={max_bytes!r} ({budget} bytes) is too small for one slot, which "
                f"takes {per_slot} bytes ({per_slot - record} of data + {record} of slot record)"
            )
        given = "max_bytes"
    else:
        slots = length if capacity is None else min(check_count("capacity", capacity), length)
        given = "capacity" if capacity is not None and capacity <= length else "length"
    if slots > max_slots(fields):
        raise ValueError(
            f"{given} gives {slots} slots of {per_slot} bytes, a file of about {slots * per_slot} bytes: "
            f"more than a file can hold (2**63 - 1 bytes, at most {max_slots(fields)} such slots); "
            "cache fewer samples with capacity= or max_bytes="
        )
    return slots


def plan_variable(
    fields: dict[str, Field], length: int, capacity: int | None, max_bytes: int | str | None
) -> tuple[int, int]:
    """``(slots, variable region bytes)`` for a new file with variable fields: ``max_bytes`` covers both."""
    variable = [name for name, field in fields.items() if field.variable]
    if max_bytes is None:
        raise ValueError(
            f"fields {variable} have variable dimensions, so the cache needs a byte budget for their values: "
            'pass max_bytes= (e.g. max_bytes="8GiB"); it covers the fixed parts of every slot and the values'
        )
    budget = parse_bytes(max_bytes, name="max_bytes")
    slots = length if capacity is None else min(check_count("capacity", capacity), length)
    if slots > max_slots(fields):
        raise ValueError(f"{slots} slots are more than a file can hold; cache fewer samples with capacity=")
    fixed = slots * slot_nbytes(fields)
    region = min(align_down(budget - fixed), align_down((MAX_FILE_SIZE - fixed) // 2))
    if region < ALIGNMENT:
        raise ValueError(
            f"max_bytes={max_bytes!r} ({budget} bytes) leaves no room for the values of the variable fields "
            f"{variable}: the fixed parts of {slots} slots already take {fixed} bytes "
            f"({slot_nbytes(fields)} per slot). Give max_bytes of at least {fixed} bytes plus the total size "
            "of the values you expect, or fewer slots with capacity="
        )
    return slots, region


VARIABLE_HEADROOM = 1.25  # without a budget: room for this many times the measured mean of a slot's values
EXTENT_ROOM = 2**20  # and this much more: writers claim the region in extents (see _region/allocator.py)


def variable_budget(fields: dict[str, Field], slots: int, mean_values: float) -> int:
    """The byte budget of a new file with variable fields and no ``max_bytes``: the one sizing policy.

    The fixed parts of every slot, plus ``VARIABLE_HEADROOM`` times
    ``mean_values`` (the measured mean bytes of a slot's variable values,
    each rounded as the region places it: :func:`~._heap.place`) per slot,
    plus ``EXTENT_ROOM``. A caller that measured nothing has no budget to
    offer: ``Cache(...)`` asks for ``max_bytes=`` instead.
    """
    return slots * slot_nbytes(fields) + variable_room(slots, mean_values)


def variable_room(slots: int, mean_values: float) -> int:
    """The variable region's share of :func:`variable_budget`: headroom over the measured values, and extents.

    A stream cache (whose slots are not a ``Cache``'s) sizes its region by this same rule.
    """
    return math.ceil(VARIABLE_HEADROOM * mean_values * slots) + EXTENT_ROOM


def creation_info() -> dict[str, Any]:
    from .._version import __version__

    return {
        "time": iso_time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "uid": os.geteuid(),
        "mmapcache": __version__,
    }
