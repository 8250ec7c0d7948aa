"""Time of one training step (docs/planning.md §4): the FLOPs of a step, its kernels on the roofline
through the pipeline schedule (:mod:`jaxpar.cost._roofline`), its collectives (:func:`jaxpar.cost.comms`)
on the links each mesh axis group spans, what :class:`Overlap` hides, and the optimizer update.

Example::

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    >>> abs(step_flops(m, remat="full") / narayanan_flops(1536, 2048, 96, 12288, 51200) - 1) < 1e-12
    True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

from jaxpar.cost import _collectives as C
from jaxpar.cost._cluster import FP8, Cluster
from jaxpar.cost._host_link import offload_seconds
from jaxpar.cost._memory import REMAT, leaf_shard_counts, sizes_key
from jaxpar.cost._schedule import runs_in_lockstep, schedule_stats
from jaxpar.cost._model import ModelSpec
from jaxpar.cost._parallel import AXES, Plan
from jaxpar.cost._roofline import (Work, end_work, fp8_kernels, kernel_seconds, layer_elementwise_bytes, layer_kernels,
                                   layer_work)
from jaxpar.cost._traffic import Comm, bytes_per_axis, comms
from jaxpar.errors import CostModelError, is_number


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration with full recomputation, Narayanan et al. (2021) eq. (3):
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``.

    Args:
      batch, seq, layers, hidden, vocab: ``B``, ``s``, ``l``, ``h``, ``V``.

    Returns:
      FLOPs.
    """
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def _layer_forward(m: ModelSpec, moe: bool = False) -> float:
    """Forward FLOPs of one layer and sequence: the projections (``wq, wk, wv, wo``: ``4 h^2`` for the GPT),
    the MLP's matrices (2, or 3 gated) or the routed and shared experts' and the router, and ``QK^T`` and
    ``AV`` over the queries' width."""
    s, h = m.seq, m.hidden
    if moe:
        mlp = m.mlp_matrices * h * (m.top_k * m.expert_mlp + m.shared_mlp) + h * m.experts
    else:
        mlp = m.mlp_matrices * h * m.mlp
    return 2 * s * (m.attention_params + mlp) + 4 * s * s * m.q_width


def step_flops(m: ModelSpec, remat: str = "none") -> float:
    """FLOPs of one training step of the global batch, recomputation included.

    Args:
      m: the model.
      remat: ``"none"``, ``"save-matmuls"`` or ``"full"``.

    Returns:
      FLOPs.

    >>> from jaxpar.cost._model import gpt
    >>> dense, moe = gpt(2, 64, 4, 32, 128, 8), gpt(2, 64, 4, 32, 128, 8, experts=8, top_k=1)
    >>> step_flops(moe) - step_flops(dense) == 8 * 2 * 3 * 2 * 32 * 64 * 8      # top-1: + the router only
    True
    >>> from jaxpar.cost._model import decoder        # GQA 8 / 2 of 16, SwiGLU 160: 3 matrices
    >>> step_flops(decoder(1, 64, 8, 32, 128, 1, 160, kv_heads=2, head_dim=16)) == 3 * (
    ...     2 * 32 * (64 * 2 * (128 + 32) + 3 * 64 * 160) + 4 * 32 * 32 * 128) + 6 * 32 * 64 * 128
    True
    """
    if remat not in REMAT:
        raise CostModelError(f"remat={remat!r}: choose one of {', '.join(REMAT)}.")
    n_moe = m.moe_layers
    layers = 0.0
    for n, moe in ((m.layers - n_moe, False), (n_moe, True)):
        if n:
            fwd = _layer_forward(m, moe)
            extra = {"none": 0.0, "save-matmuls": 4 * m.seq**2 * m.q_width, "full": fwd}[remat]
            layers += n * (3 * fwd + extra)
    return m.batch * (layers + 6 * m.seq * m.hidden * m.vocab)


# ----------------------------------------------------------------------------- timing
@lru_cache(maxsize=65536)
def _groups(sizes: tuple[tuple[str, int], ...], axes: tuple[str, ...], per_node: int) -> tuple[int, int]:
    s = dict(sizes)
    strides, stride = {}, 1
    for a in reversed(AXES):
        strides[a] = stride
        stride *= s.get(a, 1)
    offsets = [0]
    for a in axes:
        offsets = [o + i * strides[a] for o in offsets for i in range(s[a])]
    p_in = sum(1 for o in offsets if o < per_node)
    return p_in, len(offsets) // max(p_in, 1)


