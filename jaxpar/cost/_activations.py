"""Activation bytes per layer: Korthikanti et al. (2022), and the terms context and expert parallelism change.

:func:`activation_bytes_per_layer` is the paper's Table 2: bytes per layer with 16-bit activations,
sequence ``s``, micro-batch ``b``, hidden ``h``, ``a`` heads, ``t``-way tensor parallelism: ``sbh(34 +
5as/h)`` (none), ``sbh(10 + 24/t + 5as/(ht))`` (TP), ``sbh/t·(34 + 5as/h)`` (TP + SP), the ``5as/h``
term dropped by selective recomputation, ``2sbh`` (``/t`` with SP) with full recomputation;
:func:`layer_activations` applies it at ``s / context`` tokens with the CP method's attention scores and,
for an MoE layer, the MoE MLP's buffers (:mod:`jaxpar.cost._context_experts`). Both are re-exported by
:mod:`jaxpar.cost._memory`.

Example::

    >>> activation_bytes_per_layer(2048, 1, 12288, 96, remat="full") == 2 * 2048 * 12288
    True
    >>> activation_bytes_per_layer(seq=2048, micro_batch=1, hidden=12288, heads=96, tensor=8,
    ...                            sequence_parallel=True, remat="selective") == 2048 * 12288 * 34 / 8
    True
"""
from __future__ import annotations

from typing import Mapping

from jaxpar.cost._context_experts import context_score_bytes, dense_mlp_bytes, moe_mlp_bytes
from jaxpar.cost._model import ModelSpec
from jaxpar.errors import CostModelError

REMAT = ("none", "selective", "full")


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tensor: int = 1,
                               sequence_parallel: bool = False, remat: str = "none",
                               bytes_per_value: float = 2) -> float:
    """Korthikanti et al. (2022) activation bytes of one transformer layer (``docs/planning.md`` §3).

    ``bytes_per_value`` scales from the paper's 16-bit activations (2) to fp32 (4).

    Args:
      seq: the sequence length ``s``.
      micro_batch: sequences per micro-batch ``b``.
      hidden: the hidden size ``h``.
      heads: attention heads ``a``.
      tensor: the tensor-parallel size ``t``.
      sequence_parallel: Megatron's sequence parallelism (the norms and dropouts split over ``t``).
      remat: ``"none"``, ``"selective"`` or ``"full"`` recomputation.
      bytes_per_value: bytes per activation value.

    Returns:
      Bytes per device.

    >>> activation_bytes_per_layer(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    True
    """
    if remat not in REMAT:
        raise CostModelError(f"remat={remat!r}: choose one of {', '.join(REMAT)}.")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tensor
    attn = 0.0 if remat == "selective" else 5 * a * s / h
    if remat == "full":
        per = 2 / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per = (34 + attn) / t
    else:
        per = 10 + 24 / t + attn / t
    return s * b * h * per * bytes_per_value / 2



def layer_activations(model: ModelSpec, sizes: Mapping[str, int], rows: float, *, remat: str = "none",
                      sequence_parallel: bool = False, activation_bytes: float = 2, context_method: str = "ring",
                      moe: bool = False) -> float:
    """Bytes one layer keeps for the backward per micro-batch of ``rows`` sequences: Korthikanti et al.'s
    terms at ``s / context`` tokens, the attention scores of the CP method
    (:func:`jaxpar.cost._context_experts.context_score_bytes`) and, for an MoE layer (``moe``), the MoE
    MLP's buffers (:func:`~jaxpar.cost._context_experts.moe_mlp_bytes`) in place of the dense MLP's.

    Args:
      model: the model.
      sizes: mesh axis name -> size.
      rows: sequences per micro-batch on one device.
      remat: ``"none"``, ``"selective"`` or ``"full"``.
      sequence_parallel: Megatron's sequence parallelism.
      activation_bytes: bytes per activation value.
      context_method: ``"ring"``, ``"all-gather"`` or ``"ulysses"``.
      moe: the layer is an MoE layer.

    Returns:
      Bytes per device.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> layer_activations(m, {}, 2) == activation_bytes_per_layer(32, 2, 64, 4)
    True
    """
    t, C = sizes.get("tensor", 1), sizes.get("context", 1)
    sp, bpv = sequence_parallel, activation_bytes
    if C == 1 and not moe:
        return activation_bytes_per_layer(model.seq, rows, model.hidden, model.heads, tensor=t,
                                          sequence_parallel=sp, remat=remat, bytes_per_value=bpv)
    s = model.seq / C
    out = activation_bytes_per_layer(s, rows, model.hidden, model.heads, tensor=t, sequence_parallel=sp,
                                     remat="full" if remat == "full" else "selective", bytes_per_value=bpv)
    if remat == "full":
        return out
    out += context_score_bytes(model, rows, t, C, context_method if C > 1 else "all_gather", remat, bpv)
    if moe:
        out += moe_mlp_bytes(model, rows, t, C, sp, bpv) - dense_mlp_bytes(rows * s, model.hidden, t, sp, bpv)
    return out
