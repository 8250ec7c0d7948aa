"""A lockstep program: every stage runs the tick's action, a masked one where it has none.

:mod:`._lockstep` re-times a schedule so that every tick holds one kind of action. Here that
table is run. The conditional of each kind has the tick's kind as its predicate, the same on
every device, so a collective inside an action (sequence parallelism's all-gathers and
reduce-scatters over ``tensor``) is reached by every device. Within the action nothing
branches per stage either:

* a stage with nothing to do at the tick runs the action on a spare slot (the residual buffer's
  and the frontier buffer's extra last slot, the cotangent inbox's discard slot), and
  :class:`StageFlags` mask what it adds to the gradients, the loss and the metrics;
* every F runs ``pre`` and ``post``, and every B runs ``pre``'s pullback. The flags of the first
  and last virtual stage pick the stage's input and mask what the others add;
* a padding layer of a short stage runs too, its result masked (``jnp.where``).

The masked work is the price: a stage computes during its bubble, and ``pre`` and ``post`` run on
every stage. The executor (:func:`~._executor.pipeline_value_and_grad`, ``lockstep=True``) runs
this program where a collective sits inside the stages' actions.

Example:
    >>> from jaxpar.parallel.pipeline import get_schedule, lower
    >>> from jaxpar.parallel.pipeline._lockstep import lockstep
    >>> table = lockstep_table(lower(lockstep(get_schedule("1f1b", 2, 4))))
    >>> [k.op for k in table.kinds], table.rows.kind.shape, table.rows.acts.shape
    (['B', 'F'], (10,), (10, 2))
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.pipeline._buffers import PipelineState, Slots, SlotView, TickIO, take, take_tree
from jaxpar.parallel.pipeline._instructions import Program
from jaxpar.parallel.pipeline._stage import ActionKind, Stage, exchange, initial_state, one_of
from jaxpar.errors import ScheduleError


class StageFlags(NamedTuple):
    """What a stage's action at a tick counts for (traced booleans)."""

    acts: Any     # the stage has an action of the tick's kind
    first: Any    # ... on virtual stage 0: F reads ``pre``'s output, B adds ``pre``'s pullback
    last: Any     # ... on the last virtual stage: F adds ``post``'s loss and gradient


class LockstepRow(NamedTuple):
    """One tick of a lockstep table; the scan runs over a ``[ticks, ...]`` stack of them."""

    kind: Any       # []: index of the tick's action kind, the same on every device
    acts: Any       # [p] bool
    first: Any      # [p] bool
    last: Any       # [p] bool
    slots: Slots    # each [p]; a stage without an action writes to the spare slots
    fwd_pat: Any
    bwd_pat: Any
    fwd_recv: Any
    bwd_recv: Any


class LockstepTable(NamedTuple):
    kinds: list        # ActionKind(op) of each tick kind
    fwd_pats: list
    bwd_pats: list
    rows: LockstepRow


def lockstep_table(program: Program) -> LockstepTable:
    """The rows of a lowered lockstep program (one kind per tick, :func:`._lockstep.lockstep`).

    Args:
        program: ``lower(lockstep(schedule))``.

    Returns:
        The tick kinds, the send patterns and the rows; a stage without an action gets the spare
        slots: residual ``n_res``, frontier ``n_grad``, cotangent ``n_bwd`` (the discard slot, which
        every F but the head's writes its unused d loss / d y to).
    """
    ticks = program.ticks
    ops = [{i.op for i in t.instrs} - {"idle"} for t in ticks]
    if any(len(o) != 1 for o in ops):
        raise ScheduleError(f"schedule {program.schedule.name!r} is not a lockstep table (a tick holds the kinds "
                            f"{sorted(next(o for o in ops if len(o) != 1))}); re-time it with "
                            "jaxpar.parallel.pipeline.lockstep.")
    kinds = sorted({ActionKind(o.pop()) for o in ops})
    fwd_pats = sorted({t.fwd_pairs for t in ticks if t.fwd_pairs})
    bwd_pats = sorted({t.bwd_pairs for t in ticks if t.bwd_pairs})
    spare = {"res": program.n_res, "grad": program.n_grad, "dy": program.n_bwd}

    def slot(i, name):
        if name == "dy" and not (i.op == "F" and i.last):      # only the head writes d loss / d y
            return spare["dy"]
        return getattr(i, name) if i.op != "idle" else spare.get(name, 0)

    per_stage = lambda f: np.array([[f(i) for i in t.instrs] for t in ticks])             # noqa: E731
    pattern = lambda pats, pairs: pats.index(pairs) + 1 if pairs else 0                  # noqa: E731
    rows = LockstepRow(
        kind=np.array([kinds.index(ActionKind(next(i.op for i in t.instrs if i.op != "idle"))) for t in ticks],
                      np.int32),
        acts=per_stage(lambda i: i.op != "idle"), first=per_stage(lambda i: i.first),
        last=per_stage(lambda i: i.last),
        slots=Slots(*(per_stage(lambda i, a=a: slot(i, a)).astype(np.int32)
                      for a in ("microbatch", "chunk", "res", "inbox", "dy", "grad"))),
        fwd_pat=np.array([pattern(fwd_pats, t.fwd_pairs) for t in ticks], np.int32),
        bwd_pat=np.array([pattern(bwd_pats, t.bwd_pairs) for t in ticks], np.int32),
        fwd_recv=np.array([t.fwd_recv for t in ticks], np.int32),
        bwd_recv=np.array([t.bwd_recv for t in ticks], np.int32))
    return LockstepTable(kinds, fwd_pats, bwd_pats, rows)


