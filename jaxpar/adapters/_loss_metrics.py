"""Metrics a loss reports beside its value: ``report_metric("moe/drop_rate", x)`` inside ``loss_fn``.

The train step traces the loss inside :func:`collect_metrics` and returns what it reported with the
gradient (``jax.value_and_grad(..., has_aux=True)``), averaged over the micro-batches; the step's
metrics then hold them under their names, and the train loop logs every name with a ``/`` (JSONL
and TensorBoard, the name as the tag). A metric is a scalar (or an array, logged by the caller)
computed at the loss's own level: not inside a ``lax.scan`` body or a ``shard_map`` of its own,
whose values cannot leave it this way (carry them out, as the GPT's MoE blocks carry their
statistics).

Outside a collector (a plain call of the loss) :func:`report_metric` does nothing.

>>> import jax.numpy as jnp
>>> def loss(w):
...     report_metric("fit/abs_w", jnp.abs(w))
...     return w ** 2
>>> with collect_metrics() as found:
...     value = loss(jnp.float32(3.0))
>>> float(value), {k: float(v) for k, v in found.items()}
(9.0, {'fit/abs_w': 3.0})
>>> float(loss(jnp.float32(2.0)))            # no collector: the value only
4.0
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, ContextManager

import jax.numpy as jnp

from jaxpar.rules import scoped

_FOUND: contextvars.ContextVar = contextvars.ContextVar("jaxpar_loss_metrics", default=None)


def report_metric(name: str, value: Any) -> None:
    """Report ``value`` under ``name`` (e.g. ``"moe/load_cv"``) to the step that traces this loss.

    Args:
      name: the metric's name; a ``/`` makes the train loop log it (``group/metric``).
      value: an array (a scalar for the log), in fp32.
    """
    found = _FOUND.get()
    if found is not None:
        found[name] = jnp.asarray(value, jnp.float32)


def collect_metrics() -> ContextManager[dict[str, Any]]:
    """Collect what :func:`report_metric` reports while tracing in this context (innermost wins)."""
    return scoped(_FOUND, {})


def with_reported_metrics(loss_of: Callable) -> Callable:
    """``loss_of`` traced inside :func:`collect_metrics`, for ``jax.value_and_grad(..., has_aux=True)``.

    Args:
      loss_of: ``loss_of(*args) -> scalar loss``; may call :func:`report_metric`.

    Returns:
      ``run(*args) -> (loss, metrics)``: the loss and a dict of what it reported (name -> fp32 array).
    """
    def run(*args):
        with collect_metrics() as found:
            loss = loss_of(*args)
        return loss, dict(found)
    return run
