"""Header fuzz: a damaged header or a cut-short file is refused with a CacheError -- never a crash or wrong data.

The opens run in a spawned child process: a SIGBUS or segfault there kills the
child, not pytest, and the test reports the case that was running as a
failure. Each case rewrites the whole (small) file, so the cases are
independent:

* every byte of the header region XOR 0xFF, and every byte with one bit
  flipped (the header checksum must catch each);
* every byte of the prefix and the metadata replaced by a handful of values,
  *with the header checksum recomputed*, so the validation behind the
  checksum (sizes, flags, the JSON metadata) is reached; here a successful
  open is allowed only if the schema is still what the caller asked for and
  every sample reads back unchanged;
* the file truncated at many points (every byte of the first 128, a dense
  sample of the header and table, every region boundary +-1, random points)
  or extended.

After every failed open the file must be byte-for-byte what it was: opening
never "repairs" a file it does not recognise.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmapcache import Cache, CacheError, CacheFormatError, Field

SPAWN = multiprocessing.get_context("spawn")

FIELDS = {"image": Field((4, 8, 8), "uint8"), "label": Field((), "int64"), "weight": Field((2,), "float32")}
LENGTH, CAPACITY, KEY = 40, 32, "fuzz/v1"
FILLED = [0, 1, 5, 17, 31]

# A case: (kind, a, b). kind "xor": data[a] ^= b; "set": data[a] = b, then
# recompute the header checksum; "truncate": keep the first a bytes;
# "extend": append a zero bytes; "crash": the child kills itself with signal a
# (to show that the harness reports crashes); "none": the unmodified file.
Case = tuple[str, int, int]

_CRC = slice(20, 24)


def _sample(index: int) -> dict[str, Any]:
    rng = np.random.default_rng(index)
    return {
        "image": rng.integers(0, 256, (4, 8, 8), dtype=np.uint8),
        "label": index * 1000 + 7,
        "weight": rng.standard_normal(2).astype(np.float32),
    }


# Variable-shape fields (format version 3): the fuzz covers their metadata and descriptors too.
VARIABLE = {"tokens": Field((None,), "int32"), "label": Field((), "int64"), "boxes": Field((None, 4), "float32")}


def _variable_sample(index: int) -> dict[str, Any]:
    rng = np.random.default_rng(index)
    return {
        "tokens": rng.integers(0, 50_000, index % 9 + 1, dtype=np.int32),
        "label": index * 1000 + 7,
        "boxes": rng.standard_normal((index % 3, 4)).astype(np.float32),
    }


SCHEMAS: dict[str, tuple[dict[str, Field], Any, dict[str, Any]]] = {
    "fixed": (FIELDS, _sample, {"capacity": CAPACITY}),
    "variable": (VARIABLE, _variable_sample, {"capacity": CAPACITY, "max_bytes": "256KiB"}),
}


def _make_cache(path: Path, variant: str = "fixed") -> bytes:
    fields, sample, options = SCHEMAS[variant]
    with Cache.open(path, fields, LENGTH, key=KEY, **options) as cache:
        for i in FILLED:
            assert cache.put(i, sample(i))
    return path.read_bytes()


def _fix_checksum(data: bytearray) -> None:
    """Recompute the header checksum the way a reader checks it, if the header size allows."""
    (header_size,) = struct.unpack_from("<I", data, 12)
    if header_size % 4096 or not 4096 <= header_size <= len(data):
        return
    region = bytearray(data[:header_size])
    region[_CRC] = bytes(4)
    data[_CRC] = struct.pack("<I", zlib.crc32(region))


def _mutated(original: bytes, case: Case) -> bytes:
    kind, a, b = case
    data = bytearray(original)
    if kind == "xor":
        data[a] ^= b
    elif kind == "set":
        data[a] = b
        _fix_checksum(data)
    elif kind == "truncate":
        del data[a:]
    elif kind == "extend":
        data += bytes(a)
    return bytes(data)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def _try_open(path: Path, variant: str) -> tuple[str, str]:
    """Open the damaged file as a user would; ("refused", error) or ("opened", what was checked)."""
    fields, make_sample, _ = SCHEMAS[variant]
    try:
        cache = Cache.open(path, fields, LENGTH, key=KEY)
    except CacheError as error:
        return "refused", f"{type(error).__name__}: {error}"
    with cache:
        # The header still says exactly what the caller asked for, so the
        # samples must read back unchanged (a shorter capacity may hide some).
        assert cache.fields == fields
        assert cache.length == LENGTH
        assert cache.key == KEY
        for i in range(cache.capacity):
            sample = cache.get(i)
            if i in FILLED:
                assert sample is not None, f"slot {i} lost"
                for name, value in make_sample(i).items():
                    assert np.array_equal(sample[name], value), f"slot {i} field {name} reads wrong data"
            else:
                assert sample is None, f"slot {i} reads as filled"
        return "opened", f"capacity {cache.capacity}"


def _run_cases(
    path: str,
    original: bytes,
    cases: list[Case],
    progress: Any,
    conn: multiprocessing.connection.Connection,
    variant: str,
) -> None:
    """In the child: apply and open every case; send back ``{case: outcome}`` and the failures."""
    target = Path(path)
    outcomes: dict[str, int] = {}
    failures: list[tuple[Case, str]] = []
    for number, case in enumerate(cases):
        progress.value = number
        if case[0] == "crash":
            os.kill(os.getpid(), case[1])
        damaged = _mutated(original, case)
        _write(target, damaged)
        try:
            outcome, detail = _try_open(target, variant)
        except Exception as error:  # anything but a CacheError (or wrong data) is a failure
            failures.append((case, f"{type(error).__name__}: {error}"))
            continue
        outcomes[f"{case[0]}:{outcome}"] = outcomes.get(f"{case[0]}:{outcome}", 0) + 1
        if outcome == "refused" and target.read_bytes() != damaged:
            failures.append((case, "a failed open modified the file"))
        if outcome == "opened" and case[0] in ("xor", "truncate", "extend"):
            failures.append((case, f"opened a damaged file ({detail})"))
        if outcome == "refused" and case[0] in ("xor", "truncate", "extend") and "CacheFormatError" not in detail:
            failures.append((case, f"refused with the wrong error: {detail}"))
    progress.value = len(cases)
    conn.send((outcomes, failures))


def _fuzz(
    path: Path, original: bytes, cases: list[Case], variant: str = "fixed"
) -> tuple[dict[str, int], list[tuple[Case, str]]]:
    """Run ``cases`` in a spawned child; a crash of the child becomes a failure naming its case."""
    progress = SPAWN.Value("i", -1, lock=False)
    ours, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_run_cases, args=(str(path), original, cases, progress, theirs, variant))
    child.start()
    theirs.close()
    try:
        # Poll, so that a child dying before it even got its pipe end cannot hang us.
        while not ours.poll(0.2):
            if not child.is_alive():
                raise EOFError
        outcomes, failures = ours.recv()
    except EOFError:
        child.join(10)
        code = child.exitcode or 0
        case = cases[progress.value] if 0 <= progress.value < len(cases) else None
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return {}, [(case or ("?", -1, -1), f"the opening process died: {why}")]
    child.join(10)
    assert child.exitcode == 0
    return outcomes, failures


def _header_size(original: bytes) -> int:
    (size,) = struct.unpack_from("<I", original, 12)
    return int(size)


def _describe(failures: list[tuple[Case, str]]) -> str:
    return "\n".join(f"{case}: {why}" for case, why in failures[:20])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(SCHEMAS))
def test_every_header_byte_flipped_is_refused(variant: str, cache_dir: Path) -> None:
    path = cache_dir / "flip.mmc"
    original = _make_cache(path, variant)
    header_size = _header_size(original)
    cases: list[Case] = [("none", 0, 0)]
    cases += [("xor", offset, 0xFF) for offset in range(header_size)]
    cases += [("xor", offset, 1 << (offset % 8)) for offset in range(header_size)]
    outcomes, failures = _fuzz(path, original, cases, variant)
    assert not failures, _describe(failures)
    assert outcomes == {"none:opened": 1, "xor:refused": 2 * header_size}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(SCHEMAS))
def test_header_bytes_changed_behind_a_valid_checksum(variant: str, cache_dir: Path) -> None:
    """The checksum recomputed after each change: what the checksum cannot catch, validation must."""
    path = cache_dir / "evil.mmc"
    original = _make_cache(path, variant)
    (meta_size,) = struct.unpack_from("<I", original, 16)
    values = sorted({0x00, 0x01, 0x7F, 0x80, 0xFF, *b'09-+.e"[]{},: \\nA'})
    cases: list[Case] = [
        ("set", offset, value)
        for offset in range(64 + meta_size)
        if not 20 <= offset < 24  # the checksum itself: recomputing it would undo the change
        for value in values
        if value != original[offset]
    ]
    outcomes, failures = _fuzz(path, original, cases, variant)
    assert not failures, _describe(failures)
    assert outcomes.get("set:refused", 0) > len(cases) // 2, outcomes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(SCHEMAS))
def test_truncated_or_extended_file_is_refused(variant: str, cache_dir: Path) -> None:
    path = cache_dir / "cut.mmc"
    original = _make_cache(path, variant)
    size, header_size = len(original), _header_size(original)
    with Cache.open(path) as cache:
        boundaries = [header_size, cache._layout.table_offset, *cache._layout.field_offsets.values(), size]
    points = set(range(129)) | set(range(129, header_size + 4096, 37))
    points |= {b + d for b in boundaries for d in (-1, 0, 1)}
    points |= set(random.Random(0).sample(range(size), 200))
    cases: list[Case] = [("truncate", p, 0) for p in sorted(points) if 0 <= p < size]
    cases += [("extend", n, 0) for n in (1, 7, 4096, 65536)]
    outcomes, failures = _fuzz(path, original, cases, variant)
    assert not failures, _describe(failures)
    assert outcomes == {"truncate:refused": len(cases) - 4, "extend:refused": 4}


@pytest.mark.timeout(60)
def test_a_crash_while_opening_is_reported(cache_dir: Path) -> None:
    """The harness itself: a child killed by SIGBUS becomes a failure naming the case."""
    path = cache_dir / "crash.mmc"
    original = _make_cache(path)
    _, failures = _fuzz(path, original, [("none", 0, 0), ("crash", int(signal.SIGBUS), 0)])
    assert failures == [(("crash", int(signal.SIGBUS), 0), "the opening process died: signal SIGBUS")]


@pytest.mark.timeout(60)
def test_comma_string_dtype_behind_a_valid_checksum_is_a_format_error(cache_dir: Path) -> None:
    """Regression: numpy parses "|u1" changed to ",u1" with ast.literal_eval, which raised SyntaxError."""
    path = cache_dir / "comma.mmc"
    original = _make_cache(path)
    offset = original.index(b'"dtype":"|u1"') + len(b'"dtype":"')
    _write(path, _mutated(original, ("set", offset, ord(","))))
    with pytest.raises(CacheFormatError, match="corrupt header: cannot decode its metadata"):
        Cache.open(path, FIELDS, LENGTH, key=KEY)
