"""One layer of the Hugging Face-style decoder (:mod:`jaxpar.models._decoder`) as pure functions.

A layer is ``x + attention(norm(x))`` then ``x + mlp(norm(x))`` (Gemma-3 adds a norm on each
half's output before the residual). Its parameters keep the checkpoint's own values and, for the
dense weights, its own orientation (``[out, in]`` reshaped by heads): norms' ``+1``, the query
scale, RoPE and the embedding's √d are applied here, in the forward pass, so that an exported
checkpoint is bit-identical to the one imported.

The carry through the stacked layers is :class:`Carry`: the residual stream with the tokens'
positions (RoPE; they restart per packed document), their segment ids (packed rows: attention
stays within a document) and the layer's index (Gemma-3's sliding-window and global layers differ
by index only, so the layers stay alike and stack). :func:`cached_layer_apply` is the same layer for
new tokens that also attend to a :class:`KVCache` of the earlier ones (decoding).

>>> import jax.numpy as jnp
>>> [round(v, 3) for v in rms_norm(jnp.arange(1.0, 4.0), jnp.zeros(3), eps=0.0, offset=1.0).tolist()]
[0.463, 0.926, 1.389]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.attention import attention, dense_attention
from jaxpar.parallel.moe import moe_apply
from jaxpar.rules import constrain
from jaxpar.parallel._tensor import column_parallel, row_parallel

#: The residual stream's logical names.
RESIDUAL = ("batch", "norm_length", "embed")

#: The MLP activations by their Hugging Face names.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}

_GLOBAL = 1 << 30      # the window of a layer without one: longer than any sequence


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding as Hugging Face computes it.

    Args:
      theta: the base wavelength (``rope_theta``).
      kind: ``"default"``, ``"linear"`` (positions divided by ``factor``) or ``"llama3"``
        (Llama-3.1's frequency-dependent scaling).
      factor, low_freq_factor, high_freq_factor, original_max_positions: the scaling's parameters.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


def rope_frequencies(rope: RoPE, head_dim: int) -> np.ndarray:
    """The inverse frequencies ``[head_dim / 2]`` (fp32), as ``transformers``' RoPE initialisers.

    Args:
      rope: the RoPE settings.
      head_dim: the rotated dimension.

    Returns:
      ``float32[head_dim // 2]``.

    >>> rope_frequencies(RoPE(theta=100.0), 4).tolist()
    [1.0, 0.10000000149011612]
    """
    inv = (1.0 / (np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
    inv = inv.astype(np.float32)
    if rope.kind == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.kind != "llama3":
        return inv
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv).astype(np.float32)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x[batch, length, heads, head_dim]`` by ``positions[batch, length]`` (the halves form:
    ``x * cos + rotate_half(x) * sin``, with cos and sin in ``x``'s dtype, as ``transformers``).

    Args:
      x: ``[batch, length, heads, head_dim]``.
      positions: int ``[batch, length]``.
      inv_freq: ``float32[head_dim // 2]`` (:func:`rope_frequencies`).

    Returns:
      The rotated ``x``, its shape and dtype.
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq          # [b, t, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0) -> jax.Array:
    """RMS norm over the last axis in fp32. ``offset=0``: ``w * n`` in ``x``'s dtype (Llama, Qwen);
    ``offset=1``: ``n * (1 + w)`` in fp32 (Gemma), both returned in ``x``'s dtype.

    Args:
      x: ``[..., features]``.
      weight: ``[features]``.
      eps: added to the mean square.
      offset: ``0.0`` or ``1.0``, as above.

    Returns:
      The normalised ``x``, its shape and dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


class Carry(NamedTuple):
    """What flows through the stacked layers: ``x[batch, length, embed]``, ``positions`` and
    ``segments`` ``[batch, length]`` (int32; ``segments`` ``None``: one document a row), and the
    next layer's ``index``."""

    x: jax.Array
    positions: jax.Array
    segments: Any
    index: jax.Array


class KVCache(NamedTuple):
    """The keys and values of earlier tokens, for decoding one token at a time.

    ``k``, ``v``: ``[layers, batch, size, kv_heads, head_dim]`` (one layer's: without ``layers``). Rows
    are left-padded: slot ``s`` of a row holds its token at position ``s - start[row]``, and the slots
    before ``start`` hold none. ``length``: the slots written; the next tokens go to slots ``length``,
    ``length + 1``, ... (``size`` must leave room for them: a write past the end is clamped by XLA).
    """

    k: jax.Array
    v: jax.Array
    start: jax.Array
    length: jax.Array


def attention_half(cfg: Any, p: dict[str, jax.Array], carry: Carry) -> jax.Array:
    """``x + attention(norm(x))`` for one layer (``cfg``: a :class:`~jaxpar.models.DecoderConfig`).

    Args:
      cfg: the model's config.
      p: one layer's parameters.
      carry: the layer's input.

    Returns:
      The new residual stream ``[batch, length, embed]``.
    """
    q, k, v, window = _queries_keys_values(cfg, p, carry)
    out = attention(q, k, v, causal=True, segment_ids=carry.segments, scale=cfg.query_scale, window=window,
                    softcap=cfg.attn_softcap)
    return _attention_output(cfg, p, carry.x, out)


def cached_attention_half(cfg: Any, p: dict[str, jax.Array], carry: Carry, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """:func:`attention_half` of new tokens that also attend to the earlier ones in ``cache``.

    The new tokens' keys and values are written at slots ``cache.length ...``; the queries attend over
    every slot of their row from ``cache.start`` up to their own (and within Gemma-3's sliding window).

    Args:
      cfg: the model's config.
      p: one layer's parameters.
      carry: the new tokens: ``positions`` their RoPE positions, ``segments`` 1 where a slot holds a
        token of the row, 0 at the left padding.
      cache: this layer's cache (``k`` / ``v`` ``[batch, size, kv_heads, head_dim]``).

    Returns:
      The new residual stream and the cache with the new keys and values written.
    """
    q, k, v, window = _queries_keys_values(cfg, p, carry)
    keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), cache.length, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), cache.length, axis=1)
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
    filled = (slots[None, :] >= cache.start[:, None]).astype(jnp.int32)
    scale = cfg.head_dim ** -0.5 if cfg.query_scale is None else cfg.query_scale
    out = dense_attention(q, keys.astype(q.dtype), values.astype(q.dtype), causal=True, scale=scale,
                          q_seg=carry.segments, k_seg=filled, q_pos=cache.length + jnp.arange(q.shape[1]),
                          k_pos=slots, window=window, softcap=cfg.attn_softcap)
    return _attention_output(cfg, p, carry.x, out), cache._replace(k=keys, v=values)


