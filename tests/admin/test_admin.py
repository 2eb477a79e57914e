"""The library side of operating caches: list_caches, info, gc, disk_usage.

Real files in a per-test directory, real processes holding caches open; no mocks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _caches import DAY, FIELDS, Holder, age, make_cache
from _tmpfs import mounted_tmpfs

import mmapcache
from mmapcache import Cache, CacheFormatError, CacheInUseError, CacheSpaceError, Field, UnsafeCacheFileError
from mmapcache._admin.df import SMALL_TMPFS, DiskUsage, disk_warnings
from mmapcache._admin.garbage import orphan_lock, remove_orphan_lock
from mmapcache._file.paths import memory_limit
from mmapcache._file.validate import read_header
from mmapcache._format.spec import version_for
from mmapcache._region.slots import WRITING


def digest(path: Path) -> tuple[str, float]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.kill()


# -- list_caches ----------------------------------------------------------------------------


def test_list_empty_directory(cache_dir: Path) -> None:
    assert mmapcache.list_caches(cache_dir) == []


def test_list_defaults_to_default_dir(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir))
    make_cache(cache_dir / "a.mmc")
    assert [item.path for item in mmapcache.list_caches()] == [cache_dir / "a.mmc"]


def test_list_reports_each_cache(cache_dir: Path) -> None:
    make_cache(cache_dir / "b.mmc", filled=4, key="two")
    make_cache(cache_dir / "a.mmc", length=20, capacity=5, key="one")
    items = mmapcache.list_caches(cache_dir)
    assert [item.path.name for item in items] == ["a.mmc", "b.mmc"]
    a, b = items
    assert (a.status, a.length, a.capacity, a.filled, a.key) == ("ok", 20, 5, 0, "one")
    assert (b.status, b.length, b.capacity, b.filled, b.fill) == ("ok", 10, 10, 4, 0.4)
    assert b.nbytes == os.stat(b.path).st_size
    assert b.in_use is False
    assert b.pids == ()
    assert b.error is None


def test_list_includes_corrupt_files_and_skips_side_files(cache_dir: Path) -> None:
    make_cache(cache_dir / "good.mmc")
    (cache_dir / "garbage.mmc").write_bytes(b"not a cache at all, just some bytes")
    (cache_dir / "empty.mmc").write_bytes(b"")
    (cache_dir / "good.mmc.tmp-1-abcd").write_bytes(b"x")
    (cache_dir / "notes.txt").write_text("hello")
    (cache_dir / "sub.mmc").mkdir()
    items = {item.path.name: item for item in mmapcache.list_caches(cache_dir)}
    assert sorted(items) == ["empty.mmc", "garbage.mmc", "good.mmc"]
    assert items["good.mmc"].ok
    for name in ("garbage.mmc", "empty.mmc"):
        assert items[name].status == "corrupt"
        assert "not an mmapcache file" in (items[name].error or "")
        assert items[name].fields == ()
        assert items[name].filled is None


def test_list_reports_damaged_header(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "c.mmc")
    with open(path, "r+b") as f:
        f.seek(80)
        f.write(b"\xff")
    (item,) = mmapcache.list_caches(cache_dir)
    assert item.status == "corrupt"
    assert "checksum" in (item.error or "")


def test_list_reports_symlink_as_unsafe(cache_dir: Path) -> None:
    target = make_cache(cache_dir / "real.mmc")
    (cache_dir / "link.mmc").symlink_to(target)
    items = {item.path.name: item for item in mmapcache.list_caches(cache_dir)}
    assert items["link.mmc"].status == "unsafe"
    assert items["real.mmc"].ok


def test_list_recursive(cache_dir: Path) -> None:
    (cache_dir / "project").mkdir()
    make_cache(cache_dir / "top.mmc")
    make_cache(cache_dir / "project" / "inner.mmc")
    assert [i.path.name for i in mmapcache.list_caches(cache_dir)] == ["top.mmc"]
    names = [i.path.relative_to(cache_dir).as_posix() for i in mmapcache.list_caches(cache_dir, recursive=True)]
    assert names == ["project/inner.mmc", "top.mmc"]


def test_list_missing_directory_raises(cache_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mmapcache.list_caches(cache_dir / "nope")
    (cache_dir / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        mmapcache.list_caches(cache_dir / "file")


def test_looking_changes_nothing(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", filled=3)
    age(path, 3 * DAY)
    before = digest(path)
    mmapcache.list_caches(cache_dir)
    mmapcache.info(path)
    mmapcache.disk_usage(cache_dir)
    mmapcache.gc(cache_dir, older_than="7d")
    mmapcache.gc(cache_dir, older_than=0, dry_run=True)
    assert digest(path) == before


# -- info -----------------------------------------------------------------------------------


def test_info_full_header(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", length=12, capacity=8, filled=5, key="imagenet-224")
    item = mmapcache.info(path)
    assert item.version == version_for(FIELDS) == 2  # no variable fields: the lowest version that holds them
    assert [(f.name, f.shape, f.dtype, f.nbytes) for f in item.fields] == [
        ("image", (3, 4, 4), "uint8", 48),
        ("label", (), "int64", 8),
    ]
    assert (item.length, item.capacity, item.filled, item.writing, item.key) == (12, 8, 5, 0, "imagenet-224")
    assert item.created["pid"] == os.getpid()
    assert item.created["mmapcache"] == mmapcache.__version__
    assert item.filesystem == "tmpfs"
    assert item.free is not None
    assert item.free > 0
    assert item.last_used == pytest.approx(os.stat(path).st_mtime)
    fd = os.open(path, os.O_RDONLY)
    try:
        _, layout = read_header(fd, str(path))
    finally:
        os.close(fd)
    assert item.nbytes == layout.file_size


def test_info_counts_writing_slots(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", filled=2)
    fd = os.open(path, os.O_RDWR)
    try:
        header, layout = read_header(fd, str(path))
        os.pwrite(fd, bytes([WRITING]), layout.table_offset + 7 * header.record_size)
    finally:
        os.close(fd)
    item = mmapcache.info(path)
    assert (item.filled, item.writing) == (2, 1)


def test_info_of_a_large_table(cache_dir: Path) -> None:
    # More slots than one pread chunk: the count spans chunks.
    length = 2**20 + 5
    with Cache.open(cache_dir / "big.mmc", {"b": Field((), "uint8")}, length) as cache:
        for i in (0, 2**20 - 1, 2**20, length - 1):
            cache.put(i, {"b": 1})
    assert mmapcache.info(cache_dir / "big.mmc").filled == 4


def test_info_errors(cache_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mmapcache.info(cache_dir / "missing.mmc")
    (cache_dir / "bad.mmc").write_bytes(b"\x00" * 100)
    with pytest.raises(CacheFormatError, match="not an mmapcache file"):
        mmapcache.info(cache_dir / "bad.mmc")
    (cache_dir / "link.mmc").symlink_to(make_cache(cache_dir / "real.mmc"))
    with pytest.raises(UnsafeCacheFileError, match="symlink"):
        mmapcache.info(cache_dir / "link.mmc")


def test_info_to_dict_is_json(cache_dir: Path) -> None:
    item = mmapcache.info(make_cache(cache_dir / "a.mmc", filled=1))
    data = json.loads(json.dumps(item.to_dict()))
    assert data["path"] == str(cache_dir / "a.mmc")
    assert data["fields"][0] == {"name": "image", "shape": [3, 4, 4], "dtype": "uint8", "nbytes": 48}
    assert data["filled"] == 1
    assert data["last_used"].endswith("Z")


# -- in use ---------------------------------------------------------------------------------


def test_in_use_names_the_holders(cache_dir: Path, holders: list[Holder]) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holders.append(Holder(path))
    holders.append(Holder(path, readonly=False))
    item = mmapcache.info(path)
    assert item.in_use
    assert set(item.pids) == {h.pid for h in holders}
    # Looking did not take the holders' locks away, nor keep others out.
    with Cache.open(path) as cache:
        assert cache.length == 10
    assert mmapcache.info(path).in_use


def test_killed_holder_is_not_a_user(cache_dir: Path, holders: list[Holder]) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = Holder(path)
    holders.append(holder)
    assert mmapcache.info(path).in_use
    holder.kill()
    item = mmapcache.info(path)
    assert not item.in_use
    assert item.pids == ()


# -- gc -------------------------------------------------------------------------------------


def test_gc_removes_only_old_unused_caches(cache_dir: Path) -> None:
    old = make_cache(cache_dir / "old.mmc")
    new = make_cache(cache_dir / "new.mmc")
    age(old, 8 * DAY)
    age(new, 6 * DAY)
    size = os.stat(old).st_size
    report = mmapcache.gc(cache_dir, older_than="7d")
    assert [(r.path, r.kind, r.nbytes) for r in report.removed] == [(old, "cache", size)]
    assert report.freed == size
    assert report.kept == ()
    assert not old.exists()
    assert not (cache_dir / "old.mmc.lock").exists()
    assert new.exists()


def test_gc_dry_run_removes_nothing(cache_dir: Path) -> None:
    old = make_cache(cache_dir / "old.mmc")
    age(old, 30 * DAY)
    report = mmapcache.gc(cache_dir, older_than=DAY, dry_run=True)
    assert report.dry_run
    assert [r.path for r in report.removed] == [old]
    assert old.exists()


def test_gc_never_touches_a_cache_in_use(cache_dir: Path, holders: list[Holder]) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holders.append(Holder(path))
    age(path, 30 * DAY)  # a long job that opened it a month ago
    for dry_run in (True, False):
        report = mmapcache.gc(cache_dir, older_than="7d", dry_run=dry_run)
        assert report.removed == ()
        (kept,) = report.kept
        assert kept.in_use
        assert kept.pids == (holders[0].pid,)
    assert path.exists()
    holders[0].kill()
    assert [r.path for r in mmapcache.gc(cache_dir, older_than="7d").removed] == [path]


def test_gc_counts_readonly_opens_as_use(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    age(path, 30 * DAY)
    with Cache.open(path, readonly=True):
        pass
    assert mmapcache.gc(cache_dir, older_than="7d").removed == ()
    assert path.exists()


def test_gc_damaged_files(cache_dir: Path) -> None:
    damaged = make_cache(cache_dir / "damaged.mmc")
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    foreign = cache_dir / "foreign.mmc"
    foreign.write_bytes(b"someone else's data")
    for path in (damaged, foreign):
        age(path, 30 * DAY)
    report = mmapcache.gc(cache_dir, older_than="7d")
    assert [(r.path, r.kind) for r in report.removed] == [(damaged, "corrupt")]
    (kept,) = report.kept
    assert kept.path == foreign
    assert "not an mmapcache file" in kept.reason
    assert foreign.read_bytes() == b"someone else's data"


def test_gc_removes_leftovers_of_dead_creators_whatever_their_age(cache_dir: Path) -> None:
    # Nobody holds their creation locks, so their creators died: a fresh leftover is as dead as an old one.
    leftover = cache_dir / "a.mmc.tmp-999-0123abcd"
    with open(leftover, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 16)
    fresh = cache_dir / "b.mmc.tmp-998-0123abcd"
    fresh.write_bytes(b"x")
    age(leftover, 2 * DAY)
    report = mmapcache.gc(cache_dir, older_than="1d", dry_run=True)
    assert sorted((r.path, r.kind) for r in report.removed) == [(leftover, "leftover"), (fresh, "leftover")]
    assert leftover.exists()
    assert fresh.exists()
    assert sorted(os.listdir(cache_dir)) == sorted([leftover.name, fresh.name])  # a dry run makes no lock file
    report = mmapcache.gc(cache_dir, older_than="1d")
    # The lock that collecting the leftover took goes too: the creation it guarded is over.
    locks = [cache_dir / "a.mmc.lock", cache_dir / "b.mmc.lock"]
    assert sorted((r.path, r.kind) for r in report.removed) == sorted(
        [(leftover, "leftover"), (fresh, "leftover"), *((lock, "lock") for lock in locks)]
    )
    assert next(r.nbytes for r in report.removed if r.path == leftover) == 1 << 16
    assert os.listdir(cache_dir) == []


LOCKER = """
import sys, time
from pathlib import Path
from mmapcache._file.create import creation_lock
with creation_lock(Path(sys.argv[1]), 10):
    print("ready", flush=True)
    time.sleep(120)
