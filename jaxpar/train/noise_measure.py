"""The gradient noise scale measured inside the data-parallel train step, every ``k`` steps.

``make_train_step(..., noise_scale_every=k)`` builds two programs. The usual one runs the
steps with ``state.step % k != 0``. On the others a measuring program runs the same update
from a loss-and-grad that is manual over the data axes in one ``shard_map`` (as a compressed
step, :mod:`jaxpar.train.compressed`): parameters sharded over the data axes (ZeRO-3 / FSDP)
are all-gathered once; each replica computes its own gradient on its ``B / N`` rows
(accumulated over micro-batches) and its squared norm; a ``pmean`` of that one scalar over
the ``N`` replicas gives ``|G_small|²``; then the gradients are averaged as usual, with an
all-reduce, or a reduce-scatter where the strategy shards gradients (ZeRO-2/3, FSDP). The
squared norm of the averaged gradient is ``|G_big|²``, and :func:`jaxpar.train.noise_scale.update`
folds both into the moving averages in ``state.stats``.

The usual program is unchanged, so the cost is the measuring step's extra time divided by
``k``, plus one more compilation. Which program runs is decided on the host from the step
number, tracked without waiting for the device (it is read once, and again only when the
step is given a state it did not return).

Not supported (a :class:`~jaxpar.train.noise_scale.NoiseScaleError` says so): no data axis of
size > 1 (``B_small = B_big``), pipelines (``mesh.pipe > 1``), compressed exchanges
(``Strategy(compression=...)``) and relaxed synchronisation (``mesh.replica > 1`` / ``Strategy(sync=...)``).

Example::

    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models.mlp import MLPClassifier, classifier_loss
    >>> from jaxpar.train.noise_scale import with_noise_scale
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = with_noise_scale(*jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh))
    >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, noise_scale_every=2)
    >>> rng = np.random.default_rng(0)
    >>> batch = {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.integers(0, 3, 16).astype(np.int32)}
    >>> keys = []
    >>> for _ in range(3):
    ...     state, metrics = step(state, batch)
    ...     keys.append("noise_scale" in metrics)
    >>> keys, int(state.stats["noise_scale"]["count"])           # measured at steps 0 and 2
    ([True, False, True], 2)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..data_parallel import _axis, _spec, bucketed_all_gather, bucketed_reduce_scatter, manual_layout
from ..mesh import data_axes, replicas
from ..rules import drop_axes, named_shardings, use_rules
from .noise_scale import KEY, NoiseScaleError, check_options, has_noise_scale, update

__all__ = ["check_measurable", "make_measured_loss_and_grad", "make_noise_scale_step"]


def _measured_axes(mesh) -> tuple[str, ...]:
    sizes = dict(mesh.shape)
    return tuple(a for a in data_axes(mesh) if sizes[a] > 1)


def check_measurable(layout, strategy, every: Any, ema: Any) -> None:
    """Raise :class:`NoiseScaleError` where ``make_train_step(noise_scale_every=every, noise_scale_ema=ema)``
    cannot measure: bad options, no place in the state, or a setting it does not support."""
    check_options(every, ema)
    sizes = dict(layout.mesh.shape)
    why = None
    if strategy.sync is not None or replicas(layout.mesh) > 1:
        why = (f"relaxed synchronisation (mesh.replica={replicas(layout.mesh)}, sync={strategy.sync!r}) keeps "
               "several replicas with their own parameters; measure without it")
    elif strategy.compression is not None:
        why = (f"compression={strategy.compression.name!r} replaces the data-axis reduction with its own exchange; "
               "measure without compression")
    elif sizes.get("pipe", 1) > 1:
        why = f"pipelines (pipe={sizes['pipe']}) are not supported yet; measure on a mesh without pipe"
    elif not _measured_axes(layout.mesh):
        why = (f"the mesh {sizes} has no data axis ('data' or 'fsdp') of size > 1, so each replica's batch is the "
               "global batch and the two-batch estimate is undefined; use a mesh with data > 1")
    elif not has_noise_scale(layout):
        why = ("the train state has no place for the moving averages; create it with "
               "state, layout = jaxpar.train.noise_scale.with_noise_scale(*jaxpar.init_train_state(...))")
    if why:
        raise NoiseScaleError(f"make_train_step(noise_scale_every={every}): {why}.")


def _psum_rest(leaves: list, axes: list[tuple[str, ...]]) -> list:
    """``psum`` of every leaf over its ``axes``, one collective per group of leaves with the same axes."""
    out, groups = list(leaves), {}
    for i, ax in enumerate(axes):
        if ax:
            groups.setdefault(ax, []).append(i)
    for ax, idx in groups.items():
        summed = jax.lax.psum([leaves[i] for i in idx], _axis(ax))
        for i, s in zip(idx, summed):
            out[i] = s
    return out


def make_measured_loss_and_grad(loss_fn: Callable, layout, strategy) -> tuple[Callable, int]:
    """``(params, batch) -> (loss, grads, sq_small)`` (call it under ``jit``) and the number ``N`` of replicas.

    ``grads``: the global mean gradient in the strategy's gradient layout; ``sq_small``: the
    mean over the ``N`` replicas of each replica's squared gradient norm (its ``B / N`` rows)."""
    from .step import local_grads, make_model_loss

    mesh = layout.mesh
    sizes = dict(mesh.shape)
    axes = _measured_axes(mesh)
    n = math.prod(sizes[a] for a in axes)
    model_loss = make_model_loss(loss_fn, layout, strategy)
    treedef = jax.tree_util.tree_structure(layout.shapes)
    lays = treedef.flatten_up_to(manual_layout(layout.logical, layout.shapes, mesh, layout.rules, strategy.zero))
    ndims = [len(s.shape) for s in jax.tree.leaves(layout.shapes)]
    dims, p_axes, g_axes = [d for d, _, _ in lays], [p for _, p, _ in lays], [g for _, _, g in lays]
    p_specs = treedef.unflatten([_spec(d, p, nd) for (d, p, _), nd in zip(lays, ndims)])
    g_specs = treedef.unflatten([_spec(d, g, nd) for (d, _, g), nd in zip(lays, ndims)])
    rest = [tuple(a for a in axes if a not in g) for g in g_axes]   # summed with psum, not reduce-scattered
    local_rules, k = drop_axes(layout.rules, axes), strategy.microbatches

    def local(params, batch):
        with use_rules(mesh, local_rules):
            full = treedef.unflatten(bucketed_all_gather(jax.tree.leaves(params), dims, p_axes))
            loss, grads = local_grads(model_loss, full, batch, k)
        leaves = jax.tree.leaves(grads)
        sq_small = jax.lax.pmean(sum(jnp.sum(jnp.square(g)) for g in leaves), _axis(axes))   # N scalars
        out = _psum_rest(bucketed_reduce_scatter(leaves, dims, g_axes), rest)
        return jax.lax.pmean(loss, _axis(axes)), treedef.unflatten([g / n for g in out]), sq_small

    smap = jax.shard_map(local, mesh=mesh, in_specs=(p_specs, PartitionSpec(_axis(axes))),
                         out_specs=(PartitionSpec(), g_specs, PartitionSpec()), axis_names=set(axes),
                         check_vma=False)
    grad_shardings = named_shardings(layout.grads, mesh)

    def loss_and_grad(params, batch):
        loss, grads, sq_small = smap(params, batch)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings), sq_small

    return loss_and_grad, n


