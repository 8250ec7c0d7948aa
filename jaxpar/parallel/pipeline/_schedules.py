"""Pipeline-parallel schedules as plain data: the GPipe, 1F1B, interleaved, ZB-H1, PipeDream-2BW and
PipeDream (weight stashing) tables.

Pure Python (no JAX), so a schedule can be built, checked and measured anywhere
and then handed to an executor. The table type and its dependency rules live in
:mod:`jaxpar.parallel.pipeline._tick_table` (``Action``, ``Schedule``, :func:`validate`), the
measures in :mod:`jaxpar.parallel.pipeline._schedule_stats` (:func:`bubble_fraction`,
:func:`peak_in_flight`, :func:`to_text`, ...); both are re-exported here, so
``from jaxpar.parallel.pipeline._schedules import ...`` reaches every name.

Tables are produced by a greedy list scheduler: each device gets its ordered
action list from the schedule's policy (GPipe, Megatron 1F1B, Megatron
interleaved, ZB-H1) and every action is placed at the earliest tick allowed
by its dependencies and by the device's order.

Example:
    >>> s = one_f_one_b(4, 8)
    >>> num_ticks(s), bubble_fraction(s, exact=True), peak_in_flight(s)
    (22, Fraction(3, 11), (4, 3, 2, 1))
"""
from __future__ import annotations

from typing import Sequence

from jaxpar.parallel.pipeline._schedule_stats import (bubble_fraction, duration, makespan, peak_in_flight, tick_bubble_fraction,
                                                      timeline, to_text)
from jaxpar.parallel.pipeline._tick_table import (Action, Schedule, ScheduleError, check_int, num_ticks, simulate,
                                                  stage_actions, validate)

# ``doctest.testmod`` of this module also runs the examples of the re-exported functions.
__test__ = {f.__name__: f for f in (validate, timeline, to_text)}

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream-2bw", "pipedream")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "one_f_one_b": "1f1b",
            "interleaved": "interleaved", "interleaved_1f1b": "interleaved",
            "interleaved-1f1b": "interleaved", "zb-h1": "zb-h1", "zbh1": "zb-h1",
            "zb_h1": "zb-h1", "zero_bubble": "zb-h1", "zero_bubble_h1": "zb-h1",
            "pipedream-2bw": "pipedream-2bw", "pipedream_2bw": "pipedream-2bw", "2bw": "pipedream-2bw",
            "pipedream": "pipedream", "weight-stashing": "pipedream", "weight_stashing": "pipedream"}


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


# ----------------------------------------------------------------------------- generators
def _check_pm(p, m) -> None:
    check_int("p (num_stages)", p, 1)
    check_int("m (num_microbatches)", m, 1)


def _need_m_ge_p(fn: str, p: int, m: int) -> None:
    if m < p:
        raise ScheduleError(f"{fn} needs m >= p, got m={m} micro-batches for p={p} stages; "
                            f"use m >= {p} (more micro-batches per step) or gpipe(p, m), which accepts any m")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (B in micro-batch order).

    Args:
        p: pipeline stages.
        m: micro-batches.

    Returns:
        The validated :class:`Schedule`.

    Example:
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

    Args:
        p: pipeline stages.
        m: micro-batches (>= ``p``).

    Returns:
        The validated :class:`Schedule`.

    Example:
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

    Args:
        p: pipeline stages (devices).
        m: micro-batches, a multiple of ``p``.
        v: chunks (virtual stages) per device, >= 2.

    Returns:
        The validated :class:`Schedule`.

    Example:
        >>> bubble_fraction(interleaved_1f1b(4, 8, 2), exact=True)
        Fraction(3, 19)
    """
    _check_pm(p, m)
    check_int("v (num_chunks)", v, 2)
    if m % p:
        raise ScheduleError(f"interleaved_1f1b needs m divisible by p, got m={m}, p={p}; "
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

    Args:
        p: pipeline stages.
        m: micro-batches (>= ``p``).

    Returns:
        The validated :class:`Schedule` (split backward: B and W actions).

    Example:
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


def pipedream_2bw(p: int, m: int, steps: int = 1) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021): 1F1B that never drains, over ``steps`` optimizer
    steps of ``m`` micro-batches (micro-batch ``i`` belongs to step ``i // m``; needs ``m >= p``).

    The periodic 1F1B steady state, written out: stage ``s`` runs ``F(i)`` at tick ``2i + s``
    and ``B(i)`` at tick ``2i + 2p - 1 - s``. Step ``t+1``'s forwards start while step ``t``'s
    backwards finish: every step after the first takes exactly ``2m`` ticks with no idle cell
    (:func:`jaxpar.parallel.pipeline._two_bw.step_windows`). This is legal because step ``t`` reads
    the weights ``W(t-1)`` (the gradient is one step late), and at most two versions are alive
    on a stage. ``steps=1`` is one step alone (as long as 1F1B with a flush).

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
    _check_pm(p, m)
    check_int("steps", steps, 1)
    if m < p:
        raise ScheduleError(f"pipedream_2bw needs m >= p, got m={m} micro-batches for p={p} stages: it runs 1F1B's "
                            f"steady state, whose stages hold micro-batches of at most two steps (two weight "
                            f"versions) only when a step has enough of them; use m >= {p} (more micro-batches per "
                            "step)")
    return _no_flush("pipedream-2bw", p, m * steps)


def pipedream(p: int, m: int, steps: int = 1) -> Schedule:
    """PipeDream with weight stashing (Narayanan et al. 2019): the same no-flush 1F1B table as
    :func:`pipedream_2bw` over ``steps`` optimizer steps of ``m`` micro-batches (any ``m >= 1``),
    read differently: every stage updates its own weights after its backwards (every
    ``update_every`` of them) and runs each micro-batch's backward on the version its forward
    used (:mod:`jaxpar.parallel.pipeline._stash_versions`). Stage ``s`` runs ``F(i)`` at tick ``2i + s`` and
    ``B(i)`` at tick ``2i + 2p - 1 - s``: right after ``B(i - (p - s))``, as in 1F1B.

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
    _check_pm(p, m)
    check_int("steps", steps, 1)
    return _no_flush("pipedream", p, m * steps)


def _no_flush(name: str, p: int, n: int) -> Schedule:
    """1F1B's periodic steady state over ``n`` micro-batches: ``F(i)`` at ``2i + s``, ``B(i)`` at ``2i + 2p-1-s``."""
    table = [[None] * p for _ in range(2 * n + 2 * p - 2)]
    for i in range(n):
        for s in range(p):
            table[2 * i + s][s] = Action("F", i)
            table[2 * i + 2 * p - 1 - s][s] = Action("B", i)
    sched = Schedule(name, p, n, 1, table)
    validate(sched)
    return sched


def canonical_kind(kind: str) -> str:
    """A schedule name or alias -> one of :data:`SCHEDULE_KINDS`; unknown names raise.

    Args:
        kind: a name of :data:`SCHEDULE_KINDS` or an alias (``"one_f_one_b"``, ``"zbh1"``, ``"2bw"``, ...), any case.

    Returns:
        The canonical name.

    Example:
        >>> canonical_kind("one_f_one_b")
        '1f1b'
    """
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
