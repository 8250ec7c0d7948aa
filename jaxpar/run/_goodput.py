"""Goodput: a run's wall time split into what it spent it on, cumulative across resumes.

:class:`Goodput` is the run's clock. The loop times each piece of host work into one bucket
(:data:`BUCKETS`): the steps (split at each metrics fetch into ``productive`` and ``skipped`` by the
steps' own ``skipped`` flag), ``compile`` (every trace, lowering and XLA compile on the loop's thread,
from JAX's compile events, wherever it happens: the first call of each program, a recompile, the
eval program; a program built inside another's trace, such as the pipeline's stage probe, counted once), ``checkpoint_save`` (the blocking part of a save and the waits for pending saves),
``checkpoint_restore``, ``data_wait`` (building a batch while the device has no step left to run),
``eval`` and ``logging`` (fetching metrics, records and progress lines). ``lost`` holds the steps an
earlier attempt did after the checkpoint this run resumed from, redone now. ``other`` is the wall
time no bucket measured: the remainder, reported with its share so that it can be bounded.

A resumed run starts from the buckets its predecessor recorded in its last record with them
(``goodput/...`` keys of the ``train`` and ``preempted`` records of ``metrics.jsonl``,
:meth:`Goodput.carry`); an attempt's time after its last record (a ``kill -9``) is in no bucket
and not in the wall time.

Example::

    >>> import time
    >>> clock = Goodput()
    >>> with clock.timed("steps"):
    ...     time.sleep(0.02)
    >>> clock.split(steps=4, skipped=1)                # the fetched window: 4 steps, 1 skipped
    >>> g = clock.fields()
    >>> round(g["goodput/skipped_s"] / (g["goodput/productive_s"] + g["goodput/skipped_s"]), 2)
    0.25
    >>> 0 < g["goodput/goodput"] < 1, g["goodput/attempts"]
    (True, 1)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from typing import Any, Iterator, Sequence

#: The measured buckets, in the order the report lists them; ``other`` is the remainder.
BUCKETS = ("productive", "compile", "checkpoint_save", "checkpoint_restore", "data_wait", "eval", "skipped",
           "lost", "logging")
#: JAX's duration events of building a program: tracing, lowering to StableHLO and the XLA compile.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_PREFIX = "goodput/"

_compiled: defaultdict[int, float] = defaultdict(float)    # seconds of compile events per thread
_spans: defaultdict[int, list[list[float]]] = defaultdict(list)   # per thread: their disjoint (start, end), in order


def _on_duration(event: str, duration: float, **_: Any) -> None:
    """Add a compile event's seconds not already counted: those outside the earlier events of its thread.

    An event nests others: a program built while another is traced (the pipeline's stage probe and its
    partitioner's cost analysis compile inside the step's trace) reports its own trace, lowering and compile
    before the outer trace reports all of its time. Each event is the span ``[now - duration, now]``; the
    thread's compile time is the length of their union, so no second is counted twice.
    """
    if event not in COMPILE_EVENTS:
        return
    thread, end = threading.get_ident(), time.perf_counter()
    start, spans, covered = end - duration, _spans[thread], 0.0
    merged = start
    while spans and spans[-1][1] > start:          # the earlier spans this one overlaps (they end before it)
        a, b = spans.pop()
        covered += min(b, end) - max(a, start)
        merged = min(merged, a)
    spans.append([merged, end])
    del spans[:-256]                               # an event as long as 256 earlier ones is not looked for
    _compiled[thread] += max(0.0, duration - covered)


@functools.cache
def _listen() -> None:
    """Register the one compile-event listener of the process (once)."""
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
    """Seconds this thread has spent tracing, lowering and compiling programs since the listener started.

    Returns:
      The running total (differences of two calls time what happened between them).
    """
    return _compiled[threading.get_ident()]


class Goodput:
    """A run's clock: seconds per bucket (:data:`BUCKETS`) since it was made, plus an earlier attempt's.

    Made when the run starts (before a restore it times); the loop adds the rest.
    """

    def __init__(self) -> None:
        _listen()
        self.t0 = time.perf_counter()
        self.compile0 = compile_seconds()
        self.seconds = dict.fromkeys(BUCKETS, 0.0)     # this attempt's, compile excluded (it is the listener's)
        self.steps_s = 0.0                             # step time not yet split into productive / skipped
        self.base = dict.fromkeys(BUCKETS, 0.0)        # the earlier attempts' (carry)
        self.base_wall, self.lost_steps, self.attempts = 0.0, 0, 1

    def mark(self) -> tuple[float, float]:
        """The start of a timed piece of work: ``(time, compile seconds)``, for :meth:`add`."""
        return time.perf_counter(), compile_seconds()

    def add(self, bucket: str, mark: tuple[float, float]) -> None:
        """Add the time since ``mark`` to ``bucket`` (``"steps"``: split later), less the compile inside it.

        Args:
          bucket: one of :data:`BUCKETS`, or ``"steps"``.
          mark: what :meth:`mark` returned when the work began.
        """
        seconds = time.perf_counter() - mark[0] - (compile_seconds() - mark[1])
        if bucket == "steps":
            self.steps_s += seconds
        else:
            self.seconds[bucket] += seconds

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[tuple[float, float]]:
        """Time the ``with`` block into ``bucket`` (:meth:`add`; an exception leaves it untimed).

        Args:
          bucket: one of :data:`BUCKETS`, or ``"steps"``.

        Yields:
          The block's :meth:`mark`.
        """
        mark = self.mark()
        yield mark
        self.add(bucket, mark)

    def split(self, steps: int, skipped: int) -> None:
        """Split the step time since the last split: ``skipped`` of the ``steps`` fetched steps dropped
        their update (their share of the time is ``skipped``), the rest are productive.

        Args:
          steps: the steps fetched since the last split.
          skipped: how many of them were skipped.
        """
        share = skipped / steps if steps else 0.0
        self.seconds["skipped"] += self.steps_s * share
        self.seconds["productive"] += self.steps_s * (1.0 - share)
        self.steps_s = 0.0

    def totals(self) -> tuple[dict[str, float], float]:
        """The cumulative seconds per bucket (earlier attempts included) and the cumulative wall time."""
        own = {**self.seconds, "compile": compile_seconds() - self.compile0}
        own["productive"] += self.steps_s
        return {b: self.base[b] + own[b] for b in BUCKETS}, self.base_wall + time.perf_counter() - self.t0

    def fields(self) -> dict[str, float | int]:
        """The cumulative goodput as record fields (``goodput/<bucket>_s``, ``goodput/other_s``,
        ``goodput/wall_s``, ``goodput/goodput``, ``goodput/lost_steps``, ``goodput/attempts``).

        Returns:
          The fields; TensorBoard shows each under its name.
        """
        seconds, wall = self.totals()
        other = wall - sum(seconds.values())
        return {**{f"{_PREFIX}{b}_s": s for b, s in seconds.items()}, f"{_PREFIX}other_s": other,
                f"{_PREFIX}wall_s": wall, f"{_PREFIX}goodput": seconds["productive"] / wall if wall > 0 else 0.0,
                f"{_PREFIX}lost_steps": self.lost_steps, f"{_PREFIX}attempts": self.attempts}

    def carry(self, kept: Sequence[dict], dropped: Sequence[dict], start: int) -> None:
        """Start from an earlier attempt's buckets: those of its last record with them. The steps it did after
        ``start`` (records in ``dropped``) are redone by this run: their step time moves to ``lost``.

        Args:
          kept: the earlier records this run keeps (steps up to ``start``).
          dropped: the earlier attempt's records after ``start``, in the order written.
          start: the step this run starts from.
        """
        kept = [r for r in kept if _PREFIX + "wall_s" in r]
        later = [r for r in dropped if _PREFIX + "wall_s" in r]
        if not kept and not later:
            return
        last = (later or kept)[-1]
        self.base = {b: float(last.get(f"{_PREFIX}{b}_s", 0.0)) for b in BUCKETS}
        self.base_wall = float(last[_PREFIX + "wall_s"])
        self.lost_steps = int(last.get(_PREFIX + "lost_steps", 0))
        self.attempts = int(last.get(_PREFIX + "attempts", 1)) + 1
        if later:
            for bucket in ("productive", "skipped"):
                redone = self.base[bucket] - _at_step(kept + later, start, bucket)
                self.base[bucket] -= redone
                self.base["lost"] += redone
            self.lost_steps += int(last["step"]) - start

    def summary(self) -> dict[str, float | int]:
        """The cumulative goodput for ``summary.json``: ``goodput``, ``wall_s``, ``<bucket>_s``, ``other_s``,
        ``lost_steps`` and ``attempts``."""
        return {k[len(_PREFIX):]: v for k, v in self.fields().items()}


def _at_step(records: Sequence[dict], step: int, bucket: str) -> float:
    """A bucket's cumulative seconds at ``step``: the record there, else interpolated linearly between the
    records around it (steps cost alike), else the last one before it (0 without one)."""
    before = [r for r in records if r["step"] <= step]
    after = [r for r in records if r["step"] > step]
    key = f"{_PREFIX}{bucket}_s"
    if not before:
        return 0.0
    b = before[-1]
    if b["step"] == step or not after:
        return float(b.get(key, 0.0))
    a = after[0]
    frac = (step - b["step"]) / (a["step"] - b["step"])
    return float(b.get(key, 0.0)) + frac * (float(a.get(key, 0.0)) - float(b.get(key, 0.0)))


def describe(goodput: dict[str, float | int]) -> str:
    """The closing line's words: ``goodput 93.1% (compile 3.2%, checkpoint save 1.0%, ...)``.

    Args:
      goodput: :meth:`Goodput.summary`'s dict.

    Returns:
      The share of productive time, then each other bucket of at least 0.05% of the wall time, largest first;
      the lost steps and attempts when there were restarts.

    Example:
      >>> describe({"goodput": 0.9, "wall_s": 10.0, "productive_s": 9.0, "compile_s": 0.7, "lost_s": 0.3,
      ...           "other_s": 0.0, "lost_steps": 3, "attempts": 2})
      'goodput 90.0% over 2 attempts (compile 7.0%, lost 3.0% in 3 redone steps)'
    """
    wall = goodput["wall_s"] or 1.0
    shares = sorted(((k[:-2], v / wall) for k, v in goodput.items()
                     if k.endswith("_s") and k not in ("wall_s", "productive_s") and v / wall >= 5e-4),
                    key=lambda kv: -kv[1])
    parts = [f"{name.replace('_', ' ')} {share:.1%}" + (f" in {goodput['lost_steps']} redone steps"
                                                         if name == "lost" else "") for name, share in shares]
    attempts = f" over {goodput['attempts']} attempts" if goodput.get("attempts", 1) > 1 else ""
    return f"goodput {goodput['goodput']:.1%}{attempts}" + (f" ({', '.join(parts)})" if parts else "")
