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

HERE = Path(__file__).parents[1]
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


# -- Hugging Face token ids: Python lists of ints --------------------------------------------------

TOKENS = {"input_ids": Field((None,), "uint16"), "label": Field((), "int64")}


def _token_rows(count: int) -> dict[str, list[Any]]:
    return {"input_ids": [list(range(i, i + i % 9)) for i in range(count)], "label": list(range(count))}


def test_hugging_face_token_lists_fit_a_declared_uint16_field_of_a_stream(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = _token_rows(40)
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset()
    assert isinstance(next(iter(stream))["input_ids"], list)  # what a tokenizer's map gives
    ds = CachedStream(stream, tmp_path / "s.mmc", key="k", fields=TOKENS, max_bytes="1MiB")
    for epoch in range(2):  # the stream, then the file
        got = {int(e["label"]): e["input_ids"] for e in ds}
        assert sorted(got) == list(range(40)), epoch
        for i, tokens in got.items():
            assert tokens.dtype == torch.uint16
            assert tokens.tolist() == rows["input_ids"][i]  # empty lists too
    assert ds.stats()["complete"]
    ds.close()


def test_hugging_face_token_lists_fit_a_declared_uint16_field_of_a_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from torch.utils.data import DataLoader

    from mmapcache.torch import CachedDataset, ragged_collate

    rows = _token_rows(40)
    table = datasets.Dataset.from_dict(rows)
    ds = CachedDataset(table, tmp_path / "d.mmc", key="k", fields=TOKENS, max_bytes="1MiB")
    assert ds[3]["input_ids"].tolist() == rows["input_ids"][3]
    loader = DataLoader(ds, batch_size=8, collate_fn=ragged_collate("list", leaves="input_ids"))
    for _ in range(2):  # misses, then hits
        got = [(int(label), tokens.tolist()) for batch in loader for label, tokens in zip(*_pair(batch), strict=True)]
        assert got == list(zip(rows["label"], rows["input_ids"], strict=True))
    ds.close()


def _pair(batch: Any) -> tuple[Any, Any]:
    return batch["label"], batch["input_ids"]


def test_token_lists_that_do_not_fit_give_a_short_error_naming_with_format_numpy(tmp_path: Path) -> None:
    class Tokens(torch.utils.data.IterableDataset[Any]):
        def __init__(self, first: int) -> None:
            self.first = first

        def __iter__(self) -> Iterator[Any]:
            for i in range(10):
                yield {"input_ids": list(range(self.first + i, self.first + 2 * i + 600)), "label": i}

    too_large = CachedStream(Tokens(70000), tmp_path / "a.mmc", key="k", fields=TOKENS, max_bytes="1MiB")
    with pytest.raises(ValueError, match="out of range for uint16") as raised:
        list(too_large)
    assert 'with_format("numpy")' in str(raised.value)
    assert len(str(raised.value)) < 400
    undeclared = CachedStream(Tokens(0), tmp_path / "b.mmc", key="k", max_bytes="1MiB")
    with pytest.raises(ValueError, match="a Python list of 601 numbers, where the first sample's had 600") as raised:
        list(undeclared)
    message = str(raised.value)
    assert len(message) < 900  # with what became of the file made from the first element
    assert 'with_format("numpy")' in message
    assert '"input_ids": Field((None,), "int64")' in message  # the declaration to use


# -- a first try refuted by its second element -------------------------------------------------------


class Growing(torch.utils.data.IterableDataset[Any]):
    """Token sequences whose length varies from the second element on: fields inferred from the first do not fit."""

    def __iter__(self) -> Iterator[Any]:
        for i in range(100):
            yield {"tokens": torch.arange(i % 7 + 3), "label": i}


GROWING = {"tokens": Field((None,), "int64"), "label": Field((), "int64")}


@pytest.mark.parametrize("held", [False, True])
def test_a_first_try_refuted_by_its_second_element_is_replaced_by_the_corrected_rerun(
    tmp_path: Path, held: bool
) -> None:
    from mmapcache import Cache

    path = tmp_path / "s.mmc"
    first = CachedStream(Growing(), path, key="k", max_bytes="1MiB")
    holder = None
    if held:  # another process of the first try still has the file open
        _interrupted(first, 1)
        holder = Cache(path, key="k")
    with pytest.raises(ValueError, match="fields=") as raised:
        list(first)
    left = path.exists()
    rerun = CachedStream(Growing(), path, key="k", fields=GROWING, max_bytes="1MiB")
    assert [int(e["label"]) for e in rerun] == list(range(100))
    assert sorted(int(e["label"]) for e in rerun) == list(range(100))  # from the new file
    assert rerun.stats()["complete"]
    assert rerun.stats()["stored"] == 100
    rerun.close()
    if held:
        assert "the next try replaces it" in str(raised.value)
        assert left
    else:
        assert "was removed: the next try starts afresh" in str(raised.value)
        assert not left
    first.close()
    if holder is not None:
        assert holder.refuted  # its nameless copy
        holder.close()


# -- holes left by a writer killed inside a batch store ------------------------------------------------

STREAM_PROCS = HERE / "_stream_procs.py"


def _procs(path: Path, length: int, *extra: str) -> tuple[int, str, str]:
    """Run tests/_stream_procs.py on partition 0 of 1: its return code and output."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    args = [sys.executable, str(STREAM_PROCS), str(path), "0", "1", "0", "1", str(length), *extra]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("moment", ["batch-half-filled", "batch-filled", "batch-recording", "batch-counting"])
def test_holes_a_writer_killed_mid_batch_store_leaves_are_filled_again_so_a_sized_file_completes_cached(
    tmp_path: Path, moment: str
) -> None:
    import signal

    from _stream_procs import FIELDS, KEY

    from mmapcache._streams.stream_cache import Partition, open_stream, stream_status

    path = tmp_path / "s.mmc"
    length = 1000  # the file is sized from the length: 1000 + 16 + 16 slots, less than one killed batch more
    for at in (128, 640):  # two kills, each inside the store of a 64-element batch
        code, _, err = _procs(path, length, "--batch", "64", "--die", moment, str(at))
        assert code == -signal.SIGKILL, err
    code, out, err = _procs(path, length, "--batch", "64")
    assert code == 0, err
    assert out.split()[-2:] == ["ended", "1"]
    cache = open_stream(path, key=KEY, fields=FIELDS, partition=Partition(), plan=None)
    assert cache is not None
    with cache:
        status = stream_status(cache)
        assert status.capacity == 1032
        assert status.cached, status  # complete, and nothing left uncached
        assert status.stored == status.total == length
        assert not cache.verify()


def test_a_sized_cached_stream_killed_twice_inside_batch_stores_completes_with_everything_cached(
    tmp_path: Path,
) -> None:
    import json
    import os
    import signal
    import subprocess

    path, out = tmp_path / "s.mmc", tmp_path / "out.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [str(path), "--length", "1000", "--kind", "fixed", "--sized", "--out", str(out), *extra]
        return subprocess.run([sys.executable, str(HERE / "stream_run.py"), *args], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip

    for kill in ("3", "6"):  # the 3rd batch of the first run, the 6th of the second (its pass continues the first)
        killed = run("--epochs", "1", "--kill-in-store", kill)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run("--epochs", "2")
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    stats = json.loads(next(line for line in lines if line.startswith("stats")).split(" ", 2)[2])
    assert stats["complete"]
    assert not stats["full"]
    assert stats["stored"] == stats["total"] == 1000
    assert stats["uncached"] == 0
    assert stats["capacity"] == 1032  # 1000 elements, 32 to spare: less than the two killed batches
    second = [int(line.split()[2]) for line in lines if line.startswith("0 1 ")]
    assert sorted(second) == list(range(1000))  # the second epoch, read from the file
