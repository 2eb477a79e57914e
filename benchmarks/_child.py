"""A benchmark's child process, driven over JSON lines: the parent's :class:`Child` and the child's :func:`reply`.

Peers that cannot share the parent's interpreter (stocaching pins numpy<2 and
lives in its own virtualenv) run as a child of the same script; so do the
processes whose memory or CPU time is measured on their own. The child prints
its answers to stdout prefixed with :data:`MARK`, one JSON object a line; any
other line (libraries print too) is passed through to the parent's stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MARK = "@@"  # prefix of protocol lines on a child's stdout (stocaching prints to stdout too)

__all__ = ["MARK", "Child", "reply"]


def reply(obj: dict[str, Any]) -> None:
    """Send one message to the parent (from the child)."""
    print(MARK + json.dumps(obj), flush=True)


class Child:
    """The parent's end of ``python script argv...`` speaking the JSON-lines protocol.

    With ``handshake`` the child's first message (its ``hello``) is read at once.
    """

    def __init__(self, python: str, script: str | Path, argv: list[str], *, handshake: bool = True) -> None:
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            [python, str(Path(script).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello: dict[str, Any] = self.read() if handshake else {}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child {self.proc.args!r} exited with {self.proc.wait()}")
            if line.startswith(MARK):
                message: dict[str, Any] = json.loads(line[len(MARK) :])
                return message
            sys.stderr.write(f"  [child {self.proc.pid}] {line}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(json.dumps(cmd))
        return self.read()

    def close(self) -> None:
        """Ask the child to quit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit")
                self.proc.wait(timeout=60)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
