"""A hang becomes an error: a step that takes longer than a bound stops the run.

:class:`Watchdog` watches the training loop from a thread of its own. The loop beats after each step it
dispatches (:meth:`Watchdog.beat`); a dispatch waits for the step ``max_inflight`` before it, so beats come
once per step time, and stop when a step stops making progress: a collective that never completes because
another process is stuck or gone, a data loader that never returns, a device that stopped. When no beat comes
within the bound, the watchdog writes every thread's Python stack (:mod:`faulthandler`) to
``<directory>/hang-p<process>.txt``, prints a :class:`~jaxpar.errors.StepHangError` line and ends the process
with :data:`HUNG_EXIT`: the main thread is blocked inside XLA, where no Python exception reaches it. Each
process has its own watchdog, so every process of a hung job ends, each with its own stacks. Process 0 ends
last (:data:`LEADER_GRACE`): it hosts JAX's coordination service, and when it is gone the runtime of every
other process aborts at once, before that process's watchdog has written its stacks.

The bound is ``seconds`` when given, else ``factor`` times the median time between beats so far, never less
than ``min_seconds``. Compiling the first step, evaluations and checkpoint saves do not count
(:meth:`Watchdog.paused`; the watchdog is armed at the first step's dispatch).

Example (no hang: the loop beats in time)::

    >>> import time
    >>> with Watchdog(seconds=5.0, directory=None) as dog:
    ...     for step in range(3):
    ...         time.sleep(0.01)          # stands for a step
    ...         dog.beat(step + 1)
    >>> dog.fired
    False
    >>> Watchdog(factor=10, min_seconds=2).bound([0.5, 0.1, 0.3]), Watchdog(factor=10, min_seconds=60).bound([0.5])
    (3.0, 60.0)
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Sequence

import jax

from jaxpar.errors import LoopError, StepHangError

#: The exit status of a process the watchdog ended: 124, as ``timeout(1)`` ends a command that ran too long.
HUNG_EXIT = 124
#: Seconds (at most the bound) that process 0 of several waits after its own error before it ends, so that the
#: others' watchdogs, with the same bound and beats as old, end them first with their own stacks.
LEADER_GRACE = 10.0


def parse_step_timeout(spec: str, setting: str = "--step-timeout") -> "Watchdog | None":
    """The watchdog ``jaxpar train --step-timeout SPEC`` (or ``train.step_timeout``) asks for.

    Args:
      spec: ``"S"`` (seconds), ``"Nx"`` (N times the median step time, at least 300 s), ``"Nx:S"`` (at least
        S seconds), or ``"0"`` (no watchdog).
      setting: where ``spec`` came from, for the error.

    Returns:
      A :class:`Watchdog` without a directory (the caller sets it), or None for ``"0"``.

    Raises:
      LoopError: a spec of another form, or a bound that is not a positive number.

    >>> parse_step_timeout("30").seconds, parse_step_timeout("20x").factor, parse_step_timeout("20x:45").min_seconds
    (30.0, 20.0, 45.0)
    >>> parse_step_timeout("0") is None
    True
    """
    text = str(spec).strip()
    try:
        if text.endswith("x") or "x:" in text:
            factor, _, floor = text.partition("x")
            dog = Watchdog(factor=float(factor), **({"min_seconds": float(floor[1:])} if floor else {}))
        elif float(text) == 0:
            return None
        else:
            dog = Watchdog(seconds=float(text))
    except ValueError:
        raise LoopError(f"{setting} {spec!r}: give seconds (600), a multiple of the measured step time (10x, "
                        "at least 300 s) with an optional floor in seconds (10x:60), or 0 for no watchdog.") from None
    return dog


class Watchdog:
    """Ends the process when the training loop makes no progress within a bound (see the module docstring).

    Args:
      seconds: a fixed bound in seconds (None: ``factor`` times the measured step time).
      factor: the bound's multiple of the median time between beats.
      min_seconds: the least bound with ``factor`` (also the bound before two beats were measured).
      directory: where ``hang-p<process>.txt`` goes (None: the stacks go to stderr only).
      poll: how often the watchdog thread looks, in seconds.
    """

    def __init__(self, *, seconds: float | None = None, factor: float = 10.0, min_seconds: float = 300.0,
                 directory: str | Path | None = None, poll: float | None = None):
        for name, value in (("seconds", seconds), ("factor", factor), ("min_seconds", min_seconds)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise LoopError(f"Watchdog({name}={value!r}): must be a number > 0.")
        self.seconds, self.factor, self.min_seconds = seconds, float(factor), float(min_seconds)
        self.directory = None if directory is None else Path(directory)
        self.poll = poll if poll is not None else min(1.0, (seconds or min_seconds) / 10)
        self.intervals: deque[float] = deque(maxlen=100)
        self.step, self.fired = 0, False
        self._last: float | None = None       # None: not armed (before the first step, while paused)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bound(self, intervals: Sequence[float] | None = None) -> float:
        """The bound in seconds.

        Args:
          intervals: times between beats (None: those measured so far).

        Returns:
          ``seconds``, else ``factor`` x the median of ``intervals``, at least ``min_seconds``.
        """
        intervals = list(self.intervals if intervals is None else intervals)
        if self.seconds is not None:
            return self.seconds
        return max(self.min_seconds, self.factor * statistics.median(intervals)) if intervals else self.min_seconds

    def describe(self) -> str:
        """The bound in words, for the run's header."""
        bound = (f"{self.seconds:g} s" if self.seconds is not None else
                 f"{self.factor:g} x the median step time (at least {self.min_seconds:g} s)")
        return f"a step that takes over {bound} ends the run (exit status {HUNG_EXIT})"

    def __enter__(self) -> "Watchdog":
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, step: int) -> None:
        """Record progress: the loop dispatched a step (its batch built, the step ``max_inflight`` back done).

        Args:
          step: the number of steps dispatched.
        """
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self.intervals.append(now - self._last)
            self._last, self.step = now, step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time that does not count: an evaluation, a checkpoint save, a traced step. The clock restarts after."""
        with self._lock:
            armed, self._last = self._last is not None, None
        try:
            yield
        finally:
            with self._lock:
                self._last = time.monotonic() if armed else None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                waited = None if self._last is None else time.monotonic() - self._last
                bound = self.bound()
            if waited is not None and waited > bound:
                self._fire(waited, bound)

    def _fire(self, waited: float, bound: float) -> None:
        """Dump every thread's stack, print the error and end the process with :data:`HUNG_EXIT`."""
        self.fired = True
        process, count = jax.process_index(), jax.process_count()
        measured = (f"{self.factor:g} x the median step time {statistics.median(self.intervals):.3g} s, at least "
                    f"{self.min_seconds:g} s" if self.seconds is None and self.intervals else
                    "the set bound" if self.seconds is not None else f"at least {self.min_seconds:g} s")
        where = "stderr"
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                path = self.directory / f"hang-p{process}.txt"
                with open(path, "w") as f:
                    f.write(f"process {process} of {count}: no progress for {waited:.1f} s after step {self.step} "
                            f"was dispatched (bound {bound:.1f} s)\n\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                where = str(path)
            except OSError as e:
                where = f"stderr ({path} not written: {e})"
        if where.startswith("stderr"):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        error = StepHangError(
            f"no progress for {waited:.1f} s after step {self.step} was dispatched, over the bound of {bound:.1f} s "
            f"({measured}): "
            f"process {process} of {count} is stuck, or waits in a collective for a process that is stuck or gone. "
            f"This process's Python stacks are in {where} (every process writes its own; the stuck one shows where "
            f"it stopped). Exit status {HUNG_EXIT} (hung). Continue from the last checkpoint with --resume; if a "
            "step is slow rather than stuck, raise the bound (train.step_timeout, or --step-timeout).")
        print(f"jaxpar train: error: StepHangError: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if count > 1 and process == 0:       # the coordination service's host ends last
            time.sleep(min(LEADER_GRACE, bound))
        os._exit(HUNG_EXIT)
