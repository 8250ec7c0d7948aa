"""FP8 matmuls: a layer's covered weights meet their activations in FP8 GEMMs.

A weight is *covered* when its logical names hold ``embed`` and a feature axis (``heads``,
``kv_heads``, ``mlp``): the attention projections, the MLP and the experts. The embedding, the
head, the router, norms and biases are not. :func:`fp8_layer` rewrites one layer's program: every
``dot_general`` that reads a covered weight (directly or through a cast, reshape or transpose)
runs as :func:`fp8_dot_general`, in e4m3 forward and with e5m2 gradients backward. A covered
weight that no such ``dot_general`` reads is an error that names it. The compiled program's side
(its GEMMs' operand types, by weight) is :mod:`jaxpar.analysis._gemms`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.extend.core import primitives as prims

from flax import nnx

from jaxpar.adapters._blocks import LAYERS, use_layer_transform
from jaxpar.errors import Fp8Error
from jaxpar.logical import FP8_FEATURES, fp8_covered
from jaxpar.mesh import REPLICA
from jaxpar.options import Fp8
from jaxpar.parallel._tensor import separate_projections
from jaxpar.rules import path_str, scoped

#: The forward operands' and the gradients' FP8 types.
FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2
#: Manual axes whose devices hold tensors of their own (pipeline stages, relaxed-sync replicas).
_OWN_TENSORS = ("pipe", REPLICA)
_OWN_SCALES: contextvars.ContextVar = contextvars.ContextVar("jaxpar_fp8_own_scales", default=())
_FP8: contextvars.ContextVar = contextvars.ContextVar("jaxpar_fp8", default=None)
#: The ops a weight passes through on its way to the matmul and stays itself.
_VIEWS = {"convert_element_type", "reshape", "transpose", "squeeze", "sharding_constraint", "copy", "copy_p",
          "pvary", "mesh_cast", "reshard"}


def own_scales(axes) -> ContextManager[None]:
    """In this context the devices of the manual ``axes`` compute tensors of their own (each data
    replica's own gradient, for a codec, local clipping or the noise scale): their FP8 scales are
    not shared over those axes.

    Args:
      axes: mesh axis names.
    """
    return scoped(_OWN_SCALES, tuple(axes))


is_covered = fp8_covered      # the one rule: jaxpar.logical


def _scale_and_cast(x: jax.Array, dtype, keep: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """``x`` divided by its scale and cast to ``dtype``, and the fp32 scale (the absolute maximum
    over every dimension not in ``keep``, over ``dtype``'s largest value). Inside a ``shard_map``, a
    tensor's maximum (``keep`` empty) is taken over its shards on the manual axes that split one
    tensor (not ``pipe`` or ``replica``: stages and replicas hold tensors of their own); a row's
    maximum is its shard's, exact only where the contracted dimensions are not split there."""
    x = x.astype(jnp.float32)
    reduce = tuple(d for d in range(x.ndim) if d not in keep)
    amax = jnp.max(jnp.abs(x), axis=reduce, keepdims=True)
    own = _OWN_TENSORS + _OWN_SCALES.get()
    shards = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a not in own)
    if shards and not keep:
        amax = jax.lax.pmax(amax, shards)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x / scale).astype(dtype), scale


