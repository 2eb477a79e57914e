"""`NodeShardSampler`: every sample stays on one node for the whole run; shuffling happens within the node.

With ``DistributedSampler`` every rank draws from the whole dataset each
epoch, so every node ends up caching all of it. Here the dataset's indices are
split once into ``num_nodes`` disjoint shards (a permutation seeded by
``seed``, dealt round-robin, so sizes differ by at most one and every shard
is a fair sample of the dataset), and the ranks of a node draw a fresh
permutation of their node's shard each epoch, split among the node's local
ranks as ``DistributedSampler`` splits among all ranks. Every rank of the job
gets the same number of indices (padding by repeating, or dropping with
``drop_last``), as collective operations in DDP need.

Each rank computes only what it needs, in time and memory proportional to its
node's shard: the dealt permutation is a keyed bijection of ``range(n)``
evaluated at the node's places only (:class:`_Bijection`), never a permutation
of the whole dataset. Up to :data:`EXACT_MAX` samples, where a whole
permutation costs at most 16 MiB and a few tens of milliseconds, numpy's
seeded permutation deals the shards instead (the shards of mmapcache 0.3.0,
so the node caches it made stay warm) and shuffles each epoch. An epoch's order
is a function of (seed, epoch, position): a resumed epoch starts at any
position in O(1), with no replay.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed
import torch.utils.data

from .._region import compiled

__all__ = ["SEEDS", "NodeShardSampler", "checked_integer", "node_topology", "seed_words", "seeded_permutation"]

SEEDS = 2**64
"""Seeds and epochs are integers in ``0 .. SEEDS - 1``."""
EXACT_MAX = 2**21
"""Permutations of up to this many elements are numpy's seeded permutations; larger ones, keyed bijections."""

_ROUNDS = 6  # Feistel rounds: with halves of >= 11 bits and a full 64-bit mixer, 6 leave no measurable pattern
_CHUNK = 2**16  # positions evaluated at a time: the temporaries stay in the CPU's cache
_STATE_VERSION = 1  # bump when the order a state describes changes
_ORDER = 1  # the spawn key's first word for an epoch's order (the shards use the seed alone, as 0.3.0 did)
# What a state must agree on with the sampler loading it: otherwise its position is in another order.
_SAME = ("seed", "length", "num_nodes", "local_world_size", "shuffle", "drop_last")

Positions = np.ndarray[Any, np.dtype[np.int64]]


