"""CachedDataset with variable-shape fields: fields=, ragged samples through DataLoaders, pad_collate.

Tests that count loads from the dataset pass ``check=0``: the stale and determinism checks load a few
samples more per process (tests/torch/test_pipelines.py tests them).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch_helpers import (
    TOKEN_FIELDS,
    Tokens,
    accesses,
    as_tokens,
    check_padded_batch,
    identity,
    pad_tokens,
    same,
    tokens,
)

from mmapcache import Field, SchemaMismatchError
from mmapcache.torch import CachedDataset, Padded, pad_collate

N = 60
BUDGET = "1MiB"


def token_cache(path: Path, log: Path | None = None, **kwargs: Any) -> CachedDataset:
    return CachedDataset(
        Tokens(N, log), path, key="tokens/v1", fields=TOKEN_FIELDS, max_bytes=BUDGET, **kwargs, check=0
    )


def batches(loader: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator here
        return list(loader)


# -- a real DataLoader with workers over tokenized text ------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_cache_each_token_sequence_once(context: str, cache_dir: Path) -> None:
    log = cache_dir / "accesses"
    ds = token_cache(cache_dir / "c.mmc", log)

    def loader(**kwargs: Any) -> DataLoader[Any]:
        return DataLoader(ds, num_workers=2, multiprocessing_context=context, **kwargs)

    # Epoch 1: the workers load every sample once, store it, and the padded batches are exact.
    seen = [i for batch in loader(batch_size=8, shuffle=True, collate_fn=pad_tokens) for i in check_padded_batch(batch)]
    assert sorted(seen) == list(range(N))
    first = accesses(log)
    assert Counter(i for _, _, i in first) == Counter(range(N)), "each sample loaded once"
    assert len({pid for pid, _, _ in first}) == 2, "both workers loaded samples"
    assert os.getpid() not in {pid for pid, _, _ in first}
    assert ds.cache.filled == N
    # Epoch 2, new workers: every sample, as it is in the dataset, from the file alone.
    before = ds.stats()
    seen = []
    for batch in loader(batch_size=7, shuffle=True, collate_fn=identity):
        for ids, label in batch:
            assert same((ids, label), as_tokens(int(label)))
            seen.append(int(label))
    assert sorted(seen) == list(range(N))
    after = ds.stats()
    assert after["total_misses"] == before["total_misses"], "zero misses in the second epoch"
    assert after["total_hits"] - before["total_hits"] == N
    assert accesses(log) == first
    # And through loader(), whose workers read the same file.
    fast = [
        i for b in batches(ds.loader(batch_size=9, num_workers=2, collate_fn=pad_tokens)) for i in check_padded_batch(b)
    ]
    assert fast == list(range(N))
    assert accesses(log) == first


def test_cold_and_warm_reads_give_the_dataset_samples(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    order = [5, 1, 5, 59, 0, 17]
    cold = ds.__getitems__(order)  # misses, with a duplicate
    single = [ds[i] for i in order]  # hits, one at a time
    warm = ds.__getitems__(order)
    mixed = ds.__getitems__([2, 5, 3, 59])
    for got in (cold, single, warm):
        for i, sample in zip(order, got, strict=True):
            assert same(sample, as_tokens(i)), (i, sample)
    for i, sample in zip([2, 5, 3, 59], mixed, strict=True):
        assert same(sample, as_tokens(i))
    assert any(len(tokens(i)[0]) == 0 for i in range(N)), "the dataset holds empty sequences too"
    assert all(same(ds[i], as_tokens(i)) for i in range(N))
    # Fresh tensors: writing into one never reaches the cache.
    ds[5][0].fill_(7)
    ds.__getitems__([5])[0][0].fill_(7)
    assert same(ds[5], as_tokens(5))
    # Reopened by path in a "new process": the schema, variable fields included, comes from the file.
    again = pickle.loads(pickle.dumps(CachedDataset(Tokens(N), ds.path, key="tokens/v1")))
    assert same(again[59], as_tokens(59))
    assert again.stats()["misses"] == 0


class Detection(torch.utils.data.Dataset[Any]):
    """Images at their own size, a varying number of boxes and labels, fixed and torch-only dtypes beside them."""

    def __init__(self, length: int = 12, *, uniform: bool = False) -> None:
        self.length, self.uniform = length, uniform

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        # uniform: every batch of 4 consecutive samples has one shape (default_collate can stack them).
        key = i // 4 if self.uniform else i
        h, w, n = 4 + key % 3, 5 + key % 4, key % 3
        return {
            "image": torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g),
            "boxes": torch.rand(n, 4, generator=g),
            "labels": np.arange(n, dtype=np.int64) + i,
            "scale": torch.randn(2, generator=g).to(torch.bfloat16),
            "embedding": torch.randn(n, 3, generator=g).to(torch.bfloat16),
            "id": i,
        }


DETECTION_FIELDS = {
    "image": Field((3, None, None), "uint8"),
    "boxes": Field((None, 4), "float32"),
    "labels": Field((None,), "int64"),
    "scale": Field((2,), torch.bfloat16),
    "embedding": Field((None, 3), torch.bfloat16),
    "id": Field((), "int64"),
}


def _detection_expected(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(v) if isinstance(v, np.ndarray) else torch.tensor(v) if isinstance(v, int) else v
        for k, v in sample.items()
    }


@pytest.mark.parametrize("copy", [True, False])
def test_mixed_fixed_and_variable_fields_round_trip(copy: bool, cache_dir: Path) -> None:
    source = Detection()
    ds = CachedDataset(source, cache_dir / "c.mmc", key="det", fields=DETECTION_FIELDS, max_bytes=BUDGET, copy=copy)
    ds.__getitems__([0, 1, 2])  # creates the file
    if not copy:
        # copy=False maps the file when it is opened: reopen, so that the hits below read through views.
        ds = CachedDataset(source, ds.path, key="det", fields=DETECTION_FIELDS, copy=copy)
    for got in (ds.__getitems__(list(range(12))), [ds[i] for i in range(12)], ds.__getitems__([11, 0, 11])):
        want = [source[i] for i in ([11, 0, 11] if len(got) == 3 else range(12))]
        for sample, raw in zip(got, want, strict=True):
            assert same(sample, _detection_expected(raw))
            assert sample["scale"].dtype == sample["embedding"].dtype == torch.bfloat16
    assert ds.stats()["filled"] == 12


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_stacks_variable_leaves_that_agree_and_raises_as_torch_does(
    workers: int, cache_dir: Path
) -> None:
    uniform = CachedDataset(
        Detection(uniform=True), cache_dir / "u.mmc", key="uniform", fields=DETECTION_FIELDS, max_bytes=BUDGET
    )
    for _ in range(2):  # cold, then warm
        plain = batches(DataLoader(uniform, batch_size=4, num_workers=workers))
        fast = batches(uniform.loader(batch_size=4, num_workers=workers, collate_fn=default_collate))
        direct = batches(DataLoader(Detection(uniform=True), batch_size=4))
        for a, b, c in zip(plain, fast, direct, strict=True):
            assert same(a, b), "loader(collate_fn=default_collate) yields what DataLoader(ds) yields"
            assert same(a, c), "and what DataLoader over the dataset itself yields"
        assert plain[0]["boxes"].shape == (4, 0, 4)
    ragged = CachedDataset(Detection(), cache_dir / "r.mmc", key="ragged", fields=DETECTION_FIELDS, max_bytes=BUDGET)
    ragged.fill(progress=False)
    errors = []
    for loader in (
        DataLoader(Detection(), batch_size=4, num_workers=workers),
        DataLoader(ragged, batch_size=4, num_workers=workers),
        ragged.loader(batch_size=4, num_workers=workers, collate_fn=default_collate),
    ):
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
        text = str(info.value)  # with workers: "Caught RuntimeError in DataLoader worker ...", a traceback
        errors.append((text.split("\n")[0], text.strip().split("\n")[-1]))
    assert "stack expects each tensor to be equal size" in errors[0][1]
    assert errors[0] == errors[1] == errors[2], "the cache changes nothing about torch's own error"


class Ramps(torch.utils.data.Dataset[Any]):
    """Bare leaves: float32 ramps of length 0 to 9."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> Any:
        return torch.arange(i, dtype=torch.float32) * 1.5


