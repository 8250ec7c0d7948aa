"""What a :func:`jaxpar.run.train` call reports and is told: :class:`LogOptions` (how a run reports;
``train()`` also takes its fields as keywords), :class:`TrainSummary` (what a call did: losses, timings,
skipped and checkpointed steps, one :meth:`~TrainSummary.line`) and :func:`plot_losses` (the ``loss.png``
curve)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence


from jaxpar._text import agg_axes, save_plot
from jaxpar.errors import LoopError, check_int, finite_number
from jaxpar.run._goodput import describe
from jaxpar.run._memory_meter import describe_memory
from jaxpar.run._metrics import mfu


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
    compiled peaks (:class:`~jaxpar.run._memory_meter.MemoryMeter`). ``profile``: the steps ``(A, B)``, ``A .. B-1``, traced by
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
            if value is not None and (not finite_number(value) or value <= 0):
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