class NodeShardSampler(torch.utils.data.Sampler[int]):
    """A distributed sampler that keeps each sample on one node: the job's caches hold the dataset once.

    ``num_nodes``, ``node_rank``, ``local_world_size`` and ``local_rank``
    default to what the launcher says (see :func:`node_topology`). Call
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
    ``seed`` and every epoch are integers in ``0 .. 2**64 - 1``.

    :meth:`state_dict` / :meth:`load_state_dict` save and resume an epoch
    midway (torchdata's ``StatefulDataLoader`` calls them).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_nodes: int | None = None,
        node_rank: int | None = None,
        local_world_size: int | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.seed = checked_integer("seed", seed, SEEDS)
        self.num_nodes, self.node_rank, self.local_world_size, self.local_rank = node_topology(
            num_nodes=num_nodes, node_rank=node_rank, local_world_size=local_world_size, local_rank=local_rank
        )
        self.length = len(dataset)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.epoch = 0
        self.node_indices: Positions = _node_shard(
            self.length, self.num_nodes, self.node_rank, self.seed if self.shuffle else None
        )
        # Equal for every rank of the job (collectives need it): from the smallest or largest shard.
        smallest, largest = self.length // self.num_nodes, -(-self.length // self.num_nodes)
        if self.drop_last:
            self.num_samples = smallest // self.local_world_size
        else:
            self.num_samples = math.ceil(largest / self.local_world_size)
        if self.num_samples == 0 and self.length:
            raise ValueError(
                f"with drop_last=True, a node's shard of {smallest} samples leaves nothing for each of its "
                f"{self.local_world_size} ranks; use drop_last=False or fewer ranks"
            )
        self._cursor: _Cursor | None = None  # the last iterator's place
        self._resume: tuple[int, int] | None = None  # (epoch, position) loaded, for the next iterator

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation :meth:`__iter__` draws (the same on every rank of a node)."""
        self.epoch = checked_integer("epoch", epoch, SEEDS)
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None  # another epoch than the loaded state's starts from its beginning

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return self._draw(self._begin())

    def batches(self, size: int) -> Iterator[Positions]:
        """:meth:`__iter__`'s indices as arrays of ``size`` (the last one shorter), in the same order.

        What ``CachedDataset.loader()`` reads its batches from (no list of ints a batch). The
        state counts a batch's indices as it is taken, as it counts ints taken from :meth:`__iter__`.
        """
        size = checked_integer("size", size, SEEDS, start=1)
        cursor = self._begin()
        order = self._order(cursor.epoch)
        chunk_size = max(size, _CHUNK - _CHUNK % size)  # whole batches a chunk
        while cursor.end < self.num_samples:
            start = cursor.end
            chunk = self._indices(order, start, min(start + chunk_size, self.num_samples))
            for at in range(0, len(chunk), size):
                cursor.end = start + min(at + size, len(chunk))
                yield chunk[at : at + size]

    def _begin(self) -> _Cursor:
        """A new iterator's place: the loaded state's, else the start of :attr:`epoch`."""
        start = 0
        if self._resume is not None:
            start = self._resume[1]
            self._resume = None
        cursor = _Cursor(self.epoch, start)
        self._cursor = cursor
        return cursor

    def _draw(self, cursor: _Cursor) -> Iterator[int]:
        """This rank's indices of ``cursor.epoch`` from ``cursor.end`` on, computed a chunk at a time."""
        order = self._order(cursor.epoch)
        while cursor.end < self.num_samples:
            start = cursor.end
            stop = min(start + _CHUNK, self.num_samples)
            chunk = self._indices(order, start, stop).tolist()
            cursor.rest, cursor.end = iter(chunk), stop
            yield from cursor.rest

    def _order(self, epoch: int) -> Callable[[Positions | slice], Positions] | None:
        """The epoch's permutation of the node's shard (``None``: in order)."""
        size = len(self.node_indices)
        if not self.shuffle or size < 2:
            return None
        return seeded_permutation(size, np.random.SeedSequence(self.seed, spawn_key=(_ORDER, *seed_words(epoch))))

    def _indices(self, order: Callable[[Positions], Positions] | None, start: int, stop: int) -> Positions:
        """This rank's indices ``start .. stop - 1`` of the epoch."""
        # The rank's places in its node's sequence for the epoch, split as DistributedSampler splits.
        places = self.local_rank + self.local_world_size * np.arange(start, stop, dtype=np.int64)
        size = len(self.node_indices)
        if size == 0:
            # Fewer samples than nodes: this node's shard is empty, yet its ranks must draw as many
            # indices as every other rank. They read samples of other shards (uncached here).
            return (self.node_rank + places) % self.length
        places %= size  # padding repeats the node's sequence from its start, as DistributedSampler does
        return self.node_indices[places if order is None else order(places)]

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler is: ``epoch`` and ``position`` (this rank's indices handed out in the epoch).

        The position is the same on every rank of a job that steps in lockstep, so one rank's state
        (rank 0's checkpoint) resumes every rank. The other keys let :meth:`load_state_dict` refuse a
        state of another dataset length, seed or topology. A loader that prefetches (``num_workers > 0``)
        has taken more indices than the training loop consumed: torchdata's ``StatefulDataLoader``
        saves the state as of the last batch it returned; with a plain ``DataLoader``, set
        ``position`` to the batches consumed times the batch size.
        """
        epoch, position = self._where()
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "position": position,
            "length": self.length,
            "num_nodes": self.num_nodes,
            "local_world_size": self.local_world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def _where(self) -> tuple[int, int]:
        if self._resume is not None:
            return self._resume
        cursor = self._cursor
        if cursor is not None and cursor.epoch == self.epoch:
            return cursor.epoch, cursor.position
        return self.epoch, 0

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iterator continues the saved epoch at the saved position.

        Sets :attr:`epoch`. A state saved at the end of an epoch resumes at the start of the
        next. Raises ``ValueError`` for a state of another dataset length, seed or topology, or
        one that is not a state of this sampler, and changes nothing then.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"a NodeShardSampler state is a dict from state_dict(), not {type(state).__name__}")
        expected = ("version", "epoch", "position", *_SAME)
        missing = [key for key in expected if key not in state]
        if missing:
            raise ValueError(
                f"not a NodeShardSampler state: it lacks {missing} (state_dict() gives the keys {list(expected)})"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"the state is of version {state['version']!r}, and this mmapcache reads version {_STATE_VERSION}: "
                "its order is not this version's; start the epoch afresh (set_epoch) instead of loading it"
            )
        here = {key: getattr(self, key) for key in _SAME}
        differ = {key: (state[key], value) for key, value in here.items() if state[key] != value}
        if differ:
            saved = ", ".join(f"{key}={old!r}" for key, (old, _) in differ.items())
            ours = ", ".join(f"{key}={new!r}" for key, (_, new) in differ.items())
            raise ValueError(
                f"the state was saved by a NodeShardSampler with {saved}, but this one has {ours}: the saved position "
                "is in another order. Resume with the same dataset, seed and topology (num_nodes, local_world_size), "
                "or start the epoch afresh (set_epoch) instead of loading the state"
            )
        epoch = checked_integer("the state's epoch", state["epoch"], SEEDS)
        position = checked_integer("the state's position", state["position"], self.num_samples + 1)
        if position == self.num_samples and self.num_samples and epoch + 1 < SEEDS:
            epoch, position = epoch + 1, 0  # the epoch was over
        self.epoch = epoch
        self._resume = (epoch, position)

    def __repr__(self) -> str:
        return (
            f"NodeShardSampler(node {self.node_rank} of {self.num_nodes}, local rank {self.local_rank} of "
            f"{self.local_world_size}, {len(self.node_indices)} indices on the node, {self.num_samples} per rank)"
        )


class _Cursor:
    """Where one iterator of a sampler is: its epoch, and how many of the rank's indices it handed out."""

    __slots__ = ("end", "epoch", "rest")

    def __init__(self, epoch: int, start: int) -> None:
        self.epoch = epoch
        self.end = start  # the position after the current chunk
        self.rest: Iterator[int] = iter(())  # what the current chunk has left

    @property
    def position(self) -> int:
        return self.end - operator.length_hint(self.rest)


def _node_shard(length: int, num_nodes: int, node_rank: int, seed: int | None) -> Positions:
    """The node's shard, sorted: places ``node_rank, node_rank + num_nodes, ...`` of the dealt permutation.

    ``seed`` ``None``: no permutation (``shuffle=False``). In O(shard) time and memory above
    :data:`EXACT_MAX` samples.
    """
    if seed is None or num_nodes == 1:
        return np.arange(node_rank, length, num_nodes, dtype=np.int64)  # one node: its shard is everything
    permutation = seeded_permutation(length, np.random.SeedSequence(seed))
    shard = np.empty(len(range(node_rank, length, num_nodes)), np.int64)
    for start in range(0, len(shard), _CHUNK):
        stop = min(start + _CHUNK, len(shard))
        shard[start:stop] = permutation(
            np.arange(node_rank + start * num_nodes, node_rank + stop * num_nodes, num_nodes, dtype=np.int64)
        )
    shard.sort()
    return shard


def seeded_permutation(n: int, key: np.random.SeedSequence) -> Callable[[Positions | slice], Positions]:
    """A random permutation of ``range(n)`` seeded by ``key``, as a function of positions (an array, or a
    ``slice`` of consecutive ones: a view of the permutation held whole).

    Up to :data:`EXACT_MAX`: numpy's permutation (``default_rng(seed).permutation(n)`` for a
    ``SeedSequence(seed)``), held whole — computed by the compiled ``permute`` when it is there
    (the same permutation, its draws inlined: a third of the time). Above: a :class:`_Bijection`,
    held as its round keys.
    """
    if n <= EXACT_MAX:
        bits = np.random.PCG64(key)
        native = compiled()
        if native is None:
            order: Positions = np.random.Generator(bits).permutation(n)
        else:
            state = bits.state
            order = np.empty(n, np.int64)
            native.permute(
                state["state"]["state"], state["state"]["inc"], state["has_uint32"], state["uinteger"], order
            )
        return order.__getitem__
    return _Bijection(n, key.generate_state(_ROUNDS, np.uint64).tolist())


def seed_words(value: int) -> tuple[int, int]:
    """A 64-bit value as two 32-bit words: a spawn key of fixed layout for every value."""
    return value & 0xFFFFFFFF, value >> 32


_U64 = np.uint64
_MIX1, _MIX2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_SHIFT1, _SHIFT2, _SHIFT3 = _U64(30), _U64(27), _U64(31)


class _Bijection:
    """A keyed permutation of ``range(n)``, evaluated at any positions in time proportional to their number.

    A Feistel network permutes the ``b``-bit integers (``2**b >= n``, ``b >= 2``): a value is
    split into a left half of ``b // 2`` bits and a right half of the rest; each round maps
    ``(left, right)`` to ``(right, left ^ F(right ^ key))``, truncated to the left half's width
    (the widths swap every round; after an even number of rounds they are back), with
    splitmix64's finalizer as ``F`` and a 64-bit key per round. Each round is invertible
    whatever ``F`` is, so the network is a permutation of ``range(2**b)``. *Cycle walking*
    restricts it to ``range(n)``: a value ``>= n`` is sent through the network again until it
    lands below ``n``; this is a permutation of ``range(n)`` (it follows each cycle of the
    network to its next element below ``n``), reached in under 2 passes on average since
    ``2**b < 2n``.
    """

    def __init__(self, n: int, keys: list[int]) -> None:
        if len(keys) % 2:
            raise ValueError("a Feistel network with an odd number of rounds leaves its halves swapped")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.left, self.right = bits // 2, bits - bits // 2
        self.keys = [_U64(key) for key in keys]

    def __call__(self, positions: Positions | slice) -> Positions:
        if isinstance(positions, slice):
            positions = np.arange(positions.start, positions.stop, dtype=np.int64)
        out = self._network(positions.astype(np.uint64))
        limit = _U64(self.n)
        walking = np.flatnonzero(out >= limit)
        while walking.size:
            again = self._network(out[walking])
            out[walking] = again
            walking = walking[again >= limit]
        return out.astype(np.int64)

    def _network(self, x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
        width_left, width_right = self.left, self.right
        left, right = x >> _U64(width_right), x & _U64((1 << width_right) - 1)
        for key in self.keys:
            mixed = right ^ key
            mixed ^= mixed >> _SHIFT1
            mixed *= _MIX1
            mixed ^= mixed >> _SHIFT2
            mixed *= _MIX2
            mixed ^= mixed >> _SHIFT3
            mixed &= _U64((1 << width_left) - 1)
            mixed ^= left
            left, right = right, mixed
            width_left, width_right = width_right, width_left
        out: np.ndarray[Any, np.dtype[np.uint64]] = (left << _U64(width_right)) | right
        return out


def checked_integer(name: str, value: Any, stop: int, *, start: int = 0) -> int:
    """``value`` as an ``int`` in ``start .. stop - 1``: ``TypeError`` for a non-integer, ``ValueError`` outside."""
    accepted = f"an integer from {start} to {_bound(stop - 1)}"
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be {accepted}, not {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if not start <= number < stop:
        raise ValueError(f"{name} must be {accepted}, not {number}")
    return number


def _bound(value: int) -> str:
    return "2**64 - 1" if value == SEEDS - 1 else str(value)


def node_topology(
    *,
    num_nodes: int | None = None,
    node_rank: int | None = None,
    local_world_size: int | None = None,
    local_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[int, int, int, int]:
    """``(num_nodes, node_rank, local_world_size, local_rank)``: the arguments given, else the launcher's word.

    Read, in order: torchrun (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``WORLD_SIZE``), Lightning (``LOCAL_RANK``,
    ``NODE_RANK``), SLURM (``SLURM_NNODES``, ``SLURM_NODEID``,
    ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``), then an initialised
    ``torch.distributed`` group (world size and rank). A process with none of
    these is one node of one rank. Raises ``ValueError`` naming the arguments
    to pass when what it finds does not add up.
    """
    given = {
        "num_nodes": num_nodes,
        "node_rank": node_rank,
        "local_world_size": local_world_size,
        "local_rank": local_rank,
    }
    for name, value in given.items():
        if value is not None and (isinstance(value, bool) or not hasattr(type(value), "__index__")):
            raise TypeError(f"{name} must be an integer, not {value!r} ({type(value).__name__})")
    num_nodes, node_rank, local_world_size, local_rank = (
        None if value is None else operator.index(value) for value in given.values()
    )
    env = os.environ if environ is None else environ
    world, rank = _world()
    world = world if world is not None else _int(env, "WORLD_SIZE")
    local_world_size = _first(local_world_size, _int(env, "LOCAL_WORLD_SIZE"), _tasks_per_node(env))
    local_rank = _first(local_rank, _int(env, "LOCAL_RANK"), _int(env, "SLURM_LOCALID"))
    num_nodes = _first(num_nodes, _int(env, "SLURM_NNODES"))
    node_rank = _first(node_rank, _int(env, "GROUP_RANK"), _int(env, "NODE_RANK"), _int(env, "SLURM_NODEID"))
    if world is None and all(v is None for v in (num_nodes, node_rank, local_world_size, local_rank)):
        return 1, 0, 1, 0  # not distributed: one node, one rank
    if local_world_size is None and world is not None and num_nodes:
        local_world_size = world // num_nodes
    if num_nodes is None and world is not None and local_world_size:
        num_nodes = world // local_world_size
    if node_rank is None and rank is not None and local_world_size:
        node_rank = rank // local_world_size
    if local_rank is None and rank is not None and local_world_size:
        local_rank = rank % local_world_size
    if num_nodes is None and node_rank is None and world is None:
        num_nodes, node_rank = 1, 0  # local ranks only (one node)
    found = {
        "num_nodes": num_nodes,
        "node_rank": node_rank,
        "local_world_size": local_world_size,
        "local_rank": local_rank,
    }
    unknown = [name for name, value in found.items() if value is None]
    if unknown:
        raise ValueError(
            f"NodeShardSampler cannot tell {', '.join(unknown)} from the launcher (found {found}, world size "
            f"{world}); pass {', '.join(f'{name}=' for name in unknown)} (e.g. from your job script's node count "
            "and node index)"
        )
    return _checked(int(num_nodes or 0), int(node_rank or 0), int(local_world_size or 0), int(local_rank or 0))


def _checked(num_nodes: int, node_rank: int, local_world_size: int, local_rank: int) -> tuple[int, int, int, int]:
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be at least 1")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank {node_rank} is not in 0..{num_nodes - 1} (num_nodes={num_nodes})")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local_rank {local_rank} is not in 0..{local_world_size - 1} (local_world_size={local_world_size})"
        )
    return num_nodes, node_rank, local_world_size, local_rank


def _world() -> tuple[int | None, int | None]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return None, None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    """SLURM's ``SLURM_NTASKS_PER_NODE``: ``"4"``, or ``"4(x2)"`` for 2 nodes of 4 tasks."""
    value = env.get("SLURM_NTASKS_PER_NODE")
    if not value:
        return None
    first = value.split(",")[0].split("(")[0]
    return int(first) if first.isdigit() else None


def _first(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)
