"""Real worker processes for the variable-field concurrency tests (the ``_procs.py`` harness, ragged).

A :class:`VariableWorker` is a spawned process like :class:`_procs.Worker`
(same pipe protocol, same ``call``/``send``/``recv``/``kill``/``stop``); its
server knows the ragged schema of :func:`make_fields` instead of the fixed one.

Sample data is deterministic, and so is its *shape*: what a writer using
``tag`` stores at ``index`` is :func:`make_sample` ``(index, tag)`` -- token
and image sizes as well as bytes are a pure function of both, and the ``tag``
field records the tag. A reader checks any sample on its own with
:func:`sample_problem`: a slot whose descriptor (offset, shape) came from one
put and whose bytes from another, or whose bytes lie in space that a second
writer was also handed, cannot pass.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from _procs import SPAWN, Worker, _base, _Server

from mmapcache import Cache, Field

__all__ = [
    "Encoded",
    "VariableWorker",
    "decode",
    "encode",
    "make_batch",
    "make_fields",
    "make_sample",
    "payload_nbytes",
    "sample_data",
    "sample_problem",
    "sample_shapes",
]

MAX_TOKENS = 4096
MAX_SIDE = 384


def make_fields() -> dict[str, Field]:
    """The schema: token ids of any length, a 3-channel image of any size, the writer's tag."""
    return {
        "tokens": Field((None,), "int32"),
        "image": Field((3, None, None), "uint8"),
        "tag": Field((), "int32"),
    }


