"""The V family at equal costs: peak activation and bubble over p, and v-adaptive's
memory -> bubble curve against the lower bound 6p - 1 - 3k.

    python benchmarks/v_family.py [--p 2 4 8 16] [--m-per-p 3] [--curve-p 8] [--json FILE]

Unit model: F of one microbatch through a full stage holds 1 (a V chunk 1/2), so 1F1B's
peak is p; k is the peak in chunk activations (2 x peak). Bubbles are in unit slots (one
chunk pass; the simulator's unit cost is a full stage, so a slot is 1/2 time unit):

    span    longest rank span (first start to last end) minus busy time, as in the papers
    global  makespan minus busy time, what `Timeline.bubble_ratio` uses
    6p-1-3k the lower bound for k; at odd k the best reachable is one slot more (6p-3k)
    ref     the reference generators' span bubble (zbv_greedy.py in
            sail-sg/zero-bubble-pipeline-parallelism) at m >= 2p, measured by running them
"""
from __future__ import annotations

import argparse
import json
import sys

from pipeblocks import schedules, simulate

NAMES = ("v-min", "v-half", "v-zb", "1f1b-v")
REFERENCE_SPAN_BUBBLE = {
    "v-min": {2: 3, 3: 5, 4: 11, 5: 15, 6: 17, 7: 23, 8: 27, 9: 29, 10: 35, 11: 39, 12: 41, 13: 47, 14: 51,
              15: 53, 16: 59},
    "v-half": {2: 1, 3: 5, 4: 5, 5: 11, 6: 11, 7: 17, 8: 17, 9: 23, 10: 23, 11: 29, 12: 29, 13: 35, 14: 35,
               15: 41, 16: 41},
}


def measure(schedule) -> dict:
    tl = simulate(schedule)
    p = schedule.p
    busy = max(tl.busy(r) for r in range(p))
    span = max(evs[-1].end - evs[0].start for evs in tl.events)
    peak = max(tl.peak_activation)
    return {
        "peak": peak, "k": round(2 * peak), "peak_vs_1f1b": peak / p, "span_bubble_slots": 2 * (span - busy),
        "global_bubble_slots": 2 * (tl.makespan - busy), "bubble_ratio": tl.bubble_ratio,
        "lower_bound_slots": max(0, 6 * p - 1 - 3 * round(2 * peak)),
    }


def family_table(ps: list[int], m_per_p: int) -> list[dict]:
    rows = []
    for p in ps:
        for name in NAMES:
            row = {"schedule": name, "p": p, "m": m_per_p * p, **measure(schedules.get(name)(p=p, m=m_per_p * p))}
            row["reference_span_bubble_slots"] = REFERENCE_SPAN_BUBBLE.get(name, {}).get(p)
            rows.append(row)
    return rows


def adaptive_curve(p: int, m: int) -> list[dict]:
    rows = []
    for k in range(1, 2 * p + 1):
        try:
            s = schedules.get("v-adaptive")(p=p, m=m, memory_limit=k / 2)
        except ValueError:  # below the smallest feasible limit
            continue
        rows.append({"memory_limit": k / 2, "k_limit": k, "block": dict(s.options)["block"], **measure(s)})
        rows[-1]["lower_bound_slots"] = max(0, 6 * p - 1 - 3 * k)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--m-per-p", type=int, default=3, help="m = this x p (default 3)")
    parser.add_argument("--curve-p", type=int, nargs="+", default=[8], help="p for the v-adaptive curve")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)

    table = family_table(args.p, args.m_per_p)
    print(f"V family at equal costs, m = {args.m_per_p}p (bubbles in unit slots)")
    print(f"{'schedule':8} {'p':>3} {'m':>3} {'peak':>5} {'/1f1b':>6} {'span':>5} {'global':>6} {'ratio':>6} "
          f"{'bound':>5} {'ref':>4}")
    for r in table:
        ref = "-" if r["reference_span_bubble_slots"] is None else str(r["reference_span_bubble_slots"])
        print(f"{r['schedule']:8} {r['p']:3d} {r['m']:3d} {r['peak']:5.1f} {r['peak_vs_1f1b']:6.2f} "
              f"{r['span_bubble_slots']:5.0f} {r['global_bubble_slots']:6.0f} {r['bubble_ratio']:6.3f} "
              f"{r['lower_bound_slots']:5d} {ref:>4}")
    curves = {}
    for p in args.curve_p:
        m = args.m_per_p * p
        curves[p] = adaptive_curve(p, m)
        print(f"\nv-adaptive, p={p}, m={m}: memory limit -> bubble (k = limit in chunk activations)")
        print(f"{'limit':>5} {'k':>3} {'peak':>5} {'span':>5} {'global':>6} {'6p-1-3k':>7}  block")
        for r in curves[p]:
            print(f"{r['memory_limit']:5.1f} {r['k_limit']:3d} {r['peak']:5.1f} {r['span_bubble_slots']:5.0f} "
                  f"{r['global_bubble_slots']:6.0f} {r['lower_bound_slots']:7d}  {r['block']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"m_per_p": args.m_per_p, "family": table, "adaptive": {str(p): c for p, c in curves.items()}},
                      handle, indent=1)
        print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
