"""Which layers go to which pipeline stage, and the stacked-parameter layout for it.

* :func:`partition_layers`: contiguous stage boundaries that minimise the
  slowest stage for given per-layer costs (PipeDream's dynamic programme),
  counting the embedding on the first stage and the head on the last.
* :func:`layer_costs`: layer / embedding / head costs from XLA's compiled cost analysis.
* :func:`to_stages` / :func:`from_stages`: a block parameter stacked as
  ``[L, ...]`` (the model's layer order) <-> the executor's ``[v, p, Lmax, ...]``
  (chunk, stage, layer; virtual stage ``k = chunk * p + stage`` holds the next
  ``stage_layers[k]`` layers, padded to ``Lmax``).

Example:
    >>> partition_layers([1.0] * 6, 4, first_extra=0.5, last_extra=1.0)
    (1, 2, 2, 1)
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import PartitionError


def uniform_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """``num_layers / num_stages`` layers per stage; a :class:`PartitionError` names the sizes if it does not divide.

    Args:
        num_layers: the model's layers.
        num_stages: the virtual stages (``pipe x virtual_stages``).

    Returns:
        One equal layer count per stage.

    >>> uniform_layers(8, 4)
    (2, 2, 2, 2)
    """
    if num_layers % num_stages:
        raise PartitionError(
            f"{num_layers} layers cannot be split evenly over {num_stages} pipeline stages "
            f"(pipe x virtual_stages). Use a layer count that is a multiple of {num_stages}, or give "
            f"stage_layers explicitly (e.g. from partition_layers) for an uneven split.")
    return (num_layers // num_stages,) * num_stages


def partition_layers(costs: Sequence[float], num_stages: int, *, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers per stage (contiguous, each >= 1) minimising the slowest stage's cost.

    Exact dynamic programme, O(num_stages * L^2). Ties prefer earlier stages lighter.

    Args:
        costs: ``costs[i]`` is layer ``i``'s cost (e.g. forward + backward seconds or FLOPs).
        num_stages: the stages, at most ``len(costs)``.
        first_extra: the embedding's cost, on the first stage.
        last_extra: the head's cost, on the last stage.

    Returns:
        Layers per stage, summing to ``len(costs)``.
    """
    L = len(costs)
    if num_stages < 1 or L < num_stages:
        raise PartitionError(f"cannot split {L} layers over {num_stages} stages: every stage needs at "
                             "least one layer. Use fewer stages or more layers.")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, float))])
    # best[k][i]: min over partitions of layers[:i] into k stages of the max stage cost (inf: none)
    best = [[math.inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, L - (num_stages - k) + 1):
            for j in range(k - 1, i):
                c = prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0)
                c += last_extra if k == num_stages else 0.0
                worst = max(best[k - 1][j], c)
                if worst < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = worst, j
    sizes, i = [], L
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def layer_costs(parts: Any, outer: Any, layer: Any, batch: Any) -> tuple[float, float, float]:
    """Forward + backward FLOPs of one layer, of ``parts.pre`` and of ``parts.post``, for one micro-batch.

    Feed them to :func:`partition_layers` as ``([layer] * L, stages, first_extra=, last_extra=)``.

    Args:
        parts: a :class:`jaxpar.parallel.pipeline.PipelineParts`.
        outer: the parameters of ``pre`` and ``post`` (abstract shapes suffice, as for all arguments).
        layer: one layer's parameters.
        batch: one micro-batch.

    Returns:
        ``(layer, first_extra, last_extra)``: the FLOPs of one layer, of what runs before the layers
        (e.g. the embedding) and of what runs after them (head + loss).
    """
    x = jax.eval_shape(parts.pre, outer, batch)

    def flops(fn, argnums, *args) -> float:
        """FLOPs of ``fn``'s compiled gradient at ``args`` from XLA's cost analysis (0.0 if it has none)."""
        grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)
        analysis = jax.jit(grad).lower(*args).compile().cost_analysis()
        return float((analysis or {}).get("flops", 0.0))

    return (flops(parts.layer, (0, 1), layer, x), flops(parts.pre, 0, outer, batch),
            flops(parts.post, (0, 1), outer, x, batch))


