"""The gradient of a train step: ``(params, batch) -> (loss, grads)``, in three kinds.

* :func:`global_grads`: the GSPMD program (XLA places the data-axis collectives), or jaxpar's
  explicit per-layer collectives (:mod:`jaxpar.parallel._data_parallel`); the gradient comes back
  averaged, in the strategy's gradient layout.
* :func:`pipeline_grads`: the pipeline executor running the strategy's schedule table.
* :func:`replica_grads`: each data-parallel replica's own gradient (a leading replica axis,
  sharded over the data axes), for an exchange that is not XLA's (a codec, a measurement).
  The pipeline executor gives the same form with ``pipeline_grads(..., per_replica=True)``.

Every kind accumulates over ``strategy.microbatches`` with :func:`accumulate` (the pipeline's
micro-batches are its schedule's) and casts the parameters to the compute dtype first.

Example:
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(microbatches=2))
    >>> batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)}
    >>> exact = jax.jit(global_grads(classifier_loss, layout))
    >>> mine = jax.jit(replica_grads(classifier_loss, layout))
    >>> (l1, g1), (l2, g2) = exact(state.params, batch), mine(state.params, batch)
    >>> g2["out"]["kernel"].shape                              # [replicas, ...]
    (2, 8, 3)
    >>> bool(np.allclose(g1["out"]["kernel"], g2["out"]["kernel"].mean(0), atol=1e-6))
    True
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.batch import split_microbatches
from jaxpar.adapters._blocks import LAYERS, find_layer_calls, use_layer_runner
from jaxpar.parallel._data_parallel import (DataParallelLayers, axis_name, bucketed_all_gather, explicit_by_default, manual_layout,
                                            sharded_spec)
from jaxpar.adapters._loss_metrics import with_reported_metrics
from jaxpar.mesh import data_axes
from jaxpar.parallel.moe import balanced, use_step_loads
from jaxpar.rules import axes_of, drop_axes, named_shardings, path_str, use_rules
from jaxpar.adapters._mesh_axes import ModelLoss
from jaxpar.step._balancing import refuse_unbalanced, whole_step_loads
from jaxpar.parallel._fp8 import fp8_model_loss, own_scales
from jaxpar.step._state import StateLayout
from jaxpar.errors import ExplicitDPError


def model_loss(loss_fn: Callable, layout: StateLayout) -> Callable:
    """The loss as a function of the parameters.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``.
      layout: the state's layout (graph definition and strategy).

    Returns:
      ``(params, batch) -> loss``: the model rebuilt from ``params`` cast to the strategy's compute
      dtype, scored by ``loss_fn``; a model that pins shardings by mesh axes runs with the mesh's
      axes Explicit (:class:`~jaxpar.adapters._mesh_axes.ModelLoss`).
    """
    graphdef, cast, loss_fn = layout.graphdef, layout.strategy.cast, fp8_model_loss(loss_fn)
    return _model_loss(lambda params, batch: loss_fn(nnx.merge(graphdef, cast(params)), batch), layout)


def _model_loss(loss_of: Callable, layout: StateLayout) -> ModelLoss:
    """``loss_of`` that runs with the mesh's axes Explicit where the model pins shardings by mesh axes."""
    return ModelLoss(loss_of, layout.mesh, layout.model_specs, sequence_parallel=layout.strategy.sequence_parallel)


def accumulate(grad_fn: Callable, params: Any, batch: Any, k: int, *, mesh=None, zeros: Callable = None,
               has_aux: bool = False):
    """The mean loss and fp32 gradient of ``grad_fn(params, micro-batch)`` over ``k`` micro-batches.

    Args:
      grad_fn: ``(params, batch) -> (loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``.
      params: the parameters.
      batch: the batch (global with ``mesh``, one replica's rows without).
      k: the number of micro-batches (1: ``grad_fn`` on the whole batch).
      mesh: the mesh of a global batch (see :func:`jaxpar.batch.split_microbatches`).
      zeros: ``params -> zero gradients`` in the gradients' layout (default ``zeros_like``, fp32).
      has_aux: ``grad_fn`` also returns an ``aux`` tree (arrays), averaged over the micro-batches.

    Returns:
      ``(loss, grads)``, both fp32; ``(loss, grads, aux)`` with ``has_aux``.
    """
    f32 = lambda t: jax.tree.map(lambda g: g.astype(jnp.float32), t)   # noqa: E731
    split = (lambda out: out) if has_aux else (lambda out: ((out[0], {}), out[1]))   # noqa: E731
    if k == 1:
        (loss, aux), grads = split(grad_fn(params, batch))
        done = (loss.astype(jnp.float32), f32(grads))
        return done + (aux,) if has_aux else done
    zeros = zeros or (lambda p: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p))

    def body(carry, mb):
        (loss, aux), g = split(grad_fn(params, mb))
        return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], f32(g))), aux

    (loss, grads), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros(params)),
                                      split_microbatches(batch, k, mesh))
    done = (loss / k, jax.tree.map(lambda g: g / k, grads))
    return done + (jax.tree.map(lambda a: jnp.mean(a, axis=0), aux),) if has_aux else done


