"""A Hugging Face tokenized corpus to packed batches for a varlen-attention model, planned once.

    python examples/recipe_packed.py                    # 5 000 documents, sequences of 512 tokens
    python examples/recipe_packed.py --count 400 --seq-len 128

The corpus is a ``datasets.Dataset`` made here and tokenized by a
``tokenizers`` BPE model trained on it (no download), saved and reloaded as
``load_from_disk`` gives it. ``CachedDataset`` keeps the ids as ``uint16``;
``PackedSequences`` packs them best-fit decreasing into sequences of
``--seq-len`` tokens (the plan is made once, from the lengths the file
records, and kept beside the cache: the second ``PackedSequences`` reopens
it). Each batch has ``input_ids``, ``position_ids``, ``doc_ids`` and the
batch's ``cu_seqlens``/``max_seqlen``; the model here attends within
documents only, with a block-diagonal causal mask drawn from ``cu_seqlens``
(a varlen kernel such as flash-attention's ``flash_attn_varlen_func`` takes
``cu_seqlens`` and ``max_seqlen`` as they are). One epoch is checkpointed
after two batches with ``stateful=True`` and resumed: the resumed loader
yields exactly the batches that were left. The cache and its plan are
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import mmapcache
from mmapcache import Field
from mmapcache.torch import CachedDataset, PackedSequences

TEXT = (
    "the a of to and in is it that for on with as was at by this be from or are an not have but all they "
    "model data train cache token batch loss layer epoch sample worker file memory node disk page shared "
    "attention gradient optimizer learning rate schedule checkpoint tokenizer vocabulary sequence padding"
)
WORDS = TEXT.split()


def corpus(count: int) -> datasets.Dataset:
    """Stands in for load_dataset(...): ``count`` documents of log-normal length."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(60), 0.9, count), 3, 2000).astype(int)
    return datasets.Dataset.from_dict({"text": [" ".join(rng.choice(WORDS, size=int(n))) for n in lengths]})


def train_tokenizer(table: datasets.Dataset, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"], show_progress=False)
    tokenizer.train_from_iterator((row["text"] for row in table), trainer=trainer)
    return tokenizer


class TinyVarlenLM(torch.nn.Module):
    """One attention layer whose attention stays within each fragment that ``cu_seqlens`` delimits."""

    def __init__(self, vocab: int, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(4096, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = (self.embed(input_ids) + self.position(position_ids)).reshape(1, -1, self.embed.embedding_dim)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = varlen_mask(cu_seqlens, x.shape[1])
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y).reshape(*input_ids.shape, -1)


def varlen_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The causal block-diagonal mask of the fragments ``cu_seqlens`` delimits (what a varlen kernel computes)."""
    fragment = torch.bucketize(torch.arange(total), cu_seqlens[1:].long(), right=True)
    return (fragment[:, None] == fragment[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()


def train_step(model: TinyVarlenLM, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> float:
    ids = batch["input_ids"].long()
    logits = model(ids, batch["position_ids"], batch["cu_seqlens"])
    # Predict the next token within a document: no target across a fragment's end or on padding.
    same = (batch["doc_ids"][:, 1:] == batch["doc_ids"][:, :-1]) & (batch["doc_ids"][:, 1:] >= 0)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][same], ids[:, 1:][same])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=5_000)
    parser.add_argument("--vocab", type=int, default=2_000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    scratch = Path(tempfile.mkdtemp())
    try:
        table = corpus(args.count)
        tokenizer = train_tokenizer(table, args.vocab)
        tokenized = table.map(
            lambda batch: {"input_ids": [e.ids for e in tokenizer.encode_batch(batch["text"])]},
            batched=True,
            remove_columns=["text"],
        )
        tokenized.save_to_disk(scratch / "tokenized")
        tokenized = datasets.load_from_disk(str(scratch / "tokenized"))
        tokens = pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py()
        docs = CachedDataset(
            tokenized.with_format("torch"),
            key=f"recipes/packed/bpe{args.vocab}/v1",
            fields={"input_ids": Field((None,), "uint16")},
            # The token bytes, 24 bytes a slot (its record, the ids' descriptor), up to 16 of alignment a
            # value, headroom, and 1 MiB for the extents writers claim.
            max_bytes=int(1.2 * (2 * tokens + 40 * len(tokenized))) + 2**20,
        )
        packed = PackedSequences(docs, args.seq_len, mode="bfd")  # loads the documents, then plans
        again = PackedSequences(docs, args.seq_len, mode="bfd")  # the plan file reopened: nothing recomputed
        assert packed.made
        assert not again.made

        model = TinyVarlenLM(tokenizer.get_vocab_size())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        order = torch.Generator().manual_seed(1)
        loader = packed.loader(args.batch_size, shuffle=True, generator=order, stateful=True)
        losses, seen, state = [], [], None
        for step, batch in enumerate(loader, start=1):
            losses.append(train_step(model, optimizer, batch))
            seen.append(batch["input_ids"])
            if step == 2:
                state = loader.state_dict()  # a checkpoint mid-epoch
        resumed = packed.loader(
            args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1), stateful=True
        )
        resumed.load_state_dict(state)
        rest = [batch["input_ids"] for batch in resumed]
        assert all(torch.equal(a, b) for a, b in zip(seen[2:], rest, strict=True)), "the resumed epoch differs"

        everything = packed.batch(range(len(packed)))
        first = next(iter(packed.loader(args.batch_size)))
        mask = varlen_mask(first["cu_seqlens"], first["input_ids"].numel())
        docs_ids = first["doc_ids"].reshape(-1)
        leaks = int((mask & (docs_ids[:, None] != docs_ids[None, :])).sum())
        summary = {
            "documents": len(docs),
            "tokens": tokens,
            "sequences": len(packed),
            "padding below 2%": packed.padding < 0.02,
            "every token once": int((everything["doc_ids"] >= 0).sum()) == tokens,
            "attention across documents": leaks,
            "resumed batches": len(rest),
            "loss finite": bool(np.isfinite(losses).all()),
        }
        docs.close()
        mmapcache.remove(docs.path)  # its packing plans go with it
        print(json.dumps(summary))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
