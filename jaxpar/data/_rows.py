"""A global batch from each process's own rows: which rows a process holds, and their assembly.

A batch function ``batch_fn(step, rows=...)`` is asked only for the rows this process's devices
hold (:func:`process_rows`); :func:`make_global_batch` assembles them into one global array per
leaf with :func:`jax.make_array_from_process_local_data`. ``rows`` is ``None`` (every row), an
int array of global row indices, or the batch's ``Sharding`` (:func:`select_rows`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from jaxpar.errors import BatchError


def process_rows(sharding, batch_size: int) -> np.ndarray:
    """Sorted global row indices of a ``[batch_size, ...]`` batch held by this process's devices.

    ``sharding`` is the batch's sharding (e.g. :func:`jaxpar.batch.batch_sharding`);
    only its split of the leading dimension matters. With one process: all rows.
    This is the order :func:`jax.make_array_from_process_local_data` expects.

    Args:
      sharding: the batch's sharding.
      batch_size: the global batch's rows.

    Returns:
      ``int64`` row indices.

    >>> import jax, jaxpar
    >>> from jaxpar.batch import batch_sharding
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> process_rows(batch_sharding(mesh), 8)   # one process: all rows (process 0 of 2 would get 0..3)
    array([0, 1, 2, 3, 4, 5, 6, 7])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise BatchError(f"process_rows(batch_size={batch_size!r}): must be a positive int.")
    n = _num_row_shards(sharding)
    if batch_size % n:
        raise BatchError(f"process_rows: global batch size {batch_size} is not divisible by the {n} shards of the "
                         f"batch dimension ({sharding}); use a global batch that is a multiple of {n}.")
    picked = np.zeros(batch_size, dtype=bool)
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        picked[index[0] if index else slice(None)] = True
    return np.flatnonzero(picked)


def _num_row_shards(sharding, addressable: bool = False) -> int:
    """How many distinct pieces ``sharding`` cuts the leading dimension into (``addressable``: of them,
    how many this process's devices hold)."""
    probe = max(len(sharding.device_set), 1)   # a multiple of any split of the leading dim
    indices = (sharding.addressable_devices_indices_map if addressable else sharding.devices_indices_map)((probe,))
    return len({(idx[0].start or 0) if idx else 0 for idx in indices.values()})


def select_rows(rows: Any, batch_size: int) -> np.ndarray | slice:
    """``rows`` (None | int indices | Sharding) -> an index into ``[batch_size]`` arrays.

    Args:
      rows: ``None`` (all rows), 1-D int row indices, or the batch's sharding (this process's rows).
      batch_size: the global batch's rows.

    Returns:
      ``slice(None)``, or the row indices.

    >>> select_rows(None, 4), select_rows(np.array([2, 3]), 4).tolist()
    (slice(None, None, None), [2, 3])
    """
    if rows is None:
        return slice(None)
    if hasattr(rows, "addressable_devices_indices_map"):
        return process_rows(rows, batch_size)
    idx = np.asarray(rows)
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or (idx.size and (idx.min() < 0 or idx.max() >= batch_size)):
        raise BatchError(f"rows: expected None, a Sharding or a 1-D int array of row indices in "
                         f"[0, {batch_size}); got {rows!r}.")
    return idx


def takes_rows(fn: Callable) -> bool:
    try:
        return "rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def make_global_batch(batch_fn: Callable, step: int, mesh) -> Any:
    """The global batch of ``step`` on ``mesh``, split over the data axes; each process builds only its rows.

    ``batch_fn(step, rows=...)`` (jaxpar's batch functions, and ``functools.partial`` of
    them) is asked for this process's rows only, which are assembled with
    :func:`jax.make_array_from_process_local_data`. A ``batch_fn(step)`` without
    ``rows`` builds the whole host batch and each process keeps its own rows. With
    one process the result equals ``shard_batch(batch_fn(step), mesh)``.

    Args:
      batch_fn: ``batch_fn(step, rows=None)`` or ``batch_fn(step)``: a pytree of ``[batch, ...]`` arrays.
      step: the step.
      mesh: the mesh.

    Returns:
      The batch as global ``jax.Array`` s, sharded by :func:`jaxpar.batch.batch_sharding`.

    >>> import jax, numpy as np, jaxpar
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> def batch_fn(step, rows=None):
    ...     tokens = np.arange(16 * 8).reshape(16, 8) + step
    ...     return {"tokens": tokens[select_rows(rows, 16)]}
    >>> batch = make_global_batch(batch_fn, step=3, mesh=mesh)
    >>> batch["tokens"].shape, batch["tokens"].sharding.spec
    ((16, 8), P(('data', 'fsdp'),))
    >>> bool((np.asarray(batch["tokens"]) == batch_fn(3)["tokens"]).all())   # the same rows as one host batch
    True
    """
    import jax

    from jaxpar.batch import batch_sharding

    sharding = batch_sharding(mesh)
    if takes_rows(batch_fn):
        local = batch_fn(step, rows=sharding)
        leaves = jax.tree.leaves(local)
        if not leaves:
            raise BatchError("make_global_batch: batch_fn returned an empty batch.")
        n, held = _num_row_shards(sharding), _num_row_shards(sharding, addressable=True)
        sizes = {int(np.shape(x)[0]) * n // held for x in leaves}
    else:
        full = batch_fn(step)
        sizes = {int(np.shape(x)[0]) for x in jax.tree.leaves(full)}
        if len(sizes) == 1:
            keep = process_rows(sharding, sizes.copy().pop())
            local = jax.tree.map(lambda x: np.asarray(x)[keep], full)
        else:
            local = full
    if len(sizes) != 1:
        raise BatchError(f"make_global_batch: batch leaves have different leading sizes {sorted(sizes)}; "
                         "they must agree.")
    size = sizes.pop()
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x),
                                                                        (size, *np.shape(x)[1:])), local)
