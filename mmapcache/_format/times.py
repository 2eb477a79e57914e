"""Times as mmapcache writes them: in a header's creation metadata, in ``mmapcache ls``/``info``, in messages."""

from __future__ import annotations

import time

__all__ = ["iso_time"]


def iso_time(timestamp: float | None = None) -> str:
    """``timestamp`` (default: now) as ISO 8601 UTC, to the second: ``2026-11-30T05:46:11Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
