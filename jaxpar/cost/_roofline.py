"""Seconds of one transformer layer's kernels on one device, each on the device's roofline
(docs/planning.md §4): a matmul of ``w`` FLOPs that moves ``n`` bytes takes
``max(w / (peak * efficiency(w)), n / stream_bandwidth)``; the norms, residual adds, GELU and softmax
move bytes only (:func:`layer_elementwise_bytes`). Context parallelism, MoE layers and the kernels
outside the blocks are in docs/planning.md §10.

Example::

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.cost._model import gpt
    >>> m, c = gpt(24, 2304, 24, 2048, 51200, 512), load_cluster("a100_80gb")
    >>> k = {x.name: x for x in layer_kernels(m, Plan(), 16, 2)}
    >>> k["fc1"].flops == 2 * 16 * 2048 * 2304 * 9216, kernel_seconds(k["scores"], c, "bfloat16") > \\
    ...     k["scores"].flops / (c.peak("bfloat16") * c.efficiency)          # memory bound at d = 96
    (True, True)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from jaxpar.cost._cluster import FP8, LAUNCH_S, Cluster
from jaxpar.cost._context_experts import EXPERT_TILE, expert_slots, fused_context, routed_rows, score_fraction
from jaxpar.cost._device_bytes import half_per_layer
from jaxpar.cost._model import ModelSpec
from jaxpar.cost._parallel import Plan


@dataclass(frozen=True)
class Kernel:
    """``count`` launches of a kernel of ``flops`` FLOPs that reads and writes ``bytes`` bytes,
    run ``passes`` times per training step of one micro-batch (forward, backward, recomputation);
    a matmul's ``shape`` is ``(batch, m, k, n)``; ``flash``: one of a fused attention kernel's ``s²``
    GEMMs, on the kernel's own efficiency curve (:meth:`~jaxpar.cost.Cluster.flash_efficiency`). ``experts``: how
    MoE's routed experts run this batched matmul (:data:`EXPERT_KERNELS`): ``""`` one dense batched GEMM (the
    textbook's), ``"grouped"`` one grouped-kernel call over the ``batch`` groups of ``m`` rows
    (:meth:`~jaxpar.cost.Cluster.grouped_efficiency`, plus a launch), ``"tiles"`` the tile loop: ``batch * m /
    EXPERT_TILE`` GEMMs of one tile each, at the small GEMM's efficiency, each with :data:`TILE_LAUNCHES`
    launches on a GPU."""

    name: str
    flops: float
    bytes: float
    count: int = 1
    passes: int = 1
    shape: tuple = ()
    flash: bool = False
    experts: str = ""


#: How each lowering runs MoE's routed experts (:data:`jaxpar.cost._traffic.LOWERINGS`): the GPU compilers
#: jaxpar's grouped kernels, the CPU's and libtpu the tile loop, the textbook and Megatron-LM one batched GEMM.
EXPERT_KERNELS = {"xla": "grouped", "xla-cpu": "tiles", "xla-tpu": "tiles"}
#: Launches of one tile of the tile loop on a GPU: its gather, GEMMs, activation, scatter-add and table updates
#: (4 to 13 read in the compiled h100 step; issue 88).
TILE_LAUNCHES = 8


def matmul(name: str, batch: float, m: float, k: float, n: float, compute_bytes: float, *, count: int = 1,
           passes: int = 1) -> Kernel:
    """A (batched) matmul ``[batch, m, k] x [batch, k, n]``: ``2·batch·m·k·n`` FLOPs, its two operands
    read and its result written once.

    Args:
      name: a label.
      batch, m, k, n: the shape.
      compute_bytes: bytes per value.
      count: launches of it (e.g. separate q, k and v projections).
      passes: runs per training step of one micro-batch.

    Returns:
      The :class:`Kernel`.

    >>> matmul("x", 1, 4, 8, 2, 2).flops, matmul("x", 1, 4, 8, 2, 2).bytes
    (128, 112)
    """
    return Kernel(name, 2 * batch * m * k * n, compute_bytes * batch * (m * k + k * n + m * n), count, passes,
                  (batch, m, k, n))


def fp8_kernels(m: ModelSpec, plan: Plan) -> frozenset[str]:
    """The kernels of :func:`layer_kernels` that run in FP8 under the plan's FP8: the attention projections,
    the MLP and the shared experts, each where its GEMM's contracted and output sizes (of the model's
    weights: ``hidden`` against the heads' ``hidden``, ``mlp``, ``shared_mlp``) are both at least its
    ``min_dim`` (:meth:`~jaxpar.cost.Leaf.fp8`); not the routed experts (:func:`jaxpar.logical.fp8_covered`).

    Args:
      m: the model.
      plan: its ``fp8`` is read.

    Returns:
      Kernel names (empty without FP8).

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.options import Fp8
    >>> from jaxpar.strategy import Strategy
    >>> sorted(fp8_kernels(gpt(2, 1024, 8, 64, 256, 8, mlp=512), Plan(strategy=Strategy(fp8=Fp8(min_dim=1024)))))
    ['proj', 'qkv']
    """
    if plan.strategy.fp8 is None:
        return frozenset()
    h, d = m.hidden, plan.strategy.fp8.min_dim
    groups = {("qkv", "proj"): m.q_width, ("fc1", "fc2"): m.mlp, ("shared_fc1", "shared_fc2"): m.shared_mlp}
    return frozenset(k for names, width in groups.items() if width and min(h, width) >= d for k in names)


def fp8_quantize_bytes(kernels: list[Kernel], covered: frozenset[str], recipe: str | None, compute_bytes: float,
                       remat: str = "none") -> tuple[float, float]:
    """Bytes the FP8 casts of the covered matmuls read and write per micro-batch, ``(forward, backward)``:
    each operand element quantized costs ``2 * compute_bytes + 1`` (its absolute maximum read, then read,
    scaled and written in one byte). Forward: both operands of each launch (again under full
    recomputation); backward, tensorwise: the output gradient (the forward's FP8 operands are saved);
    rowwise: each backward GEMM quantizes both its operands along its own rows.

    Args:
      kernels: :func:`layer_kernels`' list.
      covered: :func:`fp8_kernels`.
      recipe: ``"tensorwise"`` or ``"rowwise"``.
      compute_bytes: bytes per value.
      remat: the plan's recomputation.

    Returns:
      ``(forward, backward)`` bytes (backward with the recomputed forward).

    >>> k = [matmul("fc1", 1, 8, 16, 32, 2)]
    >>> fp8_quantize_bytes(k, frozenset({"fc1"}), "tensorwise", 2)
    (3200, 1280)
    """
    per, forward, backward = 2 * compute_bytes + 1, 0, 0
    for k in kernels:
        if k.name not in covered:
            continue
        b, mm, kk, n = k.shape
        forward += k.count * b * (mm * kk + kk * n) * per
        grads = mm * n if recipe == "tensorwise" else 2 * mm * n + mm * kk + kk * n
        backward += k.count * b * grads * per
    return forward, backward + forward * (remat == "full")


def layer_kernels(m: ModelSpec, plan: Plan, rows: float, compute_bytes: float, moe: bool = False, *,
                  fused_attention: bool = False, lowering: str = "ideal") -> list[Kernel]:
    """The matmuls of one layer on one device for a micro-batch of ``rows`` sequences (docs/planning.md §4): the
    q, k, v projections (``qkv``, one launch per ``qkv_inputs``), the attention's ``scores`` and ``context``, the
    output projection (``proj``), the MLP's ``fc1`` (two launches gated: gate and up) and ``fc2``, or the experts'.

    Args:
      m: the model.
      plan: the plan (its ``tensor``, ``context`` and ``expert`` sizes, CP method and ``remat`` are read).
      rows: sequences per micro-batch on one device.
      compute_bytes: bytes per value of the activations and weights (2 for bf16 / fp16).
      moe: an MoE layer of ``m`` (its MLP replaced by the experts').
      fused_attention: flash kernels run the attention (:attr:`Cluster.fused_attention`; under CP in a 16-bit
        compute dtype, :func:`~jaxpar.cost._context_experts.fused_context`): the whole-sequence kernel skips the
        causal mask's upper half and its backward computes the scores again; a ring's or all-gather's flash
        blocks compute the scores and ``dO Vᵀ`` once more in the backward (its dQ and its dK/dV kernels
        each recompute them).
      lowering: the program's lowering: how MoE's experts run (:data:`EXPERT_KERNELS`).

    Returns:
      The :class:`Kernel` list, ``passes`` set for training with ``plan.remat``.
    """
    s, h, f, a, t, cb = m.seq, m.hidden, m.mlp, m.heads, plan.tensor, compute_bytes
    C = plan.context
    tokens, heads = rows * s / C, rows * a / t
    full, attn = 3 + (plan.remat == "full"), 3 + (plan.remat != "none")
    q = m.qkv_inputs
    if m.kv_width == m.q_width == h and m.kv_split(t) == t:   # q, k and v of width h (the GPT's): as before
        out = [matmul("qkv", 1, tokens, h, 3 * h / (t * q), cb, count=q, passes=full)]
    else:           # GQA: q's width and the K/V's (split over tensor, or replicated where it does not divide them)
        width = m.q_width / t + 2 * m.kv_width / m.kv_split(t)
        out = [matmul("qkv", 1, tokens, h, width / q, cb, count=q, passes=full)]
    out += _attention_kernels(m, plan, heads, cb, attn, fused_attention)
    out.append(matmul("proj", 1, tokens, m.q_width / t, h, cb, passes=full))
    if moe:
        return out + _moe_kernels(m, plan, rows, tokens, cb, full, EXPERT_KERNELS.get(lowering, ""))
    return out + [matmul("fc1", 1, tokens, h, f / t, cb, count=m.mlp_inputs, passes=full),
                  matmul("fc2", 1, tokens, f / t, h, cb, passes=full)]


def _attention_kernels(m: ModelSpec, plan: Plan, heads: float, cb: float, attn: int, fused: bool) -> list[Kernel]:
    """``QKᵀ`` and ``AV`` of the device's share of the scores (docs/planning.md §10); ``fused``: a causal flash
    kernel's half of them, its scores once more in the backward, its forward again only under full remat."""
    s, d, C, method = m.seq, m.head_dim, plan.context, plan.strategy.context_setting.method
    if fused and (C == 1 or method == "ulysses"):   # save-matmuls keeps the kernel's residuals: only full remat reruns it
        passes = 3 + (plan.remat == "full")
        return [replace(matmul("scores", heads / C / 2, s, d, s, cb, passes=passes + 1), flash=True),
                replace(matmul("context", heads / C / 2, s, s, d, cb, passes=passes), flash=True)]
    if C == 1:
        return [matmul("scores", heads, s, d, s, cb, passes=attn), matmul("context", heads, s, s, d, cb, passes=attn)]
    extra = 1 if fused else 0           # the flash blocks' backward: scores and dO V^T in both its kernels
    if method == "ring":
        blocks, n = C * C * score_fraction("ring", C, plan.strategy.context_setting.balance), s / C
        return [matmul("scores", heads * blocks, n, d, n, cb, passes=attn + 1 + extra),
                matmul("context", heads * blocks, n, n, d, cb, passes=attn + extra)]
    if method == "all_gather":          # XLA's path keeps the probabilities; the flash blocks recompute them
        return [matmul("scores", heads, s / C, d, s, cb, passes=attn + 2 * extra),
                matmul("context", heads, s / C, s, d, cb, passes=attn + extra)]
    return [matmul("scores", heads / C, s, d, s, cb, passes=attn),
            matmul("context", heads / C, s, s, d, cb, passes=attn)]


def _moe_kernels(m: ModelSpec, plan: Plan, rows: float, tokens: float, cb: float, full: int,
                 experts: str = "") -> list[Kernel]:
    """The MoE MLP's kernels on one device (docs/planning.md §10): the router, the experts' two GEMMs on the
    routed rows (:func:`~jaxpar.cost._context_experts.routed_rows`, one batch per local expert; ``experts``: how
    they run, :attr:`Kernel.experts`), the rows' gathers and scatter-adds (:func:`_expert_rows_bytes`) and the
    shared experts. The experts' backward reads its saved pre-activations; any recomputation runs the first
    GEMM again for them (they are not matmul outputs)."""
    h, M, t, ep = m.hidden, m.expert_mlp, plan.tensor, plan.expert
    local, routed = m.experts / ep, routed_rows(m, rows, plan.context, ep)
    redo = plan.remat != "none"
    out = [matmul("router", 1, tokens, h, m.experts, cb, passes=full),
           replace(matmul("expert_fc1", local, routed / local, h, M / t, cb, count=m.mlp_inputs, passes=3 + redo),
                   experts=experts),
           replace(matmul("expert_fc2", local, routed / local, M / t, h, cb, passes=3), experts=experts),
           Kernel("expert_rows", 0.0, _expert_rows_bytes(m, plan, rows, routed, cb), passes=3 + redo)]
    if m.shared_mlp:
        out += [matmul("shared_fc1", 1, tokens, h, m.shared_mlp / t, cb, count=m.mlp_inputs, passes=full),
                matmul("shared_fc2", 1, tokens, m.shared_mlp / t, h, cb, passes=full)]
    return out


def _expert_rows_bytes(m: ModelSpec, plan: Plan, rows: float, routed: float, cb: float) -> float:
    """Bytes of one pass of an MoE layer's row moves on one device: the ``routed`` rows gathered (read and
    written) and their outputs scatter-added into the output (fp32; one row per choice under EP); under
    EP also the ``E_p·S`` rows packed into the send buffer and those brought back scatter-added into the
    fp32 tokens."""
    out = routed * (3 * cb + 8)
    if plan.expert > 1:
        out += expert_slots(m, rows, plan.context, plan.expert) * (3 * cb + 8)
    return out * m.hidden


def kernel_seconds(k: Kernel, cluster: Cluster, dtype: str) -> float:
    """Seconds of one pass of ``k`` (all its launches) on the roofline of ``cluster`` (docs/planning.md §4).

    Args:
      k: the kernel.
      cluster: its peak FLOP/s, matmul (or flash attention) efficiency and streaming bandwidth are read.
      dtype: the compute dtype (picks the peak).

    Returns:
      ``count * max(flops / (peak * efficiency(flops)), bytes / stream_bandwidth)``.

    >>> from jaxpar.cost._cluster import load_cluster
    >>> kernel_seconds(Kernel("loss", 0.0, 3350e9), load_cluster("h100"), "bfloat16")
    1.0
    """
    if k.experts:
        return k.count * _expert_seconds(k, cluster, dtype)
    efficiency = cluster.flash_efficiency(k.flops) if k.flash else cluster.matmul_efficiency(k.flops)
    compute = k.flops / (cluster.peak(dtype) * efficiency) if k.flops > 0 else 0.0
    bw = cluster.stream_bandwidth
    return k.count * max(compute, k.bytes / bw if bw > 0 else 0.0)


def _expert_seconds(k: Kernel, cluster: Cluster, dtype: str) -> float:
    """One launch of MoE's routed experts' batched matmul ``k`` as :attr:`Kernel.experts` runs it: one grouped
    call at the grouped kernel's efficiency for its rows a group, plus its launch (a GPU's); or the tile loop's
    tiles, each a GEMM of :data:`~jaxpar.cost._context_experts.EXPERT_TILE` rows at the small GEMM's efficiency,
    plus :data:`TILE_LAUNCHES` launches each on a GPU."""
    batch, rows, _, _ = k.shape
    bw, gpu = cluster.stream_bandwidth, cluster.platform == "cuda"
    memory = k.bytes / bw if bw > 0 else 0.0
    if k.experts == "grouped":
        compute = k.flops / (cluster.peak(dtype) * cluster.grouped_efficiency(rows))
        return max(compute, memory) + LAUNCH_S * gpu
    tiles = batch * rows / EXPERT_TILE
    per_tile = k.flops / tiles
    compute = tiles * per_tile / (cluster.peak(dtype) * cluster.matmul_efficiency(per_tile))
    return max(compute, memory) + tiles * TILE_LAUNCHES * LAUNCH_S * gpu


def layer_elementwise_bytes(m: ModelSpec, plan: Plan, rows: float, compute_bytes: float, moe: bool = False, *,
                            fused_attention: bool = False) -> float:
    """Bytes one device reads and writes in the memory-bound ops of one layer per micro-batch of ``rows``
    sequences, in training (see :func:`jaxpar.cost._time.elementwise_bytes` for the ops counted).

    Under CP a device has ``s/C`` tokens and its method's share of the softmax
    (:func:`~jaxpar.cost._context_experts.score_fraction` of ``s^2`` per head); in an MoE layer the
    GELU runs on the routed rows (:func:`~jaxpar.cost._context_experts.routed_rows`, about ``k`` per
    token, of width ``M/t``) and the shared experts'.

    Args:
      m: the model.
      plan: its ``tensor``, ``sequence_parallel``, ``remat`` and CP are read.
      rows: sequences per micro-batch on one device.
      compute_bytes: bytes per activation value (the softmax is counted in fp32).
      moe: an MoE layer.
      fused_attention: flash kernels keep the softmax on chip (no softmax bytes; as :func:`layer_kernels`).

    Returns:
      Bytes per layer and micro-batch (forward, backward and recomputation).

    >>> from jaxpar.cost._model import gpt
    >>> layer_elementwise_bytes(gpt(4, 128, 8, 64, 256, 16), Plan(), 1, 4) == 3 * 64 * (
    ...     (10 * 128 + 2 * 512) * 4 + 2 * 8 * 64 * 4)
    True
    """
    t, C = plan.tensor, plan.context
    passes = 3 + (plan.remat == "full")
    resid = 10 * m.hidden / (t if plan.strategy.sequence_parallel else 1)
    act = m.mlp_inputs + 1           # the activation reads its inputs (gate and up, gated) and writes one
    mlp = act * m.mlp / t
    if moe:
        routed = routed_rows(m, rows, C, plan.expert) / (rows * m.seq / C)      # per token
        mlp = act * routed * m.expert_mlp / t + act * m.shared_mlp / t
    if not m.positions:              # RoPE: q and k read and written
        resid += 2 * (m.q_width / t + m.kv_width / m.kv_split(t))
    cp = plan.strategy.context_setting
    keys = m.seq * C * score_fraction(cp.method, C, cp.balance)   # scores per query token
    softmax = 0.0 if fused_attention else 2 * m.heads * keys / t * 4 * (passes + (plan.remat == "save-matmuls"))
    return rows * (m.seq / C) * ((resid + mlp) * compute_bytes * passes + softmax)


def kept_value_bytes(m: ModelSpec, plan: Plan, rows: float, compute_bytes: float, lowering: str,
                     moe: bool = False) -> float:
    """Bytes one layer writes in the forward, and reads back in the backward, for the values it keeps without
    recomputation beyond those ``save-matmuls`` keeps, per micro-batch of ``rows`` sequences on one device:
    the GPU compiler's step (``lowering="xla"``) under ``remat="none"`` saves intermediates (norms, the
    activation's, upcasts) that ``save-matmuls`` recomputes inside the backward's fusions, at no traffic;
    the matmuls' outputs are kept either way and their kernels write them anyway. The difference of the two
    rows of :data:`~jaxpar.cost._device_bytes.HALF_KEEPS` (bytes per token and ``h``, measured under 16-bit
    compute on one tensor rank), at a device's ``s/C`` tokens and split over ``t`` as sequence parallelism
    splits it (without SP the residual stream's share repeats: a lower bound). Checked on one H200: GPT-124M's
    step with ``none`` 4.4 ms slower than with ``save-matmuls``, this term 4.6 ms (docs/benchmarks.md §21).
    Not measured, so 0: other lowerings, fp32 compute, MoE layers.

    Args:
      m: the model.
      plan: its ``remat``, ``tensor`` and ``context`` are read.
      rows: sequences per micro-batch on one device.
      compute_bytes: bytes per activation value.
      lowering: the program's lowering (:data:`jaxpar.cost._traffic.LOWERINGS`).
      moe: an MoE layer.

    Returns:
      Bytes, written once (the backward reads them once more).

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> kept_value_bytes(m, Plan(), 1, 2, "xla") == (84 - 22) * 32 * 64, kept_value_bytes(m, Plan(), 1, 4, "xla")
    (True, 0.0)
    """
    if lowering != "xla" or compute_bytes != 2 or plan.remat != "none" or moe:
        return 0.0
    extra = half_per_layer(m, "none", rows) - half_per_layer(m, "save-matmuls", rows)
    return extra / (plan.context * plan.tensor)


class Work(NamedTuple):
    """Seconds per micro-batch: ``kernels`` (matmuls, the embedding and the loss) and ``elementwise``
    (the blocks' memory-bound ops)."""

    kernels: float
    elementwise: float

    @property
    def total(self) -> float:
        return self.kernels + self.elementwise

    def __add__(self, other: "Work") -> "Work":
        return Work(self.kernels + other.kernels, self.elementwise + other.elementwise)

    def times(self, k: float) -> "Work":
        """This work ``k`` times.

        Args:
          k: the factor.

        Returns:
          The scaled :class:`Work`.
        """
        return Work(self.kernels * k, self.elementwise * k)


def layer_work(m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str, rows: float, compute_bytes: float, *,
               forward_only: bool = False, moe: bool = False, lowering: str = "ideal") -> Work:
    """Seconds of one layer per micro-batch of ``rows`` sequences on one device; under the plan's FP8 the
    covered matmuls (:func:`fp8_kernels`) at the cluster's FP8 peak and their casts
    (:func:`fp8_quantize_bytes`) with the elementwise ops, as are the kept values' write and read
    (:func:`kept_value_bytes`).

    Args:
      m, plan, cluster, dtype: the model, plan, cluster and compute dtype.
      rows: sequences per micro-batch on one device.
      compute_bytes: bytes per value.
      forward_only: the plain forward instead of training (forward, backward, recomputation).
      moe: an MoE layer.
      lowering: the program's lowering (:data:`jaxpar.cost._traffic.LOWERINGS`).

    Returns:
      A :class:`Work`: the matmuls' seconds (:func:`layer_kernels`) and the elementwise ops' seconds.
    """
    fused = cluster.fused_attention and (plan.context == 1 or fused_context(True, dtype))
    ks = layer_kernels(m, plan, rows, compute_bytes, moe, fused_attention=fused, lowering=lowering)
    fp8 = fp8_kernels(m, plan)
    kernels = sum(kernel_seconds(k, cluster, FP8 if k.name in fp8 else dtype) * (1 if forward_only else k.passes)
                  for k in ks)
    bw = cluster.stream_bandwidth
    elem = layer_elementwise_bytes(m, plan, rows, compute_bytes, moe, fused_attention=fused)
    if forward_only:
        elem /= 3 + (plan.remat == "full")
    quantize = fp8_quantize_bytes(ks, fp8, plan.strategy.fp8.recipe, compute_bytes, plan.remat) if fp8 else (0.0, 0.0)
    elem += quantize[0] if forward_only else sum(quantize)
    elem += kept_value_bytes(m, plan, rows, compute_bytes, lowering, moe) * (1 if forward_only else 2)
    return Work(kernels, elem / bw if bw > 0 else 0.0)


def end_work(m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str, rows: float,
             compute_bytes: float) -> tuple[Work, Work]:
    """Seconds per micro-batch of what the first pipeline stage runs before the blocks (the embedding)
    and the last after them (the head and the loss), in training (docs/planning.md §4).

    Args:
      m, plan, cluster, dtype: the model, plan, cluster and compute dtype.
      rows: sequences per micro-batch on one device.
      compute_bytes: bytes per value.

    Returns:
      ``(first, last)`` as :class:`Work` (all of it in ``kernels``).

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.cost._model import gpt
    >>> first, last = end_work(gpt(2, 32, 8, 16, 64, 16), Plan(), load_cluster("h100"), "bfloat16", 2, 2)
    >>> 0 < first.kernels < last.kernels, first.elementwise
    (True, 0.0)
    """
    tokens, cb, vt = rows * m.seq / plan.context, compute_bytes, m.vocab / plan.tensor
    head = matmul("head", 1, tokens, m.hidden, vt, cb, passes=4 if m.loss_chunks > 1 else 3)   # pieces: again
    loss = Kernel("loss", 0.0, tokens * vt * (2 * cb + 8))
    embed = Kernel("embedding", 0.0, 6 * tokens * m.hidden * cb)
    last = kernel_seconds(head, cluster, dtype) * head.passes + kernel_seconds(loss, cluster, dtype)
    return Work(kernel_seconds(embed, cluster, dtype), 0.0), Work(last, 0.0)
