"""The train step of K replicas on the ``replica`` axis (:mod:`jaxpar.step.relaxed`): one program
per step for the kinds that average gradients (``sync``, ``stale``, ``backup``), and an inner + a
sync program for the kinds whose replicas train on their own (``diloco``, ``local_sgd``, ``easgd``).

Every program is :func:`~jaxpar.step.program.jit_program`'s (the layout's shardings, rules and
checks); the inner programs keep their per-replica metrics sharded over ``replica`` (no gather),
and the sync program takes the state alone. ``grad_norm`` is :mod:`jaxpar.step.update`'s: the
norm of the averaged gradient, or the root mean square of the replicas' norms where each replica
updates on its own gradient."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.batch import batch_sharding, check_batch
from jaxpar.mesh import REPLICA, replicas
from jaxpar.rules import named_shardings
from jaxpar.parallel.sync import Backup, DiLoCo, Stale, check_sync, synchronous
from jaxpar.step.grads import global_grads
from jaxpar.step.program import TrainStep, jit_program
from jaxpar.step.relaxed import is_local, replica_bytes, split_replicas
from jaxpar.step.state import StateLayout, TrainState
from jaxpar.step.update import Update, apply_update

__all__ = ["relaxed_train_step", "global_step", "local_steps", "run_local_steps"]


def relaxed_train_step(loss_fn: Callable, layout: StateLayout, update: Update, *, explicit_dp, donate: bool,
                       ) -> TrainStep:
    """The step of ``layout.strategy.sync`` over the ``replica`` axis.

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout (from :func:`jaxpar.init_train_state` on a ``replica`` mesh).
      update: the update's options (the inner update for DiLoCo / EASGD).
      explicit_dp: ``True`` is refused (inside replicas XLA places the data-axis collectives).
      donate: donate the input state.

    Returns:
      The :class:`~jaxpar.step.program.TrainStep`; its programs are ``"step"`` (and ``"outer"``,
      ``"warm"`` for the kinds whose replicas train on their own).
    """
    from jaxpar.step.grads import ExplicitDPError

    strategy, mesh = layout.strategy, layout.mesh
    sync = strategy.sync or synchronous()
    check_sync(sync, replicas(mesh))
    if explicit_dp:
        raise ExplicitDPError(f"explicit_dp=True with sync {sync.name!r}: inside replicas the data-axis collectives "
                              "are left to XLA (jaxpar's per-layer shard_map does not lower under the replicas' "
                              "vmap for every ZeRO layout). Use explicit_dp=None or False.")
    check = lambda batch: check_batch(batch, mesh, strategy.microbatches)   # noqa: E731
    if is_local(sync):
        return TrainStep(local_steps(loss_fn, layout, sync, update, donate=donate), check_batch=check,
                         run=run_local_steps(sync, layout), batch_sharding=batch_sharding(mesh), state_only=("outer",))
    return TrainStep(global_step(loss_fn, layout, sync, update, donate=donate), check_batch=check,
                     batch_sharding=batch_sharding(mesh))


def _weighted_sum(w: jax.Array, tree: Any, specs: Any, mesh) -> Any:
    """``sum_r w[r] * tree[r]`` (an all-reduce over ``replica``), constrained to ``specs``."""
    out = jax.tree.map(lambda x: jnp.tensordot(w, x, axes=(0, 0)), tree)
    return jax.lax.with_sharding_constraint(out, named_shardings(specs, mesh))


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


def global_step(loss_fn, layout: StateLayout, sync, update: Update, *, donate: bool) -> dict:
    """One program per step: per-replica gradients (on delayed parameters for ``stale``), their
    (masked) mean over ``replica``, one optimizer update (``mode='async'``: one per replica, in turn).

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout (:func:`jaxpar.step.relaxed.relaxed_layout`).
      sync: the sync kind (synchronous, ``stale`` or ``backup``).
      update: the update's options.
      donate: donate the input state.

    Returns:
      ``{"step": the jitted program}``.
    """
    mesh, k = layout.mesh, replicas(layout.mesh)
    lg = global_grads(loss_fn, layout)
    delayed = isinstance(sync, Stale) and sync.max_delay > 0
    asynchronous = isinstance(sync, Stale) and sync.mode == "async"
    nbytes = replica_bytes(layout)

    def step(state: TrainState, batch):
        b = split_replicas(batch, k, mesh)
        if delayed:
            delays = sync.delays(state.step, k)
            hist = state.sync["history"]
            # the parameters of ``d`` steps ago: the newest for d = 0, else history[d - 1] (no copy of all)
            older = lambda d: jax.tree.map(lambda p, h: jnp.where(d == 0, p, h[jnp.maximum(d, 1) - 1]),  # noqa: E731
                                           state.params, hist)
            losses, grads = jax.vmap(lambda d, bb: lg(older(d), bb), spmd_axis_name=REPLICA)(delays, b)
        else:
            losses, grads = jax.vmap(lg, in_axes=(None, 0), spmd_axis_name=REPLICA)(state.params, b)
        w, extra = _replica_weights(sync, state.step, k)
        if asynchronous:
            new, metrics = _one_by_one(update, state, losses, grads, layout)
        else:
            loss = jnp.dot(w, losses)
            new, metrics = apply_update(update, state, loss, _weighted_sum(w, grads, layout.grads, mesh))
        if delayed:
            metrics["delay_mean"] = jnp.mean(delays.astype(jnp.float32))
            hist = jax.tree.map(lambda p, h: jnp.concatenate([p[None], h[:-1]]), state.params, state.sync["history"])
            new = new._replace(sync={"history": hist})
        metrics.update(extra, loss_spread=jnp.max(losses) - jnp.min(losses),
                       replica_bytes=jnp.float32(nbytes * (k > 1)))
        return new, metrics

    return {"step": jit_program(step, layout, batch_sharding(mesh), donate=donate)}


def _one_by_one(update: Update, state, losses, grads, layout):
    """Asynchronous parameter server: each replica's gradient is applied on its own, in replica
    order, on the newest parameters (K optimizer updates per step; ``step`` advances by one).
    ``grad_norm``: the root mean square of the K updates' gradient norms (:mod:`jaxpar.step.update`)."""
    k = losses.shape[0]
    new, metrics, skipped, sq = state, {}, [], []
    for r in range(k):
        g = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x[r], grads),
                                             named_shardings(layout.grads, layout.mesh))
        new, metrics = apply_update(update, new._replace(step=state.step), losses[r], g)
        skipped.append(metrics.pop("skipped", jnp.bool_(False)))
        sq.append(jnp.square(metrics["grad_norm"]))
    metrics.update(loss=jnp.mean(losses), grad_norm=jnp.sqrt(jnp.mean(jnp.stack(sq))))
    if update.skip_nonfinite:    # skipped: no update applied; skipped_updates: the replicas' updates left out
        metrics["skipped"] = jnp.all(jnp.stack(skipped))
        metrics["skipped_updates"] = jnp.sum(jnp.stack(skipped).astype(jnp.int32))
    return new._replace(step=state.step + 1), metrics


