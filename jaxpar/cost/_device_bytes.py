"""Memory per device (docs/planning.md §3 and §8): :func:`memory_per_device` sums a device's state, kept
activations, logits and working bytes from the paper's terms (:mod:`jaxpar.cost._memory`) or the compilers'
measured tables here (:data:`MEASURED_KEEPS`, :data:`HALF_KEEPS`, :data:`CONTEXT_KEEPS`, ...), the arguments in
the TPU's tiled layouts (:func:`padded_bytes`).

Example::

    >>> padded_bytes((2, 96, 4, 24), 4, TPU) == 4 * 2 * 128 * 4 * 24    # 96 innermost, 24 second
    True
    >>> padded_bytes((2, 96, 4, 24), 4, DENSE)
    73728
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Mapping

from jaxpar.cost._context_experts import context_working_bytes
from jaxpar.cost._memory import PRECISIONS, BytesPerParam, MemoryEstimate, bytes_per_param, keep_bytes, \
    layer_activations, leaf_shard_counts, leaf_spec, offloaded, sizes_key, state_bytes, zero_axes, zero_dim_of
from jaxpar.cost._model import Leaf, ModelSpec
from jaxpar.cost._parallel import Plan
from jaxpar.cost._schedule import in_flight, runs_in_lockstep
from jaxpar.errors import CostModelError
from jaxpar.logical import matrix_sides
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
#: The measured activation tables per platform (:func:`memory_table`; the paper's:
#: :data:`~jaxpar.cost._memory.PAPER_KEEPS`).
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
#: Bytes per token and vocabulary entry that the loss holds, by table (:func:`memory_table`): the paper's fp32 logits
#: and their log-softmax; the GPU compiler's fp32 logits; libtpu's, and two bf16 copies (the head's product and its
#: gradient); :data:`HALF_LOGITS`.
LOGIT_BYTES = {"paper": 8, "cuda": 4, "tpu": 8, "half": HALF_LOGITS}
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


def memory_table(model: ModelSpec, plan: Plan, precision: BytesPerParam, activation_bytes: float, keeps: str) -> str:
    """The tables :func:`memory_per_device` reads: a compiler's measured ones where they were measured (fp32
    parameters and gradients of a dense model: fp32 compute without CP, :data:`MEASURED_KEEPS`; 16-bit compute on
    GPUs on one tensor rank without a pipeline, ``"half"``: :data:`HALF_KEEPS`, under CP :data:`CONTEXT_KEEPS` where
    :func:`context_measured`), else the paper's.

    Args:
      model: the model.
      plan: the plan.
      precision: bytes per parameter.
      activation_bytes: bytes per activation value.
      keeps: ``"paper"``, or a platform (``"cpu"``, ``"cuda"``, ``"tpu"``) whose compiler's tables to read.

    Returns:
      ``"paper"``, ``"cuda"``, ``"tpu"`` or ``"half"``.

    >>> from jaxpar.cost._model import gpt
    >>> m, fp32 = gpt(2, 32, 8, 16, 64, 16), PRECISIONS["fp32"]
    >>> [memory_table(m, p, fp32, 4, "cuda") for p in (Plan(), Plan(context=2))]
    ['cuda', 'paper']
    >>> [memory_table(m, Plan(), fp32, 2, keeps) for keeps in ("cuda", "tpu")]
    ['half', 'paper']
    >>> memory_table(m, Plan(), PRECISIONS["mixed"], 2, "cuda")          # 16-bit parameters: not measured
    'paper'
    """
    if keeps not in ("paper", "cpu", *MEASURED_KEEPS):
        raise CostModelError(f"keeps={keeps!r}: choose 'paper' or a platform: 'cpu', 'cuda' or 'tpu'.")
    if keeps not in MEASURED_KEEPS or not precision.param == precision.grad == 4 or plan.expert > 1 or model.moe_layers:
        return "paper"
    if activation_bytes == 2 and keeps == "cuda":
        return "half" if plan.tensor == plan.pipe == 1 else "paper"
    return keeps if activation_bytes == 4 and plan.context == 1 else "paper"


def memory_per_device(model: ModelSpec, plan: Plan, *, precision: str | BytesPerParam = "mixed",
                      activation_bytes: float = 2, ends: bool = False, keeps: str = "paper",
                      fused_attention: bool = False) -> MemoryEstimate:
    """Predicted peak memory of one device for one plan (docs/planning.md §3 and §8 have the sources): the state,
    the layers' kept values, the logits and the working bytes, each part read from the tables of :func:`memory_table`.

    Each replica's batch ``batch / (data * fsdp * expert)`` is split into ``microbatches``; a pipeline stage holds
    ``layers / pipe`` layers and the schedule's in-flight micro-batches; the last stage the logits (``2 s b vocab / t``
    fp32 values). ``context`` splits each sequence and adds the attention's transient of the layer in flight
    (:func:`~jaxpar.cost._context_experts.context_working_bytes`); MoE layers keep their buffers.

    Args:
      model: the model.
      plan: the :class:`~jaxpar.cost.Plan`: its sizes, remat policy and strategy (ZeRO stage, micro-batches,
        pipeline schedule and virtual stages, sequence parallelism, context-parallel method and balance). Its
        strategy's ``offload`` (:mod:`jaxpar.cost._host_link`): the host update keeps the optimizer state
        off the device (``opt`` 0, in ``host``; on one device the gradients too:
        :func:`~jaxpar.cost._memory.offloaded`); the device update streams the offloaded state in for the step, so
        the device's peak keeps it (it is in ``host`` too). Offloaded activations (under ``remat="full"``) move
        the layers' inputs, which full recomputation keeps, from ``activations`` to ``host``.
      precision: a name in :data:`~jaxpar.cost._memory.PRECISIONS` or a :class:`~jaxpar.cost.BytesPerParam`.
      activation_bytes: bytes per activation value.
      ends: ``False`` (jaxpar's pipeline executor): every parameter outside the blocks on every stage,
        with the logits. ``True`` (Megatron-LM): the embeddings on the first stage, the final norm and
        head on the last (:func:`~jaxpar.cost._memory.state_bytes`); the more loaded of the two is returned, the
        first with stage 0's in-flight activations, the last with the same (an upper bound) and the logits. The
        measured tables are jaxpar's executor's.
      keeps: ``"paper"`` (:data:`~jaxpar.cost._memory.PAPER_KEEPS`), or a platform: on ``"cuda"`` and ``"tpu"``
        its compiler's measured tables (the compiled step: its arguments in the platform's layout, the larger of
        the loss's logits, one piece's, and the working bytes of the layer at the peak, the weights it copies)
        where they were measured (:func:`memory_table`), the paper's elsewhere and on ``"cpu"``.
      fused_attention: CP's blocks run the flash kernels (a GPU in a 16-bit compute dtype:
        :func:`~jaxpar.cost._context_experts.fused_context`): no scores kept, the kernels' working bytes.

    Returns:
      The :class:`~jaxpar.cost._memory.MemoryEstimate`.
    """
    bp = bytes_per_param(precision)
    table, s = memory_table(model, plan, bp, activation_bytes, keeps), plan.strategy
    ends = ends and plan.pipe > 1 and table == "paper"       # the measured steps are jaxpar's executor's
    flight = in_flight(s.schedule, plan.pipe, s.microbatches, s.virtual_stages, runs_in_lockstep(plan) and not ends)
    held = plan.stage_depth(model.layers) / s.virtual_stages * flight     # a stage's layers x micro-batches in flight
    mb = model.batch / plan.batch_split / s.microbatches                   # sequences per micro-batch on one device
    params, grads, opt = _state(model, plan, bp, table)
    kept = held * _layer_keeps(model, plan, mb, table, activation_bytes, fused_attention)
    rest = _rest(model, plan, mb, table)
    if table == "half" and context_measured(model, plan):
        kept, rest = context_temporaries(model, plan, mb / plan.context, grads, held,
                                         CONTEXT_KEEPS[s.context_setting.method])
    if ends:        # the first stage with the embeddings, or the last with the head and the logits
        first, last = (state_bytes(model, plan.sizes, s.zero, bp, end=e) for e in ("first", "last"))
        end, rest = (first, 0.0) if first["total"] > last["total"] + rest else (last, rest)
        params, grads, opt = end["params"], end["grads"], end["opt"]
    mem = offloaded(MemoryEstimate(params, grads, opt, kept, rest, flight, transient=_transient(model, plan, table)),
                    s.offload, unsplit=plan.unsplit, activation_bytes=activation_bytes)
    if table != "paper" or plan.context == 1:
        return mem
    cp = s.context_setting      # the attention's transient of the layer in flight
    return replace(mem, activations=mem.activations + context_working_bytes(
        model, mb, plan.tensor, plan.context, cp.method, cp.balance, activation_bytes, fused=fused_attention))


def _state(model: ModelSpec, plan: Plan, bp: BytesPerParam, table: str) -> tuple[float, float, float]:
    """Parameters, gradients and optimizer state (:func:`~jaxpar.cost._memory.state_bytes`); the measured tables' the
    parameters and optimizer state as the step's arguments (:func:`device_argument_bytes`)."""
    state = state_bytes(model, plan.sizes, plan.strategy.zero, bp)
    if table == "paper":
        return state["params"], state["grads"], state["opt"]
    matrix = None if bp.matrix_opt is None else bp.matrix_opt / 4
    params, args = (device_argument_bytes(model, plan.sizes, plan.strategy.zero, layout=layout_for_platform(table),
                                          moments=k, matrix_moments=k if matrix is None or not k else matrix)
                    for k in (0, bp.opt / 4))
    return params, state["grads"], args - params


