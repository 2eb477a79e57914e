"""The single-flight verbs of ``Cache``: one load per sample per node (the rules are in ``_flight.py``).

:class:`SingleFlight` is the base class that gives ``Cache`` its
``get_or_load_many``, ``get_or_load``, ``claim_many``, ``wait_for`` and
``mean_load_time``. It keeps the handle's :class:`~mmapcache._flight.Flight`
(which thread of this process holds which slot, and the mean load time) and
reaches the file through one hook, ``_bound``: the flight bound to the open
mapping, which the class that owns the mapping provides. Everything else it
uses is ``Cache``'s public surface (``length``, ``capacity``, ``read_many``,
``count``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ._flight import WAIT_TIMEOUT, Bound, Claims, Flight, check_flight, check_timeout, claim, get_or_load_many, wait_for
from ._indices import check_index, index_array

if TYPE_CHECKING:
    from .cache import Cache

__all__ = ["SingleFlight"]

_FLIGHT_LOCK = threading.Lock()


class SingleFlight:
    """The single-flight verbs of a cache; the owner of the mapping provides :meth:`_bound`."""

    @property
    def length(self) -> int:
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def _bound(self, writing: str | None) -> Bound:
        """The flight bound to the open mapping; ``writing``: the verb a readonly handle refuses."""
        raise NotImplementedError

    def _flight(self) -> Flight:
        flight: Flight | None = self.__dict__.get("_flight_state")
        if flight is None:
            with _FLIGHT_LOCK:
                flight = self.__dict__.setdefault("_flight_state", Flight())
        return flight

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
        """The samples at ``indices``, each missing one loaded by ``load`` once per node: ``(batch, loaded)``.

        ``batch`` is what :meth:`read_many` returns, every row filled;
        ``loaded[k]`` says whether row ``k`` was loaded by this call (else it
        came from the cache). ``load(indices)`` gets a list of cache indices
        and returns their samples: a batch as :meth:`put_many` takes it, or a
        list of samples ``{field: value}`` in the same order. What it returns
        is stored, and returned as a read would return it.

        A missing slot is held (the kernel lock a fill takes) before it is
        loaded and let go as soon as it is stored, a few slots at a time
        (``chunk``: by default about 10 ms of loading). A slot that another
        process — or another thread — is loading is waited for rather than
        loaded again, once this call holds nothing: up to ``timeout`` seconds
        in all (default 10), after which the call loads what is left itself.
        If that holder dies or its ``load`` raises, the waiter loads the slot.
        ``wait=None`` waits only when it pays: not when this handle's mean
        load time (:attr:`mean_load_time`) is under half a millisecond per
        sample; ``wait=False`` never waits, ``wait=True`` always does.

        An exception from ``load`` lets go of the slots it held and
        propagates. A readonly cache loads every miss itself and stores
        nothing. Usage counts a row read from the cache (waited for or not)
        as a hit and a row loaded here as a miss.
        """
        timeout = check_flight(load, timeout, wait, chunk)
        bound, cache = self._bound(None), cast("Cache", self)
        return get_or_load_many(cache, bound, indices, load, out=out, timeout=timeout, wait=wait, chunk=chunk)

    def get_or_load(
        self, index: int, load: Callable[[int], Any], *, timeout: float = WAIT_TIMEOUT, wait: bool | None = None
    ) -> dict[str, Any]:
        """The sample at ``index``: from the cache, or ``load(index)`` once per node (see :meth:`get_or_load_many`)."""
        i = check_index(index, self.length)
        if load is None or not callable(load):
            raise TypeError(f"load must be a function of an index, not {type(load).__name__}")
        batch, _ = self.get_or_load_many([i], lambda idx: [load(idx[0])], timeout=timeout, wait=wait, chunk=1)
        return {name: values[0, ...] if isinstance(values, np.ndarray) else values[0] for name, values in batch.items()}

    def claim_many(self, indices: Any) -> Claims:
        """Hold, without waiting, every slot among ``indices`` that is cacheable, not cached and free.

        Returns :class:`Claims` (a context manager): its ``indices`` are the
        slots now held by this thread — load them and store them with
        ``claims.put_many``; leaving the ``with`` block lets go of the rest.
        Its ``held`` are the slots another process or thread is loading: wait
        for them with :meth:`wait_for`, once you hold nothing.
        """
        bound = self._bound("claim_many")
        idx = index_array(indices, self.length)
        return claim(bound, idx[idx < self.capacity])

    def wait_for(self, indices: Any, *, timeout: float = WAIT_TIMEOUT) -> Claims:
        """Wait until every one of ``indices`` is cached, or until one of them is left to this thread.

        Returns :class:`Claims` holding one slot when its holder gave it up
        unstored (it died, or its load raised): load and store it, then wait
        for the rest. Otherwise the claims hold nothing, and their ``held``
        lists the slots still being loaded elsewhere after ``timeout`` seconds
        (load those yourself: storing them is refused while their holder
        lives). Waits only while this thread holds no slot (else
        ``RuntimeError``): waiting while holding could deadlock.
        """
        bound = self._bound("wait_for")
        timeout = check_timeout(timeout)
        idx = index_array(indices, self.length)
        return wait_for(bound, idx[idx < self.capacity], timeout)

    @property
    def mean_load_time(self) -> float | None:
        """Seconds per sample that :meth:`get_or_load_many`'s loads took through this handle (``None``: none yet)."""
        return self._flight().mean_load_time()
