"""Concurrent jobs with the same order: loads and first-epoch wall time, with and without single flight.

Two jobs (separate processes) each start two loader processes, as DataLoader
workers, that open one cache by path. Both jobs read the same ``n`` samples in
the same (shuffled) order, in batches; loader ``k`` of a job takes batches
``k, k + 2, ...``. A sample costs ``--delay`` seconds to load (a sleep, like a
fetch or a decode waiting on I/O; ``--load cpu`` spins instead). Every loader
starts at the same instant, once all four have opened the cache. Two ways of filling the misses, in interleaved
rounds, each round on fresh caches:

* **put** (the behaviour before single flight): ``read_many``, load every miss,
  ``put_many`` — a process that misses a sample another one is loading loads
  it too, and its put returns False;
* **get_or_load_many**: each missing sample is held before it is loaded, and a
  process that finds it held waits for it instead (``Cache.get_or_load_many``).

Reported: the loads summed over all four loaders (target: exactly ``n`` with
single flight, about ``2 n`` without), each job's first-epoch wall time, and
the ratio single flight / put of the slower job's wall time (median of
per-round ratios; target <= 0.6). Every sample read is checked.

**The torch layer** (``--level torch``; both levels by default): each job is a
training process that wraps a dataset of ``n`` samples of ``--delay`` seconds
(a 12 KB uint8 image and its index; loads logged to a shared file) in a
``CachedDataset`` with the default ``check=2``, and reads one epoch through
``ds.loader(batch_size, sampler=order, num_workers=2)`` (fork workers). The
file is made beforehand from ``dataset[0]``, so that the jobs race on the
misses, not on creating it. Two variants, in interleaved rounds: **after**, the
torch layer of this checkout, and **before**, the torch layer as it was at
``--before`` (default ``103ba3a``, before single flight and once-per-job
checks: a package extracted with ``git archive`` into a temporary directory,
run by the same script). Reported: every load of the wrapped dataset during the
epochs (single flight: ``n - 1`` misses plus each job's spot checks), each
job's epoch wall time from a common start signal, and the ratio after / before
of the slower job's (target <= 0.6).

**Claims at scale** (``--level claims``): what holding costs, in one process
and to everyone else, on fresh caches of ``--claims`` slots (default 100,000;
quick 5,000) of 64 B rows, in interleaved rounds:

* ``put_many`` of every row in a shuffled order against ``get_or_load_many``
  of the same rows through a cheap ``load`` (a slice of an array), in that
  order and in index order, and against ``claim_many`` + ``Claims.put_many``
  (target: ``get_or_load_many`` <= 2x ``put_many``);
* another process's ``put`` latency (median of 2,000 puts into slots nobody
  holds, on a cache of ``--claims`` + 2,000 slots) while nothing is held,
  while this process holds ``claim_many`` of the ``--claims`` others
  (shuffled), while it holds 1,000 scattered ones (every other slot: each its
  own kernel lock), and while a third process fills the others through
  ``get_or_load_many`` against through ``put_many`` (target: <= 2x).

Every figure is a ratio to its baseline in the same round (medians over
rounds); the load average is printed with them.

``python benchmarks/bench_singleflight.py [--quick] [--n 2000] [--delay 0.005] [--level core|torch|claims|both|all]``
Results go to ``benchmarks/results/bench_singleflight[-quick].json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_parser, machine_info, rotated, table, write_results

from mmapcache import Cache, Field

SPAWN = multiprocessing.get_context("spawn")
JOBS = 2
LOADERS = 2  # per job
SHAPE = (3, 64, 64)  # 12 KB uint8 samples
VARIANTS = ("put", "get_or_load_many")
TORCH_VARIANTS = ("before", "after")
TORCH_KEY = "bench-singleflight/v1"
BEFORE = "103ba3a"  # the torch layer before single flight and once-per-job checks
REPO = Path(__file__).resolve().parent.parent


def sample(index: int) -> np.ndarray[Any, Any]:
    return np.full(SHAPE, index % 251, np.uint8)


def make_load(delay: float, kind: str, counter: list[int]) -> Any:
    def load(indices: list[int]) -> dict[str, Any]:
        for _ in indices:
            if kind == "sleep":
                time.sleep(delay)
            else:
                end = time.thread_time() + delay
                while time.thread_time() < end:
                    pass
        counter[0] += len(indices)
        return {"image": np.stack([sample(i) for i in indices])}

    return load


def loader(path: str, variant: str, batches: list[list[int]], go: str, args: dict[str, Any], out: str) -> None:
    """One loader process: its batches, in order, through ``variant``; writes its report to ``out``."""
    counter = [0]
    load = make_load(args["delay"], args["load"], counter)
    wrong = 0
    with Cache.open(path) as cache:
        Path(f"{out}.ready").touch()
        flag, deadline = Path(go), time.monotonic() + 300
        while not flag.exists():  # every loader starts at the same instant, once all of them are up
            if time.monotonic() > deadline:
                raise SystemExit("no start signal within 300 s: the benchmark went away")
            time.sleep(0.0005)
        for batch in batches:
            if variant == "put":
                got, hits = cache.read_many(batch)
                if not hits.all():
                    missing = [i for i, hit in zip(batch, hits.tolist(), strict=True) if not hit]
                    loaded = load(missing)
                    cache.put_many(missing, loaded)
                    got["image"][~hits] = loaded["image"]
            else:
                got, _ = cache.get_or_load_many(batch, load)
            wrong += sum(int(got["image"][row, 0, 0, 0]) != i % 251 for row, i in enumerate(batch))
        finished = time.time()
    Path(out).write_text(json.dumps({"loads": counter[0], "finished": finished, "wrong": wrong}))


def job(path: str, variant: str, batches: list[list[int]], go: str, args: dict[str, Any], out: str) -> None:
    """One job: starts its loaders, each with every ``LOADERS``-th batch, and waits for them."""
    procs = [
        SPAWN.Process(target=loader, args=(path, variant, batches[k::LOADERS], go, args, f"{out}.{k}"))
        for k in range(LOADERS)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    reports = [json.loads(Path(f"{out}.{k}").read_text()) for k in range(LOADERS)]
    codes = [proc.exitcode for proc in procs]
    Path(out).write_text(json.dumps({"loaders": reports, "exitcodes": codes}))


def run_variant(directory: Path, variant: str, r: int, args: dict[str, Any]) -> dict[str, Any]:
    """Both jobs through one variant on a fresh cache; loads and each job's epoch seconds."""
    n, batch = args["n"], args["batch"]
    path = directory / f"{variant}-{r}.mmc"
    Cache.open(path, {"image": Field(SHAPE, "uint8")}, n).close()
    order = np.random.default_rng(r).permutation(n).tolist()
    batches = [order[s : s + batch] for s in range(0, n, batch)]
    go = directory / f"{variant}-{r}.go"
    outs = [str(directory / f"{variant}-{r}-job{j}.json") for j in range(JOBS)]
    procs = [SPAWN.Process(target=job, args=(str(path), variant, batches, str(go), args, outs[j])) for j in range(JOBS)]
    try:
        return _finish(procs, variant, path, outs, go)
    finally:
        for proc in procs:  # interrupted, or a loader failed: no process outlives the round
            if proc.is_alive():
                proc.kill()
                proc.join()


