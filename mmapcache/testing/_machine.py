"""The Hypothesis state machine behind :func:`mmapcache.testing.check_concurrent_access`.

One :class:`Run` holds what lives across Hypothesis examples: the private
directory, the worker processes (reused from one example to the next; a killed
one is replaced by a spare started ahead of time), an observer process, and the
:class:`Summary`. Each example gets a fresh path and a story: one line per step,
which becomes the message of the ``AssertionError`` when a step goes wrong.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import itertools
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._errors import CacheInUseError
from .._file import CHECK_OWNER, CHECK_PREFIX, default_dir, remove
from ._worker import Process, StepError, Zygote, wait_until

__all__ = ["OutOfTime", "Run", "Summary", "machine_class"]

BATCH = 8  # indices in one load, at most
UNIVERSE = 32  # loads draw from the first indices only: overlapping loads are what break caches
STEPS = 20  # steps in one example, at most
SHRINK_SECONDS = 30.0  # time given to shrinking a failure before its best story is replayed
SHRINK_ENV = "MMAPCACHE_TESTING_SHRINK_SECONDS"  # overrides it (e.g. shorter in CI)


def shrink_seconds() -> float:
    """The time shrinking a failure may take: ``$MMAPCACHE_TESTING_SHRINK_SECONDS``, else 30 s."""
    given = os.environ.get(SHRINK_ENV)
    if given is None:
        return SHRINK_SECONDS
    try:
        seconds = float(given)
    except ValueError:
        raise ValueError(f"{SHRINK_ENV}={given!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise ValueError(f"{SHRINK_ENV}={given!r}: give a number of seconds, 0 or more")
    return seconds


REPLAYS = 1  # while shrinking, a sequence of steps that passed is run again this many times


@dataclasses.dataclass
class Summary:
    """What a :func:`~mmapcache.testing.check_concurrent_access` run did."""

    examples: int = 0  #: Hypothesis examples run (fresh cache paths)
    steps: int = 0  #: steps run, over all examples
    loads: int = 0  #: loads by worker processes (each racer and forked child counts), all compared
    samples: int = 0  #: samples compared with the oracle, the observer's included
    kills: int = 0  #: workers killed with SIGKILL while asked to load
    kills_mid_load: int = 0  #: of those, killed before their load had finished
    races: int = 0  #: steps in which several processes loaded the same indices at once
    forks: int = 0  #: loads by a child forked from a worker that holds the dataset
    reopens: int = 0  #: datasets made again by ``make_dataset``, in the same or a fresh process
    removes: int = 0  #: attempts to remove an mmapcache file while workers may hold it
    seconds: float = 0.0  #: wall-clock time of the whole check

    def __str__(self) -> str:
        return (
            f"{self.examples} examples, {self.steps} steps in {self.seconds:.1f} s: {self.loads} loads "
            f"({self.samples} samples compared), {self.races} races, {self.kills} kills "
            f"({self.kills_mid_load} mid-load), {self.forks} forked loads, {self.reopens} reopens, "
            f"{self.removes} removes"
        )


class Run:
    """Processes, directory and counters shared by the examples of one check."""

    def __init__(
        self,
        make_dataset: Callable[[str], Any],
        oracle: Callable[[int], Any],
        *,
        processes: int,
        kill: bool,
        deadline: float | None,
    ) -> None:
        self.processes = processes
        self.kill = kill
        self.summary = Summary()
        self.started = time.monotonic()
        self.deadline = None if deadline is None else self.started + deadline
        self.failed_at: float | None = None  # when the first failure happened (shrinking starts then)
        self.shrink_seconds = shrink_seconds()  # read once, before the first example: a bad value fails early
        self.failed_example = 0
        self.shortest: tuple[int, str] | None = None  # the failing story of fewest steps seen
        self.replays = 0  # runs of a shrink candidate's steps after the first
        self.per_sample = 0.001  # how long a load takes per index, recently at most: where kills aim
        self.length = 0
        self.mmapcache = False  # whether the dataset keeps its samples in an mmapcache Cache
        self._names = itertools.count()
        self.directory = Path(tempfile.mkdtemp(prefix=CHECK_PREFIX, dir=default_dir()))
        # Held while the check runs: `mmapcache gc` removes the directory of a check that died.
        self._owner = os.open(self.directory / CHECK_OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._owner, fcntl.LOCK_EX)
        self.zygote = Zygote(make_dataset, oracle)
        self.workers: list[Process] = []
        self.observer: Process | None = None

    def start(self) -> None:
        """Start the processes and learn the dataset's length from one of them."""
        probe = str(self.directory / "probe")
        try:
            self.workers = [self.zygote.fork() for _ in range(self.processes)]
            self.observer = self.zygote.fork()
            self.length, self.mmapcache = self.observer.call("probe", probe)
        except StepError as error:
            raise RuntimeError(
                f"make_dataset({probe!r}) in a worker process {error.summary}\n{error.details}"
            ) from None
        finally:
            self._remove_files("probe")
        if self.length <= 0:
            raise ValueError("the dataset is empty: there is nothing to load concurrently")

    def close(self) -> None:
        for process in [*self.workers, *([self.observer] if self.observer else [])]:
            process.stop()
        self.zygote.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._owner)
        self.summary.seconds = time.monotonic() - self.started

    def out_of_time(self) -> bool:
        """Whether the deadline has passed with nothing failed and some sample compared: the check ends now."""
        return (
            self.failed_at is None
            and self.deadline is not None
            and time.monotonic() > self.deadline
            and self.summary.samples > 0
        )

    def begin_example(self, *, replay: bool = False) -> str | None:
        """A fresh path for the next example, or None once shrinking has had its time.

        Past the deadline (and once a sample was compared) this raises
        :class:`OutOfTime`, which ends the whole check. Out of shrinking time,
        an example still draws its steps but runs none of them (Hypothesis
        must see the same draws for the same data), so the remaining
        candidates pass in microseconds. The final replay of a shrunk failure
        always runs.
        """
        now = time.monotonic()
        if self.out_of_time():
            raise OutOfTime
        if (
            self.failed_at is not None
            and now > self.failed_at + self.shrink_seconds
            and not current_build_context().is_final
        ):
            return None  # shrinking had its time: keep the story found so far
        if replay:
            self.replays += 1
        else:
            self.summary.examples += 1
        return str(self.directory / f"example-{next(self._names)}")

    def end_example(self, path: str) -> None:
        """Close the dataset in every worker (replacing any that fails to) and delete the example's files."""
        for w, process in enumerate(self.workers):
            try:
                if process.broken:
                    raise StepError("broken")
                process.call("close")
            except (StepError, OSError):
                self.replace(w)
        if self.observer is not None and self.observer.broken:
            self.observer.kill()
            self.observer = self.zygote.fork()
        self._remove_files(Path(path).name)

    def replace(self, w: int, *, kill: bool = True) -> Process:
        """Kill worker ``w`` (or let it close its dataset and exit) and put a fresh process in its place."""
        if kill:
            self.workers[w].kill()
        else:
            self.workers[w].stop()
        self.workers[w] = self.zygote.fork()
        return self.workers[w]

    def learn(self, seconds: float, count: int) -> None:
        # A moving average of recent loads, which a kill step's load is likely to resemble.
        self.per_sample = 0.5 * self.per_sample + 0.5 * seconds / max(count, 1)

    def _remove_files(self, name: str) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(name):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def _collapsed(steps: list[str]) -> list[str]:
    """The steps with each run of identical ones said once: "worker 0 closes ... again (3 times)"."""
    out: list[str] = []
    for step, run in itertools.groupby(steps):
        count = len(list(run))
        out.append(step if count == 1 else f"{step} ({count} times)")
    return out


