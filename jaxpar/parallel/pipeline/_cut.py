"""Cut any NNX model for a pipeline at its stacked layers, with the user's own loss.

A model that runs its repeated blocks through :func:`jaxpar.adapters.scan_blocks` (or
:func:`~jaxpar.adapters.run_layers`) needs no other declaration: :func:`cut_model` traces
``loss_fn(model, batch)`` once, abstractly, to find that call, and builds the three
:class:`PipelineParts` from the loss itself (docs/pipeline.md, "Any NNX model"): ``pre`` runs the
loss up to the call, which stops it and hands back its input; ``layer`` is one layer under the
model's remat policy; ``post`` runs the loss again with the call replaced by the last stage's output.
``outer`` is every parameter leaf outside the stacked blocks, as a list.

Example::

    >>> import jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> class Tiny(nnx.Module):                  # an input layer, then 2 stacked layers
    ...     def __init__(self):
    ...         self.w_in = nnx.Param(jnp.full((3, 4), 0.5))
    ...         self.blocks = nnx.Param(jnp.stack([jnp.eye(4)] * 2))     # leading ``layers`` axis
    ...     def __call__(self, x):
    ...         return jaxpar.run_layers(lambda w, h: jnp.tanh(h @ w), self.blocks[...], x @ self.w_in[...])
    >>> loss_fn = lambda model, mb: jnp.mean(model(mb["x"]) ** 2)
    >>> graphdef, params = nnx.split(Tiny())
    >>> params, microbatch = nnx.to_pure_dict(params), {"x": jnp.ones((2, 3))}
    >>> cut = cut_model(loss_fn, graphdef, params, microbatch)
    >>> outer, blocks = cut.split(params)        # outer: [w_in]; blocks: the stacked array
    >>> len(outer), blocks.shape
    (1, (2, 4, 4))
    >>> x = cut.parts.pre(outer, microbatch)     # first stage: up to the blocks
    >>> x.shape
    (2, 4)
    >>> y = cut.parts.layer(blocks[1], cut.parts.layer(blocks[0], x))
    >>> bool(jnp.allclose(cut.parts.post(outer, y, microbatch), loss_fn(nnx.merge(graphdef, params), microbatch)))
    True
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.adapters._blocks import find_layer_calls, use_layer_runner, with_remat
from jaxpar.adapters._layer_lists import layer_differences
from jaxpar.mesh import data_axes
from jaxpar.adapters._mesh_axes import batch_specs, call_site, explicit_call, model_batch_axes, needs_explicit_mesh
from jaxpar.rules import constrain, spec_without
from jaxpar.errors import PipelineCutError
from jaxpar.parallel.pipeline._gathers import whole_indexed_dims


@dataclass(frozen=True)
class PipelineParts:
    """How the executor runs a model: ``pre`` and ``post`` share one parameter tree, ``outer`` (every
    parameter that is not a block's; a tied embedding is one leaf of both, its gradients added).

    - ``pre(outer, microbatch) -> x``: before the blocks (e.g. the embedding), on the first virtual stage.
    - ``layer(layer_params, x) -> y``: one block; ``y`` has ``x``'s shape and dtype.
    - ``post(outer, y, microbatch) -> loss``: after the blocks (e.g. head and loss), on the last
      virtual stage: a scalar averaged over the micro-batch's rows.
    """

    pre: Callable
    layer: Callable
    post: Callable

    def __post_init__(self):
        for name in ("pre", "layer", "post"):
            value = getattr(self, name)
            if not callable(value):
                raise PipelineCutError(f"PipelineParts({name}={value!r}): {name} must be a function; see the "
                                       "class docstring for each part's signature.")


class _Reached(Exception):
    """Raised at the stacked-layers call to end the ``pre`` part there; its argument: the call's input."""


def _stop(call):
    raise _Reached(call.x)


def _stage_layout(x, rows: int):
    """The layout of activations between pipeline stages and layers: each leaf of ``x`` whose leading
    dimension is the micro-batch's ``rows`` split over the data axes there and, for ``[batch, length,
    ...]`` leaves, by the ``length`` rule on its sequence (over ``context`` under context
    parallelism, else whole); the rest whole, as are leaves without the batch (statistics carried
    beside the activation). Left free, XLA may pick another layout inside a stage's branch and move
    data between layouts with collective-permutes, which XLA:CPU runs as one rendezvous over every
    device (a deadlock or a wrong result inside a branch only one stage runs)."""
    def one(a):
        if not a.ndim or a.shape[0] != rows:
            return constrain(a, (None,) * a.ndim)
        sequence = ("length",) if a.ndim >= 3 else ()
        return constrain(a, ("batch",) + sequence + (None,) * (a.ndim - 1 - len(sequence)))

    return jax.tree.map(one, x)


def _sent(x):
    """``x`` as the pipeline carries it: integer and boolean leaves as float32 (exact below 2**24).
    The executor differentiates what it sends between layers and stages, and an integer's
    cotangent (``float0``) cannot be stored or sent."""
    return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(jnp.float32), x)


