"""The decoder of Hugging Face's Llama-3, Qwen3, Qwen3-MoE and Gemma-3 text models, in plain Flax NNX.

One module covers the four families; :class:`DecoderConfig` says what differs (``jaxpar.hf``
reads it from a checkpoint's ``config.json``). The layers' parameters are stacked on a leading
``layers`` axis and run by :func:`jaxpar.adapters.run_layers`, with logical names only, so every
strategy applies: data, ZeRO / FSDP, tensor (+ sequence) parallelism, pipelines, context parallelism
(attention is :func:`jaxpar.attention.attention`, with Gemma-3's sliding window) and expert
parallelism (Qwen3-MoE's experts are :func:`jaxpar.parallel.moe.moe_apply`'s gated experts).

Packed rows: a batch may carry ``segment_ids`` (documents numbered from 1, 0 = padding) and
``positions`` that restart per document; attention stays within a document and RoPE sees each
document's own positions, so a row of three documents gives each the logits it gets alone.

Decoding: :meth:`Decoder.decode` runs new tokens against a :class:`KVCache` of the earlier ones'
keys and values (:meth:`Decoder.init_cache`), with the same layer code; its logits are those of
:meth:`Decoder.__call__` over the whole rows (:func:`jaxpar.greedy_generate` uses it).

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> cfg = DecoderConfig(vocab=11, embed=8, layers=2, heads=2, kv_heads=1, head_dim=4, mlp=12)
    >>> with nnx.use_eager_sharding(False):
    ...     model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> model.layers.wq.shape, model.layers.wq.out_sharding        # [layers, heads, head_dim, embed]
    ((2, 2, 4, 8), ('layers', 'heads', 'kv', 'embed'))
    >>> tokens = jnp.zeros((2, 5), jnp.int32)
    >>> model(tokens).shape
    (2, 5, 11)
    >>> round(float(decoder_loss(model, {"tokens": tokens, "targets": tokens})), 1)    # about ln 11 at init
    2.3
    >>> cache = model.init_cache(2, 8)                  # 8 slots per row
    >>> logits, cache = model.decode(tokens, cache)     # the prompt; then each new token, as tokens[:, :1]
    >>> logits.shape, int(cache.length)
    ((2, 5, 11), 5)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.adapters._blocks import REMAT_POLICIES, remat_policy, run_layers
from jaxpar.errors import ModelConfigError, check_int
from jaxpar.parallel.context import in_sequence_order, sequence_order
from jaxpar.logical import ROW_TABLE
from jaxpar.parallel._lookup import embed_lookup
from jaxpar.rules import constrain
from jaxpar.parallel import cross_entropy, linear_cross_entropy
from jaxpar.models._decoder_layers import ACTIVATIONS, Carry, KVCache, RoPE, cached_layer_apply, layer_apply, rms_norm


@dataclass(frozen=True)
class DecoderMoE:
    """Routed gated experts in place of every layer's MLP (Qwen3-MoE).

    Args:
      experts: experts per layer.
      top_k: experts per token.
      mlp: each expert's hidden size.
      normalize: renormalise the chosen experts' softmax weights to sum to 1 (``norm_topk_prob``).
      capacity_factor: slots per row and expert; ``None``: dropless, as ``transformers``.
    """

    experts: int
    top_k: int
    mlp: int
    normalize: bool = True
    capacity_factor: float | None = None


@dataclass(frozen=True)
class DecoderConfig:
    """What differs between the families (field names are jaxpar's; :mod:`jaxpar.hf` maps ``config.json``).

    Args:
      vocab, embed, layers, heads, kv_heads, head_dim, mlp: the sizes (``kv_heads`` divides ``heads``).
      norm_eps: RMS norms' epsilon. norm_offset: 1 for Gemma's ``(1 + w)`` norms, else 0.
      qk_norm: RMS norms on each head's queries and keys (Qwen3, Gemma-3).
      activation: the MLP's activation, by its Hugging Face name (``silu``, ``gelu_pytorch_tanh``).
      rope: the (global layers') RoPE. local_rope: the sliding-window layers' RoPE (Gemma-3), or ``None``.
      sliding_window: the window of the ``"sliding_attention"`` layers of ``layer_types``.
      layer_types: ``"full_attention"`` / ``"sliding_attention"`` per layer (``None``: all full).
      query_scale: the attention's score scale (``None``: ``head_dim ** -0.5``).
      attn_softcap, final_softcap: soft caps of the attention scores and of the logits (``None``: none).
      embed_scale: multiply the embeddings by √embed in the compute dtype (Gemma).
      sandwich_norms: norms on each half's output too (Gemma-3's post-attention / post-feedforward norms).
      tie_embeddings: the head is the embedding table.
      moe: routed experts instead of the MLP, or ``None``.
      remat: ``"none"``, ``"full"`` or ``"save-matmuls"``. scan_layers: ``lax.scan`` over the layers.
      loss_chunks: :func:`decoder_loss` computes the head and the loss over this many pieces of the
        vocabulary, one piece's logits at a time (:func:`jaxpar.parallel.linear_cross_entropy`); 1: whole.
      init_std: the standard deviation of random weights (a model trained from scratch).
      max_positions: the longest sequence the model takes (``max_position_embeddings``), or ``None``
        (no limit): :meth:`Decoder.init_cache` refuses a longer cache.
    """

    vocab: int
    embed: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    qk_norm: bool = False
    activation: str = "silu"
    rope: RoPE = RoPE()
    local_rope: RoPE | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: bool = False
    sandwich_norms: bool = False
    tie_embeddings: bool = False
    moe: DecoderMoE | None = None
    remat: str = "none"
    scan_layers: bool = True
    loss_chunks: int = 1
    init_std: float = 0.02
    max_positions: int | None = None

    def __post_init__(self):
        for name in ("vocab", "embed", "layers", "heads", "kv_heads", "head_dim", "mlp", "loss_chunks"):
            check_int("DecoderConfig", name, getattr(self, name), 1, ModelConfigError)
        if self.max_positions is not None:      # the checkpoint's max_position_embeddings
            check_int("DecoderConfig", "max_positions", self.max_positions, 1, ModelConfigError)
        if self.vocab % self.loss_chunks:
            raise ModelConfigError(f"DecoderConfig: loss_chunks={self.loss_chunks} must divide vocab={self.vocab} "
                                   "(the loss's pieces of the vocabulary; YAML model.loss_chunks).")
        if self.heads % self.kv_heads:
            raise ModelConfigError(f"DecoderConfig: kv_heads={self.kv_heads} must divide heads={self.heads} "
                                   "(grouped-query attention).")
        if self.remat not in REMAT_POLICIES:
            raise ModelConfigError(f"DecoderConfig.remat={self.remat!r}: choose one of {REMAT_POLICIES}.")
        if self.activation not in ACTIVATIONS:
            raise ModelConfigError(f"DecoderConfig.activation={self.activation!r}: choose one of "
                                   f"{sorted(ACTIVATIONS)}.")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            kinds = {"full_attention", "sliding_attention"}
            if len(self.layer_types) != self.layers or not set(self.layer_types) <= kinds:
                raise ModelConfigError(f"DecoderConfig.layer_types={self.layer_types!r}: give one of "
                                       f"{sorted(kinds)} for each of the {self.layers} layers.")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ModelConfigError("DecoderConfig: layer_types has sliding_attention layers but sliding_window is "
                                       "None; set sliding_window (the sliding layers' window, in tokens).")
        if self.moe is not None and self.activation != "silu":
            raise ModelConfigError(f"DecoderConfig.activation={self.activation!r}: routed experts run SiLU "
                                   "(SwiGLU) only; use activation='silu' or moe=None.")


#: Logical names of one layer's parameters (the stacked arrays add a leading ``layers``).
LAYER_LOGICAL = {
    "attn_norm": ("embed",), "mlp_norm": ("embed",), "attn_out_norm": ("embed",), "mlp_out_norm": ("embed",),
    "wq": ("heads", "kv", "embed"), "wk": ("kv_heads", "kv", "embed"), "wv": ("kv_heads", "kv", "embed"),
    "wo": ("embed", "heads", "kv"), "q_norm": ("kv",), "k_norm": ("kv",),
    "w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"), "w_down": ("embed", "mlp"),
    "router": ("embed", None), "experts_gate": ("experts", "embed", "mlp"), "experts_up": ("experts", "embed", "mlp"),
    "experts_down": ("experts", "mlp", "embed"),
}


def layer_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """One layer's parameter shapes (no ``layers`` axis)."""
    E, H, K, D = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
    shapes = {"attn_norm": (E,), "mlp_norm": (E,), "wq": (H, D, E), "wk": (K, D, E), "wv": (K, D, E), "wo": (E, H, D)}
    if cfg.qk_norm:
        shapes.update(q_norm=(D,), k_norm=(D,))
    if cfg.sandwich_norms:
        shapes.update(attn_out_norm=(E,), mlp_out_norm=(E,))
    if cfg.moe is None:
        shapes.update(w_gate=(cfg.mlp, E), w_up=(cfg.mlp, E), w_down=(E, cfg.mlp))
    else:
        X, M = cfg.moe.experts, cfg.moe.mlp
        shapes.update(router=(E, X), experts_gate=(X, E, M), experts_up=(X, E, M), experts_down=(X, M, E))
    return shapes


def _param(rngs: nnx.Rngs, shape, logical, cfg: DecoderConfig, norm: bool) -> nnx.Param:
    if norm:       # norms start at the identity: 1, or 0 under Gemma's (1 + w)
        value = jnp.full(shape, 1.0 - cfg.norm_offset, jnp.float32)
    else:
        value = cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=logical)


