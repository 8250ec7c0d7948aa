"""What the cost model knows of a model: sizes, and its parameters as leaves with logical axes.

:func:`gpt` describes jaxpar's GPT (:mod:`jaxpar.models._gpt`) from numbers, leaf by leaf; :func:`decoder`
(and :func:`from_decoder_config`) jaxpar's :class:`~jaxpar.models.Decoder`: grouped-query attention, a gated
MLP, RMSNorm, RoPE, a tied or untied head, gated experts; :func:`from_nnx` reads any Flax NNX model through
``jax.eval_shape`` (JAX is imported only inside that function). The leaves let :mod:`jaxpar.cost._memory` shard each parameter the
way jaxpar does (tensor rules, ZeRO's largest divisible dimension), so small arrays that
stay replicated are counted exactly.

Example::

    >>> m = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=16)
    >>> m.n_params, m.n_layer_params, m.mlp
    (163072512, 85017600, 3072)
    >>> leaf = m.leaf("blocks/w1"); leaf.shape, leaf.logical
    ((12, 768, 3072), ('layers', 'embed', 'mlp'))

A mixture-of-experts GPT (:mod:`jaxpar.parallel.moe`): every ``moe_every``-th layer's MLP is replaced by
``experts`` expert MLPs of width ``expert_mlp``, ``top_k`` of them per token, with
``capacity_factor`` (None: dropless) and optional always-on shared experts (``shared_mlp``)::

    >>> moe = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=8, experts=8, top_k=2, moe_every=2)
    >>> moe.moe_layers, moe.leaf("blocks/moe_w1").shape, moe.leaf("blocks/moe_w1").logical
    (2, (2, 8, 64, 256), ('layers', 'experts', 'embed', 'mlp'))
    >>> moe.capacity(32)             # per group of 32 tokens and expert: ceil(1.25 * 32 * 2 / 8)
    10

Llama-3-8B (32 query heads, 8 K/V heads of 128, SwiGLU 14336, untied)::

    >>> llama = decoder(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, batch=8, mlp=14336, kv_heads=8)
    >>> llama.n_params, llama.kv_width, llama.leaf("layers/w_gate").logical
    (8030261248, 1024, ('layers', 'mlp', 'embed'))
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from jaxpar.errors import CostModelError, check_int, finite_number, int_problem
from jaxpar.logical import ROW_TABLE, fp8_covered

#: Logical names jaxpar's tensor rules shard over ``tensor`` (:func:`jaxpar.parallel.tensor_rules`).
TENSOR_LOGICAL = ("mlp", "heads", "vocab")


@dataclass(frozen=True)
class Leaf:
    """One parameter array: ``name`` (path), ``shape`` and one logical name (or None) per dimension.
    A leaf whose first logical name is ``layers`` is *stacked*: one slice per layer. ``head``: the output
    head, a matmul on the last pipeline stage whatever its logical names (the Decoder's ``lm_head`` is
    ``('vocab', 'embed')``, as a token table)."""

    name: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...]
    head: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return bool(self.logical) and self.logical[0] == "layers"

    @property
    def matmul(self) -> bool:
        """A weight that a matmul reads (its gradient is a dot): two or more dimensions besides
        ``layers``, not a lookup table (first dimension ``vocab``, or unnamed as a position table)."""
        dims = [n for n in self.logical if n != "layers"]
        return self.head or (len(dims) >= 2 and dims[0] not in ("vocab", None))

    def fp8(self, min_dim: int) -> bool:
        """Whether FP8 covers this weight's GEMMs (:func:`jaxpar.parallel.fp8_layer`): logical names with
        ``embed`` and a feature axis (:func:`jaxpar.logical.fp8_covered`), and a GEMM whose contracted and output sizes
        (the ``embed`` dimensions' and the feature dimensions', ``layers`` and ``experts`` apart) are both
        at least ``min_dim``.

        Args:
          min_dim: :class:`jaxpar.options.Fp8`'s ``min_dim``.

        Returns:
          True when its GEMMs run in FP8.

        >>> w1 = Leaf("blocks/w1", (2, 1024, 4096), ("layers", "embed", "mlp"))
        >>> w1.fp8(1024), w1.fp8(2048), Leaf("head", (1024, 256), ("embed", "vocab")).fp8(0)
        (True, False, False)
        """
        if not fp8_covered(self.logical):
            return False
        embed = math.prod(d for d, n in zip(self.shape, self.logical) if n == "embed")
        other = math.prod(d for d, n in zip(self.shape, self.logical) if n not in ("embed", "layers", "experts"))
        return min(embed, other) >= min_dim


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a transformer (``hidden`` = model width, ``seq`` = context, ``batch`` = global
    batch in sequences) and its parameter ``leaves``.

    ``qkv_inputs``: how many projections read the attention input (3 for jaxpar's separate
    ``wq, wk, wv``; 1 for a fused QKV); under tensor parallelism XLA all-reduces each one's
    input gradient separately, so it sets the backward's tensor all-reduces per layer.

    The decoder's fields (:func:`decoder`; their defaults are jaxpar's GPT): ``kv_heads`` (0: ``heads``;
    fewer: grouped-query attention, K and V ``hidden x kv_heads * head_dim``), ``head_dim`` (0:
    ``hidden // heads``), ``gated`` (three MLP matrices, SwiGLU / GeGLU, in the experts too), ``tied`` (the
    head is the token table), ``positions`` (a learned position table; False: RoPE), ``biases``
    (LayerNorms and MLP biases; False: RMSNorm scales only), ``kernel_layout`` (``in_out``: the GPT's
    ``[in, out]`` weights; ``out_in``: Hugging Face's ``[out, in]``) and ``column_regions`` (q, k, v and the
    MLP's gate and up run in one column-parallel region each, :func:`jaxpar.parallel.column_parallel`: their
    input gradients are summed before one all-reduce on every compiler, XLA:CPU's too; FP8 runs them apart).
    ``loss_chunks``: the head and the loss run over that many pieces of the vocabulary, the backward recomputing
    each piece's logits (:func:`jaxpar.parallel.linear_cross_entropy`; 1: whole).
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    mlp: int = 0
    leaves: tuple[Leaf, ...] = field(default=(), repr=False)
    name: str = "gpt"
    qkv_inputs: int = 3
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25
    moe_every: int = 1
    expert_mlp: int = 0
    shared_mlp: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    gated: bool = False
    tied: bool = False
    positions: bool = True
    biases: bool = True
    kernel_layout: str = "in_out"
    column_regions: bool = False
    loss_chunks: int = 1

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq", "vocab", "batch", "loss_chunks"):
            check_int("ModelSpec", f, getattr(self, f), 1, CostModelError)
        _check_attention(self)
        if self.mlp == 0:
            object.__setattr__(self, "mlp", 4 * self.hidden)
        check_int("ModelSpec", "mlp", self.mlp, 1, CostModelError)
        if self.qkv_inputs not in (1, 3):
            raise CostModelError(f"ModelSpec.qkv_inputs={self.qkv_inputs!r}: 3 (separate q, k, v) or 1 (fused).")
        _check_moe(self)
        if self.experts and self.expert_mlp == 0:
            object.__setattr__(self, "expert_mlp", self.mlp)

    @property
    def is_moe(self) -> bool:
        """Whether some layers are mixture-of-experts layers (``experts > 0``)."""
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers: every ``moe_every``-th, ``layers // moe_every`` (0 if dense)."""
        return self.layers // self.moe_every if self.experts else 0

    def capacity(self, tokens_per_group: int) -> int:
        """Buffer slots per group and expert, :func:`jaxpar.parallel.moe.capacity`'s rule:
        ``min(T, ceil(capacity_factor * T * top_k / experts))``, ``T`` when dropless (None).

        Args:
          tokens_per_group: ``T``, the tokens of one routing group.

        Returns:
          The number of slots.
        """
        if self.capacity_factor is None:
            return tokens_per_group
        return min(tokens_per_group, math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.experts))

    @property
    def n_params(self) -> int:
        """All parameters (from the leaves; without leaves the formula of jaxpar's GPT, or of a decoder)."""
        if self.leaves:
            return sum(l.size for l in self.leaves)
        h = self.hidden
        tables = self.vocab * h * (1 if self.tied else 2) + (self.seq * h if self.positions else 0)
        return self.n_layer_params + tables + (2 * h if self.biases else h)

    @property
    def n_layer_params(self) -> int:
        """Parameters of the stacked blocks (all layers)."""
        if self.leaves:
            return sum(l.size for l in self.leaves if l.stacked)
        h, f = self.hidden, self.mlp
        small = f + 6 * h if self.biases else 2 * h        # the GPT's biases and LayerNorms; RMSNorm scales
        return self.layers * (self.attention_params + self.mlp_matrices * h * f + small)

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention's output): ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention projections: ``wq``, ``wk``, ``wv`` and ``wo`` (``4 h^2`` for the GPT)."""
        return self.hidden * 2 * (self.q_width + self.kv_width)

    @property
    def mlp_matrices(self) -> int:
        """Matrices of one MLP (and of one expert): 3 gated (gate, up, down), else 2."""
        return 3 if self.gated else 2

    @property
    def mlp_inputs(self) -> int:
        """MLP matrices that read the MLP's input (column-parallel): 2 gated (gate, up), else 1."""
        return self.mlp_matrices - 1

    def kv_split(self, tensor: int) -> int:
        """How many ways ``tensor`` splits K and V: ``tensor`` when it divides ``kv_heads`` (or they are the
        query heads, as the GPT's), else 1 (replicated, as :func:`jaxpar.parallel.tensor_rules` keeps them).

        Args:
          tensor: the tensor-parallel size.

        Returns:
          ``tensor`` or 1.
        """
        return tensor if self.kv_heads % tensor == 0 or self.kv_heads == self.heads else 1

    def leaf(self, name: str) -> Leaf:
        """The leaf called ``name`` (e.g. ``'blocks/w1'``).

        Args:
          name: the leaf's path.

        Returns:
          The :class:`Leaf`.
        """
        for l in self.leaves:
            if l.name == name:
                return l
        raise KeyError(f"ModelSpec has no leaf {name!r}; leaves: {', '.join(l.name for l in self.leaves)}")


