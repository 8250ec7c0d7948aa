"""``jaxpar profile``: run a config's first steps, trace some of them with ``jax.profiler``, and print each
traced step's time by row (:func:`jaxpar.analysis.step_profiles`: compute, each collective kind per mesh
axis, host transfer, data wait, idle) beside the cost model's term for the same config on the same
devices (the ``cpu_sim`` cluster, calibrated on this machine by ``jaxpar calibrate``, on the CPU; the
``h100`` preset on GPUs; ``--cluster`` to choose). A pipeline's measured bubble stands beside its
schedule's. docs/profiling.md says what each row holds and what XLA:CPU's trace cannot attribute.

The run goes to ``<train.out_dir>/profile`` (its ``metrics.jsonl``, the trace in ``trace/``, the tables'
numbers in ``profile.json``); no checkpoint is read or written.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxpar.config._schema import ConfigError, JobConfig

#: The steps ``jaxpar profile`` traces by default: after the first (which compiles) and the second.
DEFAULT_STEPS = "2:4"


def parse_steps(text: str) -> tuple[int, int]:
    """``--steps A:B`` as ``(A, B)``: the steps ``A .. B-1``.

    Args:
      text: ``"A:B"``.

    Returns:
      ``(A, B)``.

    Raises:
      ConfigError: not ``A:B`` with ``0 <= A < B``.

    >>> parse_steps("2:4")
    (2, 4)
    """
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A:B, e.g. --steps 2:4 (the steps A .. B-1).") from None
    if not 0 <= a < b:
        raise ConfigError(f"--steps {text!r}: need 0 <= A < B (the steps A .. B-1).")
    return a, b


def profile_steps(profile: Mapping[str, Any]) -> tuple[int, int] | None:
    """``train.profile``'s steps: ``{steps: [A, B]}`` -> ``(A, B)``; ``{}`` -> None.

    Args:
      profile: the config's ``train.profile``.

    Returns:
      ``(A, B)`` or None.

    Raises:
      ConfigError: another key, or steps that are not two integers ``0 <= A < B``.

    >>> profile_steps({"steps": [3, 5]}), profile_steps({})
    ((3, 5), None)
    """
    if not profile:
        return None
    steps = profile.get("steps")
    ok = (set(profile) == {"steps"} and isinstance(steps, (list, tuple)) and len(steps) == 2
          and all(isinstance(s, int) and not isinstance(s, bool) for s in steps) and 0 <= steps[0] < steps[1])
    if not ok:
        raise ConfigError(f"train.profile={dict(profile)!r}: expected {{steps: [A, B]}} with 0 <= A < B, the steps "
                          "A .. B-1 to trace (e.g. train.profile.steps=[2,4]); {} traces none.")
    return int(steps[0]), int(steps[1])


def traced_line(out_dir: Path, profile: tuple[int, int] | None) -> str | None:
    """The closing line of a ``jaxpar train`` run with ``train.profile``: where its trace is (None: no trace,
    e.g. a resumed run that started past the steps).

    Args:
      out_dir: the run's ``train.out_dir``.
      profile: the traced steps ``(A, B)``, or None.

    Returns:
      The line, or None.
    """
    if not profile or not (out_dir / "trace" / "steps.json").exists():
        return None
    return (f"profile  steps {profile[0]} .. {profile[1] - 1} traced -> {out_dir / 'trace'} (tensorboard --logdir "
            f"{out_dir / 'trace'}, or ui.perfetto.dev; tables: jaxpar profile, docs/profiling.md)")


def run_profile(config: str, overrides: Sequence[str], *, steps: str = DEFAULT_STEPS, cluster: str | None = None,
                dist: dict | None = None) -> int:
    """``jaxpar profile``: train steps ``0 .. B-1`` of the config, trace ``A .. B-1``, print a table per step.

    Args:
      config: the YAML config.
      overrides: dotted ``key=value`` overrides.
      steps: ``"A:B"``.
      cluster: the cost model's cluster preset or YAML (None: ``cpu_sim`` on the CPU, ``h100`` on GPUs).
      dist: ``jaxpar train``'s process options (None: one process, or a launcher's environment).

    Returns:
      The exit status (0).
    """
    from jaxpar.analysis import find_trace, read_trace, step_profiles
    from jaxpar.config._job import build_job
    from jaxpar.config._load import load_config
    from jaxpar.devices._distributed import start_processes
    from jaxpar.run import train

    first, end = parse_steps(steps)
    cfg = load_config(config, list(overrides))
    start_processes(**{k: v for k, v in (dist or {}).items() if v is not None}, devices=cfg.train.devices)
    job = build_job(cfg)
    state, layout = job.init_state()
    out = Path(cfg.train.out_dir) / "profile"
    log = dataclasses.replace(job.log_options(layout, None), out_dir=str(out), profile=(first, end), plot=False,
                              tensorboard=False, progress="none")
    print(f"profile  {cfg.name}: steps 0 .. {end - 1}, tracing {first} .. {end - 1} -> {out / 'trace'}")
    step = job.train_step(layout)
    train(step, state, job.batch_fn, mesh=layout.mesh, steps=end, start_step=0, log=log,
          on_nonfinite=job.run.on_nonfinite, ramp=job.ramp, steps_per_call=job.steps_per_call, handle_signals=False)
    compiled = job.compile(layout, step)            # the programs that ran: no second compile
    trace = read_trace(find_trace(out / "trace"))
    profiles = step_profiles(trace, program_collectives(compiled, layout.mesh))
    model = predicted_rows(cfg, layout.mesh, job.strategy, cluster)
    expected = expected_per_device(compiled["step"], layout.mesh, job.strategy, model)
    clock = dict(json.loads((out / "trace" / "steps.json").read_text())["steps"]) if \
        (out / "trace" / "steps.json").exists() else {}
    for p in profiles:
        print()
        print(profile_table(p, model, expected, clock.get(p.step)))
    record = profile_record(profiles, model, expected, clock, trace.path)
    (out / "profile.json").write_text(json.dumps(record, indent=1))
    print(f"\ntrace    {trace.path} (Perfetto: ui.perfetto.dev; TensorBoard: tensorboard --logdir {out / 'trace'})")
    print(f"numbers  {out / 'profile.json'}")
    return 0


def program_collectives(compiled: Mapping[str, Any], mesh: Any) -> dict[str, dict]:
    """``{hlo module name: {instruction name: Collective}}`` of the step's programs (the trace names its
    events by module and instruction); where two programs share a module name, ``"step"``'s names win.

    Args:
      compiled: ``{program name: compiled}`` (:meth:`jaxpar.config.Job.compile`).
      mesh: the mesh they were compiled for.

    Returns:
      The mapping.
    """
    from jaxpar.analysis import collectives

    out: dict[str, dict] = {}
    for name in sorted(compiled, key=lambda n: n != "step"):
        c = compiled[name]
        module = re.match(r"HloModule\s+([\w.\-]+)", c.as_text()).group(1)
        found = {x.name: x for x in collectives(c, mesh)}
        out[module] = {**found, **out.get(module, {})}
    return out


def _axes_key(axes: Sequence[str] | None) -> frozenset | None:
    return None if axes is None else frozenset(axes)


def predicted_rows(cfg: JobConfig, mesh: Any, strategy: Any, cluster: str | None) -> dict:
    """The cost model's terms for the config on the mesh's devices (its own lowering of the platform).

    Args:
      cfg: the config.
      mesh: the mesh the run used.
      strategy: the config's strategy.
      cluster: the cluster preset or YAML (None: ``cpu_sim`` on the CPU, ``h100`` on GPUs).

    Returns:
      ``{"cluster", "why" (None, or why nothing is predicted), "compute": s, "compute_parts", "total": s,
      "collectives": {frozenset(axes) and kind: {"seconds", "count", "bytes"}}, "plan", "bubble"}``.
    """
    from jaxpar import cost
    from jaxpar.config._plan_command import planner_view, unpredicted
    from jaxpar.cost._time import comm_time
    from jaxpar.cost._traffic import comms, lowering_for_platform

    sizes = dict(mesh.shape)
    platform = {"gpu": "cuda"}.get(p := mesh.devices.flat[0].platform, p)
    cluster = cluster or {"cpu": "cpu_sim"}.get(platform, "h100")
    out = {"cluster": cluster, "why": unpredicted(cfg, strategy, sizes), "collectives": {}, "plan": None}
    if out["why"] is not None:
        return out
    lowering = lowering_for_platform(platform)
    model, plan, est = planner_view(cfg, sizes, strategy, cluster, lowering=lowering)
    c = cost.load_cluster(cluster)
    c = c.with_devices(plan.devices) if plan.devices <= c.devices_per_node or plan.devices % c.devices_per_node == 0 \
        else cost.load_cluster(cluster, nodes=1)
    act = 2 if strategy.compute_dtype == "bfloat16" else 4
    grad = 4 if lowering == "xla-cpu" else act
    for x in comms(model, plan, lowering=lowering, compute_bytes=act, grad_bytes=grad):
        row = out["collectives"].setdefault((x.kind, _axes_key(x.axes)), {"seconds": 0.0, "count": 0.0, "bytes": 0.0})
        row["seconds"] += x.timed * comm_time(x, plan.sizes, c)
        row["count"] += x.count
        row["bytes"] += x.count * x.bytes
    t = est.time
    out.update(compute=t.compute + t.elementwise + t.optimizer, total=t.total, plan=plan, bubble=t.bubble,
               compute_parts=(t.compute, t.elementwise, t.optimizer))
    return out


def expected_per_device(compiled: Any, mesh: Any, strategy: Any, model: Mapping) -> dict[int, dict]:
    """How many of each collective row the compiled step runs on each device, and their bytes: the HLO's
    instructions times their computations' trip counts; in a pipeline, each stage's branches as its
    schedule takes them (:func:`jaxpar.analysis._axis_bytes.stage_branch_weights`).

    Args:
      compiled: the compiled step.
      mesh: its mesh.
      strategy: the config's strategy.
      model: :func:`predicted_rows`' (its plan, when there is one).

    Returns:
      ``{device id: {(kind, axes): (count, bytes)}}``.
    """
    import numpy as np

    from jaxpar.analysis import collectives, trip_counts
    from jaxpar.analysis._hlo_text import module_text

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
    from jaxpar.analysis._hlo_text import branch_computations, call_graph, parse_instructions, reached_computations

    instrs = parse_instructions(text)
    graph, permutes = call_graph(instrs), {c.computation for c in colls if c.kind == "collective-permute"}
    return {i.name for i in instrs if i.opcode == "conditional"
            and permutes & set(reached_computations(graph, branch_computations(i)))}


def _pipeline_plan(sizes: Mapping[str, int], strategy: Any, model: Mapping) -> Any:
    if model.get("plan") is not None:
        return model["plan"]
    from jaxpar import cost

    return cost.Plan(pipe=sizes.get("pipe", 1), data=sizes.get("data", 1), fsdp=sizes.get("fsdp", 1),
                     tensor=sizes.get("tensor", 1), schedule=strategy.schedule, virtual=strategy.virtual_stages,
                     microbatches=strategy.microbatches, sequence_parallel=strategy.sequence_parallel)


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
    from jaxpar._text import format_bytes

    return "none" if m is None else f"{_ms(m['seconds'])} [{m['count']:g}, {format_bytes(m['bytes'])}]"


def _row_cells(p: Any, key: Any, model: Mapping, expected: Mapping[int, Mapping]) -> list[str]:
    """One row of :func:`profile_table`: count, bytes and the cost model's cell (the measured ones first)."""
    from jaxpar._text import format_bytes
    from jaxpar.analysis._trace import COMPUTE

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
                    "-" if model["why"] else _model_cell(model["collectives"].get((key[0], _axes_key(key[1]))))]


def profile_table(p: Any, model: Mapping, expected: Mapping[int, Mapping], clock: float | None = None) -> str:
    """One traced step's table: each row's measured milliseconds (mean over devices), its share, the
    collectives' wait for their group, count and bytes per device beside the compiled HLO's, and the
    cost model's term.

    Args:
      p: a :class:`jaxpar.analysis.StepProfile`.
      model: :func:`predicted_rows`'.
      expected: :func:`expected_per_device`'.
      clock: the step's seconds on the loop's clock (``steps.json``; None: not known).

    Returns:
      The text.
    """
    from jaxpar._text import render_table
    from jaxpar.analysis._trace import COMPUTE, DATA, DISPATCH, IDLE, TRANSFER

    rows = [_row_cells(p, key, model, expected) for key in p.rows]
    matched = {(k[0], _axes_key(k[1])) for k in p.rows if isinstance(k, tuple)}
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

        b = float(bubble_fraction(get_schedule(plan.schedule, plan.pipe, plan.microbatches, plan.virtual)))
        line += (f"; schedule {plan.schedule} p={plan.pipe} m={plan.microbatches}: bubble fraction {b:.3f} "
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
