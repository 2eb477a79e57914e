"""Field: shapes, dtypes (numpy and torch), equality, errors."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmapcache import Cache, Field
from mmapcache._field import normalize_fields


def test_nbytes_and_shape() -> None:
    assert Field((3, 32, 32), "uint8").nbytes == 3072
    assert Field((), "int64").nbytes == 8
    assert Field((0, 5), "float32").nbytes == 0
    assert Field(7, "float64").shape == (7,)
    assert Field([2, np.int64(3)], "f4").shape == (2, 3)


def test_fields_compare_by_value() -> None:
    assert Field((2,), "float32") == Field((2,), np.float32) == Field([2], np.dtype("<f4"))
    assert Field((2,), "float32") != Field((3,), "float32")
    assert Field((2,), "float32") != Field((2,), "float64")
    assert len({Field((2,), "float32"), Field((2,), np.float32)}) == 1
    assert Field((), "uint16") != Field((), "bfloat16")  # same bits, different meaning


def test_repr_and_pickle() -> None:
    field = Field((3, 4), "uint8")
    assert repr(field) == "Field((3, 4), 'uint8')"
    assert pickle.loads(pickle.dumps(field)) == field
    assert repr(Field((), "bfloat16")) == "Field((), 'bfloat16')"


@pytest.mark.parametrize("shape", [(-1,), (2, -3)])
def test_negative_shape(shape: Any) -> None:
    with pytest.raises(ValueError, match="negative"):
        Field(shape, "uint8")


@pytest.mark.parametrize("shape", [(1.5,), "abc", None, True, (2, "x")])
def test_non_integer_shape(shape: Any) -> None:
    with pytest.raises(TypeError, match="tuple of ints"):
        Field(shape, "uint8")


def test_variable_dimensions() -> None:
    tokens, image = Field((None,), "int32"), Field((3, None, None), "uint8")
    assert tokens.variable
    assert image.variable
    assert not Field((3,), "u1").variable
    assert image.shape == (3, None, None)
    assert image.fits((3, 5, 7))
    assert image.fits((3, 0, 1))
    assert not image.fits((4, 5, 7))
    assert not image.fits((3, 5))
    assert not tokens.fits(())
    with pytest.raises(TypeError, match="variable"):
        image.nbytes  # noqa: B018
    with pytest.raises(TypeError, match="variable"):
        image.fixed_shape  # noqa: B018
    assert repr(tokens) == "Field((None,), 'int32')"
    assert tokens == Field([None], np.int32)


@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        (object, "Python objects"),
        ("O", "Python objects"),
        (np.dtype([("a", "O")]), "Python objects"),
        ("U", "no size"),
        ("S", "no size"),
        (np.dtype(("f4", (3,))), "sub-array"),
        ("not-a-dtype", "not a dtype"),
        ("torch.float32", "torch dtype itself"),
    ],
)
def test_unstorable_dtypes(dtype: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        Field((2,), dtype)


def test_torch_dtypes() -> None:
    import torch  # a test dependency: a missing torch fails, it is not skipped

    assert Field((2,), torch.float32) == Field((2,), np.float32)
    assert Field((2,), torch.float16) == Field((2,), np.float16)
    assert Field((2,), torch.bool).dtype == np.bool_
    bf16 = Field((2,), torch.bfloat16)
    assert bf16.dtype == np.uint16
    assert bf16.torch_dtype == "bfloat16"
    assert bf16.nbytes == 4
    assert bf16 == Field((2,), "bfloat16")
    assert Field((), torch.complex32).dtype.itemsize == 4
    assert Field((), torch.float8_e4m3fn).dtype == np.uint8
    with pytest.raises(TypeError, match="quantized"):
        Field((), torch.qint8)


def test_normalize_fields() -> None:
    fields = normalize_fields({"a": ((2,), "f4"), "b": Field((), "i8")})
    assert fields == {"a": Field((2,), "float32"), "b": Field((), "int64")}
    assert list(fields) == ["a", "b"]
    with pytest.raises(TypeError, match="mapping"):
        normalize_fields([("a", Field((), "i8"))])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty strings"):
        normalize_fields({"": Field((), "i8")})
    with pytest.raises(TypeError, match="Field"):
        normalize_fields({"a": "float32"})  # type: ignore[dict-item]


@pytest.mark.parametrize("dtype", [np.dtype([]), np.dtype([("a", "u1", (0,))])])
def test_a_variable_field_of_a_dtype_without_bytes_is_refused(dtype: Any) -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        Field((None,), dtype)
    with pytest.raises(ValueError, match="at least one byte"):
        Field((3, None), dtype)
    assert Field((3,), dtype).nbytes == 0, "a fixed field of no bytes stores nothing, and opens"


def test_a_cache_with_a_variable_field_without_bytes_is_never_created(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        Cache(tmp_path / "c.mmc", {"x": ((None,), np.dtype([]))}, 4, max_bytes="1MiB")
    assert list(tmp_path.iterdir()) == []
