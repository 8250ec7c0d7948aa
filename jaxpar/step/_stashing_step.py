"""Weight stashing's update placement in the no-flush program: per-stage updates inside the tick loop.

:func:`make_stashing_step` (``make_train_step`` with ``Strategy(schedule='pipedream')``) runs
:func:`~jaxpar.parallel.pipeline.pipedream` ``(p, m, K)`` (``K = steps_per_call`` optimizer
steps, one tick loop) with the rule of :mod:`jaxpar.parallel.pipeline._pipedream`, on the
versioned stage (:class:`~jaxpar.parallel.pipeline._pipedream.VersionedStage`). Inside the
``shard_map`` (manual over ``pipe``) every stage carries:

* a buffer of weight versions, ``[n_slots + 1, ...]`` (its layers and its own copy of the
  parameters around the blocks, ``outer``); the lowering
  (:func:`~jaxpar.parallel.pipeline._pipedream.lower_stashed`) gives each (tick, stage) the
  slot F / B read and, after an update, the slots it reads and writes, assigned by interval
  colouring like the executor's residual slots;
* its own optimizer state (the stage's rows of the block leaves, its copy of ``outer``'s).

A backward whose micro-batch ends an ``update_every`` group runs, in the same conditional, the
train step's one update (:func:`jaxpar.step._update.apply_update`: ``tx`` and the skip rule) on the
stage's gradient (the group's mean) and writes the new version. The
gradient is reduced over the data axes by XLA inside the stage (those axes stay automatic):
the accumulator is replicated over them, so each backward's weight gradient is all-reduced
over the stage's data devices before it is added, and the update reads the reduced sum.
With ``fsdp`` or ZeRO the version buffer and the optimizer state follow the parameters'
sharding over those axes (XLA's sharding propagation from the state's inputs; no constraint
is added, and ``tests/test_weight_stashing.py`` checks the per-device bytes), and XLA gathers
a version for each action.

``outer`` leaves belong to the stage that reads them: those read before the blocks (``pre``)
to stage 0, those read after (``post``) to stage ``p - 1`` (a leaf read by neither follows
stage 0); a leaf read by both (tied embeddings) is an error. Every stage updates its copy, and
the train state keeps the owner's. The optimizer must update each stage's parameters from
their own values and gradients alone (SGD, Adam, AdamW...):
:func:`jaxpar.parallel.pipeline._pipedream.optimizer_is_per_stage` (in ``make_train_step``) probes it and names one
that does not (global-norm clipping, a trust ratio over a whole stacked
leaf). ``clip_norm`` (global, across stages) is an error.

The train state holds the current version (``params``) and the ``ceil((p-1)/k)`` older ones
(``versions``, newest first), per stage; so a call starts where a never-draining pipeline would
be, and a checkpoint resumes bit-exact. Metrics per step: ``loss`` and what the loss reported (means
over its ``m`` micro-batches), ``grad_norm`` (as defined in :mod:`jaxpar.step._update`: the root mean
square, over the step's ``m / update_every`` updates, of the global norm of an update's gradient, all
stages' parts; with one update per step, that gradient's norm), ``skipped`` (every stage skipped
its non-finite update: no weight changed), ``skipped_updates`` and ``lr``.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from jaxpar.adapters._blocks import use_layer_runner
from jaxpar.batch import step_microbatches
from jaxpar.errors import StashingError
from jaxpar.optimizers import learning_rate
from jaxpar.rules import drop_axes, path_str, use_rules
from jaxpar.parallel.pipeline._buffers import put, take, take_tree
from jaxpar.parallel.pipeline._partition import from_stages, to_stages
from jaxpar.parallel.pipeline._piped import staged_cut
from jaxpar.parallel.pipeline._schedules import pipedream
from jaxpar.parallel.pipeline._pipedream import StageWeights, StashProgram, VersionedStage, VersionRows, lower_stashed
from jaxpar.parallel.pipeline._instructions import PIPE, stage_counts
from jaxpar.parallel.pipeline._stage import run_ticks, tick_table
from jaxpar.step._state import TrainState
from jaxpar.step._update import Update, apply_update, updates_metrics


def _stage_update(update: Update, cut, w_cur, opt, g_outer, g_chunk):
    """A stage's optimizer step on its newest version (one chunk: ``[Lmax, ...]`` layers):
    :func:`~jaxpar.step._update.apply_update` on the stage's parameters, which sees no loss (the
    last stage's), so a non-finite gradient norm alone skips it. Returns the new version, the
    optimizer state, the squared norm of the update's gradient, whether it was skipped and the learning rate
    the optimizer state holds (0 without one)."""
    params = cut.merge(list(w_cur[0]), take_tree(w_cur[1], 0))
    grads = cut.merge(list(g_outer), g_chunk)
    new, m = apply_update(update, TrainState(jnp.zeros((), jnp.int32), params, opt), jnp.zeros((), jnp.float32),
                          grads)
    skip = m["skipped"].astype(jnp.float32) if "skipped" in m else jnp.zeros((), jnp.float32)
    outer, blocks = cut.split(new.params)
    sq = jnp.square(m["grad_norm"]) if "grad_norm" in m else jnp.zeros((), jnp.float32)
    return (outer, jax.tree.map(lambda a: a[None], blocks)), new.opt_state, sq, skip, m.get("lr", jnp.float32(0))


# ----------------------------------------------------------------------------- outer ownership
def _used_inputs(fn, args, n: int) -> list[bool]:
    """Which of the first ``n`` flattened inputs of ``fn(*args)`` its result depends on (dead code
    removed; an equation counts whole)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(o in live for o in eqn.outvars):
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return [v in live for v in jaxpr.invars[:n]]


