"""The pipelined loss-and-grad of a train step: cut the model, lay its blocks out per stage,
run the schedule, bring the gradients back into the parameters' layout.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> class Tiny(nnx.Module):                  # an input layer, then 2 stacked layers
    ...     def __init__(self):
    ...         self.w_in = nnx.Param(jnp.full((3, 4), 0.5))
    ...         self.blocks = nnx.Param(jnp.stack([jnp.eye(4)] * 2))     # leading ``layers`` axis
    ...     def __call__(self, x):
    ...         return jaxpar.run_layers(lambda w, h: jnp.tanh(h @ w), self.blocks[...], x @ self.w_in[...])
    >>> loss_fn = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)
    >>> graphdef, params = nnx.split(Tiny())
    >>> params = nnx.to_pure_dict(params)
    >>> mesh = jaxpar.make_mesh({"pipe": 2}, devices=jax.devices()[:2])    # one layer per stage
    >>> strategy = jaxpar.Strategy(microbatches=2, schedule="1f1b")
    >>> rules, specs = strategy.rules(mesh), jax.tree.map(lambda _: P(), params)   # replicated, for brevity
    >>> fn = make_pipeline_loss_and_grad(loss_fn, graphdef, mesh, rules, specs, specs, strategy)
    >>> batch = {"x": jnp.arange(12.0).reshape(4, 3) / 12}
    >>> with jaxpar.use_rules(mesh, rules):
    ...     loss, grads = jax.jit(fn)(params, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
    >>> bool(jnp.allclose(loss, ref_loss)), jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), grads, ref_grads)
    (True, {'blocks': True, 'w_in': True})
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.batch import split_microbatches
from jaxpar.parallel.moe import reported_loads, step_loads_needed, use_step_loads
from jaxpar.mesh import data_axes
from jaxpar.rules import axes_of, named_shardings, without_rules
from jaxpar.parallel.pipeline.cut import ModelCut, cut_model
from jaxpar.parallel.pipeline.executor import pipeline_value_and_grad
from jaxpar.parallel.pipeline.lockstep import lockstep
from jaxpar.parallel.pipeline.parts import PipelineParts
from jaxpar.parallel.pipeline.partition import check_stage_layers, from_stages, layer_costs, partition_layers, to_stages, uniform_layers
from jaxpar.parallel.pipeline.instructions import lower
from jaxpar.parallel.pipeline.schedules import get_schedule
from jaxpar.parallel.pipeline.sweep import pipeline_forward_sum

__all__ = ["make_pipeline_loss_and_grad", "auto_stage_layers", "check_pipeline_strategy", "runs_in_lockstep",
           "staged_cut", "StagedCut"]


def auto_stage_layers(cut: ModelCut, outer: list, blocks: Any, microbatch: Any, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage balancing the compiled FLOPs of one of the model's own layers,
    of what runs before the layers (first stage) and after them (last stage)."""
    abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)   # noqa: E731
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks)
    with without_rules():
        cost, first, last = layer_costs(cut.parts, abstract(outer), layer, abstract(microbatch))
    return partition_layers([cost] * jax.tree.leaves(blocks)[0].shape[0], stages, first_extra=first,
                            last_extra=last)


def check_pipeline_strategy(strategy, mesh) -> None:
    """Errors for what the no-flush programs (PipeDream-2BW, weight stashing) do not support."""
    if strategy.sequence_parallel and mesh.shape.get("tensor", 1) > 1:
        raise ValueError(f"Strategy(sequence_parallel=True) with schedule={strategy.schedule!r} on "
                         f"pipe={mesh.shape['pipe']} is not supported: sequence parallelism's collectives sit inside "
                         "each stage's actions, which only the flush schedules (gpipe, 1f1b, interleaved, zb-h1) run "
                         "in lockstep; the no-flush programs run a different action per stage. Use a flush schedule, "
                         "or sequence_parallel=False.")


def runs_in_lockstep(strategy, mesh) -> bool:
    """Whether the pipeline runs as a lockstep program (:mod:`.lockstep`): with sequence parallelism on a
    ``tensor`` axis, whose collectives sit inside every stage's actions."""
    return bool(strategy.sequence_parallel) and mesh.shape.get("tensor", 1) > 1


