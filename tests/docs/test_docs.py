"""Every Python example in docs/ runs (the README's: tests/docs/test_readme.py); the format spec is the code's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mmapcache._format.spec

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted((ROOT / "docs").glob("*.md"))
# operating.md interleaves shell sessions with Python; tests/admin/test_cli.py runs both kinds in order.
# The README's blocks each run alone, as a reader copies them: tests/docs/test_readme.py.
PYTHON_ONLY = [d for d in DOCUMENTS if d.name != "operating.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_format_doc_is_the_format_module_docstring() -> None:
    text = (ROOT / "docs" / "format.md").read_text(encoding="utf-8")
    assert mmapcache._format.spec.__doc__ is not None
    assert text.endswith(mmapcache._format.spec.__doc__)


def python_blocks(document: Path) -> list[str]:
    return BLOCK.findall(document.read_text(encoding="utf-8"))


# `print(...)  # what it prints`: a line that shows its output in a comment (after it, `<- a remark` may follow).
SHOWN = re.compile(r"^(?P<indent>\s*)print\((?P<args>.*)\)  # (?P<shown>.*?)(?:\s+<-.*)?$")
_SHOW = """
def __shown(line, *args, **kwargs):
    import io, json
    buffer = io.StringIO()
    print(*args, file=buffer, **kwargs)
    print(buffer.getvalue(), end="")
    with open(__SHOWN_FILE, "a") as f:
        f.write(json.dumps([line, buffer.getvalue().rstrip("\\n")]) + "\\n")
"""


def with_shown_outputs(script: str, record: Path) -> tuple[str, dict[int, str]]:
    """``script`` with each ``print(...)  # shown`` recording what it printed in ``record``; ``{line: shown}``."""
    lines, shown = [], {}
    for number, line in enumerate(script.splitlines()):
        found = SHOWN.match(line)
        if found is None:
            lines.append(line)
            continue
        shown[number] = found["shown"].strip()
        lines.append(f"{found['indent']}__shown({number}, {found['args']})")
    return f"__SHOWN_FILE = {str(record)!r}\n{_SHOW}\n" + "\n".join(lines), shown


def shows(shown: str, printed: str) -> bool:
    """Whether a page's ``shown`` output is what was ``printed``.

    Whitespace runs compare equal; ``...`` stands for anything, and so does a
    placeholder such as ``<user>``; a remark may follow the output after ``: ``
    (``9: one sample``); a print that runs more than once shows its outputs as ``0 22, then 1 32``.
    """
    printed = " ".join(printed.split())
    if ", then " in shown:
        return any(shows(each, printed) for each in shown.split(", then "))
    candidates = [shown] + [shown[: m.start()] for m in re.finditer(r": ", shown)]
    for candidate in candidates:
        parts = re.split(r"\s*(?:\.\.\.|<[\w-]+>)\s*", " ".join(candidate.split()))
        if re.fullmatch(".*?".join(map(re.escape, parts)), printed, re.S):
            return True
    return False


def check_shown(document: str, record: Path, shown: dict[int, str]) -> None:
    """Every ``print`` whose output a page shows printed exactly that (each time it ran)."""
    import json

    printed = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    wrong = [(shown[k], text) for k, text in printed if not shows(shown[k], text)]
    assert wrong == [], f"{document}: the page shows (left) what its code does not print (right): {wrong}"
    never = sorted(set(shown) - {k for k, _ in printed})
    assert never == [], f"{document}: prints whose shown output never printed: {[shown[k] for k in never]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("document", [d for d in PYTHON_ONLY if python_blocks(d)], ids=lambda d: d.name)
def test_examples_run_and_print_what_the_page_shows(document: Path, cache_dir: Path) -> None:
    """A document's blocks run in order as one script, in a scratch directory, like a reader would,
    and every ``print(...)  # output`` prints the output the page shows."""
    record = cache_dir / "shown.jsonl"
    script, shown = with_shown_outputs("\n\n".join(python_blocks(document)), record)
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir / "default")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=cache_dir, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{document.name} examples failed:\n{result.stdout}\n{result.stderr}"
    check_shown(document.name, record, shown)
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
            assert int(found.group(1)) > mmapcache._format.spec.FORMAT_VERSION, f"{page.name}: {found.group(0)!r}"
