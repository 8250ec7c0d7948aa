"""Each strategy's collectives per training step (:func:`comms`): what moves over which mesh axis, and
how much, with the bytes the compiled program's inventory reports (:mod:`jaxpar.analysis._hlo`).
:data:`LOWERINGS` (docs/planning.md §4): the textbook program (``ideal``), what the GPU, TPU and CPU
compilers make of jaxpar's step (``xla``, ``xla-tpu``, ``xla-cpu``) and Megatron-LM's (``megatron``).

Example::

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.cost._parallel import Plan
    >>> bytes_per_axis(comms(gpt(2, 32, 8, 16, 64, 16), Plan(data=2, tensor=4)))
    {'tensor': 83968.0, 'data': 16256.0}
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Mapping

from jaxpar.cost._context_experts import context_collectives, expert_collectives, expert_reductions, ring_hops
from jaxpar.cost._memory import leaf_shard_counts, pipe_end, sizes_key, zero_axes
from jaxpar.cost._model import Leaf, ModelSpec
from jaxpar.cost._parallel import AXES, BATCH_AXES, Plan
from jaxpar.cost._roofline import fp8_kernels
from jaxpar.cost._schedule import runs_in_lockstep
from jaxpar.errors import CostModelError
from jaxpar.logical import ROW_TABLE, TOKEN_TABLE

#: ``ideal``: the textbook program; ``xla`` and ``xla-tpu``: what jaxpar's train step compiles to with the GPU
#: and the TPU compiler (docs/planning.md §8); ``xla-cpu``: what it compiles to on XLA:CPU; ``megatron``:
#: Megatron-LM's program (docs/planning.md §4), for published runs.
LOWERINGS = ("ideal", "xla", "xla-tpu", "xla-cpu", "megatron")


def lowering_for_platform(platform: str) -> str:
    """The lowering that predicts jaxpar's train step compiled for ``platform``.

    Args:
      platform: a JAX platform name (``cpu``, ``cuda``, ``rocm``, ``tpu``).

    Returns:
      ``xla-cpu``, ``xla-tpu``, or ``xla`` for the GPU compilers.

    >>> lowering_for_platform("tpu"), lowering_for_platform("cuda")
    ('xla-tpu', 'xla')
    """
    return {"cpu": "xla-cpu", "tpu": "xla-tpu"}.get(platform, "xla")


def outer_at_ends(lowering: str) -> bool:
    """Whether the program of ``lowering`` keeps the embedding on the first pipeline stage and the head on
    the last only (Megatron-LM) rather than every parameter outside the blocks on every stage (jaxpar's
    executor replicates them over ``pipe``).

    Args:
      lowering: one of :data:`LOWERINGS`.

    Returns:
      True for ``megatron``.

    >>> outer_at_ends("megatron"), outer_at_ends("xla")
    (True, False)
    """
    return lowering == "megatron"


@dataclass(frozen=True)
class Comm:
    """``count`` collectives per step of ``bytes`` each (result on one device, the HLO inventory's
    convention: a collective-permute counts where the device receives), over mesh ``axes``; ``phase``
    says why (``grads``, ``params``, ``tensor``, ``pipeline``, ``loss``); ``runs``: how many the device
    takes part in, its time, when that differs from ``count`` (a pipeline stage also waits on the sends
    it makes)."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: float
    phase: str
    behind: str = ""       # the ring's hops: the ring step's blocks they can run behind ("forward" / "backward")
    runs: float | None = None

    @property
    def timed(self) -> float:
        """How many the device spends time on: ``runs``, else ``count``."""
        return self.count if self.runs is None else self.runs

    def buffer_bytes(self, sizes: Mapping[str, int]) -> float:
        """The ``n`` of :mod:`jaxpar.cost._collectives`: a reduce-scatter's input is ``p`` results.

        Args:
          sizes: mesh axis name -> size.

        Returns:
          Bytes.
        """
        p = math.prod(sizes[a] for a in self.axes)
        return self.bytes * p if self.kind == "reduce-scatter" else self.bytes


def _is_row_parallel(leaf: Leaf, kernel_layout: str = "in_out") -> bool:
    """A row-parallel weight (``wo``, ``w2``; the Decoder's ``wo``, ``w_down``): its tensor-split dimension is the
    contracted input, first in an ``in_out`` weight, after ``embed`` in an ``out_in`` one."""
    dims = [n for n in leaf.logical if n not in ("layers", "experts")]
    if kernel_layout == "out_in":
        return len(dims) >= 2 and dims[0] == "embed" and dims[1] in ("heads", "mlp")
    return len(dims) >= 2 and dims[0] in ("heads", "mlp")


def _axes(sizes: Mapping[str, int], names) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in names and sizes.get(a, 1) > 1)


