"""Where each parameter of a :class:`~jaxpar.models.Decoder` lies in a Hugging Face checkpoint.

Every parameter has a :class:`TensorMap`: the key template of the file tensors it is made of, the
template fields that become its leading axes (``layer``; ``layer`` and ``expert`` for experts
stored one per key), and how one file tensor becomes one element: a part of it (the gate or up half
of a fused ``gate_up_proj``), a row-major reshape (``q_proj [heads * head_dim, embed]`` as
``[heads, head_dim, embed]``) and a transpose (the experts, which :func:`jaxpar.parallel.moe.moe_apply`
holds as ``[in, out]``). These are exact rearrangements: values are never changed, so an export
writes back the very bytes it read.

>>> from jaxpar.models import DecoderConfig
>>> cfg = DecoderConfig(vocab=11, embed=8, layers=2, heads=2, kv_heads=1, head_dim=4, mlp=12)
>>> m = tensor_maps(cfg, "llama")
>>> m[("layers", "wq")]
TensorMap(key='model.layers.{layer}.self_attn.q_proj.weight', file=(8, 8), stack=('layer',), view=(2, 4, 8),
          perm=None, part=None)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from jaxpar.models._decoder import DecoderConfig

#: How a checkpoint stores a layer's experts: one key per expert and projection, or fused 3-D tensors.
EXPERT_LAYOUTS = ("per_expert", "fused")


@dataclass(frozen=True)
class TensorMap:
    """One parameter's place in the checkpoint.

    Attributes:
      key: the key template, e.g. ``"model.layers.{layer}.mlp.up_proj.weight"``.
      file: the file tensor's shape.
      stack: the template's fields, outermost first, that are the parameter's leading axes.
      view: the file tensor (after ``part``) reshaped row-major to this shape (``None``: as it is).
      perm: then transposed by this permutation (``None``: not).
      part: ``(axis, start, size)``: the parameter takes this range of the file tensor's axis.
    """

    key: str
    file: tuple[int, ...]
    stack: tuple[str, ...] = ()
    view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    part: tuple[int, int, int] | None = None

    def keys(self, counts: dict[str, int]) -> list[str]:
        """Every file key, for ``counts`` of the stacked fields (e.g. ``{"layer": 4}``).

        Args:
          counts: the size of each field in :attr:`stack`.

        Returns:
          The keys, last field fastest.
        """
        ranges = [range(counts[f]) for f in self.stack]
        return [self.key.format(**dict(zip(self.stack, c))) for c in itertools.product(*ranges)]

    @property
    def taken(self) -> tuple[int, ...]:
        """The shape of the part of the file tensor the parameter takes (``file`` without ``part``)."""
        if self.part is None:
            return self.file
        axis, _, size = self.part
        return self.file[:axis] + (size,) + self.file[axis + 1:]


def _norm_keys(family: str) -> dict[str, str]:
    if family == "gemma3_text":
        return {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def tensor_maps(cfg: DecoderConfig, family: str, experts_layout: str = "per_expert") -> dict[tuple, TensorMap]:
    """The :class:`TensorMap` of every parameter of ``Decoder(cfg)``, by its path in the parameter dict.

    Args:
      cfg: the decoder's config.
      family: the checkpoint's ``model_type``.
      experts_layout: one of :data:`EXPERT_LAYOUTS` (Qwen3-MoE).

    Returns:
      ``{("layers", "wq"): TensorMap(...), ("embed",): ..., ...}``.
    """
    layer = "model.layers.{layer}."
    H, K, D, E = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.embed
    V, F = cfg.vocab, cfg.mlp
    maps = {("embed",): TensorMap("model.embed_tokens.weight", (V, E)), ("norm",): TensorMap("model.norm.weight", (E,))}
    if not cfg.tie_embeddings:
        maps[("lm_head",)] = TensorMap("lm_head.weight", (V, E))

    def add(name: str, key: str, file: tuple[int, ...], **kw: Any) -> None:
        maps[("layers", name)] = TensorMap(layer + key, file, ("layer",), **kw)

    for name, hf in _norm_keys(family).items():
        if name in ("attn_norm", "mlp_norm") or cfg.sandwich_norms:
            add(name, f"{hf}.weight", (E,))
    add("wq", "self_attn.q_proj.weight", (H * D, E), view=(H, D, E))
    add("wk", "self_attn.k_proj.weight", (K * D, E), view=(K, D, E))
    add("wv", "self_attn.v_proj.weight", (K * D, E), view=(K, D, E))
    add("wo", "self_attn.o_proj.weight", (E, H * D), view=(E, H, D))
    if cfg.qk_norm:
        add("q_norm", "self_attn.q_norm.weight", (D,))
        add("k_norm", "self_attn.k_norm.weight", (D,))
    if cfg.moe is None:
        for name, proj, file in (("w_gate", "gate_proj", (F, E)), ("w_up", "up_proj", (F, E)),
                                 ("w_down", "down_proj", (E, F))):
            add(name, f"mlp.{proj}.weight", file)
        return maps
    X, M = cfg.moe.experts, cfg.moe.mlp
    add("router", "mlp.gate.weight", (X, E), perm=(1, 0))
    if experts_layout == "fused":
        add("experts_gate", "mlp.experts.gate_up_proj", (X, 2 * M, E), perm=(0, 2, 1), part=(1, 0, M))
        add("experts_up", "mlp.experts.gate_up_proj", (X, 2 * M, E), perm=(0, 2, 1), part=(1, M, M))
        add("experts_down", "mlp.experts.down_proj", (X, E, M), perm=(0, 2, 1))
        return maps
    for name, proj, file in (("experts_gate", "gate_proj", (M, E)), ("experts_up", "up_proj", (M, E)),
                             ("experts_down", "down_proj", (E, M))):
        maps[("layers", name)] = TensorMap(layer + "mlp.experts.{expert}." + proj + ".weight", file,
                                           ("layer", "expert"), perm=(1, 0))
    return maps


def stack_counts(cfg: DecoderConfig) -> dict[str, int]:
    """The sizes of the stacked template fields.

    Args:
      cfg: the model's config.

    Returns:
      ``{"layer": layers, "expert": experts (0 without MoE)}``.
    """
    return {"layer": cfg.layers, "expert": cfg.moe.experts if cfg.moe else 0}
