"""Figures shared by every report (the planner's, the analysis', the runner's and the CLI's): byte sizes
and aligned tables in plain text (pure Python), and PNG plots with matplotlib's object API on a figure's
own Agg canvas (imported lazily: no pyplot state, no process-wide backend).

Example::

    >>> format_bytes(1536 * 1024)
    '1.5 MiB'
    >>> print(render_table(["a", "bytes"], [["x", "4.0 KiB"]], right=[False, True]))
    a |   bytes
    --+--------
    x | 4.0 KiB
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
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


def shown_path(path: str | Path) -> str:
    """A path as the reports print it: relative to the working directory when under it, else absolute;
    normalised either way (no ``..`` or ``.`` parts).

    Args:
      path: a path, absolute or relative to the working directory.

    Returns:
      The text.

    >>> import os
    >>> shown_path(os.path.join(os.getcwd(), "runs", "..", "runs", "x")), shown_path("/srv/../tmp/run")
    ('runs/x', '/tmp/run')
    """
    full = os.path.normpath(os.path.abspath(path))
    cwd = os.getcwd()
    return os.path.relpath(full, cwd) if full == cwd or full.startswith(cwd.rstrip(os.sep) + os.sep) else full


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """Aligned plain-text table (shared by the analysis modules)."""
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        return " | ".join(parts).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def agg_axes(figsize: tuple[float, float] = (7, 4), dpi: int = 110) -> tuple[Any, Any]:
    """A new figure on its own Agg canvas and its one axes.

    Args:
      figsize: the figure's size in inches.
      dpi: its dots per inch.

    Returns:
      ``(figure, axes)``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def save_plot(fig: Any, ax: Any, path: str | Path) -> str:
    """Finish a line plot on :func:`agg_axes` (light grid, legend, tight layout) and write it as a PNG.

    Args:
      fig: the figure.
      ax: its axes.
      path: the PNG file to write.

    Returns:
      ``path`` as a string.
    """
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
    return str(path)
