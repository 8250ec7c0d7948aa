"""Megatron-style tensor parallelism (+ sequence parallelism) as logical rules.

Column-parallel layers shard their output features (``mlp``, ``heads``,
``vocab``) over ``tensor``; the row-parallel layer that follows shards its input
features the same way, so each pair needs one reduction of the residual stream.
Without sequence parallelism that reduction is an all-reduce; with it, the
residual / norm region is sharded over the sequence (``norm_length`` ->
``tensor``) and the reduction becomes a reduce-scatter, paired with an
all-gather before the next column-parallel layer. The loss of logits whose
vocabulary is split is :mod:`jaxpar.parallel._cross_entropy`'s.

Example::

    >>> dict(tensor_rules(sequence_parallel=True))["norm_length"]
    'tensor'
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from typing import Any, ContextManager, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.errors import UnusedAxisWarning
from jaxpar.parallel._regions import collective_in, enter, keep_axes, reduce_dtype, region_axes, region_spec
from jaxpar.rules import (LogicalRules, axes_of, constrain, current_rules, logical_to_spec, manual_axes, scoped,
                          shard_map_mesh)

_SEPARATE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_separate_projections", default=False)


def tensor_rules(*, sequence_parallel: bool = False, batch_axes: tuple[str, ...] = ("data", "fsdp")) -> LogicalRules:
    """Rules for jaxpar's logical names under Megatron TP on the ``tensor`` axis.

    With a ``tensor`` axis of size 1 these rules shard nothing, so they are the
    default for every strategy.

    Args:
      sequence_parallel: also shard the residual / norm region over the sequence
        (``norm_length`` -> ``tensor``).
      batch_axes: the mesh axes that split the batch, e.g. ``("data", "fsdp")``; empty: none.

    Returns:
      The ordered ``(logical name, mesh axis or None)`` rules.
    """
    return (
        ("batch", batch_axes or None),
        ("length", None),
        ("norm_length", "tensor" if sequence_parallel else None),
        ("embed", None),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("kv_heads", None),     # fewer K/V heads than the tensor axis: replicated over it (Megatron's GQA)
        ("kv", None),
        ("vocab", "tensor"),
        ("classes", None),
        ("layers", None),
    )


def warn_unsplit_tensor_axis(param_specs: Any, mesh: Any, *, axis: str = "tensor") -> bool:
    """Warn (:class:`jaxpar.errors.UnusedAxisWarning`) when the mesh's ``axis`` has size > 1 and no
    parameter is split over it: a model without tensor-parallel annotations then runs the same
    computation on every device of a ``tensor`` group, and the strategy's name (``...-tp2``) says otherwise.

    Args:
      param_specs: the parameters' ``PartitionSpec`` tree over mesh axes (``StateLayout.params``).
      mesh: the device mesh (a ``jax.sharding.Mesh``, abstract devices too).
      axis: the tensor-parallel mesh axis (as :func:`row_parallel`'s ``axis``).

    Returns:
      True when it warned.

    Example:
      >>> import jax, warnings, jaxpar
      >>> mesh = jaxpar.make_mesh({"data": 4, "tensor": 2}, devices=jax.devices()[:8])
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warn_unsplit_tensor_axis({"w": PartitionSpec("data", None)}, mesh)
      True
      >>> warn_unsplit_tensor_axis({"w": PartitionSpec(None, "tensor")}, mesh)
      False
    """
    size = dict(mesh.shape).get(axis, 1)
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if size <= 1 or any(axis in axes_of(e) for s in specs if isinstance(s, PartitionSpec) for e in s):
        return False
    warnings.warn(
        f"mesh axis {axis!r} has size {size}, but no parameter is split over it: every device of a {axis!r} group "
        f"holds the same parameters and repeats the same computation. Give the parameters logical names that "
        f"tensor_rules() maps to {axis!r} (mlp, heads, vocab: e.g. nnx.with_partitioning(init, ('embed', 'mlp'))), "
        f"or set mesh.{axis}=1 and give those devices to data or fsdp.", UnusedAxisWarning, stacklevel=2)
    return True


def separate_projections() -> ContextManager[None]:
    """In this context :func:`column_parallel` leaves each einsum to XLA: FP8's rewrite
    (:func:`jaxpar.parallel.fp8_layer`) matches each weight's GEMM with the weight's whole shape and its
    scales over whole rows."""
    return scoped(_SEPARATE, True)


def column_parallel(eqs: Sequence[str], x: jax.Array, ws: Sequence[jax.Array], x_logical: tuple,
                    w_logicals: Sequence[tuple], out_logicals: Sequence[tuple], *,
                    axis: str = "tensor") -> tuple[jax.Array, ...]:
    """Column-parallel contractions ``einsum(eqs[i], x, ws[i])`` of one input, each output constrained to
    ``out_logicals[i]``: Q, K and V (or an MLP's gate and up) as one fused projection, the weights apart.

    The weights that split an output dimension over ``axis`` (two or more, ``x`` whole over it) run in
    one ``shard_map`` manual over ``axis``: backward, each device adds their input gradients, and the
    region's edge all-reduces the sum once (XLA:CPU reduces each einsum's apart). The other weights, and
    all of them under :func:`separate_projections` (FP8), are XLA's einsums.

    Args:
      eqs: one einsum equation per weight, ``x``'s subscripts then the weight's (``"bte,hde->bthd"``).
      x: the shared input.
      ws: the weights.
      x_logical: ``x``'s logical axis names.
      w_logicals, out_logicals: each weight's and each output's logical axis names.
      axis: the tensor-parallel mesh axis.

    Returns:
      The outputs, in the order of ``ws``.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> mesh = jaxpar.make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    >>> h, w1, w3 = jnp.ones((2, 4, 8)), jnp.ones((8, 4)), jnp.ones((8, 2))
    >>> project = lambda h, w1, w3: column_parallel(["bte,em->btm"] * 2, h, [w1, w3], ("batch", "length", "embed"),
    ...                                             [("embed", "mlp")] * 2, [("batch", "length", "mlp")] * 2)
    >>> grad = jax.jit(jax.grad(lambda *a: sum(y.sum() for y in project(*a))))
    >>> with jaxpar.use_rules(mesh, tensor_rules()):
    ...     hlo = grad.lower(h, w1, w3).compile().as_text()
    >>> hlo.count(" all-reduce(")          # h's gradient: one sum, one all-reduce
    1
    """
    ctx = current_rules()
    region = {} if ctx is None or _SEPARATE.get() else _column_region(*ctx, eqs, x, ws, x_logical, w_logicals,
                                                                      out_logicals, axis)
    if len(region) < 2:
        return tuple(constrain(jnp.einsum(eq, x, w), lg) for eq, w, lg in zip(eqs, ws, out_logicals))
    mesh = ctx[0]
    manual = region_axes(mesh, {axis})
    inside = list(region)
    x_spec = PartitionSpec(*([None] * x.ndim))
    wire = reduce_dtype(x.dtype, mesh, manual)    # float32 where XLA:CPU needs it (jaxpar.parallel._regions)

    def local(a, *w):
        return tuple(jnp.einsum(eqs[i], a.astype(x.dtype), wi) for i, wi in zip(inside, w))

    in_specs = (region_spec(x_spec, x.ndim, mesh, manual),
                *(region_spec(keep_axes(region[i][0], manual), ws[i].ndim, mesh, manual) for i in inside))
    out_specs = tuple(keep_axes(region[i][1], manual) for i in inside)
    ys = jax.shard_map(local, mesh=shard_map_mesh(mesh), in_specs=in_specs, out_specs=out_specs, axis_names=manual,
                       check_vma=False)(enter(x, x_spec, mesh, manual, wire), *(ws[i] for i in inside))
    done = dict(zip(inside, ys))
    return tuple(constrain(done[i] if i in done else jnp.einsum(eqs[i], x, ws[i]), out_logicals[i])
                 for i in range(len(ws)))


def _column_region(mesh, rules, eqs, x, ws, x_logical, w_logicals, out_logicals, axis) -> dict:
    """``{i: (weight spec, output spec)}`` of the weights :func:`column_parallel` runs in its region: those
    split over ``axis`` on output dimensions only, the output split there too; none where ``x`` is split."""
    if dict(mesh.shape).get(axis, 1) == 1 or axis in manual_axes():
        return {}
    if any(axis in axes_of(e) for e in logical_to_spec(x_logical, rules, mesh, shape=x.shape)):
        return {}
    out = {}
    for i, (eq, w) in enumerate(zip(eqs, ws)):
        w_spec = logical_to_spec(w_logicals[i], rules, mesh, shape=w.shape)
        y_spec = logical_to_spec(out_logicals[i], rules, mesh, shape=jax.eval_shape(
            functools.partial(jnp.einsum, eq), x, w).shape)
        w_sub, y_sub = eq.split("->")[0].split(",")[1], eq.split("->")[1]
        split = lambda spec, sub: {sub[d] for d, e in enumerate(spec) if axis in axes_of(e)}     # noqa: E731
        if split(w_spec, w_sub) and split(w_spec, w_sub) == split(y_spec, y_sub):
            out[i] = (w_spec, y_spec)
    return out


def row_parallel(eq: str, x: jax.Array, w: jax.Array, x_logical: tuple, w_logical: tuple,
                 out_logical: tuple, *, axis: str = "tensor") -> jax.Array:
    """Row-parallel contraction ``einsum(eq, x, w)`` whose output is constrained to ``out_logical``.

    When the contracted dimension is sharded over ``axis`` and the output is sharded over ``axis``
    too (sequence parallelism), the reduction is an explicit reduce-scatter (``psum_scatter`` in a
    ``shard_map`` manual over ``axis`` and the axes that split the batch, opened by
    :mod:`jaxpar.parallel._regions`); otherwise the einsum is left to XLA (an all-reduce). The
    reduce-scatter moves the activations' dtype (fp32 on CPU where an automatic axis > 1 remains).

    Args:
      eq: the einsum equation, ``x``'s subscripts then ``w``'s (``"btm,me->bte"``).
      x, w: the activation and the weight.
      x_logical, w_logical, out_logical: the logical axis names of ``x``, ``w`` and the output.
      axis: the tensor-parallel mesh axis.

    Returns:
      ``einsum(eq, x, w)``, sharded as ``out_logical`` says.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> mesh = jaxpar.make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    >>> h, w2 = jnp.ones((2, 4, 8)), jnp.ones((8, 3))
    >>> f = jax.jit(lambda h, w2: row_parallel("btm,me->bte", h, w2, ("batch", "length", "mlp"),
    ...                                        ("mlp", "embed"), ("batch", "norm_length", "embed")))
    >>> with jaxpar.use_rules(mesh, tensor_rules(sequence_parallel=True)):
    ...     y = f(h, w2)
    ...     hlo = f.lower(h, w2).compile().as_text()
    >>> y.sharding.spec, bool(jnp.allclose(y, jnp.einsum("btm,me->bte", h, w2)))
    (P(None, 'tensor'), True)
    >>> "reduce-scatter" in hlo               # sequence parallel: a reduce-scatter, not an all-reduce
    True
    """
    ctx = current_rules()
    if ctx is None:
        return jnp.einsum(eq, x, w)
    mesh, rules = ctx
    sizes = dict(mesh.shape)
    out_spec = logical_to_spec(out_logical, rules, mesh)
    x_full = logical_to_spec(x_logical, rules, mesh)
    w_spec = keep_axes(logical_to_spec(w_logical, rules, mesh), {axis})
    scatter = [d for d, e in enumerate(keep_axes(out_spec, {axis})) if e is not None]
    if sizes.get(axis, 1) == 1 or not scatter or all(e is None for e in w_spec) or axis in manual_axes():
        return constrain(jnp.einsum(eq, x, w), out_logical)
    # Manual over every axis that splits x or the output: the batch's data axes too (XLA would gather them first).
    manual = region_axes(mesh, {axis} | {a for e in (*x_full, *out_spec) for a in axes_of(e) if sizes.get(a, 1) > 1})
    x_spec, o_spec = keep_axes(x_full, manual), keep_axes(out_spec, manual)
    dtype = jnp.result_type(x, w)
    wire = reduce_dtype(dtype, mesh, manual)      # bf16, or float32 where XLA:CPU needs it (jaxpar.parallel._regions)

    def local(a, b):
        y = jnp.einsum(eq, a.astype(dtype), b.astype(dtype))
        return collective_in(wire, functools.partial(jax.lax.psum_scatter, axis_name=axis,
                                                     scatter_dimension=scatter[0], tiled=True), y)
    x, w = enter(x, x_spec, mesh, manual, wire), enter(w, w_spec, mesh, manual, wire)
    in_specs = (region_spec(x_spec, x.ndim, mesh, manual), region_spec(w_spec, w.ndim, mesh, manual))
    y = jax.shard_map(local, mesh=shard_map_mesh(mesh), in_specs=in_specs, out_specs=o_spec, axis_names=manual,
                      check_vma=False)(x, w)
    return constrain(y, out_logical)
