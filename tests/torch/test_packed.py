"""PackedSequences: packing plans, their file beside the cache, items and batches.

Tokens are numbered through the whole corpus (document ``d``'s token ``j`` is
``edges[d] + j``), so a sequence tells which token of which document sits
where, and every property reads straight off the values.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapcache
from mmapcache import Field
from mmapcache._file.names import plans_of
from mmapcache.torch import CachedDataset, CachedStream, NodeShardSampler, PackedSequences
from mmapcache.torch._packing_plan import best_fit_decreasing, make_plan

FIELDS = {"input_ids": Field((None,), "int32")}


class Documents:
    """Documents of the given lengths; token ``j`` of document ``d`` is ``edges[d] + j`` (+ ``shift``)."""

    def __init__(self, lengths: list[int], shift: int = 0) -> None:
        self.lengths = list(lengths)
        self.edges = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self.shift = shift

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        start = int(self.edges[i]) + self.shift
        return {"input_ids": torch.arange(start, start + self.lengths[i], dtype=torch.int32)}


class Stream(torch.utils.data.IterableDataset[Any]):
    def __init__(self, lengths: list[int]) -> None:
        self.docs = Documents(lengths)

    def __iter__(self) -> Any:
        return (self.docs[i] for i in range(len(self.docs)))


def dataset(directory: Path, lengths: list[int], *, name: str = "c.mmc", **kwargs: Any) -> CachedDataset:
    budget = 64 * 1024 + 8 * sum(lengths)
    return CachedDataset(
        Documents(lengths, **kwargs), directory / name, key="docs", fields=FIELDS, max_bytes=budget, check=0
    )


def everything(packed: PackedSequences) -> dict[str, Any]:
    return packed.batch(np.arange(len(packed)))


def fragments(batch: dict[str, Any]) -> list[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """``(doc, tokens, positions)`` of each fragment of a batch, by its ``cu_seqlens``."""
    cu = batch["cu_seqlens"].numpy()
    ids, docs, pos = (batch[k].reshape(-1).numpy() for k in ("input_ids", "doc_ids", "position_ids"))
    return [(int(docs[a]), ids[a:b], pos[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


def check_packing(packed: PackedSequences, lengths: list[int], pad_id: int) -> None:
    """Every property the plan promises, read off the values of every sequence."""
    seq_len, mode, long_docs = packed.seq_len, packed.mode, packed.long_docs
    batch = everything(packed)
    count = len(packed)
    ids, docs, pos = (batch[k].numpy() for k in ("input_ids", "doc_ids", "position_ids"))
    assert ids.shape == docs.shape == pos.shape == (count, seq_len)
    assert batch["position_ids"].dtype == batch["doc_ids"].dtype == torch.int64
    assert batch["input_ids"].dtype == torch.int32
    cu = batch["cu_seqlens"].numpy()
    assert batch["cu_seqlens"].dtype == torch.int32
    assert cu[0] == 0
    assert cu[-1] == count * seq_len
    assert (np.diff(cu) > 0).all()
    # Every row boundary is a fragment boundary.
    assert set(range(0, count * seq_len + 1, seq_len)) <= set(cu.tolist())
    edges = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    kept = np.minimum(lengths, seq_len) if long_docs == "truncate" else np.asarray(lengths, np.int64)
    seen: list[np.ndarray[Any, Any]] = []
    longest = 0
    for doc, tokens, positions in fragments(batch):
        longest = max(longest, len(tokens))
        np.testing.assert_array_equal(positions, np.arange(len(tokens)))  # from 0 in every fragment
        if doc == -1:
            assert (tokens == pad_id).all()
            continue
        first = int(tokens[0]) - int(edges[doc])
        assert first >= 0
        assert first + len(tokens) <= kept[doc]  # within the document (what is kept of it)
        np.testing.assert_array_equal(tokens, np.arange(len(tokens)) + tokens[0])  # in order
        seen.append(tokens)
    assert batch["max_seqlen"] == longest
    # doc_ids change only where a fragment starts (cu_seqlens agrees with doc_ids).
    flat_docs = docs.reshape(-1)
    changes = np.flatnonzero(np.diff(flat_docs)) + 1
    assert set(changes.tolist()) <= set(cu.tolist())
    # Padding only at the end of a row.
    for row in docs:
        pad = np.flatnonzero(row == -1)
        assert not len(pad) or pad[0] == seq_len - len(pad)
    if mode == "concat":
        assert (docs == -1).sum() == (count * seq_len - int(kept.sum()))
        assert (docs == -1).sum() < seq_len
        assert (docs[:-1] != -1).all()  # only the last sequence is padded
    everything_seen = np.sort(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
    expected = np.concatenate([np.arange(edges[d], edges[d] + kept[d]) for d in range(len(lengths))] + [[]])
    np.testing.assert_array_equal(everything_seen, expected)  # every kept token exactly once
    if mode == "concat":
        np.testing.assert_array_equal(np.concatenate(seen) if seen else [], expected)  # in document order
    if mode == "bfd":
        whole = [doc for doc, _, _ in fragments(batch) if doc >= 0 and lengths[doc] <= seq_len]
        assert len(whole) == len(set(whole)), "a document that fits a sequence is never split"


SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PACKINGS = {
    "lengths": st.lists(st.integers(0, 80), min_size=1, max_size=24),
    "seq_len": st.integers(1, 40),
    "mode": st.sampled_from(["bfd", "concat"]),
    "long_docs": st.sampled_from(["split", "truncate"]),
    "pad_id": st.integers(-5, 5),
}


def _check_a_packing(lengths: list[int], seq_len: int, mode: str, long_docs: str, pad_id: int, cache_dir: Path) -> None:
    if sum(lengths) == 0:
        lengths = [*lengths, 1]
    directory = Path(tempfile.mkdtemp(dir=cache_dir))
    ds = dataset(directory, lengths)
    packed = PackedSequences(ds, seq_len, mode=mode, long_docs=long_docs, pad_id=pad_id)
    check_packing(packed, lengths, pad_id)
    ds.close()


@settings(SETTINGS, max_examples=20)  # each example is a cache file and its plan; the slow test below tries more
@given(**PACKINGS)
def test_every_token_appears_once_in_order_and_ids_never_cross_a_fragment(
    lengths: list[int], seq_len: int, mode: str, long_docs: str, pad_id: int, cache_dir: Path
) -> None:
    _check_a_packing(lengths, seq_len, mode, long_docs, pad_id, cache_dir)


@pytest.mark.slow
@settings(SETTINGS, max_examples=200)
@given(**PACKINGS)
def test_every_token_appears_once_in_order_and_ids_never_cross_a_fragment_in_many_packings(
    lengths: list[int], seq_len: int, mode: str, long_docs: str, pad_id: int, cache_dir: Path
) -> None:
    _check_a_packing(lengths, seq_len, mode, long_docs, pad_id, cache_dir)


def reference_bfd(sizes: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing one item at a time: the least room that fits, ties to the first bin opened."""
    order = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    room: list[int] = []
    bins = [0] * len(sizes)
    for k in order:
        fitting = [(r, b) for b, r in enumerate(room) if r >= sizes[k]]
        if fitting:
            _, b = min(fitting)
        else:
            b = len(room)
            room.append(capacity)
        room[b] -= sizes[k]
        bins[k] = b
    return bins


