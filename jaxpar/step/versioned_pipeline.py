"""PipeDream's no-flush pipelines as one program: stages that read weight versions named by a table.

PipeDream-2BW with ``steps_per_call`` > 1 and weight stashing (``schedule='pipedream'``) run
``K`` optimizer steps of a table that never drains. Both are one program
(:mod:`jaxpar.parallel.pipeline.versioned_stage`): every stage keeps a buffer of weight
versions and runs the table's ticks, each action on the version slot the schedule's *version
table* names; gradients, the loss and what the loss reported are summed per step. They differ
in one thing, *where the update runs*, and both call the one update
(:func:`~jaxpar.step.update.apply_update`):

* **between step windows, on the whole model** (2BW, :mod:`jaxpar.step.no_flush_steps`): the
  table is cut at the optimizer steps; after window ``t`` the gradient of step ``t`` (taken at
  ``W(t-1)``) updates ``W(t)`` outside the manual region, under 2BW's rule
  (:func:`~jaxpar.step.update.delayed`), so every optax optimizer and ``clip_norm`` work, and
  window ``t + 1`` reads ``(W(t), W(t+1))``;
* **inside the tick loop, per stage** (weight stashing, :mod:`jaxpar.step.stashing_step`): the
  backward that ends an ``update_every`` group runs the stage's own update in the same
  conditional and writes the new version into the slot the table names.

The metrics are :mod:`jaxpar.step.update`'s: ``loss``, ``grad_norm`` (with several updates per
step, :func:`~jaxpar.step.update.updates_metrics`), ``skipped`` and ``lr``; a call returns them
per step (``[K]``).

Example:
    >>> from jaxpar import Strategy
    >>> check_steps_per_call(Strategy(schedule="1f1b", microbatches=2), 2)
    Traceback (most recent call last):
    ...
    jaxpar.errors.AsyncPipelineError: steps_per_call=2 with schedule='1f1b': this no-flush program runs ...
"""
from __future__ import annotations

from typing import Callable

from jaxpar.parallel.pipeline.stash_versions import StashingError, check_stashing, older_versions
from jaxpar.parallel.pipeline.two_bw import AsyncPipelineError, check_two_bw
from jaxpar.step.update import Update

__all__ = ["make_versioned_pipeline", "check_versioned_state", "check_steps_per_call"]


def make_versioned_pipeline(loss_fn: Callable, layout, update: Update, steps: int) -> tuple[Callable, object]:
    """``steps`` optimizer steps of the layout's no-flush schedule in one program (see the module docstring).

    Args:
      loss_fn: the user's loss (on the last stage).
      layout: the train state's layout (its strategy: ``schedule='pipedream'`` or ``'pipedream-2bw'``).
      update: the train step's update options.
      steps: optimizer steps per call.

    Returns:
      ``(run, program)``: ``run(state, batches) -> (state, metrics)`` to jit, every leaf of
      ``batches`` ``[steps, B, ...]`` and every metric ``[steps]``; ``program`` the lowered table.

    Raises:
      AsyncPipelineError / StashingError: ``steps`` or the state does not fit the schedule.
    """
    check_steps_per_call(layout.strategy, steps)
    check_versioned_state(layout.strategy, layout)
    if layout.strategy.schedule == "pipedream":
        from jaxpar.step.stashing_step import make_stashing_step

        return make_stashing_step(loss_fn, layout, update, steps)
    from jaxpar.step.no_flush_steps import make_two_bw_steps

    return make_two_bw_steps(loss_fn, layout, update, steps)


def check_versioned_state(strategy, layout) -> None:
    """The schedule's own checks (:func:`~jaxpar.parallel.pipeline.two_bw.check_two_bw`,
    :func:`~jaxpar.parallel.pipeline.stash_versions.check_stashing`) and the state's versions: one
    older version for 2BW, ``ceil((pipe - 1) / update_every)`` for weight stashing.

    Args:
      strategy: the strategy (``schedule='pipedream-2bw'`` or ``'pipedream'``).
      layout: the train state's layout (its mesh and ``versions``).

    Raises:
      AsyncPipelineError / StashingError: the strategy cannot run on this mesh, or the state keeps
        other versions than the schedule reads.
    """
    sizes = dict(layout.mesh.shape)
    if strategy.schedule == "pipedream":
        check_stashing(strategy, sizes)
        n = older_versions(sizes["pipe"], strategy.update_every)
        ok, error = isinstance(layout.versions, tuple) and len(layout.versions) == n, StashingError
        kept, made_for = f"{n} older weight versions", "another schedule or update_every"
    else:
        check_two_bw(strategy, sizes)
        ok, error = bool(layout.versions) and not isinstance(layout.versions, tuple), AsyncPipelineError
        kept, made_for = "second weight version", "another schedule"
    if not ok:
        raise error(f"make_train_step with schedule={strategy.schedule!r}, but the layout keeps no {kept} "
                    f"(TrainState.versions): the state was made for {made_for}. Create it with "
                    "init_train_state(..., strategy) using this same strategy.")


def check_steps_per_call(strategy, steps) -> None:
    """Errors for ``steps_per_call`` of the no-flush programs (``make_train_step`` scans the step of
    any other schedule).

    Args:
      strategy: the strategy (its ``schedule``).
      steps: ``steps_per_call``.

    Raises:
      AsyncPipelineError: ``steps`` is not an int >= 1, or is > 1 with another schedule.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AsyncPipelineError(f"steps_per_call={steps!r}: give an int >= 1 (optimizer steps per call).")
    if steps > 1 and strategy.schedule not in ("pipedream-2bw", "pipedream"):
        raise AsyncPipelineError(
            f"steps_per_call={steps} with schedule={strategy.schedule!r}: this no-flush program runs "
            "schedule='pipedream-2bw' or 'pipedream'; build the step with jaxpar.make_train_step, which scans "
            "the step of any other schedule.")
