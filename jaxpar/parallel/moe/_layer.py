"""The MoE layer: a pure function of a parameter dict, and a small Flax NNX module around it.

``moe_apply(params, x)`` routes (:func:`~jaxpar.parallel.moe.route`), dispatches to the experts
(:func:`~jaxpar.parallel.moe.dispatch_combine`: dense on one device, expert parallel under a mesh
whose rules shard ``experts``), adds the shared experts and returns ``(y, MoEStats)``. The losses are
in the statistics, unweighted: the model adds ``aux_weight * stats.aux_loss + z_weight *
stats.z_loss`` to its loss.

Parameters (logical names in :data:`MOE_LOGICAL`): ``router[D, E]``, expert weights ``w1[E, D, M]`` and
``w2[E, M, D]`` stacked on a leading ``experts`` axis, optional shared experts ``shared_w1[D, S]``,
``shared_w2[S, D]`` (an always-on MLP) and the aux-loss-free balancing bias ``router_bias[E]``
(selection only). A layer built with ``router_bias=True`` keeps no bias of its own: inside a train
step it reads its row of the bias the train state keeps (:func:`jaxpar.step.with_router_bias`, one
row per MoE call in the order the forward runs them), which the step moves by the step's loads.

**Gated experts** (Mixtral, Qwen2/3-MoE, DeepSeek): with ``w3[E, D, M]`` (named and split like ``w1``)
an expert computes ``(act(x w1) * (x w3)) w2``: ``w1`` is the gate projection, ``w3`` the up projection
and ``w2`` the down projection (Mixtral's ``w1``/``w3``/``w2``; Hugging Face Qwen3-MoE's ``gate_proj``,
``up_proj``, ``down_proj``, transposed to ``[in, out]``). ``shared_w3[D, S]`` gates the shared experts
alike. ``act`` is ``moe_apply``'s ``activation``: ``"gelu"`` (the default) or ``"silu"`` (SwiGLU, what
those models use). Without ``w3`` an expert is ``act(x w1) w2``.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> layer = MoE(embed=4, mlp=8, experts=4, top_k=2, capacity_factor=None, rngs=nnx.Rngs(0))
>>> layer.w1.shape, layer.w1.out_sharding
((4, 4, 8), ('experts', 'embed', 'mlp'))
>>> y, stats = layer(jnp.ones((2, 3, 4)))                 # (batch, length, embed): a group per row
>>> y.shape, int(stats.load.sum()), int(stats.dropped)    # 2 * 3 tokens, 2 choices each, dropless
((2, 3, 4), 12, 0)
"""

from __future__ import annotations

import contextvars
from typing import Any, ContextManager

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.parallel.moe._balance import site_balance, step_bias
from jaxpar.rules import constrain, scoped
from jaxpar.parallel.moe._dispatch import activation_fn, dispatch_combine, gated_hidden
from jaxpar.parallel.moe._routing import MoEError, MoEStats, check_options, route, routing_stats

#: Logical names of the layer's parameters (a model that stacks layers adds a leading ``layers``).
MOE_LOGICAL = {
    "router": ("embed", None), "router_bias": (None,),
    "w1": ("experts", "embed", "mlp"), "w2": ("experts", "mlp", "embed"),
    "w3": ("experts", "embed", "mlp"),
    "shared_w1": ("embed", "mlp"), "shared_w2": ("mlp", "embed"), "shared_w3": ("embed", "mlp"),
}


class MoECalls:
    """What a traced loss did: how many MoE layers it ran, and whether it read the step's router bias
    (:func:`router_bias`)."""

    def __init__(self):
        self.layers, self.router_bias = 0, False


_CALLS: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_calls", default=None)


def count_moe_calls() -> ContextManager[MoECalls]:
    """Record the MoE layers run while tracing in this context.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = MoE(embed=4, mlp=8, experts=4, top_k=1, capacity_factor=None, rngs=nnx.Rngs(0))
    >>> with count_moe_calls() as calls:
    ...     _ = layer(jnp.ones((1, 2, 4)))
    >>> calls.layers
    1
    """
    return scoped(_CALLS, MoECalls())