def _check_attention(m: ModelSpec) -> None:
    """Set ``head_dim`` (0: ``hidden // heads``) and ``kv_heads`` (0: ``heads``) and check the decoder's fields."""
    if m.head_dim == 0:
        if m.hidden % m.heads:
            raise CostModelError(f"ModelSpec: hidden={m.hidden} is not divisible by heads={m.heads}; "
                                 "choose hidden as a multiple of heads, or give head_dim.")
        object.__setattr__(m, "head_dim", m.hidden // m.heads)
    check_int("ModelSpec", "head_dim", m.head_dim, 1, CostModelError)
    check_int("ModelSpec", "kv_heads", m.kv_heads, 0, CostModelError)
    if m.kv_heads == 0:
        object.__setattr__(m, "kv_heads", m.heads)
    if m.heads % m.kv_heads:
        raise CostModelError(f"ModelSpec: kv_heads={m.kv_heads} does not divide heads={m.heads}; each K/V head serves "
                             "heads / kv_heads query heads (grouped-query attention): choose a divisor of heads.")
    for f in ("gated", "tied", "positions", "biases", "column_regions"):
        if not isinstance(getattr(m, f), bool):
            raise CostModelError(f"ModelSpec.{f}={getattr(m, f)!r}: must be True or False.")
    if m.kernel_layout not in ("in_out", "out_in"):
        raise CostModelError(f"ModelSpec.kernel_layout={m.kernel_layout!r}: 'in_out' (weights [in, out], jaxpar's "
                             "GPT) or 'out_in' ([out, in], Hugging Face's and jaxpar's Decoder).")


def _check_moe(m: ModelSpec) -> None:
    check_int("ModelSpec", "experts", m.experts, 0, CostModelError)
    if not m.experts:
        return
    if int_problem(m.top_k, 1) or m.top_k > m.experts:
        raise CostModelError(f"ModelSpec.top_k={m.top_k!r} must be an int in [1, experts={m.experts}]: a token picks "
                             "top_k distinct experts.")
    cf = m.capacity_factor
    if cf is not None and (not finite_number(cf) or cf <= 0):
        raise CostModelError(f"ModelSpec.capacity_factor={cf!r} must be a finite number > 0 (1.25 is common) or None "
                             "for dropless routing.")
    check_int("ModelSpec", "moe_every", m.moe_every, 1, CostModelError)
    if m.moe_every > m.layers:
        raise CostModelError(f"ModelSpec.moe_every={m.moe_every} > layers={m.layers}: no layer would be an MoE layer; "
                             f"choose moe_every <= {m.layers} or experts=0 for a dense model.")
    for f in ("expert_mlp", "shared_mlp"):
        check_int("ModelSpec", f, getattr(m, f), 0, CostModelError)


def _gpt_leaves(layers: int, h: int, heads: int, s: int, V: int, f: int, moe: ModelSpec | None = None
                ) -> tuple[Leaf, ...]:
    L, d = layers, h // heads
    n_moe = moe.moe_layers if moe is not None else 0
    D = L - n_moe          # layers with a dense MLP
    blocks = [("ln1_scale", (L, h), ("layers", "embed")), ("ln1_bias", (L, h), ("layers", "embed")),
              *((w, (L, h, heads, d), ("layers", "embed", "heads", "kv")) for w in ("wq", "wk", "wv")),
              ("wo", (L, heads, d, h), ("layers", "heads", "kv", "embed")),
              ("ln2_scale", (L, h), ("layers", "embed")), ("ln2_bias", (L, h), ("layers", "embed"))]
    if D:
        blocks += [("w1", (D, h, f), ("layers", "embed", "mlp")), ("b1", (D, f), ("layers", "mlp")),
                   ("w2", (D, f, h), ("layers", "mlp", "embed")), ("b2", (D, h), ("layers", "embed"))]
    if n_moe:       # jaxpar.parallel.moe.MOE_LOGICAL, stacked over the MoE layers
        E, M, S = moe.experts, moe.expert_mlp, moe.shared_mlp
        blocks += [("moe_router", (n_moe, h, E), ("layers", "embed", None)),
                   ("moe_w1", (n_moe, E, h, M), ("layers", "experts", "embed", "mlp")),
                   ("moe_w2", (n_moe, E, M, h), ("layers", "experts", "mlp", "embed"))]
        if S:
            blocks += [("moe_shared_w1", (n_moe, h, S), ("layers", "embed", "mlp")),
                       ("moe_shared_w2", (n_moe, S, h), ("layers", "mlp", "embed"))]
    out = [Leaf("wte", (V, h), ROW_TABLE), Leaf("wpe", (s, h), (None, "embed"))]
    out += [Leaf(f"blocks/{n}", shape, lg) for n, shape, lg in blocks]
    out += [Leaf("lnf_scale", (h,), ("embed",)), Leaf("lnf_bias", (h,), ("embed",)),
            Leaf("head", (h, V), ("embed", "vocab"))]
    return tuple(out)


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int, mlp: int | None = None,
        name: str = "gpt", *, experts: int = 0, top_k: int = 2, capacity_factor: float | None = 1.25,
        moe_every: int = 1, expert_mlp: int | None = None, shared_mlp: int = 0) -> ModelSpec:
    """jaxpar's GPT from numbers (``mlp`` defaults to ``4 * hidden``); ``experts > 0`` makes every
    ``moe_every``-th layer a mixture of experts (see the module doc; ``expert_mlp`` defaults to ``mlp``).

    Args:
      layers: transformer layers.
      hidden: the hidden size.
      heads: attention heads.
      seq: the sequence length.
      vocab: the vocabulary size.
      batch: the global batch in sequences.
      mlp: the MLP's hidden size, or ``None`` for ``4 * hidden``.
      name: the model's name.
      experts: experts per MoE layer (0: dense).
      top_k: experts per token.
      capacity_factor: buffer slots per expert relative to an even split; ``None``: dropless.
      moe_every: every how many layers one is MoE.
      expert_mlp: one expert's MLP size, or ``None`` for ``mlp``.
      shared_mlp: the shared experts' MLP size (0: none).

    Returns:
      The :class:`ModelSpec`.

    >>> gpt(layers=2, hidden=32, heads=8, seq=16, vocab=64, batch=16).n_params
    29824
    >>> moe = gpt(layers=2, hidden=32, heads=8, seq=16, vocab=64, batch=16, experts=4)
    >>> moe.n_params == 29824 - 2 * (2 * 32 * 128 + 128 + 32) + 2 * (4 * 2 * 32 * 128 + 32 * 4)  # 4 x (w1, w2), router
    True
    """
    spec = ModelSpec(layers, hidden, heads, seq, vocab, batch, mlp or 0, name=name, experts=experts, top_k=top_k,
                     capacity_factor=capacity_factor, moe_every=moe_every, expert_mlp=expert_mlp or 0,
                     shared_mlp=shared_mlp)
    return replace(spec, leaves=_gpt_leaves(layers, hidden, heads, seq, vocab, spec.mlp, spec))