def test_a_sample_that_is_one_variable_leaf(cache_dir: Path) -> None:
    ds = CachedDataset(
        Ramps(), cache_dir / "c.mmc", key="ramps", fields={".": Field((None,), "float32")}, max_bytes=BUDGET
    )
    for _ in range(2):  # cold, then warm
        plain = batches(DataLoader(ds, batch_size=4, collate_fn=pad_collate))
        fast = batches(ds.loader(batch_size=4, collate_fn=pad_collate))
        assert same(plain, fast)
        assert same(plain, batches(DataLoader(Ramps(), batch_size=4, collate_fn=pad_collate)))
    assert torch.equal(plain[0].lengths, torch.tensor([0, 1, 2, 3]))
    assert all(same(sample, Ramps()[i]) for i, sample in zip([9, 0, 4], ds.__getitems__([9, 0, 4]), strict=True))
    assert ds.stats()["misses"] == 10


def _lists(batch: list[Any]) -> Any:
    """A collate that keeps the variable leaves as lists and stacks the rest (the detection idiom)."""
    keep = {"image", "boxes", "labels", "embedding"}
    return {
        key: [s[key] for s in batch] if key in keep else default_collate([s[key] for s in batch]) for key in batch[0]
    }


def _pad_named(batch: list[Any]) -> Any:
    return pad_collate(batch, pad=["image", "boxes", "labels", "embedding"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "collate", [_lists, identity, pad_collate, _pad_named], ids=["lists", "identity", "pad", "named"]
)
def test_loader_with_a_collate_fn_equals_dataloader(workers: int, collate: Any, cache_dir: Path) -> None:
    ds = CachedDataset(Detection(), cache_dir / "c.mmc", key="det", fields=DETECTION_FIELDS, max_bytes=BUDGET)
    ds.__getitems__([1, 4, 6])  # a few hits, the rest misses

    def epoch(make: Any) -> list[Any]:
        gen = torch.Generator().manual_seed(3)
        return batches(make(batch_size=5, shuffle=True, num_workers=workers, collate_fn=collate, generator=gen))

    fast = epoch(ds.loader)  # cold: loader() fills the cache
    plain = epoch(functools.partial(DataLoader, ds))
    assert len(plain) == len(fast) == 3
    assert all(same(a, b) for a, b in zip(plain, fast, strict=True))
    assert all(same(a, b) for a, b in zip(epoch(ds.loader), plain, strict=True)), "warm"
    direct = batches(DataLoader(Detection(), batch_size=5, collate_fn=collate))
    cached = batches(ds.loader(batch_size=5, collate_fn=collate))
    for a, b in zip(direct, cached, strict=True):
        assert same(_tensors(a), _tensors(b)), "and what the dataset itself gives, leaves as tensors"


def _tensors(value: Any) -> Any:
    """Numbers and arrays as tensors (what CachedDataset makes of them), containers kept."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, Padded):
        return Padded(*(_tensors(v) for v in value))
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return value


def test_copy_false_reads_variable_fields_as_fresh_copies(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    token_cache(path).fill(progress=False)
    ds = CachedDataset(Tokens(N), path, key="tokens/v1", copy=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        samples = [ds[7], *ds.__getitems__([7, 8])]
    for sample, i in zip(samples, [7, 7, 8], strict=True):
        assert same(sample, as_tokens(i))
    samples[0][0].fill_(1)  # a variable leaf is a fresh copy: writable, and the cache keeps its bytes
    assert same(ds[7], as_tokens(7))
    assert ds.stats()["misses"] == 0


def test_verify_reads_variable_slots_against_their_checksums(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    token_cache(path).fill(progress=False)
    ds = CachedDataset(Tokens(N), path, key="tokens/v1", verify=True)
    assert all(same(s, as_tokens(i)) for i, s in enumerate(ds.__getitems__(list(range(N)))))
    assert ds.stats()["hits"] == N


class Long(torch.utils.data.Dataset[Any]):
    """Token sequences of 100 to 299 ids (0.8 to 2.4 KB), logging each access."""

    def __init__(self, log: Path) -> None:
        self.log = Tokens(N, log)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        self.log[i]
        return long_tokens(i), i


def long_tokens(i: int) -> torch.Tensor:
    return torch.arange(100 + (i * 37) % 200) * i


def test_a_full_variable_region_serves_the_rest_from_the_dataset(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = cache_dir / "accesses"
    source = Long(log)
    ds = CachedDataset(source, cache_dir / "c.mmc", key="small", fields=TOKEN_FIELDS, max_bytes=40_000, check=0)
    with caplog.at_level(logging.WARNING, logger="mmapcache"):
        for _ in range(2):
            for ids, labels in DataLoader(ds, batch_size=8, collate_fn=identity_batch):
                for got, label in zip(ids, labels, strict=True):
                    assert torch.equal(got, long_tokens(int(label)))
    region = ds.cache.variable_region
    assert region is not None
    assert sum(len(long_tokens(i)) * 8 for i in range(N)) > region.size, "the values do not all fit"
    filled = ds.cache.filled
    assert 0 < filled < N
    loaded = Counter(i for _, _, i in accesses(log))
    assert sum(1 for i in range(N) if loaded[i] == 1) == filled, "what was stored is loaded once"
    assert all(loaded[i] == 2 for i in range(N) if i not in ds.cache), "the rest, every epoch"
    assert caplog.text.count("full") == 1, "one warning in this process"


class Documents(torch.utils.data.Dataset[Any]):
    """``count`` token rows of 5 to 400 ids (random lengths, seeded) and a label: a tokenized corpus."""

    def __init__(self, count: int, seed: int) -> None:
        self.lengths = np.random.default_rng(seed).integers(5, 400, size=count)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Any:
        return {"ids": torch.arange(int(self.lengths[index])) % 300, "label": index}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_workers_filling_a_budget_with_a_few_percent_headroom_store_every_row(seed: int, cache_dir: Path) -> None:
    """Two workers fill a cache sized by the tokens sizing rule (5 % headroom, less after the page rounding of
    a small file): the worker that finishes first must not strand room the other still needs."""
    source = Documents(400, seed)
    fields = {"ids": Field((None,), "uint16"), "label": Field((), "int64")}
    budget = int(1.05 * (2 * int(source.lengths.sum()) + 32 * len(source)))
    ds = CachedDataset(source, cache_dir / "c.mmc", key="docs", fields=fields, max_bytes=budget, check=0)
    seen = 0
    for batch in ds.loader(batch_size=16, shuffle=True, num_workers=2, ragged="list"):
        seen += len(batch["label"])
    assert seen == len(source)
    stats = ds.stats()
    assert stats["filled"] == len(source), stats
    assert stats["variable_refused"] == 0, stats
    assert all(torch.equal(ds[i]["ids"].long(), source[i]["ids"]) for i in range(0, len(source), 9))


def identity_batch(batch: list[Any]) -> Any:
    """The token ids as a list, the labels stacked."""
    return [ids for ids, _ in batch], torch.tensor([int(label) for _, label in batch])


# -- fields= ---------------------------------------------------------------------------------


def test_fields_travel_with_the_dataset(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.fields == ds.fields == TOKEN_FIELDS
    assert same(clone[3], as_tokens(3))
    assert ds.cache.fields == TOKEN_FIELDS
    # (shape, dtype) pairs are Fields too; capacity= and max_bytes= together are fine with variable fields.
    pairs = CachedDataset(
        Tokens(N),
        cache_dir / "p.mmc",
        key="pairs",
        fields={"0": ((None,), "int64"), "1": ((), "int64")},
        max_bytes=BUDGET,
        capacity=10,
    )
    assert pairs.fields == TOKEN_FIELDS
    assert pairs.cache.capacity == 10


def test_fields_may_declare_fixed_fields_and_dtypes_for_python_numbers(cache_dir: Path) -> None:
    fields = {"0": Field((None,), "int64"), "1": Field((), "int32")}
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="int32", fields=fields, max_bytes=BUDGET)
    ids, label = ds[9]
    assert label.dtype == torch.int32
    assert int(label) == 9
    assert torch.equal(ids, tokens(9)[0])


def test_fields_in_another_order_than_the_sample(cache_dir: Path) -> None:
    fields = {k: DETECTION_FIELDS[k] for k in reversed(DETECTION_FIELDS)}
    source = Detection()
    ds = CachedDataset(source, cache_dir / "c.mmc", key="det", fields=fields, max_bytes=BUDGET)
    assert same(ds.__getitems__([3])[0], _detection_expected(source[3]))
    assert list(ds.cache.fields) == list(DETECTION_FIELDS), "the file keeps the sample's order"


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"0": Field((None,), "int64"), "x": Field((), "int64")}, ValueError, ["'x'", "do not describe", "'0'"]),
        ({"0": Field((None,), "int64"), "2": Field((), "int64")}, ValueError, ["0..1", "tuple"]),
        ({".": Field((None,), "U4")}, TypeError, ["'.'", "<U4", "torch"]),
        ({"0": "int64"}, TypeError, ["'0'", "Field"]),
        ([("0", Field((None,), "int64"))], TypeError, ["mapping"]),
    ],
)
def test_fields_that_cannot_describe_a_sample_are_refused_at_once(
    fields: Any, error: type[Exception], words: list[str], cache_dir: Path
) -> None:
    with pytest.raises(error) as info:
        CachedDataset(Tokens(N), cache_dir / "c.mmc", key="bad", fields=fields, max_bytes=BUDGET)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        (
            {"0": Field((None,), "int64"), "1": Field((), "int64"), "2": Field((), "int64")},
            ValueError,
            ["dataset[0]", "fields=", "'2'", "['0', '1']"],
        ),
        ({"0": Field((None,), "int64")}, ValueError, ["dataset[0]", "['0', '1']"]),
        ({"tokens": Field((None,), "int64"), "label": Field((), "int64")}, ValueError, ["['0', '1']", "tokens"]),
        ({"0": Field((None,), "uint8"), "1": Field((), "int64")}, ValueError, ["'0'", "uint8", "such as uint16"]),
        ({"0": Field((None,), "float16"), "1": Field((), "int64")}, ValueError, ["'0'", "float16", "such as"]),
        ({"0": Field((None, 1), "int64"), "1": Field((), "int64")}, ValueError, ["'0'", "(None, 1)", "{first}"]),
        ({"0": Field((1,), "int64"), "1": Field((), "int64")}, ValueError, ["'0'", "(1,)", "{first}"]),
        ({"0": Field((None,), "int64"), "1": Field((3,), "int64")}, ValueError, ["'1'", "(3,)"]),
    ],
)
def test_fields_that_do_not_fit_the_first_sample_name_the_field(
    fields: dict[str, Field], error: type[Exception], words: list[str], cache_dir: Path
) -> None:
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="bad", fields=fields, max_bytes=BUDGET)
    first = f"({len(tokens(0)[0])},)"  # the shape of the first sample's token ids
    for read in (lambda: ds[0], lambda: ds.__getitems__([0, 1, 2])):
        with pytest.raises(error) as info:
            read()
        for word in words:
            assert word.format(first=first) in str(info.value), str(info.value)
    assert not ds.path.exists(), "nothing is created from fields that do not fit"


@pytest.mark.parametrize("dtype", ["int32", "uint16"])
def test_a_declared_field_takes_int64_ids_that_convert_exactly(dtype: str, cache_dir: Path) -> None:
    fields = {"0": Field((None,), dtype), "1": Field((), "int64")}
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="narrow", fields=fields, max_bytes=BUDGET, check=0)
    first = ds.__getitems__(list(range(N)))  # misses: converted, stored, returned as stored
    ds.close()
    again = CachedDataset(Tokens(N), ds.path, key="narrow", fields=fields, max_bytes=BUDGET)
    for read in (first, again.__getitems__(list(range(N))), [again[i] for i in range(N)]):
        for i, (ids, label) in enumerate(read):
            assert ids.dtype == getattr(torch, dtype)
            assert torch.equal(ids.long(), tokens(i)[0])
            assert int(label) == i
    assert again.cache.fields["0"] == Field((None,), dtype)
    batch = next(iter(again.loader(batch_size=8, collate_fn=pad_tokens)))
    assert batch[0].data.dtype == getattr(torch, dtype)


def test_dtypes_sets_the_storage_dtype_of_declared_fields(cache_dir: Path) -> None:
    ds = CachedDataset(
        Tokens(N), cache_dir / "c.mmc", key="narrow", fields=TOKEN_FIELDS, dtypes={"0": torch.int32}, max_bytes=BUDGET
    )
    assert ds.fields == {"0": Field((None,), "int32"), "1": Field((), "int64")}
    ids, _ = ds[7]
    assert ids.dtype == torch.int32
    assert torch.equal(ids.long(), tokens(7)[0])
    assert ds.cache.fields == ds.fields
    restored = pickle.loads(pickle.dumps(ds))
    assert restored.fields == ds.fields
    assert torch.equal(restored[7][0], ids)


def test_dtypes_with_fields_must_name_declared_numeric_fields() -> None:
    with pytest.raises(ValueError, match=r"dtypes= names the field 'ids', but fields= has the fields \['0', '1'\]"):
        CachedDataset(Tokens(N), key="t", fields=TOKEN_FIELDS, dtypes={"ids": "int32"}, max_bytes=BUDGET)
    with pytest.raises(TypeError, match=r"'0'.*str"):
        CachedDataset(Tokens(N), key="t", fields={"0": Field((None,), str)}, dtypes={"0": "int32"}, max_bytes=BUDGET)


def test_a_declared_field_refuses_a_value_it_cannot_hold_and_names_a_dtype_that_can(cache_dir: Path) -> None:
    fields = {"0": Field((None,), "uint8"), "1": Field((), "int64")}
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="u8", fields=fields, max_bytes=BUDGET)
    with pytest.raises(ValueError, match=r"dataset\[\d+\].*field '0': the value \d+ cannot be stored as uint8") as info:
        ds.__getitems__(list(range(8)))
    suggested = re.search(r"such as (\w+)", str(info.value))
    assert suggested is not None, str(info.value)
    assert not ds.path.exists()
    fields["0"] = Field((None,), suggested[1])
    wide = CachedDataset(Tokens(N), ds.path, key="u8", fields=fields, max_bytes=BUDGET)
    assert all(torch.equal(ids.long(), tokens(i)[0]) for i, (ids, _) in enumerate(wide.__getitems__(list(range(N)))))


def test_the_suggested_declaration_works_with_the_dtypes_that_made_it(cache_dir: Path) -> None:
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="t", dtypes={"0": "int32"})
    with pytest.raises(ValueError, match="fixed shape") as info:
        ds.__getitems__(list(range(8)))
    message = str(info.value)
    assert 'fields={"0": Field((None,), "int32"), "1": Field((), "int64")}' in message, message
    fields = eval(message[message.index("fields={") + 7 : message.index(", max_bytes")], {"Field": Field})
    for dtypes in ({"0": "int32"}, None):  # pasted next to the dtypes= that was there, or instead of it
        pasted = CachedDataset(Tokens(N), ds.path, key="t", fields=fields, dtypes=dtypes, max_bytes=BUDGET)
        read = pasted.__getitems__(list(range(N)))
        assert all(ids.dtype == torch.int32 for ids, _ in read)
        assert all(torch.equal(ids.long(), tokens(i)[0]) for i, (ids, _) in enumerate(read))


def test_a_later_sample_that_does_not_fit_fields_is_named(cache_dir: Path) -> None:
    class Boxes(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> Any:
            return torch.zeros(i, 4 if i != 6 else 5)

    ds = CachedDataset(
        Boxes(), cache_dir / "c.mmc", key="boxes", fields={".": Field((None, 4), "float32")}, max_bytes=BUDGET
    )
    assert ds[3].shape == (3, 4)
    with pytest.raises(ValueError, match=re.escape("dataset[6]: field '.'")) as info:
        ds.__getitems__([5, 6, 7])
    assert "(6, 5)" in str(info.value)
    assert "fields=" in str(info.value)


def test_an_existing_file_with_other_fields_is_a_schema_mismatch(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    token_cache(path)[0]
    other = {"0": Field((None,), "int32"), "1": Field((), "int64")}
    ds = CachedDataset(Tokens(N), path, key="tokens/v1", fields=other, max_bytes=BUDGET)
    with pytest.raises(SchemaMismatchError) as info:
        ds[1]
    message = str(info.value)
    assert "fields=" in message
    assert "change the key" in message
    assert f"mmapcache rm {path}" in message
    assert info.value.differences["fields"] == (other, TOKEN_FIELDS)
    # A dataset that declares nothing reads the variable fields from the file.
    plain = CachedDataset(Tokens(N), path, key="tokens/v1")
    assert same(plain[0], as_tokens(0))
    assert same(plain[1], as_tokens(1))  # a miss: the sample fits the file's fields


def test_variable_fields_without_a_byte_budget_are_sized_from_a_spread_sample(cache_dir: Path) -> None:
    """No max_bytes: 60 samples (all of them, fewer than 64) are loaded, stored, and every one fits."""
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="t", fields=TOKEN_FIELDS, check=0)
    assert same(ds[5], as_tokens(5))
    assert ds.cache.filled == N, "the samples loaded to size the file were stored"
    assert ds.stats()["misses"] == 1
    assert all(same(s, as_tokens(i)) for i, s in enumerate(ds.__getitems__(list(range(N)))))
    stats = ds.stats()
    assert stats["misses"] == 1
    assert 0 < stats["variable_used"] <= stats["variable_bytes"] <= 1.25 * stats["variable_used"] + 2**20 + 4096


# -- without fields=: the error says how to declare them --------------------------------------


def test_ragged_samples_without_fields_say_how_to_declare_them(cache_dir: Path) -> None:
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="tokens/v1")
    with pytest.raises(ValueError, match="fixed shape") as info:
        ds.__getitems__(list(range(8)))
    message = str(info.value)
    example = 'fields={"0": Field((None,), "int64"), "1": Field((), "int64")}'
    assert example in message, message
    assert "'0'" in message
    assert "max_bytes=" in message
    assert not ds.path.exists(), "the first batch is checked before the file is created"
    assert not list(cache_dir.iterdir()) or [p.name for p in cache_dir.iterdir()] == ["c.mmc.lock"]
    # The example is ready to paste.
    fields = eval(message[message.index("fields={") + 7 : message.index(", max_bytes")], {"Field": Field})
    pasted = CachedDataset(Tokens(N), ds.path, key="tokens/v1", fields=fields, max_bytes=BUDGET)
    assert all(same(s, as_tokens(i)) for i, s in enumerate(pasted.__getitems__(list(range(N)))))


def test_the_suggestion_covers_every_field_that_varies_in_the_batch(cache_dir: Path) -> None:
    ds = CachedDataset(Detection(), cache_dir / "c.mmc", key="det")
    with pytest.raises(ValueError, match="fixed shape") as info:
        DataLoader(ds, batch_size=6).__iter__().__next__()
    message = str(info.value)
    for entry in [
        '"image": Field((3, None, None), "uint8")',
        '"boxes": Field((None, 4), "float32")',
        '"labels": Field((None,), "int64")',
        '"scale": Field((2,), "bfloat16")',
        '"embedding": Field((None, 3), "bfloat16")',
        '"id": Field((), "int64")',
    ]:
        assert entry in message, message
    assert "mmapcache rm" not in message
    assert not ds.path.exists()


def test_fill_checks_a_whole_first_chunk_before_creating_the_file(cache_dir: Path) -> None:
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="tokens/v1")
    with pytest.raises(ValueError, match="fields="):
        ds.fill(progress=False)
    assert not ds.path.exists()


def test_a_file_made_from_one_sample_is_named_in_the_error(cache_dir: Path) -> None:
    ds = CachedDataset(Tokens(N), cache_dir / "c.mmc", key="tokens/v1")
    ds[0]  # a single sample creates the file, with its shape
    with pytest.raises(ValueError, match="fixed shape") as info:
        ds.__getitems__(list(range(8)))
    message = str(info.value)
    assert 'fields={"0": Field((None,), "int64"), "1": Field((), "int64")}' in message
    assert "it was removed, so the next try starts afresh" in message
    assert not ds.path.exists()


def test_a_change_in_the_number_of_dimensions_is_explained(cache_dir: Path) -> None:
    class Flat(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            return torch.zeros(3) if i != 2 else torch.zeros(3, 1)

    ds = CachedDataset(Flat(), cache_dir / "c.mmc", key="flat")
    with pytest.raises(ValueError, match="number of dimensions") as info:
        ds.__getitems__([0, 1, 2])
    assert "dataset[2]" in str(info.value)


# -- pad_collate --------------------------------------------------------------------------------


def test_pad_collate_pads_one_dimensional_leaves_and_gives_lengths() -> None:
    batch = [(torch.tensor([1, 2, 3]), 0), (torch.tensor([], dtype=torch.int64), 1), (torch.tensor([4]), 2)]
    ids, labels = pad_collate(batch, padding_value=-1)
    assert isinstance(ids, Padded)
    assert torch.equal(ids.data, torch.tensor([[1, 2, 3], [-1, -1, -1], [4, -1, -1]]))
    assert torch.equal(ids.lengths, torch.tensor([3, 0, 1]))
    assert ids.lengths.dtype == torch.int64
    assert torch.equal(labels, torch.tensor([0, 1, 2]))
    data, lengths = pad_collate([torch.tensor([1.5]), torch.tensor([2.5, 3.5])])  # default padding 0
    assert torch.equal(data, torch.tensor([[1.5, 0.0], [2.5, 3.5]]))
    assert torch.equal(lengths, torch.tensor([1, 2]))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_pad_collate_pads_the_unsigned_dtypes_torch_has_few_kernels_for(dtype: torch.dtype) -> None:
    rows = [torch.tensor([65535, 1, 2], dtype=torch.int64).to(dtype), torch.tensor([7], dtype=torch.int64).to(dtype)]
    padded = pad_collate([(row,) for row in rows], pad="0", padding_value=9)[0]
    assert padded.data.dtype == dtype
    assert padded.data.long().tolist() == [[65535, 1, 2], [7, 9, 9]]
    assert padded.lengths.tolist() == [3, 1]


def test_pad_collate_pads_every_dimension_and_keeps_the_dtype() -> None:
    images = [torch.full((3, 2, 5), 1, dtype=torch.uint8), torch.full((3, 4, 1), 2, dtype=torch.uint8)]
    half = [torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(1, 3, dtype=torch.bfloat16)]
    out = pad_collate([{"image": a, "emb": b, "n": i} for i, (a, b) in enumerate(zip(images, half, strict=True))])
    image = out["image"]
    assert image.data.shape == (2, 3, 4, 5)
    assert image.data.dtype == torch.uint8
    assert torch.equal(image.lengths, torch.tensor([[3, 2, 5], [3, 4, 1]]))
    assert torch.equal(image.data[0, :, :2, :5], images[0])
    assert torch.equal(image.data[1, :, :4, :1], images[1])
    assert int(image.data[0, :, 2:].sum()) == 0
    assert int(image.data[1, :, :, 1:].sum()) == 0
    assert out["emb"].data.dtype == torch.bfloat16
    assert torch.equal(out["emb"].lengths, torch.tensor([[2, 3], [1, 3]]))
    assert torch.equal(out["n"], torch.tensor([0, 1]))


def test_pad_collate_is_default_collate_where_shapes_agree() -> None:
    samples = [(torch.arange(3), np.float32(i), {"m": torch.ones(2, 2), "s": "a"}, [i, i * 2.0]) for i in range(4)]
    assert same(pad_collate(samples), default_collate(samples))
    # pad= names leaves (their field names) that are padded in every batch, even when they agree.
    out = pad_collate(samples, pad=["0", "2/m"])
    assert isinstance(out[0], Padded)
    assert torch.equal(out[0].lengths, torch.tensor([3, 3, 3, 3]))
    assert torch.equal(out[2]["m"].lengths, torch.tensor([[2, 2]] * 4))
    assert same(out[1], default_collate(samples)[1])
    one = pad_collate([samples[0]], pad="0")
    assert isinstance(one[0], Padded)
    assert one[0].data.shape == (1, 3)


def test_pad_collate_takes_numpy_arrays_and_bare_leaves() -> None:
    out = pad_collate([np.arange(2, dtype=np.int16), np.arange(3, dtype=np.int16)])
    assert isinstance(out, Padded)
    assert out.data.dtype == torch.int16
    assert torch.equal(out.data, torch.tensor([[0, 1, 0], [0, 1, 2]], dtype=torch.int16))
    assert isinstance(pad_collate([torch.zeros(2)], pad="."), Padded)


def test_pad_collate_refuses_what_it_cannot_pad() -> None:
    batch = [(torch.zeros(2), 1), (torch.zeros(3), 2)]
    with pytest.raises(ValueError, match=r"'tokens'.*\['0'\]"):
        pad_collate(batch, pad="tokens")
    with pytest.raises(ValueError, match="0-d"):
        pad_collate([(torch.tensor(1),), (torch.tensor(2),)], pad="0")
    with pytest.raises(ValueError, match="dimensions"):
        pad_collate([torch.zeros(2), torch.zeros(2, 1)])
    with pytest.raises(ValueError, match="at least one"):
        pad_collate([])
    with pytest.raises(RuntimeError, match="stack expects"):  # a leaf not named in pad= is stacked, as torch does
        pad_collate([(torch.zeros(2), torch.zeros(1)), (torch.zeros(3), torch.zeros(2))], pad="0")


def test_pad_collate_in_workers_puts_the_batch_in_shared_memory(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    loader = DataLoader(ds, batch_size=10, num_workers=1, collate_fn=pad_tokens)
    seen = []
    for batch in loader:
        assert batch[0].data.is_shared()
        seen += check_padded_batch(batch)
    assert seen == list(range(N))
