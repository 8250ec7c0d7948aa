"""The GPT's layers as pure functions of one layer's parameters, and their stacked parameters.

:class:`Blocks` holds ``layers`` decoder blocks stacked on a leading ``layers`` axis;
:func:`block_apply` runs one: :func:`attention_apply` then :func:`mlp_apply` (pre-norm, residual).
The MoE variant (:mod:`jaxpar.models._gpt_moe`) reuses :func:`attention_apply` and swaps the MLP.

>>> import jax.numpy as jnp
>>> p = {"ln1_scale": jnp.ones(4), "ln1_bias": jnp.zeros(4)}
>>> [round(v, 2) for v in layer_norm(jnp.arange(4.0), p["ln1_scale"], p["ln1_bias"]).tolist()]
[-1.34, -0.45, 0.45, 1.34]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.attention import attention
from jaxpar.rules import constrain
from jaxpar.parallel._tensor import row_parallel


def param(key, shape, logical, std):
    """An ``nnx.Param`` of ``std``-scaled normal values (ones when ``std`` is 0) with logical names.

    Args:
      key: a PRNG key.
      shape: the shape.
      logical: one logical axis name per dimension.
      std: the standard deviation, or 0 (ones).

    Returns:
      The fp32 ``nnx.Param``.
    """
    value = std * jax.random.normal(key, shape, jnp.float32) if std else jnp.ones(shape, jnp.float32)
    return nnx.Param(value, out_sharding=logical)


def zeros(shape, logical):
    """An ``nnx.Param`` of zeros with logical names.

    Args:
      shape: the shape.
      logical: one logical axis name per dimension.

    Returns:
      The fp32 ``nnx.Param``.
    """
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=logical)


#: Logical names of one block's parameters (the stacked arrays add a leading ``layers``).
BLOCK_LOGICAL = {
    "ln1_scale": ("embed",), "ln1_bias": ("embed",),
    "wq": ("embed", "heads", "kv"), "wk": ("embed", "heads", "kv"), "wv": ("embed", "heads", "kv"),
    "wo": ("heads", "kv", "embed"),
    "ln2_scale": ("embed",), "ln2_bias": ("embed",),
    "w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed"), "b2": ("embed",),
}


class Blocks(nnx.Module):
    """``layers`` decoder blocks, parameters stacked on a leading ``layers`` axis."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        L, E, H, D, M = cfg.layers, cfg.embed, cfg.heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * L) ** 0.5
        self.ln1_scale = param(None, (L, E), ("layers", "embed"), 0)
        self.ln1_bias = zeros((L, E), ("layers", "embed"))
        self.wq = param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wk = param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wv = param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wo = param(rngs.params(), (L, H, D, E), ("layers", "heads", "kv", "embed"), out_std)
        self.ln2_scale = param(None, (L, E), ("layers", "embed"), 0)
        self.ln2_bias = zeros((L, E), ("layers", "embed"))
        self.w1 = param(rngs.params(), (L, E, M), ("layers", "embed", "mlp"), std)
        self.b1 = zeros((L, M), ("layers", "mlp"))
        self.w2 = param(rngs.params(), (L, M, E), ("layers", "mlp", "embed"), out_std)
        self.b2 = zeros((L, E), ("layers", "embed"))


def layer_norm(x, scale, bias, eps=1e-5):
    """Layer norm over the last axis in fp32, returned in ``x``'s dtype.

    Args:
      x: ``[..., features]``.
      scale, bias: ``[features]``.
      eps: added to the variance.

    Returns:
      The normalised ``x``, its shape and dtype.
    """
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def block_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One pre-norm decoder block on ``x`` of shape ``(batch, length, embed)``.

    ``p`` maps the names of :class:`Blocks` to one layer's arrays (no ``layers``
    axis). Megatron pairing: q/k/v and ``w1`` are column-parallel (``heads`` /
    ``mlp`` sharded), ``wo`` and ``w2`` row-parallel: one reduction per pair.

    Args:
      p: one layer's parameters.
      x: ``[batch, length, embed]``.

    Returns:
      The block's output, ``x``'s shape.
    """
    return mlp_apply(p, attention_apply(p, x))


#: The residual stream's logical names.
RESIDUAL = ("batch", "norm_length", "embed")


def attention_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The attention half of a block: ``x + attention(ln1(x))`` (``ln1_*``, ``wq``, ``wk``, ``wv``, ``wo``).

    Args:
      p: one layer's parameters.
      x: ``[batch, length, embed]``.

    Returns:
      The new residual stream, ``x``'s shape.
    """
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    h = constrain(h, ("batch", "length", "embed"))
    q = constrain(jnp.einsum("bte,ehd->bthd", h, p["wq"]), ("batch", "length", "heads", "kv"))
    k = constrain(jnp.einsum("bte,ehd->bthd", h, p["wk"]), ("batch", "length", "heads", "kv"))
    v = constrain(jnp.einsum("bte,ehd->bthd", h, p["wv"]), ("batch", "length", "heads", "kv"))
    attn = constrain(attention(q, k, v, causal=True), ("batch", "length", "heads", "kv"))   # context parallel
    return x + row_parallel("bthd,hde->bte", attn, p["wo"], ("batch", "length", "heads", "kv"),
                            ("heads", "kv", "embed"), RESIDUAL)


def mlp_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The MLP half of a block: ``x + mlp(ln2(x))`` (``ln2_*``, ``w1``, ``b1``, ``w2``, ``b2``).

    Args:
      p: one layer's parameters.
      x: ``[batch, length, embed]``.

    Returns:
      The new residual stream, ``x``'s shape.
    """
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    h = constrain(h, ("batch", "length", "embed"))
    h = jax.nn.gelu(constrain(jnp.einsum("bte,em->btm", h, p["w1"]) + p["b1"], ("batch", "length", "mlp")))
    x = x + row_parallel("btm,me->bte", h, p["w2"], ("batch", "length", "mlp"), ("mlp", "embed"), RESIDUAL) + p["b2"]
    return constrain(x, RESIDUAL)
