"""File names: what a cache is called, and every side file derived from its name.

A cache file is named ``<name>.mmc`` (``SUFFIX``; :func:`is_cache_name`). Every name derived from
a cache's name comes from this module.

The *stem* of a cache named ``N`` is ``N`` itself when ``N`` plus the
longest side suffix (``.tmp-<pid>-<8 hex>``, at most 24 bytes) fits the
directory's ``NAME_MAX`` (255 bytes on most file systems); else it is the
first bytes of ``N`` (cut at a UTF-8 character boundary), ``~``, the first 16
hex digits of the SHA-256 of ``N``, and ``N``'s extension (``.mmc``), short
enough that every side name fits. The side files are:

- ``<stem>.lock``: the creation lock (never deleted while in use; see
  :func:`mmapcache._file.create.creation_lock`); its holder may write one line of JSON into it
  saying what it does and how far it is (:class:`~mmapcache._file.create.LockStatus`: the check
  after a reboot does), which waiters log;
- ``<stem>.tmp-<pid>-<8 hex>``: the file a creator builds before linking it
  to ``N``; only a holder of the creation lock makes or deletes one (a packing
  plan is built under the same name and lock before it is renamed);
- ``<stem>.plan-<16 hex>``: a packing plan of ``mmapcache.torch.PackedSequences``
  (docs/format.md), the hex digits a digest of what it was made for (the
  cache's ``uuid``, the lengths of its documents, the packing arguments);
  ``mmapcache.remove`` deletes a cache's plans with it, ``mmapcache gc``
  deletes plans whose cache is gone.

A directory holding caches may also hold its byte budget (:mod:`mmapcache._file.budgets`), in hidden files
that are neither caches nor side files of one (``ls`` and ``gc`` pass them by):

- ``.mmapcache-budget`` (``BUDGET_NAME``): the budget set for the directory, one line of JSON;
- ``.mmapcache-reserve-<pid>-<8 hex>`` (``RESERVATION_PREFIX``): the bytes one live creator reserved,
  exclusively ``flock``-ed by it while it lives (a reservation whose lock is free is dead).

A stem is its own stem, so ``lock_path_for(directory / temp_stem(name,
directory))`` is the creation lock that guards the temp file ``name``:
``mmapcache gc`` can collect the leftovers of killed creators without knowing
the cache's name.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

__all__ = [
    "BUDGET_NAME",
    "CHECK_OWNER",
    "CHECK_PREFIX",
    "LOCK_SUFFIX",
    "PLAN_DIGITS",
    "PLAN_MARK",
    "RESERVATION_PREFIX",
    "SUFFIX",
    "TEMP_MARK",
    "is_cache_name",
    "is_reservation_name",
    "is_temp_name_of",
    "leftover_stem",
    "lock_path_for",
    "lock_stem",
    "name_max",
    "new_reservation_name",
    "new_temp_path",
    "plan_path_for",
    "plan_stem",
    "plans_of",
    "side_stem",
    "temp_stem",
]

# Cache files end in this; `mmapcache ls` and `gc` look only at such names.
SUFFIX = ".mmc"
# mmapcache.testing's private directories in default_dir(): `check-<random>`, holding an owner file that
# the running check keeps an exclusive flock on (free once it died: `mmapcache gc` then removes the directory).
CHECK_PREFIX = "check-"
CHECK_OWNER = ".owner"

# A directory's byte budget (see the module docstring): hidden names, so never a cache's or a side file's.
BUDGET_NAME = ".mmapcache-budget"
RESERVATION_PREFIX = ".mmapcache-reserve-"

LOCK_SUFFIX = ".lock"
TEMP_MARK = ".tmp-"
PLAN_MARK = ".plan-"
PLAN_DIGITS = 16  # hex digits of a plan's digest: ".plan-" + 16 = 22 bytes, within the longest side suffix
# ".tmp-" + a pid of up to 10 digits + "-" + 8 hex digits: the longest side suffix.
_SIDE_SUFFIX_MAX = len(TEMP_MARK) + 10 + 1 + 8
_HASH_DIGITS = 16
_EXTENSION_MAX = 16
_DEFAULT_NAME_MAX = 255


def name_max(directory: Path) -> int:
    """The longest file name (in bytes) the file system holding ``directory`` accepts."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _DEFAULT_NAME_MAX


