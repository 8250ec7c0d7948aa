"""Run any valid schedule table as one SPMD program: ``shard_map`` manual over ``pipe``.

Each device holds its stages' layers (``[v, Lmax, ...]``: ``v`` chunks of at most
``Lmax`` layers). A ``lax.scan`` runs the lowered table (:mod:`.program`) tick by
tick; at each tick every device runs the action of its row, one boolean ``lax.cond``
per action kind (idle stages compute nothing in bubbles):

* **F**: ``pre`` (virtual stage 0), the chunk's layers with one ``jax.vjp`` each
  (each layer's residuals to ``[slot, layer]`` of buffers sized by the table's peak
  in-flight count, not by ``m``), then ``post`` and ``d loss / d y`` (last virtual
  stage) or a send.
* **B**: the stored vjps in reverse on the received cotangent, accumulating the
  weight gradients (fused); or, split (zero-bubble), only the part of each layer's
  pullback that the input cotangent needs, keeping what the weight gradients read
  (the *frontier*, :mod:`jaxpar.split_backward`) for **W**, which runs the rest; then
  ``pre``'s vjp (virtual stage 0) or a send.

An action reads a :class:`SlotView` (one slot of the inboxes, the residual and
frontier buffers whole) and returns what it writes and sends (a :class:`TickIO`);
its conditional updates the buffers (:class:`PipelineState`) in place, and the
layer loops index them at ``[slot, layer]``, so no slot is copied out or back
(an index ``switch`` over the kinds would copy every buffer it passes through).
Then ``ppermute`` sends
activations forward and cotangents backward between the stages that send at that
tick (wrap-around ``p-1 -> 0`` for interleaved chunks): one ``ppermute`` per
distinct set of pairs, chosen by a ``lax.switch`` whose index is the same on every
device. The other mesh axes stay automatic, so data / ZeRO / tensor parallelism
work inside a stage. ``pre`` and ``post`` add into one gradient of ``outer``,
summed over ``pipe`` once at the end. The result equals the non-pipelined run.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.pipeline import PipelineParts, get_schedule, lower, to_stages
    >>> parts = PipelineParts(pre=lambda o, mb: mb["x"] * o["scale"],
    ...                       layer=lambda w, x: jnp.tanh(x @ w),
    ...                       post=lambda o, y, mb: jnp.mean((y - mb["y"]) ** 2))
    >>> mesh = jaxpar.make_mesh({"pipe": 2}, devices=jax.devices()[:2])
    >>> fn = pipeline_value_and_grad(parts, mesh, (), lower(get_schedule("1f1b", 2, 4)), stage_layers=(2, 2))
    >>> outer, blocks = {"scale": jnp.ones(())}, 0.5 * jnp.ones((4, 3, 3))      # 4 stacked layers
    >>> mbs = {"x": jnp.ones((4, 2, 3)), "y": jnp.zeros((4, 2, 3))}             # 4 micro-batches of 2 rows
    >>> loss, (g_outer, g_blocks) = jax.jit(fn)(outer, to_stages(blocks, (2, 2), p=2), mbs)
    >>> def plain(o, w, mb):                                                   # the same loss on one device
    ...     h = mb["x"] * o["scale"]
    ...     for i in range(4):
    ...         h = jnp.tanh(h @ w[i])
    ...     return jnp.mean((h - mb["y"]) ** 2)
    >>> g_ref = jax.grad(plain)(outer, blocks, mbs)
    >>> g_blocks.shape, bool(jnp.allclose(loss, plain(outer, blocks, mbs)))
    ((1, 2, 2, 3, 3), True)
    >>> bool(jnp.allclose(g_outer["scale"], g_ref["scale"], rtol=1e-5))
    True
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..blocks import use_layer_runner
from ..rules import drop_axes, use_rules
from ..split_backward import split_backward
from ..vjp_residuals import join_pullback, split_pullback
from .parts import PipelineParts
from .program import Instr, Program

__all__ = ["pipeline_value_and_grad", "PIPE", "TICKS_SCOPE", "ActionKind", "Slots", "PipelineState", "SlotView",
           "TickIO"]

PIPE = "pipe"
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
        return cls(instr.op, instr.first and instr.op in ("F", "B"), instr.last and instr.op == "F")


class Slots(NamedTuple):
    """One stage's instruction at one tick (int32; ``[ticks, p]`` in the table). See :class:`.Instr`."""

    mb: Any      # micro-batch
    chunk: Any   # which of the device's ``v`` chunks
    res: Any     # residual slot
    inbox: Any   # F: inbox_f slot read; B: inbox_b slot read
    dy: Any      # F (last): inbox_b slot written with d loss / d y
    grad: Any    # grads_y slot: B (split) writes, W reads


