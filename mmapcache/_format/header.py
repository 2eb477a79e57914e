"""A cache file's header as bytes: written for a new file, read back and validated — the spec is in ``_format/spec.py``.

The header region (see "Header region" in ``_format/spec.py``'s docstring) is a
fixed 64-byte prefix (:data:`PREFIX`: magic, version, sizes, the header's
CRC-32, length, capacity, record size, flags, uuid) and the JSON metadata
(fields, key, checksum algorithm, creation metadata, and the members of later
versions: ``variable``, ``indices``, ``stream``). :func:`new_header` sizes a
new file's header, :func:`pack_header` writes it, :func:`unpack_prefix` and
:func:`unpack_header` read and validate it in the documented order, each
error naming the offending value. The metadata's encoder and decoder sit side
by side, so that a member is written and read in one place; what each version
may hold is ``_format.VERSIONS``, the one table both consult.
"""

from __future__ import annotations

import json
import struct
import uuid as uuid_module
import zlib
from dataclasses import replace
from typing import Any

import numpy as np

from .._errors import CacheFormatError
from .._field import TEXT_KINDS, Field
from .spec import (
    ALIGNMENT,
    CHECKSUM,
    FORMAT_VERSION,
    MAGIC,
    MAX_FILE_SIZE,
    MAX_HEADER_SIZE,
    MAX_PARTITIONS,
    PAYLOAD_ALIGNMENT,
    VERSIONS,
    Header,
    align,
    version_for,
)

__all__ = ["CRC_SLICE", "PREFIX", "PREFIX_SIZE", "new_header", "pack_header", "unpack_header", "unpack_prefix"]


# magic, version, header_size, meta_size, header crc, length, capacity,
# record_size, flags, uuid
PREFIX = struct.Struct("<8sIIIIQQII16s")


PREFIX_SIZE = PREFIX.size
assert PREFIX_SIZE == 64


CRC_SLICE = slice(20, 24)


def new_header(
    fields: dict[str, Field],
    length: int,
    capacity: int,
    key: str,
    created: dict[str, Any],
    *,
    variable_size: int = 0,
    extent_size: int = 0,
    indices_digest: str = "",
    on_disk: bool = False,
    stream: tuple[int, int] | None = None,
) -> Header:
    """A header for a new file, with a fresh uuid and the smallest header size that fits.

    Raises ``ValueError`` naming what is too big when the header would exceed
    :data:`MAX_HEADER_SIZE` (a reader would refuse the file).
    """
    version = version_for(fields, indexed=bool(indices_digest), on_disk=on_disk, stream=stream is not None)
    draft = Header(
        fields,
        length,
        capacity,
        key,
        uuid_module.uuid4().bytes,
        created,
        header_size=ALIGNMENT,
        version=version,
        variable_size=variable_size,
        extent_size=extent_size,
        indices_digest=indices_digest,
        stream=stream,
    )
    meta = metadata_bytes(draft)
    header_size = align(PREFIX_SIZE + len(meta))
    if header_size > MAX_HEADER_SIZE:
        raise ValueError(_too_big_message(draft, header_size))
    return replace(draft, header_size=header_size)


def _too_big_message(header: Header, header_size: int) -> str:
    def encoded(value: Any) -> int:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))

    key_bytes = encoded(header.key)
    fields_bytes = encoded(_fields_metadata(header.fields))
    culprit = (
        "a shorter key (store a hash of it, e.g. hashlib.sha256(key.encode()).hexdigest())"
        if key_bytes >= fields_bytes
        else "fewer fields or shorter field names and dtypes"
    )
    return (
        f"the cache header would take {header_size} bytes, over the format's limit of "
        f"{MAX_HEADER_SIZE} bytes ({MAX_HEADER_SIZE // 2**20} MiB): the key takes {key_bytes} bytes "
        f"and the description of the {len(header.fields)} fields {fields_bytes} bytes. Use {culprit}"
    )


def metadata_bytes(header: Header) -> bytes:
    meta: dict[str, Any] = {
        "fields": _fields_metadata(header.fields),
        "key": header.key,
        "checksum": header.checksum,
        "created": header.created,
    }
    if header.variable_size:
        meta["variable"] = {"size": header.variable_size, "extent": header.extent_size}
    if header.indices_digest:
        meta["indices"] = {"digest": header.indices_digest}
    if header.stream:
        meta["stream"] = {"ranks": header.stream[0], "workers": header.stream[1]}
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _fields_metadata(fields: dict[str, Field]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "shape": list(field.shape),
            "dtype": _descr(field.dtype),
            "torch_dtype": field.torch_dtype,
            **({"text": field.text} if field.text is not None else {}),
        }
        for name, field in fields.items()
    ]


def _descr(dtype: np.dtype[Any]) -> Any:
    descr = np.lib.format.dtype_to_descr(dtype)
    # JSON has no tuples; the reader turns lists back into what numpy expects.
    return json.loads(json.dumps(descr))


