"""The training loop: steps, logging, eval, checkpoints, preemption and non-finite steps.

Plain values in: a step function, a train state, ``batch_fn(step) -> host batch``
(so the data order depends on the step number alone and a run can resume from
it) and the mesh the batches are placed on. The loop blocks on the device only
at log and checkpoint points: step dispatch is asynchronous, so the next host
batch is built while the device computes.

* **Metrics**: ``metrics.jsonl`` and TensorBoard (:mod:`jaxpar.train.metrics`),
  a progress bar, a loss-curve PNG at the end; files are written by process 0 only.
* **Checkpoints** (:class:`~jaxpar.train.checkpoint.Checkpointer`): every
  ``checkpointer.every`` steps, at the end, and on SIGTERM / SIGINT.
* **Preemption**: SIGTERM or SIGINT lets the current step finish, saves a
  checkpoint of it and returns normally (``summary.preempted`` names the signal);
  a second Ctrl-C interrupts at once. With several processes a signal may reach
  only one of them (one evicted pod / node): after the first step and every
  ``stop_check_every`` steps (default: at the log points) the processes agree
  through JAX's coordination service (a barrier and a key-value read, host only)
  on whether any of them was signalled, so all stop after the same step, all take
  part in the checkpoint and all return.
* **Non-finite steps**: a NaN / inf loss or gradient norm is reported; with
  ``on_nonfinite="skip"`` (and a step built with ``skip_nonfinite=True``) the run
  goes on with that update dropped, with ``"stop"`` it raises :class:`NonFiniteError`.
  Checks happen before every checkpoint, so a non-finite state is never saved.

Example::

    >>> step = make_train_step(lm_loss, tx, layout, strategy, lr_schedule=sched)      # doctest: +SKIP
    >>> evaluate = make_eval_fn(lm_loss, layout, strategy, eval_batches)             # doctest: +SKIP
    >>> state, summary = train(step, state, lambda i: text_batch(corpus, i, batch_size=32, seq_len=64),
    ...                        mesh=layout.mesh, steps=300, eval_fn=evaluate, eval_every=100,
    ...                        out_dir="runs/demo")                                    # doctest: +SKIP
    >>> summary.first_loss, summary.last_loss                                         # doctest: +SKIP
    (5.55, 2.31)
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..rules import named_shardings, use_rules
from ..strategy import Strategy
from .metrics import MetricsWriter, is_main_process, mfu
from .state import StateLayout
from .data import make_global_batch
from .step import batch_sharding, make_model_loss, shard_batch

__all__ = ["TrainSummary", "NonFiniteError", "train", "make_eval_fn", "plot_losses", "NONFINITE_MODES"]

NONFINITE_MODES = ("skip", "stop")


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was NaN / inf and the run was told to stop (or could not skip it)."""


@dataclass
class TrainSummary:
    """What a :func:`train` call did. Losses are host floats; paths are ``None`` without ``out_dir``."""

    start_step: int
    end_step: int
    first_loss: float          # loss of the first step run
    last_loss: float           # loss of the last step run
    eval_loss: float | None    # last eval loss, if any
    wall_time: float           # seconds, whole loop including compilation
    first_step_time: float     # seconds, the first step (includes compilation)
    step_time: float           # mean seconds per step after the first
    tokens_per_s: float | None
    metrics_path: str | None = None
    plot_path: str | None = None
    preempted: str | None = None       # the signal that stopped the run early ("SIGTERM" / "SIGINT")
    skipped_steps: list[int] = field(default_factory=list)     # steps whose update was dropped (non-finite)
    checkpoint_steps: list[int] = field(default_factory=list)  # steps checkpointed by this call
    mfu: float | None = None
    losses: list[float] = field(default_factory=list, repr=False)
    evals: list[tuple[int, float]] = field(default_factory=list, repr=False)

    def line(self) -> str:
        """One human line: ``loss 5.54 -> 2.31 over 300 steps (eval 2.40); 0.062 s/step ...``."""
        ev = f" (eval {self.eval_loss:.4f})" if self.eval_loss is not None else ""
        tps = f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""
        tps += f", MFU {self.mfu:.1%}" if self.mfu is not None else ""
        skip = f"; {len(self.skipped_steps)} non-finite steps skipped" if self.skipped_steps else ""
        stop = f"; stopped by {self.preempted} at step {self.end_step}" if self.preempted else ""
        return (f"loss {self.first_loss:.4f} -> {self.last_loss:.4f} over {self.end_step - self.start_step} steps"
                f"{ev}; {self.step_time:.4f} s/step{tps}; first step (compile) {self.first_step_time:.1f} s; "
                f"total {self.wall_time:.1f} s{skip}{stop}")


