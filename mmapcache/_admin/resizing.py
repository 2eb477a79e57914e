"""`resize`: give a cache a larger budget without refilling what it holds.

A file that others may have mapped is never truncated, extended or
rewritten: their reads would fault or see zeros. Resizing builds a new file
and swaps the name, as creation does:

1. Under the creation lock (no other creator, remover or resizer), with the
   old file open (its shared in-use lock keeps ``clear`` away), plan the new
   layout: the same fields, length, key and index table, a larger budget.
2. Create it under a temp name in the same directory, preallocated
   (``posix_fallocate``), after checking that the file system has room for it
   next to the old one.
3. Copy every READY slot that matches its checksum — slots are write-once, so
   a READY slot's bytes stay as they are while other processes keep filling
   other slots — with its checksum; values of variable fields are packed one
   after another from the start of the new variable region. The usage
   counters are summed into the new file's retired record.
4. ``fsync`` it and ``rename`` it over the old name. Processes that have the
   old file open keep a valid mapping of it (what they fill from then on
   stays in the old file, freed when the last of them closes it); every
   later open, and an open that raced the rename (it checks the name still
   names the file it locked), gets the new file. A handle tells that its name
   names another file now (``Cache.replaced``); ``CachedDataset`` asks on
   every miss and moves to the new file before loading it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CacheSpaceError
from .._file import (
    admitted,
    boot_page,
    check_space,
    creation_lock,
    filesystem_type,
    fsync_dir,
    is_memory_filesystem,
    new_temp_path,
    plan_capacity,
    plan_variable,
    preallocate,
    remove_leftovers,
    remove_plans,
    write_all,
)
from .._format import (
    ELEMENT_RECORD_SIZE,
    Header,
    Layout,
    align_down,
    compute_layout,
    descriptor_nbytes,
    extent_size_for,
    format_bytes,
    iso_time,
    new_header,
    pack_header,
    parse_bytes,
    slot_nbytes,
)
from .._region import _ALLOCATED, _ELEMENT, _PARTITION, ENDED, FULL, HOLE, READY, intact_parts, place

__all__ = ["Resized", "resize"]

log = logging.getLogger("mmapcache")

_COUNTER = np.dtype([("pid", "<u4"), ("flags", "<u4"), ("hits", "<u8"), ("misses", "<u8"), ("written", "<u8")])


@dataclass(frozen=True)
class Resized:
    """What :func:`resize` did: the file's size and slots before and after, and the samples it kept."""

    path: Path
    old_bytes: int
    new_bytes: int
    old_capacity: int
    new_capacity: int
    old_variable_bytes: int
    new_variable_bytes: int
    kept: int  # READY slots copied into the new file
    dropped: int  # READY slots that did not match their checksum (not copied)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "path": str(self.path)}


