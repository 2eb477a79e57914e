"""Shared fixtures: every test gets its own cache directory under /dev/shm, removed afterwards."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SHM = Path("/dev/shm")
_OWN_BASETEMP = pytest.StashKey[Path]()
_SCRATCH = pytest.StashKey[tuple[Path, "str | None"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the long stress tests (marker: slow); MMAPCACHE_SLOW=1 does the same",
    )


def pytest_configure(config: pytest.Config) -> None:
    # pytest's numbered temporary directories are shared by every run of one user: a run that
    # starts while another is going prunes the other's directory (its tests then fail with
    # FileNotFoundError). Unless --basetemp is given, each run gets a directory of its own,
    # removed when the run ends.
    if config.option.basetemp is None:
        root = Path(tempfile.gettempdir()) / f"pytest-of-{os.getuid()}"
        root.mkdir(mode=0o700, exist_ok=True)
        config.option.basetemp = str(root / f"run-{os.getpid()}")
        config.stash[_OWN_BASETEMP] = Path(config.option.basetemp)
    # Temporary files of the processes the tests start go to a directory of this run, removed
    # when it ends: among them multiprocessing's pymp-* directories, which a process killed by
    # a signal (a test's SIGKILL, a DataLoader terminating its workers after an error) never
    # removes itself. This process keeps its own temporary directory: multiprocessing removes
    # its pymp-* directory at exit, after this hook.
    tempfile.tempdir = tempfile.gettempdir()
    scratch = Path(tempfile.mkdtemp(prefix="mmapcache-tests-tmp-"))
    config.stash[_SCRATCH] = (scratch, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = str(scratch)


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)
    scratch, before = config.stash.get(_SCRATCH, (None, None))
    if scratch is not None:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Long stress runs are opt-in: deselected (not skipped) unless asked for; each has a
    # short always-on counterpart.
    if config.getoption("--run-slow") or os.environ.get("MMAPCACHE_SLOW") == "1":
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    """A private directory for this test's caches (in /dev/shm when there is one), removed afterwards."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="mmapcache-test-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A private directory under /var/tmp: the root file system, a disk here (not tmpfs), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mmapcache-disk-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_default_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point ``default_dir()`` at a per-test directory so no test ever writes to the real default location."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="mmapcache-default-", dir=base))
    monkeypatch.setenv("MMAPCACHE_DIR", str(path))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes a test starts; any still alive at the end are killed (a failed test leaves none behind)."""
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
