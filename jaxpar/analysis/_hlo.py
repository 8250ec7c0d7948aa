"""Inventory of the collectives in a compiled (SPMD-partitioned) JAX program.

Example::

    compiled = jax.jit(step).lower(params, batch).compile()
    colls = collectives(compiled, mesh)
    print(collectives_table(colls))
    count(colls, "all-reduce", axes=("data",))    # how many all-reduces span the data axis

This module reads the HLO text (instructions, shapes, which computations run
inside while loops); :mod:`jaxpar.analysis._replica_groups` expands each
collective's replica groups or ``source_target_pairs`` and names the mesh axes
they span. Ids in an SPMD program are partition ids; partition ``i`` runs on
the ``i``-th device of the executable's device assignment, which for a
program jitted over a ``NamedSharding`` is ``mesh.devices.flat[i]``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar.analysis._hlo_text import (KINDS, Instruction, array_shapes, call_graph, called_computations, module_text,
                                       parse_instructions, reached_computations, shape_bytes, tpu_async_roles,
                                       tpu_reduce_scatters)
from jaxpar._text import format_bytes, render_table
from jaxpar.analysis._replica_groups import (axes_of_groups, axes_of_pairs, iota_replica_groups, parse_replica_groups,
                                             source_target_pairs)
from jaxpar.analysis._windowed import Windowed, windowed_einsums
from jaxpar.errors import AnalysisError


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    ``bytes`` is the size of the result on one device; ``axes`` the mesh axes it
    runs over (mesh order; ``()`` for device-local groups, ``None`` if no subset
    of the mesh axes produces its groups); ``in_loop`` whether it sits in a
    while-loop body or condition, directly or via called computations;
    ``asynchronous`` whether the compiler scheduled it as an async start / done pair
    (GPU: ``*-start`` or inside an ``async-start`` wrapper; TPU: the start of one of libtpu's
    async collective fusion chains, :func:`~jaxpar.analysis._hlo_text.tpu_async_roles`), so
    compute can overlap it.
    """

    kind: str
    bytes: int
    axes: tuple[str, ...] | None
    computation: str
    in_loop: bool
    name: str
    asynchronous: bool = False


# ----------------------------------------------------------------------------- HLO text


def _loop_computations(instrs: list[Instruction]) -> set[str]:
    """Computations executed per iteration of some while loop."""
    loops = [callee for i in instrs if i.opcode == "while"
             for key, callee in called_computations(i) if key in ("body", "condition")]
    return reached_computations(call_graph(instrs), loops)


def _async_computations(instrs: list[Instruction]) -> set[str]:
    """Computations that an ``async-start`` wrapper runs."""
    return {callee for i in instrs if i.opcode == "async-start" for _, callee in called_computations(i)}


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _first_operand(instr: Instruction) -> str | None:
    match = re.search(r"%([\w.\-]+)", instr.rest) or re.match(r"\s*([\w.\-]+)", instr.rest)
    return match.group(1) if match else None


def _result_bytes(instr: Instruction, kind: str, done_shapes: dict[str, str]) -> int:
    if not instr.opcode.endswith("-start"):
        return shape_bytes(instr.shape)
    if instr.name in done_shapes:
        return shape_bytes(done_shapes[instr.name])
    arrays = array_shapes(instr.shape)  # (operand, result, ...) tuples of async starts
    if kind in ("all-gather", "collective-permute") and instr.shape.startswith("(") and len(arrays) >= 2:
        return shape_bytes(arrays[-1] if kind == "all-gather" else arrays[1])
    return shape_bytes(instr.shape)


# ----------------------------------------------------------------------------- public API


def partition_positions(compiled: Any, mesh: Any) -> list[int] | None:
    """Mesh position (index into ``mesh.devices.flat``) of each partition id of ``compiled``.

    Args:
      compiled: a ``jax.stages.Compiled`` (HLO text has no device assignment).
      mesh: the mesh the program was compiled for.

    Returns:
      ``positions[partition id]``, or ``None`` when ``compiled`` has no device assignment or
      its devices are not the mesh's.
    """
    try:
        devices = compiled.runtime_executable().local_devices()
    except Exception:  # HLO text, or a backend without a device assignment
        return None
    flat = [d.id for d in mesh.devices.flat]
    ids = [d.id for d in devices]
    if sorted(ids) != sorted(flat):
        return None
    where = {d: i for i, d in enumerate(flat)}
    return [where[d] for d in ids]


