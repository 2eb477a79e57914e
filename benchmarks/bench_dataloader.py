"""Epoch time of a JPEG-decoding dataset through ``DataLoader``, and node memory under 2-process DDP.

Part 1, warm epochs, same run: a folder of generated 256 px JPEGs (2,000 by
default, issue 9's figure), decoded with Pillow and resized to 112 px (uint8
CHW tensor + int label), read in shuffled batches of 64 with ``num_workers`` 0
and 2 (persistent workers), by

* ``uncached`` — the decoding dataset itself, through ``DataLoader``;
* ``stocaching`` — stocaching's ``SharedCache`` used as its README shows, through
  ``DataLoader`` (in its own virtualenv: stocaching pins numpy<2);
* ``mmapcache`` — ``mmapcache.torch.CachedDataset`` (default ``copy=True``) through
  ``DataLoader(ds, ...)``, the path users write;
* ``mmapcache copy=False`` — zero-copy views, same file, through ``DataLoader``;
* ``mmapcache loader()`` — the default dataset through ``ds.loader(...)``, the batched
  read path (one gather per field straight into the batch). Skipped, with a note,
  in a checkout whose ``CachedDataset`` has no ``loader()``. Before timing, one pass
  checks that it yields the same batches as ``DataLoader(ds)`` for the same order
  (structure, dtypes, shapes, values).

Each library runs in its own long-lived process; the parent sends it "run an
epoch" commands, interleaving the variants round by round (rotated order). The
headline figure is the **CPU time** of a warm epoch (the serving process plus
that loader's workers, from POSIX CPU-time clocks), and each variant's speed
against stocaching is the median over rounds of stocaching's time / its time in
the same round, with quartiles and range. Wall times are reported too. The first
epoch of a cached dataset fills it (reported separately). Also: the first epoch
of a *new* process on the existing mmapcache file (the second run of a job;
stocaching cannot do this: its cache dies with the process).
Targets (issue 9): ``loader()`` >= 1.5x stocaching's speed with 0 workers and
>= 1.2x with 2; ``DataLoader(ds)`` >= 1.0x with 0 and 2; every cached variant
>= 10x faster than uncached.

Part 2, memory: two processes act as DDP ranks (a gloo process group,
``DistributedSampler``, a DataLoader worker each); each rank reads its half of
the data in epoch 0 (filling the cache) and the other half in epoch 1. Then the
parent adds up, over the ranks and their workers, PSS from
``/proc/<pid>/smaps_rollup`` and the tmpfs bytes of every /dev/shm file they map
(stocaching's multiprocessing heap arenas, mmapcache's cache file). Targets:
mmapcache's node memory ~1x the data, stocaching's ~2x (one copy per rank).

Run ``python benchmarks/bench_dataloader.py`` (about 5 minutes) or ``--quick``
(768 images, 5 rounds: about a minute, a smoke test). The stocaching side needs
``benchmarks/.venv-stocaching``: ``--setup-stocaching`` (re)creates it (about 30 s,
pinned to this interpreter's torch build, e.g. ``2.13.0+cpu``), or give
``--stocaching-python``; without either that side is skipped. Results go to
``benchmarks/results/bench_dataloader[-quick].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _child import Child, reply
from _common import add_json_arg, fmt_bytes, machine_info, spread, table, write_results
from _peers import VENV, setup_stocaching, stocaching_ready
from PIL import Image
from torch.utils.data import DataLoader, Dataset

SCRIPT = Path(__file__).resolve()

KEY = "bench-dataloader/jpeg256-to-112/v1"
BATCH = 64


# -- the dataset ---------------------------------------------------------------------


def make_jpegs(directory: Path, n: int, px: int = 256, seed: int = 0) -> None:
    """``n`` JPEGs of smooth colour fields plus noise (so decoding does real work)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        base = np.asarray(small.resize((px, px), Image.Resampling.BICUBIC), dtype=np.int16)
        noisy = np.clip(base + rng.integers(-24, 24, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(directory / f"{i:06d}.jpg", quality=90)


class DecodeCounter:
    """Samples decoded, counted in anonymous shared memory so forked DataLoader workers add to it.

    One slot per process kind (main process, worker 0, worker 1, ...), so no
    two processes ever increment the same slot.
    """

    def __init__(self) -> None:
        self._mm = mmap.mmap(-1, 4096)
        self.slots = np.frombuffer(self._mm, np.int64)

    def add(self) -> None:
        info = torch.utils.data.get_worker_info()
        self.slots[0 if info is None else 1 + info.id] += 1

    def total(self) -> int:
        return int(self.slots.sum())


class JpegDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decode a JPEG with Pillow, resize to ``size`` px, return (uint8 CHW tensor, label)."""

    def __init__(self, root: str, n: int, size: int, counter: DecodeCounter | None = None) -> None:
        self.files = [os.path.join(root, f"{i:06d}.jpg") for i in range(n)]
        self.labels = [i % 10 for i in range(n)]
        self.size = size
        self.counter = counter

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as im:
            rgb = im.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
        if self.counter is not None:
            self.counter.add()
        return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous(), self.labels[i]


class StocachingDataset(Dataset[tuple[torch.Tensor, int]]):
    """The decoding dataset behind stocaching's ``SharedCache``, the way stocaching's README wires it."""

    def __init__(self, base: JpegDataset) -> None:
        from stocaching import SharedCache

        self.base = base
        self.cache = SharedCache(size_limit_gib=8, dataset_len=len(base), data_dims=(3, base.size, base.size))

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.cache.get_slot(i)
        if x is None:
            x, _ = self.base[i]
            self.cache.set_slot(i, x)
        return x, self.base.labels[i]


LOADER = "mmapcache loader()"  # the variant read through CachedDataset.loader() instead of DataLoader(ds)
COLLATE = "mmapcache collate"  # DataLoader(ds, collate_fn=mmapcache.torch.collate)
BATCH_TRANSFORM = "mmapcache loader(batch_transform=)"  # the crop + flip on whole batches, no transform=
CROP = 96  # --transform crop-flip: a random 96 px crop of the 112 px image, flipped left-right half the time


def crop_flip(sample: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    """Per-sample random crop + horizontal flip with plain torch ops (what RandomCrop + RandomHorizontalFlip do)."""
    image, label = sample
    top, left = torch.randint(0, image.shape[1] - CROP + 1, (2,)).tolist()
    image = image[:, top : top + CROP, left : left + CROP]
    if torch.rand(()) < 0.5:
        image = image.flip(-1)
    return image, label


class BatchCropFlip:
    """The same crop + flip, drawn per sample, applied to a whole gathered batch (docs/recipes.md's recipe)."""

    def __call__(self, batch: list[Any]) -> list[Any]:
        images, labels = batch
        n, channels, height, width = images.shape
        tops = torch.randint(0, height - CROP + 1, (n,)).tolist()
        lefts = torch.randint(0, width - CROP + 1, (n,)).tolist()
        flips = (torch.rand(n) < 0.5).tolist()
        out = images.new_empty((n, channels, CROP, CROP))
        for k, (top, left, flip) in enumerate(zip(tops, lefts, flips, strict=True)):
            crop = images[k, :, top : top + CROP, left : left + CROP]
            out[k] = crop.flip(-1) if flip else crop
        return [out, labels]


class Transformed(Dataset[Any]):
    """``base`` with a per-sample transform (the uncached and stocaching sides of ``--transform``)."""

    def __init__(self, base: Dataset[Any], transform: Any) -> None:
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.base[i])


def have_cached_dataset() -> bool:
    try:
        import mmapcache.torch
    except ImportError:
        return False
    return hasattr(mmapcache.torch, "CachedDataset")


def have_loader() -> bool:
    """Whether ``CachedDataset.loader()`` (the batched read path of issue 9) exists in this checkout."""
    if not have_cached_dataset():
        return False
    from mmapcache.torch import CachedDataset

    return hasattr(CachedDataset, "loader")


def build(mode: str, base: JpegDataset, cache_path: str, transform: str | None = None) -> dict[str, Dataset[Any]]:
    """The datasets one child process serves, by variant name (``LOADER`` reads the default one).

    With ``transform="crop-flip"`` every variant applies :func:`crop_flip` per sample, but
    ``BATCH_TRANSFORM``, which reads the plain dataset and crops and flips each batch.
    """
    if mode == "uncached":
        return {"uncached": base if transform is None else Transformed(base, crop_flip)}
    if mode == "stocaching":
        sto = StocachingDataset(base)
        return {"stocaching": sto if transform is None else Transformed(sto, crop_flip)}
    from mmapcache.torch import CachedDataset

    if transform is not None:
        augmented = CachedDataset(base, cache_path, key=KEY, transform=crop_flip)
        plain = CachedDataset(base, cache_path, key=KEY)
        return {"mmapcache": augmented, COLLATE: augmented, LOADER: augmented, BATCH_TRANSFORM: plain}

    ds = CachedDataset(base, cache_path, key=KEY)
    datasets: dict[str, Dataset[Any]] = {
        "mmapcache": ds,
        "mmapcache copy=False": CachedDataset(base, cache_path, key=KEY, copy=False),
    }
    if have_loader():
        datasets[LOADER] = ds
    return datasets


def make_loader(variant: str, ds: Any, workers: int, **kwargs: Any) -> DataLoader[Any]:
    """What a training loop writes: ``DataLoader(ds, ...)``, or ``ds.loader(...)`` for ``LOADER``."""
    kwargs = {"batch_size": BATCH, "num_workers": workers, "persistent_workers": workers > 0, **kwargs}
    if variant == LOADER:
        loader: DataLoader[Any] = ds.loader(**kwargs)
        return loader
    if variant == BATCH_TRANSFORM:
        batched: DataLoader[Any] = ds.loader(batch_transform=BatchCropFlip(), **kwargs)
        return batched
    if variant == COLLATE:
        from mmapcache.torch import collate

        return DataLoader(ds, collate_fn=collate, **kwargs)
    return DataLoader(ds, **kwargs)


def batch_difference(a: Any, b: Any, where: str = "batch") -> str | None:
    """Where two collated batches differ in structure, dtype, shape or value; None if they are equal."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        return None if torch.equal(a, b) else f"{where}: values differ"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} vs {list(b)}"
        pairs: list[tuple[Any, Any, str]] = [(a[k], b[k], f"{where}[{k!r}]") for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        pairs = [(x, y, f"{where}[{k}]") for k, (x, y) in enumerate(zip(a, b, strict=True))]
    else:
        return None if a == b else f"{where}: {a!r} vs {b!r}"
    for x, y, w in pairs:
        found = batch_difference(x, y, w)
        if found is not None:
            return found
    return None


def compare_loaders(ds: Any, n: int, workers: int) -> dict[str, Any]:
    """One pass of ``ds.loader()`` and of ``DataLoader(ds)`` over the same shuffled order: equal batches?"""
    order = np.random.default_rng(7).permutation(n).tolist()
    ours = make_loader(LOADER, ds, workers, sampler=order, persistent_workers=False)
    default = make_loader("mmapcache", ds, workers, sampler=order, persistent_workers=False)
    batches, difference = 0, None
    for k, (a, b) in enumerate(zip(ours, default, strict=True)):
        batches += 1
        difference = batch_difference(a, b, f"batch {k}")
        if difference is not None:
            break
    return {"batches": batches, "equal": difference is None, "difference": difference}


# -- child processes -----------------------------------------------------------------


_LIBC = ctypes.CDLL(None, use_errno=True)


def process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads, live and exited), from its POSIX CPU-time clock.

    Nanosecond resolution, where ``/proc/<pid>/stat`` (psutil) counts 10 ms
    ticks: a warm epoch of 2,000 samples takes ~20 ms of CPU.
    """
    clock = ctypes.c_int()
    err = _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock))
    if err:
        raise ProcessLookupError(err, os.strerror(err))
    return time.clock_gettime(clock.value)


