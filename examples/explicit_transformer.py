"""A small decoder-only transformer written the way JAX's and Flax's current guides write one:
parameters annotated with **mesh-axis** ``PartitionSpec``s (``nnx.with_partitioning(init,
P("fsdp", "tensor"))``), activations pinned with ``out_sharding=P(...)`` on ``jnp.einsum`` and
``nnx.Embed`` under the mesh set by ``jax.set_mesh``, and its blocks as a Python list
(``nnx.List``) whose layers may differ (a per-layer attention window). GQA, RMSNorm and RoPE.

No jaxpar import: this is the user's own model. jaxpar trains it by import path
(``configs/explicit_model.yaml``):

* ``ExplicitTransformer(vocab, embed, heads, kv_heads, mlp, layers, windows=None, *, rngs)``;
* ``loss(model, batch) -> scalar``: next-token cross-entropy;
* ``batches(step, *, batch_size, seed, eval=False, seq_len, vocab)``: a deterministic stream.

The mesh axes it names are jaxpar's: the batch over ``("data", "fsdp")``, weights over
``fsdp`` and ``tensor``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

BATCH = ("data", "fsdp")
_INIT = nnx.initializers.normal(0.02)


def rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x`` [batch, length, ..., dim] at ``positions`` [length]."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]          # [length, half]
    angle = angle.reshape((1, x.shape[1]) + (1,) * (x.ndim - 3) + (half,))
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention with an optional sliding window (``window`` tokens back): the
    query heads are ``kv_heads`` groups of ``heads // kv_heads``, each group reading one K/V head."""

    def __init__(self, embed: int, heads: int, kv_heads: int, window: int | None, *, rngs: nnx.Rngs):
        self.window, self.dim = window, embed // heads
        group = heads // kv_heads
        self.q = nnx.Param(nnx.with_partitioning(_INIT, P("fsdp", "tensor", None, None))(
            rngs.params(), (embed, kv_heads, group, self.dim)))
        kv = nnx.with_partitioning(_INIT, P("fsdp", "tensor", None))
        self.k = nnx.Param(kv(rngs.params(), (embed, kv_heads, self.dim)))
        self.v = nnx.Param(kv(rngs.params(), (embed, kv_heads, self.dim)))
        self.o = nnx.Param(nnx.with_partitioning(_INIT, P("tensor", None, None, "fsdp"))(
            rngs.params(), (kv_heads, group, self.dim, embed)))

    def __call__(self, x: jax.Array) -> jax.Array:
        length = x.shape[1]
        pos = jnp.arange(length)
        grouped, heads = P(BATCH, None, "tensor", None, None), P(BATCH, None, "tensor", None)
        q = rope(jnp.einsum("bld,dngk->blngk", x, self.q[...], out_sharding=grouped), pos)
        k = rope(jnp.einsum("bld,dnk->blnk", x, self.k[...], out_sharding=heads), pos)
        v = jnp.einsum("bld,dnk->blnk", x, self.v[...], out_sharding=heads)
        scores = jnp.einsum("blngk,bmnk->bnglm", q, k, out_sharding=P(BATCH, "tensor", None, None, None))
        mask = pos[:, None] >= pos[None, :]
        if self.window is not None:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        scores = jnp.where(mask, scores / np.sqrt(self.dim), jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bnglm,bmnk->blngk", probs, v, out_sharding=grouped)
        return jnp.einsum("blngk,ngkd->bld", out, self.o[...], out_sharding=P(BATCH, None, None))


class MLP(nnx.Module):
    """A gated (SwiGLU) feed-forward block."""

    def __init__(self, embed: int, mlp: int, *, rngs: nnx.Rngs):
        up = nnx.with_partitioning(_INIT, P("fsdp", "tensor"))
        self.gate = nnx.Param(up(rngs.params(), (embed, mlp)))
        self.up = nnx.Param(up(rngs.params(), (embed, mlp)))
        self.down = nnx.Param(nnx.with_partitioning(_INIT, P("tensor", "fsdp"))(rngs.params(), (mlp, embed)))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = P(BATCH, None, "tensor")
        h = jax.nn.silu(jnp.einsum("bld,dm->blm", x, self.gate[...], out_sharding=hidden))
        h = h * jnp.einsum("bld,dm->blm", x, self.up[...], out_sharding=hidden)
        return jnp.einsum("blm,md->bld", h, self.down[...], out_sharding=P(BATCH, None, None))


class Block(nnx.Module):
    def __init__(self, embed: int, heads: int, kv_heads: int, mlp: int, window: int | None, *, rngs: nnx.Rngs):
        norm = nnx.with_partitioning(nnx.initializers.ones_init(), P(None))
        self.attn_norm = nnx.RMSNorm(embed, scale_init=norm, rngs=rngs)
        self.attn = Attention(embed, heads, kv_heads, window, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(embed, scale_init=norm, rngs=rngs)
        self.mlp = MLP(embed, mlp, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ExplicitTransformer(nnx.Module):
    """Token embedding, ``layers`` blocks in an ``nnx.List``, a final RMSNorm and an untied head.

    Args:
      vocab: vocabulary size.
      embed: model width.
      heads: query heads; ``kv_heads`` divides it (GQA).
      kv_heads: key / value heads.
      mlp: the feed-forward width.
      layers: number of blocks.
      windows: per-layer attention window (``None``: full causal attention), or ``None`` for
        all layers alike.
      rngs: the random keys.
    """

    def __init__(self, vocab: int, embed: int, heads: int, kv_heads: int, mlp: int, layers: int,
                 windows: list | None = None, *, rngs: nnx.Rngs):
        windows = [None] * layers if windows is None else list(windows)
        self.embed = nnx.Embed(vocab, embed, rngs=rngs,
                               embedding_init=nnx.with_partitioning(_INIT, P("tensor", "fsdp")))
        self.blocks = nnx.List([Block(embed, heads, kv_heads, mlp, w, rngs=rngs) for w in windows])
        self.norm = nnx.RMSNorm(embed, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), P(None)),
                                rngs=rngs)
        self.head = nnx.Param(nnx.with_partitioning(_INIT, P("fsdp", "tensor"))(rngs.params(), (embed, vocab)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens, out_sharding=P(BATCH, None, None))
        for block in self.blocks:
            x = block(x)
        return jnp.einsum("bld,dv->blv", self.norm(x), self.head[...], out_sharding=P(BATCH, None, "tensor"))


def loss(model: ExplicitTransformer, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["tokens"]`` [batch, length + 1]."""
    tokens = batch["tokens"]
    logits = jax.sharding.reshard(model(tokens[:, :-1]), P(BATCH, None, None))   # the whole vocabulary per row
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def batches(step: int, *, batch_size: int, seed: int, eval: bool = False, seq_len: int = 16,
            vocab: int = 64) -> dict:
    """A deterministic stream of token windows with a learnable pattern (each token the previous + 1
    or + 2, mod ``vocab``)."""
    rng = np.random.default_rng([seed, step, int(eval)])
    start = rng.integers(0, vocab, (batch_size, 1))
    stride = rng.integers(1, 3, (batch_size, 1))
    return {"tokens": ((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.int32)}
