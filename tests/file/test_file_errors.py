"""What users meet when the file system says no: every error triggered for real, each one says what to do.

Real mounts (a tmpfs with few inodes, a read-only tmpfs), real sockets, FIFOs
and devices, and real processes running as other users; the tests that need
root skip without it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _tmpfs import mounted_tmpfs

import mmapcache
from mmapcache import Cache, CacheSpaceError, Field, UnsafeCacheFileError
from mmapcache._file.names import lock_path_for

FIELDS = {"x": Field((8,), "uint8")}
IS_ROOT = os.geteuid() == 0
NOBODY = 65534
USER = 4242  # a uid that owns nothing here: neither root nor NOBODY
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mounts, chown, setuid)")


def make_cache(path: Path) -> None:
    with Cache.open(path, FIELDS, length=4) as cache:
        cache.put(0, {"x": np.arange(8, dtype=np.uint8)})


# -- not a regular file -----------------------------------------------------------------


def _plant(path: Path, kind: str) -> Iterator[None]:
    if kind == "socket":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        try:
            yield
        finally:
            server.close()
        return
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "character device":
        if not IS_ROOT:
            pytest.skip("mknod needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
    yield


KINDS = {
    "socket": "a Unix socket",
    "fifo": "a FIFO (named pipe)",
    "directory": "a directory",
    "character device": "a character device",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_anything_but_a_regular_file_is_refused_by_every_entry_point_and_left_alone(cache_dir: Path, kind: str) -> None:
    path = cache_dir / "c.mmc"
    planted = _plant(path, kind)
    next(planted)
    before = os.lstat(path)
    attempts: dict[str, Callable[[], object]] = {
        "open": lambda: Cache.open(path),
        "open readonly": lambda: Cache.open(path, readonly=True),
        "open or create": lambda: Cache.open(path, FIELDS, length=4),
        "in_use": lambda: mmapcache.in_use(path),
        "remove": lambda: mmapcache.remove(path),
        "remove force": lambda: mmapcache.remove(path, force=True),
    }
    for name, attempt in attempts.items():
        with pytest.raises(UnsafeCacheFileError) as info:
            attempt()
        assert str(info.value) == (
            f"{path} is not a regular file (it is {KINDS[kind]}); mmapcache leaves it alone. Use another path"
        ), name
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
    assert sorted(os.listdir(cache_dir)) == ["c.mmc"]  # not even a lock file
    next(planted, None)


# -- another user's file ------------------------------------------------------------------

AS_USER = """
import json, os, sys
import mmapcache, mmapcache.cache, mmapcache._file.create, mmapcache._format.sizes  # all, before losing /root
from mmapcache import Cache, Field
path = sys.argv[1]
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[2]))
fields = {"x": Field((8,), "uint8")}
attempts = {
    "open": lambda: Cache.open(path).close(),
    "open readonly": lambda: Cache.open(path, readonly=True).close(),
    "open or create": lambda: Cache.open(path, fields, length=4).close(),
    "remove": lambda: mmapcache.remove(path),
}
results = {}
for name in sys.argv[3:]:
    try:
        attempts[name]()
        results[name] = "ok"
    except Exception as error:
        results[name] = [type(error).__name__, str(error)]
print(json.dumps(results))
"""


def run_as(uid: int, path: Path, *attempts: str) -> dict[str, Any]:
    """Run ``attempts`` on ``path`` in a child process that has dropped root for ``uid``."""
    result = subprocess.run(
        [sys.executable, "-c", AS_USER, str(path), str(uid), *attempts], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    answers: dict[str, Any] = json.loads(result.stdout)
    return answers


@pytest.fixture
def user_dir(cache_dir: Path) -> Path:
    """A directory that belongs to USER, inside the test's (root-owned) cache directory."""
    os.chmod(cache_dir, 0o711)
    directory = cache_dir / "user"
    directory.mkdir(mode=0o755)
    os.chown(directory, USER, USER)
    return directory


@needs_root
def test_another_users_readable_file_gets_one_answer_whatever_the_mode(user_dir: Path) -> None:
    path = user_dir / "c.mmc"
    make_cache(path)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o644)
    answers = run_as(USER, path, "open", "open readonly", "open or create", "remove")
    expected = [
        "UnsafeCacheFileError",
        f"{path} belongs to uid {NOBODY}, not to you (uid {USER}); mmapcache only opens its own users' "
        "files. Use another path",
    ]
    assert answers == {name: expected for name in answers}
    assert path.exists()


