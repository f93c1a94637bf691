"""Costs given means cost-aware: zb-v, v-zb, v-half and v-min built for the costs against
their fixed patterns and the reference greedy, over p and cost ratios.

    PYTHONPATH=src python benchmarks/cost_aware.py [--p 4 8 16] [--m-per-p 4] [--json out.json]

For each (schedule, p, costs), m = m_per_p * p, the span bubble ratio (`bubble_ratio_span`:
idle time inside the longest rank span over that span, the papers' measure) of
  pattern    cost_aware=False: the fixed order laid out for equal costs, timed with the costs
  reference  our restatement of the ZB paper's cost-aware V greedy at the same memory limit
             (the pattern's peak under the costs); "-" where it cannot fit that limit (it
             is a 1F1B-memory scheduler; the reference's own V-Half and V-Min are fixed
             patterns, i.e. the `pattern` column)
  ours       the default when costs are given: the best by simulation of the pattern, the
             pattern with its Ws placed again for the costs, the reference greedy, our list
             scheduler and local search, at that memory limit
and the peak activation (equal for all three by construction; 1F1B's is p). Costs: 1:1:1,
3:4:2, the ZB paper's profiled 1.5B costs (18.5/18.1/9.3 ms, comm 0.6 ms) and the analytic
transformer model (14.6B on A100, per-stage costs with the LM head).
"""
from __future__ import annotations

import argparse
import json
import time

from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.schedules import get
from pipeblocks.sim import Costs, simulate

NAMES = ("zb-v", "v-zb", "v-half", "v-min")


def cost_sets(p: int) -> list[tuple[str, Costs]]:
    sets = [
        ("1:1:1", Costs()),
        ("3:4:2", Costs(t_f=3, t_b=4, t_w=2)),
        ("ZB 1.5B", Costs(t_f=18.5, t_b=18.1, t_w=9.3, t_comm=0.6)),
    ]
    try:
        from pipeblocks.sim.analytic import HARDWARE, MODELS, transformer_costs

        sets.append(("analytic 14.6B", transformer_costs(MODELS["14.6b"], HARDWARE["a100"], num_stages=2 * p)))
    except (ImportError, ScheduleError, KeyError):
        pass
    return sets


def row(name: str, p: int, m: int, label: str, costs: Costs) -> dict:
    fixed = get(name)(p=p, m=m, costs=costs, cost_aware=False)
    started = time.process_time()
    ours = get(name)(p=p, m=m, costs=costs, cost_aware=True)  # the default for any costs but the unit ones
    seconds = time.process_time() - started
    limit = dict(ours.options)["memory_limit"]
    try:
        reference = get("zb-v")(p=p, m=m, costs=costs, cost_aware=True, mode="reference", memory_limit=limit)
        ref_span = simulate(reference, costs).bubble_ratio_span
    except ScheduleError:  # the reference greedy cannot fit this memory limit
        ref_span = None
    tl_fixed, tl_ours = simulate(fixed, costs), simulate(ours, costs)
    return {
        "schedule": name, "p": p, "m": m, "costs": label, "memory_limit": limit,
        "peak_pattern": max(tl_fixed.peak_activation), "peak_ours": max(tl_ours.peak_activation),
        "span_bubble_pattern": tl_fixed.bubble_ratio_span, "span_bubble_reference": ref_span,
        "span_bubble_ours": tl_ours.bubble_ratio_span, "seconds_ours": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--m-per-p", type=int, default=4, help="m = this x p (default 4: p=8, m=32)")
    parser.add_argument("--schedules", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    rows = []
    print("span bubble ratio (bubble_ratio_span) at the pattern's memory; ours = default with costs given")
    print(f"{'schedule':8} {'p':>3} {'m':>4} {'costs':15} {'peak':>6} {'pattern':>8} {'reference':>9} {'ours':>8} "
          f"{'ours/pat':>8} {'cpu s':>6}")
    for p in args.p:
        for label, costs in cost_sets(p):
            for name in args.schedules:
                r = row(name, p, args.m_per_p * p, label, costs)
                rows.append(r)
                ref = "-" if r["span_bubble_reference"] is None else f"{r['span_bubble_reference']:.4f}"
                ratio = r["span_bubble_ours"] / r["span_bubble_pattern"] if r["span_bubble_pattern"] > 0 else 1.0
                print(f"{name:8} {p:3d} {r['m']:4d} {label:15} {r['peak_ours']:6.3g} {r['span_bubble_pattern']:8.4f} "
                      f"{ref:>9} {r['span_bubble_ours']:8.4f} {ratio:8.3f} {r['seconds_ours']:6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