"""


CREATOR = """
import os, sys
from pathlib import Path
from mmapcache import Cache, Field
path = Path(sys.argv[1])
with Cache.open(path, {"x": Field((4,), "uint8")}, 4):
    pass
print(os.stat(path.with_name(path.name + ".lock")).st_ino, flush=True)
"""


def test_gc_keeps_the_temp_file_of_a_live_creator(cache_dir: Path) -> None:
    temp = cache_dir / "a.mmc.tmp-1-0123abcd"
    temp.write_bytes(b"being built")
    age(temp, 2 * DAY)
    creator = subprocess.Popen([sys.executable, "-c", LOCKER, str(cache_dir / "a.mmc")], stdout=subprocess.PIPE)
    try:
        assert creator.stdout is not None
        assert creator.stdout.readline().strip() == b"ready"
        report = mmapcache.gc(cache_dir, older_than="1d")
    finally:
        creator.kill()
        creator.wait()
        if creator.stdout is not None:
            creator.stdout.close()
    assert report.removed == ()
    assert [k.path for k in report.kept] == [temp]
    assert temp.exists()


def test_gc_age_forms(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    age(path, 100)
    assert mmapcache.gc(cache_dir, older_than="2m").removed == ()
    assert mmapcache.gc(cache_dir, older_than=200.0).removed == ()
    assert mmapcache.gc(cache_dir, older_than=50).removed != ()
    with pytest.raises(ValueError, match="duration"):
        mmapcache.gc(cache_dir, older_than="soon")
    with pytest.raises(ValueError, match="negative"):
        mmapcache.gc(cache_dir, older_than=-1)


def test_gc_report_to_dict_is_json(cache_dir: Path) -> None:
    age(make_cache(cache_dir / "a.mmc"), 9 * DAY)
    data = json.loads(json.dumps(mmapcache.gc(cache_dir, dry_run=True).to_dict()))
    assert data["dry_run"] is True
    assert data["older_than_seconds"] == 7 * DAY
    assert data["removed"][0]["kind"] == "cache"
    assert data["freed"] == data["removed"][0]["nbytes"]


# -- orphan lock files ---------------------------------------------------------------------


def test_gc_collects_the_lock_file_of_a_creation_that_failed(cache_dir: Path) -> None:
    # Three inodes: the root directory, the lock file, and no room for the temp file.
    with mounted_tmpfs(cache_dir / "tiny", "size=4m,nr_inodes=3,mode=0700") as tiny:
        path = tiny / "a.mmc"
        with pytest.raises(CacheSpaceError):
            Cache.open(path, FIELDS, 10)
        lock = tiny / "a.mmc.lock"
        assert os.listdir(tiny) == [lock.name]  # what nothing used to clean: ls hides it, gc ignored it
        assert mmapcache.list_caches(tiny) == []
        assert mmapcache.gc(tiny, older_than="1d").removed == ()  # too young
        age(lock, 2 * DAY)
        report = mmapcache.gc(tiny, older_than="1d", dry_run=True)
        assert [(r.path, r.kind) for r in report.removed] == [(lock, "lock")]
        assert lock.exists()
        report = mmapcache.gc(tiny, older_than="1d")
        assert [(r.path, r.kind) for r in report.removed] == [(lock, "lock")]
        assert report.kept == ()
        assert os.listdir(tiny) == []


def test_gc_collects_the_lock_file_of_a_cache_deleted_by_hand(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    os.unlink(path)  # `rm a.mmc` instead of `mmapcache rm a.mmc`
    lock = cache_dir / "a.mmc.lock"
    age(lock, 30 * DAY)
    assert orphan_lock(path) == lock
    assert [(r.path, r.kind, r.nbytes) for r in mmapcache.gc(cache_dir).removed] == [(lock, "lock", 0)]
    assert os.listdir(cache_dir) == []


def test_gc_leaves_the_lock_file_of_a_cache_that_exists(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    age(cache_dir / "a.mmc.lock", 30 * DAY)
    assert orphan_lock(path) is None
    assert mmapcache.gc(cache_dir).removed == ()
    assert sorted(os.listdir(cache_dir)) == ["a.mmc", "a.mmc.lock"]


def test_gc_keeps_an_orphan_lock_file_a_creator_holds(cache_dir: Path) -> None:
    lock = cache_dir / "a.mmc.lock"
    creator = subprocess.Popen([sys.executable, "-c", LOCKER, str(cache_dir / "a.mmc")], stdout=subprocess.PIPE)
    try:
        assert creator.stdout is not None
        assert creator.stdout.readline().strip() == b"ready"
        age(lock, 2 * DAY)
        for dry_run in (True, False):
            report = mmapcache.gc(cache_dir, older_than="1d", dry_run=dry_run)
            assert report.removed == ()
            (kept,) = report.kept
            assert (kept.path, kept.in_use, kept.pids) == (lock, True, (creator.pid,))
            assert "creating or removing" in kept.reason
        with pytest.raises(CacheInUseError, match=str(creator.pid)):
            remove_orphan_lock(lock)
        assert lock.exists()
    finally:
        creator.kill()
        creator.wait()
        if creator.stdout is not None:
            creator.stdout.close()
    remove_orphan_lock(lock)  # the creator is gone, and the kernel dropped its lock
    assert os.listdir(cache_dir) == []


def test_a_creator_racing_the_removal_of_an_orphan_lock_holds_the_named_lock_file(cache_dir: Path) -> None:
    """A creator that waits while the orphan lock file is unlinked ends up on the file that has the name.

    (filelock checks ``st_nlink`` after locking and retries on an unlinked
    inode: what lets remove_orphan_lock unlink the file it holds.)
    """
    lock = cache_dir / "a.mmc.lock"
    lock.touch(mode=0o600)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the position remove_orphan_lock is in when it unlinks
        creator = subprocess.Popen(
            [sys.executable, "-c", CREATOR, str(cache_dir / "a.mmc")], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)  # let it open the old inode and wait for its lock
        os.unlink(lock)
    finally:
        os.close(fd)
    assert creator.stdout is not None
    inode = int(creator.stdout.readline())
    creator.wait(timeout=60)
    creator.stdout.close()
    assert inode == os.stat(lock).st_ino  # it created under the lock file that has the name
    assert sorted(os.listdir(cache_dir)) == ["a.mmc", "a.mmc.lock"]


def test_remove_orphan_lock_refuses_the_lock_of_an_existing_cache(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc")
    with pytest.raises(FileExistsError, match="mmapcache rm"):
        remove_orphan_lock(cache_dir / "a.mmc.lock")
    assert sorted(os.listdir(cache_dir)) == ["a.mmc", "a.mmc.lock"]


def test_remove_orphan_lock_refuses_what_is_not_a_lock_file(cache_dir: Path) -> None:
    (cache_dir / "notes.lock").write_text("")
    with pytest.raises(CacheFormatError, match="not the lock file of a cache"):
        remove_orphan_lock(cache_dir / "notes.lock")
    (cache_dir / "a.mmc.lock").write_text("my data")
    with pytest.raises(CacheFormatError, match="not empty"):
        remove_orphan_lock(cache_dir / "a.mmc.lock")
    os.mkfifo(cache_dir / "b.mmc.lock")
    with pytest.raises(UnsafeCacheFileError, match="not a regular file"):
        remove_orphan_lock(cache_dir / "b.mmc.lock")
    (cache_dir / "c.mmc.lock").symlink_to(cache_dir / "notes.lock")
    with pytest.raises(UnsafeCacheFileError, match="symlink"):
        remove_orphan_lock(cache_dir / "c.mmc.lock")
    assert mmapcache.gc(cache_dir, older_than=0).removed == ()
    assert (cache_dir / "a.mmc.lock").read_text() == "my data"
    assert sorted(os.listdir(cache_dir)) == ["a.mmc.lock", "b.mmc.lock", "c.mmc.lock", "notes.lock"]


# -- files that are not regular files -------------------------------------------------------


@pytest.fixture
def not_regular(cache_dir: Path) -> Iterator[dict[str, Path]]:
    """A Unix socket (bound, listening), a FIFO and a directory, each named like a cache."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(cache_dir / "socket.mmc"))
    server.listen()
    os.mkfifo(cache_dir / "fifo.mmc")
    (cache_dir / "dir.mmc").mkdir()
    try:
        yield {kind: cache_dir / f"{kind}.mmc" for kind in ("socket", "fifo", "dir")}
    finally:
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["socket", "fifo", "dir"])
def test_info_refuses_what_is_not_a_regular_file(not_regular: dict[str, Path], kind: str) -> None:
    path = not_regular[kind]
    before = os.lstat(path)
    with pytest.raises(UnsafeCacheFileError, match="not a regular file"):
        mmapcache.info(path)
    assert os.path.samestat(before, os.lstat(path))


