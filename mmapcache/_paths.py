"""Where cache files live, and which files and directories are safe to use.

/dev/shm is world writable, so a predictable name there can be pre-planted by
another user (a symlink to a file of yours, or a file they can read or write).
Every path is therefore checked before use: no symlinks, owned by this user,
not writable by others, a regular file (directories: not a symlink, owned by
this user, not writable by others).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import stat
from pathlib import Path

from ._errors import UnsafeCacheFileError

__all__ = ["check_directory", "check_file_stat", "default_dir", "filesystem_type"]

log = logging.getLogger("mmapcache")

ENV_DIR = "MMAPCACHE_DIR"
_SHM = Path("/dev/shm")


def default_dir() -> Path:
    """The directory caches go to when no path is given; created (mode 0700) if missing.

    ``$MMAPCACHE_DIR`` if set; else a per-user directory under /dev/shm
    (``/dev/shm/mmapcache-<user>``); else ``$XDG_CACHE_HOME/mmapcache``
    (``~/.cache/mmapcache``).
    """
    env = os.environ.get(ENV_DIR)
    if env:
        return _ensure_private_dir(Path(env).expanduser(), strict=False)
    if _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK):
        return _ensure_private_dir(_SHM / f"mmapcache-{_user_tag()}", strict=True)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return _ensure_private_dir(base / "mmapcache", strict=False)


def _user_tag() -> str:
    try:
        name = getpass.getuser()
    except Exception:  # no passwd entry (containers run with a bare uid)
        name = ""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return safe if safe and safe == name else str(os.geteuid())


def _ensure_private_dir(path: Path, *, strict: bool) -> Path:
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=not strict)
    if strict:
        check_directory(path, private=True)
    elif not path.is_dir():
        raise NotADirectoryError(f"{path} exists but is not a directory; point {ENV_DIR} at a directory")
    return path


def check_directory(path: Path, *, private: bool) -> None:
    """Refuse a symlinked directory, or one another user owns or can write to."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheFileError(
            f"{path} is a symlink; mmapcache does not follow symlinks for its directories "
            "(someone could redirect your cache). Point MMAPCACHE_DIR at the real directory",
            path=path,
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheFileError(f"{path} is not a directory", path=path)
    if not private:
        return
    if st.st_uid != os.geteuid():
        raise UnsafeCacheFileError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); another user "
            "may have created it to intercept your caches. Remove it or set MMAPCACHE_DIR",
            path=path,
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheFileError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod 700 {path}` or set MMAPCACHE_DIR",
            path=path,
        )


def check_file_stat(path: str, st: os.stat_result) -> None:
    """Refuse a cache file that is not a regular file, is another user's, or is writable by others."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheFileError(
            f"{path} is a symlink; mmapcache opens cache files only by their real path "
            "(a planted symlink could point at any of your files)",
            path=path,
        )
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheFileError(f"{path} is not a regular file", path=path)
    if st.st_uid != os.geteuid():
        raise UnsafeCacheFileError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
            "mmapcache only opens its own users' files. Use another path",
            path=path,
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeCacheFileError(
            f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}), so its "
            f"contents cannot be trusted; remove it or run `chmod o-w {path}`",
            path=path,
        )


# File systems where flock/fcntl locks or shared mappings are not coherent
# across machines.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "9p", "glusterfs", "afs"}
)


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The file system type (``"tmpfs"``, ``"ext4"``, ...) holding ``path``, from /proc/self/mountinfo."""
    try:
        target = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return None
    best, best_type = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        parts = left.split()
        if len(parts) < 5 or not right:
            continue
        mount_point = parts[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, right.split()[0]
    return best_type


def is_network_filesystem(fs_type: str | None) -> bool:
    return fs_type is not None and (fs_type in NETWORK_FILESYSTEMS or fs_type.startswith("fuse."))
