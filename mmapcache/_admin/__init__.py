"""Administration as library calls: ``ls``/``info``, ``gc``, ``du``/``df``, ``resize``, the byte budget, and the
reports the command prints. Used by ``mmapcache`` (public names) and ``mmapcache.cli``.
"""

from .df import DiskUsage, disk_usage
from .garbage import DEFAULT_GC_AGE, GcReport, gc, is_lock_name, orphan_lock, remove_orphan_lock
from .listing import CacheInfo, error_message, info, list_caches
from .reports import format_budget, format_df, format_gc, format_info, format_ls, format_problems
from .resizing import Resized, resize

__all__ = [
    "DEFAULT_GC_AGE",
    "CacheInfo",
    "DiskUsage",
    "GcReport",
    "Resized",
    "disk_usage",
    "error_message",
    "format_budget",
    "format_df",
    "format_gc",
    "format_info",
    "format_ls",
    "format_problems",
    "gc",
    "info",
    "is_lock_name",
    "list_caches",
    "orphan_lock",
    "remove_orphan_lock",
    "resize",
]