def _received(x, like):
    """Inverse of :func:`_sent`: each leaf back in the dtype of ``like``'s."""
    return jax.tree.map(lambda a, t: a if a.dtype == t.dtype else a.astype(t.dtype), x, like)


@dataclass(frozen=True)
class ModelCut:
    """A model cut at its stacked layers: ``parts`` for the executor, and how the parameter
    tree splits into ``outer`` (a list of leaves) and ``blocks`` (the stacked tree)."""

    parts: PipelineParts
    block_leaves: tuple[int, ...]      # positions of the blocks' leaves in jax.tree.leaves(params)
    block_treedef: Any
    params_treedef: Any
    x: Any                              # the blocks' input (one micro-batch): ShapeDtypeStructs

    def split(self, params: Any) -> tuple[list, Any]:
        """``(outer, blocks)`` of a tree of the cut model's structure (parameters or gradients): the leaves
        outside the stacked blocks (a list), and the blocks' tree."""
        leaves = self.params_treedef.flatten_up_to(params)
        inside = set(self.block_leaves)
        outer = [leaf for i, leaf in enumerate(leaves) if i not in inside]
        return outer, self.block_treedef.unflatten([leaves[i] for i in self.block_leaves])

    def merge(self, outer: list, blocks: Any) -> Any:
        """Inverse of :meth:`split`: the parameter tree of ``outer`` and ``blocks``."""
        inside = dict(zip(self.block_leaves, self.block_treedef.flatten_up_to(blocks)))
        rest = iter(outer)
        return self.params_treedef.unflatten([inside[i] if i in inside else next(rest)
                                              for i in range(self.params_treedef.num_leaves)])


def _site(loss_fn: Callable, graphdef, params: Any, batch: Any, explicit: "_Explicit | None"):
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    run = lambda p, b: loss_fn(nnx.merge(graphdef, p), b)   # noqa: E731
    try:
        sites = find_layer_calls(run, params, batch, wrap=explicit and explicit.whole)
    except Exception as e:  # noqa: BLE001 - JAX's refusal of a model's mesh-axis pins, said with the model's line
        if not needs_explicit_mesh(e) or explicit is not None:
            raise
        raise PipelineCutError(
            f"pipeline: loss_fn {name!r} pins shardings by mesh axes (at {call_site(e)}), which JAX allows only with "
            "the mesh's axes Explicit, and no mesh was given to run it with (cut_model(..., mesh=, own_specs=))."
            + layer_lists(nnx.merge(graphdef, params))) from e
    if len(sites) != 1:
        raise PipelineCutError(
            f"pipeline: loss_fn {name!r} runs stacked layers {len(sites)} times; a pipeline cuts the model at "
            "exactly one stacked-layers call. Run the model's repeated blocks once through "
            "jaxpar.scan_blocks(self.blocks, x) (blocks built with nnx.vmap and a 'layers' axis), or a loop over an "
            "nnx.List of alike layers, or train without a 'pipe' mesh axis."
            + (layer_lists(nnx.merge(graphdef, params)) if not sites else ""))
    site = sites[0]
    if None in site.leaves:
        raise PipelineCutError(
            f"pipeline: loss_fn {name!r} passes values computed from the parameters (not the parameters "
            "themselves) to its stacked-layers call; pass the stacked module / arrays unchanged so the "
            "pipeline can place each layer's parameters on its stage.")
    if site.closure:
        shapes = [tuple(a.shape) for a in site.closure]
        raise PipelineCutError(
            f"pipeline: loss_fn {name!r} passes arrays of shapes {shapes} to every layer besides x (e.g. positions or "
            "a mask: block(x, mask)); a pipeline stage receives only x from the previous stage. Compute them inside "
            "the layer, or train without a 'pipe' mesh axis.")
    return site


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def explicit_whole_loss(loss_fn: Callable, graphdef, shapes: Any, batch: Any, mesh, own_specs: Any) -> Callable:
    """The whole model's loss ``(params, batch) -> loss`` in JAX's explicit mode, as :func:`cut_model` runs a
    model that pins shardings by mesh axes.

    Args:
      loss_fn: the user's ``loss_fn(model, batch)``.
      graphdef: the model's NNX graph definition.
      shapes: the parameters' shapes (``jax.ShapeDtypeStruct`` tree).
      batch: one micro-batch's shapes.
      mesh: the mesh.
      own_specs: the specs the model's annotations give its parameters (before ZeRO).

    Returns:
      The loss, for use under ``jit`` with ``Auto`` axes.
    """
    explicit = _Explicit(loss_fn, graphdef, shapes, batch, mesh, own_specs)
    return explicit.whole(explicit.loss)


