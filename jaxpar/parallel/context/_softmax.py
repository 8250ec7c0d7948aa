"""The attention arithmetic that whole-sequence attention (:func:`jaxpar.attention.dense_attention`) and the
ring (:mod:`jaxpar.parallel.context._ring`) share: masks from true positions and segment ids, the window and
soft-cap checks, soft-capped scores, and the per-block steps of the online softmax (forward) and of its
gradient (backward) that the ring runs.

Layouts: activations are ``[batch, length, heads, head_dim]``; with GQA, query head ``h`` uses K/V
head ``h // (heads // kv_heads)`` (as ``jnp.repeat(k, heads // kv_heads, axis=2)``, and as
``jax.nn.dot_product_attention``). The block steps hold queries grouped as
``[batch, length, kv_heads, group, head_dim]`` and their statistics as
``[batch, kv_heads, group, length]``, in fp32.

A token ``q`` may attend to a token ``k`` when ``segment[q] == segment[k]`` (packed sequences),
with a causal mask when ``position[k] <= position[q]``, and with a sliding ``window`` (Mistral,
Gemma-2/3) when ``position[q] - position[k] < window`` (without a causal mask also
``position[k] - position[q] < window``: a window on both sides). ``window`` is a Python int or an
int32 scalar array (traced: a per-layer window under ``lax.scan``). Every token attends to itself
(``window >= 1``), so no row of a mask is empty. With a ``softcap`` (Gemma-2's
``attn_logit_softcapping``) the scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)``
before the mask and the softmax.

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


#: The score of a masked entry: finite, so that a row whose block is wholly masked gives no NaN
#: (its running max is corrected away by the first unmasked block, as in jax's flash attention).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def allowed(q_pos: Any, k_pos: Any, q_seg: Any, k_seg: Any, *, causal: bool, window: Any = None) -> jnp.ndarray:
    """Which (query, key) pairs may attend: a bool array ``[batch or 1, len(q_pos), len(k_pos)]``.

    Args:
      q_pos, k_pos: the true positions of the queries and keys.
      q_seg, k_seg: ``[batch, length]`` segment ids of the queries and keys, or both ``None``.
      causal: keys after the query are masked.
      window: the sliding window (an int or an int scalar array), or ``None``: keys ``window`` or
        more positions before the query are masked (and, without ``causal``, as far after it).

    Returns:
      The mask, true where the pair may attend.
    """
    mask = jnp.ones((1, len(q_pos), len(k_pos)), bool)
    if causal:
        mask = mask & (jnp.asarray(q_pos)[:, None] >= jnp.asarray(k_pos)[None, :])[None]
    if window is not None:
        gap = jnp.asarray(q_pos, jnp.int32)[:, None] - jnp.asarray(k_pos, jnp.int32)[None, :]
        mask = mask & ((gap if causal else jnp.abs(gap)) < window)[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask


def check_window(window: Any, error: type = ValueError, what: str = "attention") -> Any:
    """``window`` checked: ``None``, a Python int >= 1, or an int32 scalar array (a traced one is not
    checked for its value).

    Args:
      window: the sliding window given by the user.
      error: the exception class to raise.
      what: the function named in the message.

    Returns:
      ``None``, an ``int`` or an int32 ``jax.Array`` of shape ``()``.

    >>> check_window(np.int64(4)), check_window(None)
    (4, None)
    """
    if window is None:
        return None
    if isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_)):
        if window < 1:
            raise error(f"{what}: window={window} is not a positive int; a query attends to the keys less than "
                        "window positions before it, itself included. Fix: window >= 1 (or None: no window).")
        return int(window)
    dtype, shape = getattr(window, "dtype", None), getattr(window, "shape", None)
    if dtype is None or shape != () or not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        got = f"{type(window).__name__} {window!r}" if dtype is None else f"{dtype}{list(shape)} array"
        raise error(f"{what}: window must be a positive int or an int scalar array (e.g. jnp.int32(512), traced "
                    f"per layer); got {got}. Fix: pass an int, an int32 array of shape (), or None.")
    if not isinstance(window, jax.core.Tracer) and int(window) < 1:
        raise error(f"{what}: window={int(window)} is not positive. Fix: window >= 1 (or None: no window).")
    return jnp.asarray(window, jnp.int32)


def check_softcap(softcap: Any, error: type = ValueError, what: str = "attention") -> float | None:
    """``softcap`` checked: ``None`` or a finite Python number > 0 (returned as a ``float``).

    Args:
      softcap: the value to check.
      error: the exception class raised.
      what: the caller, for the error message.

    Returns:
      ``float(softcap)``, or ``None``.

    >>> check_softcap(50), check_softcap(None)
    (50.0, None)
    """
    if softcap is None:
        return None
    number = isinstance(softcap, (int, float, np.integer, np.floating)) and not isinstance(softcap, (bool, np.bool_))
    if not number or not np.isfinite(softcap) or softcap <= 0:
        raise error(f"{what}: softcap={softcap!r} ({type(softcap).__name__}); the logit soft-cap must be a finite "
                    "Python number > 0 (scores become softcap * tanh(scores / softcap), e.g. Gemma-2's 50.0). "
                    "Fix: a positive float, or None for no cap.")
    return float(softcap)


def capped_attention(q, k, v, mask, scale: float, softcap: float) -> jax.Array:
    """Soft-capped attention: ``softmax(where(mask, softcap tanh(scale q.k / softcap), MASK_VALUE)) v``,
    scores and softmax in fp32 (GQA: query head ``h`` uses K/V head ``h // (heads // kv_heads)``).

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, k_length, kv_heads, head_dim]``.
      mask: ``[batch or 1, q_length, k_length]`` from :func:`allowed`.
      scale: the score scale.
      softcap: the logit soft-cap.

    Returns:
      ``[batch, q_length, heads, head_dim]`` in ``q``'s dtype.
    """
    b, t, h, d = q.shape
    p = jax.nn.softmax(_scores(group_heads(q, k.shape[2]), k, mask, scale, softcap), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def group_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, t, heads, d]`` -> ``[b, t, kv_heads, heads // kv_heads, d]`` (query head ``h`` -> K/V head
    ``h // group``).

    Args:
      q: queries ``[b, t, heads, d]``, ``heads`` a multiple of ``kv_heads``.
      kv_heads: the K/V heads.

    Returns:
      The grouped queries.
    """
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