@pytest.mark.timeout(60)
def test_list_and_gc_leave_what_is_not_a_regular_file_alone(cache_dir: Path, not_regular: dict[str, Path]) -> None:
    items = {item.path.name: item for item in mmapcache.list_caches(cache_dir)}
    assert sorted(items) == ["fifo.mmc", "socket.mmc"]  # directories are not listed
    for item in items.values():
        assert item.status == "unsafe"
        assert "not a regular file" in (item.error or "")
    for path in not_regular.values():
        age(path, 30 * DAY)
    report = mmapcache.gc(cache_dir, older_than="1d")
    assert report.removed == ()
    assert sorted(k.path.name for k in report.kept) == ["fifo.mmc", "socket.mmc"]
    assert sorted(os.listdir(cache_dir)) == ["dir.mmc", "fifo.mmc", "socket.mmc"]


# -- disk_usage -----------------------------------------------------------------------------


def test_disk_usage_counts_caches(cache_dir: Path) -> None:
    a = make_cache(cache_dir / "a.mmc")
    b = make_cache(cache_dir / "b.mmc", length=100)
    (cache_dir / "c.mmc.tmp-1-00").write_bytes(b"x" * 5000)
    usage = mmapcache.disk_usage(cache_dir)
    assert usage.directory == cache_dir
    assert usage.filesystem == "tmpfs"
    assert usage.caches == 2
    assert usage.cache_bytes == os.stat(a).st_blocks * 512 + os.stat(b).st_blocks * 512
    assert (usage.leftovers, usage.leftover_bytes) == (1, os.stat(cache_dir / "c.mmc.tmp-1-00").st_blocks * 512)
    assert 0 < usage.free <= usage.total
    assert any("mmapcache gc" in warning for warning in usage.warnings)
    json.dumps(usage.to_dict())


