"""Read a ``jax.profiler`` trace back: each traced step's time on each device, by what ran.

``jax.profiler.trace(directory, create_perfetto_trace=True)`` writes
``<directory>/plugins/profile/<run>/`` with ``*.xplane.pb`` (TensorBoard's profile plugin) and
``perfetto_trace.json.gz`` (Chrome trace-event JSON, what https://ui.perfetto.dev opens), read here.
XLA:CPU records each HLO instruction it runs (a thunk) as an event with ``hlo_module``, ``hlo_op`` and
``device_ordinal``; the rendezvous of a collective (waiting for the other devices of its group) as
``Wait ...`` events on the same thread, inside it. XLA:GPU records each kernel with ``hlo_module`` and
``hlo_op`` in the process ``/device:GPU:<ordinal>``, and its copies as ``MemcpyH2D`` / ``MemcpyD2H`` there. jaxpar's loop marks each traced step
(:data:`STEP_EVENT`, with ``step_num``) and its batch (:data:`DATA_EVENT`); jax marks the batch's host to
device copies (:data:`TRANSFER_EVENTS`).

:func:`step_profiles` splits each step's window on each device into rows that tile it: the step's
collectives by kind and mesh axes (matched to the compiled HLO's by instruction name), compute (every
other instruction), host transfer and data wait (the host placing and building the batch while the device
runs nothing), dispatch (from then to the device's first instruction: the host launching the program) and
idle (the rest: gaps between instructions, and the wait after the device's last instruction for the step's
end). Where instructions overlap, a collective counts before compute. Docs: docs/profiling.md.

Example::

    >>> import tempfile, jax, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> f = jax.jit(lambda x: jnp.tanh(x @ x))
    >>> x = jnp.ones((64, 64)); _ = f(x).block_until_ready()
    >>> with jax.profiler.trace(d, create_perfetto_trace=True):
    ...     with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=0):
    ...         _ = f(x).block_until_ready()
    >>> [p] = step_profiles(read_trace(find_trace(d)), {})
    >>> p.step, p.rows["compute"] > 0, abs(sum(p.rows.values()) - p.wall) < 1e-9
    (0, True, True)
"""
from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxpar.analysis._hlo_text import KINDS
from jaxpar.errors import AnalysisError
from jaxpar.step._program import DATA_EVENT, STEP_EVENT

#: jax's host events of placing arrays on devices (host to device copies).
TRANSFER_EVENTS = ("shard_args", "DevicePutWithSharding")
#: The rows that are not collectives, in table order (collective rows are ``(kind, axes)`` keys).
COMPUTE, TRANSFER, DATA, DISPATCH, IDLE = "compute", "host transfer", "data wait", "dispatch", "idle"
#: Opcode prefixes of instructions (and GPU copy events) that move data between host and device.
_HOST_OPS = ("infeed", "outfeed", "send", "recv", "host-", "MemcpyH2D", "MemcpyD2H")
_DEVICE = re.compile(r"/device:[A-Z]+:(\d+)")


@dataclass(frozen=True)
class Op:
    """One instruction run on one device: ``start`` and ``end`` in seconds, ``thread`` the trace's."""

    device: int
    module: str
    name: str
    start: float
    end: float
    thread: int


@dataclass(frozen=True)
class Span:
    """One host event (an annotation or a runtime event): its ``args`` as the trace gives them."""

    name: str
    start: float
    end: float
    thread: int
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Trace:
    """A parsed trace: the instructions run on devices, the host events, and each thread's waits."""

    path: Path
    ops: list[Op]
    host: list[Span]
    waits: dict[int, list[tuple[float, float]]]


@dataclass(frozen=True)
class StepProfile:
    """One traced step, the mean over its devices.

    ``wall``: the step's window (the :data:`STEP_EVENT` annotation), seconds. ``rows``: seconds by row
    (:data:`COMPUTE`, ``(kind, axes)`` of each collective, :data:`TRANSFER`, :data:`DATA`, :data:`DISPATCH`,
    :data:`IDLE`),
    summing to ``wall``. ``waiting``: of a collective row's seconds, those spent waiting in the rendezvous
    for the group's other devices. ``counts``: per collective row, how many ran on each device (device
    ordinal -> count); ``bytes``: per row, the result bytes they moved on one device (mean over devices).
    ``per_device``: each device's rows. ``unmatched``: collective-looking instructions of modules not given.
    """

    step: int
    wall: float
    rows: dict
    waiting: dict
    counts: dict
    bytes: dict
    per_device: dict
    unmatched: tuple = ()


