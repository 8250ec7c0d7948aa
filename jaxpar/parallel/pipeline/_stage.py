"""One pipeline stage's share of a lowered program, traced inside the ``shard_map`` over ``pipe``: the
program as arrays (:func:`tick_table`), the :class:`Stage` and its actions F / B / W on one slot of its
buffers (:mod:`._buffers`), and the tick (:func:`run_ticks`: the stage's action, then the sends).

Example:
    >>> from jaxpar.parallel.pipeline import get_schedule, lockstep, lower
    >>> table = tick_table(lower(get_schedule("1f1b", 2, 4)))
    >>> [k.op for k in table.kinds], table.fwd_pats, table.bwd_pats, table.rows.kind.shape
    (['B', 'B', 'F', 'F', 'idle'], [((0, 1),)], [((1, 0),)], (10, 2))
    >>> table = tick_table(lower(lockstep(get_schedule("1f1b", 2, 4))), lockstep=True)
    >>> [k.op for k in table.kinds], table.rows.kind.shape, table.rows.flags.acts.shape
    (['B', 'F'], (10,), (10, 2))
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.adapters._loss_metrics import with_reported_metrics
from jaxpar.parallel.pipeline._buffers import (PipelineState, Slots, SlotView, TickIO, put, put_tree, take, take_tree,
                                               zeros_like_tree)
from jaxpar.parallel.pipeline._cut import PipelineParts
from jaxpar.parallel.pipeline._instructions import PIPE, Instr, Program, stage_counts
from jaxpar.parallel.pipeline._layer_vjp import LayerVJP
from jaxpar.errors import ScheduleError

#: name scope of the tick loop: in the compiled HLO, its ``while``'s ``op_name``
#: ends ``pipeline_ticks/while``
TICKS_SCOPE = "pipeline_ticks"


# ----------------------------------------------------------------------------- the program as arrays
class ActionKind(NamedTuple):
    """What an instruction needs compiled: one conditional per distinct kind.

    >>> ActionKind.of(Instr("F", first=True, last=False))
    ActionKind(op='F', first=True, last=False, updates=False)
    """

    op: str                # 'idle' | 'F' | 'B' | 'W'
    first: bool = False    # virtual stage 0: F runs ``pre``, B backprops it
    last: bool = False     # last virtual stage: F runs ``post``
    updates: bool = False  # the stage's own update follows the action (weight stashing)

    @classmethod
    def of(cls, instr: Instr, updates: bool = False) -> "ActionKind":
        """The kind of an instruction: its op, ``first`` (F / B only), ``last`` (F only) and ``updates``."""
        return cls(instr.op, instr.first and instr.op in ("F", "B"), instr.last and instr.op == "F", updates)


class StageFlags(NamedTuple):
    """What a stage's action counts for: a lockstep table's row (traced booleans), or the kind's own."""

    acts: Any     # the stage has an action of the tick's kind
    first: Any    # ... on virtual stage 0: F reads ``pre``'s output, B adds ``pre``'s pullback
    last: Any     # ... on the last virtual stage: F adds ``post``'s loss and gradient


class TickRow(NamedTuple):
    """One row of the lowered table; the scan runs over a ``[ticks, ...]`` stack of them."""

    kind: Any       # [p]: index of each stage's branch; lockstep: [], the tick's, the same on every device
    slots: Slots    # each [p]; lockstep: a stage without an action gets the spare slots
    fwd_pat: Any    # index of the forward send pattern (0: none), the same on every device
    bwd_pat: Any
    fwd_recv: Any   # [p]: inbox_f slot the received activation goes to (n_fwd: discarded)
    bwd_recv: Any   # [p]: inbox_b slot the received cotangent goes to (n_bwd: discarded)
    flags: Any = None   # lockstep: the stages' StageFlags, [p] each


class TickTable(NamedTuple):
    """A lowered program as arrays: its rows and what their indices refer to."""

    kinds: list        # the distinct ActionKinds: branch i runs kinds[i]
    fwd_pats: list     # the distinct sets of (source, target) pairs sending forward / backward
    bwd_pats: list
    rows: TickRow      # [ticks, ...]


