"""The router: top-k gates, the capacity rule, the balancing losses and the per-call statistics.

Plain ``jnp`` on ``[groups, tokens, ...]``: a group is a batch row, which no strategy splits, so every
quantity is a per-group rule or a mean over the call's tokens (GSPMD reduces it as one device would).

**Gates** (``logits = x @ router`` in float32): ``softmax`` (``p = scores = softmax(logits)``) or
``sigmoid`` (DeepSeek-V3: ``p = scores / sum_e scores``). A token's top-k experts have the largest
``scores + bias`` (ties: the lower index; the aux-loss-free ``bias`` selects only). Their weights are
``scores[top-k]``, divided by their sum when ``normalize``. Dropless, this is Hugging Face's
Qwen3-MoE / Mixtral router (there the logits are multiplied in the model's dtype).

**Capacity** (GShard): ``C = min(T, ceil(capacity_factor * T * k / E))`` per group and expert, or ``T``
(dropless); all first choices of a group go before any second, then by position; a slot ``>= C`` drops.

**Losses** over the call's ``N`` tokens: load balancing ``aux = E * sum_e f_e * P_e`` with
``f_e = load_e / (N k)`` (no gradient) and ``P_e = mean_t p_e(t)`` (:func:`load_balancing_loss`);
the z-loss ``mean_t logsumexp(logits_t)^2``; the router entropy.

>>> import jax.numpy as jnp
>>> x, router = jnp.ones((1, 4, 2)), jnp.array([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
>>> r = route(x, router, top_k=1, capacity_factor=1.5)    # C = ceil(1.5 * 4 * 1 / 3) = 2
>>> r.expert[0, :, 0].tolist(), r.slot[0, :, 0].tolist(), r.kept[0, :, 0].tolist()
([0, 0, 0, 0], [0, 1, 2, 3], [True, True, False, False])
>>> stats = routing_stats(r)
>>> stats.load.tolist(), int(stats.dropped), float(stats.drop_rate)
([4, 0, 0], 2, 0.5)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.parallel.context import in_natural_order, in_sequence_order
from jaxpar.errors import MoEError, finite_number, int_problem

GATES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """Where each token goes: ``[G, T, k]`` arrays in choice-rank order, plus the router's outputs."""

    expert: jax.Array     # int32 [G, T, k]: the chosen experts
    weight: jax.Array     # float32 [G, T, k]: combine weights (as routed; a dropped choice contributes 0)
    slot: jax.Array       # int32 [G, T, k]: position in the expert's buffer of the group
    kept: jax.Array       # bool [G, T, k]: slot < capacity
    logits: jax.Array     # float32 [G, T, E]
    probs: jax.Array      # float32 [G, T, E]: the gate distribution p
    capacity: int         # C, per group and expert (a Python int: it sets shapes)


class MoEStats(NamedTuple):
    """Per-call statistics (arrays; over all the tokens of the call)."""

    aux_loss: jax.Array   # float32: E * sum_e f_e P_e (1 when balanced)
    z_loss: jax.Array     # float32: mean_t logsumexp(logits)^2
    load: jax.Array       # int32 [E]: assignments routed to each expert, before capacity
    dropped: jax.Array    # int32: assignments (token, choice) dropped by capacity
    drop_rate: jax.Array  # float32: dropped / (tokens * k)
    entropy: jax.Array    # float32: mean router entropy (nats)


def check_options(experts: int, top_k: int, gate: str, capacity_factor: float | None) -> None:
    """Check the router's options.

    Args:
      experts: routed experts, a positive int.
      top_k: experts per token, an int in ``[1, experts]``.
      gate: one of :data:`GATES`.
      capacity_factor: a finite number > 0, or None (dropless).

    Raises:
      MoEError: naming the bad option, its value and the fix.

    >>> check_options(8, 9, "softmax", 1.0)
    Traceback (most recent call last):
    ...
    jaxpar.errors.MoEError: top_k=9 must be an int in [1, experts=8]: a token picks top_k distinct experts.
    """
    if int_problem(experts, 1):
        raise MoEError(f"experts={experts!r} must be a positive int.")
    if int_problem(top_k, 1) or top_k > experts:
        raise MoEError(f"top_k={top_k!r} must be an int in [1, experts={experts}]: a token picks top_k "
                       "distinct experts.")
    if gate not in GATES:
        raise MoEError(f"gate={gate!r} is not a known gate; choose one of {GATES}.")
    if capacity_factor is not None and (not finite_number(capacity_factor) or capacity_factor <= 0):
        raise MoEError(f"capacity_factor={capacity_factor!r} must be a finite number > 0 (1.0: room for an "
                       "even load; 1.25 is common) or None for dropless routing.")