def comms(m: ModelSpec, plan: Plan, *, lowering: str = "ideal", compute_bytes: float = 2,
          grad_bytes: float = 2) -> list[Comm]:
    """The collectives of one step on one device of the busiest stage (docs/planning.md §4).

    Args:
      m: the model.
      plan: the plan.
      lowering: one of :data:`LOWERINGS` (``"megatron"``: Megatron-LM's programs).
      compute_bytes: bytes per activation value.
      grad_bytes: bytes per gradient value.

    Returns:
      The :class:`Comm` list.

    >>> from jaxpar.cost._model import gpt
    >>> [(c.kind, c.axes, c.bytes, c.count) for c in comms(gpt(2, 32, 8, 16, 64, 16), Plan(data=8), grad_bytes=4)]
    [('all-reduce', ('data',), 18688.0, 1), ('all-reduce', ('data',), 50304.0, 2)]
    """
    if lowering not in LOWERINGS:
        raise CostModelError(f"lowering={lowering!r}: choose one of {', '.join(LOWERINGS)}.")
    sizes = plan.sizes
    out: list[Comm] = []

    def add(kind, axes, nbytes, count, phase, behind="", runs=None):
        axes = _axes(sizes, axes)
        if axes and nbytes > 0 and count > 0:
            out.append(Comm(kind, axes, float(nbytes), count, phase, behind, runs))

    rows = m.batch / (plan.batch_split * plan.strategy.microbatches)        # sequences per device per micro-batch
    seq = m.seq / plan.context                                      # their tokens on this device
    act = rows * seq * m.hidden * compute_bytes                     # one activation of the residual stream
    if plan.tensor > 1:
        _tensor_comms(add, m, plan, act, rows * seq * 4, lowering, rows, compute_bytes)
    if plan.context > 1 or (plan.expert > 1 and m.moe_layers):
        qkv = (rows * seq * m.q_width * compute_bytes / plan.tensor,
               rows * seq * m.kv_width * compute_bytes / m.kv_split(plan.tensor))
        _context_expert_comms(add, m, plan, qkv, rows, compute_bytes)
    if plan.pipe > 1:
        _pipe_comms(add, m, plan, act, lowering, grad_bytes)
    if _axes(sizes, GRAD_AXES):
        out += _data_comms(m, plan, lowering, compute_bytes, grad_bytes)
    return out


#: The axes over which a parameter's gradient is summed, unless the parameter is split over it.
GRAD_AXES = BATCH_AXES + ("context",)


def _context_expert_comms(add, m: ModelSpec, plan: Plan, qkv: tuple[float, float], rows: float, cb: float) -> None:
    """CP: the method's collectives per layer and micro-batch
    (:func:`~jaxpar.cost._context_experts.context_collectives`; ``qkv``: one device's Q and K shards); EP: per MoE
    layer and micro-batch the all-to-alls of the counts, the routed rows and their weights
    (:func:`~jaxpar.cost._context_experts.expert_collectives`)."""
    mb = plan.strategy.microbatches
    q, kv = qkv
    if plan.context > 1:
        n_layer = plan.stage_depth(m.layers) * mb
        method = plan.strategy.context_setting.method
        if method == "ring":
            for kind, nbytes, count, behind in ring_hops(plan.context, kv, cb, plan.remat != "none"):
                add(kind, ("context",), nbytes, count * n_layer, "context", behind)
        else:
            if method == "ulysses":      # K/V heads repeated until the context axis splits them
                kv *= plan.context // math.gcd(m.kv_heads // m.kv_split(plan.tensor), plan.context)
            for kind, nbytes, count in context_collectives(method, plan.context, kv, cb, plan.remat, q=q):
                add(kind, ("context",), nbytes, count * n_layer, "context")
    if m.moe_layers:
        n_moe = m.moe_layers / m.layers * plan.stage_depth(m.layers) * mb
        for kind, nbytes, count in expert_collectives(m, rows, plan.context, plan.expert, cb, plan.remat):
            add(kind, ("expert",), nbytes, count * n_moe, "expert")


