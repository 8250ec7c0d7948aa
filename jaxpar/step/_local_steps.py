"""The train step of replicas that train on their own between syncs: DiLoCo, local SGD and
EASGD (:mod:`jaxpar.parallel.sync`) on the ``replica`` axis (:mod:`jaxpar.step._replica_mean`).

The *inner* program is the one :func:`~jaxpar.step._update.apply_update` on each replica's own
gradient and optimizer state (no collective over ``replica``; per-replica metrics stay sharded,
reduced by the :class:`~jaxpar.step.TrainStep`'s ``summary``); every ``sync.every`` steps the
*outer* program moves the center from the replicas' mean (DiLoCo's outer optimizer through
``apply_update``, or EASGD's elastic pull). Before ``start_step`` a *warm* program keeps the
replicas synchronous. Every program is :func:`~jaxpar.step._program.jit_program`'s; the outer
step's metrics: docs/training.md."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.batch import batch_sharding, check_batch
from jaxpar.mesh import REPLICA, replicas
from jaxpar.rules import named_shardings
from jaxpar.parallel.sync import DiLoCo
from jaxpar.step._grads import global_grads
from jaxpar.step._program import TrainStep, jit_program
from jaxpar.step._replica_mean import replica_bytes, split_replicas, weighted_sum
from jaxpar.step._state import StateLayout, TrainState
from jaxpar.step._update import Update, apply_update, updates_metrics


def local_train_step(loss_fn: Callable, layout: StateLayout, update: Update, *, donate: bool) -> TrainStep:
    """The step of DiLoCo / local SGD / EASGD (``layout.strategy.sync``) over the ``replica`` axis: the
    inner program (each replica its own optimizer step, no collective over ``replica``) every step, or
    the synchronous ``warm`` one before ``sync.start_step``, then the sync program after every
    ``sync.every``-th step.

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout (from :func:`jaxpar.init_train_state` on a ``replica`` mesh).
      update: the inner update's options.
      donate: donate the input state.

    Returns:
      The :class:`~jaxpar.step.TrainStep`; its programs are ``"step"`` (the inner one),
      ``"outer"`` (the sync, on the state alone) and, with a ``start_step``, ``"warm"``.
    """
    strategy, mesh, sync = layout.strategy, layout.mesh, layout.strategy.sync
    local = _LocalPrograms(loss_fn, layout, sync, update)
    per_replica = NamedSharding(mesh, P(REPLICA))       # per-replica metrics: no gather over ``replica``
    msh = {"replica": per_replica}
    programs = {"step": jit_program(local.inner, layout, batch_sharding(mesh), donate=donate, metrics_sharding=msh),
                "outer": jit_program(local.outer, layout, None, donate=donate,      # the state alone
                                     metrics_sharding={"replica_distance": per_replica})}
    every, start, nbytes = sync.every, getattr(sync, "start_step", 0), replica_bytes(layout)
    if start:
        programs["warm"] = jit_program(local.warm, layout, batch_sharding(mesh), donate=donate, metrics_sharding=msh)

    def run(programs, state: TrainState, batch, count: int):
        warming = count < start
        state, metrics = programs["warm" if warming else "step"](state, batch)
        metrics = {**metrics, "replica_bytes": float(nbytes) if warming else 0.0}   # warm: the gradients' all-reduce
        if not warming and (count + 1 - start) % every == 0:
            state, synced = programs["outer"](state)
            metrics.update(synced, replica_bytes=float(nbytes))
        return state, metrics

    return TrainStep(programs, check_batch=lambda batch: check_batch(batch, mesh, strategy.microbatches), run=run,
                     batch_sharding=batch_sharding(mesh), state_only=("outer",), summary=_replica_summary)


def _any_replica(reps: Any, specs: Any, mesh) -> Any:
    """Replicas known to be identical -> the parameters, with no communication: each device keeps
    its own replica's shard (a ``shard_map`` manual over ``replica`` that declares the result
    replicated over it, which holds because every replica computed the same update)."""
    take = jax.shard_map(lambda r: jax.tree.map(lambda x: x[0], r), mesh=mesh, in_specs=P(REPLICA),
                         out_specs=P(), axis_names={REPLICA}, check_vma=False)    # inner axes stay automatic
    return jax.lax.with_sharding_constraint(take(reps), named_shardings(specs, mesh))


class _LocalPrograms:
    """The programs of :func:`local_train_step` (``inner``, ``warm``, ``outer``) for one layout, sync
    kind and inner update."""

    def __init__(self, loss_fn, layout: StateLayout, sync, update: Update):
        self.layout, self.sync, self.mesh, self.k = layout, sync, layout.mesh, replicas(layout.mesh)
        self.lg = global_grads(loss_fn, layout)
        self.rep_specs = layout.parts["sync"].specs["params"]
        self.update = update

    def _step(self, step, p, o, loss, grads):
        """One replica's inner optimizer step: its new parameters, optimizer state and metrics."""
        new, m = apply_update(self.update, TrainState(step, p, o), loss, grads)
        return new.params, new.opt_state, m

    def one(self, step, p, o, b):
        """One replica's inner optimizer step on its own batch."""
        return self._step(step, p, o, *self.lg(p, b))

    @staticmethod
    def replica_metrics(losses, m) -> dict:
        """Per-replica ``[K]`` metrics, the learning rates among them (no gather over ``replica``)."""
        return {"replica": {"loss": losses, **{k: m[k] for k in ("grad_norm", "skipped", "lr") if k in m}}}

    def inner(self, state: TrainState, batch):
        """Every replica's own optimizer step, no collective over ``replica``."""
        p, o, m = jax.vmap(self.one, in_axes=(None, 0, 0, 0), spmd_axis_name=REPLICA)(
            state.step, state.sync["params"], state.sync["opt"], split_replicas(batch, self.k, self.mesh))
        metrics = self.replica_metrics(m["loss"], m)
        return TrainState(state.step + 1, state.params, state.opt_state, sync={"params": p, "opt": o}), metrics

    def warm(self, state: TrainState, batch):
        """Before ``start_step``: synchronous. The replicas' gradients are averaged (an all-reduce
        over ``replica``) and each replica applies the same update, so they stay identical."""
        layout, mesh, k = self.layout, self.mesh, self.k
        losses, grads = jax.vmap(self.lg, spmd_axis_name=REPLICA)(state.sync["params"], split_replicas(batch, k, mesh))
        mean = weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), grads, layout.grads, mesh)

        p, o, m = jax.vmap(self._step, in_axes=(None, 0, 0, None, None), spmd_axis_name=REPLICA)(
            state.step, state.sync["params"], state.sync["opt"], jnp.mean(losses), mean)
        center = _any_replica(p, layout.params, mesh)
        metrics = self.replica_metrics(losses, m)
        return TrainState(state.step + 1, center, state.opt_state, sync={"params": p, "opt": o}), metrics

    def outer(self, state: TrainState):
        """The sync: the replicas' mean moves the center. DiLoCo: the outer optimizer's step
        (:func:`~jaxpar.step._update.apply_update`, no clip or skip rule) on the pseudo-gradient, and
        every replica restarts from the center. EASGD (Zhang et al. 2015): the center and the replicas
        pulled toward each other."""
        mesh, k = self.mesh, self.k
        mean = weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), state.sync["params"], self.layout.params, mesh)
        if isinstance(self.sync, DiLoCo):
            delta = jax.tree.map(jnp.subtract, state.params, mean)       # the pseudo-gradient
            new, _ = apply_update(Update(self.sync.outer), state, jnp.float32(0), delta)
            center, opt_state = new.params, new.opt_state
            reps = jax.tree.map(lambda c: jnp.broadcast_to(c, (k, *c.shape)), center)
        else:
            alpha, opt_state = self.sync.alpha, state.opt_state
            reps = jax.tree.map(lambda r, c: r - alpha * (r - c), state.sync["params"], state.params)
            center = jax.tree.map(lambda c, r: c + alpha * k * (r - c), state.params, mean)
        reps = jax.lax.with_sharding_constraint(reps, named_shardings(self.rep_specs, mesh))
        dist = jax.vmap(lambda r: optax.tree.norm(jax.tree.map(jnp.subtract, r, mean)), spmd_axis_name=REPLICA)(
            state.sync["params"])
        return (TrainState(state.step, center, opt_state, sync={"params": reps, "opt": state.sync["opt"]}),
                {"replica_distance": dist})


def _replica_summary(metrics: dict) -> dict:
    """The step's metrics from the per-replica ones (:func:`~jaxpar.step._update.updates_metrics`:
    ``grad_norm`` the root mean square of the replicas' update norms, ``skipped`` every replica's
    update skipped, ``lr`` the first replica's), the spread of their losses and their mean distance from the
    center; a program of its own after the step (:class:`~jaxpar.step.TrainStep`'s ``summary``), since the
    inner program must not communicate over ``replica``."""
    rep = metrics["replica"]
    out = {k: v for k, v in metrics.items() if k != "replica"}
    if "replica_distance" in out:
        out["replica_distance"] = jnp.mean(out["replica_distance"])
    k = rep["loss"].shape[0]
    skipped = jnp.sum(rep["skipped"].astype(jnp.int32)) if "skipped" in rep else None
    sq_norms = jnp.sum(jnp.square(rep["grad_norm"])) if "grad_norm" in rep else None
    lr = rep["lr"][0] if "lr" in rep else None
    out.update(updates_metrics(jnp.mean(rep["loss"]), sq_norms, k, skipped, lr=lr))
    return {**out, "loss_spread": jnp.max(rep["loss"]) - jnp.min(rep["loss"])}
