"""The process-local handle: closing under concurrent use, leaks, fork without descriptors.

Anything that could crash the interpreter runs in a child process, so a
SIGSEGV shows up as that child's exit status instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mmapcache
from mmapcache import Cache, Field, SchemaMismatchError

FIELDS = {"x": Field((16_384,), "uint8"), "y": Field((), "int64")}


def run_child(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; its exit status tells whether it crashed."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_clean_exit(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


CLOSE_RACE = """
import random, sys, threading, time
import numpy as np
from mmapcache import Cache, Field

path, trials = sys.argv[1], int(sys.argv[2])
fields = {"x": Field((65_536,), "uint8"), "y": Field((), "int64")}
with Cache.open(path, fields, length=256) as filler:
    filler.put_many(np.arange(256), {"x": np.ones((256, 65_536), np.uint8), "y": np.arange(256)})
outcomes = {"completed": 0, "closed": 0}
failures = []
for trial in range(trials):
    cache = Cache.open(path)
    start = threading.Barrier(5)

    def reader(kind):
        rng = random.Random(trial * 10 + kind)
        start.wait()
        while True:
            try:
                if kind == 0:
                    batch = cache.get_many(rng.sample(range(256), 64))
                    ok = batch["x"].shape == (64, 65_536) and int(batch["x"][:, ::4096].min()) == 1
                elif kind == 1:
                    sample = cache.get(rng.randrange(256))
                    ok = sample is not None and int(sample["x"][::4096].min()) == 1
                elif kind == 2:
                    ok = bool(cache.contains_many(np.arange(256)).all()) and 5 in cache
                else:
                    ok = cache.put(rng.randrange(256), {"x": np.ones(65_536, np.uint8), "y": 0}) is False
                if not ok:
                    failures.append(f"trial {trial}: reader {kind} saw wrong data")
                    return
                outcomes["completed"] += 1
            except ValueError as error:
                if "closed cache" not in str(error):
                    failures.append(f"trial {trial}: reader {kind}: {error!r}")
                outcomes["closed"] += 1
                return

    threads = [threading.Thread(target=reader, args=(kind,)) for kind in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(random.uniform(0, 0.004))
    cache.close()
    for thread in threads:
        thread.join()
if failures:
    sys.exit("\\n".join(failures))
print(outcomes)
"""


def test_close_while_other_threads_read_never_crashes(cache_dir: Path) -> None:
    # Before the fix, close() unmapped memory that np.take in other threads was
    # reading: 23 of 30 trials died with SIGSEGV.
    run = run_child(CLOSE_RACE, str(cache_dir / "race.mmc"), "30")
    assert_clean_exit(run)
    assert "'closed': 120" in run.stdout  # every reader of every trial saw the close


def test_views_outlive_close(cache_dir: Path) -> None:
    code = """
    import sys, gc
    import numpy as np
    from mmapcache import Cache, Field
    cache = Cache.open(sys.argv[1], {"x": Field((1024,), "uint8")}, length=4)
    cache.put(2, {"x": np.full(1024, 7, np.uint8)})
    view = cache.views["x"]
    cache.close()
    gc.collect()
    assert int(view[2].sum()) == 7 * 1024, view[2]
    assert not view.flags.writeable
    print("ok")
    """
    run = run_child(code, str(cache_dir / "v.mmc"))
    assert_clean_exit(run)
    assert run.stdout.strip() == "ok"


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_open_leaks_no_descriptor_and_no_in_use_lock(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, FIELDS, length=4, key="k").close()
    before = _open_descriptors()
    for _ in range(50):
        with pytest.raises(SchemaMismatchError):
            Cache.open(path, FIELDS, length=4, key="other")
        with pytest.raises(SchemaMismatchError):
            Cache.open(path, {"x": Field((3,), "uint8")}, length=4)
    assert _open_descriptors() == before
    assert not mmapcache.in_use(path)
    mmapcache.remove(path)


def test_closing_releases_the_descriptor_at_once(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    before = _open_descriptors()
    cache = Cache.open(path, FIELDS, length=4)
    view = cache.views["x"]  # keeps the mapping, not the descriptor or the in-use lock
    cache.close()
    assert mmapcache.in_use(path) is False
    if sys.version_info >= (3, 13):  # before 3.13, mmap keeps a duplicate of a (lock-free) descriptor
        assert _open_descriptors() == before
    del view
    assert _open_descriptors() == before
    mmapcache.remove(path)


EMFILE_FORK = """
import os, resource, sys
import numpy as np
from mmapcache import Cache, Field, ReadonlyCacheError

cache = Cache.open(sys.argv[1], {"x": Field((8,), "uint8")}, length=8)
cache.put(0, {"x": np.arange(8, dtype=np.uint8)})
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
spare = []
while True:  # fill every free descriptor number below the limit
    try:
        spare.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
pid = os.fork()
if pid == 0:
    status = 0
    try:
        if cache.get(0)["x"].tolist() != list(range(8)):
            status = 3  # reads must keep working through the inherited mapping
        cache.put(1, {"x": np.zeros(8, np.uint8)})
        status = 4  # the put went through the parent's description
    except ReadonlyCacheError as error:
        if "fork" not in str(error) or "EMFILE" not in str(error):
            status = 5
    except BaseException:
        status = 6
    os._exit(status)
_, status = os.waitpid(pid, 0)
for fd in spare:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
assert 1 not in cache, "the child's refused put must not store anything"
cache.put(1, {"x": np.zeros(8, np.uint8)})  # the parent's own handle still writes
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_without_descriptors_refuses_writes(cache_dir: Path) -> None:
    # Before the fix, the child logged a warning and wrote through the parent's
    # open file description, so both could hold one slot's claim.
    run = run_child(EMFILE_FORK, str(cache_dir / "f.mmc"))
    assert_clean_exit(run)


def test_a_numpy_array_over_a_closed_cache_is_never_unmapped_under_it(cache_dir: Path) -> None:
    # The root cause: np.ndarray(buffer=mmap) holds no buffer export, so an
    # explicit mmap.close() would succeed under live arrays.
    code = """
    import sys
    import numpy as np
    from mmapcache import Cache, Field
    cache = Cache.open(sys.argv[1], {"x": Field((4096,), "uint8")}, length=64)
    cache.put_many(np.arange(64), {"x": np.full((64, 4096), 3, np.uint8)})
    views = cache.views
    del cache  # the finalizer closes the handle
    import gc; gc.collect()
    assert int(views["x"].sum()) == 3 * 64 * 4096
    """
    assert_clean_exit(run_child(code, str(cache_dir / "n.mmc")))


def test_writes_after_close_raise_value_error(cache_dir: Path) -> None:
    cache = Cache.open(cache_dir / "c.mmc", FIELDS, length=4)
    cache.close()
    sample = {"x": np.zeros(16_384, np.uint8), "y": 1}
    for call in (
        lambda: cache.put(0, sample),
        lambda: cache.put_many([0], {"x": np.zeros((1, 16_384), np.uint8), "y": [1]}),
        cache.clear,
        cache.verify,
        lambda: cache.get(0),
        lambda: cache.get_many([0]),
        lambda: 0 in cache,
        lambda: cache.contains_many([0]),
        lambda: cache.filled,
        lambda: cache.views,
    ):
        with pytest.raises(ValueError, match="closed cache"):
            call()
