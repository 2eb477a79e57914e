"""A Hugging Face streaming dataset, tokenized, cached by CachedStream: streamed once, then read with a true shuffle.

    python examples/stream_tokens.py                    # 20 000 synthetic documents in JSONL shards, 2 workers
    python examples/stream_tokens.py --count 500 --workers 0 --keep

``load_dataset(..., streaming=True)`` over local JSONL shards stands in for a
remote corpus; ``.map`` tokenizes each document (the expensive, deterministic
part). ``CachedStream`` wraps the stream: the first epoch streams it — each
DataLoader worker reads its own shards, as without the cache — yields every
element and stores it once. From the second epoch on, every element comes
from the file, in a fresh permutation per epoch (``set_epoch``) across all
the shards, which a stream alone cannot give. Token ids have no fixed
length: ``fields=`` declares the ``None`` dimension, and ``max_bytes`` is the
file's budget (a stream has no length to size it from). At the end the cache
is removed, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from torch.utils.data import DataLoader

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedStream, Padded, pad_collate

TEXT = (
    "the a of to and in is it that for on with as was at by this be from or are an not have but all they "
    "model data train cache token batch loss layer epoch sample worker file memory node disk page shared"
)
WORDS = TEXT.split()
VOCAB = {word: i + 2 for i, word in enumerate(WORDS)}  # 0: padding, 1: beginning of a document


def write_shards(directory: Path, count: int, shards: int) -> list[str]:
    """JSONL shards of synthetic documents: stands in for a corpus in a bucket."""
    rng = np.random.default_rng(0)
    files = []
    for shard in range(shards):
        path = directory / f"docs-{shard:02d}.jsonl"
        with path.open("w") as file:
            for index in range(shard, count, shards):
                words = rng.choice(WORDS, size=int(rng.integers(5, 200)))
                file.write(json.dumps({"text": " ".join(words), "topic": index % 4}) + "\n")
        files.append(str(path))
    return files


def tokenize(row: dict[str, Any]) -> dict[str, Any]:
    ids = [1] + [VOCAB[word] for word in row["text"].split()]
    return {"input_ids": np.asarray(ids, np.int64), "topic": row["topic"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the cache for the next run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        files = write_shards(Path(directory), args.count, shards=max(args.workers, 1) * 2)
        stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        stream = stream.map(tokenize, remove_columns=["text"])
        ds = CachedStream(
            stream,
            key=f"example-stream-tokens/{args.count}/v1",
            fields={"input_ids": Field((None,), "int64"), "topic": Field((), "int64")},
            max_bytes="64MiB",
        )
        loader = DataLoader(ds, batch_size=64, num_workers=args.workers, collate_fn=pad_collate)
        try:
            for epoch in range(args.epochs):
                ds.set_epoch(epoch)
                start = time.perf_counter()
                tokens = 0
                first: list[int] = []
                for batch in loader:
                    ids = batch["input_ids"]
                    assert isinstance(ids, Padded)
                    tokens += int(ids.lengths.sum())
                    first = first or batch["topic"][:8].tolist()
                stats = ds.stats()
                state = "complete" if stats["complete"] else "filling"
                print(
                    f"epoch {epoch}: {tokens} tokens in {time.perf_counter() - start:.2f} s; cache {state}, "
                    f"{stats['stored']} documents stored; first topics {first}"
                )
            print(f"len(ds) = {len(ds)} documents per epoch, read from {ds.path}")
        finally:
            ds.close()
            if not args.keep and ds.path.exists():
                mmapcache.remove(ds.path)


if __name__ == "__main__":
    main()
