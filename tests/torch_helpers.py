"""Datasets for the torch and Lightning tests, importable by spawned worker processes.

``Recorded`` is a deterministic dataset that appends one line per sample it
produces to a log file (``pid ppid index``), so a test can count the misses
of every process, DataLoader workers and DDP ranks included.

Run as a script, it is one "job" of the concurrent-jobs test: it reads every
sample of a ``Recorded`` dataset through a ``CachedDataset`` and checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from mmapcache import Field
from mmapcache.torch import CachedDataset


def reference(index: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """The sample at ``index``: uint8 image, Python int label, and a dict of fp16/bf16/float64/index leaves."""
    g = torch.Generator().manual_seed(index)
    image = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g)
    half = torch.randn(4, generator=g).to(torch.float16)
    brain = torch.randn(2, 3, generator=g).to(torch.bfloat16)
    return image, index % 10, {"half": half, "bf16": brain, "weight": np.float64(index) / 3, "index": index}


class Recorded(torch.utils.data.Dataset[Any]):
    """``reference(i)`` for ``i < length``, logging each access to ``log`` (if given)."""

    def __init__(self, length: int, log: str | os.PathLike[str] | None = None) -> None:
        self.length = length
        self.log = None if log is None else str(log)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.length:
            raise IndexError(index)
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{os.getpid()} {os.getppid()} {index}\n".encode())
            finally:
                os.close(fd)
        return reference(index)


def accesses(log: str | os.PathLike[str]) -> list[tuple[int, int, int]]:
    """``(pid, ppid, index)`` for every logged access (empty if nothing was logged)."""
    path = Path(log)
    if not path.exists():
        return []
    return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in path.read_text().splitlines())]


def as_collated(index: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``reference(index)`` as CachedDataset returns it: every leaf a tensor."""
    image, label, extra = reference(index)
    return (
        image,
        torch.tensor(label),
        {
            "half": extra["half"],
            "bf16": extra["bf16"],
            "weight": torch.tensor(extra["weight"]),
            "index": torch.tensor(extra["index"]),
        },
    )


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested samples: same container types, dtypes, shapes and bits."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    sizes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view(sizes[t.element_size()])


def check_batch(batch: Any) -> list[int]:
    """Assert that a collated batch of ``Recorded`` samples equals the reference; return its indices."""
    image, label, extra = batch
    indices: list[int] = extra["index"].tolist()
    for row, index in enumerate(indices):
        got = (image[row], label[row], {k: v[row] for k, v in extra.items()})
        assert same(got, as_collated(index)), f"sample {index} differs from the dataset"
    return indices


def identity(sample: Any) -> Any:
    """A collate_fn that keeps samples as they are (the default one turns tuples into lists)."""
    return sample


class NoGetitems(CachedDataset):
    """A CachedDataset that DataLoader reads one ``ds[i]`` at a time."""

    __getitems__ = None  # type: ignore[assignment]  # the fetcher checks it for truthiness


def run_job(argv: list[str] | None = None) -> dict[str, Any]:
    """One job over a shared cache: read every sample twice through a DataLoader, check each one."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--start", help="wait until this file exists before reading")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--context", default=None, help="DataLoader multiprocessing context")
    args = parser.parse_args(argv)
    if args.start:
        while not os.path.exists(args.start):
            time.sleep(0.005)
    ds = CachedDataset(Recorded(args.length, args.log), key=args.key, check=0)
    seen: list[int] = []
    context = args.context if args.workers else None
    for _ in range(2):
        for batch in DataLoader(
            ds, batch_size=16, shuffle=True, num_workers=args.workers, multiprocessing_context=context
        ):
            seen += check_batch(batch)
    assert sorted(seen) == sorted(list(range(args.length)) * 2)
    return {"path": str(ds.path), "pid": os.getpid(), **ds.stats()}


# -- tokenized text: variable-length samples ------------------------------------------------

TOKEN_FIELDS = {"0": Field((None,), "int64"), "1": Field((), "int64")}


def tokens(index: int) -> tuple[torch.Tensor, int]:
    """Sample ``index`` of a tokenized-text dataset: int64 token ids (0 to 11 of them) and a Python int label.

    The label is the index itself, so that a batch tells which samples it holds.
    """
    g = torch.Generator().manual_seed(index)
    length = int(torch.randint(0, 12, (), generator=g))
    return torch.randint(0, 50_000, (length,), generator=g), index


class Tokens(torch.utils.data.Dataset[Any]):
    """``tokens(i)`` for ``i < length``, logging each access to ``log`` (if given), as ``Recorded`` does."""

    def __init__(self, length: int, log: str | os.PathLike[str] | None = None) -> None:
        self.inner = Recorded(length, log)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        self.inner[index]  # the bounds check and the log line
        return tokens(index)


def as_tokens(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens(index)`` as CachedDataset returns it: every leaf a tensor."""
    ids, label = tokens(index)
    return ids, torch.tensor(label)


def pad_tokens(batch: Any) -> Any:
    """The padding collate for ``Tokens`` batches (module level, so spawned workers can import it)."""
    from mmapcache.torch import pad_collate

    return pad_collate(batch, pad="0", padding_value=-1)


def check_padded_batch(batch: Any) -> list[int]:
    """Assert that a ``pad_tokens`` batch holds exactly the ``tokens`` samples it names; return their indices."""
    from mmapcache.torch import Padded

    padded, labels = batch
    assert isinstance(padded, Padded)
    assert padded.data.dtype == torch.int64
    assert padded.lengths.dtype == torch.int64
    assert padded.lengths.shape == labels.shape == (len(padded.data),)
    indices: list[int] = labels.tolist()
    longest = max(padded.lengths.tolist())
    assert padded.data.shape[1] == longest, "padded to the longest sample of the batch"
    for data, length, index in zip(padded.data, padded.lengths.tolist(), indices, strict=True):
        assert torch.equal(data[:length], tokens(index)[0]), f"sample {index} differs from the dataset"
        assert torch.all(data[length:] == -1), "the padding"
    return indices


if __name__ == "__main__":
    print(json.dumps(run_job(sys.argv[1:])))
