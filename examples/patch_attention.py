"""Bring your own model: a small vision transformer written with plain Flax NNX layers.

Nothing here is jaxpar-specific except one call: the repeated blocks are stacked with
``nnx.vmap`` (a leading ``layers`` axis) and run with :func:`jaxpar.scan_blocks`. The
parameters carry logical names through ``nnx.with_partitioning``; jaxpar's rules map them
onto the mesh. With that, the model trains under every strategy (DP, ZeRO-1/2/3, FSDP,
tensor parallelism, pipelines) with its own loss, from Python or from a YAML config
(``configs/byo_model.yaml``).

* ``PatchAttentionNet``: a convolutional patch stem, ``layers`` pre-norm blocks of
  ``nnx.MultiHeadAttention`` + MLP, a mean-pooled ``nnx.Linear`` classifier head.
* ``loss(model, batch)``: mean softmax cross-entropy; ``batch = {"images": f32[B, H, W, C], "labels": i32[B]}``.
* ``batches(step, *, batch_size, seed, eval=False)``: a synthetic, learnable task (the label is
  the class template an image is closest to), the same batch for the same step.

Example::

    >>> with nnx.use_eager_sharding(False):   # jaxpar places the state itself; no mesh needed here
    ...     model = PatchAttentionNet(layers=2, rngs=nnx.Rngs(0))
    >>> batch = batches(0, batch_size=4, seed=0)
    >>> model(batch["images"]).shape
    (4, 5)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpar

__all__ = ["Block", "PatchAttentionNet", "loss", "batches"]

_init = nnx.initializers


def _named(init, *names):
    return nnx.with_partitioning(init, names)


def _norm(features: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(features, scale_init=_named(_init.ones_init(), "embed"),
                         bias_init=_named(_init.zeros_init(), "embed"), rngs=rngs)


def _linear(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, kernel_init=_named(_init.lecun_normal(), *names),
                      bias_init=_named(_init.zeros_init(), names[-1]), rngs=rngs)


class Block(nnx.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, embed: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
        self.ln1 = _norm(embed, rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, embed, decode=False, keep_rngs=False, rngs=rngs,
            kernel_init=_named(_init.lecun_normal(), "embed", "heads", "kv"),
            out_kernel_init=_named(_init.lecun_normal(), "heads", "kv", "embed"),
            bias_init=_named(_init.zeros_init(), "heads", "kv"),
            out_bias_init=_named(_init.zeros_init(), "embed"))
        self.ln2 = _norm(embed, rngs)
        self.up = _linear(embed, mlp, ("embed", "mlp"), rngs)
        self.down = _linear(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), decode=False)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class PatchAttentionNet(nnx.Module):
    """Images ``[B, image, image, channels]`` -> class logits ``[B, classes]``."""

    def __init__(self, *, channels: int = 3, image: int = 8, patch: int = 2, embed: int = 24, heads: int = 4,
                 mlp: int = 40, layers: int = 4, classes: int = 5, remat: bool = False, rngs: nnx.Rngs):
        self.remat = remat
        self.stem = nnx.Conv(channels, embed, (patch, patch), strides=(patch, patch), padding="VALID", rngs=rngs,
                             kernel_init=_named(_init.lecun_normal(), None, None, None, "embed"),
                             bias_init=_named(_init.zeros_init(), "embed"))
        tokens = (image // patch) ** 2
        self.pos = nnx.Param(_named(_init.normal(0.02), None, "embed")(rngs.params(), (tokens, embed)))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r: nnx.Rngs) -> Block:
            return Block(embed, heads, mlp, rngs=r)

        self.blocks = stack(rngs)
        self.norm = _norm(embed, rngs)
        self.head = _linear(embed, classes, ("embed", "classes"), rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.stem(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos[...]
        policy = jax.checkpoint_policies.nothing_saveable if self.remat else None
        x = jaxpar.scan_blocks(self.blocks, x, remat=policy)
        return self.head(self.norm(x).mean(axis=1)).astype(jnp.float32)


def loss(model: PatchAttentionNet, batch: dict) -> jax.Array:
    """Mean softmax cross-entropy of the model's logits against ``batch["labels"]``."""
    logp = jax.nn.log_softmax(model(batch["images"]), axis=-1)
    onehot = jax.nn.one_hot(batch["labels"], logp.shape[-1], dtype=logp.dtype)
    return -jnp.sum(logp * onehot, axis=-1).mean()


def batches(step: int, *, batch_size: int, seed: int = 0, eval: bool = False, image: int = 8, channels: int = 3,
            classes: int = 5) -> dict:
    """The batch of ``step``: noisy copies of ``classes`` fixed random templates, labelled by template."""
    templates = np.random.default_rng(seed).normal(size=(classes, image, image, channels))
    rng = np.random.default_rng([seed, step, int(eval)])
    labels = rng.integers(0, classes, batch_size)
    images = templates[labels] + rng.normal(scale=1.0, size=(batch_size, image, image, channels))
    return {"images": images.astype(np.float32), "labels": labels.astype(np.int32)}
