"""Real pipelines meeting the cache's rules: text leaves, storage dtypes, stale and random data, failed first tries."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _tmpfs import mounted_tmpfs
from pipelines import Documents, Huge, NumpyStrings, Pixels, Random, Texts, Unresized, normalize_in_place
from torch.utils.data import DataLoader, default_collate

from mmapcache import Cache, CacheError, Field, SchemaMismatchError, StaleCacheError, in_use
from mmapcache.torch import CachedDataset

HERE = Path(__file__).resolve().parents[1]


def fresh_process(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new Python process (a later run, another job), with tests/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def stored(path: Path) -> list[bytes]:
    """Every slot's bytes (the usage counters aside: opening a cache counts into them)."""
    with Cache(path, readonly=True) as cache:
        assert cache.filled == cache.capacity
        batch = cache.get_many(range(cache.length))
        return [np.ascontiguousarray(batch[name]).tobytes() for name in cache.fields]


# -- str and bytes leaves ------------------------------------------------------------------


def test_text_leaves_come_back_as_str_and_bytes(tmp_path: Path) -> None:
    ds = CachedDataset(Texts(), tmp_path / "t.mmc", key="texts/v1")  # no max_bytes: text gets room by itself
    for i in (3, 0, 39):
        got, want = ds[i], Texts()[i]
        assert got["text"] == want["text"]
        assert type(got["text"]) is str
        assert got["path"] == want["path"]
        assert type(got["path"]) is bytes
        assert torch.equal(got["ids"], want["ids"])
    assert ds.cache.fields["text"] == Field((None,), str)
    assert ds.cache.fields["path"] == Field((None,), bytes)
    batch = default_collate(ds.__getitems__([5, 6]))
    assert batch["text"] == [Texts()[5]["text"], Texts()[6]["text"]]  # lists of str, as without the cache
    assert batch["path"] == [b"/data/00005.jpg", b"/data/00006.jpg"]
    assert batch["label"].tolist() == [5, 6]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_text_through_dataloader_workers_and_loader(tmp_path: Path, context: str) -> None:
    ds = CachedDataset(Texts(), tmp_path / "t.mmc", key="texts/v1")
    want = [Texts()[i] for i in range(40)]
    for loader in (
        DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context),
        ds.loader(batch_size=4, num_workers=2, multiprocessing_context=context),
    ):
        texts = [text for batch in loader for text in batch["text"]]
        assert texts == [w["text"] for w in want]
    assert ds.stats()["filled"] == 40
    with Cache(ds.path, readonly=True) as cache:  # the core hands text back as str and bytes too
        assert cache.get(7)["text"] == want[7]["text"]
        assert cache.get_many([1, 2])["path"] == [want[1]["path"], want[2]["path"]]


def test_text_room_is_sized_from_a_spread_sample_and_the_sample_is_stored(tmp_path: Path) -> None:
    """The first batch's texts are short, later ones long: the spread sample sees both, so every one fits."""
    ds = CachedDataset(Texts(40, long_after=20), tmp_path / "t.mmc", key="texts/v1")
    first = ds.__getitems__(list(range(8)))
    assert [s["text"] for s in first] == [Texts()[i]["text"] for i in range(8)]
    assert ds.cache.filled == 40, "the 40 samples loaded to size the file were stored"
    for i in range(40):
        assert ds[i]["text"] == Texts(40, long_after=20)[i]["text"]
    assert ds.stats()["misses"] == 8