class Layers(nnx.Module):
    """The decoder's layers, every parameter stacked on a leading ``layers`` axis."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        for name, shape in layer_shapes(cfg).items():
            setattr(self, name, _param(rngs, (cfg.layers,) + shape, ("layers",) + LAYER_LOGICAL[name], cfg,
                                       name.endswith("norm")))


class Decoder(nnx.Module):
    """Token embedding, the stacked layers, the final norm and the (tied or untied) head."""

    #: Weights are ``[out, in]`` as Hugging Face stores them (read by :func:`jaxpar.optimizers.muon`).
    kernel_layout = "out_in"

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.embed = _param(rngs, (cfg.vocab, cfg.embed), ROW_TABLE, cfg, False)
            self.layers = Layers(cfg, rngs=rngs)
            self.norm = _param(rngs, (cfg.embed,), ("embed",), cfg, True)
            if not cfg.tie_embeddings:
                self.lm_head = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), cfg, False)

    def __call__(self, tokens: jax.Array, positions: Any = None, segment_ids: Any = None) -> jax.Array:
        """Float32 logits ``[batch, length, vocab]`` of ``tokens[batch, length]``.

        Args:
          tokens: token ids.
          positions: each token's position (``[length]`` or ``[batch, length]``; ``None``: ``arange``):
            RoPE's positions, restarting per packed document, or the balanced context-parallel order.
          segment_ids: ``[batch, length]`` document ids of packed rows (``None``: one document a row).
        """
        return self._logits(self.hidden(tokens, positions, segment_ids))

    def hidden(self, tokens: jax.Array, positions: Any = None, segment_ids: Any = None) -> jax.Array:
        """The final norm's output: what the head projects.

        Args:
          tokens, positions, segment_ids: as for ``__call__``.

        Returns:
          ``[batch, length, embed]`` in the compute dtype.
        """
        cfg = self.cfg
        b, t = tokens.shape
        positions = jnp.arange(t, dtype=jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
        positions = jnp.broadcast_to(positions, (b, t))
        carry = Carry(self._embed(tokens), positions, segment_ids, jnp.zeros((), jnp.int32))
        params = nnx.to_pure_dict(nnx.state(self.layers))
        logical = {k: LAYER_LOGICAL[k] for k in params}
        carry = run_layers(lambda p, c: layer_apply(cfg, p, c), params, carry, logical=logical,
                           remat=remat_policy(cfg.remat), scan=cfg.scan_layers)
        return self._normed(carry.x)

    def head(self) -> jax.Array:
        """The head's ``[vocab, embed]`` weights: the embedding table when tied."""
        return constrain(self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...], ("vocab", "embed"))

    def init_cache(self, batch: int, size: int, start: Any = None, dtype: Any = None) -> KVCache:
        """An empty :class:`KVCache` for :meth:`decode`: ``size`` slots per row.

        Args:
          batch: rows.
          size: slots per row (the longest row's prompt plus continuation, at most ``cfg.max_positions``).
          start: int ``[batch]``: each row's first slot (rows of shorter prompts are left-padded); ``None``: 0.
          dtype: the keys' and values' dtype (``None``: the embedding's).

        Returns:
          The cache, zeros, ``length`` 0.

        Raises:
          ModelConfigError: ``size`` is not an int >= 1 or exceeds ``cfg.max_positions``.
        """
        cfg = self.cfg
        check_int("Decoder.init_cache", "size", size, 1, ModelConfigError)
        if cfg.max_positions is not None and size > cfg.max_positions:
            raise ModelConfigError(f"Decoder.init_cache(size={size}): longer than DecoderConfig.max_positions="
                                   f"{cfg.max_positions}, the longest sequence the model takes; use size <= "
                                   f"{cfg.max_positions} (a shorter prompt or fewer new tokens).")
        shape = (cfg.layers, batch, size, cfg.kv_heads, cfg.head_dim)
        dtype = self.embed[...].dtype if dtype is None else dtype
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), start, jnp.zeros((), jnp.int32))

    def decode(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Logits of ``tokens`` that continue the rows of ``cache``, and the cache with them added.

        ``tokens[batch, t]`` go to slots ``cache.length ... + t`` of every row (a prefill writes a
        whole left-padded prompt, a decode step one token); each attends to its row's tokens before
        it, as :meth:`__call__` over the whole row does.

        Args:
          tokens: token ids ``[batch, t]``.
          cache: the earlier tokens (:meth:`init_cache`); its ``size`` leaves room for ``t`` more.

        Returns:
          Float32 logits ``[batch, t, vocab]`` and the cache, ``length`` advanced by ``t``.
        """
        cfg = self.cfg
        slots = cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
        segments = (slots[None, :] >= cache.start[:, None]).astype(jnp.int32)
        carry = Carry(self._embed(tokens), positions, segments, jnp.zeros((), jnp.int32))

        def layer(c, p_k_v):
            p, k, v = p_k_v
            c, layer_cache = cached_layer_apply(cfg, p, c, cache._replace(k=k, v=v))
            return c, (layer_cache.k, layer_cache.v)

        params = nnx.to_pure_dict(nnx.state(self.layers))
        carry, (k, v) = jax.lax.scan(layer, carry, (params, cache.k, cache.v))
        return self._logits(self._normed(carry.x)), KVCache(k, v, cache.start, cache.length + tokens.shape[1])

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """The residual stream's input ``[batch, length, embed]`` (Gemma's √embed applied)."""
        x = embed_lookup(self.embed[...], tokens)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.embed ** 0.5, jnp.float32).astype(x.dtype)
        return constrain(x, ("batch", "norm_length", "embed"))

    def _normed(self, x: jax.Array) -> jax.Array:
        """The final norm of the last layer's output."""
        x = rms_norm(x, self.norm[...], eps=self.cfg.norm_eps, offset=self.cfg.norm_offset)
        return constrain(x, ("batch", "length", "embed"))

    def _logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits of the final norm's output: the head, Gemma's soft cap."""
        logits = jnp.einsum("bte,ve->btv", x, self.head()).astype(jnp.float32)
        if self.cfg.final_softcap is not None:
            logits = jnp.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return constrain(logits, ("batch", "length", "vocab"))


def decoder_loss(model: Decoder, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of a :class:`Decoder`.

    ``batch``: ``tokens`` and ``targets`` ``[batch, length]``; optionally ``segment_ids`` and
    ``positions`` (packed rows), ``loss_mask`` (which targets count: e.g. not across a document
    boundary, not padding; the mean is over the batch given) and ``loss_weights`` (the mask scaled
    over the global batch: the mean is the global batch's under any micro-batching). Under a balanced
    context-parallel layout the sequence is permuted into its order
    (:func:`jaxpar.parallel.context.sequence_order`) and the model gets the true positions. With
    ``loss_chunks`` > 1 the head and the loss run over pieces of the vocabulary
    (:func:`jaxpar.parallel.linear_cross_entropy`).

    Args:
      model: the decoder.
      batch: the arrays above.

    Returns:
      The scalar loss (fp32).
    """
    tokens, targets = batch["tokens"], batch["targets"]
    segments, positions, mask = batch.get("segment_ids"), batch.get("positions"), batch.get("loss_mask")
    weights = batch.get("loss_weights")
    order = sequence_order(tokens.shape[1])
    if order is not None:
        positions = order if positions is None else in_sequence_order(jnp.broadcast_to(positions, tokens.shape))
        tokens, targets = in_sequence_order(tokens), in_sequence_order(targets)
        segments, mask, weights = (None if x is None else in_sequence_order(x) for x in (segments, mask, weights))
    chunks = model.cfg.loss_chunks
    if chunks == 1:
        return cross_entropy(model(tokens, positions, segments), targets, mask, weights)
    return linear_cross_entropy(model.hidden(tokens, positions, segments), model.head(), targets, mask, weights,
                                chunks=chunks, softcap=model.cfg.final_softcap)