def side_stem(path: Path) -> str:
    """The stem of the side files of the cache at ``path`` (see the module docstring)."""
    name = path.name
    encoded = os.fsencode(name)
    room = name_max(path.parent) - _SIDE_SUFFIX_MAX
    if len(encoded) <= room:
        return name
    extension = os.path.splitext(name)[1]
    if len(os.fsencode(extension)) > _EXTENSION_MAX:
        extension = ""
    tail = "~" + hashlib.sha256(encoded).hexdigest()[:_HASH_DIGITS] + extension
    keep = max(0, room - len(os.fsencode(tail)))
    while 0 < keep < len(encoded) and encoded[keep] & 0xC0 == 0x80:  # not inside a UTF-8 character
        keep -= 1
    return os.fsdecode(encoded[:keep]) + tail


def lock_path_for(path: Path) -> Path:
    """The creation lock of the cache at ``path``: ``<stem>.lock``."""
    return path.parent / (side_stem(path) + LOCK_SUFFIX)


def new_temp_path(path: Path) -> Path:
    """A fresh name to build the cache at ``path`` under: ``<stem>.tmp-<pid>-<8 hex>``."""
    return path.parent / f"{side_stem(path)}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def temp_stem(name: str, directory: Path) -> str | None:
    """The stem the temp file ``directory / name`` was made from (``None``: not a temp name).

    ``lock_path_for(directory / stem)`` is the creation lock that guards it.
    """
    stem, mark, tail = name.rpartition(TEMP_MARK)
    if not (mark and stem and _is_temp_tail(tail)) or side_stem(directory / stem) != stem:
        return None
    return stem


def is_temp_name_of(name: str, path: Path) -> bool:
    """Whether ``name`` (in ``path``'s directory) is a temp file of a creator of ``path``."""
    prefix = side_stem(path) + TEMP_MARK
    return name.startswith(prefix) and _is_temp_tail(name[len(prefix) :])


def _is_temp_tail(tail: str) -> bool:
    pid, dash, token = tail.partition("-")
    return pid.isdigit() and bool(dash) and bool(token)


def is_cache_name(name: str) -> bool:
    """Whether ``name`` is named like a cache (``*.mmc``, not hidden)."""
    return name.endswith(SUFFIX) and not name.startswith(".")


def new_reservation_name() -> str:
    """A fresh name for a creator's reservation: ``.mmapcache-reserve-<pid>-<8 hex>``."""
    return f"{RESERVATION_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def is_reservation_name(name: str) -> bool:
    """Whether ``name`` is named like a creator's reservation of budget bytes."""
    return name.startswith(RESERVATION_PREFIX) and _is_temp_tail(name[len(RESERVATION_PREFIX) :])


def leftover_stem(path: Path) -> str | None:
    """The side-file stem of the cache whose creator made the temp file ``path``, if it is one."""
    stem = temp_stem(path.name, path.parent)
    return stem if stem is not None and is_cache_name(stem) else None


def lock_stem(path: Path) -> str | None:
    """The side-file stem of the cache whose creation lock ``path`` is, if it is one (``<stem>.lock``)."""
    stem = path.name.removesuffix(LOCK_SUFFIX)
    if stem == path.name or not is_cache_name(stem) or lock_path_for(path.with_name(stem)) != path:
        return None
    return stem


def plan_path_for(path: Path, digest: str) -> Path:
    """The packing plan ``digest`` (16 hex digits) of the cache at ``path``: ``<stem>.plan-<digest>``."""
    if len(digest) != PLAN_DIGITS or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"a plan's digest is {PLAN_DIGITS} lowercase hex digits, got {digest!r}")
    return path.parent / f"{side_stem(path)}{PLAN_MARK}{digest}"


def plan_stem(path: Path) -> str | None:
    """The side-file stem of the cache whose packing plan ``path`` is, if it is one (``<stem>.plan-<hex>``)."""
    stem, mark, digest = path.name.rpartition(PLAN_MARK)
    if not (mark and is_cache_name(stem)) or len(digest) != PLAN_DIGITS:
        return None
    if any(c not in "0123456789abcdef" for c in digest) or side_stem(path.with_name(stem)) != stem:
        return None
    return stem


def plans_of(path: Path) -> list[Path]:
    """The packing plans of the cache at ``path`` present in its directory."""
    prefix = side_stem(path) + PLAN_MARK
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return sorted(path.parent / n for n in names if n.startswith(prefix) and plan_stem(path.parent / n) is not None)