@pytest.mark.parametrize("first", [256 * 1024, 10])
def test_a_first_document_far_from_the_typical_size_does_not_size_the_file(tmp_path: Path, first: int) -> None:
    """A large first document asked for length x its size; a small one left the rest without room."""
    documents = Documents(2000, first=first)
    ds = CachedDataset(documents, tmp_path / "d.mmc", key="docs", check=0)
    assert ds[0]["text"] == Documents(2000, first=first)[0]["text"]
    assert documents.loads == 65, "the first, and 64 samples spread over the dataset"
    assert ds.cache.filled == 65
    ds.fill(progress=False)
    assert ds.cache.filled == 2000, "every document found room"
    values = sum(len(Documents(2000, first=first)[i]["text"]) for i in range(2000))
    stats = ds.stats()
    assert values <= stats["variable_used"] <= stats["variable_bytes"] <= 2 * values + 2 * 2**20
    assert stats["variable_free"] == stats["variable_bytes"] - stats["variable_claimed"]


def test_numpy_strings_are_text(tmp_path: Path) -> None:
    ds = CachedDataset(NumpyStrings(), tmp_path / "t.mmc", key="np-strings")
    assert ds[3]["text"] == "row 3 row 3 row 3 "
    assert ds[4]["raw"] == b"xxxx"
    assert [s["text"] for s in ds.__getitems__([0, 1])] == ["", "row 1 "]
    assert ds.cache.fields["text"] == Field((None,), str)


def test_the_core_refuses_text_of_the_wrong_kind(tmp_path: Path) -> None:
    with Cache(tmp_path / "c.mmc", {"t": Field((None,), str), "b": Field((None,), bytes)}, 3, max_bytes="1MB") as c:
        with pytest.raises(TypeError, match="holds str values: give a str, not bytes"):
            c.put(0, {"t": b"x", "b": b""})
        with pytest.raises(TypeError, match="holds bytes values"):
            c.put(0, {"t": "x", "b": "y"})
        with pytest.raises(ValueError, match="not UTF-8"):
            c.put(0, {"t": np.frombuffer(b"\xff\xfe", np.uint8), "b": b""})
        with pytest.raises(ValueError, match="UTF-8"):
            c.put(0, {"t": "\ud800", "b": b""})
        assert c.filled == 0
    with pytest.raises(ValueError, match=r"Field\(\(None,\), str\)"):
        Field((4,), str)


# -- dtypes= ---------------------------------------------------------------------------------


def test_dtypes_sets_the_storage_dtype(tmp_path: Path) -> None:
    wide = CachedDataset(Pixels(), tmp_path / "wide.mmc", key="px")
    narrow = CachedDataset(Pixels(), tmp_path / "narrow.mmc", key="px", dtypes={"0": torch.uint8})
    wide.fill(progress=False)
    narrow.fill(progress=False)
    image, label = narrow[3]
    assert image.dtype == torch.uint8
    assert torch.equal(image, Pixels()[3][0].to(torch.uint8))
    assert label.dtype == torch.int64
    assert narrow.cache.fields["0"] == Field((3, 8, 8), "uint8")
    data = {ds: ds.cache.capacity * ds.cache.fields["0"].nbytes for ds in (wide, narrow)}
    assert data[wide] == 8 * data[narrow]
    batch = next(iter(narrow.loader(batch_size=6, num_workers=2)))
    assert batch[0].dtype == torch.uint8
    assert torch.equal(batch[0], torch.stack([Pixels()[i][0] for i in range(6)]).to(torch.uint8))


def test_a_lossy_dtype_is_refused_naming_field_and_value(tmp_path: Path) -> None:
    ds = CachedDataset(Pixels(top=300), tmp_path / "c.mmc", key="px", dtypes={"0": "uint8"})
    with pytest.raises(ValueError, match=r"dataset\[\d+\]: field '0': the value \d+ cannot be stored as uint8"):
        ds.__getitems__(list(range(8)))
    assert not (tmp_path / "c.mmc").exists(), "the first batch is checked before the file is made"
    with pytest.raises(TypeError, match="complex values cannot be stored as float32"):
        CachedDataset(lambda_free_complex(), tmp_path / "z.mmc", key="z", dtypes={".": torch.float32})[0]