def fp8_flops_share(m: ModelSpec, plan: Plan) -> float:
    """The share of a step's model FLOPs (:func:`step_flops`, no recomputation) that the plan's FP8 GEMMs compute
    (:func:`~jaxpar.cost._roofline.fp8_kernels`: the attention projections, the MLP and the shared experts where
    ``min_dim`` covers them).

    Args:
      m: the model.
      plan: the plan (its ``strategy.fp8``).

    Returns:
      The share, in [0, 1]; 0 without FP8.

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.options import Fp8
    >>> from jaxpar.strategy import Strategy
    >>> m = gpt(2, 1024, 8, 64, 256, 8)
    >>> fp8_flops_share(m, Plan()), round(fp8_flops_share(m, Plan(strategy=Strategy(fp8=Fp8()))), 3)
    (0.0, 0.98)
    """
    covered = fp8_kernels(m, plan)
    if not covered:
        return 0.0

    def per_layer(moe: bool) -> float:        # forward FLOPs of one sequence's covered GEMMs in one layer
        return sum(k.flops * k.count for k in layer_kernels(m, Plan(), 1, 2, moe) if k.name in covered)
    n_moe = m.moe_layers
    forward = (m.layers - n_moe) * per_layer(False) + (n_moe * per_layer(True) if n_moe else 0.0)
    return min(1.0, 3 * m.batch * forward / step_flops(m))


def gemm_peak(m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str) -> float:
    """The peak FLOP/s an MFU sets a step's model FLOPs against: each GEMM's dtype's, the plan's FP8 GEMMs'
    share (:func:`fp8_flops_share`) at the cluster's FP8 peak and the rest at ``dtype``'s, so that the MFU stays
    at most 1 (an FP8 plan computing in float32 set against the float32 peak alone reached 1.78).

    Args:
      m: the model.
      plan: the plan.
      cluster: the cluster (its peaks).
      dtype: the compute dtype.

    Returns:
      FLOP/s of one device.
    """
    share = fp8_flops_share(m, plan) if cluster.has_fp8 else 0.0
    if not share:
        return cluster.peak(dtype)
    return 1.0 / ((1 - share) / cluster.peak(dtype) + share / cluster.peak(FP8))


def axis_groups(sizes: Mapping[str, int], axes: tuple[str, ...], per_node: int) -> tuple[int, int]:
    """``(p_in, p_out)``: devices of one group of ``axes`` inside a node, and nodes it spans.

    Args:
      sizes: the mesh axis sizes by name (absent: 1).
      axes: the group's axes.
      per_node: devices per node.

    Returns:
      ``(p_in, p_out)``.

    >>> axis_groups({"pipe": 4, "data": 2, "tensor": 8}, ("tensor",), 8), axis_groups({"pipe": 4, "data": 2, "tensor": 8}, ("data",), 8)
    ((8, 1), (1, 2))
    """
    return _groups(tuple(sorted((a, sizes.get(a, 1)) for a in AXES)), tuple(axes), per_node)


def comm_time(c: Comm, sizes: Mapping[str, int], cluster: Cluster) -> float:
    """Seconds of one collective ``c`` (the best algorithm on each level).

    Args:
      c: the collective.
      sizes: the mesh axis sizes by name.
      cluster: the cluster (its links and devices per node).

    Returns:
      Seconds.
    """
    n = c.buffer_bytes(sizes)
    p_in, p_out = axis_groups(sizes, c.axes, cluster.devices_per_node)
    intra, inter = cluster.intra, cluster.inter
    if c.kind == "collective-permute":
        return C.time(c.kind, n, 2, intra if p_out == 1 else inter)
    if p_out == 1:
        return C.time(c.kind, n, p_in, intra)
    if p_in == 1:
        return C.time(c.kind, n, p_out, inter)
    if c.kind == "all-reduce":
        return (C.time("reduce-scatter", n, p_in, intra) + C.time("all-reduce", n / p_in, p_out, inter)
                + C.time("all-gather", n, p_in, intra))
    if c.kind == "all-gather":
        return C.time("all-gather", n / p_in, p_out, inter) + C.time("all-gather", n, p_in, intra)
    if c.kind == "reduce-scatter":
        return C.time("reduce-scatter", n, p_in, intra) + C.time("reduce-scatter", n / p_in, p_out, inter)
    return C.time(c.kind, n, p_in * p_out, inter)


