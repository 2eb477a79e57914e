"""Property tests for datasets whose cache is shared by processes, and Hypothesis strategies for mmapcache.

    pip install "mmapcache[testing]"

:func:`check_concurrent_access` puts a cached dataset -- a
:class:`~mmapcache.torch.CachedDataset`, or any cache of your own -- in the
hands of several real processes and lets Hypothesis choose what they do:
load overlapping batches, load the same indices at the same instant, die by
``kill -9`` in the middle of a load, reopen it, fork children that load.
After every step a fresh process reads back everything that was loaded. Every
sample any process gets must equal the oracle's (the uncached truth)::

    import functools
    from mmapcache.testing import check_concurrent_access
    from mmapcache.torch import CachedDataset

    def test_my_cache_under_concurrency():
        check_concurrent_access(functools.partial(CachedDataset, MyDataset(), key="t"), MyDataset().__getitem__)

A failure raises ``AssertionError`` whose message is the shrunk sequence of
steps, one line each, the last one saying what came back and what was
expected. docs/testing.md explains what the check explores and what it cannot.

:func:`fields` and :func:`samples` are Hypothesis strategies for schemas
(``{name: Field}``, fixed and variable shapes) and for samples of a schema.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    import hypothesis
except ImportError as error:  # pragma: no cover - exercised in a subprocess without Hypothesis
    raise ImportError(
        "mmapcache.testing needs Hypothesis, which mmapcache does not install by itself: "
        'pip install "mmapcache[testing]"'
    ) from error

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import get_state_machine_test

from .._field import Field, FieldsLike, normalize_fields
from ._machine import STEPS, OutOfTime, Run, Summary, machine_class

__all__ = ["DTYPES", "Summary", "check_concurrent_access", "fields", "samples"]

Summary.__module__ = __name__  # pickles name the public module

MAX_EXAMPLES = 25
MAX_PROCESSES = 32  # worker processes a check may start (plus the observer)


def check_concurrent_access(
    make_dataset: Callable[[str], Any],
    oracle: Callable[[int], Any],
    *,
    processes: int = 3,
    max_examples: int = MAX_EXAMPLES,
    kill: bool = True,
    seed: int | None = None,
    deadline: float | None = None,
) -> Summary:
    """Drive ``processes`` spawned processes sharing the dataset through Hypothesis-chosen steps.

    ``make_dataset(path)`` is called in each process (spawn start method, like
    DataLoader workers, DDP ranks and other jobs) with a fresh path per example,
    inside a private directory this function creates and removes; it returns a
    map-style dataset (``__len__``, ``__getitem__``, ``__getitems__`` if it has
    one) that caches in the file at ``path``. ``oracle(index)`` returns the
    sample the dataset must return. Both must be picklable.

    Steps: a worker loads a batch (by ``__getitems__`` or one index at a
    time); several workers load the same indices at once, each in its own order
    and with its own delay; a worker is killed with SIGKILL part-way into a load
    (``kill=True``) and a fresh process takes its place; a worker exits, or
    closes and remakes its dataset; a child forked from a worker loads (through
    a DataLoader worker for a torch dataset); and, for an mmapcache file, the
    test process tries to remove it. After every step another process makes
    the dataset afresh and loads everything loaded so far; for an mmapcache
    cache it also checks that no slot that was filled has gone.

    Samples are compared exactly: same structure (tuple, list, dict), same
    dtype names, shapes and bytes; tensors, arrays and Python numbers match
    across kinds. ``max_examples`` bounds the Hypothesis examples (up to 20
    steps each), ``deadline`` the seconds the call takes: once they have
    passed, no further step starts (the call ends after the step in progress
    and the processes' shutdown), unless no sample has been compared yet — a
    check always compares some. Once a failure was found, shrinking it takes
    up to ``MMAPCACHE_TESTING_SHRINK_SECONDS`` (30 s) more. ``processes`` is
    at most 32. ``seed`` makes the choice of steps repeatable (timing never is).

    Run in the main thread, SIGTERM (with its default action) first stops
    the processes and removes the check's directory, then ends the process as
    usual; after a SIGKILL, ``mmapcache gc`` removes the directory.

    Returns a :class:`Summary` of what ran. Raises ``AssertionError`` with the
    shrunk steps when a sample is wrong, a stored one is lost, a process
    raises, dies or hangs (60 s), or a cache in use is removed; and when the
    run ended without comparing a single sample. Arguments of the wrong type
    raise ``TypeError``, out-of-range ones ``ValueError``, before anything runs.
    """
    _check_int("processes", processes, MAX_PROCESSES)
    _check_int("max_examples", max_examples)
    if not isinstance(kill, bool):
        raise TypeError(f"kill must be True or False, not {type(kill).__name__} {kill!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, not {type(seed).__name__} {seed!r}")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise TypeError(
                f"deadline must be a number of seconds (int or float) or None, not {type(deadline).__name__} "
                f"{deadline!r}"
            )
        if not 0 < deadline < math.inf:
            raise ValueError(f"deadline must be a positive, finite number of seconds or None, not {deadline!r}")
    for name, value in (("make_dataset", make_dataset), ("oracle", oracle)):
        if not callable(value):
            raise TypeError(f"{name} must be callable, not {type(value).__name__}")
        try:
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"{name} must be picklable to reach the worker processes (a module-level function, or "
                f"functools.partial of one or of a class); pickling {value!r} failed: {error}"
            ) from None
    with _cleaned_up_on_sigterm():
        return _check(make_dataset, oracle, processes, max_examples, kill, seed, deadline)


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwind (stopping the processes, removing the directory), then die of it.

    A ``KeyboardInterrupt`` so that Hypothesis lets it through untouched.
    """


@contextlib.contextmanager
def _cleaned_up_on_sigterm() -> Iterator[None]:
    """While a check runs in the main thread with SIGTERM's default action: SIGTERM unwinds it first."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without the handler
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check(
    make_dataset: Callable[[str], Any],
    oracle: Callable[[int], Any],
    processes: int,
    max_examples: int,
    kill: bool,
    seed: int | None,
    deadline: float | None,
) -> Summary:
    run = Run(make_dataset, oracle, processes=processes, kill=kill, deadline=deadline)
    try:
        run.start()
        test = get_state_machine_test(  # type: ignore[no-untyped-call]  # Hypothesis leaves it unannotated
            machine_class(run),
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=STEPS,
                deadline=None,  # steps start processes: their time varies
                database=None,  # no .hypothesis directory next to the user's code
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,
                verbosity=Verbosity.quiet,  # the AssertionError tells the story
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
            ),
        )
        if seed is not None:
            test = hypothesis.seed(seed)(test)
        try:
            test()
        except OutOfTime:
            pass  # the deadline passed between two steps, nothing had failed: the check is over
        except AssertionError as failure:
            raise AssertionError(_report(run, failure, replayed=True)) from None
        except Flaky:
            # A timing-dependent failure: a replay of the steps did not fail, or failed at another step.
            if run.shortest is None:
                raise
            raise AssertionError(_report(run, run.shortest[1], replayed=False)) from None
    finally:
        run.close()
    if not run.summary.samples:
        raise AssertionError(
            f"check_concurrent_access compared no sample with the oracle ({run.summary}): a run that "
            "compares nothing shows nothing. Give it more examples (max_examples=) or more time (deadline=)"
        )
    return run.summary


def _check_int(name: str, value: Any, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    if most is not None and value > most:
        raise ValueError(
            f"{name} must be at most {most}, not {value!r}: each is a Python process of its own (with the "
            "dataset and its imports), and a few already make every race the check looks for"
        )


def _report(run: Run, failure: AssertionError | str, *, replayed: bool) -> str:
    import time

    now = time.monotonic()
    found = (run.failed_at or now) - run.started
    summary = run.summary
    head = (
        f"check_concurrent_access: {run.processes} processes sharing the dataset went wrong in example "
        f"{run.failed_example} after {found:.1f} s; shrinking took {now - (run.failed_at or now):.1f} s "
        f"({summary.examples} examples in all)."
    )
    if replayed:
        head += " The shrunk steps:"
    else:
        head += (
            " The failure depends on timing: replaying the steps did not always fail the same way. "
            "The shortest sequence of steps that failed:"
        )
    return f"{head}\n{failure}"


# -- strategies -------------------------------------------------------------------------

#: dtypes that numpy, torch and the cache all store (torch-only ones such as bfloat16 are left out).
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64")
_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_MAX_DIM = 4


@st.composite
def _fields(draw: st.DrawFn, variable: bool | None, max_fields: int) -> dict[str, Field]:
    names = draw(st.lists(_NAMES, min_size=1, max_size=max_fields, unique=True))
    shapes: list[list[int | None]] = [draw(st.lists(st.integers(0, _MAX_DIM), max_size=3)) for _ in names]
    if variable is not False:
        for shape in shapes:
            for k in range(len(shape)):
                if draw(st.booleans()):
                    shape[k] = None
        if variable and not any(None in shape for shape in shapes):
            chosen = shapes[draw(st.integers(0, len(shapes) - 1))]
            if chosen:
                chosen[draw(st.integers(0, len(chosen) - 1))] = None
            else:
                chosen.append(None)
    return {name: Field(tuple(shape), draw(st.sampled_from(DTYPES))) for name, shape in zip(names, shapes, strict=True)}


def fields(*, variable: bool | None = None, max_fields: int = 4) -> st.SearchStrategy[dict[str, Field]]:
    """Schemas ``{name: Field}`` that :meth:`~mmapcache.Cache.open` and ``CachedDataset(fields=)`` accept.

    Names are lowercase identifiers (a dict sample's keys); shapes have up to
    three dimensions of 0 to 4; dtypes come from :data:`DTYPES`. With
    ``variable=True`` at least one dimension is ``None`` (such a cache needs
    ``max_bytes``), with ``False`` none is, and by default either.
    """
    if variable is not None and not isinstance(variable, bool):
        raise TypeError(f"variable must be True, False or None, not {type(variable).__name__} {variable!r}")
    _check_int("max_fields", max_fields)
    return _fields(variable, max_fields)


@st.composite
def _samples(draw: st.DrawFn, schema: dict[str, Field]) -> dict[str, np.ndarray[Any, Any]]:
    sample = {}
    for name, field in schema.items():
        shape = tuple(draw(st.integers(0, _MAX_DIM + 2)) if d is None else d for d in field.shape)
        sample[name] = draw(hnp.arrays(field.dtype, shape))
    return sample


def samples(fields: FieldsLike | Mapping[str, Field]) -> st.SearchStrategy[dict[str, np.ndarray[Any, Any]]]:
    """Samples for ``fields``: ``{name: ndarray}`` of each field's dtype, of any size (0 to 6) where it says ``None``.

    Values cover the dtype's whole range, NaNs, infinities and signed zeros included.
    """
    return _samples(normalize_fields(fields))
