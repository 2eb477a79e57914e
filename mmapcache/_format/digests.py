"""Slot checksums: XXH3-64, chained over a sample's fields, kept to 32 bits.

Chosen for speed, because every ``put`` pays it and so does every read with
``verify=True`` (and every read on weakly ordered CPUs, see ``_region/slots.py``).
Measured here on 12 KB / 150 KB buffers: zlib's CRC-32 takes 3.0 / 44 µs,
hardware CRC-32C 0.7 / 6.5 µs, XXH3-64 0.3 / 3.0 µs — about memory bandwidth.

The chain: ``h = 0``; for each field's bytes in field order,
``h = XXH3_64(bytes, seed=h)``; the checksum is ``h & 0xFFFFFFFF``. Any
implementation of XXH3-64 (xxHash 0.8) with a 64-bit seed reproduces it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = ["NAME", "checksum", "checksums", "digest64"]

NAME = "xxh3-64"
_xxh3 = xxhash.xxh3_64_intdigest


def checksum(parts: Iterable[Any]) -> int:
    """The slot checksum of ``parts``: contiguous buffers (bytes, C-contiguous arrays), in field order."""
    h = 0
    for part in parts:
        h = _xxh3(part, h)
    return h & 0xFFFFFFFF


def checksums(columns: Iterable[Sequence[Any]], rows: int) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """The slot checksums of ``rows`` rows at once: ``columns`` holds each part, in field order, for every row."""
    hashes = [0] * rows
    for column in columns:
        hashes = [_xxh3(part, h) for part, h in zip(column, hashes, strict=True)]
    return (np.array(hashes, np.uint64) & 0xFFFFFFFF).astype(np.uint32)


def digest64(data: Any) -> int:
    """The full 64-bit XXH3 (seed 0) of one contiguous buffer."""
    return _xxh3(data, 0)
