"""`pipeblocks plot NAME -p P -m M -o FILE`: timeline and memory plot (PNG or SVG)."""
from __future__ import annotations

import argparse

from ..sim.plots import plot_timeline
from .argtypes import plot_file
from .common import add_schedule_options, analytic_costs, build, request_from_args


def register(sub) -> None:
    parser = sub.add_parser("plot", help="plot a schedule's timeline and memory over time to PNG/SVG")
    add_schedule_options(parser)
    parser.add_argument("-o", "--output", required=True, type=plot_file, help="output file, .png or .svg")
    parser.add_argument("--no-memory", action="store_true", help="leave out the memory panel")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    built = build(request_from_args(args))
    timeline = built.simulate()
    # analytic costs are seconds and bytes; otherwise the cost model's own units
    units = {"time_unit": "s", "memory_unit": "bytes"} if analytic_costs(args) else {}
    path = plot_timeline(timeline, args.output, memory=not args.no_memory, **units)
    print(f"wrote {path}")
    return 0
