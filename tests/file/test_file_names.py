"""Side-file names (lock and temp files) fit NAME_MAX: every name the file system accepts for a cache works."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mmapcache
from mmapcache import Cache, Field
from mmapcache._file.names import (
    LOCK_SUFFIX,
    TEMP_MARK,
    is_temp_name_of,
    lock_path_for,
    name_max,
    new_temp_path,
    side_stem,
    temp_stem,
)

FIELDS = {"x": Field((8,), "uint8")}


def long_name(nbytes: int, *, fill: str = "n") -> str:
    """A cache name of exactly ``nbytes`` bytes, ending in .mmc."""
    return fill * (nbytes - len(".mmc")) + ".mmc"


def byte_len(name: str) -> int:
    return len(os.fsencode(name))


@pytest.mark.parametrize("nbytes", [5, 200, 231, 232, 237, 238, 250, 251, 254, 255])
def test_a_name_of_any_length_the_file_system_accepts_creates_reopens_and_removes(cache_dir: Path, nbytes: int) -> None:
    assert name_max(cache_dir) == 255
    path = cache_dir / long_name(nbytes)
    with Cache.open(path, FIELDS, length=4) as cache:
        cache.put(1, {"x": np.arange(8, dtype=np.uint8)})
    with Cache.open(path, FIELDS, length=4, readonly=True) as cache:
        assert cache.get(1)["x"].tolist() == list(range(8))
    lock = lock_path_for(path)
    assert sorted(os.listdir(cache_dir)) == sorted([path.name, lock.name])
    assert byte_len(lock.name) <= 255
    assert not mmapcache.in_use(path)
    mmapcache.remove(path)
    assert os.listdir(cache_dir) == []


def test_short_names_keep_the_plain_side_names(cache_dir: Path) -> None:
    path = cache_dir / long_name(231)
    assert lock_path_for(path).name == path.name + LOCK_SUFFIX
    assert new_temp_path(path).name.startswith(path.name + TEMP_MARK)


def test_long_side_names_are_short_recognisable_and_distinct(cache_dir: Path) -> None:
    first, second = cache_dir / long_name(255), cache_dir / (long_name(255)[:-5] + "m.mmc")
    stem = side_stem(first)
    prefix, tilde, tail = stem.rpartition("~")  # a prefix of the name, a hash, the extension
    assert long_name(255).startswith(prefix)
    assert tilde
    assert len(tail) == 16 + len(".mmc")
    assert tail.endswith(".mmc")
    assert side_stem(second) != stem  # same 230-byte prefix, different names
    assert lock_path_for(first).name == stem + LOCK_SUFFIX
    # The longest temp name (a 10-digit pid) fits too.
    longest_temp = f"{stem}{TEMP_MARK}{2**32}-{'f' * 8}"
    assert byte_len(longest_temp) <= 255
    temp = new_temp_path(first)
    assert temp.parent == cache_dir
    assert byte_len(temp.name) <= 255
    # From a temp name alone, gc finds the creation lock that guards it: a stem is its own stem.
    found = temp_stem(temp.name, cache_dir)
    assert found == stem
    assert side_stem(cache_dir / found) == found
    assert lock_path_for(cache_dir / found) == lock_path_for(first)
    assert is_temp_name_of(temp.name, first)
    assert not is_temp_name_of(temp.name, second)
    assert temp_stem("a.mmc.tmp-12-0123abcd", cache_dir) == "a.mmc"
    assert temp_stem("a.mmc.tmp-x", cache_dir) is None
    assert temp_stem(first.name, cache_dir) is None


def test_a_long_multibyte_name_is_cut_at_a_character_boundary(cache_dir: Path) -> None:
    path = cache_dir / ("я" * 125 + ".mmc")  # 254 bytes, 129 characters
    assert byte_len(path.name) == 254
    stem = side_stem(path)
    assert stem.startswith("яя")
    os.fsencode(stem).decode("utf-8")  # no half character
    with Cache.open(path, FIELDS, length=4):
        pass
    assert sorted(os.listdir(cache_dir)) == sorted([path.name, stem + LOCK_SUFFIX])


def test_a_name_longer_than_the_file_system_accepts_says_so_and_creates_nothing(cache_dir: Path) -> None:
    path = cache_dir / long_name(256)
    for attempt in (
        lambda: Cache.open(path, FIELDS, length=4),
        lambda: Cache.open(path, readonly=True),
        lambda: mmapcache.in_use(path),
        lambda: mmapcache.remove(path),
    ):
        with pytest.raises(OSError, match="is 256 bytes, longer than the 255 bytes") as info:
            attempt()
        assert info.value.errno == errno.ENAMETOOLONG
        assert "shorter name" in str(info.value)
    assert os.listdir(cache_dir) == []


CREATOR = """
import os, sys
from mmapcache import Cache, Field
with Cache.open(sys.argv[1], {"x": Field((8,), "uint8")}, length=64) as cache:
    cache.put(int(sys.argv[2]), {"x": [int(sys.argv[2])] * 8})
    print(os.stat(sys.argv[1]).st_ino, cache.filled >= 1)
