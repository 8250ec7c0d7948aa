"""Context parallelism (CP) and expert parallelism (EP) in the cost model (docs/planning.md §10): the
per-layer collectives, the attention work and memory of each CP method, and the MoE layer's sorted
dispatch: the rows its experts compute (:func:`routed_rows`), what one device sends each EP peer
(:func:`send_rows`), its all-to-alls and tensor all-reduces, and what it keeps for the backward. The
runtime is the ground truth (:mod:`jaxpar.parallel.context`, :mod:`jaxpar.parallel.moe`).

Example::

    >>> score_fraction("ring", 4, True), score_fraction("ring", 4, False), score_fraction("all_gather", 4, True)
    (0.140625, 0.25, 0.25)
    >>> [(k, n, c) for k, n, c in context_collectives("all_gather", 4, 1000.0, 2, "none")]
    [('all-gather', 4000.0, 2), ('reduce-scatter', 1000.0, 2)]
"""
from __future__ import annotations

import math

from jaxpar.cost._model import ModelSpec

#: Rows of one expert tile on GPUs and TPUs (:data:`jaxpar.parallel.moe.TILE_ROWS`; 32 on CPU).
EXPERT_TILE = 128
#: Dropless, one EP round sends a peer at most this multiple of the mean
#: (:data:`jaxpar.parallel.moe.DROPLESS_SEND_FACTOR`).
DROPLESS_SEND_FACTOR = 1.25


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


