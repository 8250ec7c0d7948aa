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
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar.errors import AnalysisError

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Human-readable binary size, the one formatter of jaxpar (analysis tables, the CLI).

    Below 1 KiB whole bytes, above one decimal of the largest unit that keeps the
    number under 1024 (``KiB`` ... ``PiB``). Accepts Python and NumPy numbers.

    Args:
      n: a number of bytes (may be negative or fractional).

    Returns:
      The text, e.g. ``"1.5 MiB"``.

    >>> [format_bytes(n) for n in (512, 4096, 1536 * 1024, 2.5 * 2**30)]
    ['512 B', '4.0 KiB', '1.5 MiB', '2.5 GiB']
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or math.isnan(n):
        raise AnalysisError(f"format_bytes(n={n!r}): n must be a number of bytes (an int or float), e.g. 4096.")
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """Aligned plain-text table (shared by the analysis modules)."""
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        return " | ".join(parts).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


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
