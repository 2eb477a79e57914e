"""`mmapcache.resize` / `mmapcache resize`: a larger budget, every cached sample kept, safe under use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _tmpfs import mounted_tmpfs

import mmapcache
from mmapcache import Cache, CacheSpaceError, Field

FIELDS = {"tokens": Field((None,), "uint16"), "n": Field((), "int64")}
N = 400


def tokens(i: int) -> np.ndarray[Any, Any]:
    return (np.arange(i % 53 + 1) * 3 + i).astype(np.uint16)


def fill(cache: Cache, indices: Any) -> list[int]:
    return [i for i in indices if cache.put(i, {"tokens": tokens(i), "n": i})]


def test_resize_grows_the_variable_region_and_keeps_every_cached_sample(tmp_path: Path) -> None:
    path = tmp_path / "t.mmc"
    with Cache.open(path, FIELDS, N, max_bytes=N * 32 + 8192) as cache:
        stored = fill(cache, range(N))
        region = cache.variable_region
        assert region is not None
        assert 0 < len(stored) < N
        assert region.refused == N - len(stored)
        before = cache.usage().total
    done = mmapcache.resize(path, max_bytes="1MiB")
    assert (done.kept, done.dropped) == (len(stored), 0)
    assert done.new_capacity == done.old_capacity == N
    assert done.new_variable_bytes > done.old_variable_bytes
    with Cache.open(path) as grown:
        assert grown.nbytes == done.new_bytes
        assert grown.filled == len(stored)
        batch = grown.get_many(stored)
        assert batch["tokens"] == [tokens(i) for i in stored]
        assert batch["n"].tolist() == stored
        region = grown.variable_region
        assert region is not None
        assert region.refused == 0
        assert grown.usage().total.written == before.written  # the history carries over
        assert sorted(stored + fill(grown, range(N))) == list(range(N))  # the rest fits now
        assert grown.verify() == []
    mmapcache.remove(path)


def test_resize_gives_a_cache_of_fixed_fields_more_slots(tmp_path: Path) -> None:
    path = tmp_path / "f.mmc"
    fields = {"x": Field((4,), "float32")}
    with Cache.open(path, fields, 100, capacity=10) as cache:
        cache.put_many(range(10), {"x": np.ones((10, 4), np.float32)})
    done = mmapcache.resize(path, max_bytes=100 * 24)
    assert (done.old_capacity, done.new_capacity, done.kept) == (10, 100, 10)
    with Cache.open(path) as grown:
        assert grown.capacity == 100
        assert grown.filled == 10
        assert grown.put(50, {"x": np.zeros(4, np.float32)})
    mmapcache.remove(path)


def test_resize_refuses_to_shrink_and_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "t.mmc"
    with Cache.open(path, FIELDS, N, max_bytes="1MiB") as cache:
        fill(cache, range(10))
    before = os.stat(path)
    with pytest.raises(ValueError, match="only grows"):
        mmapcache.resize(path, max_bytes=N * 32 + 8192)
    after = os.stat(path)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert sorted(os.listdir(tmp_path)) == ["t.mmc", "t.mmc.lock"]
    mmapcache.remove(path)


def test_resize_says_when_there_is_no_room_for_the_new_file_next_to_the_old(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "tiny", "size=2m,mode=0700") as tiny:  # a real 2 MiB file system
        path = tiny / "t.mmc"
        with Cache.open(path, FIELDS, N, max_bytes="1MiB") as cache:
            fill(cache, range(10))
        with pytest.raises(CacheSpaceError, match="built next to the old one") as error:
            mmapcache.resize(path, max_bytes="1536KiB")
        assert error.value.needed is not None
        assert error.value.free is not None
        assert error.value.needed > error.value.free
        assert sorted(os.listdir(tiny)) == ["t.mmc", "t.mmc.lock"]
        with Cache.open(path) as cache:
            assert cache.filled == 10
        mmapcache.remove(path)


def test_a_handle_open_before_resize_keeps_reading_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "t.mmc"
    with Cache.open(path, FIELDS, N, max_bytes=N * 32 + 8192) as old:
        stored = fill(old, range(N))
        mmapcache.resize(path, max_bytes="1MiB")
        assert old.get_many(stored)["tokens"] == [tokens(i) for i in stored]
        late = [i for i in range(N) if i not in stored][:3]
        old.put(late[0], {"tokens": np.zeros(0, np.uint16), "n": 0})  # fills the old file only
        with Cache.open(path) as new:
            assert late[0] not in new
            assert new.filled == len(stored)
    mmapcache.remove(path)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "mmapcache", *args], capture_output=True, text=True, env=env, check=False
    )


def test_mmapcache_resize_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "t.mmc"
    with Cache.open(path, FIELDS, N, max_bytes=N * 32 + 8192) as cache:
        stored = fill(cache, range(N))
    shown = cli("resize", str(path), "--max-bytes", "2MiB")
    assert shown.returncode == 0, shown.stderr
    assert f"{len(stored)} cached samples kept" in shown.stdout
    assert json.loads(cli("resize", str(path), "--max-bytes", "4MiB", "--json").stdout)["kept"] == len(stored)
    refused = cli("resize", str(path), "--max-bytes", "1MiB")
    assert refused.returncode == 2
    assert "only grows" in refused.stderr
    mmapcache.remove(path)


# A reader and a filler in their own processes, reopening the cache by path as they go.
_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from mmapcache import Cache
    path, role, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(os.getpid())
    def tokens(i):
        return (np.arange(i % 53 + 1) * 3 + i).astype(np.uint16)
    rounds = reads = 0
    while not os.path.exists(stop):
        with Cache.open(path) as cache:
            for _ in range(20):
                idx = rng.integers(0, cache.length, 64)
                if role == "filler":
                    for i in idx.tolist():
                        cache.put(i, {"tokens": tokens(i), "n": i})
                    continue
                batch, hits = cache.read_many(idx)
                for row, i in enumerate(idx.tolist()):
                    if not hits[row]:
                        continue
                    reads += 1
                    if batch["n"][row] != i or not np.array_equal(batch["tokens"][row], tokens(i)):
                        print(f"slot {i} read wrong", flush=True)
                        sys.exit(1)
        rounds += 1
        if rounds == 1:
            print("ready", flush=True)
    print(f"{role}: {rounds} opens, {reads} hits checked", flush=True)
    """
)


