"""LitData's side of ``bench_stream.py``, run by the python of an environment where litdata is installed.

``python _litdata_child.py ELEMENTS.pkl OUTPUT_DIR``: converts the pickled
elements with ``litdata.optimize`` into OUTPUT_DIR, then times two epochs of
a ``StreamingDataset`` over it, element by element in this process, and
prints one JSON line of seconds and microseconds per element.
"""

from __future__ import annotations

import functools
import json
import pickle
import sys
import time
from typing import Any

ELEMENTS: list[Any] = []


def _element(source: str, i: int) -> Any:
    if not ELEMENTS:  # each of LitData's worker processes loads them once
        with open(source, "rb") as file:
            ELEMENTS.extend(pickle.load(file))
    return ELEMENTS[i]


def main(source: str, output: str) -> None:
    import litdata

    _element(source, 0)
    start = time.perf_counter()
    litdata.optimize(
        fn=functools.partial(_element, source),
        inputs=list(range(len(ELEMENTS))),
        output_dir=output,
        chunk_bytes="16MB",
        num_workers=1,
    )
    optimize = time.perf_counter() - start
    dataset = litdata.StreamingDataset(output, shuffle=True)
    epochs = []
    for epoch in range(2):
        dataset.set_epoch(epoch + 1)
        start = time.perf_counter()
        count = sum(1 for _ in dataset)
        epochs.append(time.perf_counter() - start)
        assert count == len(ELEMENTS), (count, len(ELEMENTS))
    n = len(ELEMENTS)
    print(
        json.dumps(
            {
                "elements": n,
                "optimize_seconds": optimize,
                "epoch1_us_per_element": epochs[0] / n * 1e6,
                "epoch2_us_per_element": epochs[1] / n * 1e6,
                "litdata": litdata.__version__,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