def _queries_keys_values(cfg: Any, p: dict[str, jax.Array], carry: Carry):
    """The layer's rotated ``q, k, v`` ``[batch, length, heads, head_dim]`` and its sliding window (or None)."""
    norm = _norm(cfg)
    h = constrain(norm(carry.x, p["attn_norm"]), ("batch", "length", "embed"))
    q, k, v = column_parallel(["bte,hde->bthd"] * 3, h, [p["wq"], p["wk"], p["wv"]], ("batch", "length", "embed"),
                              [("heads", "kv", "embed"), ("kv_heads", "kv", "embed"), ("kv_heads", "kv", "embed")],
                              [("batch", "length", "heads", "kv"), *[("batch", "length", "kv_heads", "kv")] * 2])
    if cfg.qk_norm:
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    local = _is_local(cfg, carry.index)
    inv_freq = jnp.asarray(rope_frequencies(cfg.rope, cfg.head_dim))
    if cfg.local_rope is not None:
        inv_freq = jnp.where(local, jnp.asarray(rope_frequencies(cfg.local_rope, cfg.head_dim)), inv_freq)
    q, k = apply_rope(q, carry.positions, inv_freq), apply_rope(k, carry.positions, inv_freq)
    window = None if cfg.sliding_window is None else jnp.where(local, cfg.sliding_window, _GLOBAL)
    return q, k, v, window


