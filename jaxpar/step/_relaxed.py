"""The state of K model replicas on the ``replica`` mesh axis (:mod:`jaxpar.parallel.sync`).

Every replica runs the strategy's own loss-and-grad on its share of the batch: the per-replica
function is ``jax.vmap``-ed with ``spmd_axis_name='replica'``, so each replica is sharded by the
strategy on the inner axes (DP, ZeRO, FSDP, TP) and nothing inside it communicates over
``replica``. What crosses ``replica`` is decided here:

* ``sync`` / ``stale`` / ``backup``: one program per step; the (delayed / masked) mean of the
  replicas' gradients is an all-reduce over ``replica``; one optimizer state;
* ``diloco`` / ``local_sgd`` / ``easgd``: the *inner* program updates each replica on its own (its
  own inner optimizer state, no collective over ``replica``); every ``every`` steps a separate
  *sync* program all-reduces one model's worth of parameters over ``replica``.

State: ``params`` is always the model one evaluates (DiLoCo's outer parameters, EASGD's centre,
the newest parameters otherwise). ``sync`` holds what the kind adds, with a leading axis:
``{"params", "opt"}`` of the replicas (``[K, ...]``, sharded over ``replica``), or the
``history`` of the last ``max_delay`` parameter versions (``[s, ...]``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.mesh import REPLICA, data_axes, replicas
from jaxpar.rules import named_shardings
from jaxpar.strategy import Strategy
from jaxpar.parallel.sync import DiLoCo, EASGD, Stale, synchronous
from jaxpar.step._state import PartLayout, StateLayout, optimizer_specs

_is_spec = lambda x: isinstance(x, P)   # noqa: E731


def _lead(specs: Any, axis: str | None) -> Any:
    return jax.tree.map(lambda s: P(axis, *s), specs, is_leaf=_is_spec)


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


def relaxed_layout(layout: StateLayout, tx: optax.GradientTransformation, strategy: Strategy) -> tuple[StateLayout, Callable]:
    """The layout of a replicated train state.

    Args:
      layout: the layout of one replica's state (:func:`jaxpar.state_layout`).
      tx: the optimizer (each replica's inner one, for the local kinds).
      strategy: the strategy (its ``sync``; None: synchronous).

    Returns:
      ``(layout, make)``: the layout with the sync kind's optimizer state and ``sync`` part, and
      ``make(params) -> (opt_state, sync)`` that builds them from the parameters. ``init_train_state``
      has checked ``strategy`` on the mesh (the compatibility table's refusals of a sync kind).
    """
    mesh, sync = layout.mesh, strategy.sync or synchronous()
    k = replicas(mesh)
    inner_shapes, inner_specs = optimizer_specs(tx, layout.shapes, layout.opt_param_specs)
    if isinstance(sync, DiLoCo):
        opt_shapes, opt_specs = optimizer_specs(sync.outer, layout.shapes, layout.opt_param_specs)
    elif isinstance(sync, EASGD):
        opt_shapes, opt_specs = optimizer_specs(optax.identity(), layout.shapes, layout.opt_param_specs)
    else:
        opt_shapes, opt_specs = inner_shapes, inner_specs
    part, part_shapes = (), ()
    if is_local(sync):
        part = {"params": _lead(layout.params, REPLICA), "opt": _lead(inner_specs, REPLICA)}
        part_shapes = {"params": _stack_shapes(layout.shapes, k), "opt": _stack_shapes(inner_shapes, k)}
    elif isinstance(sync, Stale) and sync.max_delay > 0:
        part = {"history": _lead(layout.params, None)}
        part_shapes = {"history": _stack_shapes(layout.shapes, sync.max_delay)}

    def make(params):
        if isinstance(sync, DiLoCo):
            opt = sync.outer.init(params)
        elif isinstance(sync, EASGD):
            opt = optax.identity().init(params)
        else:
            opt = tx.init(params)
        if is_local(sync):
            reps = jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), params)
            return opt, {"params": reps, "opt": jax.vmap(tx.init)(reps)}
        if part:
            return opt, {"history": jax.tree.map(lambda a: jnp.broadcast_to(a, (sync.max_delay, *a.shape)), params)}
        return opt, ()

    parts = dict(layout.parts)
    if part:
        sync_init = jax.jit(lambda params: make(params)[1], out_shardings=named_shardings(part, mesh))
        parts["sync"] = PartLayout(part, part_shapes, sync_init)
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
    sharding = NamedSharding(mesh, P(REPLICA, data_axes(mesh) or None))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x.reshape(k, x.shape[0] // k, *x.shape[1:]),
                                                                   sharding), batch)