def find_trace(directory: str | Path) -> Path:
    """The newest ``perfetto_trace.json.gz`` that ``jax.profiler`` wrote under ``directory``.

    Args:
      directory: the directory given to ``jax.profiler.trace`` / ``start_trace``.

    Returns:
      The file's path.

    Raises:
      AnalysisError: there is none (traced without ``create_perfetto_trace=True``, or not traced).
    """
    found = sorted(Path(directory).glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise AnalysisError(f"no plugins/profile/*/perfetto_trace.json.gz under {directory}: trace with "
                            "jax.profiler.trace(directory, create_perfetto_trace=True).")
    return found[-1]


def read_trace(path: str | Path) -> Trace:
    """Parse a Perfetto / Chrome trace-event JSON file (``.json`` or ``.json.gz``) of ``jax.profiler``.

    Args:
      path: the file (e.g. :func:`find_trace`'s).

    Returns:
      The :class:`Trace`: times in seconds from the trace's origin.

    Raises:
      AnalysisError: the file is not trace-event JSON.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise AnalysisError(f"{path}: not a trace-event JSON file ({e}).") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise AnalysisError(f"{path}: no traceEvents list; expected jax.profiler's perfetto_trace.json.gz.")
    ops, host, waits = [], [], defaultdict(list)
    devices = {e.get("pid"): int(m.group(1)) for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and (m := _DEVICE.search(str((e.get("args") or {}).get("name", ""))))}
    for e in events:
        if e.get("ph") != "X":
            continue
        start, end = e["ts"] * 1e-6, (e["ts"] + e.get("dur", 0.0)) * 1e-6
        tid, args = e.get("tid", 0), e.get("args") or {}
        device = int(args["device_ordinal"]) if "device_ordinal" in args else devices.get(e.get("pid"))
        if device is not None and ("hlo_op" in args or e["name"].startswith(_HOST_OPS)):
            ops.append(Op(device, args.get("hlo_module", ""), args.get("hlo_op", e["name"]), start, end, tid))
        elif e["name"].startswith("Wait"):
            waits[tid].append((start, end))
        else:
            host.append(Span(e["name"], start, end, tid, args))
    return Trace(path, ops, host, {t: _union(v) for t, v in waits.items()})


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering ``intervals``."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of sorted disjoint ``intervals`` inside ``[lo, hi]``."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals if e > lo and s < hi)


def _row_of(op: Op, collectives: Mapping[str, Mapping[str, Any]]) -> Any:
    """The row of an instruction: its collective's ``(kind, axes)``, :data:`TRANSFER` or :data:`COMPUTE`."""
    c = collectives.get(op.module, {}).get(op.name)
    if c is not None:
        return (c.kind, c.axes)
    return TRANSFER if op.name.startswith(_HOST_OPS) else COMPUTE


def _looks_collective(name: str) -> bool:
    return name.startswith(KINDS + ("ppermute",))


def _sweep(device_ops: Sequence[tuple[float, float, Any]], host: Sequence[tuple[float, float, str]],
           lo: float, hi: float) -> dict:
    """Seconds of ``[lo, hi]`` by row: a collective before compute before a host transfer before data wait
    before dispatch; idle where nothing runs."""
    rank = {TRANSFER: 1, COMPUTE: 2}
    edges = []
    for s, e, row in [*device_ops, *((s, e, ("host", r)) for s, e, r in host)]:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            edges += [(s, 1, row), (e, -1, row)]
    edges.sort(key=lambda x: (x[0], x[1]))
    active: Counter = Counter()
    out: dict = defaultdict(float)
    t = lo
    for when, delta, row in edges:
        if when > t:
            out[_top(active, rank)] += when - t
            t = when
        active[row] += delta
        if not active[row]:
            del active[row]
    out[_top(active, rank)] += hi - t
    return dict(out)


def _top(active: Counter, rank: Mapping[str, int]) -> Any:
    """The row an instant counts for, given the rows running then."""
    if not active:
        return IDLE
    device = [r for r in active if not (isinstance(r, tuple) and r[0] == "host")]
    collective = [r for r in device if isinstance(r, tuple)]
    if collective:
        return min(collective, key=lambda r: (KINDS.index(r[0]) if r[0] in KINDS else len(KINDS), str(r[1])))
    if device:
        return min(device, key=lambda r: rank.get(r, 0))
    return next(r for r in (TRANSFER, DATA, DISPATCH) if ("host", r) in active)


def _host_rows(trace: Trace, lo: float, hi: float) -> list[tuple[float, float, str]]:
    """The host's batch work inside ``[lo, hi]``: its copies to the devices and the rest of building it."""
    spans = [s for s in trace.host if s.end > lo and s.start < hi]
    copies = _union([(s.start, s.end) for s in spans if s.name in TRANSFER_EVENTS])
    data = [(s.start, s.end, DATA) for s in spans if s.name == DATA_EVENT]
    return data + [(s, e, TRANSFER) for s, e in copies]


def step_profiles(trace: Trace, collectives: Mapping[str, Mapping[str, Any]], *,
                  devices: Sequence[int] | None = None) -> list[StepProfile]:
    """Each traced step's window split into rows on each device (see the module doc).

    Args:
      trace: :func:`read_trace`'s.
      collectives: ``{hlo module name: {instruction name: collective}}``, the collectives of each program that
        runs (each with ``kind``, ``axes``, ``bytes``: :func:`jaxpar.analysis.collectives`), e.g.
        ``{"jit_traced": {c.name: c for c in collectives(compiled, mesh)}}``.
      devices: the device ordinals to profile (None: every device with an instruction in the window).

    Returns:
      One :class:`StepProfile` per :data:`STEP_EVENT` annotation, in step order.

    Raises:
      AnalysisError: the trace has no step annotation.
    """
    steps = sorted((s for s in trace.host if s.name == STEP_EVENT), key=lambda s: s.start)
    if not steps:
        raise AnalysisError(f"{trace.path}: no {STEP_EVENT!r} annotation; trace the steps inside "
                            f"jax.profiler.StepTraceAnnotation({STEP_EVENT!r}, step_num=step).")
    return [_profile(trace, collectives, s, devices) for s in steps]


def _profile(trace: Trace, collectives: Mapping, span: Span, devices: Sequence[int] | None) -> StepProfile:
    lo, hi = span.start, span.end
    inside = [op for op in trace.ops if op.end > lo and op.start < hi]
    by_device: dict[int, list[Op]] = defaultdict(list)
    for op in inside:
        by_device[op.device].append(op)
    ids = sorted(by_device) if devices is None else list(devices)
    host = _host_rows(trace, lo, hi)
    per_device, waiting, counts, moved = {}, defaultdict(float), defaultdict(dict), defaultdict(float)
    for d in ids:
        rows = [(op, _row_of(op, collectives)) for op in by_device.get(d, [])]
        first = min((op.start for op, _ in rows), default=hi)          # until then: the program's dispatch
        per_device[d] = _sweep([(op.start, op.end, row) for op, row in rows], [*host, (lo, first, DISPATCH)], lo, hi)
        for op, row in rows:
            if isinstance(row, tuple):
                counts[row][d] = counts[row].get(d, 0) + 1
                moved[row] += collectives[op.module][op.name].bytes
                waiting[row] += _overlap(trace.waits.get(op.thread, ()), max(op.start, lo), min(op.end, hi))
    n = max(len(ids), 1)
    keys = {k for rows in per_device.values() for k in rows} | set(counts)
    mean = {k: sum(rows.get(k, 0.0) for rows in per_device.values()) / n for k in _ordered(keys)}
    unmatched = tuple(sorted({op.name for op in inside if op.module not in collectives and _looks_collective(op.name)}))
    return StepProfile(int(span.args.get("step_num", -1)), hi - lo, mean, {k: v / n for k, v in waiting.items()},
                       dict(counts), {k: v / n for k, v in moved.items()}, per_device, unmatched)


def _ordered(keys) -> list:
    """Table order: compute, the collectives (kind order, then axes), host transfer, data wait, idle."""
    def key(k):
        if isinstance(k, tuple):
            return (1, KINDS.index(k[0]) if k[0] in KINDS else len(KINDS), str(k[1]))
        return ({COMPUTE: 0, TRANSFER: 2, DATA: 3, DISPATCH: 4, IDLE: 5}.get(k, 6), 0, k)
    return sorted(keys, key=key)
