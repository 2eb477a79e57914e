"""A CachedStream's first epoch never stores wrong data and never blocks a corrected rerun.

Declared fields against an existing file, a stream whose order or content changes between passes, a stream
that repeats itself, Python lists of token ids, a first try refuted by its second element, and holes left by
a writer killed inside a batch store.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mmapcache import Field, SchemaMismatchError, StaleCacheError
from mmapcache._errors import CacheError
from mmapcache.torch import CachedStream

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


class Vectors(torch.utils.data.IterableDataset[Any]):
    """``count`` elements ``{"x": a (shape) tensor of dtype, "label": i}``, in order, or shuffled each pass."""

    def __init__(
        self, count: int, shape: tuple[int, ...] = (4,), dtype: torch.dtype = torch.float32, *, shuffled: bool = False
    ) -> None:
        self.count, self.shape, self.dtype, self.shuffled = count, shape, dtype, shuffled
        self.offset = 0  # changed preprocessing: every value shifted

    def __iter__(self) -> Iterator[Any]:
        order = list(range(self.count))
        if self.shuffled:
            random.shuffle(order)  # a shuffle buffer: another order every pass
        for i in order:
            yield {"x": torch.full(self.shape, i + self.offset, dtype=self.dtype), "label": i}


# -- declared fields against the existing file ---------------------------------------------------


def test_fields_declaring_other_shapes_or_dtypes_than_the_file_raise_schema_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "s.mmc"
    old = {"x": Field((4,), "float32"), "label": Field((), "int64")}
    first = CachedStream(Vectors(10), path, key="k", fields=old, max_bytes="1MiB")
    assert len(list(first)) == 10
    first.close()
    new = {"x": Field((8,), "int64"), "label": Field((), "int64")}
    other = CachedStream(Vectors(10, (8,), torch.int64), path, key="k", fields=new, max_bytes="1MiB")
    with pytest.raises(SchemaMismatchError) as raised:
        next(iter(other))
    message = str(raised.value)
    assert "(4,) float32" in message
    assert "(8,) int64" in message
    assert raised.value.differences["fields"] == (new, old)
    with pytest.raises(SchemaMismatchError, match="dtypes= asks for"):
        next(iter(CachedStream(Vectors(10), path, key="k", dtypes={"x": "float16"}, max_bytes="1MiB")))
    same = CachedStream(Vectors(10), path, key="k", fields=dict(reversed(list(old.items()))), max_bytes="1MiB")
    assert sorted(int(e["label"]) for e in same) == list(range(10))  # the same fields in another order
    same.close()


# -- a stream that changes between passes ----------------------------------------------------------


def _interrupted(ds: CachedStream, count: int) -> None:
    """A first epoch stopped after ``count`` elements (what it yielded is stored)."""
    for _ in itertools.islice(iter(ds), count):
        pass


def test_a_continued_fill_of_a_stream_in_another_order_is_refused_naming_the_idiom_and_the_fix(
    tmp_path: Path,
) -> None:
    ds = CachedStream(Vectors(1000, shuffled=True), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    _interrupted(ds, 500)
    with pytest.raises(StaleCacheError) as raised:
        list(ds)
    message = str(raised.value)
    assert "element 0 of partition 0" in message
    assert "shuffle buffer" in message
    assert "resampled=True" in message
    assert "'k/v2'" in message
    assert "mmapcache rm" in message
    assert ds.stats()["stored"] == 500
    assert not ds.stats()["complete"]
    assert not ds.cache.verify()  # type: ignore[union-attr]
    ds.close()


def test_a_continued_fill_of_changed_preprocessing_under_the_same_key_is_refused(tmp_path: Path) -> None:
    stream = Vectors(300)
    ds = CachedStream(stream, tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    _interrupted(ds, 200)
    stream.offset = 1
    with pytest.raises(StaleCacheError, match=r"element 0 of partition 0.*the stored element\['x'\]"):
        list(ds)
    stream.offset = 0  # the stream as it was: continued, and every element once
    assert sorted(int(e["label"]) for e in ds) == list(range(300))
    assert Counter(int(e["label"]) for e in ds) == Counter(range(300))
    ds.close()


class Resampled(torch.utils.data.IterableDataset[Any]):
    """WebDataset's ``resampled=True``: 30 shards of 100 samples drawn with replacement from 22."""

    def __init__(self, *, keyed: bool) -> None:
        self.keyed = keyed

    def __iter__(self) -> Iterator[Any]:
        rng = random.Random(0)
        for _ in range(30):
            shard = rng.randrange(22)
            for i in range(shard * 100, shard * 100 + 100):
                element: dict[str, Any] = {"x": torch.arange(16) + i, "label": i}
                if self.keyed:
                    element["__key__"] = f"shard{shard:04d}/sample{i:06d}"
                yield element


def test_a_first_epoch_repeating_a_key_is_refused_naming_resampled(tmp_path: Path) -> None:
    ds = CachedStream(Resampled(keyed=True), tmp_path / "s.mmc", key="k", max_bytes="4MiB")
    with pytest.raises(CacheError, match=r"repeats the __key__ .*resampled=True"):
        list(ds)
    assert not ds.stats()["complete"]
    ds.close()


def test_a_first_epoch_repeating_its_elements_warns_naming_resampled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = CachedStream(Resampled(keyed=False), tmp_path / "s.mmc", key="k", max_bytes="4MiB")
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        assert len(list(ds)) == 3000
    warned = [r.getMessage() for r in caplog.records if "repeats elements" in r.getMessage()]
    assert len(warned) == 1
    assert "resampled=True" in warned[0]
    ds.close()


def test_a_stream_with_few_natural_duplicates_does_not_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Corpus(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Iterator[Any]:
            for i in range(2000):
                tokens = torch.arange(i % 50) if i % 33 else torch.zeros(0, dtype=torch.int64)  # 3 % empty
                boilerplate = torch.arange(40) if i % 100 == 0 else torch.arange(i, i + 40)
                yield {"tokens": tokens + i, "boilerplate": boilerplate}

    fields = {"tokens": Field((None,), "int64"), "boilerplate": Field((40,), "int64")}
    ds = CachedStream(Corpus(), tmp_path / "s.mmc", key="k", fields=fields, max_bytes="8MiB")
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        assert len(list(ds)) == 2000
    assert not [r for r in caplog.records if "repeats" in r.getMessage()]
    ds.close()
