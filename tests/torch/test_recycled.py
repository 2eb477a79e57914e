"""``loader()`` reads a batch into the memory of an earlier one only once nothing refers to that one.

Every batch must stay what it was read as for as long as anything holds it — the batch, one of its
tensors, a view, a ``.numpy()`` array — and batches nobody holds are read into again (the warm epoch
pays no page faults for them). Real files, real reads; the buffers are told apart by their addresses.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mmapcache.torch._recycled as recycled
from mmapcache.torch import CachedDataset, Mixture

ROW, N, BATCH = 1024, 2048, 64


class Rows(torch.utils.data.Dataset[Any]):
    """Row ``i``: ``ROW`` bytes of ``i % 251`` and the label ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return torch.full((ROW,), i % 251, dtype=torch.uint8), i


@pytest.fixture
def warm(cache_dir: Path) -> Iterator[CachedDataset]:
    """A warm cache in /dev/shm: batches of fixed fields in memory are the ones read into kept buffers."""
    ds = CachedDataset(Rows(), cache_dir / "r.mmc", key="rows")
    ds.fill(progress=False)
    yield ds
    ds.close()


def _check(batch: Any) -> None:
    rows, labels = batch
    assert torch.equal(rows, (labels % 251).to(torch.uint8)[:, None].expand(-1, ROW))


def test_batches_nobody_holds_are_read_into_again(warm: CachedDataset) -> None:
    loader = warm.loader(batch_size=BATCH, shuffle=True)
    for _ in range(2):
        addresses = set()
        for batch in loader:
            _check(batch)
            addresses.add(batch[0].data_ptr())
        assert len(addresses) <= 3, "the loop holds one batch: the others' memory is read into again"
    assert loader.dataset.recycled._kept, "the last batches are kept for the next epoch"  # type: ignore[attr-defined]


@pytest.mark.parametrize("hold", ["batch", "tensor", "view", "numpy", "labels only"])
def test_a_batch_anything_refers_to_is_never_written_again(warm: CachedDataset, hold: str) -> None:
    loader = warm.loader(batch_size=BATCH, shuffle=True)
    held: list[tuple[Any, Any]] = []  # (what is held, a copy of what it was)
    addresses: list[int] = []
    for k, batch in enumerate(loader):
        addresses.append(batch[0].data_ptr())
        if k % 4 == 1:
            kept = {
                "batch": batch,
                "tensor": batch[0],
                "view": batch[0][3:9, 100:],
                "numpy": batch[0].numpy()[5],
                "labels only": batch[1],
            }[hold]
            held.append((kept, _copy(kept)))
    assert len(held) == len(loader) // 4
    for kept, copy in held:  # every batch read since: none of them went where a held one is
        assert _same(kept, copy)
    if hold != "labels only":  # a held batch's memory is never handed out again (the labels' only is held there)
        for k in range(1, len(addresses), 4):
            assert addresses[k] not in addresses[k + 1 :], f"batch {k} is held, and a later batch went to its memory"
    assert len(set(addresses)) <= len(held) + 3, "the batches nobody held were read into again"


def _copy(kept: Any) -> Any:
    if isinstance(kept, list):
        return [_copy(part) for part in kept]
    return kept.clone() if isinstance(kept, torch.Tensor) else np.array(kept, copy=True)


def _same(kept: Any, copy: Any) -> bool:
    if isinstance(kept, list):
        return all(_same(a, b) for a, b in zip(kept, copy, strict=True))
    return torch.equal(kept, copy) if isinstance(kept, torch.Tensor) else np.array_equal(kept, copy)


def test_a_batch_transform_that_returns_new_tensors_releases_the_batch(warm: CachedDataset) -> None:
    loader = warm.loader(batch_size=BATCH, shuffle=True, batch_transform=lambda b: (b[0].flip(1), b[1]))
    seen = []
    for rows, labels in loader:
        _check((rows.flip(1), labels))
        seen.append(rows)  # the transform's output is kept, not the gathered batch
    assert len(seen) == len(loader)


def test_two_threads_iterating_one_loader_never_share_a_buffer(warm: CachedDataset) -> None:
    loader = warm.loader(batch_size=BATCH, shuffle=True)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        try:
            barrier.wait()
            for _ in range(3):
                for batch in loader:
                    _check(batch)
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


def test_a_batch_above_the_size_kept_goes_back_at_once(warm: CachedDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recycled, "_MAX_BYTES", BATCH * ROW - 1)  # a batch of rows is just over it
    loader = warm.loader(batch_size=BATCH, shuffle=True)
    pool = loader.dataset.recycled  # type: ignore[attr-defined]
    for batch in loader:
        _check(batch)
        assert pool._kept == []


def test_a_mixture_batch_held_is_never_written_again_and_released_ones_are_read_into(cache_dir: Path) -> None:
    sources = {}
    for name in ("a", "b"):
        sources[name] = CachedDataset(Rows(), cache_dir / f"{name}.mmc", key=f"rows-{name}")
        sources[name].fill(progress=False)
    try:
        loader = Mixture(sources, {"a": 0.7, "b": 0.3}, seed=1).loader(BATCH, num_samples=N)
        held, addresses = [], []
        for k, batch in enumerate(loader):
            _check(batch)
            addresses.append(batch[0].data_ptr())
            if k % 4 == 1:
                held.append((batch[0], batch[0].clone()))
        assert all(torch.equal(kept, copy) for kept, copy in held)
        for k in range(1, len(addresses), 4):
            assert addresses[k] not in addresses[k + 1 :], f"mixture batch {k} is held; a later one went there"
        assert len(set(addresses)) <= len(held) + 3, "the batches nobody held were read into again"
    finally:
        for ds in sources.values():
            ds.close()


def test_the_kept_batches_stay_within_the_byte_budget(warm: CachedDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    batch_bytes = BATCH * (ROW + 8)  # the rows and the int64 labels
    monkeypatch.setattr(recycled, "_MAX_BYTES", 2 * batch_bytes)  # two batches' worth, not three
    loader = warm.loader(batch_size=BATCH, shuffle=True)
    pool = loader.dataset.recycled  # type: ignore[attr-defined]
    addresses = set()
    for batch in loader:
        _check(batch)
        addresses.add(batch[0].data_ptr())
        assert sum(a.nbytes for _, _, arrays in pool._kept for a in arrays) <= 2 * batch_bytes
    assert len(addresses) <= 2, "two kept batches: the one the loop holds and the one read into next"
