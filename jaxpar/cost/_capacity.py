"""The one capacity rule of ``plan``, ``inspect``, ``check`` and ``train``: the bytes a program may use on one
device (docs/planning.md §4, docs/targets.md).

On a GPU, JAX's client preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device's memory (0.75 unless the
environment says otherwise) and a program can use no more; on a TPU (and the simulated CPU devices) the whole
memory. The planner ranks a plan only when its predicted peak, with :data:`PLAN_MARGIN` more, fits.

Example::

    >>> c = Capacity(84942979072, 0.75, MEM_FRACTION_ENV)     # an H100 80GB as its driver reports it, JAX default
    >>> c.text()
    '59.3 GiB usable (75% of 79.1 GiB: XLA_PYTHON_CLIENT_MEM_FRACTION)'
    >>> device_capacity(16 * 2**30, "tpu").text()
    '16.0 GiB usable (all of the device memory)'
    >>> round(c.plan_bytes / 2**30, 1)                                # a plan's predicted peak, with the margin
    53.9
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jaxpar._text import format_bytes
from jaxpar.errors import ClusterError

#: The environment variable of JAX's GPU client: its share of each GPU's memory.
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: JAX's default share of a GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION`` unset).
GPU_MEM_FRACTION = 0.75
#: The planner's margin: a plan is ranked only when its predicted peak x (1 + margin) fits the usable bytes
#: (the cost model's peak is within about 10% of the compiled one: docs/planning.md §4).
PLAN_MARGIN = 0.10


def memory_fraction_problem() -> str | None:
    """Why ``XLA_PYTHON_CLIENT_MEM_FRACTION`` gives no GPU capacity (None: unset, or a number in (0, 1]).

    Returns:
      The problem, naming the variable, its value and the fix, or None.
    """
    text = os.environ.get(MEM_FRACTION_ENV)
    try:
        value = float(text or GPU_MEM_FRACTION)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        return (f"{MEM_FRACTION_ENV}={text!r} is not a fraction in (0, 1]; set it to one such as 0.9, or unset it "
                f"(JAX's default, {GPU_MEM_FRACTION}).")
    return None


def gpu_memory_fraction() -> float:
    """JAX's share of a GPU's memory: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else :data:`GPU_MEM_FRACTION`.

    Raises:
      ClusterError: the variable is no fraction (:func:`memory_fraction_problem`).
    """
    if why := memory_fraction_problem():
        raise ClusterError(why)
    return float(os.environ.get(MEM_FRACTION_ENV) or GPU_MEM_FRACTION)


@dataclass(frozen=True)
class Capacity:
    """The memory of one device and the share a program may use.

    Attributes:
      device_bytes: the device's memory.
      fraction: the share a program may use.
      source: where the share comes from (the variable's name, or empty: the whole memory).
    """

    device_bytes: float
    fraction: float = 1.0
    source: str = ""

    @property
    def usable(self) -> float:
        """The bytes a program may use."""
        return self.device_bytes * self.fraction

    @property
    def plan_bytes(self) -> float:
        """The largest predicted peak the planner ranks: the usable bytes over ``1 +`` :data:`PLAN_MARGIN`."""
        return self.usable / (1 + PLAN_MARGIN)

    def text(self) -> str:
        """The capacity in words, the same in every command's message."""
        share = (f"{self.fraction:.0%} of {format_bytes(self.device_bytes)}: {self.source}" if self.source
                 else "all of the device memory")
        return f"{format_bytes(self.usable)} usable ({share})"


def device_capacity(device_bytes: float, platform: str, *, fraction: float | None = None) -> Capacity:
    """The capacity rule: on ``cuda`` JAX's share of the device (:func:`gpu_memory_fraction`), else the whole memory.

    Args:
      device_bytes: the device's memory.
      platform: ``cuda``, ``tpu`` or ``cpu``.
      fraction: a share given by the caller (None: the rule's).

    Returns:
      The :class:`Capacity`.
    """
    if fraction is not None:
        return Capacity(device_bytes, fraction, "the share given")
    if platform == "cuda":
        return Capacity(device_bytes, gpu_memory_fraction(), MEM_FRACTION_ENV)
    return Capacity(device_bytes)
