"""Relaxed synchronisation (:mod:`jaxpar.parallel.sync`): the state of K model replicas on the
``replica`` mesh axis, and the parts of a step whose replicas average their gradients.

Every replica runs the strategy's own loss-and-grad on its share of the batch, ``jax.vmap``-ed with
``spmd_axis_name='replica'``: it is sharded by the strategy on the inner axes and nothing inside it
communicates over ``replica``. The state (:func:`relaxed_layout`): ``params`` is always the model one
evaluates (DiLoCo's outer parameters, EASGD's centre, the newest parameters otherwise); ``sync`` holds
what the kind adds, with a leading axis: ``{"params", "opt"}`` of the replicas (``[K, ...]``, sharded
over ``replica``: the local kinds, :mod:`jaxpar.step._local_steps`), or the ``history`` of the last
``max_delay`` parameter versions (``[s, ...]``).

Synchronous, ``stale`` and ``backup`` relaxed synchronisation are composed by
:func:`jaxpar.make_train_step` like any other gradient, exchange and update:

* the **gradient** (:func:`replica_gradient`): each replica's own loss and gradient on its share
  of the batch, at the parameters of ``d`` steps ago for ``stale`` (``d`` drawn per replica and step);
* the **exchange** (:func:`replica_exchange`): the weighted sum of the replicas' gradients, an
  all-reduce over ``replica``; ``backup`` gives the slowest replicas weight 0; the
  asynchronous parameter server keeps the gradients apart;
* the **update** (:func:`replica_rule`): the one :func:`~jaxpar.step._update.apply_update`, or,
  asynchronously, one per replica in turn on the newest parameters; ``stale`` then pushes the
  parameters the step started from onto its history.

Example:
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> from jaxpar.parallel.sync import backup
    >>> mesh = jaxpar.make_mesh({"replica": 4}, devices=jax.devices()[:4])
    >>> s = jaxpar.Strategy(sync=backup(backups=1))
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, s)
    >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout)
    >>> state, m = step(state, {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)})
    >>> int(m["replica_used"].sum())           # the three fastest replicas' gradients, averaged
    3
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.mesh import REPLICA, data_axes, replicas
from jaxpar.optimizers import learning_rate
from jaxpar.parallel.sync import Backup, DiLoCo, EASGD, Stale, synchronous
from jaxpar.parallel._zero import spec_shards
from jaxpar.rules import named_shardings
from jaxpar.strategy import Strategy
from jaxpar.step._grads import global_grads
from jaxpar.step._state import PartLayout, StateLayout, TrainState, optimizer_specs
from jaxpar.step._update import Update, apply_update, updates_metrics

_is_spec = lambda x: isinstance(x, PartitionSpec)   # noqa: E731


def _lead(specs: Any, axis: str | None) -> Any:
    return jax.tree.map(lambda s: PartitionSpec(axis, *s), specs, is_leaf=_is_spec)


def _stack_shapes(shapes: Any, n: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), shapes)


def is_local(sync) -> bool:
    """Whether the replicas of a sync kind train on their own between syncs.

    Args:
      sync: the strategy's sync kind (:mod:`jaxpar.parallel.sync`).

    Returns:
      True for DiLoCo (local SGD too) and EASGD.
    """
    return isinstance(sync, (DiLoCo, EASGD))


def relaxed_layout(layout: StateLayout, tx: optax.GradientTransformation,
                   strategy: Strategy) -> tuple[StateLayout, Callable]:
    """The layout of a replicated train state.

    Args:
      layout: the layout of one replica's state (:func:`jaxpar.state_layout`).
      tx: the optimizer (each replica's inner one, for the local kinds).
      strategy: the strategy (its ``sync``; None: synchronous).

    Returns:
      ``(layout, make)``: the layout with the sync kind's optimizer state and ``sync`` part, and
      ``make(params) -> (opt_state, parts)`` that builds them from the parameters (``parts``: the
      ``TrainState`` fields, ``{"sync": ...}`` or none). ``init_train_state`` has checked ``strategy``
      on the mesh (the compatibility table's refusals of a sync kind).
    """
    mesh, sync = layout.mesh, strategy.sync or synchronous()
    k = replicas(mesh)
    # the optimizer of ``params``: DiLoCo's outer one, none for EASGD's centre, else ``tx``
    own_tx = sync.outer if isinstance(sync, DiLoCo) else optax.identity() if isinstance(sync, EASGD) else tx
    opt_shapes, opt_specs = optimizer_specs(own_tx, layout.shapes, layout.opt_param_specs)
    part, part_shapes = {}, {}
    if is_local(sync):
        inner_shapes, inner_specs = optimizer_specs(tx, layout.shapes, layout.opt_param_specs)
        part = {"params": _lead(layout.params, REPLICA), "opt": _lead(inner_specs, REPLICA)}
        part_shapes = {"params": _stack_shapes(layout.shapes, k), "opt": _stack_shapes(inner_shapes, k)}
    elif _delayed(sync):
        part = {"history": _lead(layout.params, None)}
        part_shapes = {"history": _stack_shapes(layout.shapes, sync.max_delay)}

    def make_sync(params):
        if is_local(sync):
            reps = jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), params)
            return {"params": reps, "opt": jax.vmap(tx.init)(reps)}
        return {"history": jax.tree.map(lambda a: jnp.broadcast_to(a, (sync.max_delay, *a.shape)), params)}

    def make(params):
        return own_tx.init(params), ({"sync": make_sync(params)} if part else {})

    parts = dict(layout.parts)
    if part:
        parts["sync"] = PartLayout(part, part_shapes, jax.jit(make_sync, out_shardings=named_shardings(part, mesh)))
    return replace(layout, opt_state=opt_specs, opt_shapes=opt_shapes, parts=parts), make


def split_replicas(batch: Any, k: int, mesh) -> Any:
    """``[B, ...] -> [K, B/K, ...]``: replica ``r`` takes its own rows (no resharding).

    Args:
      batch: the global batch (leading dimension split over ``replica`` and the data axes).
      k: the number of replicas.
      mesh: the mesh.

    Returns:
      The batch with a leading replica axis, sharded over ``replica``.
    """
    sharding = NamedSharding(mesh, PartitionSpec(REPLICA, data_axes(mesh) or None))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x.reshape(k, x.shape[0] // k, *x.shape[1:]),
                                                                   sharding), batch)


def replica_parts(loss_fn: Callable, layout: StateLayout, update: Update) -> tuple[Callable, Callable, Callable]:
    """The gradient, exchange and update of ``layout.strategy.sync`` (synchronous without one).

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout.
      update: the update's options.

    Returns:
      ``(gradient, exchange, rule)``: :func:`replica_gradient`, :func:`replica_exchange` and
      :func:`replica_rule` of the sync kind.
    """
    sync = layout.strategy.sync or synchronous()
    return replica_gradient(loss_fn, layout, sync), replica_exchange(sync, layout), replica_rule(sync, update, layout)


def weighted_sum(w: jax.Array, tree: Any, specs: Any, mesh) -> Any:
    """``sum_r w[r] * tree[r]``: an all-reduce over ``replica``, constrained to ``specs``.

    Args:
      w: ``[K]`` weights.
      tree: a tree of ``[K, ...]`` arrays sharded over ``replica``.
      specs: the result's partition specs (the tree's without its leading axis).
      mesh: the mesh.

    Returns:
      The weighted sum, in ``specs``.
    """
    out = jax.tree.map(lambda x: jnp.tensordot(w, x, axes=(0, 0)), tree)
    return jax.lax.with_sharding_constraint(out, named_shardings(specs, mesh))


def replica_bytes(layout: StateLayout) -> int:
    """Bytes per device of one model's worth of fp32 values in the parameters' layout: the
    buffer of each all-reduce over ``replica`` (gradients every step, or parameters at a sync).

    Args:
      layout: the train state's layout (its shapes, parameter specs and mesh).

    Returns:
      The bytes on one device.
    """
    sizes = dict(layout.mesh.shape)
    return sum(4 * a.size // spec_shards(spec, sizes)
               for a, spec in zip(jax.tree.leaves(layout.shapes), jax.tree.leaves(layout.params, is_leaf=_is_spec)))


def _delayed(sync) -> bool:
    return isinstance(sync, Stale) and sync.max_delay > 0


def replica_gradient(loss_fn: Callable, layout: StateLayout, sync) -> Callable:
    """Every replica's loss and gradient on its own rows of the batch.

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout (:func:`relaxed_layout`).
      sync: the sync kind (synchronous, ``stale`` or ``backup``).

    Returns:
      ``grad(state, batch) -> (losses [K], grads [K, ...], metrics)``; ``stale`` with a delay
      reads the parameters of ``d`` steps ago (``state.sync["history"]``) and reports ``delay_mean``.
    """
    mesh, k = layout.mesh, replicas(layout.mesh)
    lg = global_grads(loss_fn, layout)

    def grad(state: TrainState, batch):
        b = split_replicas(batch, k, mesh)
        if not _delayed(sync):
            losses, grads = jax.vmap(lg, in_axes=(None, 0), spmd_axis_name=REPLICA)(state.params, b)
            return losses, grads, {}
        delays, hist = sync.delays(state.step, k), state.sync["history"]
        # the parameters of ``d`` steps ago: the newest for d = 0, else history[d - 1] (no copy of all)
        older = lambda d: jax.tree.map(lambda p, h: jnp.where(d == 0, p, h[jnp.maximum(d, 1) - 1]),  # noqa: E731
                                       state.params, hist)
        losses, grads = jax.vmap(lambda d, bb: lg(older(d), bb), spmd_axis_name=REPLICA)(delays, b)
        return losses, grads, {"delay_mean": jnp.mean(delays.astype(jnp.float32))}

    return grad


def _replica_weights(sync, step, k: int) -> tuple[jax.Array, dict]:
    """The weight of each replica's gradient in the mean, and the kind's metrics."""
    if not isinstance(sync, Backup):
        return jnp.full((k,), 1.0 / k, jnp.float32), {}
    times = sync.times(step, k)
    n = k - sync.backups
    rank = jnp.argsort(jnp.argsort(times, stable=True), stable=True)   # 0 = fastest; ties by index
    used = rank < n
    ordered = jnp.sort(times)
    return jnp.where(used, 1.0 / n, 0.0).astype(jnp.float32), {
        "modelled_time": ordered[n - 1], "modelled_time_sync": ordered[-1], "replica_times": times,
        "replica_used": used}


def replica_exchange(sync, layout: StateLayout) -> Callable:
    """The exchange of the replicas' gradients over ``replica``.

    Args:
      sync: the sync kind.
      layout: the relaxed layout.

    Returns:
      ``exchange(state, losses, grads) -> (loss, grads, parts, metrics)``: the (masked) mean for the
      synchronous kinds; the per-replica values, untouched, for ``stale`` with ``mode='async'``
      (each is its own update); ``parts`` is empty (the exchange keeps no state). The metrics: ``loss_spread``, ``replica_bytes`` (the bytes of the
      all-reduce per device), and ``backup``'s modelled times and ``replica_used``.
    """
    mesh, k, nbytes = layout.mesh, replicas(layout.mesh), replica_bytes(layout)
    asynchronous = isinstance(sync, Stale) and sync.mode == "async"

    def exchange(state: TrainState, losses, grads):
        metrics = {"loss_spread": jnp.max(losses) - jnp.min(losses), "replica_bytes": jnp.float32(nbytes * (k > 1))}
        if asynchronous:
            return losses, grads, {}, metrics
        w, extra = _replica_weights(sync, state.step, k)
        return jnp.dot(w, losses), weighted_sum(w, grads, layout.grads, mesh), {}, {**extra, **metrics}

    return exchange


def replica_rule(sync, update: Update, layout: StateLayout) -> Callable:
    """The update of a step over replicas.

    Args:
      sync: the sync kind.
      update: the update's options.
      layout: the relaxed layout.

    Returns:
      ``rule(state, loss, grads, *, parts=None, metrics=None) -> (state, metrics)``: one
      :func:`~jaxpar.step._update.apply_update`, or, for ``mode='async'``, one per replica (see
      :func:`_one_by_one`); ``stale`` with a delay then pushes the step's starting parameters
      onto ``state.sync["history"]``.
    """
    asynchronous = isinstance(sync, Stale) and sync.mode == "async"

    def rule(state: TrainState, loss, grads, *, parts=None, metrics=None):
        if asynchronous:
            new, out = _one_by_one(update, state, loss, grads, layout, metrics or {})
        else:
            new, out = apply_update(update, state, loss, grads, parts=parts, metrics=metrics)
        if _delayed(sync):
            hist = jax.tree.map(lambda p, h: jnp.concatenate([p[None], h[:-1]]), state.params, state.sync["history"])
            new = new._replace(sync={"history": hist})
        return new, out

    return rule


def _one_by_one(update: Update, state, losses, grads, layout, metrics: dict):
    """Asynchronous parameter server: each replica's gradient is applied on its own, in replica
    order, on the newest parameters (K optimizer updates per step; ``step`` advances by one).
    ``grad_norm``: the root mean square of the K updates' gradient norms (:mod:`jaxpar.step._update`)."""
    k = losses.shape[0]
    new, skipped, sq = state, [], []
    for r in range(k):
        g = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x[r], grads),
                                             named_shardings(layout.grads, layout.mesh))
        new, out = apply_update(update, new._replace(step=state.step), losses[r], g)
        skipped.append(out.get("skipped", jnp.bool_(False)))
        if "grad_norm" in out:
            sq.append(jnp.square(out["grad_norm"]))
    count = jnp.sum(jnp.stack(skipped).astype(jnp.int32)) if update.skip_nonfinite else None
    lr = learning_rate(new.opt_state)
    sq_norms = jnp.sum(jnp.stack(sq)) if sq else None
    out = {**metrics, **updates_metrics(jnp.mean(losses), sq_norms, k, count, lr=lr)}
    return new._replace(step=state.step + 1), out