def check_fp8(mesh, logical: Any, shapes: Any, fp8: Fp8 | None) -> None:
    """Refuse FP8 options that cannot pay: devices without FP8 GEMMs (an NVIDIA GPU before compute
    capability 8.9, such as the A100; TPU v5e, v5p and v6e; the CPU emulates them, for tests), or a model
    none of whose matmuls they cover: no weight with ``embed`` and a feature axis (:func:`is_covered`), or
    every such weight's GEMM below ``min_dim`` (the smaller of its ``embed`` size and its feature sizes).

    Args:
      mesh: the mesh (its devices; a compile target's abstract devices too).
      logical: the parameters' logical names (``PartitionSpec`` or tuples, or ``None``).
      shapes: the parameters' shapes, the same tree.
      fp8: the options, or ``None`` (nothing to check).

    Raises:
      Fp8Error: the devices have no FP8 GEMMs, or nothing is covered (the message names the largest
        covered weight and ``min_dim``).
    """
    if fp8 is None:
        return
    device = mesh.devices.flat[0]
    cc = getattr(device, "compute_capability", None)
    kind = str(getattr(device, "device_kind", device.platform))
    if (device.platform == "gpu" and cc and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9)) or (
            device.platform == "tpu" and re.search(r"v5|v6", kind)):
        raise Fp8Error(f"Strategy.fp8: the mesh's devices ({kind}) have no FP8 GEMMs, so the covered matmuls "
                       "would run in the compute dtype behind FP8's casts. Fix: turn Strategy.fp8 off, or run on an "
                       "H100, H200 or B200 (compute capability 8.9 or newer).")
    names = jax.tree.leaves(logical, is_leaf=lambda x: x is None or isinstance(x, tuple))
    sizes = [None if n is None or not is_covered(tuple(n)) else _gemm_side(tuple(n), tuple(x.shape))
             for n, x in zip(names, jax.tree.leaves(shapes))]
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    covered = {path: side for path, side in zip(paths, sizes) if side is not None}
    if not covered:
        raise Fp8Error(f"Strategy.fp8: no weight of the model is covered: FP8 runs the matmuls of weights "
                       f"whose logical names hold 'embed' and one of {FP8_FEATURES} (nnx.with_partitioning), and none "
                       "has them. Fix: annotate the attention and MLP kernels so, or turn Strategy.fp8 off.")
    if max(covered.values()) < fp8.min_dim:
        largest = max(covered, key=covered.get)
        raise Fp8Error(f"Strategy.fp8: every covered weight's GEMM is below min_dim={fp8.min_dim} (the largest, "
                       f"{largest!r}, has {covered[largest]}), so no matmul would run in FP8. Fix: "
                       f"Strategy.fp8.min_dim={covered[largest]} or less, or turn Strategy.fp8 off.")


def _gemm_side(names: tuple, shape: tuple) -> int:
    """The smaller of a covered weight's ``embed`` size and its feature size (the GEMM's ``min_dim`` test)."""
    embed = math.prod(d for d, n in zip(shape, names) if n == "embed")
    other = math.prod(d for d, n in zip(shape, names) if n not in ("embed", LAYERS, "experts"))
    return min(embed, other)


def _free(ndim: int, contract, batch) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def scaled_dot(lhs, rhs, dimension_numbers, types, *, rowwise: bool, out_dtype):
    """One GEMM with FP8 operands: each operand scaled and cast to its type, the product taken in
    FP8 with fp32 accumulation, and the scales multiplied back.

    Args:
      lhs, rhs: the operands; dimension_numbers: ``lax.dot_general``'s.
      types: the lhs and rhs FP8 types.
      rowwise: one scale per row (per index of the dimensions the GEMM does not contract); else
        one per operand.
      out_dtype: the result's dtype.

    Returns:
      ``lax.dot_general(lhs, rhs, dimension_numbers)`` computed in FP8.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    left = _scale_and_cast(lhs, types[0], (*lb, *lf) if rowwise else ())
    right = _scale_and_cast(rhs, types[1], (*rb, *rf) if rowwise else ())
    return _quantized_dot(left, right, dimension_numbers, out_dtype)


def _quantized_dot(left, right, dimension_numbers, out_dtype):
    """The product of two quantized operands ``(fp8 values, fp32 scales)``, the scales multiplied back
    (one per operand, or one per row: the scales keep the operand's rank)."""
    (lq, ls), (rq, rs) = left, right
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lq.ndim, lc, lb), _free(rq.ndim, rc, rb)
    # the GEMM accumulates in fp32 and returns the compute dtype: a sum of its partial products over
    # a split contraction (tensor parallelism) moves that dtype, as the same GEMM without FP8 does
    out = jax.lax.dot_general(lq, rq, dimension_numbers, preferred_element_type=out_dtype).astype(jnp.float32)
    if ls.size > 1 or rs.size > 1:   # rowwise: the result's dimensions are (batch, lhs free, rhs free)
        ls = ls.transpose((*lb, *lf, *lc)).reshape(out.shape[:len(lb) + len(lf)] + (1,) * len(rf))
        rs = rs.transpose((*rb, *rf, *rc)).reshape(out.shape[:len(lb)] + (1,) * len(lf) + out.shape[len(lb) + len(lf):])
    else:
        ls, rs = ls.reshape(()), rs.reshape(())
    return (out * ls * rs).astype(out_dtype)


