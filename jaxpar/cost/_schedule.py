"""Pipeline schedules as the cost model reads them (docs/planning.md §3): bubble fraction and stage 0's
in-flight micro-batches, from the schedule tables of :mod:`jaxpar.parallel.pipeline._schedules` up to
``p * m * v =`` :data:`TABLE_LIMIT` (JAX is imported only then), from closed forms above it; with
``lockstep=True``, of the lockstep re-timing (:func:`jaxpar.parallel.pipeline._schedules.lockstep`).

Example::

    >>> schedule_stats("interleaved", 4, 8, 2)
    (0.15789473684210525, 11)
    >>> schedule_stats("1f1b", 4, 8, 1, lockstep=True)
    (0.2727272727272727, 7)
"""
from __future__ import annotations

from functools import lru_cache

from jaxpar.errors import ScheduleError


#: Largest ``p * m * v`` whose bubble and in-flight count are read from the built table; above it
#: the closed forms (equal to the tables wherever both are computed: tests/test_cost_formulas.py).
TABLE_LIMIT = 256


def closed_form_stats(kind: str, p: int, m: int, v: int = 1) -> tuple[float, int]:
    """Bubble fraction and stage 0's peak in-flight (micro-batch, chunk) pairs of a schedule, in closed form:
    ``(p-1)/(m+p-1)`` (GPipe, 1F1B), ``(p-1)/(vm+p-1)`` (interleaved), ``(p-1)/(3m+p-1)`` (ZB-H1);
    peaks ``m``, ``p``, ``min(2(p-1) + (v-1)p + 1, vm)``, ``p``.

    Args:
      kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
      p: pipeline stages.
      m: micro-batches.
      v: virtual stages per device.

    Returns:
      ``(bubble fraction, peak in-flight pairs)``.

    >>> closed_form_stats("1f1b", 4, 8)
    (0.2727272727272727, 4)
    """
    if kind == "gpipe":
        return (p - 1) / (m + p - 1), m
    if kind == "1f1b":
        return (p - 1) / (m + p - 1), min(p, m)
    if kind == "zb-h1":
        return (p - 1) / (3 * m + p - 1), min(p, m)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1), min(2 * (p - 1) + (v - 1) * p + 1, v * m)
    raise ScheduleError(f"schedule={kind!r}: choose gpipe, 1f1b, interleaved or zb-h1.")


def lockstep_closed_form(kind: str, p: int, m: int, v: int = 1) -> tuple[float, int]:
    """Bubble and stage 0's peak in-flight pairs of a lockstep table, in closed form (docs/planning.md §3).

    Args:
      kind: the schedule.
      p: pipeline stages.
      m: micro-batches.
      v: virtual stages per device.

    Returns:
      ``(bubble fraction, peak in-flight pairs)``.

    >>> lockstep_closed_form("gpipe", 4, 8) == closed_form_stats("gpipe", 4, 8)
    True
    """
    bubble, peak = closed_form_stats(kind, p, m, v)
    if kind == "zb-h1":
        bubble = 2 * (p - 1) / (3 * m + 2 * (p - 1))
    return bubble, min(2 * p - 1, m) if kind in ("1f1b", "zb-h1") else peak


@lru_cache(maxsize=4096)
def schedule_stats(kind: str, p: int, m: int, v: int, lockstep: bool = False) -> tuple[float, int]:
    """Bubble fraction and stage 0's peak in-flight (micro-batch, chunk) pairs of a schedule (cached).

    Read from the built schedule table (:mod:`jaxpar.parallel.pipeline._schedules`) up to ``p * m * v =``
    :data:`TABLE_LIMIT`, from :func:`closed_form_stats` (:func:`lockstep_closed_form`) above it. A lockstep
    tick lasts as long as its kind: F = 1, B = 2 (B = W = 1 with a split backward).

    Args:
      kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
      p: pipeline stages.
      m: micro-batches.
      v: virtual stages (chunks) per device.
      lockstep: the lockstep re-timing of the table (sequence parallelism inside the pipeline).

    Returns:
      ``(bubble fraction, peak in-flight pairs)``.

    >>> schedule_stats("1f1b", 4, 8, 1)
    (0.2727272727272727, 4)
    """
    if p * m * v > TABLE_LIMIT:
        return (lockstep_closed_form if lockstep else closed_form_stats)(kind, p, m, v)
    from jaxpar.parallel.pipeline import _schedules

    s = _schedules.get_schedule(kind, p, m, v)
    if not lockstep:
        return float(_schedules.bubble_fraction(s)), _schedules.peak_in_flight(s)[0]
    s = _schedules.lockstep(s)
    cost = {"F": 1, "B": 1 if s.split_backward else 2, "W": 1}
    span = sum(cost[next(a.kind for a in row if a is not None)] for row in s.table)
    return 1 - v * m * 3 / span, _schedules.peak_in_flight(s)[0]


def runs_in_lockstep(plan) -> bool:
    """Whether a plan's pipeline runs as a lockstep program: sequence parallelism on a tensor axis
    (as :func:`jaxpar.parallel.pipeline._piped.runs_in_lockstep` decides for a strategy).

    Args:
      plan: a :class:`~jaxpar.cost.Plan`.

    Returns:
      Whether it runs in lockstep.
    """
    return bool(plan.strategy.sequence_parallel) and plan.tensor > 1


def in_flight(schedule: str, pipe: int, microbatches: int, virtual: int = 1, lockstep: bool = False) -> int:
    """Peak (micro-batch, chunk) pairs whose activations a stage holds (1 without a pipeline).

    Args:
      schedule: the schedule.
      pipe: pipeline stages.
      microbatches: micro-batches per step.
      virtual: virtual stages per device.
      lockstep: the lockstep program (:func:`runs_in_lockstep`).

    Returns:
      The number of pairs.

    >>> in_flight("gpipe", 4, 8), in_flight("1f1b", 4, 8), in_flight("interleaved", 4, 8, 2)
    (8, 4, 11)
    """
    if pipe == 1:
        return 1
    return schedule_stats(schedule, pipe, microbatches, virtual, lockstep)[1]
