"""A small Gemma-like decoder written the way Flax's NNX Gemma example (``google/flax``,
``examples/gemma``) writes its model: a ``ShardingConfig`` of mesh-axis ``PartitionSpec`` s with
its own axis names (``fsdp`` and a tensor-parallel name), parameters sharded through
``kernel_metadata={"out_sharding": ...}``, activations pinned with ``out_sharding=`` on
``nnx.Einsum`` / ``nnx.Linear`` / ``nnx.Embed`` calls, the batch of every activation on ``fsdp``
alone. GQA, RoPE at the positions the loss derives from the tokens, sliding-window and global
layers in a repeating pattern, ``nnx.List`` blocks, a tied embedding.

No jaxpar import: this is a user's own model, trained by import path (``configs/gemma_style.yaml``,
``docs/models.md``):

* ``GemmaStyle(config, *, rngs)`` with ``TransformerConfig`` and ``ShardingConfig.fsdp_tp_sharding``;
* ``loss(model, batch) -> scalar``: next-token cross-entropy over the non-padding tokens;
* ``batches(step, *, batch_size, seed, eval=False, seq_len, vocab)``: a deterministic stream.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

K_MASK = -2.3819763e38


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Mesh-axis specs of the weights (``*_weight_*``, ``emb_vd``) and activations (``act_*``; b:
    batch, t: time, d: model, f: feed-forward, n: heads, k: kv heads, h: head dim, c: k/v)."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_cbtkh: P | None = None

    @staticmethod
    def no_sharding() -> "ShardingConfig":
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(fsdp_axis_name: str = "fsdp", tensor_parallel_axis_name: str = "tp") -> "ShardingConfig":
        fsdp, tp = fsdp_axis_name, tensor_parallel_axis_name
        return ShardingConfig(
            emb_vd=P(tp, fsdp), q_weight_ndh=P(tp, fsdp, None), kv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp), ffw_weight_df=P(fsdp, tp), ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(tp), act_btd=P(fsdp, None, tp), act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None), act_cbtkh=P(None, fsdp, None, tp, None))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 64
    embed_dim: int = 32
    hidden_dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    num_layers: int = 4
    attention_pattern: tuple = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
    sliding_window_size: int = 4
    shd_config: ShardingConfig = ShardingConfig.no_sharding()

    def attention_types(self) -> list[AttentionType]:
        return [self.attention_pattern[i % len(self.attention_pattern)] for i in range(self.num_layers)]


def _meta(spec: P | None) -> dict:
    return {} if spec is None else {"out_sharding": spec}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, spec: P | None, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)), **_meta(spec))

    def __call__(self, x: jax.Array) -> jax.Array:
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


def apply_rope(x: jax.Array, positions: jax.Array, max_wavelength: int = 10_000) -> jax.Array:
    """Rotary embedding of ``x`` [b, t, n, h] at ``positions`` [b, t]."""
    half = x.shape[-1] // 2
    timescale = max_wavelength ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angle = (positions[..., None] / timescale)[..., None, :]              # [b, t, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        shd, init = cfg.shd_config, nnx.initializers.normal(0.05)
        self.shd, self.attn_type, self.window = shd, attn_type, cfg.sliding_window_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (cfg.num_heads, cfg.embed_dim, cfg.head_dim),
                                   kernel_init=init, kernel_metadata=_meta(shd.q_weight_ndh), rngs=rngs)
        self.kv_einsum = nnx.Einsum("BTD,CKDH->CBTKH", (2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim),
                                    kernel_init=init, kernel_metadata=_meta(shd.kv_weight_cndh), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (cfg.num_heads, cfg.head_dim, cfg.embed_dim),
                                          kernel_init=init, kernel_metadata=_meta(shd.o_weight_nhd), rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attn_mask: jax.Array) -> jax.Array:
        q = self.q_einsum(x, out_sharding=self.shd.act_btnh)
        k, v = self.kv_einsum(x, out_sharding=self.shd.act_cbtkh)
        q = apply_rope(q, positions) * self.head_dim ** -0.5
        k = apply_rope(k, positions)
        b, t, _, h = q.shape
        groups = self.num_heads // self.num_kv_heads
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape((b, t, self.num_kv_heads, groups, h)), k)
        logits = logits.reshape((b, t, self.num_heads, -1))
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            attn_mask = attn_mask * jnp.triu(ones, 1 - self.window) * jnp.tril(ones, self.window - 1)
        probs = jax.nn.softmax(jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK), axis=-1)
        probs = probs.reshape((b, t, self.num_kv_heads, groups, -1))
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape((b, t, self.num_heads, h))
        return self.attn_vec_einsum(encoded, out_sharding=self.shd.act_btd)


class FeedForward(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        shd, init = cfg.shd_config, nnx.initializers.normal(0.05)
        self.shd = shd
        linear = lambda i, o, spec: nnx.Linear(i, o, use_bias=False, kernel_init=init,  # noqa: E731
                                               kernel_metadata=_meta(spec), rngs=rngs)
        self.gate_proj = linear(cfg.embed_dim, cfg.hidden_dim, shd.ffw_weight_df)
        self.up_proj = linear(cfg.embed_dim, cfg.hidden_dim, shd.ffw_weight_df)
        self.down_proj = linear(cfg.hidden_dim, cfg.embed_dim, shd.ffw_weight_fd)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = nnx.gelu(self.gate_proj(x, out_sharding=self.shd.act_btf))
        hidden = gate * self.up_proj(x, out_sharding=self.shd.act_btf)
        return self.down_proj(hidden, out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        norm = cfg.shd_config.rms_norm_weight
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, norm, rngs=rngs)
        self.attn = Attention(cfg, attn_type, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(cfg.embed_dim, norm, rngs=rngs)
        self.mlp = FeedForward(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attn_mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.pre_attention_norm(x), positions, attn_mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaStyle(nnx.Module):
    """Embedding (tied with the output), ``num_layers`` blocks in an ``nnx.List``, a final norm."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        shd = config.shd_config
        self.shd = shd
        self.embedder = nnx.Embed(config.vocab, config.embed_dim, embedding_init=nnx.initializers.normal(0.05),
                                  embedding_metadata=_meta(shd.emb_vd), rngs=rngs)
        self.layers = nnx.List([Block(config, kind, rngs=rngs) for kind in config.attention_types()])
        self.final_norm = RMSNorm(config.embed_dim, shd.rms_norm_weight, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, attn_mask: jax.Array) -> jax.Array:
        x = self.embedder(tokens, out_sharding=self.shd.act_btd) * jnp.sqrt(self.embedder.features)
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        return self.embedder.attend(self.final_norm(x), out_sharding=self.shd.act_btd)


