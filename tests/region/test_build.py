"""Building the compiled gather: optional by default, required with MMAPCACHE_REQUIRE_EXTENSION=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` of this checkout into ``tmp_path`` with a C compiler that always fails."""
    environment = {k: v for k, v in os.environ.items() if k != "MMAPCACHE_REQUIRE_EXTENSION"}
    environment.update(CC="false", LDSHARED="false", **env)
    command = [sys.executable, "setup.py", "-q", "build_ext"]
    command += ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "temp")]
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)


def test_a_build_without_a_compiler_goes_on_without_the_extension(tmp_path: Path) -> None:
    result = build(tmp_path)
    assert result.returncode == 0, result.stderr
    assert not list((tmp_path / "lib").rglob("_cgather*.so"))


def test_a_build_that_requires_the_extension_fails_without_a_compiler(tmp_path: Path) -> None:
    result = build(tmp_path, MMAPCACHE_REQUIRE_EXTENSION="1")
    assert result.returncode != 0
    assert "_cgather" in result.stdout + result.stderr
