"""The jitted programs of :mod:`jaxpar.train.relaxed`: one per step for the kinds that average
gradients (``sync``, ``stale``, ``backup``), and an inner + a sync program for the kinds whose
replicas train on their own (``diloco``, ``local_sgd``, ``easgd``)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..batch import batch_sharding
from ..mesh import REPLICA, replicas
from ..rules import named_shardings, use_rules
from ..sync import Backup, DiLoCo, Stale
from .relaxed import _split, replica_bytes
from .state import StateLayout, TrainState
from .step import HostStep, _apply_update, make_loss_and_grad

_is_spec = lambda x: isinstance(x, P)   # noqa: E731


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


def global_step(loss_fn, tx, layout: StateLayout, strategy, sync, *, donate, clip_norm, lr_schedule,
                skip_nonfinite, explicit_dp) -> Callable:
    """One program per step: per-replica gradients (on delayed parameters for ``stale``), their
    (masked) mean over ``replica``, one optimizer update (``mode='async'``: one per replica, in turn)."""
    mesh, k = layout.mesh, replicas(layout.mesh)
    lg = make_loss_and_grad(loss_fn, layout, strategy, explicit_dp=explicit_dp)
    delayed = isinstance(sync, Stale) and sync.max_delay > 0
    asynchronous = isinstance(sync, Stale) and sync.mode == "async"
    nbytes = replica_bytes(layout)
    upd = dict(clip_norm=clip_norm, lr_schedule=lr_schedule, skip_nonfinite=skip_nonfinite)

    def step(state: TrainState, batch):
        b = _split(batch, k, mesh)
        with use_rules(mesh, layout.rules):
            if delayed:
                delays = sync.delays(state.step, k)
                hist = state.comm["history"]
                # the parameters of ``d`` steps ago: the newest for d = 0, else history[d - 1] (no copy of all)
                older = lambda d: jax.tree.map(lambda p, h: jnp.where(d == 0, p, h[jnp.maximum(d, 1) - 1]),  # noqa: E731
                                               state.params, hist)
                losses, grads = jax.vmap(lambda d, bb: lg(older(d), bb), spmd_axis_name=REPLICA)(delays, b)
            else:
                losses, grads = jax.vmap(lg, in_axes=(None, 0), spmd_axis_name=REPLICA)(state.params, b)
            w, extra = _replica_weights(sync, state.step, k)
            if asynchronous:
                new, metrics = _one_by_one(tx, state, losses, grads, layout, **upd)
            else:
                loss = jnp.dot(w, losses)
                new, metrics = _apply_update(tx, state, loss, _weighted_sum(w, grads, layout.grads, mesh), **upd)
        if delayed:
            metrics["delay_mean"] = jnp.mean(delays.astype(jnp.float32))
            hist = jax.tree.map(lambda p, h: jnp.concatenate([p[None], h[:-1]]), state.params, state.comm["history"])
            new = new._replace(comm={"history": hist})
        metrics.update(extra, loss_spread=jnp.max(losses) - jnp.min(losses),
                       replica_bytes=jnp.float32(nbytes * (k > 1)))
        return new, metrics

    shardings = layout.shardings()
    jitted = jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,) if donate else ())

    def run(state, batch):
        return jitted(state, batch)

    run.jitted, run.lower = jitted, jitted.lower
    return run


def _one_by_one(tx, state, losses, grads, layout, **upd):
    """Asynchronous parameter server: each replica's gradient is applied on its own, in replica
    order, on the newest parameters (K optimizer updates per step; ``step`` advances by one)."""
    k = losses.shape[0]
    new, metrics, skipped = state, None, []
    for r in range(k):
        g = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x[r], grads),
                                             named_shardings(layout.grads, layout.mesh))
        new, m = _apply_update(tx, new._replace(step=state.step), losses[r], g, **upd)
        skipped.append(m.pop("skipped", jnp.bool_(False)))
        metrics = m if metrics is None else {**m, "grad_norm": jnp.maximum(metrics["grad_norm"], m["grad_norm"])}
    metrics["loss"] = jnp.mean(losses)
    if upd.get("skip_nonfinite"):    # any replica's update left out; the others' were applied
        metrics["skipped"] = jnp.any(jnp.stack(skipped))
        metrics["skipped_replicas"] = jnp.sum(jnp.stack(skipped).astype(jnp.int32))
    return new._replace(step=state.step + 1), metrics


def _any_replica(reps: Any, rep_specs: Any, specs: Any, mesh) -> Any:
    """Replicas known to be identical -> the parameters, with no communication: each device keeps
    its own replica's shard (a ``shard_map`` manual over ``replica`` that declares the result
    replicated over it, which holds because every replica computed the same update)."""
    take = jax.shard_map(lambda r: jax.tree.map(lambda x: x[0], r), mesh=mesh, in_specs=P(REPLICA),
                         out_specs=P(), axis_names={REPLICA}, check_vma=False)    # inner axes stay automatic
    return jax.lax.with_sharding_constraint(take(reps), named_shardings(specs, mesh))


def local_steps(loss_fn, tx, layout: StateLayout, strategy, sync, *, donate, clip_norm, lr_schedule,
                skip_nonfinite, explicit_dp) -> Callable:
    """DiLoCo / local SGD / EASGD: the inner program (each replica its own optimizer step, no
    collective over ``replica``) every step, and the sync program every ``sync.every`` steps."""
    mesh, k = layout.mesh, replicas(layout.mesh)
    lg = make_loss_and_grad(loss_fn, layout, strategy, explicit_dp=explicit_dp)
    rep_specs = layout.comm["params"]
    upd = dict(clip_norm=clip_norm, lr_schedule=None, skip_nonfinite=skip_nonfinite)

    def one(step, p, o, b):
        loss, grads = lg(p, b)
        new, m = _apply_update(tx, TrainState(step, p, o, ()), loss, grads, **upd)
        return new.params, new.opt_state, m

    def replica_metrics(step, losses, m) -> dict:
        """Per-replica ``[K]`` metrics (no gather over ``replica``) and the step's learning rate."""
        rep = {"loss": losses, "grad_norm": m["grad_norm"], **({"skipped": m["skipped"]} if skip_nonfinite else {})}
        lr = {"lr": jnp.asarray(lr_schedule(step), jnp.float32)} if lr_schedule is not None else {}
        return {"replica": rep, **lr}

    def inner(state: TrainState, batch):
        with use_rules(mesh, layout.rules):
            p, o, m = jax.vmap(one, in_axes=(None, 0, 0, 0), spmd_axis_name=REPLICA)(
                state.step, state.comm["params"], state.comm["opt"], _split(batch, k, mesh))
        metrics = replica_metrics(state.step, m["loss"], m)
        return TrainState(state.step + 1, state.params, state.opt_state, {"params": p, "opt": o}), metrics

    def warm(state: TrainState, batch):
        """Before ``start_step``: synchronous. The replicas' gradients are averaged (an all-reduce
        over ``replica``) and each replica applies the same update, so they stay identical."""
        with use_rules(mesh, layout.rules):
            losses, grads = jax.vmap(lg, spmd_axis_name=REPLICA)(state.comm["params"], _split(batch, k, mesh))
            mean = _weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), grads, layout.grads, mesh)

            def apply(p, o):
                new, m = _apply_update(tx, TrainState(state.step, p, o, ()), jnp.mean(losses), mean, **upd)
                return new.params, new.opt_state, m

            p, o, m = jax.vmap(apply, spmd_axis_name=REPLICA)(state.comm["params"], state.comm["opt"])
            center = _any_replica(p, rep_specs, layout.params, mesh)
        metrics = replica_metrics(state.step, losses, m)
        return TrainState(state.step + 1, center, state.opt_state, {"params": p, "opt": o}), metrics

    def outer(state: TrainState):
        reps = state.comm["params"]
        with use_rules(mesh, layout.rules):
            mean = _weighted_sum(jnp.full((k,), 1.0 / k, jnp.float32), reps, layout.params, mesh)
            if isinstance(sync, DiLoCo):
                delta = jax.tree.map(jnp.subtract, state.params, mean)       # the pseudo-gradient
                updates, opt = sync.outer.update(delta, state.opt_state, state.params)
                center, opt_state = optax.apply_updates(state.params, updates), opt
                reps = jax.tree.map(lambda c: jnp.broadcast_to(c, (k, *c.shape)), center)
            else:                                                            # EASGD (Zhang et al. 2015)
                diff = jax.tree.map(lambda r, c: r - c, reps, state.params)
                center = jax.tree.map(lambda c, r, c0: c + sync.alpha * k * (r - c0), state.params, mean, state.params)
                reps = jax.tree.map(lambda r, d: r - sync.alpha * d, reps, diff)
                opt_state = state.opt_state
            reps = jax.lax.with_sharding_constraint(reps, named_shardings(rep_specs, mesh))
        dist = jax.vmap(lambda r: optax.tree.norm(jax.tree.map(jnp.subtract, r, mean)), spmd_axis_name=REPLICA)(
            state.comm["params"])
        comm = {"params": reps, "opt": state.comm["opt"]}
        return TrainState(state.step, center, opt_state, comm), {"replica_distance": dist}

    shardings, per_replica = layout.shardings(), NamedSharding(mesh, P(REPLICA))
    msh = {"replica": per_replica, **({"lr": NamedSharding(mesh, P())} if lr_schedule is not None else {})}
    inner_jit = jax.jit(inner, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, msh),
                        donate_argnums=(0,) if donate else ())
    outer_jit = jax.jit(outer, in_shardings=(shardings,), out_shardings=(shardings, {"replica_distance": per_replica}),
                        donate_argnums=(0,) if donate else ())
    start = getattr(sync, "start_step", 0)
    warm_jit = jax.jit(warm, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, msh),
                       donate_argnums=(0,) if donate else ()) if start else None
    return _LocalRunner(inner_jit, outer_jit, sync.every, replica_bytes(layout), warm_jit, start)


