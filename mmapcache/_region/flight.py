"""Single flight: each sample is loaded once per node, however many processes miss it together.

``Cache`` holds a :class:`SingleFlight` per open handle and delegates its
verbs to it (``get_or_load_many``, ``get_or_load``, ``claim_many``,
``wait_for``); the handle's :class:`Flight` records which thread holds which
slot and the mean load time. Reads go through the mapping's views, stores
through the handle's one writer (``_region/writer.py``): the flight never calls
back into ``Cache``.

A process that misses a slot **holds** it before loading its sample: the kernel
record lock on the slot's state byte that every fill takes (``_region/slots.py``),
taken *before* the load instead of just before the copy. Another process that
misses the same slot finds it held and waits for it to become READY instead of
loading it too. The rules, and why they are enough:

1. **Hold without waiting, load, store, let go.** Holds are taken with a
   non-blocking lock, a few slots at a time (about ``CHUNK_SECONDS`` of loading,
   at most ``MAX_CHUNK`` slots), just before those slots are loaded, a lock
   call per run of consecutive slots (``SlotTable.hold_many``); they are let
   go once their samples are published, a run at a time (a published slot is
   READY: nobody waits for it), or when the load raises. Two processes walking
   the same batch therefore share it: each holds the next free slots while the
   other loads.
2. **Never wait while holding.** A thread waits only once it holds no slot
   (:meth:`Flight.wait` refuses otherwise). Every held slot thus belongs to a
   thread that is loading, not waiting; a load that ends lets its slots go, so
   no cycle of waits can form: two processes holding overlapping batches in
   opposite orders cannot deadlock.
3. **Every wait is bounded.** A waiter polls the state byte (READY: read it)
   and the lock (free but not READY: the holder died — the kernel dropped its
   lock — or its load failed; the waiter now holds the slot and loads it
   itself). Past its deadline it stops waiting and loads the sample itself;
   the fill then stores it only if the slot is still free, so nothing is
   stored twice and nothing hangs.
4. **Wait only when it pays.** A process measures its mean load time per
   sample; when that is below ``CHEAP_LOAD`` seconds, loading again costs
   less than waiting, and a held slot is loaded again rather than waited for.

Threads of one process share a handle's open file description, and with it
every lock: the kernel cannot tell them apart. A :class:`Flight` therefore
also records which thread holds which slot, and a thread that finds a slot
held by another thread of its process waits for it like for another process.

A forked child inherits the parent's description *and* this record; the
parent's holds stay the parent's. The child starts with an empty record (its
handle reopened its descriptor, see ``_region/handle.py``), and a :class:`Claims`
taken in the parent refuses to store in the child.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._field import Field
from .gathers import empty_aligned
from .handle import Handle, closed_error
from .indices import check_index, index_array
from .jagged import Jagged, rows_like
from .slots import READY, SlotTable, runs
from .values import coerce_batch
from .variable import text_value
from .writer import Writer, readonly_error

if TYPE_CHECKING:
    from .mapped import Mapped

__all__ = [
    "CHEAP_LOAD",
    "CHUNK_SECONDS",
    "HELD_HERE",
    "MAX_CHUNK",
    "READY_NOW",
    "TIMED_OUT",
    "WAIT_TIMEOUT",
    "Claims",
    "Flight",
    "SingleFlight",
    "as_batch",
    "check_flight",
    "check_timeout",
]

WAIT_TIMEOUT = 10.0  # seconds a call waits at most for samples other processes are loading
CHEAP_LOAD = 0.0005  # a mean load below this (seconds per sample) is repeated rather than waited for
CHUNK_SECONDS = 0.01  # slots held together: about this much loading, so that concurrent loaders share a batch
MAX_CHUNK = 64  # and at most this many: every kernel lock call walks the locks held on the file

READY_NOW, HELD_HERE, TIMED_OUT = range(3)  # what a wait for one slot ended with

_FIRST_POLL = 50e-6
_MAX_POLL = 0.005


class Flight:
    """One handle's holds in this process: which thread holds which slot, and its mean load time."""

    __slots__ = ("_lock", "_owners", "_pid", "_samples", "_seconds", "_threads")

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._owners: dict[int, int] = {}  # slot -> the thread holding it
        self._threads: dict[int, int] = {}  # thread -> how many slots it holds
        self._seconds = 0.0
        self._samples = 0

    def _here(self) -> threading.Lock:
        """The record lock; after a fork, the record emptied first (the parent's holds are not ours)."""
        if self._pid != os.getpid():
            # The parent's lock may have been held by a thread that does not exist here.
            self._lock = threading.Lock()
            self._owners, self._threads, self._pid = {}, {}, os.getpid()
        return self._lock

    @property
    def pid(self) -> int:
        return self._pid

    # -- holding ------------------------------------------------------------------

    def hold(self, handle: Handle, slots: SlotTable, index: int) -> bool:
        """Hold slot ``index`` for this thread without waiting; False if it is READY or held elsewhere."""
        me = threading.get_ident()
        with self._here():
            if index in self._owners:
                return False
            with handle.write_lock:
                handle.check_usable(writing=True)
                if not slots.hold(index):
                    return False
            self._owners[index] = me
            self._threads[me] = self._threads.get(me, 0) + 1
        return True

    def hold_many(self, handle: Handle, slots: SlotTable, indices: Sequence[int]) -> list[int]:
        """:meth:`hold` of distinct ``indices``, a lock call per run of consecutive slots; those held, in order."""
        me = threading.get_ident()
        with self._here():
            owners = self._owners
            free = []
            for i in indices:  # loops, not comprehensions: one frame less on every load
                if i not in owners:
                    free.append(i)
            if not free:
                return []
            with handle.write_lock:
                handle.check_usable(writing=True)
                got = set(slots.hold_many(free))
            mine = []
            for i in free:
                if i in got:
                    mine.append(i)
                    owners[i] = me
            if mine:
                self._threads[me] = self._threads.get(me, 0) + len(mine)
        return mine

    def let_go(self, handle: Handle, slots: SlotTable, indices: Iterable[int]) -> None:
        """Forget this thread's holds of ``indices`` and release their locks, a run of consecutive slots per call."""
        me = threading.get_ident()
        with self._here():
            owners = self._owners
            mine = []
            for i in indices:  # a loop, not a comprehension: one frame less on every store
                if owners.get(i) == me:
                    mine.append(i)
            if not mine:
                return
            with handle.write_lock:
                if handle.fd >= 0:  # closed: the kernel released every lock with the descriptor
                    slots.release_many(mine)
            for i in mine:
                del self._owners[i]
            left = self._threads[me] - len(mine)
            if left:
                self._threads[me] = left
            else:
                del self._threads[me]

    def forget(self, indices: Iterable[int]) -> None:
        """Forget this thread's holds of ``indices`` whose locks are gone already (a closed descriptor)."""
        me = threading.get_ident()
        with self._here():
            for i in indices:
                if self._owners.get(i) == me:
                    del self._owners[i]
                    self._threads[me] -= 1
            if not self._threads.get(me, 1):
                del self._threads[me]

    def holding(self) -> int:
        """How many slots the calling thread holds."""
        with self._here():
            return self._threads.get(threading.get_ident(), 0)

    def held_by_me(self, index: int) -> bool:
        with self._here():
            return self._owners.get(index) == threading.get_ident()

    def held_here(self, index: int) -> bool:
        """Whether a thread of this process holds slot ``index`` through this handle."""
        with self._here():
            return index in self._owners

    # -- waiting ------------------------------------------------------------------

    def wait(self, handle: Handle, slots: SlotTable, index: int, deadline: float) -> int:
        """Wait for slot ``index`` until it is READY, or free (then hold it), or ``deadline`` passes.

        Returns ``READY_NOW``, ``HELD_HERE`` (this thread now holds it: its
        holder died or gave it up, load it) or ``TIMED_OUT``. Looks once even
        when the deadline has passed.
        """
        held = self.holding()
        if held:
            raise RuntimeError(
                f"this thread holds {held} slot(s) of {handle.path} and may not wait for another: store or "
                "release them first (Claims.put_many, Claims.release). A process that waits while holding a "
                "slot can deadlock with one that waits for that slot"
            )
        states = slots.state_bytes
        delay = _FIRST_POLL
        most = min(_MAX_POLL, max(0.0005, (self.mean_load_time() or 0.0) / 8))
        while True:
            if states[index] == READY:
                return READY_NOW
            if self.hold(handle, slots, index):
                return HELD_HERE
            now = time.monotonic()
            if now >= deadline:
                return TIMED_OUT
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, most)

    # -- the load-time meter ------------------------------------------------------

    def timed(self, load: Callable[[list[int]], Any], indices: list[int]) -> Any:
        """``load(indices)``, its time added to the mean load time."""
        start = time.perf_counter()
        result = load(indices)
        seconds = time.perf_counter() - start
        with self._here():
            self._seconds += seconds
            self._samples += len(indices)
        return result

    def mean_load_time(self) -> float | None:
        """Seconds per sample of this handle's loads (in this process and, after a fork, its parent's)."""
        return self._seconds / self._samples if self._samples else None

    def worth_waiting(self) -> bool:
        mean = self.mean_load_time()
        return mean is None or mean >= CHEAP_LOAD

    def chunk(self, left: int) -> int:
        """How many slots to hold for the next load: about ``CHUNK_SECONDS`` of loading (1 before a measure).

        At most ``MAX_CHUNK``: a claim is a kernel record lock, and the kernel
        walks every lock held on the file at each lock call (any process's).
        Consecutive slots merge into one (see ``_region/slots.py``), scattered
        ones do not: thousands of scattered slots held at once — cheap loads
        of a large shuffled batch — would cost milliseconds per lock call
        here and slow every other writer.
        """
        if not self._samples:
            return 1
        mean = self._seconds / self._samples  # mean_load_time()
        return max(1, min(left, MAX_CHUNK, int(CHUNK_SECONDS / mean) if mean > 0 else left))


