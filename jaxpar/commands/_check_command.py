"""``jaxpar check`` (:func:`run_check`): what ``jaxpar train`` would refuse before its first step: the config on
the devices train would find (or a ``--target``'s count), the data files, and the run directory; then every check
that needs no compiled program (:func:`check_config`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from jaxpar.commands._common import check_inputs
from jaxpar.commands._job_devices import job_devices, refuse_cpu_only, refuse_target
from jaxpar.commands._lines import header_lines, model_line, state_line
from jaxpar.config._checks import check
from jaxpar.config._job import build_job
from jaxpar.config._load import load_config
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.errors import RunDirectoryError
from jaxpar.run._checkpoint import no_checkpoint_error
from jaxpar.run._run_directory import checkpoint_steps, earlier_run


def run_check(config: str, overrides: Sequence[str], *, target: str | None = None, resume: bool = False,
              overwrite: bool = False) -> int:
    """``jaxpar check``: what ``jaxpar train`` (with the same ``--resume`` / ``--overwrite``) would refuse, and then
    every check of :func:`check_config`, nothing compiled.

    In order: the config; the devices train would find (``train.devices=0``: JAX's own, refused where they are
    CPU devices only: :func:`~jaxpar.commands._job_devices.refuse_cpu_only`; ``target``: its count, simulated,
    after every refusal of ``jaxpar inspect --target`` before it compiles:
    :func:`~jaxpar.commands._job_devices.refuse_target`); the mesh on them; the data files (``data.paths``,
    ``data.sources``); the run directory (an earlier run in ``train.out_dir``, or with ``resume`` no complete
    checkpoint); then the train state's layout and step.

    Args:
      config: the YAML file.
      overrides: its ``key=value`` overrides.
      target: a GPU / TPU target (``h100:1x8``) whose device count the mesh is checked on.
      resume: check as ``jaxpar train --resume`` would run.
      overwrite: check as ``jaxpar train --overwrite`` would run (an earlier run would be moved aside).

    Returns:
      The exit status, 0 (a problem raises).

    Raises:
      ConfigError: a setting the config or the library refuses, or the devices; Fp8Error / TargetError: the
        target refuses the config (no FP8 GEMMs, a TPU chip grid of no whole hosts); DataError: a data file that
        is missing; RunDirectoryError / CheckpointError: what train refuses in the run directory.
    """
    cfg = load_config(config, [*overrides, *(["checkpoint.resume=true"] if resume else [])])
    if overwrite and cfg.checkpoint.resume:
        raise ConfigError("--overwrite starts a new run (the earlier one moved aside) and --resume "
                          "(checkpoint.resume=true) continues the earlier one; give one of them.")
    devices, found = _devices_to_check(cfg, target)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, devices=devices))
    check(cfg, num_devices=devices)
    files = check_inputs(cfg)
    run = _check_run_directory(cfg, overwrite)
    status = check_config(cfg)
    for line in (*found, files, run):
        if line:
            print(line)
    return status


def _devices_to_check(cfg: Any, target: str | None) -> tuple[int, list[str]]:
    """The device count the mesh is checked on, and the lines that say whose: ``target``'s (after every refusal
    of ``jaxpar inspect --target``, with its capacity), JAX's (``train.devices=0``), or ``train.devices``."""
    if target is not None:
        from jaxpar.devices import parse_target

        tgt = parse_target(target)
        refuse_target(cfg, tgt)            # what jaxpar inspect --target refuses before it compiles
        return tgt.num_devices, [
            f"found    {tgt.num_devices} devices of {tgt} (simulated CPU devices: the mesh, layout and step options)",
            f"capacity {tgt.capacity.text()} on {tgt.spec.device} (jaxpar inspect --target {tgt} compiles the step "
            "against it)"]
    if cfg.train.devices == 0:
        refuse_cpu_only(0)
        devices = jax.device_count()
        return devices, [f"found    {devices} x {jax.devices()[0].device_kind} (train.devices=0: the devices JAX finds "
                         "here)"]
    return cfg.train.devices, []


def _check_run_directory(cfg: Any, overwrite: bool) -> str:
    """What train would do with the run directory, in words; what it would refuse raises."""
    ck = cfg.checkpoint.dir if cfg.checkpoint.enabled else None
    if cfg.checkpoint.resume:
        if not (steps := checkpoint_steps(ck)):
            raise no_checkpoint_error(Path(ck).absolute(), [str(s) for s in checkpoint_steps(ck, complete=False)])
        return f"run      --resume continues from the checkpoint of step {steps[-1]} in {ck} (if it reads)"
    found = earlier_run(cfg.train.out_dir, ck)
    if found and not overwrite:
        raise RunDirectoryError(
            f"train.out_dir={cfg.train.out_dir!r} holds an earlier run ({found}): jaxpar train refuses a new run "
            "there. Continue it with --resume, start the new run elsewhere with train.out_dir=NEW_DIR, or pass "
            "--overwrite to move the earlier run aside (nothing is deleted).")
    return (f"run      --overwrite moves the earlier run in {cfg.train.out_dir} aside" if found else
            f"run      a new run in {cfg.train.out_dir}")


def check_config(cfg: JobConfig) -> int:
    """``jaxpar check``: every check of ``cfg`` that needs no compiled program, and what it would train.

    It builds what ``jaxpar train`` builds, as far as it can without running: the mesh on the config's
    devices (simulated CPU devices when they are not there), the library's objects, the train state's
    layout (traced, not allocated: the compatibility table's refusals) and the train step with its
    options. The data section's files are not read (``jaxpar data show`` reads them).

    Args:
      cfg: the loaded config (:func:`jaxpar.config.load_config` has run its own checks).

    Returns:
      The exit status, 0 (a problem raises).

    Raises:
      ConfigError: a setting the config or the library refuses, named by its YAML key.
      JaxparError: a refusal of the library that no YAML check knows (the compatibility table's, the
        train step's), named by the library's field; FP8's by its YAML keys (``Job.train_step``).

    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> from jaxpar.config import load_config
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
    job = build_job(cfg, job_devices(cfg, None, "check"), data=False)
    layout = job.state_layout()
    step = job.train_step(layout)           # make_train_step's checks; its programs are built lazily
    job.log_options(layout, None)           # the loop's logging options
    print(f"check    {cfg.name}: ok (every check passed; no step compiled or run)")
    print("\n".join(header_lines(job)))
    print(model_line(cfg.model, job.hf, layout))
    print(state_line(layout))
    print(f"programs {', '.join(step.programs)}")
    return 0
