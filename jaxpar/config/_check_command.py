"""``jaxpar check CONFIG [key=value ...]``: every check of a config; no step is compiled or run.

It builds what ``jaxpar train`` builds, as far as it can without running: the config's own checks
(:func:`jaxpar.config.check`, the keys' types, ranges and cross-section rules), the mesh on the
config's devices (simulated CPU devices when they are not there), the library's objects (the model
config, the strategy, the optimizer, the pipeline schedule), the train state's layout (the model is
traced, not allocated; the compatibility table's refusals), and the train step with its options
(:func:`jaxpar.make_train_step`). The data section's settings are checked; its files are not read
(``jaxpar data show`` reads them). Any problem is a :class:`~jaxpar.errors.JaxparError` naming the
YAML key (a usage error, exit status 2); a config that passes prints what it would train.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import load_config
    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> check_config(load_config(quickstart, ["model.layers=1", "model.embed=32", "model.seq_len=16"]))
    ... # doctest: +ELLIPSIS
    check    quickstart: ok (every check passed; no step compiled or run)
    devices  8 x cpu (cpu)
    mesh     pipe=1 x data=2 x fsdp=2 x tensor=2
    strategy dp2-fsdp2-tp2
    model    gpt: ... parameters
    state    ... per device (params ..., optimizer ...)
    programs step
    0
"""

from __future__ import annotations

import argparse

import jax

from jaxpar.config._schema import JobConfig


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``check`` command to the ``jaxpar`` parser.

    Args:
      sub: the ``jaxpar`` parser's sub-parsers.
    """
    p = sub.add_parser("check", help="check a config: every check, the mesh on its devices and the train step "
                                     "built, nothing compiled or run",
                       description="Run every check of CONFIG that needs no compiled program: the config's, the "
                                   "mesh on the config's devices (simulated CPU devices when they are not there), "
                                   "the train state's layout and the train step's options.")
    p.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides")


def run_check(args: argparse.Namespace) -> int:
    """``jaxpar check``: load the config with its overrides and :func:`check_config` it.

    Args:
      args: the parsed ``check`` arguments (``config``, ``overrides``).

    Returns:
      The exit status, 0 (a problem raises a :class:`~jaxpar.errors.JaxparError`).
    """
    from jaxpar.config._load import load_config

    return check_config(load_config(args.config, list(args.overrides)))


def check_config(cfg: JobConfig) -> int:
    """Run every check of ``cfg`` that needs no compiled program and print what it would train.

    Args:
      cfg: the loaded config (:func:`jaxpar.config.load_config` has run its own checks).

    Returns:
      The exit status, 0 (a problem raises).

    Raises:
      ConfigError: a setting the config or the library refuses, named by its YAML key.
      JaxparError: a refusal of the library that no YAML check knows (the compatibility table's, the
        train step's), named by the library's field.
    """
    from jaxpar.config._describe import header_lines, model_label, model_line, state_line
    from jaxpar.config._inspection import job_devices
    from jaxpar.config._job import build_job
    from jaxpar.devices._distributed import setup_devices

    n = job_devices(cfg, "check")
    setup_devices(n)
    job = build_job(cfg, jax.devices()[:n], data=False)
    layout = job.state_layout()
    step = job.train_step(layout)           # make_train_step's checks; its programs are built lazily
    job.log_options(layout, None)           # the loop's logging options
    print(f"check    {cfg.name}: ok (every check passed; no step compiled or run)")
    print("\n".join(header_lines(job)))
    print(model_line(model_label(cfg.model, job.hf), layout))
    print(state_line(layout))
    print(f"programs {', '.join(step.programs)}")
    return 0
