"""A miss batch's one conversion: samples into the storage columns single flight stores as they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mmapcache import Field  # noqa: E402
from mmapcache.torch._columns import columns  # noqa: E402
from mmapcache.torch._leaves import exact_column, fit, write_column  # noqa: E402
from mmapcache.torch._schema import Schema  # noqa: E402

PATH = Path("/nonexistent/columns.mmc")  # named in messages only


def one_by_one(schema: Schema, raw: list[Any]) -> list[np.ndarray[Any, Any]]:
    """The columns as leaf-by-leaf conversion makes them: every leaf through fit, then write_column."""
    rows = [schema.flatten(sample) for sample in raw]
    return [
        write_column([fit(row[k], field, name) for row in rows], field)
        for k, (name, field) in enumerate(schema.fields.items())
    ]


BATCHES = {
    "uint8 tensors and ints": (
        {"0": Field((3, 4), "uint8"), "1": Field((), "int64")},
        [(torch.full((3, 4), i, dtype=torch.uint8), i) for i in range(5)],
    ),
    "bfloat16 tensors and floats": (
        {"0": Field((2,), torch.bfloat16), "1": Field((), "float64")},
        [(torch.tensor([i / 3, -i], dtype=torch.bfloat16), i / 7) for i in range(4)],
    ),
    "arrays and bools in a dict": (
        {"image": Field((2, 2), "float32"), "flag": Field((), "bool")},
        [{"image": np.full((2, 2), i, np.float32), "flag": i % 2 == 0} for i in range(3)],
    ),
    "a bare non-contiguous tensor": (
        {".": Field((3, 2), "int16")},
        [torch.arange(6, dtype=torch.int16).reshape(2, 3).T + i for i in range(3)],
    ),
}


@pytest.mark.parametrize("case", sorted(BATCHES))
def test_a_batch_of_leaves_that_fit_as_they_are_is_stacked_as_leaf_by_leaf_conversion_makes_it(case: str) -> None:
    fields, raw = BATCHES[case]
    schema = Schema(fields, PATH)
    assert schema.exact, "every field takes such leaves as they are"
    got = columns(schema, list(range(len(raw))), raw, None, declared=False)
    want = one_by_one(schema, raw)
    for column, expected in zip(got, want, strict=True):
        assert column.dtype == expected.dtype
        assert column.shape == expected.shape
        assert column.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("leaves", "why"),
    [
        ([torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)], "another dtype"),
        ([torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)], "another shape"),
        ([torch.zeros(2, dtype=torch.uint8), np.zeros(2, np.uint8)], "an array among tensors"),
        ([torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8).to_sparse()], "a sparse tensor"),
    ],
)
def test_a_column_with_any_leaf_fit_would_change_or_refuse_is_left_to_fit(leaves: list[Any], why: str) -> None:
    exact = Schema({".": Field((2,), "uint8")}, PATH).exact[0]
    assert exact_column(leaves, exact) is None, why


def test_a_leaf_that_needs_grad_is_stored_detached_through_fit() -> None:
    schema = Schema({".": Field((2,), "float32")}, PATH)
    leaf = torch.ones(2, requires_grad=True)
    assert exact_column([leaf], schema.exact[0]) is None
    (column,) = columns(schema, [0], [leaf], None, declared=False)
    assert column.tolist() == [[1.0, 1.0]]


def test_a_bad_leaf_in_a_batch_raises_the_error_leaf_by_leaf_conversion_raises() -> None:
    schema = Schema({"0": Field((2,), "uint8"), "1": Field((), "int64")}, PATH)
    raw: list[Any] = [(torch.zeros(2, dtype=torch.uint8), i) for i in range(4)]
    raw[2] = (torch.zeros(2, dtype=torch.float32), 2)
    with pytest.raises(TypeError, match=r"dataset\[12\]: field '0': the dataset gave float32 values"):
        columns(schema, [10, 11, 12, 13], raw, None, declared=False)
    raw[2] = (torch.zeros(2, dtype=torch.uint8), 2**63)  # beyond int64: refused, never wrapped
    with pytest.raises(ValueError, match=r"dataset\[12\]: field '1': values from 9223372036854775808 "):
        columns(schema, [10, 11, 12, 13], raw, None, declared=False)


def test_python_ints_of_a_narrower_declared_field_are_checked_value_by_value() -> None:
    schema = Schema({"0": Field((), "uint8")}, PATH)
    assert not schema.exact[0].number, "only a field of the numbers' own dtype takes them as they are"
    (column,) = columns(schema, [0, 1], [(3,), (255,)], None, declared=True)
    assert column.dtype == np.uint8
    assert column.tolist() == [3, 255]
    with pytest.raises(ValueError, match=r"dataset\[1\]"):
        columns(schema, [0, 1], [(3,), (256,)], None, declared=True)
