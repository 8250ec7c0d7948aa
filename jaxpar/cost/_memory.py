"""The paper's terms of the memory per device (docs/planning.md §3): ZeRO's training state per stage,
Korthikanti et al.'s activations per layer (:data:`PAPER_KEEPS`) and how each parameter is sharded on a mesh;
:func:`jaxpar.cost.memory_per_device` sums them (:class:`MemoryEstimate`, offload's rule :func:`offloaded`).
:data:`PRECISIONS`: bytes per parameter, gradient and optimizer state.

Example::

    >>> [round(zero_state_bytes(7.5e9, 64, s)["total"] / 1e9, 3) for s in (0, 1, 2, 3)]
    [120.0, 31.406, 16.641, 1.875]
    >>> activation_bytes_per_layer(2048, 1, 12288, 96, remat="full") == 2 * 2048 * 12288
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Mapping, NamedTuple

from jaxpar.cost._context_experts import context_score_bytes, dense_mlp_bytes, moe_mlp_bytes
from jaxpar.cost._model import TENSOR_LOGICAL, Leaf, ModelSpec
from jaxpar.errors import CostModelError, LayoutError, int_problem
from jaxpar.logical import matrix_sides, zero_dim_order
from jaxpar.options import Offload


REMAT = ("none", "save-matmuls", "full")
#: The paper's activation table (Korthikanti et al., 2022, §4): values one GPT layer keeps per token for its
#: backward, ``(whole, split, scores)`` (:func:`keep_bytes`) per recomputation, each value ``bytes_per_value``:
#: the paper's ``sbh (34 + 5 as/h)`` bytes at 16 bits. The measured tables are the compilers'
#: (:data:`jaxpar.cost._device_bytes.MEASURED_KEEPS`).
PAPER_KEEPS = {"none": (5.0, 12.0, 2.5), "save-matmuls": (5.0, 12.0, 0.0), "full": (1.0, 0.0, 0.0)}


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tensor: int = 1,
                               sequence_parallel: bool = False, remat: str = "none",
                               bytes_per_value: float = 2, widths: tuple[float, float] = (10, 24)) -> float:
    """Korthikanti et al. (2022) activation bytes of one transformer layer (``docs/planning.md`` §3).

    ``bytes_per_value`` scales from the paper's 16-bit activations (2) to fp32 (4); ``widths`` are the
    values per token kept whole and split over ``t``, in units of ``h`` at 16 bits (:func:`activation_widths`).

    Args:
      seq: the sequence length ``s``.
      micro_batch: sequences per micro-batch ``b``.
      hidden: the hidden size ``h``.
      heads: attention heads ``a``.
      tensor: the tensor-parallel size ``t``.
      sequence_parallel: Megatron's sequence parallelism (the norms and dropouts split over ``t``).
      remat: ``"none"``, ``"save-matmuls"`` or ``"full"`` recomputation.
      bytes_per_value: bytes per activation value.
      widths: ``(whole, split)``: Korthikanti's ``(10, 24)`` for the GPT.

    Returns:
      Bytes per device.

    >>> activation_bytes_per_layer(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    True
    """
    if remat not in REMAT:
        raise CostModelError(f"remat={remat!r}: choose one of {', '.join(REMAT)}.")
    whole, split, scores = PAPER_KEEPS[remat]
    if remat != "full":
        whole, split = widths[0] / 2, widths[1] / 2
    return keep_bytes(seq, micro_batch, hidden, heads, tensor, sequence_parallel, (whole, split, scores),
                      bytes_per_value)


def keep_bytes(seq: float, rows: float, hidden: int, heads: int, tensor: int, sequence_parallel: bool,
               keeps: tuple, value_bytes: float, sp_whole: float = 0.0) -> float:
    """Bytes of one layer's kept values ``keeps = (whole, split, scores)`` (per token in units of ``h``; the
    scores in units of ``a s``) per micro-batch of ``rows`` sequences: ``whole`` split over ``tensor`` only
    under SP (plus ``sp_whole`` that stay whole), the rest split over ``tensor``.

    >>> keep_bytes(4, 1, 8, 2, 2, False, (1.0, 2.0, 1.0), 4) == 4 * (4 * 8 * (1 + 2 / 2) + 2 * 16 / 2)
    True
    """
    whole, split, scores = keeps
    s, t = seq, tensor
    whole = whole / t + sp_whole if sequence_parallel else whole
    return value_bytes * (s * rows * hidden * (whole + split / t) + scores * heads * s * s * rows / t)


def mlp_split(model: ModelSpec) -> float:
    """The MLP's values per token split over ``t``, in units of ``h`` at 16 bits: Korthikanti's 16 (the 4h MLP's
    output before and after GELU; counted so for the GPT whatever its ``mlp``), or a gated MLP's gate, up,
    activation and product (``8 f / h``).

    Args:
      model: the model.

    Returns:
      The count.

    >>> from jaxpar.cost._model import decoder, gpt
    >>> mlp_split(gpt(2, 64, 4, 32, 128, 8)), mlp_split(decoder(2, 64, 4, 32, 128, 8, 224))
    (16, 28.0)
    """
    return 8 * model.mlp / model.hidden if model.gated else 16


def activation_widths(model: ModelSpec) -> tuple[float, float]:
    """``(whole, split)`` values per token one layer keeps, in units of ``h`` at 16 bits (Korthikanti et al.):
    whole, the norms' and the two halves' inputs (10); split, q and k (``2(q + kv)``), v (``2 kv``), the
    attention's output (``2 q``) and the MLP's (:func:`mlp_split`): ``(10, 24)`` for the GPT.

    Args:
      model: the model.

    Returns:
      ``(whole, split)``.

    >>> from jaxpar.cost._model import decoder
    >>> activation_widths(decoder(2, 64, 8, 32, 128, 8, 224, kv_heads=2))        # 4(64 + 16) / 64 + 8 * 224 / 64
    (10, 33.0)
    """
    return 10, 4 * (model.q_width + model.kv_width) / model.hidden + mlp_split(model)


def layer_activations(model: ModelSpec, sizes: Mapping[str, int], rows: float, *, remat: str = "none",
                      sequence_parallel: bool = False, activation_bytes: float = 2, context_method: str = "ring",
                      moe: bool = False, fused: bool = False) -> float:
    """Bytes one layer keeps for the backward per micro-batch of ``rows`` sequences: Korthikanti et al.'s
    terms at ``s / context`` tokens, the attention scores of the CP method
    (:func:`jaxpar.cost._context_experts.context_score_bytes`) and, for an MoE layer (``moe``), the MoE
    MLP's buffers (:func:`~jaxpar.cost._context_experts.moe_mlp_bytes`) in place of the dense MLP's.

    Args:
      model: the model.
      sizes: mesh axis name -> size.
      rows: sequences per micro-batch on one device.
      remat: ``"none"``, ``"save-matmuls"`` or ``"full"``.
      sequence_parallel: Megatron's sequence parallelism.
      activation_bytes: bytes per activation value.
      context_method: ``"ring"``, ``"all-gather"`` or ``"ulysses"``.
      moe: the layer is an MoE layer.
      fused: CP's blocks run the flash kernels (:func:`~jaxpar.cost._context_experts.fused_context`).

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> layer_activations(m, {}, 2) == activation_bytes_per_layer(32, 2, 64, 4)
    True
    """
    t, C = sizes.get("tensor", 1), sizes.get("context", 1)
    sp, bpv, widths = sequence_parallel, activation_bytes, activation_widths(model)
    if C == 1 and not moe:
        return activation_bytes_per_layer(model.seq, rows, model.hidden, model.heads, tensor=t,
                                          sequence_parallel=sp, remat=remat, bytes_per_value=bpv, widths=widths)
    s = model.seq / C
    out = activation_bytes_per_layer(s, rows, model.hidden, model.heads, tensor=t, sequence_parallel=sp,
                                     remat="full" if remat == "full" else "save-matmuls", bytes_per_value=bpv,
                                     widths=widths)
    if remat == "full":
        return out
    out += context_score_bytes(model, rows, t, C, context_method if C > 1 else "all_gather", remat, bpv,
                               fused=fused and C > 1)
    if moe:
        out += (moe_mlp_bytes(model, rows, t, C, sizes.get("expert", 1), sp, bpv, remat)
                - dense_mlp_bytes(rows * s, model.hidden, t, sp, bpv, mlp_split(model)))
    return out


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of the weights, the gradients and the optimizer state (``k`` = their sum);
    ``matrix_opt``: the optimizer state of a matrix leaf (:func:`jaxpar.cost.matrix_sides`) where it differs
    (Muon: :func:`muon_precision`), None: ``opt``."""

    param: float
    grad: float
    opt: float
    matrix_opt: float | None = None

    @property
    def k(self) -> float:
        return self.param + self.grad + self.opt


