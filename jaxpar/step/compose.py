"""One train step for any strategy and any NNX model, composed from small parts.

``make_train_step(loss_fn, tx, layout)`` runs the strategy the layout was built for. It checks
the compatibility table (:mod:`jaxpar.compat.table`), then builds the program of the strategy's shape
(:func:`program_kind`) from four parts:

* the **gradient** (:mod:`jaxpar.step.grads`): XLA's GSPMD program or explicit per-layer
  collectives (:func:`~jaxpar.step.grads.global_grads`), the pipeline executor running the
  schedule table (:func:`~jaxpar.step.grads.pipeline_grads`), or each data-parallel replica's own
  gradient (:func:`~jaxpar.step.grads.replica_grads`), accumulated over the micro-batches;
* the **exchange** (:mod:`jaxpar.step.exchange`) of per-replica gradients: exact, a codec's, or
  measured (the gradient noise scale, every ``k`` steps in a second program);
* the **update** (:mod:`jaxpar.step.update`): clip, optax, skip a non-finite step, log the lr;
  PipeDream-2BW's one-step delay; weight stashing's per-stage updates inside the pipeline; the
  outer step of DiLoCo / EASGD (:mod:`jaxpar.step.relaxed_steps`);
* the **program** (:mod:`jaxpar.step.program`): one ``jax.jit`` with the layout's shardings and
  rules, wrapped in a :class:`~jaxpar.step.program.TrainStep` that picks the program per step.

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

from functools import partial
from typing import Callable, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.batch import batch_sharding, check_batch, shard_batch
from jaxpar.compat.table import Setting
from jaxpar.mesh import batch_axes
from jaxpar.parallel.moe import MoEError, use_router_bias
from jaxpar.step.balancing import finish as finish_moe
from jaxpar.strategy import Strategy
from jaxpar.step.exchange import compressed_exchange, exact_exchange, measured_exchange, run_exchange
from jaxpar.step.grads import ExplicitDPError, global_grads, manual_specs, pipeline_grads, replica_grads
from jaxpar.step.init import raise_table_problems
from jaxpar.step.program import TrainStep, jit_program
from jaxpar.run.report import check_int
from jaxpar.step.noise_scale import step_measure
from jaxpar.step.router_bias import KEY as BIAS, has_router_bias, step_rate
from jaxpar.step.state import StateLayout, StrategyMismatchError, layout_strategy
from jaxpar.step.update import Update, apply_update, delayed_update

__all__ = ["make_train_step", "StepOptions", "ExplicitDPError", "StrategyMismatchError", "batch_sharding",
           "check_batch", "shard_batch"]


class StepOptions(NamedTuple):
    """``make_train_step``'s options that shape the programs (the update's are :class:`~.update.Update`)."""

    explicit_dp: bool | None = None
    steps_per_call: int = 1
    noise_scale_every: int | None = None
    noise_scale_ema: float = 0.95
    donate: bool = True
    router_bias_rate: float | None = None


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, layout: StateLayout,
                    strategy: Strategy | None = None, *, clip_norm: float | None = None,
                    log_lr: Callable | None = None, donate: bool = True,
                    explicit_dp: bool | None = None, skip_nonfinite: bool = False,
                    noise_scale_every: int | None = None, noise_scale_ema: float | None = None,
                    steps_per_call: int = 1, router_bias_rate: float | None = None, **removed) -> TrainStep:
    """Build ``step(state, batch) -> (state, metrics)``, jitted with the layout's shardings.

    The step runs the strategy the layout was built for (``layout.strategy``, from
    :func:`jaxpar.init_train_state`). ``explicit_dp=True`` makes the data-axis collectives of
    the model's stacked blocks explicit (:mod:`jaxpar.parallel.data_parallel`; an :class:`ExplicitDPError`
    says why where it cannot), ``False`` leaves them to XLA, and ``None`` (default) decides
    (:func:`~jaxpar.step.grads.explicit_data_parallel`). With a ``pipe`` mesh axis the step runs the strategy's
    pipeline schedule on the model, cut at its stacked blocks (:mod:`jaxpar.parallel.pipeline.cut`),
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
      noise_scale_every: the older spelling of ``with_noise_scale(state, layout, every=k)``, which
        switches the gradient noise scale on (:mod:`jaxpar.step.noise_scale`: every ``k``-th step runs
        a second program that also measures it); kept for a state part added without ``every``.
      noise_scale_ema: likewise, ``with_noise_scale(..., ema=)``.
      steps_per_call: ``K``: ``step(state, batches)`` runs ``K`` optimizer steps in one program,
        ``batches`` stacked ``[K, B, ...]``, every metric ``[K]``. PipeDream-2BW and weight
        stashing run ``K`` steps of their no-flush pipeline; the other strategies scan their step
        (the same updates as ``K`` calls).
      router_bias_rate: the older spelling of ``with_router_bias(state, layout, shape, rate=)``
        (aux-loss-free MoE balancing: after each step, every MoE layer's router bias moves by the
        rate towards balance, from the step's loads); kept for a bias added without its rate.
      **removed: options that no longer exist raise a ``TypeError`` that says what replaced them.

    Returns:
      The :class:`~jaxpar.step.program.TrainStep` (``step.lower`` for ahead-of-time compilation,
      ``step.programs`` for every program it runs).
    """
    _refuse_removed(removed)
    layout_strategy(layout, strategy)      # a strategy other than the layout's raises
    update = Update(tx, clip_norm=clip_norm, skip_nonfinite=skip_nonfinite, log_lr=log_lr)
    every, ema = step_measure(layout, noise_scale_every, noise_scale_ema) or (None, 0.95)   # the part's options
    opts = StepOptions(explicit_dp, steps_per_call, every, ema, donate, step_rate(layout, router_bias_rate))
    _check_step(layout, update, opts)
    return _BUILDERS[program_kind(layout.strategy, dict(layout.mesh.shape), steps_per_call)](
        loss_fn, layout, update, opts)


def program_kind(strategy: Strategy, mesh_sizes: dict, steps_per_call: int = 1) -> str:
    """Which program shape a step of ``strategy`` runs.

    Args:
      strategy: the layout's strategy.
      mesh_sizes: the mesh's axis sizes.
      steps_per_call: optimizer steps per call.

    Returns:
      ``'stashing'`` (weight stashing: each stage updates inside the pipeline), ``'no-flush'``
      (several PipeDream-2BW steps in one program), ``'replicas'`` (relaxed synchronisation over
      ``replica``) or ``'per-step'`` (one gradient, one exchange, one update per step; K steps
      per call scanned in one program).
    """
    if strategy.schedule == "pipedream":
        return "stashing"
    if steps_per_call != 1 and strategy.schedule == "pipedream-2bw" and mesh_sizes.get("pipe", 1) > 1:
        return "no-flush"
    if strategy.sync is not None or mesh_sizes.get("replica", 1) > 1:
        return "replicas"
    return "per-step"


def _check_step(layout: StateLayout, update: Update, opts: StepOptions) -> None:
    """``steps_per_call``'s value, the compatibility table's refusals for this step
    (:mod:`jaxpar.compat.table`), then the checks of the options' own values."""
    strategy = layout.strategy
    check_int("make_train_step", "steps_per_call", opts.steps_per_call, 1)
    raise_table_problems(Setting(strategy, dict(layout.mesh.shape), explicit_dp=opts.explicit_dp,
                                 steps_per_call=opts.steps_per_call, clip_norm=update.clip_norm,
                                 noise_scale_every=opts.noise_scale_every))
    if opts.noise_scale_every is not None:
        from jaxpar.step.noise_scale import check_measurable   # the noise scale loads only when used

        check_measurable(layout, opts.noise_scale_every, opts.noise_scale_ema)
    if strategy.schedule == "pipedream-2bw":
        from jaxpar.parallel.pipeline.two_bw import check_two_bw_step

        check_two_bw_step(strategy, layout)
    kind = program_kind(strategy, dict(layout.mesh.shape), opts.steps_per_call)
    if has_router_bias(layout) and (kind != "per-step" or strategy.schedule == "pipedream-2bw"):
        raise MoEError(f"the train state keeps a router bias (aux-loss-free balancing: with_router_bias), which "
                       f"moves by each step's loads, and schedule={strategy.schedule!r} / sync="
                       f"{getattr(strategy.sync, 'name', None)!r} runs steps on older or per-replica weights "
                       "(the loads of no single step). Use a flush schedule and synchronous data parallelism, or "
                       "the load-balancing loss (aux_weight) instead.")


def _per_step(loss_fn: Callable, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """One gradient, one exchange and one update per step; with the noise scale, a second program
    measures every ``noise_scale_every`` steps; with ``steps_per_call`` K, one program scans K steps."""
    mesh, strategy = layout.mesh, layout.strategy
    step = _step_fn(loss_fn, layout, update, opts, measure=False)
    if opts.steps_per_call != 1:
        return _stacked_steps(scan_steps(step), layout, opts, None)
    programs = {"step": jit_program(step, layout, batch_sharding(mesh), donate=opts.donate)}
    choose = None
    if opts.noise_scale_every is not None:
        measure = _step_fn(loss_fn, layout, update, opts, measure=True)
        programs["measure"] = jit_program(measure, layout, batch_sharding(mesh), donate=opts.donate)
        every = opts.noise_scale_every
        choose = lambda s: "measure" if s % every == 0 else "step"   # noqa: E731
    check = lambda batch: check_batch(batch, mesh, strategy.microbatches)   # noqa: E731
    return TrainStep(programs, check_batch=check, choose=choose, batch_sharding=batch_sharding(mesh))


def scan_steps(step: Callable) -> Callable:
    """``run(state, batches)``: ``step`` over the stacked batches ``[K, B, ...]`` in one ``lax.scan``
    (metrics ``[K]``), the same K optimizer steps as K calls."""
    def run(state, batches):
        return jax.lax.scan(step, state, batches)

    return run


def _step_fn(loss_fn: Callable, layout: StateLayout, update: Update, opts: StepOptions, *, measure: bool):
    """``step(state, batch) -> (state, metrics)``: gradient (at ``W(t-1)`` for PipeDream-2BW), exchange, update."""
    strategy, mesh = layout.strategy, layout.mesh
    piped = dict(mesh.shape).get("pipe", 1) > 1
    exchange = _exchange(layout, measure)
    if piped:
        grad = pipeline_grads(loss_fn, layout, per_replica=exchange is not None)
    elif exchange is not None:
        grad = replica_grads(loss_fn, layout, with_metrics=True)
    else:
        grad = global_grads(loss_fn, layout, explicit_dp=opts.explicit_dp, with_metrics=True)
    reduce = run_exchange(exchange, layout) if exchange is not None else None
    delayed = piped and strategy.schedule == "pipedream-2bw"
    rule = delayed_update if delayed else apply_update
    replicas_ = manual_specs(layout).replicas if measure else 1
    biased = has_router_bias(layout)

    def step(state, batch):
        with use_router_bias(state.stats[BIAS] if biased else None):
            loss, grads, *reported = grad(state.versions if delayed else state.params, batch)
        parts, metrics = {}, dict(reported[0]) if reported else {}     # what the loss reported
        if reduce is not None:
            grads, codec_state, exchanged = reduce(grads, state.codec, state.step)
            metrics = {**metrics, **exchanged}
            parts = {"codec": codec_state} if strategy.compression is not None else {}
        if measure:
            parts["stats"], metrics = _noise_scale_stats(state, batch, metrics, replicas_, opts.noise_scale_ema)
        stats, metrics = finish_moe(parts.get("stats", state.stats), metrics, opts.router_bias_rate)   # MoE's part
        if biased:
            parts["stats"] = stats
        return rule(update, state, loss, grads, parts=parts, metrics=metrics)

    return step


def _exchange(layout: StateLayout, measure: bool):
    """The exchange of the program (``None``: XLA's exact one, inside the gradient)."""
    strategy = layout.strategy
    if strategy.compression is None and not measure:
        return None
    man = manual_specs(layout)
    if strategy.compression is not None:
        from jaxpar.step.compressed import compression_plan   # compression loads only when used

        inner = compressed_exchange(compression_plan(strategy.compression, layout, strategy.zero),
                                    strategy.local_clip)
    else:
        inner = exact_exchange(man)
    return measured_exchange(inner, man) if measure else inner


def _noise_scale_stats(state, batch, metrics: dict, replicas_: int, ema: float) -> tuple[dict, dict]:
    """The noise scale's moving averages after this step's two squared norms, and the metrics."""
    from jaxpar.step.noise_scale import KEY, update as update_noise_scale

    metrics = dict(metrics)
    sq_small, sq_big = metrics.pop("grad_sq_small"), metrics.pop("grad_sq_big")
    b_big = jax.tree.leaves(batch)[0].shape[0]
    stats, measured = update_noise_scale(state.stats[KEY], sq_small, sq_big, b_big // replicas_, b_big, ema)
    return {**state.stats, KEY: stats}, {**metrics, **measured}


def _stashing(loss_fn, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """Weight stashing: each stage applies ``tx`` to its own weights inside the pipeline."""
    from jaxpar.step.stashing_step import make_stashing_step   # pipelines load only when used

    run, program = make_stashing_step(loss_fn, update.tx, layout, opts.steps_per_call, log_lr=update.log_lr,
                                      skip_nonfinite=update.skip_nonfinite)
    return _stacked_steps(run, layout, opts, program)


def _no_flush(loss_fn, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """``steps_per_call`` PipeDream-2BW steps of the no-flush pipeline, the update between them."""
    from jaxpar.step.no_flush_steps import make_two_bw_steps

    run, program = make_two_bw_steps(loss_fn, layout, opts.steps_per_call, partial(apply_update, update))
    return _stacked_steps(run, layout, opts, program)


def _stacked_steps(run: Callable, layout: StateLayout, opts: StepOptions, program) -> TrainStep:
    """The step of a program that runs ``opts.steps_per_call`` optimizer steps on stacked batches
    ``[K, B, ...]`` (metrics ``[K]``); with ``K = 1`` it takes one batch and returns one step's metrics."""
    from jaxpar.step.no_flush_steps import check_stacked_batches

    mesh, m, k = layout.mesh, layout.strategy.microbatches, opts.steps_per_call
    if k == 1:
        def one(state, batch):
            new, metrics = run(state, jax.tree.map(lambda a: a[None], batch))
            return new, jax.tree.map(lambda a: a[0], metrics)

        return TrainStep({"step": jit_program(one, layout, batch_sharding(mesh), donate=opts.donate)},
                         check_batch=lambda b: check_batch(b, mesh, m), batch_sharding=batch_sharding(mesh),
                         pipeline_program=program)
    stacked = NamedSharding(mesh, PartitionSpec(None, batch_axes(mesh) or None))
    return TrainStep({"step": jit_program(run, layout, stacked, donate=opts.donate)},
                     check_batch=lambda b: check_stacked_batches(b, mesh, m, k), batch_sharding=stacked,
                     pipeline_program=program)


def _replicas(loss_fn, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    from jaxpar.step.relaxed_steps import relaxed_train_step   # relaxed synchronisation loads only when used

    return relaxed_train_step(loss_fn, layout, update, explicit_dp=opts.explicit_dp, donate=opts.donate)


_BUILDERS = {"per-step": _per_step, "stashing": _stashing, "no-flush": _no_flush, "replicas": _replicas}


def _refuse_removed(removed: dict) -> None:
    if "lr_schedule" in removed:
        raise TypeError("make_train_step(lr_schedule=...) was removed: it only logged metrics['lr'] and never "
                        "changed the updates, which follow tx. Build tx with the schedule (e.g. "
                        "optax.adamw(schedule)) and pass log_lr=schedule to log it.")
    if removed:
        raise TypeError(f"make_train_step got unexpected keyword arguments {sorted(removed)}.")