def _check_partitions(text: str, mesh: Any) -> None:
    match = re.search(r"\bnum_partitions=(\d+)", text.split("\n", 1)[0])
    if match and int(match.group(1)) > 1 and int(match.group(1)) != mesh.devices.size:
        raise AnalysisError(f"mesh has {mesh.devices.size} devices but the program has "
                            f"num_partitions={match.group(1)}")


def _axes(instr: Instruction, kind: str, mesh: Any, positions: list[int] | None) -> tuple[str, ...] | None:
    shape, names, size = mesh.devices.shape, tuple(mesh.axis_names), mesh.devices.size
    to_pos = (lambda i: positions[i] if i < len(positions) else size) if positions else (lambda i: i)
    if kind == "collective-permute":
        return axes_of_pairs([(to_pos(s), to_pos(t)) for s, t in source_target_pairs(instr.rest)], shape, names)
    groups = parse_replica_groups(instr.rest)
    if groups is None:
        return None
    groups = groups or [list(range(size))]
    return axes_of_groups([[to_pos(i) for i in g] for g in groups], shape, names)


def collectives(compiled: Any, mesh: Any) -> list[Collective]:
    """All collectives of ``compiled`` (a ``jax.stages.Compiled`` or HLO text),
    in program-text order, attributed to axes of ``mesh``.

    Async ``*-start``/``*-done`` pairs count once (at the start), with the
    bytes of the done's result; so does each chain of libtpu's async collective
    fusions, whose start, continuations and done each carry a copy of the collective
    (:func:`~jaxpar.analysis._hlo_text.tpu_async_roles`): it counts at the start.
    libtpu's ``all-reduce-scatter`` fusions (an all-reduce sliced to each partition's
    shard, :func:`~jaxpar.analysis._hlo_text.tpu_reduce_scatters`) count as reduce-scatters,
    with the bytes of the shard. A windowed einsum loop (a dot computed round a ring of
    collective-permutes, :mod:`jaxpar.analysis._windowed`) counts as the one all-gather or
    reduce-scatter it runs, with that collective's result bytes, in the loop's computation.

    Args:
      compiled: a ``jax.stages.Compiled`` or its HLO text.
      mesh: the ``jax.sharding.Mesh`` it was compiled for.

    Returns:
      One :class:`Collective` per collective.
    """
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "devices"):
        raise AnalysisError(f"mesh must be the jax.sharding.Mesh the program was compiled for, got "
                            f"{type(mesh).__name__}")
    text = module_text(compiled)
    _check_partitions(text, mesh)
    positions = None if isinstance(compiled, str) else partition_positions(compiled, mesh)
    instrs = parse_instructions(text)
    in_loop, wrapped, tpu = _loop_computations(instrs), _async_computations(instrs), tpu_async_roles(text, instrs)
    done_shapes = {_first_operand(i): i.shape for i in instrs if i.opcode.endswith("-done") and _kind(i.opcode[:-5])}
    scatters, windowed = tpu_reduce_scatters(instrs), windowed_einsums(instrs)
    by_name = {i.name: i for i in instrs} if windowed else {}
    in_window = {p for w in windowed.values() for p in w.permutes}
    found = []
    for instr in instrs:
        if instr.name in windowed:
            loop = windowed[instr.name]
            found.append(_windowed(instr, loop, by_name[loop.buffer], done_shapes, mesh, positions, in_loop))
            continue
        kind = _kind(instr.opcode)
        if kind is None or tpu.get(instr.name, "start") != "start" or instr.name in in_window:
            continue
        fused = scatters.get(instr.name)
        async_ = instr.opcode.endswith("-start") or instr.computation in wrapped or instr.name in tpu
        found.append(Collective(kind="reduce-scatter" if fused else kind,
                                bytes=shape_bytes(fused.shape) if fused else _result_bytes(instr, kind, done_shapes),
                                axes=_axes(instr, kind, mesh, positions), computation=instr.computation,
                                in_loop=instr.computation in in_loop, name=instr.name, asynchronous=async_))
    return found


