"""Turning put's values into storage arrays: casting rules, torch values, raw bits, no second conversion."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mmapcache import Field
from mmapcache._region.values import coerce_batch, coerce_value

BITS = np.array([0x0000, 0x8000, 0x3FC0, 0x7F80, 0xFF80, 0x7FC1], np.uint16)  # 0, -0, 1.5, inf, -inf, NaN


def test_a_same_width_unsigned_array_is_the_raw_bits_of_a_torch_only_field() -> None:
    field = Field((6,), torch.bfloat16)
    assert coerce_value(BITS, field, "b").tolist() == BITS.tolist()
    assert coerce_value(BITS.astype(">u2"), field, "b").tolist() == BITS.tolist()  # byte order normalized
    as_tensor = torch.from_numpy(BITS.copy())
    assert coerce_value(as_tensor, field, "b").tolist() == BITS.tolist()  # a uint16 tensor: bits too
    # What Cache.get hands out goes back in unchanged, whichever way it is viewed.
    values = torch.from_numpy(BITS.copy()).view(torch.bfloat16)
    assert coerce_value(values, field, "b").tolist() == BITS.tolist()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1.5, -2.0], [1.5, -2.0]),
        (np.array([1.5, -2.0], np.float32), [1.5, -2.0]),
        (torch.tensor([1.5, -2.0], dtype=torch.float64), [1.5, -2.0]),
        (np.array([3, 4], np.uint8), [3.0, 4.0]),  # another width: numbers, not bits
        (torch.tensor([3, 4], dtype=torch.int16), [3.0, 4.0]),
    ],
)
def test_numbers_become_a_torch_only_dtype_through_torch(value: Any, expected: list[float]) -> None:
    stored = coerce_value(value, Field((2,), torch.bfloat16), "b")
    assert stored.dtype == np.uint16
    assert torch.from_numpy(stored).view(torch.bfloat16).tolist() == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (torch.ones(2, dtype=torch.complex64), ["cannot store", "complex64", "bfloat16"]),
        (np.array(["a", "b"]), ["cannot store", "ndarray", "bfloat16"]),
        (torch.ones(2).to_sparse(), ["sparse_coo", "dense"]),
    ],
)
def test_what_torch_cannot_cast_within_its_kind_is_refused(value: Any, words: list[str]) -> None:
    with pytest.raises(TypeError) as info:
        coerce_value(value, Field((2,), torch.bfloat16), "b")
    for word in words:
        assert word in str(info.value)


def test_tensors_follow_the_numpy_casting_rules_for_numpy_dtypes() -> None:
    field = Field((3,), np.int8)
    assert coerce_value(torch.tensor([1, 2, -128]), field, "x").dtype == np.int8  # int64 -> int8: they fit
    with pytest.raises(ValueError, match="out of range"):
        coerce_value(torch.tensor([1, 2, 128]), field, "x")
    with pytest.raises(TypeError, match="same kind"):
        coerce_value(torch.tensor([1, 2, 3]), Field((3,), np.uint8), "x")  # int64 -> uint8, as for numpy
    with pytest.raises(TypeError, match="same kind"):
        coerce_value(torch.tensor([1.0, 2.0, 3.0]), field, "x")
    grad = torch.ones(3, requires_grad=True)
    assert coerce_value(grad, Field((3,), np.float32), "x").tolist() == [1.0, 1.0, 1.0]
    conj = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert coerce_value(conj, Field((2,), np.complex64), "c").tolist() == [1 - 2j, 3 + 1j]
    wide = torch.arange(12, dtype=torch.float16).reshape(3, 4)[:, ::2]  # not contiguous
    assert coerce_value(wide, Field((3, 2), np.float16), "w").tolist() == wide.tolist()


def test_storage_arrays_pass_through_put_many_unconverted() -> None:
    """CachedDataset's misses hand put_many arrays of the storage dtype: they must not be converted again."""
    fields = {"x": Field((2, 3), np.float32), "b": Field((6,), torch.bfloat16), "s": Field((), np.int64)}
    batch = {
        "x": np.zeros((4, 2, 3), np.float32),
        "b": np.tile(BITS, (4, 1)),
        "s": np.arange(4, dtype=np.int64),
    }
    arrays = coerce_batch(batch, fields, 4)
    assert all(array is batch[name] for array, name in zip(arrays, fields, strict=True))
