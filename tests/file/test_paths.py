"""default_dir(): $MMAPCACHE_DIR, a private per-user directory under /dev/shm, or the user cache dir."""

from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import mmapcache
from mmapcache import UnsafeCacheFileError
from mmapcache._file import paths as _paths

IS_ROOT = os.geteuid() == 0


def test_env_var_wins_and_is_created(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = cache_dir / "nested" / "caches"
    monkeypatch.setenv("MMAPCACHE_DIR", str(target))
    assert mmapcache.default_dir() == target
    assert target.is_dir()


def test_env_var_may_be_a_symlinked_directory(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache_dir / "real").mkdir()
    (cache_dir / "link").symlink_to(cache_dir / "real")
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir / "link"))
    assert mmapcache.default_dir() == cache_dir / "link"


def test_env_var_pointing_at_a_file_is_an_error(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache_dir / "file").write_text("x")
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir / "file"))
    with pytest.raises(OSError, match="not a directory"):
        mmapcache.default_dir()


def test_env_var_writable_by_everyone_without_sticky_bit_is_refused(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = cache_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MMAPCACHE_DIR", str(shared))
    with pytest.raises(UnsafeCacheFileError, match=r"writable by every user .* lacks the sticky bit") as caught:
        mmapcache.default_dir()
    assert "MMAPCACHE_DIR=" in str(caught.value)
    assert "chmod +t" in str(caught.value)
    assert os.listdir(shared) == []  # refused before anything was made there


def test_env_var_with_sticky_bit_like_tmp_is_accepted(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = cache_dir / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("MMAPCACHE_DIR", str(shared))
    assert mmapcache.default_dir() == shared


def test_env_var_group_writable_is_accepted(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team = cache_dir / "team"
    team.mkdir()
    team.chmod(0o2775)
    monkeypatch.setenv("MMAPCACHE_DIR", str(team))
    assert mmapcache.default_dir() == team


def test_env_var_symlink_is_followed_and_its_target_checked(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache_dir / "open").mkdir()
    (cache_dir / "open").chmod(0o777)
    (cache_dir / "link").symlink_to(cache_dir / "open")
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir / "link"))
    with pytest.raises(UnsafeCacheFileError, match=re.escape(f"really {cache_dir / 'open'}")):
        mmapcache.default_dir()


@pytest.mark.skipif(not IS_ROOT, reason="making another user's directory needs root")
def test_env_var_sticky_directory_of_another_user_is_refused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = cache_dir / "theirs"
    theirs.mkdir()
    theirs.chmod(0o1777)
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("MMAPCACHE_DIR", str(theirs))
    with pytest.raises(UnsafeCacheFileError, match="belongs to uid 65534"):
        mmapcache.default_dir()


@pytest.mark.skipif(not IS_ROOT, reason="making another user's symlink needs root")
def test_env_var_symlink_of_another_user_is_refused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache_dir / "real").mkdir(mode=0o700)
    (cache_dir / "link").symlink_to(cache_dir / "real")
    os.chown(cache_dir / "link", 65534, 65534, follow_symlinks=False)
    monkeypatch.setenv("MMAPCACHE_DIR", str(cache_dir / "link"))
    with pytest.raises(UnsafeCacheFileError, match="symlink that belongs to uid 65534"):
        mmapcache.default_dir()


@pytest.fixture
def fake_shm(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the /dev/shm branch against a real directory of this test's own."""
    shm = cache_dir / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    monkeypatch.delenv("MMAPCACHE_DIR")
    monkeypatch.setattr(_paths, "_SHM", shm)
    return shm


def test_private_per_user_directory_under_shm(fake_shm: Path) -> None:
    path = mmapcache.default_dir()
    assert path.parent == fake_shm
    assert path.name.startswith("mmapcache-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.geteuid()
    assert mmapcache.default_dir() == path  # idempotent


def test_planted_symlink_directory_is_refused(fake_shm: Path, cache_dir: Path) -> None:
    elsewhere = cache_dir / "elsewhere"
    elsewhere.mkdir()
    (fake_shm / f"mmapcache-{_paths._user_tag()}").symlink_to(elsewhere)
    with pytest.raises(UnsafeCacheFileError, match="symlink"):
        mmapcache.default_dir()


def test_directory_writable_by_others_is_refused(fake_shm: Path) -> None:
    planted = fake_shm / f"mmapcache-{_paths._user_tag()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(UnsafeCacheFileError, match="writable by other users"):
        mmapcache.default_dir()


@pytest.mark.skipif(not IS_ROOT, reason="creating another user's directory needs root")
def test_directory_owned_by_another_user_is_refused(fake_shm: Path) -> None:
    planted = fake_shm / f"mmapcache-{_paths._user_tag()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    with pytest.raises(UnsafeCacheFileError, match="belongs to uid 65534"):
        mmapcache.default_dir()


# The per-user directory in a fresh process, as a user's shell would get it.
SHOW_DEFAULT_DIR = """
import sys
from pathlib import Path
from mmapcache._file import paths as _paths
_paths._SHM = Path(sys.argv[1])
print(_paths.default_dir())
"""


@pytest.mark.parametrize("claimed", ["someone-else", "root", ""])
def test_directory_name_comes_from_the_effective_uid_not_from_user_variables(fake_shm: Path, claimed: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MMAPCACHE_DIR", "LNAME", "USERNAME")}
    env.update(USER=claimed, LOGNAME=claimed)  # what `sudo -E` or a wrong profile leaves behind
    result = subprocess.run(
        [sys.executable, "-c", SHOW_DEFAULT_DIR, str(fake_shm)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    expected = fake_shm / f"mmapcache-{pwd.getpwuid(os.geteuid()).pw_name}"
    assert result.stdout.strip() == str(expected)
    assert os.listdir(fake_shm) == [expected.name]


def test_falls_back_to_the_user_cache_dir(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MMAPCACHE_DIR")
    monkeypatch.setattr(_paths, "_SHM", cache_dir / "no-such-shm")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir / "xdg"))
    assert mmapcache.default_dir() == cache_dir / "xdg" / "mmapcache"


def test_filesystem_type_of_dev_shm() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    assert _paths.filesystem_type("/dev/shm") == "tmpfs"
    assert _paths.is_network_filesystem("nfs4")
    assert not _paths.is_network_filesystem("tmpfs")
