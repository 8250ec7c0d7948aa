"""Pipelines without flushes: PipeDream-2BW's update rule, its no-flush table read as
optimizer steps, and the weight versions each stage holds.

PipeDream-2BW (Narayanan et al. 2021) accumulates the gradient of ``m`` micro-batches and
applies it one step late (``t``: optimizer step, ``W(-1) = W(0)``)::

    W(t+1) = W(t) - update(grad f_t(W(t-1)))

Every micro-batch of step ``t`` runs its forward and backward on ``W(t-1)``, which exists
since the end of step ``t-2``. So step ``t``'s forwards may start while step ``t-1``'s
backwards still run: the pipeline never drains, and a stage holds two versions (``W(t-1)``
for step ``t``, ``W(t)`` for step ``t+1``). :func:`~jaxpar.parallel.pipeline.pipedream_2bw`
writes that steady state as a table; :func:`step_windows` cuts it into optimizer steps and
:func:`two_bw_versions` counts the versions a stage holds (interval colouring, like the
executor's residual slots).

The train step (``Strategy(schedule='pipedream-2bw')``) keeps ``W(t-1)`` in
``TrainState.versions`` and computes each step's gradient there, then updates ``W(t)``
(:func:`jaxpar.step._update.delayed`: ``W(t)`` becomes the older version, after a skipped
non-finite step too); with
``steps_per_call=K`` it runs ``K`` steps of the no-flush table in one program, the updates
between the step windows (:mod:`jaxpar.step._no_flush_steps`), each action reading the version
:func:`version_rows` names.

Example:
    >>> from jaxpar.parallel.pipeline._schedules import pipedream_2bw
    >>> s = pipedream_2bw(4, 8, steps=3)
    >>> [end - start for start, end in step_windows(4, 8, 3)]   # the fill once, then m F + m B per step
    [22, 16, 16]
    >>> two_bw_versions(s, m=8)     # per stage (the last one finishes a step before it starts the next)
    (2, 2, 2, 1)
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxpar.compat._table import Setting, raise_problems
from jaxpar.parallel.pipeline._instructions import Program, colour_intervals
from jaxpar.parallel.pipeline._schedules import Schedule, canonical_kind
from jaxpar.errors import AsyncPipelineError

TWO_BW = "pipedream-2bw"


def is_two_bw(strategy, mesh_sizes: Mapping[str, int]) -> bool:
    """Whether a strategy runs PipeDream-2BW.

    Args:
      strategy: the :class:`~jaxpar.strategy.Strategy`.
      mesh_sizes: the mesh's axis sizes.

    Returns:
      True for the 2BW schedule (any of its names) with a ``pipe`` axis > 1.

    >>> from jaxpar import Strategy
    >>> is_two_bw(Strategy(schedule="2bw", microbatches=2), {"pipe": 2}), is_two_bw(Strategy(), {"pipe": 2})
    (True, False)
    """
    return canonical_kind(strategy.schedule) == TWO_BW and dict(mesh_sizes).get("pipe", 1) > 1


def step_windows(p: int, m: int, steps: int) -> list[tuple[int, int]]:
    """``[start, end)`` ticks of each optimizer step in ``pipedream_2bw(p, m, steps)``.

    Step ``t``'s update (``W(t+1)``) follows tick ``end - 1`` of window ``t``: the last
    backward of step ``t``'s micro-batches on stage 0. The first window holds the fill
    (``2m + 2(p-1)`` ticks), every later one ``2m`` ticks; the last also holds the drain.

    Args:
      p: the number of stages.
      m: micro-batches per optimizer step.
      steps: optimizer steps in the table.

    Returns:
      One ``(start, end)`` per step.

    >>> step_windows(2, 2, 3)
    [(0, 6), (6, 10), (10, 14)]
    """
    lag = 2 * p - 2
    return [(0 if t == 0 else 2 * t * m + lag, 2 * (t + 1) * m + lag) for t in range(steps)]


def version_rows(program: Program, m: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The version slot each action of the no-flush 2BW table reads, per tick and stage.

    During step window ``t`` a stage holds ``W(t-1)`` (slot 0) and ``W(t)`` (slot 1); a
    micro-batch ``i`` of step ``i // m`` reads ``W(i // m - 1)``, slot ``i // m - t`` (an idle
    cell reads slot 0). No action updates (the model is updated between windows).

    Args:
      program: the lowered :func:`~jaxpar.parallel.pipeline.pipedream_2bw` table.
      m: micro-batches per optimizer step.
      steps: optimizer steps in the table.

    Returns:
      ``(ver, cur, new)``, int32 ``[ticks, p]`` each (``cur`` and ``new`` zero: no update).

    >>> from jaxpar.parallel.pipeline._instructions import lower
    >>> from jaxpar.parallel.pipeline._schedules import pipedream_2bw
    >>> ver, _, _ = version_rows(lower(pipedream_2bw(2, 2, 2)), m=2, steps=2)
    >>> ver[:, 0].tolist()      # stage 0: step 1's forward in window 0 reads W(0) (slot 1), the rest W(t-1)
    [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    """
    p = program.schedule.num_stages
    window = np.zeros(len(program.ticks), np.int64)
    for t, (lo, hi) in enumerate(step_windows(p, m, steps)):
        window[lo:hi] = t
    mb = np.array([[i.microbatch for i in tick.instrs] for tick in program.ticks])
    ver = np.clip(mb // m - window[:, None], 0, 1).astype(np.int32)
    return ver, np.zeros_like(ver), np.zeros_like(ver)


def two_bw_versions(schedule: Schedule, m: int) -> tuple[int, ...]:
    """Weight versions each stage must hold when micro-batch ``i`` runs on version ``i // m``:
    a version lives from its first action on the stage to its last (interval colouring).

    Args:
      schedule: the table (:func:`~jaxpar.parallel.pipeline.pipedream_2bw`, or any other).
      m: micro-batches per optimizer step.

    Returns:
      The number of versions per stage, ``(stage 0, ..., stage p - 1)``.

    >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b
    >>> two_bw_versions(one_f_one_b(4, 8), m=8)     # a flush: one version at a time
    (1, 1, 1, 1)
    """
    p = schedule.num_stages
    span: list[dict[int, list[int]]] = [{} for _ in range(p)]
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                lo_hi = span[s].setdefault(a.microbatch // m, [t, t])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], t), max(lo_hi[1], t)
    return tuple(colour_intervals((v, lo, hi) for v, (lo, hi) in span[s].items())[1] for s in range(p))


def check_two_bw(strategy, mesh_sizes: Mapping[str, int]) -> None:
    """The compatibility table's refusals and needs of a PipeDream-2BW strategy on a mesh
    (:func:`jaxpar.compat.raise_problems`: a ``pipe`` axis > 1, ``microbatches >= pipe``, and what 2BW
    combines with), for a caller without ``init_train_state`` / ``make_train_step`` (they run the table once).

    Args:
      strategy: the strategy (``schedule='pipedream-2bw'``).
      mesh_sizes: the mesh's axis sizes.

    Raises:
      AsyncPipelineError: no ``pipe`` axis > 1, or fewer micro-batches than stages (another refusal
        of the table as its own class).

    >>> from jaxpar import Strategy
    >>> check_two_bw(Strategy(schedule="pipedream-2bw", microbatches=2), {"data": 2})
    Traceback (most recent call last):
    ...
    jaxpar.errors.AsyncPipelineError: schedule='pipedream-2bw' needs a 'pipe' mesh axis > 1 (got pipe=1)...
    """
    raise_problems(Setting(strategy, dict(mesh_sizes)))