def router_bias() -> Any:
    """The bias of :func:`~jaxpar.parallel.moe.use_router_bias` (``None`` outside it); the step checks that a loss reads the
    bias it keeps.

    >>> import jax.numpy as jnp
    >>> from jaxpar.parallel.moe import use_router_bias
    >>> with use_router_bias(jnp.zeros((2, 4))):
    ...     router_bias().shape
    (2, 4)
    """
    bias = step_bias()
    calls = _CALLS.get()
    if calls is not None and bias is not None:
        calls.router_bias = True
    return bias


def need_router_bias(setting: str, off: str = "set the rate to 0") -> None:
    """A model that balances with a router bias says so by calling this while it traces.

    Args:
      setting: the model's option that asks for the bias, e.g. ``"GPTConfig.moe.bias_rate=0.001"``.
      off: how to turn that option off, for the message.

    Raises:
      MoEError: inside a step's trace without a bias (:func:`~jaxpar.parallel.moe.use_router_bias`), naming ``setting``.
    """
    if _CALLS.get() is not None and step_bias() is None:
        raise MoEError(f"{setting} balances the experts with a router bias kept in the train state, and this state "
                       "has none. Add it: state, layout = jaxpar.step.with_router_bias(state, layout, "
                       f"(moe_layers, experts), rate=...) (jaxpar train does), or {off}.")


def shared_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array | None = None, *,
               activation: str = "gelu") -> jax.Array:
    """The shared experts: one MLP on every token, ``act(x w1) w2``, or gated ``(act(x w1) * (x w3)) w2``.

    Args:
      x: tokens ``[G, T, D]``.
      w1: ``[D, S]``, the gate projection when ``w3`` is given.
      w2: ``[S, D]``, the down projection.
      w3: optional ``[D, S]`` up projection.
      activation: a key of :data:`~jaxpar.parallel.moe.ACTIVATIONS`.

    Returns:
      ``[G, T, D]``.
    """
    h = constrain(gated_hidden("gtd,ds->gts", x, w1, w3, activation), ("batch", "length", "mlp"))
    return constrain(jnp.einsum("gts,sd->gtd", h, w2), ("batch", "length", "embed"))


def _check_params(params: dict[str, jax.Array]) -> None:
    """An :class:`MoEError` for an up projection without its gate projection or of another shape."""
    for up, gate in (("w3", "w1"), ("shared_w3", "shared_w1")):
        if up in params and (gate not in params or params[up].shape != params[gate].shape):
            got = tuple(params[gate].shape) if gate in params else "none"
            raise MoEError(f"params[{up!r}] (the up projection of gated experts) has shape {tuple(params[up].shape)}; "
                           f"it must be shaped like the gate projection params[{gate!r}] (got {got}).")


def moe_apply(params: dict[str, jax.Array], x: jax.Array, *, top_k: int = 2, gate: str = "softmax",
              capacity_factor: float | None = None, normalize: bool = True,
              balance_load: jax.Array | None = None, activation: str = "gelu",
              router_bias: bool = False) -> tuple[jax.Array, MoEStats]:
    """The MoE layer on ``x[G, T, D]`` (``G`` groups = batch rows, ``T`` tokens each).

    Args:
      params: ``router``, ``w1``, ``w2``, optionally ``w3`` (gated experts: ``w1`` the gate, ``w3`` the up
        projection); optionally ``shared_w1`` and ``shared_w2`` (and ``shared_w3``: gated), and
        ``router_bias`` (selection only, no gradient).
      x: tokens.
      top_k: experts per token.
      gate: ``"softmax"`` or ``"sigmoid"``.
      capacity_factor: slots per group and expert ``min(T, ceil(cf * T * top_k / E))``; None: dropless.
      normalize: normalise the top-k combine weights to sum to 1.
      balance_load: optional ``[E]`` load of the whole step for the aux loss's ``f`` (micro-batches:
        see :func:`~jaxpar.parallel.moe.routing_stats`); by default, inside a train step, the
        step's load of this call (:mod:`jaxpar.parallel.moe._balance`: the call also reports its own
        load there), else this call's own load.
      activation: the experts' (and shared experts') activation, ``"gelu"`` (``jax.nn.gelu``, tanh
        approximation) or ``"silu"``.
      router_bias: choose the experts by ``scores + bias`` with this call's row of the router bias
        the train state keeps (:func:`jaxpar.step.with_router_bias`; inside a step that has none, an
        :class:`MoEError`); outside a step, no bias. ``params["router_bias"]``, if given, is used instead.

    Returns:
      ``(y[G, T, D], stats)``; ``y`` is the routed experts' output plus the shared experts'.
    """
    _check_params(params)
    calls = _CALLS.get()
    if calls is not None:
        calls.layers += 1
    step_load, tap, record, site_bias = site_balance(params["router"].shape[-1])
    bias = params.get("router_bias")
    if router_bias and bias is None:
        need_router_bias("MoE(router_bias=True)", "build the layers with router_bias=False")
        bias = site_bias
        if calls is not None and bias is not None:
            calls.router_bias = True
    r = route(x, params["router"], top_k=top_k, gate=gate, capacity_factor=capacity_factor, normalize=normalize,
              bias=None if bias is None else jax.lax.stop_gradient(bias))
    y = dispatch_combine(x, r.expert, r.slot, r.weight, params["w1"], params["w2"], capacity=r.capacity,
                         w3=params.get("w3"), activation=activation)
    if "shared_w1" in params:
        y = y + shared_mlp(x, params["shared_w1"], params["shared_w2"], params.get("shared_w3"), activation=activation)
    stats = routing_stats(r, step_load if balance_load is None else balance_load)
    record(stats.load)
    return y, stats if tap is None else stats._replace(aux_loss=stats.aux_loss + tap)