PRECISIONS = {
    "fp32": BytesPerParam(4, 4, 8),
    "mixed": BytesPerParam(2, 2, 12),
    "megatron": BytesPerParam(2, 4, 12),
    "mixed-fp32-accum": BytesPerParam(2, 6, 12),
}


def bytes_per_param(precision: str | BytesPerParam) -> BytesPerParam:
    """``precision``'s :class:`BytesPerParam`: a name in :data:`PRECISIONS`, or one given."""
    if isinstance(precision, BytesPerParam):
        return precision
    if precision not in PRECISIONS:
        raise CostModelError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)} or pass a "
                             "BytesPerParam(param, grad, opt).")
    return PRECISIONS[precision]


def muon_precision(precision: str | BytesPerParam) -> BytesPerParam:
    """``precision``'s bytes per parameter under :func:`jaxpar.optimizers.muon`: a matrix keeps one fp32
    moment (its momentum) where Adam keeps two; the other leaves keep AdamW's.

    Args:
      precision: a name in :data:`PRECISIONS` or a :class:`BytesPerParam`.

    Returns:
      The :class:`BytesPerParam` with ``matrix_opt`` = ``opt`` - 4.

    >>> muon_precision("mixed")
    BytesPerParam(param=2, grad=2, opt=12, matrix_opt=8)
    """
    bp = bytes_per_param(precision)
    return replace(bp, matrix_opt=bp.opt - 4)


