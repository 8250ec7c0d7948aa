"""A GPT-style decoder (causal attention, pre-norm) annotated with logical axes.

The blocks' parameters are stacked along a leading ``layers`` axis and run by
:func:`jaxpar.blocks.run_layers` (a ``jax.lax.scan``, so compile time does not grow
with depth, or a Python loop with ``scan_layers=False``), which is where the
strategy takes over: explicit data parallelism per layer, or the pipeline cut.
:func:`block_apply` is the pure function of one block.

Logical names used: parameters ``vocab, embed, heads, kv, mlp, layers``;
activations ``batch, length`` (inside attention / MLP) and ``norm_length``
(the residual stream and norms: sharded over ``tensor`` under sequence
parallelism).

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> cfg = GPTConfig(vocab=8, seq_len=8, embed=8, heads=1, layers=1, mlp=8)   # tiny: quick to build
    >>> with nnx.use_eager_sharding(False):      # no mesh here (jaxpar places the state when training)
    ...     model = GPT(cfg, rngs=nnx.Rngs(0))
    >>> model.blocks.wq.shape, model.blocks.wq.out_sharding    # stacked, with logical names
    ((1, 8, 1, 8), ('layers', 'embed', 'heads', 'kv'))
    >>> tokens = jnp.zeros((2, 8), jnp.int32)
    >>> model(tokens).shape                      # logits: (batch, length, vocab)
    (2, 8, 8)
    >>> round(float(lm_loss(model, {"tokens": tokens, "targets": tokens})), 1)   # about ln 8 at init
    2.1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..blocks import run_layers
from ..context import attention, in_sequence_order, sequence_order
from ..rules import constrain
from ..tensor import row_parallel

__all__ = ["GPTConfig", "GPT", "Blocks", "block_apply", "run_blocks", "BLOCK_LOGICAL", "REMAT_POLICIES", "lm_loss",
           "cross_entropy", "embed_apply", "head_apply", "remat_policy"]

REMAT_POLICIES = ("none", "full", "save-matmuls")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. ``mlp`` defaults to ``4 * embed``."""

    vocab: int = 256
    seq_len: int = 64
    embed: int = 64
    heads: int = 4
    layers: int = 2
    mlp: int | None = None
    remat: str = "none"
    scan_layers: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab", "seq_len", "embed", "heads", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive int.")
        if self.embed % self.heads:
            raise ValueError(f"GPTConfig: embed={self.embed} is not divisible by heads={self.heads}; "
                             "choose embed as a multiple of heads.")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"GPTConfig.remat={self.remat!r}: choose one of {REMAT_POLICIES}.")

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp or 4 * self.embed


def _param(key, shape, logical, std):
    value = std * jax.random.normal(key, shape, jnp.float32) if std else jnp.ones(shape, jnp.float32)
    return nnx.Param(value, out_sharding=logical)


def _zeros(shape, logical):
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

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        L, E, H, D, M = cfg.layers, cfg.embed, cfg.heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * L) ** 0.5
        self.ln1_scale = _param(None, (L, E), ("layers", "embed"), 0)
        self.ln1_bias = _zeros((L, E), ("layers", "embed"))
        self.wq = _param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wk = _param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wv = _param(rngs.params(), (L, E, H, D), ("layers", "embed", "heads", "kv"), std)
        self.wo = _param(rngs.params(), (L, H, D, E), ("layers", "heads", "kv", "embed"), out_std)
        self.ln2_scale = _param(None, (L, E), ("layers", "embed"), 0)
        self.ln2_bias = _zeros((L, E), ("layers", "embed"))
        self.w1 = _param(rngs.params(), (L, E, M), ("layers", "embed", "mlp"), std)
        self.b1 = _zeros((L, M), ("layers", "mlp"))
        self.w2 = _param(rngs.params(), (L, M, E), ("layers", "mlp", "embed"), out_std)
        self.b2 = _zeros((L, E), ("layers", "embed"))


def _layer_norm(x, scale, bias, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def block_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One pre-norm decoder block on ``x`` of shape ``(batch, length, embed)``.

    ``p`` maps the names of :class:`Blocks` to one layer's arrays (no ``layers``
    axis). Megatron pairing: q/k/v and ``w1`` are column-parallel (``heads`` /
    ``mlp`` sharded), ``wo`` and ``w2`` row-parallel: one reduction per pair.
    """
    res = ("batch", "norm_length", "embed")
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    h = constrain(h, ("batch", "length", "embed"))
    q = constrain(jnp.einsum("bte,ehd->bthd", h, p["wq"]), ("batch", "length", "heads", "kv"))
    k = constrain(jnp.einsum("bte,ehd->bthd", h, p["wk"]), ("batch", "length", "heads", "kv"))
    v = constrain(jnp.einsum("bte,ehd->bthd", h, p["wv"]), ("batch", "length", "heads", "kv"))
    attn = constrain(attention(q, k, v, causal=True), ("batch", "length", "heads", "kv"))   # context parallel
    x = x + row_parallel("bthd,hde->bte", attn, p["wo"], ("batch", "length", "heads", "kv"),
                         ("heads", "kv", "embed"), res)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    h = constrain(h, ("batch", "length", "embed"))
    h = jax.nn.gelu(constrain(jnp.einsum("bte,em->btm", h, p["w1"]) + p["b1"], ("batch", "length", "mlp")))
    x = x + row_parallel("btm,me->bte", h, p["w2"], ("batch", "length", "mlp"), ("mlp", "embed"), res) + p["b2"]
    return constrain(x, res)


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of a remat name (``None`` for ``"none"``: no remat)."""
    return {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
            "save-matmuls": jax.checkpoint_policies.checkpoint_dots}[name]


