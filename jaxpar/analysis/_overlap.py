"""Compute that the compiler scheduled under each asynchronous collective of a compiled program.

A scheduled HLO module (``compiled.as_text()``) runs each computation's instructions in text
order. An asynchronous collective is a start and a done: what the scheduler put between them runs
while the collective moves data, and only that can hide it. :func:`overlap` pairs them, in the
entry computation, in while bodies and in any other computation, and measures what lies between:

* GPU: ``all-gather-start`` / ``all-gather-done`` (likewise ``all-reduce``, ``reduce-scatter``,
  ``collective-permute``), or a collective wrapped in ``async-start`` / ``async-update`` / ``async-done``;
* TPU: a fusion whose computation ends in the ``AsyncCollectiveStart`` custom call and one whose ends in
  ``AsyncCollectiveDone``, paired by the collective's ``channel_id``; the fusions that carry the same
  collective (libtpu's continuations, :func:`jaxpar.analysis._hlo_text.tpu_async_roles`) are compute under
  it, not other collectives.

What lies between is counted in instructions (parameters, constants, tuples, get-tuple-elements and
bitcasts left out) and in FLOPs of dots and convolutions: a dot ``2 x prod(result dims) x contracted
size``; a convolution ``2 x`` output batch and features ``x`` input features ``x`` the (output position,
kernel tap) pairs that land on the input (padding and dilation holes left out); a cuBLAS gemm custom call
as its dot; a fusion, call or async wrapper as its computation; a while loop its body and condition times
its trip count (:func:`jaxpar.analysis.while_trip_counts`: the known one, or read from the loop);
a conditional every branch (an upper bound, as :func:`jaxpar.analysis.trip_counts`). Elementwise
work and reductions count no FLOPs. Collectives without start / done are synchronous (XLA:CPU makes every one so).

Example:
    >>> hlo = '''HloModule m, is_scheduled=true
    ... ENTRY %main (a: f32[1,32], x: f32[8,32], w: f32[32,16]) -> f32[8,16] {
    ...   %a = f32[1,32]{1,0} parameter(0)
    ...   %x = f32[8,32]{1,0} parameter(1)
    ...   %w = f32[32,16]{1,0} parameter(2)
    ...   %ags = (f32[1,32]{1,0}, f32[2,32]{1,0}) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
    ...   %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ...   %agd = f32[2,32]{1,0} all-gather-done(%ags)
    ...   ROOT %ar = f32[8,16]{1,0} all-reduce(%d), replica_groups={{0,1}}, to_apply=%add
    ... }'''
    >>> r = overlap(hlo)
    >>> [(a.kind, a.start, a.done, a.instructions, a.flops, a.bytes) for a in r.asynchronous]
    [('all-gather', 'ags', 'agd', 1, 8192.0, 256)]
    >>> [(s.kind, s.name, s.bytes) for s in r.synchronous]
    [('all-reduce', 'ar', 512)]
    >>> r.step_flops, r.overlapped_flops, r.overlapped_fraction      # 2 x 8 x 16 x 32
    (8192.0, 8192.0, 1.0)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from jaxpar.analysis._hlo_text import (KINDS, Instruction, by_computation, called_computations, channel,
                                       custom_call_targets, module_text, operands, parse_instructions, shape_bytes,
                                       tpu_async_roles, tpu_reduce_scatters)
from jaxpar.analysis._loops import trip_counts, while_trip_counts
from jaxpar.errors import AnalysisError

#: Instructions that move no data and compute nothing (left out of the instruction counts).
BOOKKEEPING = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})

_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
_RAW = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")


@dataclass(frozen=True)
class AsyncCollective:
    """An asynchronous collective: ``runs`` per execution of the program (trip counts), ``bytes`` of the
    done's result on one device, and per run the ``instructions`` (but :data:`BOOKKEEPING`) and the
    dot / convolution ``flops`` scheduled strictly between its start and its done. ``collective``: the
    collective's own instruction (GPU: the start), as :func:`jaxpar.analysis.collectives` names it."""

    kind: str
    collective: str
    start: str
    done: str
    computation: str
    runs: float
    bytes: int
    instructions: int
    flops: float