def _dispatch(normal: Callable, measure: Callable, every: int) -> Callable:
    """``step(state, batch)``: ``measure`` where ``state.step % every == 0``, else ``normal``. The step
    number is read from the device once and then counted on the host while the caller passes back
    the state it was given (any other state is read again)."""
    from .step import HostStep

    counter = HostStep()

    def step(state, batch):
        s = counter.read(state)
        new, metrics = (measure if s % every == 0 else normal)(state, batch)
        counter.advance(new, s + 1)
        return new, metrics

    step.jitted, step.lower = normal.jitted, normal.lower     # the usual program, for inspection
    step.measure = measure                                    # the measuring one (.jitted, .lower)
    return step


def make_noise_scale_step(normal: Callable, loss_fn: Callable, tx, layout, strategy, *, every: int, ema: float,
                          clip_norm, lr_schedule, skip_nonfinite: bool, donate: bool) -> Callable:
    """The train step ``normal`` (from :func:`~jaxpar.train.step.make_train_step`) with the measuring
    program on every ``every``-th step; call :func:`check_measurable` first."""
    from .step import _apply_update, _jit_step

    measured, n = make_measured_loss_and_grad(loss_fn, layout, strategy)

    def step(state, batch):
        b_big = jax.tree.leaves(batch)[0].shape[0]
        loss, grads, sq_small = measured(state.params, batch)
        sq_big = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        ns, metrics = update(state.stats[KEY], sq_small, sq_big, b_big // n, b_big, ema)
        return _apply_update(tx, state, loss, grads, clip_norm=clip_norm, lr_schedule=lr_schedule,
                             skip_nonfinite=skip_nonfinite, comm_metrics=metrics, stats={**state.stats, KEY: ns})

    return _dispatch(normal, _jit_step(step, layout, strategy, donate), every)
