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
from typing import Any, Mapping, Sequence

from jaxpar.config._schema import ConfigError

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
    from jaxpar.commands._weights_commands import config_job
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


