"""CachedStream over real streams (generator IterableDataset, HF datasets, WebDataset): workers, ranks, kills."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from mmapcache import Cache, Field
from mmapcache._streams.stream_cache import stream_status
from mmapcache.torch import CachedStream, Packed, Padded, pad_collate, ragged_collate

HERE = Path(__file__).parents[1]
sys.path.insert(0, str(HERE))
from stream_sources import Numbers, WithLength, fixed, large, numbered  # noqa: E402

FIELDS = {
    "x": Field((4,), "int64"),
    "label": Field((), "int64"),
    "caption": Field((None,), "str"),
    "tokens": Field((None,), "int32"),
}


def _labels(loader: DataLoader[Any]) -> list[int]:
    return [label for batch in loader for label in batch["label"].tolist()]


def _passes(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}


def test_the_first_epoch_yields_the_stream_in_order_as_the_cache_returns_it(tmp_path: Path) -> None:
    ds = CachedStream(Numbers(20), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    first = list(ds)
    later = {int(element["label"]): element for element in ds}
    for i, element in enumerate(first):
        expected = numbered(i)
        assert isinstance(element["x"], torch.Tensor)
        assert torch.equal(element["x"], expected["x"])
        assert element["label"].dtype == torch.int64
        assert int(element["label"]) == i
        assert element["caption"] == expected["caption"]
        assert torch.equal(element["tokens"], expected["tokens"])
        cached = later[i]  # the same element, read from the file
        assert cached["caption"] == element["caption"]
        assert torch.equal(cached["tokens"], element["tokens"])
        assert torch.equal(cached["x"], element["x"])


def _stored_labels(ds: CachedStream) -> list[int]:
    """The labels a complete cache holds, one per stored element (a later epoch, in stored order)."""
    ds.shuffle = False
    return [int(element["label"]) for element in ds]


@pytest.mark.parametrize("how", ["break", "del"])
def test_an_iterator_abandoned_mid_epoch_stores_what_it_yielded_and_the_next_epoch_the_rest(
    tmp_path: Path, how: str
) -> None:
    ds = CachedStream(Numbers(100), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    seen = []
    if how == "break":
        for element in ds:
            seen.append(int(element["label"]))
            if len(seen) == 10:
                break
    else:
        iterator = iter(ds)
        seen = [int(next(iterator)["label"]) for _ in range(10)]
        del iterator
    assert seen == list(range(10))
    assert ds.stats()["stored"] == 10  # fewer than a batch: stored when the iterator was let go, not lost
    assert [int(element["label"]) for element in ds] == list(range(100))  # the rest of epoch 1
    stats = ds.stats()
    assert (stats["complete"], stats["stored"], stats["total"]) == (True, 100, 100)
    assert _stored_labels(ds) == list(range(100))  # each element once


def test_changing_a_yielded_element_in_place_does_not_change_what_is_stored(tmp_path: Path) -> None:
    ds = CachedStream(Numbers(150), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB", shuffle=False)
    for element in ds:
        element["x"].add_(1000)  # an in-place augmentation, before the element's batch is stored
        element["tokens"].zero_()
    for element in ds:
        expected = numbered(int(element["label"]))
        assert torch.equal(element["x"], expected["x"])
        assert torch.equal(element["tokens"], expected["tokens"])


def test_an_error_making_the_file_in_the_background_is_raised_from_the_iteration(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    ds = CachedStream(Numbers(100), tmp_path / "a-file" / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        list(ds)


@pytest.mark.parametrize("kind", ["numbered", "large"])
def test_an_error_making_the_file_after_an_early_stop_is_logged_not_raised_from_the_cleanup(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.mmc"
    options: dict[str, Any] = {"fields": FIELDS, "max_bytes": "1MiB"} if kind == "numbered" else {"max_bytes": "16MiB"}
    ds = CachedStream(Numbers(300, kind=kind), path, key="k", **options)
    iterator = iter(ds)  # no file yet: the first element makes it, in a thread
    ds._lock.acquire()  # which waits for this: the error comes after the stop
    releaser = threading.Timer(0.3, ds._lock.release)
    try:
        first = next(iterator)
        assert int(first["label"]) == 0
        path.write_bytes(b"not a cache file" * 512)  # what the thread then finds instead of making the file
        releaser.start()
        with caplog.at_level(logging.WARNING, logger="mmapcache"):
            iterator.close()  # what a break does once the loop lets go of the iterator
    finally:
        releaser.join()
    assert "stopped early" in caplog.text
    assert "not an mmapcache file" in caplog.text
    assert path.read_bytes() == b"not a cache file" * 512, "the foreign file is left as it was"


@pytest.mark.parametrize("how", ["whole", "break", "augmented", "two workers"])
def test_large_rows_stored_beside_the_stream_are_each_stored_once_and_read_back_exact(tmp_path: Path, how: str) -> None:
    ds = CachedStream(Numbers(300, kind="large"), tmp_path / "s.mmc", key="k", max_bytes="16MiB", shuffle=False)
    if how == "two workers":
        loader = DataLoader(ds, batch_size=16, num_workers=2)
        assert sorted(_labels(loader)) == list(range(300))
    else:
        for element in ds:
            assert torch.equal(element["image"], large(int(element["label"]))["image"])
            if how == "augmented":
                element["image"].zero_()  # in place, while earlier batches are being stored
            if how == "break" and int(element["label"]) == 99:
                break
        if how == "break":
            assert ds.stats()["stored"] == 100  # what was yielded, stored when the iterator was let go
            assert [int(element["label"]) for element in ds] == list(range(300))  # epoch 1 again, storing the rest
    stats = ds.stats()
    assert (stats["complete"], stats["stored"], stats["total"]) == (True, 300, 300)
    labels = []
    for element in ds:  # a later epoch: only the file
        label = int(element["label"])
        labels.append(label)
        assert torch.equal(element["image"], large(label)["image"])
    assert sorted(labels) == list(range(300))
    ds.close()
    with Cache(tmp_path / "s.mmc") as cache:
        assert cache.verify() == []


def test_an_error_making_the_file_for_large_rows_is_raised_from_the_iteration(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    ds = CachedStream(Numbers(300, kind="large"), tmp_path / "a-file" / "s.mmc", key="k", max_bytes="16MiB")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        list(ds)


@pytest.mark.parametrize("workers", [0, 2])
def test_token_sequences_through_pad_collate_give_exact_padded_batches_in_every_epoch(
    tmp_path: Path, workers: int
) -> None:
    ds = CachedStream(Numbers(60), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    loader = DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=pad_collate)
    for epoch in range(2):  # the first fills the cache, the second reads it
        ds.set_epoch(epoch)
        labels = []
        for batch in loader:
            tokens = batch["tokens"]
            assert isinstance(tokens, Padded)
            for k, label in enumerate(batch["label"].tolist()):
                expected = numbered(label)["tokens"]
                assert int(tokens.lengths[k]) == len(expected)
                assert torch.equal(tokens.data[k, : len(expected)], expected)
                assert not tokens.data[k, len(expected) :].any()  # padded with zeros
            assert tokens.data.shape[1] == int(tokens.lengths.max())
            labels += batch["label"].tolist()
        assert sorted(labels) == list(range(60))
    assert ds.stats()["complete"]


def test_later_epochs_read_only_the_file_in_a_fresh_permutation_each(tmp_path: Path) -> None:
    passes = tmp_path / "passes"
    ds = CachedStream(
        Numbers(64, kind="fixed", passes=str(passes)), tmp_path / "s.mmc", key="k", max_bytes="1MiB", seed=1
    )
    loader = DataLoader(ds, batch_size=8)
    with pytest.raises(TypeError, match="known once its cache is complete"):
        len(ds)
    assert _labels(loader) == list(range(64))  # stream order
    assert _passes(passes) == 1
    assert len(ds) == len(loader) * 8 == 64
    orders = []
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        orders.append(_labels(loader))
    assert _passes(passes) == 1  # the stream was not read again
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(64))
    assert orders[0] != orders[1]
    ds.set_epoch(1)
    again = CachedStream(Numbers(64, kind="fixed"), tmp_path / "s.mmc", key="k", max_bytes="1MiB", seed=1)
    again.set_epoch(1)
    assert _labels(DataLoader(again, batch_size=8)) == orders[0]  # the same permutation in every process
    unshuffled = CachedStream(Numbers(64, kind="fixed"), tmp_path / "s.mmc", key="k", max_bytes="1MiB", shuffle=False)
    assert _labels(DataLoader(unshuffled, batch_size=8)) == list(range(64))
    stats = ds.stats()
    assert (stats["complete"], stats["full"], stats["stored"], stats["total"], stats["uncached"]) == (
        True,
        False,
        64,
        64,
        0,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_workers_store_each_element_once_and_share_later_epochs(tmp_path: Path, workers: int) -> None:
    passes = tmp_path / "passes"
    ds = CachedStream(Numbers(50, passes=str(passes)), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pad_collate)
    assert sorted(_labels(loader)) == list(range(50))
    with Cache(tmp_path / "s.mmc", readonly=True) as cache:
        status = stream_status(cache)
        assert status.partitioning == (1, max(workers, 1))
        assert (status.cached, status.stored) == (True, 50)
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        assert sorted(_labels(loader)) == list(range(50))
    assert _passes(passes) == max(workers, 1)  # one pass per worker, in the first epoch only


def test_a_stream_with_a_len_sizes_the_file_from_it(tmp_path: Path) -> None:
    ds = CachedStream(WithLength(30, kind="fixed"), tmp_path / "s.mmc", key="k")
    assert len(ds) == 30  # the stream's own, until the cache is complete
    assert len(list(ds)) == 30
    assert ds.cache is not None
    assert 30 <= ds.cache.capacity < 100


def test_a_stream_larger_than_the_budget_is_admitted_until_full_and_the_rest_streamed_every_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    passes = tmp_path / "passes"
    ds = CachedStream(Numbers(3000, kind="fixed", passes=str(passes)), tmp_path / "s.mmc", key="k", max_bytes="64KiB")
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        assert sorted(int(e["label"]) for e in ds) == list(range(3000))
    assert "is full" in caplog.text
    stats = ds.stats()
    assert (stats["complete"], stats["full"]) == (True, True)
    assert 0 < stats["stored"] < 3000
    assert stats["uncached"] == 3000 - stats["stored"]
    second = [int(e["label"]) for e in ds]
    assert sorted(second) == list(range(3000))  # the stored ones from the file, the rest streamed
    assert _passes(passes) == 2
    assert ds.stats()["read"] == stats["stored"]


def test_hf_datasets_streaming_over_jsonl_and_parquet(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"text": f"line {i} " + "x" * (i % 9), "label": i} for i in range(40)]
    jsonl = []
    for k in range(2):  # two files: two shards, one per DataLoader worker
        path = tmp_path / f"part{k}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows[k * 20 : (k + 1) * 20]))
        jsonl.append(str(path))
    parquet = str(tmp_path / "all.parquet")
    datasets.Dataset.from_list(rows).to_parquet(parquet)
    for name, files, kind, workers in (("j", jsonl, "json", 2), ("p", [parquet], "parquet", 0)):
        stream = datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
        ds = CachedStream(stream, tmp_path / f"{name}.mmc", key=f"hf-{name}", max_bytes="1MiB")
        loader = DataLoader(ds, batch_size=8, num_workers=workers)
        first = [
            (text, int(label)) for batch in loader for text, label in zip(batch["text"], batch["label"], strict=True)
        ]
        assert sorted(first, key=lambda row: row[1]) == [(row["text"], row["label"]) for row in rows]
        assert ds.stats()["complete"]
        ds.set_epoch(1)
        second = [
            (text, int(label)) for batch in loader for text, label in zip(batch["text"], batch["label"], strict=True)
        ]
        assert sorted(second) == sorted(first)
        assert second != first


def test_webdataset_tar_shards(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    shards = []
    for k in range(2):
        shard = str(tmp_path / f"shard-{k}.tar")
        with wds.TarWriter(shard) as writer:
            for i in range(k * 25, (k + 1) * 25):
                writer.write({"__key__": f"{i:06d}", "txt": f"caption {i}", "cls": i})
        shards.append(shard)
    for workers in (0, 2):
        stream = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("txt", "cls")
        ds = CachedStream(stream, tmp_path / f"w{workers}.mmc", key=f"wds-{workers}", max_bytes="1MiB")
        loader = DataLoader(ds, batch_size=5, num_workers=workers)
        for epoch in range(2):
            ds.set_epoch(epoch)
            seen = [(text, int(label)) for texts, labels in loader for text, label in zip(texts, labels, strict=True)]
            assert sorted(seen, key=lambda row: row[1]) == [(f"caption {i}", i) for i in range(50)]
        assert ds.stats()["stored"] == 50


@pytest.mark.parametrize("kind", ["numbered", "large"])
def test_a_run_killed_during_the_first_epoch_is_continued_by_the_next_without_duplicates(
    tmp_path: Path, kind: str
) -> None:
    path, out = tmp_path / "s.mmc", tmp_path / "out"
    command = [sys.executable, str(HERE / "stream_run.py"), str(path), "--length", "200", "--workers", "2",
               "--kind", kind]  # fmt: skip
    run = subprocess.Popen([*command, "--delay", "0.01", "--out", str(out)], env=_env(), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _passes(out) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    # The orphaned workers notice their parent is gone (within torch's 5 s status interval), store what they
    # yielded and exit: wait for it, however loaded the machine.
    deadline = time.monotonic() + 60
    while True:
        with Cache(path, readonly=True) as cache:
            status = stream_status(cache)
        if status.stored or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not status.complete
    assert 0 < status.stored < 200
    done = subprocess.run([*command, "--out", str(out), "--epochs", "2"], env=_env(), capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    with Cache(path, readonly=True) as cache:
        status = stream_status(cache)
        assert (status.cached, status.stored, status.total) == (True, 200, 200)
        assert cache.verify() == []  # each element in one slot, every checksum right
    stats_line = out.read_text().splitlines()[-1]
    assert stats_line.startswith("stats 0")


def test_two_ranks_under_torchrun_store_the_stream_once_and_read_equal_shares(tmp_path: Path) -> None:
    path, out = tmp_path / "s.mmc", tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(HERE / "stream_run.py"), str(path), "--length", "101", "--workers", "2", "--epochs", "3"]
    run = subprocess.run(
        [*command, "--out", str(out), "--ddp"], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line.split() for line in out.read_text().splitlines() if not line.startswith("stats")]
    by_epoch: dict[int, Counter[int]] = {}
    per_rank: Counter[tuple[int, int]] = Counter()
    for rank, epoch, label in ((int(a), int(b), int(c)) for a, b, c in lines):
        by_epoch.setdefault(epoch, Counter())[label] += 1
        per_rank[(epoch, rank)] += 1
    assert sorted(by_epoch[0]) == list(range(101))
    assert set(by_epoch[0].values()) == {1}  # the first epoch: the stream itself, each element once
    for epoch in (1, 2):
        assert sorted(by_epoch[epoch]) == list(range(101))  # every element, one padded in twice
        assert sum(by_epoch[epoch].values()) == 102
        assert per_rank[(epoch, 0)] == per_rank[(epoch, 1)] == 51  # equal shares, as DDP needs
    with Cache(path, readonly=True) as cache:
        status = stream_status(cache)
        assert status.partitioning == (2, 2)
        assert (status.cached, status.stored) == (True, 101)


def test_a_map_style_dataset_or_a_one_shot_iterator_is_refused_with_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cache it with mmapcache\.torch\.CachedDataset"):
        CachedStream(torch.utils.data.TensorDataset(torch.zeros(3)), tmp_path / "s.mmc", key="k")
    with pytest.raises(TypeError, match="one-shot iterator"):
        CachedStream((fixed(i) for i in range(3)), tmp_path / "s.mmc", key="k")
    with pytest.raises(ValueError, match="key must not be empty"):
        CachedStream(Numbers(3), tmp_path / "s.mmc", key="")


def test_a_stream_without_len_or_budget_is_refused_at_its_first_element(tmp_path: Path) -> None:
    ds = CachedStream(Numbers(3, kind="fixed"), tmp_path / "s.mmc", key="k")
    with pytest.raises(ValueError, match="pass max_bytes="):
        next(iter(ds))


def test_varying_shapes_without_fields_are_refused_with_the_declaration_to_use(tmp_path: Path) -> None:
    ds = CachedStream(Numbers(20), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    with pytest.raises(ValueError, match=r"fields=\{.*\"tokens\": Field\(\(None,\), \"int32\"\)"):
        list(ds)


def test_spawned_workers_receive_the_stream_without_data_and_fill_the_same_file(tmp_path: Path) -> None:
    ds = CachedStream(Numbers(40, kind="fixed"), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    assert sorted(_labels(loader)) == list(range(40))
    assert sorted(_labels(loader)) == list(range(40))  # the second epoch from the file
    stats = ds.stats()
    assert (stats["complete"], stats["stored"], stats["partitioning"]) == (True, 40, [1, 2])


def test_cached_dataset_refuses_a_stream_and_names_cached_stream(tmp_path: Path) -> None:
    from mmapcache.torch import CachedDataset

    with pytest.raises(TypeError, match=r"IterableDataset \(a stream\).*CachedStream"):
        CachedDataset(Numbers(10), tmp_path / "a.mmc", key="k")

    class OnlyLength:
        def __len__(self) -> int:
            return 3

    with pytest.raises(TypeError, match=r"got OnlyLength\. A stream.*CachedStream"):
        CachedDataset(OnlyLength(), tmp_path / "b.mmc", key="k")


def test_cached_dataset_over_a_getitem_that_raises_not_implemented_names_cached_stream(tmp_path: Path) -> None:
    from mmapcache.torch import CachedDataset

    class Streaming(torch.utils.data.Dataset[Any]):  # map-style by its methods, a stream in fact
        def __len__(self) -> int:
            return 5

        def __getitem__(self, index: int) -> Any:
            raise NotImplementedError

        def __iter__(self) -> Any:
            return iter(range(5))

    ds = CachedDataset(Streaming(), tmp_path / "c.mmc", key="k")
    with pytest.raises(TypeError, match="CachedStream") as info:
        ds[0]
    assert "CachedStream" in str(info.value)
    assert "raised NotImplementedError" in str(info.value)


def test_a_webdataset_pipeline_with_a_length_is_refused_by_cached_dataset_with_what_to_use(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    from mmapcache.torch import CachedDataset

    shard = str(tmp_path / "s.tar")
    with wds.TarWriter(shard) as writer:
        writer.write({"__key__": "0", "txt": "a", "cls": 0})
    pipeline = wds.WebDataset([shard], shardshuffle=False).decode().to_tuple("txt", "cls").with_length(1)
    with pytest.raises(TypeError, match="CachedStream"):
        CachedDataset(pipeline, tmp_path / "w.mmc", key="k")


@pytest.mark.parametrize("workers", [0, 2])
def test_token_sequences_through_ragged_collate_give_exact_packed_batches_in_every_epoch(
    tmp_path: Path, workers: int
) -> None:
    ds = CachedStream(Numbers(60), tmp_path / "s.mmc", key="k", fields=FIELDS, max_bytes="1MiB")
    loader = DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=ragged_collate("packed", leaves="tokens"))
    for epoch in range(2):  # the first fills the cache, the second reads it
        ds.set_epoch(epoch)
        labels = []
        for batch in loader:
            packed = batch["tokens"]
            assert isinstance(packed, Packed)
            expected = [numbered(label)["tokens"] for label in batch["label"].tolist()]
            assert torch.equal(packed.values, torch.cat(expected))
            assert packed.cu_seqlens.tolist() == [0, *itertools.accumulate(len(t) for t in expected)]
            assert packed.max_seqlen == max(len(t) for t in expected)
            labels += batch["label"].tolist()
        assert sorted(labels) == list(range(60))
    assert ds.stats()["complete"]


def test_dtypes_and_fields_together_store_int32_tokens_as_uint16_and_refuse_a_value_that_does_not_fit(
    tmp_path: Path,
) -> None:
    """As CachedDataset: dtypes= sets the declared fields' dtypes, and a declared field takes exact conversions."""
    ds = CachedStream(
        Numbers(30), tmp_path / "s.mmc", key="k", fields=FIELDS, dtypes={"tokens": "uint16"}, max_bytes="1MiB"
    )
    for _ in range(2):  # filled, then read from the file
        for element in ds:
            expected = numbered(int(element["label"]))
            assert element["tokens"].dtype == torch.uint16
            assert element["tokens"].tolist() == expected["tokens"].tolist()
    assert ds.cache is not None
    assert ds.cache.fields["tokens"] == Field((None,), "uint16")
    narrow = {**FIELDS, "x": Field((4,), "uint8")}  # x holds 3 * i, past 255 from i = 86
    too_small = CachedStream(Numbers(100), tmp_path / "n.mmc", key="n", fields=narrow, max_bytes="1MiB")
    with pytest.raises(ValueError, match="cannot be stored as uint8"):
        list(too_small)