def make_eval_fn(loss_fn: Callable, layout: StateLayout, strategy: Strategy = Strategy(),
                 batches: Sequence[Any] = ()) -> Callable[[Any], float]:
    """``evaluate(state) -> mean loss`` over fixed host ``batches`` (forward only, jitted once).

    The model runs as in training: same layout, logical rules and compute dtype.
    """
    mesh = layout.mesh
    if not batches:
        raise ValueError("make_eval_fn: batches is empty; give at least one eval batch.")
    placed = [shard_batch(b, mesh) for b in batches]   # checked and placed once, reused at every eval
    model_loss = make_model_loss(loss_fn, layout, strategy)

    def loss_of(params, batch):
        with use_rules(mesh, layout.rules):
            return model_loss(params, batch)

    jitted = jax.jit(loss_of, in_shardings=(named_shardings(layout.params, mesh), batch_sharding(mesh)),
                     out_shardings=NamedSharding(mesh, PartitionSpec()))

    def evaluate(state) -> float:
        losses = [jitted(state.params, b) for b in placed]
        return float(jnp.mean(jnp.stack(losses)))

    return evaluate


def plot_losses(path: str | Path, steps: Sequence[int], losses: Sequence[float],
                evals: Sequence[tuple[int, float]] = (), *, title: str = "training loss") -> str:
    """Write a loss-curve PNG (train per step, eval as markers) with the Agg canvas; return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(list(steps), list(losses), lw=1.2, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", ms=4, label="eval (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
    return str(path)


class _Progress:
    """tqdm bar on a terminal, plain lines otherwise (or nothing)."""

    def __init__(self, mode: str, total: int, initial: int, print_fn: Callable[[str], None]):
        if mode not in ("auto", "bar", "lines", "none"):
            raise ValueError(f"train(progress={mode!r}): choose one of 'auto', 'bar', 'lines', 'none'.")
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.print_fn, self.bar = mode, print_fn, None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, text: str, postfix: dict | None = None) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.write(text)
        elif self.mode == "lines":
            self.print_fn(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _StopSignals:
    """Record the first SIGTERM / SIGINT instead of dying (main thread only); a second SIGINT interrupts."""

    early: str | None = None      # recorded by catch_stop_signals() before the loop started
    _early_handler = None

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "_StopSignals":
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
            self.received, _StopSignals.early = _StopSignals.early, None
        return self

    def __exit__(self, *exc) -> None:
        defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        for sig, old in self._old.items():     # the early catcher lasts until the loop starts, not after it
            signal.signal(sig, defaults[sig] if old is _StopSignals._early_handler else old)


def catch_stop_signals() -> None:
    """Record a SIGTERM / SIGINT from now on (start-up, restore, compilation): the next :func:`train`
    stops after its first step, with a checkpoint. For jobs of several processes, where JAX's own
    preemption notifier (installed by ``jax.distributed.initialize``) would swallow such a SIGTERM.
    Main thread only; a second SIGINT interrupts."""

    def handle(signum, frame) -> None:
        if _StopSignals.early is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _StopSignals.early = signal.Signals(signum).name

    if threading.current_thread() is threading.main_thread():
        _StopSignals._early_handler = handle
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handle)


class _StopAgreement:
    """With several processes: agree after a step whether any process got SIGTERM / SIGINT.

    Each signalled process puts ``jaxpar/stop/<call>/<step>/<process>`` into the
    coordination service's key-value store, then every process waits at one
    barrier and lists ``jaxpar/stop/<call>/<step>/``. Keys are only written before
    the barrier, so every process reads the same set: all stop after the same step.
    Host only (no device sync). One process: the local signal, nothing else.
    """

    _calls = 0                                # train() calls in this process (the same in every process)
    BARRIER_TIMEOUT_S = 3600

    def __init__(self, every: int):
        self.every = every
        self.client = None
        if jax.process_count() > 1:
            from jax._src import distributed

            self.client = distributed.global_state.client
        _StopAgreement._calls += 1
        self.prefix = f"jaxpar/stop/{_StopAgreement._calls}"
        self.processes: list[int] = []        # who was signalled (several processes only)

    def check(self, step: int, local: str | None, due: bool = False) -> str | None:
        """The signal that stops every process after ``step`` (None: go on). Every process must call it
        with the same ``step`` and ``due`` (agree now even off the ``every`` grid)."""
        if self.client is None:
            return local
        if step % self.every and not due:
            return None
        if local is not None:
            self.client.key_value_set(f"{self.prefix}/{step}/{jax.process_index()}", local, allow_overwrite=True)
        try:
            self.client.wait_at_barrier("jaxpar_stop", self.BARRIER_TIMEOUT_S * 1000)
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError from the coordination service
            raise RuntimeError(f"train: step {step}: the processes could not agree on stopping (a peer died or "
                               f"did not reach step {step} within {self.BARRIER_TIMEOUT_S} s): {e}") from e
        entries = self.client.key_value_dir_get(f"{self.prefix}/{step}/")
        found = sorted((int(k.rstrip("/").rsplit("/", 1)[-1]), v) for k, v in entries)
        if not found:
            return None
        self.processes = [pid for pid, _ in found]
        return found[0][1]


def _num(x: float) -> float | str:
    """JSON-safe float: NaN / inf become the strings ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    return x if math.isfinite(x) else str(x)


