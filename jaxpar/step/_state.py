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

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.rules import named_shardings, resolve
from jaxpar.strategy import Strategy
from jaxpar.parallel._offload import host_state_shardings
from jaxpar.parallel._zero import analytic_state_bytes
from jaxpar.errors import StrategyMismatchError


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
    """One optional part of the train state in the layout: where it lives and how it starts.

    Attributes:
      specs: its ``PartitionSpec`` tree.
      shapes: its ``ShapeDtypeStruct`` tree.
      init: ``init(params)`` -> the part in its shardings, for a restore that starts it afresh
        (``None``: the restore makes zeros, or copies of the parameters for ``versions``).
      options: what the step does with it (the noise scale's ``Measure``, the router bias's rate).
    """

    specs: Any
    shapes: Any
    init: Callable[[Any], Any] | None = None
    options: Any = None


_EMPTY = PartLayout((), ())


@dataclass(frozen=True)
class StateLayout:
    """Where every piece of the train state lives, plus what is needed to rebuild the model.

    ``parts`` holds the optional parts by name (:class:`PartLayout`): the :class:`TrainState` fields
    ``codec``, ``sync`` and ``versions``, and under any other name an entry of ``TrainState.stats``
    (``noise_scale``, ``router_bias``). ``layer_lists`` maps the path of each ``nnx.List`` of layers
    that runs stacked (:func:`jaxpar.stack_layers`, or a pipeline) to its length:
    :func:`jaxpar.adapters.list_form` turns the parameters back into the list's own paths."""

    mesh: Mesh
    rules: tuple
    graphdef: Any
    shapes: Any          # params: ShapeDtypeStruct tree (no sharding)
    logical: Any         # params: PartitionSpec tree of logical names
    params: Any          # PartitionSpec trees over mesh axes
    grads: Any
    opt_param_specs: Any  # params-shaped: how optimizer moments are sharded
    opt_state: Any
    opt_shapes: Any
    parts: Mapping[str, PartLayout] = field(default_factory=dict)
    strategy: Strategy = Strategy()   # what the layout was built for; make_train_step runs this strategy
    layer_lists: Any = None  # {path: count} of the model's nnx.Lists run stacked (jaxpar.adapters._layer_lists.list_form)

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


def stats_part_layout(layout: StateLayout, name: str, shapes: Any, options: Any = None) -> StateLayout:
    """``layout`` with a replicated part ``stats[name]`` of ``shapes`` (``ShapeDtypeStruct``s), without
    creating it (ahead-of-time compilation: :meth:`StateLayout.abstract_state` then has it).

    Args:
      layout: the layout.
      name: the part's name in ``stats``.
      shapes: its ``ShapeDtypeStruct`` tree.
      options: what the step does with the part (:attr:`PartLayout.options`).

    Returns:
      The layout with the part.
    """
    part = PartLayout(jax.tree.map(lambda _: PartitionSpec(), shapes), shapes, options=options)
    return replace(layout, parts={**layout.parts, name: part})


def with_stats_part(state: TrainState, layout: StateLayout, name: str, value: Any,
                    options: Any = None) -> tuple[TrainState, StateLayout]:
    """``(state, layout)`` with ``value`` (arrays) as the replicated part ``stats[name]``: a running
    measurement or a balancing state the step keeps (checkpointed with the rest); ``options`` as in
    :func:`stats_part_layout`.

    Args:
      state: the train state.
      layout: its layout.
      name: the part's name in ``stats``.
      value: the part's arrays.
      options: the part's options, or ``None``.

    Returns:
      The state and layout with the part.
    """
    layout = stats_part_layout(layout, name, jax.eval_shape(lambda: value), options)
    placed = jax.device_put(value, NamedSharding(layout.mesh, PartitionSpec()))
    return state._replace(stats={**(state.stats or {}), name: placed}), layout
