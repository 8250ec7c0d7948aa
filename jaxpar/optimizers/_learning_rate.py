"""The learning rate as optimizer state. An optimizer built by ``optax.inject_hyperparams`` with its
learning-rate schedule (as ``jaxpar train``'s are) holds, in its state, the learning rate of the last update it
applied and the number of updates; the train step logs that rate and a resume reads it (:func:`learning_rate`).
"""
from __future__ import annotations

from typing import Any

import jax


def _holds_learning_rate(node: Any) -> bool:
    return isinstance(getattr(node, "hyperparams", None), dict) and "learning_rate" in node.hyperparams


def schedule_state(opt_state: Any) -> Any | None:
    """The outermost ``optax.inject_hyperparams`` state in ``opt_state`` with a ``learning_rate``.

    Args:
      opt_state: an optimizer state.

    Returns:
      That state (its ``count``: the updates applied; ``hyperparams["learning_rate"]``: the last one's rate),
      or None.
    """
    return next(filter(_holds_learning_rate, jax.tree.leaves(opt_state, is_leaf=_holds_learning_rate)), None)


def learning_rate(opt_state: Any) -> jax.Array | None:
    """The learning rate of the last update ``opt_state`` took (before the first: of the first).

    Args:
      opt_state: an optimizer state.

    Returns:
      The ``learning_rate`` of its ``optax.inject_hyperparams`` state, or None without one.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=lambda count: 0.1 / (1 + count))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.ones(2)}, state)
    >>> _, state = tx.update({"w": jnp.ones(2)}, state)
    >>> round(float(learning_rate(state)), 6), learning_rate(optax.sgd(0.1).init({"w": jnp.ones(2)}))
    (0.05, None)
    """
    state = schedule_state(opt_state)
    return None if state is None else state.hyperparams["learning_rate"]
