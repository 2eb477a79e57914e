"""A random ``transform=`` across a resume, as docs/torch.md says: the samples exact, the augmentations not.

A resumed ``ds.loader(stateful=True)`` gives exactly the samples that were left,
but a random per-sample transform draws afresh (the workers' generators start
again from their seeds); augmenting in the training step from a generator whose
state is saved with the loader's makes the resumed steps exact too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmapcache.torch import CachedDataset

pytest.importorskip("torchdata", reason="ds.loader(stateful=True) needs torchdata: pip install torchdata")

LENGTH, BATCH, K = 48, 4, 5  # 12 batches an epoch; the run stops after K of them


class Images(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((6,), float(index)), index


def noise(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """A random augmentation drawn from the process's (a worker's) generator."""
    image, label = sample
    return image + torch.rand(image.shape), label


def _loader(ds: CachedDataset) -> Any:
    return ds.loader(BATCH, shuffle=True, num_workers=2, stateful=True, generator=torch.Generator().manual_seed(3))


def _batches(loader: Any, stop: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for images, labels in loader:
        out.append((images, labels))
        if len(out) == stop:
            break
    return out


def test_a_random_transform_draws_afresh_after_a_resume_while_the_samples_are_exact(cache_dir: Path) -> None:
    ds = CachedDataset(Images(), cache_dir / "images.mmc", key="images", transform=noise)
    ds.fill()
    whole = _batches(_loader(ds))
    interrupted = _loader(ds)
    first = _batches(interrupted, K)
    state = interrupted.state_dict()
    resumed = _loader(ds)
    resumed.load_state_dict(state)
    rest = _batches(resumed)
    assert [labels.tolist() for _, labels in first + rest] == [labels.tolist() for _, labels in whole]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, whole, strict=False)), "the same start draws alike"
    after = [torch.equal(a, b) for (a, _), (b, _) in zip(rest, whole[K:], strict=True)]
    assert not any(after), "the resumed steps' augmentations are drawn afresh"


def test_augmenting_in_the_step_from_a_saved_generator_resumes_exactly(cache_dir: Path) -> None:
    ds = CachedDataset(Images(), cache_dir / "images.mmc", key="images")
    ds.fill()

    def steps(loader: Any, generator: torch.Generator, stop: int | None = None) -> list[torch.Tensor]:
        out = []
        for images, _ in loader:
            out.append(images + torch.rand(images.shape, generator=generator))  # the training step's augmentation
            if len(out) == stop:
                break
        return out

    whole = steps(_loader(ds), torch.Generator().manual_seed(9))
    interrupted, generator = _loader(ds), torch.Generator().manual_seed(9)
    first = steps(interrupted, generator, K)
    checkpoint = {"loader": interrupted.state_dict(), "augmentation": generator.get_state()}
    resumed, generator = _loader(ds), torch.Generator()
    resumed.load_state_dict(checkpoint["loader"])
    generator.set_state(checkpoint["augmentation"])
    rest = steps(resumed, generator)
    assert len(first + rest) == len(whole) == LENGTH // BATCH
    assert all(torch.equal(a, b) for a, b in zip(first + rest, whole, strict=True))
