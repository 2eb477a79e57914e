"""Real pipelines meeting the cache's rules: text leaves, storage dtypes, stale and random data, failed first tries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import NumpyStrings, Pixels, Random, Texts, Unresized, normalize, normalize_in_place
from torch.utils.data import DataLoader, default_collate

from mmapcache import Cache, CacheError, Field, SchemaMismatchError, StaleCacheError
from mmapcache.torch import CachedDataset

HERE = Path(__file__).resolve().parent


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


def test_text_longer_than_the_default_room_is_served_uncached(tmp_path: Path) -> None:
    """The room for text is sized from the first batch; values that do not fit are read from the dataset."""
    ds = CachedDataset(Texts(40, long_after=20), tmp_path / "t.mmc", key="texts/v1")
    first = ds.__getitems__(list(range(8)))  # creates the file from short texts
    assert [s["text"] for s in first] == [Texts()[i]["text"] for i in range(8)]
    for _ in range(2):
        for i in range(40):
            assert ds[i]["text"] == Texts(40, long_after=20)[i]["text"]
    assert 8 <= ds.cache.filled < 40  # some long ones found no room, and were still exact


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
    with pytest.raises(ValueError, match="next try replaces it once the processes using it now have let go"):
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


# -- copy=False ---------------------------------------------------------------------------------


def test_copy_false_refuses_an_in_place_transform(tmp_path: Path) -> None:
    CachedDataset(Pixels(), tmp_path / "c.mmc", key="px", dtypes={"0": "uint8"}).fill(progress=False)
    ds = CachedDataset(
        Pixels(), tmp_path / "c.mmc", key="px", dtypes={"0": "uint8"}, copy=False, transform=normalize_in_place
    )
    with pytest.raises(ValueError, match=r"writes to its input in place.*copy=False"):
        ds[0]
    with pytest.raises(ValueError, match="copy=False"):
        list(DataLoader(ds, batch_size=4, num_workers=1))
    fine = CachedDataset(Pixels(), tmp_path / "c.mmc", key="px", dtypes={"0": "uint8"}, copy=False, transform=normalize)
    assert torch.equal(fine[2][0], Pixels()[2][0].to(torch.uint8) - 1)


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