def _check_stage(stage) -> None:
    if stage not in (0, 1, 2, 3):
        raise CostModelError(f"zero stage={stage!r}: choose 0 (plain data parallel), 1, 2 or 3.")


def zero_state_bytes(psi: float, n_d: int, stage: int, *, param_bytes: float = 2, grad_bytes: float = 2,
                     opt_bytes: float = 12) -> dict[str, float]:
    """ZeRO's closed forms (paper Table 1): bytes per device of parameters, gradients, optimizer state.

    Args:
      psi: the parameter count.
      n_d: the data-parallel size.
      stage: the ZeRO stage (0 to 3).
      param_bytes: bytes per parameter.
      grad_bytes: bytes per gradient.
      opt_bytes: bytes of optimizer state per parameter (Adam in mixed precision: 12).

    Returns:
      ``{'params', 'grads', 'opt', 'total'}``: bytes per device.

    >>> zero_state_bytes(1e9, 1, 0)["total"] / 1e9          # 16 bytes per parameter
    16.0
    """
    _check_stage(stage)
    if int_problem(n_d, 1):
        raise CostModelError(f"n_d={n_d!r}: the number of data-parallel ranks must be a positive int.")
    p = psi * param_bytes / (n_d if stage >= 3 else 1)
    g = psi * grad_bytes / (n_d if stage >= 2 else 1)
    o = psi * opt_bytes / (n_d if stage >= 1 else 1)
    return {"params": p, "grads": g, "opt": o, "total": p + g + o}


