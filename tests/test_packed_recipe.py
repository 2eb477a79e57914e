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

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "recipe_packed.py"


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
