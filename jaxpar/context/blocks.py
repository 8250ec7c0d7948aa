"""The attention arithmetic shared by the context-parallel methods: masks from true positions and
segment ids, whole-sequence attention (``jax.nn.dot_product_attention``) and the per-block steps of
the online softmax (forward) and of its gradient (backward) that the ring runs.

Layouts: activations are ``[batch, length, heads, head_dim]``; with GQA, query head ``h`` uses K/V
head ``h // (heads // kv_heads)`` (as ``jnp.repeat(k, heads // kv_heads, axis=2)``, and as
``jax.nn.dot_product_attention``). The block steps hold queries grouped as
``[batch, length, kv_heads, group, head_dim]`` and their statistics as
``[batch, kv_heads, group, length]``, in fp32.

A token ``q`` may attend to a token ``k`` when ``segment[q] == segment[k]`` (packed sequences) and,
with a causal mask, ``position[k] <= position[q]``. Every token attends to itself, so no row of a
mask is empty.

Example::

    >>> allowed(jnp.arange(3), jnp.arange(3), None, None, causal=True)[0].astype(int)
    Array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]], dtype=int32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MASK_VALUE", "allowed", "dense_attention", "group_heads", "Softmax", "empty_softmax", "softmax_step",
           "softmax_result", "softmax_grad_step"]

#: The score of a masked entry: finite, so that a row whose block is wholly masked gives no NaN
#: (its running max is corrected away by the first unmasked block, as in jax's flash attention).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def allowed(q_pos: Any, k_pos: Any, q_seg: Any, k_seg: Any, *, causal: bool) -> jnp.ndarray:
    """Which (query, key) pairs may attend: a bool array ``[batch or 1, len(q_pos), len(k_pos)]``.

    Args:
      q_pos, k_pos: the true positions of the queries and keys.
      q_seg, k_seg: ``[batch, length]`` segment ids of the queries and keys, or both ``None``.
      causal: keys after the query are masked.
    """
    mask = jnp.ones((1, len(q_pos), len(k_pos)), bool)
    if causal:
        mask = mask & (jnp.asarray(q_pos)[:, None] >= jnp.asarray(k_pos)[None, :])[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask


def dense_attention(q, k, v, *, causal: bool, scale: float, q_seg=None, k_seg=None, q_pos=None,
                    k_pos=None) -> jax.Array:
    """Attention of all of ``q`` to all of ``k``/``v`` with ``jax.nn.dot_product_attention``.

    Without positions the tokens are in their natural order and the causal mask is the function's
    own (``is_causal``, which cuDNN's flash attention supports where JAX selects it); segment ids add a
    mask. With positions (a permuted or partial sequence) the whole mask is built from them.

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, k_length, kv_heads, head_dim]``.
      causal: the causal mask.
      scale: the score scale.
      q_seg, k_seg: ``[batch, length]`` segment ids, or ``None``.
      q_pos, k_pos: true positions, or ``None`` for ``arange``.

    Returns:
      ``[batch, q_length, heads, head_dim]``.
    """
    if q_pos is None:
        mask = None if q_seg is None else (q_seg[:, :, None] == k_seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal)
    mask = allowed(q_pos, k_pos, q_seg, k_seg, causal=causal)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)


def group_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, t, heads, d]`` -> ``[b, t, kv_heads, heads // kv_heads, d]`` (query head ``h`` -> K/V head
    ``h // group``)."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


class Softmax(NamedTuple):
    """The running state of one query block's online softmax (fp32): the unnormalised output
    ``o`` ``[b, kv_heads, group, t, d]``, the row max ``m`` and the row sum ``l`` ``[b, kv_heads, group, t]``."""

    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741 - the usual name of the softmax denominator


def empty_softmax(q: jax.Array) -> Softmax:
    """The state before any key block, for grouped queries ``q`` ``[b, t, kv_heads, group, d]``."""
    b, t, hk, g, d = q.shape
    m = jnp.full((b, hk, g, t), MASK_VALUE, jnp.float32)
    return Softmax(jnp.zeros((b, hk, g, t, d), jnp.float32), m, jnp.zeros_like(m))


def _scores(q, k, mask, scale) -> jax.Array:
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], s, MASK_VALUE)


def softmax_step(state: Softmax, q, k, v, mask, scale: float) -> Softmax:
    """Fold one key block into the online softmax of a query block.

    ``m' = max(m, rowmax(s))``; ``p = exp(s - m')``; ``l' = exp(m - m') l + rowsum(p)``;
    ``o' = exp(m - m') o + p v``: the earlier blocks are rescaled to the new max, so after the last
    block ``o / l`` is the softmax-weighted sum over all keys.

    Args:
      state: the query block's :class:`Softmax`.
      q: grouped queries ``[b, tq, kv_heads, group, d]``.
      k, v: ``[b, tk, kv_heads, d]``.
      mask: ``[b or 1, tq, tk]`` from :func:`allowed`.
      scale: the score scale.
    """
    s = _scores(q, k, mask, scale)
    m = jnp.maximum(state.m, s.max(-1))
    p = jnp.exp(s - m[..., None])
    alpha = jnp.exp(state.m - m)
    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p, v, preferred_element_type=jnp.float32)
    return Softmax(alpha[..., None] * state.o + pv, m, alpha * state.l + p.sum(-1))


def softmax_result(state: Softmax, dtype) -> tuple[jax.Array, jax.Array]:
    """``(out [b, t, heads, d] in dtype, logsumexp [b, kv_heads, group, t] fp32)`` of a finished state."""
    b, hk, g, t, d = state.o.shape
    out = (state.o / state.l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
    return out.astype(dtype), state.m + jnp.log(state.l)


def softmax_grad_step(q, k, v, do, lse, delta, mask, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradient contributions of one (query block, key block) pair (flash attention's backward).

    With ``p = exp(s - lse)`` (the final softmax, recomputed from the forward's logsumexp):
    ``dV = p^T dO``, ``dP = dO V^T``, ``dS = p (dP - delta)`` where ``delta = rowsum(dO * O)``,
    ``dQ = scale dS K`` and ``dK = scale dS^T Q``.

    Args:
      q: grouped queries ``[b, tq, kv_heads, group, d]``.
      k, v: ``[b, tk, kv_heads, d]``.
      do: the output's cotangent, grouped like ``q``.
      lse, delta: ``[b, kv_heads, group, tq]`` fp32.
      mask: ``[b or 1, tq, tk]``.
      scale: the score scale.

    Returns:
      ``(dq like q, dk, dv like k)`` in fp32.
    """
    p = jnp.exp(_scores(q, k, mask, scale) - lse[..., None])
    f32 = jnp.float32
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=f32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q, preferred_element_type=f32)
    return dq, dk, dv
