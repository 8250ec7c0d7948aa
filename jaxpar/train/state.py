"""Train state created already sharded: ``eval_shape`` -> shardings -> ``jit(out_shardings=...)``.

No full copy of the parameters or optimizer state ever sits on one device.

Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from jaxpar import MeshSpec, Strategy, make_mesh
    >>> from jaxpar.models.mlp import MLPClassifier
    >>> mesh = make_mesh(MeshSpec(fsdp=2), devices=jax.devices()[:2])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = init_train_state(model_fn, optax.adamw(1e-3), mesh, Strategy())
    >>> layout.logical["up"][0]["kernel"], state.params["up"][0]["kernel"].sharding.spec
    (P('embed', 'mlp'), P('fsdp', 'tensor'))
    >>> state.opt_state[0].mu["up"][0]["kernel"].sharding.spec     # Adam moments: the same layout
    P('fsdp', 'tensor')
    >>> target = layout.abstract_state()   # ShapeDtypeStruct(..., sharding=...) tree for Orbax restore
    >>> target.params["up"][0]["kernel"]
    ShapeDtypeStruct(shape=(8, 8), dtype=float32, sharding=NamedSharding(...spec=P('fsdp', 'tensor')...))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..mesh import replicas
from ..rules import named_shardings, resolve
from ..strategy import Strategy
from ..zero import analytic_state_bytes, zero_specs

__all__ = ["TrainState", "StateLayout", "init_train_state", "state_layout", "abstract_model"]


class TrainState(NamedTuple):
    """``step`` (int32 scalar), ``params`` (pure dict of arrays), ``opt_state`` (optax),
    ``comm``: the gradient codec's per-replica state (error-feedback residuals, PowerSGD's
    ``Q``, ...; a leading replica axis sharded over the data axes), ``()`` without compression.
    ``stats``: small running measurements kept across steps and checkpoints, a dict by feature
    (``{"noise_scale": ...}``, :mod:`jaxpar.train.noise_scale`), ``()`` when nothing is measured.
    ``versions``: older weight versions a pipeline schedule keeps (PipeDream-2BW: ``W(t-1)``, in
    ``params``' layout; :mod:`jaxpar.pipeline.asynchronous`; PipeDream weight stashing: a tuple of
    ``ceil((p-1)/k)`` params-like trees, each stage's newest older versions first;
    :mod:`jaxpar.pipeline.stashing`), ``()`` for the other schedules."""

    step: jax.Array
    params: Any
    opt_state: Any
    comm: Any = ()
    stats: Any = ()
    versions: Any = ()


@dataclass(frozen=True)
class StateLayout:
    """Where every piece of the train state lives, plus what is needed to rebuild the model."""

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
    comm: Any = ()           # compression state: PartitionSpec tree (leading replica axis)
    comm_shapes: Any = ()
    comm_init: Callable[..., Any] = tuple   # () -> a fresh codec state in ``comm``'s shardings
    comm_from_params: bool = False           # comm_init(params): relaxed sync's replicas (jaxpar.sync)
    stats: Any = ()          # running measurements (TrainState.stats): PartitionSpec tree
    stats_shapes: Any = ()
    versions: Any = ()       # older weight versions (TrainState.versions): PartitionSpec tree
    versions_shapes: Any = ()
    strategy: Strategy = Strategy()   # what the layout was built for; make_train_step runs this strategy

    def shardings(self) -> TrainState:
        """``TrainState`` of ``NamedSharding``s (for ``jit`` in/out shardings)."""
        return TrainState(NamedSharding(self.mesh, PartitionSpec()),
                          named_shardings(self.params, self.mesh), named_shardings(self.opt_state, self.mesh),
                          named_shardings(self.comm, self.mesh), named_shardings(self.stats, self.mesh),
                          named_shardings(self.versions, self.mesh))

    def abstract_state(self) -> TrainState:
        """``TrainState`` of ``ShapeDtypeStruct(..., sharding=...)``: a restore target."""
        sh = self.shardings()
        abs_state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), self.shapes, self.opt_shapes, self.comm_shapes,
                               self.stats_shapes, self.versions_shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, sh)

    def analytic_bytes(self) -> dict[str, float]:
        """Per-device parameter + optimizer bytes from the ZeRO formulas (see :mod:`jaxpar.zero`)."""
        opt_leaves = sum(a.size for a in jax.tree.leaves(self.opt_shapes) if hasattr(a, "size"))
        psi = sum(a.size for a in jax.tree.leaves(self.shapes))
        per_param = round(4 * opt_leaves / psi) if psi else 0
        return analytic_state_bytes(self.shapes, self.params, self.opt_param_specs, dict(self.mesh.shape),
                                    opt_bytes=per_param)


def abstract_model(model_fn: Callable[[], nnx.Module]):
    """``(graphdef, param shapes, logical specs)`` of the model, without allocating it."""
    with nnx.use_eager_sharding(False):
        abs_model = nnx.eval_shape(model_fn)
    graphdef, abs_params, rest = nnx.split(abs_model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("init_train_state: the model has non-Param state "
                         f"({sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})}); "
                         "jaxpar trains models whose state is all nnx.Param. Keep RNG streams "
                         "and counters outside the module.")
    logical = nnx.to_pure_dict(nnx.get_partition_spec(abs_params))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(abs_params))
    return graphdef, shapes, logical


def _opt_specs(tx: optax.GradientTransformation, shapes: Any, param_like_specs: Any) -> tuple[Any, Any]:
    opt_shapes = jax.eval_shape(tx.init, shapes)
    specs = optax.tree_map_params(tx, lambda _, s: s, opt_shapes, param_like_specs,
                                  transform_non_params=lambda _: PartitionSpec(),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))
    return opt_shapes, specs


def init_train_state(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh,
                     strategy: Strategy = Strategy()) -> tuple[TrainState, StateLayout]:
    """Create the train state directly in its sharded layout.

    ``model_fn()`` builds the model (eager sharding is turned off inside it: jaxpar places the
    state). Parameters are annotated with logical names via ``nnx.with_partitioning`` /
    ``out_sharding`` metadata.

    Args:
      model_fn: builds the NNX model (every variable an ``nnx.Param``).
      tx: the optax optimizer.
      mesh: the device mesh.
      strategy: what to do with the mesh axes; the layout records it, and
        :func:`jaxpar.make_train_step` runs it.

    Returns:
      ``(state, layout)``: the :class:`TrainState`, already sharded, and its :class:`StateLayout`.
    """
    layout, init = _layout_and_init(model_fn, tx, mesh, strategy)
    return jax.jit(init, out_shardings=layout.shardings())(), layout


def state_layout(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh,
                 strategy: Strategy = Strategy()) -> StateLayout:
    """The :class:`StateLayout` that :func:`init_train_state` builds, without creating the state.

    Args:
      model_fn: builds the NNX model; it is only traced (``eval_shape``).
      tx: the optax optimizer.
      mesh: the device mesh (abstract devices of a compile target work too).
      strategy: what to do with the mesh axes.

    Returns:
      The layout; ``layout.abstract_state()`` is a restore or ahead-of-time compile target.

    Example:
      >>> import jax, optax
      >>> from flax import nnx
      >>> from jaxpar import Strategy, make_mesh
      >>> from jaxpar.models.mlp import MLPClassifier
      >>> mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
      >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
      >>> layout = state_layout(model_fn, optax.sgd(0.1), mesh, Strategy(zero=3))
      >>> layout.strategy.zero, layout.params["up"][0]["kernel"]
      (3, P('data', 'tensor'))
    """
    return _layout_and_init(model_fn, tx, mesh, strategy)[0]


def _layout_and_init(model_fn, tx, mesh: Mesh, strategy: Strategy) -> tuple[StateLayout, Callable]:
    """The layout and an ``init() -> TrainState`` to jit with the layout's shardings."""
    graphdef, shapes, logical = abstract_model(model_fn)
    rules = tuple(strategy.rules(mesh))
    base = resolve(logical, rules, mesh, shapes)
    sizes = dict(mesh.shape)
    params = zero_specs(base, shapes, logical, sizes, strategy.zero, "params")
    grads = zero_specs(base, shapes, logical, sizes, strategy.zero, "grads")
    opt_param = zero_specs(base, shapes, logical, sizes, strategy.zero, "opt")
    opt_shapes, opt_state = _opt_specs(tx, shapes, opt_param)
    layout = StateLayout(mesh, rules, graphdef, shapes, logical, params, grads, opt_param, opt_state, opt_shapes,
                         strategy=strategy)
    comm_init = lambda: ()   # noqa: E731
    if strategy.sync is not None or replicas(mesh) > 1:
        if strategy.compression is not None:
            from ..sync import SyncError

            raise SyncError(f"Strategy(compression={strategy.compression.name!r}) on a mesh with replica="
                            f"{replicas(mesh)}: the replica axis keeps replicas in step with Strategy.sync "
                            "(synchronous by default), which does not run through a gradient codec. Fold the "
                            "replica devices into the data axis (mesh data=...) to compress the exchange, or "
                            "drop compression.")
        return _relaxed_layout_and_init(model_fn, tx, layout, strategy)
    if strategy.compression is not None:
        from .compressed import compression_state   # compression loads only when used

        comm_init, comm_specs, comm_shapes = compression_state(strategy.compression, layout, strategy.zero)
        comm_init = jax.jit(comm_init, out_shardings=named_shardings(comm_specs, mesh))
        layout = replace(layout, comm=comm_specs, comm_shapes=comm_shapes, comm_init=comm_init)
    two_bw, stashed = _two_bw(strategy, mesh), _stashed(strategy, mesh)
    if two_bw:      # PipeDream-2BW keeps W(t-1) beside W(t), in the same layout
        layout = replace(layout, versions=layout.params, versions_shapes=layout.shapes)
    if stashed:     # weight stashing keeps the newest older versions of every stage, newest first
        layout = replace(layout, versions=(layout.params,) * stashed, versions_shapes=(layout.shapes,) * stashed)

    def init():
        with nnx.use_eager_sharding(False):
            model = model_fn()
        p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        older = jax.tree.map(jnp.copy, p) if two_bw else ()
        older = tuple(jax.tree.map(jnp.copy, p) for _ in range(stashed)) if stashed else older
        return TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), comm_init(), versions=older)

    return layout, init


