"""Collectives inside device-dependent branches of a compiled program: a taint analysis of its HLO.

A ``conditional`` whose branch index differs between devices runs a branch on some devices only; a
collective in it waits for peers that never reach it (a hang). :func:`device_dependent_collectives`
lists them; the rules of the analysis are in docs/targets.md ("Collectives in device-dependent branches").

Example:
    >>> hlo = '''HloModule m, num_partitions=2
    ... %add (a: f32[], b: f32[]) -> f32[] {
    ...   %a = f32[] parameter(0)
    ...   %b = f32[] parameter(1)
    ...   ROOT %s = f32[] add(%a, %b)
    ... }
    ... %reduce (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
    ... }
    ... %skip (q: f32[4]) -> f32[4] {
    ...   ROOT %q = f32[4]{0} parameter(0)
    ... }
    ... ENTRY %main (x: f32[4]) -> f32[4] {
    ...   %x = f32[4]{0} parameter(0)
    ...   %id = u32[] partition-id()
    ...   %zero = u32[] constant(0)
    ...   %first = pred[] compare(%id, %zero), direction=EQ
    ...   ROOT %c = f32[4]{0} conditional(%first, %x, %x), true_computation=%reduce, false_computation=%skip
    ... }'''
    >>> device_dependent_collectives(hlo)
    [BranchCollective(name='ar', kind='all-reduce', conditional='c', computation='reduce', branch='reduce')]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Union

from jaxpar.analysis._hlo_text import (KINDS, Instruction, branch_computations, called_computations, module_text,
                                       operands, parse_instructions, reached_computations, tpu_async_roles,
                                       tpu_reduce_scatters)
from jaxpar.analysis._replica_groups import parse_replica_groups

#: A value's taint: a bool for an array, a tuple of taints for a tuple.
Taint = Union[bool, tuple]

_SOURCES = ("partition-id", "replica-id")
_POSITIONAL = ("call", "fusion", "async-start", "custom-call")
_ROOT = re.compile(r"^\s+ROOT\s+%?([\w.\-]+)\s*=", re.M)
_MORE_CALLS = re.compile(r"\b(called_computations|select|scatter)=(\{[^}]*\}|%[\w.\-]+)")
_INDEX = re.compile(r"\bindex=(\d+)")


@dataclass(frozen=True)
class BranchCollective:
    """A collective that only the devices taking one branch of a device-dependent conditional reach.

    Attributes:
      name: the collective instruction (an async collective's ``-start``).
      kind: one of :data:`~jaxpar.analysis._hlo_text.KINDS`.
      conditional: the device-dependent ``conditional`` (or ``while``) instruction.
      computation: the computation the collective is in.
      branch: the branch computation of ``conditional`` that reaches it (the body, for a ``while``).
    """

    name: str
    kind: str
    conditional: str
    computation: str
    branch: str


# ----------------------------------------------------------------------------- the lattice


def _any(t: Taint) -> bool:
    return any(_any(e) for e in t) if isinstance(t, tuple) else bool(t)


def _norm(t: Taint) -> Taint:
    if not isinstance(t, tuple):
        return bool(t)
    t = tuple(_norm(e) for e in t)
    if all(e is True for e in t) and t:
        return True
    return False if not _any(t) else t


def _join(a: Taint, b: Taint) -> Taint:
    if a is False or b is True:
        return b
    if b is False or a is True:
        return a
    if len(a) != len(b):
        return True if _any(a) or _any(b) else False
    return _norm(tuple(_join(x, y) for x, y in zip(a, b)))


def _element(t: Taint, i: int) -> Taint:
    return t[i] if isinstance(t, tuple) and i < len(t) else bool(t) if not isinstance(t, tuple) else _any(t)


def _join_all(ts) -> Taint:
    out: Taint = False
    for t in ts:
        out = _join(out, t)
    return out


# ----------------------------------------------------------------------------- the module


class _Module:
    """An HLO module's instructions, roots and parameters, and the taint of each value."""

    def __init__(self, text: str):
        self.instrs = parse_instructions(text)
        self.by_name = {i.name: i for i in self.instrs}
        self.roots = {self.by_name[n].computation: n for n in _ROOT.findall(text) if n in self.by_name}
        self.ops = {i.name: operands(i.rest) for i in self.instrs}
        self.calls = {i.name: _calls(i) for i in self.instrs}
        match = re.search(r"\bnum_partitions=(\d+)", text.split("\n", 1)[0])
        self.partitions = int(match.group(1)) if match else 0
        self.taint: dict[str, Taint] = {}
        self.params: dict[tuple[str, int | None], Taint] = {}

    def of(self, name: str) -> Taint:
        return self.taint.get(name, False)

    def root(self, comp: str) -> Taint:
        return self.of(self.roots.get(comp, ""))

    def feed(self, comp: str, k: int | None, t: Taint) -> bool:
        """Join ``t`` into parameter ``k`` of ``comp`` (``None``: every parameter); True if it grew."""
        old = self.params.get((comp, k), False)
        new = _join(old, t)
        self.params[(comp, k)] = new
        return new != old

    def param(self, instr: Instruction) -> Taint:
        k = self.ops[instr.name][0] if self.ops[instr.name] else "0"
        return _join(self.params.get((instr.computation, int(k) if k.isdigit() else 0), False),
                     self.params.get((instr.computation, None), False))


def _calls(instr: Instruction) -> list[tuple[str, str]]:
    """``called_computations`` plus the attributes it does not read (custom calls, select-and-scatter)."""
    more = [(key, name) for key, value in _MORE_CALLS.findall(instr.rest) for name in re.findall(r"%([\w.\-]+)", value)]
    return called_computations(instr) + more


def _uniform(m: _Module, instr: Instruction) -> bool:
    """An all-reduce or all-gather over one group of every device: the same result everywhere."""
    if instr.opcode.removesuffix("-start") not in ("all-reduce", "all-gather") or not m.partitions:
        return False
    try:
        groups = parse_replica_groups(instr.rest)
    except ValueError:
        return False
    return groups is not None and (groups == [] or (len(groups) == 1 and len(groups[0]) == m.partitions))


def _result(m: _Module, instr: Instruction) -> Taint:
    """The taint of ``instr``'s result, from its operands' and its callees' current taints."""
    op, ops = instr.opcode, [m.of(o) for o in m.ops[instr.name]]
    callees = [c for _, c in m.calls[instr.name]]
    if op in _SOURCES:
        return True
    if op == "parameter":
        return m.param(instr)
    if op == "tuple":
        return _norm(tuple(ops))
    if op == "get-tuple-element":
        index = _INDEX.search(instr.rest)
        return _element(ops[0], int(index.group(1))) if ops and index else _any(_join_all(ops))
    if op == "while":
        body = next((c for k, c in m.calls[instr.name] if k == "body"), "")
        cond = next((c for k, c in m.calls[instr.name] if k == "condition"), "")
        return True if _any(m.root(cond)) else _join(_join_all(ops), m.root(body))
    if op == "conditional":
        roots = _join_all(m.root(b) for b in branch_computations(instr))
        return True if ops and _any(ops[0]) else roots
    if op in ("call", "fusion") and callees:
        return m.root(callees[0])
    if _uniform(m, instr):
        return False
    return _any(_join_all(ops + [m.root(c) for c in callees]))


def _branch_operands(instr: Instruction) -> list[tuple[str, int]]:
    """``(branch computation, index of the operand it is passed)`` of a ``conditional``: a predicate
    conditional passes operand 1 to its true computation and operand 2 to its false one."""
    calls = dict(called_computations(instr))
    if "true_computation" in calls:
        return [(calls["true_computation"], 1), (calls.get("false_computation", ""), 2)]
    return [(b, j + 1) for j, b in enumerate(branch_computations(instr))]


def _feed_callees(m: _Module, instr: Instruction) -> bool:
    """Pass ``instr``'s operand taints to its callees' parameters; True if one grew."""
    ops = [m.of(o) for o in m.ops[instr.name]]
    grew = False
    if instr.opcode == "while":
        into = _join(ops[0] if ops else False, m.root(next((c for k, c in m.calls[instr.name] if k == "body"), "")))
        for _, callee in m.calls[instr.name]:
            grew |= m.feed(callee, 0, into)
    elif instr.opcode == "conditional":
        for branch, k in _branch_operands(instr):
            grew |= m.feed(branch, 0, ops[k] if k < len(ops) else False)
    elif instr.opcode in _POSITIONAL:
        for _, callee in m.calls[instr.name]:
            for k, t in enumerate(ops):
                grew |= m.feed(callee, k, t)
    else:
        for _, callee in m.calls[instr.name]:
            grew |= m.feed(callee, None, _any(_join_all(ops)))
    return grew


def _analyse(text: str) -> _Module:
    m = _Module(text)
    changed = True
    while changed:
        changed = False
        for instr in m.instrs:
            changed |= _feed_callees(m, instr)
            old = m.of(instr.name)
            new = _join(old, _result(m, instr))
            if new != old:
                m.taint[instr.name] = new
                changed = True
    return m


# ----------------------------------------------------------------------------- public API


def _dependent(m: _Module) -> list[tuple[Instruction, list[str]]]:
    """The device-dependent conditionals and whiles of ``m``, with the computations they choose between."""
    out = []
    for i in m.instrs:
        ops = m.ops[i.name]
        if i.opcode == "conditional" and ops and _any(m.of(ops[0])):
            out.append((i, branch_computations(i)))
        elif i.opcode == "while":
            calls = dict(m.calls[i.name])
            if _any(m.root(calls.get("condition", ""))):
                out.append((i, [calls.get("body", "")]))
    return out


def device_dependent_collectives(compiled_or_text: Any) -> list[BranchCollective]:
    """Every collective inside a branch of a device-dependent conditional (docs/targets.md has the rules).

    Args:
      compiled_or_text: a ``jax.stages.Compiled`` or HLO module text (XLA:CPU, GPU or libtpu).

    Returns:
      One :class:`BranchCollective` per collective, in text order of the conditionals (innermost
      first: HLO text prints callees before callers); ``[]`` when every collective is reached by
      every device that reaches its computation's caller.
    """
    text = module_text(compiled_or_text)
    m = _analyse(text)
    graph: dict[str, set[str]] = {}
    for i in m.instrs:
        graph.setdefault(i.computation, set()).update(c for _, c in m.calls[i.name])
    tpu, scatters = tpu_async_roles(text, m.instrs), tpu_reduce_scatters(m.instrs)
    colls = [i for i in m.instrs if i.opcode.removesuffix("-start") in KINDS and tpu.get(i.name, "start") == "start"]
    found, seen = [], set()
    for cond, branches in _dependent(m):
        branch_of = {}
        for branch in reversed(branches):        # a computation two branches reach: the first one's
            branch_of.update(dict.fromkeys(reached_computations(graph, [branch]), branch))
        for i in colls:
            if i.computation in branch_of and i.name not in seen:
                seen.add(i.name)
                kind = "reduce-scatter" if i.name in scatters else i.opcode.removesuffix("-start")
                found.append(BranchCollective(i.name, kind, cond.name, i.computation, branch_of[i.computation]))
    return found
