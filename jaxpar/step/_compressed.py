"""The state part of a compressed exchange (``Strategy(compression=...)``): the codec's plan over
the layout's gradients, and its per-replica state (``TrainState.codec``).

A step with a codec takes each replica's own gradient (:func:`jaxpar.step._grads.replica_grads`:
parameters sharded over the data axes are all-gathered once, uncompressed; the gradient is
accumulated over micro-batches, or comes from the pipeline executor), then the codec's exchange
(:func:`jaxpar.step._exchange.compressed_exchange`) averages it over the replicas, once per step,
into the strategy's gradient layout.

Example::

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.parallel.compression import qsgd
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> strategy = jaxpar.Strategy(zero=2, compression=qsgd())
    >>> model_fn = lambda: MLPClassifier(features=8, embed=64, mlp=256, classes=4, depth=2, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, strategy)
    >>> state.codec, layout.part("codec").specs           # qsgd keeps no state (no error feedback)
    ({}, {})
    >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, strategy)
    >>> batch = jaxpar.shard_batch({"x": jax.numpy.ones((8, 8)), "y": jax.numpy.zeros((8,), "int32")}, mesh)
    >>> state, metrics = step(state, batch)
    >>> round(float(metrics["comm_ratio"]), 3)            # bytes sent vs the fp32 exchange
    0.254
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.adapters._blocks import LAYERS
from jaxpar.parallel.compression import ExchangePlan, exchange_plan
from jaxpar.parallel._data_parallel import axis_name, manual_layout
from jaxpar.step._state import StateLayout


def compression_plan(codec, layout: StateLayout, zero: int) -> ExchangePlan:
    """The exchange of ``layout``'s gradients over its mesh's data axes with ``codec``.

    Args:
      codec: the codec (e.g. :func:`~jaxpar.parallel.compression.qsgd`), as in ``Strategy(compression=...)``.
      layout: the state's layout (shapes, logical names, rules, mesh); the table's codec rules ran
        when it was made.
      zero: the ZeRO stage (which gradients are sharded over the data axes).

    Returns:
      The :class:`~jaxpar.parallel.compression.ExchangePlan`.
    """
    mesh = layout.mesh
    lays = jax.tree_util.tree_structure(layout.shapes).flatten_up_to(
        manual_layout(layout.logical, layout.shapes, mesh, layout.rules, zero))
    shapes = [s.shape for s in jax.tree.leaves(layout.shapes)]
    logical = jax.tree_util.tree_structure(layout.shapes).flatten_up_to(layout.logical)
    stacked = [tuple(lg)[:1] == (LAYERS,) for lg in logical]
    return exchange_plan(codec, shapes, dims=[d for d, _, _ in lays], grad_axes=[g for _, _, g in lays],
                         stacked=stacked, mesh_sizes=dict(mesh.shape), zero=zero, checked=False)   # by the layout


def compression_state(codec, layout: StateLayout, zero: int) -> tuple[Callable, Any, Any]:
    """The per-replica codec state (``TrainState.codec``): how to make it, its specs and shapes.

    Args:
      codec: the codec, as in ``Strategy(compression=...)``.
      layout: the state's layout.
      zero: the ZeRO stage.

    Returns:
      ``(init, specs, shapes)``: ``init()`` (under ``jit``) makes the state, every leaf with a leading
      replica axis sharded over the data axes; ``specs``: its ``PartitionSpec`` tree; ``shapes``: its
      ``jax.ShapeDtypeStruct`` tree.
    """
    plan = compression_plan(codec, layout, zero)
    spec = PartitionSpec(axis_name(plan.axes))      # a leading replica axis, sharded over the data axes

    def init():
        one = plan.init()
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.replicas, *a.shape)), one)

    shapes = jax.eval_shape(init)
    return init, jax.tree.map(lambda _: spec, shapes), shapes