def _grad_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int, for_lhs: bool):
    """The dimension numbers of the gradient GEMM for one operand, and the permutation that puts
    its result in that operand's layout."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb)
    nb = len(lb)
    g_lf = list(range(nb, nb + len(lf)))
    g_rf = list(range(nb + len(lf), nb + len(lf) + len(rf)))
    g_b = list(range(nb))
    if for_lhs:    # dlhs = g . rhs over rhs's free dims: result (batch, lhs free, rhs contracted)
        dims = ((g_rf, rf), (g_b, list(rb)))
        rest = [c for c in range(rhs_ndim) if c not in rf and c not in rb]     # rhs contracted, in order
        order = list(lb) + lf + [lc[list(rc).index(c)] for c in rest]
    else:          # drhs = lhs . g over lhs's free dims: result (batch, lhs contracted, rhs free)
        dims = ((lf, g_lf), (list(lb), g_b))
        rest = [c for c in range(lhs_ndim) if c not in lf and c not in lb]
        order = list(rb) + [rc[list(lc).index(c)] for c in rest] + rf
    return dims, [order.index(d) for d in range(len(order))]


def _as_bits(quantized):
    """An FP8 residual as its bytes: a ``jax.checkpoint`` policy that saves it would pass a float
    residual through ``reduce_precision`` with IEEE e4m3 semantics, which overflows e4m3fn values
    above 240 to infinity."""
    q, scale = quantized
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scale


def _from_bits(saved):
    bits, scale = saved
    return jax.lax.bitcast_convert_type(bits, FORWARD), scale


def fp8_dot_general(lhs, rhs, dimension_numbers, *, rowwise: bool = False):
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with its three GEMMs in FP8: e4m3 × e4m3
    forward; the gradient in e5m2 against the other operand in e4m3 backward.

    Args:
      lhs, rhs: the operands (the result has their common dtype).
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
      rowwise: the recipe's scaling (:class:`Fp8`).

    Returns:
      The product.

    >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
    >>> [round(v, 5) for v in fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()[0]]   # the scales' round-off
    [4.0, 4.0]
    """
    (lc, rc), (lb, rb) = dimension_numbers
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    out_dtype = jnp.result_type(lhs, rhs)
    # rowwise: a row's scale runs along the other GEMMs' contracted dimensions: quantize again
    return (_rowwise_dot if rowwise else _tensorwise_dot)(lhs, rhs, dn, out_dtype)


def _rowwise_dot(lhs, rhs, dn, out_dtype):
    """One scale per row: each GEMM quantizes its operands along its own rows."""
    @jax.custom_vjp
    def dot(a, b):
        return scaled_dot(a, b, dn, (FORWARD, FORWARD), rowwise=True, out_dtype=out_dtype)

    def backward(res, g):
        a, b = res
        ldims, lperm = _grad_dims(dn, a.ndim, b.ndim, True)
        rdims, rperm = _grad_dims(dn, a.ndim, b.ndim, False)
        da = scaled_dot(g, b, ldims, (BACKWARD, FORWARD), rowwise=True, out_dtype=a.dtype)
        db = scaled_dot(a, g, rdims, (FORWARD, BACKWARD), rowwise=True, out_dtype=b.dtype)
        return da.transpose(lperm), db.transpose(rperm)

    dot.defvjp(lambda a, b: (dot(a, b), (a, b)), backward)
    return dot(lhs, rhs)


def _tensorwise_dot(lhs, rhs, dn, out_dtype):
    """One scale per operand: the forward's FP8 operands are the backward's too (saved, not
    quantized again, so a weight is quantized once per micro-batch)."""
    ldims, lperm = _grad_dims(dn, lhs.ndim, rhs.ndim, True)
    rdims, rperm = _grad_dims(dn, lhs.ndim, rhs.ndim, False)

    def forward(a, b):
        left, right = _scale_and_cast(a, FORWARD, ()), _scale_and_cast(b, FORWARD, ())
        return _quantized_dot(left, right, dn, out_dtype), (_as_bits(left), _as_bits(right))

    def backward(res, g):
        left, right = (_from_bits(r) for r in res)
        grad = _scale_and_cast(g, BACKWARD, ())
        da = _quantized_dot(grad, right, ldims, lhs.dtype)
        db = _quantized_dot(left, grad, rdims, rhs.dtype)
        return da.transpose(lperm), db.transpose(rperm)

    dot = jax.custom_vjp(lambda a, b: forward(a, b)[0])
    dot.defvjp(forward, backward)
    return dot(lhs, rhs)