def _owners(parts, outer, mb, x, names: list[str], p: int) -> list[int]:
    """The stage owning each ``outer`` leaf: 0 (read by ``pre`` or by nothing) or ``p - 1``."""
    shape = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)   # noqa: E731
    pre = _used_inputs(parts.pre, (shape(outer), shape(mb)), len(outer))
    post = _used_inputs(parts.post, (shape(outer), x, shape(mb)), len(outer))
    both = [nm for nm, a, b in zip(names, pre, post) if a and b]
    if both:
        raise StashingError(
            f"schedule='pipedream': parameters {both[:4]} are read both before the stacked blocks (stage 0) and "
            "after them (the last stage), e.g. tied embeddings or a skip connection around the blocks; weight "
            "stashing keeps one version per stage, so such a leaf would get two. Untie them, or use "
            "schedule='pipedream-2bw' / '1f1b'.")
    return [p - 1 if b else 0 for b in post]


# ----------------------------------------------------------------------------- the optimizer
def _opt_tags(tx, layout) -> list[int]:
    """For each leaf of the optimizer state: the index of the parameter leaf it mirrors, or -1."""
    ids = jax.tree.unflatten(jax.tree.structure(layout.shapes), list(range(len(jax.tree.leaves(layout.shapes)))))
    masked = lambda v: isinstance(v, optax.MaskedNode)       # noqa: E731  (a masked-out leaf: no state)
    tags = jax.tree.leaves(optax.tree_map_params(tx, lambda v, i: v if masked(v) else i, layout.opt_shapes, ids,
                                                 transform_non_params=lambda _: -1, is_leaf=masked))
    shapes, params = jax.tree.leaves(layout.opt_shapes), jax.tree.leaves(layout.shapes)
    if len(tags) != len(shapes) or any(t >= 0 and shapes[n].shape != params[t].shape for n, t in enumerate(tags)):
        raise StashingError("schedule='pipedream': the optimizer state has leaves that mirror a parameter but not "
                            "its shape (factored statistics?), so it cannot be split per pipeline stage. Use an "
                            "optimizer whose state is element-wise (sgd, adam, adamw), or schedule='1f1b'.")
    return tags