def pack_header(header: Header) -> bytes:
    """The ``header_size`` bytes of the header region."""
    meta = metadata_bytes(header)
    if PREFIX_SIZE + len(meta) > header.header_size:
        raise ValueError("metadata does not fit the header size")
    if header.header_size > MAX_HEADER_SIZE:
        raise ValueError(f"header size {header.header_size} exceeds the format's limit of {MAX_HEADER_SIZE}")
    prefix = PREFIX.pack(
        MAGIC,
        header.version,
        header.header_size,
        len(meta),
        0,
        header.length,
        header.capacity,
        header.record_size,
        0,
        header.uuid,
    )
    region = bytearray(header.header_size)
    region[:PREFIX_SIZE] = prefix
    region[PREFIX_SIZE : PREFIX_SIZE + len(meta)] = meta
    region[CRC_SLICE] = struct.pack("<I", zlib.crc32(region))
    return bytes(region)


def unpack_prefix(data: bytes, *, path: str, file_size: int) -> tuple[int, int]:
    """Check magic, version and header size; return ``(header_size, meta_size)``.

    ``data`` is at least the first :data:`PREFIX_SIZE` bytes of the file.
    """
    if file_size < PREFIX_SIZE or len(data) < PREFIX_SIZE:
        raise CacheFormatError(
            f"{path} is not an mmapcache file: it holds {file_size} bytes, fewer than the "
            f"{PREFIX_SIZE}-byte header prefix",
            path=path,
        )
    magic, version, header_size, meta_size, *_ = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CacheFormatError(
            f"{path} is not an mmapcache file: it starts with {magic!r}, expected {MAGIC!r}",
            path=path,
        )
    if version not in VERSIONS:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        known = ", ".join(map(str, VERSIONS))
        raise CacheFormatError(
            f"{path} uses cache format version {version}, {newer} version than this mmapcache "
            f"reads (versions {known}); upgrade mmapcache or remove the file "
            "(`mmapcache rm PATH`) to rebuild it",
            path=path,
        )
    if header_size % ALIGNMENT or not ALIGNMENT <= header_size <= MAX_HEADER_SIZE:
        raise CacheFormatError(
            f"{path} has a corrupt header: header size {header_size} is not a multiple of "
            f"{ALIGNMENT} between {ALIGNMENT} and {MAX_HEADER_SIZE}",
            path=path,
        )
    if file_size < header_size:
        raise CacheFormatError(
            f"{path} is truncated: it holds {file_size} bytes, fewer than its {header_size}-byte header",
            path=path,
        )
    if meta_size > header_size - PREFIX_SIZE:
        raise CacheFormatError(
            f"{path} has a corrupt header: metadata size {meta_size} exceeds the header",
            path=path,
        )
    return header_size, meta_size


def unpack_header(region: bytes, *, path: str) -> Header:
    """Validate the whole header region (checksum, then contents) and decode it."""
    header_size, meta_size = unpack_prefix(region, path=path, file_size=len(region))
    region = region[:header_size]
    (stored,) = struct.unpack_from("<I", region, CRC_SLICE.start)
    zeroed = bytearray(region)
    zeroed[CRC_SLICE] = b"\0\0\0\0"
    actual = zlib.crc32(zeroed)
    if stored != actual:
        raise CacheFormatError(
            f"{path} has a corrupt header: its checksum is {stored:#010x} but the header "
            f"bytes give {actual:#010x}; the file was damaged or written by something "
            "else. Remove it (`mmapcache rm PATH`) to rebuild the cache",
            path=path,
        )
    _, version, _, _, _, length, capacity, record_size, flags, uuid = PREFIX.unpack_from(region)
    try:
        meta = json.loads(region[PREFIX_SIZE : PREFIX_SIZE + meta_size].decode("utf-8"))
        fields = _decode_fields(meta["fields"])
        key = meta["key"]
        checksum = meta["checksum"]
        created = meta.get("created", {})
        if not isinstance(key, str) or not isinstance(created, dict):
            raise TypeError("key must be a string and created an object")
        variable_size, extent_size = _variable_metadata(meta.get("variable"))
        indices_digest = _indices_metadata(meta.get("indices"))
        stream = _stream_metadata(meta.get("stream"))
    # numpy parses comma-string dtypes ("(2,)u1,") with ast.literal_eval, so a
    # damaged descriptor can also raise SyntaxError; deeply nested JSON raises
    # RecursionError. Found by tests/format/test_header_fuzz.py.
    except (ValueError, KeyError, TypeError, SyntaxError, OverflowError, RecursionError) as error:
        raise CacheFormatError(
            f"{path} has a corrupt header: cannot decode its metadata ({type(error).__name__}: {error})", path=path
        ) from None
    problems = []
    if record_size != VERSIONS[version].record_size:
        problems.append(f"slot record size {record_size} (expected {VERSIONS[version].record_size})")
    if flags != 0:
        problems.append(f"flags {flags:#x} (expected 0)")
    if checksum != CHECKSUM:
        problems.append(f"checksum algorithm {checksum!r} (expected {CHECKSUM!r})")
    if capacity > length:
        problems.append(f"capacity {capacity} larger than length {length}")
    problems += _variable_problems(fields, version, variable_size, extent_size)
    if indices_digest and not VERSIONS[version].indexed:
        problems.append(f"a dataset index table, which format version {version} cannot hold")
    if (stream is not None) != VERSIONS[version].stream:
        problems.append(f"{'a' if stream else 'no'} stream partitioning in format version {version}")
    if problems:
        raise CacheFormatError(f"{path} has an unsupported or corrupt header: {'; '.join(problems)}", path=path)
    return Header(
        fields=fields,
        length=length,
        capacity=capacity,
        key=key,
        uuid=uuid,
        created=created,
        header_size=header_size,
        record_size=record_size,
        checksum=checksum,
        version=version,
        variable_size=variable_size,
        extent_size=extent_size,
        indices_digest=indices_digest,
        stream=stream,
    )


