"""Pickles made by mmapcache 0.3.0 (tests/data/pickles-0.3.0.pkl, see make_pickles_0_3_0.py) still load and work."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmapcache import Field
from mmapcache.torch import CachedDataset, Padded

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
