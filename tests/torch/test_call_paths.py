"""How far a batch of ``CachedDataset.__getitems__`` travels (``benchmarks/call_paths.py``): held to its bounds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]

WARM_FUNCTIONS = 25  # a warm batch: 22 through __getitems__, 25 through loader() (it was 29 and 30): it may only shrink
MISS_FUNCTIONS = 50  # a 32-sample miss batch (107 before it read once, converted once and held by runs): the target
MISS_REENTRIES = 40


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("call_paths", REPO / "benchmarks" / "call_paths.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["call_paths"] = module
    spec.loader.exec_module(module)
    measured: dict[str, dict[str, Any]] = module.measure(tmp_path_factory.mktemp("paths"))
    return measured


def test_a_warm_batch_is_no_longer_than_before(paths: dict[str, dict[str, Any]]) -> None:
    for name in ("warm", "loader() warm"):
        assert paths[name]["functions"] <= WARM_FUNCTIONS, (name, paths[name]["function_names"])
        assert paths[name]["reentries"] == 0, paths[name]["reentry_chains"]


def test_a_miss_batch_reads_once_and_stays_within_its_bounds(paths: dict[str, dict[str, Any]]) -> None:
    miss = paths["miss 32"]
    names = miss["function_names"]
    assert (
        "mmapcache._region.flight:SingleFlight.read" not in names
    )  # single flight takes the caller's read: no second one
    assert "mmapcache.torch._schema:Schema.with_rows" not in names  # loaded rows go into the read's columns
    assert "mmapcache.cache:Cache.counts" not in names  # single flight says what it stored
    assert miss["reentry_sites"] <= MISS_REENTRIES, miss["reentry_chains"]


def test_a_miss_batch_converts_its_samples_once(paths: dict[str, dict[str, Any]]) -> None:
    names = paths["miss 32"]["function_names"]
    assert "mmapcache._region.values:coerce_batch" not in names  # single flight stores the load's columns as is
    assert "mmapcache.torch._leaves:fit" not in names  # leaves that fit as they are: stacked, no call per leaf
    assert "mmapcache.torch._schema:Schema.flatten" not in names


def test_a_miss_batch_of_32_samples_crosses_at_most_50_functions(paths: dict[str, dict[str, Any]]) -> None:
    assert paths["miss 32"]["functions"] <= MISS_FUNCTIONS, paths["miss 32"]["function_names"]
