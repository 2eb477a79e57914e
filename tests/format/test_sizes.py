"""Parsing and formatting byte counts and durations."""

from __future__ import annotations

import pytest

from mmapcache._format.sizes import format_age, format_bytes, parse_bytes, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (123, 123),
        ("123", 123),
        ("500MB", 500 * 10**6),
        ("8GiB", 8 * 2**30),
        ("8G", 8 * 2**30),
        ("8 gib", 8 * 2**30),
        ("1.5KiB", 1536),
        ("2TB", 2 * 10**12),
        ("64k", 65536),
    ],
)
def test_parse_bytes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "5 parsecs", "-1", "1e9", "GiB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


def test_parse_bytes_rejects_negative_and_non_numbers() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-5)
    with pytest.raises(TypeError):
        parse_bytes(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_bytes(True)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_durations() -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("90") == 90
    assert parse_duration("1.5h") == 5400
    assert parse_duration("2w") == 14 * 86400
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")
    assert format_age(0.2) == "just now"
    assert format_age(90) == "1m ago"
    assert format_age(3 * 86400 + 5) == "3d ago"
    assert format_age(-5) == "in the future"
