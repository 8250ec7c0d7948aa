"""PipeDream's no-flush pipelines as one program: stages whose actions read the weight version a table names.

PipeDream-2BW with ``steps_per_call`` > 1 and weight stashing (``schedule='pipedream'``) run ``K``
optimizer steps of a table that never drains, as one program: every stage keeps a buffer of
weight versions, ``(outer [V, ...], blocks [V, v, Lmax, ...])``, and runs the table's ticks on a
:class:`VersionedStage`. Three int32 tables ``[ticks, p]`` (:class:`VersionRows`) say, per tick and
stage, which version slot the action reads (``ver``) and, for an action that ends an update,
which slot the update reads (``cur``) and writes (``new``). The schedules fill them in, and say
*where the update runs*; both call the train step's one update
(:func:`~jaxpar.step._update.apply_update`):

* PipeDream-2BW (:func:`~jaxpar.parallel.pipeline._two_bw.version_rows`): two versions, ``W(t-1)``
  and ``W(t)`` during step window ``t``; no action updates: the whole model is updated between
  windows, outside the tick loop, under 2BW's rule (:mod:`jaxpar.step._no_flush_steps`), so every
  optax optimizer and ``clip_norm`` work;
* weight stashing (:func:`~jaxpar.parallel.pipeline._stash_versions.lower_stashed`): a stage's
  versions in slots assigned by interval colouring; the backward that ends an ``update_every``
  group runs the stage's own update (:class:`StageUpdate`) in the same conditional and writes the
  new version (:mod:`jaxpar.step._stashing_step`).

Gradients are summed per *accumulator* (``(i // per_step) % accumulators`` for micro-batch ``i``:
2BW keeps two, since the next step's first backwards run before this step's update), the loss and
what the loss reported per *sum slot* (``(i // per_step) % sums``: the step, or 2BW's two). The
metrics are :mod:`jaxpar.step._update`'s (with several updates per step,
:func:`~jaxpar.step._update.updates_metrics`), per step.

Example:
    >>> from jaxpar import Strategy
    >>> check_versioned_state(Strategy(schedule="pipedream", microbatches=2), {"pipe": 4}, ())
    Traceback (most recent call last):
    ...
    jaxpar.errors.StashingError: make_train_step with schedule='pipedream', but the layout keeps no 3 older ...
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.pipeline._buffers import PipelineState, Slots, SlotView, TickIO, put, put_tree, read_slots, \
    take, take_tree, write_slots
from jaxpar.parallel.pipeline._instructions import Program
from jaxpar.parallel.pipeline._stage import TICKS_SCOPE, ActionKind, Stage, TickTable, exchange, initial_state, \
    one_of, tick_table
from jaxpar.parallel.pipeline._stash_versions import StashingError, check_stashing, older_versions
from jaxpar.parallel.pipeline._two_bw import AsyncPipelineError, check_two_bw


class VersionRows(NamedTuple):
    """Per tick and stage (int32 ``[ticks, p]``): the version slot an action reads (``ver``), and
    the slots an update reads (``cur``) and writes (``new``)."""

    ver: Any
    cur: Any
    new: Any


class StageWeights(NamedTuple):
    """What a stage carries beside its buffers: its versions and, for updates in the tick loop,
    its optimizer state and each sum slot's squared update norms and skipped updates."""

    w: Any          # (outer [V, ...], blocks [V, v, Lmax, ...])
    opt: Any
    gsq: Any        # [sums]
    skips: Any      # [sums]


#: ``update(w_cur, opt, g_outer, g_chunk) -> (w_new, opt, squared gradient norm, skipped)``: a
#: stage's own optimizer update on its newest version (``w_cur``, one version of the buffer) from
#: the update's gradient sums.
StageUpdate = Callable[[Any, Any, Any, Any], tuple]


class _View(NamedTuple):
    base: SlotView
    w_use: Any      # the version the action reads
    w_cur: Any      # the newest version (an update's input)
    opt: Any


class _IO(NamedTuple):
    base: TickIO
    w_new: Any
    opt: Any
    gsq: Any
    skip: Any


