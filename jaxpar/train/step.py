"""One jitted, donated train step for any strategy and any NNX model.

``loss_fn(model, batch) -> scalar`` is the user's loss on an NNX model. The step
does gradient accumulation over micro-batches (``lax.scan``) or runs the pipeline
schedule (``pipe > 1``), optional bf16 compute with fp32 master weights, global-norm
clipping, the optax update, and returns metrics (loss, grad norm, learning rate).
The model's stacked blocks (:func:`jaxpar.scan_blocks`) are where the strategy
takes over: explicit per-layer data-parallel collectives, or the pipeline cut.

Example::

    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models.mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> tx, strategy = optax.sgd(0.1), jaxpar.Strategy(zero=1)
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    >>> step = make_train_step(classifier_loss, tx, layout, strategy, clip_norm=1.0)
    >>> batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)}   # split over ``data``
    >>> state, metrics = step(state, batch)
    >>> int(state.step), sorted(metrics)
    (1, ['grad_norm', 'loss'])
    >>> state, again = step(state, batch)
    >>> float(again["loss"]) < float(metrics["loss"])
    True
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..batch import batch_sharding, check_batch, shard_batch, split_microbatches
from ..blocks import LAYERS, find_layer_calls, use_layer_runner
from ..data_parallel import DataParallelLayers, explicit_by_default
from ..mesh import data_axes, replicas
from ..rules import named_shardings, path_str, use_rules
from ..strategy import Strategy
from .state import StateLayout, TrainState

__all__ = ["make_train_step", "make_loss_and_grad", "make_model_loss", "explicit_data_parallel",
           "ExplicitDPError", "StrategyMismatchError", "layout_strategy", "batch_sharding", "check_batch", "shard_batch"]


class ExplicitDPError(ValueError):
    """``explicit_dp=True`` was asked where jaxpar cannot make the data-axis collectives explicit."""


def make_model_loss(loss_fn: Callable, layout: StateLayout, strategy: Strategy) -> Callable:
    """``(params, batch) -> loss``: the model rebuilt from ``params`` (cast to the
    strategy's compute dtype) and scored by ``loss_fn(model, batch)``."""
    graphdef = layout.graphdef

    def loss_of(params, batch):
        return loss_fn(nnx.merge(graphdef, strategy.cast(params)), batch)

    return loss_of


def _stacked_layers(layout: StateLayout) -> int | None:
    """The length of the ``layers`` axis of the stacked parameters (``None``: none, or several)."""
    flat = jax.tree_util.tree_flatten_with_path(layout.logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    shapes = jax.tree.leaves(layout.shapes)
    sizes = {shapes[i].shape[0] for i, (_, lg) in enumerate(flat) if tuple(lg)[:1] == (LAYERS,)}
    return sizes.pop() if len(sizes) == 1 else None


def _unrun_stacked(layout: StateLayout, sites) -> list[str]:
    """Paths of parameters stacked on ``layers`` that no stacked-layers call ran."""
    ran = {i for site in sites for i in site.leaves}
    flat = jax.tree_util.tree_flatten_with_path(layout.logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return [path_str(path) for i, (path, lg) in enumerate(flat) if tuple(lg)[:1] == (LAYERS,) and i not in ran]


def explicit_data_parallel(asked: bool | None, loss_fn: Callable, params: Any, batch: Any,
                           layout: StateLayout, strategy: Strategy) -> bool:
    """Whether the step makes the data-axis collectives explicit (:mod:`jaxpar.data_parallel`).

    They are explicit per layer of the model's stacked blocks (:func:`jaxpar.scan_blocks`);
    the other parameters are left to XLA. ``asked=None`` decides with
    :func:`~jaxpar.data_parallel.explicit_by_default` when every stacked parameter runs through
    ``scan_blocks``; ``asked=True`` raises :class:`ExplicitDPError` saying why where it cannot apply.
    """
    mesh = layout.mesh
    if asked is False:
        return False
    sizes = dict(mesh.shape)
    axes = [a for a in data_axes(mesh) if sizes[a] > 1]
    merged = lambda p, b: loss_fn(nnx.merge(layout.graphdef, p), b)   # noqa: E731  (p: in the compute dtype)
    sites = find_layer_calls(merged, strategy.cast(params), batch)
    unrun = _unrun_stacked(layout, sites)
    if asked is None:
        return bool(axes and sites and not unrun) and explicit_by_default(sizes, strategy.zero)
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


def make_loss_and_grad(loss_fn: Callable, layout: StateLayout, strategy: Strategy, *,
                       explicit_dp: bool | None = False) -> Callable:
    """``(params, batch) -> (loss, grads)`` with accumulation and grads in their layout
    (call it under ``jit`` and :func:`jaxpar.use_rules`); ``explicit_dp`` as in :func:`make_train_step`."""
    mesh = layout.mesh
    if strategy.compression is not None:
        from ..compression import CompressionError

        raise CompressionError(
            f"make_loss_and_grad with compression={strategy.compression.name!r}: this loss-and-grad reduces "
            "gradients uncompressed, so the codec would be silently ignored. Use make_train_step (or "
            "jaxpar.train.compressed.make_compressed_loss_and_grad), which runs the compressed exchange.")
    grad_shardings = named_shardings(layout.grads, mesh)
    model_loss = make_model_loss(loss_fn, layout, strategy)
    runner = DataParallelLayers(mesh, layout.rules, strategy.zero)

    def grad_of(params, batch, explicit):
        with use_layer_runner(runner if explicit else None):
            loss, grads = jax.value_and_grad(model_loss)(params, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)

    def loss_and_grad(params, batch):
        k = strategy.microbatches
        mbs = split_microbatches(batch, k, mesh) if k > 1 else None
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), mbs) if k > 1 else batch
        explicit = explicit_data_parallel(explicit_dp, loss_fn, params, one, layout, strategy)
        if k == 1:
            return grad_of(params, batch, explicit)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings)

        def body(carry, mb):
            loss, grads = grad_of(params, mb, explicit)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None

        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mbs)
        return loss / k, jax.tree.map(lambda g: g / k, grads)

    return loss_and_grad


