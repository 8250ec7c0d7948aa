"""Repeated blocks: the one call through which a model hands its layer loop to the strategy.

A model keeps its repeated layers *stacked*: every parameter of the block has a
leading ``layers`` axis (a module built with ``nnx.vmap(...,
transform_metadata={nnx.PARTITION_NAME: "layers"})``, or a dict of stacked
arrays) and runs them with :func:`scan_blocks` (an NNX module) or
:func:`run_layers` (a pure function of one layer's parameters). Outside a jaxpar
train step that is a ``lax.scan`` over the layers under the model's remat policy.
Inside one, the strategy takes the call over:

* explicit data parallelism (:mod:`jaxpar.parallel._data_parallel`) wraps each layer with
  its flat-buffer all-gather of the parameters and reduce-scatter of the gradients;
* a pipeline (:mod:`jaxpar.parallel.pipeline._cut`) cuts the model at this call: what runs
  before it runs on the first stage, the layers are spread over the stages, and
  what runs after it (head and loss) runs on the last stage.

The block's input and output is one activation array with the batch first.

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    ... def make_blocks(key):
    ...     init = nnx.initializers
    ...     return nnx.Linear(4, 4, rngs=nnx.Rngs(key),
    ...                       kernel_init=nnx.with_partitioning(init.lecun_normal(), ("embed", "mlp")),
    ...                       bias_init=nnx.with_partitioning(init.zeros_init(), ("mlp",)))
    >>> with nnx.use_eager_sharding(False):
    ...     blocks = make_blocks(jax.random.split(jax.random.key(0), 3))
    >>> scan_blocks(blocks, jnp.ones((2, 4))).shape
    (2, 4)
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.rules import RulesError, path_str, scoped
from jaxpar.errors import ModelStateError
from jaxpar.options import LAYER_INPUT

#: The logical name of the stacked layer axis (axis 0 of every block parameter).
LAYERS = "layers"


#: The models' remat names (``remat=`` of the built-in models' configs).
REMAT_POLICIES = ("none", "full", "save-matmuls", "offload")
#: The ``checkpoint_name`` of a fused attention's output and residuals, which ``save-matmuls`` saves.
ATTENTION_RESIDUALS = "jaxpar_attention"
_OFFLOADED: contextvars.ContextVar = contextvars.ContextVar("jaxpar_offloaded_activations", default=None)


@dataclass
class OffloadedActivations:
    """The activation names a train step offloads (``Strategy.offload.activations``), and what its trace
    asked of them: ``policies`` built (:func:`remat_policy` ``"offload"``) and ``seen``, the names that
    the policy met in the traced program."""

    names: tuple[str, ...]
    policies: int = 0
    seen: set = dataclasses.field(default_factory=set)


def use_offloaded_activations(names: tuple[str, ...]) -> ContextManager[OffloadedActivations]:
    """Offload the residuals named ``names`` to host memory in this context, wherever the model's remat
    policy is ``"offload"`` (the train step opens it around its trace).

    Args:
      names: ``checkpoint_name`` names (:data:`LAYER_INPUT`, :data:`ATTENTION_RESIDUALS`, the model's own).

    Returns:
      A context manager yielding the :class:`OffloadedActivations` record.
    """
    return scoped(_OFFLOADED, OffloadedActivations(tuple(names)))


class _OffloadPolicy:
    """``save_and_offload_only_these_names`` over the context's names, recording the names it meets
    (a ``jax.checkpoint`` policy is called once per equation of the checkpointed function)."""

    def __init__(self, record: OffloadedActivations):
        self.record = record
        self.policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=record.names, offload_src="device",
            offload_dst="pinned_host")

    def __call__(self, prim, *avals, **params):
        if "name" in params and getattr(prim, "name", "") == "name":
            self.record.seen.add(params["name"])
        return self.policy(prim, *avals, **params)


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of a remat name (``None`` for ``"none"``: no remat).

    Args:
      name: ``"none"``, ``"full"`` (save nothing), ``"save-matmuls"`` (save dot results and a fused
        attention's residuals, :data:`ATTENTION_RESIDUALS`: its kernel's forward runs once) or ``"offload"``
        (move the residuals named by the step's ``Strategy.offload.activations`` to host memory and back for
        the backward, recompute the rest; outside a train step that names some, it saves nothing).

    Returns:
      The policy, or ``None``.

    >>> remat_policy("none") is None, remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    (True, True)
    """
    policies = jax.checkpoint_policies
    if name == "offload":
        record = _OFFLOADED.get()
        if record is None or not record.names:
            return policies.nothing_saveable
        record.policies += 1
        return _OffloadPolicy(record)
    return {"none": None, "full": policies.nothing_saveable,
            "save-matmuls": policies.save_from_both_policies(
                policies.checkpoint_dots, policies.save_only_these_names(ATTENTION_RESIDUALS))}[name]


def with_remat(fn: Callable, remat: Callable | None = None) -> Callable:
    """``fn`` under the ``jax.checkpoint`` policy ``remat`` (``None``: ``fn`` itself, no remat). Under the
    ``"offload"`` policy the layer's input (its second argument) is named :data:`LAYER_INPUT`.

    Args:
      fn: the function, ``fn(layer_params, x, ...)``.
      remat: a ``jax.checkpoint`` policy, or ``None``.

    Returns:
      The function to call.

    >>> with_remat(abs) is abs
    True
    """
    return fn if remat is None else jax.checkpoint(name_layer_input(fn, remat), policy=remat)


def name_layer_input(fn: Callable, remat: Callable | None) -> Callable:
    """``fn(layer_params, x, ...)`` with its input ``x`` named :data:`LAYER_INPUT` under the ``"offload"``
    remat policy (``fn`` itself under any other): what a runner that checkpoints a layer itself calls.

    Args:
      fn: the layer.
      remat: its ``jax.checkpoint`` policy, or ``None``.

    Returns:
      The layer to checkpoint.
    """
    if not isinstance(remat, _OffloadPolicy):
        return fn
    from jax.ad_checkpoint import checkpoint_name

    return lambda p, x, *a: fn(p, jax.tree.map(lambda v: checkpoint_name(v, LAYER_INPUT), x), *a)


@dataclass(frozen=True)
class LayerCall:
    """One call of a model's stacked layers, as a strategy sees it.

    - ``layer(layer_params, x) -> y``: one layer (no remat applied yet);
    - ``params``: the stacked parameters (leading ``layers`` axis);
    - ``logical``: one layer's logical names, a tree mirroring ``params`` without the ``layers`` axis;
    - ``x``: the input activation, batch first; ``remat``: the model's ``jax.checkpoint`` policy;
    - ``scan``: ``lax.scan`` over the layers (``False``: a Python loop, unrolled);
    - ``closure``: arrays ``layer`` reads besides its arguments (a list's per-call arguments such as
      positions): values of the caller's trace, so a strategy that moves the layer into another
      trace (a pipeline stage) cannot run it;
    - ``source``, ``transform``: the model's own layer and the :func:`use_layer_transform` that made
      ``layer`` of it (``None``: ``layer`` is the model's own).
    """

    layer: Callable
    params: Any
    logical: Any
    x: jax.Array
    remat: Callable | None = None
    scan: bool = True
    closure: tuple = ()
    source: Callable | None = None
    transform: Callable | None = None

    def rewrap(self, wrap: Callable[[Callable], Callable]) -> Callable:
        """``wrap`` applied to the model's own layer, then the layer transform (a runner that wraps
        the layer, e.g. to carry values beside the activation, wraps it inside the transform).

        Args:
          wrap: ``wrap(layer) -> layer``.

        Returns:
          The layer to run.
        """
        if self.transform is None:
            return wrap(self.layer)
        return self.transform(wrap(self.source), self.logical)

    def layer_shapes(self) -> Any:
        """One layer's parameters as ``ShapeDtypeStruct``s (the ``layers`` axis dropped)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.params)

    def run(self, body: Callable | None = None) -> jax.Array:
        """Apply ``body`` (default: the layer under its remat policy) to every layer in turn.

        Args:
          body: ``body(layer_params, x) -> y``, or ``None``.

        Returns:
          The last layer's output.
        """
        body = body or with_remat(self.layer, self.remat)
        if self.scan:
            return jax.lax.scan(lambda h, p: (body(p, h), None), self.x, self.params)[0]
        x = self.x
        for i in range(jax.tree.leaves(self.params)[0].shape[0]):
            x = body(jax.tree.map(lambda a, i=i: a[i], self.params), x)
        return x


_RUNNER: contextvars.ContextVar = contextvars.ContextVar("jaxpar_layer_runner", default=None)
_TRANSFORM: contextvars.ContextVar = contextvars.ContextVar("jaxpar_layer_transform", default=None)


def use_layer_runner(runner: Callable[[LayerCall], jax.Array] | None) -> ContextManager[None]:
    """Let ``runner(call) -> y`` run every :func:`run_layers` / :func:`scan_blocks` call in this
    context (``None``: the plain scan). Strategies use it; models never need to.

    Args:
      runner: ``runner(call: LayerCall) -> y``, or ``None``.

    >>> import jax.numpy as jnp
    >>> with use_layer_runner(lambda call: call.x * 0):
    ...     run_layers(lambda p, x: x + p, jnp.ones((3,)), jnp.ones((2,))).tolist()
    [0.0, 0.0]
    """
    return scoped(_RUNNER, runner)


def use_layer_transform(transform: Callable[[Callable, Any], Callable] | None) -> ContextManager[None]:
    """Let ``transform(layer, logical) -> layer`` rewrite the layer of every :func:`run_layers` /
    :func:`scan_blocks` call in this context, before any runner sees it (FP8 matmuls:
    :func:`jaxpar.parallel.fp8_loss`).

    Args:
      transform: ``transform(layer, logical) -> layer``, or ``None``.

    >>> import jax.numpy as jnp
    >>> with use_layer_transform(lambda layer, logical: lambda p, x: 2 * layer(p, x)):
    ...     run_layers(lambda p, x: x + p, jnp.ones((3,)), jnp.zeros((1,))).tolist()
    [14.0]
    """
    return scoped(_TRANSFORM, transform)


def current_layer_runner() -> Callable | None:
    """The layer runner in effect (:func:`use_layer_runner`), for a runner that hands calls on to it.

    Returns:
      ``runner(call) -> y``, or ``None`` (the plain scan).
    """
    return _RUNNER.get()


def _traced_afresh(layer: Callable) -> Callable:
    """``layer`` as a new function object. JAX caches a function's trace by its identity and the shapes
    (``jax.make_jaxpr``, ``jax.checkpoint``), not by jaxpar's contexts that the trace reads (the rules, context
    parallelism, FP8): a model's module-level layer traced under one strategy would otherwise come back
    under another in the same process."""
    return lambda *args, **kwargs: layer(*args, **kwargs)


def run_layers(layer: Callable, params: Any, x: jax.Array, *, logical: Any = None,
               remat: Callable | None = None, scan: bool = True, closure: tuple = ()) -> jax.Array:
    """Run ``layer(layer_params, x) -> y`` over stacked ``params`` (leading ``layers`` axis).

    Args:
      layer: ``layer(layer_params, x) -> y``.
      params: the stacked parameters.
      x: the first layer's input, batch first.
      logical: one layer's logical names (a tree mirroring ``params``, no ``layers`` axis;
        ``None``: unannotated, replicated).
      remat: a ``jax.checkpoint`` policy (``None``: no remat).
      scan: ``False`` unrolls the loop.
      closure: the arrays ``layer`` reads besides its arguments (see :class:`LayerCall`).

    Returns:
      The last layer's output.

    >>> import jax.numpy as jnp
    >>> run_layers(lambda w, x: x * w, jnp.array([2.0, 3.0]), jnp.ones((2,))).tolist()
    [6.0, 6.0]
    """
    if logical is None:
        logical = jax.tree.map(lambda a: (None,) * (a.ndim - 1), params)
    layer = _traced_afresh(layer)
    transform = _TRANSFORM.get()
    call = LayerCall(layer, params, logical, x, remat, scan, tuple(closure))
    if transform is not None:
        call = dataclasses.replace(call, layer=transform(layer, logical), source=layer, transform=transform)
    runner = _RUNNER.get()
    return call.run() if runner is None else runner(call)


def _layer_logical(state: nnx.State) -> Any:
    """One layer's logical names from a stacked module's sharding metadata; an error names a
    parameter whose axis 0 is not the ``layers`` axis."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)

    def drop(path, spec, value):
        names = tuple(spec) if spec is not None else ()
        if names and names[0] != LAYERS or (not names and value.ndim > 0):
            raise RulesError(
                f"scan_blocks: parameter {path_str(path)!r} of shape {tuple(value.shape)} has logical names "
                f"{names or 'none'}; every parameter of stacked blocks needs {LAYERS!r} on axis 0. Create the "
                f"blocks with nnx.vmap(..., transform_metadata={{nnx.PARTITION_NAME: {LAYERS!r}}}) and annotate "
                "each parameter with nnx.with_partitioning.")
        return tuple(names[1:])

    return jax.tree_util.tree_map_with_path(drop, specs, shapes,
                                            is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def scan_blocks(blocks: nnx.Module, x: jax.Array, *, remat: Callable | None = None, scan: bool = True,
                layer_args: tuple = (), layer_kwargs: dict | None = None) -> jax.Array:
    """Run the stacked NNX module ``blocks`` (built with ``nnx.vmap``) layer by layer on ``x``:
    ``x = block_i(x, *layer_args, **layer_kwargs)`` for every layer ``i``. See the module docstring;
    ``remat`` and ``scan`` as in :func:`run_layers`. ``blocks`` must hold only ``nnx.Param`` state.

    Args:
      blocks: the stacked module.
      x: the first layer's input, batch first.
      remat: a ``jax.checkpoint`` policy, or ``None`` (no remat).
      scan: ``False`` unrolls the loop.
      layer_args, layer_kwargs: further arguments of every layer's call.

    Returns:
      The last layer's output.
    """
    graphdef, state, rest = nnx.split(blocks, nnx.Param, ...)
    if jax.tree.leaves(rest):
        kinds = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
        raise ModelStateError(f"scan_blocks: the blocks hold non-Param state {kinds}; stacked blocks may hold only "
                              "nnx.Param variables (keep RNG streams, caches and counters outside them).")
    logical = _layer_logical(state)

    kwargs = dict(layer_kwargs or {})

    def layer(p, h):
        with nnx.use_eager_sharding(False):
            return nnx.merge(graphdef, p)(h, *layer_args, **kwargs)

    closure = tuple(a for a in jax.tree.leaves((layer_args, kwargs)) if isinstance(a, jax.Array))
    return run_layers(layer, nnx.to_pure_dict(state), x, logical=logical, remat=remat, scan=scan, closure=closure)


@dataclass(frozen=True)
class LayerSite:
    """Where a model ran stacked layers, found by :func:`find_layer_calls`: ``leaves`` are the
    positions of the stacked parameters among ``jax.tree.leaves(params)`` (``None``: not a
    parameter leaf as given, e.g. a value computed from one), ``treedef`` their tree, ``x`` the
    input's shape and dtype; ``layer``, ``logical``, ``remat``, ``scan``, ``closure`` as in :class:`LayerCall`."""

    leaves: tuple
    treedef: Any
    layer: Callable
    logical: Any
    remat: Callable | None
    scan: bool
    x: jax.ShapeDtypeStruct
    closure: tuple = ()


def find_layer_calls(fn: Callable, params: Any, *args: Any, wrap: Callable | None = None) -> list[LayerSite]:
    """Trace ``fn(params, *args)`` abstractly (nothing is computed) and report each
    :func:`run_layers` / :func:`scan_blocks` call it makes, in order. ``wrap``: a transformation
    of ``fn`` to trace it under (e.g. JAX's explicit mode), applied outside the recording.

    Args:
      fn: ``fn(params, *args)``, the model's forward or loss.
      params: its parameters (arrays or ``ShapeDtypeStruct`` s).
      *args: its other arguments.
      wrap: ``fn -> fn'``, or ``None``.

    Returns:
      One :class:`LayerSite` per call.

    >>> import jax.numpy as jnp
    >>> f = lambda p, x: run_layers(lambda w, h: h * w, p["w"], x).sum() + p["b"]
    >>> [s.leaves for s in find_layer_calls(f, {"b": 1.0, "w": jnp.ones(3)}, jnp.ones(2))]
    [(1,)]
    """
    sites: list[LayerSite] = []

    def traced(p, *a):
        position = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(p))}

        def record(call: LayerCall) -> jax.Array:
            leaves, treedef = jax.tree.flatten(call.params)
            sites.append(LayerSite(tuple(position.get(id(leaf)) for leaf in leaves), treedef, call.layer,
                                   call.logical, call.remat, call.scan,
                                   jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), call.x), call.closure))
            return call.run()

        with use_layer_runner(record):
            return fn(p, *a)

    abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), t)  # noqa: E731
    jax.eval_shape(wrap(traced) if wrap else traced, abstract(params), *abstract(args))
    return sites
