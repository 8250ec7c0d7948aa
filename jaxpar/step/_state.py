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

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.rules import named_shardings, resolve
from jaxpar.strategy import Strategy
from jaxpar.parallel._zero import analytic_state_bytes
from jaxpar.errors import StrategyMismatchError


class TrainState(NamedTuple):
    """``step`` (int32 scalar), ``params`` (pure dict of arrays), ``opt_state`` (optax).

    Each feature that keeps state of its own has a named part, ``()`` without the feature:

    ``codec``: the gradient codec's per-replica state (error-feedback residuals, PowerSGD's
    ``Q``, ...; a leading replica axis sharded over the data axes; :mod:`jaxpar.step._compressed`).
    ``sync``: relaxed synchronisation's state (:mod:`jaxpar.step._relaxed`): the replicas'
    parameters and inner optimizer states ``{"params", "opt"}`` (a leading ``replica`` axis), or
    the stale kinds' older parameters ``{"history"}``.
    ``stats``: small running measurements kept across steps and checkpoints, a dict by feature
    (``{"noise_scale": ...}``, :mod:`jaxpar.step._noise_scale`), ``()`` when nothing is measured.
    ``versions``: older weight versions a pipeline schedule keeps (PipeDream-2BW: ``W(t-1)``, in
    ``params``' layout; :mod:`jaxpar.parallel.pipeline._two_bw`; PipeDream weight stashing: a tuple of
    ``ceil((p-1)/k)`` params-like trees, each stage's newest older versions first;
    :mod:`jaxpar.parallel.pipeline._stash_versions`), ``()`` for the other schedules."""

    step: jax.Array
    params: Any
    opt_state: Any
    codec: Any = ()
    sync: Any = ()
    stats: Any = ()
    versions: Any = ()


@dataclass(frozen=True)
class StateLayout:
    """Where every piece of the train state lives, plus what is needed to rebuild the model.

    Each optional part of :class:`TrainState` has its specs (``codec``, ``sync``, ``stats``,
    ``versions``: ``PartitionSpec`` trees), its shapes (``*_shapes``) and, for those a restore
    may have to start afresh from the layout alone, its init: ``codec_init()`` and
    ``sync_init(params)``, each returning the part in its shardings. ``layer_lists`` maps the path
    of each ``nnx.List`` of layers that runs stacked (:func:`jaxpar.stack_layers`, or a pipeline) to
    its length: :func:`jaxpar.adapters.list_form` turns the parameters back into the list's own
    paths. ``part_options`` holds the options each ``stats`` part was switched on with (the router
bias's rate, the noise scale's period), which the step reads from there: :func:`part_options`."""

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
    codec: Any = ()          # the gradient codec's state (TrainState.codec): PartitionSpec tree
    codec_shapes: Any = ()
    codec_init: Callable[[], Any] = tuple
    sync: Any = ()           # relaxed synchronisation's state (TrainState.sync): PartitionSpec tree
    sync_shapes: Any = ()
    sync_init: Callable[[Any], Any] = lambda params: ()   # noqa: E731
    stats: Any = ()          # running measurements (TrainState.stats): PartitionSpec tree
    stats_shapes: Any = ()
    versions: Any = ()       # older weight versions (TrainState.versions): PartitionSpec tree
    versions_shapes: Any = ()
    strategy: Strategy = Strategy()   # what the layout was built for; make_train_step runs this strategy
    layer_lists: Any = None  # {path: count} of the model's nnx.Lists run stacked (jaxpar.adapters._layer_lists.list_form)
    part_options: tuple = ()  # ((stats key, options), ...): the options a part was added with (part_options())

    def shardings(self) -> TrainState:
        """``TrainState`` of ``NamedSharding``s (for ``jit`` in/out shardings)."""
        return TrainState(NamedSharding(self.mesh, PartitionSpec()),
                          named_shardings(self.params, self.mesh), named_shardings(self.opt_state, self.mesh),
                          named_shardings(self.codec, self.mesh), named_shardings(self.sync, self.mesh),
                          named_shardings(self.stats, self.mesh), named_shardings(self.versions, self.mesh))

    def model_specs(self) -> Any:
        """The parameters' ``PartitionSpec`` values, as the model annotates them (its logical names under
        the layout's rules), before ZeRO / FSDP shard them further: what a model that pins its own
        shardings, and a pipeline stage, run the parameters in."""
        return resolve(self.logical, self.rules, self.mesh, self.shapes)

    def abstract_state(self) -> TrainState:
        """``TrainState`` of ``ShapeDtypeStruct(..., sharding=...)``: a restore target."""
        sh = self.shardings()
        abs_state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), self.shapes, self.opt_shapes,
                               self.codec_shapes, self.sync_shapes, self.stats_shapes, self.versions_shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, sh)

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
    specs = optax.tree_map_params(tx, lambda _, s: s, opt_shapes, param_like_specs,
                                  transform_non_params=lambda _: PartitionSpec(),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))
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


