"""Aux-loss-free load balancing (DeepSeek-V3) in the train step: a router bias per MoE layer, kept in
``TrainState.stats["router_bias"]``: the state part :func:`router_bias` (``init_train_state(parts=[...])``;
:func:`with_router_bias` adds it to a state made without it). The part installs the bias around the loss
(:func:`jaxpar.parallel.moe.use_router_bias`) for every runner, and after each step moves each layer's bias by
``rate`` towards balance from that layer's load over the whole step (:func:`balanced_bias`; the rule and what
the compatibility table refuses: docs/strategies.md).

>>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
>>> from flax import nnx
>>> from jaxpar.models._gpt import GPT, GPTConfig, MoESettings, lm_loss
>>> cfg = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2, moe=MoESettings(experts=4, bias_rate=0.001))
>>> mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
>>> state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh)
>>> state, layout = with_router_bias(state, layout, (2, 4), rate=0.001)      # 2 MoE layers, 4 experts
>>> step = jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout)
>>> tokens = jnp.arange(32).reshape(4, 8)
>>> state, metrics = step(state, {"tokens": tokens, "targets": tokens})
>>> bias = np.asarray(state.stats["router_bias"])       # +-rate: below / above the mean load
>>> bias.shape, sorted({round(float(b), 6) for b in bias.ravel()}) in ([-0.001, 0.001], [-0.001, 0.0, 0.001])
((2, 4), True)
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.compat import Setting, raise_problems
from jaxpar.errors import is_number
from jaxpar.parallel.moe import LAYER_LOADS, MoEError, update_router_bias, use_router_bias
from jaxpar.step._state import PartLayout, add_parts, stats_part

#: The key of the router bias in ``TrainState.stats``.
KEY = "router_bias"


def router_bias(shape: tuple[int, ...], *, rate: float) -> PartLayout:
    """The router bias as a state part: a zero bias of ``shape`` in ``stats["router_bias"]`` (replicated),
    installed around the loss (:func:`jaxpar.parallel.moe.use_router_bias`) and moved by ``rate`` towards
    balance after every step: ``init_train_state(..., parts=[router_bias(shape, rate=...)])``.

    Args:
      shape: ``(MoE layers, experts)`` (the GPT: ``(layers // moe.every, moe.experts)``).
      rate: the bias step per train step, a number > 0 (DeepSeek-V3: 0.001); required.

    Returns:
      The part.

    Raises:
      MoEError: naming a bad shape or rate.
    """
    return _part(shape, rate, "router_bias")


def _part(shape: Any, rate: Any, owner: str) -> PartLayout:
    shape = tuple(shape)
    if len(shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise MoEError(f"{owner}(shape={shape!r}): give (MoE layers, experts), two positive ints.")
    if not is_number(rate) or not rate > 0:
        raise MoEError(f"{owner}(rate={rate!r}): the bias step must be a number > 0 (DeepSeek-V3: 0.001); a "
                       "model that does not balance with a bias is built without this part.")
    after = lambda bias, batch, metrics, measured, replicas: (balanced_bias(bias, metrics, rate), metrics)  # noqa
    return stats_part(KEY, lambda: jnp.zeros(shape, jnp.float32), options=rate, setting={"router_bias_rate": rate},
                      after_step=after, install=use_router_bias, after_trace=_read)


def _read(moe: Any) -> None:
    """A router bias kept in the state must be read by the loss."""
    if not moe.router_bias:
        raise MoEError("the train state keeps a router bias (aux-loss-free balancing: with_router_bias), but the loss "
                       "never read it, so it would move without steering any choice. Build the MoE layers with "
                       "jaxpar.parallel.moe.MoE(..., router_bias=True) (the GPT: GPTConfig.moe.bias_rate > 0), or build the "
                       "state without it.")


def with_router_bias(state: Any, layout: Any, shape: tuple[int, ...], *, rate: float) -> tuple[Any, Any]:
    """``(state, layout)`` with the :func:`router_bias` part added to a state made without it (call it before
    restoring a checkpoint); ``make_train_step`` reads the rate from the layout.

    Args:
      state: the train state.
      layout: its layout.
      shape: as in :func:`router_bias`.
      rate: as in :func:`router_bias`.

    Returns:
      The state and layout with ``stats["router_bias"] = zeros(shape)``.

    Raises:
      MoEError: naming a bad shape or rate, or a strategy that cannot move the bias (the
        compatibility table's RB pairs: PipeDream's no-flush schedules, replicas).
    """
    part = _part(shape, rate, "with_router_bias")
    raise_problems(Setting(layout.strategy, dict(layout.mesh.shape), **part.setting))   # the RB pairs
    return add_parts(state, layout, [part])


def balanced_bias(bias: jax.Array, metrics: dict, rate: float) -> jax.Array:
    """The bias after a step whose metrics hold the loss's reported loads, ``metrics[LAYER_LOADS]``.

    Args:
      bias: ``stats["router_bias"]`` before the step, ``[layers, E]``.
      metrics: the step's metrics (what the loss reported, averaged).
      rate: the bias step.

    Returns:
      Each layer's bias moved by ``rate`` towards balance.

    Raises:
      MoEError: the loss reported no loads, or loads of another shape than the bias.
    """
    loads = metrics.get(LAYER_LOADS)
    if loads is None or tuple(loads.shape) != tuple(bias.shape):
        got = "no loads" if loads is None else f"loads of shape {tuple(loads.shape)}"
        raise MoEError(f"the train state keeps a router bias of shape {tuple(bias.shape)} (with_router_bias), but the "
                       f"loss reported {got} ({LAYER_LOADS!r}): one row per MoE call of the forward. Give with_router_bias "
                       "the shape (MoE layers, experts) of the model's MoE(router_bias=True) layers (the GPT's: "
                       "(layers // moe.every, experts)), or build the state without it.")
    return jax.vmap(update_router_bias, in_axes=(0, 0, None))(bias, loads, rate)
