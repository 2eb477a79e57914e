"""docs/mixtures.md: its examples run as one script and print exactly what the page says they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "mixtures.md"
FENCE = re.compile(r"^```(python|text)\n(.*?)^```", re.S | re.M)


def test_the_mixtures_page_prints_what_it_says(cache_dir: Path) -> None:
    blocks = FENCE.findall(PAGE.read_text(encoding="utf-8"))
    script = "\n\n".join(body for kind, body in blocks if kind == "python")
    printed = "".join(body for kind, body in blocks if kind == "text")
    assert printed, "the page shows what its examples print"
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir / "default")}
    (cache_dir / "default").mkdir(mode=0o700)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=cache_dir, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout == printed
    assert list((cache_dir / "default").rglob("*.mmc")) == [], "the examples remove their caches"


def test_the_guide_and_the_reference_link_the_mixtures_page() -> None:
    assert "mixtures.md" in (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    assert "mmapcache.torch.Mixture" in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
