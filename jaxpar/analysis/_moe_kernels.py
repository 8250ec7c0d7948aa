"""MoE's routed experts in a compiled GPU program: the grouped-GEMM kernels it calls
(:mod:`jaxpar.parallel.moe._grouped`, Pallas Triton custom calls named by :data:`KERNEL_NAMES`) with how often
each runs, their GEMM work at a given number of rows, and the while loops whose trip count only the routing
knows and that run GEMMs (the tile loop's; the expert-parallel exchange's further rounds, which hold an
all-to-all, are not among them).

Example::

    >>> hlo = '''HloModule m
    ... ENTRY %main (x: bf16[256,64]) -> bf16[256,32] {
    ...   ROOT %k = bf16[256,32]{1,0} custom-call(%e, %u, %x, %w), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={s32[2]{0}, s32[1]{0}, bf16[256,64]{1,0}, bf16[4,64,32]{2,1,0}}, backend_config={name = "moe_grouped_matmul"}
    ... }'''
    >>> grouped_calls(hlo)
    [GroupedCall(kernel='moe_grouped_matmul', computation='main', runs=1.0, flops_per_row=4096.0)]
"""
from __future__ import annotations

import re
from typing import NamedTuple

from jaxpar.analysis._hlo_text import (call_graph, called_computations, instruction_lines, parse_instructions,
                                      reached_computations)
from jaxpar.analysis._loops import trip_counts, while_trip_counts
from jaxpar.parallel.moe._grouped import KERNEL_NAMES      # the forward GEMM's, the input gradient's, the weights'

_NAME = re.compile(rf'name = \\?"({"|".join(KERNEL_NAMES)})\\?"')
_RESULT = re.compile(r"=\s+\w+\[([\d,]*)\]")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")
_GEMM = re.compile(r" (?:dot|custom-call)\(")


class GroupedCall(NamedTuple):
    """One grouped-kernel call: its kernel, its computation, how often that runs per execution and the GEMM
    FLOPs of one row (``2·K·N``)."""

    kernel: str
    computation: str
    runs: float
    flops_per_row: float


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def grouped_calls(hlo: str, unknown_trips: float = 0.0) -> list[GroupedCall]:
    """The grouped-kernel calls of ``compiled.as_text()``, in text order.

    Args:
      hlo: the HLO text.
      unknown_trips: the trip count of a while loop whose count is known only at run time (the exchange's
        further rounds): 0 counts the first round's calls only.

    Returns:
      One :class:`GroupedCall` per call.
    """
    mult, out = trip_counts(hlo, unknown=unknown_trips), []
    for computation, line in instruction_lines(hlo):
        name = _NAME.search(line)
        if name is None or "custom-call(" not in line:
            continue
        result = _dims(_RESULT.search(line).group(1))
        if name.group(1) == KERNEL_NAMES[2]:                 # dW [E, K, N]
            k, n = result[-2], result[-1]
        else:                                               # Y [rows, N] from X [rows, K]
            operands = _ARRAY.findall(line.split("operand_layout_constraints=", 1)[1])
            k, n = _dims(operands[2])[-1], result[-1]
        out.append(GroupedCall(name.group(1), computation, float(mult.get(computation, 0.0)), 2.0 * k * n))
    return out


def grouped_flops(hlo: str, rows: float) -> float:
    """The GEMM FLOPs of the grouped kernels of one execution, each call computing ``rows`` rows (the routed
    rows and their padding), the exchange's further rounds left out.

    Args:
      hlo: the HLO text.
      rows: the rows each call computes.

    Returns:
      The FLOPs.
    """
    return sum(c.runs * c.flops_per_row * rows for c in grouped_calls(hlo))


def routing_loops(hlo: str) -> list[str]:
    """The while loops whose trip count is known only at run time and that run GEMMs (a dot or a grouped kernel)
    but no all-to-all: the tile loop's, not the exchange's rounds.

    Args:
      hlo: the HLO text.

    Returns:
      The loops' instruction names.
    """
    instrs = parse_instructions(hlo)
    known, calls = while_trip_counts(hlo, instrs), call_graph(instrs)
    gemm, a2a = set(), set()
    for computation, line in instruction_lines(hlo):
        if _GEMM.search(line) and (" dot(" in line or "__cublas" in line or _NAME.search(line)):
            gemm.add(computation)
        if " all-to-all" in line:
            a2a.add(computation)
    loops = []
    for w in instrs:
        if w.opcode == "while" and w.name not in known:
            inside = reached_computations(calls, [c for key, c in called_computations(w) if key == "body"])
            if inside & gemm and not inside & a2a:
                loops.append(w.name)
    return loops

