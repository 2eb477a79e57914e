"""PackedSequences: the plan's build and reopen time, its padding, and a warm epoch of packed batches.

    python benchmarks/bench_packed.py            # 10**6 documents, 10**8 tokens
    python benchmarks/bench_packed.py --quick    # 10**5 documents, 10**7 tokens

Documents are uint16 token ids whose lengths are drawn as bench_tokens draws
them (log-normal around 256, clipped to 8..4096), scaled to the token count
asked for. One CachedDataset is filled once; then, in interleaved rounds:

* the plan built (``PackedSequences`` over the open cache, its plan file
  deleted first) and reopened (the file present) for ``bfd`` and ``concat``;
* a warm epoch of packed batches (``seq_len`` 4096, batch 8, shuffled, no
  workers) through ``PackedSequences.loader()``, against the limit: the same
  token bytes read from a flat ``np.memmap`` of the concatenated tokens into
  the ``(batch, seq_len)`` tensor (one ``np.take``), and that limit plus the
  ``position_ids``/``doc_ids``/``cu_seqlens`` a varlen model needs, computed
  from the documents' offsets (what a flat-file packer does).

Padding is measured at ``seq_len`` 4096 on the bench_tokens distribution
itself (mean ~380 tokens). Ratios are per round against the baseline of the
same round; the load average is recorded.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import bench_parser, machine_info, ratio, run_rounds, spread, table, write_results

from mmapcache import Field
from mmapcache._file.names import plans_of
from mmapcache.torch import CachedDataset, PackedSequences
from mmapcache.torch._packing_plan import make_plan

SEQ_LEN = 4096
BATCH = 8
FIELDS = {"input_ids": Field((None,), "uint16")}


def lengths_of(n: int, tokens: int | None, seed: int = 0) -> np.ndarray[Any, Any]:
    """bench_tokens' document lengths; scaled to ``tokens`` in all when given."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(256), 0.9, n)), 8, 4096).astype(np.int64)
    if tokens is not None:
        lengths = np.maximum(1, np.round(lengths * (tokens / lengths.sum()))).astype(np.int64)
    return lengths


class Rows:
    """Documents as views of one token array."""

    def __init__(self, tokens: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any]) -> None:
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[self.offsets[i] : self.offsets[i + 1]]}


def build(ds: CachedDataset, mode: str) -> float:
    for plan in plans_of(ds.path):
        os.unlink(plan)
    start = time.perf_counter()
    packed = PackedSequences(ds, SEQ_LEN, mode=mode)
    seconds = time.perf_counter() - start
    assert packed.made
    return seconds


def reopen(ds: CachedDataset, mode: str) -> float:
    PackedSequences(ds, SEQ_LEN, mode=mode)  # made if missing
    start = time.perf_counter()
    packed = PackedSequences(ds, SEQ_LEN, mode=mode)
    seconds = time.perf_counter() - start
    assert not packed.made
    return seconds


def packed_epoch(packed: PackedSequences, order: np.ndarray[Any, Any]) -> float:
    start = time.perf_counter()
    for batch in packed.loader(BATCH, sampler=order.tolist()):
        assert batch["input_ids"].shape[1] == SEQ_LEN
    return time.perf_counter() - start


