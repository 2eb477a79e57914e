"""The file format as pure bytes: the spec (``spec``, its docstring the normative text), the header codec,
checksums, and the units (sizes, durations, times) the format and messages use. No I/O. Used by every other
layer.
"""

from .digests import checksum, checksums
from .header import PREFIX_SIZE, new_header, pack_header, unpack_header, unpack_prefix
from .sizes import format_age, format_bytes, parse_bytes, parse_duration
from .spec import (
    ALIGNMENT,
    COUNTER_RECORD_SIZE,
    ELEMENT_RECORD_SIZE,
    MAGIC,
    MAX_FILE_SIZE,
    MAX_PARTITIONS,
    PARTITION_RECORD_SIZE,
    PAYLOAD_ALIGNMENT,
    Header,
    Layout,
    align,
    align_down,
    compute_layout,
    descriptor_nbytes,
    extent_size_for,
    field_slot_nbytes,
    indices_digest,
    max_slots,
    slot_nbytes,
)
from .times import iso_time

__all__ = [
    "ALIGNMENT",
    "COUNTER_RECORD_SIZE",
    "ELEMENT_RECORD_SIZE",
    "MAGIC",
    "MAX_FILE_SIZE",
    "MAX_PARTITIONS",
    "PARTITION_RECORD_SIZE",
    "PAYLOAD_ALIGNMENT",
    "PREFIX_SIZE",
    "Header",
    "Layout",
    "align",
    "align_down",
    "checksum",
    "checksums",
    "compute_layout",
    "descriptor_nbytes",
    "extent_size_for",
    "field_slot_nbytes",
    "format_age",
    "format_bytes",
    "indices_digest",
    "iso_time",
    "max_slots",
    "new_header",
    "pack_header",
    "parse_bytes",
    "parse_duration",
    "slot_nbytes",
    "unpack_header",
    "unpack_prefix",
]
