"""Flash attention of one block of context-parallel attention (a Pallas Triton kernel for GPUs), and the
merge of blocks by their log-sum-exp.

The ring (:mod:`jaxpar.parallel.context._ring`) computes each (query chunk, key chunk) block with
:func:`flash_forward`, which returns the block's output (fp32) and its natural log-sum-exp, and folds the
blocks together with :func:`merge_blocks` (ring-flash-attention's method). Its backward runs
:func:`flash_backward` per block with the global output's ``delta = rowsum(dO * O)`` and the global
log-sum-exp: ``p = exp(s - lse)`` is then the block's part of the final softmax, so each block's dQ, dK, dV
are its exact share. No ``[block, block]`` array leaves the kernel.

Why a kernel of our own: JAX's Pallas GPU flash attention
(``jax.experimental.pallas.ops.gpu.attention.mha``) returns a base-2 log-sum-exp (``m + log2 l`` of scores
scaled by ``log2 e``), reads the query's and the key's segment ids from one array (a ring block's keys are
other tokens than its queries) and has no causal offset (the all-gather method's queries sit at an offset
within the gathered keys). Here the mask of a block is, by true positions
``q_pos = offset + i`` and ``k_pos = j``: ``q_pos >= k_pos`` when ``causal``, ``q_pos - k_pos < window``
with a sliding ``window`` (without ``causal`` also ``k_pos - q_pos < window``), and ``q_seg == k_seg`` with
segment ids; a ``softcap`` makes the scores ``s = scale * q.k`` into ``softcap * tanh(s / softcap)`` before
the mask (:func:`jaxpar.parallel.context._softmax.allowed` and ``_logits``, XLA's path). Key (or, for
dK/dV, query) tiles that the causal mask or the window masks wholly are skipped. GQA: query head ``h``
reads K/V head ``h // (heads // kv_heads)``; dK/dV are summed over each group. ``interpret=True`` runs the
kernels in Pallas's interpreter (the CPU's exactness tests).

Example::

    >>> import jax, jax.numpy as jnp
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 16))
    >>> out, lse = flash_forward(q, k, v, causal=True, scale=0.25, interpret=True)
    >>> want = jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=True)
    >>> bool(jnp.allclose(out, want, atol=1e-5)), lse.shape
    (True, (1, 2, 16))
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import AttentionError
from jaxpar.parallel.context._softmax import MASK_VALUE

#: The kernels' tile along the sequence (the smaller of it and the block's length).
TILE = 64
_F32 = jnp.float32
#: Triton's launch settings (the Triton backend, not Mosaic GPU, runs the kernels).
_TRITON = plgpu.CompilerParams(num_warps=4, num_stages=2)


def flash_tile(length: int, head_dim: int) -> str | None:
    """Why a block of ``length`` tokens and ``head_dim`` cannot run the kernel, or ``None`` when it can.

    Args:
      length: the block's (query or key) length.
      head_dim: the head dimension.

    Returns:
      ``None``, or the reason.

    >>> flash_tile(4096, 128), flash_tile(100, 128)
    (None, 'block length 100 (the flash block kernel: a multiple of 64, or a power of 2 below it)')
    """
    tile = min(TILE, length)
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} (the flash block kernel: a power of 2, at least 16)"
    if length % tile or tile & (tile - 1):
        return f"block length {length} (the flash block kernel: a multiple of {TILE}, or a power of 2 below it)"
    return None


def _vma(x: Any) -> set:
    """The manual axes ``x`` varies over (jax 0.10 keeps them in ``aval.mat.varying``, older in ``aval.vma``)."""
    if x is None:
        return set()
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def as_varying(tree: Any, *refs: Any) -> Any:
    """``tree`` marked as varying over every manual axis that one of ``refs`` varies over, so that
    ``lax.cond`` sees equal types under ``shard_map(check_vma=True)`` (a no-op without it)."""
    axes = set().union(*(_vma(r) for r in refs))

    def cast(x):
        missing = tuple(sorted(axes - _vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def _out(shape: tuple, ref: jax.Array) -> jax.ShapeDtypeStruct:
    """An fp32 kernel output of ``shape`` that varies over the manual axes ``ref`` varies over (a
    ``shard_map`` with ``check_vma=True`` asks)."""
    aval = jax.typeof(ref)
    mesh = getattr(aval.sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return jax.ShapeDtypeStruct(shape, _F32)
    return jax.ShapeDtypeStruct(shape, _F32, sharding=NamedSharding(mesh, PartitionSpec()), manual_axis_type=aval.mat)


def _both(mask, other):
    """``mask & other``, ``other`` where ``mask`` is ``None``."""
    return other if mask is None else mask & other


def _mask(q_pos, k_pos, q_seg, k_seg, causal: bool, window):
    """The tile's mask (``None``: all allowed) by true positions, the ``window`` (``None``: none) and
    segment ids, as :func:`jaxpar.parallel.context._softmax.allowed`."""
    mask = q_pos[:, None] >= k_pos[None, :] if causal else None
    if window is not None:
        gap = q_pos[:, None] - k_pos[None, :]
        mask = _both(mask, gap < window if causal else (gap < window) & (gap > -window))
    if q_seg is not None:
        mask = _both(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _scores(q, k, scale: float, softcap: float | None, mask) -> tuple[jax.Array, Any]:
    """``scale * q k^T`` in fp32, soft-capped with ``softcap``, masked entries at :data:`MASK_VALUE`; and
    ``tanh(scale * q k^T / softcap)`` with a cap (the backward's ``d capped / d raw = 1 - tanh^2``), else ``None``."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * scale
    tanh = None
    if softcap is not None:
        tanh = jnp.tanh(s / softcap)
        s = softcap * tanh
    return (s if mask is None else jnp.where(mask, s, MASK_VALUE)), tanh


def _score_grad(p, dp, delta, scale: float, tanh):
    """dS of the raw scores ``q k^T``: ``p (dP - delta)`` through the soft-cap (``1 - tanh^2``) and the scale."""
    ds = p * (dp - delta[:, None])
    return ds * scale if tanh is None else ds * (1 - tanh * tanh) * scale


def _gaps(causal: bool, window) -> tuple[Any, Any]:
    """The lowest and highest ``q_pos - k_pos`` the mask allows (``None``: unbounded)."""
    low = 0 if causal else (None if window is None else 1 - window)
    return low, None if window is None else window - 1


def _tiles(first, last, tile: int, tiles: int) -> tuple[Any, Any]:
    """The tiles ``[start, stop)`` of ``tiles`` tiles of ``tile`` that hold positions ``first..last``
    (``None``: unbounded on that side; positions may lie outside the block)."""
    start = 0 if first is None else jnp.clip(lax.div(jnp.maximum(first, 0), tile), 0, tiles)
    if last is None:
        return start, tiles
    return start, jnp.maximum(jnp.clip(lax.div(jnp.maximum(last + tile, 0), tile), 0, tiles), start)


def _key_tiles(offset, window, causal: bool, i, tile_q: int, tile_k: int, tiles: int) -> tuple[Any, Any]:
    """The key tiles query tile ``i`` needs: those the causal mask and the window leave any entry of."""
    low, high = _gaps(causal, window)
    first = offset + i * tile_q
    return _tiles(None if high is None else first - high, None if low is None else first + tile_q - 1 - low,
                  tile_k, tiles)


def _query_tiles(offset, window, causal: bool, j, tile_k: int, tile_q: int, tiles: int) -> tuple[Any, Any]:
    """The query tiles key tile ``j`` needs (block rows ``q_pos - offset``)."""
    low, high = _gaps(causal, window)
    first = j * tile_k - offset
    return _tiles(None if low is None else first + low, None if high is None else first + tile_k - 1 + high,
                  tile_q, tiles)


def _window_of(win_ref):
    """The window the kernel reads from its ``[1]`` input, or ``None`` without one."""
    return None if win_ref is None else win_ref[0]


def _forward_kernel(off_ref, win_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, scale, softcap, causal,
                    tile_k):
    tile_q, i, offset, window = q_ref.shape[0], pl.program_id(0), off_ref[0], _window_of(win_ref)
    q, q_pos = q_ref[...], offset + i * tile_q + jnp.arange(tile_q)
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(j, carry):
        o, m, l = carry     # noqa: E741
        keys = pl.ds(j * tile_k, tile_k)
        k_seg = None if ks_ref is None else ks_ref[keys]
        mask = _mask(q_pos, j * tile_k + jnp.arange(tile_k), q_seg, k_seg, causal, window)
        s, _ = _scores(q, k_ref[keys, :], scale, softcap, mask)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p, alpha = jnp.exp(s - m_new[:, None]), jnp.exp(m - m_new)
        v = v_ref[keys, :]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
        return alpha[:, None] * o + pv, m_new, alpha * l + p.sum(axis=-1)
    init = (jnp.zeros(q.shape, _F32), jnp.full((tile_q,), MASK_VALUE, _F32), jnp.zeros((tile_q,), _F32))
    start, stop = _key_tiles(offset, window, causal, i, tile_q, tile_k, k_ref.shape[0] // tile_k)
    o, m, l = lax.fori_loop(start, stop, body, init)    # noqa: E741
    empty = m == MASK_VALUE                               # rows no key may attend to: lse MASK_VALUE, output 0
    l = jnp.where(empty, 1.0, l)                          # noqa: E741
    o_ref[...] = jnp.where(empty[:, None], 0.0, o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _specs(head: Callable, tile: int | None, length: int, head_dim: int):
    """BlockSpecs of a ``[b, t, heads, d]`` array, its ``[b, t]`` segment ids and its ``[b, heads, t]``
    statistics: a ``tile`` of rows at grid index 0 (``None``: all rows), head ``head(grid index 2)``."""
    rows = length if tile is None else tile
    at = (lambda i: 0) if tile is None else (lambda i: i)
    return (pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, at(i), head(h), 0)),
            pl.BlockSpec((None, rows), lambda i, b, h: (b, at(i))),
            pl.BlockSpec((None, None, rows), lambda i, b, h: (b, head(h), at(i))))


def _group(group: int) -> Callable:
    """Query head ``h``'s K/V head."""
    return lambda h: h // group


def _member(group: int, g: int) -> Callable:
    """K/V head ``h``'s ``g``-th query head."""
    return lambda h: h * group + g


def _offset(offset: Any) -> tuple[jax.Array, pl.BlockSpec]:
    """The causal offset as an int32 ``[1]`` input and its spec."""
    return jnp.asarray(offset, jnp.int32).reshape(1), pl.BlockSpec((1,), lambda i, b, h: (0,))


#: The largest window the kernels take: any wider one masks like it (no block is 2**30 tokens from
#: another), and the tile bounds ``position +- window`` stay in int32.
_WIDEST = 2 ** 30


def _window(window: Any) -> tuple[Any, Any]:
    """The sliding window as an int32 ``[1]`` input (at most :data:`_WIDEST`) and its spec, or
    ``(None, None)`` without one."""
    if window is None:
        return None, None
    return _offset(jnp.minimum(jnp.asarray(window, jnp.int32), _WIDEST))


def _segments(q_seg, k_seg) -> tuple[Any, Any]:
    if (q_seg is None) != (k_seg is None):
        raise AttentionError(f"flash_forward(q_seg={'given' if q_seg is not None else None}, k_seg="
                             f"{'given' if k_seg is not None else None}): give both segment ids, or neither.")
    return (None, None) if q_seg is None else (q_seg.astype(jnp.int32), k_seg.astype(jnp.int32))


def flash_forward(q, k, v, q_seg=None, k_seg=None, *, causal: bool, scale: float, offset: Any = 0,
                  window: Any = None, softcap: float | None = None,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """One block's attention by the flash kernel: its output and its log-sum-exp.

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, k_length, kv_heads, head_dim]``.
      q_seg, k_seg: ``[batch, q_length]`` and ``[batch, k_length]`` segment ids, or both ``None``.
      causal: mask keys after the query, by positions ``offset + row`` (queries) and ``column`` (keys).
      scale: the score scale.
      offset: the queries' first position among the keys (an int or a traced int32 scalar; negative where
        the queries come before the keys).
      window: the sliding window (a Python int >= 1 or a traced int32 scalar), or ``None``: keys ``window``
        or more positions before the query are masked (and, without ``causal``, as far after it).
      softcap: the logit soft-cap (a Python float > 0), or ``None``.
      interpret: run in Pallas's interpreter (off a GPU).

    Returns:
      ``(out [batch, q_length, heads, head_dim] fp32, lse [batch, heads, q_length] fp32)``; a row no
      key may attend to has an lse near :data:`MASK_VALUE` (it weighs nothing in :func:`merge_blocks`).
    """
    (b, tq, h, d), tk = q.shape, k.shape[1]
    tile_q, tile_k = min(TILE, tq), min(TILE, tk)
    q_seg, k_seg = _segments(q_seg, k_seg)
    (q_spec, qs_spec, lse_spec), (k_spec, ks_spec, _) = (_specs(_group(1), tile_q, tq, d),
                                                          _specs(_group(h // k.shape[2]), None, tk, d))
    (off, off_spec), (win, win_spec) = _offset(offset), _window(window)
    args = as_varying((off, win, q, k, v, q_seg, k_seg), off, win, q, k, v, q_seg, k_seg)
    kernel = functools.partial(_forward_kernel, scale=scale, softcap=softcap, causal=causal, tile_k=tile_k)
    segs = (None, None) if q_seg is None else (qs_spec, ks_spec)
    return pl.pallas_call(
        kernel, grid=(tq // tile_q, b, h), in_specs=[off_spec, win_spec, q_spec, k_spec, k_spec, *segs],
        out_specs=[q_spec, lse_spec], out_shape=[_out(q.shape, q), _out((b, h, tq), q)],
        interpret=interpret, compiler_params=_TRITON, name="ring_flash_forward")(*args)


def _dq_kernel(off_ref, win_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref, *,
               scale, softcap, causal, tile_k):
    tile_q, i, offset, window = q_ref.shape[0], pl.program_id(0), off_ref[0], _window_of(win_ref)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = offset + i * tile_q + jnp.arange(tile_q)
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(j, dq):
        keys = pl.ds(j * tile_k, tile_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_seg = None if ks_ref is None else ks_ref[keys]
        s, tanh = _scores(q, k, scale, softcap, _mask(q_pos, j * tile_k + jnp.arange(tile_k), q_seg, k_seg, causal,
                                                      window))
        p = jnp.exp(s - lse[:, None])
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        ds = _score_grad(p, dp, delta, scale, tanh).astype(k.dtype)
        return dq + lax.dot_general(ds, k, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    start, stop = _key_tiles(offset, window, causal, i, tile_q, tile_k, k_ref.shape[0] // tile_k)
    dq_ref[...] = lax.fori_loop(start, stop, body, jnp.zeros(q.shape, _F32))


def _dkv_kernel(off_ref, win_ref, k_ref, v_ref, qs_ref, ks_ref, *refs, scale, softcap, causal, tile_q, group):
    """dK, dV of one key tile of one K/V head: over the tiles of each of its ``group`` query heads (``refs``:
    q, dO, lse and delta of each, then the dK and dV outputs)."""
    (dk_ref, dv_ref), tile_k, j, offset = refs[4 * group:], k_ref.shape[0], pl.program_id(0), off_ref[0]
    window = _window_of(win_ref)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * tile_k + jnp.arange(tile_k)
    k_seg = None if ks_ref is None else ks_ref[...]

    def body(heads, i, carry):
        (q_ref, do_ref, lse_ref, delta_ref), (dk, dv) = heads, carry
        rows = pl.ds(i * tile_q, tile_q)
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows], delta_ref[rows]
        q_seg = None if qs_ref is None else qs_ref[rows]
        mask = _mask(offset + i * tile_q + jnp.arange(tile_q), k_pos, q_seg, k_seg, causal, window)
        s, tanh = _scores(q, k, scale, softcap, mask)
        p = jnp.exp(s - lse[:, None])
        dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        ds = _score_grad(p, dp, delta, scale, tanh).astype(q.dtype)
        return dk + lax.dot_general(ds, q, (((0,), (0,)), ((), ())), preferred_element_type=_F32), dv
    start, stop = _query_tiles(offset, window, causal, j, tile_k, tile_q, refs[0].shape[0] // tile_q)
    grads = (jnp.zeros(k.shape, _F32),) * 2
    for g in range(group):
        grads = lax.fori_loop(start, stop, functools.partial(body, refs[4 * g:4 * g + 4]), grads)
    dk_ref[...], dv_ref[...] = grads


def flash_backward(q, k, v, q_seg, k_seg, d_out, lse, delta, *, causal: bool, scale: float, offset: Any = 0,
                   window: Any = None, softcap: float | None = None,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's share of the attention gradient, from the statistics of the whole attention.

    Args:
      q, k, v, q_seg, k_seg, causal, scale, offset, window, softcap, interpret: as for :func:`flash_forward`.
      d_out: the cotangent of the whole attention's output at these queries, like ``q``.
      lse: the whole attention's log-sum-exp at these queries ``[batch, heads, q_length]`` fp32.
      delta: ``rowsum(d_out * out)`` of the whole attention's output ``[batch, heads, q_length]`` fp32.

    Returns:
      ``(dq like q, dk like k, dv like v)``, all fp32.
    """
    (b, tq, h, d), tk, hk = q.shape, k.shape[1], k.shape[2]
    tile_q, tile_k = min(TILE, tq), min(TILE, tk)
    q_seg, k_seg = _segments(q_seg, k_seg)
    (off, off_spec), (win, win_spec) = _offset(offset), _window(window)
    args = (off, win, q, k, v, d_out.astype(q.dtype), lse, delta, q_seg, k_seg)
    args = as_varying(args, *args)
    off, win, q, k, v, do, lse, delta, q_seg, k_seg = args
    common = dict(scale=scale, softcap=softcap, causal=causal)
    group = h // hk
    q_tiled = _specs(_group(1), tile_q, tq, d)
    k_tiled, k_whole = _specs(_group(1), tile_k, tk, d), _specs(_group(group), None, tk, d)
    segs = lambda qs, ks: (None, None) if q_seg is None else (qs, ks)    # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, tile_k=tile_k, **common), grid=(tq // tile_q, b, h),
        in_specs=[off_spec, win_spec, q_tiled[0], k_whole[0], k_whole[0], q_tiled[0], q_tiled[2], q_tiled[2],
                  *segs(q_tiled[1], k_whole[1])],
        out_specs=q_tiled[0], out_shape=_out(q.shape, q), interpret=interpret, compiler_params=_TRITON,
        name="ring_flash_dq")(*args)
    heads = [_specs(_member(group, g), None, tq, d) for g in range(group)]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, tile_q=tile_q, group=group, **common), grid=(tk // tile_k, b, hk),
        in_specs=[off_spec, win_spec, k_tiled[0], k_tiled[0], *segs(heads[0][1], k_tiled[1]),
                  *[spec for q_whole in heads for spec in (q_whole[0], q_whole[0], q_whole[2], q_whole[2])]],
        out_specs=[k_tiled[0]] * 2, out_shape=[_out(k.shape, q)] * 2,
        interpret=interpret, compiler_params=_TRITON, name="ring_flash_dkv")(
            off, win, k, v, q_seg, k_seg, *[x for _ in range(group) for x in (q, do, lse, delta)])
    return dq, dk, dv


def merge_blocks(state: tuple[jax.Array, jax.Array], block: tuple[jax.Array, jax.Array]) -> tuple:
    """Two partial attentions over disjoint keys merged into the attention over both, by their log-sum-exps.

    Args:
      state: ``(out [b, t, heads, d] fp32, lse [b, heads, t] fp32)`` so far.
      block: the next block's ``(out, lse)`` from :func:`flash_forward`.

    Returns:
      The merged ``(out, lse)``.

    >>> o = jnp.ones((1, 1, 1, 2)); lse = jnp.zeros((1, 1, 1))
    >>> merge_blocks((o, lse), (3 * o, lse))[0].tolist(), float(merge_blocks((o, lse), (o, lse))[1][0, 0, 0])
    ([[[[2.0, 2.0]]]], 0.6931471824645996)
    """
    (out, lse), (out_b, lse_b) = state, block
    new = jnp.maximum(lse, lse_b) + jnp.log1p(jnp.exp(-jnp.abs(lse - lse_b)))
    weight = lambda x: jnp.exp(x - new).transpose(0, 2, 1)[..., None]     # noqa: E731
    return out * weight(lse) + out_b * weight(lse_b), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def flash_attention(q, k, v, q_seg, k_seg, offset, window, causal: bool, scale: float, softcap: float | None,
                    interpret: bool) -> jax.Array:
    """Attention of ``q`` to all of ``k``/``v`` by the flash kernel, differentiable (its backward is the
    kernel's too): the all-gather method's local attention, queries at ``offset`` among the keys.

    Args:
      q, k, v, q_seg, k_seg, offset, window, causal, scale, softcap, interpret: as for :func:`flash_forward`.

    Returns:
      ``[batch, q_length, heads, head_dim]`` in ``q``'s dtype.
    """
    return _attention_fwd(q, k, v, q_seg, k_seg, offset, window, causal, scale, softcap, interpret)[0]


def _attention_fwd(q, k, v, q_seg, k_seg, offset, window, causal, scale, softcap, interpret):
    out, lse = flash_forward(q, k, v, q_seg, k_seg, causal=causal, scale=scale, offset=offset, window=window,
                             softcap=softcap, interpret=interpret)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_seg, k_seg, offset, window, out, lse)


def _attention_bwd(causal, scale, softcap, interpret, residuals, d_out):
    q, k, v, q_seg, k_seg, offset, window, out, lse = residuals
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(_F32), out.astype(_F32))
    dq, dk, dv = flash_backward(q, k, v, q_seg, k_seg, d_out, lse, delta, causal=causal, scale=scale, offset=offset,
                                window=window, softcap=softcap, interpret=interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


flash_attention.defvjp(_attention_fwd, _attention_bwd)
