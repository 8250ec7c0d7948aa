"""One jitted, donated train step for any strategy.

``loss_fn(model, batch) -> scalar`` is the user's loss on an NNX model. The step
does gradient accumulation over micro-batches (``lax.scan``), optional bf16
compute with fp32 master weights, global-norm clipping, the optax update, and
returns metrics (loss, grad norm, learning rate).

Example::

    >>> step = make_train_step(lm_loss, tx, layout, strategy, clip_norm=1.0)   # doctest: +SKIP
    >>> state, metrics = step(state, batch)                                    # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..mesh import data_axes
from ..models.gpt import lm_loss
from ..pipeline.executor import pipeline_value_and_grad
from ..pipeline.partition import (check_stage_layers, from_stages, layer_costs, partition_layers, to_stages,
                                  uniform_layers)
from ..pipeline.parts import PipelineParts, gpt_parts
from ..pipeline.program import lower
from ..pipeline.schedules import get_schedule
from ..data_parallel import data_parallel_block, explicit_by_default
from ..rules import named_shardings, path_str, use_block_transform, use_rules
from ..strategy import Strategy
from .state import StateLayout, TrainState

__all__ = ["make_train_step", "batch_sharding", "check_batch", "shard_batch", "make_loss_and_grad", "make_model_loss",
           "make_pipeline_loss_and_grad", "default_parts"]


def batch_sharding(mesh) -> NamedSharding:
    """Leading (batch) dimension split over the data axes, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(data_axes(mesh) or None))


def check_batch(batch: Any, mesh, microbatches: int = 1) -> int:
    """Check every leaf's leading dim is divisible by data axes x micro-batches; return it."""
    n = math.prod(mesh.shape[a] for a in data_axes(mesh))
    sizes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not getattr(leaf, "shape", ()):
            raise ValueError(f"batch leaf {path_str(path)!r} is a scalar; every batch leaf needs a leading "
                             "batch dimension.")
        b = leaf.shape[0]
        sizes.add(b)
        if b % (n * microbatches):
            axes = ", ".join(f"{a}={mesh.shape[a]}" for a in data_axes(mesh))
            raise ValueError(
                f"batch leaf {path_str(path)!r}: global batch size {b} is not divisible by the data axes "
                f"({axes}; product {n}) x microbatches ({microbatches}) = {n * microbatches}. Use a global "
                f"batch that is a multiple of {n * microbatches}.")
    if len(sizes) > 1:
        raise ValueError(f"batch leaves have different leading sizes {sorted(sizes)}; they must agree.")
    return sizes.pop()


def shard_batch(batch: Any, mesh) -> Any:
    """Place a host batch (numpy / jax arrays) on the mesh, split over the data axes."""
    check_batch(batch, mesh)
    return jax.device_put(batch, batch_sharding(mesh))


def _split_microbatches(batch: Any, k: int, mesh) -> Any:
    """``[B, ...] -> [k, B/k, ...]``; micro-batch i takes rows i, i+k, ... so every
    device's local rows feed every micro-batch (no resharding)."""
    spec = PartitionSpec(None, data_axes(mesh) or None)

    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def _cast(params: Any, dtype) -> Any:
    """Parameters in the compute dtype (fp32 master weights stay untouched for fp32)."""
    return jax.tree.map(lambda a: a.astype(dtype), params) if dtype != jnp.float32 else params


def _model_cfg(layout: StateLayout) -> Any:
    """The model's ``cfg`` attribute (e.g. :class:`GPTConfig`), or ``None``; no arrays are built."""
    return getattr(nnx.merge(layout.graphdef, layout.shapes), "cfg", None)


def make_model_loss(loss_fn: Callable, layout: StateLayout, strategy: Strategy) -> Callable:
    """``(params, batch) -> loss``: the model rebuilt from ``params`` (cast to the
    strategy's compute dtype) and scored by ``loss_fn(model, batch)``."""
    graphdef, dtype = layout.graphdef, strategy.dtype

    def loss_of(params, batch):
        return loss_fn(nnx.merge(graphdef, _cast(params, dtype)), batch)

    return loss_of


