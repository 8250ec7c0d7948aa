"""Reporting for :func:`jaxpar.run.train`: options, progress, metrics records, summary, plot.

:class:`LogOptions` (how a run reports; ``train()`` also takes its fields as keywords),
:class:`TrainSummary` (what a call did: losses, timings, skipped and checkpointed steps, one
:meth:`~TrainSummary.line`), :func:`plot_losses` (the ``loss.png`` curve). :class:`Progress` (tqdm
bar or lines) and :class:`Meter` (fetches step metrics at log points, checks them for NaN / inf,
writes ``train`` and ``nonfinite`` records, times steps) and :class:`MemoryMeter` (the peak memory per
device, measured at log points, beside the compiled step's) serve the loop only. The sinks:
:class:`MetricsWriter` (``metrics.jsonl`` and TensorBoard, written by process 0 only) and the FLOP count
behind MFU (:func:`mfu` of :func:`jaxpar.cost._model.flops_per_token`; the formula: docs/training.md).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from jaxpar._text import agg_axes, format_bytes, save_plot
from jaxpar.analysis._compiled_memory import memory_report
from jaxpar.errors import AnalysisError, LoopError, NonFiniteError, check_int
from jaxpar.run._goodput import describe

_PROGRESS_MODES = ("auto", "bar", "lines", "none")


@dataclass
class TrainSummary:
    """What a :func:`~jaxpar.run.train` call did (losses: host floats; paths: ``None`` without ``out_dir``)."""

    start_step: int
    end_step: int
    first_loss: float          # loss of the first step run
    last_loss: float           # loss of the last step run
    eval_loss: float | None    # last eval loss, if any
    wall_time: float           # seconds of this attempt: goodput's clock, from the restore (or train()'s call)
    first_step_time: float     # seconds, the first step (includes compilation)
    step_time: float           # mean seconds per step after the first
    tokens_per_s: float | None
    metrics_path: str | None = None
    plot_path: str | None = None
    preempted: str | None = None       # the signal that stopped the run early ("SIGTERM" / "SIGINT")
    skipped_steps: list[int] = field(default_factory=list)     # steps whose update was dropped (non-finite)
    checkpoint_steps: list[int] = field(default_factory=list)  # steps checkpointed by this call
    mfu: float | None = None
    goodput: dict | None = None        # the run's wall time by bucket, across resumes (jaxpar.run._goodput)
    memory: dict | None = None         # peak bytes per device: measured, compiled, predicted (MemoryMeter.summary)
    losses: list[float] = field(default_factory=list, repr=False)
    evals: list[tuple[int, float]] = field(default_factory=list, repr=False)

    def line(self) -> str:
        """One human line: ``loss 5.54 -> 2.31 over 300 steps (eval 2.40); 0.062 s/step ...``."""
        ev = f" (eval {self.eval_loss:.4f})" if self.eval_loss is not None else ""
        tps = f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""
        tps += f", MFU {self.mfu:.1%}" if self.mfu is not None else ""
        skip = f"; {len(self.skipped_steps)} non-finite steps skipped" if self.skipped_steps else ""
        stop = f"; stopped by {self.preempted} at step {self.end_step}" if self.preempted else ""
        mem = f"; {describe_memory(self.memory)}" if self.memory else ""
        good = f"; {describe(self.goodput)}" if self.goodput else ""
        return (f"loss {self.first_loss:.4f} -> {self.last_loss:.4f} over {self.end_step - self.start_step} steps"
                f"{ev}; {self.step_time:.4f} s/step{tps}; first step (compile) {self.first_step_time:.1f} s; "
                f"total {self.wall_time:.1f} s{skip}{stop}{mem}{good}")


def plot_losses(path: str | Path, steps: Sequence[int], losses: Sequence[float],
                evals: Sequence[tuple[int, float]] = (), *, title: str = "training loss") -> str:
    """Write a loss-curve PNG (train per step, eval as markers) on a figure of its own Agg canvas
    (matplotlib's object API, no pyplot state).

    Args:
      path: the PNG file to write.
      steps: the step of each train loss.
      losses: the train losses (nats / token), one per step.
      evals: ``(step, eval_loss)`` pairs, drawn as markers.
      title: the plot's title.

    Returns:
      ``path`` as a string.
    """
    fig, ax = agg_axes()
    ax.plot(list(steps), list(losses), lw=1.2, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", ms=4, label="eval (held out)")
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=title)
    return save_plot(fig, ax, path)


#: Metrics of a compressed gradient exchange, logged when the step reports them.
_COMM = ("comm_bytes", "comm_ratio", "residual_norm", "replica_grad_norm",             # compression
         "loss_spread", "replica_distance", "replica_bytes", "delay_mean", "modelled_time", "modelled_time_sync",
         "noise_scale", "grad_sq_small", "grad_sq_big", "noise_trace", "noise_grad_sq",   # noise scale
         "batch_size", "data_wait")                     # the step's global batch; seconds waiting for it


def _num(x: float) -> float | str:
    """JSON-safe float: NaN / inf become the strings ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    return x if math.isfinite(x) else str(x)


def _fmt(x: float | str, spec: str) -> str:
    """``x`` formatted with ``spec``, or as is when :func:`_num` made it a string (NaN / inf)."""
    return x if isinstance(x, str) else format(x, spec)


@dataclass(frozen=True)
class LogOptions:
    """How :func:`~jaxpar.run.train` reports: progress, files under ``out_dir``, throughput and MFU.

    ``log_every``: a ``train`` record and progress line at the first step, every
    ``log_every`` steps and the last. ``out_dir`` (None: no files) receives
    ``metrics.jsonl`` (one JSON object per point, ``"kind"`` ``"train"``, ``"eval"``,
    ``"nonfinite"`` or ``"preempted"``; a train record's ``loss`` is the mean of the finite
    losses since the previous one), ``tb/`` (with ``tensorboard``) and ``loss.png`` (with
    ``plot``, titled ``title``). ``progress``: ``"auto"`` (a tqdm bar on a terminal, else
    lines), ``"bar"``, ``"lines"`` (through ``print_fn``) or ``"none"``. ``tokens_per_batch``
    adds tokens/s; with ``flops_per_token`` and ``peak_flops`` (of one device) MFU too.
    ``predicted_peak_bytes``: the cost model's peak per device, shown beside the measured and
    compiled peaks (:class:`MemoryMeter`). ``profile``: the steps ``(A, B)``, ``A .. B-1``, traced by
    ``jax.profiler`` into ``<out_dir>/trace`` (``train.profile``; docs/profiling.md).

    Example::

        >>> opts = LogOptions(log_every=5, out_dir="runs/demo", progress="lines")
        >>> opts.mfu_at(1000.0, devices=1) is None     # MFU needs flops_per_token and peak_flops
        True
        >>> LogOptions(progress="fancy")
        Traceback (most recent call last):
        ...
        jaxpar.errors.LoopError: LogOptions(progress='fancy'): choose one of 'auto', 'bar', 'lines', 'none'.
    """

    log_every: int = 10
    out_dir: str | Path | None = None
    progress: str = "auto"
    plot: bool = True
    title: str = "training loss"
    print_fn: Callable[[str], None] = print
    tensorboard: bool = False
    tokens_per_batch: int | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None
    predicted_peak_bytes: float | None = None
    profile: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_int("LogOptions", "log_every", self.log_every, 1, LoopError)
        if self.progress not in _PROGRESS_MODES:
            raise LoopError(f"LogOptions(progress={self.progress!r}): choose one of "
                             f"{', '.join(map(repr, _PROGRESS_MODES))}.")
        for name in ("peak_flops", "flops_per_token", "predicted_peak_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise LoopError(f"LogOptions({name}={value!r}): must be a finite number > 0 (None: "
                                f"{'not predicted' if name == 'predicted_peak_bytes' else 'no MFU'}).")

    def mfu_at(self, tokens_per_s: float | None, devices: int) -> float | None:
        """MFU at ``tokens_per_s`` on ``devices``.

        Args:
          tokens_per_s: the measured throughput (None: unknown).
          devices: how many devices ran it.

        Returns:
          The MFU as a fraction, or None without tokens/s, ``flops_per_token`` or ``peak_flops``.
        """
        if not (tokens_per_s and self.flops_per_token and self.peak_flops):
            return None
        return mfu(tokens_per_s, self.flops_per_token, peak_flops=self.peak_flops, devices=devices)


_LOG_FIELDS = tuple(f.name for f in fields(LogOptions))


def merge_log_options(log: LogOptions | None, direct: dict[str, Any]) -> LogOptions:
    """``log`` with the logging options given to ``train()`` directly.

    Args:
      log: a :class:`LogOptions`, or None for ``LogOptions()``.
      direct: :class:`LogOptions` field names and values; an unknown name raises :class:`~jaxpar.errors.LoopError`.

    Returns:
      A :class:`LogOptions`: ``log`` with ``direct``'s fields replaced.
    """
    unknown = [name for name in direct if name not in _LOG_FIELDS]
    if unknown:
        raise LoopError(f"train() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the "
                        f"logging options it also takes directly are {', '.join(_LOG_FIELDS)}.")
    if log is not None and not isinstance(log, LogOptions):
        raise LoopError(f"train(log={log!r}): expected a LogOptions (or None), got {type(log).__name__}.")
    return replace(log if log is not None else LogOptions(), **direct)


class Progress:
    """tqdm bar on a terminal, plain lines otherwise (or nothing).

    Args:
      mode: ``"auto"`` (a bar on a terminal, else lines), ``"bar"``, ``"lines"`` or ``"none"``.
      total: the last step.
      initial: the step the bar starts at.
      print_fn: prints a line in ``"lines"`` mode.
    """

    def __init__(self, mode: str, total: int, initial: int, print_fn: Callable[[str], None]):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.print_fn, self.bar = mode, print_fn, None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self, steps: int = 1) -> None:
        """Move the bar on.

        Args:
          steps: how many steps.
        """
        if self.bar is not None:
            self.bar.update(steps)

    def log(self, text: str, postfix: dict | None = None) -> None:
        """Print a line above the bar (or as a plain line in ``"lines"`` mode).

        Args:
          text: the line.
          postfix: values shown after the bar (None: those shown stay).
        """
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.write(text)
        elif self.mode == "lines":
            self.print_fn(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Meter:
    """The metrics of one :func:`~jaxpar.run.train` call: fetched from the device at log and
    checkpoint points, checked for non-finite values, written as records and progress lines, and timed.

    Args:
      writer: where the records go.
      bar: where the progress lines go.
      log: the run's :class:`LogOptions`.
      on_nonfinite: ``"stop"`` or ``"skip"``, as in ``train()``.
      start: the first step of the call.
      end: the last step of the call.
      devices: the mesh's device count (for MFU).
    """

    def __init__(self, writer: MetricsWriter, bar: Progress, log: LogOptions, *, on_nonfinite: str,
                 start: int, end: int, devices: int):
        self.writer, self.bar, self.log = writer, bar, log
        self.on_nonfinite, self.end, self.devices = on_nonfinite, end, devices
        self.saved: list[int] = []               # steps checkpointed by this call (appended by _Run.save)
        self.losses: list[float] = []
        self.skipped_steps: list[int] = []
        self.window: list[dict] = []             # host metrics of the steps since the last record
        self.noise_scale: list[tuple[int, float]] = []   # (step, B_simple) of every measuring step
        self.pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet fetched
        self.t_mark = time.perf_counter()
        self.mark_step, self.first_step_time = start, None
        self.timed_s, self.timed_steps = 0.0, 0  # time and steps after the first (eval excluded)

    def wait_inflight(self, max_inflight: int) -> None:
        """Block until at most ``max_inflight - 1`` dispatched steps are unfinished.

        Args:
          max_inflight: the most steps dispatched ahead of the device.
        """
        if len(self.pending) >= max_inflight:
            jax.block_until_ready(self.pending[-max_inflight][1])

    def add(self, done: int, metrics: Any, steps: int = 1) -> None:
        """Keep the device metrics of the step ending at ``done`` until the next fetch.

        Args:
          done: the step count after these steps.
          metrics: the step function's device metrics.
          steps: with ``steps > 1``, the metrics of the ``steps`` steps ending at ``done`` (every metric
            has a leading axis of that length).
        """
        self.pending.append((done, metrics, steps))

    def device_idle(self) -> bool:
        """Whether the device has finished every dispatched step (asks, never waits).

        Returns:
          True when no step is pending or the last one's metrics are ready.
        """
        if not self.pending:
            return True
        leaves = jax.tree.leaves(self.pending[-1][1])
        return not leaves or getattr(leaves[0], "is_ready", lambda: True)()

    def fetch(self) -> tuple[int, int]:
        """Bring the pending metrics to the host; report (or stop at) non-finite steps.

        Returns:
          ``(steps, skipped)``: how many steps were fetched, and how many of them dropped their update.
        """
        pending, self.pending = self.pending, []
        if not pending:
            return 0, 0
        fetched = []
        for (done, _, k), m in zip(pending, jax.device_get([m for _, m, _ in pending])):
            fetched += [(done, m)] if k == 1 else [(done - k + 1 + i, {key: v[i] for key, v in m.items()})
                                                   for i in range(k)]
        for s, m in fetched:
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            skipped = bool(m.get("skipped", False)) or int(m.get("skipped_updates", 0)) > 0
            self.losses.append(loss)
            self.window.append({"loss": loss, "grad_norm": gnorm, "lr": float(m.get("lr", float("nan"))),
                                "skipped": skipped, **{k: float(m[k]) for k in _COMM if k in m},
                                **{k: float(v) for k, v in m.items() if "/" in k and getattr(v, "ndim", 0) == 0}})
            if "noise_scale" in m:
                self.noise_scale.append((s, float(m["noise_scale"])))
            if not (math.isfinite(loss) and math.isfinite(gnorm)) or skipped:
                self._nonfinite(s, loss, gnorm, skipped)
        return len(fetched), sum(w["skipped"] for w in self.window[-len(fetched):])

    def _nonfinite(self, s: int, loss: float, gnorm: float, skipped: bool) -> None:
        what = f"step {s}: the loss is {loss} and the gradient norm {gnorm}"
        if math.isfinite(loss) and math.isfinite(gnorm):     # skipped: the update itself was not finite
            what += ", and its update would make a parameter or an optimizer moment non-finite"
        if self.on_nonfinite == "stop":
            last_ckpt = f" The last checkpoint is step {self.saved[-1]}." if self.saved else ""
            raise NonFiniteError(f"train: {what}; stopping (on_nonfinite='stop').{last_ckpt} Lower the "
                                 "learning rate, enable gradient clipping, or skip such steps "
                                 "(on_nonfinite='skip').")
        if not skipped:
            raise NonFiniteError(f"train: {what}, and the step function applied that update, so the state "
                                 "is no longer finite. Build the step with make_train_step(..., "
                                 "skip_nonfinite=True) to drop such updates.")
        self.skipped_steps.append(s)
        self.writer.write({"kind": "nonfinite", "step": s, "loss": _num(loss), "grad_norm": _num(gnorm),
                           "action": "skipped"})
        cause = (f"non-finite loss {loss} / grad norm {gnorm}" if not (math.isfinite(loss) and math.isfinite(gnorm))
                 else "non-finite update")
        self.bar.log(f"step {s:>6}/{self.end}  WARNING {cause}: update skipped (params and optimizer state "
                     "unchanged)")

    def record(self, done: int, now: float, extra: dict | None = None) -> None:
        """Write the ``train`` record and progress line of the steps fetched since the last one.

        Args:
          done: the step count at this point.
          now: ``time.perf_counter()`` when those steps finished.
          extra: more fields of the record (the run's goodput).
        """
        dt = (now - self.t_mark) / (done - self.mark_step)
        first = self.first_step_time is None
        if first:
            self.first_step_time = now - self.t_mark
        else:
            self.timed_s += now - self.t_mark
            self.timed_steps += done - self.mark_step
        rec, last = self._train_record(done, dt, first)
        self.writer.write({**rec, **(extra or {})})
        self.bar.log(*self._progress_line(rec, last))
        self.window.clear()
        self.t_mark, self.mark_step = time.perf_counter(), done

    def _train_record(self, done: int, dt: float, first: bool) -> tuple[dict, dict]:
        """The record (mean of the finite losses in the window) and the window's last (finite) metrics."""
        finite = [w for w in self.window if math.isfinite(w["loss"]) and math.isfinite(w["grad_norm"])]
        last = (finite or self.window)[-1]
        tps = self.log.tokens_per_batch / dt if self.log.tokens_per_batch else None
        rec = {"kind": "train", "step": done,
               "loss": sum(w["loss"] for w in finite) / len(finite) if finite else _num(last["loss"]),
               "grad_norm": _num(last["grad_norm"]), "lr": _num(last["lr"]), "step_time": dt,
               "tokens_per_s": tps, "skipped": sum(w["skipped"] for w in self.window), "includes_compile": first}
        utilisation = self.log.mfu_at(tps, self.devices)
        if utilisation is not None:
            rec["mfu"] = utilisation
        rec.update({k: _num(w[k]) for w in finite or self.window for k in w if k in _COMM or "/" in k})  # the latest
        for key in ("replica_bytes", "data_wait"):      # per step, the window's mean
            if key in rec:
                rec[key] = sum(w.get(key, 0.0) for w in self.window) / len(self.window)
        return rec, last

    def _progress_line(self, rec: dict, last: dict) -> tuple[str, dict]:
        tps = rec["tokens_per_s"]
        loss_text = f"{rec['loss']:.4f}" if isinstance(rec["loss"], float) else rec["loss"]
        extra = f" {tps:,.0f} tok/s" if tps else ""
        extra += f" MFU {rec['mfu']:.1%}" if "mfu" in rec else ""
        if "comm_bytes" in rec:     # compressed gradient exchange (Strategy.compression)
            extra += (f"  wire {format_bytes(rec['comm_bytes'])}/step ({_fmt(rec['comm_ratio'], '.3f')}x fp32)"
                      f" residual {_fmt(rec['residual_norm'], '.3g')}")
            extra += f" replica norm {_fmt(rec['replica_grad_norm'], '.3g')}" if "replica_grad_norm" in rec else ""
        if "loss_spread" in rec:    # relaxed sync (Strategy.sync): replicas' loss range, bytes over ``replica``
            extra += f"  spread {_fmt(rec['loss_spread'], '.3f')} replica {format_bytes(rec['replica_bytes'])}/step"
            extra += f" dist {_fmt(rec['replica_distance'], '.3g')}" if "replica_distance" in rec else ""
            extra += (f" modelled {_fmt(rec['modelled_time'], '.2f')} vs {_fmt(rec['modelled_time_sync'], '.2f')} sync"
                      if "modelled_time" in rec else "")
        if "noise_scale" in rec:    # the gradient noise scale (a state with with_noise_scale(..., every=k))
            extra += f"  B_noise {rec['noise_scale']:.4g}" if isinstance(rec["noise_scale"], float) else ""
        extra += " (incl. compile)" if rec["includes_compile"] else ""
        text = (f"step {rec['step']:>6}/{self.end}  loss {loss_text}  grad_norm {last['grad_norm']:.3f}  "
                f"lr {last['lr']:.2e}  {rec['step_time']:.3f} s/step{extra}")
        return text, {"loss": loss_text, **({"tok/s": f"{tps:,.0f}"} if tps else {})}

    def step_time(self) -> float:
        """Mean seconds per step after the first (the first step's time if there was only one)."""
        return self.timed_s / self.timed_steps if self.timed_steps else (self.first_step_time or 0.0)


_HOST_MEMORY = ("pinned_host", "unpinned_host")    # memory kinds of arrays kept in host memory, not the device's


def live_bytes(devices: Sequence[Any]) -> dict[Any, int]:
    """The bytes of this process's live jax arrays on each of ``devices`` (``jax.live_arrays()``; an array
    in host memory is not counted; a shard counts on every device that holds a copy).

    Args:
      devices: the devices to count.

    Returns:
      ``{device: bytes}``, every one of ``devices`` included.
    """
    total = dict.fromkeys(devices, 0)
    for a in jax.live_arrays():
        sharding = a.sharding
        if sharding.memory_kind in _HOST_MEMORY:
            continue
        size = math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize
        for d in sharding.addressable_devices:
            if d in total:
                total[d] += size
    return total


class MemoryMeter:
    """A run's peak memory per device, measured at log points, beside the compiled step's and the cost model's.

    Where the backend keeps allocator statistics (GPU, TPU: ``device.memory_stats()``), the measure is
    ``peak_bytes_in_use``: the allocator's peak since the process started, the step's temporaries
    included. XLA:CPU keeps none; there the measure is the largest total of live jax arrays' bytes on one
    device seen when a log point's step has been dispatched (:func:`live_bytes`: the state, the batch, the
    metrics). It misses the temporaries inside a step, which only the compiler's figure has. Either is the
    busiest device of the mesh's in this process.

    Args:
      devices: the mesh's devices.
    """

    def __init__(self, devices: Sequence[Any]):
        self.devices = [d for d in devices if d.process_index == jax.process_index()]
        stats = self.devices[0].memory_stats() if self.devices else None
        self.source = "memory_stats" if stats else "live_arrays"
        self.limit = int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
        self.peak, self.count, self.seconds = 0, 0, 0.0
        self.compiled: Any = None          # the step's MemoryReport (None: not compiled, or no memory analysis)
        self.batch: Any = None             # the shapes of a batch the step ran on (keep_batch)

    def measure(self) -> int:
        """Measure now; keep the peak.

        Returns:
          The bytes in use on the busiest device (``memory_stats``: its peak so far).
        """
        t0 = time.perf_counter()
        if self.source == "memory_stats":
            now = max(int(d.memory_stats().get("peak_bytes_in_use", 0)) for d in self.devices)
        else:
            now = max(live_bytes(self.devices).values(), default=0)
        self.peak = max(self.peak, now)
        self.count += 1
        self.seconds += time.perf_counter() - t0
        return now

    def keep_batch(self, batch: Any) -> None:
        """Keep the shapes and shardings of a batch the step ran on, for :meth:`read_compiled` (the batch itself
        is not kept alive).

        Args:
          batch: the batch.
        """
        self.batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)

    def read_compiled(self, step_fn: Callable, state: Any) -> None:
        """The compiled step's memory (its program ``"step"``, compiled by the run already: the lowering and
        the compile are JAX's cached ones), or nothing for a step function that cannot be lowered.

        Args:
          step_fn: the step function (a :class:`~jaxpar.step.TrainStep` or a jitted function).
          state: a state it is called with.
        """
        if not hasattr(step_fn, "lower") or self.batch is None:
            return
        t0 = time.perf_counter()
        try:
            self.compiled = memory_report(step_fn.lower(state, self.batch).compile())
        except AnalysisError:           # a backend without memory analysis
            self.compiled = None
        self.seconds += time.perf_counter() - t0

    def summary(self, predicted: float | None = None) -> dict[str, Any] | None:
        """The figures for ``summary.json`` (bytes per device; None before any measure).

        Args:
          predicted: the cost model's peak per device (None: not predicted).

        Returns:
          ``measured_peak_bytes``, ``measured_by`` (``"memory_stats"`` / ``"live_arrays"``),
          ``compiled_peak_bytes`` and ``compiled_argument_bytes`` (None without a compiled step),
          ``predicted_peak_bytes``, ``device_bytes_limit`` (None: unknown), ``measures`` and ``measure_s``
          (their count and cost).
        """
        if not self.count:
            return None
        c = self.compiled
        return {"measured_peak_bytes": self.peak, "measured_by": self.source,
                "compiled_peak_bytes": c.required_bytes if c else None,
                "compiled_argument_bytes": c.argument_bytes if c else None,
                "predicted_peak_bytes": predicted, "device_bytes_limit": self.limit,
                "measures": self.count, "measure_s": self.seconds}


def describe_memory(memory: dict[str, Any]) -> str:
    """The closing line's memory part: ``memory per device 48.1 MiB (live arrays) / compiled 60.2 MiB``.

    Args:
      memory: :meth:`MemoryMeter.summary`'s dict.

    Returns:
      The text.

    >>> describe_memory({"measured_peak_bytes": 3 * 2**20, "measured_by": "memory_stats",
    ...                  "compiled_peak_bytes": 4 * 2**20, "predicted_peak_bytes": 5 * 2**20})
    'memory per device 3.0 MiB (peak in use) / compiled 4.0 MiB / predicted 5.0 MiB'
    """
    how = "peak in use" if memory["measured_by"] == "memory_stats" else "live arrays"
    text = f"memory per device {format_bytes(memory['measured_peak_bytes'])} ({how})"
    for key, name in (("compiled_peak_bytes", "compiled"), ("predicted_peak_bytes", "predicted")):
        if memory.get(key):
            text += f" / {name} {format_bytes(memory[key])}"
    return text


#: JSONL record key -> TensorBoard tag.
TB_TAGS = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "skipped": "train/skipped_steps",
    "step_time": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "data_wait": "perf/data_wait_s", "memory_peak": "perf/memory_peak_bytes",
    "eval_loss": "eval/loss",
}


