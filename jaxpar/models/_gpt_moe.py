"""The GPT's mixture-of-experts blocks: every ``every``-th MLP replaced by a routed MoE layer.

``GPTConfig(moe=MoESettings(experts=8, top_k=2, capacity_factor=1.25, every=2))`` groups the layers
``every`` at a time: a group is ``every`` attention halves, ``every - 1`` dense MLPs and one MoE MLP
(:func:`jaxpar.parallel.moe.moe_apply`), so that the groups are alike and stack on the ``layers`` axis (scans
and ZeRO see ``layers / every`` stacked units). The experts' weights carry the ``experts``
logical axis, which an ``expert`` mesh axis splits (expert parallelism: two all-to-alls per MoE layer
forward, two backward).

The groups carry the routing statistics beside the residual stream; :func:`run_moe_blocks` returns
their sums over the MoE layers (:class:`MoEStats`: the load-balancing and z losses, the load per
expert, the dropped assignments, the router entropy), and the GPT's ``lm_loss`` adds
``aux_weight * aux_loss + z_weight * z_loss``. Inside a train step the MoE layers report their loads
and balance with the whole step's themselves (:mod:`jaxpar.parallel.moe._balance`): the model has no
part in it.

>>> import jax.numpy as jnp
>>> s = MoESettings(experts=4, top_k=2, every=2)
>>> s.check(layers=4), s.moe_layers(4)
(None, 2)
>>> MoESettings(experts=4, every=3).check(layers=4)
Traceback (most recent call last):
...
jaxpar.errors.MoEError: model.moe.every=3 must divide model.layers=4: the layers are grouped every=3 at a time (...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.adapters._blocks import run_layers
from jaxpar.errors import is_number
from jaxpar.parallel.moe import MoEError, MoEStats, check_options, load_cv, moe_apply
from jaxpar.rules import constrain
from jaxpar.models._gpt_layers import BLOCK_LOGICAL, RESIDUAL, attention_apply, layer_norm, mlp_apply, param, zeros

_ATTENTION = ("ln1_scale", "ln1_bias", "wq", "wk", "wv", "wo", "ln2_scale", "ln2_bias")
_MLP = ("w1", "b1", "w2", "b2")

#: Logical names of one group's parameters (the stacked arrays add a leading ``layers``): the
#: attention halves and dense MLPs get a sub-layer axis (unsplit), the MoE layer its ``experts`` axis.
MOE_BLOCK_LOGICAL = {
    **{k: (None,) + BLOCK_LOGICAL[k] for k in _ATTENTION + _MLP},
    "router": ("embed", None), "experts_w1": ("experts", "embed", "mlp"), "experts_w2": ("experts", "mlp", "embed"),
    "shared_w1": ("embed", "mlp"), "shared_w2": ("mlp", "embed"),
}


@dataclass(frozen=True)
class MoESettings:
    """The GPT's mixture of experts (``model.moe`` in YAML).

    Args:
      experts: routed experts per MoE layer.
      top_k: experts per token (1 or 2 usually).
      capacity_factor: slots per batch row and expert ``ceil(cf * T * top_k / E)``; ``None`` (the default):
        dropless, what Hugging Face MoE models compute.
      every: every ``every``-th MLP is an MoE layer (the last of each group of ``every`` layers).
      gate: ``"softmax"`` or ``"sigmoid"``.
      aux_weight: weight of the load-balancing loss (summed over the MoE layers) in the loss.
      z_weight: weight of the router z-loss.
      shared_mlp: hidden size of the shared experts, an MLP every token goes through besides its
        routed experts (DeepSeek-MoE); 0: none.
      bias_rate: aux-loss-free balancing (DeepSeek-V3): each step moves a per-layer router bias by this
        much towards balance; 0: off. The train state keeps the bias and the step moves it (``jaxpar
        train`` does both; the library: :func:`jaxpar.step.with_router_bias` with
        ``rate=`` this rate).
    """

    experts: int
    top_k: int = 2
    capacity_factor: float | None = None
    every: int = 1
    gate: str = "softmax"
    aux_weight: float = 0.01
    z_weight: float = 0.0
    shared_mlp: int = 0
    bias_rate: float = 0.0

    def check(self, layers: int) -> None:
        """Check the settings against the model's depth.

        Args:
          layers: the model's ``layers``; ``every`` must divide it.

        Raises:
          MoEError: naming the bad setting, its value and the fix.
        """
        check_options(self.experts, self.top_k, self.gate, self.capacity_factor)
        if not isinstance(self.every, int) or self.every < 1 or layers % self.every:
            raise MoEError(f"model.moe.every={self.every!r} must divide model.layers={layers}: the layers are grouped "
                           f"every={self.every} at a time (each group ends with the MoE layer). Fix: every in "
                           f"{[d for d in range(1, layers + 1) if layers % d == 0]}.")
        for name in ("aux_weight", "z_weight", "shared_mlp", "bias_rate"):
            value = getattr(self, name)
            if not is_number(value) or value < 0 or (name == "shared_mlp" and not isinstance(value, int)):
                raise MoEError(f"model.moe.{name}={value!r} must be a{'n int' if name == 'shared_mlp' else ' number'} "
                               ">= 0.")

    def moe_layers(self, layers: int) -> int:
        """The number of MoE layers (groups) among ``layers``.

        Args:
          layers: the model's ``layers``.

        Returns:
          ``layers // every``.
        """
        return layers // self.every


class MoEBlocks(nnx.Module):
    """``layers / every`` groups of decoder layers, parameters stacked on a leading ``layers`` axis."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        moe = cfg.moe
        G, S, E, H, D, M = cfg.layers // moe.every, moe.every, cfg.embed, cfg.heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5
        logical = {k: ("layers",) + v for k, v in MOE_BLOCK_LOGICAL.items()}
        for name in ("ln1_scale", "ln2_scale"):
            setattr(self, name, param(None, (G, S, E), logical[name], 0))
        for name in ("ln1_bias", "ln2_bias"):
            setattr(self, name, zeros((G, S, E), logical[name]))
        for name in ("wq", "wk", "wv"):
            setattr(self, name, param(rngs.params(), (G, S, E, H, D), logical[name], std))
        self.wo = param(rngs.params(), (G, S, H, D, E), logical["wo"], out_std)
        if S > 1:
            self.w1 = param(rngs.params(), (G, S - 1, E, M), logical["w1"], std)
            self.b1 = zeros((G, S - 1, M), logical["b1"])
            self.w2 = param(rngs.params(), (G, S - 1, M, E), logical["w2"], out_std)
            self.b2 = zeros((G, S - 1, E), logical["b2"])
        X = moe.experts
        self.router = param(rngs.params(), (G, E, X), logical["router"], std)
        self.experts_w1 = param(rngs.params(), (G, X, E, M), logical["experts_w1"], std)
        self.experts_w2 = param(rngs.params(), (G, X, M, E), logical["experts_w2"], out_std)
        if moe.shared_mlp:
            self.shared_w1 = param(rngs.params(), (G, E, moe.shared_mlp), logical["shared_w1"], std)
            self.shared_w2 = param(rngs.params(), (G, moe.shared_mlp, E), logical["shared_w2"], out_std)