def _tensor_comms(add, m: ModelSpec, plan: Plan, act: float, stats: float, lowering: str, rows: float,
                  cb: float) -> None:
    """TP / SP: per layer per micro-batch, then the embedding, the head and the loss (``stats``: fp32
    softmax statistics). With a pipeline the embedding (first stage) and the head (last) are apart:
    the busiest stage, the last, has only the head's.

    Backward, the input gradients of q, k and v are summed on the device before one reduction (GPU and
    TPU compilers; XLA:CPU reduces each of the ``qkv_inputs``, and of a gated MLP's gate and up, unless the
    model runs them in one column-parallel region: ``column_regions``, jaxpar's Decoder). Recomputation (``remat`` other than
    ``none``) runs the layer forward again up to its attention block's output: one more reduction
    (TP) or two all-gathers and one reduce-scatter (SP) per layer; Megatron's full recomputation runs
    the whole layer forward again (two reductions; two all-gathers and two reduce-scatters).

    An MoE layer without SP reduces its experts' output on the rows they compute, and backward its
    cotangent and its input gradient (:func:`_moe_reductions`; ``rows`` sequences per device, ``cb`` bytes
    per value), in place of the MLP's two reductions; under SP on the GPU compiler too (:func:`_gpu_sequence_parallel`,
    measured), elsewhere the MoE layer is counted as a dense one (an approximation).

    A lockstep pipeline (SP with ``pipe`` > 1, :func:`~._schedule.runs_in_lockstep`) runs every tick's
    action on every stage, masked in its bubble: ``vm + p - 1`` forwards and as many backwards of each
    chunk, each F with ``pre`` and ``post``, so both ends' reductions on every stage. FP8: :func:`_fp8_reductions`;
    SP on the GPU compiler: :func:`_gpu_sequence_parallel`."""
    t, mb = plan.tensor, plan.strategy.microbatches
    lock = plan.pipe > 1 and runs_in_lockstep(plan) and lowering != "megatron"
    if lock:
        v = plan.strategy.virtual_stages
        mb = (plan.strategy.microbatches * v + plan.pipe - 1) / v
    n_layer = plan.stage_depth(m.layers) * mb
    moe = _moe_reductions(add, m, plan, mb, lowering, rows, cb)
    ends = 1 if plan.pipe > 1 and not lock else 2
    cpu = lowering == "xla-cpu"
    if lowering == "megatron":
        redo = 2 if plan.remat == "full" else 0
    else:
        redo = 0 if cpu or plan.remat == "none" else 1
    if not plan.strategy.sequence_parallel:
        if not _fp8_reductions(add, m, plan, act, n_layer, moe, redo, lowering):
            bwd = m.mlp_inputs + m.qkv_inputs if cpu and not m.column_regions else 2
            add("all-reduce", ("tensor",), act, (2 + bwd + redo) * n_layer - 2 * moe, "tensor")
        add("all-reduce", ("tensor",), act, ends * mb, "tensor")         # embedding forward, head backward
    elif lowering == "xla":
        _gpu_sequence_parallel(add, m, plan, act, n_layer, moe, redo, mb, cb)
    else:
        # 2 forward, 2 backward (libtpu keeps one forward gather for the backward), 2 recomputed
        add("all-gather", ("tensor",), act, (4 - (lowering == "xla-tpu") + (2 if redo else 0)) * n_layer, "tensor")
        add("reduce-scatter", ("tensor",), act / t, (2 + redo) * n_layer, "tensor")
        if cpu:
            _cpu_sequence_parallel(add, m, act, n_layer, mb)
        else:
            if lowering in ("xla", "xla-tpu"):   # the GPU / TPU compilers all-reduce column-parallel input gradients
                add("all-reduce", ("tensor",), act, 2 * n_layer, "tensor")
            else:
                add("reduce-scatter", ("tensor",), act / t, 2 * n_layer, "tensor")
            add("all-gather", ("tensor",), act, mb, "tensor")
            add("reduce-scatter", ("tensor",), act / t, 2 * mb, "tensor")
    add("all-reduce", ("tensor",), stats, 4 * mb, "loss")               # vocab-parallel cross-entropy


def column_reductions(m: ModelSpec, plan: Plan) -> tuple[int, int, bool]:
    """The GPU compiler's column-parallel input-gradient reductions of one layer under TP (each of the attention's
    and the dense MLP's input): FP8 (the plan's ``fp8``) runs each covered projection as its own dot
    (:func:`jaxpar.parallel.fp8_layer`), whose input gradient XLA reduces on its own, while those of the projections
    it does not cover are summed first (measured, docs/planning.md §8 and §11: Llama-3-8B's q, k, v, gate and up,
    5 all-reduces a layer; Qwen3-MoE's q (covered) and k + v (512 wide, not covered), 2).

    Args:
      m: the model.
      plan: the plan (its ``fp8``).

    Returns:
      ``(attention, mlp, fp8)``: the reductions of the attention's input and of the dense MLP's (0 without a dense
      MLP), and whether FP8 covers any of the layer's projections (1 and 1 and False without FP8).

    >>> from jaxpar.cost._model import decoder
    >>> from jaxpar.options import Fp8
    >>> from jaxpar.strategy import Strategy
    >>> m = decoder(2, 2048, 16, 64, 256, 8, mlp=4096, kv_heads=4, head_dim=128)     # K and V 512 wide
    >>> column_reductions(m, Plan(tensor=2)), column_reductions(m, Plan(tensor=2, strategy=Strategy(fp8=Fp8())))
    ((1, 1, False), (2, 2, True))
    """
    fp8 = plan.strategy.fp8
    groups = {"attention": [], "mlp": []}
    for leaf in m.leaves:
        names = [n for n in leaf.logical if n != "layers"]
        if not leaf.stacked or "experts" in leaf.logical or not leaf.matmul or _is_row_parallel(leaf, m.kernel_layout):
            continue
        if "heads" in names or "kv_heads" in names:
            groups["attention"].append(leaf)
        elif "mlp" in names:
            groups["mlp"].append(leaf)
    covered = {k: sum(fp8 is not None and leaf.fp8(fp8.min_dim) for leaf in v) for k, v in groups.items()}
    if not any(covered.values()):
        return 1, int(bool(groups["mlp"])), False
    count = [covered[k] + (covered[k] < len(groups[k])) for k in ("attention", "mlp")]
    return count[0], count[1], True


