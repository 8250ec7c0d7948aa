"""Time of one training step: compute by FLOPs, each strategy's collectives per mesh axis, the pipeline bubble.

FLOPs (per step, global batch ``B`` sequences of ``s`` tokens, ``l`` layers, hidden ``h``,
MLP width ``f``, vocabulary ``V``):

* a layer's forward is ``2s(4h² + 2hf) + 4s²h`` per sequence (projections and MLP, then
  ``QKᵀ`` and ``AV``); training is 3 forwards (backward = 2); full recomputation adds one
  more forward of the layers, selective recomputation the ``4s²h`` attention part; the
  logits cost ``2shV`` forward. With ``f = 4h`` and full recomputation this is Narayanan et
  al. (2021, eq. 3): :func:`narayanan_flops` ``= 96Bslh²(1 + s/(6h) + V/(16lh))``.
* MFU counts the model FLOPs without recomputation; per token that is ``6N + 12lhs`` for
  ``N`` non-embedding parameters (Kaplan et al. 2020 / PaLM appendix B): :func:`flops_per_token`.

Collectives (:func:`comms`) are listed per step with the bytes the compiled program's
inventory reports (:mod:`jaxpar.analysis.hlo`: the result of each collective on one device)
and timed with :mod:`jaxpar.cost.collectives` on the links the mesh axis spans
(:func:`axis_groups`: mesh order ``pipe, data, fsdp, tensor``, ``tensor`` innermost; a group
spread over nodes runs hierarchically: reduce-scatter in the node, the collective across
nodes on ``1/p_in`` of the bytes, all-gather in the node).

Two lowerings: ``ideal`` is the textbook program (Megatron TP: 2 all-reduces of the layer's
activations forward and ``1 + qkv_inputs`` backward, SP: all-gathers and reduce-scatters in
their place; DP: all-reduce; ZeRO-2/3 and FSDP: reduce-scatter + all-gather; ZeRO-3
gathers every layer twice per micro-batch). ``xla-cpu`` is what jaxpar's train step compiles
to on XLA:CPU, as checked against compiled programs by ``tests/test_cost_compiled.py``
(gradients that XLA reduces with all-reduce where ``ideal`` uses reduce-scatter, the
embedding gathered under SP, ...).

Overlap assumptions (:class:`Overlap`): by default *nothing* overlaps (XLA:CPU runs
collectives synchronously); ``Overlap(data=0.8)`` hides 80% of the data-axis collectives
behind the backward, as bucketed DDP / FSDP prefetch do on GPUs. Tensor-parallel and
pipeline transfers are on the critical path. The pipeline stretches the compute by
``1 / (1 - bubble)`` with the bubble of the schedule table (equal F, B, W costs). Compute runs
at ``cluster.matmul_efficiency(w)`` of the peak, ``w`` the FLOPs of the layer's largest matmul on
one device per micro-batch (``2·rows·s·h·f/t``): small micro-batches and thin shards run slower.
The optimizer update is memory bound: :func:`update_bytes` over ``cluster.memory_bandwidth``
(ZeRO-1/2/3 and FSDP update only their shard), not overlapped; so are the blocks' norms,
residual adds, GELU and softmax (:func:`elementwise_bytes`: the residual stream's share is
repeated on every tensor device under TP and split under SP).

Example::

    >>> from jaxpar.cost.model import gpt
    >>> m = gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    >>> f = step_flops(m, remat="full")
    >>> abs(f / narayanan_flops(1536, 2048, 96, 12288, 51200) - 1) < 1e-12
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

from . import collectives as C
from .cluster import Cluster
from .memory import REMAT, _key, _schedule_stats, _shards, _zero_axes
from .model import Leaf, ModelSpec

__all__ = ["Plan", "Comm", "Overlap", "StepTime", "LOWERINGS", "SCHEDULES", "flops_per_token", "narayanan_flops",
           "step_flops", "model_flops", "comms", "update_bytes", "elementwise_bytes", "bytes_per_axis", "axis_groups",
           "comm_time", "bubble", "step_time"]

LOWERINGS = ("ideal", "xla-cpu")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
AXES = ("pipe", "data", "fsdp", "tensor")


@dataclass(frozen=True)
class Plan:
    """One point of the search: mesh sizes and what to do with them (as :class:`jaxpar.Strategy`)."""

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    remat: str = "none"

    def __post_init__(self):
        for a in AXES + ("virtual", "microbatches"):
            v = getattr(self, a)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Plan.{a}={v!r}: must be a positive int.")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Plan.zero={self.zero!r}: choose 0, 1, 2 or 3.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
        if self.remat not in REMAT:
            raise ValueError(f"Plan.remat={self.remat!r}: choose one of {', '.join(REMAT)}.")

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def devices(self) -> int:
        return self.pipe * self.data * self.fsdp * self.tensor

    def name(self) -> str:
        """Short label in :meth:`jaxpar.Strategy.name`'s style, plus the remat policy.

        >>> Plan(pipe=4, data=2, tensor=8, zero=1, sequence_parallel=True, microbatches=8).name()
        'pp4-1f1b-m8-dp2-zero1-tp8-sp'
        """
        parts = []
        if self.pipe > 1:
            parts += [f"pp{self.pipe}", self.schedule] + ([f"v{self.virtual}"] if self.virtual > 1 else [])
            parts += [f"m{self.microbatches}"]
        for axis, label in (("data", "dp"), ("fsdp", "fsdp"), ("tensor", "tp")):
            if getattr(self, axis) > 1:
                parts.append(f"{label}{getattr(self, axis)}")
                if axis == "data" and self.zero:
                    parts.append(f"zero{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.microbatches > 1 and self.pipe == 1:
            parts.append(f"accum{self.microbatches}")
        if self.remat != "none":
            parts.append(f"remat-{self.remat}")
        return "-".join(parts) or "single"


# ----------------------------------------------------------------------------- FLOPs
def flops_per_token(n_params: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token ``6N + 12·l·h·s`` (``N``: parameters without embeddings).

    >>> flops_per_token(85e6, 12, 768, 1024) == 6 * 85e6 + 12 * 12 * 768 * 1024
    True
    """
    return 6 * n_params + 12 * layers * hidden * seq


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration with full recomputation, Narayanan et al. (2021) eq. (3):
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def _layer_forward(m: ModelSpec) -> float:
    s, h = m.seq, m.hidden
    return 2 * s * (4 * h * h + 2 * h * m.mlp) + 4 * s * s * h


