"""examples/recipe_packed.py (the docs/recipes.md section's full version): what it prints holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="the recipe uses Hugging Face datasets and tokenizers")
pytest.importorskip("tokenizers", reason="the recipe uses Hugging Face datasets and tokenizers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "recipe_packed.py"


@pytest.mark.timeout(300)
def test_the_packed_recipe_trains_on_packed_batches_resumes_and_leaves_nothing(cache_dir: Path) -> None:
    default = cache_dir / "default"
    env = {**os.environ, "MMAPCACHE_DIR": str(default), "TMPDIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--count", "300", "--vocab", "300", "--seq-len", "128"],
        cwd=cache_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 300
    assert summary["sequences"] * 128 >= summary["tokens"]
    assert summary["padding below 2%"] is True
    assert summary["every token once"] is True
    assert summary["attention across documents"] == 0
    assert summary["resumed batches"] == -(-summary["sequences"] // 4) - 2
    assert summary["loss finite"] is True
    assert not [p for p in cache_dir.rglob("*") if p.is_file()], "the recipe removes the cache and its plan"


def _section_block(document: str, heading: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / document).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", len(heading))]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _expected_prints(block: str) -> list[str]:
    """What each ``print`` of a block says it prints: its ``# comment`` (on its line or the next), before any ': '."""
    lines = block.splitlines()
    expected = []
    for k, line in enumerate(lines):
        if not line.startswith("print("):
            continue
        comment = line.partition("  # ")[2] or lines[k + 1].removeprefix("# ")
        expected.append(comment.split(": ", 1)[0])
    return expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("document", "heading"),
    [("recipes.md", "## Packed sequences for a varlen-attention model"), ("torch.md", "## Packed sequences: ")],
)
def test_the_docs_packed_sections_print_what_they_say(document: str, heading: str, cache_dir: Path) -> None:
    block = _section_block(document, heading)
    prelude = "import numpy as np\nimport torch\nimport mmapcache\nfrom mmapcache.torch import CachedDataset\n"
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir / "default")}
    done = subprocess.run(
        [sys.executable, "-c", prelude + block], cwd=cache_dir, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == _expected_prints(block)
    assert not list((cache_dir / "default").rglob("*.mmc*")), "the block removes its cache and plan"
