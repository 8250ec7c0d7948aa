"""Split a layer's backward into its input part (B) and its weight part (W), for zero-bubble pipelines.

A zero-bubble schedule runs a layer's backward in two actions: **B** computes the cotangent of
the layer's input (the next stage is waiting for it) and **W** the weight gradients, later, in
what would be a bubble. Re-running the whole pullback in W would do B's work twice. Instead,
:func:`split_backward` traces the pullback ``(params, stored, g) -> (dp, dx)`` once to a jaxpr
and cuts it by what each output needs:

* **B** = the equations ``dx`` depends on. It also returns the *frontier*: the values it
  computes (or receives: ``g``) that W's equations read, typically the cotangent at the output
  of each weight matmul.
* **W** = the remaining equations ``dp`` depends on, run on ``(params, stored, frontier)``:
  for a matmul ``y = h @ w``, only ``h.T @ dy``.

Every equation of the pullback runs in exactly one of the two, so B + W costs one backward.
The frontier is what must be kept from B to W (the executor stores it per layer in slots).

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.parallel.pipeline._vjp_residuals import split_pullback, join_pullback
    >>> def layer(p, x):
    ...     return jnp.tanh(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)) * 0.1, "w2": jnp.ones((8, 4)) * 0.1}
    >>> x = jnp.ones((2, 4))
    >>> y, pullback = jax.vjp(layer, p, x)
    >>> stored, layout = split_pullback(pullback, p)
    >>> split = split_backward(lambda p, s, g: join_pullback(layout, s, p)(g), p, stored, y)
    >>> dx, frontier = split.inputs(p, stored, y)
    >>> dp = split.weights(p, stored, frontier)
    >>> full_dp, full_dx = pullback(y)
    >>> bool(jnp.allclose(dx, full_dx)) and bool(jnp.allclose(dp["w1"], full_dp["w1"]))
    True
    >>> split.dots                          # matmuls in B and in W: 2 + 2, as in one pullback
    (2, 2)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Var


def _needed(eqns: list, start: list, skip: frozenset = frozenset()) -> tuple[list[int], set]:
    """Indices (in order) of the equations ``start``'s variables depend on, skipping ``skip``,
    and every variable those equations read."""
    need = {v for v in start if isinstance(v, Var)}
    picked = []
    for i in reversed(range(len(eqns))):
        if i in skip:
            continue
        e = eqns[i]
        if any(isinstance(o, Var) and o in need for o in e.outvars):
            picked.append(i)
            need |= {v for v in e.invars if isinstance(v, Var)}
    return picked[::-1], need


def _sub(jaxpr: Jaxpr, invars: list, outvars: list, eqns: list, name: str) -> Jaxpr:
    info = DebugInfo("split_backward", name, None, None).with_unknown_names()
    return Jaxpr(jaxpr.constvars, invars, outvars, eqns, jaxpr.effects, info)


@dataclass(frozen=True)
class BackwardSplit:
    """A pullback cut in two (see the module docstring). ``frontier``: shapes and dtypes of
    what B hands to W; ``dots``: ``dot_general`` equations in B and in W."""

    b: ClosedJaxpr
    w: ClosedJaxpr
    p_tree: Any
    x_tree: Any
    frontier: tuple[jax.ShapeDtypeStruct, ...]
    dots: tuple[int, int]

    def inputs(self, params, stored, g) -> tuple[Any, list]:
        """B: the input cotangent, and what W needs of B's work.

        Args:
            params: the layer's parameters.
            stored: its stored residuals.
            g: the output cotangent.

        Returns:
            ``(dx, frontier)``: ``dx`` shaped like the input; ``frontier`` a list shaped as ``self.frontier``.
        """
        args = [*jax.tree.leaves(params), *stored, *jax.tree.leaves(g)]
        out = jax.core.eval_jaxpr(self.b.jaxpr, self.b.consts, *args)
        n = self.x_tree.num_leaves
        return jax.tree.unflatten(self.x_tree, out[:n]), list(out[n:])

    def weights(self, params, stored, frontier) -> Any:
        """W: the weight gradients.

        Args:
            params: the layer's parameters.
            stored: its stored residuals.
            frontier: what :meth:`inputs` returned beside ``dx``.

        Returns:
            ``dp``, in the structure of ``params``.
        """
        out = jax.core.eval_jaxpr(self.w.jaxpr, self.w.consts, *jax.tree.leaves(params), *stored, *frontier)
        return jax.tree.unflatten(self.p_tree, out)


def split_backward(backward: Callable, params, stored: list, g) -> BackwardSplit:
    """Cut ``backward(params, stored, g) -> (dp, dx)`` into B and W (see the module docstring).

    Args:
        backward: the pullback as a function of the parameters, stored residuals and cotangent.
        params: arrays or ``ShapeDtypeStruct`` of the shapes it will be called with.
        stored: likewise, a list (e.g. :func:`jaxpar.parallel.pipeline._vjp_residuals.split_pullback`'s).
        g: likewise, the output cotangent.

    Returns:
        The :class:`BackwardSplit`.
    """
    closed, (dp_shape, dx_shape) = jax.make_jaxpr(backward, return_shape=True)(params, stored, g)
    jaxpr = closed.jaxpr
    p_tree, x_tree = jax.tree.structure(dp_shape), jax.tree.structure(dx_shape)
    n_p, n_s = p_tree.num_leaves, len(stored)
    dp_out, dx_out = jaxpr.outvars[:n_p], jaxpr.outvars[n_p:]
    b_idx, _ = _needed(jaxpr.eqns, dx_out)
    w_idx, w_reads = _needed(jaxpr.eqns, dp_out, skip=frozenset(b_idx))
    w_reads |= {v for v in dp_out if isinstance(v, Var)}
    # what W reads that only B (or g) has: B's outputs and g, in a fixed order
    g_vars = jaxpr.invars[n_p + n_s:]
    offered = [o for i in b_idx for o in jaxpr.eqns[i].outvars if isinstance(o, Var)] + list(g_vars)
    frontier = [v for v in dict.fromkeys(offered) if v in w_reads]
    b = _sub(jaxpr, jaxpr.invars, [*dx_out, *frontier], [jaxpr.eqns[i] for i in b_idx], "B")
    w = _sub(jaxpr, [*jaxpr.invars[:n_p + n_s], *frontier], dp_out, [jaxpr.eqns[i] for i in w_idx], "W")
    count = lambda idx: sum(jaxpr.eqns[i].primitive.name == "dot_general" for i in idx)   # noqa: E731
    return BackwardSplit(ClosedJaxpr(b, closed.consts), ClosedJaxpr(w, closed.consts), p_tree, x_tree,
                         tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in frontier),
                         (count(b_idx), count(w_idx)))
