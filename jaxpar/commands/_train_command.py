"""``jaxpar train`` (:func:`run_train`): load and check the config, start the processes, claim the run directory,
build the job, print what it trains and the cost model's prediction, train with checkpoints and summarise.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Sequence

import jax

from jaxpar._text import shown_path
from jaxpar.commands._common import check_inputs, profile_steps
from jaxpar.commands._job_devices import refuse_cpu_only
from jaxpar.commands._lines import describe_data, header_lines, model_line, packing_line, state_line, traced_line
from jaxpar.config._checks import check, check_on_devices
from jaxpar.config._cost_model import config_view
from jaxpar.config._job import build_job
from jaxpar.config._load import load_config, to_yaml
from jaxpar.config._schema import ConfigError
from jaxpar.devices._distributed import start_processes
from jaxpar.errors import CostModelError, LayoutError, PlanError
from jaxpar.plan import RUN_CLUSTERS, RunPrediction, muon_lines, platform_of, run_prediction
from jaxpar.run._checkpoint import no_checkpoint_error
from jaxpar.run._out_of_memory import out_of_memory_error
from jaxpar.run._resume import checkpoint_meta, train_with_checkpoints
from jaxpar.run._run_directory import checkpoint_steps, claim_run_directory
from jaxpar.run._watchdog import parse_step_timeout


def run_train(config: str, overrides: Sequence[str], *, print_config: bool = False, resume: bool = False,
              overwrite: bool = False, dist: dict | None = None, step_timeout: str | None = None) -> int:
    """``jaxpar train``: load + check the config, claim the run directory, build the job, train, summarise.

    ``resume`` (``--resume``) sets ``checkpoint.resume=true``; else a ``train.out_dir`` that holds another run
    is refused before anything is written, or moved aside with ``overwrite`` (``--overwrite``:
    :func:`jaxpar.run._run_directory.claim_run_directory`). Exit status 0 also after SIGTERM / SIGINT (a
    checkpoint of the current step is saved), 1 when a non-finite loss stops the run (``train.on_nonfinite=stop``),
    124 when a step hangs (``--step-timeout``, else ``train.step_timeout``:
    :func:`jaxpar.run._watchdog.parse_step_timeout`).

    Args:
      config: the YAML config.
      overrides: dotted ``key=value`` overrides.
      print_config: print the resolved config and return.
      resume: ``--resume``.
      overwrite: ``--overwrite``.
      dist: the process options (None: one process, or a launcher's environment).
      step_timeout: ``--step-timeout`` (None: ``train.step_timeout``).

    Returns:
      The exit status.
    """
    cfg = load_config(config, [*overrides, *(["checkpoint.resume=true"] if resume else [])], checked=False)
    made = check(cfg)                       # once: the devices' part when they are known (_start)
    if print_config:
        print(to_yaml(cfg), end="")
        return 0
    profile = profile_steps(cfg.train.profile)        # train.profile: the steps to trace, checked first
    watchdog = (parse_step_timeout(cfg.train.step_timeout, "train.step_timeout") if step_timeout is None
                else parse_step_timeout(step_timeout))
    if overwrite and cfg.checkpoint.resume:
        raise ConfigError("jaxpar train: --overwrite starts a new run (the earlier one moved aside) and --resume "
                          "(checkpoint.resume=true) continues the earlier one; give one of them.")
    out_dir = _start(cfg, made, overwrite, dist, watchdog)
    job = build_job(cfg, made=made)
    print(f"job      {cfg.name}  ->  {shown_path(out_dir)}")
    print("\n".join(header_lines(job)))
    predicted: dict = {}                 # the cost model's peak and the state's bytes per device, once laid out
    try:
        status = _train_job(cfg, job, profile, predicted, watchdog)
    except Exception as e:      # XLA's RESOURCE_EXHAUSTED, named with the predicted and available memory
        command = shlex.join([config, *overrides])       # what jaxpar inspect compiles
        if (oom := out_of_memory_error(e, predicted.get("peak"), jax.devices(), state_bytes=predicted.get("state"),
                                       config=command)) is not None:
            raise oom from None
        raise
    if line := packing_line(job.batch_fn, cfg.train.steps):       # data.kind=documents: real tokens
        print(line)
    if line := traced_line(out_dir, profile):
        print(line)
    return status


def _predict(cfg, job, layout) -> RunPrediction:
    """The cost model's prediction of the run on its platform's cluster; what the cost model cannot price is
    said in the prediction's line, and never stops the run."""
    platform = platform_of(layout.mesh)
    if (cluster := RUN_CLUSTERS.get(platform)) is None:
        return RunPrediction(None)
    try:
        return run_prediction(config_view(cfg, dict(layout.mesh.shape), job.strategy, cluster, platform=platform)[0])
    except (CostModelError, LayoutError, PlanError) as e:
        return RunPrediction(None, cluster, (f"not predicted ({type(e).__name__}: {e})",))


def _train_job(cfg, job, profile, predicted: dict, watchdog) -> int:
    """Lay out the built job's state, print its summary, then :func:`jaxpar.run._resume.train_with_checkpoints`
    (``predicted``: the cost model's ``peak`` and the train ``state``'s bytes per device, set once known)."""
    state, layout = job.init_state(weights=not job.run.resume)     # a resumed run restores its own weights
    prediction = _predict(cfg, job, layout)
    predicted.update(peak=prediction.peak, state=layout.analytic_bytes()["total"])
    print(model_line(cfg.model, job.hf, layout), state_line(layout), sep="\n")
    if line := prediction.line():
        print(line)
    if routing := muon_lines(cfg.optimizer.muon if cfg.optimizer.name == "muon" else None, layout):
        print("\n".join(routing[1:]))                # the run's config summary: each parameter's half
    line, tokens = describe_data(cfg, job.batch_fn)
    print(line)
    step, evaluate = job.train_step(layout), job.eval_fn(layout)
    log, ckpt = job.log_options(layout, tokens), job.checkpointer(layout)
    log = dataclasses.replace(log, predicted_peak_bytes=predicted["peak"], profile=profile)
    return train_with_checkpoints(step, state, layout, job.batch_fn, job.run, log, checkpointer=ckpt,
                                  meta=checkpoint_meta(mesh_sizes=layout.mesh.shape, **job.meta), eval_fn=evaluate,
                                  eval_batches=job.eval_batches, ramp=job.ramp, config_text=to_yaml(cfg),
                                  watchdog=watchdog, claim=False)      # _start claimed the run directory


def _start(cfg, made, overwrite: bool, dist: dict | None, watchdog=None) -> Path:
    """Start the processes and find the devices, check the config on them and the files it reads (``model.hf``,
    the data files), then the run directory: claim
    ``train.out_dir`` for a new run, or find a complete checkpoint for ``--resume`` (before anything is built
    or written); returns it. With a ``watchdog``, XLA's own NCCL timeout is set first (:func:`gpu_timeout_flag`)."""
    if watchdog is not None:
        gpu_timeout_flag(watchdog.seconds or watchdog.min_seconds)
    info = start_processes(**(dist or {}), devices=cfg.train.devices)   # jax.distributed, then the devices
    refuse_cpu_only(cfg.train.devices, simulated=bool((dist or {}).get("local_devices")))
    check_on_devices(cfg, made, jax.device_count())     # on these devices, before the run directory is touched
    check_inputs(cfg)                               # and the files it reads (model.hf, data.paths)
    out_dir = Path(cfg.train.out_dir)
    if not cfg.checkpoint.resume:
        claim_run_directory(out_dir, cfg.checkpoint.dir if cfg.checkpoint.enabled else None, overwrite=overwrite)
    elif not checkpoint_steps(cfg.checkpoint.dir):     # before the job is built: nothing created, no wait
        raise no_checkpoint_error(Path(cfg.checkpoint.dir).absolute(),
                                  [f"{s}" for s in checkpoint_steps(cfg.checkpoint.dir, complete=False)])
    if info.multiprocess or info.method == "k8s":
        from jaxpar.run._preemption import catch_stop_signals

        print(f"process  {info.describe()}")
        if info.multiprocess:
            catch_stop_signals()      # a SIGTERM during start-up stops every process after the first step
    return out_dir


#: XLA's own timeout for NCCL (a GPU flag jaxlib 0.10.2 parses; its help: "Timeout in seconds before terminating
#: jobs stuck in NCCL Rendezvous"). Not exercised on GPUs here (docs/gpu.md).
NCCL_TIMEOUT_FLAG = "--xla_gpu_nccl_termination_timeout_seconds"


def gpu_timeout_flag(seconds: float) -> None:
    """Add :data:`NCCL_TIMEOUT_FLAG` with the watchdog's least bound to ``XLA_FLAGS``, before the backend starts
    (not when the user set it, nor once a backend is up: then it would not be read)."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if NCCL_TIMEOUT_FLAG in flags or xla_bridge.backends_are_initialized():
        return
    os.environ["XLA_FLAGS"] = f"{flags} {NCCL_TIMEOUT_FLAG}={int(seconds)}".strip()