def bubble(schedule: str, pipe: int, microbatches: int, virtual: int = 1, lockstep: bool = False) -> float:
    """Bubble fraction of the schedule table (:func:`jaxpar.parallel.pipeline.bubble_fraction`); of its
    lockstep re-timing with ``lockstep`` (sequence parallelism in the pipeline, :mod:`._schedule`).

    Args:
      schedule: the schedule's name.
      pipe: pipeline stages.
      microbatches: micro-batches per step.
      virtual: virtual stages per device.
      lockstep: time the lockstep re-timing.

    Returns:
      The fraction, in [0, 1) (0 without a pipeline).

    >>> bubble("1f1b", 4, 8), bubble("gpipe", 1, 8)
    (0.2727272727272727, 0.0)
    """
    return 0.0 if pipe == 1 else schedule_stats(schedule, pipe, microbatches, virtual, lockstep)[0]


@dataclass(frozen=True)
class Overlap:
    """Fraction of each axis group's collective time hidden behind compute (0 = none), and whether the
    data-axis gradient reductions run behind the last micro-batch's backward (``grads_in_backward``:
    bucketed DDP; the hidden part is read from the schedule, :func:`behind_backward`), and whether the
    ring attention's hops run behind the blocks of their ring step (``ring_behind_blocks``, Liu et al.
    2023: a hop is exposed as far as it outlasts the step's block compute, :func:`ring_step_seconds`)."""

    data: float = 0.0
    tensor: float = 0.0
    pipeline: float = 0.0
    grads_in_backward: bool = False
    context: float = 0.0
    expert: float = 0.0
    ring_behind_blocks: bool = False

    def __post_init__(self):
        for k in ("data", "tensor", "pipeline", "context", "expert"):
            v = getattr(self, k)
            if not is_number(v) or not 0 <= v <= 1:
                raise CostModelError(f"Overlap.{k}={v!r}: must be a fraction in [0, 1].")
        for k in ("grads_in_backward", "ring_behind_blocks"):
            if not isinstance(getattr(self, k), bool):
                raise CostModelError(f"Overlap.{k}={getattr(self, k)!r}: must be True or False.")