def resize(path: str | os.PathLike[str], *, max_bytes: int | str, timeout: float = 60.0) -> Resized:
    """Give the cache at ``path`` the budget ``max_bytes`` (as at creation), keeping every cached sample.

    ``max_bytes`` is read as when the cache was created: it covers the fixed
    part of every slot and the values of variable (and text) fields. A cache
    with variable fields keeps its slots and gets a larger variable region; a
    cache of fixed fields gets more slots (up to its length). It only grows:
    a budget smaller than the present one raises ``ValueError``.

    Safe while other processes read and fill the cache: the file is never
    changed in place. A new file is built next to it, every filled slot is
    copied, and the new file takes the name. Processes that have the old file
    open keep reading and filling it until they reopen (``Cache.open`` by the
    same path, a new ``CachedDataset``, the next run); what they fill after the
    copy is not in the new file. A ``CachedDataset`` moves to the new file on
    its next miss, in every process (``Cache.replaced`` tells a ``Cache`` that
    its path names a new file). Both files take space until the last of them
    closes the old one: :class:`CacheSpaceError` says so when there is not
    room for both.
    """
    from ..cache import Cache

    target = Path(os.path.abspath(os.fspath(path)))
    budget = parse_bytes(max_bytes, name="max_bytes")
    with Cache(target, timeout=timeout, readonly=True) as old:
        header, layout = old._header, old._layout
        with creation_lock(target, timeout):
            if not os.path.samestat(os.stat(target, follow_symlinks=False), os.fstat(old._handle.fd)):
                raise FileNotFoundError(errno.ENOENT, f"{target} was replaced while resizing it", str(target))
            remove_leftovers(target)  # the temp files of resizers (or creators) killed before us
            planner = _plan_stream if header.stream is not None else _plan
            planned = planner(header, layout, budget, max_bytes, old, target)
            try:
                check_space(target, compute_layout(planned).file_size)
            except CacheSpaceError as error:
                raise CacheSpaceError(
                    f"cannot resize {target} to {format_bytes(compute_layout(planned).file_size)}: the new file is "
                    f"built next to the old one ({format_bytes(layout.file_size)}), which stays until every process "
                    f"that has it open closes it, and {target.parent} has {format_bytes(error.free or 0)} free. "
                    "Free some space (`mmapcache ls`, `mmapcache gc`) or give a smaller max_bytes",
                    path=target,
                    needed=compute_layout(planned).file_size,
                    free=error.free,
                ) from None
            with admitted(target, planned, timeout=timeout, floor=header) as admission:
                new = admission.header
                new_layout = compute_layout(new)
                kept, dropped = _build(target, old, new, new_layout)
    log.info(
        "resized %s from %d to %d bytes (%d samples kept, %d dropped)",
        target,
        layout.file_size,
        new_layout.file_size,
        kept,
        dropped,
    )
    return Resized(
        path=target,
        old_bytes=layout.file_size,
        new_bytes=new_layout.file_size,
        old_capacity=header.capacity,
        new_capacity=new.capacity,
        old_variable_bytes=header.variable_size,
        new_variable_bytes=new.variable_size,
        kept=kept,
        dropped=dropped,
    )


def _plan(header: Header, layout: Layout, budget: int, given: Any, old: Any, path: Path) -> Header:
    """The new file's header: the old one with the budget ``max_bytes`` gives, refused if it shrinks."""
    fields = header.fields
    if any(field.variable for field in fields.values()):
        capacity, region = plan_variable(fields, header.length, header.capacity, budget)
        if region < header.variable_size:
            raise ValueError(
                f"max_bytes={given!r} gives a variable region of {format_bytes(region)}, smaller than the "
                f"{format_bytes(header.variable_size)} {path} has: resize only grows a cache (remove it and "
                "create it anew to shrink it)"
            )
    else:
        capacity, region = plan_capacity(fields, header.length, None, budget), 0
        if capacity < header.capacity:
            raise ValueError(
                f"max_bytes={given!r} gives {capacity} slots, fewer than the {header.capacity} {path} has: "
                "resize only grows a cache (remove it and create it anew to shrink it)"
            )
    return _header(header, header.length, capacity, region, path)


_RUN = 64  # the most slots a stream writer takes at once (a batch)


def _plan_stream(header: Header, layout: Layout, budget: int, given: Any, old: Any, path: Path) -> Header:
    """A stream cache's new header: more slots (its length is its slots) and values, as a new stream's plan.

    The values per slot are planned from what the filled slots hold so far;
    a complete stream's length (its partitions' totals, besides the slots
    taken) bounds the slots, as ``len()`` does at creation. The slots never shrink: what the budget lacks
    for them comes out of the variable region (refused if that shrinks).
    """
    from .._streams import plan_stream

    fields = header.fields
    region = old.variable_region
    value_bytes = 0 if region is None else region.used // max(old.filled, 1)
    stream = old._live().stream
    ended = bool(np.all(stream.flags & ENDED))
    # The slots in use stay taken (with their holes); the elements to store again need fresh ones — at
    # most the whole stream (a damaged slot reopens its partition from its element on) — and a batch's run
    # of slots per partition may be left a hole by a killed writer.
    length = int(stream.allocated[0]) + int(stream.total.sum()) + _RUN * header.partitions if ended else None
    per_slot = slot_nbytes(fields, header.version) + ELEMENT_RECORD_SIZE
    try:
        plan = plan_stream(
            fields, max_bytes=budget, length=length, partitions=header.partitions, value_bytes=value_bytes
        )
        slots, variable = plan.slots, plan.variable_size
    except ValueError:
        slots = variable = 0
    if slots < header.capacity:
        slots = header.capacity
        variable = align_down(max(budget - slots * per_slot, 0)) if header.variable_size else 0
    if budget < slots * per_slot or variable < header.variable_size:
        raise ValueError(
            f"max_bytes={given!r} leaves {format_bytes(variable)} for the values of {slots} slots, less than the "
            f"{format_bytes(header.variable_size)} of {path}: resize only grows a cache (give a larger max_bytes, "
            f"such as its size, {format_bytes(layout.file_size)}; or remove it and let the next run fill it anew)"
        )
    return _header(header, slots, slots, variable, path)