def step_flops(m: ModelSpec, remat: str = "none") -> float:
    """FLOPs of one training step of the global batch, recomputation included."""
    if remat not in REMAT:
        raise ValueError(f"remat={remat!r}: choose one of {', '.join(REMAT)}.")
    fwd = _layer_forward(m)
    extra = {"none": 0.0, "selective": 4 * m.seq**2 * m.hidden, "full": fwd}[remat]
    return m.batch * (m.layers * (3 * fwd + extra) + 6 * m.seq * m.hidden * m.vocab)


def model_flops(m: ModelSpec) -> float:
    """FLOPs of one step without recomputation (the numerator of MFU)."""
    return step_flops(m, "none")


# ----------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Comm:
    """``count`` collectives per step of ``bytes`` each (result on one device, the HLO inventory's
    convention), over mesh ``axes``; ``phase`` says why (``grads``, ``params``, ``tensor``,
    ``pipeline``, ``loss``)."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: float
    phase: str

    def buffer_bytes(self, sizes: Mapping[str, int]) -> float:
        """The ``n`` of :mod:`jaxpar.cost.collectives`: a reduce-scatter's input is ``p`` results."""
        p = math.prod(sizes[a] for a in self.axes)
        return self.bytes * p if self.kind == "reduce-scatter" else self.bytes


def _is_matmul(leaf: Leaf) -> bool:
    """A weight read by a matmul (its gradient is a dot): >= 2 non-layer dims, not an embedding table."""
    dims = [n for n in leaf.logical if n != "layers"]
    return len(dims) >= 2 and dims[0] not in ("vocab", None)


def _is_row_parallel(leaf: Leaf) -> bool:
    """A row-parallel weight (``wo``, ``w2``): its tensor-split dimension is the contracted input."""
    dims = [n for n in leaf.logical if n != "layers"]
    return len(dims) >= 2 and dims[0] in ("heads", "mlp")


def _axes(sizes: Mapping[str, int], names) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in names and sizes.get(a, 1) > 1)


