"""Context-parallel attention: :func:`jaxpar.attention.attention` under a ``context`` mesh axis of size > 1.

q/k/v arrive split along the sequence; :func:`context_attention` opens a ``shard_map`` manual over ``context``
and the other axes that split q/k/v (inside an outer ``shard_map``, that region's mesh) and runs the method of
:func:`jaxpar.parallel.context.use_context_parallel`: ``ring`` (:mod:`jaxpar.parallel.context._ring`),
``all_gather`` (K/V gathered over ``context``) or ``ulysses`` (all-to-all from sequence to heads and back; K/V
heads repeated up to a multiple of ``C``). docs/strategies.md compares them. Masks go by true position, also in
the balanced layout (:func:`sequence_order`).

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.attention import dense_attention
    >>> from jaxpar.parallel.context import use_context_parallel
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> mesh = jaxpar.make_mesh({"context": 2}, devices=jax.devices()[:2])
    >>> rules = (("batch", None), ("length", "context"), ("heads", None))
    >>> call = lambda q, k, v: context_attention(dense_attention, q, k, v, None, causal=True, scale=0.5,
    ...                                          window=None, softcap=None)
    >>> with jaxpar.use_rules(mesh, rules), use_context_parallel("all_gather"):
    ...     y = jax.jit(call)(q, k, v)
    >>> bool(jnp.allclose(y, 1.0))
    True
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.parallel._regions import collective_in, keep_axes, reduce_dtype, region_axes, region_spec
from jaxpar.rules import axes_of, current_rules, logical_to_spec, manual_axes, shard_map_mesh
from jaxpar.parallel.context._flash import flash_attention
from jaxpar.parallel.context._zigzag import (check_length, chunk_index, chunks_per_shard, from_balanced,
                                             sequence_positions, shard_positions, to_balanced)
from jaxpar.mesh import CONTEXT
from jaxpar.parallel.context._options import current_context_parallel, note_context_call
from jaxpar.parallel.context._ring import ring_attention
from jaxpar.errors import ContextParallelError

#: The logical names of q, k and v (``[batch, length, heads, head_dim]``); k/v share the heads' axes.
QKV_LOGICAL = ("batch", "length", "heads", None)


class _Call(NamedTuple):
    size: int
    causal: bool
    scale: float
    balance: bool
    hop: str = "permute"
    softcap: float | None = None
    wire: Any = None          # the dtype of the all-gather method's K/V (jaxpar.parallel._regions.reduce_dtype); None: theirs
    dense: Callable = None    # whole-sequence attention on one device (jaxpar.attention.dense_attention)
    kernel: str = "xla"       # the ring's and all-gather's blocks: "xla" or "pallas" (jaxpar.parallel.context._flash)
    interpret: bool = False   # the "pallas" kernel in Pallas's interpreter (not compiled for a GPU)


def context_attention(dense: Callable, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *,
                      causal: bool, scale: float, window: int | jax.Array | None, softcap: float | None,
                      block_kernel: Callable | None = None) -> jax.Array:
    """:func:`jaxpar.attention.attention` under a ``context`` axis of size > 1: the method of
    :func:`jaxpar.parallel.context.use_context_parallel` on the local shards (inside a ``shard_map`` manual
    over ``context``, on them as they are).

    Args:
      dense: the whole-sequence attention the ``all_gather`` and ``ulysses`` methods run on each device
        (:func:`jaxpar.attention.dense_attention`).
      q, k, v, segment_ids: as for :func:`jaxpar.attention.attention`, checked.
      causal: the causal mask.
      scale: the score scale.
      window: the checked sliding window, or ``None``.
      softcap: the checked logit soft-cap, or ``None``.
      block_kernel: ``block_kernel(q, k, method=, chunk=) -> (kernel, interpret)``, the kernel of
        the ``ring`` and ``all_gather`` methods' blocks (:func:`jaxpar.attention._kernels.context_kernel`);
        ``None``: ``"xla"``.

    Returns:
      ``[batch, length, heads, head_dim]``, sharded like ``q``.

    Raises:
      ContextParallelError: the sequence, the heads or the rules do not fit the context axis.
    """
    ctx, size = current_rules(), context_size()
    local = CONTEXT in manual_axes()                  # already inside a shard_map manual over context
    if isinstance(window, int) and window >= q.shape[1] * (size if local else 1):
        window = None                                 # wider than the sequence: no window
    note_context_call("attention")
    setting = current_context_parallel()
    call = _Call(size, causal, scale, setting.balance, _ring_hop(ctx[0]), softcap, dense=dense)
    chunk = check_length(q.shape[1] * (size if local else 1), size, setting.balance)
    if block_kernel is not None and setting.method != "ulysses":
        kernel, interpret = block_kernel(q, k, method=setting.method, chunk=chunk)
        call = call._replace(kernel=kernel, interpret=interpret)
    if local:
        call = call._replace(wire=reduce_dtype(q.dtype, ctx[0], ()))     # in the enclosing region
        return _LOCAL[setting.method](call, q, k, v, segment_ids, window)
    return _sharded(_LOCAL[setting.method], call, *ctx, q, k, v, segment_ids, window)


def _ring_hop(mesh) -> str:
    """How the ring's hops move: ``"gather"`` on XLA:CPU inside a pipeline stage (a ``shard_map``
    manual over ``pipe``; why: :mod:`jaxpar.parallel.context._ring`), else ``"permute"``."""
    devices = getattr(mesh, "devices", None)
    on_cpu = devices is not None and devices.flat[0].platform == "cpu"
    return "gather" if on_cpu and "pipe" in manual_axes() else "permute"


def context_size() -> int:
    """The size of the ``context`` axis of the mesh of :func:`jaxpar.use_rules` (1: none, or no rules)."""
    ctx = current_rules()
    return 1 if ctx is None else dict(ctx[0].shape).get(CONTEXT, 1)


def sequence_order(length: int):
    """The order a model's loss lays its sequence out in: ``None`` (the natural order) unless the
    setting is balanced over a ``context`` axis, then the true positions :func:`balanced_order`.

    A loss that supports the balanced layout permutes its inputs and targets by it along the
    sequence (``tokens[:, order]``: a local gather, the batch is not split along the sequence yet)
    and gives the model the positions (position embeddings, RoPE); the mean loss is unchanged. The
    train step refuses ``balance=True`` for a loss that never asks.

    Args:
      length: the sequence length.

    Returns:
      ``None``, or an int array of ``length`` true positions.

    >>> sequence_order(8) is None                # no context axis
    True
    """
    size, setting = context_size(), current_context_parallel()
    if size == 1 or not setting.balance:
        return None
    note_context_call("order")
    return sequence_positions(length, size, True)


def in_sequence_order(x: jax.Array, axis: int = 1) -> jax.Array:
    """``x`` with its sequence axis ``axis`` in the order of :func:`sequence_order` (unchanged in the
    natural order): static slices of ``2C`` chunks, no gather, so it also runs inside a pipeline
    stage. A loss permutes its tokens, targets (and segment ids, position tables) with it.

    Args:
      x: an array with a sequence axis.
      axis: the sequence axis.

    Returns:
      ``x`` reordered, its shape.

    >>> in_sequence_order(jnp.arange(4.0)[None]).tolist()   # no context axis: unchanged
    [[0.0, 1.0, 2.0, 3.0]]
    """
    return _reordered(x, axis, to_balanced)


def in_natural_order(x: jax.Array, axis: int = 1) -> jax.Array:
    """The inverse of :func:`in_sequence_order`: ``x``'s sequence axis from the order of
    :func:`sequence_order` back to the natural one (unchanged in the natural order), by static slices.

    Args:
      x: an array with a sequence axis in the order of :func:`sequence_order`.
      axis: the sequence axis.

    Returns:
      ``x`` reordered, its shape.

    >>> in_natural_order(jnp.arange(4.0)[None]).tolist()    # no context axis: unchanged
    [[0.0, 1.0, 2.0, 3.0]]
    """
    return _reordered(x, axis, from_balanced)


def _reordered(x: jax.Array, axis: int, reorder) -> jax.Array:
    """``reorder(x, axis, C)`` on the whole sequence under the balanced layout, else ``x``. The whole
    sequence is permuted on each device, then split: left free, XLA splits the chunks first and moves
    them with collective-permutes (9 per chunked array at C = 4), which a pipeline stage cannot run."""
    if sequence_order(x.shape[axis]) is None:
        return x
    free = [PartitionSpec.UNCONSTRAINED] * x.ndim
    free[axis] = None
    whole = NamedSharding(shard_map_mesh(current_rules()[0]), PartitionSpec(*free))   # in a stage: its mesh
    pin = lambda a: jax.lax.with_sharding_constraint(a, whole)    # noqa: E731
    return pin(reorder(pin(x), axis, context_size()))


def _specs(mesh, rules, q, k) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """The ``PartitionSpec`` of q, of k/v and of the segment ids, from the rules."""
    sizes = dict(mesh.shape)
    q_spec = logical_to_spec(QKV_LOGICAL, rules, mesh, shape=q.shape, what="attention: q")
    if axes_of(q_spec[1]) != (CONTEXT,):
        raise ContextParallelError(
            f"attention: the mesh has a context axis of size {sizes[CONTEXT]} but the rules map the logical name "
            f"'length' to {q_spec[1]!r}. Context parallelism needs the rule ('length', 'context') (before any other "
            "'length' rule), or a mesh without a context axis.")
    heads = axes_of(q_spec[2])
    if k.shape[2] % math.prod(sizes[a] for a in heads):
        raise ContextParallelError(
            f"attention: the rules split the {q.shape[2]} query heads over {heads} (size "
            f"{math.prod(sizes[a] for a in heads)}), which does not divide the {k.shape[2]} K/V heads. Fix: K/V heads "
            "divisible by that size (repeat them in the model), or a rule that splits the heads less.")
    return q_spec, PartitionSpec(q_spec[0], CONTEXT, q_spec[2], None), PartitionSpec(q_spec[0], CONTEXT)


def _sharded(method: Callable, call: _Call, mesh, rules, q, k, v, segment_ids, window) -> jax.Array:
    """``method(call, ...)`` on the local shards, in a ``shard_map`` manual over every axis that splits
    q/k/v (:func:`jaxpar.parallel._regions.region_axes`: the whole mesh when the other axes have size 1; an array
    ``window`` goes in replicated; a static one stays static)."""
    sizes = dict(mesh.shape)
    specs = _specs(mesh, rules, q, k)
    manual = region_axes(mesh, {a for s in specs for e in s for a in axes_of(e) if sizes[a] > 1})
    body = functools.partial(method, call._replace(wire=reduce_dtype(q.dtype, mesh, manual)))
    q_spec, kv_spec, seg_spec = (keep_axes(s, manual) for s in specs)
    args, in_specs = (q, k, v), tuple(region_spec(s, 4, mesh, manual) for s in (q_spec, kv_spec, kv_spec))
    if segment_ids is not None:
        args, in_specs = args + (segment_ids,), in_specs + (seg_spec,)
    traced = window is not None and not isinstance(window, int)
    if traced:
        args, in_specs = args + (window,), in_specs + (PartitionSpec(),)

    def local(q, k, v, *rest):
        seg = rest[0] if segment_ids is not None else None
        return body(q, k, v, seg, rest[-1] if traced else window)
    return jax.shard_map(local, mesh=shard_map_mesh(mesh), in_specs=in_specs, out_specs=q_spec, axis_names=manual,
                         check_vma=False)(*args)


def _ring_local(call: _Call, q, k, v, seg, window):
    return ring_attention(q, k, v, seg, seg, axis_name=CONTEXT, causal=call.causal, scale=call.scale,
                          balance=call.balance, hop=call.hop, window=window, softcap=call.softcap, kernel=call.kernel,
                          interpret=call.interpret)


def _all_gather_local(call: _Call, q, k, v, seg, window):
    def gather(x):        # K/V in call.wire: its transpose, a reduce-scatter, too (jaxpar.parallel._regions)
        if x is None:
            return None
        wire = x.dtype if call.wire is None or not jnp.issubdtype(x.dtype, jnp.floating) else call.wire
        return collective_in(wire, functools.partial(jax.lax.all_gather, axis_name=CONTEXT, axis=1, tiled=True), x)
    k, v, k_seg = gather(k), gather(v), gather(seg)
    if call.kernel == "pallas":
        return _all_gather_fused(call, q, k, v, seg, k_seg, window)
    if not call.causal and window is None:   # a full mask depends on the segments only, not on where tokens sit
        return call.dense(q, k, v, causal=False, scale=call.scale, q_seg=seg, k_seg=k_seg, softcap=call.softcap)
    q_pos = shard_positions(jax.lax.axis_index(CONTEXT), q.shape[1], call.size, call.balance)
    k_pos = sequence_positions(k.shape[1], call.size, call.balance)
    return call.dense(q, k, v, causal=call.causal, scale=call.scale, q_seg=seg, k_seg=k_seg, q_pos=q_pos,
                           k_pos=k_pos, window=window, softcap=call.softcap)


def _all_gather_fused(call: _Call, q, k, v, seg, k_seg, window):
    """The all-gather method's local attention by the flash kernel: the gathered K/V in the natural order,
    each query chunk at its offset among them (its first true position; the ``window``, static or traced,
    masks by it too)."""
    if call.balance:
        k, v = from_balanced(k, 1, call.size), from_balanced(v, 1, call.size)
        k_seg = None if k_seg is None else from_balanced(k_seg, 1, call.size)
    parts = chunks_per_shard(call.balance) if call.causal or window is not None else 1
    chunk, me = q.shape[1] // parts, jax.lax.axis_index(CONTEXT)
    rows = lambda x, a: None if x is None else x[:, a * chunk:(a + 1) * chunk]     # noqa: E731
    return jnp.concatenate([flash_attention(rows(q, a), k, v, rows(seg, a), k_seg, chunk_index(me, a, call.size,
                                            call.balance) * chunk, window, call.causal, call.scale, call.softcap,
                                            call.interpret) for a in range(parts)], axis=1)


def ulysses_kv_repeat(heads: int, kv_heads: int, size: int) -> int:
    """How many times Ulysses repeats each K/V head so that ``size`` devices split them evenly.

    Args:
      heads, kv_heads: the query and K/V heads on one device (after any tensor split).
      size: the ``context`` axis size C.

    Returns:
      The smallest ``r`` with ``kv_heads * r`` divisible by ``size`` (it divides the group size).

    Raises:
      ContextParallelError: ``heads`` is not divisible by ``size``.

    >>> ulysses_kv_repeat(8, 2, 4), ulysses_kv_repeat(8, 8, 4)
    (2, 1)
    """
    if heads % size:
        raise ContextParallelError(
            f"attention (ulysses): the {heads} query heads on each device are not divisible by the context axis "
            f"size {size} (Ulysses gives each device heads / {size} heads). Fix: method 'ring' or 'all_gather', a "
            f"context size that divides {heads}, or fewer tensor-parallel splits of the heads.")
    return size // math.gcd(kv_heads, size)


def _ulysses_local(call: _Call, q, k, v, seg, window):
    repeat = ulysses_kv_repeat(q.shape[2], k.shape[2], call.size)
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)

    def to_heads(x):     # [b, t / C, h, d] -> [b, t, h / C, d]
        return jax.lax.all_to_all(x, CONTEXT, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    seg = None if seg is None else jax.lax.all_gather(seg, CONTEXT, axis=1, tiled=True)
    if call.balance:     # the whole sequence is here: back to the natural order, so is_causal applies
        q, k, v = (from_balanced(x, 1, call.size) for x in (q, k, v))
        seg = None if seg is None else from_balanced(seg, 1, call.size)
    out = call.dense(q, k, v, causal=call.causal, scale=call.scale, q_seg=seg, k_seg=seg, window=window,
                          softcap=call.softcap)
    if call.balance:
        out = to_balanced(out, 1, call.size)
    return jax.lax.all_to_all(out, CONTEXT, split_axis=1, concat_axis=2, tiled=True)


_LOCAL = {"ring": _ring_local, "all_gather": _all_gather_local, "ulysses": _ulysses_local}
