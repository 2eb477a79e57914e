"""Writes ``pickles-<version>.pkl``: objects pickled by a released mmapcache, which later versions must load.

Run it against the sources of that release, never the current ones (0.4.0 is commit b771134, 0.5.0
commit 45d29aa; 0.3.0 has its own script, ``make_pickles_0_3_0.py``)::

    mkdir /tmp/mmapcache-0.5.0 && git archive 45d29aa mmapcache | tar -x -C /tmp/mmapcache-0.5.0
    PYTHONPATH=/tmp/mmapcache-0.5.0:tests python tests/data/make_pickles.py

Every path in it is ``PLACEHOLDER``-long, so that a test can point the datasets at a file of its own
(a same-length replacement keeps the pickle valid). The stream's source is ``pickled_sources.Numbers``
(tests/pickled_sources.py), which the loading test imports too.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from pickled_sources import Numbers
from torch.utils.data import TensorDataset

import mmapcache
from mmapcache import Field, Jagged
from mmapcache.torch import CachedDataset, CachedStream, NodeShardSampler, Packed, Padded

PLACEHOLDER = "/" + "x" * 195 + "{}.mmc"

images = torch.arange(6 * 12, dtype=torch.uint8).reshape(6, 3, 4)
labels = torch.arange(6)
tokens = [torch.arange(n, dtype=torch.int32) for n in (3, 0, 5, 1, 2, 4)]
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
    "ragged": CachedDataset(
        [{"tokens": t, "label": i} for i, t in enumerate(tokens)],
        PLACEHOLDER.format("b"),
        key="fixture/ragged",
        fields={"tokens": Field((None,), "int32"), "label": Field((), "int64")},
        max_bytes="1MiB",
        check=0,
    ),
    "stream": CachedStream(
        Numbers(10),
        PLACEHOLDER.format("c"),
        key="fixture/stream",
        fields={"x": Field((), "int64"), "y": Field((None,), "int64")},
        max_bytes="1MiB",
        seed=3,
    ),
    "sampler": NodeShardSampler(list(range(10)), seed=4, num_nodes=2, node_rank=1, local_world_size=1, local_rank=0),
    "padded": Padded(torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([2, 1])),
    "packed": Packed(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3], dtype=torch.int32), 2),
    "jagged": Jagged.from_arrays([np.arange(3, dtype=np.int16), np.arange(0, dtype=np.int16)]),
    "field": Field((None, 4), "float32"),
}
out = Path(__file__).with_name(f"pickles-{mmapcache.__version__}.pkl")
out.write_bytes(pickle.dumps(objects, protocol=4))
print(f"wrote {out}")