class SingleFlight:
    """A handle's single flight over its open mapping: the verbs ``Cache`` delegates to, and the holds they make.

    ``Cache`` holds one per open handle (and drops it on ``close``). It
    reaches the file through the mapping's views and stores through the
    handle's :class:`~mmapcache._region.writer.Writer`; it never calls back into the
    cache. ``readonly``: it holds and stores nothing (a readonly handle loads
    every miss itself).
    """

    __slots__ = ("capacity", "fields", "flight", "handle", "length", "mapped", "readonly", "verify", "writer")

    def __init__(self, flight: Flight, writer: Writer, *, verify: bool) -> None:
        self.flight, self.writer, self.verify = flight, writer, verify
        self.handle, self.mapped, self.fields = writer.handle, writer.mapped, writer.fields
        self.length, self.capacity, self.readonly = writer.length, writer.capacity, writer.readonly

    # -- the verbs ----------------------------------------------------------------

    def get_or_load_many(
        self,
        indices: Any,
        load: Callable[[list[int]], Any],
        *,
        out: dict[str, np.ndarray[Any, Any]] | None = None,
        timeout: float = WAIT_TIMEOUT,
        wait: bool | None = None,
        chunk: int | None = None,
    ) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]]]:
        """:meth:`Cache.get_or_load_many <mmapcache.Cache.get_or_load_many>`: the rules in this module's docstring."""
        seconds = check_flight(load, timeout, wait, chunk)
        idx = index_array(indices, self.length)
        batch, hits = self.read(idx, out)
        batch, loaded, _ = _get_or_load_many(
            self, idx, batch, hits, load, timeout=seconds, wait=wait, chunk=chunk, coerced=False
        )
        return batch, loaded

    def load_misses(
        self,
        idx: np.ndarray[Any, Any],
        batch: dict[str, Any],
        hits: np.ndarray[Any, np.dtype[np.bool_]],
        load: Callable[[list[int]], list[Any]],
    ) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]], int]:
        """The misses of a read the caller made, loaded by the rules of this module: ``(batch, loaded, written)``.

        The read is handed on, not made again: ``idx`` validated, ``batch`` and
        ``hits`` as :meth:`read` returns them (uncounted); its rows are filled
        in place. ``load(indices)`` returns their samples in storage form —
        per field, in field order, what :func:`~mmapcache._region.values.coerce_batch`
        makes — stored as they are, not converted or checked again. ``written``:
        the slots this call stored. The defaults of :meth:`get_or_load_many`
        (wait when it pays, at most ``WAIT_TIMEOUT``).
        """
        return _get_or_load_many(
            self, idx, batch, hits, load, timeout=WAIT_TIMEOUT, wait=None, chunk=None, coerced=True
        )

    def get_or_load(
        self, index: int, load: Callable[[int], Any], *, timeout: float = WAIT_TIMEOUT, wait: bool | None = None
    ) -> dict[str, Any]:
        """:meth:`Cache.get_or_load <mmapcache.Cache.get_or_load>`."""
        i = check_index(index, self.length)
        if load is None or not callable(load):
            raise TypeError(f"load must be a function of an index, not {type(load).__name__}")
        batch, _ = self.get_or_load_many([i], lambda idx: [load(idx[0])], timeout=timeout, wait=wait, chunk=1)
        return {name: values[0, ...] if isinstance(values, np.ndarray) else values[0] for name, values in batch.items()}

    def claim_many(self, indices: Any) -> Claims:
        """:meth:`Cache.claim_many <mmapcache.Cache.claim_many>`: hold what is cacheable and free."""
        self._writable("claim_many")
        idx = index_array(indices, self.length)
        return _claim(self, idx[idx < self.capacity])

    def wait_for(self, indices: Any, *, timeout: float = WAIT_TIMEOUT) -> Claims:
        """:meth:`Cache.wait_for <mmapcache.Cache.wait_for>`."""
        self._writable("wait_for")
        seconds = check_timeout(timeout)
        idx = index_array(indices, self.length)
        return _wait_for(self, idx[idx < self.capacity], seconds)

    # -- what the rules are made of -----------------------------------------------

    def read(
        self, idx: np.ndarray[Any, Any], out: dict[str, np.ndarray[Any, Any]] | None = None
    ) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]]]:
        """What is cached of validated ``idx`` (``Cache.read_many`` with ``count=False``)."""
        mapped = self._live()
        if out is None:
            out = {name: empty_aligned((len(idx), *array.shape[1:]), array.dtype) for name, array in mapped.items}
        return mapped.read(idx, out, self.capacity, self.length, self.verify)

    def _writable(self, verb: str) -> None:
        self._live()
        if self.readonly:
            raise readonly_error(self.handle.path, verb)

    def _live(self) -> Mapped:
        if self.handle.fd < 0:
            raise closed_error(self.handle.path)
        return self.mapped

    def can_hold(self) -> bool:
        return not self.readonly and self.handle.refused is None

    def hold(self, index: int) -> bool:
        return self.flight.hold(self.handle, self._live().slots, index)

    def hold_many(self, indices: Sequence[int]) -> list[int]:
        return self.flight.hold_many(self.handle, self._live().slots, indices)

    def wait_one(self, index: int, deadline: float) -> int:
        return self.flight.wait(self.handle, self._live().slots, index, deadline)

    def put_coerced(
        self, idx: np.ndarray[Any, Any], arrays: list[Any], *, held: bool = True
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Store coerced rows at ``idx``: slots this thread holds, or free ones (``held=False``).

        Held ones are stored under their locks and forgotten by the flight, their
        locks kept: the :class:`Claims` that holds them lets go of them (see
        :meth:`Claims.put_many`). Free ones that a thread of this process holds
        are left to it.
        """
        if not held:
            flight = self.flight
            rows = np.array([row for row, i in enumerate(idx.tolist()) if not flight.held_here(i)], np.intp)
            return self.writer.put_many(idx, arrays, rows=rows, coerced=True)
        # A batch refused, or a store that raises, leaves the slots held: the claims' owner lets them go.
        stored = self.writer.put_many(idx, arrays, coerced=True, held=True)
        self.flight.forget(idx.tolist())
        return stored

    def unlock(self, indices: Iterable[int]) -> None:
        """Let go of the kernel locks of slots this flight no longer records (stored, or never held)."""
        with self.handle.write_lock:
            if self.handle.fd >= 0:  # closed: the kernel released every lock with the descriptor
                self.mapped.slots.release_many(indices)

    def release(self, indices: list[int]) -> None:
        if self.handle.fd < 0:  # closed: the descriptor took every lock with it
            self.flight.forget(indices)
            return
        self.flight.let_go(self.handle, self.mapped.slots, indices)


class Claims:
    """Slots this thread holds to load their samples: store them with :meth:`put_many`, or let them go.

    Returned by :meth:`Cache.claim_many <mmapcache.Cache.claim_many>` and
    :meth:`Cache.wait_for <mmapcache.Cache.wait_for>`. A context manager:
    leaving the ``with`` block lets go of every slot not stored yet (also when
    the load raised), so that a process waiting for one takes it over. A
    process that dies lets go of its slots too (the kernel drops its locks).
    Only the thread and process that took the claims may store them: in a
    forked child, :meth:`put_many` raises and :meth:`release` does nothing
    (the parent still holds them).
    """

    __slots__ = ("_bound", "_firsts", "_kept", "_left", "_pid", "_runs", "_thread", "held", "indices")

    def __init__(self, bound: SingleFlight, indices: Sequence[int], held: Sequence[int] = ()) -> None:
        self._bound = bound
        self._pid = os.getpid()
        self._thread = threading.get_ident()
        #: The slots held (each once, in the order asked for): load these, then :meth:`put_many` them.
        self.indices: np.ndarray[Any, np.dtype[np.intp]] = np.asarray(indices, np.intp)
        #: Slots among those asked for that another process or thread was loading (not held here).
        self.held: np.ndarray[Any, np.dtype[np.intp]] = np.asarray(held, np.intp)
        # The runs of consecutive slots held (each one kernel lock), how many slots of each are not
        # stored yet, and the stored slots whose lock is kept until their run is done (see put_many).
        self._runs = runs(indices)
        self._firsts = [first for first, _ in self._runs]
        self._left = [last - first + 1 for first, last in self._runs]
        self._kept: set[int] = set()

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        path = str(self._bound.handle.path)
        return f"<Claims of {len(self.indices)} slots of {path!r}, {len(self.held)} held elsewhere>"

    def put_many(self, indices: Any, batch: Mapping[str, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Store row ``k`` of ``batch`` at ``indices[k]`` (slots these claims hold), and publish each.

        ``batch`` is what :meth:`Cache.put_many <mmapcache.Cache.put_many>`
        takes. Returns which rows were stored (False only for a variable value
        that found no room). A bad batch raises before anything is stored; the
        slots stay held.

        A stored slot is READY, and no process waits for it any more; its
        lock is let go of with the rest of its run of consecutive slots, once
        every one of them is stored (or at :meth:`release`): letting go of
        slots from the middle of a run would split its kernel lock into
        pieces, and every lock call on the file walks them all.
        """
        self._check_owner()
        idx = np.asarray(indices, np.intp).reshape(-1)
        strangers = [i for i in idx.tolist() if not (self._mine(i) and self._bound.flight.held_by_me(i))]
        if strangers:
            raise ValueError(
                f"indices {strangers[:10]} are not held by these claims (held: {self.indices[:10].tolist()}"
                f"{', ...' if len(self.indices) > 10 else ''}): store only the slots you claimed"
            )
        bound = self._bound
        return self.store(idx, coerce_batch(batch, bound.fields, len(idx)))

    def _mine(self, index: int) -> bool:
        """Whether ``index`` is one of the slots these claims took (stored or not)."""
        k = bisect.bisect_right(self._firsts, index) - 1
        return k >= 0 and index <= self._runs[k][1]

    def store(self, idx: np.ndarray[Any, Any], arrays: list[Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """:meth:`put_many` of coerced rows at slots held here; the locks let go of as it says."""
        stored = self._bound.put_coerced(idx, arrays)
        done = dict.fromkeys(idx.tolist(), False)
        for i, row_stored in zip(idx.tolist(), stored.tolist(), strict=True):
            done[i] = done[i] or row_stored
        free = [i for i, kept in done.items() if not kept]  # not stored: let go now, a miss for the next one
        kept, left, firsts = self._kept, self._left, self._firsts
        for i in done:
            k = bisect.bisect_right(firsts, i) - 1
            left[k] -= 1
            if done[i]:
                kept.add(i)
            if not left[k]:
                first, last = self._runs[k]
                finished = [j for j in range(first, last + 1) if j in kept]
                kept.difference_update(finished)
                free += finished
        if free:
            self._bound.unlock(free)
        return stored

    def release(self) -> None:
        """Let go of every slot not stored yet (idempotent); nothing is stored. A no-op in a forked child."""
        if self._pid != os.getpid() or self._thread != threading.get_ident():
            return
        self._bound.release(self.indices.tolist())
        if self._kept:
            kept, self._kept = self._kept, set()
            self._bound.unlock(kept)

    def _check_owner(self) -> None:
        if self._pid != os.getpid():
            raise RuntimeError(
                f"these claims on {self._bound.handle.path} were taken by process {self._pid}; a forked child cannot "
                "store through them (the parent still holds the slots). Claim again in the child "
                "(cache.claim_many) or use cache.get_or_load_many"
            )
        if self._thread != threading.get_ident():
            raise RuntimeError("claims belong to the thread that took them: store them from that thread")

    def __enter__(self) -> Claims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def as_batch(result: Any, names: Sequence[str], count: int) -> Mapping[str, Any]:
    """What a ``load`` returned as a batch ``{field: rows}``: a batch as it is, or a list of ``count`` samples."""
    if isinstance(result, Mapping):
        return result
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        raise TypeError(
            f"load must return a batch {{field: rows}} or a list of {count} samples {{field: value}}, "
            f"not {type(result).__name__}"
        )
    if len(result) != count:
        raise ValueError(f"load returned {len(result)} samples for {count} indices: return one per index, in order")
    for sample in result:
        if not isinstance(sample, Mapping):
            raise TypeError(f"load returned a list holding {type(sample).__name__}: each sample must be a mapping")
        if sample.keys() != set(names):
            raise ValueError(f"load returned a sample with the fields {list(sample)}; the cache has {list(names)}")
    return {name: [sample[name] for sample in result] for name in names}


def _get_or_load_many(
    single: SingleFlight,
    idx: np.ndarray[Any, Any],
    batch: dict[str, Any],
    hits: np.ndarray[Any, Any],
    load: Callable[[list[int]], Any],
    *,
    timeout: float,
    wait: bool | None,
    chunk: int | None,
    coerced: bool,
) -> tuple[dict[str, Any], np.ndarray[Any, np.dtype[np.bool_]], int]:
    """:meth:`SingleFlight.get_or_load_many` once the batch was read: ``batch`` and ``hits`` of ``idx``.

    ``coerced``: ``load`` returns its batch in storage form (see :meth:`SingleFlight.load_misses`).
    Returns the batch, which rows were loaded, and how many slots were stored.
    """
    loaded = np.zeros(len(idx), bool)
    board = single.handle.board
    if hits.all():
        board.add(hits=len(idx))
        return batch, loaded, 0
    flight = single.flight
    run = _Run(single, idx, batch, loaded, load, coerced=coerced)
    for row in np.flatnonzero(~hits).tolist():
        run.rows.setdefault(int(idx[row]), []).append(row)
    todo = list(run.rows)  # in the caller's order: concurrent callers in one order share the work
    ready: list[int] = []  # cached by another process since the first read: read them at the end
    held: list[int] = []  # being loaded elsewhere
    here: list[int] = []  # loaded here without holding (not cacheable, or nothing can be held)
    handle, slots = single.handle, single.mapped.slots
    states, capacity = slots.state_bytes, single.capacity
    if single.can_hold():
        cacheable: list[int] = []
        for i in todo:  # a loop, not comprehensions: one frame less on every load
            (cacheable if i < capacity else here).append(i)
        todo = cacheable
    else:
        here, todo = todo, []
    start = 0
    while start < len(todo):  # the next free slots held together (a lock call per run), loaded, let go
        window = todo[start : start + (chunk or flight.chunk(len(todo)))]
        start += len(window)
        mine = flight.hold_many(handle, slots, window)  # raises once the handle is closed
        if mine:
            run.load_held(mine)
        if len(mine) < len(window):
            got = set(mine)
            for i in window:
                if i not in got:
                    (ready if states[i] == READY else held).append(i)
    if held and (wait if wait is not None else flight.worth_waiting()) and timeout > 0:
        deadline = time.monotonic() + timeout
        for i in held:
            outcome = single.wait_one(i, deadline)
            if outcome == READY_NOW:
                ready.append(i)
            elif outcome == HELD_HERE:
                run.load_held([i])
            else:
                here.append(i)
    else:
        here += held
    if ready:
        here += run.read(ready)  # those that fail their checks are loaded here
    if here:
        run.load_free(here)
    found = int(np.count_nonzero(loaded))
    board.add(hits=len(idx) - found, misses=found)
    return (run.finished() if run.jagged else run.batch), loaded, run.written


class _Run:
    """One :func:`get_or_load_many` call: the batch it fills and the rows of each missing slot."""

    def __init__(
        self,
        single: SingleFlight,
        idx: np.ndarray[Any, Any],
        batch: dict[str, Any],
        loaded: np.ndarray[Any, Any],
        load: Callable[[list[int]], Any],
        *,
        coerced: bool,
    ) -> None:
        self.bound, self.idx, self.loaded = single, idx, loaded
        # Returns the batch in storage form: per field, in field order (see SingleFlight.load_misses).
        self.load = load if coerced else functools.partial(_coerced, load, single.fields)
        self.flight = single.flight
        self.rows: dict[int, list[int]] = {}
        self.fields = single.fields
        self.written = 0  # slots stored
        # A read-only Jagged batch becomes a list of rows while rows are filled in (see finished).
        # Loops, not comprehensions: a miss batch crosses as few frames as it can.
        self.jagged: dict[str, Jagged] = {}
        self.batch: dict[str, Any] = {}
        for name, values in batch.items():
            if isinstance(values, Jagged):
                self.jagged[name] = values
                values = list(values)
            self.batch[name] = values

    def finished(self) -> dict[str, Any]:
        """The batch with every row filled, as a read returns it (variable fields: one Jagged each)."""
        batch = self.batch
        for name, jagged in self.jagged.items():
            batch[name] = rows_like(jagged, batch[name])
        return batch

    def load_held(self, indices: list[int]) -> None:
        """Load slots this thread holds, store them and let go (by runs); on error let go of them all."""
        bound = self.bound
        try:
            arrays = self.flight.timed(self.load, indices)
            stored = bound.put_coerced(np.asarray(indices, np.intp), arrays)
        except BaseException:
            bound.release(indices)  # still held and recorded: let go of them all
            raise
        bound.unlock(indices)  # stored (READY) or refused: their locks go, a lock call per run
        self.written += int(np.count_nonzero(stored))
        self._place(indices, arrays)

    def load_free(self, indices: list[int]) -> None:
        """Load slots without holding them; store those still free (a live holder keeps its own)."""
        arrays = self.flight.timed(self.load, indices)
        if self.bound.can_hold():
            stored = self.bound.put_coerced(np.asarray(indices, np.intp), arrays, held=False)
            self.written += int(np.count_nonzero(stored))
        self._place(indices, arrays)

    def read(self, indices: list[int]) -> list[int]:
        """Read slots that became READY into their rows; the ones that fail the read's checks."""
        got, hits = self.bound.read(np.asarray(indices, np.intp))
        for j, i in enumerate(indices):
            if not hits[j]:
                continue
            for name, field in self.fields.items():
                if field.variable:
                    for row in self.rows[i]:
                        self.batch[name][row] = got[name][j]
                else:
                    self.batch[name][self.rows[i]] = got[name][j]
        return [i for j, i in enumerate(indices) if not hits[j]]

    def _place(self, indices: list[int], arrays: list[Any]) -> None:
        """Loaded ``arrays`` (coerced, row ``j`` for ``indices[j]``) into the rows that asked for them."""
        wanted, firsts = [], []
        for i in indices:  # loops, not comprehensions: one frame less on every load
            rows = self.rows[i]
            wanted.append(rows)
            firsts.append(rows[0])
        if sum(map(len, wanted)) == len(wanted):  # each index asked for once: one fancy assignment per field
            targets, sources = np.array(firsts, np.intp), None
        else:
            targets = np.concatenate([np.asarray(rows, np.intp) for rows in wanted])
            sources = np.repeat(np.arange(len(indices)), [len(rows) for rows in wanted])
        self.loaded[targets] = True
        for (name, field), values in zip(self.fields.items(), arrays, strict=True):
            if not field.variable:
                self.batch[name][targets] = values if sources is None else values[sources]
                continue
            for j, rows in enumerate(wanted):
                value = values[j] if field.text is None else text_value(field.text, values[j])
                for row in rows:
                    self.batch[name][row] = value


def _coerced(load: Callable[[list[int]], Any], fields: dict[str, Field], indices: list[int]) -> list[Any]:
    """What ``load(indices)`` returned, as :func:`~.values.coerce_batch` makes it: storage form, in field order."""
    return coerce_batch(as_batch(load(indices), list(fields), len(indices)), fields, len(indices))


def check_timeout(timeout: Any) -> float:
    """A wait's ``timeout`` as a float: finite and non-negative, else ``ValueError``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(
            f"timeout must be a finite number of seconds >= 0 (0: never wait), not {timeout!r}; "
            "every wait is bounded, so that a stuck loader cannot hang the others"
        )
    return float(timeout)


def check_flight(load: Any, timeout: Any, wait: Any, chunk: Any) -> float:
    """:meth:`Cache.get_or_load_many <mmapcache.Cache.get_or_load_many>`'s arguments checked; the timeout."""
    if load is None or not callable(load):
        raise TypeError(f"load must be a function of a list of indices, not {type(load).__name__}")
    seconds = check_timeout(timeout)
    if wait is not None and not isinstance(wait, bool):
        raise TypeError(f"wait must be True, False or None (wait when it pays), not {wait!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int (slots held per load) or None, not {chunk!r}")
    return seconds


def _claim(bound: SingleFlight, idx: np.ndarray[Any, Any]) -> Claims:
    """:meth:`Cache.claim_many <mmapcache.Cache.claim_many>` of cacheable ``idx``: hold what is free."""
    states = bound.mapped.slots.state_bytes
    todo = [i for i in dict.fromkeys(idx.tolist()) if states[i] != READY]
    mine = bound.hold_many(todo)  # a lock call per run of consecutive slots, in any order asked
    got = set(mine)
    return Claims(bound, mine, [i for i in todo if i not in got and states[i] != READY])


def _wait_for(bound: SingleFlight, idx: np.ndarray[Any, Any], timeout: float) -> Claims:
    """:meth:`Cache.wait_for <mmapcache.Cache.wait_for>` of cacheable ``idx``."""
    flight, handle, slots = bound.flight, bound.handle, bound.mapped.slots
    states = slots.state_bytes
    todo = list(dict.fromkeys(idx.tolist()))
    deadline = time.monotonic() + timeout
    for k, i in enumerate(todo):
        if flight.wait(handle, slots, i, deadline) == HELD_HERE:
            rest = [j for j in todo[k + 1 :] if states[j] != READY]
            return Claims(bound, [i], rest)
    return Claims(bound, [], [i for i in todo if states[i] != READY])
