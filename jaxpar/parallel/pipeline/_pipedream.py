"""PipeDream's pipelines without flushes, PipeDream-2BW and weight stashing (docs/pipeline.md states
both version rules): the versions of their no-flush 1F1B tables (:func:`step_windows`,
:func:`version_rows`, :func:`lower_stashed`), and the :class:`VersionedStage` both run, which reads the
weight version a table names (:class:`VersionRows`); where their update runs is :mod:`jaxpar.step`'s.

Example:
    >>> from jaxpar.parallel.pipeline._schedules import pipedream, pipedream_2bw
    >>> [end - start for start, end in step_windows(4, 8, 3)]   # the fill once, then m F + m B per step
    [22, 16, 16]
    >>> two_bw_versions(pipedream_2bw(4, 8, steps=3), m=8)     # the last stage finishes a step first
    (2, 2, 2, 1)
    >>> s = pipedream(4, 4, steps=3)
    >>> stashed_versions(s, update_every=1), stashed_versions(s, update_every=1, vertical_sync=True)
    ((4, 3, 2, 1), (4, 4, 4, 4))
    >>> [version(s.num_stages, st, 5) for st in range(4)], lower_stashed(s, m=4).n_slots
    ([2, 3, 4, 5], 4)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.pipeline._buffers import PipelineState, Slots, SlotView, TickIO, put, put_tree, take, take_tree
from jaxpar.parallel.pipeline._instructions import Program, colour_intervals, lower
from jaxpar.parallel.pipeline._schedules import Schedule, canonical_kind
from jaxpar.parallel.pipeline._stage import ActionKind, Stage
from jaxpar.errors import StashingError, check_int


def _runs(kind: str, strategy, mesh_sizes: Mapping[str, int]) -> bool:
    return canonical_kind(strategy.schedule) == kind and dict(mesh_sizes).get("pipe", 1) > 1


def is_two_bw(strategy, mesh_sizes: Mapping[str, int]) -> bool:
    """Whether a strategy runs PipeDream-2BW: its schedule (any of its names) with a ``pipe`` axis > 1.

    >>> from jaxpar import Strategy
    >>> is_two_bw(Strategy(schedule="2bw", microbatches=2), {"pipe": 2}), is_two_bw(Strategy(), {"pipe": 2})
    (True, False)
    """
    return _runs("pipedream-2bw", strategy, mesh_sizes)


def is_stashing(strategy, mesh_sizes: Mapping[str, int]) -> bool:
    """Whether a strategy runs weight stashing: ``schedule='pipedream'`` with a ``pipe`` axis > 1."""
    return _runs("pipedream", strategy, mesh_sizes)


# ----------------------------------------------------------------------------- PipeDream-2BW
def step_windows(p: int, m: int, steps: int) -> list[tuple[int, int]]:
    """``[start, end)`` ticks of each optimizer step in ``pipedream_2bw(p, m, steps)``.

    Step ``t``'s update (``W(t+1)``) follows tick ``end - 1`` of window ``t``: the last backward of
    step ``t``'s micro-batches on stage 0. The first window holds the fill (``2m + 2(p-1)`` ticks),
    every later one ``2m`` ticks; the last also holds the drain.

    Args:
      p: the number of stages.
      m: micro-batches per optimizer step.
      steps: optimizer steps in the table.

    Returns:
      One ``(start, end)`` per step: ``step_windows(2, 2, 3) == [(0, 6), (6, 10), (10, 14)]``.
    """
    lag = 2 * p - 2
    return [(0 if t == 0 else 2 * t * m + lag, 2 * (t + 1) * m + lag) for t in range(steps)]


def version_rows(program: Program, m: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ver, cur, new)``, int32 ``[ticks, p]`` each, of the lowered 2BW table of ``steps`` steps of ``m``
    micro-batches: during window ``t`` a stage holds ``W(t-1)`` (slot 0) and ``W(t)`` (slot 1), and
    micro-batch ``i`` reads ``W(i // m - 1)``, slot ``i // m - t`` (an idle cell slot 0). ``cur`` and
    ``new`` are zero: no action updates (the model is updated between windows).

    >>> from jaxpar.parallel.pipeline._schedules import pipedream_2bw
    >>> ver, _, _ = version_rows(lower(pipedream_2bw(2, 2, 2)), m=2, steps=2)
    >>> ver[:, 0].tolist()      # stage 0: step 1's forward in window 0 reads W(0) (slot 1), the rest W(t-1)
    [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    """
    p = program.schedule.num_stages
    window = np.zeros(len(program.ticks), np.int64)
    for t, (lo, hi) in enumerate(step_windows(p, m, steps)):
        window[lo:hi] = t
    mb = np.array([[i.microbatch for i in tick.instrs] for tick in program.ticks])
    ver = np.clip(mb // m - window[:, None], 0, 1).astype(np.int32)
    return ver, np.zeros_like(ver), np.zeros_like(ver)


def two_bw_versions(schedule: Schedule, m: int) -> tuple[int, ...]:
    """Weight versions each stage must hold when micro-batch ``i`` runs on version ``i // m``:
    a version lives from its first action on the stage to its last (interval colouring).

    Args:
      schedule: the table (:func:`~jaxpar.parallel.pipeline.pipedream_2bw`, or any other).
      m: micro-batches per optimizer step.

    Returns:
      The number of versions per stage, ``(stage 0, ..., stage p - 1)``.

    >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b
    >>> two_bw_versions(one_f_one_b(4, 8), m=8)     # a flush: one version at a time
    (1, 1, 1, 1)
    """
    p = schedule.num_stages
    span: list[dict[int, list[int]]] = [{} for _ in range(p)]
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:        # ticks ascend: the first sets the start, each one the end
                span[s].setdefault(a.microbatch // m, [t, t])[1] = t
    return tuple(colour_intervals((v, lo, hi) for v, (lo, hi) in span[s].items())[1] for s in range(p))


# ----------------------------------------------------------------------------- weight stashing
def version(p: int, stage: int, i: int, update_every: int = 1, vertical_sync: bool = False) -> int:
    """``v_s(i)``, the version F(i) and B(i) read on a stage, relative to those a call starts from:
    ``0`` is ``state.params``, ``-j`` is ``state.versions[j - 1]`` (see the module docstring).

    >>> [version(2, 0, i) for i in range(4)], [version(2, 0, i, update_every=2) for i in range(4)]
    ([-1, 0, 1, 2], [-1, 0, 0, 1])
    """
    d = p - 1 if vertical_sync else p - 1 - stage
    return (i - d) // update_every


def older_versions(p: int, update_every: int = 1) -> int:
    """Older versions the train state keeps beside ``params``: ``ceil((p - 1) / update_every)``.

    >>> older_versions(4), older_versions(4, update_every=2), older_versions(2, update_every=4)
    (3, 2, 1)
    """
    return -(-(p - 1) // update_every)


def _stage_events(schedule: Schedule, stage: int, k: int, vertical_sync: bool):
    """``(tick, action, version, updates so far)`` of one stage, checking that the table runs each
    ``F(i)`` after exactly ``max(0, i - d_s)`` of the stage's backwards (1F1B's order)."""
    p, d = schedule.num_stages, schedule.num_stages - 1 - stage
    done, out = 0, []
    for t, row in enumerate(schedule.table):
        a = row[stage]
        if a is None:
            continue
        if a.kind == "F" and done != max(0, a.microbatch - d):
            raise StashingError(
                f"tick {t}, stage {stage}: {a} runs after {done} backwards of its stage, but weight stashing "
                f"needs 1F1B's order (after {max(0, a.microbatch - d)}): the table {schedule.name!r} is not a "
                "1F1B table without flushes. Build it with jaxpar.parallel.pipeline.pipedream(p, m, steps).")
        out.append((t, a, version(p, stage, a.microbatch, k, vertical_sync), done // k))
        done += a.kind == "B"
    return out


def _check_table(schedule: Schedule, k: int, m: int | None = None, owner: str = "lower_stashed") -> None:
    """The lowering's own arguments: a one-chunk table with a fused backward, ``update_every`` ``k``
    dividing the micro-batches per step ``m`` (default: the table's), and ``m`` the table's."""
    if schedule.num_chunks != 1 or schedule.split_backward:
        raise StashingError(f"weight stashing runs one chunk per stage with a fused backward; the table "
                            f"{schedule.name!r} has num_chunks={schedule.num_chunks}, split_backward="
                            f"{schedule.split_backward}. Use jaxpar.parallel.pipeline.pipedream(p, m, steps).")
    m = schedule.num_microbatches if m is None else m
    check_int(owner, "update_every", k, 1, StashingError)
    check_int(owner, "m", m, 1, StashingError)
    if m % k or schedule.num_microbatches % m:
        divisors = [d for d in range(1, m + 1) if m % d == 0]
        raise StashingError(f"update_every={k} must divide the micro-batches per step m={m}, and m the table's "
                            f"{schedule.num_microbatches}; use update_every in {divisors}.")


def _intervals(schedule: Schedule, stage: int, k: int, vertical_sync: bool, keep: int | None):
    """``version -> [start, end]`` ticks on one stage. A version lives from the tick after the
    update that makes it (tick 0 for those a call starts with) to its last read (F, B, or the
    update that makes the next one); ``keep``: the newest ``keep + 1`` live to the end (saved)."""
    ticks = len(schedule.table)
    span: dict[int, list[int]] = {}
    for t, a, v, u in _stage_events(schedule, stage, k, vertical_sync):     # ticks ascend: a read ends a life
        span.setdefault(v, [0, t])[1] = t
        if a.kind == "B" and (a.microbatch + 1) % k == 0:       # the update after this backward
            span.setdefault(u, [0, t])[1] = t
            span[u + 1] = [t + 1, t + 1]
    final = schedule.num_microbatches // k
    span.setdefault(final, [0, 0])
    if keep is not None:
        for v in range(final - keep, final + 1):
            span.setdefault(v, [0, 0])[1] = ticks
    return span


def stashed_versions(schedule: Schedule, update_every: int = 1, vertical_sync: bool = False) -> tuple[int, ...]:
    """Weight versions each stage holds at once when it runs ``schedule`` with stashing
    (interval colouring of the versions' live ticks, like the executor's residual slots).

    Args:
        schedule: a no-flush 1F1B table (:func:`~jaxpar.parallel.pipeline.pipedream`).
        update_every: backwards per update; it must divide the table's micro-batches.
        vertical_sync: every stage reads the version stage 0 reads.

    Returns:
        The number of versions per stage, ``(stage 0, ..., stage p - 1)``.
    """
    _check_table(schedule, update_every, owner="stashed_versions")
    return tuple(colour_intervals((v, lo, hi) for v, (lo, hi) in
                                  _intervals(schedule, s, update_every, vertical_sync, None).items())[1]
                 for s in range(schedule.num_stages))


def update_ticks(schedule: Schedule, update_every: int = 1) -> list[tuple[int, int]]:
    """``(stage, tick)`` of every update of a no-flush 1F1B table (after the tick's backward), for a Gantt chart."""
    return [(s, t) for t, row in enumerate(schedule.table) for s, a in enumerate(row)
            if a is not None and a.kind == "B" and (a.microbatch + 1) % update_every == 0]


@dataclass(frozen=True)
class StashProgram:
    """A lowered no-flush table (:class:`~jaxpar.parallel.pipeline.Program`) plus the version
    slots: ``ver[t][s]`` the slot F / B read, ``cur`` / ``new`` the slots an update reads and
    writes (``update[t][s]``), ``init[s][j]`` the slot version ``-j`` is loaded into (``n_slots``:
    not read in this call), ``final[s][j]`` the slot holding the newest version ``- j`` at the end."""

    program: Program
    n_slots: int
    older: int
    ver: tuple
    cur: tuple
    new: tuple
    update: tuple
    init: tuple
    final: tuple


def lower_stashed(schedule: Schedule, *, m: int, update_every: int = 1, vertical_sync: bool = False) -> StashProgram:
    """Lower a no-flush 1F1B table (:func:`~jaxpar.parallel.pipeline.pipedream`) of ``m`` micro-batches
    per optimizer step with version slots; a :class:`~jaxpar.errors.StashingError` if the table is not
    in 1F1B's order or ``update_every`` does not divide ``m``."""
    program = lower(schedule)
    k, p = update_every, schedule.num_stages
    _check_table(schedule, k, m)
    older, ticks = older_versions(p, k), len(schedule.table)
    ver, cur, new, upd = ([[0] * p for _ in range(ticks)] for _ in range(4))
    init, final, n_slots = [], [], 0
    for s in range(p):
        span = _intervals(schedule, s, k, vertical_sync, older)
        unread = {v for v in range(-older, 1) if span.get(v, [0, -1])[1] < 0}
        slot, n = colour_intervals((v, lo, hi) for v, (lo, hi) in span.items() if v not in unread)
        n_slots = max(n_slots, n)
        for t, a, v, u in _stage_events(schedule, s, k, vertical_sync):
            ver[t][s] = slot[v]
            if a.kind == "B" and (a.microbatch + 1) % k == 0:
                cur[t][s], new[t][s], upd[t][s] = slot[u], slot[u + 1], 1
        top = schedule.num_microbatches // k
        init.append(tuple(-1 if -j in unread else slot[-j] for j in range(older + 1)))
        final.append(tuple(slot[top - j] for j in range(older + 1)))
    init = tuple(tuple(n_slots if x < 0 else x for x in row) for row in init)
    ver, cur, new, upd = (tuple(map(tuple, rows)) for rows in (ver, cur, new, upd))
    return StashProgram(program, n_slots, older, ver, cur, new, upd, init, tuple(final))


def optimizer_is_per_stage(tx: optax.GradientTransformation, shapes: Any, block_ids: set) -> bool:
    """Whether ``tx`` updates each stage's parameters from their own values and gradients alone, as weight
    stashing runs it (SGD, Adam, AdamW: yes; a global norm or a trust ratio over a stacked leaf: no): two
    steps on a small tree of ``shapes``' ranks, whole and split into two stages (``block_ids``' leaves by
    rows, the others alternately), agree to ``rtol=1e-5``.

    >>> shapes = {"blocks": jax.ShapeDtypeStruct((4, 3), "float32"), "head": jax.ShapeDtypeStruct((3,), "float32")}
    >>> optimizer_is_per_stage(optax.adam(1e-3), shapes, {0}), optimizer_is_per_stage(
    ...     optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0)), shapes, {0})
    (True, False)
    """
    leaves, treedef = jax.tree.flatten(shapes)
    rng = np.random.default_rng(0)
    small = [np.asarray(rng.normal(size=(2,) * len(a.shape)), np.float32) for a in leaves]
    grads = [[np.asarray(rng.normal(size=a.shape), np.float32) for a in small] for _ in range(2)]
    outer_b = {i for n, i in enumerate(i for i in range(len(leaves)) if i not in block_ids) if n % 2}

    def run(sel):
        params = [a[sel[i]] if i in block_ids else a for i, a in enumerate(small)]
        state = tx.init(treedef.unflatten(params))
        for g in grads:
            g = [x[sel[i]] if i in block_ids else x * sel[i] for i, x in enumerate(g)]
            p_tree = treedef.unflatten(params)
            upd, state = tx.update(treedef.unflatten(g), state, p_tree)
            params = treedef.flatten_up_to(optax.apply_updates(p_tree, upd))
        return params

    whole = run({i: slice(None) if i in block_ids else 1.0 for i in range(len(leaves))})
    for half, rows in ((0, slice(0, 1)), (1, slice(1, 2))):
        own = {i: rows if i in block_ids else float((i in outer_b) == bool(half)) for i in range(len(leaves))}
        got = run(own)
        for i in range(len(leaves)):
            ref = whole[i][rows] if i in block_ids else whole[i]
            if (i in block_ids or own[i]) and not np.allclose(got[i], ref, rtol=1e-5, atol=1e-6):
                return False
    return True


def stacked_block_ids(logical) -> set:
    """The indices, among the flattened parameter leaves, of those stacked on ``layers`` (whose first
    logical name is ``layers``; ``logical``: the layout's ``PartitionSpec`` tree of logical names)."""
    flat = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
    return {i for i, lg in enumerate(flat) if tuple(lg)[:1] == ("layers",)}


# ----------------------------------------------------------------------------- the versioned stage
class VersionRows(NamedTuple):
    """Per tick and stage (int32 ``[ticks, p]``): the version slot an action reads (``ver``), and
    the slots an update reads (``cur``) and writes (``new``)."""

    ver: Any
    cur: Any
    new: Any


class StageWeights(NamedTuple):
    """What a stage carries beside its buffers: its versions and, for updates in the tick loop,
    its optimizer state and each sum slot's squared update norms, skipped updates and last learning rate."""

    w: Any          # (outer [V, ...], blocks [V, v, Lmax, ...])
    opt: Any
    gsq: Any        # [sums]
    skips: Any      # [sums]
    lr: Any         # [sums]


#: ``update(w_cur, opt, g_outer, g_chunk) -> (w_new, opt, squared gradient norm, skipped, learning rate)``: a
#: stage's own optimizer update on its newest version (``w_cur``, one version of the buffer) from
#: the update's gradient sums.
StageUpdate = Callable[[Any, Any, Any, Any], tuple]


class VersionedStage(Stage):
    """A stage whose actions read the weight version their table names, carried through the tick
    loop as :class:`StageWeights` with :class:`VersionRows` beside the tick's rows
    (:func:`~jaxpar.parallel.pipeline._stage.run_ticks`). Gradients are summed per *accumulator*
    (``(i // per_step) % accumulators`` for micro-batch ``i``: 2BW keeps two, since the next step's
    first backwards run before this step's update), the loss and what it reported per *sum slot*
    (``(i // per_step) % sums``).

    Args:
      parts: the model's ``pre``, ``layer`` and ``post``.
      program: the lowered no-flush table.
      counts: real layers per virtual stage (:func:`~jaxpar.parallel.pipeline._instructions.stage_counts`).
      like: one version, ``(outer, blocks [v, Lmax, ...])``, in the compute dtype (its shapes).
      mbs: the micro-batches, ``[n, rows, ...]`` per leaf.
      per_update: micro-batches per update: a gradient is their mean.
      per_step: micro-batches per optimizer step.
      accumulators: gradient accumulators.
      sums: loss and metric slots.
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
        """The layers of the version the running action reads, chunk ``sl.chunk``."""
        return take_tree(self._w[1], sl.chunk)

    def outer_params(self, sl: Slots):
        """``outer`` of the version the running action reads."""
        return self._w[0]

    def sum_slot(self, sl: Slots):
        """The loss and metric slot of an action's micro-batch: ``(mb // per_step) % sums`` (traced)."""
        return (sl.mb // self.per_step) % self.sums

    def _acc(self, sl: Slots):
        return (sl.mb // self.per_step) % self.accumulators

    def read(self, st: PipelineState, sl: Slots) -> SlotView:
        """What an action reads: its slots, and its micro-batch's accumulator and sum slot."""
        a, s = self._acc(sl), self.sum_slot(sl)
        one = st._replace(g_outer=self._outer_sum(st.g_outer, a), loss=take(st.loss, s),
                          metrics=take_tree(st.metrics, s))
        return super().read(one, sl._replace(chunk=a * self.v + sl.chunk))

    def write(self, st: PipelineState, sl: Slots, io: TickIO) -> PipelineState:
        """``st`` with what an action hands back written, into its accumulator and sum slot."""
        a, s = self._acc(sl), self.sum_slot(sl)
        new = super().write(st, sl._replace(chunk=a * self.v + sl.chunk), io)
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
        """The buffers before the first tick: the gradient sums per accumulator, the loss and metrics per sum slot."""
        st = super().initial_state(program)
        many = lambda t, n: jax.tree.map(lambda z: jnp.zeros((n, *z.shape), z.dtype), t)   # noqa: E731
        n = self.accumulators
        return st._replace(g_blocks=jax.tree.map(lambda z: jnp.concatenate([z] * n), st.g_blocks),
                           g_outer=st.g_outer if n == 1 else many(st.g_outer, n), loss=many(st.loss, self.sums),
                           metrics=many(st.metrics, self.sums))

    def branch(self, kind: ActionKind) -> Callable:
        """The action of ``kind`` on the version slot the tick reads (``versions.ver``); where the kind
        updates, then the stage's update of version ``cur`` into slot ``new`` on the accumulated gradient
        (zeroed)."""
        def run(st, ws: StageWeights, sl, flags, versions: VersionRows):
            self._w = self.cast(take_tree(ws.w, versions.ver))
            io = self.act(kind, self.read(st, sl), sl, flags)
            if kind.updates:
                w_new, opt, gsq, skip, lr = self.update(take_tree(ws.w, versions.cur), ws.opt, io.g_outer,
                                                        io.g_chunk)
                s = self.sum_slot(sl)
                ws = StageWeights(jax.tree.map(lambda b, x: put(b, versions.new, x), ws.w, w_new), opt,
                                  ws.gsq.at[s].add(gsq), ws.skips.at[s].add(skip), ws.lr.at[s].set(lr))
                io = io._replace(g_chunk=jax.tree.map(jnp.zeros_like, io.g_chunk),
                                 g_outer=jax.tree.map(jnp.zeros_like, io.g_outer))
            return self.write(st, sl, io), ws, io

        return run
