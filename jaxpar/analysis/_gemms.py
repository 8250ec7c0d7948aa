"""FP8 in a compiled GPU program: its GEMMs (each dot and cuBLAS call with its operand types, FLOPs and
``op_name``), the FP8 check of :func:`jaxpar.parallel._fp8.fp8_layer`'s named matmuls, and the bytes its
all-gathers move per element type (:func:`all_gather_dtypes`: FP8 values or the compute dtype's).

It reads the raw lines: the ``op_name`` and a cuBLAS call's dimension numbers are string literals,
which :func:`jaxpar.analysis._hlo_text.parse_instructions` blanks.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

from jaxpar.analysis._hlo import collectives
from jaxpar.analysis._hlo_text import array_shapes, instruction_lines, module_text, parse_instructions, shape_bytes
from jaxpar.analysis._loops import trip_counts
from jaxpar.errors import Fp8Error

_DEF = re.compile(r"(%[\w.\-]+) = \(?(\w+)\[([\d,]*)\]")
_GEMM = re.compile(r"(%[\w.\-]+) = .*? (?:dot|custom-call)\((%[\w.\-]+), (%[\w.\-]+)")
_CONTRACT = re.compile(r'lhs_contracting_dim(?:s=\{|ensions":\[)([^}\]]*)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPE = re.compile(r"fp8\[([^\]]+)\]")


class Gemm(NamedTuple):
    """One GEMM: its operands' dtypes, its FLOPs and its ``op_name`` (``""`` when it has none)."""

    lhs: str
    rhs: str
    flops: float
    op_name: str

    @property
    def fp8(self) -> bool:
        return self.lhs.startswith("f8") and self.rhs.startswith("f8")


def gemms(hlo: str) -> list[Gemm]:
    """The dots and cuBLAS GEMM calls of ``compiled.as_text()``, in text order.

    >>> hlo = '''  %a = f8e4m3fn[4,8]{1,0} parameter(0)
    ...   %b = f8e4m3fn[8,2]{1,0} parameter(1)
    ...   ROOT %d = bf16[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}'''
    >>> gemms(hlo)
    [Gemm(lhs='f8e4m3fn', rhs='f8e4m3fn', flops=128.0, op_name='')]
    """
    shapes = _shapes(hlo)
    return [g for g in (_gemm(line, shapes) for line in hlo.splitlines()) if g is not None]


def dot_flops(hlo: str, unknown_trips: float = 1.0) -> float:
    """The GEMM FLOPs of one execution of ``compiled.as_text()``: each computation's dots and cuBLAS calls
    times how often it runs (:func:`~jaxpar.analysis.trip_counts`).

    Args:
      hlo: the HLO text.
      unknown_trips: the trip count of a while loop whose count is known only at run time (MoE's tile
        loops): 0 leaves their FLOPs out, 1 gives one trip's.

    Returns:
      The FLOPs (a float).
    """
    shapes, mult, total = _shapes(hlo), trip_counts(hlo, unknown=unknown_trips), 0.0
    for computation, line in instruction_lines(hlo):
        if (g := _gemm(line, shapes)) is not None:
            total += g.flops * mult.get(computation, 0.0)
    return total


def tile_loop_flops(hlo: str) -> tuple[float, float]:
    """The GEMM FLOPs of a program with MoE tile loops (:mod:`jaxpar.parallel.moe`), whose trips are known only at
    run time: ``(the other GEMMs, one trip of every first-round tile loop)``.

    :func:`dot_flops` at ``u`` trips a loop is ``K + A u + B u^2``: ``A`` the first round's tile loops, ``B``
    the further rounds' (nested in a loop over rounds); three values of ``u`` give ``K`` and ``A``.

    Args:
      hlo: the HLO text.

    Returns:
      ``(K, A)``.
    """
    f0, f1, f2 = (dot_flops(hlo, u) for u in (0.0, 1.0, 2.0))
    return f0, (4 * f1 - f2 - 3 * f0) / 2


def _shapes(hlo: str) -> dict[str, tuple[str, list[int]]]:
    return {name: (dtype, [int(d) for d in dims.split(",") if d]) for name, dtype, dims in _DEF.findall(hlo)}


def _gemm(line: str, shapes) -> Gemm | None:
    """The GEMM of one HLO line, or None."""
    gemm = _GEMM.search(line)
    if not (gemm and (" dot(" in line or "__cublas" in line)):
        return None
    result, lhs, rhs = (shapes.get(v, ("", [])) for v in gemm.groups())
    contract = _CONTRACT.search(line)
    k = math.prod(lhs[1][int(d.strip('"'))] for d in contract.group(1).split(",") if d) if contract else 0
    name = _OP_NAME.search(line)
    return Gemm(lhs[0], rhs[0], 2.0 * math.prod(result[1]) * k, name.group(1) if name else "")


