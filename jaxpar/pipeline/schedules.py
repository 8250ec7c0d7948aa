"""Pipeline-parallel schedules as plain data: a ``tick x stage -> action`` table.

Pure Python (no JAX), so a schedule can be built, checked and measured anywhere
and then handed to an executor.

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

Tables are produced by a greedy list scheduler: each device gets its ordered
action list from the schedule's policy (GPipe, Megatron 1F1B, Megatron
interleaved, ZB-H1) and every action is placed at the earliest tick allowed
by its dependencies and by the device's order.

Cost model for :func:`bubble_fraction`
--------------------------------------
Work is weighted by :func:`duration`: ``F = 1``, split ``B = 1``, ``W = 1``,
fused ``B = 2`` (it does B and W). The per-device orders are replayed with
these durations (:func:`timeline`, same greedy rule, in time units) and
``bubble = 1 - work / (p * makespan)``. This yields exactly
``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v*m+p-1)`` for interleaved
and ``(p-1)/(3m+p-1)`` for ZB-H1 (the paper's ``(p-1)(T_F+T_B-T_W)`` bubble
with equal F/B/W costs), so all four schedules compare the same total work.
For these generators the unit-tick table gives the same fractions
(:func:`tick_bubble_fraction`).

Example:
    >>> s = one_f_one_b(4, 8)
    >>> num_ticks(s), bubble_fraction(s, exact=True), peak_in_flight(s)
    (22, Fraction(3, 11), (4, 3, 2, 1))
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional, Sequence

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULE_KINDS",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "get_schedule", "canonical_kind",
    "validate", "stage_actions", "num_ticks", "duration", "timeline", "makespan",
    "bubble_fraction", "tick_bubble_fraction", "peak_in_flight", "to_text",
]

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "one_f_one_b": "1f1b",
            "interleaved": "interleaved", "interleaved_1f1b": "interleaved",
            "interleaved-1f1b": "interleaved", "zb-h1": "zb-h1", "zbh1": "zb-h1",
            "zb_h1": "zb-h1", "zero_bubble": "zb-h1", "zero_bubble_h1": "zb-h1"}


class ScheduleError(ValueError):
    """A schedule table is illegal (missing/duplicate action or broken dependency)."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")
    return value


@dataclass(frozen=True)
class Action:
    """One unit of work on one device: ``Action('F', 3)`` or ``Action('B', 3, chunk=1)``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in ("F", "B", "W"):
            raise ValueError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        _check_int("microbatch", self.microbatch, 0)
        _check_int("chunk", self.chunk, 0)

    def label(self, with_chunk: bool = False) -> str:
        """Compact cell text: ``F3`` or, with the chunk, ``F3.1``."""
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
def _deps(a: Action, stage: int, p: int, v: int) -> list[tuple[Action, int, str]]:
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


def _simulate(orders: Sequence[Sequence[Action]], p: int, v: int,
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
                deps = [(ds, d) for d, ds, _ in _deps(a, s, p, v)]
                if any(d not in end for d in deps):
                    break
                t = max([free[s]] + [end[d] for d in deps])
                start[(s, a)], end[(s, a)] = t, t + dur(a)
                free[s], ptr[s], remaining, progressed = t + dur(a), ptr[s] + 1, remaining - 1, True
        if not progressed:
            stuck = {s: str(orders[s][ptr[s]]) for s in range(p) if ptr[s] < len(orders[s])}
            raise ScheduleError(f"action order deadlocks: next actions per stage {stuck}")
    return start


def _build(name: str, p: int, m: int, v: int, split: bool,
           orders: Sequence[Sequence[Action]]) -> Schedule:
    start = _simulate(orders, p, v, lambda a: 1)
    ticks = max(start.values()) + 1
    table = [[None] * p for _ in range(ticks)]
    for (s, a), t in start.items():
        table[t][s] = a
    sched = Schedule(name, p, m, v, table, split)
    validate(sched)  # generators must only ever emit legal tables
    return sched


# ----------------------------------------------------------------------------- generators
def _check_pm(p, m) -> None:
    _check_int("p (num_stages)", p, 1)
    _check_int("m (num_microbatches)", m, 1)


def _need_m_ge_p(fn: str, p: int, m: int) -> None:
    if m < p:
        raise ValueError(f"{fn} needs m >= p, got m={m} micro-batches for p={p} stages; "
                         f"use m >= {p} (more micro-batches per step) or gpipe(p, m), which accepts any m")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (B in micro-batch order).

    >>> num_ticks(gpipe(2, 2)), peak_in_flight(gpipe(2, 2))
    (6, (2, 2))
    """
    _check_pm(p, m)
    orders = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return _build("gpipe", p, m, 1, False, orders)


