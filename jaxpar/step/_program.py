"""The train step as an object: its compiled programs, which one runs at a step, and its checks.

A :class:`TrainStep` holds one or more jitted programs over the same state layout: ``"step"``,
plus, where a feature needs them, a measuring program every ``k`` steps (the noise scale), or
the inner / outer / warm-up programs of relaxed synchronisation. Calling it checks the batch,
picks the program for the state's step number (read once from the device, then counted on the
host) and runs it. :func:`jit_program` is the one ``jax.jit`` of a step function with the
layout's shardings and logical rules.

Example:
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier, classifier_loss
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh)
    >>> step = jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout)
    >>> sorted(step.programs)
    ['step']
    >>> batch = {"x": np.ones((4, 4), np.float32), "y": np.zeros(4, np.int32)}
    >>> "all-reduce" in step.lower(state, batch).compile().as_text()
    True
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.parallel.context import ContextParallelError, count_context_calls, use_context_parallel
from jaxpar.mesh import CONTEXT, EXPERT
from jaxpar.parallel.moe import MoEError, count_moe_calls
from jaxpar.parallel._fp8 import use_fp8
from jaxpar.rules import use_rules
from jaxpar.step._state import StateLayout, stats_parts, use_parts

#: The name of the host annotation around each traced step (``jax.profiler.StepTraceAnnotation``; the train
#: loop writes it, :mod:`jaxpar.analysis._trace` reads it).
STEP_EVENT = "jaxpar.step"
#: The name of the host annotation around building and placing a step's batch.
DATA_EVENT = "jaxpar.data"


@contextlib.contextmanager
def strategy_context(layout: StateLayout, stats: Any = None) -> Iterator[None]:
    """What a step function, eval and every runner's model call are traced under: the layout's logical rules,
    its context-parallel setting, FP8 (:func:`~jaxpar.parallel._fp8.use_fp8` of ``Strategy.fp8``), and what the
    state's parts install (:func:`~jaxpar.step._state.use_parts`: the router bias). No runner sets any of these
    by hand.

    Args:
      layout: the state's layout (mesh, rules, strategy, parts).
      stats: the state's ``TrainState.stats`` whose parts to install (``None``: none; the step installs
        them per step itself).

    Raises:
      ContextParallelError: on leaving the block, with a ``context`` axis, for a loss that never called
        :func:`jaxpar.attention.attention` (XLA would gather the whole sequence for its own
        attention), or that ignored the balanced order (:func:`jaxpar.parallel.context.sequence_order`).
      MoEError: on leaving the block, for an ``expert`` axis without MoE layers; a part's own error where
        the loss ignored it (:attr:`~jaxpar.step.PartLayout.after_trace`: a router bias never read).
    """
    setting, size = layout.strategy.context_setting, dict(layout.mesh.shape).get(CONTEXT, 1)
    with use_rules(layout.mesh, layout.rules), use_context_parallel(setting.method, balance=setting.balance), \
            use_fp8(layout.strategy.fp8), count_context_calls() as calls, count_moe_calls() as moe, \
            use_parts(layout, stats):
        yield
    _check_moe(layout, moe)
    for part in stats_parts(layout):
        if part.after_trace is not None:
            part.after_trace(moe)
    if size > 1 and not calls.attention:
        raise ContextParallelError(
            f"the mesh has a context axis of size {size}, but the loss never called jaxpar.attention.attention: its "
            "sequence would be gathered whole for its own attention, which is not context parallelism. Call "
            "jaxpar.attention.attention(q, k, v, ...) in the model, or drop the context axis.")
    if size > 1 and setting.balance and not calls.order:
        raise ContextParallelError(
            f"Strategy.context={setting!r}: balance=True lays the sequence out zig-zag over the context axis, but "
            "the loss never asked for that order (jaxpar.parallel.context.sequence_order(length)), so its tokens, targets "
            "and positions would be in the natural order: wrong masks. Permute them by that order in the loss, "
            "or use balance=False.")


def _check_moe(layout: StateLayout, moe) -> None:
    """An ``expert`` axis needs MoE layers. (The load-balancing loss under micro-batches is the gradient's
    part: :mod:`jaxpar.step._balancing`.)"""
    experts = dict(layout.mesh.shape).get(EXPERT, 1)
    if experts > 1 and not moe.layers:
        raise MoEError(f"the mesh has an expert axis of size {experts}, but the loss never ran an MoE layer "
                       "(jaxpar.parallel.moe.moe_apply, jaxpar.parallel.moe.MoE, GPTConfig.moe): the axis would only split the batch. "
                       "Use a model with MoE layers, or put those devices on the data axis.")


def jit_program(fn: Callable, layout: StateLayout, batch_sharding: Any, *, donate: bool,
                metrics_sharding: Any = None) -> Callable:
    """``jax.jit`` of ``fn(state, batch) -> (state, metrics)`` with the layout's shardings, traced
    under the layout's logical rules (:func:`strategy_context`).

    Args:
      fn: the step function.
      layout: the state's layout (shardings of the state in and out).
      batch_sharding: the batch's sharding; ``None``: ``fn`` takes the state alone,
        ``fn(state) -> (state, metrics)`` (relaxed synchronisation's outer step).
      donate: donate the input state.
      metrics_sharding: the metrics' sharding (a prefix of their tree); ``None``: replicated.
        Per-replica metrics stay sharded over ``replica``, so a program need not gather them.

    Returns:
      The jitted function (``.lower`` for ahead-of-time compilation).
    """
    mesh = layout.mesh

    def traced(*args):
        with strategy_context(layout):
            return fn(*args)

    ins = (layout.shardings(),) if batch_sharding is None else (layout.shardings(), batch_sharding)
    metrics = NamedSharding(mesh, PartitionSpec()) if metrics_sharding is None else metrics_sharding
    return jax.jit(traced, in_shardings=ins, out_shardings=(layout.shardings(), metrics),
                   donate_argnums=(0,) if donate else ())


class TrainStep:
    """``step(state, batch) -> (state, metrics)`` over named jitted programs.

    Args:
      programs: ``{name: jitted program}``; ``"step"`` is the usual one.
      check_batch: called with every batch before a program runs (raises a named error).
      choose: ``step number -> program name`` (``None``: always ``"step"``); decided on the host.
      run: ``run(programs, state, batch, step number) -> (state, metrics)`` for steps that are
        more than one program call (relaxed synchronisation); overrides ``choose``.
      batch_sharding: the sharding a batch is placed with.
      pipeline_program: the lowered pipeline table it runs, if any.
      state_only: the programs that take the state alone (relaxed sync's ``"outer"``), not ``(state, batch)``.
      summary: ``summary(metrics) -> metrics``, jitted and run after every step as a program of its own:
        it reduces the per-replica metrics of programs that must not communicate over ``replica``.

    Every program is also ``step.programs[name]``; ``step.lower`` lowers ``"step"``, ``step.lower_all``
    every program.
    """

    def __init__(self, programs: Mapping[str, Callable], *, check_batch: Callable, choose: Callable | None = None,
                 run: Callable | None = None, batch_sharding: Any = None, pipeline_program: Any = None,
                 state_only: tuple[str, ...] = (), summary: Callable | None = None):
        self.programs = dict(programs)
        self.state_only = tuple(state_only)
        self.check_batch = check_batch
        self.batch_sharding = batch_sharding
        self.pipeline_program = pipeline_program
        self._choose, self._run = choose, run
        self._summary = None if summary is None else jax.jit(summary)
        # the step number of the state last returned, counted on the host (no device round trip per step)
        self._last_step, self._count = None, None

    def lower(self, *args, **kwargs):
        """The usual program lowered, for ahead-of-time compilation.

        Args:
          *args: as the program's, ``(state, batch)`` (arrays or ``jax.ShapeDtypeStruct``\\ s).
          **kwargs: passed to ``programs["step"].lower``.

        Returns:
          The ``jax.stages.Lowered`` program.
        """
        return self.programs["step"].lower(*args, **kwargs)

    def lower_all(self, state, batch) -> dict[str, Any]:
        """Every program lowered, for ahead-of-time compilation.

        Args:
          state: the train state (or its ``jax.ShapeDtypeStruct``\\ s).
          batch: a batch (or its ``jax.ShapeDtypeStruct``\\ s); unused by the state-only programs.

        Returns:
          ``{name: jax.stages.Lowered}``.
        """
        return {name: p.lower(state) if name in self.state_only else p.lower(state, batch)
                for name, p in self.programs.items()}

    def __call__(self, state, batch):
        self.check_batch(batch)
        if self._choose is None and self._run is None:
            return self.programs["step"](state, batch)
        s = self._count if state.step is self._last_step else int(jax.device_get(state.step))
        if self._run is not None:
            new, metrics = self._run(self.programs, state, batch, s)
        else:
            new, metrics = self.programs[self._choose(s)](state, batch)
        self._last_step, self._count = new.step, s + 1
        return new, metrics if self._summary is None else self._summary(metrics)
