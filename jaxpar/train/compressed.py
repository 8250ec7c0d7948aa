"""The loss-and-grad of a step whose gradient exchange is compressed (``Strategy(compression=...)``).

The whole local step runs in one ``shard_map`` that is manual over the data axes (and
automatic over ``tensor``): parameters sharded over the data axes (ZeRO-3 / FSDP) are
all-gathered once, uncompressed; each replica computes its own gradient on its rows of
the batch, accumulated over micro-batches; then the codec's exchange
(:mod:`jaxpar.compression.exchange`) averages the gradients over the replicas, once per
step, and leaves them in the strategy's gradient layout. The codec's state (one copy per
replica) is part of the train state (``TrainState.comm``).

Example::

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.compression import qsgd
    >>> from jaxpar.models.mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> strategy = jaxpar.Strategy(zero=2, compression=qsgd())
    >>> model_fn = lambda: MLPClassifier(features=8, embed=64, mlp=256, classes=4, depth=2, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, strategy)
    >>> state.comm, layout.comm                           # qsgd keeps no state (no error feedback)
    ({}, {})
    >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, strategy)
    >>> batch = jaxpar.shard_batch({"x": jax.numpy.ones((8, 8)), "y": jax.numpy.zeros((8,), "int32")}, mesh)
    >>> state, metrics = step(state, batch)
    >>> round(float(metrics["comm_ratio"]), 3)            # bytes sent vs the fp32 exchange
    0.254
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ..blocks import LAYERS
from ..compression import ExchangePlan, exchange_plan
from ..data_parallel import _axis, _spec, bucketed_all_gather, manual_layout
from ..mesh import data_axes
from ..rules import drop_axes, use_rules
from .state import StateLayout

__all__ = ["compression_plan", "compression_state", "make_compressed_loss_and_grad"]


def compression_plan(codec, layout: StateLayout, zero: int) -> ExchangePlan:
    """The exchange of ``layout``'s gradients over its mesh's data axes with ``codec``."""
    mesh = layout.mesh
    lays = jax.tree_util.tree_structure(layout.shapes).flatten_up_to(
        manual_layout(layout.logical, layout.shapes, mesh, layout.rules, zero))
    shapes = [s.shape for s in jax.tree.leaves(layout.shapes)]
    logical = jax.tree_util.tree_structure(layout.shapes).flatten_up_to(layout.logical)
    stacked = [tuple(lg)[:1] == (LAYERS,) for lg in logical]
    return exchange_plan(codec, shapes, dims=[d for d, _, _ in lays], grad_axes=[g for _, _, g in lays],
                         stacked=stacked, mesh_sizes=dict(mesh.shape))


def _replica_spec(plan: ExchangePlan) -> PartitionSpec:
    return PartitionSpec(_axis(plan.axes))


def compression_state(codec, layout: StateLayout, zero: int) -> tuple[Callable, Any, Any]:
    """``(init, specs, shapes)`` of the per-replica codec state: ``init()`` (under ``jit``)
    makes it, every leaf with a leading replica axis sharded over the data axes."""
    plan = compression_plan(codec, layout, zero)
    spec = _replica_spec(plan)

    def init():
        one = plan.init()
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.replicas, *a.shape)), one)

    shapes = jax.eval_shape(init)
    return init, jax.tree.map(lambda _: spec, shapes), shapes


def make_compressed_loss_and_grad(loss_fn: Callable, layout: StateLayout, strategy) -> tuple[Callable, ExchangePlan]:
    """``(params, batch, comm, step) -> (loss, grads, comm, metrics)`` (call it under ``jit``)
    and its :class:`~jaxpar.compression.ExchangePlan`. ``loss_fn(model, batch)`` is the user's loss.

    With ``pipe > 1`` the pipeline executor returns each replica's own gradients (a leading
    replica axis) and the exchange runs in a second ``shard_map`` over the data axes."""
    from .step import local_grads, make_model_loss

    mesh, codec = layout.mesh, strategy.compression
    model_loss = make_model_loss(loss_fn, layout, strategy)
    plan = compression_plan(codec, layout, strategy.zero)
    treedef = jax.tree_util.tree_structure(layout.shapes)
    lays = treedef.flatten_up_to(manual_layout(layout.logical, layout.shapes, mesh, layout.rules, strategy.zero))
    ndims = [len(s.shape) for s in jax.tree.leaves(layout.shapes)]
    dims, p_axes = [d for d, _, _ in lays], [p for _, p, _ in lays]
    p_specs = treedef.unflatten([_spec(d, p, n) for (d, p, _), n in zip(lays, ndims)])
    g_specs = treedef.unflatten([_spec(d, g, n) for (d, _, g), n in zip(lays, ndims)])
    sizes = dict(mesh.shape)
    batch_axes = tuple(a for a in data_axes(mesh) if sizes[a] > 1)
    batch_spec = PartitionSpec(_axis(batch_axes))
    comm_spec = jax.tree.map(lambda _: _replica_spec(plan), layout.comm_shapes)
    local_rules = drop_axes(layout.rules, plan.axes)
    k = strategy.microbatches
    axis = _axis(plan.axes)
    steps = _bytes_per_stage(plan)

    def local(params, batch, comm, step):
        comm = jax.tree.map(lambda a: a[0], comm)
        with use_rules(mesh, local_rules):
            leaves = bucketed_all_gather(jax.tree.leaves(params), dims, p_axes)
            loss, grads = local_grads(model_loss, treedef.unflatten(leaves), batch, k)
        leaves, clip_stats = clip_replica(jax.tree.leaves(grads), strategy.local_clip, axis)
        out, comm, stats = plan.exchange(leaves, comm, step)
        stats = {**stats, **clip_stats}
        loss = jax.lax.pmean(loss, axis)
        return loss, treedef.unflatten(out), jax.tree.map(lambda a: a[None], comm), stats

    smap = jax.shard_map(local, mesh=mesh, in_specs=(p_specs, batch_spec, comm_spec, PartitionSpec()),
                         out_specs=(PartitionSpec(), g_specs, comm_spec, PartitionSpec()),
                         axis_names=set(plan.axes) | set(batch_axes), check_vma=False)
    grad_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.grads)
    if sizes.get("pipe", 1) > 1:
        smap = _piped(loss_fn, layout, strategy, plan, batch_axes, g_specs, comm_spec)

    def loss_and_grad(params, batch, comm, step):
        clock = comm["count"][0] if "count" in comm else step     # exchanges applied before (for a start_step)
        loss, grads, comm, stats = smap(params, batch, comm, step)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        sent = steps(clock)
        metrics = {"comm_bytes": sent, "comm_ratio": sent / plan.uncompressed_bytes(), **stats}
        return loss, grads, comm, metrics

    return loss_and_grad, plan


def clip_replica(leaves: list, clip: float | None, axis) -> tuple[list, dict]:
    """This replica's gradient ``leaves`` scaled to global norm at most ``clip`` (``None``: as
    they are), inside the ``shard_map`` over the data axes ``axis``, before the codec (Deep
    Gradient Compression's local gradient clipping). Metrics: ``replica_grad_norm``, the mean
    over replicas of the norm before clipping."""
    if clip is None:
        return leaves, {}
    norm = optax.tree.norm(leaves)
    scale = jnp.minimum(1.0, clip / (norm + 1e-6))
    return [g * scale.astype(g.dtype) for g in leaves], {"replica_grad_norm": jax.lax.pmean(norm, axis)}


def _piped(loss_fn, layout: StateLayout, strategy, plan: ExchangePlan, batch_axes, g_specs, comm_spec) -> Callable:
    """Pipeline: each replica's gradients from the executor, then the exchange over the data axes."""
    from ..pipeline.piped import make_pipeline_loss_and_grad   # pipelines load only when used
    from .step import _stacked_layers

    mesh, treedef = layout.mesh, jax.tree_util.tree_structure(layout.shapes)
    piped = make_pipeline_loss_and_grad(loss_fn, layout.graphdef, mesh, layout.rules, layout.params, layout.grads,
                                        strategy, num_layers=_stacked_layers(layout), replica_axes=batch_axes)
    rep = PartitionSpec(_axis(batch_axes))

    def exchange(grads, comm, step):
        leaves, clip_stats = clip_replica([g[0] for g in jax.tree.leaves(grads)], strategy.local_clip,
                                          _axis(plan.axes))
        out, comm, stats = plan.exchange(leaves, jax.tree.map(lambda a: a[0], comm), step)
        return treedef.unflatten(out), jax.tree.map(lambda a: a[None], comm), {**stats, **clip_stats}

    smap = jax.shard_map(exchange, mesh=mesh, in_specs=(treedef.unflatten([rep] * treedef.num_leaves), comm_spec,
                                                         PartitionSpec()),
                         out_specs=(g_specs, comm_spec, PartitionSpec()), axis_names=set(plan.axes),
                         check_vma=False)

    def run(params, batch, comm, step):
        with use_rules(mesh, layout.rules):
            loss, grads = piped(params, batch)
        grads, comm, stats = smap(grads, comm, step)
        return loss, grads, comm, stats

    return run


def _bytes_per_stage(plan: ExchangePlan) -> Callable:
    """``step -> bytes sent`` (traced), for codecs whose payload changes with the step."""
    c = plan.codec
    warm = getattr(c, "warmup", ())
    start = getattr(c, "start_step", 0)
    if warm:
        table = jnp.array([plan.wire_bytes(i * c.warmup_steps) for i in range(len(warm) + 1)], jnp.float32)
        return lambda step: table[c.stage(step)]
    if start:
        before, after = float(plan.uncompressed_bytes()), float(plan.wire_bytes())
        return lambda step: jnp.where(step >= start, after, before).astype(jnp.float32)
    sent = float(plan.wire_bytes())
    return lambda step: jnp.float32(sent)