@needs_root
def test_root_gets_the_same_answer_for_another_users_file(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    make_cache(path)
    os.chown(path, NOBODY, NOBODY)
    messages = set()
    for attempt in (
        lambda: Cache.open(path),
        lambda: Cache.open(path, readonly=True),
        lambda: Cache.open(path, FIELDS, length=4),
        lambda: mmapcache.remove(path),
    ):
        with pytest.raises(UnsafeCacheFileError, match=f"belongs to uid {NOBODY}") as info:
            attempt()
        messages.add(str(info.value))
    assert len(messages) == 1
    assert path.exists()


@needs_root
def test_your_own_read_only_file_still_advises_readonly(user_dir: Path) -> None:
    path = user_dir / "c.mmc"
    make_cache(path)
    os.chown(path, USER, USER)
    os.chown(lock_path_for(path), USER, USER)
    os.chmod(path, 0o400)
    answers = run_as(USER, path, "open", "open readonly")
    assert answers["open readonly"] == "ok"
    assert answers["open"] == [
        "PermissionError",
        f"[Errno 13] cannot open {path} for writing (permission denied, mode 400); pass readonly=True to only read it: "
        f"'{path}'",
    ]


@needs_root
def test_a_directory_you_cannot_write_says_where_to_put_caches(user_dir: Path) -> None:
    locked = user_dir.parent / "root-only"
    locked.mkdir(mode=0o755)  # root's: USER can look but not create
    path = locked / "c.mmc"
    kind, message = run_as(USER, path, "open or create")["open or create"]
    assert kind == "PermissionError"
    assert f"cannot create the cache {path}: no permission to create files in {locked}" in message
    assert "MMAPCACHE_DIR" in message
    assert os.listdir(locked) == []


# -- no inodes left ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inodes", "fails_at"),
    [
        (1, "the directory"),
        (1, "the lock file"),
        (2, "the temp file"),
        (3, "the link to the final name"),
    ],
)
def test_no_free_inodes_raises_space_error_and_leaves_no_cache(cache_dir: Path, inodes: int, fails_at: str) -> None:
    # tmpfs counts its root directory, each file and each extra hard link as an inode.
    with mounted_tmpfs(cache_dir / "mnt", f"size=4m,nr_inodes={inodes},mode=0700") as mount_point:
        path = mount_point / ("sub/c.mmc" if fails_at == "the directory" else "c.mmc")
        with pytest.raises(CacheSpaceError) as info:
            Cache.open(path, FIELDS, length=4)
        error = info.value
        assert isinstance(error, OSError)
        message = str(error)
        assert message.startswith(f"no free inodes (file entries) left in {path.parent} to create the cache {path}")
        for hint in ("mmapcache gc", "MMAPCACHE_DIR", "nr_inodes"):
            assert hint in message, fails_at
        assert error.needed > 0
        assert error.free is not None
        assert not path.exists()
        assert [n for n in os.listdir(mount_point) if n != lock_path_for(path).name] == []


# -- read-only file system ---------------------------------------------------------------------


@pytest.fixture
def readonly_mount(cache_dir: Path) -> Iterator[Path]:
    """A tmpfs holding one filled cache, ``c.mmc``, remounted read-only."""
    with mounted_tmpfs(cache_dir / "ro", "size=4m,mode=0700") as mount_point:
        make_cache(mount_point / "c.mmc")
        subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
        yield mount_point


def test_opening_a_cache_for_writing_on_a_read_only_mount_advises_readonly(readonly_mount: Path) -> None:
    path = readonly_mount / "c.mmc"
    with pytest.raises(OSError, match=r"read-only file system\. Pass readonly=True") as info:
        Cache.open(path)
    assert info.value.errno == errno.EROFS
    with pytest.raises(OSError, match="readonly=True") as info:
        Cache.open(path, FIELDS, length=4)
    assert info.value.errno == errno.EROFS
    with Cache.open(path, readonly=True) as cache:  # what the message advises works
        assert cache.get(0)["x"].tolist() == list(range(8))
        assert mmapcache.in_use(path)
    assert not mmapcache.in_use(path)


@pytest.mark.parametrize("where", ["c2.mmc", "sub/c2.mmc"])
def test_creating_on_a_read_only_mount_says_to_use_a_writable_directory(readonly_mount: Path, where: str) -> None:
    path = readonly_mount / where
    with pytest.raises(OSError, match=f"cannot create the cache {path}: .* is on a read-only file system") as info:
        Cache.open(path, FIELDS, length=4)
    assert info.value.errno == errno.EROFS
    assert "MMAPCACHE_DIR" in str(info.value)
    assert sorted(os.listdir(readonly_mount)) == ["c.mmc", "c.mmc.lock"]


def test_removing_from_a_read_only_mount_says_why(readonly_mount: Path) -> None:
    path = readonly_mount / "c.mmc"
    with pytest.raises(OSError, match="read-only file system; remount it read-write") as info:
        mmapcache.remove(path)
    assert info.value.errno == errno.EROFS
    assert path.exists()


# -- too many open files -----------------------------------------------------------------------

