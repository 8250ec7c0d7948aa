"""Megatron-style tensor parallelism (+ sequence parallelism) as logical rules.

Column-parallel layers shard their output features (``mlp``, ``heads``,
``vocab``) over ``tensor``; the row-parallel layer that follows shards its input
features the same way, so each pair needs one reduction of the residual stream.
Without sequence parallelism that reduction is an all-reduce; with it, the
residual / norm region is sharded over the sequence (``norm_length`` ->
``tensor``) and the reduction becomes a reduce-scatter, paired with an
all-gather before the next column-parallel layer. The loss of logits whose
vocabulary is split (:func:`cross_entropy`) picks the target logits by a
one-hot product: one all-reduce over the vocabulary.

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
from jax.sharding import AxisType, PartitionSpec

from jaxpar.errors import BatchError, RulesError, UnusedAxisWarning, check_int
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


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: Any = None, weights: Any = None) -> jax.Array:
    """Mean cross-entropy of ``logits[..., vocab]`` over the positions where ``mask`` is true (all when
    ``None``): ``logsumexp(logits) - logits[target]`` per position. With ``weights``, the plain mean
    of ``weights × loss`` over every position (the mask is then not read): weights normalised over a
    global batch, as :class:`jaxpar.data.PackedBatches` makes them, give the global batch's masked mean
    however the batch is split.

    The target logit is gathered (optax's integer-label form) where the vocabulary is whole on each
    device. Where it is split over a mesh axis, or inside a ``shard_map`` (a pipeline stage, where
    XLA's gather partitioner aborts on a split vocabulary), a one-hot product picks it, and its sum
    over the vocabulary is one all-reduce (:func:`target_by_gather`). The derivative, ``softmax -
    one_hot``, is one elementwise pass over the logits either way.

    Args:
      logits: ``[..., vocab]``.
      targets: integer class ids, ``logits``' shape without ``vocab``.
      mask: like ``targets``, true where a target counts, or ``None``.
      weights: like ``targets``, loss weights, or ``None``.

    Returns:
      The scalar loss.
    """
    return _mean(_nll(logits, targets.astype(jnp.int32), target_by_gather(logits)), mask, weights)


def linear_cross_entropy(x: jax.Array, head: jax.Array, targets: jax.Array, mask: Any = None, weights: Any = None,
                         *, chunks: int = 1, softcap: float | None = None) -> jax.Array:
    """:func:`cross_entropy` of the head's fp32 logits ``einsum("bte,ve->btv", x, head)`` (with
    ``softcap``: ``softcap * tanh(logits / softcap)``), computed over ``chunks`` pieces of the vocabulary
    one after another: the forward and the backward hold one piece's ``[batch, length, vocab / chunks]``
    logits, never the whole vocabulary's. Piece ``j`` is every ``chunks``-th entry from ``j``, so a
    vocabulary split over the mesh stays split. The forward sums each piece into a running
    log-sum-exp; the backward recomputes each piece's logits, writes its rows of the head's gradient and
    sums ``x``'s gradient in fp32.

    Args:
      x: the last hidden states ``[batch, length, embed]``.
      head: the output projection ``[vocab, embed]``.
      targets, mask, weights: as :func:`cross_entropy`'s, ``[batch, length]``.
      chunks: the number of pieces; it divides ``vocab``.
      softcap: the logits' soft cap, or ``None``.

    Returns:
      The scalar loss.
    """
    check_int("linear_cross_entropy", "chunks", chunks, 1, BatchError)
    if head.shape[0] % chunks:
        raise BatchError(f"linear_cross_entropy(chunks={chunks}): the vocabulary of {head.shape[0]} entries is not "
                         "a multiple of chunks; give a number of loss chunks that divides it "
                         "(DecoderConfig.loss_chunks, YAML model.loss_chunks).")
    return _mean(_chunked_nll(x, head, targets.astype(jnp.int32), chunks, softcap), mask, weights)


def _mean(nll: jax.Array, mask: Any, weights: Any) -> jax.Array:
    """The mean of the per-position losses ``nll``: weighted, masked or plain (:func:`cross_entropy`)."""
    if weights is not None:
        return jnp.mean(nll * weights.astype(nll.dtype))
    if mask is None:
        return nll.mean()
    mask = mask.astype(nll.dtype)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _vocab_pieces(head: jax.Array, n: int) -> jax.Array:
    """``[vocab, embed]`` as ``[n, vocab / n, embed]``; piece ``j`` holds rows ``j, j + n, ...``."""
    return jnp.moveaxis(head.reshape(head.shape[0] // n, n, head.shape[1]), 1, 0)


def _piece_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """One piece's fp32 logits before any soft cap."""
    return constrain(jnp.einsum("bte,ve->btv", x, head).astype(jnp.float32), ("batch", "length", "vocab"))


def _capped(z: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap * tanh(z / softcap)``, or ``z`` without a cap."""
    return z if softcap is None else jnp.tanh(z / softcap) * softcap


def _in_piece(targets: jax.Array, j: jax.Array, n: int) -> jax.Array:
    """Each target's index in piece ``j`` of ``n``, or -1 where the target is in another piece."""
    return jnp.where(targets % n == j, targets // n, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_nll(x: jax.Array, head: jax.Array, targets: jax.Array, chunks: int, softcap: float | None) -> jax.Array:
    """Per position ``logsumexp(logits) - logits[target]`` of the head's logits, piece by piece."""
    return _chunked_nll_fwd(x, head, targets, chunks, softcap)[0]


def _chunked_nll_fwd(x, head, targets, chunks, softcap):
    """A running log-sum-exp (its maximum and sum) and the target logit over the vocabulary's pieces."""
    def piece(carry, j_w):
        top, total, picked = carry
        z = _capped(_piece_logits(x, j_w[1]), softcap)
        new = jnp.maximum(top, jnp.max(z, axis=-1))
        total = total * jnp.exp(top - new) + jnp.sum(jnp.exp(z - new[..., None]), axis=-1)
        at = _in_piece(targets, j_w[0], chunks)
        picked = picked + jnp.where(at >= 0, _picked(z, jnp.maximum(at, 0), target_by_gather(z)), 0.0)
        return (new, total, picked), None

    zero = jnp.zeros_like(targets, jnp.float32)         # laid out as the targets (explicit sharding too)
    (top, total, picked), _ = jax.lax.scan(piece, (zero - jnp.inf, zero, zero),
                                           (jnp.arange(chunks), _vocab_pieces(head, chunks)))
    lse = top + jnp.log(total)
    return lse - picked, (x, head, targets, lse)


def _chunked_nll_bwd(chunks, softcap, res, g):
    """Each piece's logits again: ``(softmax - one_hot) × g`` through the cap and the cast, then its rows of
    the head's gradient (the product with ``x``) and its part of ``x``'s (with the head, summed in fp32)."""
    x, head, targets, lse = res
    logits_dtype = jnp.result_type(x, head)

    def piece(dx, j_w):
        j, w = j_w
        z = _piece_logits(x, w)
        hot = jax.nn.one_hot(_in_piece(targets, j, chunks), z.shape[-1], dtype=z.dtype)
        dz = (jnp.exp(_capped(z, softcap) - lse[..., None]) - hot) * g[..., None]
        if softcap is not None:
            dz = dz * (1 - jnp.tanh(z / softcap) ** 2)
        dz = dz.astype(logits_dtype)
        dx = dx + jnp.einsum("btv,ve->bte", dz, w, preferred_element_type=jnp.float32, out_sharding=_typed(x))
        return dx, jnp.einsum("btv,bte->ve", dz, x, out_sharding=_typed(w)).astype(head.dtype)

    dx0 = jnp.zeros_like(x, jnp.float32)
    dx, dw = jax.lax.scan(piece, dx0, (jnp.arange(chunks), _vocab_pieces(head, chunks)))
    return dx.astype(x.dtype), jnp.moveaxis(dw, 0, 1).reshape(head.shape), None


_chunked_nll.defvjp(_chunked_nll_fwd, _chunked_nll_bwd)


def _typed(a: jax.Array) -> Any:
    """``a``'s sharding where its type holds one (explicit sharding), else None (the compiler's choice)."""
    typed = getattr(jax.typeof(a), "sharding", None)
    explicit = typed is not None and any(t == AxisType.Explicit for t in getattr(typed.mesh, "axis_types", ()))
    return typed if explicit else None


def _picked(logits: jax.Array, targets: jax.Array, gather: bool) -> jax.Array:
    """``logits[..., targets]``: by a gather, or by a one-hot product."""
    if gather:
        return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _nll(logits: jax.Array, targets: jax.Array, gather: bool) -> jax.Array:
    """Per position ``logsumexp(logits) - logits[target]``."""
    return jax.nn.logsumexp(logits, axis=-1) - _picked(logits, targets, gather)


@_nll.defjvp
def _nll_jvp(gather: bool, primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    """The tangent ``sum(dlogits × (softmax - one_hot))``: its transpose is one fused elementwise pass
    (autodiff of the gather would scatter into a zeroed ``[..., vocab]`` array)."""
    logits, targets = primals
    lse = jax.nn.logsumexp(logits, axis=-1)
    slope = jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return lse - _picked(logits, targets, gather), jnp.sum(tangents[0] * slope, axis=-1)


def target_by_gather(logits: jax.Array) -> bool:
    """Whether :func:`cross_entropy` gathers the target logits of ``logits[..., vocab]`` here: outside
    any ``shard_map``, with the vocabulary on no mesh axis of size > 1, neither in the logits' own type
    (explicit sharding) nor where the current rules (:func:`jaxpar.use_rules`; none: one device) lay
    out ``("batch", "length", "vocab")`` as the GPT's head constrains them
    (:func:`jaxpar.models._gpt.head_apply`).

    Args:
      logits: the logits (an array or a tracer).

    Returns:
      ``True`` to gather, ``False`` for the one-hot product.

    >>> import jax.numpy as jnp
    >>> target_by_gather(jnp.zeros((2, 8, 64)))      # no rules: one device
    True
    """
    if manual_axes():
        return False
    typed = getattr(jax.typeof(logits), "sharding", None)                 # explicit sharding: in the type
    own = typed.spec[logits.ndim - 1] if typed is not None and len(typed.spec) >= logits.ndim else None
    if any(typed.mesh.shape[a] > 1 for a in axes_of(own)):
        return False
    ctx = current_rules()
    if ctx is None:
        return True
    mesh, rules = ctx
    head = ("batch", "length", "vocab") if logits.ndim >= 3 else ("vocab",)
    logical = (None,) * (logits.ndim - len(head)) + head
    try:
        spec = logical_to_spec(logical, rules, mesh, shape=logits.shape)
    except RulesError:          # names the rules do not map: the product is right however XLA places them
        return False
    return all(dict(mesh.shape)[a] == 1 for a in axes_of(spec[-1]))
