"""How often each computation of a compiled program runs per execution: while loops and conditionals.

XLA writes the trip count it proves for a ``while`` loop (a layer scan, the pipeline's tick
loop) into the loop's backend config as ``known_trip_count``; :func:`while_trip_counts` reads
them. :func:`trip_counts` walks the call graph from the entry computation and multiplies them
down, so that a collective's bytes times its computation's count is bytes per execution.
A conditional's branches count as taken on every execution (an upper bound) unless branch
weights say how often each one runs (:func:`jaxpar.analysis.axis_bytes.stage_branch_weights`
for the pipeline's tick loop).

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

from .hlo import called_computations, parse_instructions

__all__ = ["while_trip_counts", "trip_counts"]

_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)


def while_trip_counts(text: str) -> dict[str, int]:
    """The known trip count of each ``while`` instruction of an HLO module.

    Read from the raw text (:func:`~jaxpar.analysis.hlo.parse_instructions` blanks the
    string literals the backend config is made of).

    Args:
      text: the HLO text (``compiled.as_text()``).

    Returns:
      ``{while instruction name: trip count}``; loops without a known trip count are left out.
    """
    trips = {}
    for line in text.splitlines():
        if " while(" in line:
            name, trip = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)", line), _TRIP.search(line)
            if name and trip:
                trips[name.group(1)] = int(trip.group(1))
    return trips


def trip_counts(text: str, branch_weights: dict[str, list[float]] | None = None) -> dict[str, float]:
    """How many times each computation runs per execution of the entry computation.

    A while loop's body and condition run its known trip count times per execution of the
    loop (1 when unknown); a called computation runs as often as its caller. A computation
    reached along several paths keeps the largest count.

    Args:
      text: the HLO text (``compiled.as_text()``).
      branch_weights: ``{conditional name: [fraction of its executions that take branch i]}``;
        a conditional not in it counts every branch as taken on every execution (an upper bound).

    Returns:
      ``{computation name: times it runs}`` (a branch never taken is recorded with 0);
      empty when the text has no entry computation.
    """
    by_comp: dict[str, list] = {}
    for ins in parse_instructions(text):
        by_comp.setdefault(ins.computation, []).append(ins)
    trips = while_trip_counts(text)
    weights = branch_weights or {}
    entry = next((m.group(1) for m in _ENTRY.finditer(text)), None)
    mult: dict[str, float] = {}

    def visit(comp: str, k: float) -> None:
        if comp in mult and mult[comp] >= k:      # a branch never taken is recorded with 0
            return
        mult[comp] = k
        for ins in by_comp.get(comp, ()):
            trip = trips.get(ins.name, 1) if ins.opcode == "while" else 1
            called = called_computations(ins)
            branches = [c for key, c in called if key.endswith("computation") or key == "branch_computations"]
            w = weights.get(ins.name)
            for key, callee in called:
                f = w[branches.index(callee)] if w is not None and callee in branches else 1
                visit(callee, k * f * (trip if key in ("body", "condition") else 1))

    if entry:
        visit(entry, 1)
    return mult