class Softmax(NamedTuple):
    """The running state of one query block's online softmax (fp32): the unnormalised output
    ``o`` ``[b, kv_heads, group, t, d]``, the row max ``m`` and the row sum ``l`` ``[b, kv_heads, group, t]``."""

    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741 - the usual name of the softmax denominator


def empty_softmax(q: jax.Array) -> Softmax:
    """The state before any key block, for grouped queries ``q`` ``[b, t, kv_heads, group, d]``.

    Args:
      q: the grouped queries.

    Returns:
      The :class:`Softmax`: ``o`` and ``l`` zero, ``m`` the mask value.
    """
    b, t, hk, g, d = q.shape
    m = jnp.full((b, hk, g, t), MASK_VALUE, jnp.float32)
    return Softmax(jnp.zeros((b, hk, g, t, d), jnp.float32), m, jnp.zeros_like(m))


def _logits(q, k, scale: float, softcap: float | None) -> tuple[jax.Array, Any]:
    """The scores ``[b, kv_heads, group, tq, tk]`` (fp32, soft-capped with ``softcap``) and, with a
    cap, ``tanh(raw / softcap)`` (the backward's ``d capped / d raw = 1 - tanh^2``), else ``None``."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is None:
        return s, None
    tanh = jnp.tanh(s / softcap)
    return softcap * tanh, tanh


def _scores(q, k, mask, scale, softcap: float | None = None) -> jax.Array:
    return jnp.where(mask[:, None, None], _logits(q, k, scale, softcap)[0], MASK_VALUE)


def softmax_step(state: Softmax, q, k, v, mask, scale: float, softcap: float | None = None) -> Softmax:
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
      softcap: the logit soft-cap, or ``None``.

    Returns:
      The updated :class:`Softmax`.
    """
    s = _scores(q, k, mask, scale, softcap)
    m = jnp.maximum(state.m, s.max(-1))
    p = jnp.exp(s - m[..., None])
    alpha = jnp.exp(state.m - m)
    pv = jnp.einsum("bhgqk,bkhd->bhgqd", p, v, preferred_element_type=jnp.float32)
    return Softmax(alpha[..., None] * state.o + pv, m, alpha * state.l + p.sum(-1))


def softmax_result(state: Softmax, dtype) -> tuple[jax.Array, jax.Array]:
    """``(out [b, t, heads, d] in dtype, logsumexp [b, kv_heads, group, t] fp32)`` of a finished state.

    Args:
      state: the :class:`Softmax` after the last key block.
      dtype: the output's dtype.

    Returns:
      The output and the logsumexp of the (scaled, capped) scores.
    """
    b, hk, g, t, d = state.o.shape
    out = (state.o / state.l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
    return out.astype(dtype), state.m + jnp.log(state.l)


def softmax_grad_step(q, k, v, do, lse, delta, mask, scale: float,
                      softcap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradient contributions of one (query block, key block) pair (flash attention's backward).

    With ``p = exp(s - lse)`` (the final softmax, recomputed from the forward's logsumexp):
    ``dV = p^T dO``, ``dP = dO V^T``, ``dS = p (dP - delta)`` where ``delta = rowsum(dO * O)``,
    ``dQ = scale dS K`` and ``dK = scale dS^T Q``. With a soft-cap ``s = c tanh(raw / c)``, ``dS``
    is taken through it: ``dRaw = dS (1 - tanh^2)``.

    Args:
      q: grouped queries ``[b, tq, kv_heads, group, d]``.
      k, v: ``[b, tk, kv_heads, d]``.
      do: the output's cotangent, grouped like ``q``.
      lse, delta: ``[b, kv_heads, group, tq]`` fp32.
      mask: ``[b or 1, tq, tk]``.
      scale: the score scale.
      softcap: the logit soft-cap, or ``None``.

    Returns:
      ``(dq like q, dk, dv like k)`` in fp32.
    """
    s, tanh = _logits(q, k, scale, softcap)
    p = jnp.exp(jnp.where(mask[:, None, None], s, MASK_VALUE) - lse[..., None])
    f32 = jnp.float32
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v, preferred_element_type=f32)
    if tanh is None:
        ds = p * (dp - delta[..., None]) * scale
    else:
        ds = p * (dp - delta[..., None]) * (1 - tanh * tanh) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=f32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q, preferred_element_type=f32)
    return dq, dk, dv