def _decoder_leaves(m: ModelSpec, qk_norm: bool, sandwich_norms: bool) -> tuple[Leaf, ...]:
    """The parameters of :class:`jaxpar.models.Decoder` (:data:`jaxpar.models._decoder.LAYER_LOGICAL`), by path."""
    L, h, H, K, D, f = m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.mlp
    blocks = {"attn_norm": ((h,), ("embed",)), "mlp_norm": ((h,), ("embed",)),
              "wq": ((H, D, h), ("heads", "kv", "embed")), "wk": ((K, D, h), ("kv_heads", "kv", "embed")),
              "wv": ((K, D, h), ("kv_heads", "kv", "embed")), "wo": ((h, H, D), ("embed", "heads", "kv"))}
    if qk_norm:
        blocks.update(q_norm=((D,), ("kv",)), k_norm=((D,), ("kv",)))
    if sandwich_norms:
        blocks.update(attn_out_norm=((h,), ("embed",)), mlp_out_norm=((h,), ("embed",)))
    if m.experts:
        X, M = m.experts, m.expert_mlp
        blocks.update(router=((h, X), ("embed", None)), experts_gate=((X, h, M), ("experts", "embed", "mlp")),
                      experts_up=((X, h, M), ("experts", "embed", "mlp")),
                      experts_down=((X, M, h), ("experts", "mlp", "embed")))
    else:
        blocks.update(w_gate=((f, h), ("mlp", "embed")), w_up=((f, h), ("mlp", "embed")),
                      w_down=((h, f), ("embed", "mlp")))
    out = [Leaf("embed", (m.vocab, h), ROW_TABLE), Leaf("norm", (h,), ("embed",))]
    out += [Leaf(f"layers/{n}", (L,) + shape, ("layers",) + lg) for n, (shape, lg) in blocks.items()]
    if not m.tied:
        out.append(Leaf("lm_head", (m.vocab, h), ("vocab", "embed"), head=True))
    return tuple(sorted(out, key=lambda l: l.name))


