"""Round trips: every numpy dtype class, torch float16/bfloat16, and Hypothesis-generated schemas."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmapcache import Cache, Field

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "longdouble",
    "complex64",
    "complex128",
    "clongdouble",
    "datetime64[ns]",
    "timedelta64[s]",
    "S5",
    "U7",
    "V6",
    ">i4",
    np.dtype([("x", "<f4"), ("tag", "S2"), ("pair", "<i2", (2,))]),
]


def random_values(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """Arbitrary bit patterns of ``dtype`` (NaNs, odd strings and all)."""
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_numpy_dtype_round_trips_bit_exactly(cache_dir: Path, dtype: Any) -> None:
    dt = np.dtype(dtype)
    fields = {"v": Field((2, 3), dt), "s": Field((), dt)}
    path = cache_dir / "c.mmc"
    with Cache.open(path, fields, length=8) as cache:
        for i in range(8):
            cache.put(i, {"v": random_values(dt, (2, 3), i), "s": random_values(dt, (), 100 + i)})
    with Cache.open(path, fields, length=8) as cache:
        batch = cache.get_many(range(8))
        for i in range(8):
            one = cache[i]
            assert one["v"].dtype == dt
            assert one["v"].tobytes() == random_values(dt, (2, 3), i).tobytes()
            assert one["s"].shape == ()
            assert one["s"].tobytes() == random_values(dt, (), 100 + i).tobytes()
            assert batch["v"][i].tobytes() == one["v"].tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_torch_half_precision_round_trips(cache_dir: Path, name: str) -> None:
    import torch  # a test dependency: a missing torch fails, it is not skipped

    dtype = getattr(torch, name)
    values = torch.randn(4, 5).to(dtype)
    with Cache.open(cache_dir / "c.mmc", {"t": Field((4, 5), dtype)}, length=4) as cache:
        assert cache.put(0, {"t": values})
        assert cache.put(1, {"t": values.float()})  # same-kind cast float32 -> half
        assert cache.put(2, {"t": values.float().numpy()}) is True
        bits = torch.from_numpy(cache.get_many([0, 1, 2])["t"]).view(dtype)
        for row in range(3):
            assert torch.equal(bits[row], values)
        with pytest.raises(TypeError, match="cannot store"):
            cache.put(3, {"t": torch.ones(4, 5, dtype=torch.complex64)})


def test_multi_field_samples_keep_fields_apart(cache_dir: Path) -> None:
    fields = {
        "image": Field((3, 4, 4), "uint8"),
        "mask": Field((4, 4), "bool"),
        "box": Field((4,), "float32"),
        "label": Field((), "int64"),
    }
    with Cache.open(cache_dir / "c.mmc", fields, length=20) as cache:
        for i in range(20):
            sample = {
                "image": random_values(np.dtype("uint8"), (3, 4, 4), i),
                "mask": random_values(np.dtype("bool"), (4, 4), i),
                "box": np.arange(4, dtype=np.float32) * i,
                "label": i,
            }
            cache.put(i, sample)
        for i in range(20):
            got = cache[i]
            assert got["image"].tobytes() == random_values(np.dtype("uint8"), (3, 4, 4), i).tobytes()
            assert got["mask"].tolist() == random_values(np.dtype("bool"), (4, 4), i).tolist()
            assert got["box"].tolist() == (np.arange(4, dtype=np.float32) * i).tolist()
            assert int(got["label"]) == i


SIMPLE_DTYPES = st.sampled_from(
    ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64", "S3", "U2", "M8[ms]"]
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
SCHEMAS = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8),
    st.tuples(SHAPES, SIMPLE_DTYPES).map(lambda pair: Field(pair[0], pair[1])),
    min_size=1,
    max_size=4,
)


@st.composite
def schema_and_samples(draw: st.DrawFn) -> tuple[dict[str, Field], int, dict[int, dict[str, np.ndarray[Any, Any]]]]:
    fields = draw(SCHEMAS)
    length = draw(st.integers(1, 12))
    indices = draw(st.lists(st.integers(0, length - 1), max_size=length, unique=True))
    samples = {
        i: {name: draw(hnp.arrays(field.dtype, field.fixed_shape)) for name, field in fields.items()} for i in indices
    }
    return fields, length, samples


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema_and_samples())
def test_arbitrary_schemas_and_values_round_trip(case: tuple[dict[str, Field], int, dict[int, Any]]) -> None:
    fields, length, samples = case
    directory = Path(tempfile.mkdtemp(prefix="mmapcache-test-", dir="/dev/shm"))
    try:
        path = directory / "h.mmc"
        with Cache.open(path, fields, length=length, key="hypothesis") as cache:
            for i, sample in samples.items():
                assert cache.put(i, sample)
        with Cache.open(path, fields, length=length, key="hypothesis", readonly=True) as cache:
            assert cache.filled == len(samples)
            for i in range(length):
                got = cache.get(i)
                if i not in samples:
                    assert got is None
                    continue
                for name, want in samples[i].items():
                    assert got[name].shape == want.shape
                    assert got[name].tobytes() == want.tobytes()
            if samples:
                order = sorted(samples)
                batch = cache.get_many(order)
                for row, i in enumerate(order):
                    for name, want in samples[i].items():
                        assert batch[name][row, ...].tobytes() == want.tobytes()
    finally:
        shutil.rmtree(directory)