def context_collectives(method: str, context: int, kv: float, compute_bytes: float, remat: str, *,
                        q: float | None = None) -> list[tuple[str, float, int]]:
    """The CP collectives of one layer and micro-batch on one device (the module's table).

    Args:
      method: ``ring``, ``all_gather`` or ``ulysses``.
      context: the CP degree ``C`` (> 1).
      kv: bytes of one device's K (or V) shard, ``r·(s/C)·(h/t)·cb``.
      compute_bytes: ``cb``, bytes per value of K and V (the ring's dK/dV travel in fp32).
      remat: the recomputation policy (any but ``none`` re-runs the attention forward).
      q: bytes of one device's Q (or attention output) shard where it differs from ``kv`` (grouped-query
        attention; Ulysses moves both), None: ``kv``.

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
    if q is None or q == kv:
        return [("all-to-all", kv, 4 * (1 + redo) + 4)]
    return [("all-to-all", q, 2 * (1 + redo) + 2), ("all-to-all", kv, 2 * (1 + redo) + 2)]     # q, out; k, v


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


def send_rows(m: ModelSpec, rows: float, context: int, expert: int) -> float:
    """``S``, the rows one device sends one of its ``E_p`` expert-parallel peers in one round of an MoE layer
    (:func:`jaxpar.parallel.moe.send_rows`), for its ``G = rows`` groups (sequences) of ``T = s/C`` tokens,
    ``n = G·T·k`` choices: with capacity ``min(n, G·(E/E_p)·min(cap, T))``, ``cap`` =
    :meth:`ModelSpec.capacity` of a whole sequence; dropless (``cap = s``) ``min(n, ⌈f·n/E_p⌉)``,
    ``f`` = :data:`DROPLESS_SEND_FACTOR`. A balanced routing needs one round.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size ``C``.
      expert: the expert-parallel size ``E_p``.

    Returns:
      The number of rows.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 64, 128, 8, experts=8, top_k=2)               # cap = ceil(1.25 * 64 * 2 / 8) = 20
    >>> send_rows(m, 2, 1, 4), send_rows(m, 2, 4, 4)                     # min(256, 2 * 2 * 20), min(64, 2 * 2 * 16)
    (80.0, 64.0)
    >>> send_rows(gpt(2, 64, 4, 64, 128, 8, experts=8, capacity_factor=None), 2, 1, 4)    # 1.25 * 256 / 4
    80
    """
    T, cap = m.seq / context, m.capacity(m.seq)
    n = rows * T * m.top_k
    if cap >= m.seq:
        return min(n, math.ceil(DROPLESS_SEND_FACTOR * n / expert))
    return min(n, rows * (m.experts / expert) * min(cap, T))


def expert_slots(m: ModelSpec, rows: float, context: int, expert: int) -> float:
    """The rows of one device's sorted layout in an MoE layer, the length (less a tile) of the experts'
    saved pre-activations: the ``E_p·S`` rows it receives under EP (:func:`send_rows`), its ``N·k``
    choices without (``N = rows·s/C`` tokens).

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size ``C``.
      expert: the expert-parallel size ``E_p``.

    Returns:
      The number of rows.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 64, 128, 8, experts=8, top_k=2)
    >>> expert_slots(m, 2, 1, 4), expert_slots(m, 2, 1, 1)               # 4 * 80, 2 * 64 * 2
    (320.0, 256.0)
    """
    if expert > 1:
        return expert * send_rows(m, rows, context, expert)
    return rows * m.seq / context * m.top_k


def routed_rows(m: ModelSpec, rows: float, context: int, expert: int, tile: int = EXPERT_TILE) -> float:
    """The rows one device's experts compute in an MoE layer, on average under balanced routing: the kept
    choices, ``min(N·k, G·E·cap/C)`` (a group keeps at most ``cap`` per expert over its ``C`` context
    devices), plus half a ``tile`` of padding for each of the ``E/E_p`` experts on the device.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device (``G``).
      context: the context-parallel size ``C``.
      expert: the expert-parallel size ``E_p``.
      tile: rows per expert tile (:data:`EXPERT_TILE`).

    Returns:
      The number of rows.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 64, 128, 8, experts=8, top_k=2, capacity_factor=0.5)    # cap = 8
    >>> routed_rows(m, 2, 1, 4, tile=32)                                   # min(256, 2 * 8 * 8) + 2 * 16
    160.0
    """
    kept = min(rows * m.seq / context * m.top_k, rows * m.experts * m.capacity(m.seq) / context)
    return kept + m.experts / expert * tile / 2


def expert_collectives(m: ModelSpec, rows: float, context: int, expert: int, compute_bytes: float, remat: str
                       ) -> list[tuple[str, float, int]]:
    """The EP all-to-alls of one MoE layer and micro-batch on one device, one round (:func:`send_rows`):
    the per-expert counts (``E`` int32) and ``E_p·S`` rows of ``h`` values (``cb``) out and back forward,
    the cotangents' rows out and their gradients back backward, and each row's fp32 weight out and its
    gradient back (``E_p·S`` fp32 each). Under recomputation the forward's counts and rows out run again
    (the experts' inputs are not matmul outputs, so ``save-matmuls`` recomputes them too).

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size.
      expert: the expert-parallel size ``E_p``.
      compute_bytes: bytes per value.
      remat: ``"none"``, ``"save-matmuls"`` or ``"full"``.

    Returns:
      ``(kind, bytes, count)`` per group of collectives.

    >>> from jaxpar.cost._model import gpt
    >>> expert_collectives(gpt(2, 64, 4, 32, 128, 8, experts=8, capacity_factor=1.0), 2, 1, 4, 2, "none")
    [('all-to-all', 32, 1), ('all-to-all', 16384.0, 4), ('all-to-all', 512.0, 2)]
    """
    redo = remat != "none"
    slots = expert_slots(m, rows, context, expert)
    return [("all-to-all", 4 * m.experts, 1 + redo), ("all-to-all", slots * m.hidden * compute_bytes, 4 + redo),
            ("all-to-all", slots * 4, 2)]


def expert_reductions(m: ModelSpec, rows: float, context: int, expert: int, compute_bytes: float
                      ) -> list[tuple[float, int]]:
    """The tensor all-reduces of one MoE layer and micro-batch on one device (the experts' ``M`` split over
    ``tensor``): forward the experts' output, on the ``N`` tokens in fp32 (several choices per token are
    summed) or under EP on the ``E_p·S`` rows received (``cb``: one choice per row); backward its
    cotangent and the input gradient of the ``N`` tokens (``cb``).

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      context: the context-parallel size.
      expert: the expert-parallel size ``E_p``.
      compute_bytes: bytes per value.

    Returns:
      ``(bytes, count)`` per group of all-reduces.

    >>> from jaxpar.cost._model import gpt
    >>> expert_reductions(gpt(2, 64, 4, 32, 128, 8, experts=8), 2, 1, 1, 2)      # 64 tokens
    [(16384.0, 1), (8192.0, 2)]
    """
    tokens = rows * m.seq / context
    out = expert_slots(m, rows, context, expert) * compute_bytes if expert > 1 else tokens * 4
    return [(out * m.hidden, 1), (tokens * m.hidden * compute_bytes, 2)]


def context_score_bytes(m: ModelSpec, rows: float, tensor: int, context: int, method: str, remat: str,
                        bytes_per_value: float, fused: bool = False) -> float:
    """Bytes of one layer's attention scores (and all-gather's gathered K/V) kept for the backward under
    CP (docs/planning.md §10): 0 for the ring and under recomputation. ``fused`` (a GPU's flash kernels,
    :func:`fused_context`): no scores, the fp32 log-sum-exp of the local queries instead.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size.
      context: the context-parallel size.
      method: ``"ring"``, ``"all_gather"`` or ``"ulysses"``.
      remat: ``"none"``, ``"save-matmuls"`` or ``"full"``.
      bytes_per_value: bytes per value.
      fused: the blocks run the flash kernels.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> context_score_bytes(m, 1, 1, 4, "ulysses", "none", 2) == 5 * 4 * 32 * 32 / 4
    True
    >>> context_score_bytes(m, 1, 1, 4, "ulysses", "none", 2, fused=True) == 4 * 32 / 4 * 4
    True
    """
    if remat != "none" or method == "ring":
        return 0.0
    s, a, t = m.seq, m.heads, tensor
    if fused:
        scores = rows * a / t * s / context * 4
    else:
        scores = 5 * rows * a / t * s * s / context * bytes_per_value / 2
    if method == "all_gather":        # the gathered K and V
        scores += 2 * rows * (s - s / context) * m.kv_width / m.kv_split(t) * bytes_per_value
    return scores


def context_working_bytes(m: ModelSpec, rows: float, tensor: int, context: int, method: str, balance: bool,
                          compute_bytes: float, fused: bool = False) -> float:
    """The transient bytes of the attention of the one layer in flight under CP (docs/planning.md §10);
    ``fused`` (:func:`fused_context`): :func:`fused_working_bytes`.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size.
      context: the context-parallel size.
      method: ``"ring"``, ``"all-gather"`` or ``"ulysses"``.
      balance: the zigzag load balance.
      compute_bytes: bytes per value.
      fused: the blocks run the flash kernels.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> context_working_bytes(m, 1, 1, 4, "all_gather", True, 2) == 2 * 4 * 8 * 32 * 4 + 2 * 32 * 64 * 2
    True
    """
    if fused:
        return fused_working_bytes(m, rows, tensor, context, method, compute_bytes)
    s, a, t, C = m.seq, m.heads, tensor, context
    kv = rows * s / C * m.kv_width / m.kv_split(t) * compute_bytes
    if method == "ring":
        block = s / (2 * C if balance else C)
        return 2 * rows * a / t * block * block * 4 + 2 * kv + 4 * kv * 4 / compute_bytes
    if method == "all_gather":
        return 2 * rows * a / t * (s / C) * s * 4 + 2 * rows * s * m.kv_width / m.kv_split(t) * compute_bytes
    return 2 * rows * a / (t * C) * s * s * 4 + 4 * kv


#: The compute dtypes whose context-parallel attention runs the flash kernels on a GPU
#: (:data:`jaxpar.attention._kernels.FUSED_DTYPES`).
FUSED_COMPUTE = ("bfloat16", "float16")


def fused_context(fused_attention: bool, compute_dtype: str) -> bool:
    """Whether a plan's context-parallel attention runs the flash kernels: on a cluster whose attention is
    fused (:attr:`jaxpar.cost.Cluster.fused_attention`, NVIDIA GPUs) in a 16-bit compute dtype (``auto``
    keeps fp32 on XLA's path, :func:`jaxpar.attention._kernels.context_kernel`).

    >>> fused_context(True, "bfloat16"), fused_context(True, "float32"), fused_context(False, "bfloat16")
    (True, False, False)
    """
    return fused_attention and compute_dtype in FUSED_COMPUTE


def fused_working_bytes(m: ModelSpec, rows: float, tensor: int, context: int, method: str,
                        compute_bytes: float) -> float:
    """The transient bytes of the one layer's attention in flight under CP with the flash kernels: no
    ``[block, block]`` scores. The ring: two fp32 outputs of the local queries (the merged state and a
    block's; backward the dQ accumulator and a block's), the K/V in flight and their fp32 dK/dV
    accumulators, as :func:`context_working_bytes`. All-gather: the gathered K/V and their fp32 gradients
    before the reduce-scatter, and the fp32 dQ. Ulysses: q, k, v and the output in the heads' layout.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size.
      context: the context-parallel size.
      method: ``"ring"``, ``"all_gather"`` or ``"ulysses"``.
      compute_bytes: bytes per value.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)                   # 8 local tokens of width 64
    >>> fused_working_bytes(m, 1, 1, 4, "ring", 2) == 2 * 8 * 64 * 4 + 2 * 8 * 64 * 2 + 4 * 8 * 64 * 4
    True
    """
    s, t, C = m.seq, tensor, context
    kv = rows * s / C * m.kv_width / m.kv_split(t) * compute_bytes
    q32 = rows * s / C * m.q_width / t * 4
    if method == "ring":
        return 2 * q32 + 2 * kv + 4 * kv * 4 / compute_bytes
    if method == "all_gather":
        return 2 * C * kv * (1 + 4 / compute_bytes) + q32
    return 4 * kv + 2 * q32 * compute_bytes / 4


def dense_mlp_bytes(tokens: float, hidden: int, tensor: int, sequence_parallel: bool,
                    bytes_per_value: float, split: float = 16) -> float:
    """Korthikanti et al.'s MLP share of a layer's activations: ``sbh(3 + 16/t)`` (``19 sbh / t`` with
    SP) at 16 bits, scaled to ``bytes_per_value``; ``split`` replaces the 16 (a gated MLP's,
    :func:`jaxpar.cost._memory.activation_widths`).

    Args:
      tokens: ``sb``, tokens per micro-batch on one device.
      hidden: the hidden size ``h``.
      tensor: the tensor-parallel size ``t``.
      sequence_parallel: Megatron's sequence parallelism.
      bytes_per_value: bytes per value.
      split: the values split over ``t``, in units of ``sbh`` at 16 bits.

    Returns:
      Bytes per device.

    >>> dense_mlp_bytes(10, 4, 2, False, 2)
    440.0
    """
    per = (3 + split) / tensor if sequence_parallel else 3 + split / tensor
    return tokens * hidden * per * bytes_per_value / 2


def moe_mlp_bytes(m: ModelSpec, rows: float, tensor: int, context: int, expert: int, sequence_parallel: bool,
                  bytes_per_value: float, remat: str = "none", tile: int = EXPERT_TILE) -> float:
    """Bytes an MoE layer's MLP keeps for the backward on one device, in place of :func:`dense_mlp_bytes`:
    its input (``N·h``, ``/t`` with SP), the shared experts' hidden before and after the activation
    (``N·S/t`` each; gated: gate, up and their product), the router's fp32 logits and probabilities
    (``2·N·E`` fp32), and without recomputation the experts' pre-activations in the sorted layout
    (``(slots + tile)·M/t``, twice gated: gate and up; :func:`expert_slots`) and under EP the rows received
    (``E_p·S·h``; one round's). ``N = rows·s/C`` tokens. Under ``save-matmuls`` recomputation the experts' inputs and pre-activations are not matmul
    outputs: they are recomputed, not kept.

    Args:
      m: the model.
      rows: sequences per micro-batch on one device.
      tensor: the tensor-parallel size ``t``.
      context: the context-parallel size ``C``.
      expert: the expert-parallel size ``E_p``.
      sequence_parallel: Megatron's sequence parallelism.
      bytes_per_value: bytes per value.
      remat: ``"none"`` or ``"save-matmuls"``.
      tile: rows per expert tile (:data:`EXPERT_TILE`).

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8, experts=8, top_k=2, capacity_factor=1.0)     # N = 32, slots = 64
    >>> moe_mlp_bytes(m, 1, 1, 1, 1, False, 2) == 2 * (32 * 64 + (64 + 128) * 256) + 2 * 32 * 8 * 4
    True
    """
    t, n = tensor, rows * m.seq / context
    values = n * m.hidden / (t if sequence_parallel else 1) + (m.mlp_inputs + 1) * n * m.shared_mlp / t
    kept = values * bytes_per_value + 2 * n * m.experts * 4
    if remat != "none":
        return kept
    slots = expert_slots(m, rows, context, expert)
    kept += (slots + tile) * m.mlp_inputs * m.expert_mlp / t * bytes_per_value
    return kept + (slots * m.hidden * bytes_per_value if expert > 1 else 0.0)
