"""Streams: CachedStream's first epoch against plain streaming, its later epochs against re-streaming and LitData.

Three streams over the same local data, each iterated element by element in
one process (``num_workers=0``, where every cost shows):

* **json** — Hugging Face ``datasets`` streaming over JSONL files (a text and
  a label per row): the cheapest stream, where the cache's own cost per
  element shows most;
* **tokens** — the same stream with a ``tokenizers`` BPE tokenizer mapped over
  it (int32 token ids of varying length, the kind of stream worth caching);
* **images** — WebDataset tar shards of 192 x 192 JPEGs decoded to uint8 tensors.

Per stream, in interleaved rounds: iterating the stream (``plain``);
iterating a ``CachedStream`` over it into a new file (``fill``, the first
epoch: target <= 1.05x ``plain``); iterating a ``CachedStream`` whose file is
complete (``cached``, a later epoch: every element from the file, in a fresh
permutation). And the first epoch as a training loop sees it: the stream and
the ``CachedStream`` each through a ``DataLoader`` (``num_workers=0``, batches
of 64, ``default_collate``; ``pad_collate`` for the token ids), ``plain
loader`` and ``fill loader``. Figures are medians over rounds of per-round
ratios.

LitData (``litdata.optimize`` then ``StreamingDataset``) runs in its own
virtual environment (it depends on torchvision, which must not replace this
environment's torch): ``--litdata-python PATH``, by default
``benchmarks/.venv-litdata/bin/python`` when it exists. It
converts the token stream's elements offline, then its two epochs are timed
in that process, beside ours in the same run.

``python benchmarks/bench_stream.py [--quick] [--litdata-python PATH]``.
Results go to ``benchmarks/results/bench_stream[-quick].json``.
"""

from __future__ import annotations

import functools
import json
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from _common import HERE, bench_parser, machine_info, ratio, run_rounds, table, write_results

from mmapcache import Field
from mmapcache.torch import CachedStream

# Made by hand (it is not set up by run.py): python -m venv benchmarks/.venv-litdata &&
# benchmarks/.venv-litdata/bin/pip install torch==<this interpreter's torch version> litdata
LITDATA_PYTHON = HERE / ".venv-litdata" / "bin" / "python"


def _words(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]


