"""The training loop: steps, logging, eval, checkpoints, preemption and non-finite steps.

Plain values in: a step function, a train state, ``batch_fn(step) -> host batch``
(the data order depends on the step number alone, so a run can resume from it) and
the mesh the batches are placed on. The loop blocks on the device only at log and
checkpoint points: the next host batch is built while the device computes.

* **Metrics** (:class:`LogOptions`, :mod:`jaxpar.run._metrics`): ``metrics.jsonl``,
  TensorBoard, a progress bar, a loss-curve PNG; files are written by process 0 only.
* **Checkpoints** (:class:`~jaxpar.run.Checkpointer`): every
  ``checkpointer.every`` steps, at the end, and on SIGTERM / SIGINT.
* **Preemption** (:mod:`jaxpar.run._preemption`): SIGTERM or SIGINT lets the current
  step finish, saves a checkpoint of it and returns (``summary.preempted`` names the
  signal); a second Ctrl-C interrupts. Several processes agree on the step to stop after.
* **Non-finite steps**: a NaN / inf loss or gradient norm is reported; ``on_nonfinite=
  "skip"`` (with a step built with ``skip_nonfinite=True``) goes on without that update,
  ``"stop"`` raises :class:`~jaxpar.errors.NonFiniteError`. A non-finite state is never saved.
* **Goodput** (:mod:`jaxpar.run._goodput`): the wall time by bucket (steps, compile, checkpoints, data,
  eval, logging, steps lost to a restart) in the ``train`` records and ``summary.goodput``.
* **Hangs** (:class:`~jaxpar.run.Watchdog`): a step with no progress within a bound (a collective waiting
  for a stuck or dead process) ends the process with its Python stacks dumped and exit status 124.
* **Memory** (:class:`~jaxpar.run._memory_meter.MemoryMeter`): the peak bytes per device, measured at log points
  (``memory_stats()``; on CPU the live arrays), beside the compiled step's in ``summary.memory``.

Example::

    >>> import os, shutil, tempfile
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> tx = optax.adam(0.05)
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=2, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, tx, mesh)
    >>> step = jaxpar.make_train_step(classifier_loss, tx, layout)
    >>> def batch_fn(i):                         # depends on the step number alone: resumable
    ...     x = np.random.default_rng(i).normal(size=(8, 4)).astype(np.float32)
    ...     return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}
    >>> evaluate = make_eval_fn(classifier_loss, layout, batches=[batch_fn(10_000)])
    >>> d = tempfile.mkdtemp()
    >>> state, summary = train(step, state, batch_fn, mesh=mesh, steps=30, eval_fn=evaluate, eval_every=10,
    ...                        log=LogOptions(log_every=10, out_dir=d, progress="none"))
    >>> int(state.step), summary.last_loss < summary.first_loss, summary.eval_loss < 0.2
    (30, True, True)
    >>> sorted(os.listdir(d))
    ['loss.png', 'metrics.jsonl']
    >>> shutil.rmtree(d)
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar._text import shown_path
from jaxpar.batch import batch_sharding, shard_batch
from jaxpar.compat._table import Setting, raise_problems
from jaxpar.errors import LoopError, check_int
from jaxpar.rules import named_shardings
from jaxpar.strategy import Strategy
from jaxpar.data._rows import make_global_batch
from jaxpar.step._noise_scale import noise_scale_value
from jaxpar.run._preemption import StopAgreement, StopSignals
from jaxpar.run._goodput import Goodput
from jaxpar.run._ramp import AdaptiveRamp
from jaxpar.run._same_program import SameProgram
from jaxpar.run._watchdog import Watchdog
from jaxpar.run._run_directory import refuse_later_steps
from jaxpar.run._memory_meter import MemoryMeter
from jaxpar.run._metrics import MetricsWriter, is_main_process
from jaxpar.run._progress import Meter, Progress
from jaxpar.run._summary import LogOptions, TrainSummary, merge_log_options, plot_losses
from jaxpar.step._grads import model_loss
from jaxpar.step._program import DATA_EVENT, STEP_EVENT, strategy_context
from jaxpar.step._state import StateLayout, layout_strategy

NONFINITE_MODES = ("skip", "stop")


def make_eval_fn(loss_fn: Callable, layout: StateLayout, strategy: Strategy | None = None,
                 batches: Sequence[Any] = ()) -> Callable[[Any], float]:
    """``evaluate(state) -> mean loss`` over fixed host ``batches`` (forward only, jitted once).

    The model runs as in training: the same layout, logical rules, compute dtype, FP8 and state parts
    (:func:`~jaxpar.step.strategy_context` with the state's ``stats``).

    Args:
      loss_fn: the train step's ``loss_fn(model, batch)``.
      layout: the train state's :class:`~jaxpar.step.StateLayout` (mesh, shardings, strategy).
      strategy: None (the layout's strategy), or that same strategy.
      batches: host batches, non-empty; placed on the mesh once and reused at every eval.

    Returns:
      ``evaluate(state) -> float``: the mean loss over ``batches`` of ``state.params``.
    """
    layout_strategy(layout, strategy)
    mesh = layout.mesh
    if not batches:
        raise LoopError("make_eval_fn: batches is empty; give at least one eval batch.")
    placed = [shard_batch(b, mesh) for b in batches]   # checked and placed once, reused at every eval
    loss_of_params = model_loss(loss_fn, layout)

    def loss_of(params, batch, stats):
        with strategy_context(layout, stats):       # the state's parts as in the step (the router bias)
            return loss_of_params(params, batch)

    stats_sharding = layout.shardings().stats
    jitted = jax.jit(loss_of, in_shardings=(named_shardings(layout.params, mesh), batch_sharding(mesh), stats_sharding),
                     out_shardings=NamedSharding(mesh, PartitionSpec()))

    def evaluate(state) -> float:
        losses = [jitted(state.params, b, state.stats) for b in placed]
        return float(jnp.mean(jnp.stack(losses)))

    return evaluate


def _checked_train_args(state: Any, log: LogOptions, *, steps: int, start_step: int | None, eval_every: int,
                        max_inflight: int, stop_check_every: int | None, on_nonfinite: str, ramp: Any,
                        steps_per_call: int, checkpointer: Any) -> tuple[int, int]:
    """:func:`train`'s arguments checked: its start step and ``stop_check_every`` (default: ``log_every``).

    The ramp (an adaptive one needs the state's noise scale), ``steps_per_call`` with it and the loop's
    intervals go to the compatibility table (:func:`jaxpar.compat.raise_problems`). These rules read the
    loop's settings only, so the setting holds the default strategy and no mesh, and the noise scale as
    ``True`` when the state measures it (its interval is the layout's)."""
    stop_check_every = log.log_every if stop_check_every is None else stop_check_every
    for name, value, low in (("steps", steps, 1), ("eval_every", eval_every, 0), ("max_inflight", max_inflight, 1),
                             ("stop_check_every", stop_check_every, 1)):
        check_int("train", name, value, low, LoopError)
    if on_nonfinite not in NONFINITE_MODES:
        raise LoopError(f"train(on_nonfinite={on_nonfinite!r}): choose one of {', '.join(NONFINITE_MODES)}.")
    if log.profile is not None and not (len(log.profile) == 2 and 0 <= log.profile[0] < log.profile[1]
                                        and all(s % steps_per_call == 0 for s in log.profile) and log.out_dir):
        raise LoopError(f"LogOptions(profile={log.profile!r}, out_dir={log.out_dir!r}): profile is the steps (A, B) "
                        f"to trace, 0 <= A < B, multiples of steps_per_call={steps_per_call}, and the trace goes "
                        "to <out_dir>/trace: give out_dir.")
    start = int(state.step) if start_step is None else int(start_step)
    if hasattr(checkpointer, "steps_after"):      # before any step: keep prunes no other run's checkpoints
        refuse_later_steps(f"train(start_step={start})", checkpointer.directory, checkpointer.steps_after(start),
                           checkpointer.keep)
    check_int("train", "steps_per_call", steps_per_call, 1, LoopError)
    kind = "adaptive" if isinstance(ramp, AdaptiveRamp) else "fixed" if ramp is not None else None
    intervals = (("steps", steps), ("start", start), ("log_every", log.log_every), ("eval_every", eval_every),
                 ("checkpoint_every", getattr(checkpointer, "every", 0)), ("stop_check_every", stop_check_every))
    raise_problems(Setting(Strategy(), {}, steps_per_call=steps_per_call, ramp=kind, intervals=intervals,
                           noise_scale_every=True if noise_scale_value(state) is not None else None,
                           ramp_steps=tuple(getattr(ramp, "steps", ()))))
    return start, stop_check_every


class _TraceSteps:
    """``LogOptions.profile``: the steps ``A .. B-1`` (those of this call) traced by ``jax.profiler`` into
    ``<out_dir>/trace`` (TensorBoard's profile plugin and Perfetto read it; docs/profiling.md), each inside a
    :data:`~jaxpar.step._program.STEP_EVENT` annotation. A traced step runs alone: the device is idle when
    it starts and the host waits for it to end, so its batch, dispatch and device time show apart. Each
    step's seconds on the loop's clock go to ``<out_dir>/trace/steps.json``."""

    def __init__(self, steps: tuple[int, int], out_dir: Any, start: int, end: int, k: int):
        self.first, self.until = max(steps[0], start), min(steps[1], end)
        self.directory, self.k = Path(out_dir) / "trace", k
        self.times: list[list[float]] = []
        self.active, self.annotation, self.t0 = False, None, 0.0

    def begin(self, step: int, state: Any) -> None:
        if not self.first <= step < self.until:
            return
        if not self.active:
            jax.block_until_ready(state)          # the steps before run outside the trace
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
        self.t0 = time.perf_counter()
        self.annotation = jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=step)
        self.annotation.__enter__()

    def end(self, step: int, outputs: Any) -> None:
        if self.annotation is None:
            return
        jax.block_until_ready(outputs)
        self.annotation.__exit__(None, None, None)
        self.annotation = None
        self.times.append([step, time.perf_counter() - self.t0])
        if step + self.k >= self.until:
            self.stop()

    def stop(self) -> None:
        """End the trace (also when the run stops early) and write ``steps.json``."""
        if not self.active:
            return
        if self.annotation is not None:
            self.annotation.__exit__(None, None, None)
            self.annotation = None
        jax.profiler.stop_trace()
        self.active = False
        if is_main_process():
            (self.directory / "steps.json").write_text(json.dumps({"steps": self.times}))


class _Run:
    """One :func:`train` call: the per-step body and the work at log, checkpoint, stop and eval points."""

    def __init__(self, step_fn: Callable, batch_fn: Callable[[int], Any], mesh, log: LogOptions, *,
                 start: int, end: int, on_nonfinite: str, max_inflight: int, checkpointer: Any,
                 checkpoint_meta: dict | None, eval_fn: Callable[[Any], float] | None, eval_every: int,
                 ramp: Any = None, steps_per_call: int = 1, same_program: SameProgram | None = None,
                 goodput: Goodput | None = None, watchdog: Watchdog | None = None):
        self.clock = goodput if goodput is not None else Goodput()
        self.watchdog = watchdog
        self.step_fn, self.batch_fn, self.mesh, self.log = step_fn, batch_fn, mesh, log
        self.same_program = same_program     # several processes: the programs compared before the first step
        self.k = steps_per_call
        self.ramp = ramp if isinstance(ramp, AdaptiveRamp) else None
        self.start, self.end, self.max_inflight = start, end, max_inflight
        self.checkpointer, self.checkpoint_meta = checkpointer, checkpoint_meta
        self.eval_fn, self.eval_every = eval_fn, eval_every
        self.evals: list[tuple[int, float]] = []
        self.main = is_main_process()
        with self.clock.timed("logging"):                # the sinks: files, TensorBoard, the bar
            self.writer = MetricsWriter(log.out_dir, tensorboard=log.tensorboard,
                                        resume_step=start if start > 0 else None, enabled=self.main)
            self.clock.carry(self.writer.history, self.writer.dropped, start)   # an earlier attempt's buckets
            self.bar = Progress(log.progress if self.main else "none", end, start, log.print_fn)
        self.meter = Meter(self.writer, self.bar, log, on_nonfinite=on_nonfinite, start=start, end=end,
                            devices=mesh.size)
        self.memory = MemoryMeter(list(mesh.devices.flat))
        self.trace = _TraceSteps(log.profile, log.out_dir, start, end, steps_per_call) if log.profile else None

    def is_log(self, done: int) -> bool:
        """Whether the step count ``done`` is a log point (the first step of the call, every ``log_every``, the last)."""
        return done == self.start + self.k or done % self.log.log_every == 0 or done == self.end

    def step(self, state: Any, step: int) -> tuple[Any, Any]:
        """Dispatch step ``step`` (asynchronous, at most ``max_inflight`` ahead of the device).
        Returns the new state and the step's device metrics."""
        clock, mark = self.clock, self.clock.mark()
        # own rows per process, built ahead; steps_per_call: the k global batches stacked, [k, B, ...]
        with jax.profiler.TraceAnnotation(DATA_EVENT):      # a traced step's batch (train.profile)
            batches = [make_global_batch(self.batch_fn, s, self.mesh) for s in range(step, step + self.k)]
        batch = batches[0] if self.k == 1 else jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        waited = time.perf_counter() - mark[0]      # the host's time on the data (none when prefetched)
        clock.add("data_wait" if self.meter.device_idle() else "steps", mark)   # a busy device hid it
        if self.same_program is not None:           # before the first call: a mismatch raises, never hangs
            if line := self.same_program.check(self.step_fn, state, batch):
                self.bar.log(line)
            self.same_program = None
        with clock.timed("steps"):
            self.meter.wait_inflight(self.max_inflight)
            state, metrics = self.step_fn(state, batch)
            rows = jax.tree.leaves(batch)[0].shape[0 if self.k == 1 else 1]
            if isinstance(metrics, dict):
                metrics = {**metrics, "batch_size": rows if self.k == 1 else [rows] * self.k,
                           "data_wait": waited if self.k == 1 else [waited / self.k] * self.k}
            self.meter.add(step + self.k, metrics, self.k)
            self.bar.advance(self.k)
        if self.is_log(step + self.k):   # a log point's step dispatched: its state, batch and metrics live
            with clock.timed("logging"):
                if not self.memory.count and hasattr(self.step_fn, "lower"):
                    self.memory.keep_batch(batch)   # the compiled step is read at the end, the device idle
                self.memory.measure()
        return state, metrics

    def grow_batch(self, state: Any, done: int) -> None:
        """An adaptive ramp's decision after ``done`` steps (blocks on the noise scale of the state)."""
        if self.ramp is None or not self.ramp.due(done):
            return
        value = noise_scale_value(state)
        size = self.ramp.decide(done, value)
        if size is not None:
            self.writer.write({"kind": "batch_ramp", "step": done, "batch_size": size, "noise_scale": value})
            self.bar.log(f"step {done:>6}/{self.end}  noise scale {value:.4g}: global batch -> {size} "
                         f"from step {done}")

    def sync(self, state: Any, done: int, metrics: Any, stop: bool) -> None:
        """At log and checkpoint points (and before stopping): fetch and check the metrics, record, save."""
        ck = self.checkpointer
        is_log = self.is_log(done) or stop
        save = ck is not None and (ck.should_save(done) or done == self.end or stop)
        if is_log or save:
            with self.clock.timed("steps"):
                jax.block_until_ready(metrics)
            with self.clock.timed("logging") as now:
                self.clock.split(*self.meter.fetch())
                if is_log:
                    self.meter.record(done, now[0], {**self.clock.fields(), **(
                        {"memory_peak": self.memory.peak} if self.memory.count else {})})
        if save:
            with self.clock.timed("checkpoint_save"), self.paused():
                self.save(state, done)

    def save(self, state: Any, done: int) -> None:
        meta = dict(self.checkpoint_meta or {})
        meta["data"] = {**meta.get("data", {}), "next_step": done}
        if self.ramp is not None:
            meta["batch_ramp"] = self.ramp.state_dict()
        if self.checkpointer.save(done, state, meta):
            self.meter.saved.append(done)
            where = shown_path(self.checkpointer.directory / str(done))
            self.bar.log(f"step {done:>6}/{self.end}  checkpoint -> {where}")

    def report_stop(self, done: int, signal_name: str, processes: list[int]) -> None:
        """After the stop's checkpoint (waited for): the ``preempted`` record and line."""
        ck = self.checkpointer
        with self.clock.timed("checkpoint_save"):
            if ck is not None:
                ck.wait()
        rec = {"kind": "preempted", "step": done, "signal": signal_name,
               "checkpoint": done in self.meter.saved or (ck is not None and done in ck.steps()),
               **self.clock.fields()}
        who = ""
        if processes:
            rec["processes"] = processes
            who = f" (to process {', '.join(map(str, processes))})"
        self.writer.write(rec)
        self.bar.log(f"step {done:>6}/{self.end}  {signal_name}{who}: stopped after step {done}"
                     + (", checkpoint saved" if ck is not None else ""))

    def evaluate(self, state: Any, done: int) -> None:
        """Every ``eval_every`` steps and at the end: the eval record; its time is not step time."""
        if self.eval_fn is None or not ((self.eval_every and done % self.eval_every == 0) or done == self.end):
            return
        with self.clock.timed("steps"):
            jax.block_until_ready(state)
        with self.clock.timed("eval") as (t0, _), self.paused():
            value = float(self.eval_fn(state))
        self.evals.append((done, value))
        self.writer.write({"kind": "eval", "step": done, "eval_loss": value, "eval_time": time.perf_counter() - t0})
        self.bar.log(f"step {done:>6}/{self.end}  eval_loss {value:.4f}")
        self.meter.t_mark += time.perf_counter() - t0

    def loop(self, state: Any, handle_signals: bool, stop_check_every: int) -> tuple[Any, TrainSummary]:
        """The steps from ``start`` to ``end`` (until an agreed stop signal), then the final state and summary."""
        done, preempted, k = self.start, None, self.k
        try:
            agreement = StopAgreement(stop_check_every)
            with StopSignals(handle_signals) as signals, self.watchdog or contextlib.nullcontext():
                for step in range(self.start, self.end, k):
                    if self.trace is not None:
                        with self.paused():
                            self.trace.begin(step, state)
                    state, metrics = self.step(state, step)
                    if self.watchdog is not None:
                        self.watchdog.beat(step + k)     # armed from the first step's dispatch (compiled)
                    if self.trace is not None:
                        with self.paused():
                            self.trace.end(step, (state, metrics))
                    done = step + k
                    self.grow_batch(state, done)
                    # several processes: the same answer in all; checked after the first step too
                    preempted = agreement.check(done, signals.received, due=done == self.start + k)
                    self.sync(state, done, metrics, stop=preempted is not None)
                    if preempted is not None:
                        self.report_stop(done, preempted, agreement.processes)
                        break
                    self.evaluate(state, done)
        finally:
            self.close()
        return state, self.summary(state, done, preempted)

    def paused(self):
        """A block the watchdog does not time (an evaluation, a checkpoint save, a traced step's edges)."""
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.stop()
        if self.checkpointer is not None:
            with self.clock.timed("checkpoint_save"):
                self.checkpointer.wait()    # pending saves reach the disk, also when the run stops with an error
        with self.clock.timed("logging"):
            self.bar.close()
            self.writer.close()

    def summary(self, state: Any, done: int, preempted: str | None) -> TrainSummary:
        m, log = self.meter, self.log
        with self.clock.timed("logging"):
            self.memory.measure()       # memory_stats: the last steps' peak too
            self.memory.read_compiled(self.step_fn, state)
        goodput = self.clock.summary()          # one reading of the clock: wall_time is this attempt's part of it
        wall = goodput["wall_s"] - self.clock.base_wall
        step_time = m.step_time()
        finite = [x for x in m.losses if math.isfinite(x)] or m.losses or [float("nan")]
        tps = log.tokens_per_batch / step_time if log.tokens_per_batch and step_time else None
        summary = TrainSummary(
            start_step=self.start, end_step=done, first_loss=finite[0], last_loss=finite[-1],
            eval_loss=self.evals[-1][1] if self.evals else None, wall_time=wall,
            first_step_time=m.first_step_time or 0.0, step_time=step_time, tokens_per_s=tps,
            metrics_path=str(self.writer.path) if self.writer.path is not None else None, preempted=preempted,
            skipped_steps=m.skipped_steps, checkpoint_steps=m.saved, mfu=log.mfu_at(tps, self.mesh.size),
            goodput=goodput, memory=self.memory.summary(log.predicted_peak_bytes),
            losses=m.losses, evals=self.evals)
        if log.out_dir is not None and log.plot and self.main and m.losses:
            summary.plot_path = self._plot()
            self._plot_noise_scale()
        return summary

    def _plot_noise_scale(self) -> str | None:
        """``noise_scale.png`` (a state with ``with_noise_scale(..., every=k)``): earlier records, then this call's."""
        earlier = [(r["step"], r["noise_scale"]) for r in self.writer.history
                   if r.get("kind") == "train" and "noise_scale" in r]
        points = earlier + self.meter.noise_scale
        if not points:
            return None
        from jaxpar.step._noise_scale import plot_noise_scale

        return plot_noise_scale(Path(self.log.out_dir) / "noise_scale.png", [s for s, _ in points],
                                [v for _, v in points], title=f"{self.log.title}: gradient noise scale")

    def _plot(self) -> str:
        """``loss.png``: the train and eval records kept from earlier runs in ``out_dir``, then this call's."""
        history = self.writer.history
        earlier = [(r["step"], r["loss"]) for r in history
                   if r.get("kind") == "train" and isinstance(r.get("loss"), float)]
        losses = self.meter.losses
        steps_axis = [s for s, _ in earlier] + list(range(self.start + 1, self.start + 1 + len(losses)))
        curve = [v for _, v in earlier] + losses
        earlier_evals = [(r["step"], r["eval_loss"]) for r in history if r.get("kind") == "eval"]
        return plot_losses(Path(self.log.out_dir) / "loss.png", steps_axis, curve, earlier_evals + self.evals,
                           title=self.log.title)


def train(step_fn: Callable, state: Any, batch_fn: Callable[[int], Any], *, mesh, steps: int,
          start_step: int | None = None, eval_fn: Callable[[Any], float] | None = None, eval_every: int = 0,
          checkpointer: Any = None, checkpoint_meta: dict | None = None, on_nonfinite: str = "stop",
          handle_signals: bool = True, max_inflight: int = 2, stop_check_every: int | None = None,
          ramp: Any = None, steps_per_call: int = 1, same_program: SameProgram | None = SameProgram(),
          goodput: Goodput | None = None, watchdog: Watchdog | None = None, log: LogOptions | None = None,
          **log_options: Any) -> tuple[Any, TrainSummary]:
    """Run ``steps`` train steps from ``start_step``; log, evaluate, checkpoint, stop on a signal.

    Args:
      step_fn: ``step_fn(state, batch) -> (state, metrics)``; metrics ``loss``, ``grad_norm``, optionally ``lr``, ``skipped``.
      state: the train state (``state.step`` is the default start step).
      batch_fn: ``batch_fn(step)``: the host batch of global step ``step`` (placed with :func:`jaxpar.shard_batch`).
      mesh: the mesh the batches are placed on.
      steps: how many steps to run (>= 1).
      start_step: the first step (default ``int(state.step)``); > 0 keeps ``out_dir``'s records up to it.
      eval_fn: ``eval_fn(state) -> float`` (e.g. :func:`make_eval_fn`), or None.
      eval_every: evaluate every this many steps (0: only at the end).
      checkpointer: a :class:`~jaxpar.run.Checkpointer` (no checkpoint after the start step): saves at its
        interval, at the end and on a stop.
      checkpoint_meta: saved with each checkpoint, plus ``{"data": {"next_step": step}}``.
      on_nonfinite: ``"stop"`` raises :class:`~jaxpar.errors.NonFiniteError` at the first NaN / inf loss or grad norm;
        ``"skip"`` reports it and goes on (the step function must have skipped the update).
      handle_signals: False leaves SIGTERM / SIGINT alone.
      max_inflight: wait for step ``i - max_inflight`` before dispatching step ``i`` (unbounded, XLA:CPU can deadlock).
      stop_check_every: how often the processes agree on stopping (the same in all; default ``log_every``; ~0.7 ms).
      ramp: an :class:`~jaxpar.run.AdaptiveRamp` (the one ``batch_fn`` reads: :func:`~jaxpar.run.ramp_batch_fn`)
        decides every ``ramp.every`` steps from the noise scale; into ``batch_ramp`` records and
        ``meta["batch_ramp"]`` (restore with ``ramp.load_state_dict``). None for a fixed ramp.
      steps_per_call: ``k`` optimizer steps per ``step_fn`` call (``make_train_step(..., steps_per_call=k)``):
        batches stacked ``[k, B, ...]``, metrics ``[k]``; steps and intervals multiples of ``k``.
      same_program: several processes compare the first step's program (:class:`~jaxpar.run.SameProgram`; None: not).
      goodput: the run's clock (:class:`~jaxpar.run._goodput.Goodput`, made before a restore it timed; None: now).
      watchdog: a :class:`~jaxpar.run.Watchdog`: no progress within its bound ends the process (None: none).
      log: a :class:`LogOptions` (default ``LogOptions()``).
      **log_options: :class:`LogOptions` fields given directly (``log_every=1``), overriding ``log``'s.

    Returns:
      ``(state, summary)``: the final state and a :class:`TrainSummary`.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxpar; from jaxpar.step._state import TrainState
        >>> def step(state, batch):              # any (state, batch) -> (state, metrics); here: w -> mean(batch)
        ...     grad = state.params - batch.mean()
        ...     new = state._replace(step=state.step + 1, params=state.params - 0.5 * grad)
        ...     return new, {"loss": 0.5 * jnp.mean((state.params - batch) ** 2), "grad_norm": jnp.linalg.norm(grad)}
        >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
        >>> state = TrainState(jnp.int32(0), jnp.zeros(2), ())
        >>> state, summary = train(step, state, lambda i: np.ones((2, 2), np.float32), mesh=mesh, steps=4,
        ...                        log=LogOptions(log_every=2, progress="none"))
        >>> int(state.step), summary.first_loss, summary.last_loss
        (4, 0.5, 0.0078125)
    """
    log, common = merge_log_options(log, log_options), dict(eval_every=eval_every, max_inflight=max_inflight, ramp=ramp,
                  on_nonfinite=on_nonfinite, steps_per_call=steps_per_call, checkpointer=checkpointer)
    start, stop_check_every = _checked_train_args(state, log, steps=steps, start_step=start_step, **common,
                                                  stop_check_every=stop_check_every)
    return _Run(step_fn, batch_fn, mesh, log, start=start, end=start + steps, goodput=goodput, eval_fn=eval_fn, **common,
                checkpoint_meta=checkpoint_meta, same_program=same_program, watchdog=watchdog).loop(
                    state, handle_signals, stop_check_every)
