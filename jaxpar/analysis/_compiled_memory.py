"""Per-device memory figures of a compiled JAX program.

Example::

    compiled = jax.jit(step).lower(params, batch).compile()
    report = memory_report(compiled)
    print(format_bytes(report.peak_bytes))
    print(memory_table({"step": report}, analytic={"step": 4 * n_params / 8}))

All numbers are what XLA reports for *one* device (one SPMD partition).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar._text import format_bytes, render_table
from jaxpar.errors import AnalysisError


@dataclass(frozen=True)
class MemoryReport:
    """Memory XLA assigned to one device for one compiled program (bytes).

    ``peak_bytes`` is the simple upper bound ``argument + output + temp - alias``:
    every live buffer at once, counting donated (aliased) outputs only once.
    XLA's own heap simulation can be lower because temporaries need not all be
    live together; this bound is what a budget should be checked against.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    xla_peak_bytes: int | None = None      # XLA's own peak (heap simulation), where the backend reports it

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
    return MemoryReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        xla_peak_bytes=int(stats.peak_memory_in_bytes) if getattr(stats, "peak_memory_in_bytes", 0) else None,
    )


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
