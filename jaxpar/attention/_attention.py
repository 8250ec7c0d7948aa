"""``attention(q, k, v)``: one attention function for every strategy, context parallel or not, and the
whole-sequence attention it runs on a device.

Without a ``context`` axis of size > 1 (no :func:`jaxpar.use_rules`, or no such axis) it is
:func:`dense_attention`: ``jax.nn.dot_product_attention``, or a fused kernel where
:func:`jaxpar.attention.use_attention_kernel` and the call allow (:mod:`jaxpar.attention._kernels`). Under
one it is context parallel (:func:`jaxpar.parallel.context.context_attention`): the ``ring``, ``all_gather``
or ``ulysses`` method of :func:`jaxpar.parallel.context.use_context_parallel` on the sequence's shards.

**Masks.** ``causal`` masks by true position (also in the balanced layout). ``segment_ids``
(``[batch, length]`` ints) packs sequences into one row: a token attends only to its own id; give
padding an id of its own (padding then attends to padding: no NaN) and mask it in the loss.
``window`` (sliding window; a Python int or a traced int32 scalar) masks keys ``window`` or more
positions away. ``softcap`` caps the scores to ``softcap * tanh(s / softcap)`` before the mask
(whole-sequence methods then use :func:`jaxpar.parallel.context._softmax.capped_attention`).

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.parallel.context import use_context_parallel
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> attention(q, k, v).shape                 # no rules: one device
    (1, 8, 2, 4)
    >>> mesh = jaxpar.make_mesh({"context": 2}, devices=jax.devices()[:2])
    >>> rules = (("batch", None), ("length", "context"), ("heads", None))
    >>> with jaxpar.use_rules(mesh, rules), use_context_parallel("all_gather"):
    ...     y = jax.jit(attention)(q, k, v)
    >>> bool(jnp.allclose(y, 1.0))
    True
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.attention._kernels import context_kernel, fused_attention, kernel_for
from jaxpar.errors import AttentionError
from jaxpar.parallel.context import (allowed, capped_attention, check_softcap, check_window, context_attention,
                                     context_size)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: jax.Array | None = None,
              scale: float | None = None, window: int | jax.Array | None = None,
              softcap: float | None = None) -> jax.Array:
    """Multi-head (or grouped-query) self-attention, context parallel under a ``context`` mesh axis.

    Args:
      q: queries ``[batch, length, heads, head_dim]``.
      k, v: keys and values ``[batch, length, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``
        (query head ``h`` uses K/V head ``h // (heads // kv_heads)``).
      causal: mask the keys after each query.
      segment_ids: ``[batch, length]`` integer ids of packed sequences (see the module), or ``None``.
      scale: the score scale, ``head_dim ** -0.5`` by default.
      window: the sliding window: query position ``p`` attends to key positions ``> p - window``
        (without ``causal`` also ``< p + window``): a Python int >= 1, or an int32 scalar array,
        which may be traced; or ``None``.
      softcap: the logit soft-cap (a Python number > 0; scores become ``softcap * tanh(s / softcap)``),
        or ``None``.

    Returns:
      ``[batch, length, heads, head_dim]``, sharded like ``q``.

    Raises:
      AttentionError: the shapes do not fit together, or a bad ``window`` or ``softcap``.
      ContextParallelError: the sequence, the heads or the rules do not fit the context axis.
    """
    _check_inputs(q, k, v, segment_ids)
    window, softcap = check_window(window, AttentionError), check_softcap(softcap, AttentionError)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if context_size() > 1:
        return context_attention(dense_attention, q, k, v, segment_ids, causal=causal, scale=scale, window=window,
                                 softcap=softcap, block_kernel=context_kernel)
    wide = isinstance(window, int) and window >= q.shape[1]     # wider than the sequence: no window
    return dense_attention(q, k, v, causal=causal, scale=scale, q_seg=segment_ids, k_seg=segment_ids,
                           window=None if wide else window, softcap=softcap)


def _check_inputs(q, k, v, segment_ids) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise AttentionError(f"attention: q, k and v must be [batch, length, heads, head_dim] with k and v alike; "
                             f"got {shapes}.")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise AttentionError(f"attention: q and k/v must share batch, length and head_dim (self-attention); "
                             f"got {shapes}.")
    if q.shape[2] % k.shape[2]:
        raise AttentionError(f"attention: the {k.shape[2]} K/V heads must divide the {q.shape[2]} query heads "
                             f"(grouped-query attention); got {shapes}.")
    if segment_ids is not None and (tuple(segment_ids.shape) != tuple(q.shape[:2])
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise AttentionError(f"attention: segment_ids must be integers of shape [batch, length] = {tuple(q.shape[:2])};"
                             f" got {segment_ids.dtype}{list(segment_ids.shape)}.")


def dense_attention(q, k, v, *, causal: bool, scale: float, q_seg=None, k_seg=None, q_pos=None,
                    k_pos=None, window: int | jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Attention of all of ``q`` to all of ``k``/``v``.

    A fused kernel runs it where :func:`jaxpar.attention.use_attention_kernel` and the call allow
    (:mod:`jaxpar.attention._kernels`: cuDNN or Pallas on a GPU); otherwise XLA's path, as follows.
    Without positions, window or softcap the tokens are in their natural order and it is
    ``jax.nn.dot_product_attention`` with its own causal mask (``is_causal``, which cuDNN's flash
    attention supports where JAX selects it); segment ids add a mask. With positions (a permuted or
    partial sequence) or a window the whole mask is built from the positions (``arange`` by
    default). ``jax.nn.dot_product_attention`` has no soft-cap, so with ``softcap`` the scores are
    computed here in fp32 (:func:`jaxpar.parallel.context._softmax.capped_attention`).

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, k_length, kv_heads, head_dim]``.
      causal: the causal mask.
      scale: the score scale.
      q_seg, k_seg: ``[batch, length]`` segment ids, or ``None``.
      q_pos, k_pos: true positions, or ``None`` for ``arange``.
      window: the sliding window (int or int scalar array), or ``None``.
      softcap: the logit soft-cap, or ``None``.

    Returns:
      ``[batch, q_length, heads, head_dim]``.
    """
    blockwise = q_pos is not None or k.shape[1] != q.shape[1] or q_seg is not k_seg
    kernel = kernel_for(q, k, causal=causal, segments=q_seg is not None, positions=blockwise, window=window,
                        softcap=softcap)
    if kernel != "xla":
        return fused_attention(kernel, q, k, v, causal=causal, scale=scale, segment_ids=q_seg, window=window,
                               softcap=softcap)
    with jax.softmax_custom_jvp(True):    # the backward keeps the probabilities only, not exp() beside them
        return _xla_attention(q, k, v, causal, scale, q_seg, k_seg, q_pos, k_pos, window, softcap)


def _xla_attention(q, k, v, causal, scale, q_seg, k_seg, q_pos, k_pos, window, softcap) -> jax.Array:
    """:func:`dense_attention` on XLA's path."""
    if q_pos is None and window is None and softcap is None:
        mask = None if q_seg is None else (q_seg[:, :, None] == k_seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal)
    if q_pos is None:
        q_pos, k_pos = np.arange(q.shape[1]), np.arange(k.shape[1])
    mask = allowed(q_pos, k_pos, q_seg, k_seg, causal=causal, window=window)
    if softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)
    return capped_attention(q, k, v, mask, scale, softcap)
