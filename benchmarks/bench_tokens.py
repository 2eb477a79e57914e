"""Warm epochs over tokenized documents: ``loader(ragged="pad")`` against Hugging Face Arrow, LitData and a flat memmap.

    python benchmarks/bench_tokens.py                   # 20 000 documents, 5 rounds (about 8 min)
    python benchmarks/bench_tokens.py --quick           # 2 000 documents, 2 rounds

The documents: uint16 token ids (vocabulary 8 000) whose lengths are
log-normal (median 256, sigma 0.9, clipped to 8..4096), and an int64 label.
Every variant reads one epoch in the same shuffled order, batch 64, in this
process (``num_workers=0``: the CPU cost of the read path, not the machine's
spare cores; torch's intra-op threads set to 1 everywhere, as an
oversubscribed OpenMP pool stalled torch.stack for seconds on the loaded
2-core machine), and hands the training loop the same batch: the ids padded
with 0 to the batch's longest document, the lengths and the labels.

* **mmapcache**: ``CachedDataset(...).loader(batch_size=64, sampler=order,
  ragged="pad")`` over a filled cache of ``Field((None,), "uint16")`` ids;
  ``ragged="packed"`` beside it.
* **HF Arrow**: the same rows in a ``datasets.Dataset`` saved and reloaded
  (memory-mapped Arrow, ``Sequence(Value("uint16"))``),
  ``with_format("torch")``, through ``DataLoader(..., collate_fn=pad_collate)``.
* **limit**: every token in one flat ``np.memmap`` plus an offsets array, a
  batch gathered with numpy straight into the padded array (no DataLoader, no
  per-document object): what a batch of this layout costs at least.
* **LitData**: ``litdata.optimize`` writes the same documents into chunks,
  and ``StreamingDataset`` + ``StreamingDataLoader`` (shuffle, batch 64, the
  same padding) reads a warm epoch, in its own venv (``--litdata-python``,
  default ``/work/venv-litdata/bin/python``: it pulls a torch build of its
  own), as a subprocess that times its epochs and prints them; it runs once
  per round, between the in-process variants.

Ratios are medians over rounds of per-round ratios (time of the other / time
of mmapcache). Memory: the cache file's real size against the payload (2
bytes a token, 8 a label) plus the per-slot records, for a cache whose
``max_bytes`` follows the recipe's sizing rule (1.05 x token bytes and slots).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_parser, machine_info, spread, table, write_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402 - after the path of this checkout
from torch.utils.data import DataLoader  # noqa: E402

from mmapcache import Field  # noqa: E402
from mmapcache._format.spec import slot_nbytes  # noqa: E402
from mmapcache.torch import CachedDataset, pad_collate  # noqa: E402

BATCH = 64
VOCAB = 8_000
FIELDS = {"input_ids": Field((None,), "uint16"), "label": Field((), "int64")}
LITDATA_PYTHON = Path("/work/venv-litdata/bin/python")


def documents(n: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(flat uint16 tokens, int64 offsets (n + 1), int64 labels)``, deterministic."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(math.log(256), 0.9, n)), 8, 4096).astype(np.int64)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.uint16)
    return tokens, offsets, rng.integers(0, 4, n).astype(np.int64)


class Rows(torch.utils.data.Dataset[Any]):
    """The documents as a tokenizer's output: int64 ids (as Hugging Face gives them) and a label."""

    def __init__(self, tokens: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]):
        self.tokens, self.offsets, self.labels = tokens, offsets, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.from_numpy(self.tokens[self.offsets[i] : self.offsets[i + 1]].astype(np.int64))
        return {"input_ids": ids, "label": int(self.labels[i])}


def limit_epoch(
    flat: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], order: list[int]
) -> int:
    """One epoch over a flat memmap: per batch, one numpy gather straight into the padded array."""
    total = 0
    for start in range(0, len(order), BATCH):
        idx = np.asarray(order[start : start + BATCH])
        begins, lengths = offsets[idx], offsets[idx + 1] - offsets[idx]
        longest = int(lengths.max())
        filled = np.arange(longest) < lengths[:, None]
        cut = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lengths, out=cut[1:])
        positions = np.arange(cut[-1]) + np.repeat(begins - cut[:-1], lengths)
        padded = np.zeros((len(idx), longest), np.uint16)
        padded[filled] = flat[positions]
        batch = (torch.from_numpy(padded), torch.from_numpy(lengths), torch.from_numpy(labels[idx]))
        total += batch[0].shape[0]
    return total