def fp8_gemms(hlo: str) -> dict[str, dict[str, float]]:
    """The GEMMs of each covered weight in a compiled program's text, by operand types.

    Args:
      hlo: ``compiled.as_text()`` (a GPU target's: dots and cuBLAS calls).

    Returns:
      ``{weight path: {"fp8": n, "other": n, "fp8_flops": f, "other_flops": f}}`` over the GEMMs
      :func:`~jaxpar.parallel._fp8.fp8_layer` named after the weight (merged GEMMs carry the first one's name).
    """
    out: dict[str, dict[str, float]] = {}
    for g in gemms(hlo):
        scope = _SCOPE.search(g.op_name)
        if scope:
            kind = "fp8" if g.fp8 else "other"
            counts = out.setdefault(scope.group(1), {"fp8": 0, "other": 0, "fp8_flops": 0.0, "other_flops": 0.0})
            counts[kind] += 1
            counts[kind + "_flops"] += g.flops
    return out


def check_fp8_gemms(hlo: str) -> dict[str, dict[str, float]]:
    """:func:`fp8_gemms`, and an error naming every covered weight with a GEMM not in FP8 (e.g. a
    compiler that dequantized the operands first).

    Raises:
      Fp8Error: a covered weight's GEMM compiled with other operand types.
    """
    counts = fp8_gemms(hlo)
    slow = {path: int(c["other"]) for path, c in counts.items() if c["other"]}
    if slow:
        raise Fp8Error(f"fp8: covered matmuls compiled without FP8 operands: {slow} (weight: GEMMs). The "
                       "compiler dequantized them; this target or recipe does not run FP8 GEMMs.")
    return counts


_OPERAND = re.compile(r"%?([\w.\-]+)")


def all_gather_dtypes(compiled, mesh) -> dict[tuple[str, str], dict[str, float]]:
    """The all-gathers of a compiled program by mesh axes and element type: how many, and the bytes of
    their results per step (loops counted by trip count, :func:`jaxpar.analysis.trip_counts`).

    Args:
      compiled: a ``jax.stages.Compiled`` or its HLO text.
      mesh: the mesh it was compiled for.

    Returns:
      ``{(axes, dtype): {"count": n, "bytes": b}}``; ``axes`` as ``"fsdp"`` or ``"data,fsdp"``.
    """
    out: dict[tuple[str, str], dict[str, float]] = {}
    for axes, array, nbytes in gathered_arrays(compiled, mesh):
        row = out.setdefault((axes, array.split("[")[0]), {"count": 0, "bytes": 0.0})
        row["count"] += 1
        row["bytes"] += nbytes
    return out


def gathered_arrays(compiled, mesh):
    """Each array an all-gather of a compiled program returns: ``(axes, "dtype[dims]", bytes per step)``.

    Args:
      compiled: a ``jax.stages.Compiled`` or its HLO text.
      mesh: the mesh it was compiled for.

    Yields:
      The axes (``"fsdp"``, ``"data,fsdp"``), the array's type and its bytes times its computation's trips.
    """
    text = module_text(compiled)
    instrs = parse_instructions(text)
    by_name = {i.name: i for i in instrs}
    done = {}
    for i in instrs:
        if i.opcode == "all-gather-done" and (first := _OPERAND.match(i.rest.strip())):
            done[first.group(1)] = i.shape
    mult = trip_counts(text)
    for c in collectives(compiled, mesh):
        instr = by_name.get(c.name)
        if c.kind != "all-gather" or instr is None:
            continue
        arrays = array_shapes(done.get(c.name, instr.shape))
        if instr.opcode.endswith("-start") and c.name not in done:     # (operands, results): the results
            arrays = arrays[len(arrays) // 2:]
        for array in arrays:
            yield ",".join(c.axes) if c.axes else "-", array, shape_bytes(array) * mult.get(c.computation, 1)


def gathered_weights(compiled, mesh, weight_shapes, flat_sizes=()) -> dict[str, float]:
    """The bytes per step a compiled program all-gathers, split into ``weights`` (an array of a parameter's
    shape, or one layer's of a stacked parameter, or either split over one other axis; or a flat buffer of
    one layer's parameters, padded to a multiple of an axis size) and ``activations``.

    Args:
      compiled: a ``jax.stages.Compiled`` or its HLO text.
      mesh: the mesh it was compiled for.
      weight_shapes: the parameters' shapes (tuples), each stacked one's layer slice too.
      flat_sizes: the elements of a layer's parameters gathered as one buffer (jaxpar's per-layer FSDP).

    Returns:
      ``{"weights": bytes, "activations": bytes}``.

    >>> gathered_weights("", None, [(4, 8)])
    {'weights': 0.0, 'activations': 0.0}
    """
    sizes = sorted({n for n in dict(getattr(mesh, "shape", {})).values() if n > 1})
    known = set()
    for shape in map(tuple, weight_shapes):
        known.add(shape)
        known |= {shape[:i] + (d // n,) + shape[i + 1:] for i, d in enumerate(shape) for n in sizes if d % n == 0}
    flat = {-(-f // n) * n for f in flat_sizes for n in sizes + [1]}
    out = {"weights": 0.0, "activations": 0.0}
    if not compiled:
        return out
    for _, array, nbytes in gathered_arrays(compiled, mesh):
        dims = tuple(int(d) for d in re.findall(r"\d+", array.split("[", 1)[1].split("]")[0]))
        out["weights" if dims in known or math.prod(dims) in flat else "activations"] += nbytes
    return out
