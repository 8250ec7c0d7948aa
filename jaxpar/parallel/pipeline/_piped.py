"""The pipelined loss-and-grad of a train step: cut the model (:mod:`._cut`), lay its blocks out per stage,
run the schedule (:mod:`._executor`), bring the gradients back into the parameters' layout.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.batch import split_microbatches
from jaxpar.errors import AsyncPipelineError, MoEError, StashingError
from jaxpar.parallel.moe import balanced, probe, reported_loads, use_step_loads
from jaxpar.mesh import REPLICA, batch_axes, data_axes
from jaxpar.rules import named_shardings, spec_without, without_rules
from jaxpar.adapters._mesh_axes import needs_explicit_mesh
from jaxpar.parallel.pipeline._cut import ModelCut, PipelineParts, cut_model, explicit_whole_loss
from jaxpar.parallel.pipeline._executor import pipeline_value_and_grad
from jaxpar.parallel.pipeline._partition import (check_stage_layers, from_stages, layer_costs, partition_layers,
                                                 to_stages, uniform_layers)
from jaxpar.parallel.pipeline._instructions import lower
from jaxpar.parallel.pipeline._reshards import stage_reshards
from jaxpar.parallel.pipeline._schedules import canonical_kind, get_schedule, lockstep
from jaxpar.parallel.pipeline._sweep import pipeline_forward_sum


def auto_stage_layers(cut: ModelCut, outer: list, blocks: Any, microbatch: Any, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage balancing the compiled FLOPs of one of the model's own layers,
    of what runs before the layers (first stage) and after them (last stage).

    Args:
      cut: the model cut at its stacked layers.
      outer: the parameters outside the stacked layers (``cut.split``'s first part).
      blocks: the stacked layers' parameters, leading axis ``L``.
      microbatch: one micro-batch (arrays or shapes).
      stages: the number of virtual stages, ``pipe * virtual_stages``.

    Returns:
      Layers per virtual stage, summing to ``L``.
    """
    abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)   # noqa: E731
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks)
    with without_rules():
        cost, first, last = layer_costs(cut.parts, abstract(outer), layer, abstract(microbatch))
    return partition_layers([cost] * jax.tree.leaves(blocks)[0].shape[0], stages, first_extra=first,
                            last_extra=last)


def runs_in_lockstep(strategy, mesh) -> bool:
    """Whether the pipeline runs as a lockstep program (:func:`~._schedules.lockstep`) whatever its model: with
    sequence parallelism on a ``tensor`` axis of size > 1, whose collectives sit inside every stage's actions.
    Any other pipeline runs in lockstep where its stage holds collective-permutes (:attr:`StagedCut.reshards`)."""
    return bool(strategy.sequence_parallel) and mesh.shape.get("tensor", 1) > 1


#: The schedules without a lockstep program (their stages run different actions at a tick), with their errors.
NO_LOCKSTEP = {"pipedream-2bw": AsyncPipelineError, "pipedream": StashingError}


def _refuse_reshards(strategy, reshards: tuple[str, ...]) -> None:
    """A named error where a schedule without a lockstep program meets a stage that holds collective-permutes."""
    error = NO_LOCKSTEP.get(canonical_kind(strategy.schedule))
    if error is None or not reshards:
        return
    raise error(f"Strategy.schedule={strategy.schedule!r} with a model whose pipeline stage holds collective-permutes "
                f"(XLA reshards a sharded value at {', '.join(reshards[:3])}): every device must reach one, but this "
                "schedule runs a different action per stage, so only some stages' devices would, and the step would "
                "hang until XLA aborts it. Use a flush schedule (gpipe, 1f1b, interleaved, zb-h1; YAML "
                "parallel.schedule), which then runs in lockstep, or keep the model from resharding there (e.g. "
                "separate q / k / v projections in place of a fused one split with jnp.split).")