def _one_f_one_b_order(p: int, m: int, s: int) -> list[Action]:
    warm = min(p - s - 1, m)
    order = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [Action("F", warm + i), Action("B", i)]
    return order + [Action("B", i) for i in range(m - warm, m)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush / Megatron non-interleaved 1F1B (needs ``m >= p``).

    Stage ``s`` runs ``p-s-1`` warm-up forwards, then alternates F and B, then
    drains the remaining B's, so at most ``p-s`` micro-batches are in flight.

    >>> bubble_fraction(one_f_one_b(4, 4), exact=True)
    Fraction(3, 7)
    """
    _check_pm(p, m)
    _need_m_ge_p("one_f_one_b", p, m)
    return _build("1f1b", p, m, 1, False, [_one_f_one_b_order(p, m, s) for s in range(p)])


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron interleaved 1F1B with ``v`` chunks per device (needs ``m % p == 0``).

    Forwards go in groups of ``p`` micro-batches per chunk (chunk 0, 1, ..., v-1),
    backwards in the mirrored chunk order. Stage ``s`` warms up with
    ``min((p-s-1)*2 + (v-1)*p, m*v)`` forwards, then alternates F and B.

    >>> bubble_fraction(interleaved_1f1b(4, 8, 2), exact=True)
    Fraction(3, 19)
    """
    _check_pm(p, m)
    _check_int("v (num_chunks)", v, 2)
    if m % p:
        raise ValueError(f"interleaved_1f1b needs m divisible by p, got m={m}, p={p}; "
                         f"use m={m + (-m) % p} (a multiple of {p})")
    total, group = m * v, p * v

    def fwd(k: int, forward: bool) -> Action:
        chunk = (k % group) // p
        return Action("F" if forward else "B", (k // group) * p + k % p,
                      chunk if forward else v - 1 - chunk)

    orders = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [fwd(k, True) for k in range(warm)]
        for k in range(total - warm):
            order += [fwd(k + warm, True), fwd(k, False)]
        orders.append(order + [fwd(k, False) for k in range(total - warm, total)])
    return _build("interleaved", p, m, v, False, orders)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): B and W split, W's deferred to fill the cool-down.

    The F/B order is 1F1B's (same warm-up, same in-flight activations); stage
    ``s`` runs ``W(j)`` right after ``B(j+s)`` and the last ``s`` W's at the end,
    so at most ``p`` micro-batches per stage await their W (1F1B's peak).
    Bubble: ``(p-1)/(3m+p-1)`` vs 1F1B's ``(p-1)/(m+p-1)``. Needs ``m >= p``.

    >>> bubble_fraction(zero_bubble_h1(4, 8), exact=True)
    Fraction(1, 9)
    """
    _check_pm(p, m)
    _need_m_ge_p("zero_bubble_h1", p, m)
    orders = []
    for s in range(p):
        order, next_w = [], 0
        for a in _one_f_one_b_order(p, m, s):
            order.append(a)
            if a.kind == "B" and a.microbatch - s >= 0:
                order.append(Action("W", a.microbatch - s))
                next_w += 1
        orders.append(order + [Action("W", j) for j in range(next_w, m)])
    return _build("zb-h1", p, m, 1, True, orders)


def canonical_kind(kind: str) -> str:
    """A schedule name or alias -> one of :data:`SCHEDULE_KINDS`; unknown names raise.

    >>> canonical_kind("one_f_one_b")
    '1f1b'
    """
    key = _ALIASES.get(kind.lower()) if isinstance(kind, str) else None
    if key is None:
        raise ValueError(f"unknown schedule kind {kind!r}; allowed kinds: {', '.join(SCHEDULE_KINDS)} "
                         f"(aliases: {', '.join(sorted(set(_ALIASES) - set(SCHEDULE_KINDS)))})")
    return key


def get_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by name: ``get_schedule('1f1b', 4, 8)``, ``get_schedule('interleaved', 4, 8, v=2)``."""
    key = canonical_kind(kind)
    if key == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(f"v={v!r} virtual chunks only applies to kind 'interleaved'; use v=1 for {kind!r}")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1}[key](p, m)


# ----------------------------------------------------------------------------- validation
def _where(s: Schedule, a: Action, stage: int) -> str:
    return f"{a} (virtual stage {a.chunk * s.num_stages + stage}) on stage {stage}"


def validate(s: Schedule) -> None:
    """Prove ``s`` legal or raise :class:`ScheduleError` naming tick, stage, action and problem.

    Checks: each F and B (and W iff ``split_backward``) for every (micro-batch,
    chunk) appears exactly once on the device owning that virtual stage, and
    every dependency ran at a strictly earlier tick.

    >>> validate(gpipe(2, 3))  # returns None when legal
    """
    if not isinstance(s, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(s).__name__}")
    p = _check_int("num_stages", s.num_stages, 1)
    m = _check_int("num_microbatches", s.num_microbatches, 1)
    v = _check_int("num_chunks", s.num_chunks, 1)
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
        for d, dst, why in _deps(a, st, p, v):
            (dt,) = where[(d, dst)]
            if dt >= t:
                raise ScheduleError(f"tick {t}, stage {st}: {a} runs before its dependency {d} on stage "
                                    f"{dst} (tick {dt}, must be earlier): {why}")


# ----------------------------------------------------------------------------- metrics
def stage_actions(s: Schedule, stage: int) -> list[Action]:
    """Actions of one device in tick order: ``stage_actions(gpipe(2, 1), 0) == [F0, B0]``."""
    _check_int("stage", stage, 0)
    if stage >= s.num_stages:
        raise ValueError(f"stage must be < num_stages={s.num_stages}, got stage={stage}")
    return [row[stage] for row in s.table if row[stage] is not None]


def num_ticks(s: Schedule) -> int:
    """Number of table rows (unit-time ticks): ``num_ticks(gpipe(4, 8)) == 22``."""
    return len(s.table)


def duration(a: Action, split_backward: bool) -> int:
    """Cost of ``a`` in the bubble model: F=1, W=1, B=1 when split, B=2 when fused (B+W)."""
    return 2 if a.kind == "B" and not split_backward else 1


def timeline(s: Schedule) -> tuple[tuple[tuple[int, int, Action], ...], ...]:
    """Per stage, ``(start, end, action)`` after replaying each device's order with :func:`duration`.

    >>> timeline(gpipe(1, 1))
    (((0, 1, Action(kind='F', microbatch=0, chunk=0)), (1, 3, Action(kind='B', microbatch=0, chunk=0))),)
    """
    validate(s)
    orders = [stage_actions(s, st) for st in range(s.num_stages)]
    dur = lambda a: duration(a, s.split_backward)  # noqa: E731
    start = _simulate(orders, s.num_stages, s.num_chunks, dur)
    return tuple(tuple((start[(st, a)], start[(st, a)] + dur(a), a) for a in orders[st])
                 for st in range(s.num_stages))


def makespan(s: Schedule) -> int:
    """Total time of one step under the :func:`duration` cost model."""
    return max(end for stage in timeline(s) for _, end, _ in stage)


def bubble_fraction(s: Schedule, exact: bool = False):
    """Idle time / (p * makespan) under the :func:`duration` cost model (see module doc).

    ``exact=True`` returns a :class:`fractions.Fraction`:
    ``bubble_fraction(gpipe(4, 8), exact=True) == Fraction(3, 11)``.
    """
    tl = timeline(s)
    span = max(end for stage in tl for _, end, _ in stage)
    work = sum(end - start for stage in tl for start, end, _ in stage)
    frac = 1 - Fraction(work, s.num_stages * span)
    return frac if exact else float(frac)


def tick_bubble_fraction(s: Schedule, exact: bool = False):
    """Idle cells / all cells of the unit-tick table (every action one tick)."""
    idle = sum(a is None for row in s.table for a in row)
    frac = Fraction(idle, max(1, len(s.table) * s.num_stages))
    return frac if exact else float(frac)


def peak_in_flight(s: Schedule, until: str = "B") -> tuple[int, ...]:
    """Per stage, the max number of (micro-batch, chunk) whose F ran but whose ``until`` hasn't.

    ``until='B'`` (default) counts full activations, released by B. ``until='W'``
    also counts micro-batches still waiting for their W (which needs only the
    smaller inputs/output-grads); for fused schedules both agree.
    ``peak_in_flight(one_f_one_b(4, 8)) == (4, 3, 2, 1)``.
    """
    if until not in ("B", "W"):
        raise ValueError(f"until must be 'B' or 'W', got {until!r}")
    release = "W" if until == "W" and s.split_backward else "B"
    peaks = []
    for st in range(s.num_stages):
        live = peak = 0
        for a in stage_actions(s, st):
            live += (a.kind == "F") - (a.kind == release)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def to_text(s: Schedule) -> str:
    """Grid with one row per stage, one column per tick (``F3``, ``B3``, ``W3``, ``F3.1``, ``.``).

    >>> print(to_text(gpipe(2, 1)))
    gpipe p=2 m=1 v=1 ticks=4 bubble=0.5000 peak_in_flight=(1, 1)
    s0 | F0 .  .  B0
    s1 | .  F0 B0 .
    """
    chunks = s.num_chunks > 1
    cells = [["." if a is None else a.label(chunks) for a in row] for row in s.table]
    width = max([1] + [len(c) for row in cells for c in row])
    head = (f"{s.name} p={s.num_stages} m={s.num_microbatches} v={s.num_chunks} ticks={num_ticks(s)} "
            f"bubble={bubble_fraction(s):.4f} peak_in_flight={peak_in_flight(s)}")
    lines = [head]
    for st in range(s.num_stages):
        lines.append(f"s{st} | " + " ".join(row[st].ljust(width) for row in cells).rstrip())
    return "\n".join(lines)