def behind_backward(reduce_s: float, backward_s: float, layers: int) -> float:
    """Exposed seconds of ``reduce_s`` of gradient reductions that start layer by layer as the last
    micro-batch's backward (``backward_s`` over ``layers`` equal layers) completes each layer's gradient,
    one at a time on the network: the last layer's share is always exposed, and the rest as far as the
    reductions outrun the backward.

    Args:
      reduce_s: seconds of the gradient reductions, one after another.
      backward_s: seconds of the last micro-batch's backward on the device (recomputation included).
      layers: layers on the device (one bucket each).

    Returns:
      Exposed seconds: ``max(reduce_s / layers, reduce_s - (layers - 1) / layers * backward_s)``.

    >>> behind_backward(1.0, 4.0, 4), behind_backward(4.0, 1.0, 4)
    (0.25, 3.25)
    """
    if reduce_s <= 0:
        return 0.0
    n = max(layers, 1)
    return max(reduce_s / n, reduce_s - (n - 1) / n * backward_s)


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: ``compute`` (the kernels of :mod:`jaxpar.cost._roofline`: matmuls, embedding and
    loss, through the pipeline schedule), exposed ``data`` / ``tensor`` / ``pipeline`` communication,
    ``bubble`` fraction, ``mfu``, bytes per axis, the ``optimizer`` update and the blocks' ``elementwise``
    ops (both memory bound: :func:`update_bytes` and :func:`elementwise_bytes` over the cluster's
    streaming bandwidth; the latter through the schedule like ``compute``, with the values the GPU
    compiler's step keeps without recomputation written and read back,
    :func:`~jaxpar.cost._roofline.kept_value_bytes`), the exposed ``context``
    (CP) and ``expert`` (EP all-to-all) communication, and ``offload``: the host link's transfers of
    ``Plan.offload`` (:func:`jaxpar.cost._host_link.offload_seconds`; under the host update ``optimizer``
    is the update in host memory). ``unmodelled``: the terms the cluster preset lacks, each a sentence
    (:func:`jaxpar.cost._host_link.host_link_gaps`: no host link); they count 0 s in ``total``."""

    compute: float
    data: float
    tensor: float
    pipeline: float
    bubble: float
    mfu: float
    bytes_per_axis: dict = field(default_factory=dict)
    optimizer: float = 0.0
    elementwise: float = 0.0
    context: float = 0.0
    expert: float = 0.0
    offload: float = 0.0
    unmodelled: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return (self.compute + self.elementwise + self.data + self.tensor + self.pipeline + self.optimizer
                + self.context + self.expert + self.offload)


def update_bytes(m: ModelSpec, plan: Plan, grad_bytes: float = 4) -> float:
    """Bytes one device reads and writes in the optimizer update: for each parameter element whose
    optimizer state it holds (ZeRO shards it), fp32 master weights and two Adam moments read and
    written (``2 * (4 + 8)``) and the gradient read (``grad_bytes``).

    Args:
      m: the model.
      plan: the plan.
      grad_bytes: bytes of a gradient element.

    Returns:
      Bytes.

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.strategy import Strategy
    >>> m = gpt(2, 32, 8, 16, 64, 16)
    >>> zero1 = Plan(data=8, strategy=Strategy(zero=1))
    >>> update_bytes(m, Plan(data=8)) == 28 * m.n_params, update_bytes(m, zero1) < 28 * m.n_params / 7
    (True, True)
    """
    key = sizes_key(plan.sizes)
    zero = plan.strategy.zero
    held = sum(leaf.size / leaf_shard_counts(leaf, key, zero)[2] for leaf in m.leaves) if m.leaves else \
        m.n_params / plan.devices
    return held * (2 * (4 + 8) + grad_bytes)


def elementwise_bytes(m: ModelSpec, plan: Plan, compute_bytes: float = 2) -> float:
    """Bytes one device reads and writes per step in the memory-bound ops of the blocks.

    Per token and layer, forward: the two layer norms (read and write the residual stream,
    ``2h`` each) and the two residual adds (two reads, one write: ``3h`` each), ``10h`` in all;
    the MLP's bias and GELU (``2f``; gated: gate and up read, their product written, ``3f``); RoPE on
    the queries and keys of a decoder (``2(q + kv)``); the attention softmax with its scale and causal mask over
    ``a·s`` fp32 scores (``2·a·s`` values of 4 bytes). Training moves three times the forward's
    bytes (the backward of each op reads its input and the incoming gradient and writes the
    outgoing one; as for the FLOPs, backward = 2 forwards); full recomputation adds a forward,
    save-matmuls the softmax's. Tensor parallelism splits the MLP (``f/t``) and the softmax (heads,
    ``a/t``) but repeats the ``10h`` of the residual stream on every tensor device; sequence
    parallelism splits that too (``10h/t``).

    Args:
      m: the model.
      plan: the plan.
      compute_bytes: bytes of an activation element.

    Returns:
      Bytes.

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.strategy import Strategy
    >>> m = gpt(4, 128, 8, 64, 256, 16)
    >>> tp = elementwise_bytes(m, Plan(tensor=8), 4)
    >>> sp = elementwise_bytes(m, Plan(tensor=8, strategy=Strategy(sequence_parallel=True)), 4)
    >>> elementwise_bytes(m, Plan(), 4) == 3 * 16 * 64 * 4 * 4 * (10 * 128 + 2 * 512 + 2 * 8 * 64), round(tp / sp, 2)
    (True, 3.69)
    """
    rows = m.batch / plan.batch_split                      # sequences per device per step
    n_moe = m.moe_layers / m.layers * plan.stage_depth(m.layers)
    dense = layer_elementwise_bytes(m, plan, rows, compute_bytes) * (plan.stage_depth(m.layers) - n_moe)
    return dense + (layer_elementwise_bytes(m, plan, rows, compute_bytes, True) * n_moe if n_moe else 0.0)


def _compute(m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str, cb: float, b: float,
             lowering: str) -> tuple[Work, float]:
    """The kernels' and elementwise seconds of a step through the pipeline schedule, and the backward
    seconds of one micro-batch on a device (recomputation included). Per micro-batch a stage runs its
    layers, the first stage also the embedding and the last the head and loss: the step takes ``m`` times
    the busiest stage's micro-batch plus the schedule's bubble, ``m * b / (1 - b)`` times the mean's."""
    rows = m.batch / (plan.batch_split * plan.strategy.microbatches)
    n = plan.stage_depth(m.layers)
    n_moe = m.moe_layers / m.layers * n          # MoE layers per stage (spread evenly)
    layer = layer_work(m, plan, cluster, dtype, rows, cb, lowering=lowering)
    forward = layer_work(m, plan, cluster, dtype, rows, cb, forward_only=True, lowering=lowering)
    first, last = end_work(m, plan, cluster, dtype, rows, cb)
    blocks = layer.times(n - n_moe)
    backward = (n - n_moe) * (layer.total - forward.total)
    if n_moe:
        moe = layer_work(m, plan, cluster, dtype, rows, cb, moe=True, lowering=lowering)
        moe_fwd = layer_work(m, plan, cluster, dtype, rows, cb, forward_only=True, moe=True, lowering=lowering)
        blocks = blocks + moe.times(n_moe)
        backward += n_moe * (moe.total - moe_fwd.total)
    if plan.pipe == 1:
        busiest = blocks + first + last
    else:
        busiest = max(blocks + first, blocks + last, key=lambda w: w.total)
    mean = blocks + (first + last).times(1 / plan.pipe)
    mb = plan.strategy.microbatches
    step = busiest.times(mb) + mean.times(mb * b / (1 - b))
    return step, backward


