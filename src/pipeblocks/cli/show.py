"""`pipeblocks show NAME -p P -m M`: the schedule as a text timeline (or its action lists)."""
from __future__ import annotations

import argparse

from ..sim.text_timeline import render_text_timeline
from .common import add_schedule_options, build, request_from_args


def register(sub) -> None:
    parser = sub.add_parser("show", help="print a schedule as a text timeline")
    add_schedule_options(parser)
    parser.add_argument("--actions", action="store_true", help="print the per-rank action lists (the text form) instead")
    parser.add_argument(
        "--program", action="store_true",
        help="print the lowered program instead: sends, receives, the DP ops that --dp/--sharding add and "
        "the recomputations of --recompute (or of a -r schedule)",
    )
    parser.add_argument("-o", "--output", default=None, help="also save the schedule (.json or text form)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    built = build(request_from_args(args))
    schedule = built.schedule
    if args.output:
        schedule.save(args.output)
    if args.actions:
        print(schedule.to_text(), end="")
        return 0
    if args.program:
        print(built.program().to_text(), end="")
        return 0
    timeline = built.simulate()
    print(render_text_timeline(timeline), end="")
    print(f"makespan {timeline.makespan:.6g}   bubble ratio {timeline.bubble_ratio:.4f}   "
          f"peak activation per rank {[round(x, 4) for x in timeline.peak_activation]}")
    if timeline.comm_events:
        print(f"DP comm per rank {[round(x, 4) for x in timeline.comm_time]}   "
              f"exposed {[round(x, 4) for x in timeline.exposed_comm]}   "
              f"static memory {[round(x, 4) for x in timeline.static_memory]}")
    return 0
