"""Where cache files live, and which files and directories are safe to use.

/dev/shm is world writable, so a predictable name there can be pre-planted by
another user (a symlink to a file of yours, or a file they can read or write).
Every path is therefore checked before use: no symlinks, owned by this user,
not writable by others, a regular file (directories: not a symlink, owned by
this user, not writable by others).

``$MMAPCACHE_DIR`` is the user's own choice, so its symlinks are followed, but
the directory it leads to is checked too: one that every user can write to
must have the sticky bit (like /tmp) and belong to you or root; otherwise
anyone could delete or rename your caches and their lock files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import stat
from pathlib import Path

from .._errors import UnsafeCacheFileError

__all__ = [
    "check_chosen_directory",
    "check_directory",
    "check_file_stat",
    "check_kind",
    "default_dir",
    "file_kind",
    "filesystem_type",
    "free_bytes",
    "memory_limit",
    "statvfs_near",
]

log = logging.getLogger("mmapcache")

ENV_DIR = "MMAPCACHE_DIR"
_SHM = Path("/dev/shm")
# A user name that is safe as part of a file name.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def default_dir() -> Path:
    """The directory caches go to when no path is given; created (mode 0700) if missing.

    ``$MMAPCACHE_DIR`` if set (refused with :class:`UnsafeCacheFileError`
    when every user may write to it without the sticky bit: see
    :func:`check_chosen_directory`); else a per-user directory under /dev/shm
    (``/dev/shm/mmapcache-<user>``, the user of the effective uid); else
    ``$XDG_CACHE_HOME/mmapcache`` (``~/.cache/mmapcache``).
    """
    env = os.environ.get(ENV_DIR)
    if env:
        return _ensure_private_dir(Path(env).expanduser(), strict=False, label=f"{ENV_DIR}={env}")
    if _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK):
        return _ensure_private_dir(_SHM / f"mmapcache-{_user_tag()}", strict=True, label="")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return _ensure_private_dir(base / "mmapcache", strict=False, label=str(base / "mmapcache"))


def _user_tag() -> str:
    """The name of the effective uid's user, or the uid itself.

    Not ``$USER``/``$LOGNAME`` (``getpass.getuser``): under ``sudo -E`` or
    with a wrong ``USER`` they name someone else, which would lock a user out
    of their own directory or let them squat another user's name.
    """
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # no passwd entry (containers run with a bare uid)
        return str(uid)
    return name if _SAFE_NAME.fullmatch(name) else str(uid)


def _ensure_private_dir(path: Path, *, strict: bool, label: str) -> Path:
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=not strict)
    if strict:
        check_directory(path, private=True)
    elif not path.is_dir():
        raise NotADirectoryError(f"{path} exists but is not a directory; point {ENV_DIR} at a directory")
    else:
        check_chosen_directory(path, label=label)
    return path


def check_chosen_directory(path: Path, *, label: str) -> None:
    """Refuse a directory you chose (``$MMAPCACHE_DIR``) in which other users could delete or rename your files.

    ``label`` names it in messages. Symlinks are followed (the path is your
    own choice, not a predictable name in a shared place), except a symlink
    that another user (not root) owns. The real directory is refused when
    every user may write to it and it lacks the sticky bit, or has the sticky
    bit but belongs to another user (a sticky directory's owner may still
    delete anyone's files). Group-writable directories are accepted: files
    there are still checked one by one when opened.
    """
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        raise UnsafeCacheFileError(
            f"{label} is a symlink that belongs to uid {link.st_uid}, not to you "
            f"(uid {os.geteuid()}); someone else decides where it leads. "
            f"Point {ENV_DIR} at the real directory",
            path=path,
        )
    real = os.path.realpath(path)
    st = os.stat(real)
    where = label + (f" (really {real})" if real != os.path.abspath(path) else "")
    if not st.st_mode & stat.S_IWOTH:
        return
    if not st.st_mode & stat.S_ISVTX:
        raise UnsafeCacheFileError(
            f"{where} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}) and lacks the "
            "sticky bit, so anyone could delete or replace your caches and their lock files. "
            f"Point {ENV_DIR} at a directory only you can write to (`mkdir -m 700 DIR`), or, if "
            f"it is meant to be shared like /tmp, give it the sticky bit (`chmod +t {real}`)",
            path=path,
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafeCacheFileError(
            f"{where} is writable by every user and belongs to uid {st.st_uid}, who may delete or "
            f"rename your files in it despite the sticky bit. Point {ENV_DIR} at a directory "
            "only you can write to (`mkdir -m 700 DIR`)",
            path=path,
        )


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


_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a Unix socket"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symlink"),
)


def file_kind(st: os.stat_result) -> str:
    """What a non-regular file is, for messages: ``"a Unix socket"``, ``"a FIFO (named pipe)"``, ..."""
    return next((name for test, name in _FILE_TYPES if test(st.st_mode)), f"of type {stat.S_IFMT(st.st_mode):#o}")


def check_kind(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """Refuse a symlink or anything else that is not a regular file (from ``lstat``: nothing opened yet)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheFileError(
            f"{path} is a symlink; mmapcache opens cache files only by their real path "
            "(a planted symlink could point at any of your files)",
            path=path,
        )
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheFileError(
            f"{path} is not a regular file (it is {file_kind(st)}); mmapcache leaves it alone. Use another path",
            path=path,
        )


def check_file_stat(path: str, st: os.stat_result) -> None:
    """Refuse a cache file that is not a regular file, is another user's, or is writable by others."""
    check_kind(path, st)
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


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def is_memory_filesystem(fs_type: str | None) -> bool:
    """Whether files there live in RAM: gone at reboot, never read from a device."""
    return fs_type in MEMORY_FILESYSTEMS


def is_network_filesystem(fs_type: str | None) -> bool:
    return fs_type is not None and (fs_type in NETWORK_FILESYSTEMS or fs_type.startswith("fuse."))


def statvfs_near(path: str | os.PathLike[str]) -> os.statvfs_result | None:
    """``statvfs`` of ``path``, or of its nearest existing parent (a cache's directory may not exist yet).

    The one place free space is asked for: creation checks it, ``info``, ``ls`` and ``df`` show it.
    """
    candidate = Path(os.path.abspath(os.fspath(path)))
    for directory in (candidate, *candidate.parents):
        try:
            return os.statvfs(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return None
    return None


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged user may still allocate where ``path`` is (``None`` when unknown)."""
    st = statvfs_near(path)
    return None if st is None else st.f_bavail * st.f_frsize


# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 2**60


def memory_limit() -> int | None:
    """This process's memory cgroup limit in bytes (cgroup v1 or v2), or ``None`` if unlimited or unknown."""
    for candidate in _cgroup_limit_files():
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if value < _NO_LIMIT else None
    return None


def _cgroup_limit_files() -> list[Path]:
    """Limit files for our cgroup, most specific first (in a container the root view is ours)."""
    root = Path("/sys/fs/cgroup")
    v1: list[Path] = []
    v2: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, relative = parts
        relative = relative.lstrip("/")
        if "memory" in controllers.split(","):
            v1 = [root / "memory" / relative / "memory.limit_in_bytes", root / "memory" / "memory.limit_in_bytes"]
        elif controllers == "":
            v2 = [root / relative / "memory.max", root / "memory.max"]
    return [path for path in v1 + v2 if path.exists()]