def _rotated(indices: Sequence[int], shift: int) -> list[int]:
    k = shift % len(indices)
    return [*indices[k:], *indices[:k]]


class OutOfTime(KeyboardInterrupt):
    """The deadline passed: ends a check between two steps.

    A ``KeyboardInterrupt`` because that is what Hypothesis lets through
    without treating it as a failure to replay and shrink; only
    ``check_concurrent_access`` raises and catches it.
    """


class _FailedError(Exception):
    """A step went wrong; the example records it, runs no further step, and fails at its end."""


_Method = TypeVar("_Method", bound=Callable[..., None])


def _unless_done(method: _Method) -> _Method:
    """Run a rule or invariant only while the example is live: it has time to run and nothing failed yet.

    A failure is raised at the end of the example (by ``teardown``), not in
    the step: Hypothesis must see the same draws whatever step a replay fails
    at, or it reports inconsistent data generation instead of shrinking.
    """

    @functools.wraps(method)
    def live(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.path is not None and self.failure is None:
            if self.run.out_of_time():
                raise OutOfTime
            try:
                method(self, *args, **kwargs)
            except _FailedError as failed:
                self.failure = str(failed)
            except Exception as error:  # e.g. a pipe to a process that died: a failure of this step too
                try:
                    self._fail(f"{method.__name__} → {type(error).__name__}: {error}", traceback.format_exc())
                except _FailedError as failed:
                    self.failure = str(failed)

    return live  # type: ignore[return-value]  # the same signature, by functools.wraps


def _recorded(method: _Method) -> _Method:
    """A rule: run while the example is live (see :func:`_unless_done`), and remember it for replays."""
    live = _unless_done(method)

    @functools.wraps(method)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        self.trace.append((live, args, kwargs))
        live(self, *args, **kwargs)

    return recorded  # type: ignore[return-value]  # the same signature, by functools.wraps


def machine_class(run: Run) -> type[RuleBasedStateMachine]:
    """The state machine for one check: its strategies depend on the dataset's length and the processes."""
    processes = run.processes
    universe = min(run.length, UNIVERSE)
    batches = st.lists(st.integers(0, universe - 1), min_size=1, max_size=BATCH)
    workers = st.integers(0, processes - 1)

    class ConcurrentAccess(RuleBasedStateMachine):
        """Model: indices some completed load returned, and the slots an mmapcache file was seen to hold."""

        def __init__(self) -> None:
            super().__init__()
            self.run = run
            self.path = run.begin_example()
            self.trace: list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]] = []
            self._reset()

        def _reset(self) -> None:
            self.story: list[str] = []
            self.loaded: set[int] = set()  # asked for by some load, finished or killed
            self.cached: set[int] = set()
            self.holding = [False] * processes  # loaded through its dataset since it was made
            self.failure: str | None = None
            self._open_all()

        def _replay(self) -> None:
            """Run the steps again on a fresh path, up to REPLAYS times or until they fail.

            Only while shrinking: a failure that depends on timing then survives
            more of the shrinker's attempts, so the story it ends with is short.
            """
            trace = list(self.trace)
            for _ in range(REPLAYS):
                if self.failure is not None or self.path is None:
                    return
                run.end_example(self.path)
                self.path = run.begin_example(replay=True)
                self._reset()
                self.a_fresh_dataset_reads_back_what_was_stored()
                for live, args, kwargs in trace:
                    live(self, *args, **kwargs)
                    self.a_fresh_dataset_reads_back_what_was_stored()

        @_unless_done
        def _open_all(self) -> None:
            for w in range(processes):
                self._ask(w, f"worker {w} makes the dataset", "open", self.path)

        # -- helpers ------------------------------------------------------------------

        def _fail(self, line: str, details: str = "") -> NoReturn:
            if run.failed_at is None:
                run.failed_at, run.failed_example = time.monotonic(), run.summary.examples
            steps = _collapsed([*self.story, line])
            story = "\n".join(f"  {n}. {step}" for n, step in enumerate(steps, 1))
            story = f"{story}\n{details}".rstrip()
            if run.shortest is None or len(steps) < run.shortest[0]:
                run.shortest = (len(steps), story)
            raise _FailedError(story)

        def _ask(self, w: int, line: str, op: str, *args: Any) -> Any:
            try:
                return run.workers[w].call(op, *args)
            except StepError as error:
                self._fail(f"{line} → {error.summary}", error.details)

        def _checked(self, line: str, result: dict[str, Any], indices: Sequence[int]) -> None:
            run.summary.loads += 1
            run.summary.samples += len(indices)
            run.learn(result["seconds"], len(indices))
            if result["wrong"]:
                self._fail(f"{line} → " + "; ".join(result["wrong"]))

        def _step(self, line: str) -> None:
            run.summary.steps += 1
            self.story.append(line)

        def _fresh_process(self, w: int, *, kill: bool = True) -> None:
            """A fresh process takes worker ``w``'s place (which is killed, or asked to exit) and makes the dataset."""
            run.replace(w, kill=kill)
            run.summary.reopens += 1
            self.holding[w] = False
            self._ask(w, f"a fresh process, worker {w}, makes the dataset", "open", self.path)

        # -- rules ----------------------------------------------------------------------

        @rule(w=workers, indices=batches, by_item=st.booleans())
        @_recorded
        def load(self, w: int, indices: list[int], by_item: bool) -> None:
            line = f"worker {w} loads {indices}" + (" one index at a time" if by_item else "")
            self._checked(line, self._ask(w, line, "load", indices, by_item, 0.0, False), indices)
            self.loaded.update(indices)
            self.holding[w] = True
            self._step(line)

        @precondition(lambda self: processes >= 2)
        @rule(
            indices=batches,
            racers=st.integers(2, max(2, processes)),
            shifts=st.lists(st.integers(0, BATCH - 1), min_size=processes, max_size=processes),
            delays=st.lists(st.integers(0, 30), min_size=processes, max_size=processes),
            kill_first=st.none() | st.integers(0, 100) if run.kill else st.none(),
        )
        @_recorded
        def load_at_once(
            self, indices: list[int], racers: int, shifts: list[int], delays: list[int], kill_first: int | None
        ) -> None:
            """Several workers load the same indices at the same instant, each in its own order and delay.

            With ``kill_first``, worker 0 is killed that percent into its load, while the others load.
            """
            racers = min(racers, processes)
            run.summary.races += 1
            start_at = time.monotonic() + 0.01
            parts, batches_of = [], []
            for w in range(racers):
                batch = _rotated(indices, shifts[w])
                batches_of.append(batch)
                part = f"worker {w} {batch}" + (f" {delays[w] / 10:.1f} ms later" if delays[w] else "")
                parts.append(part)
                run.workers[w].send("load", batch, False, start_at + delays[w] / 10_000, False)
            line = "at once: " + ", ".join(parts)
            first = 0
            if kill_first is not None:
                wait_until(start_at + delays[0] / 10_000 + run.per_sample * len(indices) * kill_first / 100)
                finished = run.workers[0].answered()
                run.workers[0].kill()
                run.summary.kills += 1
                run.summary.kills_mid_load += not finished
                line += f"; worker 0 is killed {kill_first}% into its load"
                line += " (after it finished)" if finished else " (mid-load)"
                first = 1
            answers: list[dict[str, Any] | StepError] = []
            for w in range(first, racers):  # every answer is read before any is judged: none stays in a pipe
                try:
                    answers.append(run.workers[w].reply())
                except StepError as error:
                    answers.append(error)
            for w, answer in enumerate(answers, first):
                if isinstance(answer, StepError):
                    self._fail(f"{line} → worker {w} {answer.summary}", answer.details)
                self._checked(f"{line} → worker {w}", answer, batches_of[w])
                self.holding[w] = True
            self.loaded.update(indices)
            if kill_first is not None:
                self._step(line + "; a fresh process replaces it")
                self._fresh_process(0)
            else:
                self._step(line)

        @precondition(lambda self: run.kill)
        @rule(w=workers, indices=batches, percent=st.integers(0, 100))
        @_recorded
        def kill_during_load(self, w: int, indices: list[int], percent: int) -> None:
            """SIGKILL a worker ``percent`` % into its (expected) load time; a fresh process takes its place."""
            line = f"worker {w} is killed {percent}% into loading {indices}"
            process = run.workers[w]
            process.send("load", indices, False, 0.0, True)
            try:
                started = process.wait_started()
            except StepError as error:
                self._fail(f"{line} → {error.summary}", error.details)
            wait_until(started + run.per_sample * len(indices) * percent / 100)
            finished = process.answered()
            if finished:  # too late: the load completed, so it must be right
                try:
                    result = process.reply()
                except StepError as error:
                    self._fail(f"{line} → {error.summary}", error.details)
                self._checked(line, result, indices)
            self.loaded.update(indices)  # what a dead writer left must read right too
            process.kill()
            run.summary.kills += 1
            run.summary.kills_mid_load += not finished
            self._step(f"{line} ({'its load had finished' if finished else 'mid-load'}); a fresh process replaces it")
            self._fresh_process(w)

        @rule(w=workers)
        @_recorded
        def restart(self, w: int) -> None:
            """Worker ``w`` exits cleanly; a fresh process makes the dataset."""
            self._step(f"worker {w} exits; a fresh process replaces it")
            self._fresh_process(w, kill=False)

        @rule(w=workers)
        @_recorded
        def reopen(self, w: int) -> None:
            """Worker ``w`` closes its dataset and makes a new one in the same process."""
            line = f"worker {w} closes the dataset and makes it again"
            self._ask(w, line, "open", self.path)
            run.summary.reopens += 1
            self.holding[w] = False
            self._step(line)

        @rule(w=workers, indices=batches)
        @_recorded
        def forked_load(self, w: int, indices: list[int]) -> None:
            """A child forked from worker ``w`` (a DataLoader worker for a torch dataset) loads ``indices``."""
            line = f"a child forked from worker {w} loads {indices}"
            self._checked(line, self._ask(w, line, "forked_load", indices), indices)
            run.summary.forks += 1
            self.loaded.update(indices)
            self._step(line)

        @precondition(lambda self: run.mmapcache)
        @rule()
        @_recorded
        def remove_file(self) -> None:
            """``mmapcache.remove`` must refuse while a worker holds the cache; else the file goes."""
            run.summary.removes += 1
            holders = [w for w in range(processes) if self.holding[w]]
            line = "the test process removes the file" + (
                f" while workers {holders} hold it" if holders else " while no worker has loaded from it"
            )
            assert self.path is not None  # a live example's
            try:
                remove(self.path, timeout=10)
            except CacheInUseError:
                self._step(line + ": refused (in use)")
                return
            except FileNotFoundError:
                self._step(line + ": there is no file yet")
                return
            if holders:
                self._fail(f"{line} → it was removed from under them (remove() should refuse a cache in use)")
            self._step(line + ": removed")
            self.loaded.clear()
            self.cached.clear()

        # -- what must hold after every step --------------------------------------------

        @invariant()
        @_unless_done
        def a_fresh_dataset_reads_back_what_was_stored(self) -> None:
            """The observer makes the dataset afresh: every sample loaded so far, and every slot held, is right."""
            assert self.path is not None  # a live example's
            if not self.loaded and not os.path.lexists(self.path):
                return
            observer = run.observer
            assert observer is not None
            line = f"another process makes the dataset and loads {sorted(self.loaded)}"
            try:
                result = observer.call("observe", self.path, sorted(self.loaded))
            except StepError as error:
                self._fail(f"{line} → {error.summary}", error.details)
            run.summary.samples += result["loaded"]
            if result["wrong"]:
                self._fail(f"{line} → " + "; ".join(result["wrong"]))
            if result["cached"] is not None:
                cached = set(result["cached"])
                lost = sorted(self.cached - cached)
                if lost:
                    self._fail(f"{line} → slots {lost} were cached before and are not any more")
                self.cached = cached

        def teardown(self) -> None:
            if run.failed_at is not None:
                self._replay()
            if self.path is not None:
                run.end_example(self.path)
            if self.failure is not None:
                raise AssertionError(self.failure)

    return ConcurrentAccess