def run_blocks(blocks: dict[str, jax.Array], x: jax.Array, *, remat: str = "none", scan: bool = True) -> jax.Array:
    """Run stacked blocks (each array has a leading ``layers`` axis) over ``x`` with
    :func:`jaxpar.blocks.run_layers`."""
    logical = {k: BLOCK_LOGICAL[k] for k in blocks}
    return run_layers(block_apply, blocks, x, logical=logical, remat=remat_policy(remat), scan=scan)


class GPT(nnx.Module):
    """Decoder-only transformer: token + position embedding, blocks, final norm, untied head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.wte = _param(rngs.params(), (cfg.vocab, cfg.embed), ("vocab", "embed"), cfg.init_std)
            self.wpe = _param(rngs.params(), (cfg.seq_len, cfg.embed), (None, "embed"), cfg.init_std)
            self.blocks = Blocks(cfg, rngs=rngs)
            self.lnf_scale = _param(None, (cfg.embed,), ("embed",), 0)
            self.lnf_bias = _zeros((cfg.embed,), ("embed",))
            self.head = _param(rngs.params(), (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.init_std)

    def embed(self, tokens: jax.Array, positions: Any = None) -> jax.Array:
        return embed_apply({"wte": self.wte[...], "wpe": self.wpe[...]}, tokens, positions)

    def block_params(self) -> dict[str, jax.Array]:
        return nnx.to_pure_dict(nnx.state(self.blocks))

    def unembed(self, x: jax.Array) -> jax.Array:
        return head_apply({"lnf_scale": self.lnf_scale[...], "lnf_bias": self.lnf_bias[...],
                           "head": self.head[...]}, x)

    def __call__(self, tokens: jax.Array, positions: Any = None) -> jax.Array:
        """Logits of ``tokens`` ``[batch, length]``; ``positions``: their true positions (``None``:
        ``arange``), for a sequence laid out in another order (:func:`jaxpar.context.sequence_order`)."""
        x = self.embed(tokens, positions)
        x = run_blocks(self.block_params(), x, remat=self.cfg.remat, scan=self.cfg.scan_layers)
        return self.unembed(x)


def lm_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy; ``batch = {'tokens': int[B, T], 'targets': int[B, T]}``.

    Under a balanced context-parallel layout the sequence is permuted into its order
    (:func:`jaxpar.context.sequence_order`) and the model gets the true positions; the mean is the same.
    """
    tokens, targets = batch["tokens"], batch["targets"]
    order = sequence_order(tokens.shape[1])
    if order is None:
        return cross_entropy(model(tokens), targets)
    return cross_entropy(model(in_sequence_order(tokens), positions=order), in_sequence_order(targets))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits[..., vocab]`` against integer ``targets``.

    The target logit is picked with a one-hot product rather than a gather, so a
    vocabulary sharded over ``tensor`` reduces with one all-reduce (and XLA's
    gather partitioner, which fails inside a pipeline's manual region, is avoided).
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)
    return -picked.mean()


def embed_apply(p: dict[str, jax.Array], tokens: jax.Array, positions: Any = None) -> jax.Array:
    """Token + position embedding; ``p`` has ``wte`` and ``wpe``; ``positions``: the tokens' true
    positions (``None``: ``arange``)."""
    wte = constrain(p["wte"], ("vocab", "embed"))    # the compute layout (ZeRO-3: gathered over the data axes)
    wpe = p["wpe"][: tokens.shape[1]]
    if positions is not None:       # the balanced context-parallel order (jaxpar.context.sequence_order)
        wpe = in_sequence_order(wpe, 0)
    x = jnp.take(wte, tokens, axis=0) + wpe
    return constrain(x, ("batch", "norm_length", "embed"))


def head_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Final norm and the untied head -> float32 logits; ``p`` has ``lnf_scale``, ``lnf_bias`` and ``head``."""
    x = _layer_norm(x, p["lnf_scale"], p["lnf_bias"])
    x = constrain(x, ("batch", "length", "embed"))
    logits = jnp.einsum("bte,ev->btv", x, p["head"])
    return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))
