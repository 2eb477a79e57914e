"""Opening a cache file's descriptor safely and validating what it holds, in the documented order.

:func:`open_fd` opens the regular file at a path without following a symlink:
its type (and, for an opener, its owner and mode) is checked with ``lstat``
*before* anything is opened, so a socket, FIFO, device or another user's file
gets the same :class:`UnsafeCacheFileError` whatever the mode. :func:`read_header`
then validates in a fixed order and raises one precise error each time: size
>= header, magic, version, header checksum, expectations (:class:`Expected`:
fields, length, key, dataset indices — every difference listed in one
:class:`SchemaMismatchError`), file size against the layout. Every reader uses
it: ``Cache.open``, a creator reading back what it wrote, ``mmapcache info``.
Errors of the file system that users meet (a name too long, a file where a
directory should be, too many open files) say what to do (:func:`explained`).
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import (
    CacheFormatError,
    SchemaMismatchError,
)
from .._field import Field
from .._format import PREFIX_SIZE, Header, Layout, compute_layout, unpack_header, unpack_prefix
from .names import name_max
from .paths import (
    check_file_stat,
    check_kind,
)

__all__ = ["Expected", "explained", "name_too_long", "open_fd", "read_header"]


@dataclass(frozen=True)
class Expected:
    """What the caller said the file must hold (``None``: not checked)."""

    fields: dict[str, Field] | None = None
    length: int | None = None
    key: str | None = None
    indices_digest: str | None = None  # the dataset index table's digest ("": the file must have none)


def open_fd(path: Path, *, readonly: bool, check_owner: bool = False) -> int:
    """Open the regular file at ``path`` without following a symlink or touching anything else.

    The type (and with ``check_owner``, the owner and mode) is checked with
    ``lstat`` *before* opening, so every mode gets the same answer for a
    socket, a FIFO, a device or another user's file; ``fstat`` after opening
    catches a name swapped in between.
    """
    try:
        before = os.lstat(path)
    except OSError as error:
        if error.errno == errno.EACCES:
            raise PermissionError(
                errno.EACCES,
                f"cannot look up {path}: permission denied on one of its directories "
                f"({path.parent}); use a path you can reach",
                str(path),
            ) from None
        raise explained(error, path) from None
    check_kind(path, before)
    if check_owner:
        check_file_stat(str(path), before)
    # O_NONBLOCK: a FIFO swapped in after the lstat must fail the check below, not hang.
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES):
            # Replaced since the lstat (a symlink, a directory, a socket...), or another user's now.
            with suppress(FileNotFoundError):
                now = os.lstat(path)
                check_kind(path, now)
                if check_owner:
                    check_file_stat(str(path), now)
        if error.errno == errno.EACCES and not readonly:
            raise PermissionError(
                errno.EACCES,
                f"cannot open {path} for writing (permission denied, mode "
                f"{stat.S_IMODE(before.st_mode):o}); pass readonly=True to only read it",
                str(path),
            ) from None
        if error.errno == errno.EROFS:
            raise OSError(
                errno.EROFS,
                f"cannot open {path} for writing: it is on a read-only file system. Pass "
                "readonly=True to read the cache, or keep caches you fill in a writable directory "
                "(MMAPCACHE_DIR or another path)",
                str(path),
            ) from None
        raise explained(error, path) from None
    try:
        after = os.fstat(fd)
        if not os.path.samestat(before, after):
            check_kind(path, after)
            if check_owner:
                check_file_stat(str(path), after)
    except BaseException:
        os.close(fd)
        raise
    return fd


def explained(error: OSError, path: Path) -> OSError:
    """``error`` with a message that says what to do, for the errnos users meet."""
    if error.errno == errno.ENAMETOOLONG:
        return OSError(errno.ENAMETOOLONG, name_too_long(path), str(path))
    if error.errno == errno.ENOTDIR:
        parent = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), path.parent)
        return NotADirectoryError(
            errno.ENOTDIR, f"cannot use {path}: {parent} is not a directory; use another path", str(path)
        )
    if error.errno == errno.EMFILE:
        return OSError(
            errno.EMFILE,
            f"cannot open {path}: this process has too many open files (each open cache holds a "
            "descriptor); close caches and files you no longer use, or raise the limit (`ulimit -n`)",
            str(path),
        )
    return error


def name_too_long(path: Path) -> str:
    name = os.fsencode(path.name)
    limit = name_max(path.parent)
    if len(name) > limit:
        return (
            f"the file name {path.name[:40]!r}... is {len(name)} bytes, longer than the {limit} bytes "
            f"the file system at {path.parent} accepts; use a shorter name (for instance a hash of it)"
        )
    return (
        f"the path {str(path)[:60]!r}... is {len(os.fsencode(str(path)))} bytes, longer than the "
        "system accepts (PATH_MAX); use a shorter path"
    )


def read_header(fd: int, path: str, expected: Expected = Expected()) -> tuple[Header, Layout]:
    """Validate the file behind ``fd`` in the documented order; return its header and layout."""
    size = os.fstat(fd).st_size
    header_size, _ = unpack_prefix(os.pread(fd, PREFIX_SIZE, 0), path=path, file_size=size)
    header = unpack_header(os.pread(fd, header_size, 0), path=path)
    _check_expected(header, expected, path)
    layout = compute_layout(header)
    if size != layout.file_size:
        what = "truncated" if size < layout.file_size else "longer than its layout"
        raise CacheFormatError(
            f"{path} is {what}: it holds {size} bytes but its header describes "
            f"{layout.file_size}; remove it (`mmapcache rm {path}`) to rebuild the cache",
            path=path,
        )
    return header, layout


def _check_expected(header: Header, expected: Expected, path: str) -> None:
    differences: dict[str, tuple[Any, Any]] = {}
    if expected.fields is not None and expected.fields != header.fields:
        differences["fields"] = (expected.fields, header.fields)
    if expected.length is not None and expected.length != header.length:
        differences["length"] = (expected.length, header.length)
    if expected.key is not None and expected.key != header.key:
        differences["key"] = (expected.key, header.key)
    if expected.indices_digest is not None and expected.indices_digest != header.indices_digest:
        differences["dataset_indices"] = (expected.indices_digest, header.indices_digest)
    if not differences:
        return
    lines = []
    for name, (want, found) in differences.items():
        if name == "fields":
            lines.extend(_field_differences(want, found))
        elif name == "dataset_indices":
            lines.append(
                f"dataset indices: {_index_set(want)} was asked for, the file caches {_index_set(found)} (another "
                "node's shard, or a job with another node count: each shard is a cache of its own)"
            )
        else:
            lines.append(f"{name}: expected {_short(want)}, found {_short(found)}")
    raise SchemaMismatchError(
        f"the cache at {path} holds different data than requested:\n  "
        + "\n  ".join(lines)
        + f"\nUse another key or path for the new data, or remove the old cache "
        f"(`mmapcache rm {path}`) if it is stale.",
        path=path,
        differences=differences,
    )


def _index_set(digest: str) -> str:
    return f"the index set with digest {digest}" if digest else "the whole dataset (no index table)"


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, shortened for a message (a key may be megabytes long)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-limit // 4 :]} ({len(text)} characters)"


def _field_differences(want: dict[str, Field], found: dict[str, Field]) -> list[str]:
    lines = []
    for name in want.keys() | found.keys():
        if name not in found:
            lines.append(f"field {name!r}: expected {want[name]!r}, the file has no such field")
        elif name not in want:
            lines.append(f"field {name!r}: not expected, the file has {found[name]!r}")
        elif want[name] != found[name]:
            lines.append(f"field {name!r}: expected {want[name]!r}, found {found[name]!r}")
    return sorted(lines)
