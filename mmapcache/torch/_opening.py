"""A dataset's existing cache file opened — and a refuted one removed, to be created anew.

A file whose fields were inferred from a first sample that the rest of the
dataset does not fit is marked refuted (:meth:`Cache.refute`); the next
session that opens it removes it (only the very file it opened) and reports
the file missing, so that it is created again with the right fields.
"""

from __future__ import annotations

import logging
import os

from .._removal import remove
from ..cache import Cache
from ._settings import Settings

__all__ = ["open_existing"]

log = logging.getLogger("mmapcache")


def open_existing(settings: Settings) -> Cache | None:
    """The existing file, or None: missing, or refuted (removed here, to be created anew)."""
    if settings.length == 0:
        return None  # an empty shard has no file
    while True:
        try:
            named = os.stat(settings.path, follow_symlinks=False)
            cache = Cache.open(
                settings.path,
                length=settings.length,
                key=settings.key,
                verify=settings.verify,
                dataset_indices=settings.cached_indices,
                timeout=settings.timeout,
            )
        except FileNotFoundError:
            return None
        if not cache.refuted:
            return cache
        # A first try created it from a sample whose shapes the rest of the dataset does not share: it
        # is never used again, so it is replaced even while processes of that try still hold it (they
        # keep their nameless copy). mmapcache never links a removed file again, so the name held the
        # opened file if it names the same one before and after the open; only that one is removed —
        # another process may have replaced it already.
        cache.close()
        try:
            if not os.path.samestat(named, os.stat(settings.path, follow_symlinks=False)):
                continue
            remove(settings.path, force=True, timeout=settings.timeout, same_as=named)
        except FileNotFoundError:
            continue  # replaced or removed meanwhile: open what the name holds now
        log.warning("removed %s: its fields were found not to fit the dataset; creating it anew", settings.path)
        return None
