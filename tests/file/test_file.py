"""Creating, validating and removing cache files: every error triggered for real."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _tmpfs import mounted_tmpfs

import mmapcache
from mmapcache import (
    Cache,
    CacheError,
    CacheFormatError,
    CacheSpaceError,
    Field,
    UnsafeCacheFileError,
)
from mmapcache._format.spec import ALIGNMENT, FORMAT_VERSION, MAGIC

FIELDS = {"x": Field((100,), "float32")}
IS_ROOT = os.geteuid() == 0
NOBODY = 65534


def make_cache(path: Path, length: int = 10) -> None:
    with Cache.open(path, FIELDS, length=length, key="k") as cache:
        for i in range(length // 2):
            cache.put(i, {"x": np.full(100, i, np.float32)})


def test_creation_leaves_one_private_file_and_its_lock(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    assert sorted(os.listdir(cache_dir)) == ["c.mmc", "c.mmc.lock"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    size = path.stat().st_size
    assert size % ALIGNMENT == 0
    # preallocated, not sparse: every block exists before anyone touches it
    assert path.stat().st_blocks * 512 >= size


def test_leftover_temp_files_are_removed_by_the_next_creator(cache_dir: Path) -> None:
    leftover = cache_dir / "c.mmc.tmp-99999-deadbeef"
    leftover.write_bytes(b"\0" * 8192)
    make_cache(cache_dir / "c.mmc")
    assert not leftover.exists()


@pytest.mark.parametrize("cut", [0, 7, 8, 63, 64, 100, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1, -1])
def test_truncated_file_raises_format_error(cache_dir: Path, cut: int) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size + cut if cut < 0 else cut)
    before = path.read_bytes()
    with pytest.raises(CacheFormatError) as info:
        Cache.open(path)
    message = str(info.value)
    assert str(path) in message
    assert ("truncated" in message) or ("not an mmapcache file" in message)
    assert path.read_bytes() == before


def test_truncated_file_never_sigbuses_a_reader_in_another_process(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - ALIGNMENT)
    code = f"import mmapcache; mmapcache.Cache.open({str(path)!r}).get_many(range(10))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1  # a Python exception, not a signal
    assert "CacheFormatError" in result.stderr
    assert "truncated" in result.stderr


def test_file_longer_than_its_layout_is_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    with open(path, "ab") as f:
        f.write(b"\0" * ALIGNMENT)
    with pytest.raises(CacheFormatError, match="longer than its layout"):
        Cache.open(path)


def test_random_bytes_are_not_a_cache(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    path.write_bytes(np.random.default_rng(0).bytes(3 * ALIGNMENT))
    path.chmod(0o600)
    with pytest.raises(CacheFormatError, match="not an mmapcache file"):
        Cache.open(path, FIELDS, length=10)


def test_remove_same_as_deletes_only_that_file(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    old = os.stat(path)
    mmapcache.remove(path)
    make_cache(path)  # another process replaced it meanwhile
    with pytest.raises(FileNotFoundError, match="replaced already"):
        mmapcache.remove(path, force=True, same_as=old)
    with Cache(path) as cache:
        assert cache.filled == 5
    mmapcache.remove(path, same_as=os.stat(path))
    assert not path.exists()


def test_foreign_file_is_never_overwritten_or_removed(cache_dir: Path) -> None:
    path = cache_dir / "notes.mmc"
    path.write_text("important notes\n" * 100)
    path.chmod(0o600)
    with pytest.raises(CacheFormatError):
        Cache.open(path, FIELDS, length=10)
    with pytest.raises(CacheFormatError, match="refusing to delete"):
        mmapcache.remove(path)
    assert path.read_text() == "important notes\n" * 100


def _rewrite_header(path: Path, offset: int, data: bytes, *, fix_crc: bool) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        if fix_crc:
            f.seek(12)
            (header_size,) = struct.unpack("<I", f.read(4))
            f.seek(0)
            region = bytearray(f.read(header_size))
            region[20:24] = b"\0\0\0\0"
            f.seek(20)
            f.write(struct.pack("<I", zlib.crc32(region)))


def test_future_version_names_both_versions(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    _rewrite_header(path, 8, struct.pack("<I", FORMAT_VERSION + 1), fix_crc=True)
    with pytest.raises(CacheFormatError, match=f"format version {FORMAT_VERSION + 1}, a newer version") as info:
        Cache.open(path)
    assert "upgrade mmapcache" in str(info.value)


def test_corrupt_header_checksum(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    with open(path, "r+b") as f:
        f.seek(70)
        byte = f.read(1)
        f.seek(70)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(CacheFormatError, match="corrupt header: its checksum"):
        Cache.open(path)


def test_unknown_flags_with_valid_checksum_are_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    _rewrite_header(path, 44, struct.pack("<I", 1), fix_crc=True)
    with pytest.raises(CacheFormatError, match="flags"):
        Cache.open(path)


def test_format_errors_are_cache_errors_and_value_errors(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    path.write_bytes(MAGIC[:4])
    path.chmod(0o600)
    with pytest.raises(CacheError) as info:
        Cache.open(path)
    assert isinstance(info.value, ValueError)


# -- unsafe files ------------------------------------------------------------------


def test_symlink_to_a_cache_is_refused(cache_dir: Path) -> None:
    real = cache_dir / "real.mmc"
    make_cache(real)
    link = cache_dir / "link.mmc"
    link.symlink_to(real)
    with pytest.raises(UnsafeCacheFileError, match="symlink"):
        Cache.open(link)
    with pytest.raises(UnsafeCacheFileError, match="symlink"):
        Cache.open(link, readonly=True)


def test_dangling_symlink_is_never_followed_to_create_a_file(cache_dir: Path) -> None:
    target = cache_dir / "victim"
    link = cache_dir / "planted.mmc"
    link.symlink_to(target)
    with pytest.raises(UnsafeCacheFileError):
        Cache.open(link, FIELDS, length=10)
    assert not target.exists()


def test_symlinked_lock_file_is_refused(cache_dir: Path) -> None:
    target = cache_dir / "victim"
    (cache_dir / "c.mmc.lock").symlink_to(target)
    with pytest.raises(UnsafeCacheFileError, match="lock"):
        Cache.open(cache_dir / "c.mmc", FIELDS, length=10)
    assert not target.exists()


def test_world_writable_file_is_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    path.chmod(0o666)
    with pytest.raises(UnsafeCacheFileError, match="writable by every user"):
        Cache.open(path)


@pytest.mark.skipif(not IS_ROOT, reason="changing a file's owner needs root")
def test_another_users_file_is_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheFileError, match=f"belongs to uid {NOBODY}"):
        Cache.open(path)
    with pytest.raises(PermissionError):  # UnsafeCacheFileError is a PermissionError too
        Cache.open(path, readonly=True)


def test_fifo_is_refused_without_hanging(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    os.mkfifo(path, 0o600)
    with pytest.raises(UnsafeCacheFileError, match="not a regular file"):
        Cache.open(path, readonly=True)
    with pytest.raises(UnsafeCacheFileError, match="not a regular file"):
        Cache.open(path, FIELDS, length=10)


def test_directory_is_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    path.mkdir()
    with pytest.raises(UnsafeCacheFileError, match="not a regular file"):
        Cache.open(path, FIELDS, length=10)


# -- no space --------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(cache_dir: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, mounted for the test and unmounted afterwards."""
    with mounted_tmpfs(cache_dir / "tiny", "size=1m,mode=0700") as mount_point:
        yield mount_point


