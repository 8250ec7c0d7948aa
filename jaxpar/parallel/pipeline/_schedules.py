"""Pipeline schedules as plain data: the table ``tick x stage -> action``, its legality, its measures, and
the GPipe, 1F1B, interleaved, ZB-H1, PipeDream-2BW and PipeDream (weight stashing) tables.

Pure Python (no JAX), so a schedule can be built, checked and measured anywhere, then lowered
(:mod:`._instructions`) and run.

* ``p`` stages (devices on the pipe axis), ``m`` micro-batches, ``v`` chunks per device (``v > 1``
  only for interleaved). The layers are cut into ``p*v`` *virtual stages* placed round-robin:
  virtual stage ``k = chunk*p + stage``.
* Actions: ``F`` forward; ``B`` backward (with ``split_backward=False`` it also computes the weight
  gradient); ``W`` weight gradient (zero-bubble only); ``None`` is idle.
* Dependencies (all at a strictly earlier tick): F of virtual stage k needs F of k-1; B of k needs
  F of the same (micro-batch, k) and B of k+1; W needs B of the same (micro-batch, chunk, stage).
* **Unit-time table**: each device runs at most one action per tick, as the executor does.

The generators give each device its ordered action list and a greedy list scheduler
(:func:`simulate`) places every action at the earliest tick its dependencies and the order allow.
:func:`bubble_fraction` replays the orders with ``F = W = 1``, split ``B = 1``, fused ``B = 2``:
``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v*m+p-1)`` for interleaved, ``(p-1)/(3m+p-1)`` for ZB-H1.
:func:`lockstep` re-times a flush schedule so that every tick holds one kind of action (docs/pipeline.md,
"Lockstep programs").

Example:
    >>> s = one_f_one_b(4, 8)
    >>> num_ticks(s), bubble_fraction(s, exact=True), peak_in_flight(s)
    (22, Fraction(3, 11), (4, 3, 2, 1))
    >>> validate(Schedule("bad", 1, 1, 1, [[Action("B", 0)], [Action("F", 0)]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxpar.errors.ScheduleError: tick 0, stage 0: B(mb=0, chunk=0) runs before its dependency F(mb=0, ...
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional, Sequence

from jaxpar.errors import ScheduleError, check_int

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream-2bw", "pipedream")
_ALIASES = {**{k: k for k in SCHEDULE_KINDS}, "one_f_one_b": "1f1b", "interleaved_1f1b": "interleaved",
            "interleaved-1f1b": "interleaved", "zbh1": "zb-h1", "zb_h1": "zb-h1", "zero_bubble": "zb-h1",
            "zero_bubble_h1": "zb-h1", "pipedream_2bw": "pipedream-2bw", "2bw": "pipedream-2bw",
            "weight-stashing": "pipedream", "weight_stashing": "pipedream"}


@dataclass(frozen=True)
class Action:
    """One unit of work on one device: ``Action('F', 3)`` or ``Action('B', 3, chunk=1)``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in ("F", "B", "W"):
            raise ScheduleError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        check_int("Action", "microbatch", self.microbatch, 0, ScheduleError)
        check_int("Action", "chunk", self.chunk, 0, ScheduleError)

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