def empty_stats(experts: int) -> MoEStats:
    """Zero statistics: the start of the sum over MoE layers.

    Args:
      experts: routed experts per MoE layer (the length of ``load``).

    Returns:
      A :class:`MoEStats` of fp32 / int32 zeros, ``load`` of shape ``[experts]``.
    """
    f32 = jnp.zeros((), jnp.float32)
    return MoEStats(aux_loss=f32, z_loss=f32, load=jnp.zeros((experts,), jnp.int32), dropped=jnp.zeros((), jnp.int32),
                    drop_rate=f32, entropy=f32)


class LayerBias(NamedTuple):
    """Carried through the groups: the MoE layer's index and the router bias ``[layers, E]`` it reads its
    row of (:mod:`jaxpar.step._router_bias`)."""

    index: jax.Array
    bias: jax.Array


def moe_group_apply(settings: MoESettings, p: dict[str, jax.Array], carry: tuple) -> tuple:
    """One group: ``every`` attention halves, ``every - 1`` dense MLPs, then the MoE MLP.

    Args:
      settings: the MoE settings.
      p: one group's parameters (:data:`MOE_BLOCK_LOGICAL`'s keys, without the ``layers`` axis).
      carry: ``(x, stats)``, or ``(x, stats, LayerBias)`` with a router bias; ``x`` is the residual
        stream ``[batch, length, embed]``.

    Returns:
      The carry after the group: the MoE layer's statistics added to ``stats``, the bias's index
      moved to the next layer.
    """
    x, stats, *bias = carry
    for j in range(settings.every):
        sub = {k: p[k][j] for k in _ATTENTION}
        x = attention_apply(sub, x)
        if j < settings.every - 1:
            x = mlp_apply({**sub, **{k: p[k][j] for k in _MLP}}, x)
    h = constrain(layer_norm(x, sub["ln2_scale"], sub["ln2_bias"]), ("batch", "length", "embed"))
    moe = {"router": p["router"], "w1": p["experts_w1"], "w2": p["experts_w2"]}
    moe.update({k: p[k] for k in ("shared_w1", "shared_w2") if k in p})
    if bias:
        moe["router_bias"] = bias[0].bias[bias[0].index]
        bias = [bias[0]._replace(index=bias[0].index + 1)]
    y, own = moe_apply(moe, h, top_k=settings.top_k, gate=settings.gate, capacity_factor=settings.capacity_factor)
    x = constrain(x + y.astype(x.dtype), RESIDUAL)
    return (x, jax.tree.map(jnp.add, stats, own), *bias)