def _mix(index: int, tag: int, salt: int) -> int:
    # A cheap integer hash (splitmix64's finaliser): sizes look random in (index, tag).
    z = (index * 0x9E3779B97F4A7C15 + tag * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def sample_shapes(index: int, tag: int, scale: float = 1.0) -> tuple[tuple[int], tuple[int, int, int]]:
    """The token and image shapes of the sample a writer with ``tag`` stores at ``index``.

    Zero-length tokens and zero-height or zero-width images occur too.
    ``scale`` shrinks both (a writer and its readers must agree on it).
    """
    tokens = _mix(index, tag, 1) % (int(MAX_TOKENS * scale) + 1)
    side = int(MAX_SIDE * scale) + 1
    return (tokens,), (3, _mix(index, tag, 2) % side, _mix(index, tag, 3) % side)


_WORDS = -(-max(4 * MAX_TOKENS, 3 * MAX_SIDE * MAX_SIDE) // 8)


def sample_data(index: int, tag: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``_procs.sample_data`` for sizes that vary: one random block per tag (cached), cut to ``nbytes``.

    (``_procs.sample_data`` caches a block per size, which ragged sizes defeat:
    writers would spend their time drawing random numbers instead of in put.)
    """
    words = _base(tag, _WORDS)[: -(-nbytes // 8)]
    offset = np.uint64((index + 1) * 0x9E3779B97F4A7C15 % 2**64)
    data: np.ndarray[Any, np.dtype[np.uint8]] = (words + offset).view(np.uint8)[:nbytes]
    return data


def make_sample(index: int, tag: int, scale: float = 1.0) -> dict[str, Any]:
    (tokens,), image = sample_shapes(index, tag, scale)
    return {
        "tokens": sample_data(index, tag, 4 * tokens).view(np.int32),
        "image": sample_data(index, tag + 10_000, 3 * image[1] * image[2]).reshape(image),
        "tag": tag,
    }


def payload_nbytes(index: int, tag: int, scale: float = 1.0) -> int:
    """Bytes of the variable fields of :func:`make_sample` ``(index, tag)``."""
    (tokens,), image = sample_shapes(index, tag, scale)
    return 4 * tokens + image[0] * image[1] * image[2]


def make_batch(indices: Sequence[int], tag: int, scale: float = 1.0) -> dict[str, Any]:
    """A put_many batch: variable fields as a list of arrays (one per row), ``tag`` stacked."""
    samples = [make_sample(i, tag, scale) for i in indices]
    return {
        "tokens": [s["tokens"] for s in samples],
        "image": [s["image"] for s in samples],
        "tag": np.full(len(indices), tag, np.int32),
    }


def sample_problem(index: int, sample: dict[str, Any], scale: float = 1.0) -> str | None:
    """What is wrong with ``sample`` read at ``index`` (None: exactly what its writer stored)."""
    tag = int(sample["tag"])
    want = make_sample(index, tag, scale)
    for name in ("tokens", "image"):
        got = sample[name]
        if not isinstance(got, np.ndarray):
            return f"slot {index}: {name} is a {type(got).__name__}, not an array"
        if got.dtype != want[name].dtype or got.shape != want[name].shape:
            return (
                f"slot {index} (tag {tag}): {name} is {got.dtype}{list(got.shape)}, "
                f"the put stored {want[name].dtype}{list(want[name].shape)}"
            )
        if got.tobytes() != want[name].tobytes():
            return f"slot {index} (tag {tag}): {name} holds other bytes than the put stored"
    return None


Encoded = tuple[str, tuple[int, ...], bytes]


def encode(array: np.ndarray[Any, Any]) -> Encoded:
    """An array as (dtype, shape, bytes) to send through a pipe.

    numpy's pickles before protocol 5 (multiprocessing uses 4) turn a
    non-native byte order into the native one: ``>i4`` arrives as ``int32``.
    """
    return array.dtype.str, array.shape, array.tobytes()


def decode(value: Encoded) -> np.ndarray[Any, Any]:
    dtype, shape, data = value
    array: np.ndarray[Any, Any] = np.frombuffer(data, np.dtype(dtype)).reshape(shape).copy()
    return array


# -- the worker side ------------------------------------------------------------


class _VariableServer(_Server):
    """Runs in the worker process: one open ragged cache, one operation at a time."""

    def __init__(self, conn: multiprocessing.connection.Connection, barrier: Any) -> None:
        super().__init__(conn, barrier)
        self.scale = 1.0
        self.warnings: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("mmapcache").addHandler(handler)

    def op_open_variable(
        self, path: str, length: int | None, max_bytes: int | None, scale: float, kwargs: dict[str, Any]
    ) -> int:
        """Open (or create, given ``length`` and ``max_bytes``) a cache of :func:`make_fields`."""
        if self.cache is not None:
            self.cache.close()
        self.scale = scale
        fields = make_fields() if length is not None else None
        if max_bytes is not None:
            kwargs = {**kwargs, "max_bytes": max_bytes}
        self.cache = Cache.open(path, fields, length, **kwargs)
        return self.cache.capacity

    def op_open_any(self, path: str) -> dict[str, Field]:
        """Open an existing cache of any schema by path (the Hypothesis round trips)."""
        if self.cache is not None:
            self.cache.close()
        self.cache = Cache.open(path)
        return self.cache.fields

    def sample(self, index: int, tag: int) -> dict[str, Any]:
        return make_sample(index, tag, self.scale)

    def batch(self, indices: Sequence[int], tag: int) -> dict[str, Any]:
        return make_batch(indices, tag, self.scale)

    def op_put_samples(self, samples: list[tuple[int, dict[str, Encoded]]]) -> list[bool]:
        """``put`` samples the test made (any schema; arrays as :func:`encode` gives them)."""
        cache = self.open_cache
        return [cache.put(i, {name: decode(v) for name, v in sample.items()}) for i, sample in samples]

    def op_get_samples(self, indices: list[int]) -> list[dict[str, Encoded] | None]:
        """``get`` each index (any schema; arrays as :func:`encode` gives them)."""
        cache = self.open_cache
        out: list[dict[str, Encoded] | None] = []
        for i in indices:
            sample = cache.get(i)
            out.append(None if sample is None else {name: encode(v) for name, v in sample.items()})
        return out

    def op_read_random(self, length: int, seed: int) -> dict[str, Any]:
        """Read at random (get, get_many, read_many) until the test sends anything; check every hit.

        Says "started" first. Returns how many samples were read and checked,
        in how many rounds the cache was seen partly filled, and the problems.
        """
        cache, rng, scale = self.open_cache, random.Random(seed), self.scale
        self.conn.send(("started", None))
        checked, reads, partial, bad = 0, 0, 0, []

        def check(i: int, sample: dict[str, Any]) -> None:
            nonlocal checked
            checked += 1
            problem = sample_problem(i, sample, scale)
            if problem is not None:
                bad.append(problem)

        while not self.conn.poll():
            ready = np.flatnonzero(cache.contains_many(range(length)))
            partial += 0 < len(ready) < length
            # get_many of slots seen READY: slots never go back while filling.
            picked = sorted(rng.sample(ready.tolist(), min(16, len(ready))))
            if picked:
                batch = cache.get_many(picked)
                reads += len(picked)
                for row, i in enumerate(picked):
                    check(i, {name: batch[name][row] for name in batch})
            # read_many of any indices: hits checked, misses are None in the variable lists.
            wanted = [rng.randrange(length) for _ in range(16)]
            arrays, hits = cache.read_many(wanted)
            reads += len(wanted)
            for row, (i, hit) in enumerate(zip(wanted, hits.tolist(), strict=True)):
                if hit:
                    check(i, {name: arrays[name][row] for name in arrays})
                elif arrays["tokens"][row] is not None or arrays["image"][row] is not None:
                    bad.append(f"read_many: slot {i} is a miss but its variable rows are not None")
            for _ in range(16):
                i = rng.randrange(length)
                sample = cache.get(i)
                reads += 1
                if sample is not None:
                    check(i, sample)
        self.conn.recv()
        return {"checked": checked, "reads": reads, "partial": partial, "bad": bad}

    def op_region(self) -> tuple[int, int, int] | None:
        region = self.open_cache.variable_region
        return None if region is None else (region.size, region.claimed, region.used)

    def op_warnings(self) -> list[str]:
        return list(self.warnings)


def _serve_variable(conn: multiprocessing.connection.Connection, barrier: Any) -> None:
    _VariableServer(conn, barrier).serve()


# -- the test side ----------------------------------------------------------------


class VariableWorker(Worker):
    """A spawned process running ragged-cache operations for the test; see :class:`_VariableServer`."""

    def __init__(self, *, barrier: Any = None) -> None:  # the base class's, with another server
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_serve_variable, args=(child, barrier), daemon=True)
        self.process.start()
        child.close()
        self.op = ""