def decoder(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int, mlp: int, *,
            kv_heads: int | None = None, head_dim: int | None = None, tied: bool = False, qk_norm: bool = False,
            sandwich_norms: bool = False, experts: int = 0, top_k: int = 2, capacity_factor: float | None = None,
            expert_mlp: int | None = None, loss_chunks: int = 1, name: str = "decoder") -> ModelSpec:
    """jaxpar's :class:`~jaxpar.models.Decoder` (Llama-3, Qwen3, Qwen3-MoE, Gemma-3) from numbers: grouped-query
    attention, a gated MLP (or gated experts in every layer), RMSNorm, RoPE (no position table), a tied or
    untied head; its leaves have the Decoder's paths and logical names.

    Args:
      layers, hidden, heads, seq, vocab, batch: as for :func:`gpt`.
      mlp: the gated MLP's hidden size (``intermediate_size``).
      kv_heads: K/V heads (None: ``heads``).
      head_dim: the size of a head (None: ``hidden // heads``).
      tied: the head is the token table (``tie_word_embeddings``).
      qk_norm: RMS norms on the queries and keys (Qwen3, Gemma-3).
      sandwich_norms: norms on each half's output (Gemma-3).
      experts: routed experts per layer (0: dense; Qwen3-MoE: every layer's MLP).
      top_k: experts per token.
      capacity_factor: slots per expert relative to an even split; None: dropless (the Decoder's default).
      expert_mlp: one expert's hidden size (None: ``mlp``).
      loss_chunks: pieces of the vocabulary the loss runs over (``DecoderConfig.loss_chunks``).
      name: the model's name.

    Returns:
      The :class:`ModelSpec`.

    >>> m = decoder(layers=2, hidden=64, heads=8, seq=32, vocab=128, batch=4, mlp=160, kv_heads=2, head_dim=16)
    >>> m.leaf("layers/wk").shape, m.leaf("layers/wk").logical
    ((2, 2, 16, 64), ('layers', 'kv_heads', 'kv', 'embed'))
    >>> m.n_layer_params == 2 * (64 * 2 * (128 + 32) + 3 * 64 * 160 + 2 * 64)     # q, k, v, o; gate, up, down; norms
    True
    """
    spec = ModelSpec(layers, hidden, heads, seq, vocab, batch, mlp, name=name, experts=experts, top_k=top_k,
                     capacity_factor=capacity_factor, expert_mlp=expert_mlp or 0, kv_heads=kv_heads or 0,
                     head_dim=head_dim or 0, gated=True, tied=tied, positions=False, biases=False,
                     kernel_layout="out_in", column_regions=True, loss_chunks=loss_chunks)
    return replace(spec, leaves=_decoder_leaves(spec, qk_norm, sandwich_norms))