# ----------------------------------------------------------------------------- the step
def make_stashing_step(loss_fn: Callable, layout, update: Update, steps: int = 1) -> tuple[Callable, StashProgram]:
    """``steps`` optimizer steps of weight stashing in one program (see the module docstring): each
    stage applies ``tx`` to its own weights inside the pipeline.

    Args:
      loss_fn: the user's loss (on the last stage).
      layout: the train state's layout (its strategy: ``schedule='pipedream'``).
      update: the update's options (:class:`~jaxpar.step._update.Update`): ``tx`` is applied per
        stage (``make_train_step`` checked it); with ``skip_nonfinite`` a stage whose update
        gradient is not finite keeps its weights; the first stage's learning rate is logged as ``metrics["lr"]``;
        ``clip_norm`` is refused by the compatibility table (a global norm spans the stages).
      steps: optimizer steps per call.

    Returns:
      ``(run, program)``: ``run(state, batches) -> (state, metrics)`` to jit, every leaf of
      ``batches`` ``[steps, B, ...]`` and every metric ``[steps]``; ``program`` the lowered table.
      ``make_train_step`` has checked the layout and the optimizer (the table's ST x LL, ST x MU).
    """
    strategy = layout.strategy
    m = strategy.microbatches
    sp = lower_stashed(pipedream(layout.mesh.shape[PIPE], m, steps), m=m, update_every=strategy.update_every,
                       vertical_sync=strategy.vertical_sync)
    return _StashingRun(loss_fn, update, layout, sp, steps).run, sp


