"""Run any valid schedule table as one SPMD program: ``shard_map`` manual over ``pipe``.

Each device holds its stages' layers (``[v, Lmax, ...]``: ``v`` chunks of at most ``Lmax`` layers)
and a ``lax.scan`` runs the lowered table tick by tick (:mod:`._stage`): the device's action, one
boolean ``lax.cond`` per action kind (idle stages compute nothing in bubbles), then ``ppermute``
sends between the stages that send at that tick, one per distinct set of pairs, chosen by a
``lax.switch`` whose index is the same on every device. The other mesh axes stay automatic, so
data / ZeRO / tensor parallelism work inside a stage. ``pre`` and ``post`` add into one gradient
of ``outer``, summed over ``pipe`` once at the end. The result equals the non-pipelined run
(docs/pipeline.md, "How the executor works").

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.parallel.pipeline import PipelineParts, get_schedule, lower, to_stages
    >>> parts = PipelineParts(pre=lambda o, mb: mb["x"] * o["scale"],
    ...                       layer=lambda w, x: jnp.tanh(x @ w),
    ...                       post=lambda o, y, mb: jnp.mean((y - mb["y"]) ** 2))
    >>> mesh = jaxpar.make_mesh({"pipe": 2}, devices=jax.devices()[:2])
    >>> fn = pipeline_value_and_grad(parts, mesh, (), lower(get_schedule("1f1b", 2, 4)), stage_layers=(2, 2))
    >>> outer, blocks = {"scale": jnp.ones(())}, 0.5 * jnp.ones((4, 3, 3))      # 4 stacked layers
    >>> mbs = {"x": jnp.ones((4, 2, 3)), "y": jnp.zeros((4, 2, 3))}             # 4 micro-batches of 2 rows
    >>> loss, (g_outer, g_blocks) = jax.jit(fn)(outer, to_stages(blocks, (2, 2), p=2), mbs)
    >>> def plain(o, w, mb):                                                   # the same loss on one device
    ...     h = mb["x"] * o["scale"]
    ...     for i in range(4):
    ...         h = jnp.tanh(h @ w[i])
    ...     return jnp.mean((h - mb["y"]) ** 2)
    >>> g_ref = jax.grad(plain)(outer, blocks, mbs)
    >>> g_blocks.shape, bool(jnp.allclose(loss, plain(outer, blocks, mbs)))
    ((1, 2, 2, 3, 3), True)
    >>> bool(jnp.allclose(g_outer["scale"], g_ref["scale"], rtol=1e-5))
    True
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.adapters._blocks import use_layer_runner
from jaxpar.rules import drop_axes, use_rules
from jaxpar.parallel.pipeline._cut import PipelineParts
from jaxpar.parallel.pipeline._instructions import Program
from jaxpar.parallel.pipeline._partition import check_blocks_layout
from jaxpar.parallel.pipeline._stage import PIPE, Stage, run_ticks, stage_counts, tick_table


def pipeline_value_and_grad(parts: PipelineParts, mesh, rules, program: Program, *,
                            stage_layers: Sequence[int], replica_axes: Sequence[str] = (),
                            with_metrics: bool = False, lockstep: bool = False) -> Callable:
    """Build the pipelined loss-and-grad of a batch of micro-batches: a ``shard_map`` manual over ``pipe``.

    Args:
        parts: the model's ``pre``, ``layer`` and ``post``.
        mesh: the mesh; its other axes stay automatic inside a stage.
        rules: the logical rules (``pipe`` and ``replica_axes`` are dropped inside).
        program: the lowered schedule (:func:`~jaxpar.parallel.pipeline.lower`).
        stage_layers: layers of each virtual stage ``k = chunk * p + stage``; padding layers are skipped.
        replica_axes: data axes over which each replica keeps its own gradients (a compressed exchange follows):
            manual too; every gradient gets a leading replica axis sharded over them; the loss is their mean.
        with_metrics: also return what ``parts.post`` reported (:func:`jaxpar.report_metric`), averaged.
        lockstep: ``program`` is a lockstep table (``lower(lockstep(schedule))``, :func:`~._schedules.lockstep`): every stage
            runs each tick's action, masked where it has none (:class:`~._stage.Stage`), so no collective inside
            an action is reached by some devices only.

    Returns:
        ``fn(outer, blocks, microbatches) -> (loss, (g_outer, g_blocks))``, or ``(loss, grads, metrics)``.
        ``outer``: ``pre``'s and ``post``'s parameters (one tree, replicated over ``pipe``); ``blocks``:
        ``[v, p, Lmax, ...]`` per leaf, sharded ``P(None, 'pipe', ...)`` (:func:`~._partition.to_stages`);
        ``microbatches``: ``[m, rows, ...]``. The loss is the mean of the micro-batch losses, the gradients
        (float32) those of that mean; ``g_outer`` adds ``pre``'s and ``post``'s (tied weights get both).
    """
    counts = stage_counts(program, mesh, stage_layers)      # [chunk, stage]
    table = tick_table(program, lockstep=lockstep)
    replica_axes = tuple(replica_axes)
    rep_entry = (replica_axes if len(replica_axes) > 1 else replica_axes[0]) if replica_axes else None
    lead = (rep_entry,) if replica_axes else ()          # the gradients' leading replica axis
    rows = (None, rep_entry) if replica_axes else ()     # the micro-batches' rows over the replicas

    def body(outer, blocks, mbs):
        stage = Stage(parts, program, counts, outer, jax.tree.map(lambda a: a[:, 0], blocks), mbs, lockstep)
        st, _ = run_ticks(stage, table, stage.initial_state(program))
        g_blocks = jax.tree.map(lambda a: a[:, None], st.g_blocks)
        loss, g_outer = jax.lax.psum(st.loss, PIPE) / stage.m, jax.lax.psum(st.g_outer, PIPE)
        metrics = jax.tree.map(lambda a: jax.lax.psum(a, PIPE) / stage.m, st.metrics)   # the last stage's sums
        if replica_axes:        # each replica's own gradients, a leading axis
            return jax.lax.pmean((loss, metrics), rep_entry), jax.tree.map(lambda a: a[None], (g_outer, g_blocks))
        return (loss, metrics), (g_outer, g_blocks)

    inner_rules = drop_axes(rules, (PIPE, *replica_axes))
    specs = lambda t, *entries: jax.tree.map(lambda _: P(*entries), t)   # noqa: E731

    def fn(outer, blocks, mbs):
        check_blocks_layout(blocks, counts, stage_layers)
        smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE, *replica_axes}, check_vma=False,
                             in_specs=(specs(outer), specs(blocks, None, PIPE), specs(mbs, *rows)),
                             out_specs=(P(), (specs(outer, *lead), specs(blocks, *lead, None, PIPE))))
        with use_rules(mesh, inner_rules), use_layer_runner(None):
            (loss, metrics), grads = smap(outer, blocks, mbs)
        return (loss, grads, metrics) if with_metrics else (loss, grads)

    return fn