def stats_part_layout(layout: StateLayout, key: str, shapes: Any, options: Any = None) -> StateLayout:
    """``layout`` with a replicated part ``stats[key]`` of ``shapes`` (``ShapeDtypeStruct``s), without
    creating it (ahead-of-time compilation: :meth:`StateLayout.abstract_state` then has it).

    Args:
      layout: the layout.
      key: the part's name in ``stats``.
      shapes: its ``ShapeDtypeStruct`` tree.
      options: what the step does with the part (hashable; ``None``: nothing), read back with
        :func:`part_options`.

    Returns:
      The layout with the part.
    """
    from dataclasses import replace

    stats = dict(layout.stats) if isinstance(layout.stats, dict) else {}
    stats_shapes = dict(layout.stats_shapes) if isinstance(layout.stats_shapes, dict) else {}
    stats_shapes[key] = shapes
    stats[key] = jax.tree.map(lambda _: PartitionSpec(), shapes)
    kept = tuple((k, o) for k, o in layout.part_options if k != key)
    return replace(layout, stats=stats, stats_shapes=stats_shapes,
                   part_options=kept + (((key, options),) if options is not None else ()))


def with_stats_part(state: TrainState, layout: StateLayout, key: str, value: Any,
                    options: Any = None) -> tuple[TrainState, StateLayout]:
    """``(state, layout)`` with ``value`` (arrays) as the replicated part ``stats[key]``: a running
    measurement or a balancing state the step keeps (checkpointed with the rest); ``options`` as in
    :func:`stats_part_layout`.

    Args:
      state: the train state.
      layout: its layout.
      key: the part's name in ``stats``.
      value: the part's arrays.
      options: the part's options, or ``None``.

    Returns:
      The state and layout with the part.
    """
    layout = stats_part_layout(layout, key, jax.eval_shape(lambda: value), options)
    values = dict(state.stats) if isinstance(state.stats, dict) else {}
    values[key] = jax.device_put(value, NamedSharding(layout.mesh, PartitionSpec()))
    return state._replace(stats=values), layout


def has_stats_part(layout: StateLayout, key: str) -> bool:
    """Whether a layout has a place for a state part.

    Args:
      layout: the state's layout.
      key: the part's key in ``TrainState.stats``.

    Returns:
      True when ``layout.stats`` has ``key``.
    """
    return isinstance(layout.stats, dict) and key in layout.stats


def part_options(layout: StateLayout, key: str) -> Any:
    """The options the part ``stats[key]`` was added with (``None``: none, or no such part).

    Args:
      layout: the layout.
      key: the part's name in ``stats``.

    Returns:
      The options given to :func:`stats_part_layout` / :func:`with_stats_part`.
    """
    return dict(layout.part_options).get(key) if has_stats_part(layout, key) else None