def test_full_filesystem_raises_space_error_and_leaves_nothing(tiny_tmpfs: Path) -> None:
    path = tiny_tmpfs / "big.mmc"
    with pytest.raises(CacheSpaceError) as info:
        Cache.open(path, {"x": Field((1024,), "uint8")}, length=4096)  # 4 MiB > 1 MiB
    error = info.value
    assert error.needed > 4 * 2**20
    assert error.free is not None
    assert error.free <= 2**20
    assert isinstance(error, OSError)
    for hint in ("MMAPCACHE_DIR", "max_bytes", "--shm-size"):
        assert hint in str(error)
    assert os.listdir(tiny_tmpfs) == []  # checked before anything was created: not even a lock file


def test_a_cache_too_big_for_the_disk_creates_nothing_not_even_its_directory(tiny_tmpfs: Path) -> None:
    path = tiny_tmpfs / "a" / "b" / "big.mmc"
    with pytest.raises(CacheSpaceError, match=f"{tiny_tmpfs / 'a' / 'b'} has .* free"):
        Cache.open(path, {"x": Field((1024,), "uint8")}, length=4096)
    assert os.listdir(tiny_tmpfs) == []


def test_fallocate_failure_raises_space_error(tiny_tmpfs: Path) -> None:
    # The free-space pre-check can race with other writers; posix_fallocate
    # itself must then fail cleanly with ENOSPC (never a sparse file that
    # SIGBUSes later).
    from mmapcache._file.create import preallocate

    path = tiny_tmpfs / "raced.mmc"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(CacheSpaceError, match=r"needs 2\.0 MiB"):
            preallocate(fd, 2 * 2**20, path)
    finally:
        os.close(fd)
        path.unlink()


def test_cache_that_fits_a_small_tmpfs_fills_completely(tiny_tmpfs: Path) -> None:
    path = tiny_tmpfs / "fits.mmc"
    with Cache.open(path, {"x": Field((1024,), "uint8")}, length=500) as cache:
        for i in range(500):
            assert cache.put(i, {"x": np.full(1024, i % 256, np.uint8)})
        assert cache.filled == 500
        assert cache.get_many(range(500))["x"][:, 0].tolist() == [i % 256 for i in range(500)]
    mmapcache.remove(path)
    assert os.listdir(tiny_tmpfs) == []


def test_missing_parent_directories_are_created_private(cache_dir: Path) -> None:
    path = cache_dir / "a" / "b" / "c.mmc"
    make_cache(path)
    assert stat.S_IMODE((cache_dir / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((cache_dir / "a" / "b").stat().st_mode) == 0o700
