"""``CachedStream.loader()``: a complete stream read a batch at a time; workers leave the source pickled."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from mmapcache import Field
from mmapcache.torch import CachedStream, Padded, ragged_collate

HERE = Path(__file__).parents[1]
sys.path.insert(0, str(HERE))
from stream_sources import Numbers  # noqa: E402

FIELDS = {
    "x": Field((4,), "int64"),
    "label": Field((), "int64"),
    "caption": Field((None,), "str"),
    "tokens": Field((None,), "int32"),
}


def _stream(path: Path, length: int = 50, **options: Any) -> CachedStream:
    return CachedStream(Numbers(length, **options), path, key="k", fields=FIELDS, max_bytes="1MiB")


def _same(batch: Any, expected: Any) -> None:
    assert batch.keys() == expected.keys()
    assert torch.equal(batch["x"], expected["x"])
    assert torch.equal(batch["label"], expected["label"])
    assert batch["caption"] == expected["caption"]
    assert isinstance(batch["tokens"], Padded)
    assert torch.equal(batch["tokens"].data, expected["tokens"].data)
    assert torch.equal(batch["tokens"].lengths, expected["tokens"].lengths)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_complete_streams_loader_gives_the_batches_a_dataloader_over_it_gives(tmp_path: Path, workers: int) -> None:
    ds = _stream(tmp_path / "s.mmc")
    loader = ds.loader(batch_size=8, num_workers=workers)
    first = list(loader)  # the first epoch streams and fills, collated from the elements
    assert sorted(label for batch in first for label in batch["label"].tolist()) == list(range(50))
    assert ds.stats()["complete"]
    ds.set_epoch(3)
    batches = list(loader)
    ds.set_epoch(3)
    expected = list(DataLoader(ds, batch_size=8, collate_fn=ragged_collate("pad", leaves=["tokens"])))
    assert len(batches) == len(expected) == len(loader) == 7
    for batch, want in zip(batches, expected, strict=True):
        _same(batch, want)
    after = [batch["label"].tolist() for batch in loader]
    assert after != [batch["label"].tolist() for batch in batches], "the next epoch is another permutation"


def test_the_loader_keeps_order_drops_the_last_batch_and_refuses_its_own_sampler(tmp_path: Path) -> None:
    ds = _stream(tmp_path / "s.mmc")
    list(ds)
    stored = [int(element["label"]) for element in CachedStream(Numbers(50), ds.path, key="k", shuffle=False)]
    loader = ds.loader(batch_size=8, shuffle=False, drop_last=True)
    assert [label for batch in loader for label in batch["label"].tolist()] == stored[:48]
    assert len(loader) == 6
    for refused in ({"sampler": [0, 1]}, {"collate_fn": list}, {"stateful": True}):
        with pytest.raises(TypeError, match="draws its own order"):
            ds.loader(batch_size=8, **refused)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        ds.loader(batch_size=None)


class Source(torch.utils.data.IterableDataset[Any]):
    """A stream whose unpickling is recorded in ``log`` (a HF dataset takes seconds to unpickle)."""

    def __init__(self, length: int, log: str) -> None:
        self.length, self.log = length, log

    def __iter__(self) -> Any:
        yield from Numbers(self.length, kind="fixed")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        with open(self.log, "a") as file:
            file.write("unpickled\n")


@pytest.mark.parametrize("how", ["loader", "DataLoader"])
def test_spawned_workers_over_a_complete_cache_do_not_unpickle_the_source(tmp_path: Path, how: str) -> None:
    log = tmp_path / "unpickled"
    ds = CachedStream(Source(24, str(log)), tmp_path / "s.mmc", key="k", max_bytes="1MiB")
    list(ds)  # complete
    options: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "spawn"}
    loader = ds.loader(batch_size=4, **options) if how == "loader" else DataLoader(ds, batch_size=4, **options)
    labels = [label for batch in loader for label in batch["label"].tolist()]
    assert sorted(labels) == list(range(24))
    assert not log.exists(), "a worker unpickled the source"


def test_the_streams_guide_prints_what_it_says(tmp_path: Path) -> None:
    """docs/streams.md's blocks run in order; the loader section prints the lines its comments show."""
    import os
    import re
    import subprocess

    text = (HERE.parent / "docs" / "streams.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "MMAPCACHE_DIR": str(tmp_path / "default")}
    run = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    section = text[text.index("## Later epochs, a batch at a time") :]
    block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert block is not None
    shown = [line[2:] for line in block.group(1).splitlines() if line.startswith("# ")]
    printed = run.stdout.splitlines()
    start = printed.index(shown[0])
    assert printed[start : start + len(shown)] == shown