def test_resize_while_a_reader_and_a_filler_use_the_cache_never_shows_a_wrong_sample(tmp_path: Path) -> None:
    path = tmp_path / "t.mmc"
    stop = tmp_path / "stop"
    with Cache.open(path, FIELDS, N, max_bytes=N * 32 + 4096) as cache:
        first = fill(cache, range(0, N, 7))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(path), role, str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in ("reader", "filler")
    ]
    try:
        for proc in procs:  # both have done a round of reads or puts (however slow to start on a loaded machine)
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        kept = []
        for budget in ("64KiB", "256KiB", "1MiB"):
            time.sleep(0.5)
            done = mmapcache.resize(path, max_bytes=budget)
            assert done.dropped == 0
            kept.append(done.kept)
        time.sleep(0.5)
    finally:
        stop.touch()
        outputs = [proc.communicate(timeout=60) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out + err
    assert "reader:" in outputs[0][0]
    assert " 0 hits checked" not in outputs[0][0]  # the reader did read samples across the resizes
    assert kept[0] >= len(first)
    assert kept == sorted(kept)  # every resize keeps at least what the one before kept
    with Cache.open(path) as cache:
        ready = np.flatnonzero(cache.contains_many(range(N))).tolist()
        assert set(first) <= set(ready)
        assert cache.get_many(ready)["tokens"] == [tokens(i) for i in ready]
        assert cache.verify() == []
    mmapcache.remove(path)
    stop.unlink()


RESIZER = """
import sys
import mmapcache
mmapcache.resize(sys.argv[1], max_bytes="512MiB")
"""


def _kill_a_resize_midway(path: Path) -> Path:
    """Start a real `resize` of ``path``, SIGKILL it once its temp file exists; that temp file."""
    resizer = subprocess.Popen([sys.executable, "-c", RESIZER, str(path)])
    prefix = f"{path.name}.tmp-{resizer.pid}-"
    try:
        deadline = time.monotonic() + 60
        while not (temps := [n for n in os.listdir(path.parent) if n.startswith(prefix)]):
            assert resizer.poll() is None, "the resize ended before its temp file was seen"
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        resizer.kill()
        resizer.wait()
    (temp,) = temps
    return path.parent / temp


@pytest.mark.parametrize("then", ["resize", "open", "gc"])
def test_the_temp_file_of_a_killed_resize_goes_with_the_next_resize_open_or_gc(tmp_path: Path, then: str) -> None:
    # A SIGKILLed resize leaves its temp file (as large as the new cache): the next resize, open or gc
    # removes it (nobody holds the creation lock, so its maker is dead).
    path = tmp_path / "big.mmc"
    with Cache.open(path, {"x": Field((4096,), "uint8")}, 100_000, capacity=100) as cache:
        cache.put(0, {"x": np.full(4096, 7, np.uint8)})
    temp = _kill_a_resize_midway(path)
    assert temp.exists()
    if then == "resize":
        mmapcache.resize(path, max_bytes="1MiB")
    elif then == "open":
        Cache.open(path, readonly=True).close()
    else:
        report = mmapcache.gc(tmp_path)  # the default age: a dead maker's temp file goes whatever its age
        assert [(r.path, r.kind) for r in report.removed] == [(temp, "leftover")]
    assert not temp.exists()
    with Cache.open(path) as cache:  # the cache itself is intact
        assert cache.get(0)["x"].tolist() == [7] * 4096
    assert sorted(os.listdir(tmp_path)) == ["big.mmc", "big.mmc.lock"]
    mmapcache.remove(path)


class LoggedTokens:
    """A map-style dataset of variable-length token rows that logs every load (pid, index) to a file."""

    def __init__(self, n: int, log: Path) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return {"tokens": torch.arange(i % 53 + 1, dtype=torch.int32) + i}


CHECK = 2  # samples each process compares with the dataset on its first open of a file


def _loads(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []


def test_resize_during_training_with_spawn_workers_loads_each_missing_sample_once(tmp_path: Path) -> None:
    # The main process opened the file before the resize; spawn workers open the new one by path and
    # store the misses there. The main process follows the name on its first miss and gathers from the
    # new file too, instead of loading the workers' samples a second time.
    from mmapcache.torch import CachedDataset

    n, log = 768, tmp_path / "loads.log"
    ds = CachedDataset(
        LoggedTokens(n, log),
        path=tmp_path / "tok.mmc",
        key="tokens",
        fields={"tokens": Field((None,), "int32")},
        max_bytes=48 * 1024,
        check=CHECK,
    )
    for _ in ds.loader(batch_size=64, ragged="list"):  # epoch 0 in the main process: about a third fits
        pass
    kept = ds.stats()["filled"]
    assert 0 < kept < n // 2
    done = mmapcache.resize(ds.path, max_bytes="4MiB")
    assert done.kept == kept
    log.unlink()
    seen = []
    loader = ds.loader(batch_size=64, ragged="list", num_workers=2, multiprocessing_context="spawn")
    for batch in loader:
        for row in batch["tokens"]:
            i = int(row[0])
            assert row.tolist() == list(range(i, i + i % 53 + 1))
            seen.append(i)
    assert sorted(seen) == list(range(n))
    loads = _loads(log)
    # Each process (the main one, two workers) checks the new file once against the dataset: `check` loads.
    bound = 3 * CHECK
    assert sum(count - 1 for count in Counter(loads).values()) <= bound  # loaded twice: only those checks
    assert n - kept <= len(loads) <= n - kept + bound  # the samples the old file lacked, each once
    assert ds.stats()["filled"] == n
    assert not ds.cache.replaced
    ds.close()
    mmapcache.remove(ds.path)


class Documents:
    """A stream of token documents (an iterable with a length), as docs/streams.md's."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Any:
        import torch

        for i in range(self.count):
            yield {"tokens": torch.arange(i % 13 + 1) + i, "label": i}


def _stream(path: Path, max_bytes: str = "16KiB") -> Any:
    import torch.utils.data

    from mmapcache.torch import CachedStream

    class Stream(Documents, torch.utils.data.IterableDataset):  # type: ignore[misc]
        pass

    fields = {"tokens": Field((None,), "int64"), "label": Field((), "int64")}
    return CachedStream(Stream(200), path, key="docs", max_bytes=max_bytes, fields=fields)


def _labels(stream: Any) -> list[int]:
    labels = []
    for element in stream:
        i = int(element["label"])
        assert element["tokens"].tolist() == [i + t for t in range(i % 13 + 1)]
        labels.append(i)
    return sorted(labels)


def test_the_advice_for_a_full_stream_cache_works_resize_and_the_next_pass_stores_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "docs.mmc"
    small = _stream(path)
    with caplog.at_level("WARNING", logger="mmapcache"):
        assert _labels(small) == list(range(200))
    before = small.stats()
    assert before["complete"]
    assert before["full"]
    assert before["stored"] < 200
    advice = " ".join(record.getMessage() for record in caplog.records)
    assert f"mmapcache resize {path} --max-bytes SIZE" in advice
    info = subprocess.run(
        [sys.executable, "-m", "mmapcache", "info", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "mmapcache resize" in info
    small.close()
    # The next run asks for more room: the existing file keeps its size, and the log says how to grow it.
    caplog.clear()
    larger = _stream(path, max_bytes="1MiB")
    with caplog.at_level("WARNING", logger="mmapcache"):
        assert _labels(larger) == list(range(200))
    assert larger.stats()["stored"] == before["stored"]
    advice = " ".join(record.getMessage() for record in caplog.records)
    assert f"mmapcache resize {path} --max-bytes 1MiB" in advice
    larger.close()
    # Following the advice:
    subprocess.run([sys.executable, "-m", "mmapcache", "resize", str(path), "--max-bytes", "1MiB"], check=True)
    grown = _stream(path, max_bytes="1MiB")
    assert _labels(grown) == list(range(200))  # stores what did not fit
    after = grown.stats()
    assert after["complete"]
    assert not after["full"]
    assert (after["stored"], after["uncached"]) == (200, 0)
    streamed = after["streamed"]
    assert _labels(grown) == list(range(200))  # every element from the file now
    assert grown.stats()["streamed"] == streamed
    with Cache.open(path) as cache:
        assert cache.verify() == []
    grown.close()
    mmapcache.remove(path)


def test_the_advice_of_verify_fix_on_a_stream_cache_works(tmp_path: Path) -> None:
    path = tmp_path / "docs.mmc"
    stream = _stream(path, max_bytes="1MiB")
    assert _labels(stream) == list(range(200))
    assert stream.stats()["complete"]
    stream.close()
    with Cache.open(path, readonly=True) as cache:
        offset, size = cache._layout.field_offsets["label"], cache._layout.file_size
    with open(path, "r+b") as f:  # damage one slot's bytes (its checksum no longer matches)
        f.seek(offset + 3 * 8)
        f.write(b"\xff" * 8)
    fixed = subprocess.run(
        [sys.executable, "-m", "mmapcache", "verify", "--fix", str(path)], capture_output=True, text=True
    ).stdout
    assert "slot 3 does not match its checksum" in fixed
    assert "refill on the next miss" not in fixed
    assert f"mmapcache resize {path} --max-bytes SIZE" in fixed
    # Following it:
    subprocess.run([sys.executable, "-m", "mmapcache", "resize", str(path), "--max-bytes", str(2 * size)], check=True)
    again = _stream(path, max_bytes="1MiB")
    assert _labels(again) == list(range(200))  # the missing element stored again
    assert _labels(again) == list(range(200))  # and read from the file
    stats = again.stats()
    assert stats["complete"]
    assert (stats["stored"], stats["uncached"]) == (200, 0)
    again.close()
    with Cache.open(path) as cache:
        assert cache.verify() == []
    mmapcache.remove(path)