class VersionedStage(Stage):
    """A stage whose actions read the weight version their table names (see the module docstring).

    Args:
      parts: the model's ``pre``, ``layer`` and ``post``.
      program: the lowered no-flush table.
      counts: real layers per virtual stage (:func:`~jaxpar.parallel.pipeline._stage.stage_counts`).
      like: one version, ``(outer, blocks [v, Lmax, ...])``, in the compute dtype (its shapes).
      mbs: the micro-batches, ``[n, rows, ...]`` per leaf.
      per_update: micro-batches per update: a gradient is their mean.
      per_step: micro-batches per optimizer step.
      accumulators: gradient accumulators (micro-batch ``i`` adds into ``(i // per_step) % accumulators``).
      sums: loss and metric slots (``(i // per_step) % sums``).
      cast: parameters to the compute dtype.
      update: the stage's own update after the actions the table marks (``None``: none do).
    """

    def __init__(self, parts, program: Program, counts, like, mbs, *, per_update: int, per_step: int,
                 accumulators: int, sums: int, cast: Callable, update: StageUpdate | None = None):
        super().__init__(parts, program, counts, like[0], like[1], mbs)
        self.m, self.per_step = per_update, per_step     # Stage's gradient scale: the mean over an update
        self.accumulators, self.sums, self.v = accumulators, sums, program.schedule.num_chunks
        self.cast, self.update, self._w = cast, update, like

    def chunk_params(self, sl: Slots):
        """The layers of the version the running action reads.

        Args:
          sl: the action's slots (its ``chunk``).

        Returns:
          One chunk's layers, ``[Lmax, ...]`` per leaf.
        """
        return take_tree(self._w[1], sl.chunk)

    def outer_params(self, sl: Slots):
        """``outer`` of the version the running action reads.

        Args:
          sl: the action's slots.

        Returns:
          The parameters of ``pre`` / ``post``.
        """
        return self._w[0]

    def sum_slot(self, sl: Slots):
        """The loss and metric slot of an action's micro-batch.

        Args:
          sl: the action's slots (its ``mb``).

        Returns:
          ``(mb // per_step) % sums`` (traced int32).
        """
        return (sl.mb // self.per_step) % self.sums

    def _acc(self, sl: Slots):
        return (sl.mb // self.per_step) % self.accumulators

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action reads: its slots, and its micro-batch's accumulator and sum slot.

        Args:
          st: the stage's state.
          sl: the action's slots.

        Returns:
          The :class:`~jaxpar.parallel.pipeline._buffers.SlotView`.
        """
        a, s = self._acc(sl), self.sum_slot(sl)
        one = st._replace(g_outer=self._outer_sum(st.g_outer, a), loss=take(st.loss, s),
                          metrics=take_tree(st.metrics, s))
        return read_slots(one, sl._replace(chunk=a * self.v + sl.chunk))

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """Write back what an action hands back, into its accumulator and sum slot.

        Args:
          st: the stage's state.
          sl: the action's slots.
          io: what the action hands back.

        Returns:
          ``st`` with ``io`` written.
        """
        a, s = self._acc(sl), self.sum_slot(sl)
        new = write_slots(st, sl._replace(chunk=a * self.v + sl.chunk), io)
        metrics = st.metrics if io.metrics is None else put_tree(st.metrics, s, io.metrics)
        return new._replace(g_outer=self._outer_sum(st.g_outer, a, io.g_outer), loss=put(st.loss, s, io.loss),
                            metrics=metrics)

    def _outer_sum(self, sums, a, value=None):
        """Accumulator ``a`` of the gradient of ``outer`` (``value``: ``sums`` with it set). With one
        accumulator the sum has no accumulator axis, so the stage's program is a plain pipeline's."""
        if self.accumulators == 1:
            return sums if value is None else value
        return take_tree(sums, a) if value is None else jax.tree.map(lambda b, g: put(b, a, g), sums, value)

    def initial_state(self, program: Program) -> PipelineState:
        """The stage's buffers before the first tick.

        Args:
          program: the lowered table (its slot counts).

        Returns:
          Empty buffers, the gradient sums per accumulator, the loss and metrics per sum slot.
        """
        st = initial_state(program, self)
        many = lambda t, n: jax.tree.map(lambda z: jnp.zeros((n, *z.shape), z.dtype), t)   # noqa: E731
        n = self.accumulators
        return st._replace(g_blocks=jax.tree.map(lambda z: jnp.concatenate([z] * n), st.g_blocks),
                           g_outer=st.g_outer if n == 1 else many(st.g_outer, n), loss=many(st.loss, self.sums),
                           metrics=many(st.metrics, self.sums))

    def versioned_branch(self, kind: tuple) -> Callable[[_View, Slots], _IO]:
        """The action of a kind: F / B / W on the version the tick reads, then, where the kind
        updates, the stage's update on the accumulated gradient (zeroed).

        Args:
          kind: ``(op, first, last, updates)`` (:func:`versioned_table`).

        Returns:
          ``(view, slots) -> io``: what the tick runs in the kind's conditional.
        """
        base, updates = self.branch(ActionKind(*kind[:3])), kind[3]
        zero = jnp.zeros((), jnp.float32)

        def run(view: _View, sl: Slots) -> _IO:
            self._w = self.cast(view.w_use)
            io = base(view.base, sl)
            if not updates:
                return _IO(io, view.w_cur, view.opt, zero, zero)
            w_new, opt, gsq, skip = self.update(view.w_cur, view.opt, io.g_outer, io.g_chunk)
            io = io._replace(g_chunk=jax.tree.map(jnp.zeros_like, io.g_chunk),
                             g_outer=jax.tree.map(jnp.zeros_like, io.g_outer))
            return _IO(io, w_new, opt, gsq, skip)

        return run


def versioned_table(program: Program, updates) -> tuple[TickTable, list, Any]:
    """The program's :func:`~jaxpar.parallel.pipeline._stage.tick_table` with one branch per
    ``(op, first, last, updates)``.

    Args:
      program: the lowered table.
      updates: ``updates[t][s]``: the action of stage ``s`` at tick ``t`` ends an update (``None``: none does).

    Returns:
      ``(table, kinds, rows)``: the table (its send patterns), the branch kinds, and its rows with
      ``kind`` indexing ``kinds``.
    """
    table = tick_table(program)
    keys = [[(*ActionKind.of(ins), bool(updates and updates[t][s])) for s, ins in enumerate(tick.instrs)]
            for t, tick in enumerate(program.ticks)]
    kinds = sorted({k for row in keys for k in row})
    rows = table.rows._replace(kind=np.array([[kinds.index(k) for k in row] for row in keys], np.int32))
    return table, kinds, rows


def _tick(stage: VersionedStage, table: TickTable, kinds: list, branches: list, carry, xs):
    """A tick as :func:`jaxpar.parallel.pipeline._stage.tick` runs it, with the stage's versions: the
    action reads version ``ver``; an update reads ``cur`` and writes ``new``."""
    st, ws = carry
    row, vrow = xs
    i = stage.index
    sl = Slots(*(take(a, i) for a in row.slots))
    ver, cur, new = (take(a, i) for a in vrow)
    s = stage.sum_slot(sl)
    none = stage.nothing()

    def act(k):
        def run(st, ws, send_f, send_b):
            io = branches[k](_View(stage.read(st, sl), take_tree(ws.w, ver), take_tree(ws.w, cur), ws.opt), sl)
            if kinds[k][3]:
                ws = StageWeights(jax.tree.map(lambda b, x: put(b, new, x), ws.w, io.w_new), io.opt,
                                  ws.gsq.at[s].add(io.gsq), ws.skips.at[s].add(io.skip))
            return stage.write(st, sl, io.base), ws, io.base.send_f, io.base.send_b
        return run

    st, ws, send_f, send_b = one_of(take(row.kind, i), kinds, act, (st, ws, none, none))
    return (exchange(st, table, row, i, send_f, send_b), ws), None


def run_ticks(stage: VersionedStage, table: TickTable, kinds: list, st: PipelineState, ws: StageWeights,
              rows, vrows: VersionRows) -> tuple[PipelineState, StageWeights]:
    """The stage's actions over ``rows`` (a ``lax.scan`` under :data:`TICKS_SCOPE`).

    Args:
      stage: the stage.
      table: the program's table (its send patterns).
      kinds: the branch kinds (:func:`versioned_table`).
      st: the buffers before the first of ``rows``.
      ws: the versions (and the update's state) before it.
      rows: the tick rows to run (:class:`~jaxpar.parallel.pipeline._stage.TickRow`, ``[ticks, ...]``).
      vrows: their version rows.

    Returns:
      ``(st, ws)`` after the last tick.
    """
    branches = [stage.versioned_branch(k) for k in kinds]
    with jax.named_scope(TICKS_SCOPE):
        (st, ws), _ = jax.lax.scan(functools.partial(_tick, stage, table, kinds, branches), (st, ws), (rows, vrows))
    return st, ws


def check_versioned_state(strategy, mesh_sizes: Mapping[str, int], versions: Any) -> None:
    """The schedule's own checks (:func:`~jaxpar.parallel.pipeline._two_bw.check_two_bw`,
    :func:`~jaxpar.parallel.pipeline._stash_versions.check_stashing`) and the state's versions: one
    older version for 2BW, ``ceil((pipe - 1) / update_every)`` for weight stashing.

    Args:
      strategy: the strategy (``schedule='pipedream-2bw'`` or ``'pipedream'``).
      mesh_sizes: the mesh's axis sizes.
      versions: the train state's older versions (its layout's ``versions``).

    Raises:
      AsyncPipelineError / StashingError: the strategy cannot run on this mesh, or the state keeps
        other versions than the schedule reads.
    """
    sizes = dict(mesh_sizes)
    if strategy.schedule == "pipedream":
        check_stashing(strategy, sizes)
        n = older_versions(sizes["pipe"], strategy.update_every)
        ok, error = isinstance(versions, tuple) and len(versions) == n, StashingError
        kept, made_for = f"{n} older weight versions", "another schedule or update_every"
    else:
        check_two_bw(strategy, sizes)
        ok, error = bool(versions) and not isinstance(versions, tuple), AsyncPipelineError
        kept, made_for = "second weight version", "another schedule"
    if not ok:
        raise error(f"make_train_step with schedule={strategy.schedule!r}, but the layout keeps no {kept} "
                    f"(TrainState.versions): the state was made for {made_for}. Create it with "
                    "init_train_state(..., strategy) using this same strategy.")