def _any_replica(reps: Any, rep_specs: Any, specs: Any, mesh) -> Any:
    """Replicas known to be identical -> the parameters, with no communication: each device keeps
    its own replica's shard (a ``shard_map`` manual over ``replica`` that declares the result
    replicated over it, which holds because every replica computed the same update)."""
    take = jax.shard_map(lambda r: jax.tree.map(lambda x: x[0], r), mesh=mesh, in_specs=P(REPLICA),
                         out_specs=P(), axis_names={REPLICA}, check_vma=False)    # inner axes stay automatic
    return jax.lax.with_sharding_constraint(take(reps), named_shardings(specs, mesh))


class _LocalPrograms:
    """The programs of :func:`local_steps` (``inner``, ``warm``, ``outer``) for one layout, sync
    kind and inner update."""

    def __init__(self, loss_fn, layout: StateLayout, sync, update: Update):
        self.layout, self.sync, self.mesh, self.k = layout, sync, layout.mesh, replicas(layout.mesh)
        self.lg = global_grads(loss_fn, layout)
        self.rep_specs = layout.sync["params"]
        self.log_lr, self.inner_update = update.log_lr, update._replace(log_lr=None)

    def one(self, step, p, o, b):
        """One replica's inner optimizer step on its own batch."""
        loss, grads = self.lg(p, b)
        new, m = apply_update(self.inner_update, TrainState(step, p, o), loss, grads)
        return new.params, new.opt_state, m

    def replica_metrics(self, step, losses, m) -> dict:
        """Per-replica ``[K]`` metrics (no gather over ``replica``) and the step's learning rate."""
        rep = {"loss": losses, "grad_norm": m["grad_norm"], **({"skipped": m["skipped"]} if "skipped" in m else {})}
        lr = {"lr": jnp.asarray(self.log_lr(step), jnp.float32)} if self.log_lr is not None else {}
        return {"replica": rep, **lr}

    def inner(self, state: TrainState, batch):
        """Every replica's own optimizer step, no collective over ``replica``."""
        p, o, m = jax.vmap(self.one, in_axes=(None, 0, 0, 0), spmd_axis_name=REPLICA)(
            state.step, state.sync["params"], state.sync["opt"], split_replicas(batch, self.k, self.mesh))
        metrics = self.replica_metrics(state.step, m["loss"], m)
        return TrainState(state.step + 1, state.params, state.opt_state, sync={"params": p, "opt": o}), metrics

    def warm(self, state: TrainState, batch):
        """Before ``start_step``: synchronous. The replicas' gradients are averaged (an all-reduce
        over ``replica``) and each replica applies the same update, so they stay identical."""
        layout, mesh, k = self.layout, self.mesh, self.k
        losses, grads = jax.vmap(self.lg, spmd_axis_name=REPLICA)(state.sync["params"], split_replicas(batch, k, mesh))
        mean = _weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), grads, layout.grads, mesh)

        def apply(p, o):
            new, m = apply_update(self.inner_update, TrainState(state.step, p, o), jnp.mean(losses), mean)
            return new.params, new.opt_state, m

        p, o, m = jax.vmap(apply, spmd_axis_name=REPLICA)(state.sync["params"], state.sync["opt"])
        center = _any_replica(p, self.rep_specs, layout.params, mesh)
        metrics = self.replica_metrics(state.step, losses, m)
        return TrainState(state.step + 1, center, state.opt_state, sync={"params": p, "opt": o}), metrics

    def outer(self, state: TrainState):
        """The sync: the replicas' mean moves the center (DiLoCo's outer step, or EASGD's elastic pull)."""
        mesh, k = self.mesh, self.k
        mean = _weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), state.sync["params"], self.layout.params, mesh)
        if isinstance(self.sync, DiLoCo):
            center, opt_state, reps = self._diloco_outer(state, mean)
        else:
            center, opt_state, reps = self._easgd_outer(state, mean)
        reps = jax.lax.with_sharding_constraint(reps, named_shardings(self.rep_specs, mesh))
        dist = jax.vmap(lambda r: optax.tree.norm(jax.tree.map(jnp.subtract, r, mean)), spmd_axis_name=REPLICA)(
            state.sync["params"])
        return (TrainState(state.step, center, opt_state, sync={"params": reps, "opt": state.sync["opt"]}),
                {"replica_distance": dist})

    def _diloco_outer(self, state: TrainState, mean):
        """DiLoCo: the outer optimizer's step on the pseudo-gradient; every replica restarts from the center."""
        delta = jax.tree.map(jnp.subtract, state.params, mean)       # the pseudo-gradient
        updates, opt = self.sync.outer.update(delta, state.opt_state, state.params)
        center = optax.apply_updates(state.params, updates)
        reps = jax.tree.map(lambda c: jnp.broadcast_to(c, (self.k, *c.shape)), center)
        return center, opt, reps

    def _easgd_outer(self, state: TrainState, mean):
        """EASGD (Zhang et al. 2015): the center and the replicas pulled toward each other."""
        reps, alpha, k = state.sync["params"], self.sync.alpha, self.k
        diff = jax.tree.map(lambda r, c: r - c, reps, state.params)
        center = jax.tree.map(lambda c, r, c0: c + alpha * k * (r - c0), state.params, mean, state.params)
        reps = jax.tree.map(lambda r, d: r - alpha * d, reps, diff)
        return center, state.opt_state, reps