class TickRow(NamedTuple):
    """One row of the lowered table; the scan runs over a ``[ticks, ...]`` stack of them."""

    kind: Any       # [p]: index of each stage's branch
    slots: Slots    # each [p]
    fwd_pat: Any    # index of the forward send pattern (0: none), the same on every device
    bwd_pat: Any
    fwd_recv: Any   # [p]: inbox_f slot the received activation goes to (n_fwd: discarded)
    bwd_recv: Any   # [p]: inbox_b slot the received cotangent goes to (n_bwd: discarded)


class _Table(NamedTuple):
    kinds: list        # the distinct ActionKinds: branch i runs kinds[i]
    fwd_pats: list     # the distinct sets of (source, target) pairs sending forward / backward
    bwd_pats: list
    rows: TickRow


class PipelineState(NamedTuple):
    """What the tick loop carries: the slotted buffers of :mod:`.program` and the sums."""

    res: list          # per stored residual: [n_res, Lmax, ...]
    inbox_f: Any       # [n_fwd + 1, *x]; the extra slot takes what a non-receiver gets
    inbox_b: Any       # [n_bwd + 1, *x]
    grads_y: list      # per frontier value: [n_grad, Lmax, ...]: split B's hand-over to W
    g_blocks: Any      # float32 [v, Lmax, ...]
    g_outer: Any       # float32, like ``outer``
    loss: Any          # float32: sum of the micro-batch losses


class TickIO(NamedTuple):
    """What an action hands back: the slots it writes (``None``: left alone), the sums and the sends."""

    dy_out: Any        # -> inbox_b[dy]: F (last) writes d loss / d y
    g_chunk: Any       # -> g_blocks[chunk]
    g_outer: Any
    gys: list          # the frontier buffers, B (split) having written slot ``grad``
    loss: Any
    res: list          # the residual buffers, F having written slot ``res``
    send_b: Any        # cotangent for the previous virtual stage (zeros when none)
    send_f: Any        # activation for the next virtual stage (zeros when none)


class SlotView(NamedTuple):
    """What an action reads: one slot of the inboxes and of the gradient sum, and the
    residual and frontier buffers whole (the layer loops index them at the action's slot, so
    no slot is copied out or back)."""

    dy: Any            # inbox_b[inbox]: B's received cotangent
    dy_out: Any        # inbox_b[dy]
    g_chunk: Any       # g_blocks[chunk]
    g_outer: Any
    gys: list          # grads_y: B (split) writes slot ``grad``, W reads it
    loss: Any
    res: list          # res: F writes slot ``res``, B and W read it
    x: Any             # inbox_f[inbox]: F's received activation