def ring_step_seconds(m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str, compute_bytes: float) -> dict:
    """Seconds of one ring step's blocks on one device, forward and backward: the layer's attention kernels
    (:func:`~jaxpar.cost._roofline.layer_kernels`' ``scores`` and ``context``) over the ``C`` steps.

    Args:
      m, plan, cluster: the model, the plan and the cluster.
      dtype: the compute dtype.
      compute_bytes: bytes of an activation element.

    Returns:
      ``{"forward": s, "backward": s}`` ({} without a ring).

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.options import ContextParallel
    >>> from jaxpar.strategy import Strategy
    >>> balanced = Plan(context=4, strategy=Strategy(context=ContextParallel(balance=True)))
    >>> s = ring_step_seconds(gpt(2, 64, 4, 4096, 128, 8), balanced, load_cluster("h100"), "bfloat16", 2)
    >>> round(s["backward"] / s["forward"], 3)       # the scores again, dP, dV, dQ, dK: 5 matmuls of the 2 forward
    2.5
    """
    if plan.context == 1 or plan.strategy.context_setting.method != "ring":
        return {}
    rows = m.batch / (plan.batch_split * plan.strategy.microbatches)
    ks = {k.name: k for k in layer_kernels(m, plan, rows, compute_bytes) if k.name in ("scores", "context")}
    redo = plan.remat != "none"
    sec = {n: kernel_seconds(k, cluster, dtype) for n, k in ks.items()}
    forward = sec["scores"] + sec["context"]
    backward = sum(sec[n] * (ks[n].passes - 1 - redo) for n in ks)
    return {"forward": forward / plan.context, "backward": backward / plan.context}