def check_stage_layers(stage_layers: Sequence[int], num_layers: int, p: int, v: int = 1) -> np.ndarray:
    """``stage_layers`` checked: a :class:`PartitionError` names the counts, ``pipe x virtual_stages`` and the layers.

    Args:
        stage_layers: layers per virtual stage, each >= 1.
        num_layers: the model's layers (their sum).
        p: pipeline stages.
        v: virtual stages (chunks) per device.

    Returns:
        ``stage_layers`` as an int array of length ``p * v``.
    """
    counts = np.asarray(stage_layers, int)
    if counts.ndim != 1 or len(counts) != p * v:
        raise PartitionError(f"stage_layers={tuple(stage_layers)} has {len(counts)} entries; the pipeline "
                             f"has pipe={p} x virtual_stages={v} = {p * v} virtual stages. Give one layer "
                             "count per virtual stage.")
    if (counts < 1).any() or counts.sum() != num_layers:
        raise PartitionError(f"stage_layers={tuple(stage_layers)} must be positive and sum to the model's "
                             f"{num_layers} layers (they sum to {int(counts.sum())}).")
    return counts


def _positions(stage_layers: Sequence[int], num_layers: int, p: int, v: int):
    counts = check_stage_layers(stage_layers, num_layers, p, v)
    lmax = int(counts.max())
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    src = np.zeros((v, p, lmax), int)          # exec slot -> model layer (padding repeats a real one)
    pos = np.zeros(num_layers, int)            # model layer -> flat exec slot
    for k, (start, n) in enumerate(zip(starts, counts)):
        c, s = divmod(k, p)
        for j in range(lmax):
            src[c, s, j] = start + min(j, n - 1)
            if j < n:
                pos[start + j] = (c * p + s) * lmax + j
    return counts, lmax, src, pos


def to_stages(blocks: Any, stage_layers: Sequence[int], p: int, v: int = 1) -> Any:
    """Stacked ``[L, ...]`` block parameters -> ``[v, p, Lmax, ...]``.

    A plain reshape when every virtual stage has the same number of layers
    (virtual stage ``k = chunk * p + stage`` holds layers ``k*n .. k*n+n-1``);
    a gather (padding repeats a layer, which the executor skips) otherwise.

    Args:
        blocks: a pytree of block parameters, each leaf ``[L, ...]`` in the model's layer order.
        stage_layers: layers per virtual stage, ``p * v`` counts summing to ``L``.
        p: pipeline stages.
        v: virtual stages (chunks) per device.

    Returns:
        The same tree, each leaf ``[v, p, Lmax, ...]`` (chunk, stage, layer).

    >>> to_stages({"w": jnp.arange(6)}, (1, 2, 2, 1), p=4)["w"].tolist()
    [[[0, 0], [1, 2], [3, 4], [5, 5]]]
    """
    L = jax.tree.leaves(blocks)[0].shape[0]
    counts, lmax, src, _ = _positions(stage_layers, L, p, v)
    if (counts == lmax).all():
        return jax.tree.map(lambda a: a.reshape(v, p, lmax, *a.shape[1:]), blocks)
    return jax.tree.map(lambda a: jnp.take(a, jnp.asarray(src), axis=0), blocks)


def from_stages(stage_blocks: Any, stage_layers: Sequence[int], num_layers: int) -> Any:
    """Inverse of :func:`to_stages` for gradients (padding dropped).

    Args:
        stage_blocks: a pytree, each leaf ``[v, p, Lmax, ...]``.
        stage_layers: layers per virtual stage, as given to :func:`to_stages`.
        num_layers: ``L``, the model's layers.

    Returns:
        The same tree, each leaf ``[L, ...]`` in the model's layer order.
    """
    v, p = jax.tree.leaves(stage_blocks)[0].shape[:2]
    counts, lmax, _, pos = _positions(stage_layers, num_layers, p, v)
    if (counts == lmax).all():
        return jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[3:]), stage_blocks)
    return jax.tree.map(lambda a: jnp.take(a.reshape(v * p * lmax, *a.shape[3:]), jnp.asarray(pos), axis=0),
                        stage_blocks)


def check_blocks_layout(blocks, counts: np.ndarray, stage_layers) -> None:
    """A :class:`PartitionError` unless every block leaf is laid out as :func:`to_stages` lays it out.

    Args:
        blocks: the block parameters (or gradients) as given to the executor.
        counts: real layers per virtual stage, ``[chunks, stages]``.
        stage_layers: layers per virtual stage (named in the message).
    """
    (v, p), lmax = counts.shape, int(counts.max())
    lead = jax.tree.leaves(blocks)[0].shape[:3]
    if lead != (v, p, lmax):
        raise PartitionError(f"pipeline blocks must be laid out [chunks={v}, stages={p}, layers={lmax}, ...] for "
                             f"stage_layers={tuple(stage_layers)}; got leading dims {lead}. Lay them out with "
                             "jaxpar.parallel.pipeline.to_stages(blocks, stage_layers, p, v).")
