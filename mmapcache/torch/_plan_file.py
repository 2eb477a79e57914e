"""The packing plan's file beside the cache: written once, then reopened by every run and process.

Format version 1 (all integers little-endian)::

    offset  size  what
    0       8     magic b"\\x93MMCPLAN"
    8       4     uint32 format version (1)
    12      4     uint32 H: bytes of the JSON header that follows
    16      4     uint32 CRC-32 of those H bytes
    20      4     uint32 reserved, 0
    24      H     the JSON header (UTF-8):
                  {"key": {...}, "fragments": m, "sequences": n}
    D             int64 (m, 3) fragments: document, first token in it, length
    D + 24 m      int64 (n + 1) bounds: sequence s is fragments bounds[s]:bounds[s + 1]

where ``D`` is ``24 + H`` rounded up to 4096, and the file is exactly
``D + 24 m + 8 (n + 1)`` bytes. ``key`` says what the plan was made for: the
version of the packing algorithms (``planner``), the cache's ``uuid``, the
token field, the number of documents, the SHA-1 digest of their lengths
(uint32, in document order), and the packing arguments (``seq_len``, ``mode``,
``long_docs``). The file is named
``<cache stem>.plan-<16 hex>`` (``mmapcache._file.names.plan_path_for``), the hex
digits the first of the SHA-256 of the key's canonical JSON.

A reader validates in this order — size >= 24, magic, version, the JSON's
CRC-32, the JSON, the key against the one it expects, the file size against
``m`` and ``n``, ``bounds`` starting at 0 and ending at ``m`` — and uses the
arrays only when all hold; otherwise it makes the plan again. A writer builds
the file under the cache's creation lock (``<stem>.lock``) in a temporary name
(``<stem>.tmp-<pid>-<8 hex>``, which ``mmapcache gc`` collects if the writer
died) and renames it into place: a plan file is whole or absent. Plans are
never written in place, so a process that mapped one keeps reading it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._file import creation_lock, fsync_dir, new_temp_path, plan_path_for
from ._packing_plan import Plan

__all__ = ["PLAN_MAGIC", "PLAN_VERSION", "content_digest", "open_or_make", "plan_key", "read_plan", "write_plan"]

log = logging.getLogger("mmapcache")

PLAN_MAGIC = b"\x93MMCPLAN"
PLAN_VERSION = 1
PLANNER = 1  # the packing algorithms' version: a change in what they make gives new plans
_PREFIX = struct.Struct("<8sIIII")
_ALIGN = 4096


class PlanFileError(ValueError):
    """A plan file that does not validate (made again, never used)."""


def content_digest(lengths: np.ndarray[Any, Any]) -> str:
    """The SHA-1 digest (hex) of documents' lengths, as little-endian uint32 in document order.

    An identity, not a defence: SHA-1 is the fastest of hashlib's digests here (4 MB, a million
    documents, in a few ms), and a descriptor records a length as a uint32.
    """
    data = np.ascontiguousarray(lengths, "<u4")
    return hashlib.sha1(data.data, usedforsecurity=False).hexdigest()


def plan_key(
    *, uuid: str, field: str, lengths: np.ndarray[Any, Any], seq_len: int, mode: str, long_docs: str
) -> dict[str, Any]:
    """What a plan is made for (see the module docstring)."""
    return {
        "planner": PLANNER,
        "uuid": uuid,
        "field": field,
        "documents": len(lengths),
        "lengths": content_digest(lengths),
        "seq_len": seq_len,
        "mode": mode,
        "long_docs": long_docs,
    }


def plan_path(cache_path: Path, key: dict[str, Any]) -> Path:
    """Where the plan ``key`` of the cache at ``cache_path`` lives."""
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return plan_path_for(cache_path, hashlib.sha256(canonical).hexdigest()[:16])


def open_or_make(
    cache_path: Path, key: dict[str, Any], make: Callable[[], Plan], *, timeout: float
) -> tuple[Plan, bool]:
    """The plan ``key`` from its file beside the cache, or made by ``make()`` and stored; ``(plan, made)``.

    Made under the cache's creation lock, so that processes that start
    together make it once: the others wait and then read it.
    """
    path = plan_path(cache_path, key)
    plan = _try_read(path, key)
    if plan is not None:
        return plan, False
    with creation_lock(cache_path, timeout):
        plan = _try_read(path, key)
        if plan is not None:
            return plan, False
        plan = make()
        write_plan(cache_path, path, key, plan)
    return plan, True


def _try_read(path: Path, key: dict[str, Any]) -> Plan | None:
    try:
        return read_plan(path, key)
    except FileNotFoundError:
        return None
    except (PlanFileError, OSError) as error:
        log.warning("making the packing plan %s again: %s", path, error)
        return None


def read_plan(path: Path, key: dict[str, Any]) -> Plan:
    """The plan in the file ``path``, validated against ``key`` (``PlanFileError`` if anything differs)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _PREFIX.size:
            raise PlanFileError(f"{path} has {size} bytes, fewer than a plan's {_PREFIX.size}-byte prefix")
        magic, version, length, crc, _ = _PREFIX.unpack(os.pread(fd, _PREFIX.size, 0))
        if magic != PLAN_MAGIC:
            raise PlanFileError(f"{path} starts with {magic!r}, not a plan's {PLAN_MAGIC!r}")
        if version != PLAN_VERSION:
            raise PlanFileError(f"{path} is plan format {version}; this mmapcache reads {PLAN_VERSION}")
        raw = os.pread(fd, length, _PREFIX.size)
        if len(raw) != length or zlib.crc32(raw) != crc:
            raise PlanFileError(f"{path}: the header's checksum does not match (a damaged file)")
        header = json.loads(raw)
        if header.get("key") != key:
            raise PlanFileError(f"{path} was made for {header.get('key')}, not {key}")
        fragments, sequences = int(header["fragments"]), int(header["sequences"])
        start = _data_offset(length)
        expected = start + 24 * fragments + 8 * (sequences + 1)
        if size != expected:
            raise PlanFileError(f"{path} has {size} bytes; its header says {expected}")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    table = np.ndarray((fragments, 3), "<i8", buffer=mapped, offset=start)
    bounds = np.ndarray((sequences + 1,), "<i8", buffer=mapped, offset=start + 24 * fragments)
    if bounds[0] != 0 or bounds[-1] != fragments:
        raise PlanFileError(f"{path}: its bounds run from {bounds[0]} to {bounds[-1]}, not 0 to {fragments}")
    return Plan(table, bounds, int(key["seq_len"]))


def write_plan(cache_path: Path, path: Path, key: dict[str, Any], plan: Plan) -> None:
    """Store ``plan`` at ``path``: a temporary name, then a rename (the caller holds the creation lock)."""
    raw = json.dumps({"key": key, "fragments": len(plan.fragments), "sequences": len(plan)}).encode()
    prefix = _PREFIX.pack(PLAN_MAGIC, PLAN_VERSION, len(raw), zlib.crc32(raw), 0)
    head = (prefix + raw).ljust(_data_offset(len(raw)), b"\0")
    temp = new_temp_path(cache_path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(head)
            out.write(np.ascontiguousarray(plan.fragments, "<i8").data)
            out.write(np.ascontiguousarray(plan.bounds, "<i8").data)
        os.fsync(fd)
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def _data_offset(json_bytes: int) -> int:
    return -(-(_PREFIX.size + json_bytes) // _ALIGN) * _ALIGN
