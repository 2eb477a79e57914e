"""The mapping of an open cache: its regions as arrays, and what one slot's bytes go through.

:class:`Mapped` takes the views of a mapped file together — the slot table,
one array per fixed field, the variable columns and their heap, the index
table, read-ahead hints, the boot page — so that a call reads them once
(see its docstring for why that makes ``close()`` safe). Its methods are the
mechanics ``Cache`` builds its policy on:

* **read a batch** of what is cached (``read``, for ``read_many`` and single flight);
* **finish a batch read**: variable fields gathered as one
  :class:`~mmapcache.Jagged` (text as ``str``/``bytes``), damaged
  descriptors and (with ``verify``) checksum mismatches turned into misses,
  each logged once with what to do;
* **account for the variable region**: which bytes READY slots' values hold
  (``verify``, ``variable_region``, the reconciliation after a reboot).

Every write goes through the one writer on top of these views (``_region/writer.py``);
policy — which indices are valid, readonly handles, counters — stays in
``cache.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from .._file import BootPage
from .._format import Header, Layout
from .allocator import VariableRegion
from .gathers import FixedRows
from .handle import Handle
from .jagged import Jagged, rows_like
from .partitions import StreamRegion
from .readahead import prefetch_later, readahead_for
from .slots import READY, SlotTable
from .variable import NO_ROWS, VariableColumn, text_value, texts
from .verify import failed_rows, intact, intact_parts

__all__ = ["Mapped"]

log = logging.getLogger("mmapcache")


class Mapped:
    """The views of an open cache's mapping, taken together so a call reads them once.

    A method loads ``self._mapped`` once and works on that snapshot: ``close()``
    only swaps the attribute for ``None``, and the mapping lives as long as any
    snapshot (or array) refers to it, so a call racing ``close()`` in another
    thread completes on valid memory or raises the closed-cache ``ValueError``
    — it never reads unmapped memory.
    """

    __slots__ = (
        "arrays",
        "boot",
        "fixed",
        "heap",
        "indices",
        "items",
        "layout",
        "order",
        "path",
        "raws",
        "readahead",
        "region",
        "slots",
        "states",
        "stream",
        "variables",
    )

    def __init__(self, handle: Handle, header: Header, layout: Layout) -> None:
        mm = handle.mm
        self.path: Path = handle.path
        self.layout = layout  # where each region starts in the file (the writer pwrites a fresh run there)
        assert mm is not None
        capacity = header.capacity
        self.slots = SlotTable(mm, layout, capacity, header.record_size, handle.locks)
        self.states = self.slots.state_bytes
        fixed = {name: field for name, field in header.fields.items() if not field.variable}
        # Fixed fields: one array each, shape (capacity, *shape); their flat byte rows, for checksums.
        self.arrays = {
            name: np.ndarray((capacity, *field.fixed_shape), field.dtype, buffer=mm, offset=layout.field_offsets[name])
            for name, field in fixed.items()
        }
        self.items = tuple(self.arrays.items())
        self.fixed = FixedRows(self.slots.states, READY, self.arrays)  # batches of them, in one pass
        self.raws = tuple(
            np.ndarray((capacity, field.nbytes), np.uint8, buffer=mm, offset=layout.field_offsets[name])
            for name, field in fixed.items()
        )
        # Variable fields: descriptors per slot, values in the variable region.
        self.heap = handle.heap
        self.region = self.heap.region if self.heap is not None else np.zeros(0, np.uint8)
        self.variables = tuple(
            VariableColumn(name, field, mm, layout.field_offsets[name], capacity, self.region)
            for name, field in header.fields.items()
            if field.variable
        )
        raws = dict(zip(fixed, self.raws, strict=True))
        columns = {column.name: column for column in self.variables}
        self.indices: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        if layout.indices_offset:
            self.indices = np.ndarray((header.length,), "<u8", buffer=mm, offset=layout.indices_offset)
            self.indices.flags.writeable = False
        # Every field in file order: ("fixed", array, raw) or ("variable", column).
        self.order: tuple[tuple[Any, ...], ...] = tuple(
            (name, columns[name]) if name in columns else (name, self.arrays[name], raws[name])
            for name in header.fields
        )
        # Read-ahead hints for a file on a disk; None in memory (tmpfs), where reads stay as they were.
        self.readahead = readahead_for(handle.path, handle.fd, layout, header, self.variables)
        self.boot = BootPage(mm, layout.boot_offset) if layout.boot_offset else None  # version 5: see _region/reboot.py
        # Version 8: the cache of a stream (see _region/partitions.py).
        self.stream = (
            StreamRegion(mm, layout, capacity, self.slots.states, handle.locks) if layout.stream_offset else None
        )

    def parts(self, index: int) -> list[np.ndarray[Any, Any]] | None:
        """Slot ``index``'s checksum parts in field order (``None``: a variable descriptor is impossible)."""
        parts: list[np.ndarray[Any, Any]] = []
        for entry in self.order:
            if len(entry) == 3:
                parts.append(entry[2][index])
                continue
            found = entry[1].parts(index)
            if found is None:
                return None
            parts.extend(found)
        return parts

    def prefetch(self, idx: np.ndarray[Any, Any], capacity: int, length: int, *, background: bool) -> None:
        """``Cache.prefetch``: ask for the READY slots among ``idx`` to be read in (a file on a disk only)."""
        if self.readahead is None or not len(idx):
            return
        ready = idx[self.slots.ready_mask(idx, capacity, length)]
        if len(ready) and background:
            prefetch_later(self.readahead, ready)
        elif len(ready):
            self.readahead.before_read(ready)

    # -- reading --------------------------------------------------------------

    def read(
        self, idx: np.ndarray[Any, Any], out: dict[str, Any], capacity: int, length: int, verify: bool
    ) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]]]:
        """What is cached of validated ``idx``, fixed fields into ``out``: ``(every field, hits)``.

        ``Cache.read_many`` without its argument checks and counts; rows of
        misses are left as they were (``None`` in a variable field's batch).
        """
        hits = self.slots.ready_mask(idx, capacity, length)
        if self.readahead is not None:
            self.readahead.before_read(idx[hits])
        if hits.all():
            for name, array in self.items:
                np.take(array, idx, axis=0, out=out[name], mode="clip")
        elif hits.any():
            rows = np.flatnonzero(hits)
            for name, array in self.items:
                out[name][rows] = array[idx[rows]]
        out, bad = self.checked(idx, out, np.flatnonzero(hits), verify)
        hits[bad] = False
        return out, hits

    def intact(self, index: int, arrays: Any) -> bool:
        """Whether a fixed-field sample read from slot ``index`` matches its checksum (a mismatch is logged)."""
        if intact(self.slots, index, arrays):
            return True
        report_mismatch(self.path, index)
        return False

    def sample(self, i: int, verify: bool) -> dict[str, np.ndarray[Any, Any]] | None:
        """A READY sample of a cache with variable fields (``None``: it fails its checks, a miss)."""
        sample: dict[str, np.ndarray[Any, Any]] = {}
        for entry in self.order:
            if len(entry) == 3:
                sample[entry[0]] = entry[1][i, ...].copy()
                continue
            value: Any = entry[1].copy(i)
            kind = entry[1].field.text
            if value is not None and kind is not None:
                value = text_value(kind, value)  # a text field: str or bytes
            if value is None:
                report_damage(self.path, i)
                return None
            sample[entry[0]] = value
        if verify:
            parts = self.parts(i)
            if parts is None or not intact_parts(self.slots, i, parts):
                report_mismatch(self.path, i)
                return None
        return sample

    def checked(
        self, idx: np.ndarray[Any, Any], out: dict[str, Any], rows: np.ndarray[Any, Any], verify: bool
    ) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
        """Finish a batch read of ``rows`` (gathered into ``out``): variable fields added, checks made.

        Returns ``out`` with every field and the rows that failed (a damaged
        variable descriptor, or with ``verify`` a checksum mismatch).
        """
        if self.variables:
            return self.with_variables(idx, out, rows, verify)
        if not verify or not len(rows):
            return out, np.zeros(0, np.intp)
        if len(rows) == len(idx):  # every row: check the gathered arrays as they are
            bad = failed_rows(self.slots, idx, list(out.values()))
        else:
            bad = rows[failed_rows(self.slots, idx[rows], [out[name][rows] for name in self.arrays])]
        for i in idx[bad].tolist():
            report_mismatch(self.path, i)
        return out, bad

    def with_variables(
        self, idx: np.ndarray[Any, Any], out: dict[str, Any], rows: np.ndarray[Any, Any], verify: bool
    ) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
        """Add each variable field's values for ``rows`` of ``idx`` to ``out``; and the bad rows.

        A numeric field becomes one :class:`Jagged` (one gather), a text field
        a list of ``str``/``bytes``. A row is bad when a descriptor is
        impossible or (with ``verify``) the slot fails its checksum; it is
        missing there (``None``).
        """
        batches: dict[str, Any] = {}
        bad, damaged = np.zeros(len(idx), bool), False
        every = len(rows) == len(idx)  # rows are 0..n-1 in order (get_many, or read_many of all hits)
        for column in self.variables:
            jagged, impossible = column.gather(idx, None if every else rows)
            if column.field.text is not None:  # a text field: str or bytes
                values, undecodable = texts(column.field.text, list(jagged))
                impossible = np.union1d(impossible, undecodable).astype(np.intp)
                batches[column.name] = values
            else:
                batches[column.name] = jagged
            if len(impossible):  # rare: skip the array work for a batch without any
                bad[impossible] = damaged = True
        for row in np.flatnonzero(bad).tolist() if damaged else ():
            report_damage(self.path, int(idx[row]))
        if verify:
            for row in rows[~bad[rows]].tolist():
                i = int(idx[row])
                parts = self.parts(i)
                if parts is None or not intact_parts(self.slots, i, parts):
                    report_mismatch(self.path, i)
                    bad[row] = True
        failed = np.flatnonzero(bad) if damaged or verify else NO_ROWS
        if len(failed):
            batches = {name: _without(values, failed) for name, values in batches.items()}
        merged = {entry[0]: out[entry[0]] if entry[0] in out else batches[entry[0]] for entry in self.order}
        return merged, failed

    # -- the variable region --------------------------------------------------

    def variable_region(self) -> VariableRegion | None:
        """How full the variable region is (``None`` without variable fields): ``Cache.variable_region``."""
        if self.heap is None:
            return None
        heap = self.heap
        return VariableRegion(heap.size, int(heap.claimed[0]), self.region_use()[0], int(heap.refused[0]))

    def region_use(self) -> tuple[int, int]:
        """``(used, end)``: bytes of the variable region that READY slots' values hold, and where the last ends.

        Values whose descriptors are impossible (see ``VariableColumn.spans``) are left out.
        """
        ready = np.flatnonzero(np.asarray(self.slots.states) == READY)
        used = end = 0
        for column in self.variables:
            _, _, counts, ends, bad = column.spans(ready)
            good = ~bad
            used += int(counts[good].sum()) * column.dtype.itemsize
            if good.any():
                end = max(end, int(ends[good].max()))
        return used, end

    def value_ranges(self, ready: np.ndarray[Any, Any]) -> list[tuple[int, int, int]]:
        """``(start, end, slot)`` in the variable region of every variable value of the ``ready`` slots."""
        spans = []
        for column in self.variables:
            _, starts, _, ends, bad = column.spans(ready)
            good = ~bad
            spans += list(zip(starts[good].tolist(), ends[good].tolist(), ready[good].tolist(), strict=True))
        return spans

    def cover_values(self) -> None:
        """After a reboot: make the allocation counter cover every value kept (its page may have missed the disk)."""
        heap = self.heap
        if heap is None:
            return
        before = int(heap.claimed[0])
        if heap.cover(self.region_use()[1]):
            log.warning(
                "the allocation counter of the variable region (%d bytes handed out) did not cover the values "
                "kept after the reboot; moved to %d bytes so that new values never overwrite them",
                before,
                int(heap.claimed[0]),
            )


def report_damage(path: Path, index: int) -> None:
    log.warning(
        "slot %d of %s describes a variable value that cannot be in the file; treated as a miss "
        "(cache.verify(fix=True) or `mmapcache verify --fix` resets it)",
        index,
        path,
    )


def report_mismatch(path: Path, index: int) -> None:
    log.warning(
        "slot %d of %s does not match its checksum; treated as a miss "
        "(cache.verify(fix=True) or `mmapcache verify --fix` resets it)",
        index,
        path,
    )


def _without(values: Any, rows: np.ndarray[Any, Any]) -> Any:
    """A variable field's batch with ``rows`` made missing (``None``): they failed their checks."""
    if isinstance(values, Jagged):
        kept = list(values)
        for row in rows.tolist():
            kept[row] = None
        return rows_like(values, kept)
    for row in rows.tolist():
        values[row] = None
    return values
