"""Ring attention: exact attention over a sequence split across a mesh axis, never gathering K/V.

The K/V shards travel around the ``C`` devices of the axis (one ``ppermute`` per step, ``C - 1``
forward); each device folds the block it holds into its queries' fp32 online softmax
(:func:`~jaxpar.parallel.context._softmax.softmax_step`) and keeps the logsumexp. The backward (a
``jax.custom_vjp``) rings again with the dK/dV accumulators beside K/V, and one more hop brings them
home. Each hop sends one buffer (:func:`pack`), which also keeps XLA from merging the backward's hops
with the forward's (that would keep the full K/V alive). ``hop="gather"`` makes each hop an
all-gather, for pipeline stages on XLA:CPU (docs/strategies.md, "Context parallelism").

Every (query chunk, key chunk) pair (:mod:`jaxpar.parallel.context._zigzag`) is one block; a block the
causal mask or the ``window`` masks wholly is skipped, statically where every device agrees, else by
``lax.cond`` (the hops stay outside it). With a static window the steps no device needs are left out.

Example (inside a ``shard_map`` manual over the axis)::

    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh({"context": 4}, devices=jax.devices()[:4])
    >>> q = k = v = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 4)), jnp.float32)
    >>> ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="context"), mesh=mesh,
    ...                      in_specs=P(None, "context"), out_specs=P(None, "context"))
    >>> want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> bool(jnp.allclose(jax.jit(ring)(q, k, v), want, atol=1e-6))
    True
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.parallel.context._flash import as_varying, flash_backward, flash_forward, flash_tile, merge_blocks
from jaxpar.parallel.context._softmax import (MASK_VALUE, allowed, check_softcap, check_window, empty_softmax, group_heads,
                                              softmax_grad_step, softmax_result, softmax_step)
from jaxpar.parallel.context._zigzag import check_length, chunk_index, chunks_per_shard, pair_needed, ring_schedule
from jaxpar.errors import ContextParallelError


class RingSpec(NamedTuple):
    """The static part of a ring: the mesh axis, its size, the mask, the layout, how a hop moves, a
    static sliding window (``None``: none, or a traced one given to :func:`ring_forward`) and the
    logit soft-cap."""

    axis: str
    size: int
    causal: bool
    scale: float
    balance: bool
    hop: str = "permute"
    window: int | None = None
    softcap: float | None = None
    kernel: str = "xla"       # "pallas": each block by the flash kernel (jaxpar.parallel.context._flash)
    interpret: bool = False   # the flash kernel in Pallas's interpreter (off a GPU)


def pack(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """The arrays of ``tree`` as one flat ``uint8`` buffer (their bytes), and the function that
    unpacks such a buffer into the same tree (shapes and dtypes).

    Args:
      tree: a pytree of arrays.

    Returns:
      ``(buffer, unpack)``: ``uint8[total bytes]``, leaves in tree order, and ``unpack(buffer) -> tree``.

    >>> buf, unpack = pack((jnp.arange(3.0), jnp.arange(2, dtype=jnp.int32)))
    >>> buf.shape, unpack(buf)[1]
    ((20,), Array([0, 1], dtype=int32))
    """
    leaves, treedef = jax.tree.flatten(tree)
    buf = jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in leaves])

    def unpack(data: jax.Array) -> Any:
        out, start = [], 0
        for x in leaves:
            n = x.size * x.dtype.itemsize
            raw = data[start:start + n].reshape(x.shape + ((x.dtype.itemsize,) if x.dtype.itemsize > 1 else ()))
            out.append(jax.lax.bitcast_convert_type(raw, x.dtype))
            start += n
        return jax.tree.unflatten(treedef, out)
    return buf, unpack


HOPS = ("permute", "gather")


def _shift(x: Any, spec: RingSpec, by: int = 1) -> Any:
    """Every device passes ``x`` (a pytree) ``by`` devices on along the ring: one ``ppermute`` of one
    buffer, or (``hop="gather"``) one ``all_gather`` of it, keeping the one from ``by`` devices back."""
    buf, unpack = pack(x)
    if spec.hop == "gather":
        previous = (jax.lax.axis_index(spec.axis) - by) % spec.size
        return unpack(jax.lax.all_gather(buf, spec.axis)[previous])
    return unpack(jax.lax.ppermute(buf, spec.axis, [(j, (j + by) % spec.size) for j in range(spec.size)]))


def _maybe(needed: Any, step: Callable, carry: Any) -> Any:
    """``step(carry)`` where ``needed`` (a Python bool or a traced scalar), else ``carry`` unchanged."""
    if isinstance(needed, bool):
        return step(carry) if needed else carry
    return jax.lax.cond(needed, step, lambda c: c, carry)


class _Blocks(NamedTuple):
    """One device's chunked view at one ring step: slices and true positions of its query chunks and
    of the key chunks it holds."""

    parts: int
    chunk: int
    me: Any
    shift: int          # the K/V held come from device ``me - shift``
    spec: RingSpec
    window: Any         # None, a static int or a traced int32 scalar

    def rows(self, x: Any, part: int) -> Any:
        return None if x is None else x[:, part * self.chunk:(part + 1) * self.chunk]

    def q_chunk(self, a: int) -> Any:
        return chunk_index(self.me, a, self.spec.size, self.spec.balance)

    def k_chunk(self, b: int) -> Any:
        return chunk_index((self.me - self.shift) % self.spec.size, b, self.spec.size, self.spec.balance)

    def needed(self, a: int, b: int) -> Any:
        """Whether the pair (query chunk ``a``, key chunk ``b``) has unmasked entries: a Python bool
        where it is the same on every device (no ``lax.cond`` then; with a traced window, only where
        the causal mask skips it everywhere), else a traced bool."""
        static = _static_window(self.window)
        plan = ring_schedule(self.spec.size, self.spec.balance, self.spec.causal, static, self.chunk)[self.shift]
        same = {plan[d][a][b] for d in range(self.spec.size)}
        if same == {False} or (len(same) == 1 and static is self.window):
            return same.pop()
        return pair_needed(self.q_chunk(a), self.k_chunk(b), self.spec.causal, self.window, self.chunk)

    def mask(self, a: int, b: int, q_seg: Any, k_seg: Any) -> jax.Array:
        span = jnp.arange(self.chunk, dtype=jnp.int32)
        return allowed(self.q_chunk(a) * self.chunk + span, self.k_chunk(b) * self.chunk + span,
                       self.rows(q_seg, a), self.rows(k_seg, b), causal=self.spec.causal, window=self.window)


def _static_window(window: Any) -> int | None:
    """``window`` if it is static (``None`` or an int), else ``None`` (a traced window)."""
    return window if window is None or isinstance(window, int) else None


def _blocks(spec: RingSpec, q: jax.Array, t: int, window: Any = None) -> _Blocks:
    """The view at step ``t``: the K/V held come from device ``me - t``; ``window`` is the traced
    window, or ``None`` for ``spec.window``."""
    parts = chunks_per_shard(spec.balance)
    return _Blocks(parts, q.shape[1] // parts, jax.lax.axis_index(spec.axis), t, spec,
                   spec.window if window is None else window)


def _steps(view: _Blocks) -> int:
    """How many ring steps compute any block on any device: all ``C`` unless a static window masks
    the last ones wholly (the steps after them, and their hops, are left out)."""
    static = _static_window(view.window)
    if static is None:
        return view.spec.size
    plan = ring_schedule(view.spec.size, view.spec.balance, view.spec.causal, static, view.chunk)
    return 1 + max(t for t, step in enumerate(plan) if any(any(map(any, device)) for device in step))


def ring_forward(spec: RingSpec, q, k, v, q_seg=None, k_seg=None, window=None) -> tuple[jax.Array, list, jax.Array]:
    """The ring's forward pass on one device's shards (inside a ``shard_map`` manual over ``spec.axis``).

    Args:
      spec: the :class:`RingSpec`.
      q: the local queries ``[batch, shard_length, heads, head_dim]``.
      k, v: the local keys and values ``[batch, shard_length, kv_heads, head_dim]``.
      q_seg, k_seg: the local segment ids ``[batch, shard_length]`` of the queries and the keys, or ``None``.
      window: a traced sliding window (an int32 scalar), or ``None`` for ``spec.window``.

    Returns:
      ``(out like q, logsumexp per query chunk, number of blocks computed on this device)``.
    """
    parts, fused = chunks_per_shard(spec.balance), spec.kernel == "pallas"
    qg = q if fused else group_heads(q, k.shape[2])
    view = _blocks(spec, q, 0, window)
    states = as_varying([(_empty_block if fused else empty_softmax)(view.rows(qg, a)) for a in range(parts)],
                      q, k, v, view.me)
    kv, pairs, steps = jnp.stack([k, v]), as_varying(jnp.int32(0), view.me), _steps(view)
    for t in range(steps):
        view = _blocks(spec, q, t, window)
        for a, b in itertools.product(range(parts), range(parts)):
            step = functools.partial(_forward_block, fused, view, a, b, qg, kv, q_seg, k_seg)
            states[a] = _maybe(view.needed(a, b), step, states[a])
            pairs = pairs + view.needed(a, b)
        if t < steps - 1:
            kv, k_seg = _shift((kv, k_seg), spec)
    outs, lses = zip(*((s[0].astype(q.dtype), s[1]) if fused else softmax_result(s, q.dtype) for s in states))
    return jnp.concatenate(outs, axis=1), list(lses), pairs


def _empty_block(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The fused ring's state before any key block: ``(out [b, t, heads, d], lse [b, heads, t])`` fp32."""
    b, t, h, d = q.shape
    return jnp.zeros(q.shape, jnp.float32), jnp.full((b, h, t), MASK_VALUE, jnp.float32)


