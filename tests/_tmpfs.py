"""A real tmpfs for the tests of a full file system (root only; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at ``mount_point`` (created, then unmounted and removed); skips when not root."""
    if not IS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True)
    if result.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
        mount_point.rmdir()
