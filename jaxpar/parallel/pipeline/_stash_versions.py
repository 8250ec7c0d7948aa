"""PipeDream weight stashing: which weight version every action of a no-flush 1F1B table reads,
the versions each stage holds, and their lowering to version slots (pure Python, no JAX).

The rule (Narayanan et al. 2019, "PipeDream"), for stage ``s`` of ``p``, micro-batch ``i``
(counted over all optimizer steps), ``k = update_every`` and ``d_s = p - 1 - s`` (the
stage's 1F1B warm-up depth; ``d_s = p - 1`` on every stage with ``vertical_sync``)::

    v_s(i) = floor(max(0, i - d_s) / k)                          the version F(i) and B(i) read
    W_s(u+1) = W_s(u) - update_s(1/k * sum_{i=uk}^{uk+k-1} grad_s f_i)   after B(uk + k - 1)

``W_s(u)`` is stage ``s``'s weights after ``u`` of its own updates, ``update_s`` its own
optimizer (its own state) and ``grad_s f_i`` the gradient of micro-batch ``i``'s loss with
respect to stage ``s``'s weights at the versions ``(W_0(v_0(i)), ..., W_{p-1}(v_{p-1}(i)))``:
the forward and the backward of a micro-batch see the same version on each stage (the
stash). Without vertical sync, ``v_s(i)`` is simply the newest version when ``F(i)`` runs in
1F1B's steady state (after ``B(i - d_s - 1)``), so stage ``s`` holds at most ``p - s``
versions; with it, every stage reads the version stage 0 read, and holds up to ``p``.

A call of the train step runs ``pipedream(p, m, K)`` (``K`` optimizer steps, one fill and one
drain) but computes the rule above exactly as a pipeline that never drains would: the
``older`` versions a call's first forwards read (``ceil((p-1)/k)`` of them) are part of the
train state (``TrainState.versions``), so where a call starts changes no number.

Example:
    >>> from jaxpar.parallel.pipeline._schedules import pipedream
    >>> s = pipedream(4, 4, steps=3)
    >>> stashed_versions(s, update_every=1)                    # p - s (in the steady state)
    (4, 3, 2, 1)
    >>> stashed_versions(s, update_every=1, vertical_sync=True)
    (4, 4, 4, 4)
    >>> [version(s.num_stages, st, 5) for st in range(4)]     # micro-batch 5 on each stage
    [2, 3, 4, 5]
    >>> lower_stashed(s, m=4).n_slots                          # what the compiled program holds, per stage
    4
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from jaxpar.compat._table import Setting, raise_problems
from jaxpar.parallel.pipeline._instructions import Program, colour_intervals, lower
from jaxpar.parallel.pipeline._schedules import Schedule, canonical_kind
from jaxpar.parallel.pipeline._tick_table import check_int
from jaxpar.errors import StashingError

STASHING = "pipedream"


def version(p: int, stage: int, i: int, update_every: int = 1, vertical_sync: bool = False) -> int:
    """``v_s(i)``, the version F(i) and B(i) read on a stage: ``floor((i - d_s) / k)``; see the module docstring.

    Args:
        p: the number of stages.
        stage: the stage ``s``.
        i: the micro-batch, counted from the call's first.
        update_every: ``k``, backwards per update.
        vertical_sync: every stage reads the version stage 0 reads (``d_s = p - 1``).

    Returns:
        The version relative to those a call starts from: ``0`` is ``state.params``, ``-j``
        is ``state.versions[j - 1]``.

    >>> [version(2, 0, i) for i in range(4)], [version(2, 0, i, update_every=2) for i in range(4)]
    ([-1, 0, 1, 2], [-1, 0, 0, 1])
    """
    d = p - 1 if vertical_sync else p - 1 - stage
    return (i - d) // update_every


def older_versions(p: int, update_every: int = 1) -> int:
    """Older versions the train state keeps beside ``params``.

    Args:
        p: the number of stages.
        update_every: ``k``, backwards per update.

    Returns:
        ``ceil((p - 1) / k)``.

    >>> older_versions(4), older_versions(4, update_every=2), older_versions(2, update_every=4)
    (3, 2, 1)
    """
    return -(-(p - 1) // update_every)


def _stage_events(schedule: Schedule, stage: int, k: int, vertical_sync: bool):
    """``(tick, action, version, updates so far)`` of one stage, checking that the table runs each
    ``F(i)`` after exactly ``max(0, i - d_s)`` of the stage's backwards (1F1B's order)."""
    p, d = schedule.num_stages, schedule.num_stages - 1 - stage
    done, out = 0, []
    for t, row in enumerate(schedule.table):
        a = row[stage]
        if a is None:
            continue
        if a.kind == "F" and done != max(0, a.microbatch - d):
            raise StashingError(
                f"tick {t}, stage {stage}: {a} runs after {done} backwards of its stage, but weight stashing "
                f"needs 1F1B's order (after {max(0, a.microbatch - d)}): the table {schedule.name!r} is not a "
                "1F1B table without flushes. Build it with jaxpar.parallel.pipeline.pipedream(p, m, steps).")
        out.append((t, a, version(p, stage, a.microbatch, k, vertical_sync), done // k))
        done += a.kind == "B"
    return out


def _check_table(schedule: Schedule, k: int, m: int | None = None) -> None:
    """The lowering's own arguments: a one-chunk table with a fused backward, ``update_every`` ``k``
    dividing the micro-batches per step ``m`` (default: the table's), and ``m`` the table's."""
    if schedule.num_chunks != 1 or schedule.split_backward:
        raise StashingError(f"weight stashing runs one chunk per stage with a fused backward; the table "
                            f"{schedule.name!r} has num_chunks={schedule.num_chunks}, split_backward="
                            f"{schedule.split_backward}. Use jaxpar.parallel.pipeline._schedules.pipedream(p, m, steps).")
    check_int("update_every", k, 1, StashingError)
    m = schedule.num_microbatches if m is None else check_int("m", m, 1, StashingError)
    if m % k or schedule.num_microbatches % m:
        divisors = [d for d in range(1, m + 1) if m % d == 0]
        raise StashingError(f"update_every={k} must divide the micro-batches per step m={m}, and m the table's "
                            f"{schedule.num_microbatches}; use update_every in {divisors}.")


def _intervals(schedule: Schedule, stage: int, k: int, vertical_sync: bool, keep: int | None):
    """``version -> [start, end]`` ticks on one stage. A version lives from the tick after the
    update that makes it (tick 0 for those a call starts with) to its last read (F, B, or the
    update that makes the next one); ``keep``: the newest ``keep + 1`` live to the end (saved)."""
    ticks = len(schedule.table)
    span: dict[int, list[int]] = {}

    def read(v: int, t: int) -> None:
        lo_hi = span.setdefault(v, [0, t])
        lo_hi[1] = max(lo_hi[1], t)

    for t, a, v, u in _stage_events(schedule, stage, k, vertical_sync):
        read(v, t)
        if a.kind == "B" and (a.microbatch + 1) % k == 0:       # the update after this backward
            read(u, t)
            span[u + 1] = [t + 1, t + 1]
    final = schedule.num_microbatches // k
    span.setdefault(final, [0, 0])
    if keep is not None:
        for v in range(final - keep, final + 1):
            span.setdefault(v, [0, 0])[1] = ticks
    return span


def stashed_versions(schedule: Schedule, update_every: int = 1, vertical_sync: bool = False) -> tuple[int, ...]:
    """Weight versions each stage holds at once when it runs ``schedule`` with stashing
    (interval colouring of the versions' live ticks, like the executor's residual slots).

    Args:
        schedule: a no-flush 1F1B table (:func:`~jaxpar.parallel.pipeline.pipedream`).
        update_every: backwards per update; it must divide the table's micro-batches.
        vertical_sync: every stage reads the version stage 0 reads.

    Returns:
        The number of versions per stage, ``(stage 0, ..., stage p - 1)``.
    """
    _check_table(schedule, update_every)
    return tuple(colour_intervals((v, lo, hi) for v, (lo, hi) in
                                  _intervals(schedule, s, update_every, vertical_sync, None).items())[1]
                 for s in range(schedule.num_stages))


def update_ticks(schedule: Schedule, update_every: int = 1) -> list[tuple[int, int]]:
    """Where the updates run, for a Gantt chart.

    Args:
        schedule: a no-flush 1F1B table.
        update_every: backwards per update.

    Returns:
        ``(stage, tick)`` of every update (it runs after the tick's backward).
    """
    return [(s, t) for t, row in enumerate(schedule.table) for s, a in enumerate(row)
            if a is not None and a.kind == "B" and (a.microbatch + 1) % update_every == 0]


@dataclass(frozen=True)
class StashProgram:
    """A lowered no-flush table (:class:`~jaxpar.parallel.pipeline.Program`) plus the version
    slots: ``ver[t][s]`` the slot F / B read, ``cur`` / ``new`` the slots an update reads and
    writes (``update[t][s]``), ``init[s][j]`` the slot version ``-j`` is loaded into (``n_slots``:
    not read in this call), ``final[s][j]`` the slot holding the newest version ``- j`` at the end."""

    program: Program
    m: int
    update_every: int
    vertical_sync: bool
    n_slots: int
    older: int
    ver: tuple
    cur: tuple
    new: tuple
    update: tuple
    init: tuple
    final: tuple


def lower_stashed(schedule: Schedule, *, m: int, update_every: int = 1, vertical_sync: bool = False) -> StashProgram:
    """Lower a no-flush 1F1B table with version slots.

    Args:
        schedule: the table (:func:`~jaxpar.parallel.pipeline.pipedream`).
        m: micro-batches per optimizer step; it divides the table's micro-batches.
        update_every: backwards per update; it divides ``m``.
        vertical_sync: every stage reads the version stage 0 reads.

    Returns:
        The :class:`StashProgram`: the lowered table and its version slots.

    Raises:
        StashingError: the table is not in 1F1B's order, or ``update_every`` does not divide ``m``.
    """
    program = lower(schedule)
    k, p = update_every, schedule.num_stages
    _check_table(schedule, k, m)
    older, ticks = older_versions(p, k), len(schedule.table)
    ver, cur, new, upd = ([[0] * p for _ in range(ticks)] for _ in range(4))
    init, final, slots = [], [], []
    for s in range(p):
        span = _intervals(schedule, s, k, vertical_sync, older)
        unread = {v for v in range(-older, 1) if span.get(v, [0, -1])[1] < 0}
        slot, n = colour_intervals((v, lo, hi) for v, (lo, hi) in span.items() if v not in unread)
        slots.append((slot, n))
        for t, a, v, u in _stage_events(schedule, s, k, vertical_sync):
            ver[t][s] = slot[v]
            if a.kind == "B" and (a.microbatch + 1) % k == 0:
                cur[t][s], new[t][s], upd[t][s] = slot[u], slot[u + 1], 1
        top = schedule.num_microbatches // k
        init.append(tuple(-1 if -j in unread else slot[-j] for j in range(older + 1)))
        final.append(tuple(slot[top - j] for j in range(older + 1)))
    n_slots = max(n for _, n in slots)
    init = tuple(tuple(n_slots if x < 0 else x for x in row) for row in init)
    return StashProgram(program, m, k, vertical_sync, n_slots, older, tuple(map(tuple, ver)), tuple(map(tuple, cur)),
                        tuple(map(tuple, new)), tuple(map(tuple, upd)), init, tuple(final))


def is_stashing(strategy, mesh_sizes: Mapping[str, int]) -> bool:
    """Whether a strategy runs PipeDream weight stashing.

    Args:
        strategy: the :class:`~jaxpar.strategy.Strategy`.
        mesh_sizes: the mesh's axis sizes.

    Returns:
        True for ``schedule='pipedream'`` with a ``pipe`` axis > 1.
    """
    return canonical_kind(strategy.schedule) == STASHING and dict(mesh_sizes).get("pipe", 1) > 1


def check_stashing(strategy, mesh_sizes: Mapping[str, int]) -> None:
    """The compatibility table's refusals and needs of a weight-stashing strategy on a mesh
    (:func:`jaxpar.compat.raise_problems`: a ``pipe`` axis > 1, ``update_every`` dividing
    ``microbatches``, and what stashing combines with), for a caller without ``init_train_state`` /
    ``make_train_step`` (they run the table once).

    Args:
        strategy: the :class:`~jaxpar.strategy.Strategy` (``schedule='pipedream'``).
        mesh_sizes: the mesh's axis sizes.

    Raises:
        StashingError: no ``pipe`` axis > 1, or ``update_every`` does not divide ``microbatches``
            (another refusal of the table as its own class).

    >>> from jaxpar import Strategy
    >>> check_stashing(Strategy(schedule="pipedream", microbatches=4, update_every=3), {"pipe": 2})
    Traceback (most recent call last):
    ...
    jaxpar.errors.StashingError: Strategy.update_every=3 does not divide Strategy.microbatches=4...
    """
    raise_problems(Setting(strategy, dict(mesh_sizes)))