def loader_epoch(loader: Any) -> int:
    total = 0
    for batch in loader:
        total += len(batch["label"])
    return total


LITDATA_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, torch
    torch.set_num_threads(1)
    from litdata import StreamingDataLoader, StreamingDataset, optimize

    folder, data, epochs, batch, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    arrays = np.load(data)
    tokens, offsets, labels = arrays["tokens"], arrays["offsets"], arrays["labels"]


    def document(i):
        return {"input_ids": tokens[offsets[i]:offsets[i + 1]], "label": int(labels[i])}


    def collate(samples):  # the same padding as pad_collate: ids padded with 0, their lengths, the labels
        ids = [torch.from_numpy(np.asarray(s["input_ids"])) for s in samples]
        lengths = torch.tensor([len(t) for t in ids])
        padded = torch.zeros(len(ids), int(lengths.max()), dtype=ids[0].dtype)
        filled = torch.arange(padded.shape[1]) < lengths[:, None]
        padded.view(torch.int16)[filled] = torch.cat(ids).view(torch.int16)
        return {"input_ids": (padded, lengths), "label": torch.tensor([s["label"] for s in samples])}


    if __name__ == "__main__":
        if step == "optimize":
            optimize(fn=document, inputs=list(range(len(labels))), output_dir=folder, chunk_bytes="64MB", num_workers=1)
            print(json.dumps({"optimized": True}))
            sys.exit(0)
        ds = StreamingDataset(folder, shuffle=True)
        loader = StreamingDataLoader(ds, batch_size=batch, num_workers=0, collate_fn=collate)
        times = []
        for _ in range(epochs + 1):  # the first epoch warms up
            start = time.perf_counter()
            seen = sum(len(b["label"]) for b in loader)
            times.append(time.perf_counter() - start)
            assert seen == len(labels), seen
        print(json.dumps({"seconds": times[1:]}))
    """
)


def litdata(python: Path, folder: Path, data: Path, epochs: int, step: str) -> dict[str, Any] | None:
    """Run the LitData side in its venv (a script file: its optimize workers import it); its JSON, or None."""
    script = folder.parent / "litdata_child.py"
    script.write_text(LITDATA_CHILD)
    run = subprocess.run(
        [str(python), str(script), str(folder), str(data), str(epochs), str(BATCH), step],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if run.returncode != 0:
        print(f"litdata failed ({step}):\n{run.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    torch.set_num_threads(1)
    parser = bench_parser(__doc__ or "", quick="2 000 documents, 2 rounds", rounds=(5, 2))
    parser.add_argument("--n", type=int, help="documents (default 20 000, quick 2 000)")
    parser.add_argument("--litdata-python", type=Path, default=LITDATA_PYTHON, help="python of a venv with litdata")
    args = parser.parse_args()
    n = args.n or (2_000 if args.quick else 20_000)
    rounds = args.rounds or (2 if args.quick else 5)
    tokens, offsets, labels = documents(n)
    payload = tokens.nbytes + labels.nbytes
    print(f"{n} documents, {len(tokens)} tokens (mean {len(tokens) / n:.0f}), {payload / 2**20:.1f} MiB payload")

    work = Path(tempfile.mkdtemp(prefix="bench-tokens-", dir=args.dir))
    import datasets

    datasets.disable_progress_bars()
    try:
        # mmapcache: the recipe's sizing rule, filled once.
        slots = slot_nbytes(FIELDS)
        budget = int(1.05 * (tokens.nbytes + slots * n))
        ds = CachedDataset(
            Rows(tokens, offsets, labels),
            work / "tokens.mmc",
            key="bench/tokens",
            fields=FIELDS,
            max_bytes=budget,
            check=0,
        )
        ds.fill(progress=False)
        stats = ds.stats()
        file_bytes = os.stat(ds.path).st_size
        records = n * slots
        memory = {
            "max_bytes": budget,
            "file_bytes": file_bytes,
            "payload_bytes": tokens.nbytes,
            "slot_record_bytes": records,
            "file_vs_payload_and_records": file_bytes / (tokens.nbytes + records),
            "filled": stats["filled"],
            "documents": n,
        }
        # HF: the same rows, saved and reloaded (memory-mapped Arrow).
        features = datasets.Features(
            {"input_ids": datasets.Sequence(datasets.Value("uint16")), "label": datasets.Value("int64")}
        )
        arrow = datasets.Dataset.from_dict(
            {"input_ids": [tokens[offsets[i] : offsets[i + 1]] for i in range(n)], "label": labels},
            features=features,
        )
        arrow.save_to_disk(str(work / "hf"))
        del arrow
        hf = datasets.load_from_disk(str(work / "hf")).with_format("torch")
        # The limit: one flat file of tokens and the offsets.
        flat = np.memmap(work / "tokens.u16", np.uint16, "w+", shape=tokens.shape)
        flat[:] = tokens
        flat.flush()
        flat = np.memmap(work / "tokens.u16", np.uint16, "r", shape=tokens.shape)
        # LitData: chunks written once.
        np.savez(work / "documents.npz", tokens=tokens, offsets=offsets, labels=labels)
        lit_python = args.litdata_python if args.litdata_python.exists() else None
        lit_folder = work / "litdata"
        if lit_python is not None and litdata(lit_python, lit_folder, work / "documents.npz", 0, "optimize") is None:
            lit_python = None

        pad = functools.partial(pad_collate, pad="input_ids")
        variants = {
            "mmapcache loader(ragged='pad')": lambda order: loader_epoch(ds.loader(batch_size=BATCH, sampler=order)),
            "mmapcache loader(ragged='packed')": lambda order: loader_epoch(
                ds.loader(batch_size=BATCH, sampler=order, ragged="packed")
            ),
            "HF Arrow + pad_collate": lambda order: loader_epoch(
                DataLoader(hf, batch_size=BATCH, sampler=order, collate_fn=pad)
            ),
            "limit: flat memmap + numpy": lambda order: limit_epoch(flat, offsets, labels, order),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        times["LitData StreamingDataset"] = []
        for r in range(-1, rounds):
            order = np.random.default_rng(100 + r).permutation(n).tolist()
            names = list(variants)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                gc.collect()
                gc.disable()
                start = time.perf_counter()
                seen = variants[name](order)
                elapsed = time.perf_counter() - start
                gc.enable()
                assert seen == n, (name, seen)
                if r >= 0:
                    times[name].append(elapsed)
            if r >= 0 and lit_python is not None:
                lit = litdata(lit_python, lit_folder, work / "documents.npz", 1, "read")
                if lit is not None:
                    times["LitData StreamingDataset"].append(lit["seconds"][0])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v and r >= 0), flush=True)
        ds.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ours = "mmapcache loader(ragged='pad')"
    ratios: dict[str, Any] = {}
    for name, ts in times.items():
        if name == ours or not ts:
            continue
        per_round = [t / o for t, o in zip(ts, times[ours], strict=False)]
        ratios[name] = {"speed_of_mmapcache_vs_it": spread(per_round), "per_round": per_round}
    targets = {
        "HF Arrow + pad_collate": 3.0,
        "LitData StreamingDataset": 1.5,
        "limit: flat memmap + numpy": 0.7,
    }
    rows = []
    for name, ts in times.items():
        if not ts:
            rows.append([name, "not run", "", "", ""])
            continue
        median = sorted(ts)[len(ts) // 2]
        ratio = ratios.get(name, {}).get("speed_of_mmapcache_vs_it", {}).get("median")
        target = targets.get(name)
        rows.append(
            [
                name,
                f"{median * 1e3:.0f} ms",
                "1" if name == ours else f"{ratio:.2f}x",
                f">= {target}x" if target else "",
                "" if target is None or ratio is None else ("yes" if ratio >= target else "no"),
            ]
        )
    print(table(["variant", "warm epoch (median)", "mmapcache speed vs it", "target", "met"], rows))
    print(
        f"memory: file {memory['file_bytes'] / 2**20:.2f} MiB = {memory['file_vs_payload_and_records']:.3f}x "
        f"(uint16 tokens + {slots} B records a slot); filled {memory['filled']} of {n}"
    )
    path = write_results(
        "bench_tokens",
        {
            "machine": machine_info(),
            "n": n,
            "tokens": len(tokens),
            "batch": BATCH,
            "rounds": rounds,
            "seconds": times,
            "ratios": ratios,
            "targets": targets,
            "memory": memory,
            "litdata": "run" if times["LitData StreamingDataset"] else "not installed or failed",
        },
        quick=args.quick,
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
