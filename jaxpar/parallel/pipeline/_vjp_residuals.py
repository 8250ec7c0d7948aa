"""Keep a ``jax.vjp`` pullback's residuals without the parameters it closes over.

A layer's pullback holds its own parameters among its residuals. Code that
stores residuals for later (the pipeline executor's buffers, the explicit
data-parallel block's custom VJP) should not store those: it has the parameters
at the backward anyway (or gathers them again). :func:`split_pullback` keeps the
other leaves and notes where the parameters go (matched by identity: the very
arrays, or tracers, passed to ``jax.vjp``); :func:`join_pullback` rebuilds the
pullback from the stored leaves and the parameters.

Example:
    >>> import jax, jax.numpy as jnp
    >>> params, x = {"w": jnp.ones((2, 2))}, jnp.ones((3, 2))
    >>> y, pullback = jax.vjp(lambda p, x: jnp.tanh(x @ p["w"]), params, x)
    >>> stored, layout = split_pullback(pullback, params)
    >>> dp, dx = join_pullback(layout, stored, params)(jnp.ones_like(y))
    >>> dp["w"].shape, dx.shape
    ((2, 2), (3, 2))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax

from jaxpar.errors import PipelineCutError


@dataclass(frozen=True)
class ResidualLayout:
    """Where each leaf of a pullback comes from.

    - ``tree``: the pullback's pytree structure.
    - ``from_params``: per leaf, the index of the parameter leaf it is, or
      ``None`` for a leaf that is stored.
    - ``stored``: ``(shape, dtype)`` of each stored leaf, in order.
    """

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
        like: the layout of an earlier trace of the same function; a ``RuntimeError`` if this one
            differs (stored leaves would be misread).

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
    """Inverse of :func:`split_pullback`: the pullback, with ``params`` put back in.

    Args:
        layout: the :class:`ResidualLayout` :func:`split_pullback` returned.
        stored: its stored leaves, in order.
        params: the parameters (the same structure as at the split; may be new values).

    Returns:
        The pullback, ``dy -> cotangents of jax.vjp's primals``.
    """
    if len(stored) != len(layout.stored):
        raise PipelineCutError(f"join_pullback: got {len(stored)} stored residuals; the layout has "
                               f"{len(layout.stored)}. Pass the list split_pullback returned, in its order.")
    whole, it = jax.tree.leaves(params), iter(stored)
    leaves = [next(it) if i is None else whole[i] for i in layout.from_params]
    return jax.tree.unflatten(layout.tree, leaves)
