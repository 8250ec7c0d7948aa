"""Pipeline schedules as the cost model reads them: bubble fraction and in-flight micro-batches.

Read from the schedule tables of :mod:`jaxpar.pipeline.schedules` (imported, with JAX, only when a
table is built) up to ``p * m * v =`` :data:`TABLE_LIMIT`, from closed forms above it:
``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(vm+p-1)`` for interleaved, ``(p-1)/(3m+p-1)`` for
ZB-H1; stage 0 holds ``m``, ``p``, ``min(2(p-1) + (v-1)p + 1, vm)`` and ``p`` micro-batches' activations.

Example::

    >>> schedule_stats("interleaved", 4, 8, 2)
    (0.15789473684210525, 11)
"""
from __future__ import annotations

from functools import lru_cache

__all__ = ["TABLE_LIMIT", "closed_form_stats", "schedule_stats", "in_flight"]


#: Largest ``p * m * v`` whose bubble and in-flight count are read from the built table; above it
#: the closed forms (equal to the tables wherever both are computed: tests/test_cost_formulas.py).
TABLE_LIMIT = 256


def closed_form_stats(kind: str, p: int, m: int, v: int = 1) -> tuple[float, int]:
    """Bubble fraction and stage 0's peak in-flight (micro-batch, chunk) pairs of a schedule, in closed form:
    ``(p-1)/(m+p-1)`` (GPipe, 1F1B), ``(p-1)/(vm+p-1)`` (interleaved), ``(p-1)/(3m+p-1)`` (ZB-H1);
    peaks ``m``, ``p``, ``min(2(p-1) + (v-1)p + 1, vm)``, ``p``.

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
    raise ValueError(f"schedule={kind!r}: choose gpipe, 1f1b, interleaved or zb-h1.")


@lru_cache(maxsize=4096)
def schedule_stats(kind: str, p: int, m: int, v: int) -> tuple[float, int]:
    """Bubble fraction and stage 0's peak in-flight (micro-batch, chunk) pairs of a schedule (cached).

    Read from the built schedule table (:mod:`jaxpar.pipeline.schedules`) up to ``p * m * v =``
    :data:`TABLE_LIMIT`, from :func:`closed_form_stats` above it.

    Args:
      kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
      p: pipeline stages.
      m: micro-batches.
      v: virtual stages (chunks) per device.

    Returns:
      ``(bubble fraction, peak in-flight pairs)``.

    >>> schedule_stats("1f1b", 4, 8, 1)
    (0.2727272727272727, 4)
    """
    if p * m * v > TABLE_LIMIT:
        return closed_form_stats(kind, p, m, v)
    from ..pipeline.schedules import bubble_fraction, get_schedule, peak_in_flight

    s = get_schedule(kind, p, m, v)
    return float(bubble_fraction(s)), peak_in_flight(s)[0]


def in_flight(schedule: str, pipe: int, microbatches: int, virtual: int = 1) -> int:
    """Peak (micro-batch, chunk) pairs whose activations a stage holds (1 without a pipeline).

    >>> in_flight("gpipe", 4, 8), in_flight("1f1b", 4, 8), in_flight("interleaved", 4, 8, 2)
    (8, 4, 11)
    """
    if pipe == 1:
        return 1
    return schedule_stats(schedule, pipe, microbatches, virtual)[1]