def _stacked_paths(layout: StateLayout) -> list[tuple[int, str]]:
    flat = jax.tree_util.tree_flatten_with_path(layout.logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return [(i, path_str(path)) for i, (path, lg) in enumerate(flat) if tuple(lg)[:1] == (LAYERS,)]


def _data_axis_paths(layout: StateLayout, axes: list[str]) -> list[str]:
    """The parameters whose own specs (before ZeRO) already use one of the data ``axes``."""
    base = layout.model_specs()
    flat = jax.tree_util.tree_flatten_with_path(base, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return [path_str(path) for path, spec in flat if any(a in axes for e in spec for a in axes_of(e))]


def stacked_layers(layout: StateLayout) -> int | None:
    """The length of the ``layers`` axis of the stacked parameters.

    Args:
      layout: the state's layout.

    Returns:
      The length, or ``None`` when no parameter is stacked on ``layers`` or the lengths differ.
    """
    shapes = jax.tree.leaves(layout.shapes)
    sizes = {shapes[i].shape[0] for i, _ in _stacked_paths(layout)}
    return sizes.pop() if len(sizes) == 1 else None


def explicit_data_parallel(asked: bool | None, loss_fn: Callable, params: Any, batch: Any,
                           layout: StateLayout) -> bool:
    """Whether the step makes the data-axis collectives explicit (:mod:`jaxpar.parallel._data_parallel`).

    Args:
      asked: ``make_train_step(explicit_dp=...)``: ``None`` decides with
        :func:`~jaxpar.parallel.explicit_by_default` when every stacked parameter runs through
        :func:`jaxpar.scan_blocks`; ``True`` raises :class:`ExplicitDPError` where it cannot apply.
      loss_fn: the user's loss.
      params: the parameters (or their shapes).
      batch: one micro-batch (or its shapes).
      layout: the state's layout.

    Returns:
      ``True`` to run the per-layer collectives.
    """
    mesh, strategy = layout.mesh, layout.strategy
    if asked is False:
        return False
    sizes = dict(mesh.shape)
    axes = [a for a in data_axes(mesh) if sizes[a] > 1]
    merged = _model_loss(lambda p, b: loss_fn(nnx.merge(layout.graphdef, p), b), layout)   # p: in the compute dtype
    sites = find_layer_calls(merged, strategy.cast(params), batch)
    ran = {i for site in sites for i in site.leaves}
    unrun = [p for i, p in _stacked_paths(layout) if i not in ran]
    pinned = _data_axis_paths(layout, axes)
    carried = [s.x for s in sites if not isinstance(s.x, jax.ShapeDtypeStruct)]   # (activation, statistics)
    if asked is None:        # XLA's collectives where the model has its own, or rowwise FP8 (EX x F8)
        own = bool(pinned) or merged.explicit or bool(carried) or getattr(strategy.fp8, "recipe", None) == "rowwise"
        return bool(axes and sites and not unrun and not own) and explicit_by_default(sizes, strategy.zero,
                                                                                        mesh.devices.flat[0].platform)
    if merged.explicit:
        raise ExplicitDPError("explicit_dp=True: the model pins shardings by mesh axes (out_sharding=, jax.reshard), "
                              "which JAX allows only with the mesh's axes Explicit, and the explicit per-layer "
                              "collectives run it inside a shard_map. Use explicit_dp=None / False.")
    if carried:
        raise ExplicitDPError(f"explicit_dp=True: the model's stacked layers carry {jax.tree.structure(carried[0])} "
                              "from layer to layer (positions, segment ids or MoE statistics beside the activation), "
                              "and the explicit per-layer collectives run one activation. Use explicit_dp=None / False.")
    if pinned:
        raise ExplicitDPError(
            f"explicit_dp=True: the model's own specs shard parameters {pinned[:4]}{' ...' if len(pinned) > 4 else ''} "
            f"over data axes {axes} (e.g. P('fsdp', ...)), so XLA already gathers them where the model uses them and "
            "jaxpar cannot issue those gathers layer by layer. Use explicit_dp=None / False.")
    if not axes:
        raise ExplicitDPError(f"explicit_dp=True: the mesh {sizes} has no data axis ('data' or 'fsdp') of size "
                              "> 1, so there is no data-parallel collective to make explicit. Use explicit_dp=None.")
    if unrun:
        raise ExplicitDPError(
            f"explicit_dp=True: parameters {unrun[:4]}{' ...' if len(unrun) > 4 else ''} are stacked on "
            f"{LAYERS!r} but the model does not run them through jaxpar.scan_blocks (e.g. it uses nnx.scan "
            "itself), so they cannot be gathered layer by layer. Run those blocks with "
            "jaxpar.scan_blocks(blocks, x), or use explicit_dp=None / False.")
    if not sites:
        raise ExplicitDPError(
            "explicit_dp=True: the model runs no stacked blocks through jaxpar.scan_blocks (or run_layers), so "
            "there is no layer whose all-gather / reduce-scatter jaxpar could issue itself. Stack the repeated "
            "blocks with nnx.vmap (transform_metadata={nnx.PARTITION_NAME: 'layers'}) and run them with "
            "jaxpar.scan_blocks(self.blocks, x), or use explicit_dp=None / False (XLA's collectives).")
    return True


def global_grads(loss_fn: Callable, layout: StateLayout, *, explicit_dp: bool | None = False,
                 with_metrics: bool = False) -> Callable:
    """``(params, batch) -> (loss, grads)``: the averaged gradient in the strategy's layout.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``.
      layout: the state's layout (its strategy gives the micro-batches and the dtype).
      explicit_dp: as :func:`explicit_data_parallel`'s ``asked``.
      with_metrics: also return what the loss reported (:func:`jaxpar.report_metric`), averaged over
        the micro-batches: ``(loss, grads, metrics)``.

    Returns:
      The function; call it under ``jit`` and :func:`jaxpar.step.strategy_context` (the rules, FP8).
    """
    mesh, strategy = layout.mesh, layout.strategy
    if strategy.compression is not None:
        from jaxpar.parallel.compression import CompressionError

        raise CompressionError(
            f"global_grads on a layout with compression={strategy.compression.name!r}: this gradient is reduced "
            "exactly by XLA, so the codec would be silently ignored. Use make_train_step, which runs the "
            "compressed exchange (replica_grads, then the compressed exchange).")
    grad_shardings = named_shardings(layout.grads, mesh)
    loss_of = balanced(model_loss(loss_fn, layout))      # the MoE layers report and read their loads
    runner = DataParallelLayers(mesh, layout.rules, strategy.zero)
    k = strategy.microbatches

    def grads(params, batch):
        mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // k, *a.shape[1:]), a.dtype), batch)
        explicit = explicit_data_parallel(explicit_dp, balanced(loss_fn), params, mb, layout)

        def one(p, b):
            with use_layer_runner(runner if explicit else None):
                out, g = jax.value_and_grad(with_reported_metrics(loss_of), has_aux=True)(p, b)
            return out, jax.lax.with_sharding_constraint(g, grad_shardings)

        zeros = lambda p: jax.lax.with_sharding_constraint(   # noqa: E731
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), p), grad_shardings)
        with use_step_loads(whole_step_loads(loss_of, params, batch, k, mesh)):
            loss, g, metrics = accumulate(one, params, batch, k, mesh=mesh, zeros=zeros, has_aux=True)
        g = jax.lax.with_sharding_constraint(g, grad_shardings)
        return (loss, g, metrics) if with_metrics else (loss, g)

    return grads