def _gpu_sequence_parallel(add, m: ModelSpec, plan: Plan, act: float, n_layer: float, moe: float, redo: int,
                           mb: float, cb: float) -> None:
    """SP's tensor collectives on the GPU compiler (lowering ``xla``, measured: docs/planning.md §8). Per layer:
    the attention's and the MLP's inputs all-gathered forward and backward (and the attention's again when
    ``remat`` recomputes it, ``redo``), their outputs reduce-scattered (the attention's again under ``redo``); the
    column-parallel input gradients reduce-scattered in 16-bit compute, all-reduced in fp32 and, one by one, under
    FP8 (:func:`column_reductions`). An MoE layer (``moe`` of them per step, :func:`_moe_reductions`) all-reduces
    its experts' output and gradients on the gathered sequence in place of the MLP's reduce-scatter and input
    gradient. Per micro-batch: the head's input gathered, the embedding's output reduce-scattered and the head's
    input gradient reduce-scattered (all-reduced in fp32); the vocab-parallel lookup's backward all-gathers its
    cotangent, and with a batch axis its output moves by a collective-permute each way between the devices of the
    innermost one and ``tensor``. Per step: a position table's gradient, gathered whole. A LayerNorm's output (the
    GPT's) is gathered in fp32 in 16-bit compute, the head's input always and the layers' forward inputs without
    recomputation or FP8 (measured: GPT-1.3B ``tp8-sp`` and GPT-124M ``dp4-tp2-sp``, docs/planning.md §8)."""
    t = plan.tensor
    attn, mlp, fp8 = column_reductions(m, plan)
    # a LayerNorm (``ModelSpec.biases``: the GPT's) casts its fp32 output last, and XLA gathers it before the cast
    # in 16-bit compute: the head's input, and the layers' forward inputs where nothing recomputes or quantizes them
    ln32 = cb == 2 and m.biases
    add("all-gather", ("tensor",), act, (4 + (2 if redo else 0)) * n_layer, "tensor")
    if ln32 and plan.remat == "none" and not fp8:
        add("all-gather", ("tensor",), act, 2 * n_layer, "tensor")   # the forward's two, in fp32: twice the bytes
    add("reduce-scatter", ("tensor",), act / t, (2 + redo) * n_layer - moe, "tensor")
    dense = n_layer - moe
    if fp8 or cb > 2:
        add("all-reduce", ("tensor",), act, attn * n_layer + mlp * dense, "tensor")
    else:
        add("reduce-scatter", ("tensor",), act / t, attn * n_layer + mlp * dense, "tensor")
    add("all-gather", ("tensor",), act * (2 if ln32 else 1), mb, "tensor")     # the head's input
    add("reduce-scatter", ("tensor",), act / t, mb, "tensor")        # the embedding's output
    if cb > 2:                                                      # the head's input gradient
        add("all-reduce", ("tensor",), act, mb, "tensor")
    else:
        add("reduce-scatter", ("tensor",), act / t, mb, "tensor")
    if any(_is_token_table(leaf) or leaf.logical == TOKEN_TABLE for leaf in m.leaves if not leaf.head):
        add("all-gather", ("tensor",), act, mb, "tensor")            # the lookup's cotangent
        inner = [a for a in BATCH_AXES if plan.sizes[a] > 1][-1:]
        if inner:
            add("collective-permute", (inner[0], "tensor"), act / t, 2 * mb, "tensor")
    if m.positions:
        add("all-gather", ("tensor",), m.seq * m.hidden * cb, 1, "tensor")     # the position table's gradient


def _cpu_sequence_parallel(add, m: ModelSpec, act: float, n_layer: float, mb: float) -> None:
    """XLA:CPU's extra tensor collectives under SP: it all-reduces the column-parallel input gradients (one per
    projection, one per region with ``column_regions``), gathers the head's input and the embedding table, and
    reduces their gradients (and gathers the position table's)."""
    add("all-reduce", ("tensor",), act, (2 if m.column_regions else m.mlp_inputs + m.qkv_inputs) * n_layer, "tensor")
    add("all-gather", ("tensor",), act, mb, "tensor")          # the head's input
    add("all-reduce", ("tensor",), act, mb, "tensor")          # the head's input gradient
    wte = m.vocab * m.hidden * 4
    add("all-gather", ("tensor",), wte, mb, "tensor")          # the embedding table, gathered
    add("all-reduce", ("tensor",), wte, 1, "tensor")           # and its gradient
    if m.positions:
        add("all-gather", ("tensor",), m.seq * m.hidden * 4, 1, "tensor")   # positions' gradient