def make_loss_and_grad(loss_fn: Callable, layout: StateLayout, strategy: Strategy) -> Callable:
    """``(params, batch) -> (loss, grads)`` with accumulation and grads in their layout."""
    mesh = layout.mesh
    grad_shardings = named_shardings(layout.grads, mesh)
    loss_of = make_model_loss(loss_fn, layout, strategy)

    def grad_of(params, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)

    def loss_and_grad(params, batch):
        k = strategy.microbatches
        if k == 1:
            return grad_of(params, batch)
        mbs = _split_microbatches(batch, k, mesh)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings)

        def body(carry, mb):
            loss, grads = grad_of(params, mb)
            acc_loss, acc = carry
            return (acc_loss + loss, jax.tree.map(jnp.add, acc, grads)), None

        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mbs)
        return loss / k, jax.tree.map(lambda g: g / k, grads)

    return loss_and_grad


def default_parts(loss_fn: Callable, layout: StateLayout, parts: PipelineParts | None) -> PipelineParts:
    """``parts`` if given; the GPT's cut (with its remat policy) for ``lm_loss``; else an error."""
    if parts is not None:
        return parts
    if loss_fn is lm_loss:
        return gpt_parts(remat=getattr(_model_cfg(layout), "remat", "none"))
    raise ValueError(f"make_train_step: mesh has pipe={layout.mesh.shape['pipe']} but no pipeline parts for "
                     f"loss_fn={getattr(loss_fn, '__name__', loss_fn)!r}. Pass pipeline=PipelineParts(pre=, "
                     "layer=, post=, pre_keys=, post_keys=) saying how the model is cut into stages.")


def auto_stage_layers(parts: PipelineParts, layout: StateLayout, strategy: Strategy, stages: int,
                      rows: int = 1) -> tuple[int, ...]:
    """Layers per virtual stage balancing compiled FLOPs (embedding on the first, head on the last)."""
    pre, blocks, post = parts.split(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, strategy.dtype),
                                                 layout.shapes))
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks)
    seq = getattr(_model_cfg(layout), "seq_len", None)
    if seq is None:
        raise ValueError("stage_layers='auto' needs the model's sequence length (model.cfg.seq_len); give "
                         "stage_layers explicitly.")
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("tokens", "targets")}
    cost, first, last = layer_costs(parts, pre, layer, post, batch)
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    return partition_layers([cost] * num_layers, stages, first_extra=first, last_extra=last)