def _finish(procs: list[Any], variant: str, path: Path, outs: list[str], go: Path) -> dict[str, Any]:
    """Start the jobs, give the signal once every loader is up, wait for them; what they report."""
    for proc in procs:
        proc.start()
    ready = [Path(f"{out}.{k}.ready") for out in outs for k in range(LOADERS)]
    while not all(flag.exists() for flag in ready):
        if any(proc.exitcode not in (None, 0) for proc in procs):
            raise RuntimeError(f"a job of {variant} failed before it started")
        time.sleep(0.001)
    start_at = time.time()
    go.touch()
    for proc in procs:
        proc.join()
    jobs = [json.loads(Path(out).read_text()) for out in outs]
    if any(proc.exitcode for proc in procs) or any(code for j in jobs for code in j["exitcodes"]):
        raise RuntimeError(f"a job or loader of {variant} failed: {jobs}")
    with Cache.open(path) as cache:
        filled, written = cache.filled, cache.usage().total.written
    path.unlink()
    seconds = [max(report["finished"] for report in j["loaders"]) - start_at for j in jobs]
    return {
        "loads": sum(report["loads"] for j in jobs for report in j["loaders"]),
        "wrong": sum(report["wrong"] for j in jobs for report in j["loaders"]),
        "job_seconds": seconds,
        "seconds": max(seconds),
        "filled": filled,
        "written": written,
    }


# -- the torch layer -------------------------------------------------------------------------------


