"""The loop's progress: :class:`Progress` (tqdm bar or lines) and :class:`Meter` (fetches step metrics at
log points, checks them for NaN / inf, writes ``train`` and ``nonfinite`` records, times steps)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable

import jax

from jaxpar._text import format_bytes
from jaxpar.errors import NonFiniteError
from jaxpar.run._metrics import MetricsWriter
from jaxpar.run._summary import LogOptions
from jaxpar.step._noise_scale import METRICS as NOISE_METRICS


#: Metrics of a compressed gradient exchange, logged when the step reports them.
_COMM = ("comm_bytes", "comm_ratio", "residual_norm", "replica_grad_norm",             # compression
         "loss_spread", "replica_distance", "replica_bytes", "delay_mean", "modelled_time", "modelled_time_sync",
         *NOISE_METRICS, "batch_size", "data_wait")     # the step's global batch; seconds waiting for it


def _num(x: float) -> float | str:
    """JSON-safe float: NaN / inf become the strings ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    return x if math.isfinite(x) else str(x)


def _fmt(x: float | str, spec: str) -> str:
    """``x`` formatted with ``spec``, or as is when :func:`_num` made it a string (NaN / inf)."""
    return x if isinstance(x, str) else format(x, spec)


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
