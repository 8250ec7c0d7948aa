"""How often each computation of a compiled program runs per execution: while loops and conditionals.

:func:`while_trip_counts` gives each ``while`` loop's trip count (a layer scan, the pipeline's
tick loop): the ``known_trip_count`` the compiler proved and wrote into the loop's backend
config (XLA:CPU and XLA:GPU do), or else the count read from the loop itself (libtpu writes
none): a condition ``i < N`` (``<=``, ``>``, ``>=``, either operand order) of a constant ``N``,
``i``'s constant start in the loop's initial tuple and its constant step in the body's root
tuple (``i + c``). :func:`trip_counts` walks the call graph from the entry computation and
multiplies them down, so that a collective's bytes times its computation's count is bytes
per execution. A conditional's branches count as taken on every execution (an upper bound)
unless branch weights say how often each one runs
(:func:`jaxpar.analysis._axis_bytes.stage_branch_weights` for the pipeline's tick loop).

Example::

    >>> hlo = '''HloModule m
    ... %body (p: f32[4]) -> f32[4] {
    ...   ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
    ... }
    ... ENTRY %main (a: f32[4]) -> f32[4] {
    ...   ROOT %w = f32[4]{0} while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
    ... }'''
    >>> while_trip_counts(hlo)
    {'w': 3}
    >>> trip_counts(hlo)
    {'main': 1, 'cond': 3, 'body': 3, 'add': 3}
"""
from __future__ import annotations

import re

from jaxpar.analysis._hlo_text import (Instruction, branch_computations, by_computation, called_computations, operands,
                                      parse_instructions)

_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
_MIRROR = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}


def while_trip_counts(text: str, instrs: list[Instruction] | None = None) -> dict[str, int]:
    """The trip count of each ``while`` instruction of an HLO module (see the module docstring).

    The known trip count is read from the raw text (:func:`~jaxpar.analysis._hlo_text.parse_instructions`
    blanks the string literals the backend config is made of).

    Args:
      text: the HLO text (``compiled.as_text()``).
      instrs: its :func:`~jaxpar.analysis._hlo_text.parse_instructions` (parsed again when not given).

    Returns:
      ``{while instruction name: trip count}``; loops whose count is neither known nor readable
      from the loop are left out.
    """
    trips = {}
    for line in text.splitlines():
        if " while(" in line:
            name, trip = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)", line), _TRIP.search(line)
            if name and trip:
                trips[name.group(1)] = int(trip.group(1))
    instrs = parse_instructions(text) if instrs is None else instrs
    loops = [i for i in instrs if i.opcode == "while" and i.name not in trips]
    if loops:
        graph = _Graph(instrs)
        trips.update({w.name: n for w in loops if (n := graph.trip(w)) is not None})
    return trips