def mfu(tokens_per_s: float, flops_per_tok: float, *, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``devices x peak_flops``.

    Args:
      tokens_per_s: the measured throughput, all devices together.
      flops_per_tok: training FLOPs per token (:func:`jaxpar.cost._model.flops_per_token`).
      peak_flops: the peak FLOP/s of one device.
      devices: how many devices ran it.

    Returns:
      The MFU as a fraction (0.284 is 28.4 %).
    """
    if peak_flops <= 0 or devices < 1:
        raise LoopError(f"mfu(peak_flops={peak_flops!r}, devices={devices!r}): both must be positive.")
    return tokens_per_s * flops_per_tok / (peak_flops * devices)


def is_main_process() -> bool:
    """Whether this is the one process that logs and writes files.

    Returns:
      ``jax.process_index() == 0``.
    """
    return jax.process_index() == 0


class MetricsWriter:
    """``metrics.jsonl`` (one JSON object per line) and optionally TensorBoard scalars under ``<out_dir>/tb``.

    Args:
      out_dir: the folder of ``metrics.jsonl`` and ``tb/`` (None: write nothing).
      tensorboard: also write TensorBoard scalars (tags from :data:`TB_TAGS`).
      resume_step: continue an earlier run's files: JSONL records after that step (written by a run that
        died before its next checkpoint) are dropped (read into ``dropped``) and TensorBoard events after it
        are purged.
      enabled: False writes nothing (processes other than 0).
    """

    def __init__(self, out_dir: str | Path | None, *, tensorboard: bool = False, resume_step: int | None = None,
                 enabled: bool = True):
        self.path = self.tb_dir = None
        self._file = self._tb = None
        self.history: list[dict] = []    # earlier records kept on resume
        self.dropped: list[dict] = []    # earlier records after resume_step (a run that died later), dropped
        if out_dir is None or not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue       # a line cut by a crash
                (self.history if rec.get("step", 0) <= resume_step else self.dropped).append(rec)
        self._file = open(self.path, "w")
        for rec in self.history:
            self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb_dir = out / "tb"
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the JSONL file and its numbers to TensorBoard.

        Args:
          record: a JSON-able dict with a ``step``; keys with a ``/`` also become TensorBoard tags.
        """
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            tags = {**TB_TAGS, **{k: k for k in record if "/" in k}}    # a loss's own metrics: their names
            for key, tag in tags.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
