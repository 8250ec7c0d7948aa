"""Explicit data-parallel gradient reduction per layer (DP, ZeRO-1/2/3 / FSDP).

XLA's partitioner is free to lower a gradient reduction as it likes (on CPU it emits all-reduce +
slice, never reduce-scatter). jaxpar makes the data-axis collectives of each repeated block explicit
instead: the block runs inside a ``shard_map`` that is manual over the data axes (``data``, ``fsdp``)
and automatic over the rest (``tensor``), wrapped in a ``custom_vjp`` so that

* forward: parameters sharded over data axes (ZeRO-3 / FSDP) are all-gathered (and not kept for the
  backward: they are gathered again there);
* backward: each layer's weight gradient is reduced as soon as it is computed, inside the backward
  loop: reduce-scatter onto the ZeRO-2/3 gradient shards, all-reduce (``psum``) over the data axes
  that keep full gradients (DP, ZeRO-1).

Each is one collective per layer over a flat buffer of its leaves (:func:`bucketed_all_gather`,
:func:`bucketed_reduce_scatter`). Residuals are kept per device (a leading axis over the data axes),
the gathered weights excepted: only the re-gather and data movement are recomputed. Gathers run in
the compute dtype (XLA:CPU turns bf16 collectives into fp32); gradients are reduced in fp32.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> rules = (("batch", "data"), ("embed", None), ("mlp", None))
    >>> layer = lambda w, x: jnp.tanh(x @ w["kernel"])
    >>> shapes = {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    >>> body = data_parallel_block(layer, {"kernel": ("embed", "mlp")}, mesh, rules, 2, shapes)  # ZeRO-2
    >>> w, x = {"kernel": jnp.eye(4)}, jnp.arange(16.0).reshape(4, 4) / 16
    >>> g = jax.jit(jax.grad(lambda w: body(w, x).sum()))(w)
    >>> g["kernel"].sharding.spec               # reduce-scattered onto the ZeRO-2 gradient shards
    P('data',)
    >>> bool(jnp.allclose(g["kernel"], jax.grad(lambda w: layer(w, x).sum())(w)["kernel"]))
    True
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.mesh import data_axes
from jaxpar.adapters._blocks import name_layer_input, with_remat
from jaxpar.rules import axes_of, drop_axes, resolve, use_rules
from jaxpar.parallel.pipeline._layer_vjp import join_pullback, split_pullback
from jaxpar.parallel._regions import spec_entry
from jaxpar.parallel._zero import zero_axes, zero_dim

# Pure data movement, recomputed in the backward rather than saved: a layer that
# reshapes, slices or splits its weights would otherwise save the (whole) pieces.
_MOVES = frozenset({"reshape", "transpose", "slice", "dynamic_slice", "split", "concatenate", "squeeze",
                    "broadcast_in_dim", "pad", "rev", "gather", "copy"})


def _normalised(dims: list, xs: list) -> list:
    """Non-negative dimensions (``None`` stays ``None``)."""
    return [None if d is None else d % max(x.ndim, 1) for d, x in zip(dims, xs)]


def _buckets(xs: list, axes: list) -> list[tuple[tuple[str, ...], list[int]]]:
    """``(axes, leaf indices)`` of each group of leaves with the same non-empty axes and
    dtype, in first-seen order: one flat buffer, one collective per group."""
    groups: dict = {}
    for i, a in enumerate(axes):
        groups.setdefault((axes_of(a), xs[i].dtype), []).append(i)
    return [(ax, idx) for (ax, _), idx in groups.items() if ax]


def unflatten_leaf(flat: jax.Array, dim: int, lead: int, shape: tuple) -> jax.Array:
    """Undoes ``jnp.moveaxis(x, dim, 0).reshape(...)``: a leaf flattened with ``dim`` first.

    Args:
        flat: the flattened values (any shape), ``lead`` times the size of the dimensions of
            ``shape`` other than ``dim``.
        dim: the dimension that was moved first.
        lead: the size of ``dim`` in the result, e.g. a shard's or a gathered whole's.
        shape: the leaf's shape; its entry at ``dim`` is replaced by ``lead``.

    Returns:
        ``flat`` in the leaf's layout: ``shape`` with ``lead`` entries at ``dim``.

    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> bool(jnp.array_equal(unflatten_leaf(jnp.moveaxis(x, 1, 0).reshape(-1), 1, 3, x.shape), x))
    True
    """
    moved = (lead,) + tuple(s for j, s in enumerate(shape) if j != dim)
    return jnp.moveaxis(flat.reshape(moved), 0, dim)


def axis_name(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """The ``axis_name`` argument of a JAX collective over the mesh axes ``axes``.

    Args:
        axes: one or more mesh axis names, in the order the collective tiles them.

    Returns:
        The single name for one axis, else ``axes`` itself.

    >>> axis_name(("data",)), axis_name(("fsdp", "data"))
    ('data', ('fsdp', 'data'))
    """
    return axes if len(axes) > 1 else axes[0]


def bucketed_all_gather(xs: list, dims: list, axes: list) -> list:
    """``all_gather(x, axes, axis=d, tiled=True)`` for every leaf, as one collective per
    group of leaves with the same axes and dtype (one flat buffer, as in FSDP).

    Args:
      xs: the local shards.
      dims: per leaf, the dimension to gather.
      axes: per leaf, the mesh axes to gather over.

    Returns:
      The gathered leaves, in order.

    XLA:CPU does not combine all-gathers, and every collective pays a rendezvous of
    all devices, so per-leaf gathers cost far more than the bytes they move.
    Call it inside a ``shard_map`` that is manual over ``axes``::

        >>> import jax, jax.numpy as jnp, jaxpar
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
        >>> gather = jax.shard_map(lambda w, b: tuple(bucketed_all_gather([w, b], [0, 0], [("data",), ("data",)])),
        ...                        mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(), check_vma=False)
        >>> w, b = gather(jnp.ones((4, 2)), jnp.arange(4.0))      # each device holds half of each
        >>> w.shape, b.tolist()
        ((4, 2), [0.0, 1.0, 2.0, 3.0])
    """
    out, dims = list(xs), _normalised(dims, xs)
    for ax, idx in _buckets(xs, axes):
        flat = [jnp.moveaxis(xs[i], dims[i], 0).reshape(-1) for i in idx]
        full = jax.lax.all_gather(jnp.concatenate(flat), axis_name(ax), axis=0, tiled=False)   # [n, K]
        n, start = full.shape[0], 0
        for i, f in zip(idx, flat):
            out[i] = unflatten_leaf(full[:, start:start + f.size], dims[i], n * xs[i].shape[dims[i]], xs[i].shape)
            start += f.size
    return out


def bucketed_reduce_scatter(gs: list, dims: list, axes: list) -> list:
    """``psum_scatter(g, axes, scatter_dimension=d, tiled=True)`` for every leaf, as one
    collective per group of leaves with the same axes and dtype (see
    :func:`bucketed_all_gather`); leaves with no axes are returned as they are::

        >>> import jax, jax.numpy as jnp, jaxpar
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
        >>> scatter = jax.shard_map(lambda gw, gb: tuple(bucketed_reduce_scatter([gw, gb], [0, 0], [("data",), ()])),
        ...                         mesh=mesh, in_specs=(P(), P()), out_specs=(P("data"), P()), check_vma=False)
        >>> gw, gb = scatter(jnp.ones((4, 2)), jnp.ones(3))      # every device: ones
        >>> gw.tolist(), gb.tolist()                             # gw summed over data, gb as it was
        ([[2.0, 2.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]], [1.0, 1.0, 1.0])

    Args:
      gs: the local gradients.
      dims: per leaf, the dimension to scatter.
      axes: per leaf, the mesh axes to sum and scatter over (empty: as it is).

    Returns:
      The summed shards, in order.
    """
    out, dims = list(gs), _normalised(dims, gs)
    for ax, idx in _buckets(gs, axes):
        n = math.prod(jax.lax.axis_size(a) for a in ax)
        rows = [jnp.moveaxis(gs[i], dims[i], 0).reshape(n, -1) for i in idx]
        part = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axis_name(ax), scatter_dimension=0,
                                    tiled=False)   # [K]: this device's block of every leaf
        start = 0
        for i, r in zip(idx, rows):
            out[i] = unflatten_leaf(part[start:start + r.shape[1]], dims[i], gs[i].shape[dims[i]] // n, gs[i].shape)
            start += r.shape[1]
    return out


def explicit_by_default(mesh_sizes, zero: int, platform: str = "cpu") -> bool:
    """Whether jaxpar makes the data-axis collectives explicit when not told (``docs/explicit_dp.md``).

    On CPU, yes where gradients are sharded over the data axes (ZeRO-2/3, ``fsdp``): XLA:CPU
    gives no reduce-scatter there and combines no all-gather (explicit saves 29-42 % of the
    bytes). No for DP and ZeRO-1, where XLA already all-reduces each layer's gradients inside
    the loop. No when ``tensor`` > 1: in a ``shard_map`` manual over the data axes only, XLA
    first replicates the operand of an explicit all-gather / reduce-scatter over ``tensor``.
    On GPU and TPU, no: their compilers combine XLA's own collectives into the same bytes and
    schedule compute under them only without jaxpar's (TPU ZeRO-3: explicit costs +49 % bytes).

    Args:
      mesh_sizes: the mesh's axis sizes.
      zero: the ZeRO stage.
      platform: the devices' platform (``"cpu"``, ``"gpu"`` / ``"cuda"``, ``"tpu"``).

    Returns:
      ``True`` to write the collectives per layer.

    Example:
        >>> explicit_by_default({"data": 8, "tensor": 1}, zero=2), explicit_by_default({"data": 8}, zero=1)
        (True, False)
        >>> explicit_by_default({"fsdp": 8}, zero=3, platform="gpu"), explicit_by_default({"fsdp": 8}, 3, "tpu")
        (False, False)
    """
    if platform != "cpu":
        return False
    sharded = (mesh_sizes.get("data", 1) > 1 and zero >= 2) or mesh_sizes.get("fsdp", 1) > 1
    return sharded and mesh_sizes.get("tensor", 1) == 1


def manual_layout(logical: Any, shapes: Any, mesh, rules, zero: int) -> Any:
    """Per leaf ``(dim, param_axes, grad_axes)``: the ZeRO dimension (or None) and
    the data axes that shard parameters / gradients on it.

    Args:
      logical: the parameters' logical names.
      shapes: the mirroring tree of shapes.
      mesh: the mesh.
      rules: the logical rules.
      zero: the ZeRO stage.

    Returns:
      The mirroring tree of ``(dim, param_axes, grad_axes)``.
    """
    sizes = dict(mesh.shape)
    base = resolve(logical, rules, mesh, shapes)
    p_axes, g_axes = zero_axes(sizes, zero, "params"), zero_axes(sizes, zero, "grads")

    def leaf(spec, shape, lg):
        d = zero_dim(shape.shape, tuple(lg), spec, sizes, stage=zero)
        return (None, (), ()) if d is None else (d, p_axes, g_axes)

    return jax.tree.map(leaf, base, shapes, logical, is_leaf=lambda x: isinstance(x, PartitionSpec))


def sharded_spec(dim: int | None, axes: tuple[str, ...], ndim: int) -> PartitionSpec:
    """The ``PartitionSpec`` of an array sharded on one dimension over data axes.

    Args:
        dim: the sharded dimension (a leaf's ZeRO dimension, :func:`manual_layout`), or ``None``.
        axes: the mesh axes that shard it; none for a replicated array.
        ndim: the array's number of dimensions.

    Returns:
        ``PartitionSpec()`` when ``dim`` is ``None`` or ``axes`` is empty, else a spec with
        ``axes`` (one name, or the tuple of several) at ``dim``.

    >>> sharded_spec(1, ("data",), 3), sharded_spec(0, ("fsdp", "data"), 2), sharded_spec(None, ("data",), 2)
    (P(None, 'data', None), P(('fsdp', 'data'), None), P())
    """
    if dim is None or not axes:
        return PartitionSpec()
    entries = [None] * ndim
    entries[dim] = spec_entry(axes)
    return PartitionSpec(*entries)


def _local_body(fn: Callable, mesh, local_rules, remat: Callable | None) -> Callable:
    """``fn`` traced under the rules of the manual data axes, rematerialised by the model's ``remat``
    policy, never saving pure data movement."""

    named = name_layer_input(fn, remat)     # the "offload" policy's layer input

    def body(w, x):
        with use_rules(mesh, local_rules):
            return named(w, x)

    def policy(prim, *args, **params) -> bool:
        return prim.name not in _MOVES and (remat is None or remat(prim, *args, **params))

    return jax.checkpoint(body, policy=policy)


class _ManualLayer:
    """One layer inside the ``shard_map`` manual over the data axes: its forward (parameters
    gathered), its backward (gathered again) and its gradients' data-parallel reduction."""

    def __init__(self, body: Callable, shapes: Any, layout: Any, axes: tuple[str, ...]):
        lays = jax.tree_util.tree_structure(shapes).flatten_up_to(layout)     # per leaf (dim, p_axes, g_axes)
        self.body = body
        self.dims, self.p_axes, self.g_axes = ([lay[i] for lay in lays] for i in range(3))
        self.rest = [tuple(a for a in axes if a not in ga) for ga in self.g_axes]     # all-reduced (DP, ZeRO-1)
        self.pullback_layout: Any = None   # static structure of the local vjp, set while tracing the forward

    def gathered(self, p):
        """The layer's parameters, whole, in their own (compute) dtype: one all-gather
        per layer over the parameter axes."""
        leaves, tree = jax.tree_util.tree_flatten(p)
        return jax.tree_util.tree_unflatten(tree, bucketed_all_gather(leaves, self.dims, self.p_axes))

    def reduce_grads(self, dw, p):
        """The transpose of :meth:`gathered` and the data-parallel reduction in one,
        summing in fp32: each weight gradient is reduce-scattered over its gradient
        axes (ZeRO-2/3, ``fsdp``; one collective per layer) and all-reduced over the
        other data axes (DP, ZeRO-1)."""
        leaves, tree = jax.tree_util.tree_flatten(dw)
        leaves = bucketed_reduce_scatter([g.astype(jnp.float32) for g in leaves], self.dims, self.g_axes)
        leaves = [jax.lax.psum(g, r) if r else g for g, r in zip(leaves, self.rest)]   # XLA combines these
        return jax.tree.map(lambda g, a: g.astype(a.dtype), jax.tree_util.tree_unflatten(tree, leaves), p)

    def forward(self, p, x):
        """The layer on gathered parameters: its output and its residuals, stacked per device."""
        w = self.gathered(p)
        y, pullback = jax.vjp(self.body, w, x)
        # Residuals that are the gathered parameters are not kept (the backward gathers
        # them again); the rest are stacked per device.
        stored, self.pullback_layout = split_pullback(pullback, w)
        return y, [leaf[None] for leaf in stored]

    def backward(self, p, res, dy):
        """The layer's vjp from its residuals and re-gathered parameters, gradients reduced."""
        pullback = join_pullback(self.pullback_layout, [r[0] for r in res], self.gathered(p))
        dw, dx = pullback(dy)
        return self.reduce_grads(dw, p), dx


def data_parallel_block(fn: Callable, logical: Any, mesh, rules, zero: int, shapes: Any,
                        remat: Callable | None = None) -> Callable:
    """Wrap ``fn(params, x) -> y`` (x: batch-leading activations) with explicit
    per-layer data-parallel collectives; see the module docstring. ``remat`` is
    the model's ``jax.checkpoint`` policy for the layer (``None``: save everything but
    pure data movement); what it does not save is recomputed in the backward.

    Args:
      fn: the layer, ``fn(params, x) -> y``.
      logical: the layer parameters' logical names.
      mesh: the mesh.
      rules: the logical rules.
      zero: the ZeRO stage.
      shapes: the layer parameters' shapes.
      remat: a ``jax.checkpoint`` policy, or ``None``.

    Returns:
      ``fn`` with the same signature, its collectives explicit.
    """
    axes = tuple(a for a in data_axes(mesh) if mesh.shape[a] > 1)
    if not axes:
        return with_remat(fn, remat)
    layout = manual_layout(logical, shapes, mesh, rules, zero)
    p_specs = jax.tree.map(lambda s, lay: sharded_spec(lay[0], lay[1], len(s.shape)), shapes, layout)
    g_specs = jax.tree.map(lambda s, lay: sharded_spec(lay[0], lay[2], len(s.shape)), shapes, layout)
    x_spec = PartitionSpec(axes)
    layer = _ManualLayer(_local_body(fn, mesh, drop_axes(rules, axes), remat), shapes, layout, axes)

    smap = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,  # noqa: E731
                                         axis_names=set(axes), check_vma=False)

    @jax.custom_vjp
    def block(p, x):
        return fn(p, x)

    def fwd(p, x):
        y, res = smap(layer.forward, (p_specs, x_spec), (x_spec, x_spec))(p, x)
        return y, (p, res)

    def bwd(saved, dy):
        p, res = saved
        return smap(layer.backward, (p_specs, x_spec, x_spec), (g_specs, x_spec))(p, res, dy)

    block.defvjp(fwd, bwd)
    return block