class Delayed:
    """``n`` samples ``(image, index)`` of ``delay`` seconds each, every load logged as one line of ``log``."""

    def __init__(self, n: int, delay: float, log: str | None) -> None:
        self.n, self.delay, self.log = n, delay, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[np.ndarray[Any, Any], int]:
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{os.getpid()} {index}\n".encode())
            finally:
                os.close(fd)
        time.sleep(self.delay)
        return sample(index), index


def torch_job(spec: dict[str, Any]) -> None:
    """One training job (run as ``--torch-job``): one epoch of ``ds.loader()`` with 2 workers, every sample checked."""
    from mmapcache.torch import CachedDataset

    ds = CachedDataset(Delayed(spec["n"], spec["delay"], spec["log"]), spec["path"], key=TORCH_KEY)
    loader = ds.loader(batch_size=spec["batch"], sampler=spec["order"], num_workers=LOADERS)
    Path(f"{spec['out']}.ready").touch()
    flag, deadline = Path(spec["go"]), time.monotonic() + 300
    while not flag.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no start signal within 300 s: the benchmark went away")
        time.sleep(0.0005)
    wrong = seen = 0
    for images, labels in loader:
        wrong += sum(int(images[row, 0, 0, 0]) != i % 251 for row, i in enumerate(labels.tolist()))
        seen += len(labels)
    finished = time.time()
    Path(spec["out"]).write_text(json.dumps({"finished": finished, "wrong": wrong, "seen": seen}))


def before_package(directory: Path, ref: str) -> Path:
    """The mmapcache package as it was at ``ref``, extracted into ``directory``; the directory to import it from."""
    root = directory / f"before-{ref}"
    root.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "mmapcache"], capture_output=True, check=False
    )
    if archive.returncode:
        raise SystemExit(
            f"cannot extract the torch layer at {ref} for the 'before' variant ({archive.stderr.decode().strip()}): "
            "run from a git checkout of mmapcache, pass --before REF, or --level core"
        )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def run_torch_variant(
    directory: Path, variant: str, r: int, args: dict[str, Any], roots: dict[str, Path]
) -> dict[str, Any]:
    """Both jobs through one variant of the torch layer on a fresh cache (made from ``dataset[0]``)."""
    from mmapcache.torch import CachedDataset

    n = args["n"]
    path = directory / f"torch-{variant}-{r}.mmc"
    CachedDataset(Delayed(n, 0.0, None), path, key=TORCH_KEY).cache.close()
    log, go = directory / f"torch-{variant}-{r}.log", directory / f"torch-{variant}-{r}.go"
    order = np.random.default_rng(r).permutation(n).tolist()
    outs = [directory / f"torch-{variant}-{r}-job{j}.json" for j in range(JOBS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(roots[variant]), os.environ.get("PYTHONPATH", "")])}
    specs = [
        {**args, "path": str(path), "log": str(log), "go": str(go), "order": order, "out": str(out)} for out in outs
    ]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--torch-job", json.dumps(spec)], env=env, start_new_session=True)
        for spec in specs
    ]
    try:
        ready = [Path(f"{out}.ready") for out in outs]
        while not all(flag.exists() for flag in ready):
            if any(proc.poll() not in (None, 0) for proc in procs):
                raise RuntimeError(f"a {variant} job failed before it started")
            time.sleep(0.001)
        start_at = time.time()
        go.touch()
        codes = [proc.wait(600) for proc in procs]
        if any(codes):
            raise RuntimeError(f"a {variant} job failed: exit codes {codes}")
    finally:
        for proc in procs:  # interrupted, or a job failed: no process (nor its workers) outlives the round
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    jobs = [json.loads(out.read_text()) for out in outs]
    loads = len(log.read_text().splitlines()) if log.exists() else 0
    from mmapcache import Cache

    with Cache.open(path) as cache:
        filled, written = cache.filled, cache.usage().total.written
    path.unlink()
    seconds = [j["finished"] - start_at for j in jobs]
    if any(j["seen"] != n for j in jobs):
        raise RuntimeError(f"a {variant} job saw {[j['seen'] for j in jobs]} samples of {n}")
    return {
        "loads": loads,
        "wrong": sum(j["wrong"] for j in jobs),
        "job_seconds": seconds,
        "seconds": max(seconds),
        "filled": filled,
        "written": written,
    }


