"""A stream element and a dataset sample take one route from a leaf to storage.

``CachedStream``'s first epoch and ``CachedDataset``'s miss batch convert,
check and store a leaf by the same rule (``_columns.fitted_leaves``): what the
file holds is the same bytes, what a read gives back the same values, and a
leaf that does not fit fails with the same error type and the same words,
naming ``dataset[i]`` or ``stream element i``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

from mmapcache import Field
from mmapcache.torch import CachedDataset, CachedStream


class _Listed(torch.utils.data.IterableDataset[Any]):
    def __init__(self, elements: list[Any]) -> None:
        self.elements = elements

    def __iter__(self) -> Iterator[Any]:
        yield from self.elements

    def __len__(self) -> int:
        return len(self.elements)


class _Indexed(torch.utils.data.Dataset[Any]):
    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __getitem__(self, index: int) -> Any:
        return self.samples[index]

    def __len__(self) -> int:
        return len(self.samples)


# (samples, fields=, dtypes=): leaves the one-pass stream path does not take, so the general route converts them.
FITTING = {
    "int64 tensors into declared uint8": (
        [{"x": torch.arange(4) + i} for i in range(6)],
        {"x": Field((4,), "uint8")},
        None,
    ),
    "float64 arrays into dtypes= float16": (
        [{"x": np.full(3, i / 4, np.float64), "y": i} for i in range(6)],
        None,
        {"x": "float16"},
    ),
    "lists of numbers": ([{"x": [i, i + 1, i + 2]} for i in range(6)], None, None),
    "numpy scalars and bfloat16": (
        [{"s": np.float32(i / 2), "b": torch.full((2,), i, dtype=torch.bfloat16)} for i in range(6)],
        None,
        None,
    ),
    "variable tokens into declared int16": (
        [{"tokens": torch.arange(i + 1, dtype=torch.int64) - 3} for i in range(6)],
        {"tokens": Field((None,), "int16")},
        None,
    ),
}


def _both(tmp_path: Path, samples: list[Any], fields: Any, dtypes: Any) -> tuple[CachedDataset, CachedStream]:
    budget = "1MiB"
    dataset = CachedDataset(
        _Indexed(samples), tmp_path / "d.mmc", key="d", fields=fields, dtypes=dtypes, max_bytes=budget
    )
    stream = CachedStream(
        _Listed(samples), tmp_path / "s.mmc", key="s", fields=fields, dtypes=dtypes, max_bytes=budget, shuffle=False
    )
    return dataset, stream


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert isinstance(a, torch.Tensor)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", list(FITTING))
def test_a_stream_stores_what_a_dataset_stores_from_the_same_samples(tmp_path: Path, case: str) -> None:
    samples, fields, dtypes = FITTING[case]
    dataset, stream = _both(tmp_path, samples, fields, dtypes)
    with closing(dataset), closing(stream):
        first = list(stream)  # the first epoch: converted and stored by the stream
        read = list(stream)  # the second: from the file
        assert stream.stats()["complete"]
        loaded = dataset.__getitems__(list(range(len(samples))))  # one miss batch
        again = [dataset[i] for i in range(len(samples))]  # from the file
        assert dataset.cache is not None
        assert stream.cache is not None
        assert dataset.cache.fields == stream.cache.fields
        for k in range(len(samples)):
            for value in (first[k], read[k], again[k]):
                _same(loaded[k], value)
        for name, field in dataset.cache.fields.items():
            if field.variable:
                continue
            stored_d = dataset.cache.read_many(np.arange(len(samples)))[0][name]
            stored_s = stream.cache.read_many(np.arange(len(samples)))[0][name]
            assert stored_d.tobytes() == stored_s.tobytes()


# (samples, fields=, dtypes=, the error's type, a pattern of the shared words): the last sample does not fit.
UNFIT = {
    "a value the declared dtype cannot hold": (
        [{"x": torch.tensor([1, 2])}, {"x": torch.tensor([3, 300])}],
        {"x": Field((2,), "uint8")},
        None,
        ValueError,
        r"field 'x': the value 300 cannot be stored as uint8 without changing it",
    ),
    "complex into a real dtypes=": (
        [{"x": np.ones(2, np.float64)}, {"x": np.ones(2, np.complex128)}],
        None,
        {"x": "float32"},
        TypeError,
        r"field 'x': complex values cannot be stored as float32",
    ),
    "a declared shape": (
        [{"x": np.ones(2, np.float32)}, {"x": np.ones(3, np.float32)}],
        {"x": Field((2,), "float32")},
        None,
        ValueError,
        r"field 'x': expected a sample of shape \(2,\), got shape \(3,\), which fields= declares",
    ),
    "a dtype that changed": (
        [{"x": np.ones(2, np.float32)}, {"x": np.ones(2, np.float64)}],
        None,
        None,
        TypeError,
        r"field 'x': the dataset gave float64 values, the cache holds float32\. mmapcache caches samples of one "
        r"structure and dtype per field",
    ),
}


@pytest.mark.parametrize("case", list(UNFIT))
def test_a_leaf_that_does_not_fit_fails_alike_in_a_stream_and_a_dataset(tmp_path: Path, case: str) -> None:
    samples, fields, dtypes, kind, words = UNFIT[case]
    dataset, stream = _both(tmp_path, samples, fields, dtypes)
    with closing(dataset), closing(stream):
        assert dataset[0] is not None
        with pytest.raises(kind) as from_dataset:
            dataset[1]
        with pytest.raises(kind) as from_stream:
            list(stream)
    assert re.search(r"^dataset\[1\]: " + words, str(from_dataset.value)), from_dataset.value
    assert re.search(r"^stream element 1: " + words, str(from_stream.value)), from_stream.value