def local_steps(loss_fn, layout: StateLayout, sync, update: Update, *, donate: bool) -> dict:
    """DiLoCo / local SGD / EASGD: the inner program (each replica its own optimizer step, no
    collective over ``replica``) every step, and the sync program every ``sync.every`` steps.

    Args:
      loss_fn: the user's loss.
      layout: the relaxed layout.
      sync: the sync kind (``diloco``, ``local_sgd`` or ``easgd``).
      update: the inner update's options.
      donate: donate the input state.

    Returns:
      ``{"step": inner, "outer": sync program, "warm": synchronous program before
      ``start_step`` (only with one)}``, run by :func:`run_local_steps`.
    """
    mesh = layout.mesh
    local = _LocalPrograms(loss_fn, layout, sync, update)
    per_replica = NamedSharding(mesh, P(REPLICA))       # per-replica metrics: no gather over ``replica``
    msh = {"replica": per_replica, **({"lr": NamedSharding(mesh, P())} if update.log_lr is not None else {})}
    programs = {"step": jit_program(local.inner, layout, batch_sharding(mesh), donate=donate, metrics_sharding=msh),
                "outer": jit_program(local.outer, layout, None, donate=donate,      # the state alone
                                     metrics_sharding={"replica_distance": per_replica})}
    if getattr(sync, "start_step", 0):
        programs["warm"] = jit_program(local.warm, layout, batch_sharding(mesh), donate=donate, metrics_sharding=msh)
    return programs


