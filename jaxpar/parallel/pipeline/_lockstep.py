"""Lockstep schedules: every stage runs the same kind of action (F, B or W) at every tick, so a collective
inside an action is reached by every device (pure Python; docs/pipeline.md, "Lockstep programs", has the
re-timing rule, the why and the costs). :func:`lockstep` re-times a flush schedule.

Example:
    >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b, num_ticks, peak_in_flight
    >>> s = lockstep(one_f_one_b(2, 4))
    >>> [sorted({a.kind for a in row if a}) for row in s.table][:4]
    [['F'], ['F'], ['B'], ['F']]
    >>> num_ticks(s), peak_in_flight(s)
    (10, (3, 1))
"""
from __future__ import annotations

from jaxpar.parallel.pipeline._schedules import Action, Schedule, dependencies, peak_in_flight, stage_actions, validate


def is_lockstep(schedule: Schedule) -> bool:
    """Whether every tick of ``schedule`` holds one kind of action.

    Args:
        schedule: a schedule table.

    Returns:
        True if no tick mixes F, B and W.
    """
    return all(len({a.kind for a in row if a is not None}) <= 1 for row in schedule.table)


def lockstep(schedule: Schedule) -> Schedule:
    """``schedule`` re-timed so that every tick holds one kind of action (see the module).

    Args:
        schedule: a valid schedule table.

    Returns:
        A valid table with the same actions on the same stages, one kind per tick, named
        ``"<name> (lockstep)"``; ``schedule`` itself if it already is one.
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