class _StashingRun:
    """The ``run(state, batches)`` of :func:`make_stashing_step`: the state split per stage, every
    stage's tick loop in a ``shard_map`` over ``pipe``, and the state merged back."""

    def __init__(self, loss_fn, update: Update, layout, sp: StashProgram, steps: int):
        self.loss_fn, self.update, self.layout, self.sp, self.steps = loss_fn, update, layout, sp, steps
        self.table = tick_table(sp.program, updates=sp.update)
        self.vrows = VersionRows(*(np.array(x, np.int32) for x in (sp.ver, sp.cur, sp.new)))
        self.flat_paths = [path_str(pth) for pth, _ in jax.tree_util.tree_flatten_with_path(layout.shapes)[0]]
        self.tags = _opt_tags(update.tx, layout)

    def run(self, state, batches):
        """``steps`` optimizer steps: ``(state, batches [steps, B, ...]) -> (state, metrics [steps])``."""
        layout, strategy, steps, mesh = self.layout, self.layout.strategy, self.steps, self.layout.mesh
        p, m, k = mesh.shape[PIPE], strategy.microbatches, strategy.update_every
        mbs = step_microbatches(batches, m, mesh, steps)
        cut = staged_cut(self.loss_fn, layout.graphdef, mesh, layout.params, strategy, strategy.cast(state.params),
                         jax.tree.map(lambda a: a[:m], mbs), own_specs=layout.model_specs())
        blocks_ids = set(cut.model.block_leaves)
        outer_names = [nm for i, nm in enumerate(self.flat_paths) if i not in blocks_ids]
        staged = [cut.stage(w) for w in (state.params, *state.versions)]      # the versions stacked per stage
        w_outer = [jnp.stack(a) for a in zip(*(o for o, _ in staged))]
        w_blocks = jax.tree.map(lambda *a: jnp.stack(a), *(b for _, b in staged))
        mb0 = jax.tree.map(lambda a: a[0], mbs)
        x = jax.eval_shape(cut.parts.pre, strategy.cast([a[0] for a in w_outer]), mb0)
        owners = _owners(cut.parts, [a[0] for a in w_outer], mb0, x, outer_names, p)
        counts = stage_counts(self.sp.program, mesh, cut.stage_layers)
        opt_leaves, opt_def = jax.tree.flatten(state.opt_state)
        is_block = [t >= 0 and t in blocks_ids for t in self.tags]
        opt_in = [to_stages(a, cut.stage_layers, p) if b else a for a, b in zip(opt_leaves, is_block)]

        rep = lambda t: jax.tree.map(lambda _: P(), t)                         # noqa: E731
        blk = lambda t: jax.tree.map(lambda _: P(None, None, PIPE), t)         # noqa: E731
        opt_specs = [P(None, PIPE) if b else P() for b in is_block]
        opt_out_specs = [P(None, PIPE) if b else P(PIPE) for b in is_block]
        stage_loop = functools.partial(self._stage_loop, cut, counts, opt_def, is_block)
        smap = jax.shard_map(stage_loop, mesh=mesh, axis_names={PIPE}, check_vma=False,
                             in_specs=(rep(w_outer), blk(w_blocks), opt_specs, rep(mbs)),
                             out_specs=(P(), [P(PIPE)] * len(w_outer), blk(w_blocks), opt_out_specs))
        with use_rules(mesh, drop_axes(layout.rules, (PIPE,))), use_layer_runner(None):
            (loss, gsq, skips, lr, reported), o_out, b_out, opt_out = smap(w_outer, w_blocks, opt_in, mbs)
        new = self._merged(state, cut, owners, opt_def, is_block, o_out, b_out, opt_out)
        upd, holds_lr = self.update, learning_rate(state.opt_state) is not None
        per_step = [updates_metrics(loss[j] / m, gsq[j] if upd.grad_norm else None, m // k, skips[j] if upd.skip_nonfinite else None,
                                    of=p * (m // k), lr=lr[j] if holds_lr else None)
                    for j in range(steps)]      # grad_norm: the RMS over the step's updates of their global norm
        metrics = jax.tree.map(lambda *a: jnp.stack(a), *per_step)
        return new, {**jax.tree.map(lambda a: a / m, reported), **metrics}     # what the loss reported, per step

    def _stage_loop(self, cut, counts, opt_def, is_block: list, w_outer, w_blocks, opt_in, mbs):
        """One stage's program: its weight versions and optimizer state through the table's ticks."""
        sp, strategy, steps = self.sp, self.layout.strategy, self.steps
        init = (w_outer, jax.tree.map(lambda a: a[:, :, 0], w_blocks))
        opt = opt_def.unflatten([a[0, 0] if b else a for a, b in zip(opt_in, is_block)])
        per_stage = self.update._replace(clip_norm=None, place=None)   # no global clip: it spans the stages
        update = functools.partial(_stage_update, per_stage, cut.model)
        stage = VersionedStage(cut.parts, sp.program, counts, strategy.cast(take_tree(init, 0)), mbs,
                               per_update=strategy.update_every, per_step=strategy.microbatches, accumulators=1,
                               sums=steps, cast=strategy.cast, update=update)
        slots = jnp.asarray(np.array(sp.init, np.int32))[stage.index]
        buf = jax.tree.map(lambda a: jnp.zeros((sp.n_slots + 1, *a.shape[1:]), a.dtype), init)
        for j in range(sp.older + 1):           # the state's versions in their first slots
            buf = jax.tree.map(lambda b, a, j=j: put(b, slots[j], a[j]), buf, init)
        per_step = jnp.zeros((steps,), jnp.float32)
        st, ws = run_ticks(stage, self.table, stage.initial_state(sp.program),
                           StageWeights(buf, opt, per_step, per_step, per_step), self.table.rows, self.vrows)
        final = jnp.asarray(np.array(sp.final, np.int32))[stage.index]
        out = jax.tree.map(lambda b: jnp.stack([take(b, final[j]) for j in range(sp.older + 1)]), ws.w)
        first = jnp.where(jax.lax.axis_index(PIPE) == 0, ws.lr, 0.0)        # the first stage's learning rate
        sums = jax.tree.map(lambda a: jax.lax.psum(a, PIPE), (st.loss, ws.gsq, ws.skips, first, st.metrics))
        opt_out = [a[None, None] if b else a[None] for a, b in zip(jax.tree.leaves(ws.opt), is_block)]
        return sums, [a[None] for a in out[0]], jax.tree.map(lambda a: a[:, :, None], out[1]), opt_out

    def _merged(self, state, cut, owners: list, opt_def, is_block: list, o_out, b_out, opt_out):
        """The new train state: each version's owners' outer leaves and all stages' blocks, and the optimizer's."""
        blocks_ids = set(cut.model.block_leaves)
        outer_pos = {pi: j for j, pi in enumerate(i for i in range(len(self.flat_paths)) if i not in blocks_ids)}
        versions = [cut.grads([a[owners[n], j] for n, a in enumerate(o_out)], jax.tree.map(lambda a: a[j], b_out))
                    for j in range(self.sp.older + 1)]
        L = jax.tree.leaves(cut.model.split(self.layout.shapes)[1])[0].shape[0]
        opt_state = opt_def.unflatten([
            from_stages(a, cut.stage_layers, L) if b else (a[owners[outer_pos[t]]] if t >= 0 else a[0])
            for a, b, t in zip(opt_out, is_block, self.tags)])
        return state._replace(step=state.step + self.steps, params=versions[0], opt_state=opt_state,
                              versions=tuple(versions[1:]))

