"""Context parallelism (CP) and expert parallelism (EP) in the cost model (docs/planning.md §10): the
per-layer collectives, the attention work and memory of each CP method, and the MoE layer's kernels
and memory. The runtime is the ground truth (:mod:`jaxpar.parallel.context`, :mod:`jaxpar.parallel.moe`).

Example::

    >>> score_fraction("ring", 4, True), score_fraction("ring", 4, False), score_fraction("all_gather", 4, True)
    (0.140625, 0.25, 0.25)
    >>> [(k, n, c) for k, n, c in context_collectives("all_gather", 4, 1000.0, 2, "none")]
    [('all-gather', 4000.0, 2), ('reduce-scatter', 1000.0, 2)]
"""
from __future__ import annotations

from jaxpar.cost._model import ModelSpec


def score_fraction(method: str, context: int, balance: bool) -> float:
    """The attention scores one device computes, as a fraction of the whole ``s x s`` square per head.

    Args:
      method: ``ring``, ``all_gather`` or ``ulysses``.
      context: the CP degree ``C``.
      balance: the balanced (zig-zag) layout.

    Returns:
      ``(2C+1)/4C^2`` for the balanced ring (the causal blocks it skips), ``1/C`` otherwise (the
      natural-order ring's busiest device, the whole masked ``[s/C, s]`` of all-gather and Ulysses);
      1 without CP.
    """
    if context == 1:
        return 1.0
    if method == "ring" and balance:
        return (2 * context + 1) / (4 * context * context)
    return 1.0 / context


def context_collectives(method: str, context: int, kv: float, compute_bytes: float, remat: str
                        ) -> list[tuple[str, float, int]]:
    """The CP collectives of one layer and micro-batch on one device (the module's table).

    Args:
      method: ``ring``, ``all_gather`` or ``ulysses``.
      context: the CP degree ``C`` (> 1).
      kv: bytes of one device's K (or V) shard, ``r·(s/C)·(h/t)·cb``.
      compute_bytes: ``cb``, bytes per value of K and V (the ring's dK/dV travel in fp32).
      remat: the recomputation policy (any but ``none`` re-runs the attention forward).

    Returns:
      ``[(kind, bytes of the result on one device, count)]``; the ring's are listed forward hops, backward
      hops, then the last hop (see :func:`ring_hops`).
    """
    redo = remat != "none"
    C = context
    if method == "ring":
        return [(kind, n, count) for kind, n, count, _ in ring_hops(C, kv, compute_bytes, redo)]
    if method == "all_gather":
        return [("all-gather", C * kv, 2 * (1 + redo)), ("reduce-scatter", kv, 2)]
    return [("all-to-all", kv, 4 * (1 + redo) + 4)]


def ring_hops(context: int, kv: float, compute_bytes: float, redo: bool) -> list[tuple[str, float, int, str]]:
    """The ring's permutes of one layer and micro-batch, each with the ring step it can run behind
    (``forward`` / ``backward``: the blocks of one step, Liu et al. 2023, "Ring Attention with Blockwise
    Transformers", §3; ``""``: the last hop of the dK/dV accumulators, after the last step).

    Args:
      context: the ring's size ``C``.
      kv: bytes of one K/V block.
      compute_bytes: bytes per value of the gradients' accumulators.
      redo: the forward's hops run again in the backward (recomputation).

    Returns:
      ``(kind, bytes, count, step)`` per group of permutes.

    >>> ring_hops(4, 10.0, 2, False)
    [('collective-permute', 20.0, 3, 'forward'), ('collective-permute', 60.0, 3, 'backward'), ('collective-permute', 40.0, 1, '')]
    """
    grads = 2 * kv * 4 / compute_bytes
    C = context
    return [("collective-permute", 2 * kv, (C - 1) * (1 + redo), "forward"),
            ("collective-permute", 2 * kv + grads, C - 1, "backward"),
            ("collective-permute", grads, 1, "")]