@dataclass
class _Rewrite:
    fp8: Fp8
    covered: dict            # a Var of the layer's program -> the weight's path
    used: set


def fp8_layer(layer: Callable, logical: Any, fp8: Fp8) -> Callable:
    """``layer(params, x, *rest) -> y`` with the matmuls of its covered weights in FP8.

    Args:
      layer: one layer's function.
      logical: the layer's logical names, a tree mirroring ``params``.
      fp8: the options.

    Returns:
      The rewritten function: equal to ``layer`` up to the FP8 rounding of the covered GEMMs.
    """
    def run(params, *args):
        with separate_projections():      # each covered weight's own dot (jaxpar.parallel.column_parallel)
            closed = jax.make_jaxpr(layer)(params, *args)
        names, _ = jax.tree_util.tree_flatten_with_path(params)
        spec = jax.tree.leaves(logical, is_leaf=lambda n: isinstance(n, tuple))
        invars = closed.jaxpr.invars
        covered = {invars[i]: path_str(path) for i, ((path, _), names_) in enumerate(zip(names, spec))
                   if is_covered(tuple(names_ or ()))}
        rewrite = _Rewrite(fp8, covered, set())
        out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves((params, *args)), rewrite)
        missed = sorted(set(covered.values()) - rewrite.used)
        if missed:
            raise Fp8Error(f"fp8: the layer's covered weights {missed} reach no matmul that jaxpar can run in "
                           "FP8 (a dot_general that reads the weight, through casts and reshapes only). Give "
                           "them logical names without a feature axis to leave them out, or turn fp8 off.")
        return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(layer, params, *args)), out)
    return run


