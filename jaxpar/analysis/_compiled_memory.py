"""Per-device memory figures of a compiled JAX program.

Example::

    compiled = jax.jit(step).lower(params, batch).compile()
    report = memory_report(compiled)
    print(format_bytes(report.peak_bytes))
    print(memory_table({"step": report}, analytic={"step": 4 * n_params / 8}))
    moved = host_transfers(compiled.as_text())      # memory offloading: bytes between device and host

All numbers are what XLA reports for *one* device (one SPMD partition), in device memory; the bytes a
program keeps in host memory (``Strategy.offload``) are reported apart.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar._text import format_bytes, render_table
from jaxpar.analysis._hlo_text import instruction_lines, parse_instructions, shape_bytes
from jaxpar.analysis._loops import trip_counts
from jaxpar.errors import AnalysisError


@dataclass(frozen=True)
class MemoryReport:
    """Memory XLA assigned to one device for one compiled program (bytes).

    ``peak_bytes`` is the simple upper bound ``argument + output + temp - alias``:
    every live buffer at once, counting donated (aliased) outputs only once.
    XLA's own heap simulation can be lower because temporaries need not all be
    live together; this bound is what a budget should be checked against.
    ``xla_peak_bytes`` is XLA's ``peak_memory_in_bytes`` less the host-resident arguments and temporaries,
    which XLA counts in it (an offloaded program, ``Strategy.offload``): a device figure like the rest. (Without
    that, XLA's figure exceeds ``peak_bytes``, which bounds every device buffer live at once: a Llama-3-shaped
    Decoder with the host update compiled for one H100 reads 29.7 GB there against 7.6 GB.)
    ``host_argument_bytes`` and ``host_temp_bytes`` are what the program holds in host memory.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    xla_peak_bytes: int | None = None      # XLA's own peak (heap simulation) in device memory, where reported
    host_argument_bytes: int = 0
    host_temp_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """``argument + output + temp - alias`` (see class docstring)."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def required_bytes(self) -> int:
        """What the program needs on a device: the larger of :attr:`peak_bytes` and XLA's own peak
        (TPU's compiler reports its temporaries in its peak only: ``temp_bytes`` is 0 there)."""
        return max(self.peak_bytes, self.xla_peak_bytes or 0)


def memory_report(compiled: Any) -> MemoryReport:
    """Read ``compiled.memory_analysis()`` into a :class:`MemoryReport`.

    Args:
      compiled: a ``jax.stages.Compiled``.

    Returns:
      Its per-device :class:`MemoryReport`.
    """
    analyse = getattr(compiled, "memory_analysis", None)
    if analyse is None:
        raise AnalysisError(f"compiled must be a jax.stages.Compiled (jax.jit(f).lower(*args).compile()), got "
                            f"{type(compiled).__name__}")
    stats = analyse()
    if stats is None:
        raise AnalysisError("compiled.memory_analysis() returned None: this backend reports no memory figures")
    host_args = int(getattr(stats, "host_argument_size_in_bytes", 0) or 0)
    host_temps = int(getattr(stats, "host_temp_size_in_bytes", 0) or 0)
    xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    return MemoryReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        xla_peak_bytes=xla_peak - host_args - host_temps if xla_peak else None,
        host_argument_bytes=host_args,
        host_temp_bytes=host_temps,
    )


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``"(f32[2]{0}, (s32[], u32[]))"``), or ``[shape]``."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape[1:-1], 1):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(shape[start:i].strip())
            start = i + 1
    return [e for e in out + [shape[start:-1].strip()] if e]


def _device_bytes(shape: str, arrays_only: bool = False) -> int:
    """Bytes of the arrays of ``shape`` (a tuple or one array) that lie in device memory (no ``S(5)``);
    ``arrays_only``: not the scalars (a slice's indices)."""
    return sum(shape_bytes(a) for a in re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", shape)
               if "S(5)" not in a and not (arrays_only and "[]" in a))