def run_torch(directory: Path, settings: dict[str, Any], rounds: int, ref: str) -> dict[str, Any]:
    """The torch-level rounds, before and after interleaved; their summary."""
    roots = {"before": before_package(directory, ref), "after": REPO}
    runs, summary = interleaved(
        TORCH_VARIANTS, lambda name, r: run_torch_variant(directory, name, r, settings, roots), rounds, "torch "
    )
    ratios = [a["seconds"] / b["seconds"] for b, a in zip(runs["before"], runs["after"], strict=True)]
    rows = [
        [f"CachedDataset {name}", summary[name]["loads"], f"{summary[name]['seconds']:.2f}", summary[name]["written"]]
        for name in TORCH_VARIANTS
    ]
    print(table(["variant", "loads (both jobs)", "slower job's epoch, s", "slots written"], rows))
    ratio = statistics.median(ratios)
    print(f"torch layer after / before, slower job's first epoch: {ratio:.2f}x (target <= 0.6); per round {ratios}")
    if any(s["wrong"] for s in summary.values()):
        raise SystemExit("samples read back wrong through the torch layer")
    return {"before": ref, "summary": summary, "ratio": ratio, "ratios": ratios, "runs": runs}


def main() -> None:
    if sys.argv[1:2] == ["--torch-job"]:  # one job of the torch level, in its own process
        torch_job(json.loads(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--claims-job"]:  # a writer or filler of the claims level, in its own process
        claims_job(json.loads(sys.argv[2]))
        return
    parser = bench_parser(__doc__, quick="200 samples of 2 ms, 1 round (< 30 s)", rounds=(3, 1))
    parser.add_argument("--n", type=int, help="samples (default 2000, quick 200)")
    parser.add_argument("--delay", type=float, help="seconds to load one sample (default 0.005, quick 0.002)")
    parser.add_argument("--batch", type=int, default=32, help="samples per batch (default 32)")
    parser.add_argument("--load", choices=("sleep", "cpu"), default="sleep", help="what a load does (default sleep)")
    parser.add_argument(
        "--level",
        choices=("core", "torch", "claims", "both", "all"),
        default="all",
        help="what to measure (both: core and torch; all: and claims)",
    )
    parser.add_argument("--claims", type=int, help="slots of the claims level (default 100000, quick 5000)")
    parser.add_argument("--before", default=BEFORE, help=f"git ref of the torch layer 'before' (default {BEFORE})")
    args = parser.parse_args()
    quick: bool = args.quick
    rounds = args.rounds or (1 if quick else 3)
    settings = {
        "n": args.n or (200 if quick else 2000),
        "delay": args.delay or (0.002 if quick else 0.005),
        "batch": args.batch,
        "load": args.load,
    }
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, kernel {info['kernel']}")
    print(
        f"{JOBS} jobs x {LOADERS} loader processes, {settings['n']} samples of {settings['delay'] * 1e3:g} ms "
        f"({settings['load']}), batches of {settings['batch']}, same order; {rounds} interleaved rounds"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM runs the cleanup below too
    directory = Path(tempfile.mkdtemp(prefix="mmapcache-bench-", dir=args.dir))
    results: dict[str, Any] = {"machine": info, "quick": quick, "rounds": rounds, "settings": settings}
    try:
        if args.level in ("core", "both", "all"):
            results.update(run_core(directory, settings, rounds))
        if args.level == "claims" or args.level == "all":
            slots = args.claims or (5000 if quick else 100_000)
            results["claims"] = run_claims(directory, slots, rounds)
        if args.level in ("torch", "both", "all"):
            print(f"torch layer: {JOBS} jobs x {LOADERS} DataLoader workers, CachedDataset(check=2), ds.loader()")
            results["torch"] = run_torch(directory, settings, rounds, args.before)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    write_results("bench_singleflight", results, quick=quick, path=args.json)


def interleaved(
    names: tuple[str, ...], run_one: Any, rounds: int, label: str
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """``run_one(name, r)`` for every variant in every round (rotated order); the runs and their medians."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            runs[name].append(run_one(name, r))
            got = runs[name][-1]
            print(
                f"  round {r} {label}{name:17s} loads {got['loads']:5d}  jobs "
                f"{', '.join(f'{t:.2f}' for t in got['job_seconds'])} s"
            )
    summary = {
        name: {
            "loads": statistics.median(run["loads"] for run in runs[name]),
            "seconds": statistics.median(run["seconds"] for run in runs[name]),
            "wrong": sum(run["wrong"] for run in runs[name]),
            "written": statistics.median(run["written"] for run in runs[name]),
        }
        for name in names
    }
    return runs, summary


def run_core(directory: Path, settings: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The core-level rounds, put and get_or_load_many interleaved; their summary."""
    runs, summary = interleaved(VARIANTS, lambda name, r: run_variant(directory, name, r, settings), rounds, "")
    ratios = [f["seconds"] / p["seconds"] for p, f in zip(runs["put"], runs["get_or_load_many"], strict=True)]
    ratio = statistics.median(ratios)
    rows = [
        [name, summary[name]["loads"], f"{summary[name]['seconds']:.2f}", summary[name]["written"]] for name in VARIANTS
    ]
    print(table(["variant", "loads (all loaders)", "slower job's epoch, s", "slots written"], rows))
    print(f"single flight / put, slower job's first epoch: {ratio:.2f}x (target <= 0.6); per round {ratios}")
    wrong = sum(s["wrong"] for s in summary.values())
    if wrong:
        raise SystemExit(f"{wrong} samples read back wrong")
    return {"summary": summary, "ratio": ratio, "ratios": ratios, "runs": runs}


# -- claims at scale -------------------------------------------------------------------------------

ROW = 64  # bytes per row of the claims level
PUTS = 2000  # puts another process times per setting
SCATTERED = 1000  # slots held one apart (each its own kernel lock)


def rows_of(n: int) -> np.ndarray[Any, Any]:
    return (np.arange(n, dtype=np.int64)[:, None] * 7 + np.arange(ROW)).astype(np.uint8)


def claims_job(spec: dict[str, Any]) -> None:
    """``--claims-job``: ``puts`` (time puts into slots from ``first``) or ``fill`` (fill slots ``0 .. n - 1``)."""
    rows = rows_of(spec["slots"])
    with Cache.open(spec["path"]) as cache:
        Path(f"{spec['out']}.ready").touch()
        flag = Path(spec["go"])
        while not flag.exists():
            time.sleep(0.0005)
        if spec["kind"] == "fill":
            order = np.random.default_rng(1).permutation(spec["n"])
            if spec["via"] == "put_many":
                cache.put_many(order, {"x": rows[order]})
            else:
                cache.get_or_load_many(order, lambda idx: {"x": rows[idx]})
            Path(spec["out"]).write_text("{}")
            return
        times = []
        for i in range(spec["first"], spec["first"] + PUTS):
            start = time.perf_counter()
            cache.put(i, {"x": rows[i]})
            times.append(time.perf_counter() - start)
    Path(spec["out"]).write_text(json.dumps({"median": statistics.median(times)}))


def _claims_procs(specs: list[dict[str, Any]]) -> list[Any]:
    procs = [
        subprocess.Popen([sys.executable, __file__, "--claims-job", json.dumps(spec)], start_new_session=True)
        for spec in specs
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{spec['out']}.ready").exists() for spec in specs):
        if any(proc.poll() not in (None, 0) for proc in procs) or time.monotonic() > deadline:
            raise RuntimeError("a claims job failed before it started")
        time.sleep(0.001)
    return procs


def _put_latency(directory: Path, slots: int, setting: str, r: int) -> float:
    """Median seconds of another process's put while this process holds ``setting``'s claims (or a filler fills).

    A fresh cache of ``slots + PUTS`` slots: the claims (or the fill) take slots
    ``0 .. slots - 1``, the timed puts the others.
    """
    tag = f"claims-{setting.replace(' ', '_')}-{r}"
    path, go = directory / f"{tag}.mmc", directory / f"{tag}.go"
    Cache.open(path, {"x": Field((ROW,), "uint8")}, slots + PUTS).close()
    base = {"path": str(path), "slots": slots + PUTS, "go": str(go)}
    specs = [{**base, "kind": "puts", "first": slots, "out": str(directory / f"{tag}.puts")}]
    if setting.startswith("fill "):
        specs.append({**base, "kind": "fill", "n": slots, "via": setting[5:], "out": str(directory / f"{tag}.fill")})
    procs = _claims_procs(specs)
    try:
        with Cache.open(path) as cache:
            if setting == "claims of every slot":
                claims = cache.claim_many(np.random.default_rng(r).permutation(slots))
            elif setting == "scattered claims":
                claims = cache.claim_many(np.arange(min(SCATTERED, slots // 2)) * 2)
            else:
                claims = cache.claim_many([])
            with claims:
                go.touch()
                codes = [proc.wait(600) for proc in procs]
        if any(codes):
            raise RuntimeError(f"a claims job failed: exit codes {codes}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        path.unlink(missing_ok=True)
    return float(json.loads(Path(specs[0]["out"]).read_text())["median"])


def _load_seconds(directory: Path, slots: int, variant: str, r: int) -> float:
    """Seconds to fill every slot of a fresh cache through ``variant``."""
    path = directory / f"claims-{variant.replace(' ', '_')}-{r}.mmc"
    rows = rows_of(slots)
    order = np.random.default_rng(r).permutation(slots)
    with Cache.open(path, {"x": Field((ROW,), "uint8")}, slots) as cache:
        start = time.perf_counter()
        if variant == "put_many":
            cache.put_many(order, {"x": rows[order]})
        elif variant == "get_or_load_many":
            cache.get_or_load_many(order, lambda idx: {"x": rows[idx]})
        elif variant == "get_or_load_many in index order":
            cache.get_or_load_many(np.arange(slots), lambda idx: {"x": rows[idx]})
        else:
            with cache.claim_many(order) as claims:
                claims.put_many(claims.indices, {"x": rows[claims.indices]})
        seconds = time.perf_counter() - start
        got, hits = cache.read_many(order)
        if not hits.all() or not np.array_equal(got["x"], rows[order]):
            raise SystemExit(f"{variant}: rows read back wrong")
    path.unlink()
    return seconds


LOAD_VARIANTS = ("put_many", "get_or_load_many", "get_or_load_many in index order", "claim_many + Claims.put_many")
PUT_SETTINGS = ("idle", "claims of every slot", "scattered claims", "fill put_many", "fill get_or_load_many")


def run_claims(directory: Path, slots: int, rounds: int) -> dict[str, Any]:
    """The claims level: loads against put_many, and another writer's put latency; ratios per round, medians."""
    loads: dict[str, list[float]] = {name: [] for name in LOAD_VARIANTS}
    puts: dict[str, list[float]] = {name: [] for name in PUT_SETTINGS}
    loadavg = []
    print(f"claims: {slots} slots of {ROW} B; load average {os.getloadavg()[0]:.2f}")
    for r in range(rounds):
        for name in rotated(LOAD_VARIANTS, r):
            loads[name].append(_load_seconds(directory, slots, name, r))
        for name in rotated(PUT_SETTINGS, r):
            puts[name].append(_put_latency(directory, slots, name, r))
        loadavg.append(os.getloadavg()[0])
        print(
            f"  round {r}: "
            + ", ".join(f"{name} {loads[name][-1]:.2f} s" for name in LOAD_VARIANTS)
            + "; put "
            + ", ".join(f"{name} {puts[name][-1] * 1e6:.1f} us" for name in PUT_SETTINGS)
            + f"; load average {loadavg[-1]:.2f}"
        )
    load_ratios = {
        name: statistics.median(t / p for t, p in zip(loads[name], loads["put_many"], strict=True))
        for name in LOAD_VARIANTS
    }
    baselines = {"fill put_many": "fill put_many", "fill get_or_load_many": "fill put_many"}
    put_ratios = {
        name: statistics.median(t / b for t, b in zip(puts[name], puts[baselines.get(name, "idle")], strict=True))
        for name in PUT_SETTINGS
    }
    print(
        table(
            ["fill of every slot", "seconds (median)", "x put_many"],
            [[name, f"{statistics.median(loads[name]):.2f}", f"{load_ratios[name]:.2f}"] for name in LOAD_VARIANTS],
        )
    )
    print(
        table(
            ["another process's put, while", "us (median)", "x baseline"],
            [[name, f"{statistics.median(puts[name]) * 1e6:.1f}", f"{put_ratios[name]:.2f}"] for name in PUT_SETTINGS],
        )
    )
    print(
        f"get_or_load_many / put_many: {load_ratios['get_or_load_many']:.2f}x (target <= 2); another writer's put "
        f"while claims are held / idle: {put_ratios['claims of every slot']:.2f}x, while get_or_load_many "
        f"fills / while put_many fills: {put_ratios['fill get_or_load_many']:.2f}x (targets <= 2); load average "
        f"{statistics.median(loadavg):.2f}"
    )
    return {
        "slots": slots,
        "seconds": loads,
        "ratios": load_ratios,
        "put_seconds": puts,
        "put_ratios": put_ratios,
        "loadavg": loadavg,
    }


if __name__ == "__main__":
    main()
