"""One pipeline stage's share of a lowered program, traced inside the ``shard_map`` over ``pipe``.

:func:`tick_table` turns a lowered :class:`.Program` into ``[ticks, ...]`` int32 arrays
(a :class:`TickTable`): per tick and stage the index of the action kind to run and its
slots, and per tick the send patterns. A :class:`Stage` holds one device's chunks of
layers and runs the actions F / B / W on one slot of its buffers (:mod:`.buffers`);
:func:`tick` runs one row of the table: the stage's action (one boolean ``lax.cond`` per
action kind, :func:`one_of`), then the sends (:func:`exchange`). The executor
(:mod:`.executor`), the no-flush 2BW program (:mod:`.nonstop`) and weight stashing
(:mod:`.stashed`) scan :func:`tick` over the table's rows.

Example:
    >>> from jaxpar.parallel.pipeline import get_schedule, lower
    >>> table = tick_table(lower(get_schedule("1f1b", 2, 4)))
    >>> [k.op for k in table.kinds], table.fwd_pats, table.bwd_pats
    (['B', 'B', 'F', 'F', 'idle'], [((0, 1),)], [((1, 0),)])
    >>> table.rows.kind.shape          # [ticks, stages]
    (10, 2)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.adapters.loss_metrics import with_reported_metrics
from jaxpar.parallel.pipeline.buffers import (PipelineState, Slots, SlotView, TickIO, put, put_tree, read_slots, take, take_tree, write_slots,
                      zeros_like_tree)
from jaxpar.parallel.pipeline.layer_vjp import LayerVJP
from jaxpar.parallel.pipeline.parts import PipelineParts
from jaxpar.parallel.pipeline.instructions import PIPE, Instr, Program, stage_counts

__all__ = ["PIPE", "TICKS_SCOPE", "ActionKind", "TickRow", "TickTable", "tick_table", "Stage",
           "initial_state", "exchange", "tick", "one_of", "stage_counts"]

#: name scope of the tick loop: in the compiled HLO, its ``while``'s ``op_name``
#: ends ``pipeline_ticks/while``
TICKS_SCOPE = "pipeline_ticks"


class ActionKind(NamedTuple):
    """What an instruction needs compiled: one conditional per distinct kind.

    >>> ActionKind.of(Instr("F", first=True, last=False))
    ActionKind(op='F', first=True, last=False)
    """

    op: str              # 'idle' | 'F' | 'B' | 'W'
    first: bool = False  # virtual stage 0: F runs ``pre``, B backprops it
    last: bool = False   # last virtual stage: F runs ``post``

    @classmethod
    def of(cls, instr: Instr) -> "ActionKind":
        """The kind of ``instr`` (``first`` only for F / B, ``last`` only for F)."""
        return cls(instr.op, instr.first and instr.op in ("F", "B"), instr.last and instr.op == "F")


class TickRow(NamedTuple):
    """One row of the lowered table; the scan runs over a ``[ticks, ...]`` stack of them."""

    kind: Any       # [p]: index of each stage's branch
    slots: Slots    # each [p]
    fwd_pat: Any    # index of the forward send pattern (0: none), the same on every device
    bwd_pat: Any
    fwd_recv: Any   # [p]: inbox_f slot the received activation goes to (n_fwd: discarded)
    bwd_recv: Any   # [p]: inbox_b slot the received cotangent goes to (n_bwd: discarded)


class TickTable(NamedTuple):
    """A lowered program as arrays: its rows and what their indices refer to."""

    kinds: list        # the distinct ActionKinds: branch i runs kinds[i]
    fwd_pats: list     # the distinct sets of (source, target) pairs sending forward / backward
    bwd_pats: list
    rows: TickRow      # [ticks, ...] int32


def tick_table(program: Program) -> TickTable:
    """The lowered table as ``[ticks, ...]`` int32 arrays, and what its indices refer to.

    Args:
        program: a lowered schedule (:func:`.lower`).

    Returns:
        The distinct action kinds (sorted; a row's ``kind`` indexes them), the distinct
        forward and backward send patterns (a row's ``fwd_pat`` / ``bwd_pat`` is the index
        plus one, 0 for no send), and the rows.
    """
    ticks = program.ticks
    kinds = sorted({ActionKind.of(i) for t in ticks for i in t.instrs})
    fwd_pats = sorted({t.fwd_pairs for t in ticks if t.fwd_pairs})
    bwd_pats = sorted({t.bwd_pairs for t in ticks if t.bwd_pairs})
    per_stage = lambda f: np.array([[f(i) for i in t.instrs] for t in ticks], np.int32)   # noqa: E731
    per_tick = lambda f: np.array([f(t) for t in ticks], np.int32)                     # noqa: E731
    pattern = lambda pats, pairs: pats.index(pairs) + 1 if pairs else 0                # noqa: E731
    rows = TickRow(
        kind=per_stage(lambda i: kinds.index(ActionKind.of(i))),
        slots=Slots(*(per_stage(lambda i, a=a: getattr(i, a))
                      for a in ("microbatch", "chunk", "res", "inbox", "dy", "grad"))),
        fwd_pat=per_tick(lambda t: pattern(fwd_pats, t.fwd_pairs)),
        bwd_pat=per_tick(lambda t: pattern(bwd_pats, t.bwd_pairs)),
        fwd_recv=per_tick(lambda t: t.fwd_recv), bwd_recv=per_tick(lambda t: t.bwd_recv))
    return TickTable(kinds, fwd_pats, bwd_pats, rows)


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
        """The layers' parameters an action on ``sl`` uses (one chunk, ``[Lmax, ...]``)."""
        return take_tree(self.blocks, sl.chunk)

    def outer_params(self, sl: Slots):
        """The parameters of ``pre`` / ``post`` an action on ``sl`` uses."""
        return self.outer

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action on ``sl`` reads of ``st`` (inside its conditional)."""
        return read_slots(st, sl)

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """``st`` with what the action on ``sl`` hands back written to its slots."""
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
        """``(y, res)``: one chunk on one micro-batch, each layer's stored residuals written to
        ``res[slot, layer]``."""
        def one(carry, item):
            h, bufs = carry
            y, stored = self.lv.forward(item[0], h)
            return (y, [_set(b, slot, item[-1], r) for b, r in zip(bufs, stored)]), None

        return jax.lax.scan(self._each_layer(one, n), (x, res),
                            (bp, jnp.arange(self.lmax)))[0]

    def backward_layers(self, bp, res, slot, dy, n, acc, gslot=None):
        """Reverse over the chunk's layers from ``dy`` on the residuals ``res[slot]``:
        ``(dx, acc)``, each layer's weight gradients added to ``acc`` (``[Lmax, ...]``); with a
        split backward, ``acc`` is the frontier buffers and each layer's frontier goes to
        ``acc[gslot, layer]``, kept for W."""
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
        """``acc`` plus each layer's weight gradients, from the residuals ``res[slot]`` and the
        frontier ``gys[gslot]`` a split B kept."""
        def one(acc, item):
            layer = item[-1]
            dp = self.lv.split.weights(item[0], [_at(b, slot, layer) for b in res],
                                       [_at(b, gslot, layer) for b in gys])
            return _add_at(acc, layer, dp), None

        return jax.lax.scan(self._each_layer(one, n), acc,
                            (bp, jnp.arange(self.lmax)))[0]

    def branch(self, kind: ActionKind) -> Callable[[SlotView, Slots], TickIO]:
        """The action of ``kind``: ``(view, slots) -> TickIO``."""
        if kind.op == "idle":
            return lambda view, sl: self._unchanged(view)
        action = {"F": self.forward, "B": self.backward, "W": self.weights}[kind.op]
        return lambda view, sl: action(kind, view, sl)

    def forward(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """F: ``pre`` (first), the chunk's layers, then ``post`` (last: keeps d loss / d y, adds its
        gradient of ``outer`` and what the loss reported) or a send to the next virtual stage."""
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
        pullback into the gradient of ``outer`` (first) or a send to the previous virtual stage."""
        dx, io = self.chunk_backward(view, sl)
        mb = take_tree(self.mbs, sl.mb)
        if not kind.first:
            return io._replace(send_b=self._cast(dx))
        _, pull = jax.vjp(lambda q: self.parts.pre(q, mb), self.outer_params(sl))
        return io._replace(g_outer=_accumulate(view.g_outer, pull(self._cast(dx))[0]))

    def chunk_backward(self, view: SlotView, sl: Slots) -> tuple[Any, TickIO]:
        """The chunk's pullbacks on ``sl``: ``(dx, io)``, ``io`` with the chunk's weight gradients
        added (fused) or its frontier written (split)."""
        bp, n, io = self.chunk_params(sl), self.n_layers[sl.chunk], self._unchanged(view)
        if self.split:
            dx, gys = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.gys, gslot=sl.grad)
            return dx, io._replace(gys=gys)
        dx, g_chunk = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.g_chunk)
        return dx, io._replace(g_chunk=g_chunk)

    def weights(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """W (split backward): the chunk's weight gradients from the cotangents B kept."""
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


def _send(pats: list, pat, x):
    """``x`` along the tick's pairs (``pats[pat - 1]``; 0: nothing moves). ``pat`` is
    the same on every device, so each ``ppermute`` runs on all of them or none."""
    fns = [zeros_like_tree] + [lambda y, q=q: jax.lax.ppermute(y, PIPE, q) for q in pats]
    return jax.lax.switch(pat, fns, x) if len(fns) > 1 else fns[0](x)


def exchange(st: PipelineState, table: TickTable, row: TickRow, s, send_f, send_b) -> PipelineState:
    """The tick's sends each way over ``pipe``; what arrives goes to its inbox slot.

    Args:
        st: the stage's state.
        table: the program's table (its send patterns).
        row: the tick's row.
        s: this stage's index on ``pipe``.
        send_f: the activation this stage sends forward (zeros when none).
        send_b: the cotangent this stage sends backward (zeros when none).

    Returns:
        ``st`` with what this stage receives written to its inbox slots.
    """
    inbox_f = put_tree(st.inbox_f, take(row.fwd_recv, s), _send(table.fwd_pats, row.fwd_pat, send_f))
    inbox_b = put_tree(st.inbox_b, take(row.bwd_recv, s), _send(table.bwd_pats, row.bwd_pat, send_b))
    return st._replace(inbox_f=inbox_f, inbox_b=inbox_b)


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


def one_of(kind, kinds: list, act: Callable, carry: tuple) -> tuple:
    """Run the action of kind ``kind`` on ``carry``, with one boolean ``cond`` per kind.

    Each ``cond`` that is not idle reads and writes the carried buffers in place (an index
    ``switch`` copies every buffer its branches pass through).

    Args:
        kind: the index into ``kinds`` of the action to run (traced).
        kinds: the distinct kinds; the first field of each is its op (``'idle'`` runs nothing).
        act: ``act(i)`` is the function ``(*carry) -> carry`` of ``kinds[i]``.
        carry: the values the action reads and writes.

    Returns:
        ``act(kind)(*carry)``, or ``carry`` if ``kinds[kind]`` is idle.
    """
    for i, k in enumerate(kinds):
        if k[0] != "idle":
            carry = jax.lax.cond(kind == i, act(i), lambda *a: a, *carry)
    return carry