def _moe_reductions(add, m: ModelSpec, plan: Plan, mb: float, lowering: str, rows: float, cb: float) -> float:
    """The MoE layers' tensor all-reduces without SP (:func:`~jaxpar.cost._context_experts.expert_reductions`);
    returns how many MoE layers run per step on the device (0 where they are counted as dense ones)."""
    if not m.moe_layers or (plan.strategy.sequence_parallel and lowering != "xla") or lowering == "megatron":
        return 0
    moe = m.moe_layers / m.layers * plan.stage_depth(m.layers) * mb
    for nbytes, count in expert_reductions(m, rows, plan.context, plan.expert, cb):
        add("all-reduce", ("tensor",), nbytes, count * moe, "tensor")
    return moe


def _fp8_reductions(add, m: ModelSpec, plan: Plan, act: float, n_layer: float, moe: float, redo: int,
                    lowering: str) -> bool:
    """The blocks' tensor all-reduces under FP8 (the plan's ``fp8``) on the GPU compiler (``xla``), without SP:
    the covered projections' input gradients are reduced one by one (:func:`column_reductions`), as XLA:CPU does,
    instead of summed first (measured, docs/planning.md §11), and recomputation does not run the attention's output
    reduction again where FP8 covers its projection (the FP8 dot's output is saved: measured on Llama-3-8B,
    docs/planning.md §8). A dense layer reduces its two outputs forward, an MoE layer (``moe`` of them per step) the
    attention's. False (nothing added) when FP8 covers no projection."""
    attn, mlp, fp8 = column_reductions(m, plan)
    if lowering != "xla" or not fp8:
        return False
    redo = 0 if "proj" in fp8_kernels(m, plan) else redo
    add("all-reduce", ("tensor",), act, (2 + redo + attn + mlp) * n_layer - (1 + mlp) * moe, "tensor")
    return True


def _pipe_comms(add, m: ModelSpec, plan: Plan, act: float, lowering: str, grad_bytes: float) -> None:
    """Activations forward and their gradients backward, per micro-batch and chunk: the busiest device
    receives ``2 v m`` of them, ``(2v - 1) m`` with 2 stages (the first stage receives no activation, the
    last no gradient), and waits on ``2 v m`` sends either way. jaxpar's executor then sums the gradients
    of the parameters outside the blocks (and the loss) over ``pipe``; Megatron sends ``1/t`` of each
    activation and all-gathers it over ``tensor``, and sums the tied word embedding's gradient between
    the first and the last stage (two devices: one transfer of it)."""
    mv = plan.strategy.microbatches * plan.strategy.virtual_stages
    sends, received = 2 * mv, 2 * mv - (plan.strategy.microbatches if plan.pipe == 2 else 0)
    t, sp = plan.tensor, plan.strategy.sequence_parallel
    if lowering == "megatron":
        add("collective-permute", ("pipe",), act / t, received, "pipeline", runs=sends)
        if not sp:
            add("all-gather", ("tensor",), act, sends, "pipeline")
        add("collective-permute", ("pipe",), m.vocab * m.hidden / t * grad_bytes, 1, "pipeline")
        return
    # jaxpar's stages send the whole activation, SP or not (measured: the compiled H100 step of
    # configs/megatron.yaml moves as many bytes over pipe with SP as without)
    add("collective-permute", ("pipe",), act, received, "pipeline", runs=sends)
    key = sizes_key(plan.sizes)
    shards = [leaf_shard_counts(leaf, key, plan.strategy.zero) for leaf in m.leaves if not leaf.stacked]
    # the GPU compiler sums the shards that ZeRO-2 / FSDP leave of them (measured: Qwen3-MoE, docs/planning.md §8)
    outer = sum(leaf.size / c.grads if lowering == "xla" else c.local
                for leaf, c in zip((leaf for leaf in m.leaves if not leaf.stacked), shards))
    add("all-reduce", ("pipe",), outer * 4 + 4, 1, "pipeline")        # fp32 gradients and the loss


def _reduced_whole(m: ModelSpec, plan: Plan, leaf: Leaf, lowering: str, data_axes, g_axes) -> bool:
    """Whether XLA all-reduces ``leaf``'s whole gradient over the data axes although the state shards
    it: libtpu does so for the lookup tables (tokens, positions); XLA:GPU where two or more axes split the
    tokens (``data_axes``, the leaf's) and ZeRO / FSDP shard the gradient (``g_axes``) over some of them, for a
    lookup table (the scatter-add's gradient), the Decoder's head (``Leaf.head``) and the weights whose gradient a
    ``shard_map`` sums over those axes (:func:`_summed_in_region`): jaxpar orders a shard's axes ``fsdp`` before
    ``data`` (:func:`~jaxpar.cost._memory.zero_axes`), the batch ``data`` first, and XLA makes no reduce-scatter of
    such a sum (measured: Llama-3-8B and Qwen3-MoE, docs/planning.md §8)."""
    lookup = not leaf.stacked and len(leaf.logical) == 2 and not leaf.matmul
    if lowering == "xla-tpu":
        return lookup
    return (lowering == "xla" and bool(g_axes) and len(data_axes) >= 2
            and (lookup or leaf.head or _summed_in_region(m, plan, leaf)))


