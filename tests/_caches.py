"""Helpers shared by the operating tests (tests/admin/test_admin.py, tests/admin/test_cli.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mmapcache import Cache, Field

FIELDS = {"image": Field((3, 4, 4), "uint8"), "label": Field((), "int64")}
DAY = 86400.0


def make_cache(path: Path, *, length: int = 10, filled: int = 0, key: str = "k", capacity: int | None = None) -> Path:
    with Cache.open(path, FIELDS, length, key=key, capacity=capacity) as cache:
        for i in range(filled):
            cache.put(i, {"image": np.full((3, 4, 4), i, np.uint8), "label": i})
    return path


def age(path: Path, seconds: float) -> None:
    """Make ``path`` look last used ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


HOLDER = """
import sys, time
from mmapcache import Cache
cache = Cache.open(sys.argv[1], readonly=sys.argv[2] == "ro")
print("ready", flush=True)
time.sleep(120)
"""


class Holder:
    """Another process that has a cache open until it is killed."""

    def __init__(self, path: Path, *, readonly: bool = True) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), "ro" if readonly else "rw"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL it (no chance to close anything) and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()