def _flash_args(view: _Blocks, a: int, b: int, q, kv, q_seg, k_seg) -> tuple[tuple, dict]:
    """The flash kernel's block arguments for the pair (``a``, ``b``): the diagonal block (step 0,
    ``a == b``) is the only one a causal mask cuts; every other needed pair lies wholly in the past. With
    a window the kernel masks by the queries' offset from the keys, ``(q chunk - k chunk) * chunk``."""
    args = (view.rows(q, a), view.rows(kv[0], b), view.rows(kv[1], b), view.rows(q_seg, a), view.rows(k_seg, b))
    causal = view.spec.causal and view.shift == 0 and a == b
    options = dict(causal=causal, scale=view.spec.scale, softcap=view.spec.softcap, interpret=view.spec.interpret)
    if view.window is not None:
        options.update(window=view.window, offset=(view.q_chunk(a) - view.k_chunk(b)) * view.chunk)
    return args, options


def _forward_block(fused: bool, view: _Blocks, a: int, b: int, qg, kv, q_seg, k_seg, state):
    """``state`` with the pair's block folded in: by the flash kernel (``fused``) or the XLA online softmax."""
    if fused:
        args, options = _flash_args(view, a, b, qg, kv, q_seg, k_seg)
        return merge_blocks(state, flash_forward(*args, **options))
    kb = view.rows(kv[0], b), view.rows(kv[1], b)
    return softmax_step(state, view.rows(qg, a), *kb, view.mask(a, b, q_seg, k_seg), view.spec.scale,
                        view.spec.softcap)


