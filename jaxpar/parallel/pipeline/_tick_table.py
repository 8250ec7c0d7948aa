"""The schedule table itself: ``tick x stage -> action``, its dependency rules and legality.

Pure Python (no JAX). The generators in :mod:`jaxpar.parallel.pipeline._schedules` build
tables; :mod:`jaxpar.parallel.pipeline._schedule_stats` measures them.

Model
-----
* ``p`` stages (devices on the pipe axis), ``m`` micro-batches, ``v`` model
  chunks per device (``v > 1`` only for the interleaved schedule). The layers
  are cut into ``p*v`` contiguous *virtual stages*, placed round-robin:
  virtual stage ``k = chunk*p + stage``, so device ``stage`` holds virtual
  stages ``stage, stage+p, stage+2p, ...``.
* Actions: ``F`` forward; ``B`` backward (input gradient; in schedules with
  ``split_backward=False`` it also computes the weight gradient, i.e. W is
  fused into B); ``W`` weight gradient (zero-bubble only); ``None`` is idle.
* Dependencies (all at a strictly earlier tick): F of virtual stage k needs
  F of k-1; B of k needs F of the same (micro-batch, k) and B of k+1 (the
  last virtual stage only its own F); W needs B of the same (micro-batch,
  chunk, stage).
* **Unit-time table.** Each device runs at most one action per tick and
  every action occupies exactly one tick: the abstraction of a synchronous
  SPMD executor that runs one action per tick. :func:`num_ticks` counts rows.

Example (one stage, one micro-batch, written by hand):
    >>> s = Schedule("tiny", 1, 1, 1, [[Action("F", 0)], [None], [Action("B", 0)]])
    >>> validate(s), num_ticks(s), stage_actions(s, 0)[1].label()
    (None, 3, 'B0')
    >>> validate(Schedule("bad", 1, 1, 1, [[Action("B", 0)], [Action("F", 0)]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxpar.errors.ScheduleError: tick 0, stage 0: B(mb=0, chunk=0) runs before its dependency F(mb=0, ...
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence
from jaxpar.errors import ScheduleError


def check_int(name: str, value, minimum: int, error: type[Exception] = ScheduleError) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``, else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {name}={value}")
    return value


@dataclass(frozen=True)
class Action:
    """One unit of work on one device: ``Action('F', 3)`` or ``Action('B', 3, chunk=1)``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in ("F", "B", "W"):
            raise ScheduleError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        check_int("microbatch", self.microbatch, 0)
        check_int("chunk", self.chunk, 0)

    def label(self, with_chunk: bool = False) -> str:
        """Compact cell text: ``F3`` or, with the chunk, ``F3.1``.

        Args:
            with_chunk: append ``.chunk`` (interleaved schedules).

        Returns:
            ``F3`` or, with the chunk, ``F3.1``.
        """
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if with_chunk else "")

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


Cell = Optional[Action]


