"""AdamW whose second moment freezes: the optimizer of 1-bit Adam (Tang et al. 2021; docs/compression.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.errors import OptimizerError, check_int
from jaxpar.optimizers._large_batch import Mask
from jaxpar.optimizers._ranges import check_hyperparameters


def scale_by_adam_frozen_variance(freeze_step: int, *, b1: float = 0.9, b2: float = 0.999,
                                  eps: float = 1e-8) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` whose second moment stops changing after ``freeze_step`` updates
    (1-bit Adam, Tang et al. 2021: from then on only the first moment, a linear function of the
    gradients, is exchanged compressed). Before it, the same numbers as ``optax.scale_by_adam``;
    the state is optax's ``ScaleByAdamState``, so checkpoints of either restore into the other.

    Args:
      freeze_step: the number of updates after which the second moment is frozen.
      b1: the first-moment decay.
      b2: the second-moment decay.
      eps: added to ``sqrt(nu_hat)``.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp
    >>> tx = scale_by_adam_frozen_variance(1, b2=0.5)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, 2.0]), state)
    >>> _, state = tx.update(jnp.array([9.0, 9.0]), state)     # after 1 update: the variance is frozen
    >>> state.nu.tolist()
    [0.5, 2.0]
    """
    check_int("scale_by_adam_frozen_variance", "freeze_step", freeze_step, 1, OptimizerError)
    check_hyperparameters("scale_by_adam_frozen_variance", b1=b1, b2=b2, eps=eps)
    def update_fn(updates, state, params=None):
        frozen = state.count >= freeze_step
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        nu = jax.tree.map(lambda new, old: jnp.where(frozen, old, new), nu, state.nu)
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, jnp.minimum(count, freeze_step))
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(optax.scale_by_adam(b1=b1, b2=b2, eps=eps).init, update_fn)


def adamw_frozen_variance(learning_rate: optax.ScalarOrSchedule, freeze_step: int, *, b1: float = 0.9,
                          b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
                          mask: Mask = None) -> optax.GradientTransformation:
    """``optax.adamw`` with :func:`scale_by_adam_frozen_variance`: the optimizer of 1-bit Adam,
    with ``compression=sign(optimizer_momentum=b1, start_step=freeze_step)`` (:mod:`jaxpar.parallel.compression`).

    Args:
      learning_rate: a scalar or an optax schedule.
      freeze_step: the number of updates after which the second moment is frozen.
      b1: the first-moment decay.
      b2: the second-moment decay.
      eps: added to ``sqrt(nu_hat)``.
      weight_decay: the decoupled weight decay.
      mask: which parameters decay: a tree of bools or a function of the params.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp, optax
    >>> p, g = jnp.ones(3), jnp.array([0.1, -0.2, 0.3])
    >>> a, b = adamw_frozen_variance(1e-2, 10), optax.adamw(1e-2)
    >>> bool(jnp.allclose(a.update(g, a.init(p), p)[0], b.update(g, b.init(p), p)[0]))   # before freeze_step
    True
    """
    check_hyperparameters("adamw_frozen_variance", learning_rate=learning_rate, weight_decay=weight_decay)
    return optax.chain(
        scale_by_adam_frozen_variance(freeze_step, b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask=mask),
        optax.scale_by_learning_rate(learning_rate),
    )
