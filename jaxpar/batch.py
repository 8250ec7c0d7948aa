"""Global batches on the mesh: the batch dimension split over the data axes, checks with
clear errors, and the split into micro-batches (gradient accumulation, pipelines).

Example::

    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> shard_batch({"x": np.zeros((4, 3))}, mesh)["x"].sharding.spec
    P('data',)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.mesh import REPLICA, batch_axes
from jaxpar.rules import path_str
from jaxpar.errors import BatchError

__all__ = ["batch_sharding", "check_batch", "check_stacked_batches", "shard_batch", "split_microbatches",
           "step_microbatches"]


def batch_sharding(mesh) -> NamedSharding:
    """Leading (batch) dimension split over the data axes (and ``replica``), the rest replicated.

    Args:
      mesh: the mesh.

    Returns:
      A ``NamedSharding`` on ``mesh``.
    """
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh) or None))


def check_batch(batch: Any, mesh, microbatches: int = 1) -> int:
    """Check every leaf's leading dim is divisible by data axes x micro-batches; return it.

    Args:
      batch: a pytree of arrays with a leading batch dimension.
      mesh: the mesh whose data axes split the batch.
      microbatches: the number of micro-batches each replica's rows are split into.

    Returns:
      The global batch size (the leaves' common leading size).

    Raises:
      BatchError: no leaf, a scalar leaf, leaves of different leading sizes, or a size that the data
        axes x ``microbatches`` do not divide.
    """
    n = math.prod(mesh.shape[a] for a in batch_axes(mesh))
    sizes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not getattr(leaf, "shape", ()):
            raise BatchError(f"batch leaf {path_str(path)!r} is a scalar; every batch leaf needs a leading "
                             "batch dimension.")
        b = leaf.shape[0]
        sizes.add(b)
        if b % (n * microbatches):
            axes = ", ".join(f"{a}={mesh.shape[a]}" for a in batch_axes(mesh))
            raise BatchError(
                f"batch leaf {path_str(path)!r}: global batch size {b} is not divisible by the data axes "
                f"({axes}; product {n}) x microbatches ({microbatches}) = {n * microbatches}. Use a global "
                f"batch that is a multiple of {n * microbatches}.")
    if len(sizes) > 1:
        raise BatchError(f"batch leaves have different leading sizes {sorted(sizes)}; give every leaf the same "
                         "global batch size.")
    if not sizes:
        raise BatchError(f"batch={batch!r} holds no arrays; give a pytree of arrays with a leading batch dimension, "
                         "e.g. {'x': x[B, ...], 'y': y[B]}.")
    return sizes.pop()


def shard_batch(batch: Any, mesh) -> Any:
    """Place a host batch (numpy / jax arrays) on the mesh, split over the data axes.

    Args:
      batch: a pytree of host arrays with a leading batch dimension.
      mesh: the mesh.

    Returns:
      The same pytree of ``jax.Array``s, split over the data axes.
    """
    check_batch(batch, mesh)
    return jax.device_put(batch, batch_sharding(mesh))


def split_microbatches(batch: Any, k: int, mesh=None) -> Any:
    """``[B, ...] -> [k, B/k, ...]``; micro-batch ``i`` takes rows ``i, i+k, ...``, so every
    device's local rows feed every micro-batch (no resharding).

    Args:
      batch: a pytree of arrays with a leading batch dimension divisible by ``k``.
      k: the number of micro-batches.
      mesh: the mesh of a global batch (the split keeps the rows on their data axes); ``None``
        for one replica's own rows inside a ``shard_map``.

    Returns:
      The micro-batches, stacked on a new leading axis. Call it under ``jit``.
    """
    rows = tuple(a for a in batch_axes(mesh) if a != REPLICA) if mesh is not None else ()   # data axes, expert
    spec = PartitionSpec(None, rows or None) if mesh is not None else None

    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return x if spec is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def step_microbatches(batches: Any, m: int, mesh, steps: int) -> Any:
    """Stacked global batches as micro-batches, step by step.

    Args:
      batches: ``steps`` global batches stacked, ``[steps, B, ...]`` per leaf.
      m: micro-batches per step.
      mesh: the device mesh (its data axes split each micro-batch).
      steps: the number of stacked batches.

    Returns:
      The ``steps * m`` micro-batches, ``[steps * m, B / m, ...]`` per leaf, step 0's first.
    """
    mbs = [split_microbatches(jax.tree.map(lambda a, j=j: a[j], batches), m, mesh) for j in range(steps)]
    return jax.tree.map(lambda *a: jnp.concatenate(a), *mbs)


def check_stacked_batches(batches: Any, mesh, m: int, steps: int) -> None:
    """Check ``steps`` stacked global batches (``make_train_step(steps_per_call=steps)``): every
    leaf ``[steps, B, ...]``, ``B`` divisible by the data axes times ``m`` micro-batches.

    Args:
      batches: the stacked batches (arrays or ``ShapeDtypeStruct``s).
      mesh: the device mesh.
      m: micro-batches per step.
      steps: ``steps_per_call``.

    Raises:
      BatchError: a leaf's leading size is not ``steps``, or ``B`` does not split into the data axes times ``m``.
    """
    leads = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(batches)}
    if leads != {steps}:
        raise BatchError(
            f"steps_per_call={steps}: every batch leaf must be [steps={steps}, batch, ...] (one global batch per "
            f"optimizer step, stacked), got leading sizes {sorted(leads, key=str)}. Stack {steps} batches, "
            "e.g. jax.tree.map(lambda *b: np.stack(b), *batches).")
    check_batch(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batches), mesh, m)
