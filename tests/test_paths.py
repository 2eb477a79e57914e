"""default_dir(): $MMAPCACHE_DIR, a private per-user directory under /dev/shm, or the user cache dir."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import mmapcache
from mmapcache import UnsafeCacheFileError, _paths

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