NO_DESCRIPTORS = """
import os, resource, sys
from mmapcache import Cache, Field
fields = {"x": Field((8,), "uint8")}
fds = []
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
while True:  # use up every descriptor
    try:
        fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
try:
    Cache.open(sys.argv[1], fields, length=4) if sys.argv[2] == "create" else Cache.open(sys.argv[1])
except OSError as error:
    print(error.errno, error)
"""


@pytest.mark.parametrize("case", ["open", "create"])
def test_running_out_of_descriptors_says_what_to_do(cache_dir: Path, case: str) -> None:
    path = cache_dir / "c.mmc"
    if case == "open":
        make_cache(path)
    result = subprocess.run([sys.executable, "-c", NO_DESCRIPTORS, str(path), case], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    code, _, message = result.stdout.strip().partition(" ")
    assert int(code) == errno.EMFILE
    assert "too many open files" in message
    assert "ulimit -n" in message


@needs_root
def test_a_directory_you_cannot_enter_says_so(user_dir: Path) -> None:
    closed = user_dir.parent / "closed"
    closed.mkdir(mode=0o700)  # root's: USER cannot even look inside
    path = closed / "c.mmc"
    answers = run_as(USER, path, "open", "open or create")
    for kind, message in answers.values():
        assert kind == "PermissionError"
        assert f"cannot look up {path}: permission denied on one of its directories ({closed})" in message


def test_a_file_where_a_directory_should_be_says_so(cache_dir: Path) -> None:
    (cache_dir / "notes").write_text("a file, not a directory")
    path = cache_dir / "notes" / "sub" / "c.mmc"
    attempts: list[Callable[[], Cache]] = [
        lambda: Cache.open(path, FIELDS, length=4),
        lambda: Cache.open(path, readonly=True),
    ]
    for attempt in attempts:
        with pytest.raises(NotADirectoryError, match=f"cannot use {path}: {cache_dir / 'notes'} is not a directory"):
            attempt()
    assert sorted(os.listdir(cache_dir)) == ["notes"]


# -- planted lock files ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socket", "fifo", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_left_alone(cache_dir: Path, kind: str) -> None:
    path = cache_dir / "c.mmc"
    lock = lock_path_for(path)
    planted = _plant(lock, kind)
    next(planted)
    with pytest.raises(UnsafeCacheFileError, match=re.escape(f"the lock file {lock} is {KINDS[kind]}, not a regular")):
        Cache.open(path, FIELDS, length=4)
    assert sorted(os.listdir(cache_dir)) == [lock.name]
    next(planted, None)


@needs_root
def test_another_users_lock_file_is_refused(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    lock = lock_path_for(path)
    lock.touch(mode=0o666)
    os.chown(lock, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheFileError, match=f"the lock file {lock} belongs to uid {NOBODY}"):
        Cache.open(path, FIELDS, length=4)
    assert not path.exists()


# -- the directory disappears -------------------------------------------------------------------

HOLD_THEN_DELETE = """
import shutil, sys
from pathlib import Path
from mmapcache._file.create import creation_lock
path = Path(sys.argv[1])
with creation_lock(path, timeout=10):
    print("locked", flush=True)
    sys.stdin.readline()
    shutil.rmtree(path.parent)  # a job-end cleanup while another creator waits for the lock
"""

CREATE = """
import sys
from mmapcache import Cache, Field
print("ready", flush=True)
with Cache.open(sys.argv[1], {"x": Field((8,), "uint8")}, length=4, timeout=60) as cache:
    print("created", cache.length)
"""


def test_a_directory_deleted_while_a_creator_waits_is_made_again(cache_dir: Path) -> None:
    path = cache_dir / "sub" / "c.mmc"
    path.parent.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THEN_DELETE, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    creator = subprocess.Popen([sys.executable, "-c", CREATE, str(path)], stdout=subprocess.PIPE, text=True)
    assert creator.stdout is not None
    assert creator.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # the creator now polls for the lock (if not, the test passes without the race)
    holder.stdin.write("go\n")
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0
    out, _ = creator.communicate(timeout=60)
    assert creator.returncode == 0
    assert out.strip() == "created 4"
    assert sorted(os.listdir(path.parent)) == ["c.mmc", "c.mmc.lock"]


# -- messages stay readable ----------------------------------------------------------------------


def test_a_mismatch_with_a_huge_key_gives_a_short_message(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    huge = "k" * 2**20
    with Cache.open(path, FIELDS, length=4, key=huge):
        pass
    with pytest.raises(mmapcache.SchemaMismatchError) as info:
        Cache.open(path, FIELDS, length=4, key="other")
    assert len(str(info.value)) < 1000
    assert f"({len(repr(huge))} characters)" in str(info.value)
    assert info.value.differences["key"] == ("other", huge)  # the values themselves stay whole