def _header(header: Header, length: int, capacity: int, region: int, path: Path) -> Header:
    fresh = new_header(
        header.fields,
        length,
        capacity,
        header.key,
        {**header.created, "resized": iso_time()},
        variable_size=region,
        extent_size=extent_size_for(region) if region else 0,
        indices_digest=header.indices_digest,
        on_disk=not is_memory_filesystem(filesystem_type(path.parent)),
        stream=header.stream,
    )
    return fresh


def _build(target: Path, old: Any, header: Header, layout: Layout) -> tuple[int, int]:
    """Write the new file under a temp name, copy the READY slots into it and rename it over ``target``."""
    mapped = old._live()
    # A stream's counts are read before its slots: an element counted then is READY when the slots are read.
    counts = _stream_counts(old) if header.stream is not None else None
    temp = new_temp_path(target)
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        preallocate(fd, layout.file_size, target)
        write_all(fd, pack_header(header), 0, temp)
        if mapped.indices is not None:
            write_all(fd, np.ascontiguousarray(mapped.indices, "<u8").tobytes(), layout.indices_offset, temp)
        if layout.boot_offset:
            write_all(fd, boot_page(), layout.boot_offset, temp)
        if layout.stream_offset:  # the fill boot id: this boot's (the new file is made durable before it is named)
            write_all(fd, boot_page(), layout.stream_offset, temp)
        with mmap.mmap(fd, layout.file_size) as mm:
            kept, dropped = _copy(mapped, header, layout, mm)
            if counts is not None:
                _copy_stream(old, counts, header, layout, mm)
            _carry_counters(old, layout, mm)
            mm.flush()
        os.fsync(fd)
        os.rename(temp, target)  # atomic: every open sees the old file or the new one
    except BaseException:
        os.unlink(temp)
        raise
    finally:
        os.close(fd)
    remove_plans(target)  # packing plans name the old file's uuid: the new file makes its own
    fsync_dir(target.parent)
    return kept, dropped


def _copy(mapped: Any, header: Header, layout: Layout, mm: mmap.mmap) -> tuple[int, int]:
    """Copy the old mapping's READY slots that match their checksums into ``mm``; ``(kept, dropped)``."""
    slots = mapped.slots
    ready = np.flatnonzero(np.asarray(slots.states) == READY)
    good = [i for i in ready.tolist() if (parts := mapped.parts(i)) is not None and intact_parts(slots, i, parts)]
    keep = np.asarray(good, np.intp)
    capacity = header.capacity
    table = np.ndarray((capacity, header.record_size), np.uint8, buffer=mm, offset=layout.table_offset)
    table[keep, 4:8] = np.asarray(slots.checksums)[keep].view(np.uint8).reshape(-1, 4)
    for name, array in mapped.arrays.items():
        target = np.ndarray((capacity, *array.shape[1:]), array.dtype, buffer=mm, offset=layout.field_offsets[name])
        target[keep] = array[keep]
    if layout.variable_size:
        region = np.ndarray((layout.variable_size,), np.uint8, buffer=mm, offset=layout.variable_offset)
        pos = 0
        for column in mapped.variables:
            field = header.fields[column.name]
            width = descriptor_nbytes(field)
            descriptors = np.ndarray((capacity, width), np.uint8, buffer=mm, offset=layout.field_offsets[column.name])
            offsets = descriptors[:, :8].view("<u8")[:, 0]
            dims = descriptors[:, 8 : 8 + 4 * len(field.shape)].view("<u4")
            shapes = column.dims[keep]
            dims[keep] = shapes
            starts = column.offsets[keep].astype(np.int64).tolist()
            sizes = (shapes.astype(np.int64).prod(axis=1) * field.dtype.itemsize).tolist()
            source = mapped.region
            for i, start, size in zip(keep.tolist(), starts, sizes, strict=True):
                offsets[i] = pos if size else 0
                region[pos : pos + size] = source[start : start + size]
                pos += place(size)
        np.ndarray((1,), "<u8", buffer=mm, offset=layout.allocator_offset)[0] = pos
    table[keep, 0] = READY  # last, as a writer publishes (nobody maps this file yet)
    return len(keep), len(ready) - len(keep)