def _layer_keeps(model: ModelSpec, plan: Plan, mb: float, table: str, activation_bytes: float, fused: bool) -> float:
    """Bytes one layer keeps for the backward per micro-batch of ``mb`` sequences, the layers' mean: the measured
    tables' (:func:`half_per_layer`; :func:`saved_per_layer`, in a pipeline :func:`stored_per_layer`, which the GPU
    compiler holds twice) or the paper's (:func:`~jaxpar.cost._memory.layer_activations`, an MoE layer's its own)."""
    rows = mb / plan.context
    if table == "half":
        return half_per_layer(model, plan.remat, rows)
    if table != "paper":
        return (saved_per_layer(model, plan, rows, table) if plan.pipe == 1 else
                stored_per_layer(model, plan, rows, table) * (1 if table == "tpu" else 2))
    kw = dict(remat=plan.remat, sequence_parallel=plan.strategy.sequence_parallel, activation_bytes=activation_bytes,
              context_method=plan.strategy.context_setting.method, fused=fused)
    dense, n_moe = layer_activations(model, plan.sizes, mb, **kw), model.moe_layers
    moe = layer_activations(model, plan.sizes, mb, moe=True, **kw) if n_moe else dense
    return ((model.layers - n_moe) * dense + n_moe * moe) / model.layers if n_moe else dense


