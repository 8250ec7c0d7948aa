"""Bytes per step per mesh axis of a compiled train step, the figure the cost model predicts.

:func:`compiled_bytes_per_axis` counts every collective of the HLO inventory
(:func:`jaxpar.analysis.collectives`) times how often its computation runs
(:func:`jaxpar.analysis.trip_counts`: the layer scans' trip counts), so the result is
bytes per step, comparable with :func:`jaxpar.cost._traffic.bytes_per_axis`; a collective
over several mesh axes counts for each of them.

A pipelined step needs one more count. The pipeline executor (:mod:`jaxpar.parallel.pipeline._executor`)
runs the lowered schedule as one ``while`` loop of ``T`` ticks. At each tick a chain of boolean
conditionals, one per action kind that is not idle (in the order of the tick table's
``kinds``), runs the stage's action, and two switches pick the tick's forward and backward
sends (branch 0: nothing moves; branch ``j``: one ``ppermute`` over the ``j``-th set of pairs).
Counting every branch on every tick would count each collective ``T`` times;
:func:`stage_branch_weights` reads from the schedule how often each one runs:

* the conditional of kind ``k`` (two branches: 0 does nothing, 1 the action): branch 1 runs on
  the ticks where the stage's instruction is ``kinds[k]``, branch 0 on the others. XLA:CPU and
  libtpu keep it an index conditional (``branch_computations={skip, action}``); the GPU compiler
  rewrites it as a predicate conditional (``true_computation=action, false_computation=skip``),
  read in the same branch order (:func:`~jaxpar.analysis._hlo_text.branch_computations`);
* a send switch: the branch whose ``collective-permute`` moves between the stage pairs ``S``
  runs on the ticks whose forward or backward pairs are ``S``. When both switches have a
  branch for the same ``S`` (``p = 2`` with wrap-around), each gets half of the total, so the
  bytes on ``pipe`` add up (both send the same activation shape). A stage counts the branches in
  which it receives (a collective's bytes are its result on the device; the permute runs on every
  device, but one that is not a target of ``S`` gets nothing).

The tick loop is found by its trip count, ``T``: known on XLA:CPU and XLA:GPU, read from the
loop on TPU (:func:`~jaxpar.analysis.while_trip_counts`). The pipelined figure is that of
the busiest stage's device, axis by axis. JAX is imported
only inside :func:`stage_branch_weights` (for the tick table).

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jaxpar import make_mesh
    >>> mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> x = jax.ShapeDtypeStruct((3, 8, 4), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    >>> scan = lambda xs: jax.lax.scan(lambda c, x: (c + x.sum(0), None), jnp.zeros(4), xs)[0]
    >>> compiled_bytes_per_axis(jax.jit(scan).lower(x).compile(), mesh)    # 3 all-reduces of f32[4]
    {'data': 48.0}
"""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.cost._parallel import Plan
from jaxpar.cost._schedule import runs_in_lockstep
from jaxpar.parallel.pipeline._instructions import lower
from jaxpar.parallel.pipeline._schedules import get_schedule, lockstep
from jaxpar.analysis._hlo import Collective, collectives, partition_positions
from jaxpar.analysis._hlo_text import (branch_computations, by_computation, called_computations, module_text,
                                      parse_instructions)
from jaxpar.analysis._loops import trip_counts, while_trip_counts
from jaxpar.analysis._replica_groups import source_target_pairs
from jaxpar.errors import AnalysisError


def compiled_bytes_per_axis(compiled: Any, mesh: Any, plan: Plan | None = None) -> dict[str, float]:
    """Bytes per step per mesh axis of the collectives in ``compiled``, loops counted by trip count; a loop
    whose count is known only at run time (the MoE exchange's further rounds, for a skewed routing) 0 times.

    Args:
      compiled: a ``jax.stages.Compiled`` train step, or its HLO text (``as_text()``; partition ``i``
        is then taken to run on ``mesh.devices.flat[i]``, as for a deviceless compile).
      mesh: the mesh it was compiled for.
      plan: the :class:`~jaxpar.cost.Plan` it was compiled from; needed for a pipelined
        step (``plan.pipe > 1``), whose tick loop's switches are counted by how often the
        schedule takes each branch (:func:`stage_branch_weights`).

    Returns:
      ``{mesh axis: bytes}``; for a pipelined plan, per axis the largest over the pipeline
      stages' devices.
    """
    text = module_text(compiled)
    colls = collectives(compiled, mesh)
    if plan is None or plan.pipe == 1:
        return _sum_axes(colls, trip_counts(text, unknown=0.0))
    out: dict[str, float] = {}
    for weights in stage_branch_weights(compiled, mesh, plan):
        for a, v in _sum_axes(colls, trip_counts(text, weights, unknown=0.0)).items():
            out[a] = max(out.get(a, 0.0), v)
    return out