class _Graph:
    """An HLO module's instructions by name and by computation, for reading a loop's counter."""

    def __init__(self, instrs: list[Instruction]):
        self.by_name = {i.name: i for i in instrs}
        self.by_comp = by_computation(instrs)

    def source(self, name: str) -> Instruction | None:
        """The instruction ``name`` is a copy or bitcast of (itself if neither)."""
        ins = self.by_name.get(name)
        while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and operands(ins.rest):
            ins = self.by_name.get(operands(ins.rest)[0])
        return ins

    def constant(self, name: str) -> int | None:
        ins = self.source(name)
        match = re.match(r"\s*(-?\d+)\)", ins.rest) if ins is not None and ins.opcode == "constant" else None
        return int(match.group(1)) if match else None

    def element(self, tup: Instruction | None, index: int) -> Instruction | None:
        """The ``index``-th operand of a ``tuple`` instruction (through copies)."""
        ops = operands(tup.rest) if tup is not None and tup.opcode == "tuple" else []
        return self.source(ops[index]) if index < len(ops) else None

    def trip(self, w: Instruction) -> int | None:
        """The trip count of loop ``w`` read from its condition, initial tuple and body, or ``None``."""
        called = dict(called_computations(w))
        cmp = [i for i in self.by_comp.get(called.get("condition"), ()) if i.opcode == "compare"]
        ops = [self.source(n) for n in operands(cmp[0].rest)] if len(cmp) == 1 else []
        direction = next(iter(re.findall(r"direction=(\w+)", cmp[0].rest)), "") if cmp else ""
        if len(ops) != 2 or None in ops or direction not in _MIRROR:
            return None
        if ops[0].opcode != "get-tuple-element":
            ops, direction = ops[::-1], _MIRROR[direction]
        index = re.search(r"index=(\d+)", ops[0].rest)
        limit = self.constant(ops[1].name)
        if ops[0].opcode != "get-tuple-element" or not index or limit is None:
            return None
        k = int(index.group(1))
        init_ins = self.element(self.source(next(iter(operands(w.rest)), "")), k)
        init = self.constant(init_ins.name) if init_ins is not None else None
        step = self._step(called.get("body"), k)
        return None if init is None or step is None else _count(init, limit, step, direction)

    def _step(self, body: str | None, k: int) -> int | None:
        """``c`` when the body's root tuple sets element ``k`` to ``element k + c`` (or ``- c``; constant ``c``)."""
        seq = self.by_comp.get(body, ())
        nxt = self.element(seq[-1], k) if seq else None          # the root: last in the text
        if nxt is None or nxt.opcode not in ("add", "subtract"):
            return None
        a, b = (self.source(n) for n in operands(nxt.rest)[:2])
        if nxt.opcode == "add" and _is_element(b, k):
            a, b = b, a
        c = self.constant(b.name) if _is_element(a, k) and b is not None else None
        return None if c is None else (c if nxt.opcode == "add" else -c)


def _is_element(ins: Instruction | None, k: int) -> bool:
    return ins is not None and ins.opcode == "get-tuple-element" and re.search(rf"\bindex={k}\b", ins.rest) is not None


def _count(init: int, limit: int, step: int, direction: str) -> int | None:
    """How many times ``i = init, init + step, ...`` satisfies ``i <direction> limit`` before it first fails."""
    if step == 0 or (step > 0) != (direction in ("LT", "LE")):
        return None
    span = (limit - init if step > 0 else init - limit) + (direction in ("LE", "GE"))
    return max(0, -(-span // abs(step)))


def trip_counts(text: str, branch_weights: dict[str, list[float]] | None = None, *, unknown: float = 1.0
                ) -> dict[str, float]:
    """How many times each computation runs per execution of the entry computation.

    A while loop's body and condition run its known trip count times per execution of the
    loop (``unknown`` times when it is known only at run time); a called computation runs as often as its caller. A computation
    reached along several paths keeps the largest count.

    Args:
      text: the HLO text (``compiled.as_text()``).
      branch_weights: ``{conditional name: [fraction of its executions that take branch i]}``;
        a conditional not in it counts every branch as taken on every execution (an upper bound).
      unknown: the trip count of a loop whose count is neither known nor readable from the loop.

    Returns:
      ``{computation name: times it runs}`` (a branch never taken is recorded with 0);
      empty when the text has no entry computation.
    """
    instrs = parse_instructions(text)
    by_comp = by_computation(instrs)
    trips = while_trip_counts(text, instrs)
    weights = branch_weights or {}
    entry = next((m.group(1) for m in _ENTRY.finditer(text)), None)
    mult: dict[str, float] = {}

    def visit(comp: str, k: float) -> None:
        if comp in mult and mult[comp] >= k:      # a branch never taken is recorded with 0
            return
        mult[comp] = k
        for ins in by_comp.get(comp, ()):
            trip = trips.get(ins.name, unknown) if ins.opcode == "while" else 1
            called = called_computations(ins)
            branches = branch_computations(ins) if ins.opcode == "conditional" else []
            w = weights.get(ins.name)
            for key, callee in called:
                f = w[branches.index(callee)] if w is not None and callee in branches else 1
                visit(callee, k * f * (trip if key in ("body", "condition") else 1))

    if entry:
        visit(entry, 1)
    return mult