def tick_table(program: Program, *, lockstep: bool = False, updates=None) -> TickTable:
    """The lowered table as ``[ticks, ...]`` int32 arrays, and what their indices refer to.

    Args:
        program: a lowered schedule (:func:`~._instructions.lower`).
        lockstep: ``program`` is ``lower(lockstep(schedule))``: a row's ``kind`` is the tick's, its
            ``flags`` what each stage's action counts for, and a stage without an action gets the spare
            slots: residual ``n_res``, frontier ``n_grad``, cotangent ``n_bwd`` (the discard slot, which
            every F but the head's writes its unused d loss / d y to).
        updates: ``updates[t][s]``: the action of stage ``s`` at tick ``t`` ends an update (weight stashing).

    Returns:
        The distinct action kinds (sorted; a row's ``kind`` indexes them), the distinct forward and
        backward send patterns (a row's ``fwd_pat`` / ``bwd_pat`` is the index plus one, 0 for no
        send), and the rows.
    """
    ticks = program.ticks
    if lockstep:
        keys = [[ActionKind(op)] for op in _tick_ops(program)]
    else:
        keys = [[ActionKind.of(i, bool(updates and updates[t][s])) for s, i in enumerate(tick.instrs)]
                for t, tick in enumerate(ticks)]
    kinds = sorted({k for row in keys for k in row})
    kind = np.array([[kinds.index(k) for k in row] for row in keys], np.int32)
    fwd_pats = sorted({t.fwd_pairs for t in ticks if t.fwd_pairs})
    bwd_pats = sorted({t.bwd_pairs for t in ticks if t.bwd_pairs})
    per_stage = lambda f: np.array([[f(i) for i in t.instrs] for t in ticks])         # noqa: E731
    per_tick = lambda f: np.array([f(t) for t in ticks], np.int32)                    # noqa: E731
    pattern = lambda pats, pairs: pats.index(pairs) + 1 if pairs else 0             # noqa: E731
    slot = _spare_slots(program) if lockstep else getattr
    flags = (StageFlags(per_stage(lambda i: i.op != "idle"), per_stage(lambda i: i.first), per_stage(lambda i: i.last))
             if lockstep else None)
    rows = TickRow(
        kind=kind[:, 0] if lockstep else kind,
        slots=Slots(*(per_stage(lambda i, a=a: slot(i, a)).astype(np.int32)
                      for a in ("microbatch", "chunk", "res", "inbox", "dy", "grad"))),
        fwd_pat=per_tick(lambda t: pattern(fwd_pats, t.fwd_pairs)),
        bwd_pat=per_tick(lambda t: pattern(bwd_pats, t.bwd_pairs)),
        fwd_recv=per_tick(lambda t: t.fwd_recv), bwd_recv=per_tick(lambda t: t.bwd_recv),
        flags=flags)
    return TickTable(kinds, fwd_pats, bwd_pats, rows)


def _tick_ops(program: Program) -> list[str]:
    """The one op of each tick of a lockstep program."""
    ops = [{i.op for i in t.instrs} - {"idle"} for t in program.ticks]
    if any(len(o) != 1 for o in ops):
        raise ScheduleError(f"schedule {program.schedule.name!r} is not a lockstep table (a tick holds the kinds "
                            f"{sorted(next(o for o in ops if len(o) != 1))}); re-time it with "
                            "jaxpar.parallel.pipeline.lockstep.")
    return [o.pop() for o in ops]


def _spare_slots(program: Program) -> Callable:
    """``slot(instr, name)`` of a lockstep program: an idle stage's action runs on the spare slots."""
    spare = {"res": program.n_res, "grad": program.n_grad, "dy": program.n_bwd}

    def slot(i: Instr, name: str):
        if name == "dy" and not (i.op == "F" and i.last):      # only the head writes d loss / d y
            return spare["dy"]
        return getattr(i, name) if i.op != "idle" else spare.get(name, 0)

    return slot


def _send(pats: list, pat, x):
    """``x`` along the tick's pairs (``pats[pat - 1]``; 0: nothing moves). ``pat`` is
    the same on every device, so each ``ppermute`` runs on all of them or none."""
    fns = [zeros_like_tree] + [lambda y, q=q: jax.lax.ppermute(y, PIPE, q) for q in pats]
    return jax.lax.switch(pat, fns, x) if len(fns) > 1 else fns[0](x)


# ----------------------------------------------------------------------------- the stage
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