def _whole_over_data_axes(specs: list, mesh) -> list:
    """Shardings of the parameters around the blocks gathered over the data axes (ZeRO-3 /
    FSDP shards), other axes kept: they are gathered once per step, outside the schedule.
    Left sharded, XLA reshards them inside the first / last stage's branch with
    collective-permutes over every device, which only that stage runs (a deadlock)."""
    drop = set(data_axes(mesh))

    def whole(spec):
        entries = [tuple(a for a in axes_of(e) if a not in drop) for e in spec]
        return NamedSharding(mesh, PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in entries)))

    return [whole(sp) for sp in specs]


def _pinned(parts: PipelineParts, shardings: list) -> PipelineParts:
    """``parts`` whose ``pre`` / ``post`` see ``outer`` (and so produce its gradient) in ``shardings``."""
    pin = lambda outer: jax.tree.map(jax.lax.with_sharding_constraint, outer, shardings)   # noqa: E731
    return PipelineParts(pre=lambda outer, mb: parts.pre(pin(outer), mb), layer=parts.layer,
                         post=lambda outer, y, mb: parts.post(pin(outer), y, mb))


def _stage_layers(strategy, cut: ModelCut, outer, blocks, microbatch, stages: int) -> tuple[int, ...]:
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    if strategy.stage_layers == "auto":
        return auto_stage_layers(cut, outer, blocks, microbatch, stages)
    return tuple(strategy.stage_layers or uniform_layers(num_layers, stages))


class StagedCut(NamedTuple):
    """The model cut for the executor (traced under ``jit``): ``parts`` (``outer`` pinned to its
    layout), ``stage(params) -> (outer, blocks [v, p, Lmax, ...])`` and ``grads(g_outer, g_blocks)``
    back in the parameters' tree; ``model``: the :class:`~.cut.ModelCut` (its ``split`` / ``merge``)."""

    parts: PipelineParts
    stage_layers: tuple
    stage: Callable
    grads: Callable
    model: Any = None


