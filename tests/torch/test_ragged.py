"""``loader(ragged=)``: variable fields in a batch as padded, nested, packed or list batches, from one gather.

Also ``Jagged.to_nested()``, the nested tensor that views a gathered batch.
"""

from __future__ import annotations

import functools
import itertools
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch_helpers import TOKEN_FIELDS, Tokens, same, tokens

from mmapcache import Field, Jagged
from mmapcache.torch import CachedDataset, Packed, Padded, pad_collate, ragged_collate
from mmapcache.torch._loader import Batched, WorkerBatch
from mmapcache.torch._ragged import jagged_batch

N = 60
BUDGET = "1MiB"
MODES = ["pad", "nested", "packed", "list"]


def token_cache(path: Path, **kwargs: Any) -> CachedDataset:
    return CachedDataset(Tokens(N), path, key="tokens/v1", fields=TOKEN_FIELDS, max_bytes=BUDGET, check=0, **kwargs)


def batches(loader: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator here
        return list(loader)


def rows_of(leaf: Any, ragged: str) -> list[torch.Tensor]:
    """The per-sample tensors a batch of one variable field holds, whatever its batch type."""
    if ragged == "pad":
        assert isinstance(leaf, Padded)
        lengths = leaf.lengths.tolist()
        if leaf.lengths.ndim == 1:
            return [row[:n] for row, n in zip(leaf.data, lengths, strict=True)]
        return [row[tuple(slice(0, d) for d in shape)] for row, shape in zip(leaf.data, lengths, strict=True)]
    if ragged == "nested":
        assert isinstance(leaf, torch.Tensor)
        assert leaf.is_nested
        return list(leaf.unbind())
    if ragged == "packed":
        assert isinstance(leaf, Packed)
        bounds = leaf.cu_seqlens.tolist()
        assert leaf.cu_seqlens.dtype == torch.int32
        assert leaf.max_seqlen == max(b - a for a, b in itertools.pairwise(bounds))
        return [leaf.values[a:b] for a, b in itertools.pairwise(bounds)]
    assert isinstance(leaf, list)
    return leaf


# -- the batch types ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ragged", MODES)
def test_every_ragged_batch_holds_the_samples_cold_and_warm(ragged: str, workers: int, cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    ds.__getitems__([1, 4, 9])  # a few hits, the rest misses
    for _ in range(2):  # cold (workers fill), then warm
        gen = torch.Generator().manual_seed(5)
        loader = ds.loader(batch_size=7, shuffle=True, num_workers=workers, ragged=ragged, generator=gen)
        seen = []
        for ids, labels in batches(loader):
            assert labels.dtype == torch.int64
            got = rows_of(ids, ragged)
            assert len(got) == len(labels)
            for row, i in zip(got, labels.tolist(), strict=True):
                assert same(row.contiguous(), tokens(i)[0]), (ragged, i)
            seen += labels.tolist()
        assert sorted(seen) == list(range(N))
    assert ds.stats()["filled"] == N


def test_pad_is_the_default_and_equals_pad_collate_of_the_samples(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    ds.fill(progress=False)
    fast = batches(ds.loader(batch_size=8))
    padded = batches(ds.loader(batch_size=8, ragged="pad", padding_value=-1))
    plain = batches(DataLoader(ds, batch_size=8, collate_fn=functools.partial(pad_collate, pad="0")))
    plain_minus = batches(
        DataLoader(ds, batch_size=8, collate_fn=functools.partial(pad_collate, pad="0", padding_value=-1))
    )
    assert same(fast, plain)
    assert same(padded, plain_minus)


def test_a_transform_batches_its_samples_as_ragged_asks(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    shifted = token_cache(cache_dir / "c.mmc", transform=_shifted)
    ds.fill(progress=False)
    for ragged in MODES:
        expected = batches(ds.loader(batch_size=8, ragged="list"))
        for got, want in zip(batches(shifted.loader(batch_size=8, ragged=ragged)), expected, strict=True):
            assert same([r.contiguous() for r in rows_of(got[0], ragged)], [r + 1 for r in want[0]])
            assert same(got[1], want[1])


def _shifted(sample: Any) -> Any:
    ids, label = sample
    return ids + 1, label


def test_ragged_must_be_one_of_the_four(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    with pytest.raises(ValueError, match="'pad', 'nested', 'packed', 'list'"):
        ds.loader(batch_size=4, ragged="padded")
    with pytest.raises(TypeError, match="padding_value"):
        ds.loader(batch_size=4, padding_value="0")
    assert not ds.path.exists()


class Boxes(torch.utils.data.Dataset[Any]):
    """Images at their own size and bfloat16 box features: two variable dimensions, and a fixed tail."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 256, (3, 2 + i % 3, 3 + i % 2), dtype=torch.uint8, generator=g),
            "feats": torch.randn(i % 4, 3, generator=g).to(torch.bfloat16),
        }


BOX_FIELDS = {"image": Field((3, None, None), "uint8"), "feats": Field((None, 3), torch.bfloat16)}


@pytest.mark.parametrize("ragged", MODES)
def test_fixed_tails_and_torch_only_dtypes_keep_their_shape_and_dtype(ragged: str, cache_dir: Path) -> None:
    ds = CachedDataset(Boxes(), cache_dir / "c.mmc", key="boxes", fields=BOX_FIELDS, max_bytes=BUDGET)
    ds.fill(progress=False)
    if ragged in ("nested", "packed"):
        with pytest.raises(ValueError, match=rf"field 'image' varies in 3 dimensions.*ragged={ragged!r}"):
            next(iter(ds.loader(batch_size=5, ragged=ragged)))
        return
    for k, batch in enumerate(batches(ds.loader(batch_size=5, ragged=ragged))):
        for name in ("image", "feats"):
            got = rows_of(batch[name], ragged)
            want = [Boxes()[i][name] for i in range(5 * k, min(5 * k + 5, 12))]
            assert same([r.contiguous() for r in got], want), name


def test_packed_and_nested_keep_a_fixed_tail(cache_dir: Path) -> None:
    fields = {"feats": Field((None, 3), torch.bfloat16)}
    ds = CachedDataset(_Feats(), cache_dir / "c.mmc", key="feats", fields=fields, max_bytes=BUDGET)
    want = [_Feats()[i]["feats"] for i in range(6)]
    for _ in range(2):
        packed = next(iter(ds.loader(batch_size=6, ragged="packed")))["feats"]
        nested = next(iter(ds.loader(batch_size=6, ragged="nested")))["feats"]
        assert packed.values.shape == (sum(len(w) for w in want), 3)
        assert packed.values.dtype == nested.dtype == torch.bfloat16
        assert same(rows_of(packed, "packed"), want)
        assert same(rows_of(nested, "nested"), want)


class _Feats(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return {"feats": Boxes()[i]["feats"]}


# -- one gather, no copy beyond it --------------------------------------------------------------


def test_nested_and_packed_view_the_gathered_values_and_list_rows_are_views() -> None:
    jagged = Jagged.from_arrays(
        [np.arange(3, dtype=np.uint16), np.arange(0, dtype=np.uint16), np.arange(5, dtype=np.uint16)]
    )
    address = jagged.values.ctypes.data
    nested = jagged_batch(jagged, "nested", None, 0, "0")
    packed = jagged_batch(jagged, "packed", None, 0, "0")
    rows = jagged_batch(jagged, "list", None, 0, "0")
    assert nested.values().data_ptr() == packed.values.data_ptr() == address
    assert all(row.untyped_storage().data_ptr() == address for row in rows)
    padded = jagged_batch(jagged, "pad", None, 7, "0")
    assert padded.data.tolist() == [[0, 1, 2, 7, 7], [7] * 5, [0, 1, 2, 3, 4]]
    assert padded.data.dtype == torch.uint16


def test_workers_leave_the_gather_of_variable_fields_to_the_main_process(cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    ds.fill(progress=False)
    batched = ds.loader(batch_size=4, ragged="packed").dataset
    assert isinstance(batched, Batched)
    sent = batched.in_worker([3, 4])
    assert isinstance(sent, WorkerBatch)
    assert len(pickle.dumps(sent)) < 400, "only the positions cross to the main process"
    ids, labels = batched.gather(pickle.loads(pickle.dumps(sent)))
    assert same(rows_of(ids, "packed"), [tokens(3)[0], tokens(4)[0]])
    assert labels.tolist() == [3, 4]


# -- a collate_fn of one's own ----------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_fn_overrides_ragged_and_sees_what_dataloader_sees(workers: int, cache_dir: Path) -> None:
    ds = token_cache(cache_dir / "c.mmc")
    ds.fill(progress=False)
    errors = []
    for loader in (
        ds.loader(batch_size=8, num_workers=workers, collate_fn=default_collate, ragged="packed"),
        DataLoader(ds, batch_size=8, num_workers=workers),
    ):
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
        errors.append(str(info.value).strip().split("\n")[-1])  # torch's own error, in a worker or not
    assert errors[0] == errors[1]
    assert workers or "stack expects each tensor to be equal size" in errors[0]
    mine = batches(ds.loader(batch_size=8, num_workers=workers, collate_fn=list))
    assert same(mine, batches(DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=list)))


# -- Jagged.to_nested ---------------------------------------------------------------------------


def test_to_nested_views_the_values_and_knows_its_lengths() -> None:
    rows = [np.arange(4, dtype=np.int32), np.zeros(0, np.int32), np.arange(7, dtype=np.int32) * 3]
    jagged = Jagged.from_arrays(rows)
    nested = jagged.to_nested()
    assert nested.is_nested
    assert nested.layout == torch.jagged
    assert nested.values().data_ptr() == jagged.values.ctypes.data, "no copy"
    assert torch.equal(nested.offsets(), torch.from_numpy(np.array(jagged.offsets)))
    assert (nested._min_seqlen, nested._max_seqlen) == (0, 7), "passed in: nothing syncs to find them"
    assert [t.tolist() for t in nested.unbind()] == [r.tolist() for r in rows]
    bits = Jagged.from_arrays([torch.ones(2, 3, dtype=torch.bfloat16).view(torch.uint16).numpy()])
    as_bf16 = bits.to_nested(torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert as_bf16.shape[2] == 3
    assert torch.equal(as_bf16.unbind()[0], torch.ones(2, 3, dtype=torch.bfloat16))


def test_to_nested_refuses_what_a_nested_tensor_cannot_hold() -> None:
    images = Jagged.from_arrays([np.zeros((3, 2, 4)), np.zeros((3, 5, 1))])
    with pytest.raises(ValueError, match=r"one ragged dimension.*to_padded"):
        images.to_nested()
    gaps = Jagged.from_arrays([np.zeros(2), None])
    with pytest.raises(ValueError, match=r"rows \[1\] are missing"):
        gaps.to_nested()
    frozen = Jagged.from_arrays([np.arange(3)])
    frozen.values.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = frozen.to_nested()
    assert copy.values().data_ptr() != frozen.values.ctypes.data, "a read-only array is copied, never written"


# -- ragged_collate: the same batch types for a plain DataLoader over samples ------------------------


def _token_samples(lengths: list[int]) -> list[dict[str, Any]]:
    return [{"tokens": torch.arange(n, dtype=torch.int32) + 100 * k, "label": k} for k, n in enumerate(lengths)]


def test_ragged_collate_packs_the_samples_values_with_cu_seqlens() -> None:
    batch = ragged_collate("packed", leaves="tokens")(_token_samples([3, 0, 5]))
    packed = batch["tokens"]
    assert isinstance(packed, Packed)
    assert torch.equal(packed.values, torch.cat([t["tokens"] for t in _token_samples([3, 0, 5])]))
    assert packed.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 5
    assert batch["label"].tolist() == [0, 1, 2]


def test_ragged_collate_gives_each_batch_type_with_the_values_of_the_samples() -> None:
    samples = _token_samples([2, 4, 1])
    padded = ragged_collate("pad", leaves="tokens", padding_value=-1)(samples)["tokens"]
    assert isinstance(padded, Padded)
    assert padded.lengths.tolist() == [2, 4, 1]
    assert padded.data[2].tolist() == [200, -1, -1, -1]
    nested = ragged_collate("nested", leaves="tokens")(samples)["tokens"]
    assert nested.is_nested
    assert [row.tolist() for row in nested.unbind()] == [s["tokens"].tolist() for s in samples]
    listed = ragged_collate("list", leaves="tokens")(samples)["tokens"]
    assert [row.tolist() for row in listed] == [s["tokens"].tolist() for s in samples]


def test_ragged_collate_refuses_what_it_cannot_batch_and_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'pad', 'nested', 'packed', 'list'"):
        ragged_collate("ragged")
    with pytest.raises(ValueError, match=r"leaves names \['text'\], which are not tensor leaves"):
        ragged_collate("packed", leaves="text")(_token_samples([1, 2]))
    with pytest.raises(TypeError, match="padding_value must be a number"):
        ragged_collate("pad", padding_value="0")  # type: ignore[arg-type]
    grids = [{"g": torch.zeros(2, 3)}, {"g": torch.zeros(2, 4)}]
    with pytest.raises(ValueError, match="vary in the first dimension only"):
        ragged_collate("packed", leaves="g")(grids)
    assert ragged_collate("pad", leaves="g")(grids)["g"].data.shape == (2, 2, 4)


def test_ragged_collate_pickles_for_spawned_workers() -> None:
    again = pickle.loads(pickle.dumps(ragged_collate("packed", leaves=["tokens"], padding_value=3)))
    assert (again.ragged, again.leaves, again.padding_value) == ("packed", ("tokens",), 3)
    assert again(_token_samples([1, 2]))["tokens"].cu_seqlens.tolist() == [0, 1, 3]
