"""One pipeline stage's share of a lowered program, traced inside the ``shard_map`` over ``pipe``.

A :class:`Stage` holds one device's chunks of layers and runs the actions F / B / W on one slot
of its buffers (:mod:`._buffers`); :func:`tick` runs one row of the table
(:func:`~jaxpar.parallel.pipeline._tick_arrays.tick_table`, re-exported here): the stage's action
(one boolean ``lax.cond`` per action kind, :func:`one_of`), then the sends (:func:`exchange`).
The executor (:mod:`._executor`) scans :func:`tick` over the table's rows; PipeDream's no-flush
programs run the same actions on weight versions (:mod:`._versioned_stage`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.adapters._loss_metrics import with_reported_metrics
from jaxpar.parallel.pipeline._buffers import (PipelineState, Slots, SlotView, TickIO, put, read_slots, take, take_tree, write_slots,
                                               zeros_like_tree)
from jaxpar.parallel.pipeline._layer_vjp import LayerVJP
from jaxpar.parallel.pipeline._parts import PipelineParts
from jaxpar.parallel.pipeline._instructions import PIPE, Program, stage_counts
from jaxpar.parallel.pipeline._tick_arrays import ActionKind, TickRow, TickTable, exchange, one_of, tick_table

#: name scope of the tick loop: in the compiled HLO, its ``while``'s ``op_name``
#: ends ``pipeline_ticks/while``
TICKS_SCOPE = "pipeline_ticks"


def _at(buf, slot, layer):
    """``buf[slot, layer]`` of a slotted per-layer buffer ``[n, Lmax, ...]``."""
    start = (slot, layer) + (0,) * (buf.ndim - 2)
    return jax.lax.dynamic_slice(buf, start, (1, 1, *buf.shape[2:]))[0, 0]


def _set(buf, slot, layer, value):
    """``buf`` with ``buf[slot, layer] = value`` (in place in a loop)."""
    start = (slot, layer) + (0,) * (buf.ndim - 2)
    return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype)[None, None], start)


def _add_at(acc, layer, grads):
    """``acc`` (``[Lmax, ...]`` per leaf) with ``grads`` added to layer ``layer``, in ``acc``'s dtypes."""
    return jax.tree.map(lambda a, d: put(a, layer, take(a, layer) + d.astype(a.dtype)), acc, grads)


