"""Sources of the datasets in tests/data/pickles-*.pkl: the releases that made them and the tests import them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class Numbers(torch.utils.data.IterableDataset[Any]):
    """``{"x": i, "y": [i] * (i % 3)}`` for ``i`` below ``count``: a stream with a fixed and a variable field."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.count):
            yield {"x": torch.tensor(i), "y": torch.full((i % 3,), i, dtype=torch.int64)}