# ----------------------------------------------------------------------------- leaves on a mesh
def leaf_spec(leaf: Leaf, sizes: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    """Mesh axes of each dimension under jaxpar's tensor rules (``mlp, heads, vocab`` -> ``tensor``, ``kv_heads`` where
    ``tensor`` divides them, else replicated; ``layers`` -> ``pipe`` where ``pipe`` divides them, else replicated, as
    an uneven pipeline stores them; ``experts`` -> ``expert``, :func:`jaxpar.parallel.moe.expert_rules`), before ZeRO.

    Args:
      leaf: the parameter.
      sizes: mesh axis name -> size.

    Returns:
      Per dimension, its mesh axes.
    """
    spec = []
    for dim, (size, name) in enumerate(zip(leaf.shape, leaf.logical)):
        axis = ("tensor" if name in TENSOR_LOGICAL else "pipe" if name == "layers" else
                "expert" if name == "experts" else None)
        if name == "kv_heads" and size % sizes.get("tensor", 1) == 0:     # fewer K/V heads: replicated
            axis = "tensor"
        n = sizes.get(axis, 1) if axis else 1
        if axis == "pipe" and size % n:      # an uneven pipeline's layers: replicated ("layers", None)
            axis, n = None, 1
        if n > 1 and size % n:
            raise LayoutError(f"parameter {leaf.name!r} dimension {dim} ({name}) has size {size}, not divisible "
                              f"by {axis}={n}; choose {axis} dividing {size}.")
        spec.append((axis,) if n > 1 else ())
    return tuple(spec)


def zero_dim_of(leaf: Leaf, spec, sizes: Mapping[str, int], stage: int = 3) -> int | None:
    """The dimension ZeRO / FSDP splits (as :func:`jaxpar.parallel.zero_dim`): the largest one that is not
    ``layers``, not split by ``spec`` (:func:`leaf_spec`) and divisible by the ZeRO axes of ``stage``'s
    optimizer state (``data * fsdp`` from stage 1, ``fsdp`` at stage 0; a token table's ``embed`` first);
    None if none.

    Args:
      leaf: the parameter.
      spec: its :func:`leaf_spec`.
      sizes: mesh axis name -> size.
      stage: the ZeRO stage (3, the default, asks for ``data * fsdp``).

    Returns:
      The dimension index, or ``None``.
    """
    n = math.prod(sizes[a] for a in zero_axes(sizes, stage, "opt"))
    for d in zero_dim_order(leaf.shape, leaf.logical):
        if leaf.logical[d] != "layers" and not spec[d] and leaf.shape[d] % n == 0:
            return d
    return None


def zero_axes(sizes: Mapping[str, int], stage: int, kind: str) -> tuple[str, ...]:
    """The mesh axes over which ZeRO / FSDP shards ``kind`` of a parameter (as :mod:`jaxpar.parallel._zero`).

    Args:
      sizes: mesh axis sizes, e.g. ``{"data": 4, "fsdp": 2}`` (missing axes have size 1).
      stage: the ZeRO stage (0 to 3): ``data`` shards the optimizer state from stage 1, the gradients
        from stage 2 and the parameters from stage 3; ``fsdp`` shards everything.
      kind: ``"params"``, ``"grads"`` or ``"opt"``.

    Returns:
      The axes in mesh order (``fsdp`` before ``data``); ``()`` when nothing is sharded.

    >>> zero_axes({"data": 4, "fsdp": 2}, 1, "grads"), zero_axes({"data": 4}, 2, "grads")
    (('fsdp',), ('data',))
    """
    first = {"opt": 1, "grads": 2, "params": 3}[kind]
    axes = ("fsdp",) if sizes.get("fsdp", 1) > 1 else ()
    return axes + (("data",) if sizes.get("data", 1) > 1 and stage >= first else ())


class LeafShards(NamedTuple):
    """How one parameter is cut on a mesh (:func:`leaf_shard_counts`)."""

    params: int        # pieces the parameter is cut into
    grads: int         # pieces its gradient is cut into
    opt: int           # pieces its optimizer state is cut into
    local: float       # elements on one device after the tensor / pipe split, before ZeRO
    shardable: bool    # whether ZeRO / FSDP can split it (a dimension divides the stage's ZeRO axes)


@lru_cache(maxsize=1 << 16)
def leaf_shard_counts(leaf: Leaf, key: tuple, stage: int) -> LeafShards:
    """Shard counts of ``leaf``'s parameters, gradients and optimizer state on a mesh (cached).

    Args:
      leaf: the parameter.
      key: the mesh sizes as :func:`sizes_key` returns them (hashable, for the cache).
      stage: the ZeRO stage (0 to 3).

    Returns:
      A :class:`LeafShards`; ``params`` / ``grads`` / ``opt`` count the tensor and pipe split
      times the ZeRO axes' sizes (:func:`zero_axes`) when the leaf is shardable.

    >>> from jaxpar.cost._model import gpt
    >>> w1 = gpt(2, 32, 8, 16, 64, 16).leaf("blocks/w1")
    >>> leaf_shard_counts(w1, sizes_key({"data": 4, "tensor": 2}), 1)
    LeafShards(params=2, grads=2, opt=8, local=4096.0, shardable=True)
    """
    s = dict(key)
    spec = leaf_spec(leaf, s)
    base = math.prod(s[a] for dim in spec for a in dim)
    shardable = zero_dim_of(leaf, spec, s, stage) is not None
    out = []
    for kind in ("params", "grads", "opt"):
        axes = zero_axes(s, stage, kind)
        out.append(base * (math.prod(s[a] for a in axes) if axes and shardable else 1))
    return LeafShards(out[0], out[1], out[2], leaf.size / base, shardable)


def sizes_key(sizes: Mapping[str, int]) -> tuple:
    """The mesh sizes as a sorted, hashable key (axes of size 1 left out), for :func:`leaf_shard_counts`.

    Args:
      sizes: mesh axis sizes.

    Returns:
      ``((axis, size), ...)`` sorted by axis name, sizes > 1 only.

    >>> sizes_key({"tensor": 2, "data": 4, "pipe": 1})
    (('data', 4), ('tensor', 2))
    """
    return tuple(sorted((a, v) for a, v in sizes.items() if v > 1))


def pipe_end(leaf: Leaf) -> str | None:
    """Which end of a pipeline runs a parameter outside the blocks: ``first`` for the embedding tables
    (indexed by token or position), ``last`` for the final norm and the head; None for a block's.

    Args:
      leaf: the parameter.

    Returns:
      ``"first"``, ``"last"`` or None.

    >>> from jaxpar.cost._model import gpt
    >>> [pipe_end(gpt(2, 32, 8, 16, 64, 16).leaf(n)) for n in ("wte", "wpe", "blocks/w1", "lnf_scale", "head")]
    ['first', 'first', None, 'last', 'last']
    """
    if leaf.stacked:
        return None
    return "first" if leaf.logical and leaf.logical[0] in ("vocab", None) and not leaf.head else "last"


def state_bytes(model: ModelSpec, sizes: Mapping[str, int], stage: int,
                precision: str | BytesPerParam = "mixed", end: str | None = None) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state, leaf by leaf (ZeRO's formulas
    where every leaf divides; a leaf that cannot be split keeps its full size).

    Args:
      model: the model.
      sizes: mesh axis sizes.
      stage: the ZeRO stage (0 to 3).
      precision: bytes per parameter (:data:`PRECISIONS` or a :class:`BytesPerParam`).
      end: None: every device holds all the parameters outside the blocks (jaxpar's pipeline executor);
        ``"first"`` / ``"last"``: a device of that pipeline stage holds only that end's
        (:func:`pipe_end`; Megatron-LM's placement). Ignored without a pipeline.

    Returns:
      ``{"params", "grads", "opt", "total"}`` in bytes.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 32, 8, 16, 64, 16)
    >>> [round(state_bytes(m, {"pipe": 2}, 0, end=e)["total"]) for e in (None, "first", "last")]
    [275968, 242176, 235008]
    """
    _check_stage(stage)
    bp = bytes_per_param(precision)
    if not model.leaves:
        n_d = sizes.get("data", 1) * sizes.get("fsdp", 1)
        t, p = sizes.get("tensor", 1), sizes.get("pipe", 1)
        return zero_state_bytes(model.n_params / (t * p), n_d, 3 if sizes.get("fsdp", 1) > 1 else stage,
                                param_bytes=bp.param, grad_bytes=bp.grad, opt_bytes=bp.opt)
    out = {"params": 0.0, "grads": 0.0, "opt": 0.0}
    key = sizes_key(sizes)
    for leaf in model.leaves:
        if end is not None and sizes.get("pipe", 1) > 1 and pipe_end(leaf) not in (None, end):
            continue
        sp, sg, so, _, _ = leaf_shard_counts(leaf, key, stage)
        out["params"] += bp.param * leaf.size / sp
        out["grads"] += bp.grad * leaf.size / sg
        matrix = bp.matrix_opt is not None and matrix_sides(leaf.logical)[0]
        out["opt"] += (bp.matrix_opt if matrix else bp.opt) * leaf.size / so
    out["total"] = out["params"] + out["grads"] + out["opt"]
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (the busiest pipeline stage): state, activations, logits; ``total`` their sum;
    ``host``: the bytes in host memory (memory offloading), not in ``total``: the offloaded state between
    steps and the offloaded layer inputs during the step; ``transient``: weights the step copies (the measured
    tables': ZeRO-3 / FSDP's gathered layers, libtpu's bf16 copies)."""

    params: float
    grads: float
    opt: float
    activations: float
    logits: float
    in_flight: int
    host: float = 0.0
    transient: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.opt + self.activations + self.logits + self.transient


def offloaded(mem: MemoryEstimate, offload: Offload | None, *, unsplit: bool = False,
              activation_bytes: float = 4) -> MemoryEstimate:
    """``mem`` under ``Plan.offload`` (see :func:`jaxpar.cost.memory_per_device`): offloaded activations (the
    layers' inputs under full recomputation) move from ``activations`` to ``host``. Under the host update on a
    device that neither reduces nor accumulates its gradients (``unsplit``) the compiled step writes them to host
    memory as the backward makes them, and its peak holds the parameters' compute-dtype copy in their place
    (``grads``; none in fp32): a Llama-3-8B-shaped Decoder on one H100 compiles to 50.83 GB, the parameters, their
    bf16 copy and the activations (docs/planning.md §12).

    Args:
      mem: the estimate without offload.
      offload: ``Plan.offload``.
      unsplit: one device, one micro-batch (every mesh size and ``microbatches`` 1: measured there only).
      activation_bytes: bytes per activation value (the compute dtype's).

    Returns:
      The estimate.

    >>> m = offloaded(MemoryEstimate(4.0, 4.0, 8.0, 1.0, 1.0, 1), Offload(optimizer=True, master=True, update="host"))
    >>> m.total, m.host
    (10.0, 12.0)
    >>> offloaded(MemoryEstimate(4.0, 4.0, 8.0, 1.0, 1.0, 1), Offload(optimizer=True, update="host"), unsplit=True,
    ...           activation_bytes=2).grads
    2.0
    """
    if offload is None:
        return mem
    moved = mem.activations if offload.activations else 0.0
    mem = replace(mem, activations=mem.activations - moved,
                  host=mem.host + moved + mem.opt * offload.optimizer + mem.params * offload.master)
    if not offload.host_update:
        return mem
    grads = mem.grads
    if unsplit:        # the gradients leave as the backward makes them; the parameters' compute copy stays
        grads = mem.params * activation_bytes / 4 if activation_bytes < 4 else 0.0
    return replace(mem, grads=grads, opt=0.0)
