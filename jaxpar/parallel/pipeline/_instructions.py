"""Lower a schedule table to per-tick, per-stage instructions with buffer slots (pure Python, no JAX).

At each :class:`Tick` every stage runs its :class:`Instr`, then the activations move forward and
the cotangents backward between the pairs of stages that send at that tick. Every value that waits
on a stage lives in a slot of a fixed-size buffer: ``res`` (forward residuals, from F until B, or W
when the backward is split), ``inbox_f`` / ``inbox_b`` (a received activation / cotangent, until the
F / B that consumes it; the head writes its own cotangent) and ``grad`` (a split backward's per-layer
output cotangents, from B until W). Slots are assigned by interval colouring per stage, so each
buffer holds the table's peak number of waiting values (for 1F1B at most ``p`` residuals), never ``m``.

Example:
    >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b, gpipe
    >>> lower(one_f_one_b(4, 16)).n_res, lower(gpipe(4, 16)).n_res
    (4, 16)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from jaxpar.parallel.pipeline._schedules import Schedule, validate
from jaxpar.errors import PartitionError, ScheduleError

PIPE = "pipe"      # the mesh axis of the stages


@dataclass(frozen=True)
class Instr:
    """What one stage does at one tick. Slots index the buffers described above."""

    op: str = "idle"        # 'idle' | 'F' | 'B' | 'W'
    microbatch: int = 0
    chunk: int = 0
    first: bool = False     # virtual stage 0: F embeds the micro-batch, B backprops the embedding
    last: bool = False      # last virtual stage: F runs the head and the loss
    res: int = 0
    inbox: int = 0          # F (not first): inbox_f slot read; B: inbox_b slot read
    dy: int = 0             # F (last): inbox_b slot written with the loss cotangent
    grad: int = 0           # B (split) writes / W reads


@dataclass(frozen=True)
class Tick:
    """One tick: an instruction per stage and the sends that end it."""

    instrs: tuple[Instr, ...]
    fwd_pairs: tuple[tuple[int, int], ...]   # (source stage, target stage)
    fwd_recv: tuple[int, ...]                # per stage: inbox_f slot written (n_fwd = discard)
    bwd_pairs: tuple[tuple[int, int], ...]
    bwd_recv: tuple[int, ...]                # per stage: inbox_b slot written (n_bwd = discard)


@dataclass(frozen=True)
class Program:
    """A lowered schedule: ticks plus the number of slots each buffer needs."""

    schedule: Schedule
    ticks: tuple[Tick, ...]
    n_res: int
    n_fwd: int
    n_bwd: int
    n_grad: int


def colour_intervals(intervals: Iterable[tuple[object, int, int]]) -> tuple[dict, int]:
    """``(key -> slot, number of slots)`` for ``(key, start, end)`` intervals (``end`` inclusive) such that
    no two intervals sharing a slot overlap: greedy colouring in order of start, which uses the fewest
    slots (the peak number alive at one tick).

    >>> colour_intervals([("a", 0, 2), ("b", 1, 3), ("c", 3, 4)])
    ({'a': 0, 'b': 1, 'c': 0}, 2)
    """
    slots: dict = {}
    free_at: list[int] = []          # per slot: first tick it is free again
    for key, start, end in sorted(intervals, key=lambda t: (t[1], t[2])):
        for i, f in enumerate(free_at):
            if f <= start:
                slots[key], free_at[i] = i, end + 1
                break
        else:
            slots[key] = len(free_at)
            free_at.append(end + 1)
    return slots, len(free_at)


def _action_ticks(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """The tick of each action: ``(kind, microbatch, virtual stage) -> tick``."""
    p = schedule.num_stages
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                when[(a.kind, a.microbatch, a.chunk * p + s)] = t
    return when


def _waiting_intervals(schedule: Schedule, when: dict) -> tuple[list, list, list, list]:
    """Per buffer (res, inbox_f, inbox_b, grad) and stage: when each value waits there, ``(key, start, end)``."""
    p = schedule.num_stages
    last_k = p * schedule.num_chunks - 1
    res, inf, inb, grd = ([[] for _ in range(p)] for _ in range(4))
    for (kind, mb, k), t in when.items():
        s = k % p
        if kind == "F":
            end = when[("W" if schedule.split_backward else "B", mb, k)]
            res[s].append(((mb, k), t, end))
            if k > 0:
                inf[s].append(((mb, k), when[("F", mb, k - 1)] + 1, t))
            if k == last_k:
                inb[s].append(((mb, k), t, when[("B", mb, k)]))
        elif kind == "B":
            if k < last_k:
                inb[s].append(((mb, k), when[("B", mb, k + 1)] + 1, t))
            if schedule.split_backward:
                grd[s].append(((mb, k), t, when[("W", mb, k)]))
    return res, inf, inb, grd


def _lower_row(schedule: Schedule, row, slot: list, n_fwd: int, n_bwd: int) -> Tick:
    """One row of the table as a :class:`Tick`; ``slot[b](key, stage)``: the slot of buffer ``b``."""
    p = schedule.num_stages
    last_k = p * schedule.num_chunks - 1
    instrs, fwd, bwd = [], [], []
    fwd_recv, bwd_recv = [n_fwd] * p, [n_bwd] * p
    for s, a in enumerate(row):
        if a is None:
            instrs.append(Instr())
            continue
        k = a.chunk * p + s
        key = (a.microbatch, k)
        first, last = k == 0, k == last_k
        if a.kind == "F":
            instrs.append(Instr("F", a.microbatch, a.chunk, first, last, res=slot[0](key, s),
                                inbox=0 if first else slot[1](key, s),
                                dy=slot[2](key, s) if last else 0))
            if not last:
                dst = (k + 1) % p
                fwd.append((s, dst))
                fwd_recv[dst] = slot[1]((a.microbatch, k + 1), dst)
        elif a.kind == "B":
            instrs.append(Instr("B", a.microbatch, a.chunk, first, last, res=slot[0](key, s),
                                inbox=slot[2](key, s),
                                grad=slot[3](key, s) if schedule.split_backward else 0))
            if not first:
                dst = (k - 1) % p
                bwd.append((s, dst))
                bwd_recv[dst] = slot[2]((a.microbatch, k - 1), dst)
        else:
            instrs.append(Instr("W", a.microbatch, a.chunk, first, last, res=slot[0](key, s),
                                grad=slot[3](key, s)))
    return Tick(tuple(instrs), tuple(fwd), tuple(fwd_recv), tuple(bwd), tuple(bwd_recv))


def lower(schedule: Schedule) -> Program:
    """Validate ``schedule`` and lower it to a :class:`Program`.

    Args:
        schedule: a schedule table (validated here).

    Returns:
        Its :class:`Program`: each tick's per-stage :class:`Instr` with buffer slots, the sends, and the
        slot count of each buffer.
    """
    validate(schedule)
    p = schedule.num_stages
    buffers = _waiting_intervals(schedule, _action_ticks(schedule))
    colourings = [[colour_intervals(buf[s]) for s in range(p)] for buf in buffers]
    slot = [lambda key, s, c=c: c[s][0][key] for c in colourings]
    n_res, n_fwd, n_bwd, n_grad = (max(c[s][1] for s in range(p)) for c in colourings)
    ticks = [_lower_row(schedule, row, slot, n_fwd, n_bwd) for row in schedule.table]
    return Program(schedule, tuple(ticks), n_res, n_fwd, n_bwd, n_grad)


def sends(program: Program) -> dict[str, int]:
    """Point-to-point transfers per step: ``{'forward': n, 'backward': n}``.

    Args:
        program: a lowered schedule.

    Returns:
        ``{'forward': n, 'backward': n}``: the activations and cotangents sent between stages.

    Example:
        >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b
        >>> sends(lower(one_f_one_b(4, 8)))      # m * (p - 1) each way
        {'forward': 24, 'backward': 24}
    """
    return {"forward": sum(len(t.fwd_pairs) for t in program.ticks),
            "backward": sum(len(t.bwd_pairs) for t in program.ticks)}


def stage_counts(program: Program, mesh, stage_layers: Sequence[int]) -> np.ndarray:
    """``stage_layers`` (layers of each virtual stage ``k = chunk * p + stage``) as an int32 ``[v, p]``
    array, checked against the schedule and the mesh's ``pipe`` axis."""
    sched = program.schedule
    p, v, pipe = sched.num_stages, sched.num_chunks, dict(mesh.shape).get(PIPE, 1)
    if pipe != p:
        raise ScheduleError(f"the schedule {sched.name!r} has {p} stages but the mesh's {PIPE!r} axis has size "
                            f"{pipe}; build the schedule with num_stages equal to the pipe axis (mesh axes: "
                            f"{dict(mesh.shape)}).")
    counts = np.asarray(stage_layers, np.int32)
    if counts.shape != (p * v,) or (counts < 1).any():
        raise PartitionError(f"stage_layers={tuple(stage_layers)}: the schedule {sched.name!r} has {p * v} virtual "
                             f"stages (pipe={p} x chunks={v}); give one positive layer count per virtual stage.")
    return counts.reshape(v, p)