def loss(model: GemmaStyle, batch: dict) -> jax.Array:
    """Next-token cross-entropy of ``batch["tokens"]`` [b, t + 1], weighted by ``batch["loss_weights"]``
    [b, t] (the non-padding targets, scaled over the global batch so that the mean is the global
    batch's mean over its real targets under any micro-batch split). Positions and the causal mask
    come from the padding (token 0), as the example's trainer builds them."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    input_mask = inputs != 0
    positions = jnp.cumsum(input_mask, axis=-1) - 1
    t = inputs.shape[1]
    attn_mask = input_mask[:, None, :] & jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))[None]
    logits = model(inputs, positions, attn_mask)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logp, axis=-1)   # as the example's trainer
    return jnp.mean(nll * batch["loss_weights"])


def batches(step: int, *, batch_size: int, seed: int, eval: bool = False, seq_len: int = 16,
            vocab: int = 64) -> dict:
    """Token windows with a learnable pattern (each token the previous + 1 or + 2, in 1..vocab-1),
    some rows ending in padding (0) so that the mask and positions matter; ``loss_weights``: the
    real targets, scaled by ``b * t / their count``."""
    rng = np.random.default_rng([seed, step, int(eval)])
    start = rng.integers(1, vocab, (batch_size, 1))
    stride = rng.integers(1, 3, (batch_size, 1))
    tokens = 1 + (start + stride * np.arange(seq_len + 1)) % (vocab - 1)
    length = rng.integers(seq_len // 2, seq_len + 2, (batch_size, 1))
    tokens = np.where(np.arange(seq_len + 1) < length, tokens, 0).astype(np.int32)
    real = (tokens[:, 1:] != 0).astype(np.float32)
    return {"tokens": tokens, "loss_weights": real * np.float32(real.size / real.sum())}