def _summed_in_region(m: ModelSpec, plan: Plan, leaf: Leaf) -> bool:
    """Whether ``leaf`` enters a ``shard_map`` whole over the batch axes, so that the region's transpose sums its
    gradient over them: the routed experts' weights (the MoE dispatch) and, under SP, the row-parallel weights
    (:func:`jaxpar.parallel.row_parallel`'s region)."""
    return "experts" in leaf.logical or (plan.strategy.sequence_parallel and plan.tensor > 1
                                         and _is_row_parallel(leaf, m.kernel_layout))


def _moves_rows(m: ModelSpec, plan: Plan, leaf: Leaf, p_axes: tuple, data_axes: tuple) -> bool:
    """Whether :func:`jaxpar.parallel.embed_lookup` moves the token rows of ``leaf`` rather than gathering
    it: a token table that ZeRO-3 / FSDP stores split, with its vocabulary whole (no tensor axis) outside a
    pipeline, where a device holds fewer tokens than the vocabulary."""
    tokens = m.batch * m.seq / math.prod(plan.sizes[a] for a in data_axes if a != "context")
    return (_is_token_table(leaf) and bool(p_axes) and plan.tensor == 1 and plan.pipe == 1
            and tokens < m.vocab and m.hidden % math.prod(plan.sizes[a] for a in p_axes) == 0)


def _row_lookup(acc, m: ModelSpec, plan: Plan, leaf: Leaf, axes: tuple, abytes: float, grad: float,
                lowering: str = "ideal") -> bool:
    """:func:`jaxpar.parallel.embed_lookup`'s collectives where it moves rows (:func:`_moves_rows`; returns
    whether it does): the token ids gathered over the axes that store the table, its ``embed`` slice's rows
    moved by an all-to-all each way (behind a collective-permute each way where those axes run in another
    order than the batch's), and the slice's gradient summed over the other data axes: reduce-scattered
    over those that shard the gradients too (ZeRO-2; the GPU and TPU compilers), all-reduced over the rest.
    ``axes``: the parameters', the gradients' (none: all-reduced, XLA:CPU) and the data axes. The GPU compiler
    (``lowering`` ``xla``), where a batch axis runs inside the table's (``expert`` inside ``fsdp``), runs the
    backward's all-to-all over that axis instead and moves both directions' rows by a collective-permute over the
    two (measured on Qwen3-MoE, docs/planning.md §8)."""
    p_axes, g_axes, data_axes = axes
    if not _moves_rows(m, plan, leaf, p_axes, data_axes):
        return False
    n = math.prod(plan.sizes[a] for a in p_axes)
    group = m.batch * m.seq / math.prod(plan.sizes[a] for a in data_axes if a not in p_axes and a != "context")
    rows = group * m.hidden / n * abytes
    acc("all-gather", p_axes, group * 4, 1, "params")
    last = max(AXES.index(a) for a in p_axes)
    inner = tuple(a for a in data_axes if a not in p_axes and a != "context" and AXES.index(a) > last)
    if lowering == "xla" and inner:
        acc("all-to-all", p_axes, rows, 1, "params")
        acc("all-to-all", inner, rows, 1, "params")
        acc("collective-permute", tuple(a for a in AXES if a in p_axes + inner), rows, 2, "params")
    else:
        acc("all-to-all", p_axes, rows, 2, "params")
    if tuple(a for a in data_axes if a in p_axes) != p_axes:
        acc("collective-permute", p_axes, rows, 2, "params")
    scattered = tuple(a for a in g_axes if a not in p_axes)
    grad /= n * math.prod(plan.sizes[a] for a in scattered)
    acc("reduce-scatter", scattered, grad, 1, "grads")
    acc("all-reduce", tuple(a for a in data_axes if a not in p_axes + scattered), grad, 1, "grads")
    return True


def _is_token_table(leaf: Leaf) -> bool:
    return not leaf.stacked and leaf.logical == ROW_TABLE


def _busiest_end(m: ModelSpec, plan: Plan) -> str:
    """The pipeline end whose parameters outside the blocks have the most gradient elements here."""
    key = sizes_key(plan.sizes)
    size = {"first": 0.0, "last": 0.0}
    for leaf in m.leaves:
        if not leaf.stacked:
            size[pipe_end(leaf)] += leaf_shard_counts(leaf, key, plan.strategy.zero)[3]
    return max(size, key=size.get)


