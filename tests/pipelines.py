"""Datasets for tests/torch/test_pipelines.py, importable by spawned DataLoader workers and child processes.

Each is deterministic unless it says otherwise; ``version``/``size`` parameters stand for a change in
the data or its preprocessing between two runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Texts(Dataset[Any]):
    """Samples with a str and a bytes leaf (a Hugging Face row with a text and a path column)."""

    def __init__(self, n: int = 40, long_after: int | None = None) -> None:
        self.n, self.long_after = n, long_after

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        repeat = 2000 if self.long_after is not None and i >= self.long_after else 1
        text = f"sample {i}: héllo wörld ✓ " * (i % 5 + 1) * repeat
        return {"text": text, "path": f"/data/{i:05d}.jpg".encode(), "label": i % 7, "ids": torch.arange(3) + i}


class Documents(Dataset[Any]):
    """``n`` documents (str) of about ``typical`` bytes each, except a first one of ``first`` bytes;
    ``loads`` counts every ``__getitem__`` in this process."""

    def __init__(self, n: int, first: int, typical: int = 1000) -> None:
        self.n, self.first, self.typical = n, first, typical
        self.loads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.loads += 1
        size = self.first if i == 0 else self.typical // 2 + (i * 7919) % self.typical
        return {"text": (f"{i} " * size)[:size], "label": i}


class Pixels(Dataset[Any]):
    """int64 "pixels" (as Hugging Face datasets upcasts uint8) of ``size`` x ``size``, plus a label."""

    def __init__(self, n: int = 24, size: int = 8, version: int = 0, top: int = 255) -> None:
        self.n, self.size, self.version, self.top = n, size, version, top

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i * 7919 + self.version)
        pixels = torch.randint(0, self.top + 1, (3, self.size, self.size), generator=g, dtype=torch.int64)
        return pixels, i % 10


class Huge(Dataset[Any]):
    """2**40 small samples (a dataset far larger than any cache of it); ``version`` changes them."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def __len__(self) -> int:
        return 2**40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), (i + self.version) % 251, dtype=torch.uint8)


class Random(Dataset[Any]):
    """Random augmentation left in ``__getitem__``: a different sample each time."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(4) + i


class Unresized(Dataset[Any]):
    """Images at their own size, like a pipeline that forgot to resize; ``resize`` fixes it."""

    def __init__(self, resize: bool = False, n: int = 12) -> None:
        self.resize, self.n = resize, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        height = 6 if self.resize or i < self.n // 2 else 6 + i
        return torch.full((3, height, 6), i, dtype=torch.uint8)


def normalize_in_place(sample: Any) -> Any:
    """An in-place transform (like Normalize(inplace=True))."""
    image, label = sample
    image.sub_(1)
    return image, label


class EraseSometimes:
    """A transform that writes to its input on every other call (like ``RandomErasing(p=0.5, inplace=True)``),
    through ``.data`` or in place; it returns the sample and whether this call wrote."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample: Any) -> Any:
        image, label = sample
        self.calls += 1
        wrote = self.calls % 2 == 0
        if wrote and self.calls % 4 == 0:
            image.data[...] = 0  # no trace in torch's version counter
        elif wrote:
            image.mul_(0)
        return image, label, wrote


def normalize(sample: Any) -> Any:
    """The same, out of place."""
    image, label = sample
    return image - 1, label


class NumpyStrings(Dataset[Any]):
    """A string column as Hugging Face datasets' numpy format gives it: 0-d string arrays and numpy scalars."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": np.array(f"row {i} " * i), "raw": np.bytes_(b"x" * i), "label": np.int64(i)}