def from_decoder_config(cfg: Any, *, seq: int, batch: int, name: str = "decoder") -> ModelSpec:
    """The :func:`decoder` of a :class:`jaxpar.models.DecoderConfig` (what :mod:`jaxpar.hf` reads from a
    ``config.json``), without weights (nothing is traced or imported).

    Args:
      cfg: the decoder's config.
      seq: the sequence length.
      batch: the global batch in sequences.
      name: the model's name.

    Returns:
      The :class:`ModelSpec`.

    >>> from jaxpar.models import DecoderConfig
    >>> cfg = DecoderConfig(vocab=128256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336)
    >>> round(from_decoder_config(cfg, seq=8192, batch=8).n_params / 1e9, 3)          # Llama-3-8B
    8.03
    """
    moe = {} if cfg.moe is None else dict(experts=cfg.moe.experts, top_k=cfg.moe.top_k, expert_mlp=cfg.moe.mlp,
                                          capacity_factor=cfg.moe.capacity_factor)
    return decoder(cfg.layers, cfg.embed, cfg.heads, seq, cfg.vocab, batch, cfg.mlp, kv_heads=cfg.kv_heads,
                   head_dim=cfg.head_dim, tied=cfg.tie_embeddings, qk_norm=cfg.qk_norm,
                   sandwich_norms=cfg.sandwich_norms, loss_chunks=cfg.loss_chunks, name=name, **moe)