def _accumulate(acc: Any, grads: Any) -> Any:
    """``acc + grads`` leaf by leaf, in ``acc``'s dtypes."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, grads)


class Stage:
    """One device's share of the program, traced inside the ``shard_map``: its chunks'
    layers (``blocks``: ``[v, Lmax, ...]``), ``outer``, the micro-batches, and the
    actions F / B / W on one slot of each buffer.

    Subclasses change which parameters an action uses (:meth:`chunk_params`,
    :meth:`outer_params`) and how it reads and writes the state (:meth:`read`, :meth:`write`).

    Args:
        parts: the model's ``pre``, ``layer`` and ``post``.
        program: the lowered schedule.
        counts: real layers per virtual stage, ``[chunk, stage]`` (:func:`stage_counts`).
        outer: the parameters of ``pre`` and ``post``.
        blocks: this device's layers, ``[v, Lmax, ...]`` per leaf.
        mbs: the micro-batches, ``[m, rows, ...]`` per leaf.
    """

    def __init__(self, parts: PipelineParts, program: Program, counts: np.ndarray, outer, blocks, mbs):
        self.parts, self.outer, self.blocks, self.mbs = parts, outer, blocks, mbs
        self.m, self.split = program.schedule.num_microbatches, program.split_backward
        self.lmax = int(counts.max())
        self.uneven = bool((counts != self.lmax).any())
        self.index = jax.lax.axis_index(PIPE)
        self.n_layers = take(jnp.asarray(counts.T), self.index)       # [v]: real layers per chunk here
        self.x = jax.eval_shape(parts.pre, outer, take_tree(mbs, 0))
        self.post = with_reported_metrics(parts.post)        # (loss, what it reported)
        self.metrics = jax.eval_shape(self.post, outer, self.x, take_tree(mbs, 0))[1]
        self.lv = LayerVJP(parts.layer, take_tree(take_tree(blocks, 0), 0), self.x, split=self.split)

    def _cast(self, a):
        """``a`` (a value or cotangent of the activation) in the activation's dtypes, leaf by leaf."""
        return jax.tree.map(lambda v, like: v.astype(like.dtype), a, self.x)

    def nothing(self):
        """Zeros shaped like the activation: what a stage that sends nothing sends."""
        return zeros_like_tree(self.x)

    def chunk_params(self, sl: Slots):
        """The layers' parameters an action uses.

        Args:
            sl: the action's slots (its ``chunk``).

        Returns:
            One chunk's layers, ``[Lmax, ...]`` per leaf.
        """
        return take_tree(self.blocks, sl.chunk)

    def outer_params(self, sl: Slots):
        """The parameters of ``pre`` / ``post`` an action uses.

        Args:
            sl: the action's slots.

        Returns:
            ``outer`` (a subclass may pick a version by ``sl``).
        """
        return self.outer

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action reads of the state (inside its conditional).

        Args:
            st: the stage's state.
            sl: the action's slots.

        Returns:
            The :class:`~jaxpar.parallel.pipeline._buffers.SlotView` of ``st`` at ``sl``.
        """
        return read_slots(st, sl)

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """Write back what an action hands back.

        Args:
            st: the stage's state.
            sl: the action's slots.
            io: what the action hands back (``None`` fields: not written).

        Returns:
            ``st`` with ``io`` written to its slots.
        """
        return write_slots(st, sl, io)

    def _unchanged(self, view: SlotView) -> TickIO:
        """No slot written (``None``), the sums as they were; nothing sent."""
        return TickIO(None, None, view.g_outer, None, view.loss, None, self.nothing(), self.nothing())

    def _each_layer(self, one: Callable, n) -> Callable:
        """A scan step: ``one`` on a real layer, nothing on padding (the item's last entry is
        the layer index; the check is compiled only when some stage is short)."""
        if not self.uneven:
            return one
        return lambda carry, item: jax.lax.cond(item[-1] < n, one, lambda c, _: (c, None), carry, item)

    def forward_layers(self, bp, x, n, res, slot):
        """One chunk's layers forward on one micro-batch.

        Args:
            bp: the chunk's layers, ``[Lmax, ...]`` per leaf.
            x: the chunk's input activation.
            n: the chunk's real layers (the rest is padding, skipped).
            res: the residual buffers, ``[n_res, Lmax, ...]`` each.
            slot: the residual slot to write.

        Returns:
            ``(y, res)``: the output, and ``res`` with each layer's residuals at ``[slot, layer]``.
        """
        def one(carry, item):
            h, bufs = carry
            y, stored = self.lv.forward(item[0], h)
            return (y, [_set(b, slot, item[-1], r) for b, r in zip(bufs, stored)]), None

        return jax.lax.scan(self._each_layer(one, n), (x, res),
                            (bp, jnp.arange(self.lmax)))[0]

    def backward_layers(self, bp, res, slot, dy, n, acc, gslot=None):
        """Reverse over the chunk's layers from ``dy`` on the residuals ``res[slot]``.

        Args:
            bp: the chunk's layers, ``[Lmax, ...]`` per leaf.
            res: the residual buffers.
            slot: the residual slot F wrote.
            dy: the cotangent of the chunk's output.
            n: the chunk's real layers.
            acc: the weight gradients, ``[Lmax, ...]`` per leaf; with a split backward the
                frontier buffers.
            gslot: the frontier slot (split backward only).

        Returns:
            ``(dx, acc)``: each layer's weight gradients added to ``acc``, or with a split backward
            each layer's frontier at ``acc[gslot, layer]``, kept for W.
        """
        def one(carry, item):
            g, acc = carry
            stored = [_at(b, slot, item[-1]) for b in res]
            if self.split:
                dx, front = self.lv.split.inputs(item[0], stored, g)
                return (dx, [_set(b, gslot, item[-1], f) for b, f in zip(acc, front)]), None
            dp, dx = self.lv.pullback(item[0], stored)(g)
            return (dx, _add_at(acc, item[-1], dp)), None

        return jax.lax.scan(self._each_layer(one, n), (dy, acc),
                            (bp, jnp.arange(self.lmax)), reverse=True)[0]

    def weight_layers(self, bp, res, gys, slot, gslot, n, acc):
        """W of a split backward: the chunk's weight gradients from what B kept.

        Args:
            bp: the chunk's layers, ``[Lmax, ...]`` per leaf.
            res, slot: the residual buffers and the slot F wrote.
            gys, gslot: the frontier buffers and the slot B wrote.
            n: the chunk's real layers.
            acc: the weight gradients, ``[Lmax, ...]`` per leaf.

        Returns:
            ``acc`` plus each layer's weight gradients.
        """
        def one(acc, item):
            layer = item[-1]
            dp = self.lv.split.weights(item[0], [_at(b, slot, layer) for b in res],
                                       [_at(b, gslot, layer) for b in gys])
            return _add_at(acc, layer, dp), None

        return jax.lax.scan(self._each_layer(one, n), acc,
                            (bp, jnp.arange(self.lmax)))[0]

    def branch(self, kind: ActionKind) -> Callable[[SlotView, Slots], TickIO]:
        """The action of a kind.

        Args:
            kind: the action kind.

        Returns:
            ``(view, slots) -> TickIO``: F, B, W, or nothing for idle.
        """
        if kind.op == "idle":
            return lambda view, sl: self._unchanged(view)
        action = {"F": self.forward, "B": self.backward, "W": self.weights}[kind.op]
        return lambda view, sl: action(kind, view, sl)

    def forward(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """F: ``pre`` (first), the chunk's layers, then ``post`` (last: keeps d loss / d y, adds its
        gradient of ``outer`` and what the loss reported) or a send to the next virtual stage.

        Args:
            kind, view, sl: the action's kind, what it reads (:meth:`read`) and its slots.

        Returns:
            What it hands back (:meth:`write` writes it).
        """
        n, bp, mb = self.n_layers[sl.chunk], self.chunk_params(sl), take_tree(self.mbs, sl.mb)
        outer = self.outer_params(sl)
        x = self.parts.pre(outer, mb) if kind.first else view.x
        y, res = self.forward_layers(bp, x, n, view.res, sl.res)
        io = self._unchanged(view)._replace(res=res)
        if not kind.last:
            return io._replace(send_f=self._cast(y))
        (loss, found), (g_outer, dy) = jax.value_and_grad(self.post, argnums=(0, 1), has_aux=True)(outer, y, mb)
        return io._replace(loss=view.loss + loss.astype(jnp.float32),
                           dy_out=self._cast(jax.tree.map(lambda d: d / self.m, dy)),
                           metrics=jax.tree.map(jnp.add, view.metrics, found),
                           g_outer=jax.tree.map(lambda a, d: a + d.astype(a.dtype) / self.m, view.g_outer, g_outer))

    def backward(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """B: the stored pullbacks in reverse on the received cotangent, then ``pre``'s
        pullback into the gradient of ``outer`` (first) or a send to the previous virtual stage.

        Args:
            kind, view, sl: the action's kind, what it reads (:meth:`read`) and its slots.

        Returns:
            What it hands back (:meth:`write` writes it).
        """
        dx, io = self.chunk_backward(view, sl)
        mb = take_tree(self.mbs, sl.mb)
        if not kind.first:
            return io._replace(send_b=self._cast(dx))
        _, pull = jax.vjp(lambda q: self.parts.pre(q, mb), self.outer_params(sl))
        return io._replace(g_outer=_accumulate(view.g_outer, pull(self._cast(dx))[0]))

    def chunk_backward(self, view: SlotView, sl: Slots) -> tuple[Any, TickIO]:
        """The chunk's pullbacks.

        Args:
            view, sl: what the action reads (:meth:`read`) and its slots.

        Returns:
            ``(dx, io)``: ``io`` with the chunk's weight gradients added (fused) or its frontier
            written (split).
        """
        bp, n, io = self.chunk_params(sl), self.n_layers[sl.chunk], self._unchanged(view)
        if self.split:
            dx, gys = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.gys, gslot=sl.grad)
            return dx, io._replace(gys=gys)
        dx, g_chunk = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.g_chunk)
        return dx, io._replace(g_chunk=g_chunk)

    def weights(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """W (split backward): the chunk's weight gradients from the cotangents B kept.

        Args:
            kind, view, sl: the action's kind, what it reads (:meth:`read`) and its slots.

        Returns:
            What it hands back (:meth:`write` writes it).
        """
        g_chunk = self.weight_layers(self.chunk_params(sl), view.res, view.gys, sl.res, sl.grad,
                                     self.n_layers[sl.chunk], view.g_chunk)
        return self._unchanged(view)._replace(g_chunk=g_chunk)


def initial_state(program: Program, stage: Stage) -> PipelineState:
    """The stage's buffers before the first tick: every slot and sum zero.

    Args:
        program: the lowered schedule (its slot counts size the buffers).
        stage: the stage (its layer's residual and frontier shapes, its parameters).

    Returns:
        Residual, inbox and frontier buffers of zeros, and float32 zero sums.
    """
    x, lmax = stage.x, stage.lmax
    buf = lambda n, shape, dtype: jnp.zeros((max(n, 1), *shape), dtype)           # noqa: E731
    f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)   # noqa: E731
    return PipelineState(
        res=[buf(program.n_res, (lmax, *r.shape), r.dtype) for r in stage.lv.stored],
        inbox_f=jax.tree.map(lambda a: buf(program.n_fwd + 1, a.shape, a.dtype), x),
        inbox_b=jax.tree.map(lambda a: buf(program.n_bwd + 1, a.shape, a.dtype), x),
        grads_y=[buf(program.n_grad, (lmax, *f.shape), f.dtype) for f in stage.lv.split.frontier]
        if stage.lv.split else [],
        g_blocks=f32(stage.blocks), g_outer=f32(stage.outer), loss=jnp.zeros((), jnp.float32),
        metrics=f32(stage.metrics))


def tick(stage: Stage, table: TickTable, branches: list, st: PipelineState, row: TickRow):
    """One tick: this stage's action on its slots of the buffers, then the sends.

    One boolean ``cond`` per action kind (at most one runs): its branch reads and writes
    the buffers in place. (A ``switch`` over all kinds, or a ``cond`` on slots read
    outside it, would copy what passes through: the residuals twice per tick.)

    Args:
        stage: the stage.
        table: the program's table.
        branches: the action of each of ``table.kinds`` (:meth:`Stage.branch`).
        st: the state before the tick.
        row: the tick's row.

    Returns:
        ``(state after the tick, None)``: a ``lax.scan`` step over the table's rows.
    """
    sl = Slots(*(take(a, stage.index) for a in row.slots))
    none = stage.nothing()

    def act(i):
        def run(st, send_f, send_b):
            io = branches[i](stage.read(st, sl), sl)
            return stage.write(st, sl, io), io.send_f, io.send_b
        return run

    st, send_f, send_b = one_of(take(row.kind, stage.index), table.kinds, act, (st, none, none))
    return exchange(st, table, row, stage.index, send_f, send_b), None