def run_moe_blocks(settings: MoESettings, blocks: dict[str, jax.Array], x: jax.Array, *, remat: Any = None,
                   scan: bool = True, router_bias: Any = None) -> tuple[jax.Array, MoEStats]:
    """Run stacked MoE groups over ``x``.

    Args:
      settings: the MoE settings.
      blocks: the groups' stacked parameters.
      x: the residual stream.
      remat: the ``jax.checkpoint`` policy.
      scan: scan the groups (``False``: unrolled).
      router_bias: ``[layers, E]``: each layer chooses its experts by ``scores + bias`` (``None``: none).

    Returns:
      ``(x, stats summed over the MoE layers)``.
    """
    logical = {k: MOE_BLOCK_LOGICAL[k] for k in blocks}
    carry = (x, empty_stats(settings.experts))
    if router_bias is not None:
        carry += (LayerBias(jnp.zeros((), jnp.int32), router_bias),)
    x, stats, *_ = run_layers(lambda p, c: moe_group_apply(settings, p, c), blocks, carry, logical=logical,
                              remat=remat, scan=scan)
    return x, stats


def moe_metrics(stats: MoEStats, moe_layers: int) -> dict[str, jax.Array]:
    """The step's MoE metrics from the statistics summed over the MoE layers.

    Args:
      stats: the statistics summed over the MoE layers (:func:`run_moe_blocks`).
      moe_layers: how many MoE layers were summed.

    Returns:
      ``{"moe/<name>": scalar}``: the means per layer of the losses, the drop rate and the router
      entropy (nats), and the load per expert pooled over the layers as a multiple of the mean load
      (``load_min``, ``load_max``: 1 when balanced) with its coefficient of variation ``load_cv``
      (std / mean).

    >>> s = empty_stats(2)._replace(load=jnp.array([3, 1]), drop_rate=jnp.float32(0.5))
    >>> {k: round(float(v), 3) for k, v in moe_metrics(s, 2).items()}["moe/load_max"]
    1.5
    """
    load = stats.load.astype(jnp.float32)
    relative = load / jnp.maximum(jnp.mean(load), 1.0)
    return {"moe/aux_loss": stats.aux_loss / moe_layers, "moe/z_loss": stats.z_loss / moe_layers,
            "moe/drop_rate": stats.drop_rate / moe_layers, "moe/entropy": stats.entropy / moe_layers,
            "moe/load_min": relative.min(), "moe/load_max": relative.max(), "moe/load_cv": load_cv(load)}
