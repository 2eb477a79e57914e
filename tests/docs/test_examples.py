"""The runnable examples run (with small sizes) and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CASES = {
    "quickstart.py": [],
    "concurrent_jobs.py": ["--length", "600"],
    "imagefolder.py": ["--count", "300", "--side", "96", "--size", "32", "--epochs", "2"],
    "lightning_ddp.py": ["--length", "256"],
    "property_test_concurrent.py": ["--examples", "3"],
    "text_tokens.py": ["--count", "300", "--batch-size", "16", "--workers", "1"],
    "detection_boxes.py": ["--count", "60", "--max-side", "48", "--batch-size", "8", "--workers", "1"],
    "recipe_torchvision.py": ["--count", "120", "--short-side", "48", "--crop", "32", "--workers", "2"],
    "recipe_hf_datasets.py": ["--count", "120", "--side", "16", "--workers", "2"],
    "recipe_hf_tokens.py": ["--count", "400", "--vocab", "300", "--workers", "2"],
    "recipe_packed.py": ["--count", "300", "--vocab", "300", "--seq-len", "128"],
    "recipe_lightning.py": ["--length", "256", "--devices", "2", "--workers", "1", "--epochs", "1"],
    "recipe_from_stocaching.py": ["--length", "300", "--workers", "2"],
    "stream_tokens.py": ["--count", "600", "--workers", "2", "--epochs", "2"],
}


def test_every_example_is_exercised() -> None:
    assert sorted(CASES) == sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "args"), list(CASES.items()), ids=list(CASES))
def test_example_runs(script: str, args: list[str], cache_dir: Path) -> None:
    default = cache_dir / "default"
    env = {**os.environ, "MMAPCACHE_DIR": str(default), "TMPDIR": str(cache_dir)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cache_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{script} printed nothing"
    # Hypothesis keeps its example database in the working directory.
    left = [str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file() and ".hypothesis" not in p.parts]
    assert left == [], f"{script} left files behind: {sorted(left)}"
