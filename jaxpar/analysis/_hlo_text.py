"""Reading an HLO module's text: instructions, shapes, operands, called computations and libtpu's
async collective fusions.

What :mod:`jaxpar.analysis._hlo`, :mod:`jaxpar.analysis._loops`, :mod:`jaxpar.analysis._overlap` and
:mod:`jaxpar.analysis._axis_bytes` share. The text is ``compiled.as_text()`` (or any HLO module text).

Example::

    >>> hlo = '''HloModule m
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=2, replica_groups={{0,1}}, to_apply=%add
    ... }'''
    >>> [(i.name, i.opcode, operands(i.rest), channel(i)) for i in parse_instructions(hlo)]
    [('p', 'parameter', ['0'], None), ('ar', 'all-reduce', ['p'], '2')]
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from jaxpar.errors import AnalysisError

#: The collective opcodes (an async ``*-start`` / ``*-done`` pair is one of them).
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "token": 0, "opaque": 0,
}  # fmt: skip
_F8_OR_SMALLER = re.compile(r"f(8|6|4)e\d+m\d+\w*")
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def module_text(compiled: Any) -> str:
    """The HLO text of a ``jax.stages.Compiled`` (``compiled.as_text()``), or the text itself."""
    if isinstance(compiled, str):
        return compiled
    as_text = getattr(compiled, "as_text", None)
    if as_text is None:
        raise AnalysisError(f"compiled must be a jax.stages.Compiled (jax.jit(f).lower(*args).compile()) or its HLO "
                            f"text (compiled.as_text()), got {type(compiled).__name__}")
    return as_text()


# ----------------------------------------------------------------------------- shapes


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    match = _F8_OR_SMALLER.fullmatch(dtype)
    if match:
        return int(match.group(1))
    raise AnalysisError(f"shape has unknown element type {dtype!r}")


def _num_elements(dims: str) -> int:
    sizes = [d.strip().lstrip("<=") for d in dims.split(",") if d.strip()]
    if any(not s.isdigit() for s in sizes):
        raise AnalysisError(f"shape has non-static dimensions [{dims}]")
    return math.prod(int(s) for s in sizes)


def array_shapes(shape: str) -> list[str]:
    """The arrays of an HLO shape string, without layouts.

    Args:
      shape: an HLO shape, an array or a tuple.

    Returns:
      One ``"dtype[dims]"`` per array.

    >>> array_shapes("(f32[8,128]{1,0}, s8[4]{0:T(128)})")
    ['f32[8,128]', 's8[4]']
    """
    return [f"{dtype}[{dims}]" for dtype, dims in _ARRAY_SHAPE.findall(shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string, summing tuple elements.

    Args:
      shape: an HLO shape, e.g. ``"f32[8,128]{1,0}"`` or a tuple of them.

    Returns:
      Bytes (sub-byte types rounded up per array).

    >>> shape_bytes("f32[8,128]{1,0}"), shape_bytes("(bf16[2], s8[4,4])")
    (4096, 20)
    """
    arrays = _ARRAY_SHAPE.findall(shape)
    if not arrays and shape.strip() not in ("()", "token[]"):
        raise AnalysisError(f"shape {shape!r} is not an HLO shape")
    return sum(math.ceil(_num_elements(dims) * _dtype_bits(dtype) / 8) for dtype, dims in arrays)


# ----------------------------------------------------------------------------- instructions