def expert_slots(m: ModelSpec, rows: float, context: int) -> float:
    """Capacity slots of one device's buffer in an MoE layer: ``rows`` groups (sequences; under CP each
    device's ``s/C`` tokens of a sequence are a group) of ``E * cap`` slots.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size ``C``.

    Returns:
      The number of slots.

    >>> from jaxpar.cost._model import gpt
    >>> expert_slots(gpt(2, 64, 4, 32, 128, 8, experts=8, top_k=2, capacity_factor=1.0), 2, 1)   # 2 * 8 * 8
    128
    """
    return rows * m.experts * m.capacity(m.seq // context)


def expert_collectives(m: ModelSpec, rows: float, context: int, compute_bytes: float, remat: str
                       ) -> list[tuple[str, float, int]]:
    """The EP all-to-alls of one MoE layer and micro-batch on one device: 2 forward, 2 backward (and 2
    recomputed under full recomputation) of the capacity buffer, ``slots·h·cb`` bytes each.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size.
      compute_bytes: bytes per value.
      remat: ``"none"``, ``"selective"`` or ``"full"``.

    Returns:
      ``(kind, bytes, count)`` per group of collectives.

    >>> from jaxpar.cost._model import gpt
    >>> expert_collectives(gpt(2, 64, 4, 32, 128, 8, experts=8, capacity_factor=1.0), 2, 1, 2, "none")
    [('all-to-all', 16384, 4)]
    """
    return [("all-to-all", expert_slots(m, rows, context) * m.hidden * compute_bytes, 4 + 2 * (remat == "full"))]


def context_score_bytes(m: ModelSpec, rows: float, tensor: int, context: int, method: str, remat: str,
                        bytes_per_value: float) -> float:
    """Bytes of one layer's attention scores (and all-gather's gathered K/V) kept for the backward under
    CP (docs/planning.md §10): 0 for the ring and under recomputation.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size.
      context: the context-parallel size.
      method: ``"ring"``, ``"all_gather"`` or ``"ulysses"``.
      remat: ``"none"``, ``"selective"`` or ``"full"``.
      bytes_per_value: bytes per value.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> context_score_bytes(m, 1, 1, 4, "ulysses", "none", 2) == 5 * 4 * 32 * 32 / 4
    True
    """
    if remat != "none" or method == "ring":
        return 0.0
    s, a, t = m.seq, m.heads, tensor
    scores = 5 * rows * a / t * s * s / context * bytes_per_value / 2
    if method == "all_gather":
        scores += 2 * rows * (s - s / context) * m.hidden / t * bytes_per_value
    return scores


def context_working_bytes(m: ModelSpec, rows: float, tensor: int, context: int, method: str, balance: bool,
                          compute_bytes: float) -> float:
    """The transient bytes of the attention of the one layer in flight under CP (docs/planning.md §10).

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size.
      context: the context-parallel size.
      method: ``"ring"``, ``"all-gather"`` or ``"ulysses"``.
      balance: the zigzag load balance.
      compute_bytes: bytes per value.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> context_working_bytes(m, 1, 1, 4, "all_gather", True, 2) == 2 * 4 * 8 * 32 * 4 + 2 * 32 * 64 * 2
    True
    """
    s, a, t, C = m.seq, m.heads, tensor, context
    kv = rows * s / C * m.hidden / t * compute_bytes
    if method == "ring":
        block = s / (2 * C if balance else C)
        return 2 * rows * a / t * block * block * 4 + 2 * kv + 4 * kv * 4 / compute_bytes
    if method == "all_gather":
        return 2 * rows * a / t * (s / C) * s * 4 + 2 * rows * s * m.hidden / t * compute_bytes
    return 2 * rows * a / (t * C) * s * s * 4 + 4 * kv


def dense_mlp_bytes(tokens: float, hidden: int, tensor: int, sequence_parallel: bool,
                    bytes_per_value: float) -> float:
    """Korthikanti et al.'s MLP share of a layer's activations: ``sbh(3 + 16/t)`` (``19 sbh / t`` with
    SP) at 16 bits, scaled to ``bytes_per_value``.

    Args:
      tokens: ``sb``, tokens per micro-batch on one device.
      hidden: the hidden size ``h``.
      tensor: the tensor-parallel size ``t``.
      sequence_parallel: Megatron's sequence parallelism.
      bytes_per_value: bytes per value.

    Returns:
      Bytes per device.

    >>> dense_mlp_bytes(10, 4, 2, False, 2)
    440.0
    """
    per = 19 / tensor if sequence_parallel else 3 + 16 / tensor
    return tokens * hidden * per * bytes_per_value / 2


def moe_mlp_bytes(m: ModelSpec, rows: float, tensor: int, context: int, sequence_parallel: bool,
                  bytes_per_value: float) -> float:
    """Bytes an MoE layer's MLP keeps for the backward on one device, in place of :func:`dense_mlp_bytes`:
    its input (``N·h``, ``/t`` with SP), the dispatch and combine masks (``N·E·cap`` each), the capacity
    buffers into and out of the experts (``slots·h`` each), the experts' hidden before and after the GELU
    (``slots·M/t`` each), the shared experts' (``N·S/t`` each) and the router's fp32 logits and
    probabilities (``2·N·E`` fp32). ``N = rows·s/C`` tokens, ``slots`` = :func:`expert_slots`.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size ``t``.
      context: the context-parallel size ``C``.
      sequence_parallel: Megatron's sequence parallelism.
      bytes_per_value: bytes per value.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8, experts=8, top_k=2, capacity_factor=1.0)
    >>> moe_mlp_bytes(m, 1, 1, 1, False, 2) == 2 * (32 * 64 + 2 * 32 * 8 * 8 + 2 * 64 * 64 + 2 * 64 * 256) + 8 * 32 * 8
    True
    """
    t = tensor
    n = rows * m.seq / context
    slots = expert_slots(m, rows, context)
    cap = m.capacity(m.seq // context)
    values = (n * m.hidden / (t if sequence_parallel else 1) + 2 * n * m.experts * cap + 2 * slots * m.hidden
              + 2 * slots * m.expert_mlp / t + 2 * n * m.shared_mlp / t)
    return values * bytes_per_value + 2 * n * m.experts * 4
