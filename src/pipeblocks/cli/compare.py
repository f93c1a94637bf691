"""`pipeblocks compare -p P -m M`: bubble, makespan and peak memory across schedules."""
from __future__ import annotations

import argparse
import time

from ..core.ir.errors import ScheduleError
from ..schedules import names
from ..resolve.build import memory_budget
from ..sim.plots import ParetoPoint, plot_pareto
from ..resolve.recompute_auto import fits_memory
from ..resolve.request import ScheduleRequest
from .argtypes import plot_file
from .common import add_schedule_options, analytic_costs, build, print_json, progress, request_from_args, split_of


def register(sub) -> None:
    parser = sub.add_parser("compare", help="compare schedules: bubble ratio, makespan, peak activation vs 1F1B")
    add_schedule_options(parser, name=False)
    parser.add_argument("--schedules", default=None, help="comma-separated names (default: every registered schedule)")
    parser.add_argument("--plot", default=None, type=plot_file, metavar="FILE", help="write the memory-against-bubble picture (.png/.svg)")
    parser.add_argument(
        "--no-curve", action="store_true",
        help="with --plot: leave out the v-adaptive memory-to-bubble curve (one simulation per budget)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    chosen = args.schedules.split(",") if args.schedules else names()
    if "1f1b" not in chosen:
        chosen = ["1f1b", *chosen]
    base = request_from_args(args, name=chosen[0])
    rows, skipped = [], []
    started = time.monotonic()
    for name in chosen:
        try:
            built = build(base.with_name(name))
            timeline = built.simulate()
        except ScheduleError as err:
            if args.schedules:  # asked for by name: the user wants to know
                raise
            skipped.append((name, str(err).splitlines()[0]))
            continue
        summary = timeline.summary()
        summary["fits_memory"] = fits_memory(timeline, memory_budget(built.request))
        counts = split_of(built)  # --split auto: chosen for this schedule
        rows.append({**summary, **({"split": list(counts)} if counts is not None else {}),
                     "peak_max": max(timeline.peak_activation),
                     "exposed_comm_max": max(summary["exposed_comm"]), "static_max": max(summary["static_memory"])})
        if time.monotonic() - started > 2:
            progress(f"compare: simulated {name} ({len(rows)}/{len(chosen)})")
    reference = next((r["peak_max"] for r in rows if r["schedule"] == "1f1b"), None)
    if reference is None:
        why = next(w for n, w in skipped if n == "1f1b")
        raise ScheduleError(f"compare measures memory against 1f1b, which these options rule out: {why}")
    for row in rows:
        row["peak_vs_1f1b"] = row["peak_max"] / reference if reference else float("nan")
    if args.plot:
        points = [ParetoPoint(r["schedule"], r["peak_max"], r["bubble_ratio"]) for r in rows]
        if not args.no_curve and "v-adaptive" in chosen:
            points += _adaptive_curve(base)
        plot_pareto(points, args.plot, title=f"p={args.p}, m={args.m}: peak activation against bubble ratio",
                    memory_unit="bytes" if analytic_costs(args) else "units")
    if args.json:
        print_json({"p": args.p, "m": args.m, "dp": args.dp, "sharding": args.sharding, "schedules": rows, "skipped": [{"name": n, "reason": w} for n, w in skipped]})
        return 0
    _print_table(rows, args)
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _adaptive_curve(base: ScheduleRequest) -> list[ParetoPoint]:
    """v-adaptive at every budget of k chunk activations (k/2 units) up to 1F1B's peak."""
    points = []
    adaptive = base.with_name("v-adaptive")
    for k in range(1, 2 * base.p + 1):
        limit = k / 2
        try:
            built = build(adaptive.with_options(memory_limit=limit))
        except ScheduleError:
            continue  # below the smallest feasible budget
        timeline = built.simulate()
        points.append(ParetoPoint(f"{limit:g}", max(timeline.peak_activation), timeline.bubble_ratio, "v-adaptive"))
    progress(f"compare: v-adaptive curve over {len(points)} budgets")
    return points


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    width = max(len("schedule"), *(len(r["schedule"]) for r in rows))
    if analytic_costs(args):
        model = args.model or f"--hf {args.hf}"
        print(f"p={args.p} m={args.m} model {model} on {args.hardware}  (makespan in s, peak activation in GiB)")
    else:
        print(f"p={args.p} m={args.m}  (peak activation: 1 = one microbatch through one full stage; 1F1B peaks at p)")
    unit = 2**30 if analytic_costs(args) else 1
    mesh = args.dp > 1 or args.sharding != "replicate"
    if mesh:
        print(f"dp={args.dp} sharding={args.sharding}  (exposed DP comm: max over ranks; static: max over ranks"
              f"{', GiB' if analytic_costs(args) else ', 16 per full stage in fp32 replicate'})")
    extra = f"  {'exp comm':>8}  {'static':>8}" if mesh else ""
    budget = args.gpu_memory is not None
    # in play only when asked for: 1f1b-r alone says by its name that it recomputes
    recomputes = (budget or args.recompute != "none") and any(any(r["recompute_time"]) for r in rows)
    extra += (f"  {'recomp':>7}" if recomputes else "") + (f"  {'fits':>4}" if budget else "")
    split = getattr(args, "split", None) is not None
    extra += "  split" if split else ""
    notes = (["recomp: recomputation time, max over ranks"] if recomputes else []) + (
        [f"fits: static + activation memory within --gpu-memory {args.gpu_memory:g} on every rank"] if budget else [])
    if notes:
        print("; ".join(notes))
    print(f"{'schedule':<{width}}  {'v':>2}  {'makespan':>9}  {'bubble':>7}  {'span bub':>8}  {'peak max':>8}  {'vs 1F1B':>7}{extra}  peak per rank")
    for r in rows:
        per_rank = " ".join(f"{x / unit:.3g}" for x in r["peak_activation"])
        extra = f"  {r['exposed_comm_max']:>8.4g}  {r['static_max'] / unit:>8.4g}" if mesh else ""
        extra += (f"  {max(r['recompute_time']):>7.4g}" if recomputes else "")
        extra += (f"  {'yes' if r['fits_memory'] else 'no':>4}" if budget else "")
        extra += f"  {','.join(map(str, r['split']))}" if split else ""
        print(f"{r['schedule']:<{width}}  {r['v']:>2}  {r['makespan']:>9.4g}  {r['bubble_ratio']:>7.4f}  {r['bubble_ratio_span']:>8.4f}  "
              f"{r['peak_max'] / unit:>8.4g}  {r['peak_vs_1f1b']:>7.3f}{extra}  {per_rank}")
    print("bubble: bubble_ratio, over the whole makespan (counts the start-up stagger); span bub: "
          "bubble_ratio_span, over each rank's own span - the figure to compare with the papers")