@dataclass(frozen=True)
class Schedule:
    """A ``table[tick][stage]`` of :class:`Action` (or ``None`` for idle) plus its shape; lists given as
    ``table`` become tuples. Build one with a generator and check a hand-made one with :func:`validate`."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    table: tuple[tuple[Optional[Action], ...], ...]
    split_backward: bool = False

    def __post_init__(self):
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))


# ----------------------------------------------------------------------------- dependencies and legality
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
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                a = orders[s][ptr[s]]
                deps = [(ds, d) for d, ds, _ in dependencies(a, s, p, v)]
                if any(d not in end for d in deps):
                    break
                t = max([free[s]] + [end[d] for d in deps])
                start[(s, a)], end[(s, a)] = t, t + dur(a)
                free[s], ptr[s], progressed = t + dur(a), ptr[s] + 1, True
        if not progressed:
            stuck = {s: str(orders[s][ptr[s]]) for s in range(p) if ptr[s] < len(orders[s])}
            raise ScheduleError(f"action order deadlocks: next actions per stage {stuck}")
    return start


def validate(s: Schedule) -> None:
    """Prove ``s`` legal or raise :class:`ScheduleError` naming tick, stage, action and problem.

    Checks: each F and B (and W iff ``split_backward``) for every (micro-batch, chunk) appears
    exactly once on the device owning that virtual stage, and every dependency ran at a strictly
    earlier tick.

    Args:
        s: the schedule table.

    Example:
        >>> validate(gpipe(2, 3))  # returns None when legal
    """
    if not isinstance(s, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(s).__name__}")
    p, m, v = s.num_stages, s.num_microbatches, s.num_chunks
    for name, value in (("num_stages", p), ("num_microbatches", m), ("num_chunks", v)):
        check_int("Schedule", name, value, 1, ScheduleError)
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
    for kind, mb, c, st in itertools.product(kinds, range(m), range(v), range(p)):
        if (Action(kind, mb, c), st) not in where:
            raise ScheduleError(f"missing action: {Action(kind, mb, c)} (virtual stage {c * p + st}) "
                                f"on stage {st} never runs")
    for (a, st), (t,) in sorted(where.items(), key=lambda kv: kv[1][0]):
        for d, dst, why in dependencies(a, st, p, v):
            (dt,) = where[(d, dst)]
            if dt >= t:
                raise ScheduleError(f"tick {t}, stage {st}: {a} runs before its dependency {d} on stage "
                                    f"{dst} (tick {dt}, must be earlier): {why}")


def stage_actions(s: Schedule, stage: int) -> list[Action]:
    """One device's actions in tick order, idle ticks left out: ``stage_actions(gpipe(2, 1), 0) == [F0, B0]``."""
    check_int("stage_actions", "stage", stage, 0, ScheduleError)
    if stage >= s.num_stages:
        raise ScheduleError(f"stage must be < num_stages={s.num_stages}, got stage={stage}")
    return [row[stage] for row in s.table if row[stage] is not None]


def num_ticks(s: Schedule) -> int:
    """Number of table rows (unit-time ticks): ``num_ticks(gpipe(4, 8)) == 22``."""
    return len(s.table)


# ----------------------------------------------------------------------------- measures
def timeline(s: Schedule) -> tuple[tuple[tuple[int, int, Action], ...], ...]:
    """Per stage, ``(start, end, action)`` after replaying each device's order with F = W = 1, split B = 1,
    fused B = 2 (``end`` exclusive).

    >>> timeline(gpipe(1, 1))
    (((0, 1, Action(kind='F', microbatch=0, chunk=0)), (1, 3, Action(kind='B', microbatch=0, chunk=0))),)
    """
    validate(s)
    orders = [stage_actions(s, st) for st in range(s.num_stages)]
    dur = lambda a: 2 if a.kind == "B" and not s.split_backward else 1  # noqa: E731
    start = simulate(orders, s.num_stages, s.num_chunks, dur)
    return tuple(tuple((start[(st, a)], start[(st, a)] + dur(a), a) for a in orders[st])
                 for st in range(s.num_stages))


def bubble_fraction(s: Schedule, exact: bool = False):
    """Idle time / (p * makespan) of the :func:`timeline` (see the module docstring).

    Args:
        s: the schedule table.
        exact: return a :class:`fractions.Fraction` instead of a float.

    Returns:
        The idle share, in ``[0, 1)``: ``bubble_fraction(gpipe(4, 8), exact=True) == Fraction(3, 11)``.
    """
    tl = timeline(s)
    span = max(end for stage in tl for _, end, _ in stage)
    work = sum(end - start for stage in tl for start, end, _ in stage)
    frac = 1 - Fraction(work, s.num_stages * span)
    return frac if exact else float(frac)


def peak_in_flight(s: Schedule, until: str = "B") -> tuple[int, ...]:
    """Per stage, the max number of (micro-batch, chunk) whose F ran but whose ``until`` hasn't.

    ``until='B'`` counts full activations, released by B; ``until='W'`` also counts micro-batches
    still waiting for their W (for fused schedules both agree).

    Args:
        s: the schedule table.
        until: ``'B'`` or ``'W'``: the action that releases a micro-batch.

    Returns:
        One peak count per stage: ``peak_in_flight(one_f_one_b(4, 8)) == (4, 3, 2, 1)``.
    """
    if until not in ("B", "W"):
        raise ScheduleError(f"until must be 'B' or 'W', got {until!r}")
    release = "W" if until == "W" and s.split_backward else "B"
    def peak(st: int) -> int:        # the most of the running count: +1 at each F, -1 at each release
        steps = [(a.kind == "F") - (a.kind == release) for a in stage_actions(s, st)]
        return max(itertools.accumulate(steps, initial=0))

    return tuple(peak(st) for st in range(s.num_stages))