def capacity(tokens_per_group: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Buffer slots per group and expert.

    Args:
      tokens_per_group: ``T``, the tokens of one group (batch row).
      experts: ``E``.
      top_k: ``k``, experts per token.
      capacity_factor: ``cf``; None: dropless.

    Returns:
      ``min(T, ceil(cf * T * k / E))``; ``T`` when ``cf`` is None.

    >>> capacity(8, 4, 2, 1.0), capacity(8, 4, 2, 1.25), capacity(8, 4, 2, None)
    (4, 5, 8)
    """
    if capacity_factor is None:
        return tokens_per_group
    return min(tokens_per_group, math.ceil(capacity_factor * tokens_per_group * top_k / experts))


def buffer_slots(expert: jax.Array, experts: int) -> jax.Array:
    """Slot of each choice in its expert's buffer.

    Args:
      expert: int ``[G, T, k]``, the chosen experts in choice-rank order.
      experts: ``E``.

    Returns:
      int32 ``[G, T, k]``: how many choices of the same group, ranked before it (lower choice rank,
      then earlier position), went to the same expert.
    """
    G, T, k = expert.shape
    onehot = jax.nn.one_hot(expert, experts, dtype=jnp.int32)              # [G, T, k, E]
    ranked = onehot.transpose(0, 2, 1, 3).reshape(G, k * T, experts)      # rank-major, then position
    before = jnp.cumsum(ranked, axis=1) - ranked
    slot = jnp.sum(before * ranked, axis=-1)
    return slot.reshape(G, k, T).transpose(0, 2, 1)


def top_k_experts(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the ``k`` largest ``scores`` on the last axis, largest first (ties: the lower index).

    ``k`` argmaxes rather than ``jax.lax.top_k``: XLA's SPMD partitioner gathers a TopK's operand over
    the axes that split its batch, an argmax stays local.

    Args:
      scores: ``[..., E]``.
      k: how many to pick.

    Returns:
      int32 ``[..., k]``.

    >>> top_k_experts(jnp.array([[0.1, 0.7, 0.2, 0.7]]), 2).tolist()
    [[1, 3]]
    """
    picked = []
    for _ in range(k):
        e = jnp.argmax(scores, axis=-1)
        picked.append(e)
        scores = jnp.where(jax.nn.one_hot(e, scores.shape[-1], dtype=bool), -jnp.inf, scores)
    return jnp.stack(picked, axis=-1).astype(jnp.int32)


def route(x: jax.Array, router: jax.Array, *, top_k: int, gate: str = "softmax",
          capacity_factor: float | None = None, normalize: bool = True,
          bias: jax.Array | None = None) -> Routing:
    """Route tokens ``x[G, T, D]`` with the router weight ``router[D, E]`` (see the module docstring).

    Args:
      x: tokens, one group (batch row) per leading index.
      router: router weight; logits are computed in float32.
      top_k: experts per token.
      gate: ``"softmax"`` or ``"sigmoid"``.
      capacity_factor: see :func:`capacity`; None: dropless.
      normalize: divide the top-k weights by their sum.
      bias: optional ``[E]`` aux-loss-free balancing bias, added to the scores for selection only.

    Returns:
      A :class:`Routing`.
    """
    G, T, _ = x.shape
    E = router.shape[-1]
    check_options(E, top_k, gate, capacity_factor)
    logits = jnp.einsum("gtd,de->gte", x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1) if gate == "softmax" else jax.nn.sigmoid(logits)   # select, weigh
    probs = scores if gate == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)     # the gate's p
    select = scores if bias is None else scores + bias.astype(jnp.float32)
    expert = top_k_experts(jax.lax.stop_gradient(select), top_k)
    # a one-hot product rather than a gather: XLA's gather partitioner fails in manual regions
    weight = jnp.sum(jax.nn.one_hot(expert, E, dtype=scores.dtype) * scores[:, :, None, :], axis=-1)
    if normalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    C = capacity(T, E, top_k, capacity_factor)
    # slots follow the true positions: under a balanced context-parallel layout, in the natural order
    slot = in_sequence_order(buffer_slots(in_natural_order(expert), E))
    return Routing(expert.astype(jnp.int32), weight, slot, slot < C, logits, probs, C)


