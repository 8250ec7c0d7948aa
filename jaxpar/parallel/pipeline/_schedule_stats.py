"""How good a schedule table is: bubble, makespan, in-flight micro-batches, and a text grid.

Pure Python (no JAX); reads the :class:`~jaxpar.parallel.pipeline.Schedule`
tables that :mod:`jaxpar.parallel.pipeline._schedules` builds.

Cost model for :func:`bubble_fraction`
--------------------------------------
Work is weighted by :func:`duration`: ``F = 1``, split ``B = 1``, ``W = 1``,
fused ``B = 2`` (it does B and W). The per-device orders are replayed with
these durations (:func:`timeline`, the generators' greedy rule, in time units)
and ``bubble = 1 - work / (p * makespan)``. This yields exactly
``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v*m+p-1)`` for interleaved
and ``(p-1)/(3m+p-1)`` for ZB-H1 (the paper's ``(p-1)(T_F+T_B-T_W)`` bubble
with equal F/B/W costs), so all four schedules compare the same total work.
For these generators the unit-tick table gives the same fractions
(:func:`tick_bubble_fraction`).

Example:
    >>> from jaxpar.parallel.pipeline._schedules import gpipe, zero_bubble_h1
    >>> s = zero_bubble_h1(4, 8)
    >>> bubble_fraction(s, exact=True), bubble_fraction(gpipe(4, 8), exact=True), makespan(s)
    (Fraction(1, 9), Fraction(3, 11), 27)
    >>> peak_in_flight(s), peak_in_flight(s, until="W")
    ((4, 3, 2, 1), (4, 4, 4, 4))
"""
from __future__ import annotations

from fractions import Fraction

from jaxpar.parallel.pipeline._tick_table import Action, Schedule, num_ticks, simulate, stage_actions, validate
from jaxpar.errors import ScheduleError


def duration(a: Action, split_backward: bool) -> int:
    """Cost of ``a`` in the bubble model: F=1, W=1, B=1 when split, B=2 when fused (B+W).

    Args:
        a: the action.
        split_backward: whether the schedule splits B and W.

    Returns:
        Its length in time units.
    """
    return 2 if a.kind == "B" and not split_backward else 1


def timeline(s: Schedule) -> tuple[tuple[tuple[int, int, Action], ...], ...]:
    """Per stage, ``(start, end, action)`` after replaying each device's order with :func:`duration`.

    Args:
        s: the schedule table.

    Returns:
        One tuple per stage of ``(start, end, action)``, ``end`` exclusive.

    Example:
        >>> from jaxpar.parallel.pipeline._schedules import gpipe
        >>> timeline(gpipe(1, 1))
        (((0, 1, Action(kind='F', microbatch=0, chunk=0)), (1, 3, Action(kind='B', microbatch=0, chunk=0))),)
    """
    validate(s)
    orders = [stage_actions(s, st) for st in range(s.num_stages)]
    dur = lambda a: duration(a, s.split_backward)  # noqa: E731
    start = simulate(orders, s.num_stages, s.num_chunks, dur)
    return tuple(tuple((start[(st, a)], start[(st, a)] + dur(a), a) for a in orders[st])
                 for st in range(s.num_stages))


def makespan(s: Schedule) -> int:
    """Total time of one step under the :func:`duration` cost model.

    Args:
        s: the schedule table.

    Returns:
        The latest end of any stage's :func:`timeline`.
    """
    return max(end for stage in timeline(s) for _, end, _ in stage)


def bubble_fraction(s: Schedule, exact: bool = False):
    """Idle time / (p * makespan) under the :func:`duration` cost model (see module doc).

    ``exact=True`` returns a :class:`fractions.Fraction`:
    ``bubble_fraction(gpipe(4, 8), exact=True) == Fraction(3, 11)``.

    Args:
        s: the schedule table.
        exact: return a :class:`fractions.Fraction` instead of a float.

    Returns:
        The idle share, in ``[0, 1)``.
    """
    tl = timeline(s)
    span = max(end for stage in tl for _, end, _ in stage)
    work = sum(end - start for stage in tl for start, end, _ in stage)
    frac = 1 - Fraction(work, s.num_stages * span)
    return frac if exact else float(frac)


def tick_bubble_fraction(s: Schedule, exact: bool = False):
    """Idle cells / all cells of the unit-tick table (every action one tick).

    Args:
        s: the schedule table.
        exact: return a :class:`fractions.Fraction` instead of a float.

    Returns:
        The idle share of the table's cells.
    """
    idle = sum(a is None for row in s.table for a in row)
    frac = Fraction(idle, max(1, len(s.table) * s.num_stages))
    return frac if exact else float(frac)


def peak_in_flight(s: Schedule, until: str = "B") -> tuple[int, ...]:
    """Per stage, the max number of (micro-batch, chunk) whose F ran but whose ``until`` hasn't.

    ``until='B'`` (default) counts full activations, released by B. ``until='W'``
    also counts micro-batches still waiting for their W (which needs only the
    smaller inputs/output-grads); for fused schedules both agree.
    ``peak_in_flight(one_f_one_b(4, 8)) == (4, 3, 2, 1)``.

    Args:
        s: the schedule table.
        until: ``'B'`` or ``'W'``: the action that releases a micro-batch.

    Returns:
        One peak count per stage.
    """
    if until not in ("B", "W"):
        raise ScheduleError(f"until must be 'B' or 'W', got {until!r}")
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

    Args:
        s: the schedule table.

    Returns:
        A header line (name, sizes, ticks, bubble, peak in flight), then one line per stage.

    Example:
        >>> from jaxpar.parallel.pipeline._schedules import gpipe
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