class _LayerVJP:
    """Static structure of one layer's ``jax.vjp``: which residuals are stored (not the
    layer's own parameters, passed back in; see :mod:`jaxpar.vjp_residuals`) and their shapes;
    with ``split``, the pullback cut into B and W (:mod:`jaxpar.split_backward`)."""

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
        """``(y, stored residuals)`` of one layer; an error if they differ from the probe's."""
        y, pullback = jax.vjp(self.layer, p, x)
        return y, split_pullback(pullback, p, like=self.layout)[0]

    def pullback(self, p, stored):
        return join_pullback(self.layout, stored, p)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _get(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


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
    return jax.tree.map(lambda a, d: _put(a, layer, _get(a, layer) + d.astype(a.dtype)), acc, grads)


def _put(buf, i, value):
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _accumulate(acc: Any, grads: Any) -> Any:
    """``acc + grads`` leaf by leaf, in ``acc``'s dtypes."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, grads)


def _table(program: Program) -> _Table:
    """The lowered table as ``[ticks, ...]`` int32 arrays, and what its indices refer to."""
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
    return _Table(kinds, fwd_pats, bwd_pats, rows)


class _Stage:
    """One device's share of the program, traced inside the ``shard_map``: its chunks'
    layers (``blocks``: ``[v, Lmax, ...]``), ``outer``, the micro-batches, and the
    actions F / B / W on one slot of each buffer."""

    def __init__(self, parts: PipelineParts, program: Program, counts: np.ndarray, outer, blocks, mbs):
        self.parts, self.outer, self.blocks, self.mbs = parts, outer, blocks, mbs
        self.m, self.split = program.schedule.num_microbatches, program.split_backward
        self.lmax = int(counts.max())
        self.uneven = bool((counts != self.lmax).any())
        self.index = jax.lax.axis_index(PIPE)
        self.n_layers = _get(jnp.asarray(counts.T), self.index)       # [v]: real layers per chunk here
        self.x = jax.eval_shape(parts.pre, outer, _index(mbs, 0))
        self.lv = _LayerVJP(parts.layer, _index(_index(blocks, 0), 0), self.x, split=self.split)

    def _cast(self, a):
        return a.astype(self.x.dtype)

    def chunk_params(self, sl: Slots):
        """The layers' parameters an action on ``sl`` uses (one chunk, ``[Lmax, ...]``)."""
        return _index(self.blocks, sl.chunk)

    def outer_params(self, sl: Slots):
        """The parameters of ``pre`` / ``post`` an action on ``sl`` uses."""
        return self.outer

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action on ``sl`` reads of ``st`` (inside its conditional)."""
        return _read(st, sl)

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """``st`` with what the action on ``sl`` hands back written to its slots."""
        return _write(st, sl, io)

    def _unchanged(self, view: SlotView) -> TickIO:
        """No slot written (``None``), the sums as they were; nothing sent."""
        none = jnp.zeros(self.x.shape, self.x.dtype)
        return TickIO(None, None, view.g_outer, None, view.loss, None, none, none)

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
        """F: ``pre`` (first), the chunk's layers, then ``post`` (last: keeps d loss / d y
        and adds its gradient of ``outer``) or a send to the next virtual stage."""
        n, bp, mb = self.n_layers[sl.chunk], self.chunk_params(sl), _index(self.mbs, sl.mb)
        outer = self.outer_params(sl)
        x = self.parts.pre(outer, mb) if kind.first else view.x
        y, res = self.forward_layers(bp, x, n, view.res, sl.res)
        io = self._unchanged(view)._replace(res=res)
        if not kind.last:
            return io._replace(send_f=self._cast(y))
        loss, (g_outer, dy) = jax.value_and_grad(self.parts.post, argnums=(0, 1))(outer, y, mb)
        return io._replace(loss=view.loss + loss.astype(jnp.float32), dy_out=self._cast(dy / self.m),
                           g_outer=jax.tree.map(lambda a, d: a + d.astype(a.dtype) / self.m, view.g_outer, g_outer))

    def backward(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """B: the stored pullbacks in reverse on the received cotangent, then ``pre``'s
        pullback into the gradient of ``outer`` (first) or a send to the previous virtual stage."""
        bp, mb, n = self.chunk_params(sl), _index(self.mbs, sl.mb), self.n_layers[sl.chunk]
        io = self._unchanged(view)
        if self.split:
            dx, gys = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.gys, gslot=sl.grad)
            io = io._replace(gys=gys)
        else:
            dx, g_chunk = self.backward_layers(bp, view.res, sl.res, view.dy, n, view.g_chunk)
            io = io._replace(g_chunk=g_chunk)
        if not kind.first:
            return io._replace(send_b=self._cast(dx))
        _, pull = jax.vjp(lambda q: self.parts.pre(q, mb), self.outer_params(sl))
        return io._replace(g_outer=_accumulate(view.g_outer, pull(self._cast(dx))[0]))

    def weights(self, kind: ActionKind, view: SlotView, sl: Slots) -> TickIO:
        """W (split backward): the chunk's weight gradients from the cotangents B kept."""
        g_chunk = self.weight_layers(self.chunk_params(sl), view.res, view.gys, sl.res, sl.grad,
                                     self.n_layers[sl.chunk], view.g_chunk)
        return self._unchanged(view)._replace(g_chunk=g_chunk)


def _initial_state(program: Program, stage: _Stage) -> PipelineState:
    x, lmax = stage.x, stage.lmax
    buf = lambda n, shape, dtype: jnp.zeros((max(n, 1), *shape), dtype)           # noqa: E731
    f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)   # noqa: E731
    return PipelineState(
        res=[buf(program.n_res, (lmax, *r.shape), r.dtype) for r in stage.lv.stored],
        inbox_f=buf(program.n_fwd + 1, x.shape, x.dtype), inbox_b=buf(program.n_bwd + 1, x.shape, x.dtype),
        grads_y=[buf(program.n_grad, (lmax, *f.shape), f.dtype) for f in stage.lv.split.frontier]
        if stage.lv.split else [],
        g_blocks=f32(stage.blocks), g_outer=f32(stage.outer), loss=jnp.zeros((), jnp.float32))


