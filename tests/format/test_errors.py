"""The exception tree: builtin bases, attributes, and clean pickling (errors cross process boundaries)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from pathlib import Path
from typing import Any

import pytest

import mmapcache
from mmapcache import (
    Cache,
    CacheError,
    CacheFormatError,
    CacheInUseError,
    CacheMissError,
    CacheSpaceError,
    CacheTimeoutError,
    Field,
    ReadonlyCacheError,
    SchemaMismatchError,
    UnsafeCacheFileError,
)

ERRORS = [
    (CacheFormatError("bad header", path="/x.mmc"), ValueError),
    (SchemaMismatchError("differs", path="/x.mmc", differences={"length": (1, 2)}), ValueError),
    (CacheSpaceError("full", path="/x.mmc", needed=10, free=3), OSError),
    (UnsafeCacheFileError("symlink", path="/x.mmc"), PermissionError),
    (CacheInUseError("busy", path="/x.mmc", pids=[12, 34]), OSError),
    (ReadonlyCacheError("readonly", path="/x.mmc"), PermissionError),
    (CacheTimeoutError("waited", path="/x.mmc"), TimeoutError),
    (CacheMissError("2 of 3 indices are not cached: 4, 9", path="/x.mmc", missing=[4, 9]), KeyError),
]


@pytest.mark.parametrize(("error", "builtin"), ERRORS, ids=lambda e: type(e).__name__)
def test_bases_and_pickling(error: CacheError, builtin: type[Exception]) -> None:
    assert isinstance(error, CacheError)
    assert isinstance(error, builtin)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    if isinstance(error, CacheMissError):
        assert isinstance(copy, CacheMissError)
        assert copy.missing.tolist() == error.missing.tolist() == [4, 9]
        assert copy.path == error.path
    else:
        assert copy.__dict__ == error.__dict__
    assert copy.path == "/x.mmc"


def test_attributes() -> None:
    assert CacheSpaceError("m", needed=10, free=None).free is None
    assert CacheInUseError("m", pids=[1]).pids == [1]
    assert SchemaMismatchError("m").differences == {}
    assert CacheFormatError("m").path is None
    assert CacheMissError("m").missing.dtype.kind == "i"


def _open_in_child(path: str, queue: Any) -> None:
    try:
        Cache.open(path, {"x": Field((3,), "float32")}, length=5)
    except CacheError as error:
        queue.put(error)


def test_a_real_error_crosses_a_process_boundary(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    Cache.open(path, {"x": Field((2,), "float32")}, length=5).close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(str(path), queue))
    child.start()
    error = queue.get(timeout=60)
    child.join(60)
    assert isinstance(error, SchemaMismatchError)
    assert set(error.differences) == {"fields"}
    assert error.path == str(path)
    assert "expected Field((3,), 'float32'), found Field((2,), 'float32')" in str(error)
    mmapcache.remove(path)