def ring_backward(spec: RingSpec, residuals: tuple, d_out: jax.Array) -> tuple:
    """The ring's backward pass: dQ stays, K/V and their dK/dV accumulators travel the ring.

    Args:
      spec: the :class:`RingSpec`.
      residuals: ``(q, k, v, q_seg, k_seg, window, out, logsumexps)`` of the forward pass.
      d_out: the cotangent of ``out``.

    Returns:
      ``(dq, dk, dv, None, None, None)``: the cotangents of the inputs (none for the segment ids and
      the window).
    """
    q, k, v, q_seg, k_seg, window, out, lses = residuals
    kv = jnp.stack([k, v])
    parts, fused = chunks_per_shard(spec.balance), spec.kernel == "pallas"
    if fused:                                    # ungrouped; delta [b, heads, t]
        qg, dog = q, d_out
        delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    else:
        qg, dog = group_heads(q, k.shape[2]), group_heads(d_out, k.shape[2]).astype(jnp.float32)
        delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog, group_heads(out, k.shape[2]).astype(jnp.float32))
    view = _blocks(spec, q, 0, window)
    deltas = [delta[..., a * view.chunk:(a + 1) * view.chunk] for a in range(parts)]
    dq, dkv = as_varying(([jnp.zeros(view.rows(qg, a).shape, jnp.float32) for a in range(parts)],
                        jnp.zeros(kv.shape, jnp.float32)), q, k, v, d_out, view.me)
    steps = _steps(view)
    for t in range(steps):
        view = _blocks(spec, q, t, window)
        for a, b in itertools.product(range(parts), range(parts)):
            grads = (qg, dog, lses[a], deltas[a])
            step = functools.partial(_backward_block, fused, view, a, b, grads, kv, q_seg, k_seg)
            dq[a], dkv = _maybe(view.needed(a, b), step, (dq[a], dkv))
        if t < steps - 1:
            kv, k_seg, dkv = _shift((kv, k_seg, dkv), spec)
    if (spec.size - steps + 1) % spec.size:      # the accumulators of device d's K/V sit on d + steps - 1
        dkv = _shift(dkv, spec, spec.size - steps + 1)
    dq = jnp.concatenate(dq, axis=1).reshape(q.shape)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None, None


