"""An out-of-memory failure named: XLA's ``RESOURCE_EXHAUSTED`` (or ``Out of memory``) becomes an
:class:`~jaxpar.errors.OutOfMemoryError` with the bytes asked for, the predicted peak per device and the memory
a device has, pointing to ``jaxpar inspect``.

Example::

    >>> import jax
    >>> e = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.")
    >>> print(out_of_memory_error(e, predicted_bytes=2 ** 30, devices=jax.devices()[:8],
    ...                           config="c.yaml"))  # doctest: +ELLIPSIS
    out of memory on the devices: XLA could not allocate 1.0 TiB (RESOURCE_EXHAUSTED: Out of memory allocating ...
    >>> out_of_memory_error(ValueError("RESOURCE_EXHAUSTED"), 0, jax.devices()) is None   # not XLA's
    True
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import jax

from jaxpar._text import format_bytes
from jaxpar.errors import OutOfMemoryError


def device_memory(devices: Sequence[Any]) -> str:
    """What one device has, in words: its allocator's limit (``memory_stats()["bytes_limit"]``), or on the CPU
    the host's memory, which every CPU device of the process shares."""
    stats = devices[0].memory_stats() if devices else None
    if stats and stats.get("bytes_limit"):
        return f"{format_bytes(stats['bytes_limit'])} per device ({devices[0].device_kind})"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = sum(d.process_index == jax.process_index() for d in devices) or 1
    return f"{format_bytes(total)} of host memory, shared by this process's {local} {devices[0].platform} device(s)"


def out_of_memory_error(error: BaseException, predicted_bytes: float | None, devices: Sequence[Any], *,
                        state_bytes: float | None = None, config: str = "CONFIG") -> OutOfMemoryError | None:
    """The named error for XLA's out-of-memory failure, or None when ``error`` is another.

    Args:
      error: what the run raised.
      predicted_bytes: the cost model's peak per device (None: not predicted, or not yet known).
      devices: the run's devices.
      state_bytes: the train state's bytes per device (parameters and optimizer; None: not known yet).
      config: the config file, for the ``jaxpar inspect`` command the message gives.

    Returns:
      An :class:`~jaxpar.errors.OutOfMemoryError` to raise from None, or None.
    """
    text = str(error)
    if not isinstance(error, jax.errors.JaxRuntimeError) or not re.search(r"RESOURCE_EXHAUSTED|out of memory", text,
                                                                         re.IGNORECASE):
        return None
    first = " ".join(text.split("\n", 1)[0].split())[:200]
    asked = re.search(r"allocat\w*\s+(\d+)\s*bytes", text)
    what = format_bytes(int(asked.group(1))) if asked else "what the program needs"
    state = f"the train state alone is {format_bytes(state_bytes)} per device" if state_bytes else ""
    predicted = (f"the cost model predicts a peak of {format_bytes(predicted_bytes)} per device" if predicted_bytes
                 else f"{state} (the cost model predicts no peak for this model)" if state
                 else "the cost model has no prediction for this run")
    return OutOfMemoryError(
        f"out of memory on the devices: XLA could not allocate {what} ({first}); {predicted}, and a device has "
        f"{device_memory(devices)}. See where the memory goes with jaxpar inspect {config} (add --target h100:1x8 "
        "for a GPU you do not have here), then shard more (mesh.fsdp, parallel.zero=3, mesh.tensor), recompute "
        "(model.remat=full), compute a checkpoint's loss in pieces of its vocabulary (model.loss_chunks) or shrink "
        "data.batch_size / model.seq_len.")
