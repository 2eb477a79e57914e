"""Every code block of the README runs as-is, alone, in a fresh file or shell, and leaves nothing behind.

A newcomer copies one block into a file and runs it: so each ``python`` block
runs by itself (not after the blocks above it) as a script, once with the
default start method and once with ``forkserver`` (Python 3.14's default on
Linux), whose DataLoader workers re-import the script. Each ``bash`` block
runs in a fresh shell; installing is CI's job (``.ci/run``), so ``pip
install`` steps are checked to be the ones CI runs rather than run again, and
the test suite does not run itself.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
SHM = Path("/dev/shm")
# The README's test command, which .ci/run runs as-is.
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == language]


def block_id(body: str) -> str:
    first = next(line for line in body.splitlines() if line.strip() and not line.startswith(("import", "from")))
    return re.sub(r"\W+", "-", first.strip())[:40].strip("-")


def ours_in_shm() -> set[str]:
    """What mmapcache could leave in /dev/shm: cache-like names at the top, and the per-user default directory."""
    if not SHM.is_dir():
        return set()
    found = {name for name in os.listdir(SHM) if ".mmc" in name}
    default = SHM / f"mmapcache-{pwd.getpwuid(os.geteuid()).pw_name}"
    if default.is_dir():
        found |= {f"{default.name}/{name}" for name in os.listdir(default)}
    return found


def run_leaving_nothing(command: list[str], cache_dir: Path, *, extra_env: dict[str, str] | None = None) -> str:
    """Run ``command`` in an empty directory with its own MMAPCACHE_DIR; both must be empty afterwards."""
    cwd, caches = cache_dir / "cwd", cache_dir / "caches"
    cwd.mkdir()
    caches.mkdir(mode=0o700)
    env = {**os.environ, "MMAPCACHE_DIR": str(caches), **(extra_env or {})}
    before = ours_in_shm()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command[-1]}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr
    assert not caches.exists() or os.listdir(caches) == [], "the block leaves caches behind"
    assert os.listdir(cwd) == [], "the block leaves files in the working directory"
    assert ours_in_shm() <= before, f"the block leaves files in /dev/shm: {ours_in_shm() - before}"
    return result.stdout


FORKSERVER = "import multiprocessing\nmultiprocessing.set_start_method('forkserver', force=True)\n"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("start_method", ["default", "forkserver"])
@pytest.mark.parametrize("body", blocks("python"), ids=block_id)
def test_python_block_runs_alone_in_a_fresh_file(body: str, start_method: str, cache_dir: Path) -> None:
    script = cache_dir / "example.py"
    script.write_text(body, encoding="utf-8")
    extra_env = {}
    if start_method == "forkserver":
        # Every process of the run (workers included) starts with forkserver as its default.
        site = cache_dir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(FORKSERVER, encoding="utf-8")
        extra_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    run_leaving_nothing([sys.executable, str(script)], cache_dir, extra_env=extra_env)


def test_the_torch_example_prints_what_the_workers_cached(cache_dir: Path) -> None:
    (body,) = [b for b in blocks("python") if "CachedDataset" in b]
    assert 'if __name__ == "__main__":' in body
    script = cache_dir / "example.py"
    script.write_text(body, encoding="utf-8")
    out = run_leaving_nothing([sys.executable, str(script)], cache_dir)
    first, second = out.splitlines()
    # The first epoch misses (almost) everything and fills the cache; the second only hits.
    found = re.fullmatch(r"epoch 0: (\d+) hits, (\d+) misses; 1000 of 1000 samples cached", first)
    assert found is not None, first
    assert int(found[1]) + int(found[2]) == 1000
    assert int(found[2]) >= 990
    assert second == "epoch 1: 1000 hits, 0 misses; 1000 of 1000 samples cached"


def shell_steps(body: str) -> list[str]:
    """A bash block's commands, without the install steps (checked separately) and the test suite itself."""
    steps = []
    for line in body.splitlines():
        for step in line.split(" && "):
            step = step.strip()
            if step and not step.startswith(("pip install ", "#")) and step != "python -m pytest":
                steps.append(step)
    return steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("body", blocks("bash"), ids=block_id)
def test_bash_block_runs_in_a_fresh_shell(body: str, cache_dir: Path) -> None:
    assert subprocess.run(["bash", "-n", "-c", body]).returncode == 0
    steps = shell_steps(body)
    if not steps:  # installs and runs this suite: test_the_test_command_is_the_one_ci_runs
        assert body.strip() == TEST_COMMAND
        return
    # Scripts named in the README live in the repository: run them from there, in a fresh shell.
    script = " && ".join(step.replace("examples/", f"{ROOT}/examples/") for step in steps)
    run_leaving_nothing(["bash", "-e", "-c", script], cache_dir)


def test_the_test_command_is_the_one_ci_runs() -> None:
    assert any(TEST_COMMAND in body for body in blocks("bash"))
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_install_advice_names_the_cpu_wheel_index() -> None:
    text = README.read_text(encoding="utf-8")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text


def test_the_quick_start_leaves_no_empty_default_directory(cache_dir: Path) -> None:
    # Without MMAPCACHE_DIR: the per-user directory in /dev/shm that default_dir() makes goes too.
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    default = SHM / f"mmapcache-{pwd.getpwuid(os.geteuid()).pw_name}"
    if default.exists():
        pytest.skip(f"{default} exists already (another run uses it)")
    script = cache_dir / "quickstart.py"
    script.write_text(blocks("python")[0], encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key != "MMAPCACHE_DIR"}
    result = subprocess.run([sys.executable, str(script)], cwd=cache_dir, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not default.exists()


def test_the_install_line_installs_from_a_checkout() -> None:
    text = README.read_text(encoding="utf-8")
    assert 'pip install "mmapcache' not in text  # no such package on the index
    assert 'pip install -e ".[torch]"' in text