def _photo(rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """A 192 x 192 RGB image with smooth gradients and some noise (JPEG-compresses like a photo)."""
    y, x = np.mgrid[0:192, 0:192]
    base = np.stack([x, y, (x + y) // 2], axis=-1) + rng.integers(0, 40, (1, 1, 3))
    return np.clip(base + rng.normal(0, 8, (192, 192, 3)), 0, 255).astype(np.uint8)


def make_data(root: Path, n: int, images: int) -> dict[str, Any]:
    """JSONL files (two shards), a BPE tokenizer trained on them, WebDataset shards of JPEGs."""
    import io

    import webdataset as wds
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = _words(rng)
    rows = [
        {"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 160))), "label": i % 10} for i in range(n)
    ]
    files = []
    for k in range(2):
        path = root / f"rows-{k}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows[k::2]))
        files.append(str(path))
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=["[UNK]"])  # type: ignore[call-arg]
    tokenizer.train_from_iterator([row["text"] for row in rows[:1000]], trainer, length=1000)
    shards = []
    pixels = np.random.default_rng(0)
    for k in range(2):
        shard = str(root / f"images-{k}.tar")
        with wds.TarWriter(shard) as writer:
            for i in range(k, images, 2):
                buffer = io.BytesIO()
                array = _photo(pixels)
                Image.fromarray(array).save(buffer, format="JPEG", quality=90)
                writer.write({"__key__": f"{i:07d}", "jpg": buffer.getvalue(), "cls": i % 10})
        shards.append(shard)
    return {"files": files, "tokenizer": tokenizer, "shards": shards, "rows": rows, "images": images}


class _Tokenize:
    """The token stream's map: a class, so that the stream pickles (spawned DataLoader workers)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": np.asarray(self.tokenizer.encode(row["text"]).ids, np.int32)}


def streams(data: dict[str, Any]) -> dict[str, tuple[Callable[[], Iterable[Any]], dict[str, Any]]]:
    """Each stream's maker and the CachedStream arguments it needs."""
    import datasets
    import webdataset as wds

    tokenizer = data["tokenizer"]

    def json_stream() -> Iterable[Any]:
        return datasets.load_dataset("json", data_files=data["files"], split="train", streaming=True)

    def tokens_stream() -> Iterable[Any]:
        return json_stream().map(_Tokenize(tokenizer), remove_columns=["text"])  # type: ignore[attr-defined,no-any-return]

    def images_stream() -> Iterable[Any]:
        return wds.WebDataset(data["shards"], shardshuffle=False).decode("torchrgb8").to_tuple("jpg", "cls")

    tokens_fields = {"label": Field((), "int64"), "input_ids": Field((None,), "int32")}
    # Budgets of about 1.5x what the elements take, as a user sizes them: the file is preallocated in epoch 1.
    rows, images = len(data["rows"]), data["images"]
    return {
        "json": (json_stream, {"max_bytes": rows * 1536}),
        "tokens": (tokens_stream, {"fields": tokens_fields, "max_bytes": rows * 2048}),
        "images": (images_stream, {"max_bytes": images * 150 * 1024}),
    }


def collate_fn(name: str) -> Callable[[list[Any]], Any]:
    """How a training loop batches the stream ``name``: token ids of varying length are padded."""
    from torch.utils.data import default_collate

    from mmapcache.torch import pad_collate

    if name == "tokens":
        return functools.partial(pad_collate, pad="input_ids")
    return default_collate  # type: ignore[no-any-return]


def _drain_loader(iterable: Iterable[Any], *, collate: Callable[[list[Any]], Any]) -> tuple[float, int]:
    from torch.utils.data import DataLoader

    start = time.perf_counter()
    count = 0
    for batch in DataLoader(iterable, batch_size=64, num_workers=0, collate_fn=collate):  # type: ignore[arg-type]
        count += len(batch[1] if isinstance(batch, (list, tuple)) else batch["label"])
    return time.perf_counter() - start, count


def _drain(iterable: Iterable[Any]) -> tuple[float, int]:
    start = time.perf_counter()
    count = 0
    for _ in iterable:
        count += 1
    return time.perf_counter() - start, count


Drain = Callable[[Iterable[Any]], tuple[float, int]]


def variants(
    name: str, make: Callable[[], Iterable[Any]], options: dict[str, Any], root: Path, complete: CachedStream,
    counts: dict[str, int],
) -> dict[str, Callable[[int], float]]:  # fmt: skip
    """The timed variants of one stream: each returns its seconds and records how many elements it saw."""
    collate = collate_fn(name)
    loader: Drain = functools.partial(_drain_loader, collate=collate)

    def plain(label: str, drain: Drain) -> Callable[[int], float]:
        def run(r: int) -> float:
            seconds, counts[label] = drain(make())
            return seconds

        return run

    def fill(label: str, drain: Drain) -> Callable[[int], float]:
        def run(r: int) -> float:
            path = root / f"{name}-{label.replace(' ', '-')}-round{r}.mmc"
            ds = CachedStream(make(), path, key=f"bench/{name}/{label}/{r}", **options)
            seconds, counts[label] = drain(ds)
            ds.close()
            path.unlink()
            return seconds

        return run

    def cached(r: int) -> float:
        complete.set_epoch(r + 1)
        seconds, counts["cached"] = _drain(complete)
        return seconds

    return {
        "plain": plain("plain", _drain),
        "fill": fill("fill", _drain),
        "cached": cached,
        "plain loader": plain("plain loader", loader),
        "fill loader": fill("fill loader", loader),
    }


def measure(data: dict[str, Any], root: Path, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (make, options) in streams(data).items():
        complete = CachedStream(make(), root / f"{name}-complete.mmc", key=f"bench/{name}", **options)
        _drain(complete)  # fill it once, outside the timing
        counts: dict[str, int] = {}  # elements each variant saw (all must agree)
        times = run_rounds(variants(name, make, options, root, complete, counts), rounds=rounds)
        assert len(set(counts.values())) == 1, counts
        n = counts["plain"]
        out[name] = {
            "elements": n,
            "us_per_element": {k: statistics.median(v) / n * 1e6 for k, v in times.items()},
            "fill_over_plain": ratio(times, "fill", "plain"),
            "fill_loader_over_plain_loader": ratio(times, "fill loader", "plain loader"),
            "plain_over_cached": ratio(times, "plain", "cached"),
            "times": times,
        }
        complete.close()
    return out


class _Listed:
    """Samples in a list, as a map-style dataset (CachedDataset's side of the loader comparison)."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


def _drain_batches(loader: Iterable[Any]) -> tuple[float, int]:
    start = time.perf_counter()
    count = 0
    for batch in loader:
        count += len(batch[1] if isinstance(batch, (list, tuple)) else batch["label"])
    return time.perf_counter() - start, count


def measure_loaders(data: dict[str, Any], root: Path, rounds: int) -> dict[str, Any]:
    """A complete stream's later epoch in batches of 64: ``CachedStream.loader()`` against ``CachedDataset.loader()``.

    Over the same samples (the stream's elements, cached once more in a map-style file), shuffled, 0 workers;
    and the stream's loader with 2 spawned workers (persistent: their start is timed apart, once, as ``fresh``).
    Targets: stream loader >= 0.8x the dataset loader's speed; 2 spawned workers <= 2x the 0-worker epoch.
    """
    from torch.utils.data import DataLoader

    from mmapcache.torch import CachedDataset

    out: dict[str, Any] = {}
    for name, (make, options) in streams(data).items():
        path = root / f"{name}-loader.mmc"
        complete = CachedStream(make(), path, key=f"bench/loader/{name}", **options)
        _drain(complete)
        in_order = CachedStream(make(), path, key=f"bench/loader/{name}", shuffle=False, **options)
        samples = list(in_order)
        in_order.close()
        assert complete.cache is not None
        dataset = CachedDataset(
            _Listed(samples), root / f"{name}-dataset.mmc", key=f"bench/dataset/{name}",
            fields=complete.cache.fields, max_bytes=options["max_bytes"] * 2,
        )  # fmt: skip
        dataset.fill(progress=False)
        spawned = complete.loader(
            batch_size=64, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
        )
        start = time.perf_counter()
        _drain_batches(spawned)  # the workers start: spawned, they import torch, unpickle the stream
        fresh = time.perf_counter() - start
        counts: dict[str, int] = {}

        def timed(label: str, loader: Iterable[Any], counts: dict[str, int] = counts) -> Callable[[int], float]:
            def run(r: int) -> float:
                seconds, counts[label] = _drain_batches(loader)
                return seconds

            return run

        variants = {
            "stream loader": timed("stream loader", complete.loader(batch_size=64)),
            "dataset loader": timed("dataset loader", dataset.loader(batch_size=64, shuffle=True)),
            "stream DataLoader": timed(
                "stream DataLoader", DataLoader(complete, batch_size=64, collate_fn=collate_fn(name))
            ),
            "stream loader, 2 spawned workers": timed("stream loader, 2 spawned workers", spawned),
        }
        times = run_rounds(variants, rounds=rounds)
        assert len(set(counts.values())) == 1, counts
        n = counts["stream loader"]
        out[name] = {
            "elements": n,
            "us_per_element": {k: statistics.median(v) / n * 1e6 for k, v in times.items()},
            "stream_loader_speed_over_dataset_loader": ratio(times, "dataset loader", "stream loader"),
            "stream_dataloader_speed_over_dataset_loader": ratio(times, "dataset loader", "stream DataLoader"),
            "spawned_2_workers_over_0_workers": ratio(times, "stream loader, 2 spawned workers", "stream loader"),
            "fresh_spawned_epoch_seconds": fresh,
            "times": times,
        }
        del spawned
        complete.close()
        dataset.close()
    return out


def litdata_epochs(python: str, data: dict[str, Any], root: Path) -> dict[str, Any]:
    """LitData over the token stream's elements, in its own environment: seconds of its first two epochs."""
    tokenizer = data["tokenizer"]
    elements = [
        {"label": row["label"], "input_ids": np.asarray(tokenizer.encode(row["text"]).ids, np.int32)}
        for row in data["rows"]
    ]
    source = root / "litdata-elements.pkl"
    source.write_bytes(pickle.dumps(elements))
    run = subprocess.run(
        [python, str(HERE / "_litdata_child.py"), str(source), str(root / "litdata")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the LitData child failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = bench_parser(__doc__ or "", quick="1500 rows, 300 images, 2 rounds", rounds=(5, 3))
    parser.add_argument(
        "--litdata-python",
        default=str(LITDATA_PYTHON) if LITDATA_PYTHON.exists() else None,
        help=f"the python of a virtual environment with litdata installed (default {LITDATA_PYTHON}, if it exists)",
    )
    args = parser.parse_args()
    n, images = (1500, 300) if args.quick else (20000, 4000)
    rounds = args.rounds or (2 if args.quick else 5)
    root = Path(tempfile.mkdtemp(prefix="bench-stream-", dir=args.dir))
    try:
        data = make_data(root, n, images)
        results: dict[str, Any] = {
            "machine": machine_info(),
            "quick": args.quick,
            "rows": n,
            "images": images,
            "rounds": rounds,
        }
        results["streams"] = measure(data, root, rounds)
        rows = []
        for name, found in results["streams"].items():
            per = found["us_per_element"]
            rows.append(
                [name, found["elements"], per["plain"], per["fill"], per["cached"], found["fill_over_plain"],
                 found["plain_over_cached"], per["plain loader"], per["fill loader"],
                 found["fill_loader_over_plain_loader"]]
            )  # fmt: skip
        headers = ["stream", "elements", "plain µs", "fill µs", "cached µs", "fill/plain", "plain/cached",
                   "plain loader µs", "fill loader µs", "fill/plain (loader)"]  # fmt: skip
        print(table(headers, rows))
        results["loaders"] = measure_loaders(data, root, rounds)
        rows = [
            [name, found["elements"], *found["us_per_element"].values(),
             found["stream_loader_speed_over_dataset_loader"], found["spawned_2_workers_over_0_workers"],
             found["fresh_spawned_epoch_seconds"]]
            for name, found in results["loaders"].items()
        ]  # fmt: skip
        headers = ["stream", "elements", "stream loader µs", "dataset loader µs", "stream DataLoader µs",
                   "2 spawned µs", "speed vs dataset", "spawned/0 workers", "fresh spawned s"]  # fmt: skip
        print(table(headers, rows))
        if args.litdata_python:
            lit = litdata_epochs(args.litdata_python, data, root)
            ours = results["streams"]["tokens"]["us_per_element"]["cached"]
            lit["cached_us_per_element"] = ours
            lit["litdata_epoch2_over_cached"] = lit["epoch2_us_per_element"] / ours
            results["litdata"] = lit
            print(
                f"LitData (tokens, converted offline in {lit['optimize_seconds']:.1f} s): epoch 1 "
                f"{lit['epoch1_us_per_element']:.1f} µs/element, epoch 2 {lit['epoch2_us_per_element']:.1f}; "
                f"CachedStream's later epoch {ours:.1f} ({lit['litdata_epoch2_over_cached']:.2f}x faster than "
                "LitData's epoch 2)"
            )
        print(f"results: {write_results('bench_stream', results, quick=args.quick, path=args.json)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
