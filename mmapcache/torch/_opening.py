"""A dataset's existing cache file opened — and a refuted one removed, to be created anew.

A file whose fields were inferred from a first sample that the rest of the
dataset does not fit is marked refuted (:meth:`Cache.refute`); the next
session that opens it removes it (only the very file it opened, with
:func:`mmapcache.cache.open_unrefuted`, which ``CachedStream`` shares) and
reports the file missing, so that it is created again with the right fields.
"""

from __future__ import annotations

from ..cache import Cache, open_unrefuted
from ._settings import Settings

__all__ = ["open_existing"]


def open_existing(settings: Settings) -> Cache | None:
    """The existing file, or None: missing, or refuted (removed here, to be created anew)."""
    if settings.length == 0:
        return None  # an empty shard has no file
    return open_unrefuted(
        settings.path,
        lambda: Cache.open(
            settings.path,
            length=settings.length,
            key=settings.key,
            verify=settings.verify,
            dataset_indices=settings.cached_indices,
            timeout=settings.timeout,
        ),
        timeout=settings.timeout,
    )
