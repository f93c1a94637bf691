"""zero3 against zero3-regather (a chunk's gathered parameters freed between its visits and
gathered again) on elastic, in the simulator, and what `--sharding auto` picks under a
budget that plain zero3 does not fit.

    python benchmarks/regather.py                 # 6.2b, p=4, m=32, d=16, cloud, v=2
    python benchmarks/regather.py --json
    python benchmarks/regather.py --model 14.6b --dp 16 -m 16

For each group sequence (the one elastic's search picks under zero3 with --gpu-memory 80,
and one group of m, breadth-first), the step time, the exposed DP communication and the
memory need per rank (GB: static memory at the step's peak plus peak activation; for
zero3-regather traced together over time) under both policies. Then, with --budget B (GB;
default: halfway between the best zero3 need and the best zero3-regather need over those
groups), `--sharding auto` for elastic (groups and policy per chunk chosen together,
`resolve.elastic_plan`): its groups, policies, step time and need.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from pipeblocks.core import simulate
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.resolve.build import build


def measure(request: ScheduleRequest) -> dict:
    built = build(request)
    timeline = simulate(built.schedule, built.costs, recompute=built.recompute)
    return {
        "forward_groups": list(built.schedule.option("forward_groups")),
        "backward_groups": list(built.schedule.option("backward_groups")),
        "sharding": [str(p) for p in built.request.sharding],
        "step_s": timeline.makespan,
        "exposed_s": max(timeline.exposed_comm),
        "gathers": max(sum(1 for e in events if "UNSHARD" in e.op) for events in timeline.comm_events),
        "need_gb": [n / 1e9 for n in timeline.memory_need],
    }


def run(args: argparse.Namespace) -> dict:
    cpu = time.process_time()
    costs = CostSpec(model=args.model, hardware=args.hardware, mixed_precision=args.mixed_precision,
                     dp_unit=args.dp_unit)
    base = dict(name="elastic", m=args.m, mesh=Mesh(pp=args.p, dp=args.dp), costs=costs)
    chosen = measure(ScheduleRequest(**base, options=(("v", args.v),), sharding=parse_sharding("zero3"),
                                     gpu_memory=args.gpu_memory))
    rows = []
    for label, groups in (("searched", (chosen["forward_groups"], chosen["backward_groups"])),
                          ("one group", ([args.m], [args.m]))):
        options = (("v", args.v), ("forward_groups", tuple(groups[0])), ("backward_groups", tuple(groups[1])))
        for policy in ("zero3", "zero3-regather"):
            rows.append({"groups": label, "policy": policy,
                         **measure(ScheduleRequest(**base, options=options, sharding=parse_sharding(policy)))})
    budget = args.budget
    if budget is None:
        zero3 = min(max(r["need_gb"]) for r in rows if r["policy"] == "zero3")
        regather = min(max(r["need_gb"]) for r in rows if r["policy"] == "zero3-regather")
        budget = round((zero3 + regather) / 2, 2)
    auto = measure(ScheduleRequest(**base, options=(("v", args.v),), auto_sharding=True, gpu_memory=budget))
    return {"model": args.model, "p": args.p, "m": args.m, "dp": args.dp, "v": args.v, "hardware": args.hardware,
            "dp_unit": args.dp_unit, "rows": rows, "budget_gb": budget, "auto": auto,
            "cpu_s": time.process_time() - cpu}


def _groups(row: dict) -> str:
    return f"{','.join(map(str, row['forward_groups']))} / {','.join(map(str, row['backward_groups']))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="6.2b")
    parser.add_argument("--hardware", default="cloud")
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=32)
    parser.add_argument("-v", type=int, default=2)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--dp-unit", choices=("chunk", "block"), default="chunk")
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GB, for elastic's group search under zero3")
    parser.add_argument("--budget", type=float, default=None, help="GB for --sharding auto (default: see above)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print(f"{args.model} p={args.p} m={args.m} d={args.dp} v={args.v} {args.hardware} {args.dp_unit} grain "
          f"(step s, exposed s, gathers per rank, memory need GB per rank)")
    print(f"{'groups':<12}{'':26}{'policy':<16}{'step':>7}{'exposed':>9}{'gathers':>8}   need per rank")
    for row in result["rows"]:
        need = " ".join(f"{n:5.1f}" for n in row["need_gb"])
        print(f"{row['groups']:<12}{_groups(row):<26}{row['policy']:<16}{row['step_s']:7.3f}{row['exposed_s']:9.3f}"
              f"{row['gathers']:8d}   {need}")
    auto = result["auto"]
    print(f"--sharding auto --gpu-memory {result['budget_gb']:g}: groups {_groups(auto)}, "
          f"sharding {','.join(auto['sharding'])}")
    print(f"   step {auto['step_s']:.3f} s, exposed {auto['exposed_s']:.3f} s, need "
          + " ".join(f"{n:.1f}" for n in auto["need_gb"]) + f" GB  ({result['cpu_s']:.1f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
