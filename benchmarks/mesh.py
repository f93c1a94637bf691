"""Exposed data-parallel communication per schedule: gradient reduction at the end of the
step against reduction overlapped (launched right after each stage's last weight gradient).

    python benchmarks/mesh.py [-p 4] [-m 8] [--dp 16] [--sharding replicate] [--model 6.2b]
                              [--hardware cloud] [--dp-bandwidth GB/s] [--mixed-precision]
                              [--dp-unit chunk|block] [--prefetch K] [--schedules a,b,...] [--json]

Simulated with the analytic model (default: the 6.2B model of the Zero Bubble paper on the
`cloud` profile, 16 replicas, so every ring leaves the node and runs on the slow link).
Columns (seconds; "exposed" is the largest over ranks of the time compute waits on the
communication stream; "step" is the makespan including it):

    compute     the step without data parallelism
    comm        DP communication per rank (the busiest rank)
    end: step / exposed      every REDUCE_GRAD at the end of the rank's step
    overlap: step / exposed  each REDUCE_GRAD right after its stage's last W or BW (lowering)
    saved       step time saved by overlapping, in percent of the end-of-step step

--dp-unit block: one gather and one reduction per layer (`core.ir.dp_units`), pipelined with
the passes; with --prefetch K only K units of a chunk are gathered ahead of its first pass.

With --emulated, p x d local processes run each schedule with emulated compute (every
pass sleeps --emulate-ms) and emulated links (every DP collective takes its modelled
time on the link, --dp-bandwidth GB/s, --stage-params parameters per stage, fp32
gradients; any --sharding), reduction at the end and overlapped (one launch per schedule,
the two placements' steps interleaved), and the table sets the measured step
time and exposed communication (per step the largest over ranks, median over the steps
after the first) beside the simulator's for the same Program and costs:

    python benchmarks/mesh.py --emulated [-p 2] [--dp 2] [-m 4] [--schedules 1f1b,bfs,zb-v]
                              [--emulate-ms 4] [--dp-bandwidth 0.2] [--stage-params 1e6]
                              [--dp-unit block --blocks 4] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pipeblocks.core import Costs, ScheduleError, simulate, simulate_program
from pipeblocks.core.cost.dp_model import DPCostModel
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.resolve.build import build

import _shared_tests  # noqa: F401  (tests/ on sys.path: _emulated_mesh)

SCHEDULES = ("1f1b", "interleaved-1f1b", "bfs", "zb-h1", "zb-v", "v-half", "v-min")


def measure(request: ScheduleRequest) -> dict:
    built = build(request)
    schedule, costs = built.schedule, built.costs
    dp = costs.data_parallel
    alone = simulate(schedule, dataclasses.replace(costs, data_parallel=DPCostModel()))
    row = {"schedule": schedule.name, "v": schedule.v, "compute_s": alone.makespan}
    for label, at_end in (("end", True), ("overlap", False)):
        program = lower_for(schedule, policies=dp.sharding, dp=dp.dp, reduce_at_end=at_end,
                            units=costs.dp_units(schedule.num_stages))
        timeline = simulate_program(program, costs)
        row[f"{label}_step_s"] = timeline.makespan
        row[f"{label}_exposed_s"] = max(timeline.exposed_comm)
        row["comm_s"] = max(timeline.comm_time)
    row["saved_pct"] = 100 * (row["end_step_s"] - row["overlap_step_s"]) / row["end_step_s"]
    return row


EMULATED_SCHEDULES = ("1f1b", "bfs", "zb-v")


def measure_emulated(name: str, args: argparse.Namespace) -> dict:
    from _emulated_mesh import EmulatedMeshCase, measure_emulated_meshes, predict_emulated_mesh
    from pipeblocks.schedules import get

    stages = get(name)(p=args.p, m=args.m).num_stages
    row = {"schedule": name, "v": stages // args.p}
    labels = (("end", True), ("overlap", False))
    cases = [EmulatedMeshCase(name, p=args.p, dp=args.dp, m=args.m, f_ms=args.emulate_ms, b_ms=args.emulate_ms,
                              w_ms=args.emulate_ms, stage_params=(args.stage_params,) * stages,
                              bandwidth=args.dp_bandwidth * 1e9, sharding=args.sharding, reduce_at_end=at_end,
                              steps=args.steps, blocks=args.blocks, dp_unit=args.dp_unit, prefetch=args.prefetch)
             for _, at_end in labels]
    # both placements in one launch, their steps interleaved: compared under the same load
    for (label, _), case, got in zip(labels, cases, measure_emulated_meshes(cases)):
        sim = predict_emulated_mesh(case)
        row["comm_s"] = sim["comm_s"]
        row[f"{label}_step_sim_s"], row[f"{label}_exposed_sim_s"] = sim["step_s"], sim["exposed_s"]
        row[f"{label}_step_meas_s"], row[f"{label}_exposed_meas_s"] = got["step_s"], got["exposed_s"]
    return row


def main_emulated(args: argparse.Namespace) -> int:
    if args.p * args.dp > 8:
        raise SystemExit(f"--emulated runs p x d = {args.p * args.dp} local processes: keep it at 8 or fewer")
    rows = []
    for name in args.schedules.split(","):
        try:
            rows.append(measure_emulated(name, args))
        except ScheduleError as err:
            print(f"skipped {name}: {str(err).splitlines()[0]}", file=sys.stderr)
    if args.json:
        json.dump({"emulated": True, "p": args.p, "m": args.m, "dp": args.dp, "sharding": args.sharding,
                   "emulate_ms": args.emulate_ms, "dp_bandwidth_gbs": args.dp_bandwidth,
                   "stage_params": args.stage_params, "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"emulated: p={args.p} m={args.m} dp={args.dp} sharding={args.sharding} --dp-unit {args.dp_unit}, "
          f"{args.blocks} block(s) per stage, F=B=W={args.emulate_ms} ms per "
          f"stage, {args.stage_params:g} parameters per stage on a {args.dp_bandwidth} GB/s link (ms; sim / measured)")
    print(f"{'schedule':<17} {'v':>2} {'comm':>6} {'end step':>15} {'end exposed':>15} "
          f"{'ovl step':>15} {'ovl exposed':>15}")
    for r in rows:
        cells = [f"{1e3 * r[f'{k}_sim_s']:6.1f} /{1e3 * r[f'{k}_meas_s']:6.1f}"
                 for k in ("end_step", "end_exposed", "overlap_step", "overlap_exposed")]
        print(f"{r['schedule']:<17} {r['v']:>2} {1e3 * r['comm_s']:>6.1f} " + " ".join(f"{c:>15}" for c in cells))
    return 0


def _check(costs: Costs) -> None:
    if costs.data_parallel.dp < 2:
        raise ScheduleError("--dp must be at least 2 to have data-parallel communication to place")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=None, help="pipeline ranks (default 4; emulated 2)")
    parser.add_argument("-m", type=int, default=None, help="microbatches (default 8; emulated 4)")
    parser.add_argument("--dp", type=int, default=None, help="replicas (default 16; emulated 2)")
    parser.add_argument("--sharding", default="replicate")
    parser.add_argument("--model", default="6.2b")
    parser.add_argument("--hardware", default="cloud")
    parser.add_argument("--dp-bandwidth", type=float, default=None, metavar="GB/s")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16-mixed: bf16 parameter gathers, fp32 gradient reductions")
    parser.add_argument("--dp-unit", default="chunk", choices=("chunk", "block"), help="grain of the DP collectives")
    parser.add_argument("--prefetch", type=int, default=None, help="--dp-unit block: units gathered ahead (default all)")
    parser.add_argument("--blocks", type=int, default=1, help="--emulated: blocks per stage")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--emulated", action="store_true",
                        help="also run each schedule on p x d local processes with emulated compute and links")
    parser.add_argument("--emulate-ms", type=float, default=4.0, help="emulated F, B and W per stage (ms)")
    parser.add_argument("--stage-params", type=float, default=1e6, help="emulated parameters per stage")
    parser.add_argument("--steps", type=int, default=5, help="emulated steps (the first is not timed)")
    args = parser.parse_args(argv)
    if args.emulated:
        args.p, args.m, args.dp = args.p or 2, args.m or 4, args.dp or 2
        args.dp_bandwidth = 0.2 if args.dp_bandwidth is None else args.dp_bandwidth
        if args.schedules == ",".join(SCHEDULES):
            args.schedules = ",".join(EMULATED_SCHEDULES)
        return main_emulated(args)
    args.p, args.m, args.dp = args.p or 4, args.m or 8, args.dp or 16
    spec = CostSpec(model=args.model, hardware=args.hardware, dp_bandwidth=args.dp_bandwidth,
                    mixed_precision=args.mixed_precision, dp_unit=args.dp_unit, dp_prefetch=args.prefetch)
    base = ScheduleRequest(name="1f1b", m=args.m, mesh=Mesh(pp=args.p, dp=args.dp), costs=spec,
                           sharding=parse_sharding(args.sharding))
    _check(build(base).costs)
    rows = []
    for name in args.schedules.split(","):
        try:
            rows.append(measure(base.with_name(name)))
        except ScheduleError as err:
            print(f"skipped {name}: {str(err).splitlines()[0]}", file=sys.stderr)
    if args.json:
        json.dump({"p": args.p, "m": args.m, "dp": args.dp, "sharding": args.sharding, "model": args.model,
                   "hardware": args.hardware, "dp_bandwidth_gbs": args.dp_bandwidth, "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    link = f"{args.dp_bandwidth} GB/s" if args.dp_bandwidth else f"{args.hardware} profile"
    precision = "bf16-mixed" if args.mixed_precision else "fp32"
    print(f"p={args.p} m={args.m} dp={args.dp} sharding={args.sharding} model {args.model}, DP link {link}, "
          f"{precision}, --dp-unit {args.dp_unit} (seconds)")
    print(f"{'schedule':<17} {'v':>2} {'compute':>8} {'comm':>7} {'end step':>9} {'end exp':>8} "
          f"{'ovl step':>9} {'ovl exp':>8} {'saved':>6}")
    for r in rows:
        print(f"{r['schedule']:<17} {r['v']:>2} {r['compute_s']:>8.4f} {r['comm_s']:>7.4f} {r['end_step_s']:>9.4f} "
              f"{r['end_exposed_s']:>8.4f} {r['overlap_step_s']:>9.4f} {r['overlap_exposed_s']:>8.4f} "
              f"{r['saved_pct']:>5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