def _accumulate(acc: Any, grads: Any, scale=1) -> Any:
    """``acc + grads / scale`` leaf by leaf, in ``acc``'s dtypes."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype) / scale, acc, grads)


def _pick(flag, new, old):
    """``new`` where ``flag``, else ``old``, leaf by leaf (``flag`` a traced bool, or ``True``: ``new``)."""
    if flag is True:
        return new
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


class Stage:
    """One device's share of the program, traced inside the ``shard_map``: its chunks' layers
    (``blocks``: ``[v, Lmax, ...]``), ``outer``, the micro-batches, and the actions F / B / W on one
    slot of each buffer. Subclasses change which parameters an action uses (:meth:`chunk_params`,
    :meth:`outer_params`) and how it reads and writes the state (:meth:`read`, :meth:`write`).
    In ``lockstep`` every stage runs every tick's action (on spare slots where it has none), what it
    adds masked by its :class:`StageFlags`, so every collective inside an action is reached by every device.

    Args:
        parts: the model's ``pre``, ``layer`` and ``post``.
        program: the lowered schedule.
        counts: real layers per virtual stage, ``[chunk, stage]`` (:func:`stage_counts`).
        outer: the parameters of ``pre`` and ``post``.
        blocks: this device's layers, ``[v, Lmax, ...]`` per leaf.
        mbs: the micro-batches, ``[m, rows, ...]`` per leaf.
        lockstep: the program is a lockstep table (:func:`~._schedules.lockstep`).
    """

    def __init__(self, parts: PipelineParts, program: Program, counts: np.ndarray, outer, blocks, mbs,
                 lockstep: bool = False):
        self.parts, self.outer, self.blocks, self.mbs, self.lockstep = parts, outer, blocks, mbs, lockstep
        self.m, self.split = program.schedule.num_microbatches, program.schedule.split_backward
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
        """The layers an action on the slots ``sl`` uses: chunk ``sl.chunk``, ``[Lmax, ...]`` per leaf."""
        return take_tree(self.blocks, sl.chunk)

    def outer_params(self, sl: Slots):
        """The parameters of ``pre`` / ``post`` an action on the slots ``sl`` uses."""
        return self.outer

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action on the slots ``sl`` reads of the state (inside its conditional): the inbox slots
        and the chunk's gradient sum at ``sl``, the residual and frontier buffers whole, and the sums."""
        return SlotView(x=take_tree(st.inbox_f, sl.inbox), dy=take_tree(st.inbox_b, sl.inbox), res=st.res,
                        gys=st.grads_y, g_chunk=take_tree(st.g_blocks, sl.chunk), g_outer=st.g_outer, loss=st.loss,
                        metrics=st.metrics)

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """``st`` with what an action on the slots ``sl`` hands back written (a ``None`` field of ``io``
        leaves its buffer as it was)."""
        new = st._replace(g_outer=io.g_outer, loss=io.loss)
        if io.dy_out is not None:
            new = new._replace(inbox_b=put_tree(st.inbox_b, sl.dy, io.dy_out))
        if io.g_chunk is not None:
            new = new._replace(g_blocks=jax.tree.map(lambda a, g: put(a, sl.chunk, g), st.g_blocks, io.g_chunk))
        whole = {"res": io.res, "metrics": io.metrics, "grads_y": io.gys}     # buffers handed back whole
        return new._replace(**{name: value for name, value in whole.items() if value is not None})

    def initial_state(self, program: Program) -> PipelineState:
        """The buffers before the first tick (sized by ``program``'s slot counts, plus a lockstep stage's spare
        residual and frontier slot): every slot and sum zero."""
        x, lmax, spare = self.x, self.lmax, int(self.lockstep)
        buf = lambda n, shape, dtype: jnp.zeros((max(n, 1), *shape), dtype)           # noqa: E731
        f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)   # noqa: E731
        return PipelineState(
            res=[buf(program.n_res + spare, (lmax, *r.shape), r.dtype) for r in self.lv.stored],
            inbox_f=jax.tree.map(lambda a: buf(program.n_fwd + 1, a.shape, a.dtype), x),
            inbox_b=jax.tree.map(lambda a: buf(program.n_bwd + 1, a.shape, a.dtype), x),
            grads_y=[buf(program.n_grad + spare, (lmax, *f.shape), f.dtype) for f in self.lv.split.frontier]
            if self.lv.split else [],
            g_blocks=f32(self.blocks), g_outer=f32(self.outer), loss=jnp.zeros((), jnp.float32),
            metrics=f32(self.metrics))

    def _unchanged(self, view: SlotView) -> TickIO:
        """No slot written (``None``), the sums as they were; nothing sent."""
        return TickIO(None, None, view.g_outer, None, view.loss, None, self.nothing(), self.nothing())

    def _layers(self, one: Callable, sl: Slots, carry, reverse: bool = False):
        """``one`` scanned over the layers of chunk ``sl.chunk`` (an item: a layer's parameters and index).
        A padding layer (only when some stage is short) does nothing: skipped by a conditional, or in
        lockstep run with its result masked."""
        n = self.n_layers[sl.chunk]

        def step(carry, item):
            if not self.uneven:
                return one(carry, item)
            if not self.lockstep:
                return jax.lax.cond(item[1] < n, one, lambda c, _: (c, None), carry, item)
            new, out = one(carry, item)
            return _pick(item[1] < n, new, carry), out

        return jax.lax.scan(step, carry, (self.chunk_params(sl), jnp.arange(self.lmax)), reverse=reverse)[0]

    def forward_layers(self, sl: Slots, x, res):
        """``(y, res)``: the chunk's layers forward on ``x``, each layer's residuals written to
        ``res[sl.res, layer]``."""
        def one(carry, item):
            h, bufs = carry
            y, stored = self.lv.forward(item[0], h)
            return (y, [_set(b, sl.res, item[1], r) for b, r in zip(bufs, stored)]), None

        return self._layers(one, sl, (x, res))

    def backward_layers(self, sl: Slots, res, dy, acc):
        """``(dx, acc)``: the chunk's pullbacks in reverse from ``dy`` on the residuals ``res[sl.res]``, each
        layer's weight gradients added to ``acc`` (``[Lmax, ...]`` per leaf), or with a split backward
        its frontier written to the frontier buffers ``acc[sl.grad, layer]``, kept for W."""
        def one(carry, item):
            g, acc = carry
            stored = [_at(b, sl.res, item[1]) for b in res]
            if self.split:
                dx, front = self.lv.split.inputs(item[0], stored, g)
                return (dx, [_set(b, sl.grad, item[1], f) for b, f in zip(acc, front)]), None
            dp, dx = self.lv.pullback(item[0], stored)(g)
            return (dx, _add_at(acc, item[1], dp)), None

        return self._layers(one, sl, (dy, acc), reverse=True)

    def act(self, kind: ActionKind, view: SlotView, sl: Slots, flags) -> TickIO:
        """The action of ``kind`` on what it read, ``view``: F, B, W, or nothing for idle; ``flags`` (a lockstep
        table's, traced) default to the kind's own."""
        if kind.op == "idle":
            return self._unchanged(view)
        action = {"F": self.forward, "B": self.backward, "W": self.weights}[kind.op]
        return action(view, sl, StageFlags(True, kind.first, kind.last) if flags is None else flags)

    def branch(self, kind: ActionKind) -> Callable:
        """What the tick runs in the conditional of ``kind``: ``(st, ws, slots, flags, versions) -> (st, ws,
        io)``, the action on what it reads of ``st``, written back (``ws``, ``versions``: see
        :class:`~jaxpar.parallel.pipeline._pipedream.VersionedStage`)."""
        def run(st, ws, sl, flags, versions):
            io = self.act(kind, self.read(st, sl), sl, flags)
            return self.write(st, sl, io), ws, io

        return run

    def forward(self, view: SlotView, sl: Slots, f: StageFlags) -> TickIO:
        """F: ``pre`` (first) or the received activation, the chunk's layers, then ``post`` (last: keeps
        d loss / d y, adds its gradient of ``outer`` and what the loss reported); sends the output."""
        mb, outer = take_tree(self.mbs, sl.mb), self.outer_params(sl)
        x = view.x if f.first is False else _pick(f.first, self._cast(self.parts.pre(outer, mb)), view.x)
        y, res = self.forward_layers(sl, x, view.res)
        io = self._unchanged(view)._replace(res=res, send_f=self._cast(y))
        if f.last is False:
            return io
        (loss, found), (g_outer, dy) = jax.value_and_grad(self.post, argnums=(0, 1), has_aux=True)(outer, y, mb)
        keep = f.acts & f.last
        return io._replace(dy_out=self._cast(jax.tree.map(lambda d: d / self.m, dy)),
                           loss=_pick(keep, view.loss + loss.astype(jnp.float32), view.loss),
                           metrics=_pick(keep, jax.tree.map(jnp.add, view.metrics, found), view.metrics),
                           g_outer=_pick(keep, _accumulate(view.g_outer, g_outer, self.m), view.g_outer))

    def backward(self, view: SlotView, sl: Slots, f: StageFlags) -> TickIO:
        """B: the stored pullbacks in reverse on the received cotangent (sent back), their weight gradients
        added (fused) or their frontier written (split), then ``pre``'s pullback into the gradient of
        ``outer`` (first)."""
        dx, acc = self.backward_layers(sl, view.res, view.dy, view.gys if self.split else view.g_chunk)
        io = self._unchanged(view)._replace(send_b=self._cast(dx))
        if self.split:          # in lockstep, a stage without an action writes to the spare frontier slot
            io = io._replace(gys=acc)
        else:
            io = io._replace(g_chunk=_pick(f.acts, acc, view.g_chunk))
        if f.first is False:
            return io
        mb = take_tree(self.mbs, sl.mb)
        _, pull = jax.vjp(lambda q: self.parts.pre(q, mb), self.outer_params(sl))
        return io._replace(g_outer=_pick(f.acts & f.first, _accumulate(view.g_outer, pull(self._cast(dx))[0]),
                                         view.g_outer))

    def weights(self, view: SlotView, sl: Slots, f: StageFlags) -> TickIO:
        """W (split backward): the chunk's weight gradients, from the residuals and the frontier B kept."""
        def one(acc, item):
            dp = self.lv.split.weights(item[0], [_at(b, sl.res, item[1]) for b in view.res],
                                       [_at(b, sl.grad, item[1]) for b in view.gys])
            return _add_at(acc, item[1], dp), None

        g_chunk = self._layers(one, sl, view.g_chunk)
        return self._unchanged(view)._replace(g_chunk=_pick(f.acts, g_chunk, view.g_chunk))