def _normal(rngs: nnx.Rngs, shape, logical, std) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=logical)


class MoE(nnx.Module):
    """A mixture-of-experts MLP: ``experts`` MLPs ``embed -> mlp -> embed``, top-k routed.

    Args:
      embed, mlp, experts: sizes ``D``, ``M``, ``E``.
      top_k, gate, capacity_factor, normalize, activation: as :func:`moe_apply`.
      gated: gated experts: an up projection ``w3`` (and ``shared_w3`` with shared experts); with
        ``activation="silu"`` the SwiGLU experts of Mixtral / Qwen3-MoE / DeepSeek.
      shared_mlp: hidden size ``S`` of the shared experts (0: none).
      router_bias: balance the experts with the router bias the train state keeps (aux-loss-free:
        :func:`jaxpar.step.with_router_bias`), this layer's row of it (see :func:`moe_apply`).
      init_std: standard deviation of the initial weights.
      rngs: Flax random streams.
    """

    def __init__(self, embed: int, mlp: int, experts: int, *, top_k: int = 2, gate: str = "softmax",
                 capacity_factor: float | None = None, normalize: bool = True, shared_mlp: int = 0,
                 router_bias: bool = False, gated: bool = False, activation: str = "gelu", init_std: float = 0.02,
                 rngs: nnx.Rngs):
        check_options(experts, top_k, gate, capacity_factor)
        activation_fn(activation)
        self.options = dict(top_k=top_k, gate=gate, capacity_factor=capacity_factor, normalize=normalize,
                            activation=activation, router_bias=router_bias)
        D, M, E, S = embed, mlp, experts, shared_mlp
        with nnx.use_eager_sharding(False):     # jaxpar places the state (as the GPT does)
            self.router = _normal(rngs, (D, E), MOE_LOGICAL["router"], init_std)
            self.w1 = _normal(rngs, (E, D, M), MOE_LOGICAL["w1"], init_std)
            self.w2 = _normal(rngs, (E, M, D), MOE_LOGICAL["w2"], init_std)
            self.shared_w1 = _normal(rngs, (D, S), MOE_LOGICAL["shared_w1"], init_std) if S else None
            self.shared_w2 = _normal(rngs, (S, D), MOE_LOGICAL["shared_w2"], init_std) if S else None
            # drawn last: the other weights are those of the same layer without gating
            self.w3 = _normal(rngs, (E, D, M), MOE_LOGICAL["w3"], init_std) if gated else None
            self.shared_w3 = _normal(rngs, (D, S), MOE_LOGICAL["shared_w3"], init_std) if gated and S else None

    def params(self) -> dict[str, Any]:
        """The arrays :func:`moe_apply` takes."""
        names = ("router", "w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3")
        return {n: getattr(self, n)[...] for n in names if getattr(self, n) is not None}

    def __call__(self, x: jax.Array, balance_load: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
        return moe_apply(self.params(), x, **self.options, balance_load=balance_load)
