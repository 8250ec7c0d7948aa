"""How often each branch of a pipelined train step's tick loop runs, per pipeline stage.

The pipeline executor (:mod:`jaxpar.pipeline.executor`) runs the lowered schedule as one
``while`` loop of ``T`` ticks. At each tick a chain of boolean conditionals, one per action
kind that is not idle (in the executor's order of ``kinds``), runs the stage's action, and two
switches pick the tick's forward and backward sends (branch 0: nothing moves; branch ``j``:
one ``ppermute`` over the ``j``-th set of pairs). Counting every branch on every tick would
count each collective ``T`` times; the schedule says how often each one runs:

* the conditional of kind ``k`` (two branches: 0 does nothing, 1 the action): branch 1 runs on
  the ticks where the stage's instruction is ``kinds[k]``, branch 0 on the others;
* a send switch: the branch whose ``collective-permute`` moves between the stage pairs ``S``
  runs on the ticks whose forward or backward pairs are ``S``. When both switches have a
  branch for the same ``S`` (``p = 2`` with wrap-around), each gets half of the total, so the
  bytes on ``pipe`` add up (both send the same activation shape).

Imports JAX (through the executor) inside its function only.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .time import Plan

__all__ = ["stage_branch_weights"]


def stage_branch_weights(compiled: Any, mesh: Any, plan: Plan) -> list[dict[str, list[float]]]:
    """Per pipeline stage, ``{conditional name: [fraction of the ticks taking branch i]}`` for the
    switches of ``compiled``'s tick loop (the ``branch_weights`` of :func:`jaxpar.cost.verify.trip_counts`)."""
    from ..analysis import hlo
    from ..analysis.replica_groups import source_target_pairs
    from ..pipeline.executor import _table
    from ..pipeline.program import lower
    from ..pipeline.schedules import get_schedule
    from .verify import _while_trips

    program = lower(get_schedule(plan.schedule, plan.pipe, plan.microbatches, plan.virtual))
    table, ticks = _table(program), program.ticks
    T = len(ticks)
    text = compiled.as_text()
    instrs = hlo._parse_instructions(text)
    by_comp: dict[str, list] = {}
    for ins in instrs:
        by_comp.setdefault(ins.computation, []).append(ins)
    bodies = {c for ins in instrs if ins.opcode == "while" and _while_trips(text).get(ins.name) == T
              for key, c in hlo._called(ins) if key == "body"}
    if not bodies:
        raise ValueError(f"plan {plan.name()}: no while loop of {T} ticks (the schedule's length) in the compiled "
                         "program; is it a jaxpar pipelined train step?")
    stage_of = _stage_of_partition(compiled, mesh)
    conds = [ins for b in bodies for ins in by_comp.get(b, ()) if ins.opcode == "conditional"]
    sends, actions = {}, []
    for sw in conds:
        branches = [c for key, c in hlo._called(sw) if key == "branch_computations"]
        permutes = [_permutes(b, by_comp) for b in branches]
        if any(permutes):
            sends[sw.name] = [frozenset((stage_of[a], stage_of[b]) for ins in ps
                                        for a, b in source_target_pairs(ins.rest)) if ps else None
                              for ps in permutes]
        elif len(branches) == 2:
            actions.append(sw.name)           # chained, so in the text in the order of ``kinds``
    active = [k for k, kind in enumerate(table.kinds) if kind.op != "idle"]
    if len(actions) != len(active):
        raise ValueError(f"plan {plan.name()}: the tick loop has {len(actions)} action conditionals, expected one per "
                         f"action kind that is not idle ({len(active)}); has the executor changed?")
    fwd = [frozenset(t.fwd_pairs) for t in ticks]
    bwd = [frozenset(t.bwd_pairs) for t in ticks]
    share = {}
    for pats in sends.values():
        for S in {S for S in pats if S}:
            share[S] = share.get(S, 0) + 1
    send_w = {name: [1.0 if S is None else (fwd.count(S) + bwd.count(S)) / T / share[S] for S in pats]
              for name, pats in sends.items()}
    kinds = np.asarray(table.rows.kind)          # [T, p]
    out = []
    for s in range(plan.pipe):
        w = dict(send_w)
        for name, k in zip(actions, active):
            taken = float((kinds[:, s] == k).sum()) / T
            w[name] = [1.0 - taken, taken]
        out.append(w)
    return out


def _permutes(comp: str, by_comp: dict) -> list:
    """The collective-permutes run by ``comp`` and what it calls."""
    from ..analysis import hlo

    seen, todo, out = set(), [comp], []
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for ins in by_comp.get(c, ()):
            if ins.opcode in ("collective-permute", "collective-permute-start"):
                out.append(ins)
            todo.extend(callee for _, callee in hlo._called(ins))
    return out


def _stage_of_partition(compiled: Any, mesh: Any) -> list[int]:
    """The ``pipe`` coordinate of each partition id."""
    from ..analysis import hlo

    positions = hlo._partition_positions(compiled, mesh) or list(range(mesh.devices.size))
    axis = list(mesh.axis_names).index("pipe")
    return [int(np.unravel_index(pos, mesh.devices.shape)[axis]) for pos in positions]
