"""``jaxpar schedule``: a pipeline schedule's tick x stage table, its bubble and peak in-flight
micro-batches, and optionally its Gantt chart as a PNG.

Usage::

    jaxpar schedule --kind 1f1b --stages 4 --microbatches 8 [--virtual V] [--png PATH] [--timed]
"""

from __future__ import annotations

import argparse


def add_schedule_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` command to the ``jaxpar`` parser.

    Args:
      sub: the ``jaxpar`` parser's sub-parsers.
    """
    p = sub.add_parser("schedule", help="print a pipeline schedule table",
                       description="Build a pipeline schedule and print its tick x stage table.")
    p.add_argument("--kind", required=True, help="gpipe, 1f1b, interleaved or zb-h1")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per stage (interleaved only)")
    p.add_argument("--png", help="also write a Gantt chart PNG here")
    p.add_argument("--timed", action="store_true", help="PNG: draw the cost-model timeline, not unit ticks")


def run_schedule(args: argparse.Namespace) -> int:
    """Print the schedule table, its bubble fraction and peak in-flight micro-batches; write the PNG.

    Args:
      args: the parsed ``schedule`` options (``kind``, ``stages``, ``microbatches``, ``virtual``,
        ``png``, ``timed``).

    Returns:
      The exit status, 0.

    Example:
      >>> run_schedule(argparse.Namespace(kind="1f1b", stages=2, microbatches=2, virtual=1, png=None,
      ...                                 timed=False))     # doctest: +ELLIPSIS
      1f1b p=2 m=2 v=1 ticks=6 bubble=0.3333 peak_in_flight=(2, 1)
      s0 | F0 F1 .  B0 .  B1
      s1 | .  F0 B0 F1 B1 .
      bubble fraction 0.3333; peak in-flight micro-batches per stage (2, 1)
      0
    """
    from jaxpar.parallel.pipeline._schedules import bubble_fraction, get_schedule, peak_in_flight, to_text

    s = get_schedule(args.kind, args.stages, args.microbatches, args.virtual)
    print(to_text(s))
    print(f"bubble fraction {bubble_fraction(s):.4f}; peak in-flight micro-batches per stage {peak_in_flight(s)}")
    if args.png:
        from jaxpar.parallel.pipeline._render import render_png

        print(f"wrote {render_png(s, args.png, timed=args.timed)}")
    return 0
