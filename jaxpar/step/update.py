"""The optimizer update of every train step: clip, optax, skip a non-finite step, log the lr.

:func:`apply_update` is the one update; the rules that change *when* it applies or *with which
weights* wrap it: :func:`delayed_update` (PipeDream-2BW: the gradient at ``W(t-1)`` updates
``W(t)``, which becomes the older version). Weight stashing updates each stage inside the
pipeline (:mod:`jaxpar.parallel.pipeline.stash_step`) and DiLoCo / EASGD add an outer step
(:mod:`jaxpar.step.relaxed_steps`); both call :func:`apply_update` for the inner update.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from jaxpar.step.state import TrainState
    >>> tx = optax.sgd(0.5)
    >>> state = TrainState(jnp.int32(0), {"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    >>> upd = Update(tx, clip_norm=1.0, skip_nonfinite=True, log_lr=lambda step: 0.5)
    >>> new, m = apply_update(upd, state, jnp.float32(1.0), {"w": jnp.array([3.0, 4.0])})
    >>> [round(float(w), 4) for w in new.params["w"]], float(m["grad_norm"]), bool(m["skipped"]), float(m["lr"])
    ([0.7, 0.6], 5.0, False, 0.5)
    >>> new, m = apply_update(upd, state, jnp.float32(jnp.nan), {"w": jnp.array([3.0, 4.0])})
    >>> new.params["w"].tolist(), int(new.step), bool(m["skipped"])
    ([1.0, 1.0], 1, True)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.step.state import TrainState

__all__ = ["Update", "apply_update", "delayed_update"]


class Update(NamedTuple):
    """The options of the update.

    Attributes:
      tx: the optax optimizer.
      clip_norm: clip the gradient to this global norm first (``None``: no clipping).
      skip_nonfinite: a step whose loss or gradient norm is not finite keeps every part of the
        state as it was (the step counter still advances) and reports ``skipped``.
      log_lr: ``step -> learning rate``, logged as ``metrics["lr"]`` (the update follows ``tx``).
    """

    tx: optax.GradientTransformation
    clip_norm: float | None = None
    skip_nonfinite: bool = False
    log_lr: Callable | None = None


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
      ``(new state, metrics)``; metrics hold ``loss``, ``grad_norm``, ``skipped`` (with
      ``skip_nonfinite``) and ``lr`` (with ``log_lr``).
    """
    gnorm = optax.tree.norm(grads)
    if update.clip_norm is not None:
        scale = jnp.minimum(1.0, update.clip_norm / (gnorm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = update.tx.update(grads, state.opt_state, state.params)
    new = state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, **(parts or {}))
    out = {"loss": loss, "grad_norm": gnorm, **(metrics or {})}
    if update.skip_nonfinite:
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        changed = ("params", "opt_state", *(parts or {}))
        new = new._replace(**{f: jax.tree.map(lambda n, o: jnp.where(ok, n, o), getattr(new, f), getattr(state, f))
                              for f in changed})
        out["skipped"] = jnp.logical_not(ok)
    if update.log_lr is not None:
        out["lr"] = jnp.asarray(update.log_lr(state.step), jnp.float32)
    return new, out


def delayed_update(update: Update, state: TrainState, loss: jax.Array, grads: Any, **kw) -> tuple[TrainState, dict]:
    """PipeDream-2BW's rule: ``grads`` (taken at ``W(t-1) = state.versions``) update ``W(t)``,
    and ``W(t)`` becomes the older version (a skipped step keeps both as they were).

    Args:
      update: the options (:class:`Update`).
      state: the train state; ``versions`` holds ``W(t-1)``.
      loss: the step's loss.
      grads: the gradient at ``W(t-1)``.
      **kw: ``parts`` / ``metrics``, as for :func:`apply_update`.

    Returns:
      ``(new state, metrics)``.
    """
    new, metrics = apply_update(update, state, loss, grads, **kw)
    older = state.params
    if update.skip_nonfinite:
        older = jax.tree.map(lambda w, o: jnp.where(metrics["skipped"], o, w), state.params, state.versions)
    return new._replace(versions=older), metrics
