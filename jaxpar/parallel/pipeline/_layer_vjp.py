"""One layer's ``jax.vjp`` as a pipeline stage keeps it: the residuals it stores, and the backward split
into its input part (B) and its weight part (W).

A stage runs each layer's forward once and its backward ticks later, so it keeps the pullback's
residuals in slotted buffers (:mod:`._buffers`). A pullback holds the layer's own parameters among
its residuals; :func:`split_pullback` keeps the other leaves (the parameters matched by identity:
the very arrays, or tracers, passed to ``jax.vjp``) and :func:`join_pullback` rebuilds it with the
parameters passed back in (the explicit data-parallel block's custom VJP uses both too).

A zero-bubble schedule runs the backward in two actions: **B** the input cotangent (the next stage
waits for it), **W** the weight gradients, later, in what would be a bubble. :func:`split_backward`
traces the pullback to a jaxpr once and cuts it by what each output needs: B is every equation
``dx`` depends on, and also returns the *frontier* (the values it computes, or receives: ``g``, that
W's equations read); W is every other equation ``dp`` depends on. Each equation runs in exactly one
of the two, so B + W costs one backward.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def layer(p, x):
    ...     return jnp.tanh(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)) * 0.1, "w2": jnp.ones((8, 4)) * 0.1}
    >>> y, pullback = jax.vjp(layer, p, jnp.ones((2, 4)))
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
from typing import Any, Callable, Optional, Sequence

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Var

from jaxpar.errors import PipelineCutError


# ----------------------------------------------------------------------------- the stored residuals
@dataclass(frozen=True)
class ResidualLayout:
    """Where each leaf of a pullback comes from: ``tree`` its structure; ``from_params`` per leaf the
    index of the parameter leaf it is, or ``None`` for a stored leaf; ``stored`` ``(shape, dtype)`` of
    each stored leaf, in order."""

    tree: Any
    from_params: tuple[Optional[int], ...]
    stored: tuple[tuple[tuple[int, ...], Any], ...]


def split_pullback(pullback: Callable, params: Any, *,
                   like: Optional[ResidualLayout] = None) -> tuple[list, ResidualLayout]:
    """Split ``pullback`` into its leaves that are not leaves of ``params``, and where the others go.

    Args:
        pullback: the pullback ``jax.vjp`` returned.
        params: the same ``params`` object(s) passed to ``jax.vjp`` (identity, not value, decides);
            call it where ``jax.vjp`` ran.
        like: the layout of an earlier trace of the same function; an error if this one differs
            (stored leaves would be misread).

    Returns:
        ``(stored, layout)``: the leaves to keep (a list) and the :class:`ResidualLayout`.
    """
    leaves, tree = jax.tree.flatten(pullback)
    position = {id(q): i for i, q in enumerate(jax.tree.leaves(params))}
    from_params = tuple(position.get(id(leaf)) for leaf in leaves)
    stored = [leaf for leaf, i in zip(leaves, from_params) if i is None]
    layout = ResidualLayout(tree, from_params, tuple((tuple(r.shape), r.dtype) for r in stored))
    if like is not None and (layout.from_params, layout.stored) != (like.from_params, like.stored):
        raise PipelineCutError("split_pullback: the residuals differ between two traces of the same function, so "
                               "stored residuals could be misread. Make the function's inputs opaque residuals "
                               "(jax.lax.optimization_barrier on them) or recompute them (remat 'full'), and "
                               "please report the function.")
    return stored, layout


def join_pullback(layout: ResidualLayout, stored: Sequence, params: Any) -> Callable:
    """Inverse of :func:`split_pullback`: the pullback ``dy -> cotangents of jax.vjp's primals``, with
    ``params`` (the same structure as at the split; may be new values) put back in."""
    if len(stored) != len(layout.stored):
        raise PipelineCutError(f"join_pullback: got {len(stored)} stored residuals; the layout has "
                               f"{len(layout.stored)}. Pass the list split_pullback returned, in its order.")
    whole, it = jax.tree.leaves(params), iter(stored)
    leaves = [next(it) if i is None else whole[i] for i in layout.from_params]
    return jax.tree.unflatten(layout.tree, leaves)


# ----------------------------------------------------------------------------- B and W
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
        """B: ``(dx, frontier)`` from the layer's parameters, stored residuals and output cotangent."""
        args = [*jax.tree.leaves(params), *stored, *jax.tree.leaves(g)]
        out = jax.core.eval_jaxpr(self.b.jaxpr, self.b.consts, *args)
        n = self.x_tree.num_leaves
        return jax.tree.unflatten(self.x_tree, out[:n]), list(out[n:])

    def weights(self, params, stored, frontier) -> Any:
        """W: the weight gradients (in the structure of ``params``) from what :meth:`inputs` kept."""
        out = jax.core.eval_jaxpr(self.w.jaxpr, self.w.consts, *jax.tree.leaves(params), *stored, *frontier)
        return jax.tree.unflatten(self.p_tree, out)


def split_backward(backward: Callable, params, stored: list, g) -> BackwardSplit:
    """Cut ``backward(params, stored, g) -> (dp, dx)`` into B and W (see the module docstring).

    Args:
        backward: the pullback as a function of the parameters, stored residuals and cotangent.
        params: arrays or ``ShapeDtypeStruct`` of the shapes it will be called with.
        stored: likewise, a list (e.g. :func:`split_pullback`'s).
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


# ----------------------------------------------------------------------------- one layer
class LayerVJP:
    """Static structure of one layer's ``jax.vjp``: which residuals are stored (not the layer's own
    parameters, passed back in) and their shapes; with ``split``, the pullback cut into B and W.

    Args:
        layer: ``layer(params, x) -> y``, with ``y`` shaped like ``x``.
        p_shapes: one layer's parameters (arrays or ``ShapeDtypeStruct``).
        x_shape: the layer's input.
        split: also cut the pullback into its input part (B) and weight part (W).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> lv = LayerVJP(lambda w, x: jnp.tanh(x @ w), jnp.ones((3, 3)), jax.ShapeDtypeStruct((2, 3), jnp.float32))
        >>> y, stored = lv.forward(0.5 * jnp.ones((3, 3)), jnp.ones((2, 3)))
        >>> y.shape, len(stored) == len(lv.stored)
        ((2, 3), True)
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
        """``(y, stored)``: the layer's output and the residuals to keep (shaped as ``self.stored``)."""
        y, pullback = jax.vjp(self.layer, p, x)
        return y, split_pullback(pullback, p, like=self.layout)[0]

    def pullback(self, p, stored):
        """The layer's pullback ``dy -> (dp, dx)``, rebuilt from its parameters and :meth:`forward`'s residuals."""
        return join_pullback(self.layout, stored, p)