@dataclass(frozen=True)
class Instruction:
    """One instruction of an HLO module's text (:func:`parse_instructions`).

    ``rest`` is what follows the opcode's ``(``: operands and attributes, with string
    literals blanked to ``""``; ``computation`` the computation the instruction is in.
    """

    name: str
    shape: str
    opcode: str
    rest: str
    computation: str


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALLS = re.compile(
    r"\b(to_apply|calls|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_COMMENT = re.compile(r"/\*.*?\*/")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _split_shape(text: str) -> tuple[str, str]:
    """Split ``'(f32[2], s32[]) all-to-all(...)'`` into shape and remainder."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[: i + 1], text[i + 1 :]
    raise AnalysisError(f"unbalanced tuple shape in {text[:80]!r}")


def instruction_lines(text: str):
    """``(computation, line)`` of each instruction line of an HLO module's text (its indented lines).

    >>> list(instruction_lines("HloModule m\\nENTRY %main (p: f32[]) -> f32[] {\\n  ROOT %p = f32[] parameter(0)\\n}"))
    [('main', '  ROOT %p = f32[] parameter(0)')]
    """
    computation = ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            header = _HEADER.match(line)
            computation = header.group(1) if header and line.rstrip().endswith("{") else computation
        elif line.strip():
            yield computation, line


def by_computation(instrs: list[Instruction]) -> dict[str, list[Instruction]]:
    """``{computation: its instructions in text order}`` of :func:`parse_instructions`' list."""
    out: dict[str, list[Instruction]] = {}
    for i in instrs:
        out.setdefault(i.computation, []).append(i)
    return out


def parse_instructions(text: str) -> list[Instruction]:
    """The instructions of an HLO module's text, in text order.

    Args:
      text: the HLO text (``compiled.as_text()``).

    Returns:
      One :class:`Instruction` per instruction line, each with the computation it belongs to.

    >>> hlo = '''HloModule m
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
    ... }'''
    >>> [(i.name, i.opcode, i.computation) for i in parse_instructions(hlo)]
    [('p', 'parameter', 'main'), ('ar', 'all-reduce', 'main')]
    """
    instrs = []
    for computation, line in instruction_lines(text):
        match = _INSTR.match(line)
        if not match:
            continue
        shape, rest = _split_shape(match.group(2).strip())
        op = re.match(r"\s*([\w\-]+)\((.*)$", rest)
        if op:
            instrs.append(Instruction(match.group(1), shape, op.group(1), _STRING.sub('""', op.group(2)), computation))
    return instrs


def called_computations(instr: Instruction) -> list[tuple[str, str]]:
    """The computations ``instr`` calls, with the attribute that names each.

    Args:
      instr: an instruction from :func:`parse_instructions`.

    Returns:
      ``[(attribute, computation)]`` in text order; the attribute is one of ``to_apply``,
      ``calls``, ``body``, ``condition``, ``branch_computations``, ``true_computation``,
      ``false_computation`` (a ``branch_computations={%a, %b}`` list gives one pair per branch).

    >>> ins = Instruction("w", "f32[]", "while", "%t), condition=%cond, body=%body", "main")
    >>> called_computations(ins)
    [('condition', 'cond'), ('body', 'body')]
    """
    return [(key, name) for key, value in _CALLS.findall(instr.rest) for name in re.findall(r"%?([\w.\-]+)", value)]


def call_graph(instrs: list[Instruction]) -> dict[str, set[str]]:
    """``{computation: the computations its instructions call}``.

    Args:
      instrs: the instructions of a program (:func:`parse_instructions`).

    Returns:
      The callees of each calling computation.
    """
    calls: dict[str, set[str]] = {}
    for instr in instrs:
        for _, callee in called_computations(instr):
            calls.setdefault(instr.computation, set()).add(callee)
    return calls


def reached_computations(calls: dict[str, set[str]], starts) -> set[str]:
    """The computations ``starts`` are and every computation they call (in ``calls``, a
    :func:`call_graph`), directly or not.

    Args:
      calls: a :func:`call_graph`.
      starts: computation names.

    Returns:
      The set of names, ``starts`` included.

    >>> ins = [Instruction("w", "f32[]", "while", "%t), condition=%c, body=%b", "main"),
    ...        Instruction("f", "f32[]", "fusion", "%x), calls=%fused", "b")]
    >>> sorted(reached_computations(call_graph(ins), ["b"]))
    ['b', 'fused']
    """
    seen, todo = set(), list(starts)
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo.extend(calls.get(comp, ()))
    return seen


def branch_computations(instr: Instruction) -> list[str]:
    """The branches of a ``conditional`` by branch index.

    A predicate conditional (``true_computation=``, ``false_computation=``, as the GPU compiler
    rewrites ``lax.cond``'s two-branch index conditional) has the false branch as branch 0 and
    the true one as branch 1, the order of ``lax.cond``'s index.

    Args:
      instr: a ``conditional`` instruction.

    Returns:
      Its branch computations' names, branch 0 first.

    >>> branch_computations(Instruction("c", "f32[]", "conditional", "%p, %a, %b), "
    ...                                 "true_computation=%act, false_computation=%skip", "body"))
    ['skip', 'act']
    """
    called = called_computations(instr)
    by_key = dict(called)
    if "true_computation" in by_key:
        return [by_key.get("false_computation", ""), by_key["true_computation"]]
    return [c for key, c in called if key == "branch_computations"]


def operands(rest: str) -> list[str]:
    """Operand names of an instruction's ``rest`` (what follows ``opcode(``; typed operands allowed).

    Args:
      rest: an :class:`Instruction`'s ``rest``.

    Returns:
      The operand names, without ``%``.

    >>> operands("f32[2]{0} %a, %b), to_apply=%add"), operands("3)")
    (['a', 'b'], ['3'])
    """
    text, depth, cuts = _COMMENT.sub("", rest) + ")", 0, [-1]
    end = len(text) - 1
    for end, ch in enumerate(text):
        if ch in ")}]" and depth == 0:
            break
        depth += (ch in "({[") - (ch in ")}]")
        cuts += [end] if ch == "," and depth == 0 else []
    parts = [text[a + 1:b] for a, b in zip(cuts, cuts[1:] + [end])]
    return [p.split()[-1].lstrip("%") for p in parts if p.strip()]


def channel(instr: Instruction) -> str | None:
    """The ``channel_id`` of a collective, or ``None``.

    Args:
      instr: an instruction.

    Returns:
      The id as text, or ``None`` when it has none.
    """
    match = re.search(r"\bchannel_id=(\d+)", instr.rest)
    return match.group(1) if match else None


def custom_call_targets(text: str) -> dict[str, str]:
    """``{custom-call instruction name: custom_call_target}`` (read from the raw text:
    :func:`parse_instructions` blanks string literals).

    Args:
      text: the HLO text.

    Returns:
      The target of each custom call.
    """
    out = {}
    for line in text.splitlines():
        if "custom_call_target=" in line and (m := _INSTR.match(line)) and (t := _TARGET.search(line)):
            out[m.group(1)] = t.group(1)
    return out


def tpu_async_roles(text: str, instrs: list[Instruction] | None = None) -> dict[str, str]:
    """The collectives of libtpu's async collective fusions, by the part of the chain each is in.

    libtpu runs an asynchronous collective as a chain of fusions that each carry a copy of the
    collective (same ``channel_id``): one whose computation ends in the ``AsyncCollectiveStart``
    custom call (``"start"``), continuations that run compute while it moves (``"continuation"``,
    possibly in a loop body the start is outside of) and one that ends in ``AsyncCollectiveDone``
    (``"done"``). The collective runs once, at the start. A copy has the start's channel, opcode and
    shape (libtpu gives unrelated collectives the same ``channel_id`` at times).

    Args:
      text: the HLO text.
      instrs: its :func:`parse_instructions` (parsed again when not given).

    Returns:
      ``{collective instruction name: "start" | "continuation" | "done"}`` for every collective
      that carries the channel of a start; other collectives are left out.
    """
    instrs = parse_instructions(text) if instrs is None else instrs
    targets = custom_call_targets(text)
    marks: dict[str, str] = {}
    for i in instrs:
        role = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}.get(targets.get(i.name, ""))
        if role and i.opcode == "custom-call":
            marks.setdefault(i.computation, role)
    colls = [i for i in instrs if i.opcode in KINDS]
    key = lambda i: (channel(i), i.opcode, tuple(array_shapes(i.shape)))  # noqa: E731  (libtpu reuses channel ids)
    started = {key(i) for i in colls if marks.get(i.computation) == "start" and channel(i) is not None}
    return {i.name: marks.get(i.computation, "continuation") for i in colls if key(i) in started}


def tpu_reduce_scatters(instrs: list[Instruction]) -> dict[str, Instruction]:
    """libtpu's reduce-scatters: ``{all-reduce name: the fusion that runs it}``.

    libtpu writes a reduce-scatter as a ``kCustom`` fusion of computation ``all-reduce-scatter.N``:
    an all-reduce whose result each partition slices to its own shard (``dynamic-slice`` at an
    offset of ``partition-id``); the fusion's result is the shard, as a ``reduce-scatter``'s is.

    Args:
      instrs: a module's :func:`parse_instructions`.

    Returns:
      For each such fusion with one all-reduce and its slices, the all-reduce's name and the fusion.
    """
    by_comp = by_computation(instrs)
    out = {}
    for f in instrs:
        comp = next((c for k, c in called_computations(f) if k == "calls"), "") if f.opcode == "fusion" else ""
        body = by_comp.get(comp, []) if comp.startswith("all-reduce-scatter") else []
        ops = {i.opcode for i in body}
        reduces = [i for i in body if i.opcode == "all-reduce"]
        if len(reduces) == 1 and {"dynamic-slice", "partition-id"} <= ops:
            out[reduces[0].name] = f
    return out
