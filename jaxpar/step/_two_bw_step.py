"""PipeDream-2BW's update placement in the no-flush program: the whole model between step windows.

:func:`make_two_bw_steps` (``make_train_step(..., steps_per_call=K)``) builds
``step(state, batches) -> (state, metrics)``: ``batches`` holds ``K`` global batches (every
leaf ``[K, B, ...]``), ``metrics`` one value per step (``loss`` ``[K]``...). The program runs
:func:`~jaxpar.parallel.pipeline.pipedream_2bw` ``(p, m, steps=K)`` cut into its optimizer
steps (:func:`~jaxpar.parallel.pipeline._pipedream.step_windows`): the first window (``2m + 2(p-1)``
ticks, the fill) is one tick loop, the ``K - 1`` later ones (``2m`` ticks each) are a loop over
windows around a ``2m``-tick loop. Between windows the in-flight state (residual and inbox
slots, the next step's partial gradient and loss) stays on its stage, and the optimizer
applies step ``t``'s gradient: ``W(t+1) = W(t) - update(grad f_t(W(t-1)))``, outside the
manual region, with the one-step train step's update and rule (:func:`jaxpar.step._update.delayed`),
so every optax optimizer, ``clip_norm``, ``skip_nonfinite`` and the logged ``lr`` work as there, and a
skipped step leaves the same state. A micro-batch of step ``t`` reads ``W(t-1)``; during window ``t`` a stage
holds ``W(t-1)`` and ``W(t)`` (the train state's ``versions`` and ``params``), the slots the
version table (:func:`~jaxpar.parallel.pipeline._pipedream.version_rows`) names for the versioned
stage (:class:`~jaxpar.parallel.pipeline._pipedream.VersionedStage`).

A call starts and ends with an empty pipeline: one fill and one drain per ``K`` steps, and
the train state (and its checkpoints) is the one-step 2BW state.

Example:
    >>> from jaxpar.parallel.pipeline._pipedream import step_windows
    >>> [hi - lo for lo, hi in step_windows(4, 8, steps=4)]    # the tick loops of one call, K = 4
    [22, 16, 16, 16]
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.batch import step_microbatches
from jaxpar.adapters._blocks import use_layer_runner
from jaxpar.rules import drop_axes, named_shardings, use_rules
from jaxpar.parallel.pipeline._buffers import PipelineState, put, take, take_tree
from jaxpar.parallel.pipeline._piped import staged_cut
from jaxpar.parallel.pipeline._instructions import PIPE, Program, lower, stage_counts
from jaxpar.parallel.pipeline._schedules import pipedream_2bw
from jaxpar.parallel.pipeline._pipedream import StageWeights, VersionedStage, VersionRows, step_windows, version_rows
from jaxpar.parallel.pipeline._stage import run_ticks, tick_table
from jaxpar.step._update import Update, apply_update, delayed

#: name scope of the loop over the later windows (in the compiled HLO, its ``while``'s ``op_name``
#: ends ``pipeline_windows/while``; the tick loops' end ``TICKS_SCOPE/while``, as in the executor)
WINDOWS_SCOPE = "pipeline_windows"


def _finish(stage: VersionedStage, st: PipelineState, a):
    """Step ``window``'s loss, gradients and reported metrics (accumulator ``a``), and ``st`` with it
    zeroed."""
    v, m = stage.v, stage.per_step
    g_blocks = jax.tree.map(lambda b: jax.lax.dynamic_slice_in_dim(b, a * v, v), st.g_blocks)
    out = (jax.lax.psum(take(st.loss, a), PIPE) / m, jax.lax.psum(take_tree(st.g_outer, a), PIPE),
           jax.tree.map(lambda g: g[:, None], g_blocks),
           jax.tree.map(lambda b: jax.lax.psum(take(b, a), PIPE) / m, st.metrics))
    st = st._replace(
        g_blocks=jax.tree.map(lambda b, g: jax.lax.dynamic_update_slice_in_dim(b, jnp.zeros_like(g), a * v, 0),
                              st.g_blocks, g_blocks),
        g_outer=jax.tree.map(lambda b: put(b, a, jnp.zeros(b.shape[1:], b.dtype)), st.g_outer),
        loss=put(st.loss, a, jnp.zeros((), jnp.float32)),
        metrics=jax.tree.map(lambda b: put(b, a, jnp.zeros(b.shape[1:], b.dtype)), st.metrics))
    return out, st


def _window_runner(parts, mesh, rules, program: Program, table, m: int, stage_layers,
                   first: bool) -> Callable:
    """The function that runs one step window of the no-flush table.

    Args:
      parts: the model's ``pre``, ``layer`` and ``post``.
      mesh: the device mesh (with a ``pipe`` axis).
      rules: the logical rules (``pipe`` is dropped inside the ``shard_map``).
      program: the lowered table.
      table: its tick table (:func:`~jaxpar.parallel.pipeline._stage.tick_table`).
      m: micro-batches per optimizer step.
      stage_layers: layers of each virtual stage (:func:`stage_counts`).
      first: the window starts from an empty pipeline (its ``state`` is None).

    Returns:
      ``fn(outer2, blocks2, mbs, state, rows, vrows, window) -> ((loss, g_outer, g_blocks, metrics),
      state)``: one window's ticks (``rows``, their version rows ``vrows``) on the versions
      ``outer2`` / ``blocks2`` (``[2, ...]``: ``W(t-1)``, ``W(t)``); ``state`` is every stage's
      in-flight :class:`~jaxpar.parallel.pipeline._buffers.PipelineState` (leading ``pipe`` axis).
    """
    counts = stage_counts(program, mesh, stage_layers)

    def body(outer2, blocks2, mbs, st, rows, vrows, window):
        w = (outer2, jax.tree.map(lambda a: a[:, :, 0], blocks2))
        stage = VersionedStage(parts, program, counts, take_tree(w, 0), mbs, per_update=m, per_step=m,
                               accumulators=2, sums=2, cast=lambda t: t)      # the versions come cast
        st = stage.initial_state(program) if first else jax.tree.map(lambda a: a[0], st)
        no_update = jnp.zeros((2,), jnp.float32)
        st, _ = run_ticks(stage, table, st, StageWeights(w, (), no_update, no_update, no_update), rows, vrows)
        out, st = _finish(stage, st, window % 2)
        return out, jax.tree.map(lambda a: a[None], st)

    rep = lambda t: jax.tree.map(lambda _: P(), t)                  # noqa: E731
    per_stage = lambda t: jax.tree.map(lambda _: P(PIPE), t)        # noqa: E731
    inner_rules = drop_axes(rules, (PIPE,))

    def fn(outer2, blocks2, mbs, st, rows, vrows, window):
        two_stage = jax.tree.map(lambda _: P(None, None, PIPE), blocks2)
        g_blocks = jax.tree.map(lambda _: P(None, PIPE), blocks2)
        smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE}, check_vma=False,
                             in_specs=(rep(outer2), two_stage, rep(mbs), per_stage(st), rep(rows), rep(vrows), P()),
                             out_specs=((P(), rep(jax.tree.map(lambda a: a[0], outer2)), g_blocks, P()),
                                        P(PIPE) if first else per_stage(st)))
        with use_rules(mesh, inner_rules), use_layer_runner(None):
            return smap(outer2, blocks2, mbs, st, rows, vrows, window)

    return fn


def _windows_rows(program: Program, rows, p: int, m: int, steps: int):
    """The table's rows and version rows cut at the step windows: the first window's, and the
    later ones stacked ``[steps - 1, 2m, ...]``."""
    both = (rows, VersionRows(*version_rows(program, m, steps)))
    (lo, hi), *rest = step_windows(p, m, steps)
    first = jax.tree.map(lambda a: a[lo:hi], both)
    later = jax.tree.map(lambda a: a[hi:].reshape(steps - 1, 2 * m, *a.shape[1:]), both) if rest else None
    return first, later


def make_two_bw_steps(loss_fn: Callable, layout, update: Update, steps: int) -> tuple[Callable, Program]:
    """``steps`` PipeDream-2BW optimizer steps of the no-flush table in one program (see the module
    docstring).

    Args:
      loss_fn: the user's loss (on the last stage).
      layout: the train state's layout (its strategy: ``schedule='pipedream-2bw'``).
      update: the train step's update options; :func:`~jaxpar.step._update.apply_update` runs under
        :func:`~jaxpar.step._update.delayed`, PipeDream-2BW's rule of the one-step program too:
        ``W(t)`` becomes the older version, on a skipped step as well (the next step's first
        micro-batches have already run on ``W(t)``).
      steps: optimizer steps per call.

    Returns:
      ``(run, program)``: ``run(state, batches) -> (state, metrics)`` to jit, every leaf of
      ``batches`` ``[steps, B, ...]`` and every metric ``[steps]``; ``program`` the lowered table.
      ``make_train_step`` has checked the layout.
    """
    strategy, mesh = layout.strategy, layout.mesh
    p, m = mesh.shape[PIPE], strategy.microbatches
    program = lower(pipedream_2bw(p, m, steps))
    table = tick_table(program)
    rows0, rows_later = _windows_rows(program, table.rows, p, m, steps)
    grad_shardings = named_shardings(layout.grads, mesh)

    rule = delayed(functools.partial(apply_update, update))      # the one-step program's rule: W(t) becomes the older version

    def run(state, batches):
        mbs = step_microbatches(batches, m, mesh, steps)
        cut = staged_cut(loss_fn, layout.graphdef, mesh, layout.params, strategy, strategy.cast(state.params),
                         jax.tree.map(lambda a: a[:m], mbs), own_specs=layout.model_specs())
        runners = [_window_runner(cut.parts, mesh, layout.rules, program, table, m, cut.stage_layers, first)
                   for first in (True, False)]

        def window(state, st, rows, t):
            older, newer = (cut.stage(strategy.cast(w)) for w in (state.versions, state.params))
            runner = runners[0 if st is None else 1]
            both = jax.tree.map(lambda x, y: jnp.stack([x, y]), older, newer)      # W(t-1), W(t)
            (loss, g_outer, g_blocks, found), st = runner(*both, mbs, st, *rows, t)
            grads = jax.lax.with_sharding_constraint(cut.grads(g_outer, g_blocks), grad_shardings)
            state, metrics = rule(state, loss, grads)
            return state, st, {**found, **metrics}       # and what the loss reported

        state, st, first = window(state, None, rows0, jnp.int32(0))
        if rows_later is None:
            return state, jax.tree.map(lambda a: a[None], first)

        def later(carry, xs):
            state, st, metrics = window(*carry, *xs)
            return (state, st), metrics

        with jax.named_scope(WINDOWS_SCOPE):
            (state, _), rest = jax.lax.scan(later, (state, st),
                                            (rows_later, jnp.arange(1, steps, dtype=jnp.int32)))
        return state, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)

    return run, program
