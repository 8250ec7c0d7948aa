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
    jaxpar.train.ramp.RampError: batch ramp: size 40 (from step 10) is not divisible by data x fsdp = 16; every size of the ramp must be a multiple of 16.
"""
from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["BatchRamp", "RampError", "ramp_batch_fn"]


class RampError(ValueError):
    """A batch ramp that cannot be run."""


@dataclass(frozen=True)
class BatchRamp:
    """Global batch ``sizes[i]`` from step ``steps[i]`` on (``steps[0] == 0``, increasing)."""

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
        """The global batch size of ``step``."""
        return self.sizes[bisect.bisect_right(self.steps, step) - 1]

    def tokens_before(self, step: int, seq_len: int) -> int:
        """Tokens of the steps ``0 .. step - 1``."""
        total = 0
        for i, (start, size) in enumerate(zip(self.steps, self.sizes)):
            end = min(step, self.steps[i + 1] if i + 1 < len(self.steps) else step)
            total += max(0, end - start) * size * seq_len
        return total

    def check_divisible(self, n: int, what: str) -> None:
        """Raise :class:`RampError` if a size is not a multiple of ``n`` (``what`` names ``n``)."""
        for start, size in zip(self.steps, self.sizes):
            if size % n:
                raise RampError(f"batch ramp: size {size} (from step {start}) is not divisible by {what}; every "
                                f"size of the ramp must be a multiple of {n}.")


def ramp_batch_fn(make: Callable[..., Any], ramp: BatchRamp) -> Callable:
    """``batch_fn(step, rows=None)`` calling ``make(step, batch_size=ramp.size_at(step), rows=rows)``
    (``rows`` only if ``make`` takes it: see :func:`jaxpar.train.data.make_global_batch`)."""
    takes_rows = "rows" in inspect.signature(make).parameters

    def batch_fn(step: int, rows: Any = None):
        kw = {"rows": rows} if takes_rows else {}
        return make(step, batch_size=ramp.size_at(step), **kw)

    return batch_fn if takes_rows else (lambda step: make(step, batch_size=ramp.size_at(step)))