def make_pipeline_loss_and_grad(parts: PipelineParts, layout: StateLayout, strategy: Strategy) -> Callable:
    """``(params, batch) -> (loss, grads)`` through the pipeline executor.

    The stacked block parameters (``[L, ...]``, ``layers`` split over ``pipe``)
    are laid out per stage (``[v, p, Lmax, ...]``; free for an even split with
    one chunk, a resharding otherwise), the batch is cut into the strategy's
    micro-batches and the schedule runs; gradients come back in ``layout.grads``.
    """
    mesh, dtype = layout.mesh, strategy.dtype
    p, m, v = mesh.shape["pipe"], strategy.microbatches, strategy.virtual_stages
    if strategy.sequence_parallel and mesh.shape.get("tensor", 1) > 1:
        raise ValueError(f"Strategy(sequence_parallel=True) with pipe={p} is not supported: XLA reorders "
                         "sequence-parallel activations with collective-permutes that span every pipeline "
                         "stage, which would deadlock inside a stage's own branch. Use sequence_parallel=False "
                         "with pipe > 1 (tensor parallelism itself works).")
    program = lower(get_schedule(strategy.schedule, p, m, v))
    _, block_shapes, _ = parts.split(layout.shapes)
    num_layers = jax.tree.leaves(block_shapes)[0].shape[0]
    stage_layers = strategy.stage_layers or uniform_layers(num_layers, p * v)
    if stage_layers == "auto":
        stage_layers = auto_stage_layers(parts, layout, strategy, p * v)
    check_stage_layers(stage_layers, num_layers, p, v)
    run = pipeline_value_and_grad(parts, mesh, layout.rules, program, stage_layers=stage_layers)
    _, block_specs, _ = parts.split(layout.params)
    stage_sh = jax.tree.map(lambda sp: NamedSharding(mesh, PartitionSpec(None, "pipe", None, *tuple(sp)[1:])),
                            block_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    grad_shardings = named_shardings(layout.grads, mesh)

    def loss_and_grad(params, batch):
        pre, blocks, post = parts.split(_cast(params, dtype))
        blocks = jax.lax.with_sharding_constraint(to_stages(blocks, stage_layers, p, v), stage_sh)
        loss, (g_pre, g_blocks, g_post) = run(pre, blocks, post, _split_microbatches(batch, m, mesh))
        grads = parts.merge(g_pre, from_stages(g_blocks, stage_layers, num_layers), g_post)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)

    return loss_and_grad


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, layout: StateLayout,
                    strategy: Strategy = Strategy(), *, clip_norm: float | None = None,
                    lr_schedule: Callable | None = None, donate: bool = True,
                    explicit_dp: bool | None = None, skip_nonfinite: bool = False,
                    pipeline: PipelineParts | None = None) -> Callable:
    """Build ``step(state, batch) -> (state, metrics)``, jitted with the layout's shardings.

    ``explicit_dp=True`` makes the data-axis collectives of repeated blocks explicit
    (:mod:`jaxpar.data_parallel`), ``False`` leaves them to XLA, and ``None``
    (default) decides with :func:`jaxpar.data_parallel.explicit_by_default`.
    ``skip_nonfinite=True``: a step whose loss or gradient norm is NaN / inf keeps
    the params and optimizer state unchanged (a ``jnp.where`` select; the step
    counter still advances) and reports ``metrics["skipped"] = True``.
    With a ``pipe`` mesh axis the step runs the strategy's pipeline schedule on
    ``pipeline`` (how the model is cut; default: the GPT's parts when
    ``loss_fn`` is :func:`jaxpar.models.lm_loss`).
    """
    mesh = layout.mesh
    piped = dict(mesh.shape).get("pipe", 1) > 1
    if explicit_dp is None:
        explicit_dp = explicit_by_default(dict(mesh.shape), strategy.zero) and not piped
    if piped:
        loss_and_grad = make_pipeline_loss_and_grad(default_parts(loss_fn, layout, pipeline), layout, strategy)
    else:
        loss_and_grad = make_loss_and_grad(loss_fn, layout, strategy)
    state_sh = layout.shardings()
    replicated = NamedSharding(mesh, PartitionSpec())

    def dp_transform(fn, logical, shapes, remat):
        return data_parallel_block(fn, logical, mesh, layout.rules, strategy.zero, shapes, remat=remat)

    def step(state: TrainState, batch):
        with use_rules(mesh, layout.rules), use_block_transform(dp_transform if explicit_dp else None):
            loss, grads = loss_and_grad(state.params, batch)
        gnorm = optax.tree.norm(grads)
        if clip_norm is not None:
            scale = jnp.minimum(1.0, clip_norm / (gnorm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": gnorm}
        if skip_nonfinite:
            ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
            metrics["skipped"] = jnp.logical_not(ok)
        if lr_schedule is not None:
            metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        return TrainState(state.step + 1, params, opt_state), metrics

    jitted = jax.jit(step, in_shardings=(state_sh, batch_sharding(mesh)), out_shardings=(state_sh, replicated),
                     donate_argnums=(0,) if donate else ())

    def checked(state, batch):
        check_batch(batch, mesh, strategy.microbatches)
        return jitted(state, batch)

    checked.jitted = jitted  # for .lower(...).compile() inspection
    checked.lower = jitted.lower
    return checked
