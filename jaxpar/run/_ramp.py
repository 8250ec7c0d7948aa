"""Batch-size ramps: grow the global batch during training instead of decaying the learning
rate (Smith et al. 2017, "Don't decay the learning rate, increase the batch size").

A ramp is a piecewise-constant schedule of global batch sizes. The train step is compiled once
per distinct size (a bounded set), the data function is asked for the step's size, and since
the size is a function of the step alone, a run resumed mid-ramp draws the same batches.

    >>> ramp = BatchRamp(sizes=(32, 64, 128), steps=(0, 100, 200))
    >>> [ramp.size_at(s) for s in (0, 99, 100, 250)]
    [32, 32, 64, 128]
    >>> ramp.tokens_before(150, seq_len=64)          # 100 steps of 32 rows + 50 of 64, 64 tokens each
    409600
    >>> BatchRamp(sizes=(32, 40), steps=(0, 10)).check_divisible(16, "data x fsdp = 16")
    Traceback (most recent call last):
    ...
    jaxpar.errors.RampError: batch ramp: size 40 (from step 10) is not divisible by data x fsdp = 16; every size of the ramp must be a multiple of 16.

An :class:`AdaptiveRamp` grows the batch toward the measured gradient noise scale
(McCandlish et al. 2018: the critical batch is about ``B_simple``): every ``every`` steps
the loop reads ``B_simple`` from the train state and moves to the largest allowed size
``<= factor * B_simple`` if that is larger than the current one (it never shrinks). Its
decisions are a function of the (checkpointed) state, and they are saved in the
checkpoint's record, so a resumed run continues with the same batches.

    >>> ramp = AdaptiveRamp(sizes=(32, 64, 128, 256), every=10)
    >>> ramp.decide(10, noise_scale=50.0), ramp.decide(20, noise_scale=170.0), ramp.decide(30, noise_scale=90.0)
    (None, 128, None)
    >>> [ramp.size_at(s) for s in (19, 20, 35)], ramp.state_dict()
    ([32, 128, 128], {'decisions': [[0, 32], [20, 128]]})
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable

from jaxpar.data._rows import takes_rows
from jaxpar.errors import RampError, check_int, int_problem, is_number


@dataclass(frozen=True)
class BatchRamp:
    """Global batch ``sizes[i]`` from step ``steps[i]`` on.

    Args:
      sizes: the global batch sizes, positive ints.
      steps: the step each size starts at: ``steps[0] == 0``, strictly increasing, one per size.
    """

    sizes: tuple[int, ...]
    steps: tuple[int, ...]

    def __post_init__(self):
        sizes, steps = tuple(self.sizes), tuple(self.steps)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "steps", steps)
        if not sizes or len(sizes) != len(steps):
            raise RampError(f"batch ramp: sizes {list(sizes)} and steps {list(steps)} must be non-empty and of the "
                            "same length (one start step per size), e.g. sizes=[32, 64, 128], steps=[0, 100, 200].")
        if any(isinstance(x, bool) or not isinstance(x, int) for x in sizes + steps):
            raise RampError(f"batch ramp: sizes {list(sizes)} and steps {list(steps)} must be ints.")
        if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise RampError(f"batch ramp: steps {list(steps)} must start at 0 and increase strictly "
                            "(the step from which each size is used).")
        if any(s < 1 for s in sizes):
            raise RampError(f"batch ramp: sizes {list(sizes)} must be positive.")

    def size_at(self, step: int) -> int:
        """The global batch size of ``step``.

        Args:
          step: a global step.

        Returns:
          The size of the last segment starting at or before ``step``.
        """
        return self.sizes[bisect.bisect_right(self.steps, step) - 1]

    def tokens_before(self, step: int, seq_len: int) -> int:
        """Tokens of the steps ``0 .. step - 1``.

        Args:
          step: the first step not counted.
          seq_len: tokens per row.

        Returns:
          The sum over those steps of their batch size times ``seq_len``.
        """
        ends = self.steps[1:] + (step,)
        rows = sum(max(0, min(step, end) - start) * size for start, end, size in zip(self.steps, ends, self.sizes))
        return rows * seq_len

    def check_divisible(self, n: int, what: str) -> None:
        """Raise :class:`RampError` if a size is not a multiple of ``n``.

        Args:
          n: the divisor (e.g. the batch axes' device count).
          what: names ``n`` in the message (``"data x fsdp = 16"``).
        """
        for start, size in zip(self.steps, self.sizes):
            if size % n:
                raise RampError(f"batch ramp: size {size} (from step {start}) is not divisible by {what}; every "
                                f"size of the ramp must be a multiple of {n}.")


class AdaptiveRamp:
    """Grow the global batch toward the measured gradient noise scale, among the allowed ``sizes``.

    Every ``every`` steps from step ``start`` on, :meth:`decide` gets ``B_simple`` (the noise
    scale's moving average, :mod:`jaxpar.step._noise_scale`, in batch rows) and moves to the
    largest size ``<= factor * B_simple`` when it is larger than the current size. The step is
    compiled once per size reached (at most ``len(sizes)``). :meth:`state_dict` /
    :meth:`load_state_dict`: the decisions, kept in the checkpoint's record by
    :func:`jaxpar.run.train`.

    Args:
      sizes: the allowed global batch sizes, strictly increasing; the run starts at ``sizes[0]``.
      every: decide every this many steps.
      factor: the target batch is ``factor x B_simple``.
      start: the first step a decision is made.
    """

    def __init__(self, sizes: tuple[int, ...], every: int, *, factor: float = 1.0, start: int = 0):
        sizes = tuple(sizes)
        if not sizes or any(int_problem(x, 1) for x in sizes):
            raise RampError(f"batch ramp: sizes {list(sizes)} must be a non-empty list of positive ints.")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise RampError(f"batch ramp: sizes {list(sizes)} must increase strictly (the batch only grows).")
        check_int("AdaptiveRamp", "every", every, 1, RampError)
        check_int("AdaptiveRamp", "start", start, 0, RampError)
        if not is_number(factor) or not factor > 0:
            raise RampError(f"batch ramp: factor={factor!r} must be a number > 0 (the target batch is factor x the "
                            "noise scale).")
        self.sizes, self.every, self.factor, self.start = sizes, every, float(factor), start
        self._ramp = BatchRamp((sizes[0],), (0,))

    def size_at(self, step: int) -> int:
        """The global batch size of ``step`` (by the decisions made so far).

        Args:
          step: a global step.

        Returns:
          The batch size.
        """
        return self._ramp.size_at(step)

    def tokens_before(self, step: int, seq_len: int) -> int:
        """Tokens of the steps ``0 .. step - 1`` (by the decisions made so far).

        Args:
          step: the first step not counted.
          seq_len: tokens per row.

        Returns:
          The token count.
        """
        return self._ramp.tokens_before(step, seq_len)

    def check_divisible(self, n: int, what: str) -> None:
        """Raise :class:`RampError` if an allowed size is not a multiple of ``n``.

        Args:
          n: the divisor (e.g. the batch axes' device count).
          what: names ``n`` in the message.
        """
        for size in self.sizes:
            if size % n:
                raise RampError(f"batch ramp: allowed size {size} is not divisible by {what}; every size of the "
                                f"ramp must be a multiple of {n}.")

    def due(self, done: int) -> bool:
        """Whether a decision is made after ``done`` steps.

        Args:
          done: the steps finished.

        Returns:
          True at multiples of ``every`` from ``max(start, 1)`` on.
        """
        return done >= max(self.start, 1) and done % self.every == 0

    def decide(self, done: int, noise_scale: float) -> int | None:
        """Decide the batch size from step ``done`` on; earlier decisions from ``done`` on are dropped.

        Args:
          done: the steps finished.
          noise_scale: the measured ``B_simple``, in batch rows.

        Returns:
          The new size, or None (no growth, or no finite positive measurement yet).
        """
        steps, sizes = self._ramp.steps, self._ramp.sizes
        keep = bisect.bisect_left(steps, done)    # decisions from `done` on are superseded (a rerun of those steps)
        steps, sizes = steps[:keep], sizes[:keep]
        fits = [s for s in self.sizes if s <= self.factor * noise_scale] if (
            isinstance(noise_scale, (int, float)) and math.isfinite(noise_scale) and noise_scale > 0) else []
        if fits and fits[-1] > sizes[-1]:
            self._ramp = BatchRamp(sizes + (fits[-1],), steps + (done,))
            return fits[-1]
        self._ramp = BatchRamp(sizes, steps)
        return None

    def state_dict(self) -> dict:
        """The decisions, for the checkpoint's record.

        Returns:
          ``{"decisions": [[step, size], ...]}`` (JSON).
        """
        return {"decisions": [[t, b] for t, b in zip(self._ramp.steps, self._ramp.sizes)]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the decisions of :meth:`state_dict`.

        Args:
          state: a :meth:`state_dict` (None: no decisions yet); sizes outside ``sizes`` raise :class:`RampError`.
        """
        pairs = (state or {}).get("decisions") or [[0, self.sizes[0]]]
        steps, sizes = tuple(int(t) for t, _ in pairs), tuple(int(b) for _, b in pairs)
        bad = sorted(set(sizes) - set(self.sizes))
        if bad:
            raise RampError(f"batch ramp: the checkpoint's decisions use size(s) {bad}, which are not among the "
                            f"allowed sizes {list(self.sizes)}; resume with the ramp the run was started with.")
        self._ramp = BatchRamp(sizes, steps)

    def __repr__(self) -> str:
        return (f"AdaptiveRamp(sizes={self.sizes}, every={self.every}, factor={self.factor}, start={self.start}, "
                f"decisions={self.state_dict()['decisions']})")


def ramp_batch_fn(make: Callable[..., Any], ramp: BatchRamp | AdaptiveRamp) -> Callable:
    """A ``batch_fn`` that asks ``make`` for the ramp's batch size of each step.

    Args:
      make: ``make(step, batch_size=..., [rows=...])``: the host batch of a step.
      ramp: a :class:`BatchRamp` or :class:`AdaptiveRamp`.

    Returns:
      ``batch_fn(step, rows=None)`` calling ``make(step, batch_size=ramp.size_at(step), rows=rows)``
      (``rows`` only if ``make`` takes it: see :func:`jaxpar.data.make_global_batch`), else ``batch_fn(step)``.
    """
    if takes_rows(make):
        return lambda step, rows=None: make(step, batch_size=ramp.size_at(step), rows=rows)
    return lambda step: make(step, batch_size=ramp.size_at(step))
