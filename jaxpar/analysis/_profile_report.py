"""``jaxpar profile``'s analysis: a traced step's rows beside the compiled HLO's collectives and the cost
model's terms (:func:`profile_table`), and their numbers (:func:`profile_record`). The run and the cost
model's prediction for a config are :mod:`jaxpar.plan`'s (``predicted_rows``); docs/profiling.md says what
each row holds.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from jaxpar import cost
from jaxpar._text import format_bytes, render_table
from jaxpar.analysis import collectives, trip_counts
from jaxpar.analysis._hlo_text import (branch_computations, call_graph, module_text, parse_instructions,
                                      reached_computations)
from jaxpar.analysis._trace import COMPUTE, DATA, DISPATCH, IDLE, TRANSFER


def program_collectives(compiled: Mapping[str, Any], mesh: Any) -> dict[str, dict]:
    """``{hlo module name: {instruction name: Collective}}`` of the step's programs (the trace names its
    events by module and instruction); where two programs share a module name, ``"step"``'s names win.

    Args:
      compiled: ``{program name: compiled}`` (a job's compiled programs).
      mesh: the mesh they were compiled for.

    Returns:
      The mapping.
    """
    out: dict[str, dict] = {}
    for name in sorted(compiled, key=lambda n: n != "step"):
        c = compiled[name]
        module = re.match(r"HloModule\s+([\w.\-]+)", c.as_text()).group(1)
        found = {x.name: x for x in collectives(c, mesh)}
        out[module] = {**found, **out.get(module, {})}
    return out


def axes_key(axes: Sequence[str] | None) -> frozenset | None:
    return None if axes is None else frozenset(axes)


def expected_per_device(compiled: Any, mesh: Any, strategy: Any, model: Mapping) -> dict[int, dict]:
    """How many of each collective row the compiled step runs on each device, and their bytes: the HLO's
    instructions times their computations' trip counts; in a pipeline, each stage's branches as its
    schedule takes them (:func:`jaxpar.analysis._axis_bytes.stage_branch_weights`).

    Args:
      compiled: the compiled step.
      mesh: its mesh.
      strategy: the config's strategy.
      model: the cost model's terms (``jaxpar.plan.predicted_rows``; its plan, when there is one).

    Returns:
      ``{device id: {(kind, axes): (count, bytes)}}``.
    """
    text, colls = module_text(compiled), collectives(compiled, mesh)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    sizes = dict(mesh.shape)
    if sizes.get("pipe", 1) == 1:
        weights = {0: None}
        stage = {int(d): 0 for d in ids.flat}
    else:
        from jaxpar.analysis._axis_bytes import stage_branch_weights

        stages = stage_branch_weights(compiled, mesh, _pipeline_plan(sizes, strategy, model))
        # a permute runs on every device of its group, the stage that only sends included, and the weights
        # zero a send where the stage is no target: a send's branch runs as often as the most any stage gives it
        sends = _send_conditionals(text, colls)
        weights = {s: {name: [max(w[name][i] for w in stages) for i in range(len(b))] if name in sends else b
                       for name, b in ws.items()} for s, ws in enumerate(stages)}
        axis = list(mesh.axis_names).index("pipe")
        stage = {int(ids[i]): int(i[axis]) for i in np.ndindex(ids.shape)}
    per_stage = {}
    for s, w in weights.items():
        mult, rows = trip_counts(text, w), {}
        for c in colls:
            n, b = rows.get((c.kind, c.axes), (0.0, 0.0))
            k = mult.get(c.computation, 1)
            rows[(c.kind, c.axes)] = (n + k, b + k * c.bytes)
        per_stage[s] = rows
    return {d: per_stage[s] for d, s in stage.items()}


def _send_conditionals(text: str, colls: Sequence[Any]) -> set[str]:
    """The conditionals whose branches run a collective-permute: the pipeline's sends."""
    instrs = parse_instructions(text)
    graph, permutes = call_graph(instrs), {c.computation for c in colls if c.kind == "collective-permute"}
    return {i.name for i in instrs if i.opcode == "conditional"
            and permutes & set(reached_computations(graph, branch_computations(i)))}


def _pipeline_plan(sizes: Mapping[str, int], strategy: Any, model: Mapping) -> Any:
    if model.get("plan") is not None:
        return model["plan"]
    return cost.Plan(pipe=sizes.get("pipe", 1), data=sizes.get("data", 1), fsdp=sizes.get("fsdp", 1),
                     tensor=sizes.get("tensor", 1), strategy=strategy)


def _label(key: Any) -> str:
    if isinstance(key, tuple):
        kind, axes = key
        return f"{kind} over {','.join(axes) if axes else ('-' if axes is not None else '?')}"
    return key


def _spread(values: Sequence[float], fmt=lambda v: f"{v:g}") -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _model_cell(m: Mapping | None) -> str:
    """A collective row's cost-model cell: milliseconds [count, bytes]."""
    return "none" if m is None else f"{_ms(m['seconds'])} [{m['count']:g}, {format_bytes(m['bytes'])}]"


def _row_cells(p: Any, key: Any, model: Mapping, expected: Mapping[int, Mapping]) -> list[str]:
    """One row of :func:`profile_table`: count, bytes and the cost model's cell (the measured ones first)."""
    sec = p.rows[key]
    cells = [_label(key), _ms(sec), f"{sec / p.wall:.1%}", _ms(p.waiting[key]) if key in p.waiting else ""]
    if not isinstance(key, tuple):
        pred = "-" if model["why"] else "not modelled"
        if key == COMPUTE and not model["why"]:
            pred = f"{_ms(model['compute'])} ({' + '.join(_ms(x) for x in model['compute_parts'])})"
        return cells + ["", "", pred]
    devices = sorted(p.per_device)
    got = [p.counts.get(key, {}).get(d, 0) for d in devices]
    want = [expected.get(d, {}).get(key, (0, 0)) for d in devices]
    hlo_bytes = sum(b for _, b in want) / max(len(devices), 1)
    return cells + [f"{_spread(got)} ({_spread([n for n, _ in want])})",
                    f"{format_bytes(p.bytes.get(key, 0.0))} ({format_bytes(hlo_bytes)})",
                    "-" if model["why"] else _model_cell(model["collectives"].get((key[0], axes_key(key[1]))))]


def profile_table(p: Any, model: Mapping, expected: Mapping[int, Mapping], clock: float | None = None) -> str:
    """One traced step's table: each row's measured milliseconds (mean over devices), its share, the
    collectives' wait for their group, count and bytes per device beside the compiled HLO's, and the
    cost model's term.

    Args:
      p: a :class:`jaxpar.analysis.StepProfile`.
      model: the cost model's terms (``jaxpar.plan.predicted_rows``).
      expected: :func:`expected_per_device`'.
      clock: the step's seconds on the loop's clock (``steps.json``; None: not known).

    Returns:
      The text.
    """
    rows = [_row_cells(p, key, model, expected) for key in p.rows]
    matched = {(k[0], axes_key(k[1])) for k in p.rows if isinstance(k, tuple)}
    rows += [[f"{kind} over {','.join(sorted(axes))}", "0.00", "", "", "0", "", _model_cell(m)]
             for (kind, axes), m in model["collectives"].items() if (kind, axes) not in matched]   # never ran
    total = sum(p.rows.values())
    rows.append(["total (the rows)", _ms(total), f"{total / p.wall:.1%}", "", "", "",
                 "-" if model["why"] else f"{_ms(model['total'])} (step)"])
    head = (f"step {p.step}: {_ms(p.wall)} ms in the trace's step window" +
            (f", {_ms(clock)} ms on the loop's clock" if clock else "") + f"; mean of {len(p.per_device)} devices")
    notes = [head, render_table(["row", "measured ms", "share", "of which waiting", "count per device (HLO)",
                                 "bytes per device (HLO)", f"cost model ms [count, bytes] ({model['cluster']})"],
                                rows, right=[False, True, True, True, True, True, False])]
    if model["why"]:
        notes.append(f"cost model: not predicted: {model['why']}")
    if (bubble := pipeline_bubble(p, model)) is not None:
        notes.append(bubble)
    if p.unmatched:
        notes.append(f"collectives of programs not compiled here (counted as compute): {', '.join(p.unmatched)}")
    notes.append(f"({TRANSFER}: the host placing the batch on the devices; {DATA}: building it; {DISPATCH}: from "
                 f"then to the device's first instruction; {IDLE}: gaps between instructions and the wait after the "
                 f"last one for the other devices. On XLA:CPU {COMPUTE} and the collectives include the time a "
                 "device's thread waits for one of the machine's cores.)")
    return "\n".join(notes)


def pipeline_bubble(p: Any, model: Mapping) -> str | None:
    """A pipeline step's bubble: the devices' wait for the other stages inside the ``pipe`` axis's
    collectives, beside the schedule's bubble fraction (None: no pipeline)."""
    pipe = {k: w for k, w in p.waiting.items() if isinstance(k, tuple) and k[1] and "pipe" in k[1]}
    if not pipe:
        return None
    waited = sum(pipe.values())
    plan = model.get("plan")
    line = f"pipeline bubble: measured {waited * 1e3:.2f} ms ({waited / p.wall:.1%} of the step: the wait for " \
           "the other stages inside the pipe axis's collectives)"
    if plan is not None:
        from jaxpar.parallel.pipeline._schedules import bubble_fraction, get_schedule

        s = plan.strategy
        b = float(bubble_fraction(get_schedule(s.schedule, plan.pipe, s.microbatches, s.virtual_stages)))
        line += (f"; schedule {s.schedule} p={plan.pipe} m={s.microbatches}: bubble fraction {b:.3f} "
                 f"({b * p.wall * 1e3:.2f} ms of this step); cost model: {b:.3f} x its compute "
                 f"{model['compute'] * 1e3:.2f} ms = {b * model['compute'] * 1e3:.2f} ms")
    return line


def _collective_rows(p: Any, expected: Mapping) -> list:
    """The collective rows the trace ran or the HLO runs on the profiled devices."""
    want = {k for d in p.per_device for k, (n, _) in expected.get(d, {}).items() if n}
    return [k for k in p.rows if isinstance(k, tuple)] + sorted(want - set(p.rows), key=str)


def profile_record(profiles: Sequence[Any], model: Mapping, expected: Mapping, clock: Mapping, path: Path) -> dict:
    """``profile.json``: each step's rows (seconds), waits, counts and bytes per device, the HLO's counts and
    the cost model's terms, keyed by the table's labels."""
    def coll(d):
        return {f"{k} over {','.join(sorted(a))}": v for (k, a), v in d.items()}
    return {"trace": str(path), "cluster": model["cluster"], "not_predicted": model["why"],
            "model": None if model["why"] else {"compute_s": model["compute"], "total_s": model["total"],
                                                 "collectives": coll(model["collectives"])},
            "steps": [{"step": p.step, "wall_s": p.wall, "loop_clock_s": clock.get(p.step),
                       "rows_s": {_label(k): v for k, v in p.rows.items()},
                       "waiting_s": {_label(k): v for k, v in p.waiting.items()},
                       "counts": {_label(k): {str(d): p.counts.get(k, {}).get(d, 0) for d in p.per_device}
                                  for k in _collective_rows(p, expected)},
                       "hlo_counts": {_label(k): {str(d): expected.get(d, {}).get(k, (0, 0))[0] for d in p.per_device}
                                      for k in _collective_rows(p, expected)},
                       "bytes": {_label(k): v for k, v in p.bytes.items()},
                       "bubble": pipeline_bubble(p, model)} for p in profiles]}
