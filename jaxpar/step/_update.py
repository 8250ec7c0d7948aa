"""The optimizer update of every train step: clip, optax, skip a non-finite step, log the learning rate the
optimizer's state holds (:func:`jaxpar.optimizers.learning_rate`).

:func:`apply_update` is the one update; every program calls it for each optimizer update it
applies, and the rules that change *when* it applies or *with which weights* wrap it:
:func:`delayed` (PipeDream-2BW, the one-step and the ``K``-step program alike), weight stashing
per stage inside the pipeline, the replicas' mean or each replica in turn
(:mod:`jaxpar.step._replica_mean`), the inner and outer updates of the local kinds
(:mod:`jaxpar.step._local_steps`). What ``grad_norm`` means in each: docs/training.md.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from jaxpar.step._state import TrainState
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    >>> state = TrainState(jnp.int32(0), {"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    >>> upd = Update(tx, clip_norm=1.0, skip_nonfinite=True)
    >>> new, m = apply_update(upd, state, jnp.float32(1.0), {"w": jnp.array([3.0, 4.0])})
    >>> [round(float(w), 4) for w in new.params["w"]], float(m["grad_norm"]), bool(m["skipped"]), float(m["lr"])
    ([0.7, 0.6], 5.0, False, 0.5)
    >>> new, m = apply_update(upd, state, jnp.float32(jnp.nan), {"w": jnp.array([3.0, 4.0])})
    >>> new.params["w"].tolist(), int(new.step), bool(m["skipped"])
    ([1.0, 1.0], 1, True)
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.optimizers import hyperparameter_problem, learning_rate
from jaxpar.step._state import TrainState


class Update(NamedTuple):
    """The options of the update.

    Attributes:
      tx: the optax optimizer.
      clip_norm: clip the gradient to this global norm first (``None``: no clipping).
      skip_nonfinite: a step whose loss or gradient norm is not finite, or whose update would make a
        parameter or an optimizer moment non-finite, keeps every part of the state as it was (the step
        counter still advances; under :func:`delayed` the older version still becomes ``W(t)``) and
        reports ``skipped``.
      place: where the optimizer's arithmetic runs, ``place(optimize, grads, opt_state, params, *scalars)
        -> (params, opt_state, ok)`` (:func:`jaxpar.parallel._offload.host_placement`: in host memory);
        ``None``: here, in the step's program.
      grad_norm: report ``grad_norm``; without it the norm is computed only where ``clip_norm`` or
        ``skip_nonfinite`` needs it.
    """

    tx: optax.GradientTransformation
    clip_norm: float | None = None
    skip_nonfinite: bool = False
    place: Callable | None = None
    grad_norm: bool = True


def clip_norm_problem(clip_norm: Any) -> str | None:
    """What is wrong with a ``clip_norm``: a norm of 0 would freeze the model and a negative one would
    flip the gradient (gradient ascent), so only a finite number > 0 clips.

    Args:
      clip_norm: the global norm the gradient is clipped to (a 0-d array counts), or None (no clipping).

    Returns:
      ``"must be ..."`` naming what it takes, or None.

    >>> clip_norm_problem(1.0), clip_norm_problem(None), clip_norm_problem(-1.0)[:30]
    (None, None, 'must be a finite number > 0 (t')
    """
    return None if clip_norm is None else hyperparameter_problem("clip_norm", clip_norm)


def apply_update(update: Update, state: TrainState, loss: jax.Array, grads: Any, *,
                 parts: dict | None = None, metrics: dict | None = None) -> tuple[TrainState, dict]:
    """One optimizer step on ``state`` from ``grads``.

    Args:
      update: the options (:class:`Update`).
      state: the train state before the step.
      loss: the step's loss (a scalar).
      grads: the gradient, in the parameters' tree.
      parts: the state parts the step itself changed (``{"codec": ..., "stats": ...}``: a codec's
        residuals, running measurements); they are kept, or rolled back with the rest when the
        step is skipped.
      metrics: more metrics of the step (an exchange's, a measurement's).

    Returns:
      ``(new state, metrics)``; metrics hold ``loss``, ``grad_norm`` (the global norm of
      ``grads``, before clipping: see the module docstring; with ``update.grad_norm``), ``skipped`` (with
      ``skip_nonfinite``) and ``lr`` (the learning rate the new optimizer state holds, when ``tx`` is an
      ``optax.inject_hyperparams`` with one: :func:`jaxpar.optimizers.learning_rate`).
    """
    needed = update.grad_norm or update.clip_norm is not None or update.skip_nonfinite
    gnorm = optax.tree.norm(grads) if needed else None
    scalars = {}
    if update.clip_norm is not None:
        scalars["scale"] = jnp.minimum(1.0, update.clip_norm / (gnorm + 1e-6))
    if update.skip_nonfinite:
        scalars["ok"] = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    optimize = partial(optimizer_arithmetic, update.tx, tuple(scalars))
    args = (grads, state.opt_state, state.params, *scalars.values())
    params, opt_state, ok = update.place(optimize, *args) if update.place else optimize(*args)
    new = state._replace(step=state.step + 1, params=params, opt_state=opt_state, **(parts or {}))
    out = {"loss": loss, **({"grad_norm": gnorm} if update.grad_norm else {}), **(metrics or {})}
    if update.skip_nonfinite:
        new = new._replace(**{f: jax.tree.map(lambda n, o: jnp.where(ok, n, o), getattr(new, f), getattr(state, f))
                              for f in (parts or {})})
        out["skipped"] = jnp.logical_not(ok)
    if (lr := learning_rate(new.opt_state)) is not None:
        out["lr"] = jnp.asarray(lr, jnp.float32)
    return new, out


def optimizer_arithmetic(tx: optax.GradientTransformation, names: tuple[str, ...], grads: Any, opt_state: Any,
                         params: Any, *scalars: jax.Array) -> tuple[Any, Any]:
    """The optimizer's arithmetic of :func:`apply_update`: the gradient scaled by the clip (``"scale"``), the
    optax update, and the old parameters and optimizer state kept where the step is skipped (``"ok"``: a
    finite loss and gradient norm, and then the update's parameters and optimizer state all finite).

    Args:
      tx: the optimizer.
      names: the names of ``scalars`` (``"scale"``, ``"ok"``).
      grads: the gradients.
      opt_state: the optimizer state.
      params: the parameters.
      *scalars: the clip's scale and the step's finite flag, as ``names`` says.

    Returns:
      ``(new_params, new_opt_state, ok)``: ``ok`` whether the update was applied (None without ``"ok"``).
    """
    given = dict(zip(names, scalars))
    if "scale" in given:
        grads = jax.tree.map(lambda g: g * given["scale"], grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if "ok" not in given:
        return new_params, new_opt, None
    ok = given["ok"] & _all_finite(new_params) & _all_finite(new_opt)
    keep = lambda n, o: jnp.where(ok, n, o)    # noqa: E731
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), ok


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating value of ``tree`` is finite (a boolean scalar)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def updates_metrics(loss: jax.Array, sq_norms: jax.Array | None, updates: int, skipped_updates: jax.Array | None = None,
                    of: int | None = None, lr: Any = None) -> dict:
    """The metrics of a step that applies several updates, each on its own gradient (see the
    module docstring): what :func:`apply_update` reports for one.

    Args:
      loss: the step's loss.
      sq_norms: the sum over the step's updates of their gradients' squared global norms (``None``: not
        measured, ``Update.grad_norm=False``; no ``grad_norm`` reported).
      updates: how many updates ``sq_norms`` sums.
      skipped_updates: how many of the step's updates were skipped (``None``: the step does not
        skip, ``skip_nonfinite=False``).
      of: how many updates ``skipped_updates`` counts among (default ``updates``; weight
        stashing counts each stage's part of an update).
      lr: the logged learning rate (``None``: not logged).

    Returns:
      ``loss``, ``grad_norm`` (the root mean square of the updates' norms), with
      ``skipped_updates`` given ``skipped`` (every update skipped: no weight changed) and
      ``skipped_updates``, and with ``lr`` given ``lr``.

    >>> import jax.numpy as jnp
    >>> m = updates_metrics(jnp.float32(2.0), jnp.float32(3.0 ** 2 + 4.0 ** 2), 2, jnp.int32(1))
    >>> round(float(m["grad_norm"]), 4), bool(m["skipped"]), int(m["skipped_updates"])
    (3.5355, False, 1)
    """
    out = {"loss": loss, **({} if sq_norms is None else {"grad_norm": jnp.sqrt(sq_norms / updates)})}
    if skipped_updates is not None:
        out["skipped"] = skipped_updates >= (of or updates)
        out["skipped_updates"] = jnp.asarray(skipped_updates).astype(jnp.int32)
    if lr is not None:
        out["lr"] = jnp.asarray(lr, jnp.float32)
    return out


def delayed(apply: Callable) -> Callable:
    """PipeDream-2BW's update rule around an update ``apply(state, loss, grads, **kw) -> (state,
    metrics)`` (:func:`apply_update` with its options bound): the gradient, taken at ``W(t-1) =
    state.versions``, updates ``W(t) = state.params``, and ``W(t)`` becomes the older version.

    A skipped step (``skip_nonfinite``) keeps the parameters and the optimizer state
    (``W(t+1) = W(t)``), and ``W(t)`` still becomes the older version, so after it both versions
    are ``W(t)`` and the next step's gradient is taken there. Keeping ``W(t-1)`` instead (as if
    the step had never run) cannot hold in the no-flush pipeline: when step ``t``'s gradient is
    found non-finite, the first micro-batches of step ``t+1`` have already run their forwards
    (and, on the later stages, backwards) on ``W(t)``, so its gradient must be taken at ``W(t)``;
    the one-step program follows the same rule, so ``steps_per_call=1`` and ``K`` give the same
    states.

    Args:
      apply: the update, ``(state, loss, grads, **kw) -> (state, metrics)``.

    Returns:
      The delayed update, with ``apply``'s signature.
    """
    def rule(state: TrainState, loss: jax.Array, grads: Any, **kw) -> tuple[TrainState, dict]:
        new, metrics = apply(state, loss, grads, **kw)
        return new._replace(versions=state.params), metrics       # W(t) becomes the older version

    return rule