def _windowed(loop: Instruction, w: Windowed, buffer: Instruction, done_shapes: dict[str, str], mesh: Any,
              positions: list[int] | None, in_loop: set[str]) -> Collective:
    """A windowed einsum loop as the collective it runs: its result is the permuted partial sum
    (reduce-scatter) or the permuted shard times the ring's size (all-gather)."""
    pairs = source_target_pairs(buffer.rest)
    ring = _cycle_length(pairs) if w.kind == "all-gather" else 1
    return Collective(kind=w.kind, bytes=_result_bytes(buffer, "collective-permute", done_shapes) * ring,
                      axes=_axes(buffer, "collective-permute", mesh, positions), computation=loop.computation,
                      in_loop=loop.computation in in_loop, name=loop.name, asynchronous=True)


def _cycle_length(pairs: list[tuple[int, int]]) -> int:
    """The length of the ring a permute's ``source_target_pairs`` shift along (the first source's cycle)."""
    step = dict(pairs)
    start = node = pairs[0][0]
    n = 0
    while True:
        node, n = step.get(node, start), n + 1
        if node == start or n > len(pairs):
            return n


def _axes_key(axes: tuple[str, ...] | None) -> tuple:
    return (axes is None, axes or ())


def summarize(colls: Iterable[Collective]) -> list[dict]:
    """Group by (kind, axes, in_loop): dicts with those keys plus count, bytes and ``asynchronous``
    (how many of the count are async).

    Args:
      colls: collectives, e.g. of :func:`collectives`.

    Returns:
      The group dicts, by kind (:data:`KINDS` order), axes and ``in_loop``.
    """
    groups: dict[tuple, dict] = {}
    for c in colls:
        key = (c.kind, c.axes, c.in_loop)
        row = groups.setdefault(key, dict(kind=c.kind, axes=c.axes, in_loop=c.in_loop, count=0, bytes=0,
                                          asynchronous=0))
        row["count"] += 1
        row["bytes"] += c.bytes
        row["asynchronous"] += c.asynchronous
    return sorted(groups.values(), key=lambda r: (KINDS.index(r["kind"]), _axes_key(r["axes"]), r["in_loop"]))


def _axes_label(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "?"
    return ",".join(axes) if axes else "-"


def _table_row(row: dict) -> list[str]:
    in_loop = "yes" if row["in_loop"] else "no"
    n, a = row["count"], row["asynchronous"]
    asynchronous = "yes" if a == n else "no" if not a else f"{a} of {n}"
    return [row["kind"], _axes_label(row["axes"]), in_loop, asynchronous, str(n), format_bytes(row["bytes"])]


def collectives_table(colls: Iterable[Collective]) -> str:
    """Printable table of :func:`summarize` (axes ``?``: no subset of mesh axes; ``-``: none).

    Args:
      colls: collectives, e.g. of :func:`collectives`.

    Returns:
      The table's text.
    """
    rows = [_table_row(r) for r in summarize(colls)]
    return render_table(["kind", "axes", "in loop", "async", "count", "bytes"], rows,
                        right=[False, False, False, False, True, True])


def count(colls: Iterable[Collective], kind: str, axes: str | Sequence[str] | None = None,
          in_loop: bool | None = None) -> int:
    """Number of ``kind`` collectives, optionally only over exactly ``axes``
    (any order) and/or only inside (``in_loop=True``) or outside loops.

    Args:
      colls: collectives, e.g. of :func:`collectives`.
      kind: one of :data:`KINDS`.
      axes: a mesh axis name or names, or ``None``: any axes.
      in_loop: ``True`` / ``False``: only those inside / outside loops; ``None``: both.

    Returns:
      The count.
    """
    if kind not in KINDS:
        raise AnalysisError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    wanted = None if axes is None else frozenset([axes] if isinstance(axes, str) else axes)
    return sum(1 for c in colls if c.kind == kind
               and (wanted is None or (c.axes is not None and frozenset(c.axes) == wanted))
               and (in_loop is None or c.in_loop == in_loop))
