"""What a compiled program does with attention: the fused kernels it calls (cuDNN's flash attention, the
Pallas flash kernel) and the largest array whose last two dimensions are ``length x length``, the mark of
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
    """Read the compiled text of a GPU program (``compiled.as_text()``) for its attention.

    Args:
      text: the compiled HLO text.
      length: the attention's sequence length (per device).

    Returns:
      The :class:`AttentionReport`.
    """
    cudnn = len(re.findall(r'custom_call_target="__cudnn\$fmha[A-Za-z]*Softmax"', text))
    pallas = len(re.findall(r'name = \\?"mha_forward\\?"', text))
    largest, most = None, 0
    for dtype, dims in re.findall(rf"\b({'|'.join(_BYTES)})\[((?:\d+,)*{length},{length})\]", text):
        size = int(np.prod([int(d) for d in dims.split(",")])) * _BYTES[dtype]
        if size > most:
            largest, most = f"{dtype}[{dims}]", size
    return AttentionReport(cudnn, pallas, largest, most)