def loader_cpu(loader: DataLoader[Any]) -> float:
    """CPU seconds of this process and of ``loader``'s worker processes (persistent ones live on between epochs).

    Only this loader's workers: the idle workers of the process's other loaders
    are not part of its epoch (a child serving three variants has six).
    """
    total = time.process_time()
    iterator = getattr(loader, "_iterator", None)  # torch keeps the iterator of persistent workers here
    for worker in getattr(iterator, "_workers", ()):
        with contextlib.suppress(OSError, TypeError):  # exited meanwhile
            total += process_cpu(worker.pid)
    return total


def run_epoch(loader: DataLoader[Any]) -> int:
    batches = 0
    for _batch in loader:
        batches += 1
    return batches


def serve(args: argparse.Namespace) -> None:
    """A child holding one library's datasets; runs epochs on command (JSON lines on stdin)."""
    torch.set_num_threads(1)
    counter = DecodeCounter()
    base = JpegDataset(args.data, args.n, args.size, counter)
    datasets = build(args.serve, base, args.cache_path, args.transform)
    loaders: dict[tuple[str, int], DataLoader[Any]] = {}
    reply({"pid": os.getpid(), "variants": list(datasets), "numpy": np.__version__, "torch": torch.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "epoch":
            key = (cmd["variant"], cmd["workers"])
            if key not in loaders:
                loaders[key] = make_loader(cmd["variant"], datasets[cmd["variant"]], cmd["workers"], shuffle=True)
            walls, cpus, decodes = [], [], []
            for _ in range(cmd.get("count", 1)):
                before = counter.total()
                c0 = loader_cpu(loaders[key])
                t0 = time.perf_counter()
                batches = run_epoch(loaders[key])
                walls.append(time.perf_counter() - t0)
                cpus.append(loader_cpu(loaders[key]) - c0)
                decodes.append(counter.total() - before)
            reply({"wall": walls, "cpu": cpus, "decodes": decodes, "batches": batches})
        elif cmd["cmd"] == "breakdown":
            reply(breakdown(datasets, args.n, cmd["rounds"], cmd["reps"]))
        elif cmd["cmd"] == "compare":
            reply({f"w={w}": compare_loaders(datasets[LOADER], args.n, w) for w in cmd["workers"]})
        elif cmd["cmd"] == "check":
            # CRC of the image bytes of a few samples, through each variant's __getitem__.
            crcs = {}
            for name, ds in datasets.items():
                if name in (LOADER, COLLATE, BATCH_TRANSFORM) or args.transform:
                    continue  # the default variant's dataset (checked batch by batch with "compare"), or random
                crc = 0
                for i in range(0, args.n, max(1, args.n // 16)):
                    crc = zlib.crc32(ds[i][0].contiguous().numpy().tobytes(), crc)
                crcs[name] = crc
            stats = {n: ds.stats() for n, ds in datasets.items() if hasattr(ds, "stats")}
            reply({"crc": crcs, "stats": stats})
    reply({"bye": True})


def breakdown(datasets: dict[str, Any], n: int, rounds: int, reps: int) -> dict[str, list[float]]:
    """Where a warm batch's time goes, in this process (num_workers=0), seconds per batch of 64.

    "views + collate" is what a cache that hands out views of its storage pays
    (stocaching's hit path, minus its per-sample Python: a state check and a
    row view of the same mapping here): the floor for ``default_collate``.
    """
    from _common import run_interleaved
    from torch.utils.data import default_collate

    ds, dsv = datasets["mmapcache"], datasets["mmapcache copy=False"]
    cache = ds.cache
    image, label = (torch.from_numpy(a) for a in cache.views.values())  # read-only views: warns once
    states = cache._mapped.states
    ready = 2  # mmapcache._region.slots.READY

    def views(batch: list[int]) -> object:
        return default_collate([(image[i], int(label[i])) for i in batch if states[i] == ready])

    def inputs(r: int) -> list[list[int]]:
        rng = np.random.default_rng(1000 + r)
        return [rng.integers(0, n, BATCH).tolist() for _ in range(reps)]

    variants: dict[str, Callable[[Any], object]] = {}
    if LOADER in datasets:
        # What DataLoader's fetcher does per batch when the dataset has __getitems__.
        batched = make_loader(LOADER, ds, 0)
        fetch, collate = batched.dataset.__getitems__, batched.collate_fn  # type: ignore[attr-defined]
        variants["mmapcache loader(): one batch"] = lambda b: collate(fetch(b))
    variants |= {
        "mmapcache: __getitems__ + collate": lambda b: default_collate(ds.__getitems__(b)),
        "mmapcache: __getitems__ only": lambda b: ds.__getitems__(b),
        "mmapcache: Cache.get_many only": lambda b: cache.get_many(b),
        "mmapcache copy=False: __getitems__ + collate": lambda b: default_collate(dsv.__getitems__(b)),
        "mmapcache copy=False: __getitems__ only": lambda b: dsv.__getitems__(b),
        "views + collate (the floor)": views,
    }
    return run_interleaved(variants, inputs, rounds=rounds)


# -- DDP ranks -----------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    """One of two DDP-like ranks: fill its shard (epoch 0), read the other shard (epoch 1), wait."""
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank_id, world_size=args.world
    )
    counter = DecodeCounter()
    base = JpegDataset(args.data, args.n, args.size, counter)
    ds: Dataset[Any]
    if args.rank == "stocaching":
        ds = StocachingDataset(base)
    else:
        from mmapcache.torch import CachedDataset

        ds = CachedDataset(base, args.cache_path, key=KEY)
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=args.world, rank=args.rank_id, shuffle=True, seed=0
    )
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=args.ddp_workers,
        persistent_workers=args.ddp_workers > 0,
    )
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        dist.barrier()
        before = counter.total()
        t0 = time.perf_counter()
        run_epoch(loader)
        epochs.append({"wall": time.perf_counter() - t0, "decodes": counter.total() - before})
    dist.barrier()
    reply({"pid": os.getpid(), "rank": args.rank_id, "epochs": epochs, "samples": len(sampler)})
    sys.stdin.readline()  # the parent measures memory now, then says go
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def smaps_rollup(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def shm_files(pid: int) -> dict[tuple[str, int], dict[str, Any]]:
    """The /dev/shm files ``pid`` maps, by (device, inode): name and bytes allocated in tmpfs."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            key = (parts[3], int(parts[4]))
            if key in found:
                continue
            try:
                st = os.stat(f"/proc/{pid}/map_files/{parts[0]}")  # works for unlinked files too (root)
                allocated = st.st_blocks * 512
            except OSError:
                allocated = -1
            found[key] = {"name": parts[5].strip(), "allocated": allocated}
    return found


def classify(name: str) -> str:
    base = os.path.basename(name.replace(" (deleted)", ""))
    if base.startswith("pym-"):
        return "multiprocessing heap"
    if base.endswith(".mmc"):
        return "mmapcache file"
    if base.startswith("torch_"):
        return "torch IPC"
    if base.startswith("sem."):
        return "semaphores"
    return "other"


def measure_memory(pids: list[int]) -> dict[str, Any]:
    import psutil

    procs: list[int] = []
    for pid in pids:
        procs.append(pid)
        procs.extend(child.pid for child in psutil.Process(pid).children(recursive=True))
    totals = {"Rss": 0, "Pss": 0, "Pss_Anon": 0, "Pss_File": 0, "Pss_Shmem": 0}
    files: dict[tuple[str, int], dict[str, Any]] = {}
    for pid in procs:
        rollup = smaps_rollup(pid)
        for name in totals:
            totals[name] += rollup.get(name, 0)
        files.update(shm_files(pid))
    by_kind: dict[str, int] = {}
    for info in files.values():
        kind = classify(info["name"])
        by_kind[kind] = by_kind.get(kind, 0) + max(0, info["allocated"])
    return {
        "processes": len(procs),
        "smaps_rollup_sum": totals,
        "shm_bytes_by_kind": by_kind,
        "shm_files": [{"name": i["name"], "allocated": i["allocated"]} for i in files.values()],
    }


def ddp_memory(lib: str, python: str, common: list[str], workers: int) -> dict[str, Any]:
    port = free_port()
    extra = ["--ddp-workers", str(workers)]
    ranks = [
        Child(
            python,
            SCRIPT,
            [*common, "--rank", lib, "--rank-id", str(r), "--world", "2", "--port", str(port), *extra],
            handshake=False,  # both ranks must run before either can report
        )
        for r in range(2)
    ]
    try:
        for rank in ranks:
            rank.hello = rank.read()
        memory = measure_memory([rank.hello["pid"] for rank in ranks])
        result = {"ranks": [rank.hello for rank in ranks], "memory": memory}
        for rank in ranks:
            rank.send("go")
        for rank in ranks:
            rank.proc.wait(timeout=120)
        return result
    finally:
        for rank in ranks:
            if rank.proc.poll() is None:
                rank.proc.kill()
                rank.proc.wait()


# -- the parent ----------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def fmt_spread(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.2f} [{s['q1']:.2f}-{s['q3']:.2f}] {s['min']:.2f}-{s['max']:.2f}"


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="768 images, 5 rounds (< 1 minute)")
    add_json_arg(parser)
    parser.add_argument("--n", type=int, help="number of images (default 2000, issue 9's figure; quick 768)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of warm epochs (default 15, quick 5)")
    parser.add_argument("--uncached-rounds", type=int, help="rounds with an uncached epoch (default 3, quick 2)")
    parser.add_argument("--workers", default="0,2", help="DataLoader num_workers values to time (default 0,2)")
    parser.add_argument("--ddp-workers", type=int, default=1, help="DataLoader workers per DDP rank (default 1)")
    parser.add_argument("--stocaching-python", help=f"python of a venv with stocaching (default {VENV}/bin/python)")
    parser.add_argument("--setup-stocaching", action="store_true", help=f"create {VENV} first")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP memory part")
    parser.add_argument(
        "--transform",
        choices=["crop-flip"],
        help="every variant applies a per-sample random 96 px crop + flip (and one crops whole batches)",
    )
    # Internal: child processes.
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--rank-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=112, help=argparse.SUPPRESS)
    parser.add_argument("--cache-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.rank:
        return rank_main(args)

    # A SIGTERM runs the cleanup below (temporary JPEGs, the /dev/shm cache files) too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quick: bool = args.quick
    n = args.n or (768 if quick else 2000)
    rounds = args.rounds or (5 if quick else 15)
    uncached_rounds = min(rounds, args.uncached_rounds or (2 if quick else 3))
    warm_reps = 5
    worker_counts = [int(w) for w in args.workers.split(",")]
    sto_python = args.stocaching_python or str(VENV / "bin" / "python")
    if args.setup_stocaching:
        sto_python = str(setup_stocaching(VENV))
    have_sto = stocaching_ready(sto_python)
    have_mmc = have_cached_dataset()
    have_batched = have_loader()
    info = machine_info()
    sample_bytes = 3 * args.size * args.size
    data_bytes = n * sample_bytes
    print(f"machine: {info['cpu']}, {info['cores']} cores; torch {info.get('torch')}, numpy {info.get('numpy')}")
    print(f"{n} JPEGs 256 px -> uint8 3x{args.size}x{args.size} ({fmt_bytes(data_bytes)} decoded), batch {BATCH}")
    if not have_sto:
        print(f"stocaching side skipped: no set-up {sto_python} (run with --setup-stocaching)")
    if not have_mmc:
        print("mmapcache side skipped: mmapcache.torch has no CachedDataset yet")
    elif not have_batched:
        print(f"'{LOADER}' skipped: CachedDataset has no loader() in this checkout yet (issue 9)")
    results: dict[str, Any] = {
        "machine": info,
        "quick": quick,
        "n": n,
        "image": [3, args.size, args.size],
        "batch": BATCH,
        "data_bytes": data_bytes,
        "rounds": rounds,
        "uncached_rounds": uncached_rounds,
        "warm_epochs_per_round": warm_reps,
        "cpu_clock": "POSIX CPU-time clocks of the serving process and its DataLoader workers (ns resolution)",
        "loader_variant": have_batched,
    }
    jpegs = Path(tempfile.mkdtemp(prefix="mmapcache-bench-jpeg-"))
    shm = Path(tempfile.mkdtemp(prefix="mmapcache-bench-", dir="/dev/shm"))
    children: dict[str, Child] = {}
    try:
        t0 = time.perf_counter()
        make_jpegs(jpegs, n)
        print(f"generated the JPEGs in {time.perf_counter() - t0:.1f} s")
        common = ["--data", str(jpegs), "--n", str(n), "--size", str(args.size)]
        if args.transform:
            common += ["--transform", args.transform]
        plan = [("uncached", sys.executable)]
        if have_sto:
            plan.append(("stocaching", sto_python))
        if have_mmc:
            plan.append(("mmapcache", sys.executable))
        for mode, python in plan:
            children[mode] = Child(python, SCRIPT, [*common, "--serve", mode, "--cache-path", str(shm / "epochs.mmc")])
        variants = {v: mode for mode, child in children.items() for v in child.hello["variants"]}
        results["child_versions"] = {
            m: {"numpy": c.hello["numpy"], "torch": c.hello["torch"]} for m, c in children.items()
        }

        # First epochs: the fill of each cache (num_workers=0), then one untimed epoch per loader.
        first: dict[str, Any] = {}
        for w in worker_counts:
            for v, mode in variants.items():
                first[f"{v} w={w}"] = children[mode].call(cmd="epoch", variant=v, workers=w)
        results["first_epochs"] = first
        fill_rows = [[k, r["wall"][0], r["cpu"][0], r["decodes"][0]] for k, r in first.items()]
        print("\nfirst epoch per loader (for the cached variants at w=0: the fill)")
        print(table(["variant", "wall s", "cpu s", "decodes"], fill_rows))
        results["transform"] = args.transform
        if have_batched and not args.transform:
            # The loader() figure is honest only if it yields what DataLoader(ds) yields.
            same = children["mmapcache"].call(cmd="compare", workers=worker_counts)
            results["loader_batches_equal_default"] = same
            for w, c in same.items():
                verdict = "equal" if c["equal"] else f"DIFFERENT: {c['difference']}"
                print(f"{LOADER} vs DataLoader(ds), same shuffled order, {w}: {c['batches']} batches {verdict}")

        # Interleaved rounds.
        raw: dict[str, dict[str, list[Any]]] = {}
        names = list(variants)
        for r in range(rounds):
            for w in worker_counts:
                # Uncached epochs take ~100x longer and need few rounds for a ~100x ratio;
                # the cached variants get many rounds, as they are compared with each other.
                timed = [v for v in names if v != "uncached" or r < uncached_rounds]
                order = timed[r % len(timed) :] + timed[: r % len(timed)]
                for v in order:
                    count = 1 if v == "uncached" else warm_reps
                    out = children[variants[v]].call(cmd="epoch", variant=v, workers=w, count=count)
                    slot = raw.setdefault(f"{v} w={w}", {"wall": [], "cpu": [], "decodes": []})
                    slot["wall"].append(med(out["wall"]))
                    slot["cpu"].append(med(out["cpu"]))
                    slot["decodes"].append(sum(out["decodes"]))
            print(f"round {r + 1}/{rounds} done")
        results["rounds_raw"] = raw
        checks = {mode: child.call(cmd="check") for mode, child in children.items()}
        results["checks"] = checks
        if have_mmc and not args.transform:
            times = children["mmapcache"].call(cmd="breakdown", rounds=rounds * 3, reps=25)
            floor = times["views + collate (the floor)"]
            results["batch_breakdown"] = {
                name: {
                    "median_us": med(ts) * 1e6,
                    "time_vs_floor": med([t / f for t, f in zip(ts, floor, strict=True)]),
                    "rounds_us": [t * 1e6 for t in ts],
                }
                for name, ts in times.items()
            }
            print(f"\nwarm batch of {BATCH}, in-process (num_workers=0): where the time goes")
            print(
                table(
                    ["path", "µs per batch", "time / floor"],
                    [[k, v["median_us"], v["time_vs_floor"]] for k, v in results["batch_breakdown"].items()],
                )
            )
        crcs = {v: c for check in checks.values() for v, c in check["crc"].items()}
        results["same_samples"] = len(set(crcs.values())) == 1
        if not results["same_samples"]:
            print(f"WARNING: variants returned different samples: {crcs}")

        summary = []
        for w in worker_counts:
            unc = raw[f"uncached w={w}"]
            sto = raw.get(f"stocaching w={w}")
            for v in names:
                cur = raw[f"{v} w={w}"]
                row: dict[str, Any] = {
                    "variant": v,
                    "workers": w,
                    "wall_s": med(cur["wall"]),
                    "cpu_s": med(cur["cpu"]),
                    "decodes_in_rounds": sum(cur["decodes"]),
                    # Paired with the uncached epoch of the same round (the first rounds only).
                    "speedup_vs_uncached": med([u / c for u, c in zip(unc["wall"], cur["wall"], strict=False)]),
                }
                if sto is not None:
                    # Speed = stocaching's time / ours, per round (uncached: the first rounds only).
                    row["cpu_speed_vs_stocaching"] = spread(
                        [s / c for c, s in zip(cur["cpu"], sto["cpu"], strict=False)]
                    )
                    row["wall_speed_vs_stocaching"] = spread(
                        [s / c for c, s in zip(cur["wall"], sto["wall"], strict=False)]
                    )
                summary.append(row)
        results["epochs"] = summary
        print(
            f"\nwarm epochs: medians over {rounds} interleaved rounds (uncached: the first {uncached_rounds}; "
            f"warm: median of {warm_reps} epochs a round); speed vs stocaching = its time / ours, per round: "
            "median [quartiles] min-max"
        )
        print(
            table(
                [
                    "variant",
                    "workers",
                    "cpu ms",
                    "wall ms",
                    "x uncached",
                    "CPU speed vs stocaching",
                    "wall speed vs stocaching",
                    "decodes",
                ],
                [
                    [
                        r["variant"],
                        r["workers"],
                        r["cpu_s"] * 1e3,
                        r["wall_s"] * 1e3,
                        r["speedup_vs_uncached"],
                        fmt_spread(r.get("cpu_speed_vs_stocaching")),
                        fmt_spread(r.get("wall_speed_vs_stocaching")),
                        r["decodes_in_rounds"],
                    ]
                    for r in summary
                ],
            )
        )
        for child in children.values():
            child.close()

        if have_mmc:
            # The next run: a new process whose first epoch reads the file the previous one filled.
            fresh = Child(
                sys.executable, SCRIPT, [*common, "--serve", "mmapcache", "--cache-path", str(shm / "epochs.mmc")]
            )
            try:
                out = fresh.call(cmd="epoch", variant="mmapcache", workers=0, count=2)
            finally:
                fresh.close()
            unc_wall = med(raw["uncached w=0"]["wall"])
            results["new_process"] = {
                "first_epoch_s": out["wall"][0],
                "second_epoch_s": out["wall"][1],
                "decodes": out["decodes"],
                "speedup_vs_uncached_median": unc_wall / out["wall"][0],
            }
            print(
                f"\nnew process on the filled mmapcache file: first epoch {out['wall'][0]:.3f} s "
                f"(decodes {out['decodes'][0]}; {unc_wall / out['wall'][0]:.1f}x faster than uncached), "
                f"second {out['wall'][1]:.3f} s"
            )

        if not args.no_ddp:
            ddp: dict[str, Any] = {}
            if have_sto:
                ddp["stocaching"] = ddp_memory("stocaching", sto_python, common, args.ddp_workers)
            if have_mmc:
                ddp["mmapcache"] = ddp_memory(
                    "mmapcache", sys.executable, [*common, "--cache-path", str(shm / "ddp.mmc")], args.ddp_workers
                )
            rows = []
            for lib, res in ddp.items():
                mem = res["memory"]
                kind = "mmapcache file" if lib == "mmapcache" else "multiprocessing heap"
                cache_bytes = mem["shm_bytes_by_kind"].get(kind, 0)
                pss_shmem = mem["smaps_rollup_sum"]["Pss_Shmem"]
                res["cache_bytes"] = cache_bytes
                res["cache_vs_data"] = cache_bytes / data_bytes
                res["pss_shmem_vs_data"] = pss_shmem / data_bytes
                epochs = [[e["wall"] for e in rank["epochs"]] for rank in res["ranks"]]
                decodes = [[e["decodes"] for e in rank["epochs"]] for rank in res["ranks"]]
                rows.append(
                    [
                        lib,
                        mem["processes"],
                        fmt_bytes(cache_bytes),
                        res["cache_vs_data"],
                        fmt_bytes(pss_shmem),
                        res["pss_shmem_vs_data"],
                        fmt_bytes(mem["smaps_rollup_sum"]["Pss"]),
                        str(decodes),
                        " ".join(f"{a:.2f}/{b:.2f}" for a, b in epochs),
                    ]
                )
            results["ddp"] = ddp
            print(f"\n2 DDP ranks x {args.ddp_workers} DataLoader worker(s); data = {fmt_bytes(data_bytes)}")
            print(
                table(
                    [
                        "library",
                        "procs",
                        "cache tmpfs",
                        "x data",
                        "sum Pss_Shmem",
                        "x data",
                        "sum Pss (all)",
                        "decodes [rank][epoch]",
                        "epoch0/epoch1 s per rank",
                    ],
                    rows,
                )
            )
    finally:
        for child in children.values():
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
        shutil.rmtree(jpegs, ignore_errors=True)
        if have_mmc:
            import mmapcache

            for name in ("epochs.mmc", "ddp.mmc"):
                if (shm / name).exists():
                    mmapcache.remove(shm / name, force=True)
        shutil.rmtree(shm, ignore_errors=True)
    print_targets(results)
    print(f"\nresults: {write_results('bench_dataloader', results, quick=quick, path=args.json)}")


# Issue 9: minimum CPU speed of a warm epoch vs stocaching's (its CPU time / ours), by variant and workers.
SPEED_TARGETS = {(LOADER, 0): 1.5, (LOADER, 2): 1.2, ("mmapcache", 0): 1.0, ("mmapcache", 2): 1.0}


def print_targets(results: dict[str, Any]) -> None:
    rows = []
    for r in results.get("epochs", []):
        if r["variant"].startswith("mmapcache"):
            label = f"{r['variant']} w={r['workers']}"
            rows.append([label, "warm epoch speedup vs uncached (wall)", ">= 10", r["speedup_vs_uncached"], "-"])
            bound = SPEED_TARGETS.get((r["variant"], r["workers"]))
            if bound is not None and "cpu_speed_vs_stocaching" in r:
                s = r["cpu_speed_vs_stocaching"]
                rows.append(
                    [label, "warm epoch CPU speed vs stocaching", f">= {bound}", s["median"], fmt_spread(s)[5:]]
                )
    for lib, target in (("mmapcache", "~ 1"), ("stocaching", "~ 2")):
        if lib in results.get("ddp", {}):
            rows.append([lib, "DDP node cache memory / data", target, results["ddp"][lib]["cache_vs_data"], "-"])
    if not rows:
        return
    for row in rows:
        op, bound = row[2].split()
        met = row[3] >= float(bound) if op == ">=" else abs(row[3] - float(bound)) < 0.1
        row.append("yes" if met else "NO")
    print("\nTargets (median of per-round ratios; spread: [quartiles] min-max)")
    print(table(["what", "figure", "target", "median", "spread", "met"], rows))
    if not results.get("loader_variant"):
        print(f"('{LOADER}' not measured: CachedDataset.loader() does not exist in this checkout yet)")


if __name__ == "__main__":
    main()
