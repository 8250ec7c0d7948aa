"""A model cut for a pipeline: the parts around the blocks, and one repeated block.

``pre`` (first virtual stage) and ``post`` (last virtual stage) share one
parameter tree, ``outer``: every parameter that is not a block's. A model with
tied embeddings uses the same leaf in both; the executor adds the two gradients.

Example:
    >>> import jax.numpy as jnp
    >>> parts = PipelineParts(
    ...     pre=lambda outer, mb: outer["embed"][mb["tokens"]],
    ...     layer=lambda p, x: x + jnp.tanh(x @ p["w"]),
    ...     post=lambda outer, y, mb: jnp.mean((y @ outer["embed"].T - mb["targets"]) ** 2))
    >>> outer, layer = {"embed": jnp.ones((5, 3))}, {"w": jnp.zeros((3, 3))}
    >>> mb = {"tokens": jnp.array([0, 4]), "targets": jnp.zeros((2, 5))}
    >>> float(parts.post(outer, parts.layer(layer, parts.pre(outer, mb)), mb))
    9.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jaxpar.errors import PipelineCutError


@dataclass(frozen=True)
class PipelineParts:
    """How the executor runs a model.

    - ``pre(outer, microbatch) -> x``: before the blocks (e.g. the embedding).
    - ``layer(layer_params, x) -> y``: one block; ``y`` has ``x``'s shape and dtype.
    - ``post(outer, y, microbatch) -> loss``: after the blocks (e.g. head and loss),
      a scalar averaged over the micro-batch's rows.
    """

    pre: Callable
    layer: Callable
    post: Callable

    def __post_init__(self):
        for name in ("pre", "layer", "post"):
            value = getattr(self, name)
            if not callable(value):
                raise PipelineCutError(f"PipelineParts({name}={value!r}): {name} must be a function; see the "
                                       "class docstring for each part's signature.")