def staged_cut(loss_fn: Callable, graphdef, mesh, param_specs: Any, strategy, params, mbs, *,
               own_specs: Any = None) -> StagedCut:
    """Cut ``loss_fn``'s model at its stacked layers for ``params`` (already cast) and the
    micro-batches ``mbs`` (``[m, rows, ...]``); call it under ``jit`` and the mesh's rules.
    ``own_specs``: the parameters' specs before ZeRO, for a model that pins shardings by mesh
    axes (:func:`~.cut.cut_model`)."""
    p, v = mesh.shape["pipe"], strategy.virtual_stages
    microbatch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs)
    cut = cut_model(loss_fn, graphdef, params, microbatch, mesh=mesh, own_specs=own_specs)
    outer, blocks = cut.split(params)
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    stage_layers = _stage_layers(strategy, cut, outer, blocks, microbatch, p * v)
    check_stage_layers(stage_layers, num_layers, p, v)
    _, block_specs = cut.split(param_specs)
    stage_sh = jax.tree.map(lambda sp: NamedSharding(mesh, PartitionSpec(None, "pipe", None, *tuple(sp)[1:])),
                            block_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    whole = _whole_over_data_axes(cut.split(param_specs)[0], mesh)

    def stage(params):
        outer, blocks = cut.split(params)
        staged = jax.lax.with_sharding_constraint(to_stages(blocks, stage_layers, p, v), stage_sh)
        return jax.lax.with_sharding_constraint(outer, whole), staged

    def grads(g_outer, g_blocks):
        return cut.merge(g_outer, from_stages(g_blocks, stage_layers, num_layers))

    return StagedCut(_pinned(cut.parts, whole), tuple(stage_layers), stage, grads, cut)


def make_pipeline_loss_and_grad(loss_fn: Callable, graphdef, mesh, rules, param_specs: Any, grad_specs: Any,
                                strategy, *, num_layers: int | None = None,
                                replica_axes: tuple[str, ...] = (), own_specs: Any = None,
                                with_metrics: bool = False, step_loads: bool = False) -> Callable:
    """``(params, batch) -> (loss, grads)`` through the pipeline executor (call it under ``jit``).

    ``loss_fn(model, batch)`` is the user's loss; the model is cut at its stacked layers
    (:mod:`jaxpar.parallel.pipeline.cut`). The blocks' parameters (``[L, ...]``, ``layers`` split over
    ``pipe``) are laid out per stage (``[v, p, Lmax, ...]``; free for an even split with one
    chunk, a resharding otherwise), the batch is cut into the strategy's micro-batches and
    the schedule runs; gradients come back in ``grad_specs``. ``num_layers`` (if known)
    checks the strategy's ``stage_layers`` now rather than at the first call. With
    ``replica_axes`` (a compressed exchange follows) the gradients are each replica's own,
    not reduced over those axes: every leaf gets a leading replica axis sharded over them.
    ``own_specs`` as in :func:`staged_cut`. ``with_metrics``: also return what the loss reported,
    averaged over the micro-batches: ``(loss, grads, metrics)``. ``step_loads`` (a model with MoE
    layers, no ``replica_axes``): a forward sweep first sums the step's load per MoE layer
    (:func:`_step_loads`), which every micro-batch's load-balancing loss then uses.
    """
    p, m, v = mesh.shape["pipe"], strategy.microbatches, strategy.virtual_stages
    in_lockstep = runs_in_lockstep(strategy, mesh)
    schedule = get_schedule(strategy.schedule, p, m, v)
    program = lower(lockstep(schedule) if in_lockstep else schedule)
    if num_layers is not None and strategy.stage_layers != "auto":
        check_stage_layers(strategy.stage_layers or uniform_layers(num_layers, p * v), num_layers, p, v)
    grad_shardings = named_shardings(grad_specs, mesh)

    def loss_and_grad(params, batch):
        params = strategy.cast(params)
        mbs = split_microbatches(batch, m, mesh)
        cut = staged_cut(loss_fn, graphdef, mesh, param_specs, strategy, params, mbs, own_specs=own_specs)
        loads = _step_loads(cut, mesh, rules, strategy, params, mbs) if step_loads and m > 1 else None
        with use_step_loads(loads) if loads is not None else contextlib.nullcontext():
            if loads is not None:        # the layers now carry the step's loads: cut again
                cut = staged_cut(loss_fn, graphdef, mesh, param_specs, strategy, params, mbs, own_specs=own_specs)
            run = pipeline_value_and_grad(cut.parts, mesh, rules, program, stage_layers=cut.stage_layers,
                                          replica_axes=replica_axes, with_metrics=True, lockstep=in_lockstep)
            loss, (g_outer, g_blocks), metrics = run(*cut.stage(params), mbs)
        if replica_axes:     # each replica's own gradients, [R, ...]
            grads = jax.vmap(cut.grads)(g_outer, g_blocks)
        else:
            grads = jax.lax.with_sharding_constraint(cut.grads(g_outer, g_blocks), grad_shardings)
        return (loss, grads, metrics) if with_metrics else (loss, grads)

    return loss_and_grad


def _step_loads(cut: StagedCut, mesh, rules, strategy, params, mbs) -> Any:
    """The step's MoE load per layer (what the loss reports as :data:`jaxpar.parallel.moe.LAYER_LOADS`) summed
    over the micro-batches by a forward sweep through the stages (:func:`.sweep.pipeline_forward_sum`);
    ``None`` for a loss that reports none or adds no load-balancing loss."""
    outer, blocks = cut.stage(params)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs)
    x = jax.eval_shape(cut.parts.pre, outer, one)
    if step_loads_needed(cut.parts.post, outer, x, one) is None:
        return None                     # no loads reported, or no balancing loss that needs them
    sweep = pipeline_forward_sum(cut.parts, mesh, rules, reported_loads(cut.parts.post),
                                 stage_layers=cut.stage_layers, chunks=strategy.virtual_stages,
                                 lockstep=runs_in_lockstep(strategy, mesh))
    return jax.lax.stop_gradient(sweep(outer, blocks, mbs))