class Values(torch.utils.data.Dataset[Any]):
    """Samples holding given values (one per sample), of a given dtype: for what ``dtypes=`` may store."""

    def __init__(self, values: list[Any], dtype: torch.dtype) -> None:
        self.values, self.dtype = values, dtype

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([0, self.values[i]], dtype=self.dtype)


@pytest.mark.parametrize(
    ("source", "value", "target"),
    [
        (torch.int8, -1, "uint8"),
        (torch.uint8, 200, "int8"),
        (torch.int32, -1, "uint32"),
        (torch.int64, -1, "uint64"),
        (torch.uint64, 2**64 - 1, "int64"),
        (torch.int64, 2**40, "int32"),
        (torch.int64, 2, "bool"),
        (torch.float32, 3e9, "int32"),
        (torch.float64, 2.0**63, "int64"),
        (torch.float32, float("inf"), "int64"),
        (torch.float32, float("nan"), "int16"),
        (torch.float64, 0.5, "int64"),
        (torch.int64, 2**63 - 1, "float64"),
        (torch.uint64, 2**64 - 1, "float32"),
        (torch.int64, 2**24 + 1, "float32"),
        (torch.float64, 1e300, "float32"),
    ],
)
def test_dtypes_refuses_every_value_the_storage_dtype_cannot_hold(
    tmp_path: Path, source: torch.dtype, value: Any, target: str
) -> None:
    """No modular wrap between signed and unsigned integers, no overflow, no rounding: a ValueError naming all."""
    ds = CachedDataset(Values([1, value], source), tmp_path / "c.mmc", key="v", dtypes={".": target}, check=0)
    assert ds[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match=rf"dataset\[1\]: field '\.': the value .* cannot be stored as {target}"):
        ds[1]
    with Cache(ds.path, readonly=True) as cache:
        assert 1 not in cache


@pytest.mark.parametrize(
    ("source", "values", "target"),
    [
        (torch.int64, [-128, 127], "int8"),
        (torch.int64, [0, 255], "uint8"),
        (torch.uint64, [2**63 - 1, 0], "int64"),
        (torch.int8, [0, 127], "uint8"),
        (torch.float64, [-(2.0**63), 2.0**62], "int64"),
        (torch.float64, [0.0, 1.0], "bool"),
        (torch.int64, [2**24, -(2**60)], "float32"),
        (torch.float64, [float("inf"), float("nan")], "float16"),
    ],
)
def test_dtypes_stores_every_value_the_storage_dtype_holds(
    tmp_path: Path, source: torch.dtype, values: list[Any], target: str
) -> None:
    ds = CachedDataset(Values(values, source), tmp_path / "c.mmc", key="v", dtypes={".": target}, check=0)
    for i, value in enumerate(values):
        got = ds[i][1].item()
        assert got == value or (got != got and value != value), (got, value)


def test_the_core_refuses_integers_that_would_wrap(tmp_path: Path) -> None:
    """Cache.put checks integer ranges (it never relies on a round trip): no wrap between signed and unsigned."""
    cases = [(np.int8(-1), "uint8"), (np.uint8(200), "int8"), (np.int32(-1), "uint32"), (np.uint64(2**64 - 1), "int64")]
    for k, (value, target) in enumerate(cases):
        with Cache(tmp_path / f"c{k}.mmc", {"x": Field((1,), target)}, 2) as cache:
            for given in (np.array([value]), torch.from_numpy(np.array([value])), [int(value)]):
                with pytest.raises((TypeError, ValueError), match="field 'x'"):
                    cache.put(0, {"x": given})
            assert cache.filled == 0


class lambda_free_complex(torch.utils.data.Dataset[Any]):  # noqa: N801 - reads as a call above
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.ones(2, dtype=torch.complex64)


