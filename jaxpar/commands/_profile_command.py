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
from pathlib import Path
from typing import Sequence

from jaxpar.commands._common import config_job, parse_steps

#: The steps ``jaxpar profile`` traces by default: after the first (which compiles) and the second.
DEFAULT_STEPS = "2:4"


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
    from jaxpar.config._cost_model import config_view
    from jaxpar.plan import platform_of, predicted_rows, profile_report
    from jaxpar.run import train

    first, end = parse_steps(steps)
    cfg, job = config_job(config, overrides, "profile", dist, data=True)
    state, layout = job.init_state()
    out = Path(cfg.train.out_dir) / "profile"
    log = dataclasses.replace(job.log_options(layout, None), out_dir=str(out), profile=(first, end), plot=False,
                              tensorboard=False, progress="none")
    print(f"profile  {cfg.name}: steps 0 .. {end - 1}, tracing {first} .. {end - 1} -> {out / 'trace'}")
    step = job.train_step(layout)
    train(step, state, job.batch_fn, mesh=layout.mesh, steps=end, start_step=0, log=log,
          on_nonfinite=job.run.on_nonfinite, ramp=job.ramp, steps_per_call=job.steps_per_call, handle_signals=False)
    compiled = job.compile(layout, step)            # the programs that ran: no second compile
    platform = platform_of(layout.mesh)
    cluster = cluster or {"cpu": "cpu_sim"}.get(platform, "h100")
    model = predicted_rows(*config_view(cfg, dict(layout.mesh.shape), job.strategy, cluster, platform=platform), cluster)
    clock = dict(json.loads((out / "trace" / "steps.json").read_text())["steps"]) if \
        (out / "trace" / "steps.json").exists() else {}
    tables, record, trace_path = profile_report(out / "trace", compiled, layout.mesh, job.strategy, model, clock)
    for table in tables:
        print()
        print(table)
    (out / "profile.json").write_text(json.dumps(record, indent=1))
    print(f"\ntrace    {trace_path} (Perfetto: ui.perfetto.dev; TensorBoard: tensorboard --logdir {out / 'trace'})")
    print(f"numbers  {out / 'profile.json'}")
    return 0
