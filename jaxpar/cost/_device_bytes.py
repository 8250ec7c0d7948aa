"""Bytes of jaxpar's train step on a real device (docs/planning.md §8): the TPU's tiled layouts
(:func:`padded_bytes`), and the peak of the step with the temporaries the compilers add
(:func:`step_peak_bytes`).

Example::

    >>> padded_bytes((2, 96, 4, 24), 4, TPU) == 4 * 2 * 128 * 4 * 24    # 96 innermost, 24 second
    True
    >>> padded_bytes((2, 96, 4, 24), 4, DENSE)
    73728
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial
from typing import Mapping

from jaxpar.cost._memory import PRECISIONS, BytesPerParam, MemoryEstimate, in_flight, keep_bytes, \
    leaf_shard_counts, leaf_spec, memory_per_device, sizes_key, zero_axes, zero_dim_of
from jaxpar.cost._model import Leaf, ModelSpec
from jaxpar.logical import matrix_sides
from jaxpar.cost._schedule import runs_in_lockstep
from jaxpar.cost._parallel import Plan
from jaxpar.strategy import Strategy


@dataclass(frozen=True)
class Layout:
    """How a device stores an array: tiles of ``second x minor`` elements of 4 bytes (``minor = 0``: dense).
    ``second`` scales with the item size (``8 * 4 / itemsize``: 16 rows of 2-byte values)."""

    name: str
    minor: int = 0
    second: int = 0


DENSE = Layout("dense")
TPU = Layout("tpu", minor=128, second=8)


def layout_for_platform(platform: str) -> Layout:
    """The layout of ``platform`` (``"tpu"``: :data:`TPU`; ``"cuda"``, ``"cpu"``: :data:`DENSE`).

    Args:
      platform: ``"tpu"``, ``"cuda"`` or ``"cpu"``.

    Returns:
      The :class:`Layout`.

    >>> layout_for_platform("tpu").minor, layout_for_platform("cuda").minor
    (128, 0)
    """
    return TPU if platform == "tpu" else DENSE


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


def padded_bytes(shape: tuple[int, ...], itemsize: int, layout: Layout) -> int:
    """Bytes of an array of ``shape`` stored in ``layout`` (the least padding over the choice of its two
    innermost dimensions; docs/planning.md §8).

    Args:
      shape: the array's shape on one device.
      itemsize: bytes per element.
      layout: the device's :class:`Layout`.

    Returns:
      Its bytes with padding.

    >>> padded_bytes((), 4, TPU), padded_bytes((96,), 4, TPU), padded_bytes((2, 96), 4, TPU)
    (512, 512, 1024)
    """
    if not layout.minor:
        return itemsize * math.prod(shape)
    if len(shape) <= 1:
        return itemsize * _ceil(shape[0] if shape else 1, layout.minor)
    tile2 = max(1, layout.second * 4 // itemsize)
    best = None
    for i, j in itertools.permutations(range(len(shape)), 2):
        rest = math.prod(d for k, d in enumerate(shape) if k not in (i, j))
        second = min(tile2, 1 << max(0, shape[j] - 1).bit_length())
        n = rest * _ceil(shape[i], layout.minor) * _ceil(shape[j], second)
        best = n if best is None else min(best, n)
    return itemsize * best


def local_shape(leaf: Leaf, sizes: Mapping[str, int], stage: int, kind: str) -> tuple[int, ...]:
    """The shape of one device's piece of ``kind`` (``params``, ``grads``, ``opt``) of ``leaf``.

    Args:
      leaf: the parameter.
      sizes: mesh axis name -> size.
      stage: the ZeRO stage.
      kind: ``"params"``, ``"grads"`` or ``"opt"``.

    Returns:
      The local shape.

    >>> from jaxpar.cost._model import gpt
    >>> local_shape(gpt(2, 32, 8, 16, 64, 16).leaf("blocks/w1"), {"data": 4, "tensor": 2}, 1, "opt")
    (2, 8, 64)
    """
    spec = leaf_spec(leaf, sizes)
    shape = [n // math.prod(sizes[a] for a in axes) for n, axes in zip(leaf.shape, spec)]
    d = zero_dim_of(leaf, spec, sizes, stage)
    if d is not None:
        shape[d] //= math.prod(sizes[a] for a in zero_axes(sizes, stage, kind)) or 1
    return tuple(shape)


def device_argument_bytes(model: ModelSpec, sizes: Mapping[str, int], zero: int, *, layout: Layout = DENSE,
                          moments: int = 2, batch_leaves: int = 2, scalars: int = 2,
                          matrix_moments: int | None = None) -> float:
    """Bytes of jaxpar's train-step arguments on one device (what ``compiled.memory_analysis()``'s
    ``argument_size_in_bytes`` reports): fp32 parameters and ``moments`` optimizer moments per parameter
    sharded per ZeRO stage, ``scalars`` int32 counters and ``batch_leaves`` int32 batch arrays, each
    array stored in ``layout``.

    Args:
      model: the model.
      sizes: mesh axis name -> size.
      zero: the ZeRO stage.
      layout: the storage layout.
      moments: optimizer moments per parameter.
      batch_leaves: the number of batch arrays.
      scalars: the number of int32 counters.
      matrix_moments: optimizer moments of a matrix leaf (:func:`jaxpar.cost.matrix_sides`) where they differ
        (Muon: 1, and one counter more); None: ``moments``.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> device_argument_bytes(gpt(2, 32, 8, 16, 64, 16), {"data": 8}, 0)    # 12 Psi + 2 counters + batch
    358152.0
    """
    out = 0.0
    for leaf in model.leaves:
        out += padded_bytes(local_shape(leaf, sizes, zero, "params"), 4, layout)
        k = matrix_moments if matrix_moments is not None and matrix_sides(leaf.logical)[0] else moments
        out += k * padded_bytes(local_shape(leaf, sizes, zero, "opt"), 4, layout)
    rows = model.batch // (sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1))
    seq = model.seq // sizes.get("context", 1)
    return out + scalars * padded_bytes((), 4, layout) + batch_leaves * padded_bytes((rows, seq), 4, layout)


#: fp32 values (in ``sbh``, and ``as^2b`` for the attention scores) that one jaxpar GPT block keeps for
#: its backward without recomputation, in the compiled layer scan: ``(whole, split, scores)``, where
#: ``whole`` is split over ``tensor`` only under SP. Measured on the GPU compiler (docs/planning.md §8:
#: the temporaries of a 4-layer step less those of a 2-layer one, one sequence, at ``as/h`` = 16 and 32,
#: ``t`` = 1 and 8, h = s = 2048; the four within 0.8 %): the two layer norms' inputs and statistics (8),
#: the matmuls' and the tanh GELU's values (28), and the softmax's probabilities (one fp32 ``as^2b``
#: array: JAX's custom-JVP softmax keeps them alone for its backward). Korthikanti et al.'s 16-bit count
#: (with dropout) is ``(5, 12, 2.5)``.
BLOCK_KEEPS = (8.0, 28.0, 1.0)
#: Whole-sequence fp32 ``sbh`` values that a layer keeps under SP beyond its split values, without
#: recomputation or under ``save-matmuls`` (measured as :data:`BLOCK_KEEPS` at ``t`` = 8: save-matmuls, 8 vs 16
#: layers, 8 sequences, 4.80 ``sbh`` per layer where the split values are 3.25): XLA keeps the row-parallel
#: products before their reduce-scatter.
SP_WHOLE = 1.5
#: Whole-sequence fp32 ``sbh`` arrays that one layer's backward holds under SP (measured as
#: :data:`BLOCK_KEEPS`: a 2-layer step at ``t`` = 8): the all-gathered inputs of its column-parallel
#: matmuls and the inputs of its reduce-scatters, forward (recomputed) and backward.
SP_BACKWARD = 8.0
#: fp32 values that a pipeline stage stores per layer and micro-batch without recomputation: the layer's
#: ``jax.vjp`` residuals (:mod:`jaxpar.parallel.pipeline._layer_vjp`), which XLA cannot prune as it does in the
#: layer scan: ``(whole, split, scores)`` as in :data:`BLOCK_KEEPS` (the layer norms' 8 values and the
#: input; two fp32 score arrays, the probabilities under JAX's custom-JVP softmax, and the boolean mask).
#: Counted with ``jax.eval_shape``.
PIPELINE_STORES = (9.0, 27.0, 2.25)
#: ``(whole, split, scores)`` per recomputation: ``save-matmuls`` keeps the matmul outputs (the input and
#: the row-parallel output whole; q, k, v, the attention output and the MLP's first product split; the
#: attention scores), ``full`` the layer's input.
REMAT_KEEPS = {"none": BLOCK_KEEPS, "save-matmuls": (2.0, 8.0, 1.0), "full": (1.0, 0.0, 0.0)}
#: :data:`REMAT_KEEPS` for libtpu, measured the same way on tpu-v5e (XLA's live peaks of 16 and 8 layers, less
#: the layers' arguments and gradients; ``as/h`` = 8 and 32, ``t`` = 1 and 4; docs/planning.md §8). libtpu
#: runs fp32 matmuls at JAX's default precision as bf16 passes: it keeps fewer fp32 values of the
#: matmuls (7 whole, 24 split without recomputation), the softmax's probabilities in fp32 alone (one
#: ``as^2b`` array), and a bf16 copy of each layer's matmul weights as the device holds them
#: (:func:`bf16_weight_bytes`, counted apart).
TPU_REMAT_KEEPS = {"none": (7.0, 24.0, 1.0), "save-matmuls": (2.0, 6.0, 1.0), "full": (1.0, 0.0, 0.0)}
#: The measured activation tables per platform (:func:`measured_memory`; the paper's: :data:`~jaxpar.cost._memory.PAPER_KEEPS`).
MEASURED_KEEPS = {"cuda": REMAT_KEEPS, "tpu": TPU_REMAT_KEEPS}


#: Bytes per token and unit of ``h`` that one layer keeps for its backward under 16-bit compute (bf16 or fp16
#: activations; fp32 parameters, gradients and moments), per recomputation, by MLP: ``"gelu"`` measured on
#: jaxpar's GPT (h = 768, 4h MLP), ``"gated"`` on a Llama-3-8B-shaped Decoder (h = 4096, SwiGLU 3.5h, 32 / 8
#: heads), each the GPU compiler's temporaries of 16 layers less those of 8 (the GPT) or 32 less 16 (the
#: Decoder), less the layers' fp32 gradients, one sequence a device, s = 2,048 to 8,192, ``t`` = 1, fused
#: attention (docs/planning.md §8; the three lengths within 4 %, the Decoder's ``none`` within 5 %).
HALF_KEEPS = {"gelu": {"none": 84.0, "save-matmuls": 22.0, "full": 2.0},
              "gated": {"none": 72.0, "save-matmuls": 26.5, "full": 2.0}}
#: Bytes per token and unit of ``h`` of the layer whose backward runs at the peak when a gated-MLP model's loss runs in
#: pieces of the vocabulary (``model.loss_chunks``), under 16-bit compute on GPUs without CP, per recomputation: fitted
#: to a Llama-3-8B-shaped Decoder over FSDP 8, 2 and 8 layers, one sequence of 8,192 or 16,384 tokens a device,
#: compiled for ``h100:1x8`` (``benchmarks/context_memory.py --methods none``; docs/planning.md §8).
HALF_PIECES = {"none": 32.0, "save-matmuls": 40.0, "full": 34.0}
#: Bytes per token and vocabulary entry that the loss holds under 16-bit compute on GPUs (bf16 logits, fp32
#: softmax statistics and gradients in pieces): the GPT's temporaries beyond its layers (above), less its
#: tables' gradients, at s = 2,048 to 8,192 (within 7 %).
HALF_LOGITS = 2.7
#: Bytes per device token and unit of ``h`` under context parallelism and 16-bit compute on GPUs, by method and
#: recomputation: ``(kept, working, working in pieces)``, what one layer keeps for its backward and the transient of
#: the layer whose backward runs at the step's peak, with the whole loss and with the loss in pieces of the
#: vocabulary (:func:`context_temporaries`). Measured on a Llama-3-8B-shaped Decoder over
#: ``context`` 8, one sequence, fsdp 1, compiled for ``h100:1x8`` (``benchmarks/context_memory.py``,
#: docs/planning.md §8): ``kept`` under ``save-matmuls`` and ``full`` is the forward scan's stacked residuals in the
#: compiled program (q, k, v, two h-wide values and the MLP's two products: 21; Ulysses keeps q, k, v and the output
#: in the heads' layout instead, k and v widened to the query heads: 26; the layer's input: 2); ``working`` (and
#: ``kept`` without recomputation) is fitted to the temporaries of 8 to 16 layers (8 and 12 without recomputation or
#: with full) at 65,536 and 131,072 tokens: within 6 % (2 %). In pieces ``working`` is fitted to every depth, 2 to 16
#: layers (2 to 12 without recomputation or with full), within 5 %; with full recomputation the step's end is the
#: peak of every program measured, and it is the largest value that keeps them so. The balanced ring keeps the
#: same arrays.
CONTEXT_KEEPS = {"ring": {"none": (67.0, 70.0, 37.0), "save-matmuls": (21.0, 40.0, 40.0), "full": (2.0, 65.0, 56.0)},
                 "all_gather": {"none": (78.0, 34.0, 31.0), "save-matmuls": (21.0, 21.0, 37.0),
                                "full": (2.0, 71.0, 56.0)},
                 "ulysses": {"none": (69.0, 83.0, 46.0), "save-matmuls": (26.0, 30.0, 33.0), "full": (2.0, 60.0, 56.0)}}
#: Bytes per device token and vocabulary entry that the loss's bf16 gradient holds under context parallelism:
#: the compiled step keeps it through the layers' backward (at 8 and 16 layers; at 2 to 6 XLA makes the head's
#: gradient first and frees it, and the model over-predicts those: docs/planning.md §8).
CONTEXT_LOGITS = 2.0


#: The attention's share of each table's ``split`` values: q, k, v and the attention's output; the rest is the MLP's.
ATTENTION_SPLIT = 4.0


def model_keeps(model: ModelSpec, keeps: tuple) -> tuple:
    """``keeps = (whole, split, scores)``, measured on jaxpar's GPT, for ``model``: the attention's
    :data:`ATTENTION_SPLIT` values at its widths (``2 (q + kv) / h``: grouped-query attention keeps narrower
    K and V) and, for a gated MLP, the MLP's values scaled from the GPT's 4h to its width ``f``, with one
    ``f``-wide value more (the second input, gate and up). The GPT's tables unchanged; a decoder's are
    estimates, not measured (docs/planning.md §8).

    Args:
      model: the model.
      keeps: a table's ``(whole, split, scores)``.

    Returns:
      The model's ``(whole, split, scores)``.

    >>> from jaxpar.cost._model import decoder
    >>> model_keeps(decoder(2, 64, 8, 32, 128, 8, 224, kv_heads=2), BLOCK_KEEPS)    # 2.5 + 24 * 224 / 256 + 3.5
    (8.0, 27.0, 1.0)
    """
    whole, split, scores = keeps
    if not split or (not model.gated and model.q_width == model.kv_width == model.hidden):
        return keeps
    mlp = split - ATTENTION_SPLIT
    if model.gated:
        mlp = mlp * model.mlp / (4 * model.hidden) + model.mlp / model.hidden
    return whole, 2 * (model.q_width + model.kv_width) / model.hidden + mlp, scores


def _layer_bytes(model: ModelSpec, plan: Plan, rows: float, keeps: tuple, sp_whole: float = 0.0) -> float:
    """fp32 bytes of ``keeps`` values per layer and micro-batch of ``rows`` sequences (:func:`model_keeps` of
    them, :func:`~jaxpar.cost._memory.keep_bytes`)."""
    return keep_bytes(model.seq, rows, model.hidden, model.heads, plan.tensor, plan.strategy.sequence_parallel,
                      model_keeps(model, keeps), 4, sp_whole)


def saved_per_layer(model: ModelSpec, plan: Plan, rows: float, platform: str = "cuda") -> float:
    """fp32 bytes one layer keeps for its backward, per micro-batch of ``rows`` sequences
    (:data:`MEASURED_KEEPS` of ``platform`` for ``plan.remat``; under SP without full recomputation
    :data:`SP_WHOLE` more).

    Args:
      model: the model.
      plan: the plan.
      rows: sequences per micro-batch.
      platform: ``"cuda"`` or ``"tpu"``.

    Returns:
      Bytes per device.
    """
    keeps = MEASURED_KEEPS[platform][plan.remat]
    return _layer_bytes(model, plan, rows, keeps, 0.0 if plan.remat == "full" else SP_WHOLE)


def half_per_layer(model: ModelSpec, remat: str, rows: float) -> float:
    """Bytes one layer keeps for its backward under 16-bit compute on GPUs (:data:`HALF_KEEPS`), per
    micro-batch of ``rows`` sequences, on one device of ``t`` = 1.

    Args:
      model: the model (a gated MLP reads the ``"gated"`` table).
      remat: the recomputation.
      rows: sequences per micro-batch.

    Returns:
      Bytes per device.
    """
    return HALF_KEEPS["gated" if model.gated else "gelu"][remat] * model.seq * rows * model.hidden


def context_measured(model: ModelSpec, plan: Plan) -> bool:
    """Whether :data:`CONTEXT_KEEPS` applies: context parallelism of a gated-MLP model whose gradients each device
    holds whole (no FSDP, no ZeRO-2 / 3 over ``data``), where it was measured.

    >>> from jaxpar.cost._model import decoder
    >>> m = decoder(2, 64, 8, 32, 128, 8, 224, kv_heads=2)
    >>> context_measured(m, Plan(context=2)), context_measured(m, Plan(context=2, fsdp=2))
    (True, False)
    """
    whole = plan.fsdp == 1 and (plan.data == 1 or plan.strategy.zero < 2)
    return plan.context > 1 and model.gated and whole


def context_temporaries(model: ModelSpec, plan: Plan, rows: float, grads: float, held: float,
                        keeps: dict[str, tuple[float, ...]]) -> tuple[float, float]:
    """A context-parallel step's temporaries beyond its fp32 gradients under 16-bit compute on GPUs, the larger of
    its two peaks (docs/planning.md §8). In the layers' backward: every layer's kept values, the loss's bf16 logits
    gradient (:data:`CONTEXT_LOGITS`), the working bytes of the layer in flight, and of the tables' gradients one
    table in bf16, not their fp32 bytes (the layers' bf16 weights and bf16 gradients are the size of their fp32
    gradients). With the loss in pieces of the vocabulary (``model.loss_chunks``) no logits gradient is held, and
    the head's fp32 gradient, made before the layers' backward, is no longer among the tables'. At the step's end:
    the gradients in bf16 beside fp32 (the all-reduce over ``context`` runs in bf16).

    Args:
      model: the model.
      plan: the plan.
      rows: sequences per micro-batch on one device (a fraction: a device's ``s / C`` tokens).
      grads: the fp32 gradients' bytes per device.
      held: the layers whose values are kept.
      keeps: the method's ``(kept, working, working in pieces)`` by recomputation, bytes per token and unit of
        ``h`` (:data:`CONTEXT_KEEPS`).

    Returns:
      ``(activations, rest)``: the layers' kept values and the rest, in bytes per device.

    >>> from jaxpar.cost._model import decoder
    >>> m = decoder(2, 64, 8, 32, 128, 8, 224, kv_heads=2)
    >>> context_temporaries(m, Plan(context=2, remat="save-matmuls"), 0.5, 1e6, 2, CONTEXT_KEEPS["ring"]) \\
    ...     == (21 * 2 * 16 * 64, 5e5 - 43008)
    True
    """
    (kept, working, in_pieces), pieces, tokens = keeps[plan.remat], model.loss_chunks > 1, model.seq * rows
    working = in_pieces if pieces else working
    acts = held * kept * tokens * model.hidden
    tables = [leaf.size for leaf in model.leaves if not leaf.stacked and not (pieces and _head_table(model, leaf))]
    backward = (0.0 if pieces else CONTEXT_LOGITS * tokens * model.vocab) + (
        working * tokens * model.hidden - 4 * sum(tables) + 2 * max(tables, default=0.0))
    return acts, max(backward, grads / 2 - acts, 0.0)


def _head_table(model: ModelSpec, leaf) -> bool:
    """Whether ``leaf`` is the head's weights: the head, or the token table of a tied model."""
    return leaf.head or (model.tied and not leaf.stacked and leaf.logical[:1] == ("vocab",))


def stored_per_layer(model: ModelSpec, plan: Plan, rows: float, platform: str = "cuda") -> float:
    """fp32 bytes a pipeline stage stores per layer and micro-batch of ``rows`` sequences for the
    backward: without recomputation :data:`PIPELINE_STORES`, else as :func:`saved_per_layer`.

    Args:
      model: the model.
      plan: the plan.
      rows: sequences per micro-batch.
      platform: ``"cuda"`` or ``"tpu"``.

    Returns:
      Bytes per device.
    """
    if plan.remat != "none":
        return saved_per_layer(model, plan, rows, platform)
    return _layer_bytes(model, plan, rows, PIPELINE_STORES)


def bf16_weight_bytes(model: ModelSpec, plan: Plan) -> float:
    """Bytes of the bf16 copies of the matmul weights that libtpu keeps, one per layer on the device, as
    the device holds the weights (split over ``tensor`` and ``pipe``, and the ZeRO-3 / FSDP shard).

    Args:
      model: the model.
      plan: the plan.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> bf16_weight_bytes(gpt(2, 32, 8, 16, 64, 16), Plan(fsdp=2)) == 2 * 2 * 12 * 32 * 32 / 2
    True
    """
    key = sizes_key(plan.sizes)
    return sum(2 * leaf.size / leaf_shard_counts(leaf, key, plan.strategy.zero).params
               for leaf in model.leaves if leaf.stacked and leaf.matmul)


def measured_keeps(platform: str):
    """``memory_per_device``'s ``keeps`` for ``platform``: its measured table (:func:`measured_memory`), or
    ``"paper"`` where none was measured.

    Args:
      platform: ``"cuda"``, ``"tpu"``, ``"cpu"``, ...

    Returns:
      The table choice.
    """
    return partial(measured_memory, keeps=platform) if platform in MEASURED_KEEPS else "paper"


def measured_memory(model: ModelSpec, plan: Plan, precision: BytesPerParam, activation_bytes: float, *,
                    keeps: str) -> MemoryEstimate | None:
    """The compiled-step model of one device's bytes (docs/planning.md §8) with ``keeps``'s measured table,
    where it was measured: fp32 parameters, gradients and compute of a dense model without CP, or 16-bit compute
    on GPUs of a dense model on one tensor rank without a pipeline (:data:`HALF_KEEPS`; under CP
    :data:`CONTEXT_KEEPS` where :func:`context_measured`, else :data:`HALF_KEEPS` at ``s / C`` tokens); before
    offload. ``logits``: the larger of the loss's logits (a piece's) and one recomputed layer (under CP the rest of
    :func:`context_temporaries`); ``transient``: two gathered layers under ZeRO-3 / FSDP, libtpu's bf16 weights.

    Args:
      model: the model.
      plan: the plan.
      precision: bytes per parameter.
      activation_bytes: bytes per activation value.
      keeps: a platform of :data:`MEASURED_KEEPS` (another: None).

    Returns:
      The :class:`~jaxpar.cost._memory.MemoryEstimate`, or None where the table was not measured.

    >>> from jaxpar.cost._model import gpt
    >>> measured_memory(gpt(2, 32, 8, 16, 64, 16), Plan(context=2), PRECISIONS["fp32"], 4, keeps="cuda") is None
    True
    """
    half = activation_bytes == 2 and keeps == "cuda"         # HALF_KEEPS: one tensor rank, no pipeline
    measured = plan.tensor == plan.pipe == 1 if half else activation_bytes == 4 and plan.context == 1
    if (keeps not in MEASURED_KEEPS or not measured or precision.param != 4 or precision.grad != 4 or plan.expert > 1
            or model.moe_layers):
        return None
    s, sizes, key, tpu = plan.strategy, plan.sizes, sizes_key(plan.sizes), keeps == "tpu"
    rows = model.batch / (plan.data * plan.fsdp * s.microbatches) / plan.context    # a device's tokens, in sequences
    grads = gathered = 0.0
    for leaf in model.leaves:
        c = leaf_shard_counts(leaf, key, s.zero)
        grads += 4 * leaf.size / c.grads
        if leaf.stacked and c.shardable and zero_axes(sizes, s.zero, "params"):
            gathered += 4 * c.local / plan.stored_layers(model.layers)      # one layer, gathered
    flight = in_flight(s.schedule, plan.pipe, s.microbatches, s.virtual_stages, runs_in_lockstep(plan))
    held = plan.stage_depth(model.layers) / s.virtual_stages * flight
    if half:
        acts = held * half_per_layer(model, plan.remat, rows)
    elif plan.pipe == 1:
        acts = held * saved_per_layer(model, plan, rows, keeps)
    else:
        acts = held * stored_per_layer(model, plan, rows, keeps) * (1 if tpu else 2)
    working = _working(model, plan, rows, half, keeps)
    # the loss's fp32 logits, one piece's; libtpu also holds two bf16 copies (the head's product and its gradient)
    logits = (HALF_LOGITS if half else 8 if tpu else 4) * model.seq * rows * model.vocab / plan.tensor
    rest = max(logits / model.loss_chunks, working)
    if half and context_measured(model, plan):              # else CP reads HALF_KEEPS at s / C tokens
        acts, rest = context_temporaries(model, plan, rows, grads, held, CONTEXT_KEEPS[s.context_setting.method])
    matrix = None if precision.matrix_opt is None else precision.matrix_opt / 4
    args = [device_argument_bytes(model, sizes, s.zero, layout=layout_for_platform(keeps), moments=k,
                                  matrix_moments=k if matrix is None or not k else matrix)
            for k in (0, precision.opt / 4)]
    return MemoryEstimate(args[0], grads, args[1] - args[0], acts, rest, flight,
                          transient=2 * gathered + (bf16_weight_bytes(model, plan) if tpu else 0.0))


def _working(model: ModelSpec, plan: Plan, rows: float, half: bool, keeps: str) -> float:
    """The working bytes of the layer whose backward runs at the peak (:func:`measured_memory`): with the loss in
    pieces under 16-bit compute :data:`HALF_PIECES`, else one layer recomputed (none without recomputation)."""
    if half and model.loss_chunks > 1:
        return HALF_PIECES[plan.remat] * model.seq * rows * model.hidden
    s = plan.strategy
    one = Plan(tensor=plan.tensor, strategy=Strategy(sequence_parallel=s.sequence_parallel))
    working = 0.0 if plan.remat == "none" else (half_per_layer(model, "none", rows) if half else
                                                 saved_per_layer(model, one, rows, keeps))
    if s.sequence_parallel and plan.tensor > 1:
        working += 4 * SP_BACKWARD * model.seq * rows * model.hidden
    return working


def step_peak_bytes(model: ModelSpec, plan: Plan, *, platform: str = "cuda") -> float:
    """Predicted peak bytes of jaxpar's fp32 train step on one device (docs/planning.md §8): what the compiled
    program allocates, arguments + outputs + temporaries - aliased, which on GPUs is XLA's peak as well
    (:func:`~jaxpar.cost._memory.memory_per_device` with ``platform``'s measured table).

    Args:
      model: the GPT.
      plan: the plan (mesh sizes, ZeRO stage, SP, pipeline schedule, micro-batches, remat).
      platform: ``"cuda"`` or ``"tpu"``: the measured table, how the device stores the arguments
        (:func:`layout_for_platform`; the rest is counted dense), and whether the compiler copies a
        pipeline stage's residual buffers in the tick's conditionals (the GPU compiler does).

    Returns:
      Bytes on the busiest device.

    >>> from jaxpar.cost._model import gpt
    >>> step_peak_bytes(gpt(2, 32, 8, 16, 64, 16), Plan(data=2)) > 0
    True
    """
    return memory_per_device(model, plan, precision="fp32", activation_bytes=4,
                             keeps=measured_keeps(platform)).total