def _host_calls(text: str) -> list[tuple[str, str, str, str]]:
    """``(computation, shape, opcode, name)`` of each ``(custom-)call-start`` on the ``host`` thread (XLA's
    ``HostExecute``) and its ``call-done``, read from the lines
    (:func:`jaxpar.analysis._hlo_text.parse_instructions` reads no nested tuple shape)."""
    out, starts = [], set()
    for computation, line in instruction_lines(text):
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*) (?:custom-)?(call-start|call-done)\(%([\w.\-]+)", line)
        if m and (m.group(3) == "call-done" and m.group(4) in starts or 'async_execution_thread="host"' in line):
            starts.add(m.group(1))
            out.append((computation, m.group(2), m.group(3), m.group(1)))
    return out


def host_transfers(text: str) -> dict[str, int]:
    """The bytes a compiled program copies between device and host memory per execution, each times how
    often its computation runs (:func:`jaxpar.analysis._loops.trip_counts`): its ``copy-start``s from or to
    host memory (the layout's ``S(5)``), its asynchronous slices of host buffers (``fusion-start``: the GPU
    compiler's offloaded activations, a device slice written into a host buffer or read out of one), and the
    device-resident operands and results of its host computations (``custom-call-start`` on the ``host``
    thread: a result written to device memory is a transfer too).

    Args:
      text: the compiled program's HLO text.

    Returns:
      ``{"to_host": bytes, "to_device": bytes}``.

    >>> host_transfers('''HloModule m
    ... ENTRY %main (a: f32[4]) -> f32[4] {
    ...   %s = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%a)
    ...   %d = f32[4]{0:S(5)} copy-done(%s)
    ...   %c = ((f32[4]{0:S(5)}), f32[2]{0}, s32[]) custom-call-start(%d), async_execution_thread="host"
    ...   %r = f32[2]{0} custom-call-done(%c)
    ...   %u = ((f32[4]{0:S(5)}, f32[2]{0}, s32[]), f32[4]{0:S(5)}, u32[]) fusion-start(%d, %r, %i), kind=kCustom
    ...   ROOT %v = f32[4]{0:S(5)} fusion-done(%u)
    ... }''')
    {'to_host': 24, 'to_device': 8}
    """
    counts, out = trip_counts(text), {"to_host": 0, "to_device": 0}
    for ins in parse_instructions(text):
        if ins.opcode == "copy-start":
            dest, src = (_elements(ins.shape) + [""])[:2]
            if "S(5)" in dest and "S(5)" not in src:
                out["to_host"] += int(shape_bytes(dest) * counts.get(ins.computation, 1))
            elif "S(5)" in src and "S(5)" not in dest:
                out["to_device"] += int(shape_bytes(src) * counts.get(ins.computation, 1))
    for computation, shape, opcode, _ in _host_calls(text):
        start = opcode == "call-start"
        moved = _device_bytes(_elements(shape)[0] if start else shape)       # the operands / the results
        out["to_host" if start else "to_device"] += int(moved * counts.get(computation, 1))
    for computation, shape in _host_slices(text):
        operands, result = _elements(shape)[:2]
        key, moved = ("to_host", _device_bytes(operands, arrays_only=True)) if "S(5)" in result else \
            ("to_device", _device_bytes(result))
        out[key] += int(moved * counts.get(computation, 1))
    return out


def _host_slices(text: str) -> list[tuple[str, str]]:
    """``(computation, shape)`` of each asynchronous fusion (``fusion-start``) that reads or writes a host
    buffer (``S(5)``): the shape is ``((operands), result, context)``."""
    out = []
    for computation, line in instruction_lines(text):
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (.*) fusion-start\(", line)
        if m and "S(5)" in m.group(1):
            out.append((computation, m.group(1)))
    return out


def _analytic_cells(name: str, report: MemoryReport, analytic: Mapping[str, float]) -> list[str]:
    expected = analytic.get(name)
    if expected is None:
        return ["-", "-"]
    if expected <= 0:
        return [format_bytes(expected), "-"]
    return [format_bytes(expected), f"{report.argument_bytes / expected:.2f}"]


def memory_table(rows: Mapping[str, MemoryReport], analytic: Mapping[str, float] | None = None) -> str:
    """Aligned table of reports; with ``analytic`` (expected argument bytes per
    device, by row name) adds the expectation and the measured/analytic ratio.

    Args:
      rows: report by row name.
      analytic: expected argument bytes per device by row name, or ``None`` (no such columns).

    Returns:
      The table's text.
    """
    for name, report in rows.items():
        if not isinstance(report, MemoryReport):
            raise AnalysisError(f"rows[{name!r}] must be a MemoryReport, got {type(report).__name__}")
    for name, value in (analytic or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise AnalysisError(f"analytic[{name!r}] must be a non-negative number of bytes, got {value!r}")
    headers = ["name", "arguments", "outputs", "temps", "peak"]
    if analytic is not None:
        headers += ["analytic args", "measured/analytic"]
    body = []
    for name, r in rows.items():
        row = [name] + [format_bytes(v) for v in (r.argument_bytes, r.output_bytes, r.temp_bytes, r.peak_bytes)]
        if analytic is not None:
            row += _analytic_cells(name, r, analytic)
        body.append(row)
    return render_table(headers, body, right=[False] + [True] * (len(headers) - 1))
