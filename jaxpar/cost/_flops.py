"""FLOPs of one training step, and per token for MFU.

FLOPs (per step, global batch ``B`` sequences of ``s`` tokens, ``l`` layers, hidden ``h``,
MLP width ``f``, vocabulary ``V``):

* a layer's forward is ``2s(4h² + 2hf) + 4s²h`` per sequence (projections and MLP, then
  ``QKᵀ`` and ``AV``); training is 3 forwards (backward = 2); full recomputation adds one
  more forward of the layers, selective recomputation the ``4s²h`` attention part; the
  logits cost ``2shV`` forward. With ``f = 4h`` and full recomputation this is Narayanan et
  al. (2021, eq. 3): :func:`narayanan_flops` ``= 96Bslh²(1 + s/(6h) + V/(16lh))``.
* MFU counts the model FLOPs without recomputation; per token that is ``6N + 12lhs`` for
  ``N`` non-embedding parameters (Kaplan et al. 2020 / PaLM appendix B): :func:`flops_per_token`.
* An MoE layer's forward counts its *active* MLP, ``top_k`` experts of width ``M`` per token, the
  router ``2shE`` and the shared experts (the capacity's padding slots and the dense dispatch are
  time, :mod:`jaxpar.cost._roofline`, not model FLOPs).

Example::

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    >>> abs(step_flops(m, remat="full") / narayanan_flops(1536, 2048, 96, 12288, 51200) - 1) < 1e-12
    True
"""
from __future__ import annotations

from jaxpar.cost._activations import REMAT
from jaxpar.cost._model import ModelSpec
from jaxpar.errors import CostModelError


def flops_per_token(n_params: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token ``6N + 12·l·h·s`` (``N``: parameters without embeddings).

    Args:
      n_params: ``N``.
      layers, hidden, seq: ``l``, ``h``, ``s``.

    Returns:
      FLOPs.

    >>> flops_per_token(85e6, 12, 768, 1024) == 6 * 85e6 + 12 * 12 * 768 * 1024
    True
    """
    return 6 * n_params + 12 * layers * hidden * seq


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
    s, h = m.seq, m.hidden
    if moe:
        mlp = 2 * h * (m.top_k * m.expert_mlp + m.shared_mlp) + h * m.experts
        return 2 * s * (4 * h * h + mlp) + 4 * s * s * h
    return 2 * s * (4 * h * h + 2 * h * m.mlp) + 4 * s * s * h


def step_flops(m: ModelSpec, remat: str = "none") -> float:
    """FLOPs of one training step of the global batch, recomputation included.

    Args:
      m: the model.
      remat: ``"none"``, ``"selective"`` or ``"full"``.

    Returns:
      FLOPs.

    >>> from jaxpar.cost._model import gpt
    >>> dense, moe = gpt(2, 64, 4, 32, 128, 8), gpt(2, 64, 4, 32, 128, 8, experts=8, top_k=1)
    >>> step_flops(moe) - step_flops(dense) == 8 * 2 * 3 * 2 * 32 * 64 * 8      # top-1: + the router only
    True
    """
    if remat not in REMAT:
        raise CostModelError(f"remat={remat!r}: choose one of {', '.join(REMAT)}.")
    n_moe = m.moe_layers
    layers = 0.0
    for n, moe in ((m.layers - n_moe, False), (n_moe, True)):
        if n:
            fwd = _layer_forward(m, moe)
            extra = {"none": 0.0, "selective": 4 * m.seq**2 * m.hidden, "full": fwd}[remat]
            layers += n * (3 * fwd + extra)
    return m.batch * (layers + 6 * m.seq * m.hidden * m.vocab)


def model_flops(m: ModelSpec) -> float:
    """FLOPs of one step without recomputation (the numerator of MFU).

    Args:
      m: the model.

    Returns:
      FLOPs.
    """
    return step_flops(m, "none")
