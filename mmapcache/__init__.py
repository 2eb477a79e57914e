"""mmapcache: a memory-mapped, file-backed dataset cache that every process on a node shares.

>>> from mmapcache import Cache, Field                       # doctest: +SKIP
>>> cache = Cache.open("/dev/shm/x.mmc", {"x": Field((3,), "float32")}, length=10)  # doctest: +SKIP
"""

from ._budget import Budget, CacheShare, budget, set_budget
from ._collect import GcReport, gc
from ._counters import Counts, Usage
from ._disk_usage import DiskUsage, disk_usage
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
from ._flight import Claims
from ._gather import accelerated
from ._heap import VariableRegion
from ._inspect import CacheInfo, info, list_caches
from ._jagged import Jagged
from ._paths import default_dir
from ._removal import in_use, remove
from ._resize import Resized, resize
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
