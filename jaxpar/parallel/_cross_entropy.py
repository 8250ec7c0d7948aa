"""The cross-entropy of logits whose vocabulary may be split over ``tensor`` (:func:`cross_entropy`: the target
logits picked by a one-hot product, one all-reduce over the vocabulary, where the vocabulary is split; by a gather
where it is whole), and the loss of the head's logits in pieces of the vocabulary (:func:`linear_cross_entropy`: a
running log-sum-exp forward and a custom VJP that recomputes each piece, so no ``[batch, length, vocab]`` array is
made).

Example::

    >>> import jax.numpy as jnp
    >>> logits, targets = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]])), jnp.array([[0]])
    >>> round(float(cross_entropy(logits, targets)), 4)
    0.6931
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from jaxpar.errors import BatchError, RulesError, check_int
from jaxpar.rules import axes_of, constrain, current_rules, logical_to_spec, manual_axes


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