class _SomeEmpty(torch.utils.data.IterableDataset[Any]):
    """Elements whose tokens and caption are empty for about 3 % of them (empty documents are ordinary)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.length, workers):
            yield _some_empty(i)


def _some_empty(i: int) -> dict[str, Any]:
    empty = (i * 7919) % 33 == 0
    return {
        "label": i,
        "caption": "" if empty else f"element {i} " + "ab" * (i % 5),
        "tokens": torch.arange(0 if empty else i % 7 + 1, dtype=torch.int32) + i,
    }


def test_empty_values_among_the_elements_are_stored_and_read_back_exact_by_two_workers(tmp_path: Path) -> None:
    fields = {"label": Field((), "int64"), "caption": Field((None,), "str"), "tokens": Field((None,), "int32")}
    ds = CachedStream(_SomeEmpty(640), tmp_path / "s.mmc", key="k", fields=fields, max_bytes="4MiB")
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    for epoch in range(2):  # the first fills the file, the second reads it back
        ds.set_epoch(epoch)
        seen = 0
        for element in loader:
            expected = _some_empty(int(element["label"]))
            assert element["caption"] == expected["caption"]
            assert torch.equal(element["tokens"], expected["tokens"])
            seen += 1
        assert seen == 640
    with Cache(tmp_path / "s.mmc", readonly=True) as cache:
        assert cache.verify() == []
