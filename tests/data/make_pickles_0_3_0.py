"""Writes ``pickles-0.3.0.pkl``: objects pickled by mmapcache 0.3.0, which later versions must still load.

Run it against the 0.3.0 sources (commit cffe973), never the current ones::

    mkdir /tmp/mmapcache-0.3.0 && git archive cffe973 mmapcache | tar -x -C /tmp/mmapcache-0.3.0
    PYTHONPATH=/tmp/mmapcache-0.3.0 python tests/data/make_pickles_0_3_0.py

Every path in it is ``PLACEHOLDER``-long, so that a test can point the datasets at a file of its own
(a same-length replacement keeps the pickle valid).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset, Padded

PLACEHOLDER = "/" + "x" * 195 + "{}.mmc"

assert mmapcache.__version__ == "0.3.0", mmapcache.__version__
images = torch.arange(6 * 12, dtype=torch.uint8).reshape(6, 3, 4)
labels = torch.arange(6)
objects = {
    "version": mmapcache.__version__,
    "whole": CachedDataset(
        TensorDataset(images, labels),
        PLACEHOLDER.format("a"),
        key="fixture/whole",
        dtypes={"1": torch.int32},
        check=1,
        capacity=5,
    ),
    "shard": CachedDataset(
        TensorDataset(images, labels),
        PLACEHOLDER.format("b"),
        key="fixture/shard",
        fields={"0": Field((3, 4), "uint8"), "1": Field((), "int64")},
        cached_indices=[4, 1, 3],
        copy=False,
        verify=True,
        check=0,
    ),
    "padded": Padded(torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([2, 1])),
}
out = Path(__file__).with_name("pickles-0.3.0.pkl")
out.write_bytes(pickle.dumps(objects, protocol=4))
print(f"wrote {out}")