def to_text(s: Schedule) -> str:
    """Grid with one row per stage, one column per tick (``F3``, ``B3``, ``W3``, ``F3.1``, ``.``).

    Args:
        s: the schedule table.

    Returns:
        A header line (name, sizes, ticks, bubble, peak in flight), then one line per stage.

    Example:
        >>> print(to_text(gpipe(2, 1)))
        gpipe p=2 m=1 v=1 ticks=4 bubble=0.5000 peak_in_flight=(1, 1)
        s0 | F0 .  .  B0
        s1 | .  F0 B0 .
    """
    label = lambda a: f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if s.num_chunks > 1 else "")   # noqa: E731
    cells = [["." if a is None else label(a) for a in row] for row in s.table]
    width = max([1] + [len(c) for row in cells for c in row])
    head = (f"{s.name} p={s.num_stages} m={s.num_microbatches} v={s.num_chunks} ticks={num_ticks(s)} "
            f"bubble={bubble_fraction(s):.4f} peak_in_flight={peak_in_flight(s)}")
    rows = [f"s{st} | " + " ".join(row[st].ljust(width) for row in cells).rstrip() for st in range(s.num_stages)]
    return "\n".join([head, *rows])


# ----------------------------------------------------------------------------- generators
def _build(name: str, p: int, m: int, v: int, split: bool,
           orders: Sequence[Sequence[Action]]) -> Schedule:
    start = simulate(orders, p, v, lambda a: 1)
    ticks = max(start.values()) + 1
    table = [[None] * p for _ in range(ticks)]
    for (s, a), t in start.items():
        table[t][s] = a
    sched = Schedule(name, p, m, v, table, split)
    validate(sched)  # generators must only ever emit legal tables
    return sched


def _check_pm(fn: str, p, m, m_ge_p: bool = False, why: str = "") -> None:
    """``p`` and ``m`` are ints >= 1 (and ``m >= p`` if ``m_ge_p``), else a :class:`ScheduleError` naming ``fn``."""
    check_int(fn, "p", p, 1, ScheduleError)
    check_int(fn, "m", m, 1, ScheduleError)
    if m_ge_p and m < p:
        raise ScheduleError(f"{fn} needs m >= p, got m={m} micro-batches for p={p} stages{why}; use m >= {p} (more "
                            "micro-batches per step)" + ("" if why else " or gpipe(p, m), which accepts any m"))


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (B in micro-batch order).

    >>> num_ticks(gpipe(2, 2)), peak_in_flight(gpipe(2, 2))
    (6, (2, 2))
    """
    _check_pm("gpipe", p, m)
    orders = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return _build("gpipe", p, m, 1, False, orders)


def _alternate(fwds: list[Action], bwds: list[Action], warm: int) -> list[Action]:
    """``warm`` forwards, then the next forward and the next backward in turn, then the remaining backwards."""
    order = fwds[:warm]
    for f, b in zip(fwds[warm:], bwds):
        order += [f, b]
    return order + bwds[len(fwds) - warm:]


def _one_f_one_b_order(p: int, m: int, s: int) -> list[Action]:
    return _alternate([Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)], min(p - s - 1, m))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush / Megatron 1F1B (needs ``m >= p``): stage ``s`` runs ``p-s-1`` warm-up forwards,
    then alternates F and B, then drains, so at most ``p-s`` micro-batches are in flight.

    >>> bubble_fraction(one_f_one_b(4, 4), exact=True)
    Fraction(3, 7)
    """
    _check_pm("one_f_one_b", p, m, m_ge_p=True)
    return _build("1f1b", p, m, 1, False, [_one_f_one_b_order(p, m, s) for s in range(p)])


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron interleaved 1F1B with ``v >= 2`` chunks per device (needs ``m % p == 0``).

    Forwards go in groups of ``p`` micro-batches per chunk (chunk 0, 1, ..., v-1), backwards in the
    mirrored chunk order. Stage ``s`` warms up with ``min((p-s-1)*2 + (v-1)*p, m*v)`` forwards.

    >>> bubble_fraction(interleaved_1f1b(4, 8, 2), exact=True)
    Fraction(3, 19)
    """
    _check_pm("interleaved_1f1b", p, m)
    check_int("interleaved_1f1b", "v", v, 2, ScheduleError)
    if m % p:
        raise ScheduleError(f"interleaved_1f1b needs m divisible by p, got m={m}, p={p}; "
                            f"use m={m + (-m) % p} (a multiple of {p})")
    total, group = m * v, p * v

    def fwd(k: int, forward: bool) -> Action:
        chunk = (k % group) // p
        return Action("F" if forward else "B", (k // group) * p + k % p,
                      chunk if forward else v - 1 - chunk)

    fwds, bwds = [fwd(k, True) for k in range(total)], [fwd(k, False) for k in range(total)]
    orders = [_alternate(fwds, bwds, min((p - s - 1) * 2 + (v - 1) * p, total)) for s in range(p)]
    return _build("interleaved", p, m, v, False, orders)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023; needs ``m >= p``): 1F1B's F/B order with B and W split; stage ``s`` runs
    ``W(j)`` right after ``B(j+s)`` and the last ``s`` W's at the end, so at most ``p`` micro-batches per
    stage await their W. Bubble ``(p-1)/(3m+p-1)``.

    >>> bubble_fraction(zero_bubble_h1(4, 8), exact=True)
    Fraction(1, 9)
    """
    _check_pm("zero_bubble_h1", p, m, m_ge_p=True)
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