@dataclass(frozen=True)
class SyncCollective:
    """A collective with no start / done: nothing runs while it moves data. libtpu's ``all-reduce-scatter``
    fusions are reduce-scatters (:func:`jaxpar.analysis._hlo_text.tpu_reduce_scatters`), with the shard's bytes."""

    kind: str
    name: str
    computation: str
    runs: float
    bytes: int


@dataclass(frozen=True)
class OverlapReport:
    """What :func:`overlap` found. ``step_flops``: dot / convolution FLOPs of one execution;
    ``overlapped_flops``: those scheduled under at least one asynchronous collective (each counted once)."""

    asynchronous: tuple[AsyncCollective, ...]
    synchronous: tuple[SyncCollective, ...]
    step_flops: float
    overlapped_flops: float

    @property
    def overlapped_fraction(self) -> float:
        """``overlapped_flops / step_flops`` (0 for a program without dots)."""
        return self.overlapped_flops / self.step_flops if self.step_flops else 0.0

    @property
    def exposed(self) -> tuple[AsyncCollective, ...]:
        """The asynchronous collectives with no dot or convolution FLOPs between start and done."""
        return tuple(a for a in self.asynchronous if not a.flops)

    @property
    def hidden_bytes(self) -> float:
        """Bytes per execution of the async collectives with dot / convolution FLOPs under them."""
        return sum(a.bytes * a.runs for a in self.asynchronous if a.flops)

    @property
    def exposed_bytes(self) -> float:
        """Bytes per execution of the other collectives: synchronous, or async with no FLOPs under them."""
        return sum(c.bytes * c.runs for c in (*self.synchronous, *self.exposed))


# ----------------------------------------------------------------------------- shapes and FLOPs