def lockstep_state(program: Program, stage: Stage) -> PipelineState:
    """The buffers before the first tick, with the spare residual and frontier slots.

    Args:
        program: the lowered lockstep program.
        stage: the stage.

    Returns:
        The :class:`~._buffers.PipelineState` of zeros, one extra residual and frontier slot each.
    """
    spare = replace(program, n_res=program.n_res + 1, n_grad=program.n_grad + 1 if program.n_grad else 0)
    return initial_state(spare, stage)


def _pick(flag, new, old):
    """``new`` where ``flag``, else ``old``, leaf by leaf."""
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


class LockstepStage(Stage):
    """A :class:`~._stage.Stage` whose actions run on every device, masked by :class:`StageFlags`."""

    def _each_layer(self, one: Callable, n) -> Callable:
        """A scan step: ``one`` on every layer, a padding layer's result masked (no conditional)."""
        if not self.uneven:
            return one

        def masked(carry, item):
            new, out = one(carry, item)
            return _pick(item[-1] < n, new, carry), out

        return masked

    def branch(self, kind: ActionKind) -> Callable[[SlotView, Slots, StageFlags], TickIO]:
        """The masked action of a kind.

        Args:
            kind: the tick's :class:`~._stage.ActionKind` (its op: F, B or W).

        Returns:
            ``(view, slots, flags) -> TickIO``.
        """
        return {"F": self.forward, "B": self.backward, "W": self.weights}[kind.op]

    def forward(self, view: SlotView, sl: Slots, flags: StageFlags) -> TickIO:
        """F on every stage: ``pre`` or the received activation, the chunk's layers, ``post``.

        Args:
            view: what the action reads (:class:`~._buffers.SlotView`).
            sl: this stage's slots at the tick (spare slots when it has no action).
            flags: this stage's :class:`StageFlags` at the tick.

        Returns:
            The :class:`~._buffers.TickIO` to write and send.
        """
        n, bp, mb, outer = self.n_layers[sl.chunk], self.chunk_params(sl), take_tree(self.mbs, sl.mb), self.outer
        x = _pick(flags.first, self._cast(self.parts.pre(outer, mb)), view.x)
        y, res = self.forward_layers(bp, x, n, view.res, sl.res)
        (loss, found), (g_outer, dy) = jax.value_and_grad(self.post, argnums=(0, 1), has_aux=True)(outer, y, mb)
        keep = flags.acts & flags.last
        added = jax.tree.map(lambda a, d: a + d.astype(a.dtype) / self.m, view.g_outer, g_outer)
        return self._unchanged(view)._replace(
            res=res, send_f=self._cast(y), dy_out=self._cast(jax.tree.map(lambda d: d / self.m, dy)),
            loss=view.loss + jnp.where(keep, loss.astype(jnp.float32), 0.0),
            metrics=jax.tree.map(lambda a, f: a + jnp.where(keep, f, 0), view.metrics, found),
            g_outer=_pick(keep, added, view.g_outer))

    def backward(self, view: SlotView, sl: Slots, flags: StageFlags) -> TickIO:
        """B on every stage: the chunk's pullbacks (the weight gradients masked), then ``pre``'s.

        Args:
            view: what the action reads (:class:`~._buffers.SlotView`).
            sl: this stage's slots at the tick (spare slots when it has no action).
            flags: this stage's :class:`StageFlags` at the tick.

        Returns:
            The :class:`~._buffers.TickIO` to write and send.
        """
        dx, io = self.chunk_backward(view, sl)        # a split B's frontier goes to the spare slot when idle
        if not self.split:
            io = io._replace(g_chunk=_pick(flags.acts, io.g_chunk, view.g_chunk))
        mb = take_tree(self.mbs, sl.mb)
        _, pull = jax.vjp(lambda q: self.parts.pre(q, mb), self.outer)
        added = jax.tree.map(lambda a, d: a + d.astype(a.dtype), view.g_outer, pull(self._cast(dx))[0])
        return io._replace(send_b=self._cast(dx), g_outer=_pick(flags.acts & flags.first, added, view.g_outer))

    def weights(self, view: SlotView, sl: Slots, flags: StageFlags) -> TickIO:
        """W on every stage: the chunk's weight gradients, masked.

        Args:
            view: what the action reads (:class:`~._buffers.SlotView`).
            sl: this stage's slots at the tick (spare slots when it has no action).
            flags: this stage's :class:`StageFlags` at the tick.

        Returns:
            The :class:`~._buffers.TickIO` to write and send.
        """
        g_chunk = self.weight_layers(self.chunk_params(sl), view.res, view.gys, sl.res, sl.grad,
                                     self.n_layers[sl.chunk], view.g_chunk)
        return self._unchanged(view)._replace(g_chunk=_pick(flags.acts, g_chunk, view.g_chunk))


def lockstep_tick(stage: LockstepStage, table: LockstepTable, branches: list, st: PipelineState,
                  row: LockstepRow):
    """One tick: the tick's action on every stage (its slots and flags), then the sends.

    Args:
        stage: the stage.
        table: the lockstep table.
        branches: the masked action of each of ``table.kinds``.
        st: the state before the tick.
        row: the tick's row.

    Returns:
        ``(state after the tick, None)``: a ``lax.scan`` step over the table's rows.
    """
    s = stage.index
    sl = Slots(*(take(a, s) for a in row.slots))
    flags = StageFlags(take(row.acts, s), take(row.first, s), take(row.last, s))
    none = stage.nothing()

    def act(i):
        def run(st, send_f, send_b):
            io = branches[i](stage.read(st, sl), sl, flags)
            return stage.write(st, sl, io), io.send_f, io.send_b
        return run

    st, send_f, send_b = one_of(row.kind, table.kinds, act, (st, none, none))
    return exchange(st, table, row, s, send_f, send_b), None