def pipeline_grads(loss_fn: Callable, layout: StateLayout, *, per_replica: bool = False) -> Callable:
    """``(params, batch) -> (loss, grads, metrics)`` through the pipeline executor and the strategy's
    schedule; ``metrics``: what the loss reported, averaged over the micro-batches (and replicas).

    Args:
      loss_fn: the user's loss (on the last stage).
      layout: the state's layout (mesh with a ``pipe`` axis).
      per_replica: return each data-parallel replica's own gradient (leading replica axis).

    Returns:
      The function; call it under ``jit`` and :func:`jaxpar.step.strategy_context` (the rules, FP8).
    """
    from jaxpar.parallel.pipeline._piped import make_pipeline_loss_and_grad   # pipelines load only when used

    mesh = layout.mesh
    axes = tuple(a for a in data_axes(mesh) if mesh.shape[a] > 1) if per_replica else ()
    return make_pipeline_loss_and_grad(fp8_model_loss(loss_fn), layout.graphdef, mesh, layout.rules, layout.params,
                                       layout.grads, layout.strategy, num_layers=stacked_layers(layout), replica_axes=axes,
                                       own_specs=layout.model_specs(), with_metrics=True)


class ManualLayout(NamedTuple):
    """The state inside a ``shard_map`` manual over the data axes ``axes``: per leaf the ZeRO
    dimension (``dims``), the data axes sharding it as a parameter / gradient (``param_axes`` /
    ``grad_axes``), and the specs of both trees."""

    axes: tuple[str, ...]
    replicas: int
    treedef: Any
    dims: list
    param_axes: list
    grad_axes: list
    param_specs: Any
    grad_specs: Any

    @property
    def replica_spec(self) -> PartitionSpec:
        """A leading replica axis, sharded over the data axes."""
        return PartitionSpec(axis_name(self.axes))