def dims(shape: str) -> list[int]:
    """The dimensions of an HLO array shape (the first array of a tuple).

    Args:
      shape: an HLO shape.

    Returns:
      The dimension sizes (bounds of dynamic dimensions as given).

    >>> dims("f32[8,128]{1,0}"), dims("(bf16[2,3]{1,0}, s8[16]{0})"), dims("f32[]")
    ([8, 128], [2, 3], [])
    """
    match = re.search(r"[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    if match is None:
        raise AnalysisError(f"shape {shape!r} has no array")
    return [int(d.strip().lstrip("<=")) for d in match.group(1).split(",") if d.strip()]


def _runs_callees(ins: Instruction) -> list[str]:
    """The computations ``ins`` runs as program steps: all it calls but the scalar ``to_apply`` of
    reductions and collectives (a ``call``'s ``to_apply`` is its body)."""
    return [c for key, c in called_computations(ins) if key != "to_apply" or ins.opcode == "call"]


def _window(rest: str, n: int) -> list[dict[str, int]]:
    """Per spatial dimension ``size``, ``stride``, ``pad`` (low side), ``lhs_dilate`` and ``rhs_dilate``."""
    match = re.search(r"window=\{([^}]*)\}", rest)
    fields = dict(f.split("=", 1) for f in match.group(1).split()) if match else {}
    keys = {"size": 1, "stride": 1, "pad": 0, "lhs_dilate": 1, "rhs_dilate": 1}
    got = {k: [int(p.split("_")[0]) for p in fields[k].split("x")] if k in fields else [v] * n for k, v in keys.items()}
    return [{k: got[k][i] for k in keys} for i in range(n)]


def _taps(n: int, out: int, w: dict) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that land on one of the ``n`` inputs."""
    extent, d, s = (n - 1) * w["lhs_dilate"], w["lhs_dilate"], w["stride"]
    total = 0
    for k in range(w["size"]):
        c = k * w["rhs_dilate"] - w["pad"]
        lo, hi = -(c // s) if c < 0 else 0, min(out - 1, (extent - c) // s)
        if hi >= lo:
            total += hi - lo + 1 if d == 1 else sum(1 for o in range(lo, hi + 1) if (o * s + c) % d == 0)
    return total


def _conv_flops(ins: Instruction, lhs: list[int], rhs: list[int]) -> float:
    match = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.rest)
    if match is None:
        return 0.0
    lhs_l, rhs_l, out_l = match.groups()
    out = dims(ins.shape)
    spatial = sorted(ch for ch in out_l if ch.isdigit())
    windows = _window(ins.rest, len(spatial))
    taps = math.prod(_taps(lhs[lhs_l.index(ch)], out[out_l.index(ch)], windows[i]) for i, ch in enumerate(spatial))
    outer = math.prod(out[i] for i, ch in enumerate(out_l) if not ch.isdigit())
    return 2.0 * outer * rhs[rhs_l.index("i")] * taps


class _Module:
    """An HLO module's instructions by computation, shapes by name, trip counts and FLOPs."""

    def __init__(self, text: str):
        self.instrs = parse_instructions(text)
        self.by_comp = by_computation(self.instrs)
        self.by_name = {ins.name: ins for ins in self.instrs}
        self.targets = custom_call_targets(text)
        gemms = {n for n, t in self.targets.items() if t.startswith("__cublas$")}
        self.gemm = {m.group(1): line for line in text.splitlines() if (m := _RAW.match(line)) and m.group(1) in gemms}
        self.tpu_roles = tpu_async_roles(text, self.instrs)
        self.trips, self.runs = while_trip_counts(text, self.instrs), trip_counts(text)
        self.entry = m.group(1) if (m := _ENTRY.search(text)) else None
        self._memo: dict[str, float] = {}

    def operand_dims(self, ins: Instruction, i: int) -> list[int]:
        ops = operands(ins.rest)
        if i >= len(ops) or ops[i] not in self.by_name:
            raise AnalysisError(f"{ins.opcode} {ins.name!r}: operand {i} has no known shape in the HLO text")
        return dims(self.by_name[ops[i]].shape)

    def flops(self, ins: Instruction) -> float:
        """Dot / convolution FLOPs of one run of ``ins`` (see the module docstring)."""
        op = ins.opcode
        if op in ("dot", "custom-call"):          # a cuBLAS gemm names its contracting dims in its backend config
            found = re.search(r"lhs_contracting_dims=\{([^}]*)\}", ins.rest) if op == "dot" else \
                re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', self.gemm.get(ins.name, ""))
            if found is None:
                return 0.0
            lhs = self.operand_dims(ins, 0)
            return 2.0 * math.prod(dims(ins.shape)) * math.prod(lhs[int(d)] for d in re.findall(r"\d+", found.group(1)))
        if op == "convolution":
            return _conv_flops(ins, self.operand_dims(ins, 0), self.operand_dims(ins, 1))
        if op in ("async-update", "async-done"):      # their computation counts once, at the start
            return 0.0
        k = self.trips.get(ins.name, 1) if op == "while" else 1
        return sum(k * self.computation_flops(c) for c in _runs_callees(ins))

    def computation_flops(self, comp: str) -> float:
        if comp not in self._memo:
            self._memo[comp] = 0.0                    # a (malformed) cycle counts once
            self._memo[comp] = sum(self.flops(i) for i in self.by_comp.get(comp, ()))
        return self._memo[comp]

    def collective_in(self, comp: str) -> Instruction | None:
        """The first collective of a computation (what an async wrapper or TPU fusion runs)."""
        return next((i for i in self.by_comp.get(comp, ()) if i.opcode in KINDS), None)


# ----------------------------------------------------------------------------- pairing


def _pairs(mod: _Module) -> tuple[list[tuple[Instruction, Instruction, Instruction]], set[str]]:
    """``([(collective, start, done)], wrapped)``: the async pairs of every computation, and the
    computations whose collectives belong to them (async wrappers; libtpu's chains are in ``mod.tpu_roles``)."""
    pairs, wrapped = [], set()
    for comp, seq in mod.by_comp.items():
        native, chain, tpu = {}, {}, {}
        for ins in seq:
            op, callees = ins.opcode, [c for k, c in called_computations(ins) if k == "calls"]
            c = mod.collective_in(callees[0]) if callees and op in ("async-start", "fusion") else None
            role = mod.tpu_roles.get(c.name) if c is not None and op == "fusion" else None
            if op.endswith("-start") and op[:-6] in KINDS:
                native[ins.name] = (ins, ins)
            elif op.endswith("-done") and op[:-5] in KINDS and (ops := operands(ins.rest)) and ops[0] in native:
                pairs.append((*native.pop(ops[0]), ins))
            elif op == "async-start" and c is not None:
                chain[ins.name] = (c, ins)
                wrapped.add(callees[0])
            elif op in ("async-update", "async-done") and (ops := operands(ins.rest)) and ops[0] in chain:
                c, start = chain.pop(ops[0])
                if op == "async-update":
                    chain[ins.name] = (c, start)
                else:
                    pairs.append((c, start, ins))
            elif role == "start":
                tpu.setdefault(channel(c), []).append((c, ins))
            elif role == "done" and tpu.get(channel(c)):
                pairs.append((*tpu[channel(c)].pop(0), ins))
    return pairs, wrapped


def _bytes(shape: str) -> int:
    try:
        return shape_bytes(shape)
    except ValueError:                                 # dynamic or unknown shapes
        return 0


def _measure(mod: _Module, coll: Instruction, start: Instruction, done: Instruction) -> AsyncCollective:
    seq = mod.by_comp[start.computation]
    between = seq[seq.index(start) + 1:seq.index(done)]
    return AsyncCollective(kind=coll.opcode.removesuffix("-start"), collective=coll.name, start=start.name, done=done.name, computation=start.computation,
                           runs=mod.runs.get(start.computation, 1), bytes=_bytes(done.shape),
                           instructions=sum(1 for x in between if x.opcode not in BOOKKEEPING),
                           flops=float(sum(mod.flops(x) for x in between)))


def _covered(mod: _Module, comp: str, spans: dict[str, list[tuple[int, int]]], seen: frozenset = frozenset()) -> float:
    """FLOPs of ``comp`` (per run) scheduled under at least one async collective, each counted once."""
    total = 0.0
    for k, ins in enumerate(mod.by_comp.get(comp, ())):
        if any(i < k < j for i, j in spans.get(comp, ())):
            total += mod.flops(ins)
        elif ins.opcode in ("while", "call", "conditional"):
            trip = mod.trips.get(ins.name, 1) if ins.opcode == "while" else 1
            total += sum(trip * _covered(mod, c, spans, seen | {comp}) for c in _runs_callees(ins) if c not in seen)
    return total


# ----------------------------------------------------------------------------- public API


def overlap(compiled: Any) -> OverlapReport:
    """The asynchronous collectives of a compiled program with the compute scheduled under each,
    and its synchronous collectives.

    Args:
      compiled: a ``jax.stages.Compiled`` or its scheduled HLO text (``compiled.as_text()``).

    Returns:
      An :class:`OverlapReport`: async collectives in text order of their starts, synchronous ones in
      text order, and the program's dot / convolution FLOPs, all and overlapped.
    """
    text = module_text(compiled)
    mod = _Module(text)
    pairs, wrapped = _pairs(mod)
    pairs.sort(key=lambda p: mod.instrs.index(p[1]))      # in text order of their starts
    spans: dict[str, list[tuple[int, int]]] = {}
    for _, start, done in pairs:
        seq = mod.by_comp[start.computation]
        spans.setdefault(start.computation, []).append((seq.index(start), seq.index(done)))
    scatters = tpu_reduce_scatters(mod.instrs)               # libtpu's: the fusion's result is the shard
    sync = [SyncCollective("reduce-scatter" if f else i.opcode, i.name, i.computation, mod.runs.get(i.computation, 1),
                           _bytes((f or i).shape))
            for i in mod.instrs if i.opcode in KINDS and i.computation not in wrapped and i.name not in mod.tpu_roles
            for f in [scatters.get(i.name)]]
    return OverlapReport(tuple(_measure(mod, *p) for p in pairs), tuple(sync),
                         mod.computation_flops(mod.entry) if mod.entry else 0.0,
                         _covered(mod, mod.entry, spans) if mod.entry else 0.0)
