"""Property-test your cached dataset under concurrent access, with Hypothesis and real processes.

    python examples/property_test_concurrent.py                 # ~30 s, cleans up after itself
    python examples/property_test_concurrent.py --examples 200  # a longer search
    pytest examples/property_test_concurrent.py                 # the same, as a pytest test

The property a cached dataset must have is simple to state: *whatever the
processes do -- load the same samples at the same time, close, reopen, die
with kill -9 in the middle of a write -- every sample any of them gets equals
what your uncached loader returns*, and a sample, once stored, stays stored.

Hypothesis is good at finding the sequence of events that breaks a property
like this, if you let it choose the events. A ``RuleBasedStateMachine``
does exactly that: each *rule* is one thing that can happen (a worker loads a
batch, two workers load the same samples at once, a worker is killed mid-fill,
...), Hypothesis strings rules together at random, and after every step the
*invariants* compare the shared cache with a tiny model. When something
fails, Hypothesis shrinks the run to a short sequence of steps and prints it.

Mocks or threads would not test what matters here (separate address spaces,
kernel locks, a process dying between two stores), so the workers are real
processes started with the "spawn" method -- the same way DataLoader workers,
DDP ranks and other jobs reach your cache -- and they open the cache by path.

To test your own dataset, change the three marked places:

1. ``FIELDS`` / ``LENGTH``: your cache's schema and dataset size.
2. ``decode(index)``: your expensive, deterministic loading code. It is also
   the *oracle*: the cache must always give back exactly what it returns.
3. ``load(cache, indices)``: how your dataset reads through the cache (here:
   hits from the cache with ``get_many``, misses decoded and stored with
   ``put_many``). If you use ``mmapcache.torch.CachedDataset``, call it
   there instead (``CachedDataset(YourDataset(), path=..., key=...)`` in the
   worker, ``ds.__getitems__(indices)`` in ``load``) and compare its tensors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import mmapcache
from mmapcache import Cache, Field

# -- 1. your schema ---------------------------------------------------------------------------------------

FIELDS = {"image": Field((3, 64, 64), "uint8"), "label": Field((), "int64")}
LENGTH = 48
WORKERS = 3  # how many processes share the cache at once

# -- 2. your loader: the expensive, deterministic part, and the oracle ----------------------------------


def decode(index: int) -> dict[str, np.ndarray[Any, Any]]:
    """Stands in for your JPEG decode + resize, tokenizer, network fetch... Same index, same bytes."""
    rng = np.random.default_rng(index)
    return {"image": rng.integers(0, 256, (3, 64, 64), dtype=np.uint8), "label": np.int64(index % 10)}


def decode_many(indices: list[int]) -> dict[str, np.ndarray[Any, Any]]:
    samples = [decode(i) for i in indices]
    return {name: np.stack([s[name] for s in samples]) for name in FIELDS}


# -- 3. your dataset's read path through the cache ------------------------------------------------------


def load(cache: Cache, indices: list[int]) -> dict[str, np.ndarray[Any, Any]]:
    """Hits come from the cache in one gather; misses are decoded, stored, and returned as decoded.

    A tempting shortcut -- ``put_many`` the misses, then ``get_many`` all of
    ``indices`` -- fails this test within seconds: when another process won
    the race for a slot it may still be writing it, so the slot is not READY
    yet and ``get_many`` raises ``KeyError``. Return what you decoded instead.
    """
    hit = cache.contains_many(indices)
    out = {name: np.empty((len(indices), *field.fixed_shape), field.dtype) for name, field in FIELDS.items()}
    if hit.any():
        # Slots never go from READY back to not READY while processes fill,
        # so what contains_many saw READY is still READY here.
        for name, values in cache.get_many(np.asarray(indices)[hit]).items():
            out[name][hit] = values
    if not hit.all():
        misses = np.asarray(indices)[~hit].tolist()
        decoded = decode_many(misses)
        cache.put_many(misses, decoded)  # False for slots another process stored first: fine
        for name, values in decoded.items():
            out[name][~hit] = values
    return out


# -- the worker process ---------------------------------------------------------------------------------
#
# A worker is a spawned process that runs one command at a time from a pipe and
# answers ("ok", result) or ("error", exception). It holds at most one open cache.


def worker_main(conn: multiprocessing.connection.Connection) -> None:
    cache: Cache | None = None
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            return
        try:
            if command == "open":
                cache = Cache.open(args[0], FIELDS, LENGTH, verify=args[1])
                result: Any = None
            elif command == "close":
                assert cache is not None
                cache.close()
                cache = None
                result = None
            elif command == "load":
                assert cache is not None
                result = load(cache, args[0])
            elif command == "fill_then_wait_for_kill":
                # Decode first, say so, then write: the test kills us during the put_many.
                assert cache is not None
                batch = decode_many(args[0])
                conn.send(("started", None))
                cache.put_many(args[0], batch)
                result = None
            elif command == "verify":
                assert cache is not None
                result = [(p.kind, p.index) for p in cache.verify()]
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except Exception as error:
            conn.send(("error", error))


class Worker:
    """The test's side of one worker process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, args))

    def receive(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):  # a hang is a failure too, not a stuck test
            raise TimeoutError(f"worker {self.process.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise value
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def kill(self) -> None:
        """kill -9: no cleanup, no atexit, no finally blocks run in the worker."""
        if self.process.pid is not None and self.process.exitcode is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.conn.close()


# -- the state machine ------------------------------------------------------------------------------------


def assert_samples_equal(got: dict[str, np.ndarray[Any, Any]], indices: list[int]) -> None:
    """The property: whatever process returned them, samples equal the uncached loader's."""
    want = decode_many(indices)
    for name in FIELDS:
        assert np.array_equal(got[name], want[name]), f"field {name!r} of {indices} differs from decode()"


index_batches = st.lists(st.integers(0, LENGTH - 1), min_size=1, max_size=12)


class ConcurrentCacheMachine(RuleBasedStateMachine):
    """Rules: things that can happen to a cache shared by WORKERS processes. Model: slots known stored."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        # A fresh cache file for every run Hypothesis tries.
        self.path = str(directory / f"run-{time.monotonic_ns()}.mmc")
        self.workers = [Worker() for _ in range(WORKERS)]
        self.open = [False] * WORKERS
        self.stored: set[int] = set()  # the model: slots some load() has returned, so they must stay stored

    def open_workers(self) -> list[int]:
        return [w for w in range(WORKERS) if self.open[w]]

    @initialize()
    def open_all(self) -> None:
        for w in range(WORKERS):
            self.workers[w].call("open", self.path, False)
            self.open[w] = True

    # Draw the worker inside the rule (st.data()) so that only workers that
    # have the cache open are picked; preconditions disable rules that need one.

    @precondition(lambda self: any(self.open))
    @rule(data=st.data(), indices=index_batches)
    def load_batch(self, data: st.DataObject, indices: list[int]) -> None:
        w = data.draw(st.sampled_from(self.open_workers()), label="worker")
        assert_samples_equal(self.workers[w].call("load", indices), indices)
        self.stored.update(indices)

    @precondition(lambda self: sum(self.open) >= 2)
    @rule(indices=index_batches)
    def load_at_once(self, indices: list[int]) -> None:
        """Every open worker loads the same samples at the same instant: they race to store them."""
        racers = self.open_workers()
        for w in racers:
            self.workers[w].send("load", indices)
        for w in racers:
            assert_samples_equal(self.workers[w].receive(), indices)
        self.stored.update(indices)

    @precondition(lambda self: any(self.open))
    @rule(data=st.data(), verify=st.booleans())
    def reopen(self, data: st.DataObject, verify: bool) -> None:
        w = data.draw(st.sampled_from(self.open_workers()), label="worker")
        self.workers[w].call("close")
        self.workers[w].call("open", self.path, verify)

    @precondition(lambda self: not all(self.open))
    @rule(data=st.data())
    def open_one(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([w for w in range(WORKERS) if not self.open[w]]), label="worker")
        self.workers[w].call("open", self.path, False)
        self.open[w] = True

    @precondition(lambda self: any(self.open))
    @rule(data=st.data(), indices=index_batches, delay=st.floats(0, 0.002))
    def kill_while_filling(self, data: st.DataObject, indices: list[int], delay: float) -> None:
        """kill -9 a worker `delay` seconds into storing a batch; a new process takes its place."""
        w = data.draw(st.sampled_from(self.open_workers()), label="worker")
        self.workers[w].send("fill_then_wait_for_kill", indices)
        assert self.workers[w].conn.recv() == ("started", None)
        time.sleep(delay)
        self.workers[w].kill()
        self.workers[w] = Worker()
        self.open[w] = False
        # Nothing to add to the model: the invariant checks that whatever the
        # dead worker managed to store is correct, and load_batch later checks
        # that whatever it did not can still be filled.

    @precondition(lambda self: any(self.open))
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.open_workers()), label="worker")
        for kind, index in self.workers[w].call("verify"):
            # The only acceptable finding: a slot a killed worker was writing.
            assert kind == "stuck", f"verify found a {kind} problem at slot {index}"

    @invariant()
    def stored_samples_are_intact(self) -> None:
        """Seen from this (third) process: known slots stay stored, and every stored slot holds decode()'s bytes."""
        with Cache.open(self.path, readonly=True) as cache:
            cached = np.flatnonzero(cache.contains_many(range(LENGTH))).tolist()
            assert self.stored <= set(cached), f"slots {sorted(self.stored - set(cached))} were lost"
            if cached:
                assert_samples_equal(cache.get_many(cached), cached)

    def teardown(self) -> None:
        for worker in self.workers:
            worker.kill()
        if os.path.exists(self.path):
            mmapcache.remove(self.path)  # also proves no dead worker still counts as a user


def run(directory: Path, examples: int, steps: int) -> None:
    run_state_machine_as_test(  # type: ignore[no-untyped-call]  # hypothesis leaves it unannotated
        lambda: ConcurrentCacheMachine(directory),
        settings=settings(
            max_examples=examples,  # how many runs (sequences of steps) to try
            stateful_step_count=steps,  # at most this many steps per run
            deadline=None,  # steps start processes; their time varies
            database=None,  # don't write a .hypothesis/ directory next to your code
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_concurrent_access(tmp_path: Path) -> None:
    """The same check, for ``pytest examples/property_test_concurrent.py``."""
    run(tmp_path, examples=8, steps=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=10, help="runs for Hypothesis to try (default 10)")
    parser.add_argument("--steps", type=int, default=25, help="steps per run (default 25)")
    args = parser.parse_args()
    start = time.perf_counter()
    # /dev/shm when there is one: that is where caches live; the directory goes at the end.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="mmapcache-proptest-", dir=shm) as directory:
        run(Path(directory), args.examples, args.steps)
    print(
        f"ok: {args.examples} runs of up to {args.steps} steps, {WORKERS} processes sharing one cache each, "
        f"in {time.perf_counter() - start:.1f} s: every sample equal to decode(), nothing lost"
    )


if __name__ == "__main__":
    main()