def _read(st: PipelineState, sl: Slots) -> SlotView:
    return SlotView(x=_get(st.inbox_f, sl.inbox), dy=_get(st.inbox_b, sl.inbox), dy_out=_get(st.inbox_b, sl.dy),
                    res=st.res, gys=st.grads_y,
                    g_chunk=_index(st.g_blocks, sl.chunk), g_outer=st.g_outer, loss=st.loss)


def _write(st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
    """``st`` with the slots ``io`` writes (not ``None``) and its sums."""
    new = st._replace(g_outer=io.g_outer, loss=io.loss)
    if io.res is not None:
        new = new._replace(res=io.res)
    if io.dy_out is not None:
        new = new._replace(inbox_b=_put(st.inbox_b, sl.dy, io.dy_out))
    if io.gys is not None:
        new = new._replace(grads_y=io.gys)
    if io.g_chunk is not None:
        new = new._replace(g_blocks=jax.tree.map(lambda a, g: _put(a, sl.chunk, g), st.g_blocks, io.g_chunk))
    return new


def _send(pats: list, pat, x):
    """``x`` along the tick's pairs (``pats[pat - 1]``; 0: nothing moves). ``pat`` is
    the same on every device, so each ``ppermute`` runs on all of them or none."""
    fns = [jnp.zeros_like] + [lambda y, q=q: jax.lax.ppermute(y, PIPE, q) for q in pats]
    return jax.lax.switch(pat, fns, x) if len(fns) > 1 else fns[0](x)


def _exchange(st: PipelineState, table: _Table, row: TickRow, s, send_f, send_b) -> PipelineState:
    """The tick's sends each way; what arrives goes to its inbox slot."""
    inbox_f = _put(st.inbox_f, _get(row.fwd_recv, s), _send(table.fwd_pats, row.fwd_pat, send_f))
    inbox_b = _put(st.inbox_b, _get(row.bwd_recv, s), _send(table.bwd_pats, row.bwd_pat, send_b))
    return st._replace(inbox_f=inbox_f, inbox_b=inbox_b)


def _tick(stage: _Stage, table: _Table, branches: list, st: PipelineState, row: TickRow):
    """Run this stage's action on its slots of the buffers, then the sends.

    One boolean ``cond`` per action kind (at most one runs): its branch reads and writes
    the buffers in place. (A ``switch`` over all kinds, or a ``cond`` on slots read
    outside it, would copy what passes through: the residuals twice per tick.)"""
    sl = Slots(*(_get(a, stage.index) for a in row.slots))
    none = jnp.zeros(stage.x.shape, stage.x.dtype)

    def act(i):
        def run(st, send_f, send_b):
            io = branches[i](stage.read(st, sl), sl)
            return stage.write(st, sl, io), io.send_f, io.send_b
        return run

    st, send_f, send_b = _one_of(_get(row.kind, stage.index), table.kinds, act, (st, none, none))
    return _exchange(st, table, row, stage.index, send_f, send_b), None


def _one_of(kind, kinds: list, act: Callable, carry: tuple) -> tuple:
    """``act(kind)(*carry)``, or ``carry`` if ``kinds[kind]`` is idle: one boolean ``cond`` per
    kind that is not, each reading and writing the carried buffers in place (an index
    ``switch`` copies every buffer its branches pass through)."""
    for i, k in enumerate(kinds):
        if k[0] != "idle":
            carry = jax.lax.cond(kind == i, act(i), lambda *a: a, *carry)
    return carry


def _stage_counts(program: Program, mesh, stage_layers: Sequence[int]) -> np.ndarray:
    """``stage_layers`` as ``[chunk, stage]``, or an error naming what does not fit."""
    sched = program.schedule
    p, v, pipe = sched.num_stages, sched.num_chunks, dict(mesh.shape).get(PIPE, 1)
    if pipe != p:
        raise ValueError(f"the schedule {sched.name!r} has {p} stages but the mesh's {PIPE!r} axis has size "
                         f"{pipe}; build the schedule with num_stages equal to the pipe axis (mesh axes: "
                         f"{dict(mesh.shape)}).")
    counts = np.asarray(stage_layers, np.int32)
    if counts.shape != (p * v,) or (counts < 1).any():
        raise ValueError(f"stage_layers={tuple(stage_layers)}: the schedule {sched.name!r} has {p * v} virtual "
                         f"stages (pipe={p} x chunks={v}); give one positive layer count per virtual stage.")
    return counts.reshape(v, p)


def pipeline_value_and_grad(parts: PipelineParts, mesh, rules, program: Program, *,
                            stage_layers: Sequence[int], replica_axes: Sequence[str] = ()) -> Callable:
    """Build ``fn(outer, blocks, microbatches) -> (loss, (g_outer, g_blocks))``.

    - ``outer``: the parameters of ``parts.pre`` and ``parts.post`` (one tree;
      replicated over ``pipe``).
    - ``blocks``: every block parameter as ``[v, p, Lmax, ...]`` (chunk, stage,
      layer), sharded ``P(None, 'pipe', ...)``; see :func:`jaxpar.pipeline.partition.to_stages`.
    - ``microbatches``: the batch pytree as ``[m, rows, ...]``.
    - ``stage_layers``: layers of each virtual stage ``k = chunk * p + stage``;
      layers beyond a stage's count are padding and are skipped at run time.
    - ``replica_axes``: data axes over which each replica keeps its own gradients (a
      compressed exchange follows): the program is manual over them too, every gradient
      gets a leading replica axis sharded over them and the loss is the replicas' mean.

    The loss is the mean of the micro-batch losses; the gradients are those of
    that mean (float32), ``g_blocks`` in the ``blocks`` layout. ``g_outer`` adds
    ``pre``'s and ``post``'s gradients (tied weights get both).
    """
    p, v = program.schedule.num_stages, program.schedule.num_chunks
    counts = _stage_counts(program, mesh, stage_layers)      # [chunk, stage]
    lmax = int(counts.max())
    table = _table(program)
    replica_axes = tuple(replica_axes)
    rep_entry = (replica_axes if len(replica_axes) > 1 else replica_axes[0]) if replica_axes else None

    def body(outer, blocks, mbs):
        stage = _Stage(parts, program, counts, outer, jax.tree.map(lambda a: a[:, 0], blocks), mbs)
        branches = [stage.branch(k) for k in table.kinds]
        with jax.named_scope(TICKS_SCOPE):
            st, _ = jax.lax.scan(functools.partial(_tick, stage, table, branches),
                                 _initial_state(program, stage), table.rows)
        g_blocks = jax.tree.map(lambda a: a[:, None], st.g_blocks)
        loss, g_outer = jax.lax.psum(st.loss, PIPE) / stage.m, jax.lax.psum(st.g_outer, PIPE)
        if replica_axes:
            lead = lambda t: jax.tree.map(lambda a: a[None], t)   # noqa: E731
            return jax.lax.pmean(loss, rep_entry), (lead(g_outer), lead(g_blocks))
        return loss, (g_outer, g_blocks)

    stage_spec = lambda t: jax.tree.map(lambda _: P(None, PIPE), t)   # noqa: E731
    rep = lambda t: jax.tree.map(lambda _: P(), t)                    # noqa: E731
    inner_rules = drop_axes(rules, (PIPE, *replica_axes))
    if replica_axes:
        out_outer = lambda t: jax.tree.map(lambda _: P(rep_entry), t)               # noqa: E731
        out_blocks = lambda t: jax.tree.map(lambda _: P(rep_entry, None, PIPE), t)  # noqa: E731
        mbs_spec = lambda t: jax.tree.map(lambda _: P(None, rep_entry), t)          # noqa: E731
    else:
        out_outer, out_blocks, mbs_spec = rep, stage_spec, rep

    def fn(outer, blocks, mbs):
        lead = jax.tree.leaves(blocks)[0].shape[:3]
        if lead != (v, p, lmax):
            raise ValueError(f"pipeline blocks must be laid out [chunks={v}, stages={p}, layers={lmax}, ...] for "
                             f"stage_layers={tuple(stage_layers)}; got leading dims {lead}. Lay them out with "
                             "jaxpar.pipeline.to_stages(blocks, stage_layers, p, v).")
        smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE, *replica_axes}, check_vma=False,
                             in_specs=(rep(outer), stage_spec(blocks), mbs_spec(mbs)),
                             out_specs=(P(), (out_outer(outer), out_blocks(blocks))))
        with use_rules(mesh, inner_rules), use_layer_runner(None):
            return smap(outer, blocks, mbs)

    return fn
