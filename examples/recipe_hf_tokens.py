"""A Hugging Face tokenized dataset through CachedDataset: token ids stored as uint16, batches padded or packed.

    python examples/recipe_hf_tokens.py                  # 20 000 documents, built and tokenized locally
    python examples/recipe_hf_tokens.py --count 500 --workers 1

The text is a ``datasets.Dataset`` made here, and the tokenizer a
``tokenizers`` BPE model trained on it (no download). ``.map()`` adds an
``input_ids`` column; ``with_format("torch")`` hands each row's ids back as an
int64 tensor. A vocabulary of at most 65 536 tokens fits ``uint16``: the field
is declared ``Field((None,), "uint16")`` and the int64 ids are converted when
stored (exactly: an id that does not fit raises a ``ValueError``), a quarter
of int64's memory.

The byte budget follows the sizing rule: the token bytes (2 per token) plus
the fixed part of each slot (``SLOT_BYTES``), with 5 % headroom, counted from
the Arrow column without decoding a row. The first epoch fills the cache in
DataLoader workers; the next ones read the file: ``ragged="pad"`` gives a
padded batch and the lengths, ``ragged="packed"`` the ids end to end with
``cu_seqlens`` (what varlen attention kernels take). The cache is removed at
the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset, Packed, Padded

TEXT = (
    "the a of to and in is it that for on with as was at by this be from or are an not have but all they "
    "model data train cache token batch loss layer epoch sample worker file memory node disk page shared "
    "attention gradient optimizer learning rate schedule checkpoint tokenizer vocabulary sequence padding"
)
WORDS = TEXT.split()
# Per slot: its 8-byte record, the 16-byte descriptor of the variable field, the 8-byte int64 label.
SLOT_BYTES = 8 + 16 + 8
HEADROOM = 1.05


def corpus(count: int) -> datasets.Dataset:
    """Stands in for load_dataset(...): ``count`` documents of 5 to 400 words and a label."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 400, size=count)
    text = [" ".join(rng.choice(WORDS, size=int(n))) for n in lengths]
    return datasets.Dataset.from_dict({"text": text, "label": [i % 4 for i in range(count)]})


def train_tokenizer(table: datasets.Dataset, vocab_size: int) -> Tokenizer:
    """A BPE tokenizer trained on the table's own text: no hub download."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"], show_progress=False)
    tokenizer.train_from_iterator((row["text"] for row in table), trainer=trainer)
    return tokenizer


def budget(table: datasets.Dataset, itemsize: int) -> int:
    """The sizing rule: token bytes plus the fixed part of every slot, with headroom; read from Arrow's lengths."""
    tokens = pc.sum(pc.list_value_length(table.data.column("input_ids"))).as_py()
    return int(HEADROOM * (tokens * itemsize + SLOT_BYTES * len(table)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--vocab", type=int, default=8_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    scratch = Path(tempfile.mkdtemp())
    try:
        table = corpus(args.count)
        tokenizer = train_tokenizer(table, args.vocab)
        assert tokenizer.get_vocab_size() <= 2**16, "a larger vocabulary needs int32 ids"

        def tokenize(batch: dict[str, Any]) -> dict[str, Any]:
            return {"input_ids": [e.ids for e in tokenizer.encode_batch(batch["text"])]}

        tokenized = table.map(tokenize, batched=True, remove_columns=["text"])
        # As a real dataset comes back from load_from_disk: rows in memory-mapped Arrow files.
        tokenized.save_to_disk(scratch / "tokenized")
        tokenized = datasets.load_from_disk(str(scratch / "tokenized"))
        rows = tokenized.with_format("torch")  # input_ids: int64 tensors of each document's length

        ds = CachedDataset(
            rows,
            key=f"recipes/hf-tokens/bpe{args.vocab}/v1",
            fields={"input_ids": Field((None,), "uint16"), "label": Field((), "int64")},
            max_bytes=budget(tokenized, itemsize=2),
        )
        times = {}
        for ragged in ("pad", "pad", "packed"):
            start = time.perf_counter()
            loader = ds.loader(
                batch_size=args.batch_size, shuffle=True, num_workers=args.workers, ragged=ragged, padding_value=0
            )
            seen = 0
            for batch in loader:
                ids, labels = batch["input_ids"], batch["label"]
                if ragged == "pad":
                    assert isinstance(ids, Padded)
                    mask = torch.arange(ids.data.shape[1]) < ids.lengths[:, None]  # the attention mask
                    assert ids.data.dtype == torch.uint16
                    assert int(mask.sum()) == int(ids.lengths.sum())
                else:
                    assert isinstance(ids, Packed)
                    assert ids.values.shape[0] == int(ids.cu_seqlens[-1])
                seen += len(labels)
            assert seen == args.count
            times[ragged if ragged not in times else "pad, warm"] = round(time.perf_counter() - start, 3)
        first = rows[0]["input_ids"]
        assert torch.equal(ds[0]["input_ids"].long(), first), "the ids are the tokenizer's, exactly"
        stats = ds.stats()
        file_bytes = ds.path.stat().st_size
        payload = 2 * sum(len(r) for r in tokenized["input_ids"])
        ds.close()
        mmapcache.remove(ds.path)
        print(
            json.dumps(
                {
                    "documents": args.count,
                    "vocabulary": tokenizer.get_vocab_size(),
                    "filled": stats["filled"],
                    "file / token bytes": round(file_bytes / payload, 3),
                    "seconds": times,
                }
            )
        )
        assert stats["filled"] == args.count, "the sizing rule leaves room for every document"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