def load_balancing_loss(load: jax.Array, probs: jax.Array) -> jax.Array:
    """The load-balancing loss ``E * sum_e f_e P_e`` (1 when balanced).

    Args:
      load: ``[E]`` assignments per expert; ``f_e = load_e / sum(load)`` (no gradient;
        ``sum(load) = N k`` for the call's own load).
      probs: the gate distribution ``[..., E]``; ``P_e`` is the mean of ``probs[..., e]`` over all
        ``N`` tokens.

    Returns:
      A float32 scalar.

    >>> float(load_balancing_loss(jnp.array([2, 2]), jnp.full((1, 4, 2), 0.5)))
    1.0
    """
    E = probs.shape[-1]
    load = jax.lax.stop_gradient(load.astype(jnp.float32))
    f = load / jnp.maximum(jnp.sum(load), 1.0)
    P = jnp.mean(probs.reshape(-1, E), axis=0)
    return E * jnp.sum(f * P)


def routing_stats(r: Routing, balance_load: jax.Array | None = None) -> MoEStats:
    """The :class:`MoEStats` of a routing (means and counts over all its tokens).

    Args:
      r: the routing (:func:`route`).
      balance_load: optional ``[E]``, replaces the routing's own load in the aux loss's ``f``: the
        load of a whole step when this call is one of its micro-batches, so that the micro-batches'
        aux losses weighted by their share of the tokens sum to the whole batch's aux loss, value and
        gradient (the gradient flows through ``P`` only, which is a mean over tokens).

    Returns:
      A :class:`MoEStats`.
    """
    E = r.probs.shape[-1]
    load = jnp.sum(jax.nn.one_hot(r.expert, E, dtype=jnp.int32), axis=(0, 1, 2))
    dropped = jnp.sum(~r.kept, dtype=jnp.int32)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))
    logp = jnp.log(jnp.maximum(r.probs, jnp.finfo(jnp.float32).tiny))
    entropy = jnp.mean(-jnp.sum(r.probs * logp, axis=-1))
    aux = load_balancing_loss(load if balance_load is None else balance_load, r.probs)
    return MoEStats(aux_loss=aux, z_loss=z, load=load, dropped=dropped, drop_rate=dropped / r.kept.size,
                    entropy=entropy)


def load_cv(load: jax.Array) -> jax.Array:
    """Coefficient of variation of the per-expert load, ``std / mean`` (0 when balanced).

    Args:
      load: ``[E]`` (any numeric dtype).

    Returns:
      A float32 scalar.

    >>> float(load_cv(jnp.array([1, 3])))
    0.5
    """
    load = load.astype(jnp.float32)
    return jnp.std(load) / jnp.maximum(jnp.mean(load), jnp.finfo(jnp.float32).tiny)


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): ``bias + rate * sign(mean(load) - load)``.

    Apply it outside the gradient, once per optimizer step, with the step's *global* load (summed over
    its micro-batches): under-loaded experts get a larger bias, so are picked more often.

    Args:
      bias: ``[..., E]``, the current bias.
      load: the step's load, ``bias``' shape.
      rate: how far each step moves the bias.

    Returns:
      The new bias, ``bias``' shape and dtype.

    >>> update_router_bias(jnp.zeros(3), jnp.array([1, 2, 6]), 0.1).tolist()
    [0.10000000149011612, 0.10000000149011612, -0.10000000149011612]
    """
    load = load.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)
