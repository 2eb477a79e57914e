r"""The mmapcache file format, versions 1 to 5 and 8.

This docstring is the specification, written so that a stranger could
implement a reader or a writer from it; `docs/format.md` carries the same
text. The format version is independent of the package version. MUST, MUST
NOT, SHOULD and MAY are used as in RFC 2119.

## Versions

| version | adds | written by |
|--------:|------|------------|
| 1 | header, slot table, fixed-shape field data | mmapcache 0.1 |
| 2 | the process counter region between the slot table and the data | mmapcache 0.2 and later |
| 3 | variable-shape fields: per-slot descriptors, and the variable region after the data | mmapcache 0.2 and later |
| 4 | the dataset index table: the file caches a chosen set of a dataset's indices (one node's shard) | mmapcache 0.3 and later |
| 5 | the boot page and each slot's synced byte: a file on a disk checks what a crash may have torn | mmapcache 0.3 and later |
| 8 | the stream region: the file caches a stream, filled once, partition by partition, in arrival order | mmapcache 0.4 and later |

Versions 6 and 7 are not assigned: a reader rejects them like any version it does not know.

A writer writes the lowest version that holds its schema (8 for the cache
of a stream; else 5 when the file lives on a disk, that is on any file system but a memory one such as tmpfs;
else 4 when the file has a dataset index table, else 3 when a field has a
variable dimension, else 2), so that older readers keep reading what they can; a reader MUST read every version it knows and MUST reject the
others. Everything below holds for every version unless a section names one.

## Overview

A cache file has these regions, each starting on a multiple of 4096 bytes:

```
+--------------------+  0
| header             |  header_size bytes (a multiple of 4096)
+--------------------+  header_size
| slot table         |  capacity * record_size bytes, padded to 4096
+--------------------+
| process counters   |  version 2: 256 * 32 bytes, padded to 4096
+--------------------+
| dataset indices    |  version 4 with an index table: length * 8 bytes, padded to 4096
+--------------------+
| field 0 data       |  capacity * nbytes(field 0) bytes, padded to 4096
| field 1 data       |  ...
| ...                |
+--------------------+
| allocation page    |  version 3 with variable fields: 4096 bytes
| variable region    |  variable_size bytes, padded to 4096
+--------------------+
| boot page          |  versions 5 and 8: 4096 bytes
+--------------------+
| stream page        |  version 8: 4096 bytes
| partition table    |  partitions * 64 bytes, padded to 4096
| element table      |  capacity * 16 bytes, padded to 4096
+--------------------+  file_size
```

All integers in the header and the slot table are little-endian. Sample data
uses the byte order its dtype descriptor names.

## Header

| offset | size | content |
|-------:|-----:|---------|
| 0 | 8 | magic: the bytes `89 4D 4D 43 0D 0A 1A 0A` (`\x89MMC\r\n\x1a\n`) |
| 8 | 4 | format version, uint32: 1 to 5, or 8 (see Versions) |
| 12 | 4 | header_size, uint32: bytes in the header region, a non-zero multiple of 4096, at most 64 MiB |
| 16 | 4 | meta_size, uint32: bytes of the metadata document |
| 20 | 4 | header checksum, uint32: CRC-32 (the zlib/PNG polynomial) of the whole header region `[0, header_size)` with these four bytes taken as zero |
| 24 | 8 | length, uint64: samples in the dataset; valid indices are `0 <= i < length` |
| 32 | 8 | capacity, uint64: cacheable slots, `capacity <= length`; slot `i` caches index `i`; indices `>= capacity` are never cached |
| 40 | 4 | record_size, uint32: bytes per slot record; 8 in versions 1 and 2 |
| 44 | 4 | flags, uint32: 0; a reader MUST reject other values |
| 48 | 16 | uuid: 16 random bytes drawn when the file was created |
| 64 | meta_size | metadata: UTF-8 JSON, an object (below) |
| 64 + meta_size | ... | zero bytes up to header_size |

The metadata object has these members. A reader MUST ignore members it does
not know; a writer MUST NOT add members that change how the data is read
without raising the format version.

- `fields`: a list, in order, of objects
  `{"name": str, "shape": [int | null, ...], "dtype": descr, "torch_dtype": str | null}`,
  plus `"text": "str" | "bytes"` for a text field (below).
  A `null` dimension (version 3) is *variable*: every sample has its own
  size there, and the field is stored as described under "Variable fields".
  `descr` is a numpy array-protocol type descriptor as in the `.npy` format
  (`"<f4"`, `"|u1"`, `"<U10"`, or a list of `[name, descr]` /
  `[name, descr, shape]` for structured dtypes). `torch_dtype` names a torch
  dtype numpy lacks (`"bfloat16"`); its values are stored as raw bits in an
  unsigned integer of the same width, which is what `dtype` then says. Names
  are unique and non-empty. A *text* field (version 3) has shape `[null]`,
  dtype `"|u1"`, no `torch_dtype`, and `text`: each value is one string's
  UTF-8 encoding (`"str"`) or a byte string (`"bytes"`), which a binding
  hands back as that Python type. Its bytes are stored and read like any
  variable `uint8` field's, so a reader that does not know `text` reads
  them as `uint8` values.
- `key`: the creator's identity string for the content (`""` if none).
- `checksum`: the slot checksum algorithm, `"xxh3-64"` (see the slot table).
- `created`: an object describing the creator (`time` as ISO 8601 UTC,
  `host`, `pid`, `uid`, `mmapcache` version); informational only.
- `variable` (version 3, present exactly when a field is variable):
  `{"size": int, "extent": int}`: the bytes of the variable region (a
  positive multiple of 4096) and of the extents writers claim from it (a
  positive multiple of 16, at most `size`).
- `indices` (version 4, present exactly when the file has a dataset index
  table): `{"digest": str}`, the XXH3-64 (seed 0) of the table's
  `length * 8` bytes as 16 lowercase hexadecimal digits. Two files cache the
  same index set exactly when their digests are equal.
- `stream` (version 8, present exactly then): `{"ranks": int, "workers": int}`,
  the partitioning of the stream the file caches (below), both positive,
  their product at most 65536.

## Slot table

One record of `record_size` bytes per slot; slot `i`'s record starts at
`header_size + i * record_size`.

| offset | size | content |
|-------:|-----:|---------|
| 0 | 1 | state: 0 EMPTY, 1 WRITING, 2 READY; other values are invalid |
| 1 | 1 | synced (version 5; zero in others): 1 when the slot's bytes are known to be on stable storage, else 0 (see "Boot page") |
| 2 | 2 | zero |
| 4 | 4 | checksum, uint32: meaningful only when the state is READY; computed as `h = 0`, then for each field in field order `h = XXH3_64(the slot's bytes of that field, seed = h)` (xxHash 0.8, 64-bit seed), and the checksum is `h & 0xFFFFFFFF`. For a variable field two steps take the place of one: first the shape (one little-endian uint32 per dimension), then the value's bytes |

## Process counters (version 2)

256 records of 32 bytes start at `counters_offset = align(header_size +
capacity * record_size)`; record `r` starts at `counters_offset + r * 32`.
They count how the cache is used, for people (hit rates); nothing in reading
or writing samples depends on them.

| offset | size | content |
|-------:|-----:|---------|
| 0 | 4 | pid, uint32: the process that owns (or last owned) the record; 0 if never used |
| 4 | 4 | zero; in record 0, `flags`, uint32 (below) |
| 8 | 8 | hits, uint64: samples served from the cache |
| 16 | 8 | misses, uint64: samples asked for that were not cached |
| 24 | 8 | written, uint64: slots this owner filled |

- Record 0 belongs to nobody: it holds the sums of the records of owners that
  are gone ("retired"). A process adds to it only while holding an exclusive
  `F_OFD_SETLKW` lock on the byte at record 0's offset.
- Record 0's `flags` say things about the whole file, set (never cleared)
  under the same lock. Bit 0, *refuted*: the fields were inferred from a first
  sample and a process found a sample of the same dataset that does not fit
  them; the file is useless for that dataset, and a binding MAY remove it
  (when nobody has it open) and create it anew. Other bits are zero.
- A process owns record `r >= 1` while it holds an exclusive `F_OFD_SETLK`
  lock on the byte at the record's offset; the kernel drops the lock when the
  process dies. Only the owner changes its record. A process claiming a
  record first moves whatever counts it holds into record 0, then zeroes it
  and stores its pid. An owner that closes the cache MAY do the same before
  letting go.
- Counts are approximate by design: an owner killed mid-update may lose its
  last update. Read the totals as record 0 plus every other record.

## Data

Field `k` occupies `capacity * nbytes_k` bytes starting at `offset_k`, where
`nbytes_k = prod(shape_k) * itemsize_k` for a fixed field and the size of a
descriptor for a variable one (below), and offsets are assigned in field
order (`align(x)` rounds `x` up to a multiple of 4096):

```
pos = align(header_size + capacity * record_size)
pos = align(pos + counter_records * 32)   # counter_records: 0 in version 1, 256 in versions 2 to 4
if indices:        indices_offset = pos;  pos = align(pos + length * 8)
for each field k:  offset_k = pos;  pos = align(pos + capacity * nbytes_k)
if variable_size:  allocation_offset = pos;  variable_offset = pos + 4096;  pos = align(variable_offset + variable_size)
if version >= 5:   boot_offset = pos;  pos = pos + 4096
if version == 8:   stream_offset = pos;  partitions_offset = pos + 4096
                   elements_offset = align(partitions_offset + partitions * 64)
                   pos = align(elements_offset + capacity * 16)
file_size = pos
```

Slot `i` of a fixed field `k` is the C-ordered array of `shape_k` at
`offset_k + i * nbytes_k`. The file MUST be exactly `file_size` bytes; a
reader MUST treat a shorter file as truncated and MUST NOT map it.

## Variable fields (version 3)

Slot `i` of a variable field `k` is a descriptor of `nbytes_k = 8 + 4 * ndim_k`
bytes rounded up to a multiple of 8, at `offset_k + i * nbytes_k`:

| offset | size | content |
|-------:|-----:|---------|
| 0 | 8 | uint64: where the value starts, in bytes from `variable_offset` |
| 8 | 4 * ndim | uint32 per dimension: the value's shape (its fixed dimensions equal the field's) |

The value is the C-ordered array of that shape and the field's dtype,
`prod(shape) * itemsize` bytes, which MUST lie within the variable region; it
starts on a multiple of 16. The allocation page's first 8 bytes are
`claimed`, uint64: the bytes of the variable region handed out so far, from
its start. Its next 8 bytes are `refused`, uint64: how many times a writer
found no room for a value (informational, for people: nothing in reading or
writing samples depends on it; older writers leave it 0). A
writer adds to it only while holding the allocation lock (below); clearing
the cache sets it to 0. The rest of the page is zero.

- A writer takes space only by advancing `claimed`, and only while holding an
  exclusive `F_OFD_SETLKW` lock on the allocation page's first byte; it takes
  an *extent* (at most `extent` bytes; mmapcache 0.5 takes at most a sixteenth
  of what is left of the region, and never less than the value it places,
  so that idle writers hold little near the end) and places
  values in it without further locking; a value larger than `extent / 16`
  gets a run of exactly its size (rounded up to 16) instead. When `claimed`
  still equals the end of the writer's current extent (nobody claimed since),
  the new claim continues it: the next value may start in the extent's unused
  end and run on into the new bytes. No two writers ever hold the same bytes.
- A writer writes the value and the descriptor before the checksum and the
  READY state (the slot rules below), so a READY slot never describes bytes
  that were not written. Space a writer claimed and did not fill before it
  died is not reused until the cache is cleared, which sets `claimed` to 0.
- When the region has no room for a value, the sample is not stored (the
  slot goes back to EMPTY).

## Dataset index table (version 4)

A file MAY cache a chosen subset of a larger dataset — one node's shard of
it in a job spanning many nodes. Its `length` is then the number of chosen
indices, and the table at `indices_offset` lists them: `length` uint64
values, strictly increasing. Position `i` (slot `i`, when `i < capacity`)
caches the dataset's sample `table[i]`; a dataset index not in the table is
not cached by this file. The table is written with the header, before the
file is published, and never changes; its digest is in the metadata
(`indices`). A reader that is asked for a given index set SHOULD compare
digests and refuse a file that holds another set.

## Boot page (version 5)

Writeback order is not program order: after a kernel crash or a power loss,
a slot's record can be on the disk with its state READY while its data is
not. The boot page tells a reader when that may have happened. Its first 16
bytes are a boot id: the 16 bytes of the UUID the Linux kernel draws at each
boot (`/proc/sys/kernel/random/boot_id`); the rest of the page is zero.

- A creator writes the boot id of the running kernel before it links the file.
- A writer MUST set a slot's synced byte to 0 when it claims the slot, before
  it writes any of the slot's bytes. It MAY set it to 1 only when the slot is
  READY and all of its bytes (record, data, descriptors, values) reached
  stable storage after it became READY (an `fdatasync` of the file that
  started after the writer saw READY), and the slot still holds the checksum
  it had then.
- A process that opens the file and finds a boot id other than the running
  kernel's MUST, before it serves any slot, compare every READY slot whose
  synced byte is 0 with its checksum, and treat those that differ as not
  cached (a process with write access resets them to EMPTY). Only when that
  is done MAY a process with write access set synced to 1 on the slots that
  matched (their bytes were read back from the disk) and then write the
  running kernel's boot id into the page. Processes doing this SHOULD exclude
  each other (mmapcache holds the creation lock, `<stem>.lock`).
- The allocation page can miss the disk while slots that use the variable
  region reach it. Before writing the boot id, a process with write access
  MUST raise `claimed` (rounded up to 16, at most `variable_size`) to cover
  the end of every value of a READY slot it keeps, so that no value written
  afterwards is placed over one of them.
- A process that resets slots a crash could find synced (clearing the cache)
  MUST make the reset reach stable storage (`fdatasync`) before any of their
  bytes are written again.
- Within one boot every process sees the same page cache, so a file whose
  boot id is the running kernel's is read as in other versions: its open
  costs no scan.

## Stream region (version 8)

A version 8 file caches a *stream*: a sequence of samples of unknown length
that the processes of a job read in *partitions*, each process its own. The
partitioning is `ranks * workers` partitions (a job's processes, each with its
loader workers; `workers` is 1 for a process that reads without workers);
partition `p = rank * workers + worker` is what process `rank`'s worker
`worker` reads, and its *elements* are numbered `0, 1, ...` in the order it
reads them. Slots are handed out in arrival order and are not dataset
indices: `length` equals `capacity`, the slots the file has room for.

The stream page, at `stream_offset`:

| offset | size | content |
|-------:|-----:|---------|
| 0 | 16 | fill boot id: the boot id (see "Boot page") of the kernel that created the file |
| 16 | 8 | allocated, uint64: slots handed out so far, from slot 0; at most `capacity` |
| 24 | 4072 | zero |

The partition table, at `partitions_offset`: one record of 64 bytes per
partition, record `p` at `partitions_offset + p * 64`:

| offset | size | content |
|-------:|-----:|---------|
| 0 | 8 | stored, uint64: the partition's elements `0 .. stored - 1` are in the file, each in exactly one READY slot |
| 8 | 8 | pending slot, uint64: 1 + the last slot of the run a writer is counting (elements `stored ..` pending element); 0 if none |
| 16 | 8 | pending element, uint64: the last element of that run |
| 24 | 8 | total, uint64: the partition's elements, when it has ended; else 0 |
| 32 | 4 | flags, uint32: bit 0 *ended* (the partition was read to its end by a writer that stored every element it could), bit 1 *full* (an element did not fit; none after it is stored); other bits zero |
| 36 | 28 | zero |

The element table, at `elements_offset`: one record of 16 bytes per slot,
slot `i`'s at `elements_offset + i * 16`: the element (uint64) and the
partition (uint32) the slot holds, then 4 zero bytes. It is meaningful only
for a READY slot below `allocated`; a partition that is not one of the
file's (a writer writes `0xFFFFFFFF`) means the slot holds no element. Such
a *hole* whose element is `2**63 + p` was reserved by a writer of partition
`p`; an element below `2**63` names no writer (mmapcache 0.5 and earlier
wrote 0).

- A writer of partition `p` holds an exclusive `F_OFD_SETLK` lock on the
  first byte of `p`'s record for as long as it writes the partition; the
  kernel drops it when the writer dies. A writer that takes the lock first
  *settles* a pending run: if pending slot is non-zero, with `k` = pending
  element, `s` = pending slot - 1 and `j` = `stored`, and `k >= j`, the run
  is the slots `s - (k - j) .. s`. If every one of them is READY and their
  element records are (`j`, `p`) .. (`k`, `p`) in order, it sets `stored`
  to `k + 1`; otherwise it writes partition `0xFFFFFFFF`, then
  element `2**63 + p`, in each of their records that names `p`. Then it sets
  pending slot to 0. Only a writer of `p` writes records of holes reserved by
  `p`, so those it then finds below `allocated` belong to no live writer: it
  MAY set their states EMPTY and fill them again, as the slots of a run,
  before it takes fresh ones (no reader serves a hole).
- A writer stores elements from `j == stored` on, while `ended` and `full`
  are clear, a *run* of consecutive elements `j .. k` at a time (a run may
  be one element): it takes `k - j + 1` slots in one advance of `allocated`
  (holding an exclusive `F_OFD_SETLKW` lock on the byte at `stream_offset +
  16`; when no slot is left it sets `full` instead), or takes back holes
  reserved by `p`, writes partition `0xFFFFFFFF`, then element `2**63 + p`, in
  their element records, and fills them by the slot rules
  below. Slots handed out this way are fresh and the writer's own, so it MAY
  fill them without the slot's lock and MAY publish them together (every
  slot's checksum before its state). It then *counts* the run: pending
  element `k`, then pending slot (1 + the run's last slot), then the run's
  element records (element, then partition), then `stored = k + 1`, then
  pending slot 0. When a slot cannot hold its sample (the variable region is
  full) the run ends before it, and the writer sets `full`. So a writer
  killed at any instant leaves each element of `p` in at most one counted
  READY slot, and a READY slot of `p` is counted exactly when its element is
  below `stored`. (mmapcache 0.4 counted a run one element at a time and
  settled only a run of one: a fill that 0.5 or later began should not be
  continued by 0.4.)
- A writer that read partition `p` from element 0 to its end, holding the
  lock throughout the elements from `stored` on, and found `stored` equal to
  the elements it read or `full` set, sets `total` and then `ended`. On a
  file that is not in memory it first makes the slots durable (`fdatasync`).
- The file is *complete* when every partition has ended. It is *fully
  cached* when, besides, no partition is full: then the READY slots below
  `allocated` hold the stream, each element once, and a reader MAY read them
  in any order and split them across any partitioning. Its canonical order
  is by partition, then element. A reader MUST NOT serve a file that is not
  complete as the whole stream.
- A file that is not complete and whose fill boot id is not the running
  kernel's MUST NOT be continued (the counts may have reached the disk
  without the slots they count); mmapcache then removes and recreates it,
  as it does when a job with another partitioning finds it not complete.

## Rules for writers and readers

- A writer MUST create the file complete (header, zeroed slot table,
  allocated data) under a temporary name and make it visible by linking it to
  its final name. The header never changes afterwards.
- A slot is written once: set its state to WRITING, write the data, write the
  checksum, then set the state to READY. While it writes, the writer holds an
  exclusive open-file-description record lock (`F_OFD_SETLK`) that covers the
  byte at the slot's state offset. mmapcache locks the slot's whole record
  (`record_size` bytes from that byte), so that the kernel merges the locks of
  consecutive slots into one; a lock on the state byte alone excludes it just
  the same. A slot found WRITING whose state byte is not locked was abandoned
  by a dead writer and MAY be written again.
- A reader MUST use a slot's data only after seeing its state READY, and MAY
  compare the data against the checksum.
- A process that has the file open holds a shared `flock` on it; clearing or
  deleting the file requires the exclusive `flock`.

## Growing the format

A new version adds a row to the table of versions (the module's `VERSIONS`,
which the writer and the reader both consult) and a section here. Readers
reject versions they do not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._field import Field
from . import digests as _checksum

__all__ = [
    "ALIGNMENT",
    "CHECKSUM",
    "FORMAT_VERSION",
    "INDEX_ITEMSIZE",
    "MAGIC",
    "MAX_HEADER_SIZE",
    "RECORD_SIZE",
    "VERSIONS",
    "Header",
    "Layout",
    "align",
    "compute_layout",
    "extent_size_for",
    "indices_digest",
    "max_slots",
    "slot_nbytes",
    "version_for",
]

MAGIC = b"\x89MMC\r\n\x1a\n"
FORMAT_VERSION = 8  # the newest; a writer writes the lowest version that holds its schema
ALIGNMENT = 4096
RECORD_SIZE = 8
MAX_HEADER_SIZE = 64 * 2**20
CHECKSUM = _checksum.NAME


@dataclass(frozen=True)
class Version:
    """What one format version holds: the one table both the writer and the reader consult."""

    record_size: int  # bytes per slot record
    counter_records: int  # process counter records after the slot table (0: no such region)
    variable: bool = False  # fields may have variable dimensions, stored in a variable region
    indexed: bool = False  # the file may hold a dataset index table (the indices it caches)
    boot: bool = False  # a boot page ends the file; slot records carry a synced byte
    stream: bool = False  # the file caches a stream: the stream region follows the boot page


VERSIONS = {
    1: Version(record_size=RECORD_SIZE, counter_records=0),
    2: Version(record_size=RECORD_SIZE, counter_records=256),
    3: Version(record_size=RECORD_SIZE, counter_records=256, variable=True),
    4: Version(record_size=RECORD_SIZE, counter_records=256, variable=True, indexed=True),
    5: Version(record_size=RECORD_SIZE, counter_records=256, variable=True, indexed=True, boot=True),
    8: Version(record_size=RECORD_SIZE, counter_records=256, variable=True, indexed=True, boot=True, stream=True),
}
INDEX_ITEMSIZE = 8  # bytes per entry of the dataset index table (uint64, little-endian)
COUNTER_RECORD_SIZE = 32
PARTITION_RECORD_SIZE = 64  # version 8: one partition table record (a cache line: writers of two partitions share none)
ELEMENT_RECORD_SIZE = 16  # version 8: one element table record per slot
MAX_PARTITIONS = 65536  # version 8: ranks * workers
PAYLOAD_ALIGNMENT = 16  # a variable value starts on a multiple of this in the variable region


def version_for(fields: dict[str, Field], *, indexed: bool = False, on_disk: bool = False, stream: bool = False) -> int:
    """The lowest format version that holds ``fields`` (an index table, a boot page): older readers read the file."""
    if stream:
        return 8
    if on_disk:
        return 5
    if indexed:
        return 4
    return 3 if any(field.variable for field in fields.values()) else 2


def descriptor_nbytes(field: Field) -> int:
    """Bytes of a variable field's per-slot descriptor: uint64 offset, uint32 per dimension, padded to 8."""
    return -(-(8 + 4 * len(field.shape)) // 8) * 8


def field_slot_nbytes(field: Field) -> int:
    """Bytes a field takes per slot in its region: the value (fixed) or its descriptor (variable)."""
    return descriptor_nbytes(field) if field.variable else field.nbytes


def align(n: int) -> int:
    """Round ``n`` up to a multiple of :data:`ALIGNMENT` (the one rule for page rounding, with :func:`align_down`)."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def align_down(n: int) -> int:
    """Round ``n`` down to a multiple of :data:`ALIGNMENT`: the whole pages that ``n`` bytes hold."""
    return n // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Header:
    """Everything the header of a cache file says."""

    fields: dict[str, Field]
    length: int
    capacity: int
    key: str
    uuid: bytes
    created: dict[str, Any]
    header_size: int
    record_size: int = RECORD_SIZE
    checksum: str = CHECKSUM
    version: int = FORMAT_VERSION
    variable_size: int = 0  # bytes of the variable region (version 3 with variable fields)
    extent_size: int = 0  # bytes a writer claims from it at a time
    indices_digest: str = ""  # version 4: the dataset index table's digest ("" when the file has none)
    stream: tuple[int, int] | None = None  # version 8: (ranks, workers), the partitioning of the cached stream

    @property
    def partitions(self) -> int:
        """Partitions of the cached stream (0: the file caches no stream)."""
        return self.stream[0] * self.stream[1] if self.stream else 0


@dataclass(frozen=True)
class Layout:
    """Where each region of a cache file lies, in bytes from the start."""

    table_offset: int
    field_offsets: dict[str, int]
    file_size: int
    counters_offset: int = 0
    counter_records: int = 0
    allocator_offset: int = 0  # the variable region's allocation page (0: no variable region)
    variable_offset: int = 0
    variable_size: int = 0
    extent_size: int = 0
    indices_offset: int = 0  # the dataset index table (0: the file has none)
    boot_offset: int = 0  # the boot page (0: the file has none, before version 5)
    stream_offset: int = 0  # version 8: the stream page (0: the file caches no stream)
    partitions_offset: int = 0  # version 8: the partition table
    elements_offset: int = 0  # version 8: the element table
    partitions: int = 0  # version 8: records in the partition table


MAX_FILE_SIZE = 2**63 - 1  # off_t, and the most bytes a numpy array can span


def slot_nbytes(fields: dict[str, Field], version: int = FORMAT_VERSION) -> int:
    """Bytes one slot takes in the fixed regions: every field's value or descriptor, plus its slot record."""
    return sum(field_slot_nbytes(field) for field in fields.values()) + VERSIONS[version].record_size


def max_slots(fields: dict[str, Field], version: int = FORMAT_VERSION) -> int:
    """The most slots a file of these fields can hold (< 2**63 bytes, with room for the header and padding)."""
    overhead = MAX_HEADER_SIZE + (len(fields) + 3) * ALIGNMENT + VERSIONS[version].counter_records * COUNTER_RECORD_SIZE
    return (MAX_FILE_SIZE - overhead) // max(slot_nbytes(fields, version), 1)


def compute_layout(header: Header) -> Layout:
    """The region offsets and the file size a header implies (pure)."""
    table_offset = header.header_size
    pos = align(table_offset + header.capacity * header.record_size)
    counters_offset, counter_records = pos, VERSIONS[header.version].counter_records
    pos = align(pos + counter_records * COUNTER_RECORD_SIZE)
    indices_offset = 0
    if header.indices_digest:
        indices_offset = pos
        pos = align(pos + header.length * INDEX_ITEMSIZE)
    offsets: dict[str, int] = {}
    for name, field in header.fields.items():
        offsets[name] = pos
        pos = align(pos + header.capacity * field_slot_nbytes(field))
    allocator_offset = variable_offset = 0
    if header.variable_size:
        allocator_offset, variable_offset = pos, pos + ALIGNMENT
        pos = align(variable_offset + header.variable_size)
    boot_offset = pos if VERSIONS[header.version].boot else 0
    pos += ALIGNMENT if boot_offset else 0
    stream_offset = partitions_offset = elements_offset = 0
    if header.stream:
        stream_offset, partitions_offset = pos, pos + ALIGNMENT
        elements_offset = align(partitions_offset + header.partitions * PARTITION_RECORD_SIZE)
        pos = align(elements_offset + header.capacity * ELEMENT_RECORD_SIZE)
    return Layout(
        table_offset=table_offset,
        field_offsets=offsets,
        file_size=pos,
        counters_offset=counters_offset,
        counter_records=counter_records,
        allocator_offset=allocator_offset,
        variable_offset=variable_offset,
        variable_size=header.variable_size,
        extent_size=header.extent_size,
        indices_offset=indices_offset,
        boot_offset=boot_offset,
        stream_offset=stream_offset,
        partitions_offset=partitions_offset,
        elements_offset=elements_offset,
        partitions=header.partitions,
    )


def indices_digest(table: np.ndarray[Any, Any]) -> str:
    """The digest the metadata records for a dataset index table (uint64 little-endian entries)."""
    return f"{_checksum.digest64(np.ascontiguousarray(table, dtype='<u8')):016x}"


_MIB = 2**20


def extent_size_for(region_size: int) -> int:
    """The extent size for a region: 1 _MIB, or a 64th of a small region (whole pages)."""
    if region_size >= 64 * _MIB:
        return _MIB
    return max(ALIGNMENT, align(region_size // 64)) if region_size >= ALIGNMENT else region_size