def test_dtypes_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"names the field 'image', but dataset\[0\] has the fields \['0', '1'\]"):
        CachedDataset(Pixels(), tmp_path / "c.mmc", key="px", dtypes={"image": "uint8"})[0]
    with pytest.raises(TypeError):
        CachedDataset(Pixels(), key="px", dtypes={"0": "not a dtype"})
    CachedDataset(Pixels(), tmp_path / "c.mmc", key="px", dtypes={"0": "uint8"}).fill(progress=False)
    with pytest.raises(SchemaMismatchError, match="dtypes= asks for"):
        CachedDataset(Pixels(), tmp_path / "c.mmc", key="px", dtypes={"0": "int16"})[0]


# -- stale content ---------------------------------------------------------------------------


def test_a_changed_dataset_under_the_same_key_is_stale(tmp_path: Path) -> None:
    CachedDataset(Pixels(), tmp_path / "c.mmc", key="px/v1").fill(progress=False)
    before = stored(tmp_path / "c.mmc")
    run = fresh_process(
        "from pipelines import Pixels\n"
        "from mmapcache import StaleCacheError\n"
        "from mmapcache.torch import CachedDataset\n"
        "ds = CachedDataset(Pixels(version=1), 'c.mmc', key='px/v1')\n"
        "try:\n"
        "    ds[0]\n"
        "except StaleCacheError as error:\n"
        "    print('STALE', error.index, error.field)\n"
        "    print(error)\n",
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("STALE "), run.stdout
    index, field = run.stdout.split()[1:3]
    assert 0 <= int(index) < 24
    assert field == "0"
    assert "change the key" in run.stdout
    assert "mmapcache rm" in run.stdout
    assert stored(tmp_path / "c.mmc") == before, "a stale cache is reported, never changed"


def test_changed_preprocessing_is_stale_and_check_0_skips_it(tmp_path: Path) -> None:
    CachedDataset(Pixels(size=8), tmp_path / "c.mmc", key="px/v1").fill(progress=False)
    with pytest.raises(StaleCacheError, match="holds samples with fields"):
        CachedDataset(Pixels(size=12), tmp_path / "c.mmc", key="px/v1")[0]
    unchecked = CachedDataset(Pixels(version=1), tmp_path / "c.mmc", key="px/v1", check=0)
    assert torch.equal(unchecked[0][0], Pixels()[0][0]), "check=0: the cached sample, unchecked"
    same = CachedDataset(Pixels(), tmp_path / "c.mmc", key="px/v1", check=8)
    assert torch.equal(same[5][0], Pixels()[5][0])


def test_stale_content_is_caught_in_a_sparse_cache(tmp_path: Path) -> None:
    """A cache with a few filled slots among many is still checked (random probes fall back to a scan)."""
    CachedDataset(Pixels(n=5000), tmp_path / "c.mmc", key="px/v1", check=0).__getitems__([4321])
    with pytest.raises(StaleCacheError) as caught:
        CachedDataset(Pixels(n=5000, version=1), tmp_path / "c.mmc", key="px/v1")[0]
    assert caught.value.index == 4321


def test_the_stale_check_of_a_partial_cache_of_a_huge_dataset_draws_from_the_filled_slots(tmp_path: Path) -> None:
    """The probes come from the slot table (O(check) memory), never from range(len(dataset))."""
    CachedDataset(Huge(), tmp_path / "c.mmc", key="huge", capacity=50_000, check=0).__getitems__([7, 40_001])
    tracemalloc.start()
    try:
        fresh = CachedDataset(Huge(), tmp_path / "c.mmc", key="huge", capacity=50_000)
        assert fresh[2**40 - 1].tolist() == [(2**40 - 1) % 251] * 4  # opened and checked: both filled slots agree
        with pytest.raises(StaleCacheError) as caught:
            CachedDataset(Huge(version=1), tmp_path / "c.mmc", key="huge", capacity=50_000)[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.index in (7, 40_001)
    assert peak < 16 * 2**20, f"the check allocated {peak / 2**20:.0f} MiB"


def test_stale_content_is_caught_in_dataloader_workers(tmp_path: Path) -> None:
    CachedDataset(Pixels(), tmp_path / "c.mmc", key="px/v1").fill(progress=False)
    stale = CachedDataset(Pixels(version=2), tmp_path / "c.mmc", key="px/v1")
    with pytest.raises(StaleCacheError):
        list(DataLoader(stale, batch_size=4, num_workers=2))


# -- random datasets -------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_random_dataset_is_refused_before_it_is_frozen(tmp_path: Path, workers: int) -> None:
    ds = CachedDataset(Random(), tmp_path / "c.mmc", key="random")
    with pytest.raises(CacheError, match=r"not deterministic.*transform="):
        list(DataLoader(ds, batch_size=4, num_workers=workers))
    assert not (tmp_path / "c.mmc").exists(), "nothing was frozen"


# -- failed first tries ------------------------------------------------------------------------


def test_varying_shapes_in_the_first_batch_leave_no_file(tmp_path: Path) -> None:
    ds = CachedDataset(Unresized(), tmp_path / "c.mmc", key="img")
    with pytest.raises(ValueError, match="declare the fields with None"):
        ds.__getitems__(list(range(12)))
    assert not (tmp_path / "c.mmc").exists()


def test_a_failed_first_try_never_blocks_the_corrected_rerun(tmp_path: Path) -> None:
    ds = CachedDataset(Unresized(), tmp_path / "c.mmc", key="img")
    for i in range(6):
        ds[i]  # the first half agrees: the file is made with its shape
    with pytest.raises(ValueError, match="it was removed, so the next try starts afresh"):
        ds[10]
    assert not (tmp_path / "c.mmc").exists()
    fixed = CachedDataset(Unresized(resize=True), tmp_path / "c.mmc", key="img")
    assert all(torch.equal(fixed[i], Unresized(resize=True)[i]) for i in range(12))


def test_a_failed_first_try_in_workers_is_replaced_by_the_rerun(tmp_path: Path) -> None:
    """Workers still hold the file when one of them finds the misfit: it is marked, and the rerun replaces it."""
    ds = CachedDataset(Unresized(), tmp_path / "c.mmc", key="img")
    ds.__getitems__(list(range(6)))
    holder = Cache(tmp_path / "c.mmc")  # another process of the first try, still running
    with pytest.raises(ValueError, match="next try replaces it, even while the processes using it now still hold it"):
        ds[10]
    assert holder.refuted
    holder.close()
    run = fresh_process(
        "import torch\n"
        "from pipelines import Unresized\n"
        "from mmapcache.torch import CachedDataset\n"
        "ds = CachedDataset(Unresized(resize=True), 'c.mmc', key='img')\n"
        "assert all(torch.equal(ds[i], Unresized(resize=True)[i]) for i in range(12))\n"
        "print(ds.cache.fields['.'])\n",
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "Field((3, 6, 6), 'uint8')" in run.stdout


def hold(path: Path) -> subprocess.Popen[str]:
    """Another process (of a first try, still running) that has the cache at ``path`` open until its stdin closes."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys\nfrom mmapcache import Cache\nc = Cache({str(path)!r})\n"
            "print('open', flush=True)\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline() == "open\n"
    return holder


@pytest.mark.parametrize("declared", [True, False])
def test_a_refuted_cache_held_by_another_process_never_blocks_the_corrected_rerun(
    tmp_path: Path, declared: bool
) -> None:
    """The rerun — with fields= declaring the shapes that vary, or with the resize fixed — replaces the held file."""
    path = tmp_path / "c.mmc"
    first = CachedDataset(Unresized(), path, key="img")
    first.__getitems__(list(range(6)))
    holder = hold(path)
    try:
        with pytest.raises(ValueError, match="the next try replaces it"):
            first[10]
        assert in_use(path)
        if declared:
            rerun = CachedDataset(
                Unresized(), path, key="img", fields={".": Field((3, None, 6), "uint8")}, max_bytes="1MiB"
            )
            want = Unresized()
        else:
            rerun = CachedDataset(Unresized(resize=True), path, key="img")
            want = Unresized(resize=True)
        assert all(torch.equal(rerun[i], want[i]) for i in range(12))
        assert rerun.stats()["filled"] == 12
        assert not rerun.cache.refuted
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0


# -- copy=False ---------------------------------------------------------------------------------


def test_copy_false_with_a_transform_that_writes_to_its_input_now_and_then(tmp_path: Path) -> None:
    """The transform gets writable copies: no signal, no write reaches the file, later reads are exact."""
    path = tmp_path / "c.mmc"
    CachedDataset(Pixels(), path, key="px", dtypes={"0": "uint8"}).fill(progress=False)
    before = stored(path)
    code = f"""
import torch
from torch.utils.data import DataLoader
from pipelines import EraseSometimes, Pixels
from mmapcache.torch import CachedDataset
ds = CachedDataset(Pixels(), {str(path)!r}, key="px", dtypes={{"0": "uint8"}}, copy=False, transform=EraseSometimes())
want = [Pixels()[i][0].to(torch.uint8) for i in range(len(ds))]

def exact(image, i, wrote):
    assert torch.equal(image, torch.zeros_like(image) if wrote else want[i]), (i, wrote)

for _ in range(3):
    for i in range(len(ds)):
        image, label, wrote = ds[i]
        exact(image, i, wrote)
    for i, (image, label, wrote) in zip(range(0, 24, 2), ds.__getitems__(list(range(0, 24, 2)))):
        exact(image, i, wrote)
loaders = [DataLoader(ds, batch_size=4, num_workers=2), ds.loader(batch_size=4, num_workers=2), ds.loader(batch_size=4)]
for loader in loaders:
    for k, (images, labels, wrote) in enumerate(loader):
        for row in range(4):
            exact(images[row], 4 * k + row, bool(wrote[row]))
print("alive", ds.stats()["misses"])
"""
    run = fresh_process(code, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["alive", "0"]
    assert stored(path) == before, "no write reached the file"
    plain = CachedDataset(Pixels(), path, key="px", dtypes={"0": "uint8"}, copy=False, transform=normalize_in_place)
    assert torch.equal(plain[2][0], Pixels()[2][0].to(torch.uint8) - 1)
    assert torch.equal(plain[2][0], Pixels()[2][0].to(torch.uint8) - 1), "the same process reads it intact again"


# -- errors that point at the fix ----------------------------------------------------------------


def test_a_pil_image_leaf_suggests_pil_to_tensor(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")

    class Images(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> Any:
            return image.new("RGB", (4, 4)), i

    with pytest.raises(TypeError, match=r"PILToTensor\(\)"):
        CachedDataset(Images(), tmp_path / "c.mmc", key="pil")[0]


def test_a_sized_budget_larger_than_the_file_system_is_capped_with_a_warning_that_says_what_to_do(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """20,000 documents of ~1 KB want ~25 MB; a 4 MiB file system gets a file sized at 90% of its free space."""
    with mounted_tmpfs(cache_dir / "small", "size=4m,mode=0700") as small:
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        with caplog.at_level(logging.WARNING, logger="mmapcache"):
            ds = CachedDataset(Documents(20_000, first=1000), small / "d.mmc", key="docs", check=0)
            assert ds[0]["text"] == Documents(20_000, first=1000)[0]["text"]
        assert "has only" in caplog.text
        assert "max_bytes=" in caplog.text
        assert "MMAPCACHE_DIR" in caplog.text
        assert (small / "d.mmc").stat().st_size <= 0.95 * free, "sized at 90% of the free space (plus the header)"
        for i in (1, 7_777, 19_999):  # cached or not, every read is exact
            assert ds[i]["text"] == Documents(20_000, first=1000)[i]["text"]
        stats = ds.stats()
        assert 0 < stats["filled"] < 20_000
        ds.close()
