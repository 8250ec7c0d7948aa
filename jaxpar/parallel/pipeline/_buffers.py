"""The slotted buffers a pipeline stage carries through its tick loop, and one action's view of them.

Each buffer has a leading slot axis sized by the lowered program (:mod:`._instructions`): the
residuals of the forwards waiting for their backward, the inboxes of received activations and
cotangents, and the split backward's frontier kept for W. An action reads a :class:`SlotView` and
hands back a :class:`TickIO`, which the stage writes into the :class:`PipelineState`. The
indices come from the table's row for the tick (traced), so every read and write is a
``dynamic_slice`` / ``dynamic_update_slice``.

Example:
    >>> import jax.numpy as jnp
    >>> buf = jnp.zeros((3, 2))
    >>> put(buf, 1, jnp.ones(2)).tolist()
    [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    >>> take(jnp.arange(6).reshape(3, 2), 2).tolist()
    [4, 5]
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Slots(NamedTuple):
    """One stage's instruction at one tick (int32; ``[ticks, p]`` in the table). See :class:`~._instructions.Instr`."""

    mb: Any      # micro-batch
    chunk: Any   # which of the device's ``v`` chunks
    res: Any     # residual slot
    inbox: Any   # F: inbox_f slot read; B: inbox_b slot read
    dy: Any      # F (last): inbox_b slot written with d loss / d y
    grad: Any    # grads_y slot: B (split) writes, W reads


class PipelineState(NamedTuple):
    """What the tick loop carries: the slotted buffers of :mod:`._instructions` and the sums."""

    res: list          # per stored residual: [n_res, Lmax, ...]
    inbox_f: Any       # per leaf of the activation x: [n_fwd + 1, *x]; the extra slot takes what a non-receiver gets
    inbox_b: Any       # per leaf: [n_bwd + 1, *x]
    grads_y: list      # per frontier value: [n_grad, Lmax, ...]: split B's hand-over to W
    g_blocks: Any      # float32 [v, Lmax, ...]
    g_outer: Any       # float32, like ``outer``
    loss: Any          # float32: sum of the micro-batch losses
    metrics: Any = None  # float32: sums of what the loss reported (jaxpar.report_metric)


class TickIO(NamedTuple):
    """What an action hands back: the slots it writes (``None``: left alone), the sums and the sends."""

    dy_out: Any        # -> inbox_b[dy]: F (last) writes d loss / d y
    g_chunk: Any       # -> g_blocks[chunk]
    g_outer: Any
    gys: list          # the frontier buffers, B (split) having written slot ``grad``
    loss: Any
    res: list          # the residual buffers, F having written slot ``res``
    send_b: Any        # B's cotangent for the previous virtual stage (zeros: none; the tick's pairs say who gets it)
    send_f: Any        # F's activation for the next virtual stage (likewise)
    metrics: Any = None  # F (last): the sums with what the loss reported added


class SlotView(NamedTuple):
    """What an action reads: one slot of the inboxes and of the gradient sum, and the
    residual and frontier buffers whole (the layer loops index them at the action's slot, so
    no slot is copied out or back)."""

    dy: Any            # inbox_b[inbox]: B's received cotangent
    g_chunk: Any       # g_blocks[chunk]
    g_outer: Any
    gys: list          # grads_y: B (split) writes slot ``grad``, W reads it
    loss: Any
    res: list          # res: F writes slot ``res``, B and W read it
    x: Any             # inbox_f[inbox]: F's received activation
    metrics: Any = None  # the sums of what the loss reported


def take(buf, i):
    """``buf[i]`` along its leading axis (``i`` an int or a traced int32 scalar)."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def take_tree(tree, i):
    """Entry ``i`` of every leaf of ``tree`` along its leading axis."""
    return jax.tree.map(lambda a: take(a, i), tree)


def put(buf, i, value):
    """``buf`` with entry ``i`` of its leading axis set to ``value`` (cast to ``buf``'s dtype; in place in a loop)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def put_tree(tree, i, values):
    """Every leaf of ``tree`` with entry ``i`` of its leading axis set to the matching leaf of ``values``."""
    return jax.tree.map(lambda b, v: put(b, i, v), tree, values)


def zeros_like_tree(tree: Any) -> Any:
    """Zeros shaped like every leaf of ``tree`` (arrays or shapes)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
