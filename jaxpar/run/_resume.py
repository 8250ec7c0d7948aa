"""A training run with checkpoints, as ``jaxpar train`` runs it: resume from the latest good
checkpoint, train with checkpoints and metrics (:func:`jaxpar.run.train`), then write
``summary.json`` and the text samples.

:class:`RunOptions` holds the run's settings (the CLI fills it from ``train.*``, ``checkpoint.resume``,
``logging.samples`` and the optimizer's learning-rate schedule, :func:`jaxpar.config.build_job`),
:class:`~jaxpar.run.LogOptions` how it reports, and a
:class:`~jaxpar.run.Checkpointer` where its checkpoints go.

:func:`checkpoint_meta` is what each checkpoint records beside the state. A run directory holds one
run: a new run (no ``resume``) into a ``train.out_dir`` that holds another run's records or
checkpoints is refused before anything is written (:func:`~jaxpar.run._run_directory.claim_run_directory`).

Example::

    >>> checkpoint_meta("demo", {"data": 8}, seed=0, model="gpt", data={"kind": "text", "seed": 0, "batch_size": 32})
    {'config': 'demo', 'seed': 0, 'model': 'gpt', 'mesh': {'data': 8}, 'data': {'kind': 'text', 'seed': 0, 'batch_size': 32}}
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from jaxpar._text import shown_path
from jaxpar.errors import RunDirectoryError
from jaxpar.optimizers import learning_rate
from jaxpar.run._checkpoint import CheckpointWarning
from jaxpar.run._goodput import Goodput
from jaxpar.run._loop import train
from jaxpar.errors import NonFiniteError
from jaxpar.run._metrics import is_main_process
from jaxpar.run._summary import LogOptions
from jaxpar.run._run_directory import claim_run_directory
from jaxpar.run._same_program import SameProgram
from jaxpar.step._state import use_parts
from jaxpar.run._sample import SampleOptions, host_params, write_samples


class RunOptions(NamedTuple):
    """The settings of a training run with checkpoints.

    ``steps``: the run ends after this step (``train.steps``; a resumed run does the rest).
    ``out_dir``: where ``summary.json`` and ``samples.txt`` go. ``eval_every``, ``on_nonfinite``,
    ``steps_per_call``: as for :func:`jaxpar.run.train`. ``resume``: continue from the
    checkpointer's latest good checkpoint. ``data_seed``: the run's data seed (a checkpoint written
    with another one is resumed with a warning). ``samples``: text samples at the end (None: none).
    ``lr_schedule``: the optimizer's learning-rate schedule (``step -> lr``), whose rates the warning of a
    resume under another ``steps`` names (None: it names none).
    """

    steps: int
    out_dir: str | Path
    eval_every: int = 0
    on_nonfinite: str = "skip"
    steps_per_call: int = 1
    resume: bool = False
    data_seed: int = 0
    samples: SampleOptions | None = None
    lr_schedule: Callable[[int], Any] | None = None


def resume(checkpointer: Any, layout: Any, *, ramp: Any = None, data_seed: int | None = None,
           steps: int | None = None, lr_schedule: Callable[[int], Any] | None = None) -> tuple[Any, int]:
    """Restore the latest good checkpoint; print one warning per unreadable newer one, and one when
    it was written with another data seed; warn (:class:`CheckpointWarning`) when it was written by a
    run of another length, whose learning-rate schedule differs (:func:`schedule_change`).

    Args:
      checkpointer: the run's :class:`~jaxpar.run.Checkpointer` (closed when the restore fails).
      layout: the train state's layout (the restore target).
      ramp: an adaptive batch ramp, given its decisions so far (``load_state_dict``); other ramps are left.
      data_seed: this run's data seed, compared with the checkpoint's.
      steps: this run's ``train.steps`` (the schedule's length), compared with the checkpoint's (None: not).
      lr_schedule: this run's learning-rate schedule (``step -> lr``), for the warning's numbers (the
        checkpoint's own rate is its optimizer state's, :func:`jaxpar.optimizers.learning_rate`).

    Returns:
      ``(state, next_step)``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)   # reported below, one line each
            restored = checkpointer.restore(layout)
    except BaseException:
        checkpointer.close()          # Orbax's background threads must finish before the interpreter exits
        raise
    for s, reason in restored.skipped:
        print(f"jaxpar train: warning: checkpoint step {s} in {checkpointer.directory} is unreadable, using step "
              f"{restored.step} instead: {reason}", file=sys.stderr)
    start = int(restored.meta["data"]["next_step"])
    if hasattr(ramp, "load_state_dict"):      # an adaptive ramp's decisions so far
        ramp.load_state_dict(restored.meta.get("batch_ramp"))
    saved_seed = restored.meta.get("data", {}).get("seed", data_seed)
    if saved_seed != data_seed:
        print(f"jaxpar train: warning: the checkpoint was written with data.seed={saved_seed}, this run has "
              f"data.seed={data_seed}: the data order differs from the original run.", file=sys.stderr)
    change = (schedule_change(restored.meta, start, steps, lr_schedule, learning_rate(restored.state.opt_state))
              if steps is not None and start < steps else None)
    if change:
        warnings.warn(change, CheckpointWarning, stacklevel=2)
    print(f"resume   step {start} from {restored.path}")
    return restored.state, start