class _Explicit:
    """How the parts of a model that pins shardings by mesh axes enter JAX's explicit mode: the
    outer parameters (gathered over the data axes, as the pipeline holds them), one layer's
    parameters (its own specs without the ``layers`` entry), activations and micro-batches split
    over the data axes the model splits its batch over (:func:`~jaxpar.adapters._mesh_axes.model_batch_axes`,
    from an abstract trace of the loss; the others stay ``Auto``) on their batch dimension."""

    def __init__(self, loss_fn: Callable, graphdef, shapes: Any, batch: Any, mesh, own_specs: Any):
        self.loss = lambda p, b: loss_fn(nnx.merge(graphdef, p), b)
        self.mesh, self.drop = mesh, set(data_axes(mesh))
        # the stages hold the layers: their specs drop ``pipe``
        self.own = jax.tree.map(lambda sp: spec_without(sp, {"pipe"}), own_specs, is_leaf=_is_spec)
        batch_axes = model_batch_axes(self.loss, self.own, shapes, batch, mesh)
        self.axes = data_axes(mesh) if batch_axes is None else batch_axes     # None: nothing traced
        self.auto = tuple(a for a in data_axes(mesh) if a not in self.axes)

    def call(self, fn: Callable, specs_of: Callable) -> Callable:
        return explicit_call(fn, self.mesh, specs_of, self.auto)

    def whole(self, fn: Callable) -> Callable:
        return self.call(fn, lambda p, b: (self.own, batch_specs(b, self.mesh, self.axes)))

    def parts(self, cut_split: Callable, pre: Callable, layer: Callable, post: Callable):
        outer_own, block_own = cut_split(self.own)
        outer = [spec_without(sp, self.drop) for sp in outer_own]     # the pipeline gathers them over the data axes
        one = jax.tree.map(lambda sp: PartitionSpec(*tuple(sp)[1:]), block_own, is_leaf=_is_spec)
        act = lambda x: batch_specs(x, self.mesh, self.axes)   # noqa: E731
        return (self.call(pre, lambda o, mb: (outer, act(mb))),
                self._layer(layer, one, act),
                self.call(post, lambda o, y, mb: (outer, act(y), act(mb))))

    def _layer(self, layer: Callable, one: Any, act: Callable) -> Callable:
        """The layer in explicit mode, its backward re-running its forward there: a stage runs a
        layer's backward ticks after its forward, and JAX evaluates an explicit-mode pullback only
        inside the region that made it, so the stage keeps only ``x`` (full remat of the layer)."""
        forward = self.call(layer, lambda p, x: (one, act(x)))
        backward = self.call(lambda p, x, g: jax.vjp(layer, p, x)[1](g), lambda p, x, g: (one, act(x), act(g)))

        @jax.custom_vjp
        def run(p, x):
            return forward(p, x)

        run.defvjp(lambda p, x: (forward(p, x), (p, x)), lambda res, g: backward(*res, g))
        return run