def _accumulate(groups: dict, sizes: Mapping[str, int], kind: str, axes, nbytes: float, count: float,
                phase: str) -> None:
    """Add ``nbytes`` to the group of collectives ``(kind, axes, count, phase)`` (axes of size 1 dropped)."""
    axes = _axes(sizes, axes)
    if axes and nbytes > 0:
        key = (kind, axes, count, phase)
        groups[key] = groups.get(key, 0.0) + nbytes


def _data_comms(m: ModelSpec, plan: Plan, lowering: str, compute_bytes: float, grad_bytes: float) -> list[Comm]:
    """Data axes: gradient reductions and ZeRO / FSDP parameter gathers. In a pipeline a device reduces
    the gradients of its own blocks and of one end's outer parameters (the busiest end: on the GPU compiler the
    end that moves more bytes, else the one with more gradient elements); the XLA compilers (CPU, GPU and TPU:
    lowerings ``xla-cpu`` and ``xla``) do so inside every backward action of the tick loop, i.e. once per
    micro-batch. Bytes per element gathered: :func:`_gather_bytes`."""
    if plan.pipe > 1 and lowering == "xla":
        ends = [_data_groups(m, plan, lowering, compute_bytes, grad_bytes, end) for end in ("first", "last")]
        groups = max(ends, key=lambda g: sum(nbytes * key[2] for key, nbytes in g.items()))
    else:
        end = _busiest_end(m, plan) if plan.pipe > 1 else None
        groups = _data_groups(m, plan, lowering, compute_bytes, grad_bytes, end)
    return [Comm(kind, axes, nbytes, count, phase) for (kind, axes, count, phase), nbytes in groups.items()]


def _data_groups(m: ModelSpec, plan: Plan, lowering: str, compute_bytes: float, grad_bytes: float,
                 end: str | None) -> dict[tuple, float]:
    """:func:`_data_comms` for a device of the pipeline's ``end`` (None: no pipeline), by group of collectives
    (:func:`_accumulate`)."""
    cpu = lowering == "xla-cpu"
    sizes = plan.sizes
    d, f, t, mb, s = plan.data, plan.fsdp, plan.tensor, plan.strategy.microbatches, plan.strategy
    base_axes = _axes(sizes, ("data", "fsdp"))
    g_axes, p_axes, o_axes = (zero_axes(sizes, s.zero, kind) for kind in ("grads", "params", "opt"))
    explicit = t == 1 and plan.pipe == 1 and ((d > 1 and s.zero >= 2) or f > 1)
    pbytes = 4 if cpu else compute_bytes
    per_mb = mb if lowering in ("xla", "xla-tpu", "xla-cpu") and plan.pipe > 1 else 1
    groups: dict[tuple, float] = {}
    acc = partial(_accumulate, groups, sizes)

    key = sizes_key(sizes)
    for leaf in m.leaves:
        n_p, _, _, local, shardable = leaf_shard_counts(leaf, key, s.zero)
        # summed over the axes that split the tokens, except ``expert`` for the experts' own weights
        data_axes = _axes(sizes, [a for a in GRAD_AXES if not (a == "expert" and "experts" in leaf.logical)])
        count = plan.stored_layers(leaf.shape[0]) if leaf.stacked else 1       # the device's layers of this leaf
        per = local / count                                             # one layer's slice
        nbytes = _gather_bytes(m, leaf, plan, lowering, pbytes)
        g = per * grad_bytes * (_sp_grad_scale(m, leaf, t) if cpu and s.sequence_parallel else 1)
        n_g = math.prod(sizes[a] for a in g_axes) if shardable else 1
        rows = _row_lookup(acc, m, plan, leaf, (p_axes, () if cpu else g_axes, data_axes), pbytes, g, lowering)
        if not rows and (end is None or leaf.stacked or pipe_end(leaf) == end):      # gradients
            if lowering in ("xla-cpu", "xla") and end is not None and _is_token_table(leaf):
                _stage_lookup_gathers(acc, m, data_axes, mb, compute_bytes)
            # reduce-scattered over the gradient's ZeRO axes (XLA:CPU: in its explicit steps only, pipe 1: per_mb 1)
            elif shardable and (explicit and leaf.stacked if cpu else
                                g_axes and not _reduced_whole(m, plan, leaf, lowering, data_axes, g_axes)):
                acc("reduce-scatter", g_axes, g / n_g, count * per_mb, "grads")
                acc("all-reduce", set(data_axes) - set(g_axes), g / n_g, count * per_mb, "grads")
            elif cpu and len(base_axes) == 2 and s.zero < 2 and leaf.matmul and shardable and not (
                    s.sequence_parallel and _is_row_parallel(leaf, m.kernel_layout)):   # SP: reduced in its region, all at once
                acc("all-reduce", ("fsdp",), g, count * per_mb, "grads")   # fsdp first, then the shard over data
                acc("all-reduce", set(data_axes) - {"fsdp"}, g / f, count * per_mb, "grads")
            else:
                acc("all-reduce", data_axes, g, count * per_mb, "grads")
        # parameters: ZeRO-3 / FSDP gathers (forward, and again in the backward for the layers)
        if p_axes and shardable and not rows:
            gathers = (2 if leaf.stacked else 1) * (mb if not cpu else 1)
            acc("all-gather", p_axes, per * nbytes, count * gathers, "params")
            if lowering == "xla" and nbytes == 1 and len(p_axes) >= 2 and t > 1:
                # FP8 values over fsdp x data beside tensor: XLA puts the shard in the gather's order first
                acc("collective-permute", p_axes, per * nbytes / math.prod(sizes[a] for a in p_axes),
                    count * gathers, "params")
        # ZeRO-1/2: the updated shard is gathered back over the axes the optimizer state has more; the result is
        # the parameter shard (1/fsdp of the slice with an fsdp axis). jaxpar's step (the XLA lowerings) keeps fp32
        # parameters on every device, which only an fp32 gather restores exactly; the textbook and Megatron's
        # distributed optimizer keep the fp32 master in the optimizer's shards and gather the 16-bit copy
        extra = tuple(a for a in o_axes if a not in p_axes)
        if extra and shardable:
            kept = 4 if lowering.startswith("xla") else compute_bytes
            acc("all-gather", extra, per * kept * (leaf.size / local) / n_p, count, "params")
    return groups