def _two_bw(strategy: Strategy, mesh: Mesh) -> bool:
    """Whether the state keeps PipeDream-2BW's second weight version (errors for settings it cannot run)."""
    from ..pipeline.asynchronous import check_two_bw, is_two_bw

    if strategy.schedule != "pipedream-2bw":
        return False
    check_two_bw(strategy, mesh.shape)
    return is_two_bw(strategy, mesh.shape)


def _stashed(strategy: Strategy, mesh: Mesh) -> int:
    """Older weight versions the state keeps for PipeDream weight stashing (0: another schedule)."""
    if strategy.schedule != "pipedream":
        return 0
    from ..pipeline.stashing import check_stashing, older_versions

    check_stashing(strategy, mesh.shape)
    return older_versions(mesh.shape["pipe"], strategy.update_every)


def _relaxed_layout_and_init(model_fn, tx, layout: StateLayout, strategy: Strategy) -> tuple[StateLayout, Callable]:
    """The state of K replicas (``replica`` axis; :mod:`jaxpar.train.relaxed`)."""
    from .relaxed import relaxed_layout   # relaxed synchronisation loads only when used

    layout, make = relaxed_layout(layout, tx, strategy)

    def init():
        with nnx.use_eager_sharding(False):
            model = model_fn()
        p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(jnp.zeros((), jnp.int32), p, *make(p))

    return layout, init
