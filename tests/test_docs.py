"""Every Python example in docs/ runs (the README's: tests/test_readme.py); the format spec in docs matches the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mmapcache._format

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted((ROOT / "docs").glob("*.md"))
# operating.md interleaves shell sessions with Python; tests/test_cli.py runs both kinds in order.
# The README's blocks each run alone, as a reader copies them: tests/test_readme.py.
PYTHON_ONLY = [d for d in DOCUMENTS if d.name != "operating.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_format_doc_is_the_format_module_docstring() -> None:
    text = (ROOT / "docs" / "format.md").read_text(encoding="utf-8")
    assert mmapcache._format.__doc__ is not None
    assert text.endswith(mmapcache._format.__doc__)


def python_blocks(document: Path) -> list[str]:
    return BLOCK.findall(document.read_text(encoding="utf-8"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("document", [d for d in PYTHON_ONLY if python_blocks(d)], ids=lambda d: d.name)
def test_examples_run(document: Path, cache_dir: Path) -> None:
    """A document's blocks run in order as one script, in a scratch directory, like a reader would."""
    script = "\n\n".join(python_blocks(document))
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir / "default")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=cache_dir, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{document.name} examples failed:\n{result.stdout}\n{result.stderr}"
    leftovers = [p for p in (cache_dir / "default").rglob("*.mmc")] if (cache_dir / "default").exists() else []
    assert leftovers == [], f"{document.name} examples leave caches behind: {leftovers}"


def test_every_public_name_is_in_the_api_reference() -> None:
    import mmapcache

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in mmapcache.__all__ if not name.startswith("__") and f"`{name}" not in text]
    assert missing == [], f"docs/api.md does not document {missing}"


def test_no_page_calls_a_format_version_that_exists_planned() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for found in re.finditer(r"planned for (?:format )?version (\d+)", page.read_text()):
            assert int(found.group(1)) > mmapcache._format.FORMAT_VERSION, f"{page.name}: {found.group(0)!r}"