def manual_specs(layout: StateLayout) -> ManualLayout:
    """The state's layout inside a ``shard_map`` manual over the data axes.

    Args:
      layout: the state's layout.

    Returns:
      The :class:`ManualLayout` over the mesh's data axes of size > 1.
    """
    mesh = layout.mesh
    sizes = dict(mesh.shape)
    axes = tuple(a for a in data_axes(mesh) if sizes[a] > 1)
    treedef = jax.tree_util.tree_structure(layout.shapes)
    lays = treedef.flatten_up_to(manual_layout(layout.logical, layout.shapes, mesh, layout.rules,
                                               layout.strategy.zero))
    ndims = [len(s.shape) for s in jax.tree.leaves(layout.shapes)]
    p_specs = treedef.unflatten([sharded_spec(d, p, n) for (d, p, _), n in zip(lays, ndims)])
    g_specs = treedef.unflatten([sharded_spec(d, g, n) for (d, _, g), n in zip(lays, ndims)])
    return ManualLayout(axes, math.prod(sizes[a] for a in axes), treedef, [d for d, _, _ in lays],
                        [p for _, p, _ in lays], [g for _, _, g in lays], p_specs, g_specs)


def replica_grads(loss_fn: Callable, layout: StateLayout, *, with_metrics: bool = False) -> Callable:
    """``(params, batch) -> (loss, grads)``: every data-parallel replica's own gradient on its rows.

    One ``shard_map`` manual over the data axes (automatic over ``tensor``): parameters sharded
    over them (ZeRO-3 / FSDP) are all-gathered once, uncompressed; each replica's gradient is
    accumulated over the micro-batches.

    Args:
      loss_fn: the user's loss.
      layout: the state's layout.
      with_metrics: also return what the loss reported, averaged over micro-batches and replicas.

    Returns:
      The function; ``loss`` is the mean over replicas, every gradient leaf ``[replicas, ...]``
      with the replica axis sharded over the data axes.
    """
    mesh, k = layout.mesh, layout.strategy.microbatches
    man = manual_specs(layout)
    loss_of, local_rules = balanced(model_loss(loss_fn, layout)), drop_axes(layout.rules, man.axes)

    def local(params, batch):
        with use_rules(mesh, local_rules), own_scales(man.axes):     # FP8: each replica's own gradient
            full = man.treedef.unflatten(bucketed_all_gather(jax.tree.leaves(params), man.dims, man.param_axes))
            mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // k, *a.shape[1:]), a.dtype), batch)
            refuse_unbalanced(loss_of, full, mb, k)          # no loads pre-pass on this path
            grad_fn = jax.value_and_grad(with_reported_metrics(loss_of), has_aux=True)
            loss, grads, metrics = accumulate(grad_fn, full, batch, k, has_aux=True)
        mean = functools.partial(jax.lax.pmean, axis_name=axis_name(man.axes))
        return mean(loss), jax.tree.map(lambda g: g[None], grads), jax.tree.map(mean, metrics)

    rep = jax.tree.map(lambda _: man.replica_spec, layout.shapes)
    run = jax.shard_map(local, mesh=mesh, in_specs=(man.param_specs, man.replica_spec),
                        out_specs=(PartitionSpec(), rep, PartitionSpec()), axis_names=set(man.axes), check_vma=False)
    return run if with_metrics else lambda params, batch: run(params, batch)[:2]
