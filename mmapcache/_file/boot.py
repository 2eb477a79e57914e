"""The kernel's boot id, and the boot page that records it in a file (format version 5).

The boot page holds the boot id (``/proc/sys/kernel/random/boot_id``, new at
every boot) of the boot whose page cache the slots were last trusted in. What a
reader does when it differs — compare the slots that may have been torn — is in
``_reboot``.
"""

from __future__ import annotations

import functools
import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from .._format import ALIGNMENT

__all__ = ["BOOT_ID_PATH", "BootPage", "boot_page", "current_boot_id"]

log = logging.getLogger("mmapcache")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_ID_SIZE = 16


@functools.cache
def current_boot_id() -> bytes:
    """The running kernel's boot id as 16 bytes (zeros where the kernel does not tell: reboots go unnoticed)."""
    try:
        return uuid.UUID(BOOT_ID_PATH.read_text().strip()).bytes
    except (OSError, ValueError):
        log.debug("no boot id at %s: reboots cannot be detected", BOOT_ID_PATH)
        return bytes(_ID_SIZE)


def boot_page() -> bytes:
    """The boot page a creator writes: the running boot id, then zeros."""
    return current_boot_id() + bytes(ALIGNMENT - _ID_SIZE)


class BootPage:
    """The boot id in a mapping of a version 5 file."""

    __slots__ = ("_view",)

    def __init__(self, buffer: Any, offset: int) -> None:
        self._view = np.ndarray((_ID_SIZE,), np.uint8, buffer=buffer, offset=offset)

    @property
    def boot_id(self) -> bytes:
        return bytes(self._view.tobytes())

    def current(self) -> bool:
        """Whether the file was last trusted in this boot (one 16-byte comparison)."""
        return bytes(self._view.tobytes()) == current_boot_id()

    def record(self) -> None:
        self._view[:] = np.frombuffer(current_boot_id(), np.uint8)