def flat_epoch(flat: np.ndarray[Any, Any], order: np.ndarray[Any, Any]) -> float:
    rows = flat[: len(flat) // SEQ_LEN * SEQ_LEN].reshape(-1, SEQ_LEN)
    count = len(rows)
    start = time.perf_counter()
    for k in range(0, len(order), BATCH):
        idx = np.minimum(order[k : k + BATCH], count - 1)
        out = np.empty((len(idx), SEQ_LEN), np.uint16)
        np.take(rows, idx, axis=0, out=out, mode="clip")
        torch.from_numpy(out)
    return time.perf_counter() - start


def flat_ids_epoch(flat: np.ndarray[Any, Any], edges: np.ndarray[Any, Any], order: np.ndarray[Any, Any]) -> float:
    """The limit plus position_ids, doc_ids and cu_seqlens from the documents' offsets (concat packing)."""
    rows = flat[: len(flat) // SEQ_LEN * SEQ_LEN].reshape(-1, SEQ_LEN)
    count = len(rows)
    start = time.perf_counter()
    for k in range(0, len(order), BATCH):
        idx = np.minimum(order[k : k + BATCH], count - 1)
        out = np.empty((len(idx), SEQ_LEN), np.uint16)
        np.take(rows, idx, axis=0, out=out, mode="clip")
        positions = (idx[:, None] * SEQ_LEN + np.arange(SEQ_LEN)).reshape(-1)
        docs = np.searchsorted(edges, positions, side="right") - 1
        starts = np.maximum(edges[docs], np.repeat(idx * SEQ_LEN, SEQ_LEN))
        position_ids = positions - starts
        cu = np.flatnonzero(position_ids == 0)
        cu_seqlens = np.append(cu, len(positions)).astype(np.int32)
        torch.from_numpy(out), torch.from_numpy(position_ids), torch.from_numpy(docs), torch.from_numpy(cu_seqlens)
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    parser = bench_parser(__doc__ or "", quick="10**5 documents, 10**7 tokens, 2 rounds", rounds=(5, 2))
    parser.add_argument("--documents", type=int, help="documents (default 10**6, quick 10**5)")
    parser.add_argument("--tokens", type=int, help="tokens in all (default 10**8, quick 10**7)")
    args = parser.parse_args()
    n = args.documents or (10**5 if args.quick else 10**6)
    total = args.tokens or (10**7 if args.quick else 10**8)
    rounds = args.rounds or (2 if args.quick else 5)
    lengths = lengths_of(n, total)
    edges = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=edges[1:])
    tokens = np.random.default_rng(1).integers(1, 50_000, int(edges[-1]), dtype=np.uint16)
    print(f"{n} documents, {len(tokens)} tokens (mean {len(tokens) / n:.0f}), load {os.getloadavg()[0]:.1f}")
    work = Path(tempfile.mkdtemp(prefix="bench-packed-", dir=args.dir))
    try:
        budget = int(1.05 * (tokens.nbytes + 40 * n)) + 2**20
        ds = CachedDataset(
            Rows(tokens, edges), work / "docs.mmc", key="bench/packed", fields=FIELDS, max_bytes=budget, check=0
        )
        start = time.perf_counter()
        ds.fill(batch_size=4096, progress=False)
        fill_seconds = time.perf_counter() - start
        flat = np.memmap(work / "tokens.u16", np.uint16, "w+", shape=tokens.shape)
        flat[:] = tokens
        flat.flush()
        flat = np.memmap(work / "tokens.u16", np.uint16, "r", shape=tokens.shape)
        plan_times = run_rounds(
            {
                "build bfd": lambda r: build(ds, "bfd"),
                "build concat": lambda r: build(ds, "concat"),
                "reopen bfd": lambda r: reopen(ds, "bfd"),
                "reopen concat": lambda r: reopen(ds, "concat"),
            },
            rounds=rounds,
        )
        packed = {mode: PackedSequences(ds, SEQ_LEN, mode=mode) for mode in ("bfd", "concat")}
        orders = {mode: np.random.default_rng(2).permutation(len(p)) for mode, p in packed.items()}
        epoch_times = run_rounds(
            {
                "limit: flat memmap": lambda r: flat_epoch(flat, orders["concat"]),
                "flat memmap + ids": lambda r: flat_ids_epoch(flat, edges, orders["concat"]),
                "PackedSequences concat": lambda r: packed_epoch(packed["concat"], orders["concat"]),
                "PackedSequences bfd": lambda r: packed_epoch(packed["bfd"], orders["bfd"]),
            },
            rounds=rounds,
        )
        # Padding on bench_tokens' own distribution (no scaling).
        natural = lengths_of(n, None)
        padding = {}
        for mode in ("bfd", "concat"):
            plan = make_plan(natural, SEQ_LEN, mode, "split")
            padding[mode] = plan.padding / (len(plan) * SEQ_LEN)
        bfd_scaled = packed["bfd"].padding
        ds.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    baseline = "limit: flat memmap"
    rows = [[name, f"{min(ts) * 1e3:.1f} ms", f"{np.median(ts) * 1e3:.1f} ms"] for name, ts in plan_times.items()]
    print(table(["plan", "min", "median"], rows))
    rows = [
        [name, f"{np.median(ts):.3f} s", f"{ratio(epoch_times, baseline, name):.2f}"]
        for name, ts in epoch_times.items()
    ]
    print(table(["warm epoch", "median", "speed vs limit"], rows))
    print(
        f"padding at seq_len {SEQ_LEN}: bfd {padding['bfd']:.4%}, concat {padding['concat']:.4%} (bench_tokens lengths)"
    )
    print(f"fill {fill_seconds:.1f} s; load {os.getloadavg()[0]:.1f}")
    payload = {
        "documents": n,
        "tokens": len(tokens),
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "fill_seconds": fill_seconds,
        "plan_seconds": {name: spread(ts) for name, ts in plan_times.items()},
        "epoch_seconds": {name: spread(ts) for name, ts in epoch_times.items()},
        "epoch_speed_vs_limit": {name: ratio(epoch_times, baseline, name) for name in epoch_times},
        "padding_bench_tokens_lengths": padding,
        "padding_bfd_scaled_lengths": bfd_scaled,
        "machine": machine_info(),
    }
    print(write_results("bench_packed", payload, quick=args.quick))


if __name__ == "__main__":
    main()