def run_local_steps(sync, layout: StateLayout) -> Callable:
    """``run(programs, state, batch, step) -> (state, metrics)`` for :func:`local_steps`' programs:
    the inner program (or the synchronous ``warm`` one before ``sync.start_step``), then the sync
    program after every ``sync.every``-th step.

    Args:
      sync: the sync kind.
      layout: the relaxed layout.

    Returns:
      The runner, for :class:`~jaxpar.step.program.TrainStep` (``run=``).
    """
    every, start, nbytes = sync.every, getattr(sync, "start_step", 0), replica_bytes(layout)

    def run(programs, state: TrainState, batch, count: int):
        warming = count < start
        state, m = programs["warm" if warming else "step"](state, batch)
        count += 1
        metrics = {k: v for k, v in m.items() if k != "replica"}
        metrics.update(_replica_summary(m["replica"]), replica_bytes=0.0)
        if warming:   # the gradients' all-reduce over ``replica``, as in synchronous data parallelism
            metrics["replica_bytes"] = float(nbytes)
        elif (count - start) % every == 0:
            state, synced = programs["outer"](state)
            metrics.update(replica_distance=jnp.mean(synced["replica_distance"]), replica_bytes=float(nbytes))
        return state, metrics

    return run


@jax.jit
def _replica_summary(rep: dict) -> dict:
    """The step's metrics from the per-replica ones (``grad_norm``: the root mean square of the
    replicas' update norms, as :mod:`jaxpar.step.update` defines it), in one program: each program with a
    collective that is dispatched while the step may still run adds to the XLA:CPU rendezvous
    that, with 8 simulated devices on 2 cores, was seen to time out (one program, not five)."""
    out = {"loss": jnp.mean(rep["loss"]), "grad_norm": jnp.sqrt(jnp.mean(jnp.square(rep["grad_norm"]))),
           "loss_spread": jnp.max(rep["loss"]) - jnp.min(rep["loss"])}
    if "skipped" in rep:
        out["skipped"] = jnp.any(rep["skipped"])
    return out
