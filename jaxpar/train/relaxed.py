"""Train steps for K model replicas on the ``replica`` mesh axis (:mod:`jaxpar.sync`).

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
the newest parameters otherwise). ``comm`` holds what the kind adds, with a leading axis:
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

from ..batch import batch_sharding, check_batch
from ..mesh import REPLICA, data_axes, replicas
from ..rules import named_shardings, use_rules
from ..strategy import Strategy
from ..zero import spec_shards
from ..sync import DiLoCo, EASGD, Stale, SyncError, check_sync, synchronous
from .state import StateLayout, TrainState, _opt_specs

__all__ = ["relaxed_layout", "make_relaxed_train_step", "replica_bytes"]

_is_spec = lambda x: isinstance(x, P)   # noqa: E731


def _lead(specs: Any, axis: str | None) -> Any:
    return jax.tree.map(lambda s: P(axis, *s), specs, is_leaf=_is_spec)


def _stack_shapes(shapes: Any, n: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), shapes)


def _is_local(sync) -> bool:
    return isinstance(sync, (DiLoCo, EASGD))


def relaxed_layout(layout: StateLayout, tx: optax.GradientTransformation, strategy: Strategy) -> tuple[StateLayout, Callable]:
    """The layout of a replicated train state and ``make(params) -> (opt_state, comm)``."""
    mesh, sync = layout.mesh, strategy.sync or synchronous()
    k = replicas(mesh)
    check_sync(sync, k)
    if dict(mesh.shape).get("pipe", 1) > 1:
        raise SyncError(f"sync {sync.name!r} with pipe={mesh.shape['pipe']} on replica={k}: pipelined replicas are "
                        "not supported yet; use data / fsdp / tensor inside each replica (mesh pipe=1).")
    inner_shapes, inner_specs = _opt_specs(tx, layout.shapes, layout.opt_param_specs)
    if isinstance(sync, DiLoCo):
        opt_shapes, opt_specs = _opt_specs(sync.outer, layout.shapes, layout.opt_param_specs)
    elif isinstance(sync, EASGD):
        opt_shapes, opt_specs = _opt_specs(optax.identity(), layout.shapes, layout.opt_param_specs)
    else:
        opt_shapes, opt_specs = inner_shapes, inner_specs
    comm, comm_shapes = (), ()
    if _is_local(sync):
        comm = {"params": _lead(layout.params, REPLICA), "opt": _lead(inner_specs, REPLICA)}
        comm_shapes = {"params": _stack_shapes(layout.shapes, k), "opt": _stack_shapes(inner_shapes, k)}
    elif isinstance(sync, Stale) and sync.max_delay > 0:
        comm = {"history": _lead(layout.params, None)}
        comm_shapes = {"history": _stack_shapes(layout.shapes, sync.max_delay)}

    def make(params):
        if isinstance(sync, DiLoCo):
            opt = sync.outer.init(params)
        elif isinstance(sync, EASGD):
            opt = optax.identity().init(params)
        else:
            opt = tx.init(params)
        if _is_local(sync):
            reps = jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), params)
            return opt, {"params": reps, "opt": jax.vmap(tx.init)(reps)}
        if comm:
            return opt, {"history": jax.tree.map(lambda a: jnp.broadcast_to(a, (sync.max_delay, *a.shape)), params)}
        return opt, ()

    comm_init = jax.jit(lambda params: make(params)[1], out_shardings=named_shardings(comm, mesh))
    new = replace(layout, opt_state=opt_specs, opt_shapes=opt_shapes, comm=comm, comm_shapes=comm_shapes,
                  comm_init=comm_init, comm_from_params=True)
    return new, make


def replica_bytes(layout: StateLayout) -> int:
    """Bytes per device of one model's worth of fp32 values in the parameters' layout: the
    buffer of each all-reduce over ``replica`` (gradients every step, or parameters at a sync)."""
    sizes = dict(layout.mesh.shape)
    return sum(4 * a.size // spec_shards(spec, sizes)
               for a, spec in zip(jax.tree.leaves(layout.shapes), jax.tree.leaves(layout.params, is_leaf=_is_spec)))


def _split(batch: Any, k: int, mesh) -> Any:
    """``[B, ...] -> [K, B/K, ...]``: replica ``r`` takes its own rows (no resharding)."""
    sharding = NamedSharding(mesh, P(REPLICA, data_axes(mesh) or None))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x.reshape(k, x.shape[0] // k, *x.shape[1:]),
                                                                   sharding), batch)


def make_relaxed_train_step(loss_fn: Callable, tx: optax.GradientTransformation, layout: StateLayout,
                            strategy: Strategy, *, clip_norm, lr_schedule, donate: bool, explicit_dp,
                            skip_nonfinite: bool) -> Callable:
    """``step(state, batch) -> (state, metrics)`` for ``strategy.sync`` on the ``replica`` axis."""
    from . import relaxed_steps

    sync = strategy.sync or synchronous()
    check_sync(sync, replicas(layout.mesh))
    if layout.comm_init is tuple or not getattr(layout, "comm_from_params", False):
        raise SyncError(f"make_train_step with sync {sync.name!r} on replica={replicas(layout.mesh)}, but the layout "
                        "was made without it. Create the state with init_train_state(..., strategy) using this "
                        "same strategy and mesh.")
    if explicit_dp:
        from .step import ExplicitDPError

        raise ExplicitDPError(f"explicit_dp=True with sync {sync.name!r}: inside replicas the data-axis collectives "
                              "are left to XLA (jaxpar's per-layer shard_map does not lower under the replicas' "
                              "vmap for every ZeRO layout). Use explicit_dp=None or False.")
    kw = dict(clip_norm=clip_norm, lr_schedule=lr_schedule, skip_nonfinite=skip_nonfinite, explicit_dp=False)
    build = relaxed_steps.local_steps if _is_local(sync) else relaxed_steps.global_step
    step = build(loss_fn, tx, layout, strategy, sync, donate=donate, **kw)

    def checked(state, batch):
        check_batch(batch, layout.mesh, strategy.microbatches)
        return step(state, batch)

    for name in ("inner", "outer", "warm", "jitted", "lower"):
        if hasattr(step, name):
            setattr(checked, name, getattr(step, name))
    checked.batch_sharding = batch_sharding(layout.mesh)
    return checked

