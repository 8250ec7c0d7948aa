"""The train state created already sharded: ``eval_shape`` -> shardings -> ``jit(out_shardings=...)``.

No full copy of the parameters or optimizer state ever sits on one device. The layout's parts
(``layout.parts``) are added here: ``codec``, ``sync`` (:mod:`._replica_mean`), ``versions``, and the
features' parts of ``stats`` the caller passes (``parts=[...]``).

Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from jaxpar import MeshSpec, Strategy, make_mesh
    >>> from jaxpar.models._mlp import MLPClassifier
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

import functools
from dataclasses import fields, replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxpar.compat._settings import replicas_on
from jaxpar.compat._table import Setting, raise_problems
from jaxpar.rules import named_shardings, resolve
from jaxpar.strategy import Strategy
from jaxpar.parallel._tensor import warn_unsplit_tensor_axis
from jaxpar.parallel._zero import warn_replicated, zero_specs
from jaxpar.adapters._layer_lists import stack_layers, stacked_counts
from jaxpar.adapters._mesh_axes import abstract_model, check_model_axes
from jaxpar.step._exchange import compression_state
from jaxpar.step._replica_mean import relaxed_layout
from jaxpar.errors import StepError
from jaxpar.step._state import (ParamLayout, PartLayout, StateLayout, TrainState, layout_strategy, optimizer_specs,
                                 with_parts)


def param_layout(model_fn: Callable[[], nnx.Module], mesh: Mesh, strategy: Strategy = Strategy()) -> ParamLayout:
    """The parameters' layout under ``strategy``, without an optimizer: the model traced once (``eval_shape``).

    An optimizer that needs the parameters' logical names or their moments' specs (Muon's routing and
    placement, LARS / LAMB's mask) reads them here; :func:`state_layout` and :func:`init_train_state` take it
    (``param_layout=``) and do not trace the model again.

    Args:
      model_fn: builds the NNX model (every variable an ``nnx.Param``); it is only traced.
      mesh: the device mesh (abstract devices of a compile target work too).
      strategy: what to do with the mesh axes.

    Returns:
      The :class:`~jaxpar.step.ParamLayout`.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from jaxpar import Strategy, make_mesh
      >>> from jaxpar.models._mlp import MLPClassifier
      >>> mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
      >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
      >>> pl = param_layout(model_fn, mesh, Strategy(zero=3))
      >>> pl.logical["up"][0]["kernel"], pl.opt_param_specs["up"][0]["kernel"], pl.kernel_layout
      (P('embed', 'mlp'), P('fsdp', 'tensor'), 'in_out')
    """
    sizes = dict(mesh.shape)
    if sizes.get("pipe", 1) > 1:        # a pipeline cuts the layers: an nnx.List of alike layers runs stacked
        model_fn = functools.partial(_stacked, model_fn)
    with nnx.use_eager_sharding(False):
        abs_model = nnx.eval_shape(model_fn)
    graphdef, shapes, logical = abstract_model(abs_model)
    rules = tuple(strategy.rules(mesh))
    check_model_axes(logical, rules, mesh)
    base = resolve(logical, rules, mesh, shapes)
    params, grads, opt = (zero_specs(base, shapes, logical, sizes, strategy.zero, what)
                          for what in ("params", "grads", "opt"))
    warn_unsplit_tensor_axis(params, mesh)
    warn_replicated(shapes, opt, logical, sizes, strategy.zero)
    return ParamLayout(mesh, rules, graphdef, shapes, logical, params, grads, opt, strategy=strategy,
                       layer_lists=stacked_counts(abs_model), kernel_layout=getattr(abs_model, "kernel_layout", "in_out"),
                       model_fn=model_fn)


def init_train_state(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh,
                     strategy: Strategy = Strategy(), *, params: Any = None, parts: Sequence[PartLayout] = (),
                     param_layout: ParamLayout | None = None) -> tuple[TrainState, StateLayout]:
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
      params: start from these parameters instead of ``model_fn``'s (e.g. :meth:`jaxpar.hf.Checkpoint.load`
        onto ``state_layout(...).params``); the optimizer state starts fresh.
      parts: features' parts of ``TrainState.stats`` (:func:`jaxpar.step.noise_scale`,
        :func:`jaxpar.step.router_bias`), checked against the strategy by the compatibility table.
      param_layout: :func:`param_layout` of ``model_fn`` on ``mesh`` and ``strategy``, already traced
        (None: traced here).

    Returns:
      ``(state, layout)``: the :class:`TrainState`, already sharded, and its :class:`StateLayout`.
    """
    layout, init = _layout_and_init(model_fn, tx, mesh, strategy, parts, param_layout)
    return jax.jit(init, out_shardings=layout.shardings())(params), layout


def state_layout(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh,
                 strategy: Strategy = Strategy(), *, parts: Sequence[PartLayout] = (),
                 param_layout: ParamLayout | None = None) -> StateLayout:
    """The :class:`StateLayout` that :func:`init_train_state` builds, without creating the state.

    Args:
      model_fn: builds the NNX model; it is only traced (``eval_shape``).
      tx: the optax optimizer.
      mesh: the device mesh (abstract devices of a compile target work too).
      strategy: what to do with the mesh axes.
      parts: as in :func:`init_train_state`.
      param_layout: as in :func:`init_train_state`.

    Returns:
      The layout; ``layout.abstract_state()`` is a restore or ahead-of-time compile target.

    Example:
      >>> import jax, optax
      >>> from flax import nnx
      >>> from jaxpar import Strategy, make_mesh
      >>> from jaxpar.models._mlp import MLPClassifier
      >>> mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
      >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
      >>> layout = state_layout(model_fn, optax.sgd(0.1), mesh, Strategy(zero=3))
      >>> layout.strategy.zero, layout.params["up"][0]["kernel"]
      (3, P('data', 'tensor'))
    """
    return _layout_and_init(model_fn, tx, mesh, strategy, parts, param_layout)[0]


def _layout_and_init(model_fn, tx, mesh: Mesh, strategy: Strategy, parts=(),
                     traced: ParamLayout | None = None) -> tuple[StateLayout, Callable]:
    """The layout and an ``init() -> TrainState`` to jit with the layout's shardings."""
    if traced is None:
        traced = param_layout(model_fn, mesh, strategy)
    elif traced.mesh != mesh:
        raise StepError(f"init_train_state(param_layout=...): the layout was traced for the mesh "
                        f"{dict(traced.mesh.shape)}, not {dict(mesh.shape)}; pass param_layout(model_fn, mesh, strategy).")
    strategy, sizes = layout_strategy(traced, strategy), dict(mesh.shape)
    opt_shapes, opt_state = optimizer_specs(tx, traced.shapes, traced.opt_param_specs)
    layout = StateLayout(**{f.name: getattr(traced, f.name) for f in fields(ParamLayout)}, opt_state=opt_state,
                         opt_shapes=opt_shapes)
    raise_problems(Setting(strategy, sizes, **{k: v for p in parts for k, v in p.setting.items()}))   # once
    if replicas_on(Setting(strategy, sizes)):
        layout, make = relaxed_layout(layout, tx, strategy)
    else:
        layout, make = _feature_parts(layout, tx)
    layout = with_parts(layout, parts)

    def init(p=None):
        p = _model_params(traced.model_fn) if p is None else p
        opt_state, made = make(p)
        stats = {part.name: part.init(p) for part in parts}
        return TrainState(jnp.zeros((), jnp.int32), p, opt_state, **made, **({"stats": stats} if stats else {}))

    return layout, init


def _feature_parts(layout: StateLayout, tx) -> tuple[StateLayout, Callable]:
    """The layout with its ``codec`` and ``versions`` parts, and ``make(params) -> (opt_state, parts)``."""
    strategy, sizes, parts = layout.strategy, dict(layout.mesh.shape), {}
    if strategy.compression is not None:
        make_codec, codec_specs, codec_shapes = compression_state(strategy.compression, layout, strategy.zero)
        codec_init = jax.jit(make_codec, out_shardings=named_shardings(codec_specs, layout.mesh))
        parts["codec"] = PartLayout(codec_specs, codec_shapes, lambda params: codec_init())
    older_shapes = older_versions_of(strategy, sizes, layout.shapes)
    if older_shapes:
        parts["versions"] = PartLayout(older_versions_of(strategy, sizes, layout.params), older_shapes)

    def make(p):
        older = jax.tree.map(jnp.copy, older_versions_of(strategy, sizes, p))
        codec = parts["codec"].init(p) if "codec" in parts else ()
        return tx.init(p), {"codec": codec, "versions": older}

    return replace(layout, parts=parts), make


def _model_params(model_fn: Callable[[], nnx.Module]) -> Any:
    with nnx.use_eager_sharding(False):
        model = model_fn()
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _stacked(model_fn: Callable[[], nnx.Module]) -> nnx.Module:
    return stack_layers(model_fn())


def older_versions_of(strategy: Strategy, sizes: dict, params: Any) -> Any:
    """The older weight versions a pipeline schedule keeps beside ``params`` (``TrainState.versions``).

    Args:
      strategy: the strategy.
      sizes: the mesh axis sizes.
      params: the parameters, or their specs or shapes (the versions mirror them).

    Returns:
      PipeDream-2BW: ``params`` (``W(t-1)`` beside ``W(t)``, in the same layout); weight stashing:
      a tuple of ``ceil((pipe - 1) / update_every)`` of them (the newest older versions of every
      stage, newest first); any other schedule: ``()``.
    """
    from jaxpar.parallel.pipeline._pipedream import is_stashing, is_two_bw, older_versions

    if is_two_bw(strategy, sizes):
        return params
    if is_stashing(strategy, sizes):
        return (params,) * older_versions(sizes["pipe"], strategy.update_every)
    return ()