@settings(max_examples=200, deadline=None, database=None)
@given(capacity=st.integers(1, 50), data=st.data())
def test_the_vectorized_best_fit_decreasing_places_every_item_as_one_at_a_time_does(
    capacity: int, data: st.DataObject
) -> None:
    sizes = data.draw(st.lists(st.integers(1, capacity), max_size=60))
    got = best_fit_decreasing(np.array(sizes, np.int64), capacity)
    assert got.tolist() == reference_bfd(sizes, capacity)


def test_bfd_pads_little_on_log_normal_documents_and_concat_pads_only_the_last_sequence() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(math.log(256), 0.9, 20_000)), 8, 4096).astype(np.int64)
    bfd = make_plan(lengths, 4096, "bfd", "split")
    assert bfd.padding / (len(bfd) * 4096) <= 0.02
    concat = make_plan(lengths, 4096, "concat", "split")
    assert concat.padding < 4096
    assert bfd.tokens == concat.tokens == int(lengths.sum())


def test_an_item_is_one_sequence_with_its_own_cu_seqlens(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [5, 3, 9])
    packed = PackedSequences(ds, 8, mode="concat", pad_id=-1)
    assert len(packed) == 3
    item = packed[0]
    assert item["input_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert item["doc_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert item["cu_seqlens"].tolist() == [0, 5, 8]
    assert item["max_seqlen"] == 5
    assert packed[1]["doc_ids"].tolist() == [2] * 8
    last = packed[-1]
    assert last["input_ids"].tolist() == [16, -1, -1, -1, -1, -1, -1, -1]
    assert last["doc_ids"].tolist() == [2, -1, -1, -1, -1, -1, -1, -1]
    assert last["position_ids"].tolist() == [0, 0, 1, 2, 3, 4, 5, 6]  # from 0 in each fragment, padding too
    assert last["cu_seqlens"].tolist() == [0, 1, 8]
    bfd = PackedSequences(ds, 8)
    assert [bfd[i]["doc_ids"].tolist() for i in range(len(bfd))] == [
        [2] * 8,  # the 9-token document split: 8, then its last token
        [0] * 5 + [1] * 3,
        [2] + [-1] * 7,
    ]
    with pytest.raises(IndexError, match="out of range"):
        packed[3]


def test_the_plan_is_stored_beside_the_cache_and_reopened_not_remade(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [5, 30, 7, 12])
    first = PackedSequences(ds, 16)
    assert first.made
    (plan,) = plans_of(ds.path)
    again = PackedSequences(ds, 16)
    assert not again.made
    assert plans_of(ds.path) == [plan]
    assert all(
        torch.equal(a, b)
        for a, b in zip(everything(first).values(), everything(again).values(), strict=True)
        if torch.is_tensor(a)
    )
    # Other arguments: another plan, another file.
    assert PackedSequences(ds, 16, mode="concat").made
    assert PackedSequences(ds, 17).made
    assert PackedSequences(ds, 16, long_docs="truncate").made
    assert not PackedSequences(ds, 16, pad_id=3).made  # padding is applied when reading
    assert len(plans_of(ds.path)) == 4


def test_a_plan_made_for_another_cache_or_other_documents_is_never_used(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [5, 30, 7])
    PackedSequences(ds, 16)
    # The same path made again: another uuid.
    ds.close()
    mmapcache.remove(ds.path)
    assert not plans_of(ds.path), "remove deletes the cache's plans"
    other = dataset(cache_dir, [5, 30, 7])
    assert PackedSequences(other, 16).made
    # The same file cleared and filled with documents of other lengths.
    other.cache.clear()
    other.close()
    longer = dataset(cache_dir, [6, 30, 9])
    packed = PackedSequences(longer, 16)
    assert packed.made
    check_packing(packed, [6, 30, 9], 0)


def test_a_resized_cache_has_its_old_plans_removed_and_packs_anew(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [5, 30, 7, 12])
    PackedSequences(ds, 16)
    PackedSequences(ds, 16, mode="concat")
    assert len(plans_of(ds.path)) == 2
    ds.close()
    mmapcache.resize(ds.path, max_bytes=4 * 64 * 1024)  # a new file at the path: another uuid
    assert plans_of(ds.path) == [], "plans name the old file's uuid: resize removes them"
    again = PackedSequences(dataset(cache_dir, [5, 30, 7, 12]), 16)
    assert again.made
    check_packing(again, [5, 30, 7, 12], 0)


def test_a_damaged_plan_file_is_made_again_and_never_used(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = dataset(cache_dir, [5, 30, 7, 12])
    PackedSequences(ds, 16)
    (plan,) = plans_of(ds.path)
    data = bytearray(plan.read_bytes())
    data[30] ^= 0xFF  # inside the JSON header: its checksum fails
    plan.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        again = PackedSequences(ds, 16)
    assert again.made
    assert "checksum" in caplog.text
    check_packing(again, [5, 30, 7, 12], 0)
    plan.write_bytes(plan.read_bytes()[:-8])  # cut short
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        assert PackedSequences(ds, 16).made


def test_documents_not_cached_yet_are_loaded_through_the_cache_before_planning(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [4, 0, 9, 3])
    assert ds.stats()["filled"] < 4  # opening it stored the first sample only
    packed = PackedSequences(ds, 8)
    assert ds.stats()["filled"] == 4
    check_packing(packed, [4, 0, 9, 3], 0)


def test_a_complete_stream_packs_its_documents_in_their_order(cache_dir: Path) -> None:
    lengths = [3, 11, 0, 6, 2]
    stream = CachedStream(Stream(lengths), cache_dir / "s.mmc", key="s", fields=FIELDS, max_bytes="1MiB")
    packed = PackedSequences(stream, 5, mode="concat")  # read once first, to cache it whole
    check_packing(packed, lengths, 0)
    assert not PackedSequences(stream, 5, mode="concat").made


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be a positive integer"),
        ({"seq_len": 2.5}, ValueError, "seq_len must be a positive integer"),
        ({"mode": "greedy"}, ValueError, r"mode must be one of \('bfd', 'concat'\)"),
        ({"long_docs": "drop"}, ValueError, r"long_docs must be one of \('split', 'truncate'\)"),
        ({"pad_id": 1.0}, TypeError, "pad_id must be an integer"),
        ({"pad_id": 2**40}, ValueError, "pad_id=1099511627776 is not a value of the field's dtype int32"),
        ({"field": "label"}, ValueError, r"must be a one-dimensional variable field .* \['input_ids'\]"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_pass(
    arguments: dict[str, Any], error: type[Exception], match: str, cache_dir: Path
) -> None:
    ds = dataset(cache_dir, [4, 5])
    given_arguments = {"seq_len": 8, **arguments}
    seq_len = given_arguments.pop("seq_len")
    with pytest.raises(error, match=match):
        PackedSequences(ds, seq_len, **given_arguments)


def test_docs_must_be_a_whole_cached_dataset_or_stream(cache_dir: Path) -> None:
    with pytest.raises(TypeError, match="docs must be a CachedDataset or a CachedStream, not list"):
        PackedSequences([1, 2], 8)
    shard = CachedDataset(
        Documents([3, 4, 5]), cache_dir / "s.mmc", key="d", fields=FIELDS, max_bytes="1MiB", cached_indices=[0, 2]
    )
    with pytest.raises(ValueError, match="caches only its cached_indices"):
        PackedSequences(shard, 8)
    small = CachedDataset(
        Documents([3, 4, 5]), cache_dir / "f.mmc", key="d", fields=FIELDS, capacity=2, max_bytes="1MiB"
    )
    with pytest.raises(ValueError, match="caches only the first 2 of 3"):
        PackedSequences(small, 8)


def test_the_loader_gives_whole_batches_with_the_batch_cu_seqlens(cache_dir: Path) -> None:
    lengths = [int(n) for n in np.random.default_rng(1).integers(0, 40, 60)]
    ds = dataset(cache_dir, lengths)
    packed = PackedSequences(ds, 32, pad_id=-1)
    order = torch.Generator().manual_seed(3)
    batches = list(packed.loader(4, shuffle=True, generator=order))
    assert sum(len(b["input_ids"]) for b in batches) == len(packed)
    for batch in batches:
        rows = len(batch["input_ids"])
        assert batch["input_ids"].shape == batch["doc_ids"].shape == batch["position_ids"].shape == (rows, 32)
        assert batch["cu_seqlens"][-1] == rows * 32
        runs = torch.diff(batch["cu_seqlens"])
        assert batch["max_seqlen"] == int(runs.max())
    seen = np.sort(np.concatenate([b["input_ids"].reshape(-1).numpy() for b in batches]))
    np.testing.assert_array_equal(seen[seen >= 0], np.arange(sum(lengths)))
    # A batch is the same whichever way it is read.
    first = packed.batch([0, 1])
    for k in range(2):
        item = packed[k]
        assert torch.equal(first["input_ids"][k], item["input_ids"])


def test_workers_and_pickles_read_the_same_batches(cache_dir: Path) -> None:
    lengths = [int(n) for n in np.random.default_rng(2).integers(0, 50, 80)]
    ds = dataset(cache_dir, lengths)
    packed = PackedSequences(ds, 40, mode="concat")
    alone = [b["input_ids"] for b in packed.loader(3)]
    workers = [b["input_ids"] for b in packed.loader(3, num_workers=2, multiprocessing_context="fork")]
    assert all(torch.equal(a, b) for a, b in zip(alone, workers, strict=True))
    copy = pickle.loads(pickle.dumps(packed))
    assert not copy.made
    assert torch.equal(copy[2]["input_ids"], packed[2]["input_ids"])


def test_node_shard_sampler_deals_the_sequences_between_nodes(cache_dir: Path) -> None:
    ds = dataset(cache_dir, [int(n) for n in np.random.default_rng(4).integers(1, 30, 50)])
    packed = PackedSequences(ds, 16, mode="concat")
    seen = []
    for node in range(2):
        for rank in range(2):
            sampler = NodeShardSampler(packed, num_nodes=2, node_rank=node, local_world_size=2, local_rank=rank)
            for batch in packed.loader(2, sampler=sampler, drop_last=False):
                seen.append(batch["input_ids"])
    rows = torch.cat(seen)
    assert len(rows) >= len(packed)
    assert {tuple(r.tolist()) for r in rows} == {tuple(packed[i]["input_ids"].tolist()) for i in range(len(packed))}


def test_without_the_compiled_gather_the_batches_are_the_same(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mmapcache._region import gathers as _gather

    lengths = [int(n) for n in np.random.default_rng(5).integers(0, 30, 40)]
    packed = PackedSequences(dataset(cache_dir, lengths), 24, pad_id=7)
    native = everything(packed)
    monkeypatch.setattr(_gather, "native", None)
    numpy = everything(packed)
    for name in ("input_ids", "position_ids", "doc_ids", "cu_seqlens"):
        assert torch.equal(native[name], numpy[name])
    assert native["max_seqlen"] == numpy["max_seqlen"]


def test_gc_removes_the_plans_of_a_cache_that_is_gone_and_ls_lists_only_caches(cache_dir: Path) -> None:
    kept = dataset(cache_dir, [5, 9], name="kept.mmc")
    PackedSequences(kept, 8)
    gone = dataset(cache_dir, [5, 9], name="gone.mmc")
    PackedSequences(gone, 8)
    (orphan,) = plans_of(gone.path)
    gone.close()
    os.unlink(gone.path)  # deleted by hand, not with mmapcache rm
    assert [item.path.name for item in mmapcache.list_caches(cache_dir)] == ["kept.mmc"]
    report = mmapcache.gc(cache_dir, older_than="1000d")
    assert [(item.path, item.kind) for item in report.removed] == [(orphan, "plan")]
    assert not orphan.exists()
    assert len(plans_of(kept.path)) == 1


def test_the_format_doc_carries_the_plan_file_spec() -> None:
    from mmapcache.torch import _plan_file

    text = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text(encoding="utf-8")
    assert _plan_file.__doc__ is not None
    assert _plan_file.__doc__.strip() in text
