"""The mapped region of an open file: the slot table, the one writer, variable values and their allocator,
gathers (compiled and numpy), read-ahead, single flight, maintenance. Used by ``mmapcache.cache.Cache``,
streams and the torch layer (through the names below).
"""

from typing import TYPE_CHECKING, Any

from .allocator import VariableRegion, place
from .attaching import attach
from .counters import REFUTED, Counts, Usage, read_flags, read_usage
from .flight import WAIT_TIMEOUT, Claims, Flight, SingleFlight
from .gathers import FixedRows, accelerated, compiled, empty_aligned, gather, take_parts, take_ready
from .handle import closed_error
from .indices import as_given, check_index, check_out, index_array
from .jagged import Jagged
from .maintenance import clear_cache, sync_cache, verify_cache
from .mapped import Mapped
from .partitions import _ALLOCATED, _ELEMENT, _PARTITION, ENDED, FULL, HOLE, PartitionState, StreamRegion, read_region
from .residency import resident_bytes
from .slots import READY, STRONGLY_ORDERED, WRITING
from .values import coerce_value
from .variable import VariableColumn, text_value, value_bytes
from .verify import Problem, intact_parts
from .writer import Writer, readonly_error

if TYPE_CHECKING:
    from .tensors import BITS, as_tensor, nested, tensor_to_numpy, torch_dtype

# Imported when first asked for: they import torch, which the core never imports at import time.
_LAZY = {
    "BITS": "tensors",
    "as_tensor": "tensors",
    "nested": "tensors",
    "tensor_to_numpy": "tensors",
    "torch_dtype": "tensors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BITS",
    "ENDED",
    "FULL",
    "HOLE",
    "READY",
    "REFUTED",
    "STRONGLY_ORDERED",
    "WAIT_TIMEOUT",
    "WRITING",
    "_ALLOCATED",
    "_ELEMENT",
    "_PARTITION",
    "Claims",
    "Counts",
    "FixedRows",
    "Flight",
    "Jagged",
    "Mapped",
    "PartitionState",
    "Problem",
    "SingleFlight",
    "StreamRegion",
    "Usage",
    "VariableColumn",
    "VariableRegion",
    "Writer",
    "accelerated",
    "as_given",
    "as_tensor",
    "attach",
    "check_index",
    "check_out",
    "clear_cache",
    "closed_error",
    "coerce_value",
    "compiled",
    "empty_aligned",
    "gather",
    "index_array",
    "intact_parts",
    "nested",
    "place",
    "read_flags",
    "read_region",
    "read_usage",
    "readonly_error",
    "resident_bytes",
    "sync_cache",
    "take_parts",
    "take_ready",
    "tensor_to_numpy",
    "text_value",
    "torch_dtype",
    "value_bytes",
    "verify_cache",
]
