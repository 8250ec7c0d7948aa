"""Whether an optimizer can run per pipeline stage, as weight stashing runs it (:mod:`jaxpar.step._stashing_step`).

Weight stashing updates each stage's parameters inside the pipeline, with the stage's own optimizer
state: right only for an optimizer that updates every parameter from its own values and gradients
(SGD, Adam, AdamW...), not one that reads the whole tree (a global norm, clip_by_global_norm) or a
trust ratio over a whole stacked leaf.

>>> import optax
>>> import jax
>>> shapes = {"blocks": jax.ShapeDtypeStruct((4, 3), "float32"), "head": jax.ShapeDtypeStruct((3,), "float32")}
>>> optimizer_is_per_stage(optax.adam(1e-3), shapes, {0}), optimizer_is_per_stage(
...     optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0)), shapes, {0})
(True, False)
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


def optimizer_is_per_stage(tx: optax.GradientTransformation, shapes: Any, block_ids: set) -> bool:
    """Whether ``tx`` updates each stage's parameters from their own values and gradients alone:
    two steps on a small tree of ``shapes``' ranks, whole and split into two stages (block leaves
    by rows, the other leaves alternately), agree.

    Args:
        tx: the optimizer.
        shapes: the parameters' shapes (a tree of ``ShapeDtypeStruct``s or arrays); only ranks are read.
        block_ids: indices of the flattened leaves stacked on ``layers`` (:func:`stacked_block_ids`).

    Returns:
        True when the whole and the split runs agree (to ``rtol=1e-5``).
    """
    leaves, treedef = jax.tree.flatten(shapes)
    rng = np.random.default_rng(0)
    small = [np.asarray(rng.normal(size=(2,) * len(a.shape)), np.float32) for a in leaves]
    grads = [[np.asarray(rng.normal(size=a.shape), np.float32) for a in small] for _ in range(2)]
    outer_b = {i for n, i in enumerate(i for i in range(len(leaves)) if i not in block_ids) if n % 2}

    def run(sel):
        params = [a[sel[i]] if i in block_ids else a for i, a in enumerate(small)]
        state, out = None, None
        for g in grads:
            g = [x[sel[i]] if i in block_ids else x * sel[i] for i, x in enumerate(g)]
            p_tree, g_tree = treedef.unflatten(params), treedef.unflatten(g)
            state = tx.init(p_tree) if state is None else state
            upd, state = tx.update(g_tree, state, p_tree)
            out = treedef.flatten_up_to(optax.apply_updates(p_tree, upd))
            params = out
        return out

    every = slice(None)
    whole = run({i: every if i in block_ids else 1.0 for i in range(len(leaves))})
    for half, rows in ((0, slice(0, 1)), (1, slice(1, 2))):
        own = {i: rows if i in block_ids else float((i in outer_b) == bool(half)) for i in range(len(leaves))}
        got = run(own)
        for i in range(len(leaves)):
            ref = whole[i][rows] if i in block_ids else whole[i]
            if (i in block_ids or own[i]) and not np.allclose(got[i], ref, rtol=1e-5, atol=1e-6):
                return False
    return True


def stacked_block_ids(logical) -> set:
    """The parameter leaves stacked on ``layers`` (the blocks a pipeline splits).

    Args:
        logical: the parameters' logical names (a pytree of ``PartitionSpec`` objects; the layout's ``logical``).

    Returns:
        The indices, among the flattened parameter leaves, of those whose first logical name is ``layers``.
    """
    flat = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
    return {i for i, lg in enumerate(flat) if tuple(lg)[:1] == ("layers",)}
