"""What a compiled program does with attention: the fused kernels it calls (cuDNN's flash attention, the
Pallas flash kernels) and the largest array whose last two dimensions are ``length x length``, the mark of
XLA's unfused path (its scores, probabilities and mask).

Example::

    >>> text = 'x = f32[2,12,1024,1024]{3,2,1,0} fusion(...)  y = bf16[16,1024,12,64] custom-call(...)'
    >>> attention_report(text, 1024)
    AttentionReport(cudnn=0, pallas=0, largest_square='f32[2,12,1024,1024]', square_bytes=100663296)
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

#: Bytes per element of the element types a score array can have.
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "pred": 1, "s8": 1, "u8": 1,
          "f8e4m3fn": 1, "f8e5m2": 1}


class AttentionReport(NamedTuple):
    """Fused attention forwards in a compiled program (each compiled layer body once), and its largest
    ``[..., length, length]`` array (``None`` when it has none) with that array's bytes."""

    cudnn: int
    pallas: int
    largest_square: str | None
    square_bytes: int

    @property
    def fused(self) -> int:
        """The fused forwards, both kernels."""
        return self.cudnn + self.pallas


def attention_report(text: str, length: int) -> AttentionReport:
    """Read the compiled text of a GPU program (``compiled.as_text()``) for its attention. Pallas's forwards
    are JAX's ``mha_forward`` and the flash block kernel's ``ring_flash_forward`` (whole-sequence attention
    with a soft-cap or a window, and the blocks of context parallelism's ring and all-gather).

    Args:
      text: the compiled HLO text.
      length: the attention's sequence length (per device).

    Returns:
      The :class:`AttentionReport`.
    """
    cudnn = len(re.findall(r'custom_call_target="__cudnn\$fmha[A-Za-z]*Softmax"', text))
    pallas = len(re.findall(rf'name = \\?"(?:mha_forward|{FLASH_BLOCK_KERNELS[0]})\\?"', text))
    largest, most = None, 0
    for dtype, dims in re.findall(rf"\b({'|'.join(_BYTES)})\[((?:\d+,)+{length},{length})\]", text):
        size = int(np.prod([int(d) for d in dims.split(",")])) * _BYTES[dtype]
        if size > most:
            largest, most = f"{dtype}[{dims}]", size
    return AttentionReport(cudnn, pallas, largest, most)


#: The floating element types a score array can have.
_FLOATS = ("f64", "f32", "bf16", "f16", "f8e4m3fn", "f8e5m2")
#: An instruction: its result type (one array, or a tuple of them) and its op.
_INSTRUCTION = re.compile(r"=\s+(\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+([\w-]+)\(")
_ARRAY = re.compile(rf"\b({'|'.join(_FLOATS)})\[((?:\d+,)*\d+)\]")
#: The flash block kernels of context parallelism (jaxpar.parallel.context._flash), by their names.
FLASH_BLOCK_KERNELS = ("ring_flash_forward", "ring_flash_dq", "ring_flash_dkv")


class ScoreArrays(NamedTuple):
    """The score-shaped float arrays of a compiled program: ``count`` instructions (bitcasts not
    counted) make one, the largest is ``largest`` (``None``: none) of ``largest_bytes``."""

    count: int
    largest: str | None
    largest_bytes: int


def score_arrays(text: str, lengths: int | tuple[int, ...]) -> ScoreArrays:
    """The instructions of a compiled program that make a float array whose two trailing dimensions are
    both block lengths (``[..., S_blk, S_blk]``: the scores, probabilities or their gradients of XLA's
    unfused attention, which carry a heads dimension before them); a bitcast, which makes no array, is not
    counted, nor a 2-D array (a weight or its gradient whose width equals a block length). Another array of
    such a shape counts (logits whose vocabulary equals a block length).

    Args:
      text: the compiled HLO text (``compiled.as_text()``).
      lengths: the block lengths (e.g. a ring's block, the shard and the whole sequence).

    Returns:
      The :class:`ScoreArrays`.

    >>> score_arrays('a = f32[8,512,512]{2,1,0} fusion(x)\\nb = f32[8,512,512]{2,1,0} bitcast(a)\\n'
    ...              'c = (bf16[2,512,8,64]{3,2,1,0}, f32[2,8,512,256]{3,2,1,0}) custom-call(y)\\n'
    ...              'w = f32[512,512]{1,0} dot(g, x)', (512, 256))
    ScoreArrays(count=2, largest='f32[8,512,512]', largest_bytes=8388608)
    """
    sizes = {lengths} if isinstance(lengths, int) else set(lengths)
    count, largest, most = 0, None, 0
    for result, op in _INSTRUCTION.findall(text):
        if op == "bitcast":
            continue
        found = False
        for dtype, dims in _ARRAY.findall(result):
            shape = [int(d) for d in dims.split(",")]
            if len(shape) >= 3 and shape[-1] in sizes and shape[-2] in sizes:
                found, size = True, int(np.prod(shape)) * _BYTES[dtype]
                if size > most:
                    largest, most = f"{dtype}[{dims}]", size
        count += found
    return ScoreArrays(count, largest, most)


def flash_blocks(text: str) -> dict[str, int]:
    """How many calls of each flash block kernel (:data:`FLASH_BLOCK_KERNELS`) a compiled program makes
    (each compiled layer body once; a ring step's block is one call).

    Args:
      text: the compiled HLO text.

    Returns:
      ``{kernel name: calls}``.

    >>> flash_blocks('c = f32[1] custom-call(x), backend_config={name = \\\\"ring_flash_forward\\\\"}')
    {'ring_flash_forward': 1, 'ring_flash_dq': 0, 'ring_flash_dkv': 0}
    """
    return {name: len(re.findall(rf'name = \\?"{name}\\?"', text)) for name in FLASH_BLOCK_KERNELS}
