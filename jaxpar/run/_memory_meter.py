"""The peak memory per device, measured at log points (:class:`MemoryMeter`, :func:`live_bytes`), beside
the compiled step's (:func:`describe_memory`)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import jax

from jaxpar._text import format_bytes
from jaxpar.analysis._compiled_memory import memory_report
from jaxpar.errors import AnalysisError


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
