"""Recomputation on PipeMesh's configuration: how much of it the rank's idle time hides.

    python benchmarks/recompute.py                       # the table and the budget curve (simulated)
    python benchmarks/recompute.py --json recompute.json --plot docs/images/recompute-budget.png \\
        --timeline docs/images/recompute-timeline.png

The configuration of the PipeMesh figures (docs/pipemesh.md): the 6.2b model, p = 4, m =
32, d = 16 replicas, zero3 chunks, the `cloud` profile, the elastic schedule with its
groups searched (`elastic_plan`). Three ways to fit --gpu-memory:

    none   no recomputation (where it fits: the searched groups shrink to make it fit)
    all    every (stage, microbatch) recomputed, the classic remedy (1F1B-R's)
    auto   `--recompute auto`: the fewest pairs that fit, placed in idle time (`recompute_place`)

Columns: the step (s), the memory need (static at the step's peak plus peak activation,
GB, the largest rank), whether it fits, the recomputation's time on the rank that
recomputes most (s) and the part of it hidden in that rank's waits (its time minus how much
later its step ends: `Timeline.recompute_exposed`), the step's exposed part (s: how much
longer the whole step is than the same Program without its RECOMPUTE ops;
`Timeline.recompute_step_cost`) and its share of the step, the pairs recomputed and how
many of them were moved into idle time. Then the budget curve: --budgets GB against auto's recomputation, total and exposed.
"""
from __future__ import annotations

import argparse
import time

from pipeblocks.core.lowering.recompute import recompute_pairs
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.resolve.build import build

from _output import write_json


def _request(args, budget: float, recompute: str, groups: tuple | None = None) -> ScheduleRequest:
    options = () if groups is None else (("forward_groups", groups[0]), ("backward_groups", groups[1]))
    return ScheduleRequest(name="elastic", m=args.m, mesh=Mesh(pp=args.p, dp=args.dp),
                           sharding=parse_sharding(args.sharding), options=options,
                           costs=CostSpec(model=args.model, hardware=args.hardware), gpu_memory=budget,
                           recompute=recompute)


def row(args, budget: float, recompute: str, groups: tuple | None = None) -> dict:
    """One plan's figures (see the module docstring)."""
    started = time.process_time()
    built = build(_request(args, budget, recompute, groups))
    timeline = built.simulate()
    need = max(timeline.memory_need) / 1e9
    busiest = max(range(args.p), key=lambda r: timeline.recompute_time[r])
    total = timeline.recompute_time[busiest]
    own = timeline.recompute_exposed[busiest] if timeline.recompute_exposed else 0.0
    exposed = timeline.recompute_step_cost or 0.0
    options = dict(built.schedule.options)
    return {
        "recompute": recompute, "budget_gb": budget, "step_s": timeline.makespan, "need_gb": need,
        "fits": need <= budget * (1 + 1e-9), "recompute_s": total, "hidden_s": max(0.0, total - own),
        "exposed_s": exposed, "exposed_share": exposed / timeline.makespan,
        "exposed_per_rank_s": list(timeline.recompute_exposed) or [0.0] * args.p,
        "pairs": len(recompute_pairs(built.schedule, built.recompute)), "moved": len(built.recompute_at),
        "groups": [list(options.get("forward_groups", ())), list(options.get("backward_groups", ()))],
        "search_cpu_s": time.process_time() - started, "timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="6.2b")
    parser.add_argument("--hardware", default="cloud")
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=32)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--sharding", default="zero3")
    parser.add_argument("--gpu-memory", type=float, default=40.0, help="the table's budget, GB (default 40)")
    parser.add_argument("--budgets", default="40,45,50,55,60,70,80", help="the curve's budgets, GB")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="the budget curve")
    parser.add_argument("--timeline", default=None, metavar="FILE.png", help="auto's timeline at --gpu-memory")
    args = parser.parse_args()
    table = []
    auto = row(args, args.gpu_memory, "auto")
    table.append(row(args, args.gpu_memory, "none"))
    table.append(row(args, args.gpu_memory, "all", groups=tuple(map(tuple, auto["groups"]))))
    table.append(auto)
    print(f"{args.model}, p={args.p}, m={args.m}, d={args.dp}, {args.sharding}, {args.hardware}, elastic; --gpu-memory "
          f"{args.gpu_memory:g} GB (all: at auto's groups)")
    print(f"{'recompute':>9} {'step s':>7} {'need GB':>8} {'fits':>5} {'recomp s':>9} {'hidden s':>9} {'exposed s':>10} "
          f"{'exposed':>8} {'pairs':>6} {'moved':>6}  groups")
    for r in table:
        print(f"{r['recompute']:>9} {r['step_s']:7.3f} {r['need_gb']:8.1f} {'yes' if r['fits'] else 'no':>5} "
              f"{r['recompute_s']:9.3f} {r['hidden_s']:9.3f} {r['exposed_s']:10.3f} {r['exposed_share']:8.1%} "
              f"{r['pairs']:6d} {r['moved']:6d}  {r['groups'][0]}/{r['groups'][1]}")
    curve = [auto if float(b) == args.gpu_memory else row(args, float(b), "auto") for b in args.budgets.split(",")]
    print("\nbudget curve (auto): GB, step s, recomputation s (busiest rank), exposed s, exposed share, pairs, moved")
    for r in curve:
        print(f"{r['budget_gb']:6g} {r['step_s']:8.3f} {r['recompute_s']:8.3f} {r['exposed_s']:8.3f} "
              f"{r['exposed_share']:8.1%} {r['pairs']:6d} {r['moved']:6d}")
    if args.plot:
        _plot_curve(curve, args.plot)
        print(f"plot {args.plot}")
    if args.timeline:
        from pipeblocks.sim.plots import plot_timeline

        plot_timeline(auto["timeline"], args.timeline, time_unit="s", memory_unit="bytes",
                      title=f"elastic {args.model} p={args.p} m={args.m} d={args.dp}, --recompute auto at "
                      f"{args.gpu_memory:g} GB: recomputation (light) in waits where it fits")
        print(f"timeline {args.timeline}")
    if args.json:
        strip = [{k: v for k, v in r.items() if k != "timeline"} for r in (*table, *curve)]
        write_json({"table": strip[:3], "curve": strip[3:], **{k: v for k, v in vars(args).items()
                                                                  if k not in ("json", "plot", "timeline")}}, args.json)


def _plot_curve(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [r["budget_gb"] for r in curve]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(budgets, [r["recompute_s"] for r in curve], "o-", label="recomputation (busiest rank)")
    ax.plot(budgets, [r["exposed_s"] for r in curve], "s-", label="exposed: lengthens the step")
    for r in curve:
        ax.annotate(f"{r['exposed_share']:.1%}", (r["budget_gb"], r["exposed_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("--gpu-memory (GB)")
    ax.set_ylabel("seconds per step")
    ax.set_title("--recompute auto, 6.2b p=4 m=32 d=16 cloud: against the budget", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
