"""mmapcache: a memory-mapped, file-backed dataset cache that every process on a node shares.

>>> from mmapcache import Cache, Field                       # doctest: +SKIP
>>> cache = Cache.open("/dev/shm/x.mmc", {"x": Field((3,), "float32")}, length=10)  # doctest: +SKIP
"""

from ._admin import CacheInfo, DiskUsage, GcReport, Resized, disk_usage, gc, info, list_caches, resize
from ._errors import (
    CacheError,
    CacheFormatError,
    CacheInUseError,
    CacheMissError,
    CacheSpaceError,
    CacheTimeoutError,
    ReadonlyCacheError,
    SchemaMismatchError,
    StaleCacheError,
    UnsafeCacheFileError,
)
from ._field import Field
from ._file import Budget, CacheShare, budget, default_dir, in_use, remove, set_budget
from ._moved import install as _install_moved
from ._region import Claims, Counts, Jagged, Usage, VariableRegion, accelerated
from ._version import __version__
from .cache import Cache, Problem

__all__ = [
    "Budget",
    "Cache",
    "CacheError",
    "CacheFormatError",
    "CacheInUseError",
    "CacheInfo",
    "CacheMissError",
    "CacheShare",
    "CacheSpaceError",
    "CacheTimeoutError",
    "Claims",
    "Counts",
    "DiskUsage",
    "Field",
    "GcReport",
    "Jagged",
    "Problem",
    "ReadonlyCacheError",
    "Resized",
    "SchemaMismatchError",
    "StaleCacheError",
    "UnsafeCacheFileError",
    "Usage",
    "VariableRegion",
    "__version__",
    "accelerated",
    "budget",
    "default_dir",
    "disk_usage",
    "gc",
    "in_use",
    "info",
    "list_caches",
    "remove",
    "resize",
    "set_budget",
]

# Pickles name the public module, whatever file the class lives in (names earlier releases
# pickled under still load: ``_moved``).
for _public in (
    Budget, CacheInfo, CacheShare, Claims, Counts, DiskUsage, GcReport, Jagged, Problem, Resized, Usage, VariableRegion
):  # fmt: skip
    _public.__module__ = __name__
_install_moved()
del _public