def _pinned(parts: PipelineParts, shardings: list) -> PipelineParts:
    """``parts`` whose ``pre`` / ``post`` see ``outer`` (and so produce its gradient) in ``shardings``."""
    pin = lambda outer: jax.tree.map(jax.lax.with_sharding_constraint, outer, shardings)   # noqa: E731
    return PipelineParts(pre=lambda outer, mb: parts.pre(pin(outer), mb), layer=parts.layer,
                         post=lambda outer, y, mb: parts.post(pin(outer), y, mb))


class StagedCut(NamedTuple):
    """The model cut for the executor (traced under ``jit``): ``parts`` (``outer`` pinned to its
    layout), ``stage(params) -> (outer, blocks [v, p, Lmax, ...])`` and ``grads(g_outer, g_blocks)``
    back in the parameters' tree; ``model``: the :class:`~._cut.ModelCut` (its ``split`` / ``merge``);
    ``reshards``: where a stage holds collective-permutes (:func:`~._reshards.stage_reshards`; not looked for when
    the pipeline runs in lockstep anyway, :func:`runs_in_lockstep`)."""

    parts: PipelineParts
    stage_layers: tuple
    stage: Callable
    grads: Callable
    model: Any = None
    reshards: tuple = ()


def staged_cut(loss_fn: Callable, graphdef, mesh, param_specs: Any, strategy, params, mbs, *,
               own_specs: Any = None) -> StagedCut:
    """Cut ``loss_fn``'s model at its stacked layers; call it under ``jit`` and the mesh's rules.

    Args:
      loss_fn: the (balanced) loss ``loss_fn(model, batch)``.
      graphdef: the model's NNX graph definition.
      mesh: the mesh, with a ``pipe`` axis.
      param_specs: the parameters' ``PartitionSpec`` tree.
      strategy: the strategy (virtual stages, ``stage_layers``).
      params: the parameters, already cast to the compute dtype.
      mbs: the micro-batches, ``[m, rows, ...]``.
      own_specs: the parameters' specs before ZeRO, for a model that pins shardings by mesh axes
        (:func:`~._cut.cut_model`).

    Returns:
      A :class:`StagedCut`.

    Raises:
      AsyncPipelineError / StashingError: PipeDream-2BW / weight stashing with a stage that holds
        collective-permutes (they have no lockstep program).
    """
    p, v = mesh.shape["pipe"], strategy.virtual_stages
    microbatch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs)
    cut = cut_model(loss_fn, graphdef, params, microbatch, mesh=mesh, own_specs=own_specs)
    outer, blocks = cut.split(params)
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    if strategy.stage_layers == "auto":
        stage_layers = auto_stage_layers(cut, outer, blocks, microbatch, p * v)
    else:
        stage_layers = tuple(strategy.stage_layers or uniform_layers(num_layers, p * v))
    check_stage_layers(stage_layers, num_layers, p, v)
    outer_specs, block_specs = cut.split(param_specs)
    stage_sh = jax.tree.map(lambda sp: NamedSharding(mesh, PartitionSpec(None, "pipe", None, *tuple(sp)[1:])),
                            block_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    # The parameters around the blocks, gathered over the data axes once per step outside the schedule: left
    # sharded, XLA reshards them inside the first / last stage's branch with collective-permutes over every
    # device, which only that stage runs (a deadlock).
    whole = [NamedSharding(mesh, spec_without(sp, set(data_axes(mesh)))) for sp in outer_specs]
    reshards = () if runs_in_lockstep(strategy, mesh) else _stage_reshards(cut, mesh, outer, whole, blocks,
                                                                           block_specs, microbatch)
    _refuse_reshards(strategy, reshards)

    def stage(params):
        outer, blocks = cut.split(params)
        staged = jax.lax.with_sharding_constraint(to_stages(blocks, stage_layers, p, v), stage_sh)
        return jax.lax.with_sharding_constraint(outer, whole), staged

    def grads(g_outer, g_blocks):
        return cut.merge(g_outer, from_stages(g_blocks, stage_layers, num_layers))

    return StagedCut(_pinned(cut.parts, whole), tuple(stage_layers), stage, grads, cut, reshards)


def _stage_reshards(cut: ModelCut, mesh, outer: list, whole: list, blocks: Any, block_specs: Any,
                    microbatch: Any) -> tuple[str, ...]:
    """:func:`~._reshards.stage_reshards` of the cut, on one layer and micro-batch in their shardings in the step."""
    shaped = lambda a, spec, skip=0: jax.ShapeDtypeStruct(a.shape[skip:], a.dtype,   # noqa: E731
                                                          sharding=NamedSharding(mesh, spec))
    rows = tuple(a for a in batch_axes(mesh) if a != REPLICA) or None
    layer = jax.tree.map(lambda a, sp: shaped(a, PartitionSpec(*tuple(sp)[1:]), 1), blocks, block_specs)
    return stage_reshards(_pinned(cut.parts, whole), mesh, [shaped(a, sh.spec) for a, sh in zip(outer, whole)],
                          layer, jax.tree.map(lambda a: shaped(a, PartitionSpec(rows)), microbatch))


def make_pipeline_loss_and_grad(loss_fn: Callable, graphdef, mesh, rules, param_specs: Any, grad_specs: Any,
                                strategy, *, num_layers: int | None = None,
                                replica_axes: tuple[str, ...] = (), own_specs: Any = None,
                                with_metrics: bool = False) -> Callable:
    """The loss and gradient through the pipeline executor (call it under ``jit``).

    The model is cut at its stacked layers (:mod:`jaxpar.parallel.pipeline._cut`); the blocks'
    parameters (``[L, ...]``, ``layers`` split over ``pipe``) are laid out per stage (``[v, p, Lmax, ...]``;
    free for an even split with one chunk), the batch is cut into micro-batches and the schedule runs.
    A loss whose MoE balancing loss counts (:mod:`jaxpar.parallel.moe._balance`) gets the step's loads,
    summed over the micro-batches by a forward sweep first (:func:`_step_loads`). The schedule runs as a
    lockstep program where :func:`runs_in_lockstep` says so or a stage holds collective-permutes
    (:attr:`StagedCut.reshards`), else as the per-stage program.

    Args:
      loss_fn: the user's ``loss_fn(model, batch)``, on the last stage.
      graphdef: the model's NNX graph definition.
      mesh: the mesh, with a ``pipe`` axis.
      rules: the logical rules.
      param_specs, grad_specs: the parameters' and gradients' ``PartitionSpec`` trees.
      strategy: the :class:`~jaxpar.Strategy` (schedule, micro-batches, virtual stages, dtype).
      num_layers: the stacked layers, if known: checks ``strategy.stage_layers`` now, not at the first call.
      replica_axes: data axes the gradients are not reduced over (a compressed exchange follows): each
        leaf gets a leading replica axis sharded over them.
      own_specs: as in :func:`staged_cut`.
      with_metrics: also return what the loss reported, averaged over the micro-batches.

    Returns:
      ``(params, batch) -> (loss, grads)``, or ``(loss, grads, metrics)`` with ``with_metrics``.
    """
    p, m, v = mesh.shape["pipe"], strategy.microbatches, strategy.virtual_stages
    by_config = runs_in_lockstep(strategy, mesh)
    program_of = _programs(get_schedule(strategy.schedule, p, m, v))
    program_of(by_config)                # lowered (and checked) now; a stage's reshards may ask for the other
    if num_layers is not None and strategy.stage_layers != "auto":
        check_stage_layers(strategy.stage_layers or uniform_layers(num_layers, p * v), num_layers, p, v)
    grad_shardings = named_shardings(grad_specs, mesh)
    loss_fn = balanced(loss_fn)          # the MoE layers report and read their loads

    def loss_and_grad(params, batch):
        params = strategy.cast(params)
        mbs = split_microbatches(batch, m, mesh)
        need = _needs_step_loads(loss_fn, graphdef, params, mbs, replica_axes, mesh, own_specs) if m > 1 else None
        with use_step_loads(None if need is None else jnp.zeros(need.shape, jnp.float32)):
            cut = staged_cut(loss_fn, graphdef, mesh, param_specs, strategy, params, mbs, own_specs=own_specs)
            in_lockstep = by_config or bool(cut.reshards)
            loads = None if need is None else _step_loads(cut, mesh, rules, strategy, params, mbs, in_lockstep)
        with use_step_loads(loads):      # the layers carry the step's loads (placeholders above: same shapes)
            run = pipeline_value_and_grad(cut.parts, mesh, rules, program_of(in_lockstep),
                                          stage_layers=cut.stage_layers, replica_axes=replica_axes,
                                          with_metrics=True, lockstep=in_lockstep)
            loss, (g_outer, g_blocks), metrics = run(*cut.stage(params), mbs)
        if replica_axes:     # each replica's own gradients, [R, ...]
            grads = jax.vmap(cut.grads)(g_outer, g_blocks)
        else:
            grads = jax.lax.with_sharding_constraint(cut.grads(g_outer, g_blocks), grad_shardings)
        return (loss, grads, metrics) if with_metrics else (loss, grads)

    return loss_and_grad


def _programs(schedule: Any) -> Callable[[bool], Any]:
    """``program_of(in_lockstep)``: ``schedule`` lowered per stage or as a lockstep program, each once."""
    @functools.cache
    def program_of(in_lockstep: bool):
        return lower(lockstep(schedule) if in_lockstep else schedule)
    return program_of


def _needs_step_loads(loss_fn: Callable, graphdef, params, mbs, replica_axes: tuple, mesh,
                      own_specs: Any) -> Any:
    """The shape of the step's loads when the balanced ``loss_fn`` uses its MoE layers' balancing loss
    (``None``: no MoE layer, or no balancing loss); an :class:`MoEError` where the step cannot make
    it exact (per-replica gradients; a use other than a sum with constant weights). A model that pins
    shardings by mesh axes is probed in JAX's explicit mode, as :func:`~jaxpar.parallel.pipeline._cut.cut_model`
    runs it."""
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs)
    whole = lambda p, b: loss_fn(nnx.merge(graphdef, p), b)     # noqa: E731
    try:
        found = probe(whole, params, one)
    except (ValueError, TypeError, NotImplementedError) as e:
        if own_specs is None or not needs_explicit_mesh(e):
            raise
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        found = probe(explicit_whole_loss(loss_fn, graphdef, shapes, one, mesh, own_specs), params, one)
    if not found.aux_used:
        return None
    if replica_axes:
        raise MoEError(f"Strategy.microbatches={jax.tree.leaves(mbs)[0].shape[0]} with a loss that adds the MoE "
                       "load-balancing loss, on a path without the step's load pre-pass (a codec's per-replica "
                       "gradients): each micro-batch would balance with its own load. Use microbatches=1, or "
                       "leave the aux loss out.")
    if not found.linear:
        raise MoEError("a pipeline: the loss uses its MoE layers' load-balancing loss (stats.aux_loss) other than as "
                       "a sum with constant weights (e.g. squared, or scaled by a value of the batch); each "
                       "micro-batch balances with the whole step's load, so the step makes exactly `loss + w * "
                       "aux_loss` (w a constant) the whole batch's. Add the aux loss that way, or use microbatches=1.")
    return found.loads


def _step_loads(cut: StagedCut, mesh, rules, strategy, params, mbs, in_lockstep: bool) -> Any:
    """The step's MoE load per layer (what the balanced loss reports as :data:`jaxpar.parallel.moe.LAYER_LOADS`)
    summed over the micro-batches by a forward sweep through the stages (:func:`._sweep.pipeline_forward_sum`),
    in lockstep as the schedule runs."""
    sweep = pipeline_forward_sum(cut.parts, mesh, rules, reported_loads(cut.parts.post),
                                 stage_layers=cut.stage_layers, chunks=strategy.virtual_stages,
                                 lockstep=in_lockstep)
    return jax.lax.stop_gradient(sweep(*cut.stage(params), mbs))