def _attention_output(cfg: Any, p: dict[str, jax.Array], x: jax.Array, out: jax.Array) -> jax.Array:
    """``x`` plus the output projection of the attention's ``out`` (and Gemma-3's norm on it)."""
    out = constrain(out, ("batch", "length", "heads", "kv"))
    y = row_parallel("bthd,ehd->bte", out, p["wo"], ("batch", "length", "heads", "kv"), ("embed", "heads", "kv"),
                     RESIDUAL)
    if cfg.sandwich_norms:
        y = _norm(cfg)(y, p["attn_out_norm"])
    return constrain(x + y, RESIDUAL)


def mlp_half(cfg: Any, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """``x + mlp(norm(x))``: the gated MLP ``down(act(gate(h)) * up(h))``, or the routed experts.

    Args:
      cfg: the model's config.
      p: one layer's parameters.
      x: the residual stream ``[batch, length, embed]``.

    Returns:
      The new residual stream, ``x``'s shape.
    """
    norm = _norm(cfg)
    h = constrain(norm(x, p["mlp_norm"]), ("batch", "length", "embed"))
    if cfg.moe is not None:
        experts = {"router": p["router"], "w1": p["experts_gate"], "w3": p["experts_up"], "w2": p["experts_down"]}
        y, _ = moe_apply(experts, h, top_k=cfg.moe.top_k, capacity_factor=cfg.moe.capacity_factor,
                         normalize=cfg.moe.normalize, activation=cfg.activation)
        y = constrain(y.astype(x.dtype), RESIDUAL)
    else:
        act = ACTIVATIONS[cfg.activation]
        gate, up = column_parallel(["bte,me->btm"] * 2, h, [p["w_gate"], p["w_up"]], ("batch", "length", "embed"),
                                   [("mlp", "embed")] * 2, [("batch", "length", "mlp")] * 2)
        h = constrain(act(gate) * up, ("batch", "length", "mlp"))
        y = row_parallel("btm,em->bte", h, p["w_down"], ("batch", "length", "mlp"), ("embed", "mlp"), RESIDUAL)
    if cfg.sandwich_norms:
        y = norm(y, p["mlp_out_norm"])
    return constrain(x + y, RESIDUAL)


def layer_apply(cfg: Any, p: dict[str, jax.Array], carry: Carry) -> Carry:
    """One decoder layer on ``carry``: its parameters ``p`` have no ``layers`` axis.

    Args:
      cfg: the model's config (a :class:`~jaxpar.models.DecoderConfig`).
      p: the layer's parameters.
      carry: the layer's input.

    Returns:
      The carry for the next layer (``index`` advanced).
    """
    x = mlp_half(cfg, p, attention_half(cfg, p, carry))
    return carry._replace(x=x, index=carry.index + 1)


def cached_layer_apply(cfg: Any, p: dict[str, jax.Array], carry: Carry, cache: KVCache) -> tuple[Carry, KVCache]:
    """:func:`layer_apply` of new tokens with this layer's ``cache`` (:func:`cached_attention_half`).

    Args:
      cfg: the model's config.
      p: the layer's parameters.
      carry: the new tokens' input.
      cache: this layer's cache (no ``layers`` axis).

    Returns:
      The carry for the next layer and this layer's cache with the new keys and values.
    """
    x, cache = cached_attention_half(cfg, p, carry, cache)
    return carry._replace(x=mlp_half(cfg, p, x), index=carry.index + 1), cache


def _norm(cfg: Any):
    return lambda x, w: rms_norm(x, w, eps=cfg.norm_eps, offset=cfg.norm_offset)


def _is_local(cfg: Any, index: jax.Array) -> jax.Array:
    """Whether layer ``index`` is a sliding-window layer (Gemma-3's ``layer_types``)."""
    kinds = cfg.layer_types or ("full_attention",) * cfg.layers
    return jnp.asarray([kind == "sliding_attention" for kind in kinds])[index]
