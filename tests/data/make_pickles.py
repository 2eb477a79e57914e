"""Writes ``pickles-<version>.pkl``: objects pickled by a released mmapcache, which later versions must load.

Run it against the sources of that release, never the current ones (0.3.0 is commit cffe973, 0.4.0
commit b771134, 0.5.0 commit 45d29aa)::

    mkdir /tmp/mmapcache-0.5.0 && git archive 45d29aa mmapcache | tar -x -C /tmp/mmapcache-0.5.0
    PYTHONPATH=/tmp/mmapcache-0.5.0:tests python tests/data/make_pickles.py

Every path in it is ``PLACEHOLDER``-long, so that a test can point the datasets at a file of its own
(a same-length replacement keeps the pickle valid). The stream's source is ``pickled_sources.Numbers``
(tests/pickled_sources.py), which the loading test imports too. 0.3.0 had no streams, samplers or
``Jagged``: its pickle holds two datasets and a ``Padded`` batch.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset, Padded

PLACEHOLDER = "/" + "x" * 195 + "{}.mmc"

images = torch.arange(6 * 12, dtype=torch.uint8).reshape(6, 3, 4)
labels = torch.arange(6)
objects: dict[str, Any] = {
    "version": mmapcache.__version__,
    "whole": CachedDataset(
        TensorDataset(images, labels),
        PLACEHOLDER.format("a"),
        key="fixture/whole",
        dtypes={"1": torch.int32},
        check=1,
        capacity=5,
    ),
    "padded": Padded(torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([2, 1])),
}
if mmapcache.__version__ == "0.3.0":
    objects["shard"] = CachedDataset(
        TensorDataset(images, labels),
        PLACEHOLDER.format("b"),
        key="fixture/shard",
        fields={"0": Field((3, 4), "uint8"), "1": Field((), "int64")},
        cached_indices=[4, 1, 3],
        copy=False,
        verify=True,
        check=0,
    )
else:
    import numpy as np
    from pickled_sources import Numbers

    from mmapcache import Jagged
    from mmapcache.torch import CachedStream, NodeShardSampler, Packed

    tokens = [torch.arange(n, dtype=torch.int32) for n in (3, 0, 5, 1, 2, 4)]
    objects |= {
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
        "sampler": NodeShardSampler(
            list(range(10)), seed=4, num_nodes=2, node_rank=1, local_world_size=1, local_rank=0
        ),
        "packed": Packed(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3], dtype=torch.int32), 2),
        "jagged": Jagged.from_arrays([np.arange(3, dtype=np.int16), np.arange(0, dtype=np.int16)]),
        "field": Field((None, 4), "float32"),
    }
out = Path(__file__).with_name(f"pickles-{mmapcache.__version__}.pkl")
out.write_bytes(pickle.dumps(objects, protocol=4))
print(f"wrote {out}")
