"""Elastic groups (PipeMesh) against depth-first and breadth-first, simulated on a
communication-bound profile.

    python benchmarks/pipemesh.py [-p 4] [-m 16] [-v 2] [--hardware cloud] [--gpu-memory 80]
                                  [--models 6.2b,14.6b,28.3b] [--dps 4,8,16]
                                  [--sharding zero3] [--mixed-precision] [--json]

For each model and data-parallel size, three schedules on the analytic model:
    depth-first    interleaved-1f1b (groups of p), each REDUCE_GRAD overlapped after its
                   stage's last backward
    breadth-first  bfs
    elastic        elastic with automatic groups (the rule, then the simulator's search,
                   within --gpu-memory) and --recompute auto
Columns: step time (s), exposed DP communication (the largest over ranks, s), memory need
(static at the step's peak + peak activation, GB, the largest rank), whether it fits
--gpu-memory, recomputation's share of the step (busiest rank), the elastic groups, and
elastic's speed-up over the best baseline that fits and its cut of depth-first's exposed
communication. Targets shaped after the paper: >= 1.15x, >= 75% cut, recompute < 2%.
"""
from __future__ import annotations

import argparse
import json
import sys

from pipeblocks.core import ScheduleError, simulate
from pipeblocks.core.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.sharding import parse_sharding
from pipeblocks.sim.build import build, memory_budget
from pipeblocks.sim.recompute_auto import fits_memory, memory_need

BASELINES = (("depth-first", "interleaved-1f1b"), ("breadth-first", "bfs"))


def measure(request: ScheduleRequest) -> dict:
    built = build(request)
    timeline = simulate(built.schedule, built.costs, recompute=built.recompute)
    step = timeline.makespan
    return {
        "step_s": step,
        "exposed_s": max(timeline.exposed_comm) if timeline.exposed_comm else 0.0,
        "need_gb": max(memory_need(timeline)) / 1e9,
        "fits": bool(fits_memory(timeline, memory_budget(request))),
        "recompute_share": max(timeline.recompute_time) / step if step else 0.0,
        "forward_groups": built.schedule.option("forward_groups"),
        "backward_groups": built.schedule.option("backward_groups"),
    }


def run_case(args: argparse.Namespace, model: str, dp: int) -> dict:
    costs = CostSpec(model=model, hardware=args.hardware, mixed_precision=args.mixed_precision)
    base = ScheduleRequest(
        name="bfs", m=args.m, mesh=Mesh(pp=args.p, dp=dp), options=(("v", args.v),), costs=costs,
        sharding=parse_sharding(args.sharding), gpu_memory=args.gpu_memory,
    )
    row: dict = {"model": model, "dp": dp}
    for label, name in BASELINES:
        row[label] = measure(base.with_name(name))
    try:
        row["elastic"] = measure(ScheduleRequest(**{**base.__dict__, "name": "elastic", "recompute": "auto"}))
    except ScheduleError as err:
        row["elastic"] = {"error": str(err)}
        return row
    fitting = [row[label]["step_s"] for label, _ in BASELINES if row[label]["fits"]]
    row["speedup_vs_best_fitting"] = min(fitting) / row["elastic"]["step_s"] if fitting else None
    depth = row["depth-first"]["exposed_s"]
    row["exposed_cut_vs_depth_first"] = 1 - row["elastic"]["exposed_s"] / depth if depth > 0 else None
    return row


def _cell(result: dict) -> str:
    if "error" in result:
        return f"{'error':>8} {'':>7} {'':>6} {'':>4}"
    return (f"{result['step_s']:8.3f} {result['exposed_s']:7.3f} {result['need_gb']:6.1f} "
            f"{'yes' if result['fits'] else 'no':>4}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=16)
    parser.add_argument("-v", type=int, default=2)
    parser.add_argument("--hardware", default="cloud")
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--models", default="6.2b,14.6b,28.3b")
    parser.add_argument("--dps", default="4,8,16")
    parser.add_argument("--sharding", default="zero3")
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [run_case(args, model, int(dp)) for model in args.models.split(",") for dp in args.dps.split(",")]
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"p={args.p} m={args.m} v={args.v} --hardware {args.hardware} --gpu-memory {args.gpu_memory:g} "
          f"--sharding {args.sharding}{' --mixed-precision' if args.mixed_precision else ''}")
    print("per schedule: step s, exposed DP comm s, memory need GB, fits")
    head = f"{'model':<7}{'dp':>3}  " + "  ".join(f"{label:^29}" for label in ("depth-first", "breadth-first", "elastic"))
    print(head + f"  {'recomp':>7} {'speedup':>7} {'cut':>6}  groups (forward / backward)")
    for row in rows:
        cells = "  ".join(_cell(row[label]) for label in ("depth-first", "breadth-first", "elastic"))
        e = row["elastic"]
        if "error" in e:
            print(f"{row['model']:<7}{row['dp']:>3}  {cells}  {e['error'][:80]}")
            continue
        speed = row["speedup_vs_best_fitting"]
        cut = row["exposed_cut_vs_depth_first"]
        print(f"{row['model']:<7}{row['dp']:>3}  {cells}  {100 * e['recompute_share']:6.2f}% "
              f"{'-' if speed is None else f'{speed:6.3f}x':>7} {'-' if cut is None else f'{100 * cut:5.1f}%':>6}  "
              f"{','.join(map(str, e['forward_groups']))} / {','.join(map(str, e['backward_groups']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