def from_nnx(model_fn: Callable[[], Any], *, layers: int, hidden: int, heads: int, seq: int, vocab: int,
             batch: int, mlp: int | None = None, name: str = "model") -> ModelSpec:
    """Parameters and logical axes of an NNX model, read with ``jax.eval_shape`` (nothing allocated).

    ``model_fn`` builds the model (as for :func:`jaxpar.init_train_state`); the sizes that the
    parameters do not tell (context, batch, ...) are given. Imports JAX.

    Args:
      model_fn: builds the NNX model, with no arguments.
      layers, hidden, heads, seq, vocab, batch, mlp, name: as for :func:`gpt`.

    Returns:
      The :class:`ModelSpec`, its leaves read from the model.

    >>> from flax import nnx
    >>> from jaxpar.models._gpt import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=2)
    >>> m = from_nnx(lambda: GPT(cfg, rngs=nnx.Rngs(0)), layers=2, hidden=32, heads=8, seq=16, vocab=64, batch=16)
    >>> m.n_params == gpt(2, 32, 8, 16, 64, 16).n_params, m.leaf("blocks/wq").logical
    (True, ('layers', 'embed', 'heads', 'kv'))
    """
    import jax

    from jaxpar.adapters._mesh_axes import abstract_model
    from jaxpar.rules import path_str

    _, shapes, logical = abstract_model(model_fn)
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_logical = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, tuple) or x is None)[0]
    by_path = {path_str(p): (tuple(lg) if lg is not None else ()) for p, lg in flat_logical}
    leaves = []
    for path, a in flat_shapes:
        key = path_str(path)
        lg = tuple(by_path.get(key, ())) or (None,) * len(a.shape)
        leaves.append(Leaf(key, tuple(int(d) for d in a.shape), lg + (None,) * (len(a.shape) - len(lg))))
    spec = ModelSpec(layers, hidden, heads, seq, vocab, batch, mlp or 0, name=name)
    return replace(spec, leaves=tuple(leaves))