def comms(m: ModelSpec, plan: Plan, *, lowering: str = "ideal", compute_bytes: float = 2,
          grad_bytes: float = 2) -> list[Comm]:
    """The collectives of one step on one device of the busiest stage (see the module doc).

    >>> from jaxpar.cost.model import gpt
    >>> [(c.kind, c.axes, c.bytes, c.count) for c in comms(gpt(2, 32, 8, 16, 64, 16), Plan(data=8), grad_bytes=4)]
    [('all-reduce', ('data',), 18688.0, 1), ('all-reduce', ('data',), 50304.0, 2)]
    """
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering={lowering!r}: choose one of {', '.join(LOWERINGS)}.")
    sizes = plan.sizes
    out: list[Comm] = []

    def add(kind, axes, nbytes, count, phase):
        axes = _axes(sizes, axes)
        if axes and nbytes > 0 and count > 0:
            out.append(Comm(kind, axes, float(nbytes), count, phase))

    cpu = lowering == "xla-cpu"
    rows = m.batch / (plan.data * plan.fsdp * plan.microbatches)   # sequences per device per micro-batch
    act = rows * m.seq * m.hidden * compute_bytes                   # one activation of the residual stream
    if plan.tensor > 1:
        _tensor_comms(add, m, plan, act, rows * m.seq * 4, cpu)
    if plan.pipe > 1:
        _pipe_comms(add, m, plan, act)
    if _axes(sizes, ("data", "fsdp")):
        out += _data_comms(m, plan, cpu, compute_bytes, grad_bytes)
    return out


