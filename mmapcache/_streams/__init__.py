"""The cache of a stream: opening or restarting a fill, one partition's writer, a complete cache's records and
their per-epoch split. Used by ``mmapcache.torch.CachedStream`` and administration.
"""

from .stream_cache import (
    Partition,
    PartitionWriter,
    StreamPlan,
    StreamStatus,
    checked_records,
    describe,
    epoch_slots,
    open_stream,
    per_rank,
    plan_stream,
    rank_ended,
    read_stream_status,
    region,
    stream_status,
    usable,
)

__all__ = [
    "Partition",
    "PartitionWriter",
    "StreamPlan",
    "StreamStatus",
    "checked_records",
    "describe",
    "epoch_slots",
    "open_stream",
    "per_rank",
    "plan_stream",
    "rank_ended",
    "read_stream_status",
    "region",
    "stream_status",
    "usable",
]