def layer_lists(model: nnx.Module) -> str:
    """What the model's ``nnx.List`` of blocks would need to be pipelined, in words ("" if it has none).

    Args:
      model: the model (its parameters may be abstract).

    Returns:
      For each ``nnx.List`` of modules: where it is, how many layers, and which layers differ from
      the first in structure (the first differing setting, e.g. ``attn/window: 4 vs None``) or in
      parameter shapes.

    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 8, rngs=rngs)])
    >>> layer_lists(Net(nnx.Rngs(0)))[:110]
    " The model keeps 2 blocks in an nnx.List at 'blocks': they differ from layer 0 (layer 1: out_features: 8 vs 4)"
    """
    notes = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.List) or not len(node) or not all(isinstance(m, nnx.Module) for m in node):
            continue
        differ = layer_differences(list(node))
        where = "/".join(map(str, path)) or "the model"
        what = ("they differ from layer 0 (" + "; ".join(differ[:3]) + (" ..." if len(differ) > 3 else "") + "), so "
                "they cannot be stacked: make the layers alike, or" if differ else "they are alike, so jaxpar runs "
                "them stacked under a 'pipe' axis; it could not here:")
        notes.append(f" The model keeps {len(node)} blocks in an nnx.List at {where!r}: {what} build them with "
                     "nnx.vmap (transform_metadata={nnx.PARTITION_NAME: 'layers'}) and run them with "
                     "jaxpar.scan_blocks.")
    return "".join(notes)


def cut_model(loss_fn: Callable, graphdef, params: Any, batch: Any, *, mesh=None, own_specs: Any = None) -> ModelCut:
    """Cut ``loss_fn(nnx.merge(graphdef, params), batch)`` at its one stacked-layers call (see the module docstring).

    Args:
      loss_fn: the user's ``loss_fn(model, batch) -> loss``.
      graphdef: the model's graph definition.
      params: the parameter tree (arrays or ``ShapeDtypeStruct``s) in the dtype the model runs in.
      batch: one micro-batch (shapes are enough).
      mesh: a model pinning shardings by mesh axes (``out_sharding=``, ``jax.reshard``) runs in explicit mode over it.
      own_specs: with ``mesh``: the specs the model's annotations give its parameters (before ZeRO).

    Returns:
      The :class:`ModelCut`: its ``parts`` and how ``params`` splits into ``outer`` and ``blocks``."""
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    try:
        site = _site(loss_fn, graphdef, shapes, batch, None)
        explicit = None
    except PipelineCutError as e:
        if mesh is None or own_specs is None or not needs_explicit_mesh(e.__cause__ or e):
            raise
        explicit = _Explicit(loss_fn, graphdef, shapes, batch, mesh, own_specs)
        site = _site(loss_fn, graphdef, shapes, batch, explicit)
    cut = ModelCut(None, site.leaves, site.treedef, jax.tree.structure(params), site.x)
    blocks = cut.split(shapes)[1]

    def model(outer: list):
        """The model with ``outer`` and zero placeholders for the blocks (intercepted before they are read)."""
        return nnx.merge(graphdef, cut.merge(outer, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), blocks)))

    def pre(outer, mb):
        try:
            with use_layer_runner(_stop):
                loss_fn(model(outer), mb)
        except _Reached as reached:
            return reached.args[0]
        raise PipelineCutError("pipeline: the loss ran to its end without reaching its stacked layers "
                               "(they are only run for some inputs); the first stage cannot be cut.")

    def post(outer, y, mb):
        with use_layer_runner(lambda call: y):
            return loss_fn(model(outer), mb)

    layer = site.layer
    if explicit is not None:
        pre, layer, post = explicit.parts(cut.split, pre, layer, post)
    else:       # a take_along_axis on a split vocabulary: XLA's partitioner aborts on it in a stage (._gathers)
        pre, post = whole_indexed_dims(pre, "pre"), whole_indexed_dims(post, "post")
    body = with_remat(layer, site.remat)
    rows = jax.tree.leaves(batch)[0].shape[0] if jax.tree.leaves(batch) else -1
    carry, layout = site.x, lambda x: _stage_layout(x, rows)   # noqa: E731
    parts = PipelineParts(pre=lambda outer, mb: _sent(layout(pre(outer, mb))),
                          layer=lambda p, x: _sent(layout(body(p, layout(_received(x, carry))))),
                          post=lambda outer, y, mb: post(outer, layout(_received(y, carry)), mb))
    return replace(cut, parts=parts)
