"""MoE load balancing as one part of the train step: the whole step's loads, the load metrics and the
router bias.

The MoE layers report their loads and read the step's themselves (:mod:`jaxpar.parallel.moe._balance`);
this part is what the step does around them:

* :func:`whole_step_loads`: with micro-batches, a forward pre-pass that sums every layer's load, which
  every micro-batch's balancing loss then uses, so that their mean is the whole batch's; a loss that
  uses the balancing loss other than as a sum with constant weights is refused;
* :func:`finish`: after the gradient, the load metrics of the whole step (``moe/load_min``,
  ``moe/load_max``, ``moe/load_cv``: the load per expert pooled over the layers, as a multiple of
  the mean); the router bias is a state part of its own (:mod:`jaxpar.step._router_bias`).

>>> import jax.numpy as jnp
>>> from jaxpar.parallel.moe import LAYER_LOADS
>>> metrics = finish({LAYER_LOADS: jnp.array([[3.0, 1.0], [1.0, 3.0]]), "loss": 1.0})
>>> sorted(metrics), float(metrics["moe/load_max"])
(['loss', 'moe/layer_loads', 'moe/load_cv', 'moe/load_max', 'moe/load_min'], 1.0)
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.batch import split_microbatches
from jaxpar.errors import MoEError
from jaxpar.parallel.moe import LAYER_LOADS, load_cv, prepass_loads, probe, reported_loads


def refuse_unbalanced(loss_of: Callable, params: Any, microbatch: Any, microbatches: int) -> None:
    """Raise :class:`MoEError` on a gradient path without the loads pre-pass (a codec's or a measurement's
    per-replica gradient) when the loss uses the balancing loss with micro-batches.

    Args:
      loss_of: the balanced loss ``(params, batch) -> loss``.
      params: the parameters (or shapes).
      microbatch: one micro-batch (or shapes).
      microbatches: the step's micro-batches.
    """
    if microbatches > 1 and probe(loss_of, params, microbatch).aux_used:
        raise MoEError(f"Strategy.microbatches={microbatches} with a loss that adds the MoE load-balancing loss, on a "
                       "path without the step's load pre-pass (a codec or a noise-scale measurement): that loss "
                       "multiplies the batch's load per expert by its router probabilities, so each micro-batch "
                       "would use its own load and the sum would differ from one step on the whole batch. Use "
                       "microbatches=1, or leave the aux loss out (the z-loss is a mean, exact under accumulation).")


def whole_step_loads(loss_of: Callable, params: Any, batch: Any, microbatches: int, mesh: Any = None) -> Any:
    """The whole step's MoE loads ``[sites, E]`` for :func:`jaxpar.parallel.moe.use_step_loads`: a forward
    pre-pass over the micro-batches (one more forward per step); ``None`` without micro-batches, MoE
    layers, or a balancing loss in the loss.

    Args:
      loss_of: the balanced loss ``(params, batch) -> loss``.
      params: the parameters.
      batch: the step's batch (global with ``mesh``).
      microbatches: the number of micro-batches.
      mesh: the mesh of a global batch.

    Returns:
      The summed loads, or ``None``.

    Raises:
      MoEError: the loss uses the balancing loss other than as a sum with constant weights.
    """
    if microbatches == 1:
        return None
    mbs = split_microbatches(batch, microbatches, mesh)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs)
    found = probe(loss_of, params, one)
    if not found.aux_used:
        return None
    if not found.linear:
        raise MoEError(
            f"Strategy.microbatches={microbatches}: the loss uses its MoE layers' load-balancing loss (stats.aux_loss) "
            "other than as a sum with constant weights (e.g. squared, or scaled by a value of the batch or the "
            "parameters). Each micro-batch balances with the whole step's load, so the step makes exactly "
            "`loss + w * aux_loss` (w a constant) the whole batch's. Add the aux loss that way, or use microbatches=1.")
    return prepass_loads(lambda b: reported_loads(loss_of)(params, b), mbs, found.loads)


def load_metrics(loads: jax.Array) -> dict[str, jax.Array]:
    """``moe/load_min``, ``moe/load_max`` (the load per expert pooled over the layers, as a multiple of
    the mean: 1 when balanced) and ``moe/load_cv`` (std / mean) of the loads ``[layers, E]``.

    Args:
      loads: the step's loads (any positive multiple of them: a mean over micro-batches).

    Returns:
      The three metrics.
    """
    load = jnp.sum(loads.astype(jnp.float32), axis=0)
    relative = load / jnp.maximum(jnp.mean(load), jnp.finfo(jnp.float32).tiny)
    return {"moe/load_min": relative.min(), "moe/load_max": relative.max(), "moe/load_cv": load_cv(load)}


def finish(metrics: dict) -> dict:
    """The step's MoE part after the gradient: the load metrics from the loads the layers reported
    (``metrics[LAYER_LOADS]``, averaged over micro-batches).

    Args:
      metrics: the step's metrics.

    Returns:
      The metrics with :func:`load_metrics`.
    """
    loads = metrics.get(LAYER_LOADS)
    return {**metrics, **load_metrics(loads)} if loads is not None and loads.ndim == 2 else metrics