def _tensor_comms(add, m: ModelSpec, plan: Plan, act: float, stats: float, cpu: bool) -> None:
    """TP / SP: per layer per micro-batch, then the embedding, the head and the loss (``stats``: fp32
    softmax statistics). With a pipeline the embedding (first stage) and the head (last) are apart:
    the busiest stage, the last, has only the head's."""
    t, mb = plan.tensor, plan.microbatches
    n_layer = (m.layers // plan.pipe) * mb
    ends = 1 if plan.pipe > 1 else 2
    if not plan.sequence_parallel:
        add("all-reduce", ("tensor",), act, (2 + 1 + m.qkv_inputs) * n_layer, "tensor")
        add("all-reduce", ("tensor",), act, ends * mb, "tensor")         # embedding forward, head backward
    else:
        add("all-gather", ("tensor",), act, 4 * n_layer, "tensor")     # 2 forward, 2 backward
        add("reduce-scatter", ("tensor",), act / t, 2 * n_layer, "tensor")
        if cpu:   # XLA:CPU reduces the column-parallel input gradients with all-reduce
            add("all-reduce", ("tensor",), act, (1 + m.qkv_inputs) * n_layer, "tensor")
            add("all-gather", ("tensor",), act, mb, "tensor")          # the head's input
            add("all-reduce", ("tensor",), act, mb, "tensor")          # the head's input gradient
            wte = m.vocab * m.hidden * 4
            add("all-gather", ("tensor",), wte, mb, "tensor")          # the embedding table, gathered
            add("all-reduce", ("tensor",), wte, 1, "tensor")           # and its gradient
            add("all-gather", ("tensor",), m.seq * m.hidden * 4, 1, "tensor")   # positions' gradient
        else:
            add("reduce-scatter", ("tensor",), act / t, (1 + m.qkv_inputs) * n_layer, "tensor")
            add("all-gather", ("tensor",), act, mb, "tensor")
            add("reduce-scatter", ("tensor",), act / t, 2 * mb, "tensor")
    add("all-reduce", ("tensor",), stats, 4 * mb, "loss")               # vocab-parallel cross-entropy


def _pipe_comms(add, m: ModelSpec, plan: Plan, act: float) -> None:
    """Activations forward and their gradients backward, per micro-batch and chunk; then jaxpar's
    executor sums the gradients of the parameters outside the blocks (and the loss) over ``pipe``."""
    add("collective-permute", ("pipe",), act / (plan.tensor if plan.sequence_parallel else 1),
        2 * plan.microbatches * plan.virtual, "pipeline")
    key = _key(plan.sizes)
    outer = sum(_shards(leaf, key, plan.zero)[3] for leaf in m.leaves if not leaf.stacked)
    add("all-reduce", ("pipe",), outer * 4 + 4, 1, "pipeline")        # fp32 gradients and the loss


def _pipe_end(leaf: Leaf) -> str:
    """Which end of a pipeline runs a parameter outside the blocks: ``first`` for the embedding
    tables (indexed by token or position), ``last`` for the final norm and the head."""
    return "first" if leaf.logical and leaf.logical[0] in ("vocab", None) else "last"


def _is_token_table(leaf: Leaf) -> bool:
    return not leaf.stacked and len(leaf.logical) == 2 and leaf.logical == ("vocab", "embed")


def _busiest_end(m: ModelSpec, plan: Plan) -> str:
    """The pipeline end whose parameters outside the blocks have the most gradient elements here."""
    key = _key(plan.sizes)
    size = {"first": 0.0, "last": 0.0}
    for leaf in m.leaves:
        if not leaf.stacked:
            size[_pipe_end(leaf)] += _shards(leaf, key, plan.zero)[3]
    return max(size, key=size.get)


def _data_comms(m: ModelSpec, plan: Plan, cpu: bool, compute_bytes: float, grad_bytes: float) -> list[Comm]:
    """Data axes: gradient reductions and ZeRO / FSDP parameter gathers. In a pipeline a device reduces
    the gradients of its own blocks and of one end's outer parameters (the busiest end); on XLA:CPU it
    does so inside every backward action of the tick loop, i.e. once per micro-batch."""
    sizes = plan.sizes
    d, f, t, mb = plan.data, plan.fsdp, plan.tensor, plan.microbatches
    layers_dev = m.layers // plan.pipe
    data_axes = _axes(sizes, ("data", "fsdp"))
    g_axes, p_axes = _zero_axes(sizes, plan.zero, "grads"), _zero_axes(sizes, plan.zero, "params")
    o_axes = _zero_axes(sizes, plan.zero, "opt")
    explicit = t == 1 and plan.pipe == 1 and ((d > 1 and plan.zero >= 2) or f > 1)
    pbytes = 4 if cpu else compute_bytes
    end = _busiest_end(m, plan) if plan.pipe > 1 else None
    per_mb = mb if cpu and plan.pipe > 1 else 1
    groups: dict[tuple, float] = {}

    def acc(kind, axes, nbytes, count, phase):
        axes = _axes(sizes, axes)
        if axes and nbytes > 0:
            key = (kind, axes, count, phase)
            groups[key] = groups.get(key, 0.0) + nbytes

    key = _key(sizes)
    for leaf in m.leaves:
        n_p, _, _, local, shardable = _shards(leaf, key, plan.zero)
        count = layers_dev if leaf.stacked else 1
        per = local / (layers_dev if leaf.stacked else 1)          # one layer's slice
        g = per * grad_bytes * (_sp_grad_scale(m, leaf, t) if cpu and plan.sequence_parallel else 1)
        n_g = math.prod(sizes[a] for a in g_axes) if shardable else 1
        if end is None or leaf.stacked or _pipe_end(leaf) == end:      # gradients
            if cpu and end is not None and _is_token_table(leaf):
                # the lookup's transpose (a scatter-add) in the executor's manual region is replicated over
                # the data axes: XLA gathers the output cotangent and the token ids instead of reducing the table
                group = m.batch / mb * m.seq                     # tokens of a micro-batch, whole data group
                acc("all-gather", data_axes, group * m.hidden * compute_bytes, mb, "grads")
                acc("all-gather", data_axes, group * 4, mb, "grads")
            elif not cpu:
                if shardable and g_axes:
                    acc("reduce-scatter", g_axes, g / n_g, count, "grads")
                    acc("all-reduce", set(data_axes) - set(g_axes), g / n_g, count, "grads")
                else:
                    acc("all-reduce", data_axes, g, count, "grads")
            elif explicit and leaf.stacked and shardable:
                acc("reduce-scatter", g_axes, g / n_g, count, "grads")
                acc("all-reduce", set(data_axes) - set(g_axes), g / n_g, count, "grads")
            elif len(data_axes) == 2 and plan.zero < 2 and _is_matmul(leaf) and shardable and not (
                    plan.sequence_parallel and _is_row_parallel(leaf)):   # SP: reduced in its region, all at once
                acc("all-reduce", ("fsdp",), g, count * per_mb, "grads")   # fsdp first, then the shard over data
                acc("all-reduce", ("data",), g / f, count * per_mb, "grads")
            else:
                acc("all-reduce", data_axes, g, count * per_mb, "grads")
        # parameters: ZeRO-3 / FSDP gathers (forward, and again in the backward for the layers)
        if p_axes and shardable:
            gathers = (2 if leaf.stacked else 1) * (mb if not cpu else 1)
            acc("all-gather", p_axes, per * pbytes, count * gathers, "params")
        # ZeRO-1/2: the updated shard is gathered back over the axes the optimizer state has more;
        # the result is the parameter shard (1/fsdp of the slice with an fsdp axis)
        extra = tuple(a for a in o_axes if a not in p_axes)
        if extra and shardable:
            acc("all-gather", extra, per * (4 if cpu else compute_bytes) * (leaf.size / local) / n_p, count, "params")
    return [Comm(kind, axes, nbytes, count, phase) for (kind, axes, count, phase), nbytes in groups.items()]


def _sp_grad_scale(m: ModelSpec, leaf: Leaf, t: int) -> float:
    """Size of ``leaf``'s data-axis gradient reduction under SP on XLA:CPU, relative to its tensor shard:
    the vocab-parallel embedding table is gathered over ``tensor`` before the lookup, so its gradient
    is formed (and reduced over the data axes) at full size (``t``); the position embedding's gradient
    comes out split over the sequence like the residual stream (``1/t``)."""
    if leaf.stacked or t == 1 or not leaf.logical:
        return 1.0
    if leaf.logical[0] == "vocab" and len(leaf.shape) == 2 and leaf.logical[1] == "embed":
        return float(t)
    if leaf.logical == (None, "embed") and leaf.shape[0] == m.seq and m.seq % t == 0:
        return 1.0 / t
    return 1.0


def bytes_per_axis(cs: list[Comm]) -> dict[str, float]:
    """Bytes per step per mesh axis (a collective over several axes counts for each of them)."""
    out: dict[str, float] = {}
    for c in cs:
        for a in c.axes:
            out[a] = out.get(a, 0.0) + c.bytes * c.count
    return out


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


def axis_groups(sizes: Mapping[str, int], axes: tuple[str, ...], per_node: int) -> tuple[int, int]:
    """``(p_in, p_out)``: devices of one group of ``axes`` inside a node, and nodes it spans.

    >>> axis_groups({"pipe": 4, "data": 2, "tensor": 8}, ("tensor",), 8), axis_groups({"pipe": 4, "data": 2, "tensor": 8}, ("data",), 8)
    ((8, 1), (1, 2))
    """
    return _groups(tuple(sorted((a, sizes.get(a, 1)) for a in AXES)), tuple(axes), per_node)


def comm_time(c: Comm, sizes: Mapping[str, int], cluster: Cluster) -> float:
    """Seconds of one collective ``c`` (the best algorithm on each level)."""
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


def bubble(schedule: str, pipe: int, microbatches: int, virtual: int = 1) -> float:
    """Bubble fraction of the schedule table (:func:`jaxpar.pipeline.schedules.bubble_fraction`).

    >>> bubble("1f1b", 4, 8), bubble("gpipe", 1, 8)
    (0.2727272727272727, 0.0)
    """
    return 0.0 if pipe == 1 else _schedule_stats(schedule, pipe, microbatches, virtual)[0]


@dataclass(frozen=True)
class Overlap:
    """Fraction of each axis group's collective time hidden behind compute (0 = none)."""

    data: float = 0.0
    tensor: float = 0.0
    pipeline: float = 0.0

    def __post_init__(self):
        for k in ("data", "tensor", "pipeline"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"Overlap.{k}={v!r}: must be a fraction in [0, 1].")


@dataclass(frozen=True)
class StepTime:
    """Seconds per step: ``compute`` (matmul FLOPs, with the bubble), exposed ``data`` / ``tensor`` /
    ``pipeline`` communication, ``bubble`` fraction, ``mfu``, bytes per axis, the ``optimizer`` update
    and the blocks' ``elementwise`` ops (both memory bound: :func:`update_bytes` and
    :func:`elementwise_bytes` over the cluster's memory bandwidth; the latter with the bubble)."""

    compute: float
    data: float
    tensor: float
    pipeline: float
    bubble: float
    mfu: float
    bytes_per_axis: dict = field(default_factory=dict)
    optimizer: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.elementwise + self.data + self.tensor + self.pipeline + self.optimizer


def update_bytes(m: ModelSpec, plan: Plan, grad_bytes: float = 4) -> float:
    """Bytes one device reads and writes in the optimizer update: for each parameter element whose
    optimizer state it holds (ZeRO shards it), fp32 master weights and two Adam moments read and
    written (``2 * (4 + 8)``) and the gradient read (``grad_bytes``).

    >>> from jaxpar.cost.model import gpt
    >>> m = gpt(2, 32, 8, 16, 64, 16)
    >>> update_bytes(m, Plan(data=8)) == 28 * m.n_params, update_bytes(m, Plan(data=8, zero=1)) < 28 * m.n_params / 7
    (True, True)
    """
    key = _key(plan.sizes)
    held = sum(leaf.size / _shards(leaf, key, plan.zero)[2] for leaf in m.leaves) if m.leaves else \
        m.n_params / plan.devices
    return held * (2 * (4 + 8) + grad_bytes)


def elementwise_bytes(m: ModelSpec, plan: Plan, compute_bytes: float = 2) -> float:
    """Bytes one device reads and writes per step in the memory-bound ops of the blocks.

    Per token and layer, forward: the two layer norms (read and write the residual stream,
    ``2h`` each) and the two residual adds (two reads, one write: ``3h`` each), ``10h`` in all;
    the MLP's bias and GELU (``2f``); the attention softmax with its scale and causal mask over
    ``a·s`` fp32 scores (``2·a·s`` values of 4 bytes). Training moves three times the forward's
    bytes (the backward of each op reads its input and the incoming gradient and writes the
    outgoing one; as for the FLOPs, backward = 2 forwards); full recomputation adds a forward,
    selective the softmax's. Tensor parallelism splits the MLP (``f/t``) and the softmax (heads,
    ``a/t``) but repeats the ``10h`` of the residual stream on every tensor device; sequence
    parallelism splits that too (``10h/t``).

    >>> from jaxpar.cost.model import gpt
    >>> m = gpt(4, 128, 8, 64, 256, 16)
    >>> tp = elementwise_bytes(m, Plan(tensor=8), 4)
    >>> sp = elementwise_bytes(m, Plan(tensor=8, sequence_parallel=True), 4)
    >>> elementwise_bytes(m, Plan(), 4) == 3 * 16 * 64 * 4 * 4 * (10 * 128 + 2 * 512 + 2 * 8 * 64), round(tp / sp, 2)
    (True, 3.69)
    """
    t = plan.tensor
    tokens = m.batch * m.seq / (plan.data * plan.fsdp) * (m.layers // plan.pipe)   # token-layers per device
    passes = 3 + (plan.remat == "full")
    resid = 10 * m.hidden / (t if plan.sequence_parallel else 1)
    softmax = 2 * m.heads * m.seq / t * 4 * (passes + (plan.remat == "selective"))
    return tokens * ((resid + 2 * m.mlp / t) * compute_bytes * passes + softmax)


def step_time(m: ModelSpec, plan: Plan, cluster: Cluster, *, dtype: str = "bfloat16", lowering: str = "ideal",
              overlap: Overlap = Overlap(), grad_bytes: float | None = None) -> StepTime:
    """Predicted seconds per step of ``plan`` on ``cluster`` (see the module doc for what is assumed).

    >>> from jaxpar.cost.cluster import load_cluster
    >>> from jaxpar.cost.model import gpt
    >>> t = step_time(gpt(12, 768, 12, 1024, 50304, 64), Plan(data=8), load_cluster("h100"))
    >>> 0 < t.mfu < 0.5, t.tensor
    (True, 0.0)
    """
    cb = 4 if dtype == "float32" else 2
    gb = cb if grad_bytes is None else grad_bytes
    sizes = plan.sizes
    flops = step_flops(m, plan.remat) / plan.devices
    b = bubble(plan.schedule, plan.pipe, plan.microbatches, plan.virtual)
    rows = m.batch / (plan.data * plan.fsdp * plan.microbatches)
    gemm = 2 * rows * m.seq * m.hidden * m.mlp / plan.tensor          # the layer's largest matmul per device
    compute = flops / (cluster.peak(dtype) * cluster.matmul_efficiency(gemm)) / (1 - b)
    spent = {"data": 0.0, "tensor": 0.0, "pipeline": 0.0}
    cs = comms(m, plan, lowering=lowering, compute_bytes=cb, grad_bytes=gb)
    for c in cs:
        group = "pipeline" if c.phase == "pipeline" else "tensor" if c.phase in ("tensor", "loss") else "data"
        spent[group] += c.count * comm_time(c, sizes, cluster)
    exposed = {k: v * (1 - getattr(overlap, k)) for k, v in spent.items()}
    bw = cluster.memory_bandwidth
    opt = update_bytes(m, plan, gb) / bw if bw > 0 else 0.0
    elem = elementwise_bytes(m, plan, cb) / bw / (1 - b) if bw > 0 else 0.0
    total = compute + elem + sum(exposed.values()) + opt
    mfu = model_flops(m) / (total * plan.devices * cluster.peak(dtype))
    return StepTime(compute, exposed["data"], exposed["tensor"], exposed["pipeline"], b, mfu, bytes_per_axis(cs), opt,
                    elem)