"""


def test_concurrent_creators_of_a_255_byte_name_all_share_one_file(cache_dir: Path) -> None:
    path = cache_dir / long_name(255)
    creators = [
        subprocess.Popen([sys.executable, "-c", CREATOR, str(path), str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(8)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in creators]
    assert [p.returncode for p in creators] == [0] * 8
    assert len({inode for inode, _ in outputs}) == 1  # one file for everybody
    with Cache.open(path, readonly=True) as cache:
        assert cache.filled == 8  # every creator's put landed in the shared file
    assert sorted(os.listdir(cache_dir)) == sorted([path.name, lock_path_for(path).name])


KILLED_CREATOR = """
import os, signal, sys
from pathlib import Path
from mmapcache._file.create import creation_lock
from mmapcache._file.names import new_temp_path
path = Path(sys.argv[1])
with creation_lock(path, timeout=10):
    fd = os.open(new_temp_path(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, 1 << 20)
    print("building", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_leftover_of_a_killed_creator_of_a_255_byte_name_is_cleaned(cache_dir: Path) -> None:
    path = cache_dir / long_name(255)
    result = subprocess.run([sys.executable, "-c", KILLED_CREATOR, str(path)], capture_output=True, text=True)
    assert result.returncode == -9, result.stderr
    [leftover] = [n for n in os.listdir(cache_dir) if TEMP_MARK in n]
    assert is_temp_name_of(leftover, path)
    with Cache.open(path, FIELDS, length=4):  # the next creator removes it under the lock
        pass
    assert sorted(os.listdir(cache_dir)) == sorted([path.name, lock_path_for(path).name])
    # remove() deletes this cache's leftovers too, and nobody else's.
    other = cache_dir / long_name(254)
    for each in (path, other):
        subprocess.run([sys.executable, "-c", KILLED_CREATOR, str(each)], capture_output=True, check=False)
    mmapcache.remove(path)
    [other_leftover] = [n for n in os.listdir(cache_dir) if TEMP_MARK in n]
    assert is_temp_name_of(other_leftover, other)
    assert sorted(os.listdir(cache_dir)) == sorted([other_leftover, lock_path_for(other).name])


def _age_everything(directory: Path, seconds: float) -> None:
    for name in os.listdir(directory):
        st = os.stat(directory / name)
        os.utime(directory / name, (st.st_atime, st.st_mtime - seconds))


def test_gc_collects_a_long_names_leftover_and_cache_through_the_stem(cache_dir: Path) -> None:
    # gc sees only the temp file's name: temp_stem() + lock_path_for() find the creation lock.
    path = cache_dir / long_name(255)
    subprocess.run([sys.executable, "-c", KILLED_CREATOR, str(path)], capture_output=True, check=False)
    [leftover] = [n for n in os.listdir(cache_dir) if TEMP_MARK in n]
    assert temp_stem(leftover, cache_dir) == side_stem(path)
    _age_everything(cache_dir, 30 * 86400)
    report = mmapcache.gc(cache_dir, older_than="1d")
    assert [(item.path.name, item.kind) for item in report.removed if item.kind != "lock"] == [(leftover, "leftover")]
    assert [n for n in os.listdir(cache_dir) if TEMP_MARK in n] == []
    with Cache.open(path, FIELDS, length=4):
        pass
    _age_everything(cache_dir, 30 * 86400)
    report = mmapcache.gc(cache_dir, older_than="1d")
    assert [(item.path.name, item.kind) for item in report.removed] == [(path.name, "cache")]
    assert os.listdir(cache_dir) == []