def check_precision(cluster: Cluster, dtype: str, plan: Plan | None = None) -> None:
    """A :class:`CostModelError` unless ``cluster`` has a peak for the compute ``dtype`` (not ``float8``)
    and, for a plan with ``fp8``, FP8 GEMMs.

    Args:
      cluster: the cluster.
      dtype: the compute dtype.
      plan: the plan (None: the dtype only).

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.options import Fp8
    >>> from jaxpar.strategy import Strategy
    >>> check_precision(load_cluster("tpu_v5e"), "bfloat16", Plan(data=8, strategy=Strategy(fp8=Fp8())))
    Traceback (most recent call last):
    ...
    jaxpar.errors.CostModelError: plan dp8-fp8: cluster 'tpu_v5e' has no FP8 GEMMs (no peak_tflops.float8); plan without fp8, or choose a cluster with FP8 GEMMs (h100).
    """
    if dtype == FP8:
        raise CostModelError(f"dtype={FP8!r} is not a compute dtype: FP8 runs the covered matmuls of a plan with "
                             "fp8 set (Plan(strategy=Strategy(fp8=Fp8()))); compute in one of "
                             f"{', '.join(cluster.compute_dtypes)}.")
    cluster.peak(dtype)
    if plan is not None and plan.strategy.fp8 is not None and not cluster.has_fp8:
        raise CostModelError(f"plan {plan.name()}: cluster {cluster.name!r} has no FP8 GEMMs (no peak_tflops.{FP8}); "
                             "plan without fp8, or choose a cluster with FP8 GEMMs (h100).")


def step_time(m: ModelSpec, plan: Plan, cluster: Cluster, *, dtype: str = "bfloat16", lowering: str = "ideal",
              overlap: Overlap = Overlap(), grad_bytes: float | None = None) -> StepTime:
    """Predicted seconds per step of ``plan`` on ``cluster`` (docs/planning.md §4 says what is assumed).

    Args:
      m: the model.
      plan: the plan.
      cluster: the cluster.
      dtype: the compute dtype (``"float32"``: 4-byte activations, else 2).
      lowering: one of :data:`jaxpar.cost._traffic.LOWERINGS` (``"megatron"``: the pipeline's runs
        interleave, no lockstep).
      overlap: what communication hides behind compute.
      grad_bytes: bytes of a gradient element (``None``: the activations').

    Returns:
      The :class:`StepTime` (with the plan's FP8, the covered matmuls at the cluster's FP8 peak and their
      casts and collectives in their own dtypes; the MFU against the compute dtype's peak).

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.cost._model import gpt
    >>> t = step_time(gpt(12, 768, 12, 1024, 50304, 64), Plan(data=8), load_cluster("h100"))
    >>> 0 < t.mfu < 0.5, t.tensor
    (True, 0.0)
    """
    cb = 4 if dtype == "float32" else 2
    gb = cb if grad_bytes is None else grad_bytes
    check_precision(cluster, dtype, plan)
    sizes = plan.sizes
    b = bubble(plan.strategy.schedule, plan.pipe, plan.strategy.microbatches, plan.strategy.virtual_stages,
               lockstep=runs_in_lockstep(plan) and lowering != "megatron")     # Megatron-LM's runs interleave
    work, backward = _compute(m, plan, cluster, dtype, cb, b, lowering)
    spent = {"data": 0.0, "tensor": 0.0, "pipeline": 0.0, "context": 0.0, "expert": 0.0}
    grads = 0.0
    cs = comms(m, plan, lowering=lowering, compute_bytes=cb, grad_bytes=gb)
    steps = ring_step_seconds(m, plan, cluster, dtype, cb) if overlap.ring_behind_blocks else {}
    for c in cs:
        group = c.phase if c.phase in ("pipeline", "context", "expert") else \
            "tensor" if c.phase in ("tensor", "loss") else "data"
        seconds = c.timed * max(0.0, comm_time(c, sizes, cluster) - steps.get(c.behind, 0.0))
        if group == "data" and c.phase == "grads" and overlap.grads_in_backward:
            grads += seconds
        else:
            spent[group] += seconds
    exposed = {k: v * (1 - getattr(overlap, k)) for k, v in spent.items()}
    exposed["data"] += behind_backward(grads, backward, plan.stage_depth(m.layers))
    bw = cluster.stream_bandwidth
    opt = update_bytes(m, plan, gb) / bw if bw > 0 else 0.0
    off = offload_seconds(m, plan, cluster, update_bytes(m, plan, 4), cb)   # the host update: fp32 gradients
    opt = off.host_update or opt
    total = work.total + sum(exposed.values()) + opt + off.link
    mfu = step_flops(m) / (total * plan.devices * gemm_peak(m, plan, cluster, dtype))
    return StepTime(work.kernels, exposed["data"], exposed["tensor"], exposed["pipeline"], b, mfu,
                    bytes_per_axis(cs), opt, work.elementwise, exposed["context"], exposed["expert"], off.link,
                    off.unmodelled)
