"""A GPT-style decoder (causal attention, pre-norm) annotated with logical axes.

The blocks' parameters are stacked along a leading ``layers`` axis and run by
:func:`jaxpar.adapters.run_layers` (a ``jax.lax.scan``, so compile time does not grow
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

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.adapters._blocks import REMAT_POLICIES, remat_policy, run_layers
from jaxpar.parallel.context import in_sequence_order, sequence_order
from jaxpar.logical import ROW_TABLE
from jaxpar.parallel import cross_entropy
from jaxpar.parallel._lookup import embed_lookup
from jaxpar.rules import constrain
from jaxpar.models._gpt_layers import BLOCK_LOGICAL, Blocks, block_apply, layer_norm, param, zeros
from jaxpar.adapters._loss_metrics import report_metric
from jaxpar.parallel.moe import need_router_bias, router_bias
from jaxpar.models._gpt_moe import MoEBlocks, MoESettings, moe_metrics, run_moe_blocks
from jaxpar.errors import ModelConfigError, int_problem

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
    moe: MoESettings | None = None

    def __post_init__(self):
        for name in ("vocab", "seq_len", "embed", "heads", "layers", "mlp"):
            value = getattr(self, name)
            if (name != "mlp" or value is not None) and int_problem(value, 1):
                raise ModelConfigError(f"GPTConfig.{name}={value!r}: must be a positive int"
                                       + (" (or None: 4 x embed)." if name == "mlp" else "."))
        if self.embed % self.heads:
            raise ModelConfigError(f"GPTConfig: embed={self.embed} is not divisible by heads={self.heads}; "
                                   "choose embed as a multiple of heads.")
        if self.remat not in REMAT_POLICIES:
            raise ModelConfigError(f"GPTConfig.remat={self.remat!r}: choose one of {REMAT_POLICIES}.")
        if not isinstance(self.scan_layers, bool):
            raise ModelConfigError(f"GPTConfig.scan_layers={self.scan_layers!r}: must be True (one lax.scan over "
                                   "the layers) or False (a Python loop).")
        std = self.init_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std < 0:
            raise ModelConfigError(f"GPTConfig.init_std={std!r}: must be a finite number >= 0 (the weights' "
                                   "initial standard deviation, e.g. 0.02).")
        if self.moe is not None:
            self.moe.check(self.layers)

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp or 4 * self.embed


class GPT(nnx.Module):
    """Decoder-only transformer: token + position embedding, blocks, final norm, untied head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.wte = param(rngs.params(), (cfg.vocab, cfg.embed), ROW_TABLE, cfg.init_std)
            self.wpe = param(rngs.params(), (cfg.seq_len, cfg.embed), (None, "embed"), cfg.init_std)
            self.blocks = MoEBlocks(cfg, rngs=rngs) if cfg.moe is not None else Blocks(cfg, rngs=rngs)
            self.lnf_scale = param(None, (cfg.embed,), ("embed",), 0)
            self.lnf_bias = zeros((cfg.embed,), ("embed",))
            self.head = param(rngs.params(), (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.init_std)

    def embed(self, tokens: jax.Array, positions: Any = None) -> jax.Array:
        """Token + position embedding (:func:`embed_apply` of this model's tables).

        Args:
          tokens: int ``[batch, length]``.
          positions: the tokens' true positions (``None``: ``arange``).

        Returns:
          The residual stream ``[batch, length, embed]``.
        """
        return embed_apply({"wte": self.wte[...], "wpe": self.wpe[...]}, tokens, positions)

    def block_params(self) -> dict[str, jax.Array]:
        return nnx.to_pure_dict(nnx.state(self.blocks))

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final norm and head (:func:`head_apply` of this model's parameters).

        Args:
          x: the residual stream ``[batch, length, embed]``.

        Returns:
          float32 logits ``[batch, length, vocab]``.
        """
        return head_apply({"lnf_scale": self.lnf_scale[...], "lnf_bias": self.lnf_bias[...],
                           "head": self.head[...]}, x)

    def __call__(self, tokens: jax.Array, positions: Any = None) -> jax.Array:
        """Logits of ``tokens`` ``[batch, length]``; ``positions``: their true positions (``None``:
        ``arange``), for a sequence laid out in another order (:func:`jaxpar.parallel.context.sequence_order`).
        The MoE layers choose experts with the router bias of :func:`jaxpar.parallel.moe.use_router_bias`, if any."""
        return self.forward(tokens, positions, router_bias=router_bias())[0]

    def forward(self, tokens: jax.Array, positions: Any = None, router_bias: Any = None) -> tuple[jax.Array, Any]:
        """Logits and the MoE layers' statistics.

        Args:
          tokens: int ``[batch, length]``.
          positions: the tokens' true positions (``None``: ``arange``).
          router_bias: each MoE layer's aux-loss-free balancing bias ``[layers, E]``
            (:mod:`jaxpar.step._router_bias`), or None.

        Returns:
          ``(logits, stats)``: float32 logits ``[batch, length, vocab]``, and the MoE layers'
          :class:`jaxpar.parallel.moe.MoEStats` summed over them (``None`` without ``cfg.moe``).
        """
        x, blocks = self.embed(tokens, positions), self.block_params()
        if self.cfg.moe is None:
            x = run_layers(block_apply, blocks, x, logical={k: BLOCK_LOGICAL[k] for k in blocks},
                           remat=remat_policy(self.cfg.remat), scan=self.cfg.scan_layers)
            return self.unembed(x), None
        x, stats = run_moe_blocks(self.cfg.moe, blocks, x, remat=remat_policy(self.cfg.remat),
                                  scan=self.cfg.scan_layers, router_bias=router_bias)
        return self.unembed(x), stats


def lm_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of a model on a batch.

    Under a balanced context-parallel layout the sequence is permuted into its order
    (:func:`jaxpar.parallel.context.sequence_order`) and the model gets the true positions; the mean is the same.
    With ``cfg.moe`` the loss adds ``aux_weight * aux_loss + z_weight * z_loss`` (summed over the MoE
    layers; inside a train step the layers balance with the whole step's loads themselves:
    :mod:`jaxpar.parallel.moe._balance`), and under :func:`jaxpar.parallel.moe.use_router_bias` the MoE
    layers choose experts with the step's router bias.

    Args:
      model: a :class:`GPT` (or any model ``model(tokens) -> logits``).
      batch: ``{'tokens': int[B, T], 'targets': int[B, T]}``.

    Returns:
      The scalar float32 loss (plus the MoE losses with ``cfg.moe``).
    """
    tokens, targets = batch["tokens"], batch["targets"]
    order = sequence_order(tokens.shape[1])
    moe = getattr(getattr(model, "cfg", None), "moe", None)
    if order is not None:
        tokens, targets = in_sequence_order(tokens), in_sequence_order(targets)
    if moe is None:         # any model: positions only in a balanced layout, no statistics
        return cross_entropy(model(tokens) if order is None else model(tokens, positions=order), targets)
    if moe.bias_rate:
        need_router_bias(f"GPTConfig.moe.bias_rate={moe.bias_rate}")
    logits, stats = model.forward(tokens, positions=order, router_bias=router_bias())
    for name, value in moe_metrics(stats, moe.moe_layers(model.cfg.layers)).items():
        report_metric(name, value)                      # the step's metrics (jaxpar.report_metric)
    loss = cross_entropy(logits, targets)
    if moe.aux_weight:
        loss = loss + moe.aux_weight * stats.aux_loss
    return loss + moe.z_weight * stats.z_loss if moe.z_weight else loss


def embed_apply(p: dict[str, jax.Array], tokens: jax.Array, positions: Any = None) -> jax.Array:
    """Token + position embedding.

    Args:
      p: ``{"wte": [vocab, embed], "wpe": [seq_len, embed]}``.
      tokens: int ``[batch, length]``.
      positions: the tokens' true positions (``None``: ``arange``); when given, the position table
        is laid out in :func:`jaxpar.parallel.context.sequence_order`.

    Returns:
      The residual stream ``[batch, length, embed]``.
    """
    wpe = p["wpe"][: tokens.shape[1]]
    if positions is not None:       # the balanced context-parallel order (jaxpar.parallel.context.sequence_order)
        wpe = in_sequence_order(wpe, 0)
    x = embed_lookup(p["wte"], tokens) + wpe
    return constrain(x, ("batch", "norm_length", "embed"))


def head_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Final norm and the untied head.

    Args:
      p: ``{"lnf_scale": [embed], "lnf_bias": [embed], "head": [embed, vocab]}``.
      x: the residual stream ``[batch, length, embed]``.

    Returns:
      float32 logits ``[batch, length, vocab]``.
    """
    x = layer_norm(x, p["lnf_scale"], p["lnf_bias"])
    x = constrain(x, ("batch", "length", "embed"))
    logits = jnp.einsum("bte,ev->btv", x, p["head"])
    return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))
