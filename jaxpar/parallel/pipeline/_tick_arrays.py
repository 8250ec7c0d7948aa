"""A lowered program as arrays, and the plumbing of a tick around a stage's action.

:func:`tick_table` turns a lowered :class:`~jaxpar.parallel.pipeline.Program` into
``[ticks, ...]`` int32 arrays (a :class:`TickTable`): per tick and stage the index of the action
kind to run and its slots, and per tick the send patterns. :func:`one_of` runs a stage's action
(one boolean ``lax.cond`` per action kind) and :func:`exchange` the tick's sends over ``pipe``;
:mod:`jaxpar.parallel.pipeline._stage` holds the actions and runs a tick with them.

Example:
    >>> from jaxpar.parallel.pipeline import get_schedule, lower
    >>> table = tick_table(lower(get_schedule("1f1b", 2, 4)))
    >>> [k.op for k in table.kinds], table.fwd_pats, table.bwd_pats
    (['B', 'B', 'F', 'F', 'idle'], [((0, 1),)], [((1, 0),)])
    >>> table.rows.kind.shape          # [ticks, stages]
    (10, 2)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxpar.parallel.pipeline._buffers import PipelineState, Slots, put_tree, take, zeros_like_tree
from jaxpar.parallel.pipeline._instructions import PIPE, Instr, Program


class ActionKind(NamedTuple):
    """What an instruction needs compiled: one conditional per distinct kind.

    >>> ActionKind.of(Instr("F", first=True, last=False))
    ActionKind(op='F', first=True, last=False)
    """

    op: str              # 'idle' | 'F' | 'B' | 'W'
    first: bool = False  # virtual stage 0: F runs ``pre``, B backprops it
    last: bool = False   # last virtual stage: F runs ``post``

    @classmethod
    def of(cls, instr: Instr) -> "ActionKind":
        """The kind of an instruction.

        Args:
            instr: a lowered instruction.

        Returns:
            Its op, ``first`` (only for F / B) and ``last`` (only for F).
        """
        return cls(instr.op, instr.first and instr.op in ("F", "B"), instr.last and instr.op == "F")


class TickRow(NamedTuple):
    """One row of the lowered table; the scan runs over a ``[ticks, ...]`` stack of them."""

    kind: Any       # [p]: index of each stage's branch
    slots: Slots    # each [p]
    fwd_pat: Any    # index of the forward send pattern (0: none), the same on every device
    bwd_pat: Any
    fwd_recv: Any   # [p]: inbox_f slot the received activation goes to (n_fwd: discarded)
    bwd_recv: Any   # [p]: inbox_b slot the received cotangent goes to (n_bwd: discarded)


class TickTable(NamedTuple):
    """A lowered program as arrays: its rows and what their indices refer to."""

    kinds: list        # the distinct ActionKinds: branch i runs kinds[i]
    fwd_pats: list     # the distinct sets of (source, target) pairs sending forward / backward
    bwd_pats: list
    rows: TickRow      # [ticks, ...] int32


def tick_table(program: Program) -> TickTable:
    """The lowered table as ``[ticks, ...]`` int32 arrays, and what its indices refer to.

    Args:
        program: a lowered schedule (:func:`~._instructions.lower`).

    Returns:
        The distinct action kinds (sorted; a row's ``kind`` indexes them), the distinct
        forward and backward send patterns (a row's ``fwd_pat`` / ``bwd_pat`` is the index
        plus one, 0 for no send), and the rows.
    """
    ticks = program.ticks
    kinds = sorted({ActionKind.of(i) for t in ticks for i in t.instrs})
    fwd_pats = sorted({t.fwd_pairs for t in ticks if t.fwd_pairs})
    bwd_pats = sorted({t.bwd_pairs for t in ticks if t.bwd_pairs})
    per_stage = lambda f: np.array([[f(i) for i in t.instrs] for t in ticks], np.int32)   # noqa: E731
    per_tick = lambda f: np.array([f(t) for t in ticks], np.int32)                     # noqa: E731
    pattern = lambda pats, pairs: pats.index(pairs) + 1 if pairs else 0                # noqa: E731
    rows = TickRow(
        kind=per_stage(lambda i: kinds.index(ActionKind.of(i))),
        slots=Slots(*(per_stage(lambda i, a=a: getattr(i, a))
                      for a in ("microbatch", "chunk", "res", "inbox", "dy", "grad"))),
        fwd_pat=per_tick(lambda t: pattern(fwd_pats, t.fwd_pairs)),
        bwd_pat=per_tick(lambda t: pattern(bwd_pats, t.bwd_pairs)),
        fwd_recv=per_tick(lambda t: t.fwd_recv), bwd_recv=per_tick(lambda t: t.bwd_recv))
    return TickTable(kinds, fwd_pats, bwd_pats, rows)


def _send(pats: list, pat, x):
    """``x`` along the tick's pairs (``pats[pat - 1]``; 0: nothing moves). ``pat`` is
    the same on every device, so each ``ppermute`` runs on all of them or none."""
    fns = [zeros_like_tree] + [lambda y, q=q: jax.lax.ppermute(y, PIPE, q) for q in pats]
    return jax.lax.switch(pat, fns, x) if len(fns) > 1 else fns[0](x)


def exchange(st: PipelineState, table: TickTable, row: TickRow, s, send_f, send_b) -> PipelineState:
    """The tick's sends each way over ``pipe``; what arrives goes to its inbox slot.

    Args:
        st: the stage's state.
        table: the program's table (its send patterns).
        row: the tick's row.
        s: this stage's index on ``pipe``.
        send_f: the activation this stage sends forward (zeros when none).
        send_b: the cotangent this stage sends backward (zeros when none).

    Returns:
        ``st`` with what this stage receives written to its inbox slots.
    """
    inbox_f = put_tree(st.inbox_f, take(row.fwd_recv, s), _send(table.fwd_pats, row.fwd_pat, send_f))
    inbox_b = put_tree(st.inbox_b, take(row.bwd_recv, s), _send(table.bwd_pats, row.bwd_pat, send_b))
    return st._replace(inbox_f=inbox_f, inbox_b=inbox_b)


def one_of(kind, kinds: list, act: Callable, carry: tuple) -> tuple:
    """Run the action of kind ``kind`` on ``carry``, with one boolean ``cond`` per kind.

    Each ``cond`` that is not idle reads and writes the carried buffers in place (an index
    ``switch`` copies every buffer its branches pass through).

    Args:
        kind: the index into ``kinds`` of the action to run (traced).
        kinds: the distinct kinds; the first field of each is its op (``'idle'`` runs nothing).
        act: ``act(i)`` is the function ``(*carry) -> carry`` of ``kinds[i]``.
        carry: the values the action reads and writes.

    Returns:
        ``act(kind)(*carry)``, or ``carry`` if ``kinds[kind]`` is idle.
    """
    for i, k in enumerate(kinds):
        if k[0] != "idle":
            carry = jax.lax.cond(kind == i, act(i), lambda *a: a, *carry)
    return carry