def train(step_fn: Callable, state: Any, batch_fn: Callable[[int], Any], *, mesh, steps: int,
          log_every: int = 10, eval_fn: Callable[[Any], float] | None = None, eval_every: int = 0,
          tokens_per_batch: int | None = None, out_dir: str | Path | None = None,
          start_step: int | None = None,
          progress: str = "auto", plot: bool = True, title: str = "training loss",
          print_fn: Callable[[str], None] = print, checkpointer: Any = None,
          checkpoint_meta: dict | None = None, on_nonfinite: str = "stop", tensorboard: bool = False,
          flops_per_token: float | None = None, peak_flops: float | None = None,
          handle_signals: bool = True, max_inflight: int = 2,
          stop_check_every: int | None = None) -> tuple[Any, TrainSummary]:
    """Run ``steps`` train steps from ``start_step`` (default: ``int(state.step)``).

    ``batch_fn(step)`` returns the host batch for global step ``step``; the loop
    places it with :func:`jaxpar.shard_batch`. ``step_fn(state, batch) ->
    (state, metrics)`` with metrics ``loss``, ``grad_norm`` and optionally ``lr``
    and ``skipped`` (see ``make_train_step(skip_nonfinite=True)``).
    Logs at the first step, every ``log_every`` steps and the last; evaluates
    every ``eval_every`` steps (0: only at the end) when ``eval_fn`` is given.

    ``out_dir`` receives ``metrics.jsonl`` (one JSON object per log / eval
    point, ``"kind": "train" | "eval" | "nonfinite" | "preempted"``; a train record's
    ``loss`` is the mean of the finite losses since the previous one), ``tb/``
    (TensorBoard, with ``tensorboard=True``) and ``loss.png`` (titled ``title``).
    When ``start_step > 0``, records of ``out_dir`` up to that step are kept.

    ``checkpointer`` (a :class:`~jaxpar.train.checkpoint.Checkpointer`) saves at its
    interval, at the end and on SIGTERM / SIGINT, with the JSON record
    ``checkpoint_meta`` plus ``{"data": {"next_step": step}}``. ``on_nonfinite``:
    ``"stop"`` raises :class:`NonFiniteError` at the first NaN / inf loss or grad
    norm; ``"skip"`` reports it and goes on (the step function must have skipped it).
    ``flops_per_token`` and ``peak_flops`` (of one device) add MFU to the records.
    ``max_inflight``: the host runs at most that many steps ahead of the device
    (it waits for step ``i - max_inflight`` before dispatching step ``i``). Without
    a bound XLA:CPU can deadlock on collectives with dozens of multi-device steps queued.
    ``stop_check_every``: with several processes, how often (in steps; default
    ``log_every``) they agree on stopping after a SIGTERM / SIGINT that reached any of
    them (a barrier through the coordination service, ~0.7 ms of host time, no device
    sync); a signalled run stops at the next multiple of it. Every process must pass the
    same value. One process stops after the step during which the signal arrived.
    """
    stop_check_every = log_every if stop_check_every is None else stop_check_every
    for name, value, low in (("steps", steps, 1), ("log_every", log_every, 1), ("eval_every", eval_every, 0),
                             ("max_inflight", max_inflight, 1), ("stop_check_every", stop_check_every, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"train({name}={value!r}): must be an int >= {low}.")
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"train(on_nonfinite={on_nonfinite!r}): choose one of {', '.join(NONFINITE_MODES)}.")
    start = int(state.step) if start_step is None else int(start_step)
    end = start + steps
    main = is_main_process()
    out = Path(out_dir) if out_dir is not None else None
    writer = MetricsWriter(out, tensorboard=tensorboard, resume_step=start if start > 0 else None, enabled=main)
    bar = _Progress(progress if main else "none", end, start, print_fn)
    devices = mesh.size

    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    skipped_steps: list[int] = []
    saved: list[int] = []
    window: list[dict] = []            # host metrics of the steps since the last record
    pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet fetched
    t_begin = t_mark = time.perf_counter()
    mark_step, first_step_time = start, None
    timed_s, timed_steps = 0.0, 0      # time and steps after the first (eval excluded)
    last_tps = None

    def fetch() -> None:
        """Bring pending metrics to the host; report (or stop at) non-finite steps."""
        nonlocal pending
        if not pending:
            return
        host = jax.device_get([m for _, m in pending])
        for (s, _), m in zip(pending, host):
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            skipped = bool(m.get("skipped", False))
            losses.append(loss)
            window.append({"loss": loss, "grad_norm": gnorm, "lr": float(m.get("lr", float("nan"))),
                           "skipped": skipped})
            if math.isfinite(loss) and math.isfinite(gnorm):
                continue
            what = f"step {s}: the loss is {loss} and the gradient norm {gnorm}"
            last_ckpt = f" The last checkpoint is step {saved[-1]}." if saved else ""
            if on_nonfinite == "stop":
                pending = []
                raise NonFiniteError(f"train: {what}; stopping (on_nonfinite='stop').{last_ckpt} Lower the "
                                     "learning rate, enable gradient clipping, or skip such steps "
                                     "(on_nonfinite='skip').")
            if not skipped:
                pending = []
                raise NonFiniteError(f"train: {what}, and the step function applied that update, so the state "
                                     "is no longer finite. Build the step with make_train_step(..., "
                                     "skip_nonfinite=True) to drop such updates.")
            skipped_steps.append(s)
            writer.write({"kind": "nonfinite", "step": s, "loss": _num(loss), "grad_norm": _num(gnorm),
                          "action": "skipped"})
            bar.log(f"step {s:>6}/{end}  WARNING non-finite loss {loss} / grad norm {gnorm}: update skipped "
                    "(params and optimizer state unchanged)")
        pending = []

    def record(done: int, now: float) -> None:
        nonlocal t_mark, mark_step, first_step_time, timed_s, timed_steps, last_tps
        dt = (now - t_mark) / (done - mark_step)
        first = first_step_time is None
        if first:
            first_step_time = now - t_mark
        else:
            timed_s, timed_steps = timed_s + (now - t_mark), timed_steps + (done - mark_step)
        finite = [w for w in window if math.isfinite(w["loss"]) and math.isfinite(w["grad_norm"])]
        last = (finite or window)[-1]
        tps = tokens_per_batch / dt if tokens_per_batch else None
        rec = {"kind": "train", "step": done,
               "loss": sum(w["loss"] for w in finite) / len(finite) if finite else _num(last["loss"]),
               "grad_norm": _num(last["grad_norm"]), "lr": _num(last["lr"]), "step_time": dt,
               "tokens_per_s": tps, "skipped": sum(w["skipped"] for w in window), "includes_compile": first}
        if tps and flops_per_token and peak_flops:
            rec["mfu"] = mfu(tps, flops_per_token, peak_flops=peak_flops, devices=devices)
        if not first:
            last_tps = tps
        writer.write(rec)
        loss_text = f"{rec['loss']:.4f}" if isinstance(rec["loss"], float) else rec["loss"]
        extra = f" {tps:,.0f} tok/s" if tps else ""
        extra += f" MFU {rec['mfu']:.1%}" if "mfu" in rec else ""
        extra += " (incl. compile)" if first else ""
        bar.log(f"step {done:>6}/{end}  loss {loss_text}  grad_norm {last['grad_norm']:.3f}  "
                f"lr {last['lr']:.2e}  {dt:.3f} s/step{extra}",
                {"loss": loss_text, **({"tok/s": f"{tps:,.0f}"} if tps else {})})
        window.clear()
        t_mark, mark_step = time.perf_counter(), done

    done, preempted = start, None
    try:
        agreement = _StopAgreement(stop_check_every)
        with _StopSignals(handle_signals) as signals:
            for step in range(start, end):
                batch = make_global_batch(batch_fn, step, mesh)   # own rows per process, built ahead
                if len(pending) >= max_inflight:
                    jax.block_until_ready(pending[-max_inflight][1])
                state, metrics = step_fn(state, batch)
                done = step + 1
                pending.append((done, metrics))
                bar.advance()
                # several processes: the same answer in all; checked after the first step too
                stop_signal = agreement.check(done, signals.received, due=done == start + 1)
                stop = stop_signal is not None
                is_log = done == start + 1 or done % log_every == 0 or done == end or stop
                save = checkpointer is not None and (checkpointer.should_save(done) or done == end or stop)
                if is_log or save:
                    jax.block_until_ready(metrics)
                    now = time.perf_counter()
                    fetch()
                    if is_log:
                        record(done, now)
                if save:
                    meta = dict(checkpoint_meta or {})
                    meta["data"] = {**meta.get("data", {}), "next_step": done}
                    if checkpointer.save(done, state, meta):
                        saved.append(done)
                        bar.log(f"step {done:>6}/{end}  checkpoint -> {checkpointer.directory / str(done)}")
                if stop:
                    preempted = stop_signal
                    if checkpointer is not None:
                        checkpointer.wait()
                    rec = {"kind": "preempted", "step": done, "signal": preempted,
                           "checkpoint": done in saved or (checkpointer is not None and done in checkpointer.steps())}
                    who = ""
                    if agreement.processes:
                        rec["processes"] = agreement.processes
                        who = f" (to process {', '.join(map(str, agreement.processes))})"
                    writer.write(rec)
                    bar.log(f"step {done:>6}/{end}  {preempted}{who}: stopped after step {done}"
                            + (", checkpoint saved" if checkpointer is not None else ""))
                    break
                if eval_fn is not None and ((eval_every and done % eval_every == 0) or done == end):
                    jax.block_until_ready(state)
                    t0 = time.perf_counter()
                    value = float(eval_fn(state))
                    evals.append((done, value))
                    writer.write({"kind": "eval", "step": done, "eval_loss": value,
                                  "eval_time": time.perf_counter() - t0})
                    bar.log(f"step {done:>6}/{end}  eval_loss {value:.4f}")
                    t_mark += time.perf_counter() - t0   # eval time does not count as step time
    finally:
        if checkpointer is not None:
            checkpointer.wait()      # pending saves reach the disk, also when the run stops with an error
        bar.close()
        writer.close()

    wall = time.perf_counter() - t_begin
    step_time = timed_s / timed_steps if timed_steps else (first_step_time or 0.0)
    finite = [x for x in losses if math.isfinite(x)] or losses or [float("nan")]
    tps = tokens_per_batch / step_time if tokens_per_batch and step_time else None
    summary = TrainSummary(
        start_step=start, end_step=done, first_loss=finite[0], last_loss=finite[-1],
        eval_loss=evals[-1][1] if evals else None, wall_time=wall, first_step_time=first_step_time or 0.0,
        step_time=step_time, tokens_per_s=tps,
        metrics_path=str(writer.path) if writer.path is not None else None, preempted=preempted,
        skipped_steps=skipped_steps, checkpoint_steps=saved,
        mfu=mfu(tps, flops_per_token, peak_flops=peak_flops, devices=devices)
        if tps and flops_per_token and peak_flops else None,
        losses=losses, evals=evals)
    if out is not None and plot and main and losses:
        history = [(r["step"], r["loss"]) for r in writer.history
                   if r.get("kind") == "train" and isinstance(r.get("loss"), float)]
        steps_axis = [s for s, _ in history] + list(range(start + 1, start + 1 + len(losses)))
        curve = [v for _, v in history] + losses
        earlier = [(s, v) for r in writer.history if r.get("kind") == "eval"
                   for s, v in [(r["step"], r["eval_loss"])]]
        summary.plot_path = plot_losses(out / "loss.png", steps_axis, curve, earlier + evals, title=title)
    return state, summary
