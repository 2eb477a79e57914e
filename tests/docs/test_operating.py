"""What docs/operating.md tells operators about changing cache files under running jobs, checked for real.

Truncating a cache file that a process has mapped kills that process with
SIGBUS when it next reads (the kernel's rule for shared mappings); removing the
name with ``mmapcache rm --force`` leaves it reading its intact file.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _caches import FIELDS, make_cache

from mmapcache import Cache

DOC = Path(__file__).resolve().parents[2] / "docs" / "operating.md"

# Opens the cache, says so, waits for a line on stdin, then reads every sample and checks it.
READER = """
import sys
import numpy as np
from mmapcache import Cache
cache = Cache.open(sys.argv[1], readonly=True)
print("ready", flush=True)
sys.stdin.readline()
for i in range(len(cache)):
    sample = cache[i]
    assert (sample["image"] == i).all() and int(sample["label"]) == i, i
print("read", len(cache), flush=True)
"""


def start_reader(path: Path) -> subprocess.Popen[str]:
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout is not None
    assert reader.stdout.readline().strip() == "ready"
    return reader


def finish(reader: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = reader.communicate("go\n", timeout=60)
    return reader.returncode, out


@pytest.mark.timeout(120)
def test_truncating_a_cache_in_use_kills_its_readers_with_sigbus(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", length=200, filled=200)
    reader = start_reader(path)
    try:
        os.truncate(path, 0)  # what `truncate -s 0`, `: >` and `cp other.mmc a.mmc` do first
        status, _ = finish(reader)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert status == -signal.SIGBUS
    assert "SIGBUS" in DOC.read_text(encoding="utf-8")


@pytest.mark.timeout(120)
def test_mmapcache_rm_leaves_readers_their_file_and_new_openers_get_a_new_one(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", length=200, filled=200)
    old = os.stat(path)
    reader = start_reader(path)
    try:
        script = shutil.which("mmapcache")
        assert script is not None
        refused = subprocess.run([script, "rm", str(path)], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1  # in use
        assert refused.stderr.startswith("CacheInUseError: ")
        forced = subprocess.run([script, "rm", "--force", str(path)], capture_output=True, text=True, timeout=60)
        assert forced.returncode == 0, forced.stderr
        with Cache.open(path, FIELDS, 200, key="k") as fresh:  # a new opener: a new, empty file
            assert fresh.filled == 0
            fresh.put(0, {"image": np.full((3, 4, 4), 99, np.uint8), "label": 99})
        assert not os.path.samestat(old, os.stat(path))
        status, out = finish(reader)  # still reads the old file, intact
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert (status, out.strip()) == (0, "read 200")


# -- the sample outputs of ls and info are what the commands print ----------------------------

_VOLATILE = [  # (in a page's line, what a real line has there): what differs between runs and machines
    (r"/dev/shm/mmapcache-alice", r"\S+"),
    (r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r"\S+"),
    (r"on node017 by pid 19375 \(uid 1000,", r"on \S+ by pid \d+ \(uid \d+,"),
    (r"[\d.]+ GiB free", r"[\d.]+ \w+ free"),
    (r"budget 22\.6 GiB", r"budget [\d.]+ \w+"),
    (r"just now", r"(?:just now|\d+s ago)"),
]


def _sample(section: str) -> list[str]:
    """The output lines the page shows after ``$ mmapcache <section>`` (its first console block with it)."""
    lines = DOC.read_text().split(f"$ mmapcache {section}\n", 1)[1].split("```", 1)[0].splitlines()
    return [line for line in lines if line.strip()]


def _pattern(line: str) -> str:
    """A page's sample line as a pattern for the real one: whitespace runs alike, volatile parts free."""
    text = " ".join(line.split())
    for k, (volatile, _) in enumerate(_VOLATILE):
        text = re.sub(volatile, f"VOLATILE{k}X", text)
    pattern = re.escape(text)
    for k, (_, real) in enumerate(_VOLATILE):
        pattern = pattern.replace(f"VOLATILE{k}X", real)
    return pattern


@pytest.mark.parametrize("section", ["ls", "info demo"])
def test_the_sample_outputs_are_what_the_commands_print(section: str, cache_dir: Path) -> None:
    import mmapcache

    setup = DOC.read_text().split("```python\n", 1)[1].split("```", 1)[0]  # the page's demo cache
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir)}
    subprocess.run([sys.executable, "-c", setup], env=env, check=True)
    printed = subprocess.run(
        [sys.executable, "-m", "mmapcache", *section.split()], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    shown = _sample(section)
    assert len(printed) == len(shown), (printed, shown)
    for page, real in zip(shown, printed, strict=True):
        matches = re.fullmatch(_pattern(page), " ".join(real.split()))
        assert matches, f"the page shows {page!r}, the command prints {real!r}"
    if section.startswith("info"):
        assert f"mmapcache {mmapcache.__version__})" in "\n".join(shown)  # the page names this version
    mmapcache.remove(cache_dir / "demo.mmc")