@jax.jit
def _replica_summary(rep: dict) -> dict:
    """The step's metrics from the per-replica ones, in one program: each program with a
    collective that is dispatched while the step may still run adds to the XLA:CPU rendezvous
    that, with 8 simulated devices on 2 cores, was seen to time out (one program, not five)."""
    out = {"loss": jnp.mean(rep["loss"]), "grad_norm": jnp.mean(rep["grad_norm"]),
           "loss_spread": jnp.max(rep["loss"]) - jnp.min(rep["loss"])}
    if "skipped" in rep:
        out["skipped"] = jnp.any(rep["skipped"])
    return out


class _LocalRunner:
    """Runs the inner program, and the sync program after every ``every``-th step (the step
    number from :class:`~jaxpar.train.step.HostStep`)."""

    def __init__(self, inner, outer, every: int, nbytes: int, warm=None, start: int = 0):
        self.inner, self.outer, self.every, self.nbytes = inner, outer, every, nbytes
        self.warm, self.start = warm, start
        self.jitted, self.lower = inner, inner.lower
        self._counter = HostStep()

    def __call__(self, state: TrainState, batch):
        count = self._counter.read(state)
        warming = count < self.start
        state, m = (self.warm if warming else self.inner)(state, batch)
        count += 1
        metrics = {k: v for k, v in m.items() if k != "replica"}
        metrics.update(_replica_summary(m["replica"]), replica_bytes=0.0)
        if warming:   # the gradients' all-reduce over ``replica``, as in synchronous data parallelism
            metrics["replica_bytes"] = float(self.nbytes)
        elif (count - self.start) % self.every == 0:
            state, synced = self.outer(state)
            metrics.update(replica_distance=jnp.mean(synced["replica_distance"]), replica_bytes=float(self.nbytes))
        self._counter.advance(state, count)
        return state, metrics