def _backward_block(fused: bool, view: _Blocks, a: int, b: int, grads: tuple, kv, q_seg, k_seg, carry):
    """One pair's dQ and dK/dV added to ``carry``: by the flash kernel (``fused``) or the XLA softmax gradient."""
    qg, dog, lse, delta = grads
    dq, dkv = carry
    if fused:
        args, options = _flash_args(view, a, b, qg, kv, q_seg, k_seg)
        dq_ab, dk, dv = flash_backward(*args, view.rows(dog, a), lse, delta, **options)
    else:
        mask = view.mask(a, b, q_seg, k_seg)
        dq_ab, dk, dv = softmax_grad_step(view.rows(qg, a), view.rows(kv[0], b), view.rows(kv[1], b),
                                          view.rows(dog, a), lse, delta, mask, view.spec.scale, view.spec.softcap)
    keys = slice(b * view.chunk, (b + 1) * view.chunk)
    return dq + dq_ab, dkv.at[:, :, keys].add(jnp.stack([dk, dv]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(spec: RingSpec, q, k, v, q_seg, k_seg, window):
    return ring_forward(spec, q, k, v, q_seg, k_seg, window)[0]


def _ring_fwd(spec: RingSpec, q, k, v, q_seg, k_seg, window):
    out, lses, _ = ring_forward(spec, q, k, v, q_seg, k_seg, window)
    return out, (q, k, v, q_seg, k_seg, window, out, lses)


_ring.defvjp(_ring_fwd, ring_backward)


#: The ring's block kernels: XLA's einsums and online softmax, or the Pallas flash kernel.
RING_KERNELS = ("xla", "pallas")


def fused_ring_problem(kernel: str, chunk: int, head_dim: int) -> str | None:
    """Why the ring cannot run its blocks by ``kernel``, or ``None`` when it can.

    Args:
      kernel: one of :data:`RING_KERNELS`.
      chunk: the block length (the shard length, half of it balanced).
      head_dim: the head dimension.

    Returns:
      ``None``, or the reason.

    >>> fused_ring_problem("pallas", 4096, 128), fused_ring_problem("pallas", 4096, 96)
    (None, 'head_dim 96 (the flash block kernel: a power of 2, at least 16)')
    """
    if kernel not in RING_KERNELS:
        return f"kernel {kernel!r} is not one of {RING_KERNELS}"
    if kernel == "xla":
        return None
    return flash_tile(chunk, head_dim)


def ring_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, axis_name: str = "context",
                   causal: bool = True, scale: float | None = None, balance: bool = False,
                   hop: str = "permute", window: Any = None, softcap: float | None = None, kernel: str = "xla",
                   interpret: bool | None = None) -> jax.Array:
    """Ring attention of one device's shards; call it inside a ``shard_map`` manual over ``axis_name``.

    Args:
      q: the local queries ``[batch, shard_length, heads, head_dim]``.
      k, v: the local keys and values ``[batch, shard_length, kv_heads, head_dim]`` (``kv_heads``
        divides ``heads``).
      q_segment_ids, kv_segment_ids: the local segment ids ``[batch, shard_length]``, or ``None``.
      axis_name: the mesh axis the sequence is split over.
      causal: the causal mask (by true positions).
      scale: the score scale, ``head_dim ** -0.5`` by default.
      balance: the sequence is in the balanced order of :func:`jaxpar.parallel.context.to_balanced`.
      hop: ``"permute"`` (one ``ppermute`` per hop) or ``"gather"`` (one ``all_gather`` per hop, for
        XLA:CPU inside a pipeline stage; see the module docstring).
      window: the sliding window (by true positions): a Python int, an int32 scalar array (may be
        traced), or ``None``.
      softcap: the logit soft-cap (a Python number > 0), or ``None``.
      kernel: ``"xla"`` (each block by einsums and an online softmax) or ``"pallas"`` (each block by the
        flash kernel of :mod:`jaxpar.parallel.context._flash`, merged by its log-sum-exp: no
        ``[block, block]`` array).
      interpret: run the ``"pallas"`` kernel in Pallas's interpreter; ``None``: off a GPU backend.

    Returns:
      The local output, like ``q``; differentiable (its backward rings too).

    Raises:
      ContextParallelError: a bad ``hop``, ``window``, ``softcap`` or ``kernel``, segment ids for one
        side only, or a shard length the layout cannot chunk.
    """
    if hop not in HOPS:
        raise ContextParallelError(f"ring_attention: hop={hop!r}; use one of {HOPS}.")
    window = check_window(window, ContextParallelError, "ring_attention")
    softcap = check_softcap(softcap, ContextParallelError, "ring_attention")
    size = jax.lax.axis_size(axis_name)
    check_length(q.shape[1] * size, size, balance)
    if isinstance(window, int) and window >= q.shape[1] * size:
        window = None                            # wider than the sequence: no window
    static = window if isinstance(window, int) else None
    if kernel != "xla" and (why := fused_ring_problem(kernel, q.shape[1] // chunks_per_shard(balance), q.shape[-1])):
        raise ContextParallelError(f"ring_attention: kernel={kernel!r} cannot run this call: {why}. "
                                   "Fix: kernel='xla'.")
    interpret = jax.default_backend() != "gpu" if interpret is None else bool(interpret)
    spec = RingSpec(axis_name, size, causal, q.shape[-1] ** -0.5 if scale is None else float(scale), balance, hop,
                    static, softcap, kernel, interpret)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ContextParallelError("ring_attention: give both q_segment_ids and kv_segment_ids, or neither.")
    return _ring(spec, q, k, v, q_segment_ids, kv_segment_ids, None if static is not None else window)
