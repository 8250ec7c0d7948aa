"""Gantt-chart rendering of pipeline schedules with matplotlib's object API and an explicit Agg canvas
(imported lazily), so it never touches pyplot or the process-wide backend of other users.
"""
from __future__ import annotations

import os
from typing import Sequence

from jaxpar._text import agg_axes
from jaxpar.parallel.pipeline._schedules import Schedule, bubble_fraction, num_ticks, peak_in_flight, timeline, validate
from jaxpar.errors import ScheduleError, check_int

# F blue, B green, W purple; chunk c > 0 is drawn progressively lighter.
ACTION_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2"}


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)


def render_png(schedule: Schedule, path, *, timed: bool = False, dpi: int = 120, step_size: int | None = None,
               updates: Sequence[tuple[int, int]] = ()) -> str:
    """Write a Gantt chart of ``schedule`` to ``path`` (PNG).

    Rows are stages (stage 0 on top), boxes are actions labelled with the
    micro-batch (``3`` or ``3.1`` with the chunk for interleaved).

    Args:
        schedule: the schedule table.
        path: the PNG file to write.
        timed: False draws the unit-tick table; True the cost-model timeline (fused B twice as wide),
            whose idle share is the title's bubble fraction.
        dpi: the image's resolution (an int >= 10).
        step_size: ``m`` draws every other optimizer step's micro-batches (``i // m`` odd) lighter.
        updates: ``(stage, tick)`` pairs drawn as a red bar at the end of that tick on that stage (weight
            stashing's per-stage updates, :func:`jaxpar.parallel.pipeline._pipedream.update_ticks`;
            unit-tick charts).

    Returns:
        ``path`` as a string.

    Example:
        >>> import os, shutil, tempfile
        >>> from jaxpar.parallel.pipeline._schedules import one_f_one_b
        >>> d = tempfile.mkdtemp()
        >>> path = render_png(one_f_one_b(2, 4), os.path.join(d, "1f1b.png"), timed=True)
        >>> os.path.basename(path), os.path.getsize(path) > 0
        ('1f1b.png', True)
        >>> shutil.rmtree(d)
    """
    validate(schedule)
    check_int("render_png", "dpi", dpi, 10, ScheduleError)
    bars = _bars(schedule, timed)
    span = max([1] + [x + w for stage in bars for x, w, _ in stage])

    fig, ax = agg_axes((min(40.0, max(6.0, 0.32 * span + 1.5)), 0.6 * schedule.num_stages + 1.6), dpi)
    _draw_actions(ax, bars, schedule.num_chunks, step_size)
    for st, t in updates:      # a red bar at the end of each update's tick
        ax.plot([t + 1, t + 1], [st - 0.45, st + 0.45], color="#C44E52", linewidth=2.0)
    _label(ax, schedule, span, timed)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path


def _bars(schedule: Schedule, timed: bool) -> list[list[tuple]]:
    """Per stage, the ``(start, width, action)`` of each box: cost-model times or unit ticks."""
    if timed:
        return [[(start, end - start, a) for start, end, a in stage] for stage in timeline(schedule)]
    return [[(t, 1, row[st]) for t, row in enumerate(schedule.table) if row[st] is not None]
            for st in range(schedule.num_stages)]


def _draw_actions(ax, bars: list[list[tuple]], v: int, step_size: int | None) -> None:
    """The action boxes, coloured by kind and lightened by chunk (or by optimizer step), labelled."""
    from matplotlib.patches import Rectangle

    font = 7 if v > 1 else 8
    for st, stage in enumerate(bars):
        for x, w, a in stage:
            light = 0.5 * a.chunk / max(1, v - 1) if step_size is None else 0.45 * ((a.microbatch // step_size) % 2)
            ax.add_patch(Rectangle((x, st - 0.4), w, 0.8, facecolor=_lighten(ACTION_COLORS[a.kind], light),
                                   edgecolor="white", linewidth=0.8))
            text = f"{a.microbatch}.{a.chunk}" if v > 1 else str(a.microbatch)
            ax.text(x + w / 2, st, text, ha="center", va="center", fontsize=font,
                    color="black" if light > 0.25 else "white")


def _label(ax, schedule: Schedule, span: float, timed: bool) -> None:
    """Axes limits and labels, the legend of action kinds and the title with the schedule's metrics."""
    from matplotlib.patches import Patch

    p, v = schedule.num_stages, schedule.num_chunks
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {st}" for st in range(p)])
    ax.set_xlabel("time (F=1, B=1 split / 2 fused, W=1)" if timed else "tick")
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    ax.legend(handles=[Patch(color=ACTION_COLORS[k], label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"{schedule.name}: p={p} m={schedule.num_microbatches} v={v}, "
                 f"{num_ticks(schedule)} ticks, bubble={bubble_fraction(schedule):.1%}, "
                 f"peak in-flight={max(peak_in_flight(schedule))}", fontsize=10)