# ----------------------------------------------------------------------------- the tick
def tick(stage: Stage, table: TickTable, branches: list, carry, xs):
    """One tick, a ``lax.scan`` step over ``(rows, version rows)`` carrying ``(st, ws)``: this stage's
    action on its slots of the buffers, then the sends each way over ``pipe``, what the stage receives
    written to its inbox slots.

    One boolean ``cond`` per action kind (at most one runs): its branch reads and writes the buffers
    in place. (A ``switch`` over all kinds, or a ``cond`` on slots read outside it, would copy what
    passes through: the residuals twice per tick.)
    """
    (st, ws), (row, vrow) = carry, xs
    s = stage.index
    sl, flags, versions = take_tree(row.slots, s), take_tree(row.flags, s), take_tree(vrow, s)
    kind = row.kind if row.kind.ndim == 0 else take(row.kind, s)    # lockstep: the tick's, on every device

    def act(i):
        def run(st, ws, send_f, send_b):
            st, ws, io = branches[i](st, ws, sl, flags, versions)
            return st, ws, io.send_f, io.send_b
        return run

    carry = (st, ws, stage.nothing(), stage.nothing())
    for i, k in enumerate(table.kinds):
        if k.op != "idle":
            carry = jax.lax.cond(kind == i, act(i), lambda *a: a, *carry)
    st, ws, send_f, send_b = carry
    inbox_f = put_tree(st.inbox_f, take(row.fwd_recv, s), _send(table.fwd_pats, row.fwd_pat, send_f))
    inbox_b = put_tree(st.inbox_b, take(row.bwd_recv, s), _send(table.bwd_pats, row.bwd_pat, send_b))
    return (st._replace(inbox_f=inbox_f, inbox_b=inbox_b), ws), None


def run_ticks(stage: Stage, table: TickTable, st: PipelineState, ws: Any = None, rows: TickRow | None = None,
              vrows: Any = None) -> tuple[PipelineState, Any]:
    """The stage's actions over ``rows`` (default: the table's), a ``lax.scan`` under :data:`TICKS_SCOPE`.

    Args:
        stage: the stage.
        table: the program's :class:`TickTable` (its kinds and send patterns).
        st: the buffers before the first of ``rows``.
        ws: PipeDream's weight versions (and the update's state) before it, or ``None``.
        rows: the tick rows to run, ``[ticks, ...]``.
        vrows: their version rows (with ``ws``).

    Returns:
        ``(st, ws)`` after the last tick.
    """
    branches = [stage.branch(k) for k in table.kinds]
    rows = table.rows if rows is None else rows
    with jax.named_scope(TICKS_SCOPE):
        (st, ws), _ = jax.lax.scan(functools.partial(tick, stage, table, branches), (st, ws), (rows, vrows))
    return st, ws