def _indices_metadata(entry: Any) -> str:
    """The digest in the metadata's ``indices`` member (``""`` when it is absent)."""
    if entry is None:
        return ""
    digest = entry["digest"]
    if not isinstance(digest, str) or len(digest) != 16 or digest.strip("0123456789abcdef"):
        raise ValueError(f"indices digest {digest!r} is not 16 lowercase hexadecimal digits")
    return digest


def _stream_metadata(entry: Any) -> tuple[int, int] | None:
    """``(ranks, workers)`` of the metadata's ``stream`` member (``None`` when it is absent)."""
    if entry is None:
        return None
    ranks, workers = entry["ranks"], entry["workers"]
    if not all(type(n) is int and n > 0 for n in (ranks, workers)) or ranks * workers > MAX_PARTITIONS:
        raise ValueError(
            f"stream partitioning {ranks!r} x {workers!r} "
            f"(expected positive integers, at most {MAX_PARTITIONS} partitions)"
        )
    return ranks, workers


def _variable_metadata(entry: Any) -> tuple[int, int]:
    """``(size, extent)`` of the metadata's ``variable`` member (``(0, 0)`` when it is absent)."""
    if entry is None:
        return 0, 0
    size, extent = entry["size"], entry["extent"]
    if not all(type(n) is int for n in (size, extent)):
        raise TypeError("variable size and extent must be integers")
    return size, extent


def _variable_problems(fields: dict[str, Field], version: int, size: int, extent: int) -> list[str]:
    variable = [name for name, field in fields.items() if field.variable]
    if variable and not VERSIONS[version].variable:
        return [f"variable dimensions in fields {variable}, which format version {version} cannot hold"]
    if not variable:
        return ["a variable region without variable fields"] if size or extent else []
    if size <= 0 or size % ALIGNMENT or size > MAX_FILE_SIZE:
        return [f"variable region size {size} (expected a positive multiple of {ALIGNMENT})"]
    if extent <= 0 or extent % PAYLOAD_ALIGNMENT or extent > size:
        return [f"extent size {extent} (expected a positive multiple of {PAYLOAD_ALIGNMENT}, at most {size})"]
    return []


def _decode_fields(entries: Any) -> dict[str, Field]:
    if not isinstance(entries, list) or not entries:
        raise ValueError("fields must be a non-empty list")
    fields: dict[str, Field] = {}
    for entry in entries:
        name = entry["name"]
        if not isinstance(name, str) or not name or name in fields:
            raise ValueError(f"bad or duplicate field name {name!r}")
        torch_dtype, text = entry.get("torch_dtype"), entry.get("text")
        if text is not None and (text not in TEXT_KINDS or torch_dtype is not None):
            raise ValueError(f"field {name!r}: text kind {text!r} (expected one of {TEXT_KINDS}, and no torch_dtype)")
        dtype: Any = text or (torch_dtype if torch_dtype is not None else _dtype_from_descr(entry["dtype"]))
        field = Field(tuple(entry["shape"]), dtype)
        if field.dtype != _dtype_from_descr(entry["dtype"]):
            raise ValueError(f"field {name!r}: dtype {entry['dtype']!r} does not store {torch_dtype}")
        fields[name] = field
    return fields


def _dtype_from_descr(descr: Any) -> np.dtype[Any]:
    if isinstance(descr, list):
        descr = [tuple(_tuplify(part) for part in item) for item in descr]
    return np.lib.format.descr_to_dtype(descr)


def _tuplify(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return tuple(value)
    if isinstance(value, list):
        return [tuple(_tuplify(part) for part in item) for item in value]
    return value