@dataclass(frozen=True)
class Schedule:
    """A ``table[tick][stage]`` of :class:`Action` (or ``None`` for idle) plus its shape.

    Build one with a generator (``one_f_one_b(4, 8)``) and check a hand-made one
    with :func:`validate`. Lists given as ``table`` are converted to tuples.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    table: tuple[tuple[Cell, ...], ...]
    split_backward: bool = False

    def __post_init__(self):
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))


# ----------------------------------------------------------------------------- dependencies
def dependencies(a: Action, stage: int, p: int, v: int) -> list[tuple[Action, int, str]]:
    """``(dependency, its stage, why)`` for action ``a`` running on ``stage``."""
    k = a.chunk * p + stage
    if a.kind == "F":
        if k == 0:
            return []
        j = k - 1
        return [(Action("F", a.microbatch, j // p), j % p,
                 f"F of virtual stage {k} needs the activation from virtual stage {j}")]
    if a.kind == "B":
        out = [(Action("F", a.microbatch, a.chunk), stage,
                f"B of virtual stage {k} needs the activations saved by its own F")]
        if k < p * v - 1:
            j = k + 1
            out.append((Action("B", a.microbatch, j // p), j % p,
                        f"B of virtual stage {k} needs the output gradient from B of virtual stage {j}"))
        return out
    return [(Action("B", a.microbatch, a.chunk), stage, "W needs the B of the same micro-batch and chunk")]


def simulate(orders: Sequence[Sequence[Action]], p: int, v: int,
             dur: Callable[[Action], int]) -> dict[tuple[int, Action], int]:
    """Greedy in-order list scheduling: start time of every ``(stage, action)``."""
    start: dict[tuple[int, Action], int] = {}
    end: dict[tuple[int, Action], int] = {}
    ptr, free = [0] * p, [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                a = orders[s][ptr[s]]
                deps = [(ds, d) for d, ds, _ in dependencies(a, s, p, v)]
                if any(d not in end for d in deps):
                    break
                t = max([free[s]] + [end[d] for d in deps])
                start[(s, a)], end[(s, a)] = t, t + dur(a)
                free[s], ptr[s], remaining, progressed = t + dur(a), ptr[s] + 1, remaining - 1, True
        if not progressed:
            stuck = {s: str(orders[s][ptr[s]]) for s in range(p) if ptr[s] < len(orders[s])}
            raise ScheduleError(f"action order deadlocks: next actions per stage {stuck}")
    return start


# ----------------------------------------------------------------------------- validation
def _where(s: Schedule, a: Action, stage: int) -> str:
    return f"{a} (virtual stage {a.chunk * s.num_stages + stage}) on stage {stage}"


def validate(s: Schedule) -> None:
    """Prove ``s`` legal or raise :class:`ScheduleError` naming tick, stage, action and problem.

    Checks: each F and B (and W iff ``split_backward``) for every (micro-batch,
    chunk) appears exactly once on the device owning that virtual stage, and
    every dependency ran at a strictly earlier tick.

    Args:
        s: the schedule table.

    Example:
        >>> from jaxpar.parallel.pipeline._schedules import gpipe
        >>> validate(gpipe(2, 3))  # returns None when legal
    """
    if not isinstance(s, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(s).__name__}")
    p = check_int("num_stages", s.num_stages, 1)
    m = check_int("num_microbatches", s.num_microbatches, 1)
    v = check_int("num_chunks", s.num_chunks, 1)
    where: dict[tuple[Action, int], list[int]] = defaultdict(list)
    for t, row in enumerate(s.table):
        if len(row) != p:
            raise ScheduleError(f"tick {t}: row has {len(row)} cells, expected num_stages={p}")
        for st, a in enumerate(row):
            if a is None:
                continue
            if not isinstance(a, Action):
                raise ScheduleError(f"tick {t}, stage {st}: cell {a!r} is not an Action or None")
            if a.kind == "W" and not s.split_backward:
                raise ScheduleError(f"tick {t}, stage {st}: {a} is a separate W action, but {s.name!r} "
                                    f"has split_backward=False (W is fused into B)")
            if a.microbatch >= m or a.chunk >= v:
                raise ScheduleError(f"tick {t}, stage {st}: {a} is out of range "
                                    f"(num_microbatches={m}, num_chunks={v})")
            where[(a, st)].append(t)
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    dups = sorted((ticks[1], st, a, ticks[0]) for (a, st), ticks in where.items() if len(ticks) > 1)
    if dups:
        t, st, a, first = dups[0]
        missing = [o for o in range(p) if (a, o) not in where]
        hint = (f"; each stage runs it once and stage {missing[0]} never does "
                f"(action placed on the wrong device?)" if missing else "")
        raise ScheduleError(f"tick {t}, stage {st}: duplicate {a}, already ran there at tick {first}{hint}")
    for kind in kinds:
        for mb in range(m):
            for c in range(v):
                for st in range(p):
                    if (Action(kind, mb, c), st) not in where:
                        raise ScheduleError(f"missing action: {_where(s, Action(kind, mb, c), st)} never runs")
    for (a, st), (t,) in sorted(where.items(), key=lambda kv: kv[1][0]):
        for d, dst, why in dependencies(a, st, p, v):
            (dt,) = where[(d, dst)]
            if dt >= t:
                raise ScheduleError(f"tick {t}, stage {st}: {a} runs before its dependency {d} on stage "
                                    f"{dst} (tick {dt}, must be earlier): {why}")


# ----------------------------------------------------------------------------- reading the table
def stage_actions(s: Schedule, stage: int) -> list[Action]:
    """Actions of one device in tick order: ``stage_actions(gpipe(2, 1), 0) == [F0, B0]``.

    Args:
        s: the schedule table.
        stage: the device's stage index.

    Returns:
        Its actions, idle ticks left out.
    """
    check_int("stage", stage, 0)
    if stage >= s.num_stages:
        raise ScheduleError(f"stage must be < num_stages={s.num_stages}, got stage={stage}")
    return [row[stage] for row in s.table if row[stage] is not None]


def num_ticks(s: Schedule) -> int:
    """Number of table rows (unit-time ticks): ``num_ticks(gpipe(4, 8)) == 22``.

    Args:
        s: the schedule table.

    Returns:
        ``len(s.table)``.
    """
    return len(s.table)