def pipedream_2bw(p: int, m: int, steps: int = 1) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021): 1F1B that never drains, over ``steps`` optimizer steps of
    ``m >= p`` micro-batches (micro-batch ``i`` belongs to step ``i // m``).

    Stage ``s`` runs ``F(i)`` at tick ``2i + s`` and ``B(i)`` at tick ``2i + 2p - 1 - s``: step ``t+1``'s
    forwards start while step ``t``'s backwards finish, legal because step ``t`` reads ``W(t-1)``
    (:func:`jaxpar.parallel.pipeline._pipedream.step_windows`). ``steps=1`` is one step alone.

    Args:
        p: pipeline stages.
        m: micro-batches per optimizer step (>= ``p``).
        steps: optimizer steps in the table.

    Returns:
        The validated :class:`Schedule` of ``m * steps`` micro-batches.

    Example:
        >>> [num_ticks(pipedream_2bw(4, 8, k)) for k in (1, 2, 3)]     # 2m + 2(p-1), then + 2m per step
        [22, 38, 54]
    """
    _check_pm("pipedream_2bw", p, m, True, ": it runs 1F1B's steady state, whose stages hold micro-batches of "
              "at most two steps (two weight versions) only when a step has enough of them")
    return _no_flush("pipedream-2bw", p, m, steps)


def pipedream(p: int, m: int, steps: int = 1) -> Schedule:
    """PipeDream with weight stashing (Narayanan et al. 2019): :func:`pipedream_2bw`'s table for any
    ``m >= 1``, read with every stage updating its own weights after its backwards
    (:mod:`jaxpar.parallel.pipeline._pipedream`).

    Args:
        p: pipeline stages.
        m: micro-batches per optimizer step.
        steps: optimizer steps in the table.

    Returns:
        The validated :class:`Schedule` of ``m * steps`` micro-batches.

    Example:
        >>> [num_ticks(pipedream(4, 2, k)) for k in (1, 2, 3)]     # 2m + 2(p-1), then + 2m per step
        [10, 14, 18]
    """
    _check_pm("pipedream", p, m)
    return _no_flush("pipedream", p, m, steps)


def _no_flush(name: str, p: int, m: int, steps: int) -> Schedule:
    """1F1B's periodic steady state over ``m * steps`` micro-batches: ``F(i)`` at ``2i + s``, ``B(i)`` at ``2i + 2p-1-s``."""
    check_int(name, "steps", steps, 1, ScheduleError)
    n = m * steps
    table = [[None] * p for _ in range(2 * n + 2 * p - 2)]
    for i in range(n):
        for s in range(p):
            table[2 * i + s][s] = Action("F", i)
            table[2 * i + 2 * p - 1 - s][s] = Action("B", i)
    sched = Schedule(name, p, n, 1, table)
    validate(sched)
    return sched


def canonical_kind(kind: str) -> str:
    """A schedule name or alias (``"one_f_one_b"``, ``"zbh1"``, ``"2bw"``, ..., any case) -> one of
    :data:`SCHEDULE_KINDS`; unknown names raise: ``canonical_kind("one_f_one_b") == '1f1b'``."""
    key = _ALIASES.get(kind.lower()) if isinstance(kind, str) else None
    if key is None:
        raise ScheduleError(f"unknown schedule kind {kind!r}; allowed kinds: {', '.join(SCHEDULE_KINDS)} "
                            f"(aliases: {', '.join(sorted(set(_ALIASES) - set(SCHEDULE_KINDS)))})")
    return key


def get_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by name: ``get_schedule('1f1b', 4, 8)``, ``get_schedule('interleaved', 4, 8, v=2)``.

    Args:
        kind: a schedule name or alias (:func:`canonical_kind`).
        p: pipeline stages.
        m: micro-batches (per optimizer step for the PipeDream kinds, which build one step).
        v: chunks per device; only ``"interleaved"`` takes ``v != 1``.

    Returns:
        The validated :class:`Schedule`.
    """
    key = canonical_kind(kind)
    if key == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ScheduleError(f"v={v!r} virtual chunks only applies to kind 'interleaved'; use v=1 for {kind!r}")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "pipedream-2bw": pipedream_2bw,
            "pipedream": pipedream}[key](p, m)


# ----------------------------------------------------------------------------- lockstep
def is_lockstep(schedule: Schedule) -> bool:
    """Whether every tick of ``schedule`` holds one kind of action.

    Args:
        schedule: a schedule table.

    Returns:
        True if no tick mixes F, B and W.
    """
    return all(len({a.kind for a in row if a is not None}) <= 1 for row in schedule.table)


def lockstep(schedule: Schedule) -> Schedule:
    """``schedule`` re-timed so that every tick holds one kind of action (F, B or W), so a collective inside
    an action is reached by every device (docs/pipeline.md, "Lockstep programs", has the rule and the costs).

    Args:
        schedule: a valid schedule table.

    Returns:
        A valid table with the same actions on the same stages, one kind per tick, named
        ``"<name> (lockstep)"``; ``schedule`` itself if it already is one.

    Example:
        >>> s = lockstep(one_f_one_b(2, 4))
        >>> [sorted({a.kind for a in row if a}) for row in s.table][:4]
        [['F'], ['F'], ['B'], ['F']]
        >>> num_ticks(s), peak_in_flight(s)
        (10, (3, 1))
    """
    validate(schedule)
    if is_lockstep(schedule):
        return schedule
    p, v = schedule.num_stages, schedule.num_chunks
    total = sum(a is not None for row in schedule.table for a in row)
    orders = [stage_actions(schedule, s) for s in range(p)]
    room = [peak + p - 1 - s for s, peak in enumerate(peak_in_flight(schedule))]
    done: set = set()
    table, kind = [], "W"
    while len(done) < total:
        for kind in _AFTER[kind]:        # the next kind in F -> B -> W -> F that some stage can run
            row = [_next_of(kind, orders[s], s, done, p, v, room[s]) for s in range(p)]
            if any(a is not None for a in row):
                break
        done.update((s, a) for s, a in enumerate(row) if a is not None)
        table.append(row)
    out = Schedule(f"{schedule.name} (lockstep)", p, schedule.num_microbatches, v, table,
                   schedule.split_backward)
    validate(out)
    return out


#: The kinds to try after a tick of each kind, in order: F, B and W take turns.
_AFTER = {"F": ("B", "W", "F"), "B": ("W", "F", "B"), "W": ("F", "B", "W")}


def _next_of(kind: str, order: list[Action], s: int, done: set, p: int, v: int, room: int):
    """The action of ``kind`` stage ``s`` runs now, or ``None``: its next pending action if of
    ``kind`` and ready; for a forward, also the next forward ahead of pending backwards while the
    stage holds fewer than ``room`` micro-batches."""
    pending = [a for a in order if (s, a) not in done]
    if not pending:
        return None
    ready = lambda a: all((ds, d) in done for d, ds, _ in dependencies(a, s, p, v))   # noqa: E731
    if pending[0].kind == kind:
        return pending[0] if ready(pending[0]) else None
    if kind != "F":
        return None
    ahead = next((a for a in pending if a.kind == "F"), None)
    in_flight = sum((a.kind == "F") - (a.kind == "B") for a in order if (s, a) in done)
    return ahead if ahead is not None and ready(ahead) and in_flight < room else None