def _stage_lookup_gathers(acc, m: ModelSpec, data_axes: tuple, mb: int, compute_bytes: float) -> None:
    """A pipeline stage's token table: the lookup's transpose (a scatter-add) in the executor's manual region is
    replicated over the data axes, so XLA (CPU and GPU) gathers the output cotangent and the token ids of each
    micro-batch instead of reducing the table."""
    group = m.batch / mb * m.seq                     # tokens of a micro-batch, whole data group
    acc("all-gather", data_axes, group * m.hidden * compute_bytes, mb, "grads")
    acc("all-gather", data_axes, group * 4, mb, "grads")


def _gather_bytes(m: ModelSpec, leaf: Leaf, plan: Plan, lowering: str, pbytes: float) -> float:
    """Bytes per element of ``leaf``'s ZeRO-3 / FSDP gather (its gradient is reduced in ``grad_bytes``). libtpu
    gathers a matmul's weight in bf16 at most. FP8 (the plan's ``fp8``): ZeRO-3 / FSDP gather each covered weight
    (:meth:`~jaxpar.cost.Leaf.fp8`) as its FP8 values, 1 byte per element (the GPU compiler quantizes before
    the gather; measured, docs/planning.md §11), except under SP a row-parallel one, which enters SP's region in
    the compute dtype and is quantized there; its gradient is reduced in the compute dtype as without. The GPU
    compiler gathers the Decoder's head (``Leaf.head``) in fp32, jaxpar's parameters, and casts it after the
    gather (measured, docs/planning.md §8)."""
    fp8 = plan.strategy.fp8
    if lowering == "xla" and leaf.head:
        return 4
    if fp8 is not None and leaf.fp8(fp8.min_dim) and lowering != "xla-cpu":
        in_region = lowering == "xla" and plan.strategy.sequence_parallel and plan.tensor > 1 and \
            _is_row_parallel(leaf, m.kernel_layout)
        return pbytes if in_region else 1
    return min(pbytes, 2) if lowering == "xla-tpu" and leaf.matmul else pbytes


def _sp_grad_scale(m: ModelSpec, leaf: Leaf, t: int) -> float:
    """Size of ``leaf``'s data-axis gradient reduction under SP on XLA:CPU, relative to its tensor shard:
    the vocab-parallel embedding table is gathered over ``tensor`` before the lookup, so its gradient
    is formed (and reduced over the data axes) at full size (``t``); the position embedding's gradient
    comes out split over the sequence like the residual stream (``1/t``)."""
    if leaf.stacked or t == 1 or not leaf.logical:
        return 1.0
    if leaf.logical in (TOKEN_TABLE, ROW_TABLE) and not leaf.head:
        return float(t)
    if leaf.logical == (None, "embed") and leaf.shape[0] == m.seq and m.seq % t == 0:
        return 1.0 / t
    return 1.0


def bytes_per_axis(cs: list[Comm]) -> dict[str, float]:
    """Bytes per step per mesh axis (a collective over several axes counts for each of them).

    Args:
      cs: the collectives, as :func:`comms` returns them.

    Returns:
      Mesh axis name -> bytes.
    """
    out: dict[str, float] = {}
    for c in cs:
        for a in c.axes:
            out[a] = out.get(a, 0.0) + c.bytes * c.count
    return out
