"""One train step for any strategy and any NNX model, composed from small parts.

``make_train_step(loss_fn, tx, layout)`` runs the strategy the layout was built for. It checks the
compatibility table (:mod:`jaxpar.compat._table`), picks the program shape (:func:`program_kind`)
and composes the **gradient** (:func:`_gradient`), the **exchange** (:func:`_exchange`), the
**update** (:func:`_rule`: the one :func:`~jaxpar.step._update.apply_update`), the ``stats``
parts after the step (MoE's load metrics, then each state part's ``after_step``) and the **program**
(:func:`~jaxpar.step._program.jit_program` in a :class:`~jaxpar.step.TrainStep`). PipeDream's
no-flush pipelines and the local kinds (DiLoCo / local SGD / EASGD) put the update inside a
larger program.

Example::

    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
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

from jaxpar.batch import batch_sharding, check_batch, check_stacked_batches, shard_batch
from jaxpar.compat._settings import replicas_on
from jaxpar.compat._table import Setting, raise_problems
from jaxpar.mesh import batch_axes
from jaxpar.rules import axes_of, path_str
from jaxpar.step._balancing import finish as finish_moe
from jaxpar.strategy import Strategy
from jaxpar.step._exchange import compressed_exchange, compression_plan, exact_exchange, measured_exchange, run_exchange
from jaxpar.adapters._blocks import use_offloaded_activations
from jaxpar.parallel._fp8 import check_fp8
from jaxpar.parallel._offload import check_activations, host_placement, stream_in
from jaxpar.step._grads import ExplicitDPError, global_grads, manual_specs, pipeline_grads, replica_grads
from jaxpar.step._init import older_versions_of
from jaxpar.step._program import TrainStep, jit_program
from jaxpar.step._replica_mean import is_local, replica_parts
from jaxpar.step._state import (StateLayout, StrategyMismatchError, layout_strategy, part_setting, parts_after_step,
                                stats_parts, use_parts)
from jaxpar.step._update import Update, apply_update, clip_norm_problem, delayed
from jaxpar.errors import AsyncPipelineError, LoopError, StashingError, StepError, check_int


class StepOptions(NamedTuple):
    """``make_train_step``'s options that shape the programs (the update's are :class:`~._update.Update`)."""

    explicit_dp: bool | None = None
    steps_per_call: int = 1
    donate: bool = True


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, layout: StateLayout,
                    strategy: Strategy | None = None, *, clip_norm: float | None = None, donate: bool = True,
                    explicit_dp: bool | None = None, skip_nonfinite: bool = False,
                    steps_per_call: int = 1, grad_norm: bool = True) -> TrainStep:
    """Build ``step(state, batch) -> (state, metrics)``, jitted with the layout's shardings.

    The step runs the strategy the layout was built for (``layout.strategy``, from
    :func:`jaxpar.init_train_state`). ``explicit_dp=True`` makes the data-axis collectives of
    the model's stacked blocks explicit (:mod:`jaxpar.parallel._data_parallel`; an :class:`ExplicitDPError`
    says why where it cannot), ``False`` leaves them to XLA, and ``None`` (default) decides
    (:func:`~jaxpar.step._grads.explicit_data_parallel`). With a ``pipe`` mesh axis the step runs the strategy's
    pipeline schedule on the model, cut at its stacked blocks (:mod:`jaxpar.parallel.pipeline._cut`),
    with ``loss_fn`` on the last stage.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar`` on the NNX model.
      tx: the optax optimizer the state was created with; its own learning rate (and schedule)
        drives the updates. Built with ``optax.inject_hyperparams`` (``learning_rate=schedule``), its state
        holds each update's learning rate, which the step logs as ``metrics["lr"]``.
      layout: the :class:`~jaxpar.StateLayout` from :func:`jaxpar.init_train_state`.
      strategy: optional; when given it must be the layout's strategy (a
        :class:`StrategyMismatchError` names both otherwise).
      clip_norm: clip the averaged gradient to this global norm (``None``: no clipping).
      donate: donate the input state's buffers.
      explicit_dp: as above.
      skip_nonfinite: a step whose loss or gradient norm is NaN / inf keeps the params and
        optimizer state unchanged (the step counter still advances) and reports
        ``metrics["skipped"] = True``.
      steps_per_call: ``K``: ``step(state, batches)`` runs ``K`` optimizer steps in one program,
        ``batches`` stacked ``[K, B, ...]``, every metric ``[K]``. PipeDream-2BW and weight
        stashing run ``K`` steps of their no-flush pipeline; the other strategies scan their step
        (the same updates as ``K`` calls).
      grad_norm: report ``metrics["grad_norm"]``, the gradient's global norm. ``False`` leaves that
        pass over the gradients out where neither ``clip_norm`` nor ``skip_nonfinite`` needs it (as
        Levanter's step between its logging steps); only the one-update-per-step programs take it.

    Returns:
      The :class:`~jaxpar.step.TrainStep` (``step.lower`` for ahead-of-time compilation,
      ``step.programs`` for every program it runs).

    Raises:
      StepError: ``clip_norm`` is not None or a finite number > 0, ``loss_fn`` is not a
        function, a flag is not a bool, or ``grad_norm=False`` for a step that reports its updates' norms.
      LoopError: ``steps_per_call`` is not an int >= 1.
      Fp8Error: ``Strategy.fp8`` on devices without FP8 GEMMs, or covering no matmul of the model.
    """
    _check_options(loss_fn, clip_norm=clip_norm, donate=donate, explicit_dp=explicit_dp,
                   skip_nonfinite=skip_nonfinite, grad_norm=grad_norm)
    layout_strategy(layout, strategy)      # a strategy other than the layout's raises
    check_fp8(layout.mesh, layout.logical, layout.shapes, layout.strategy.fp8)   # strategy_context installs it
    update = Update(tx, clip_norm=clip_norm, skip_nonfinite=skip_nonfinite, grad_norm=grad_norm,
                    place=host_placement(layout.shardings(), layout.strategy.offload))
    opts = StepOptions(explicit_dp, steps_per_call, donate)
    _check_step(layout, update, opts)
    return _program(program_kind(layout.strategy, dict(layout.mesh.shape), steps_per_call), loss_fn, layout,
                    update, opts)


def program_kind(strategy: Strategy, mesh_sizes: dict, steps_per_call: int = 1) -> str:
    """Which program shape a step of ``strategy`` runs.

    Args:
      strategy: the layout's strategy.
      mesh_sizes: the mesh's axis sizes.
      steps_per_call: optimizer steps per call.

    Returns:
      ``'versioned-pipeline'`` (weight stashing, or several PipeDream-2BW steps: a no-flush
      pipeline whose stages read older weight versions and run the update inside it),
      ``'local'`` (DiLoCo / local SGD / EASGD: each replica's inner update, then an outer rule)
      or ``'per-step'`` (one gradient, one exchange, one update per step, over replicas too; K
      steps per call scanned in one program).
    """
    from jaxpar.parallel.pipeline._pipedream import is_two_bw   # pipelines load only when used

    if strategy.schedule == "pipedream" or (steps_per_call != 1 and is_two_bw(strategy, mesh_sizes)):
        return "versioned-pipeline"
    if is_local(strategy.sync):
        return "local"
    return "per-step"


def _program(kind: str, loss_fn: Callable, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """The step's programs for its shape (:func:`program_kind`)."""
    if kind == "local":             # each replica's own update, then the outer rule
        from jaxpar.step._local_steps import local_train_step   # relaxed synchronisation loads only when used

        return local_train_step(loss_fn, layout, update, donate=opts.donate)
    if kind == "versioned-pipeline":    # the update runs inside the pipeline, per stage or between steps
        return _versioned_pipeline(loss_fn, layout, update, opts)
    return _per_step(loss_fn, layout, update, opts)


def muon_matrices(layout: StateLayout) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """Muon's matrices in the layout's optimizer state (an ``optax.contrib.MuonState``), each with the mesh axes
    that shard its momentum: the compatibility table's Muon (``Setting.muon``); None without Muon."""
    is_muon = lambda x: isinstance(x, optax.contrib.MuonState)           # noqa: E731
    states = [x for x in jax.tree.leaves(layout.opt_shapes, is_leaf=is_muon) if is_muon(x)]
    if not states:
        return None
    specs = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        layout.opt_param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(states[0].mu)[0]]
    return tuple((p, tuple(a for e in tuple(specs.get(p, ())) for a in axes_of(e))) for p in paths)


def _check_step(layout: StateLayout, update: Update, opts: StepOptions) -> None:
    """``steps_per_call``'s value, the compatibility table's refusals for this step (once:
    :mod:`jaxpar.compat._table`), then the older weight versions the layout keeps."""
    strategy, sizes = layout.strategy, dict(layout.mesh.shape)
    check_int("make_train_step", "steps_per_call", opts.steps_per_call, 1, LoopError)
    across = False
    if strategy.schedule == "pipedream":        # each stage applies tx alone: the table's ST x LL
        from jaxpar.parallel.pipeline._pipedream import optimizer_is_per_stage, stacked_block_ids
        across = not optimizer_is_per_stage(update.tx, layout.shapes, stacked_block_ids(layout.logical))
    raise_problems(Setting(strategy, sizes, explicit_dp=opts.explicit_dp, steps_per_call=opts.steps_per_call,
                           clip_norm=update.clip_norm, optimizer_across_stages=across, muon=muon_matrices(layout),
                           **part_setting(layout)))
    is_spec = lambda x: isinstance(x, PartitionSpec)   # noqa: E731
    kept = jax.tree.structure(layout.part("versions").specs, is_leaf=is_spec)
    if kept != jax.tree.structure(older_versions_of(strategy, sizes, layout.params), is_leaf=is_spec):
        error = {"pipedream": StashingError, "pipedream-2bw": AsyncPipelineError}.get(strategy.schedule, StepError)
        raise error(f"make_train_step with schedule={strategy.schedule!r}, but the layout's older weight versions "
                    "(TrainState.versions) are not those of this schedule: the state was made for another schedule "
                    "or update_every. Create it with init_train_state(..., strategy) using this same strategy.")


def _per_step(loss_fn: Callable, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """One gradient, one exchange and one update per step; with a part that measures (its ``every``), a
    second program measures every ``every`` steps; with ``steps_per_call`` K, one program scans K steps."""
    step = _step_fn(loss_fn, layout, update, opts, measure=False)
    if opts.steps_per_call != 1:
        return _train_step({"step": partial(jax.lax.scan, step)}, layout, opts)   # K steps, one lax.scan
    every = next((p.every for p in stats_parts(layout) if p.every), None)     # a part that measures
    if every is None:
        return _train_step({"step": step}, layout, opts)
    programs = {"step": step, "measure": _step_fn(loss_fn, layout, update, opts, measure=True)}
    return _train_step(programs, layout, opts, choose=lambda s: "measure" if s % every == 0 else "step")


def _train_step(programs: dict, layout: StateLayout, opts: StepOptions, *, choose: Callable | None = None,
                pipeline_program=None) -> TrainStep:
    """The :class:`TrainStep` of the step functions ``programs``, jitted: on one batch, or with
    ``steps_per_call`` K on stacked batches ``[K, B, ...]``."""
    mesh, m, k = layout.mesh, layout.strategy.microbatches, opts.steps_per_call
    if k == 1:
        sharding = batch_sharding(mesh)
        check = lambda b: check_batch(b, mesh, m)    # noqa: E731
    else:
        sharding = NamedSharding(mesh, PartitionSpec(None, batch_axes(mesh) or None))
        check = lambda b: check_stacked_batches(b, mesh, m, k)    # noqa: E731
    jitted = {name: jit_program(_streamed(fn, layout), layout, sharding, donate=opts.donate)
              for name, fn in programs.items()}
    return TrainStep(jitted, check_batch=check, choose=choose, batch_sharding=sharding,
                     pipeline_program=pipeline_program)


def _streamed(fn: Callable, layout: StateLayout) -> Callable:
    """``fn(state, batch)`` with the state's offloaded fields streamed from host to device memory first
    (every one under a device update, the parameters alone under a host update:
    :attr:`~jaxpar.options.Offload.streamed`),
    traced where the model's ``"offload"`` remat policy offloads the strategy's named activations
    (:mod:`jaxpar.parallel._offload`); ``fn`` itself without offload."""
    offload = layout.strategy.offload
    if offload is None:
        return fn
    shardings = layout.shardings()

    def streamed(state, batch):
        with use_offloaded_activations(offload.activations) as record:
            out = fn(stream_in(state, shardings, offload), batch)
        check_activations(record)
        return out

    return streamed


def _step_fn(loss_fn: Callable, layout: StateLayout, update: Update, opts: StepOptions, *, measure: bool):
    """``step(state, batch) -> (state, metrics)``: the gradient, the exchange and the update of
    the layout's strategy (:func:`_gradient`, :func:`_exchange`, :func:`_rule`; over ``replica``:
    :func:`~jaxpar.step._replica_mean.replica_parts`), and the ``stats`` parts after the step (MoE's load
    metrics, then each part's ``after_step``; ``measure``: the measuring program)."""
    if replicas_on(Setting(layout.strategy, dict(layout.mesh.shape))):    # relaxed synchronisation
        gradient, exchange, rule = replica_parts(loss_fn, layout, update)
    else:
        gradient, exchange, rule = _gradient(loss_fn, layout, opts, measure), _exchange(layout, measure), \
            _rule(layout, update)
    replicas_ = manual_specs(layout).replicas if measure else 1

    def step(state, batch):
        with use_parts(layout, state.stats):        # what each part installs around the loss (the router bias)
            loss, grads, metrics = gradient(state, batch)
        loss, grads, parts, exchanged = exchange(state, loss, grads)
        metrics = finish_moe({**metrics, **exchanged})
        stats, metrics = parts_after_step(layout, state.stats, batch, metrics, measure, replicas_)
        if stats is not state.stats:
            parts["stats"] = stats
        return rule(state, loss, grads, parts=parts, metrics=metrics)

    return step


def _gradient(loss_fn: Callable, layout: StateLayout, opts: StepOptions, measure: bool) -> Callable:
    """``gradient(state, batch) -> (loss, grads, metrics)``: the pipeline's (at ``W(t-1)`` for
    PipeDream-2BW), each data-parallel replica's (for a codec or a measurement), or the global one."""
    strategy = layout.strategy
    per_replica = strategy.compression is not None or measure
    if dict(layout.mesh.shape).get("pipe", 1) > 1:
        grad = pipeline_grads(loss_fn, layout, per_replica=per_replica)
        read = (lambda s: s.versions) if strategy.schedule == "pipedream-2bw" else (lambda s: s.params)
        return lambda state, batch: grad(read(state), batch)
    if per_replica:
        grad = replica_grads(loss_fn, layout, with_metrics=True)
    else:
        grad = global_grads(loss_fn, layout, explicit_dp=opts.explicit_dp, with_metrics=True)
    return lambda state, batch: grad(state.params, batch)


def _exchange(layout: StateLayout, measure: bool) -> Callable:
    """``exchange(state, loss, grads) -> (loss, grads, parts, metrics)``: a codec's or a measured
    exchange over the data axes, or none (XLA's exact one is inside the gradient); ``parts``: the
    state parts it changed (a codec's state)."""
    strategy = layout.strategy
    if strategy.compression is None and not measure:
        return lambda state, loss, grads: (loss, grads, {}, {})
    man = manual_specs(layout)
    if strategy.compression is not None:
        inner = compressed_exchange(compression_plan(strategy.compression, layout, strategy.zero),
                                    strategy.local_clip)
    else:
        inner = exact_exchange(man)
    reduce = run_exchange(measured_exchange(inner, man) if measure else inner, layout)

    def exchange(state, loss, grads):
        grads, codec_state, metrics = reduce(grads, state.codec, state.step)
        return loss, grads, ({"codec": codec_state} if strategy.compression is not None else {}), metrics

    return exchange


def _rule(layout: StateLayout, update: Update) -> Callable:
    """``rule(state, loss, grads, *, parts, metrics) -> (state, metrics)``: the one update
    (:func:`~jaxpar.step._update.apply_update`), or under PipeDream-2BW's version swap."""
    from jaxpar.parallel.pipeline._pipedream import is_two_bw

    if is_two_bw(layout.strategy, layout.mesh.shape):
        return delayed(partial(apply_update, update))
    return partial(apply_update, update)


def _versioned_pipeline(loss_fn, layout: StateLayout, update: Update, opts: StepOptions) -> TrainStep:
    """PipeDream's no-flush program (:mod:`jaxpar.parallel.pipeline._pipedream`),
    ``steps_per_call`` steps each on stacked batches ``[K, B, ...]`` (metrics ``[K]``; with ``K = 1``
    one batch and one step's metrics): stages that read the weight version the schedule names, the
    one update per stage inside the pipeline (weight stashing) or on the whole model between steps (2BW)."""
    if layout.strategy.schedule == "pipedream":      # make_train_step has checked the state's versions
        from jaxpar.step._stashing_step import make_stashing_step   # pipelines load only when used

        run, program = make_stashing_step(loss_fn, layout, update, opts.steps_per_call)
    else:
        from jaxpar.step._two_bw_step import make_two_bw_steps

        run, program = make_two_bw_steps(loss_fn, layout, update, opts.steps_per_call)

    def one(state, batch):
        new, metrics = run(state, jax.tree.map(lambda a: a[None], batch))
        return new, jax.tree.map(lambda a: a[0], metrics)

    step = one if opts.steps_per_call == 1 else run
    return _train_step({"step": step}, layout, opts, pipeline_program=program)


def _check_options(loss_fn: Callable, *, clip_norm, donate, explicit_dp, skip_nonfinite, grad_norm) -> None:
    """The values of ``make_train_step``'s own options (:class:`~jaxpar.errors.StepError` names the first bad one)."""
    if not callable(loss_fn):
        raise StepError(f"make_train_step(loss_fn={loss_fn!r}): must be a function loss_fn(model, batch) -> scalar.")
    if (why := clip_norm_problem(clip_norm)) is not None:
        raise StepError(f"make_train_step(clip_norm={clip_norm!r}): {why}.")
    for name, value, allowed in (("donate", donate, (True, False)), ("skip_nonfinite", skip_nonfinite, (True, False)),
                                 ("explicit_dp", explicit_dp, (True, False, None)), ("grad_norm", grad_norm, (True, False))):
        if not any(value is a for a in allowed):
            raise StepError(f"make_train_step({name}={value!r}): must be " + " or ".join(map(str, allowed)) + ".")
