"""Pickles made by mmapcache 0.3.0, 0.4.0 and 0.5.0 (tests/data/pickles-*.pkl, see make_pickles.py) load and work."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmapcache import (
    CacheInfo,
    Claims,
    Counts,
    DiskUsage,
    Field,
    GcReport,
    Jagged,
    Problem,
    Resized,
    Usage,
    VariableRegion,
)
from mmapcache._moved import MOVED
from mmapcache.testing import Summary
from mmapcache.torch import CachedDataset, CachedStream, NodeShardSampler, Packed, Padded

FIXTURE = Path(__file__).parents[1] / "data" / "pickles-0.3.0.pkl"
NAME = "x" * 195 + "{}.mmc"  # the datasets' paths are "/" + this (a Path pickles as its parts)


def load(directory: Path) -> dict[str, Any]:
    """The fixture, its datasets pointed at files in ``directory`` (same-length parts keep the pickle valid)."""
    data = FIXTURE.read_bytes()
    for tag in "ab":
        old = NAME.format(tag)
        below = str(directory).lstrip("/")
        new = f"{below}/{'p' * (len(old) - len(below) - len('/.mmc') - 1)}{tag}.mmc"
        assert len(new) == len(old)
        assert data.count(old.encode()) == 1
        data = data.replace(old.encode(), new.encode())
    loaded: dict[str, Any] = pickle.loads(data)
    return loaded


def test_a_0_3_0_dataset_unpickles_with_its_arguments_and_reads(tmp_path: Path) -> None:
    ds = load(tmp_path)["whole"]
    assert isinstance(ds, CachedDataset)
    assert (ds.key, ds.capacity, ds.check, ds.copy, ds.verify) == ("fixture/whole", 5, 1, True, False)
    assert ds.path.parent == tmp_path
    assert ds.dtypes == {"1": torch.int32}
    assert ds.timeout == 60.0  # an argument made after 0.3.0 takes its default
    image, label = ds[4]
    assert torch.equal(image, torch.arange(48, 60, dtype=torch.uint8).reshape(3, 4))
    assert label.dtype == torch.int32
    assert int(label) == 4
    assert ds.stats()["written"] == 1
    assert [int(label) for label in next(iter(ds.loader(batch_size=6)))[1]] == list(range(6))
    ds.close()


def test_a_0_3_0_shard_dataset_unpickles_with_its_fields_and_indices(tmp_path: Path) -> None:
    ds = load(tmp_path)["shard"]
    assert ds.fields == {"0": Field((3, 4), "uint8"), "1": Field((), "int64")}
    assert np.array_equal(ds.cached_indices, [1, 3, 4])
    assert (ds.copy, ds.verify, ds.check) == (False, True, 0)
    assert [int(ds[i][1]) for i in range(6)] == list(range(6))
    assert ds.cache.length == 3
    ds.close()


def test_a_0_3_0_padded_batch_unpickles_as_padded() -> None:
    padded = pickle.loads(FIXTURE.read_bytes())["padded"]
    assert isinstance(padded, Padded)
    assert padded.data.tolist() == [[1, 2, 0], [3, 0, 0]]
    assert padded.lengths.tolist() == [2, 1]


def test_new_pickles_name_the_public_module(tmp_path: Path) -> None:
    ds = load(tmp_path)["whole"]
    again = pickle.loads(pickle.dumps(ds))
    assert again.__getstate__().keys() == ds.__getstate__().keys()
    assert b"mmapcache.torch._" not in pickle.dumps(ds)
    assert b"mmapcache.torch._" not in pickle.dumps(Padded(torch.zeros(1, 2), torch.ones(1)))


def load_release(version: str, directory: Path) -> dict[str, Any]:
    """``pickles-<version>.pkl`` (see make_pickles.py), its caches pointed at files in ``directory``."""
    data = (FIXTURE.parent / f"pickles-{version}.pkl").read_bytes()
    for tag in "abc":
        old = NAME.format(tag)
        below = str(directory).lstrip("/")
        new = f"{below}/{'p' * (len(old) - len(below) - len('/.mmc') - 1)}{tag}.mmc"
        assert data.count(old.encode()) == 1
        data = data.replace(old.encode(), new.encode())
    loaded: dict[str, Any] = pickle.loads(data)
    assert loaded["version"] == version
    return loaded


RELEASES = ["0.4.0", "0.5.0"]


@pytest.mark.parametrize("version", RELEASES)
def test_datasets_and_streams_pickled_by_a_release_load_and_read(version: str, tmp_path: Path) -> None:
    loaded = load_release(version, tmp_path)
    whole, ragged, stream = loaded["whole"], loaded["ragged"], loaded["stream"]
    assert (whole.key, whole.capacity, whole.check, whole.dtypes) == ("fixture/whole", 5, 1, {"1": torch.int32})
    assert [int(label) for label in next(iter(whole.loader(batch_size=6)))[1]] == list(range(6))
    assert ragged.fields == {"tokens": Field((None,), "int32"), "label": Field((), "int64")}
    assert [ragged[i]["tokens"].tolist() for i in range(6)] == [list(range(n)) for n in (3, 0, 5, 1, 2, 4)]
    assert isinstance(stream, CachedStream)
    assert stream.path.parent == tmp_path
    for _ in range(2):  # the epoch that fills the file, then one read from it
        got = sorted((int(e["x"]), e["y"].tolist()) for e in stream)
        assert got == [(i, [i] * (i % 3)) for i in range(10)]
    for ds in (whole, ragged, stream):
        ds.close()


@pytest.mark.parametrize("version", RELEASES)
def test_values_pickled_by_a_release_load_as_the_classes_of_today(version: str, tmp_path: Path) -> None:
    loaded = load_release(version, tmp_path)
    sampler = loaded["sampler"]
    assert isinstance(sampler, NodeShardSampler)
    fresh = NodeShardSampler(list(range(10)), seed=4, num_nodes=2, node_rank=1, local_world_size=1, local_rank=0)
    assert list(sampler) == list(fresh)
    assert isinstance(loaded["padded"], Padded)
    assert loaded["padded"].lengths.tolist() == [2, 1]
    packed = loaded["packed"]
    assert isinstance(packed, Packed)
    assert (packed.values.tolist(), packed.cu_seqlens.tolist(), packed.max_seqlen) == ([1, 2, 3], [0, 2, 3], 2)
    jagged = loaded["jagged"]
    assert isinstance(jagged, Jagged)
    assert [row.tolist() for row in jagged] == [[0, 1, 2], []]
    assert loaded["field"] == Field((None, 4), "float32")


def test_public_classes_pickle_under_their_public_module() -> None:
    for cls in (Jagged, Counts, Usage, Claims, CacheInfo, GcReport, DiskUsage, Resized, Problem, VariableRegion):
        assert cls.__module__ == "mmapcache", cls
    assert (NodeShardSampler.__module__, Summary.__module__) == ("mmapcache.torch", "mmapcache.testing")
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new)


class Unreadable(torch.utils.data.IterableDataset[Any]):
    """A stream that must not be unpickled where it is only shown (its unpickling fails loudly)."""

    def __init__(self) -> None:
        self.state = "something to unpickle"

    def __iter__(self) -> Any:
        yield {"x": torch.tensor(1)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise AssertionError("the stream was unpickled")


def test_a_pickled_streams_repr_does_not_unpickle_its_stream(tmp_path: Path) -> None:
    stream = CachedStream(Unreadable(), tmp_path / "s.mmc", key="s", max_bytes="1MiB")
    again = pickle.loads(pickle.dumps(stream))
    assert repr(again) == f"CachedStream(Unreadable, path={str(tmp_path / 's.mmc')!r}, key='s')"
    with pytest.raises(AssertionError, match="unpickled"):
        _ = again.stream