def _eval(jaxpr, consts, args, rw: _Rewrite) -> list:
    """Evaluate ``jaxpr`` with the dots that read a covered weight in FP8 (``rw.covered`` maps its
    variables to weight paths; the map grows along views and into nested jits)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        paths = [None if isinstance(v, core.Literal) else rw.covered.get(v) for v in eqn.invars]
        if eqn.primitive is prims.dot_general_p and any(paths):
            outs = [_dot(eqn, ins, paths, rw)]
        elif eqn.primitive is prims.jit_p and any(paths):
            inner = eqn.params["jaxpr"]
            rw.covered |= {v: p for v, p in zip(inner.jaxpr.invars, paths) if p}
            outs = _eval(inner.jaxpr, inner.consts, ins, rw)
        elif eqn.primitive.name == "shard_map" and any(paths):
            outs = _shard_map(eqn, ins, paths, rw)
        elif eqn.primitive.name == "checkpoint" and any(paths):      # jax.checkpoint / nnx.remat
            outs = _checkpoint(eqn, ins, paths, rw)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
            if eqn.primitive.name in _VIEWS and paths[0]:
                rw.covered[eqn.outvars[0]] = paths[0]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _shard_map(eqn, ins, paths, rw: _Rewrite) -> list:
    """A ``shard_map`` that reads a covered weight, its body rewritten (the shards' scales agree:
    :func:`_scale_and_cast`)."""
    p, inner = eqn.params, eqn.params["jaxpr"]
    rw.covered |= {v: path for v, path in zip(inner.invars, paths) if path}
    body = lambda *args: tuple(_eval(inner, (), args, rw))     # noqa: E731
    return list(jax.shard_map(body, mesh=p["mesh"], in_specs=p["in_specs"], out_specs=p["out_specs"],
                              axis_names=p["newly_manual_axes"], check_vma=p["check_vma"])(*ins))


def _checkpoint(eqn, ins, paths, rw: _Rewrite) -> list:
    """A ``jax.checkpoint`` region that reads a covered weight, its body rewritten under the same policy."""
    p, inner = eqn.params, eqn.params["jaxpr"]
    rw.covered |= {v: path for v, path in zip(inner.invars, paths) if path}
    body = lambda *args: _eval(inner, (), args, rw)     # noqa: E731
    return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*ins))


def _dot(eqn, ins, paths, rw: _Rewrite) -> jax.Array:
    """One dot that reads a covered weight: in FP8 unless the GEMM is smaller than ``min_dim``."""
    lhs, rhs = ins
    path = paths[1] or paths[0]
    rw.used.add(path)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    weight, wc, wb = (rhs, rc, rb) if paths[1] else (lhs, lc, lb)
    k = math.prod(weight.shape[d] for d in wc)
    n = math.prod(weight.shape[d] for d in _free(weight.ndim, wc, wb))
    if min(k, n) < rw.fp8.min_dim:
        return eqn.primitive.bind(lhs, rhs, **eqn.params)
    with jax.named_scope(f"fp8[{path}]"):
        out = fp8_dot_general(lhs, rhs, eqn.params["dimension_numbers"], rowwise=rw.fp8.recipe == "rowwise")
    return out.astype(eqn.outvars[0].aval.dtype)



@contextlib.contextmanager
def use_fp8(fp8: Fp8 | None) -> Iterator[None]:
    """Run the covered matmuls of every loss traced in this context in FP8: the stacked layers' (a layer
    transform of :func:`jaxpar.adapters.run_layers`) and, where :func:`fp8_model_loss` meets an NNX model,
    the others. :func:`jaxpar.step.strategy_context` installs it with the strategy's ``fp8``, so the step,
    its gradients and eval all run as trained.

    Args:
      fp8: the options, or ``None`` (nothing is installed).
    """
    if fp8 is None:
        yield
        return
    with scoped(_FP8, fp8), use_layer_transform(lambda layer, logical: fp8_layer(layer, logical, fp8)):
        yield


def fp8_model_loss(loss_fn: Callable) -> Callable:
    """``loss_fn(model, batch)`` that, under :func:`use_fp8` and for an NNX model, runs the covered matmuls
    outside the stacked layers in FP8 too (its own ``nnx.Linear`` layers, attention projections, ...); the
    first such wrapper in a call consumes the setting, so a loss wrapped twice is rewritten once.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``.

    Returns:
      The loss.
    """
    def loss(model, *args, **kwargs):
        fp8 = _FP8.get()
        if fp8 is None or not isinstance(model, nnx.Module):
            return loss_fn(model, *args, **kwargs)
        with scoped(_FP8, None):
            return _with_unstacked(loss_fn, model, fp8, kwargs)(*args)

    return loss


def fp8_loss(loss_fn: Callable, fp8: Fp8 | None) -> Callable:
    """``loss_fn(model, batch)`` whose covered matmuls run in FP8 (:func:`fp8_layer`), on its own: the loss
    under :func:`use_fp8` (a train step installs that itself, from ``Strategy.fp8``); ``fp8=None``:
    ``loss_fn`` itself.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``.
      fp8: the options, or ``None``.

    Returns:
      The loss.
    """
    if fp8 is None:
        return loss_fn
    inner = fp8_model_loss(loss_fn)

    def loss(*args, **kwargs):
        with use_fp8(fp8):
            return inner(*args, **kwargs)

    return loss


def _with_unstacked(loss_fn: Callable, model: nnx.Module, fp8: Fp8, kwargs: dict) -> Callable:
    """``(*args) -> loss_fn(model, *args, **kwargs)`` with the dots that read the model's covered weights
    outside its stacked layers in FP8 (:func:`fp8_layer` over the whole loss; the stacked layers run
    their own, through the layer transform)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    values = nnx.to_pure_dict(params)
    logical = jax.tree.map(lambda spec, v: tuple(spec) if spec is not None and tuple(spec)[:1] != (LAYERS,) else (),
                           nnx.to_pure_dict(nnx.get_partition_spec(params)), values,
                           is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec))
    if not any(is_covered(names) for names in jax.tree.leaves(logical, is_leaf=lambda n: isinstance(n, tuple))):
        return lambda *args: loss_fn(model, *args, **kwargs)

    def whole(values, *args):
        state = jax.tree.map(lambda a: a, params)        # a State of its own for each trace
        nnx.replace_by_pure_dict(state, values)
        return loss_fn(nnx.merge(graphdef, state, rest), *args, **kwargs)
    return lambda *args: fp8_layer(whole, logical, fp8)(values, *args)
