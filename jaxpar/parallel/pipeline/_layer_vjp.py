"""One layer's ``jax.vjp`` split into what a pipeline stage stores and what it passes back in.

A pipeline stage runs each layer's forward once and its backward ticks later, so it keeps
the pullback's residuals in slotted buffers (:mod:`._buffers`). :class:`LayerVJP` traces the
layer once to learn which residuals those are (not the layer's own parameters, which the
backward passes back in; see :mod:`jaxpar.parallel.pipeline._vjp_residuals`) and their shapes, and with a split
backward cuts the pullback into its input part (B) and weight part (W)
(:mod:`jaxpar.parallel.pipeline._split_backward`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> lv = LayerVJP(lambda w, x: jnp.tanh(x @ w), jnp.ones((3, 3)), jax.ShapeDtypeStruct((2, 3), jnp.float32))
    >>> y, stored = lv.forward(0.5 * jnp.ones((3, 3)), jnp.ones((2, 3)))
    >>> y.shape, len(stored) == len(lv.stored)
    ((2, 3), True)
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxpar.parallel.pipeline._split_backward import split_backward
from jaxpar.parallel.pipeline._vjp_residuals import join_pullback, split_pullback


class LayerVJP:
    """Static structure of one layer's ``jax.vjp``: which residuals are stored (not the
    layer's own parameters, passed back in; see :mod:`jaxpar.parallel.pipeline._vjp_residuals`) and their shapes;
    with ``split``, the pullback cut into B and W (:mod:`jaxpar.parallel.pipeline._split_backward`).

    Args:
        layer: ``layer(params, x) -> y``, with ``y`` shaped like ``x``.
        p_shapes: one layer's parameters (arrays or ``ShapeDtypeStruct``).
        x_shape: the layer's input.
        split: also cut the pullback into its input part (B) and weight part (W).
    """

    def __init__(self, layer: Callable, p_shapes: Any, x_shape: jax.ShapeDtypeStruct, split: bool = False):
        # The barrier makes the input an internal value of the layer, so JAX keeps it among
        # the opaque residuals in every trace (left alone, it is sometimes recorded as a
        # primal argument instead, which reorders the residuals between traces).
        self.layer = lambda p, x: layer(p, jax.lax.optimization_barrier(x))
        box: dict[str, Any] = {}

        def probe(p, x):
            stored, box["layout"] = split_pullback(jax.vjp(self.layer, p, x)[1], p)
            return stored

        self.stored = jax.eval_shape(probe, p_shapes, x_shape)
        self.layout = box["layout"]
        # the output cotangent is shaped like the input: the layers are chained in a scan
        self.split = (split_backward(lambda p, s, g: self.pullback(p, s)(g), p_shapes, self.stored, x_shape)
                      if split else None)

    def forward(self, p, x):
        """One layer's forward, keeping its pullback's residuals.

        Args:
            p: the layer's parameters.
            x: its input.

        Returns:
            ``(y, stored)``: the output and the residuals to keep (a list, shaped as ``self.stored``);
            a ``RuntimeError`` if they differ from the probe's.
        """
        y, pullback = jax.vjp(self.layer, p, x)
        return y, split_pullback(pullback, p, like=self.layout)[0]

    def pullback(self, p, stored):
        """The layer's pullback, rebuilt.

        Args:
            p: the layer's parameters (not stored: passed back in).
            stored: the residuals :meth:`forward` returned.

        Returns:
            ``dy -> (dp, dx)``.
        """
        return join_pullback(self.layout, stored, p)
