"""What a train state is: :class:`TrainState` (the arrays) and :class:`StateLayout` (where each
piece lives, the model's structure, and the strategy it was built for).

:func:`jaxpar.init_train_state` (:mod:`jaxpar.step._init`) creates both.

Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from jaxpar import Strategy, init_train_state, make_mesh
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = init_train_state(model_fn, optax.sgd(0.1), mesh, Strategy(zero=3))
    >>> layout_strategy(layout) is layout.strategy, layout.strategy.name(dict(mesh.shape))
    (True, 'fsdp2')
    >>> layout_strategy(layout, Strategy(zero=1))
    Traceback (most recent call last):
    ...
    jaxpar.errors.StrategyMismatchError: make_train_step(strategy='fsdp2'), but the layout was built ...
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.rules import named_shardings, resolve
from jaxpar.strategy import Strategy
from jaxpar.parallel._offload import host_state_shardings
from jaxpar.parallel._zero import analytic_state_bytes
from jaxpar.errors import StepError, StrategyMismatchError


class TrainState(NamedTuple):
    """``step`` (int32 scalar), ``params`` (pure dict of arrays), ``opt_state`` (optax), and the
    optional parts, ``()`` without their feature (docs/training.md, "Train state parts"): ``codec``
    (a gradient codec's per-replica state, :func:`jaxpar.step._exchange.compression_state`), ``sync`` (relaxed
    synchronisation's replicas ``{"params", "opt"}`` or ``{"history"}``, :mod:`jaxpar.step._replica_mean`),
    ``stats`` (running measurements by name: ``noise_scale``, ``router_bias``) and ``versions``
    (PipeDream-2BW's ``W(t-1)``, or weight stashing's tuple of older versions,
    :func:`jaxpar.step._init.older_versions_of`)."""

    step: jax.Array
    params: Any
    opt_state: Any
    codec: Any = ()
    sync: Any = ()
    stats: Any = ()
    versions: Any = ()


class PartLayout(NamedTuple):
    """One optional part of the train state: where it lives, how it starts, and what it does in a step.

    The :class:`TrainState` fields ``codec``, ``sync`` and ``versions`` are parts the strategy makes; a
    feature's running state in ``TrainState.stats`` (the noise scale, the router bias) is a part its own
    module makes (:func:`stats_part`) and the caller passes to ``init_train_state(parts=[...])``. The step,
    :func:`~jaxpar.step.strategy_context` and the checkpoint iterate over parts; none names a feature.

    Attributes:
      specs: its ``PartitionSpec`` tree.
      shapes: its ``ShapeDtypeStruct`` tree.
      init: ``init(params)`` -> the part (in its shardings under ``jit``; ``None``: a restore makes
        zeros, or copies of the parameters for ``versions``).
      options: the part's options, as its feature reads them (the noise scale's ``Measure``, the router
        bias's rate).
      name: its name: the ``TrainState`` field, or its key in ``TrainState.stats``.
      setting: what the compatibility table reads of it (:class:`~jaxpar.compat.Setting` keywords).
      every: a second program measures every that many steps (``None``: none).
      after_step: ``after_step(value, batch, metrics, measured, replicas) -> (value, metrics)``, after the
        gradient (``measured``: the measuring program; ``replicas``: its replicas).
      install: ``install(value)`` -> the context the loss is traced and run in (every runner's, through
        :func:`~jaxpar.step.strategy_context` or :func:`use_parts`).
      after_trace: ``after_trace(moe_calls)``: raises where the traced loss ignored the part.
    """

    specs: Any
    shapes: Any
    init: Callable[[Any], Any] | None = None
    options: Any = None
    name: str = ""
    setting: Mapping[str, Any] = {}
    every: int | None = None
    after_step: Callable | None = None
    install: Callable[[Any], Any] | None = None
    after_trace: Callable[[Any], None] | None = None


def stats_part(name: str, init: Callable[[], Any], **protocol: Any) -> PartLayout:
    """A feature's replicated part of ``TrainState.stats``, for ``init_train_state(parts=[...])``.

    Args:
      name: its key in ``stats``.
      init: ``init()`` -> its fresh arrays.
      **protocol: the other :class:`PartLayout` fields (``options``, ``setting``, ``every``, ``after_step``,
        ``install``, ``after_trace``).

    Returns:
      The part.
    """
    shapes = jax.eval_shape(init)
    return PartLayout(jax.tree.map(lambda _: PartitionSpec(), shapes), shapes, lambda params: init(), name=name,
                      **protocol)


_EMPTY = PartLayout((), ())


@dataclass(frozen=True)
class ParamLayout:
    """The parameters' layout under a strategy, without an optimizer (:func:`jaxpar.param_layout`): the model
    traced once, for the optimizer that needs the parameters' names or specs (Muon, LARS / LAMB) and for
    :func:`jaxpar.state_layout`.

    ``model_fn`` builds the model as the state holds it (a pipeline's layers stacked); ``params``,
    ``grads`` and ``opt_param_specs`` are ``PartitionSpec`` trees over mesh axes (``opt_param_specs``: how
    optimizer moments are sharded); ``kernel_layout``: which side of a weight comes first (the model class's
    ``kernel_layout``, ``out_in`` for ``[out, in]`` weights, else Flax's ``in_out``)."""

    mesh: Mesh
    rules: tuple
    graphdef: Any
    shapes: Any          # params: ShapeDtypeStruct tree (no sharding)
    logical: Any         # params: PartitionSpec tree of logical names
    params: Any
    grads: Any
    opt_param_specs: Any
    strategy: Strategy = Strategy()
    layer_lists: Any = None  # {path: count} of the model's nnx.Lists run stacked (jaxpar.adapters._layer_lists.list_form)
    kernel_layout: str = "in_out"
    model_fn: Callable[[], Any] | None = None


@dataclass(frozen=True)
class StateLayout(ParamLayout):
    """Where every piece of the train state lives, plus what is needed to rebuild the model.

    ``parts`` holds the optional parts by name (:class:`PartLayout`): the :class:`TrainState` fields
    ``codec``, ``sync`` and ``versions``, and under any other name an entry of ``TrainState.stats``
    (``noise_scale``, ``router_bias``). ``layer_lists`` maps the path of each ``nnx.List`` of layers
    that runs stacked (:func:`jaxpar.stack_layers`, or a pipeline) to its length:
    :func:`jaxpar.adapters.list_form` turns the parameters back into the list's own paths. The fields of
    :class:`ParamLayout` come first; ``strategy`` is what the layout was built for (make_train_step runs it)."""

    opt_state: Any = None
    opt_shapes: Any = None
    parts: Mapping[str, PartLayout] = field(default_factory=dict)

    def part(self, name: str) -> PartLayout:
        """One of the layout's parts.

        Args:
          name: a ``TrainState`` field (``codec``, ``sync``, ``versions``) or a ``stats`` entry.

        Returns:
          The part, or an empty one (``()`` specs and shapes) when the layout keeps none.
        """
        return self.parts.get(name, _EMPTY)

    def _state_of(self, attr: str, step: Any, params: Any, opt_state: Any) -> TrainState:
        """A :class:`TrainState` of the parts' ``attr`` (``specs`` / ``shapes``)."""
        fields = {n: getattr(p, attr) for n, p in self.parts.items() if n in TrainState._fields}
        stats = {n: getattr(p, attr) for n, p in self.parts.items() if n not in TrainState._fields}
        return TrainState(step, params, opt_state, **fields, **({"stats": stats} if stats else {}))

    def shardings(self) -> TrainState:
        """``TrainState`` of ``NamedSharding``s (for ``jit`` in/out shardings); the fields the strategy
        offloads (``Strategy.offload``) in ``pinned_host`` memory."""
        named = named_shardings(self._state_of("specs", PartitionSpec(), self.params, self.opt_state), self.mesh)
        return host_state_shardings(named, self.strategy.offload)

    def model_specs(self) -> Any:
        """The parameters' ``PartitionSpec`` values, as the model annotates them (its logical names under
        the layout's rules), before ZeRO / FSDP shard them further: what a model that pins its own
        shardings, and a pipeline stage, run the parameters in."""
        return resolve(self.logical, self.rules, self.mesh, self.shapes)

    def abstract_state(self) -> TrainState:
        """``TrainState`` of ``ShapeDtypeStruct(..., sharding=...)``: a restore target."""
        abs_state = self._state_of("shapes", jax.ShapeDtypeStruct((), jnp.int32), self.shapes, self.opt_shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state,
                            self.shardings())

    def analytic_bytes(self) -> dict[str, float]:
        """Per-device parameter + optimizer bytes from the ZeRO formulas (see :mod:`jaxpar.parallel._zero`)."""
        opt_leaves = sum(a.size for a in jax.tree.leaves(self.opt_shapes) if hasattr(a, "size"))
        psi = sum(a.size for a in jax.tree.leaves(self.shapes))
        per_param = round(4 * opt_leaves / psi) if psi else 0
        return analytic_state_bytes(self.shapes, self.params, self.opt_param_specs, dict(self.mesh.shape),
                                    opt_bytes=per_param)


def optimizer_specs(tx: optax.GradientTransformation, shapes: Any, param_like_specs: Any) -> tuple[Any, Any]:
    """The optimizer state's shapes and specs: every params-like leaf (moments) in
    ``param_like_specs``, the rest (counts, scalars) replicated.

    Args:
      tx: the optax optimizer.
      shapes: the parameters' ``ShapeDtypeStruct`` tree.
      param_like_specs: a params-shaped tree of ``PartitionSpec``.

    Returns:
      ``(opt_shapes, opt_specs)``.
    """
    opt_shapes = jax.eval_shape(tx.init, shapes)
    masked = lambda x: isinstance(x, optax.MaskedNode)    # noqa: E731  (a part another optimizer owns)
    specs = optax.tree_map_params(tx, lambda v, s: v if masked(v) else s, opt_shapes, param_like_specs,
                                  transform_non_params=lambda _: PartitionSpec(),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec) or masked(x))
    return opt_shapes, specs


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


def stats_parts(layout: StateLayout) -> list[PartLayout]:
    """The layout's parts in ``TrainState.stats``, in the order they were added."""
    return [p for n, p in layout.parts.items() if n not in TrainState._fields]


def part_setting(layout: StateLayout) -> dict[str, Any]:
    """What the compatibility table reads of the layout's parts (:attr:`PartLayout.setting`, merged)."""
    return {k: v for p in stats_parts(layout) for k, v in p.setting.items()}


def with_parts(layout: StateLayout, parts: Sequence[PartLayout]) -> StateLayout:
    """``layout`` with ``parts`` in ``stats`` (:func:`stats_part`), without creating them (a restore or
    ahead-of-time target: :meth:`StateLayout.abstract_state` then has them).

    Raises:
      StepError: two parts of one name.
    """
    names = [p.name for p in parts]
    if len(set(names)) != len(names) or set(names) & set(layout.parts):
        raise StepError(f"init_train_state(parts=[{', '.join(names)}]): a part's name appears twice; give each "
                         "feature's part once.")
    return replace(layout, parts={**layout.parts, **{p.name: p for p in parts}})


def add_parts(state: TrainState, layout: StateLayout, parts: Sequence[PartLayout]) -> tuple[TrainState, StateLayout]:
    """``(state, layout)`` with ``parts`` created fresh in ``stats`` (replicated): a state made without them.

    Args:
      state: the train state.
      layout: its layout.
      parts: the parts (:func:`stats_part`).

    Returns:
      The state and layout with the parts.
    """
    layout = with_parts(layout, parts)
    values = {p.name: jax.device_put(p.init(None), NamedSharding(layout.mesh, PartitionSpec())) for p in parts}
    return state._replace(stats={**(state.stats or {}), **values}), layout


@contextlib.contextmanager
def use_parts(layout: StateLayout, stats: Any) -> Iterator[None]:
    """The context each part installs around the loss (:attr:`PartLayout.install`) with its value in
    ``stats`` (``TrainState.stats``, or host copies of it): what the step, eval and samples run under.

    Args:
      layout: the state's layout.
      stats: the state's ``stats`` (``None`` or ``()``: nothing is installed).
    """
    with contextlib.ExitStack() as stack:
        for part in stats_parts(layout) if stats else ():
            if part.install is not None:
                stack.enter_context(part.install(stats[part.name]))
        yield


def parts_after_step(layout: StateLayout, stats: Any, batch: Any, metrics: dict, measured: bool,
                     replicas: int) -> tuple[Any, dict]:
    """Every part's :attr:`PartLayout.after_step`: ``(stats, metrics)`` after the gradient."""
    for part in stats_parts(layout):
        if part.after_step is not None:
            value, metrics = part.after_step(stats[part.name], batch, metrics, measured, replicas)
            stats = {**stats, part.name: value}
    return stats, metrics
