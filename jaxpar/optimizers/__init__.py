"""jaxpar's optimizers: large-batch ones (learning-rate scaling rules, LARS / LAMB with masks), 1-bit Adam's,
and Muon routed by logical names. One module per concept:

* :mod:`~jaxpar.optimizers._ranges`: the range of each option (:data:`HYPERPARAMETERS`,
  :func:`hyperparameter_problem`, :func:`check_hyperparameters`) and :func:`scaled_lr`, the peak learning rate
  for a global batch (``linear``, ``sqrt`` or ``none``).
* :mod:`~jaxpar.optimizers._large_batch`: :func:`lars` and :func:`lamb`, built like ``optax.lars`` /
  ``optax.lamb`` but with the weight decay **and** the trust ratio masked off for biases and norm scales
  (:func:`trust_mask`), per layer for stacked blocks (docs/large_batch.md).
* :mod:`~jaxpar.optimizers._frozen_variance`: :func:`adamw_frozen_variance`, AdamW whose second moment
  freezes, the optimizer of 1-bit Adam (docs/compression.md).
* :mod:`~jaxpar.optimizers._muon_routing`: :func:`muon`, Muon on the matrices and AdamW on the rest, routed by the
  parameters' logical names (:func:`muon_routing`, :func:`muon_routing_table`), its Newton-Schulz placed on the
  mesh (:func:`muon_placements`, :mod:`jaxpar.parallel._muon_placement`; docs/muon.md).
* :mod:`~jaxpar.optimizers._learning_rate`: :func:`learning_rate`, the rate an ``optax.inject_hyperparams`` state holds
  (the one the step logs).

Example::

    >>> import jax, jax.numpy as jnp
    >>> scaled_lr(0.1, batch=1024, base_batch=256, rule="linear"), scaled_lr(0.1, 1024, 256, "sqrt")
    (0.4, 0.2)
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    >>> trust_mask(params)                                   # 1-D leaves: no decay, no trust ratio
    {'b': False, 'w': True}
    >>> tx = lamb(1e-2, weight_decay=0.1)
    >>> updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    >>> [round(float(jnp.linalg.norm(u)), 5) for u in (updates["w"], updates["b"])]   # lr ||w||, lr ||adam step||
    [0.03464, 0.01732]
"""
from jaxpar.errors import MaskError, OptimizerError
from jaxpar.optimizers._frozen_variance import adamw_frozen_variance, scale_by_adam_frozen_variance
from jaxpar.optimizers._large_batch import lamb, lars, scale_by_layer_trust_ratio, stacked_axes, trust_mask
from jaxpar.optimizers._learning_rate import learning_rate, schedule_state
from jaxpar.optimizers._muon_routing import (MUON_ADAM_DEFAULTS, MUON_KERNEL_LAYOUTS, MUON_PLACEMENTS, MuonRoute,
                                             muon, muon_placements, muon_routes, muon_routing, muon_routing_table,
                                             scale_by_placed_muon)
from jaxpar.optimizers._ranges import (HYPERPARAMETERS, LR_SCALING_RULES, check_hyperparameters,
                                       hyperparameter_problem, scaled_lr)
from jaxpar.parallel._muon_placement import MuonPlacement

__all__ = ["LR_SCALING_RULES", "HYPERPARAMETERS", "MaskError", "OptimizerError", "hyperparameter_problem",
           "check_hyperparameters", "scaled_lr", "trust_mask", "stacked_axes", "scale_by_layer_trust_ratio", "lars",
           "lamb", "scale_by_adam_frozen_variance", "adamw_frozen_variance", "MUON_ADAM_DEFAULTS", "MUON_PLACEMENTS",
           "MUON_KERNEL_LAYOUTS", "MuonRoute", "MuonPlacement", "muon_routes", "muon_routing", "muon_routing_table",
           "muon_placements", "scale_by_placed_muon", "muon", "learning_rate", "schedule_state"]