def schedule_change(record: Mapping[str, Any], step: int, steps: int,
                    lr_schedule: Callable[[int], Any] | None = None, last_lr: Any = None) -> str | None:
    """What changes when a run of ``steps`` steps resumes at ``step`` from a checkpoint whose record
    (``schedule``: its run's ``steps``) is another schedule's.

    Args:
      record: the checkpoint's JSON record (one without ``schedule``, not saved by ``jaxpar train``: no change).
      step: the step the run resumes at.
      steps: this run's ``train.steps``.
      lr_schedule: this run's learning-rate schedule (None: the message leaves out the learning rates).
      last_lr: the learning rate of the checkpoint's last step, ``step - 1`` (its optimizer state's; None or not
        finite: the message leaves out the learning rates).

    Returns:
      The warning's text, or None when the checkpoint's run had the same length.

    Example:
      >>> text = schedule_change({"schedule": {"steps": 100}}, 90, 200, lambda s: 5e-4 + s * 1e-6, 1e-4)
      >>> text[:text.index(",")]
      'checkpoint step 90 was written by a run with train.steps=100; this run has train.steps=200'
      >>> text[text.index("at step 90"):text.index(" To")]
      'at step 90 the learning rate is 0.00059 now, after 0.0001 at step 89 in the original run.'
      >>> schedule_change({"schedule": {"steps": 200}}, 90, 200), schedule_change({}, 90, 200)
      (None, None)
    """
    saved = (record.get("schedule") or {}).get("steps")
    if saved is None or int(saved) == int(steps):
        return None
    rates, jump = "", ""
    last = float("nan") if last_lr is None else float(last_lr)
    if lr_schedule is not None and math.isfinite(last):
        before, now = float(lr_schedule(step - 1)), float(lr_schedule(step))
        if abs(before - last) <= 1e-6 * max(abs(before), abs(last)):
            rates = (f": at step {step - 1} the learning rate was {last:.3g} in both runs, and it decays differently "
                     "from there")
        else:
            rates = (f": at step {step} the learning rate is {now:.3g} now, after {last:.3g} at step {step - 1} in the "
                     "original run")
            jump = f" (the learning rate jumps at step {step})"
    if saved > step:
        fix = (f"To continue the original schedule, resume with train.steps={saved}; to change its length on "
               f"purpose, keep train.steps={steps}{jump}.")
    else:
        fix = f"The original schedule ended at step {saved}; to train on, keep train.steps={steps}{jump}."
    return (f"checkpoint step {step} was written by a run with train.steps={saved}; this run has "
            f"train.steps={steps}, and the learning-rate schedule (warm-up and decay) follows train.steps{rates}. "
            f"{fix}")


def checkpoint_meta(name: str, mesh_sizes: Mapping[str, int], *, seed: int, model: str,
                    data: Mapping[str, Any], tokenizer: Mapping[str, Any] | None = None) -> dict:
    """What every checkpoint of the run records beside the state (the loop adds ``data.next_step``).

    Args:
      name: the job's name.
      mesh_sizes: the mesh's axis sizes.
      seed: the model's initialisation seed.
      model: the model's name.
      data: the data's description (kind, seed, batch size).
      tokenizer: the tokenizer's ``fingerprint`` and ``vocab_size`` (None: the run has none).

    Returns:
      The meta dict.
    """
    meta = {"config": name, "seed": seed, "model": model, "mesh": dict(mesh_sizes), "data": dict(data)}
    return meta if tokenizer is None else {**meta, "tokenizer": dict(tokenizer)}