def _rest(model: ModelSpec, plan: Plan, mb: float, table: str) -> float:
    """The loss's logits (:data:`LOGIT_BYTES`); the measured tables' the larger of one piece's (``loss_chunks``) and
    the working bytes of the layer whose backward runs at the peak (:func:`_working`)."""
    rows = mb / plan.context
    logits = LOGIT_BYTES[table] * model.seq * rows * model.vocab / plan.tensor
    return logits if table == "paper" else max(logits / model.loss_chunks, _working(model, plan, rows, table))


def _working(model: ModelSpec, plan: Plan, rows: float, table: str) -> float:
    """The working bytes of the layer whose backward runs at the peak: with the loss in pieces under 16-bit compute
    :data:`HALF_PIECES`, else one layer recomputed (none without recomputation), under SP :data:`SP_BACKWARD` more."""
    half = table == "half"
    if half and model.loss_chunks > 1:
        return HALF_PIECES[plan.remat] * model.seq * rows * model.hidden
    s = plan.strategy
    one = Plan(tensor=plan.tensor, strategy=Strategy(sequence_parallel=s.sequence_parallel))
    working = 0.0 if plan.remat == "none" else (half_per_layer(model, "none", rows) if half else
                                                 saved_per_layer(model, one, rows, table))
    if s.sequence_parallel and plan.tensor > 1:
        working += 4 * SP_BACKWARD * model.seq * rows * model.hidden
    return working


def _transient(model: ModelSpec, plan: Plan, table: str) -> float:
    """Weights the compiled step copies (the measured tables'): two layers gathered whole under ZeRO-3 / FSDP, and
    libtpu's bf16 weights (:func:`bf16_weight_bytes`)."""
    if table == "paper":
        return 0.0
    key, zero = sizes_key(plan.sizes), plan.strategy.zero
    gathers = zero_axes(plan.sizes, zero, "params")
    counts = (leaf_shard_counts(leaf, key, zero) for leaf in model.leaves if leaf.stacked and gathers)
    gathered = sum(4 * c.local / plan.stored_layers(model.layers) for c in counts if c.shardable)   # one layer
    return 2 * gathered + (bf16_weight_bytes(model, plan) if table == "tpu" else 0.0)
