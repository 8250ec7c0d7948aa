"""XLA's windowed einsums: a dot run as a loop round a ring, in place of an all-gather or a reduce-scatter.

XLA's SPMD partitioner (libtpu does it by default for large dots; the GPU compiler only above
``--xla_gpu_threshold_for_windowed_einsum_mib``) may compute a dot whose operand is sharded over an
axis that the dot needs whole, or whose result is summed and scattered over it, as a ``while`` loop
over the ring of that axis's partitions. Each iteration multiplies the shard at hand and passes a
shard on with ``collective-permute`` (both ways round the ring, in the bidirectional form). The
loop's body is named ``windowed_dot_general_body_ag`` when an operand is gathered and
``windowed_dot_general_body_rs`` when the result is reduce-scattered. Beside the loop, in the same
computation, one more permute moves the same buffer: the first shard, sent before a gathering loop,
or the last partial sum, sent after a scattering one.

Such a loop is one all-gather or one reduce-scatter, and :func:`jaxpar.analysis.collectives`
counts it as one (:func:`windowed_einsums`), with the bytes of its result, as it counts any
collective: the gathered operand (the permuted shard times the ring's size), or the shard of the sum
(the permuted partial sum). Its permutes move the whole operand, or the whole unreduced result, once
round the ring; the inventory's row for the loop says so (``Windowed.permutes``).

Example::

    >>> from jaxpar.analysis._hlo_text import parse_instructions
    >>> hlo = '''HloModule m
    ... %windowed_dot_general_body_rs (p: (f32[4], s32[])) -> (f32[4], s32[]) {
    ...   %p = (f32[4]{0}, s32[]) parameter(0)
    ...   %acc = f32[4]{0} get-tuple-element(%p), index=0
    ...   %cp = f32[4]{0} collective-permute(%acc), source_target_pairs={{0,1},{1,0}}
    ...   %i = s32[] get-tuple-element(%p), index=1
    ...   ROOT %t = (f32[4]{0}, s32[]) tuple(%cp, %i)
    ... }
    ... ENTRY %main (x: (f32[4], s32[])) -> f32[4] {
    ...   %x = (f32[4]{0}, s32[]) parameter(0)
    ...   %w = (f32[4]{0}, s32[]) while(%x), condition=%cond, body=%windowed_dot_general_body_rs
    ...   %r = f32[4]{0} get-tuple-element(%w), index=0
    ...   ROOT %last = f32[4]{0} collective-permute(%r), source_target_pairs={{0,1},{1,0}}
    ... }'''
    >>> windowed_einsums(parse_instructions(hlo))
    {'w': Windowed(kind='reduce-scatter', buffer='cp', permutes=('cp', 'last'))}
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxpar.analysis._hlo_text import Instruction, array_shapes, call_graph, called_computations, reached_computations

_BODIES = {"windowed_dot_general_body_ag": "all-gather", "windowed_dot_general_body_rs": "reduce-scatter"}
_PERMUTES = ("collective-permute", "collective-permute-start")


@dataclass(frozen=True)
class Windowed:
    """One windowed einsum loop.

    Attributes:
      kind: ``"all-gather"`` (an operand gathered round the ring) or ``"reduce-scatter"``.
      buffer: a permute in the loop's body: its result is the shard (all-gather) or the partial
        sum (reduce-scatter) passed on at each step.
      permutes: every permute that belongs to the loop, in its body and beside it.
    """

    kind: str
    buffer: str
    permutes: tuple[str, ...]


def _kind(body: str) -> str | None:
    return next((kind for name, kind in _BODIES.items() if name in body), None)


def windowed_einsums(instrs: list[Instruction]) -> dict[str, Windowed]:
    """The windowed einsum loops of a module (see the module doc).

    Args:
      instrs: the module's :func:`~jaxpar.analysis._hlo_text.parse_instructions`.

    Returns:
      ``{while instruction name: Windowed}``. A permute beside a loop is its prologue or epilogue
      when it is in the loop's computation, belongs to no loop and moves the loop's buffer shape;
      each loop takes at most one, in text order.
    """
    loops = {i.name: (i, kind, body) for i in instrs if i.opcode == "while"
             for key, body in called_computations(i) if key == "body" and (kind := _kind(body))}
    permutes = [i for i in instrs if i.opcode in _PERMUTES]
    calls = call_graph(instrs) if loops else {}
    inside: dict[str, list[Instruction]] = {}
    for name, (_, _, body) in loops.items():
        reached = reached_computations(calls, [body])
        inside[name] = [p for p in permutes if p.computation in reached]
    taken = {p.name for ps in inside.values() for p in ps}
    out = {}
    for name, (loop, kind, _) in loops.items():
        if not inside[name]:
            continue
        buffer = inside[name][0]
        shape = _buffer_shape(buffer)
        beside = next((p for p in permutes if p.name not in taken and p.computation == loop.computation
                       and _buffer_shape(p) == shape), None)
        taken |= {beside.name} if beside else set()
        out[name] = Windowed(kind, buffer.name, tuple(p.name for p in inside[name] + ([beside] if beside else [])))
    return out


def _buffer_shape(permute: Instruction) -> str:
    """The array a permute moves (an async start's shape is ``(operand, result, contexts...)``)."""
    return array_shapes(permute.shape)[0]