def test_disk_usage_defaults_to_default_dir(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir))
    assert mmapcache.disk_usage().directory == cache_dir


def usage_of(**changes: object) -> DiskUsage:
    base = {
        "directory": Path("/dev/shm/mmapcache-me"),
        "filesystem": "tmpfs",
        "total": 64 * 2**30,
        "free": 60 * 2**30,
        "caches": 0,
        "cache_bytes": 0,
        "leftovers": 0,
        "leftover_bytes": 0,
        "memory_limit": None,
        "warnings": (),
    }
    return DiskUsage(**{**base, **changes})  # type: ignore[arg-type]


def test_no_warnings_for_a_roomy_shm() -> None:
    assert disk_warnings(usage_of()) == []


def test_warns_about_dockers_64mb_shm() -> None:
    (warning,) = disk_warnings(usage_of(total=64 * 10**6, free=64 * 10**6))
    assert "/dev/shm is only 61.0 MiB" in warning
    assert "Docker" in warning
    assert "--shm-size" in warning
    assert "MMAPCACHE_DIR" in warning
    assert SMALL_TMPFS > 64 * 10**6


def test_warns_when_nearly_full_network_or_charged() -> None:
    (full,) = disk_warnings(usage_of(free=2**30))
    assert "nearly full" in full
    assert "mmapcache gc" in full
    (network,) = disk_warnings(usage_of(directory=Path("/nfs/caches"), filesystem="nfs4"))
    assert "nfs4" in network
    (charged,) = disk_warnings(usage_of(memory_limit=8 * 2**30))
    assert "memory cgroup" in charged
    assert "8.0 GiB" in charged