def _stream_counts(old: Any) -> tuple[int, np.ndarray[Any, Any]]:
    """A stream cache's ``allocated`` and partition table, copied out of the old mapping."""
    source, before = old._handle.mm, old._layout
    allocated = int(np.ndarray((1,), "<u8", buffer=source, offset=before.stream_offset + _ALLOCATED)[0])
    table = np.ndarray((before.partitions,), _PARTITION, buffer=source, offset=before.partitions_offset).copy()
    return min(allocated, old.capacity), table


def _copy_stream(
    old: Any, counts: tuple[int, np.ndarray[Any, Any]], header: Header, layout: Layout, mm: mmap.mmap
) -> None:
    """The stream region of the new file: the slots keep their numbers, the partitions their counts.

    What the counts do not cover becomes a hole: a slot whose element is not
    below its partition's ``stored`` (counted after the counts were read, or a
    run in progress), and, for a slot whose sample failed its checksum (not
    copied), its element and those after it. A partition that had run out of
    room (*full*), or lost an element so, is no longer *ended*: the next pass
    of the same partitioning stores the rest of it into the room gained.
    """
    allocated, table = counts
    source, before = old._handle.mm, old._layout
    elements = np.ndarray((allocated,), _ELEMENT, buffer=source, offset=before.elements_offset).copy()
    states = np.ndarray((allocated, header.record_size), np.uint8, buffer=mm, offset=layout.table_offset)[:, 0]
    partitions = len(table)
    stored = table["stored"].copy()
    part = elements["partition"].astype(np.int64)
    known = part < partitions
    owner = np.where(known, part, 0)
    lost = known & (elements["element"] < stored[owner]) & (states != READY)
    np.minimum.at(stored, owner[lost], elements["element"][lost])
    changed = stored < table["stored"]
    elements["partition"][known & (elements["element"] >= stored[owner])] = HOLE
    reopened = changed | ((table["flags"] & FULL) != 0)
    table["stored"] = stored
    table["flags"][reopened] = 0
    table["total"][reopened] = 0
    table["pending_slot"] = table["pending_element"] = 0
    np.ndarray((1,), "<u8", buffer=mm, offset=layout.stream_offset + _ALLOCATED)[0] = allocated
    np.ndarray((partitions,), _PARTITION, buffer=mm, offset=layout.partitions_offset)[:] = table
    np.ndarray((allocated,), _ELEMENT, buffer=mm, offset=layout.elements_offset)[:] = elements


def _carry_counters(old: Any, layout: Layout, mm: mmap.mmap) -> None:
    """The old file's usage counts (every record, summed) and flags, as the new file's retired record 0."""
    before = old._layout
    if not layout.counter_records or not before.counter_records:
        return
    source = old._handle.mm
    assert source is not None
    records = np.ndarray((before.counter_records,), _COUNTER, buffer=source, offset=before.counters_offset).copy()
    retired = np.ndarray((1,), _COUNTER, buffer=mm, offset=layout.counters_offset)
    retired["flags"] = records["flags"][0]
    for name in ("hits", "misses", "written"):
        retired[name] = records[name].sum()
