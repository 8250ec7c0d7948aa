"""The gradient exchange of a step whose gradients are each replica's own (:func:`~jaxpar.step._grads.replica_grads`).

An :class:`Exchange` turns every replica's gradient (inside a ``shard_map`` manual over the data
axes) into the averaged gradient in the strategy's gradient layout:

* :func:`exact_exchange`: reduce-scatter where the strategy shards gradients over a data axis
  (ZeRO-2/3, FSDP), all-reduce over the others;
* :func:`compressed_exchange`: a codec's exchange (:mod:`jaxpar.parallel.compression`) over the layout's
  gradients (:func:`compression_plan`), with its state (error-feedback residuals, ...) one copy per replica
  in ``TrainState.codec`` (:func:`compression_state`);
* :func:`measured_exchange`: another exchange that also measures each replica's squared
  gradient norm and the averaged one's (the gradient noise scale, :mod:`jaxpar.step._noise_scale`).

:func:`run_exchange` wraps an exchange in its ``shard_map``. When XLA places the data-axis
collectives itself (:func:`~jaxpar.step._grads.global_grads`), no exchange runs: that is the
exact exchange too.

Example:
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> from jaxpar.step._grads import global_grads, manual_specs, replica_grads
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(zero=2))
    >>> man = manual_specs(layout)
    >>> reduce = run_exchange(measured_exchange(exact_exchange(man), man), layout)
    >>> batch = {"x": np.arange(32.0, dtype=np.float32).reshape(8, 4), "y": np.zeros(8, np.int32)}
    >>> @jax.jit
    ... def both(params, batch):
    ...     _, mine = replica_grads(classifier_loss, layout)(params, batch)
    ...     grads, _, metrics = reduce(mine, (), 0)
    ...     return grads, global_grads(classifier_loss, layout)(params, batch)[1], metrics
    >>> grads, exact, metrics = both(state.params, batch)
    >>> bool(np.allclose(grads["out"]["kernel"], exact["out"]["kernel"], atol=1e-6)), sorted(metrics)
    (True, ['grad_sq_big', 'grad_sq_small'])
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.adapters._blocks import LAYERS
from jaxpar.parallel._data_parallel import axis_name, bucketed_reduce_scatter, manual_layout
from jaxpar.step._grads import ManualLayout, manual_specs
from jaxpar.step._state import StateLayout


class Exchange(NamedTuple):
    """``reduce(leaves, codec_state, step) -> (leaves, codec_state, metrics)`` inside the ``shard_map`` over the
    data axes: this replica's full gradient leaves in, its shards of the averaged gradient out.
    ``outside(grads, codec_state, step) -> metrics``: metrics computed after it, from the averaged
    gradient and the state before it (``None``: none). ``exact``: the average is exact."""

    name: str
    reduce: Callable
    outside: Callable | None = None
    exact: bool = True


def _psum_rest(leaves: list, axes: list[tuple[str, ...]]) -> list:
    """``psum`` of every leaf over its ``axes``, one collective per group of leaves with the same axes."""
    out, groups = list(leaves), {}
    for i, ax in enumerate(axes):
        if ax:
            groups.setdefault(ax, []).append(i)
    for ax, idx in groups.items():
        summed = jax.lax.psum([leaves[i] for i in idx], axis_name(ax))
        for i, s in zip(idx, summed):
            out[i] = s
    return out


def exact_exchange(man: ManualLayout) -> Exchange:
    """The exact average: reduce-scatter on each leaf's ZeRO dimension over the data axes that
    shard its gradient, all-reduce over the rest.

    Args:
      man: the layout inside the ``shard_map`` (:func:`~jaxpar.step._grads.manual_specs`).

    Returns:
      The :class:`Exchange`.
    """
    rest = [tuple(a for a in man.axes if a not in g) for g in man.grad_axes]

    def reduce(leaves, codec_state, step):
        out = _psum_rest(bucketed_reduce_scatter(leaves, man.dims, man.grad_axes), rest)
        return [g / man.replicas for g in out], codec_state, {}

    return Exchange("exact", reduce)


def clip_replica(leaves: list, clip: float | None, axis) -> tuple[list, dict]:
    """This replica's gradient scaled to global norm at most ``clip`` before a codec (Deep
    Gradient Compression's local gradient clipping).

    Args:
      leaves: this replica's gradient leaves (inside the ``shard_map`` over the data axes).
      clip: the norm (``None``: the leaves as they are).
      axis: the data axes' ``axis_name``.

    Returns:
      ``(leaves, metrics)``; ``replica_grad_norm`` is the mean over replicas of the norm before clipping.
    """
    if clip is None:
        return leaves, {}
    norm = optax.tree.norm(leaves)
    scale = jnp.minimum(1.0, clip / (norm + 1e-6))
    return [g * scale.astype(g.dtype) for g in leaves], {"replica_grad_norm": jax.lax.pmean(norm, axis)}


def compression_plan(codec, layout: StateLayout, zero: int) -> Any:
    """The exchange of ``layout``'s gradients over its mesh's data axes with ``codec``.

    Args:
      codec: the codec (e.g. :func:`~jaxpar.parallel.compression.qsgd`), as in ``Strategy(compression=...)``.
      layout: the state's layout (shapes, logical names, rules, mesh); the table's codec rules ran
        when it was made.
      zero: the ZeRO stage (which gradients are sharded over the data axes).

    Returns:
      The :class:`~jaxpar.parallel.compression.ExchangePlan`.
    """
    from jaxpar.parallel.compression import exchange_plan   # compression loads only when used

    mesh, treedef = layout.mesh, jax.tree_util.tree_structure(layout.shapes)
    lays = treedef.flatten_up_to(manual_layout(layout.logical, layout.shapes, mesh, layout.rules, zero))
    shapes = [s.shape for s in jax.tree.leaves(layout.shapes)]
    stacked = [tuple(lg)[:1] == (LAYERS,) for lg in treedef.flatten_up_to(layout.logical)]
    return exchange_plan(codec, shapes, dims=[d for d, _, _ in lays], grad_axes=[g for _, _, g in lays],
                         stacked=stacked, mesh_sizes=dict(mesh.shape), zero=zero, checked=False)   # by the layout


def compression_state(codec, layout: StateLayout, zero: int) -> tuple[Callable, Any, Any]:
    """The per-replica codec state (``TrainState.codec``): how to make it, its specs and shapes.

    Args:
      codec: the codec, as in ``Strategy(compression=...)``.
      layout: the state's layout.
      zero: the ZeRO stage.

    Returns:
      ``(init, specs, shapes)``: ``init()`` (under ``jit``) makes the state, every leaf with a leading
      replica axis sharded over the data axes; ``specs``: its ``PartitionSpec`` tree; ``shapes``: its
      ``jax.ShapeDtypeStruct`` tree.

    Example::

        >>> import jax, optax, jaxpar
        >>> from flax import nnx
        >>> from jaxpar.parallel.compression import qsgd
        >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
        >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
        >>> strategy = jaxpar.Strategy(zero=2, compression=qsgd())
        >>> model_fn = lambda: MLPClassifier(features=8, embed=64, mlp=256, classes=4, depth=2, rngs=nnx.Rngs(0))
        >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, strategy)
        >>> state.codec, layout.part("codec").specs           # qsgd keeps no state (no error feedback)
        ({}, {})
        >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, strategy)
        >>> batch = jaxpar.shard_batch({"x": jax.numpy.ones((8, 8)), "y": jax.numpy.zeros((8,), "int32")}, mesh)
        >>> state, metrics = step(state, batch)
        >>> round(float(metrics["comm_ratio"]), 3)            # bytes sent vs the fp32 exchange
        0.254
    """
    plan = compression_plan(codec, layout, zero)
    spec = PartitionSpec(axis_name(plan.axes))      # a leading replica axis, sharded over the data axes

    def init():
        one = plan.init()
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.replicas, *a.shape)), one)

    shapes = jax.eval_shape(init)
    return init, jax.tree.map(lambda _: spec, shapes), shapes


def compressed_exchange(plan: Any, local_clip: float | None = None) -> Exchange:
    """A codec's exchange (:class:`~jaxpar.parallel.compression.ExchangePlan`), after the optional local clip.

    Args:
      plan: the exchange plan of the codec over the layout's gradients.
      local_clip: clip each replica's gradient to this norm before the codec.

    Returns:
      The :class:`Exchange`; its ``outside`` metrics are ``comm_bytes`` and ``comm_ratio``.
    """
    axis = axis_name(plan.axes)
    per_step = _bytes_per_stage(plan)

    def reduce(leaves, codec_state, step):
        leaves, clip_stats = clip_replica(leaves, local_clip, axis)
        out, codec_state, stats = plan.exchange(leaves, codec_state, step)
        return out, codec_state, {**stats, **clip_stats}

    def outside(grads, codec_state, step):
        clock = codec_state["count"][0] if "count" in codec_state else step   # exchanges before (a start_step)
        sent = per_step(clock)
        return {"comm_bytes": sent, "comm_ratio": sent / plan.uncompressed_bytes()}

    return Exchange(plan.codec.name, reduce, outside, exact=False)


def measured_exchange(inner: Exchange, man: ManualLayout) -> Exchange:
    """``inner`` plus the two squared norms of the gradient noise scale: ``grad_sq_small``, the
    mean over replicas of each one's squared gradient norm, and ``grad_sq_big``, the averaged
    gradient's. After a lossy exchange the averaged gradient's norm is taken from an exact
    all-reduce of the gradients (one more collective, on measuring steps only).

    Args:
      inner: the exchange that produces the step's gradient.
      man: the layout inside the ``shard_map`` (:func:`~jaxpar.step._grads.manual_specs`).

    Returns:
      The :class:`Exchange`.
    """
    axis = axis_name(man.axes)

    def reduce(leaves, codec_state, step):
        sq_small = jax.lax.pmean(sum(jnp.sum(jnp.square(g)) for g in leaves), axis)
        out, codec_state, metrics = inner.reduce(leaves, codec_state, step)
        metrics = {**metrics, "grad_sq_small": sq_small}
        if not inner.exact:
            metrics["grad_sq_big"] = sum(jnp.sum(jnp.square(g)) for g in jax.lax.pmean(leaves, axis))
        return out, codec_state, metrics

    def outside(grads, codec_state, step):
        metrics = inner.outside(grads, codec_state, step) if inner.outside is not None else {}
        if inner.exact:
            metrics["grad_sq_big"] = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        return metrics

    return Exchange(inner.name, reduce, outside, inner.exact)


def run_exchange(exchange: Exchange, layout: StateLayout) -> Callable:
    """``(grads [R, ...], codec_state, step) -> (grads, codec_state, metrics)``: ``exchange`` in a ``shard_map``
    manual over the layout's data axes; the gradients come back in the strategy's layout.

    Args:
      exchange: the :class:`Exchange`.
      layout: the state's layout (``codec``: the codec state's specs, a leading replica axis).

    Returns:
      The function (call it under ``jit``).
    """
    man = manual_specs(layout)
    rep = jax.tree.map(lambda _: man.replica_spec, layout.shapes)
    codec_spec = jax.tree.map(lambda _: man.replica_spec, layout.part("codec").shapes)
    grad_shardings = jax.tree.map(lambda s: NamedSharding(layout.mesh, s), layout.grads)

    def local(grads, codec_state, step):
        leaves = [g[0] for g in man.treedef.flatten_up_to(grads)]
        out, codec_state, metrics = exchange.reduce(leaves, jax.tree.map(lambda a: a[0], codec_state), step)
        return man.treedef.unflatten(out), jax.tree.map(lambda a: a[None], codec_state), metrics

    smap = jax.shard_map(local, mesh=layout.mesh, in_specs=(rep, codec_spec, PartitionSpec()),
                         out_specs=(man.grad_specs, codec_spec, PartitionSpec()), axis_names=set(man.axes),
                         check_vma=False)

    def run(grads, codec_state, step):
        out, new_state, metrics = smap(grads, codec_state, step)
        out = jax.lax.with_sharding_constraint(out, grad_shardings)
        if exchange.outside is not None:
            metrics = {**metrics, **exchange.outside(out, codec_state, step)}
        return out, new_state, metrics

    return run


def _bytes_per_stage(plan: Any) -> Callable:
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
