"""Byte counts and durations: parsing what people type, formatting what they read."""

from __future__ import annotations

import decimal
import re

__all__ = ["format_age", "format_bytes", "parse_bytes", "parse_duration"]

# Decimal units follow SI (1 MB = 10**6 bytes), binary units IEC (1 MiB = 2**20).
# A bare letter (``8G``) means the binary unit, as in ``docker --shm-size 8g``.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "a byte size") -> int:
    """Return a byte count from an int or a string such as ``"8GiB"``, ``"500MB"``, ``"1.5G"``.

    Raises ``ValueError`` (or ``TypeError``) naming ``name`` and the value when
    it is not a non-negative size. The arithmetic is exact: ``"1.1G"`` is
    ``int(1.1 * 2**30)`` without float rounding, and no string overflows.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int or a string like '8GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
        return value
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {name} {value!r} as a byte size: use an int or a number with a unit "
            "such as '500MB', '8GiB' or '8G' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    with decimal.localcontext() as context:
        context.prec = len(match.group(1)) + 20  # exact for any digits the string has
        return int(decimal.Decimal(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``format_bytes(3 * 2**30) == '3.0 GiB'``: binary units, one decimal above bytes."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*$")


def parse_duration(value: str) -> float:
    """Seconds from ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (a bare number is seconds)."""
    match = _DURATION.match(value.lower())
    if match is None:
        raise ValueError(
            f"cannot read {value!r} as a duration: use a number with one of the units s, m, h, d, w (e.g. '7d', '12h')"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]


def format_age(seconds: float) -> str:
    """``format_age(90) == '1m ago'``: the largest whole unit, for people."""
    if seconds < 0:
        return "in the future"
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return "just now" if seconds < 1 else f"{int(seconds)}s ago"