def _local_microbatches(batch: Any, k: int) -> Any:
    """``[b, ...] -> [k, b/k, ...]`` with micro-batch ``i`` = local rows ``i, i+k, ...``
    (as :func:`jaxpar.batch.split_microbatches` does globally)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def local_grads(model_loss: Callable, params: Any, batch: Any, k: int) -> tuple[jax.Array, Any]:
    """This replica's fp32 mean loss and gradient over its own rows (inside a ``shard_map`` manual
    over the data axes), accumulated over ``k`` micro-batches."""
    grad = jax.value_and_grad(model_loss)
    if k == 1:
        loss, grads = grad(params, batch)
        return loss.astype(jnp.float32), jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def body(carry, mb):
        loss, g = grad(params, mb)
        return (carry[0] + loss, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry[1], g)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), _local_microbatches(batch, k))
    return loss / k, jax.tree.map(lambda g: g / k, grads)


class HostStep:
    """The step number of the state a step function is given, without a device round trip per
    step: read once, then counted while the caller passes back the state it was returned
    (any other state is read again). For step functions that pick a program by step number."""

    def __init__(self):
        self._array, self._step = None, None

    def read(self, state) -> int:
        return self._step if state.step is self._array else int(jax.device_get(state.step))

    def advance(self, new_state, step: int) -> None:
        self._array, self._step = new_state.step, step


def _apply_update(tx, state: TrainState, loss, grads, *, clip_norm, lr_schedule, skip_nonfinite,
                  comm: Any = None, comm_metrics: dict | None = None, stats: Any = None):
    """Clip, update, and (``skip_nonfinite``) keep the old state when the loss / norm is not finite.
    ``comm``: the codec state after this step's exchange (compression), ``stats``: the running
    measurements after this step's (the noise scale), kept like the rest."""
    gnorm = optax.tree.norm(grads)
    if clip_norm is not None:
        scale = jnp.minimum(1.0, clip_norm / (gnorm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    comm = state.comm if comm is None else comm
    stats = state.stats if stats is None else stats
    metrics = {"loss": loss, "grad_norm": gnorm, **(comm_metrics or {})}
    if skip_nonfinite:
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        params, opt_state, comm, stats = jax.tree.map(
            lambda new, old: jnp.where(ok, new, old), (params, opt_state, comm, stats),
            (state.params, state.opt_state, state.comm, state.stats))
        metrics["skipped"] = jnp.logical_not(ok)
    if lr_schedule is not None:
        metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    return TrainState(state.step + 1, params, opt_state, comm, stats), metrics


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, layout: StateLayout,
                    strategy: Strategy | None = None, *, clip_norm: float | None = None,
                    log_lr: Callable | None = None, donate: bool = True,
                    explicit_dp: bool | None = None, skip_nonfinite: bool = False,
                    noise_scale_every: int | None = None, noise_scale_ema: float = 0.95,
                    steps_per_call: int = 1, **removed) -> Callable:
    """Build ``step(state, batch) -> (state, metrics)``, jitted with the layout's shardings.

    The step runs the strategy the layout was built for (``layout.strategy``, from
    :func:`jaxpar.init_train_state`). ``explicit_dp=True`` makes the data-axis collectives of
    the model's stacked blocks explicit (:mod:`jaxpar.data_parallel`; an :class:`ExplicitDPError`
    says why where it cannot), ``False`` leaves them to XLA, and ``None`` (default) decides
    (:func:`explicit_data_parallel`). With a ``pipe`` mesh axis the step runs the strategy's
    pipeline schedule on the model, cut at its stacked blocks (:mod:`jaxpar.pipeline.cut`),
    with ``loss_fn`` on the last stage.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar`` on the NNX model.
      tx: the optax optimizer the state was created with; its own learning rate (and schedule)
        drives the updates.
      layout: the :class:`~jaxpar.StateLayout` from :func:`jaxpar.init_train_state`.
      strategy: optional; when given it must be the layout's strategy (a
        :class:`StrategyMismatchError` names both otherwise).
      clip_norm: clip the averaged gradient to this global norm (``None``: no clipping).
      log_lr: ``step -> learning rate``, logged as ``metrics["lr"]``; it is only logged (the
        updates follow ``tx``).
      donate: donate the input state's buffers.
      explicit_dp: as above.
      skip_nonfinite: a step whose loss or gradient norm is NaN / inf keeps the params and
        optimizer state unchanged (the step counter still advances) and reports
        ``metrics["skipped"] = True``.
      noise_scale_every: every ``k``-th step (``state.step % k == 0``) runs a second program that
        also measures the gradient noise scale (:mod:`jaxpar.train.noise_measure`), with moving
        averages of decay ``noise_scale_ema`` in ``state.stats`` (create the state with
        :func:`jaxpar.train.noise_scale.with_noise_scale`).
      noise_scale_ema: see ``noise_scale_every``.
      steps_per_call: ``K`` (PipeDream-2BW and weight stashing): ``step(state, batches)`` runs
        ``K`` optimizer steps of the no-flush pipeline in one program, ``batches`` stacked
        ``[K, B, ...]``, metrics ``[K]``.
      **removed: options that no longer exist raise a ``TypeError`` that says what replaced them.

    Returns:
      The jitted step function (with ``.lower`` for ahead-of-time compilation).
    """
    _refuse_removed(removed)
    strategy = layout_strategy(layout, strategy)
    lr_schedule = log_lr
    mesh = layout.mesh
    if noise_scale_every is not None:
        from .noise_measure import check_measurable   # the noise scale loads only when used

        check_measurable(layout, strategy, noise_scale_every, noise_scale_ema)
    if strategy.schedule == "pipedream":    # weight stashing: per-stage updates inside the pipeline
        from ..pipeline.stashed import make_stashing_step    # (check_measurable refused the noise scale: pipe > 1)

        return make_stashing_step(loss_fn, tx, layout, strategy, steps_per_call, clip_norm=clip_norm,
                                  lr_schedule=lr_schedule, donate=donate, skip_nonfinite=skip_nonfinite,
                                  explicit_dp=explicit_dp)
    two_bw = strategy.schedule == "pipedream-2bw"
    if two_bw:      # PipeDream-2BW: the gradient at W(t-1) (state.versions) updates W(t)
        from ..pipeline.asynchronous import check_two_bw_step

        check_two_bw_step(strategy, layout)
    if steps_per_call != 1:     # several optimizer steps per call: the 2BW pipeline without flushes
        from ..pipeline.nonstop import check_steps_per_call, make_two_bw_steps

        check_steps_per_call(strategy, steps_per_call)
        if explicit_dp:
            raise ExplicitDPError(f"explicit_dp=True with steps_per_call={steps_per_call}: the no-flush pipeline "
                                  "runs its stages' layers inside the pipeline executor, where the data-axis "
                                  "collectives are left to XLA. Use explicit_dp=None or False.")
        return make_two_bw_steps(loss_fn, tx, layout, strategy, steps_per_call, clip_norm=clip_norm,
                                 lr_schedule=lr_schedule, donate=donate, skip_nonfinite=skip_nonfinite)
    if strategy.sync is not None or replicas(mesh) > 1:
        from .relaxed import make_relaxed_train_step   # relaxed synchronisation loads only when used

        return make_relaxed_train_step(loss_fn, tx, layout, strategy, clip_norm=clip_norm, lr_schedule=lr_schedule,
                                       donate=donate, explicit_dp=explicit_dp, skip_nonfinite=skip_nonfinite)
    if strategy.compression is not None:
        return _compressed_train_step(loss_fn, tx, layout, strategy, clip_norm=clip_norm, lr_schedule=lr_schedule,
                                      donate=donate, explicit_dp=explicit_dp, skip_nonfinite=skip_nonfinite)
    loss_and_grad = _loss_and_grad(loss_fn, layout, strategy, explicit_dp)

    def step(state: TrainState, batch):
        with use_rules(mesh, layout.rules):
            loss, grads = loss_and_grad(state.versions if two_bw else state.params, batch)
        new, metrics = _apply_update(tx, state, loss, grads, clip_norm=clip_norm, lr_schedule=lr_schedule,
                                     skip_nonfinite=skip_nonfinite)
        if two_bw:      # W(t) becomes the older version (kept as it was when the step is skipped)
            older = state.params if not skip_nonfinite else jax.tree.map(
                lambda w, o: jnp.where(metrics["skipped"], o, w), state.params, state.versions)
            new = new._replace(versions=older)
        return new, metrics

    jitted = _jit_step(step, layout, strategy, donate)
    if noise_scale_every is None:
        return jitted
    from .noise_measure import make_noise_scale_step

    return make_noise_scale_step(jitted, loss_fn, tx, layout, strategy, every=noise_scale_every,
                                 ema=noise_scale_ema, clip_norm=clip_norm, lr_schedule=lr_schedule,
                                 skip_nonfinite=skip_nonfinite, donate=donate)


class StrategyMismatchError(ValueError):
    """``make_train_step`` was given another strategy than the one its layout was built for."""


def _fingerprint(value: Any) -> Any:
    """A comparable form of a strategy field: dataclasses by field, functions by qualified name
    (codecs and sync kinds hold closures that a second factory call creates anew)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(_fingerprint(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return tuple(_fingerprint(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _fingerprint(v)) for k, v in value.items()))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    return value


def layout_strategy(layout: StateLayout, strategy: Strategy | None = None) -> Strategy:
    """The strategy a step on ``layout`` runs: the layout's own.

    Args:
      layout: a :class:`~jaxpar.StateLayout`.
      strategy: ``None``, or a strategy that must equal ``layout.strategy``.

    Returns:
      ``layout.strategy``.

    Raises:
      StrategyMismatchError: ``strategy`` differs from the layout's, naming both.
    """
    if strategy is None or _fingerprint(strategy) == _fingerprint(layout.strategy):
        return layout.strategy
    sizes = dict(layout.mesh.shape)
    fields = [f for f in Strategy.__dataclass_fields__
              if _fingerprint(getattr(strategy, f)) != _fingerprint(getattr(layout.strategy, f))]
    raise StrategyMismatchError(
        f"make_train_step(strategy={strategy.name(sizes)!r}), but the layout was built by init_train_state for "
        f"strategy {layout.strategy.name(sizes)!r} (fields that differ: {', '.join(fields)}). The state's shardings "
        "and parts come from the layout's strategy, so the step runs that one. Pass the same strategy to "
        "init_train_state, or leave make_train_step's strategy out.")


def _refuse_removed(removed: dict) -> None:
    if "lr_schedule" in removed:
        raise TypeError("make_train_step(lr_schedule=...) was removed: it only logged metrics['lr'] and never "
                        "changed the updates, which follow tx. Build tx with the schedule (e.g. "
                        "optax.adamw(schedule)) and pass log_lr=schedule to log it.")
    if removed:
        raise TypeError(f"make_train_step got unexpected keyword arguments {sorted(removed)}.")


def _loss_and_grad(loss_fn: Callable, layout: StateLayout, strategy: Strategy, explicit_dp) -> Callable:
    """The pipelined loss-and-grad with a ``pipe`` axis, :func:`make_loss_and_grad` otherwise."""
    mesh = layout.mesh
    if dict(mesh.shape).get("pipe", 1) == 1:
        return make_loss_and_grad(loss_fn, layout, strategy, explicit_dp=explicit_dp)
    if explicit_dp:
        raise ExplicitDPError(f"explicit_dp=True with pipe={mesh.shape['pipe']}: a pipeline stage runs its "
                              "layers inside the pipeline executor, where the data-axis collectives are left "
                              "to XLA. Use explicit_dp=None or False with pipe > 1.")
    from ..pipeline.piped import make_pipeline_loss_and_grad   # pipelines load only when used

    return make_pipeline_loss_and_grad(loss_fn, layout.graphdef, mesh, layout.rules, layout.params,
                                       layout.grads, strategy, num_layers=_stacked_layers(layout))


def _jit_step(step: Callable, layout: StateLayout, strategy: Strategy, donate: bool) -> Callable:
    mesh = layout.mesh
    jitted = jax.jit(step, in_shardings=(layout.shardings(), batch_sharding(mesh)),
                     out_shardings=(layout.shardings(), NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=(0,) if donate else ())

    def checked(state, batch):
        check_batch(batch, mesh, strategy.microbatches)
        return jitted(state, batch)

    checked.jitted = jitted  # for .lower(...).compile() inspection
    checked.lower = jitted.lower
    return checked


def _compressed_train_step(loss_fn, tx, layout: StateLayout, strategy: Strategy, *, clip_norm, lr_schedule,
                           donate, explicit_dp, skip_nonfinite) -> Callable:
    """The step with ``strategy.compression``: the codec's exchange replaces the data-axis reduction."""
    from ..compression import CompressionError
    from .compressed import make_compressed_loss_and_grad   # compression loads only when used

    if layout.comm_init is tuple:      # the layout default: init_train_state saw no codec
        raise CompressionError(
            f"make_train_step with compression={strategy.compression.name!r}, but the layout was made without "
            "it (init_train_state with another strategy), so the train state has no place for the codec's "
            "state. Create the state with init_train_state(..., strategy) using this same strategy.")

    if explicit_dp:
        raise ExplicitDPError(f"explicit_dp=True with compression={strategy.compression.name!r}: the compressed "
                              "exchange already makes the data-axis collectives explicit (once per step, after "
                              "accumulation). Use explicit_dp=None with compression.")
    b1 = getattr(strategy.compression, "optimizer_momentum", 0.0)
    if b1 and clip_norm is not None:
        raise CompressionError(
            f"clip_norm={clip_norm} with compression={strategy.compression.name}(optimizer_momentum={b1}): with "
            "1-bit Adam the gradient handed to Adam carries the moment's compression error times 1 / (1 - b1), so "
            "its norm says little and a clip after the exchange would shrink every step. Clip each replica's "
            f"gradient before the codec instead: Strategy(local_clip={clip_norm}) and clip_norm=None.")
    loss_and_grad, _ = make_compressed_loss_and_grad(loss_fn, layout, strategy)

    def step(state: TrainState, batch):
        loss, grads, comm, comm_metrics = loss_and_grad(state.params, batch, state.comm, state.step)
        return _apply_update(tx, state, loss, grads, clip_norm=clip_norm, lr_schedule=lr_schedule,
                             skip_nonfinite=skip_nonfinite, comm=comm, comm_metrics=comm_metrics)

    return _jit_step(step, layout, strategy, donate)