class DataParallelLayers:
    """A layer runner (:func:`jaxpar.adapters._blocks.use_layer_runner`) that wraps every layer of a
    model's stacked blocks with :func:`data_parallel_block`: what jaxpar's train step installs
    for ``explicit_dp``.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.adapters._blocks import run_layers, use_layer_runner
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> rules = (("batch", "data"), ("embed", None), ("mlp", None))
    >>> x = jnp.arange(16.0).reshape(4, 4) / 16
    >>> def loss(p):                                  # 3 stacked layers
    ...     layer = lambda w, h: jnp.tanh(h @ w["kernel"])
    ...     return run_layers(layer, p, x, logical={"kernel": ("embed", "mlp")}).sum()
    >>> params = {"kernel": jnp.stack([jnp.eye(4)] * 3)}
    >>> with use_layer_runner(DataParallelLayers(mesh, rules, zero=2)):
    ...     g = jax.jit(jax.grad(loss))(params)
    >>> bool(jnp.allclose(g["kernel"], jax.grad(loss)(params)["kernel"]))   # same as the plain scan
    True
    """

    def __init__(self, mesh, rules, zero: int):
        self.mesh, self.rules, self.zero = mesh, tuple(rules), zero

    def __call__(self, call) -> jax.Array:
        body = data_parallel_block(call.layer, call.logical, self.mesh, self.rules, self.zero,
                                   call.layer_shapes(), remat=call.remat)
        return call.run(body)