def _sum_axes(colls: list[Collective], mult: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in colls:
        for a in c.axes or ():
            out[a] = out.get(a, 0.0) + c.bytes * mult.get(c.computation, 1)
    return out


def stage_branch_weights(compiled: Any, mesh: Any, plan: Plan) -> list[dict[str, list[float]]]:
    """How often each branch of a pipelined step's tick loop runs, per pipeline stage (see the module doc).

    Args:
      compiled: a ``jax.stages.Compiled`` pipelined train step of jaxpar, or its HLO text.
      mesh: the mesh it was compiled for (with a ``pipe`` axis).
      plan: the plan it was compiled from (``pipe``, ``schedule``, ``microbatches``, ``virtual``).

    Returns:
      One dict per pipeline stage, ``{conditional name: [fraction of the ticks taking branch i]}``
      (a send branch: 0 where the stage is not a target): the ``branch_weights`` of
      :func:`jaxpar.analysis.trip_counts`.

    Raises:
      ValueError: the program has no ``while`` loop of the schedule's length, or not one action
        conditional per action kind that is not idle.
    """
    from jaxpar.parallel.pipeline._stage import tick_table

    s = plan.strategy
    schedule = get_schedule(s.schedule, plan.pipe, s.microbatches, s.virtual_stages)
    in_lockstep = runs_in_lockstep(plan)
    program = lower(lockstep(schedule) if in_lockstep else schedule)
    table, ticks = tick_table(program, lockstep=in_lockstep), program.ticks
    T = len(ticks)
    by_comp, conds = _tick_loop(module_text(compiled), T, plan)
    sends, actions = _tick_conditionals(conds, by_comp, _stage_of_partition(compiled, mesh))
    active = [k for k, kind in enumerate(table.kinds) if kind.op != "idle"]
    if len(actions) != len(active):
        raise AnalysisError(f"plan {plan.name()}: the tick loop has {len(actions)} action conditionals, expected "
                            f"one per action kind that is not idle ({len(active)}); has the executor changed?")
    send_w = _send_weights(sends, ticks)
    kinds = np.asarray(table.rows.kind)          # [T, p]; a lockstep table: [T], every stage the tick's kind
    kinds = np.repeat(kinds[:, None], plan.pipe, axis=1) if kinds.ndim == 1 else kinds
    out = []
    for s in range(plan.pipe):
        w = {name: [x if S is None or any(b == s for _, b in S) else 0.0 for x, S in zip(send_w[name], sends[name])]
             for name in sends}
        for name, k in zip(actions, active):
            taken = float((kinds[:, s] == k).sum()) / T
            w[name] = [1.0 - taken, taken]
        out.append(w)
    return out


def _tick_loop(text: str, T: int, plan: Plan) -> tuple[dict[str, list], list]:
    """The instructions by computation, and the conditionals in the bodies of the ``T``-trip loops."""
    instrs = parse_instructions(text)
    trips = while_trip_counts(text, instrs)
    by_comp = by_computation(instrs)
    bodies = {c for ins in instrs if ins.opcode == "while" and trips.get(ins.name) == T
              for key, c in called_computations(ins) if key == "body"}
    if not bodies:
        raise AnalysisError(f"plan {plan.name()}: no while loop of {T} ticks (the schedule's length) in the compiled "
                            "program; is it a jaxpar pipelined train step?")
    return by_comp, [ins for b in bodies for ins in by_comp.get(b, ()) if ins.opcode == "conditional"]


def _tick_conditionals(conds: list, by_comp: dict[str, list],
                       stage_of: list[int]) -> tuple[dict[str, list], list[str]]:
    """Split the tick loop's conditionals ``conds`` into the send switches (``{name: [the stage pairs
    its branch i moves, or None]}``) and the action conditionals (names, in text order)."""
    sends, actions = {}, []
    for sw in conds:
        branches = branch_computations(sw)
        moves = [frozenset((stage_of[a], stage_of[b]) for ins in _permutes(b, by_comp)
                           for a, b in source_target_pairs(ins.rest) if stage_of[a] != stage_of[b]) for b in branches]
        if any(moves):      # a permute inside an action (sequence parallelism's) moves nothing between stages
            sends[sw.name] = [m or None for m in moves]
        elif len(branches) == 2:
            actions.append(sw.name)           # chained, so in the text in the order of ``kinds``
    return sends, actions


def _send_weights(sends: dict[str, list], ticks) -> dict[str, list[float]]:
    """Each send switch's branch weights: the fraction of the ticks that move its stage pairs."""
    T = len(ticks)
    fwd = [frozenset(t.fwd_pairs) for t in ticks]
    bwd = [frozenset(t.bwd_pairs) for t in ticks]
    share: dict[frozenset, int] = {}
    for pats in sends.values():
        for S in {S for S in pats if S}:
            share[S] = share.get(S, 0) + 1
    return {name: [1.0 if S is None else (fwd.count(S) + bwd.count(S)) / T / share[S] for S in pats]
            for name, pats in sends.items()}


def _permutes(comp: str, by_comp: dict) -> list:
    """The collective-permutes run by ``comp`` and what it calls."""
    seen, todo, out = set(), [comp], []
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for ins in by_comp.get(c, ()):
            if ins.opcode in ("collective-permute", "collective-permute-start"):
                out.append(ins)
            todo.extend(callee for _, callee in called_computations(ins))
    return out


def _stage_of_partition(compiled: Any, mesh: Any) -> list[int]:
    """The ``pipe`` coordinate of each partition id."""
    positions = partition_positions(compiled, mesh) or list(range(mesh.devices.size))
    axis = list(mesh.axis_names).index("pipe")
    return [int(np.unravel_index(pos, mesh.devices.shape)[axis]) for pos in positions]