def train_with_checkpoints(step: Callable, state: Any, layout: Any, batch_fn: Callable[[int], Any],
                           opts: RunOptions, log: LogOptions, *, checkpointer: Any = None,
                           meta: dict | None = None, eval_fn: Callable | None = None,
                           eval_batches: Sequence = (), ramp: Any = None, config_text: str | None = None,
                           watchdog: Any = None, claim: bool = True) -> int:
    """Resume (``opts.resume``; else a new run, in directories that hold no other run:
    :func:`~jaxpar.run._run_directory.claim_run_directory`), run :func:`jaxpar.run.train` with
    checkpoints and metrics, then write ``summary.json`` and the samples and print where everything went.

    Args:
      step: the train step (:func:`jaxpar.make_train_step`).
      state: the fresh train state (replaced by the checkpoint's when resuming).
      layout: its layout.
      batch_fn: ``step -> host batch``.
      opts: the run's settings.
      log: how the loop reports (:class:`~jaxpar.run.LogOptions`).
      checkpointer: where checkpoints go (None: none); closed at the end. Each checkpoint records the
        schedule's length (``opts.steps``); a resume under another length warns.
      meta: what each checkpoint records (:func:`checkpoint_meta`).
      eval_fn: ``state -> eval loss`` (None: no evaluation).
      eval_batches: the fixed eval batches (the samples' prompts come from the first).
      ramp: the batch ramp ``batch_fn`` reads, if any.
      config_text: the run's config (YAML), written to ``<out_dir>/config.yaml`` once the run starts
        training: after a resume succeeded, never when it fails or finds nothing to do (None: not written); with
        several processes, a program mismatch names the keys whose values differ between them.
      watchdog: a :class:`~jaxpar.run.Watchdog` (its ``directory``, where a hang's stacks go, defaults to out_dir).
      claim: claim the directories of a new run here; False: the caller claimed them (``jaxpar train`` does,
        before it builds the job).

    Returns:
      The exit status: 0, also after a stop signal (a checkpoint is saved) or when the checkpoint
      is already at ``opts.steps``; 1 when a non-finite loss stopped the run.

    Raises:
      RunDirectoryError: a new run (not ``opts.resume``) whose ``out_dir`` or checkpoint directory holds
        another run's records or checkpoints (the checkpointer is closed, nothing is written).
    """
    if checkpointer is not None:      # the schedule's length at each checkpoint
        meta = {**(meta or {}), "schedule": {"steps": int(opts.steps)}}
    clock = Goodput()                 # the run's wall time by bucket, from before the restore
    if (started := _start(state, layout, opts, checkpointer, ramp, config_text, clock, log, claim)) is None:
        return 0
    state, start = started
    if watchdog is not None:
        watchdog.directory = watchdog.directory or Path(opts.out_dir)
    try:
        state, summary = train(step, state, batch_fn, mesh=layout.mesh, steps=opts.steps - start,
                               start_step=start, eval_fn=eval_fn, eval_every=opts.eval_every,
                               checkpointer=checkpointer, checkpoint_meta=meta, on_nonfinite=opts.on_nonfinite,
                               ramp=ramp, steps_per_call=opts.steps_per_call, log=log,
                               same_program=SameProgram(config_text=config_text), goodput=clock, watchdog=watchdog)
    except NonFiniteError as e:
        print(f"jaxpar train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if checkpointer is not None:
            checkpointer.close()
    _finish(summary, state, layout, opts, checkpointer, lambda: eval_batches[0] if eval_batches else batch_fn(0))
    return 0


def _start(state: Any, layout: Any, opts: RunOptions, checkpointer: Any, ramp: Any, config_text: str | None,
           clock: Goodput, log: LogOptions, claim: bool) -> tuple[Any, int] | None:
    """``(state, start step)``: the checkpoint's (``opts.resume``, timed on ``clock``; None when it is at
    ``opts.steps`` already), or a new run's in directories that hold no other (claimed here with ``claim``);
    then ``config.yaml``. The checkpointer is closed when the run does not start."""
    start = 0
    if opts.resume:
        with clock.timed("checkpoint_restore"):
            state, start = resume(checkpointer, layout, ramp=ramp, data_seed=opts.data_seed, steps=opts.steps,
                                  lr_schedule=opts.lr_schedule)
        if start >= opts.steps:
            print(f"done     the checkpoint is at step {start} >= train.steps={opts.steps}; nothing to do. To train "
                  f"further, run again with train.steps=N --resume, N > {start} (e.g. train.steps={2 * start}).")
            checkpointer.close()
            return None
    elif claim:
        try:
            claim_run_directory(opts.out_dir, getattr(checkpointer, "directory", None))
        except RunDirectoryError:
            if checkpointer is not None:
                checkpointer.close()
            raise
    if log.peak_flops and log.flops_per_token is None:
        print("mfu      not reported: FLOPs per token are known only for the built-in GPT (logging.peak_flops)")
    if config_text is not None and is_main_process():
        Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(opts.out_dir) / "config.yaml").write_text(config_text)
    return state, start


def _finish(summary: Any, state: Any, layout: Any, opts: RunOptions, checkpointer: Any,
            first_batch: Callable[[], Any]) -> None:
    """``summary.json``, the samples (unless preempted) and the closing lines."""
    main, out_dir = is_main_process(), Path(opts.out_dir)
    if main:
        (out_dir / "summary.json").write_text(json.dumps(
            {k: v for k, v in vars(summary).items() if k not in ("losses", "evals")}, indent=2) + "\n")
    print(f"done     {summary.line()}")
    if summary.checkpoint_steps:
        print(f"saved    checkpoints of steps {summary.checkpoint_steps} in {shown_path(checkpointer.directory)}")
    if summary.preempted:
        print(f"stopped  by {summary.preempted} after step {summary.end_step}; continue with --resume")
    elif opts.samples is not None and opts.samples.count:
        params, stats = host_params((state.params, state.stats))   # every process: gathering is a collective
        if main:
            with use_parts(layout, stats):      # what the state's parts install (the MoE router bias)
                path = write_samples(layout.graphdef, params, first_batch(), out_dir / "samples.txt", opts.samples)
            print(f"samples  {shown_path(path)}")
    if main:
        tb = out_dir / "tb"             # TensorBoard's events (logging.tensorboard): tensorboard --logdir <it>
        print(f"wrote    {', '.join(shown_path(p) for p in (summary.metrics_path, summary.plot_path) if p)}"
              + (f", {shown_path(tb)}/ (tensorboard --logdir {shown_path(tb)})" if tb.is_dir() else ""))