def test_memory_limit_reads_this_process_cgroup() -> None:
    limit = memory_limit()
    assert limit is None or limit > 0


def test_info_reads_the_usage_counters_of_every_process(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as cache:
        cache.put_many([0, 1], {"x": [[1] * 4, [2] * 4]})
        cache.get(0), cache.get(0), cache.get(5)
        before = path.read_bytes()
        usage = mmapcache.info(path).usage
        assert path.read_bytes() == before, "info never writes"
        assert usage is not None
        assert (usage.total.hits, usage.total.misses, usage.total.written) == (2, 1, 2)
        assert set(usage.processes) == {os.getpid()}  # a live process: its record's lock is held
        assert mmapcache.info(path).to_dict()["usage"]["total"]["hit_rate"] == 2 / 3
    usage = mmapcache.info(path).usage
    assert usage is not None
    assert usage.processes == {}
    assert (usage.total.hits, usage.total.written) == (2, 2), "closed handles leave their counts in the file"


# -- a closed CachedDataset -------------------------------------------------------------------


def test_stats_of_a_closed_dataset_leaves_the_file_removable(cache_dir: Path) -> None:
    # The end of a training script: close, report, remove — without force=True.
    import torch

    from mmapcache.torch import CachedDataset

    class Squares(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((3,), float(i * i))

    ds = CachedDataset(Squares(), path=cache_dir / "sq.mmc", key="squares")
    for i in range(8):
        ds[i]
    ds.close()
    stats = ds.stats()
    assert (stats["filled"], stats["misses"], stats["processes"]) == (8, 8, 1)
    assert not mmapcache.in_use(ds.path)
    mmapcache.remove(ds.path)
    assert not ds.path.exists()
    ds[3]  # used again: opened (and here created) again, and kept open
    assert ds.stats()["filled"] == 1
    assert mmapcache.in_use(ds.path)
    ds.close()
    mmapcache.remove(ds.path)
