"""Tokenized text: token sequences of every length in one cache, batched with padding.

    python examples/text_tokens.py                     # 20 000 synthetic documents, 2 workers
    python examples/text_tokens.py --count 500 --workers 1 --keep

Each sample is ``(token_ids, label)``: an int64 tensor whose length is the
document's, and a Python int. Tokenizing is the deterministic, expensive
part worth caching; its output has no fixed shape, so the cache is declared
with ``fields=`` and a ``None`` dimension instead of being inferred from the
first sample, plus a ``max_bytes`` budget for the token ids. The DataLoader
(with workers) pads each batch with ``pad_collate``, which also gives each
sequence's length. The first epoch fills the cache, the second reads only the
file. At the end the cache is removed, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset, Padded, pad_collate

TEXT = (
    "the a of to and in is it that for on with as was at by this be from or are an not have but all they "
    "model data train cache token batch loss layer epoch sample worker file memory node disk page shared"
)
WORDS = TEXT.split()
VOCAB = {word: i + 2 for i, word in enumerate(WORDS)}  # 0: padding, 1: beginning of a document
TOPICS = 4


def document(index: int) -> str:
    """Stands in for reading a document: 5 to 200 words, deterministic per index."""
    rng = np.random.default_rng(index)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(5, 200))))


class Tokenized(Dataset[tuple[torch.Tensor, int]]):
    """Read and tokenize each document: the deterministic part, cached as it is."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        ids = [1] + [VOCAB[word] for word in document(index).split()]
        return torch.tensor(ids, dtype=torch.int64), index % TOPICS


# The leaves of (token_ids, label) are named "0" and "1": token ids of any length, one label.
FIELDS = {"0": Field((None,), "int64"), "1": Field((), "int64")}
# Pad the token ids ("0") in every batch; the labels are stacked as default_collate stacks them.
collate = functools.partial(pad_collate, pad="0", padding_value=0)


def training_step(tokens: Padded) -> int:
    """Stands in for the model: the mask of real tokens (as for attention), built from the lengths."""
    mask = torch.arange(tokens.data.shape[1]) < tokens.lengths[:, None]
    return int(mask.sum())


def epoch(loader: DataLoader[Any]) -> tuple[float, int, float]:
    """Seconds, samples, and the fraction of the padded batches that is padding."""
    start = time.perf_counter()
    samples = real = padded = 0
    for tokens, labels in loader:
        real += training_step(tokens)
        samples += len(labels)
        padded += tokens.data.numel()
    return time.perf_counter() - start, samples, 1 - real / max(padded, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20_000, help="documents in the dataset")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the cache for `mmapcache ls`")
    args = parser.parse_args()

    source = Tokenized(args.count)
    # Room for the token ids: about 104 per document here, 8 bytes each; max_bytes also covers each
    # slot's fixed part. A budget that runs out is not an error: the rest stays uncached.
    ds = CachedDataset(
        source, key=f"text-tokens-example/{args.count}/v1", fields=FIELDS, max_bytes=args.count * 2_000 + 2**20
    )
    print(f"{len(ds)} documents, batch {args.batch_size}, {args.workers} workers; cache {ds.path}")

    def loader(dataset: Dataset[Any]) -> DataLoader[Any]:
        return DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, collate_fn=collate
        )

    try:
        seconds, samples, padding = epoch(loader(source))
        print(f"uncached epoch: {samples} samples in {seconds:.2f} s ({padding:.0%} of the padded batches is padding)")
        cached = loader(ds)
        loaded = 0
        for number in (1, 2):
            seconds, samples, _ = epoch(cached)
            total = ds.stats()["total_misses"]  # counted in the file by every process: the workers here
            what = "fills the cache" if number == 1 else "warm"
            print(
                f"cached epoch {number} ({what}): {samples} samples in {seconds:.2f} s, "
                f"{total - loaded} loaded from the dataset"
            )
            loaded = total
        tokens, labels = next(iter(cached))
        print(
            f"a batch: token ids {tuple(tokens.data.shape)} {tokens.data.dtype} padded with 0, lengths "
            f"{tokens.lengths[:6].tolist()}..., labels {tuple(labels.shape)}"
        )
        # ds.loader() yields the same batches as DataLoader(ds) with the same arguments.
        fast = ds.loader(batch_size=args.batch_size, num_workers=args.workers, collate_fn=collate)
        seconds, samples, _ = epoch(fast)
        print(f"ds.loader() epoch: {samples} samples in {seconds:.2f} s")
        for i in (0, len(ds) - 1):  # what the cache holds is what the dataset gives
            ids, label = ds[i]
            expected, expected_label = source[i]
            assert torch.equal(ids, expected)
            assert int(label) == expected_label
        stats = ds.stats()
        region = ds.cache.variable_region
        used = f", {region.used / 2**20:.1f} of {region.size / 2**20:.1f} MiB for token ids" if region else ""
        print(f"cache: {stats['filled']}/{stats['length']} samples{used}")
    finally:
        ds.close()
        if args.keep:
            print(f"kept the cache: {ds.path} (`mmapcache rm {ds.path}` removes it)")
        elif ds.path.exists():
            mmapcache.remove(ds.path)
            print(f"removed {ds.path}")


if __name__ == "__main__":
    main()
