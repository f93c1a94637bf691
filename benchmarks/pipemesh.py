"""Elastic groups (PipeMesh) against depth-first and breadth-first, simulated on a
communication-bound profile.

    python benchmarks/pipemesh.py [-p 4] [-m 16] [-v 2] [--hardware cloud] [--gpu-memory 80]
                                  [--models 6.2b,14.6b,28.3b] [--dps 4,8,16]
                                  [--sharding zero3|auto|...] [--mixed-precision]
                                  [--dp-unit chunk|block] [--prefetch N] [--json]

For each model and data-parallel size, three schedules on the analytic model:
    depth-first    interleaved-1f1b (groups of p), each REDUCE_GRAD overlapped after its
                   stage's last backward
    breadth-first  bfs
    elastic        elastic with automatic groups (the rule, then the simulator's search,
                   within --gpu-memory) and --recompute auto; with --sharding auto the
                   groups and the per-chunk sharding are chosen together
With --sharding auto every schedule gets it (the baselines a per-chunk sharding chosen
for their order), so elastic is compared with equally tuned baselines.
Columns: step time (s), exposed DP communication (the largest over ranks, s), memory need
(static at the step's peak + peak activation, GB, the largest rank), whether it fits
--gpu-memory ("+r": a baseline that does not fit as it is, run with full recomputation,
--recompute all, the classic remedy; its figures are then with it); then elastic's throughput (tokens/s over all replicas), recomputation's
time on the busiest rank as a share of the step (recomp) and the step time it adds
(rc-cost: the same plan simulated without recomputation, whether or not that fits; zero
where every recomputation fills a wait), its speed-up over the best baseline that fits,
its cut of depth-first's exposed communication (n/a where depth-first exposes under 5% of
its step: nothing to cut), depth-first's exposed share of its step (df-exp: how
communication-bound the case is), which targets are met (S: >= 1.15x the best fitting
baseline, C: >= 75% cut, R: rc-cost < 2%; lower case: missed, '-': no baseline fits or
not communication-bound), the groups (and per-chunk sharding when chosen), and the seconds the elastic
search took (CPU). Targets shaped after the paper. --dp-unit block times the DP collectives
per block (one gather and one reduction per layer, pipelined with the passes; --prefetch K:
only K units of a chunk gathered ahead of its first pass, the rest one at a time inside
it, as FSDP2's own per-block prefetch; default: all of them ahead).

With --emulated, the runtime checks the simulated ordering: p x d = 2 x 2 local processes
run depth-first, breadth-first and elastic (explicit groups, --forward-groups and
--backward-groups) with emulated compute (every pass sleeps --emulate-ms) and emulated
links (every DP collective takes its modelled time, --stage-params parameters per stage
on a --dp-bandwidth GB/s link, --emulated-sharding, zero3 by default as above), and the
table sets the measured step time and exposed communication beside the simulator's for
the same Program and costs. Each of --repeats launches runs the three schedules with their
steps interleaved (so a change in the machine's load falls on all alike); an ordering is
checked only where the simulator puts the two at least --margin apart, and the table says
in how many repeats it held:

    python benchmarks/pipemesh.py --emulated [-m 8] [--emulate-ms 10] [--stage-params 12e6]
                                  [--dp-bandwidth 0.2] [--forward-groups 8] [--backward-groups 2,6]
                                  [--repeats 3] [--margin 0.15] [--dp-unit block --blocks 4]

(--blocks: blocks per stage, each 1/blocks of the stage's passes and parameters; at
--dp-unit block each is a unit with its own gather and reduction.) --match-idle SHARE picks
the link instead of --dp-bandwidth: the one at which the simulator puts the emulated
depth-first at SHARE of its step idle, so a --sweep point's regime maps onto p x d = 2 x 2.

With --sweep, where depth-first idles 20-35% of its step on DP communication (the PipeMesh
paper's regime) and how much of that elastic removes, over the DP link, the microbatch
size, d, v and the sharding per chunk (benchmarks/_pipemesh_sweep.py):

    python benchmarks/pipemesh.py --sweep [-m 32] [--sweep-v 2 4] [--sweep-bandwidth 2 3.125 6.25 10 12.5 25]
                                  [--sweep-latency 30] [--sweep-microbatch 1 3] [--sweep-dp 16]
                                  [--sweep-sharding zero3 ends=replicate] [--json FILE] [--plot PNG]

--json FILE writes the JSON beside the table (--json alone: JSON instead of it, as above).
"""
from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import time

from pipeblocks.core import ScheduleError, simulate
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.core.simulator.timeline import Timeline
from pipeblocks.resolve.build import build, memory_budget, model_config
from pipeblocks.resolve.recompute_auto import fits_memory, memory_need

import _shared_tests  # noqa: F401  (tests/ on sys.path: _emulated_mesh)
from _output import write_json

BASELINES = (("depth-first", "interleaved-1f1b"), ("breadth-first", "bfs"))


TARGET_SPEEDUP, TARGET_CUT, TARGET_RECOMPUTE = 1.15, 0.75, 0.02
COMM_BOUND = 0.05  # depth-first's exposed share of its step below which there is no communication to cut


def measure(request: ScheduleRequest) -> dict:
    cpu = time.process_time()
    built = build(request)
    timeline = simulate(built.schedule, built.costs, recompute=built.recompute)
    step = timeline.makespan
    config = model_config(request.costs)  # with --microbatch-size when the sweep sets it
    tokens = request.m * config.microbatch_size * config.seq * request.mesh.dp
    return {
        "step_s": step,
        "tokens_per_s": tokens / step if step else 0.0,
        "exposed_s": max(timeline.exposed_comm) if timeline.exposed_comm else 0.0,
        "exposed_per_rank_s": list(timeline.exposed_comm),
        "rank0_edges": rank_edges(timeline, 0),
        "need_gb": max(memory_need(timeline)) / 1e9,
        "fits": bool(fits_memory(timeline, memory_budget(request))),
        "recompute_share": max(timeline.recompute_time) / step if step else 0.0,
        # the step time recomputation adds: the same plan simulated without it (which may
        # not fit memory); zero where every recomputation fills a wait
        "recompute_cost": (step - simulate(built.schedule, built.costs).makespan) / step if built.recompute else 0.0,
        "forward_groups": built.schedule.option("forward_groups"),
        "backward_groups": built.schedule.option("backward_groups"),
        "sharding": [str(p) for p in built.request.sharding],
        "build_cpu_s": time.process_time() - cpu,
    }


_OP = re.compile(r"^(\d+)([A-Z_]+)(?:\.(\d+))?$")


def _op(text: str, start: float, end: float) -> dict:
    stage, kind, unit = _OP.match(text).groups()
    return {"op": text, "stage": int(stage), "kind": kind, "unit": None if unit is None else int(unit),
            "start_s": start, "duration_s": end - start}


def rank_edges(timeline: Timeline, rank: int) -> dict:
    """What `rank` waits for before its first pass and after its last, and those passes.

    On rank 0 nothing but its own chunk's gather can hold back the first pass (no activation
    arrives before it) and nothing but reductions runs after its last backward, so these two
    waits are DP communication that no order of the passes hides: every order starts rank 0
    with the same forward and ends it with the same backward."""
    events = timeline.events[rank]
    comm = timeline.comm_events[rank] if timeline.comm_events else ()
    if not events or not comm:
        return {"lead_s": 0.0, "tail_s": 0.0, "lead_ops": [], "tail_ops": [], "first_pass": None, "last_pass": None}
    first, last = events[0], events[-1]
    # at block grain a pass that waited inside is drawn ending where it ended, its waits as the gap before
    lead_ops = [_op(*c) for c in comm if c.op.startswith(f"{first.action.stage}UNSHARD") and c.start < first.end]
    tail_ops = [_op(*c) for c in comm if c.end > last.end]
    return {
        "lead_s": first.start - timeline.start,
        "tail_s": timeline.step_end[rank] - last.end,
        "lead_ops": lead_ops,
        "tail_ops": tail_ops,
        "first_pass": {"action": str(first.action), "duration_s": first.end - first.start},
        "last_pass": {"action": str(last.action), "duration_s": last.end - last.start},
    }


def measure_baseline(base: ScheduleRequest, name: str) -> dict:
    """A baseline as it is; where it does not fit, with full recomputation (--recompute all,
    the classic remedy: Megatron's full activation checkpointing) when that fits. Not with
    --recompute auto: recomputation chosen with the pipeline in view is part of what is
    being evaluated."""
    request = ScheduleRequest(**{**base.__dict__, "name": name})
    try:
        result = measure(request)
    except ScheduleError:  # --sharding auto found no fitting policy: zero3 everywhere
        request = ScheduleRequest(**{**base.__dict__, "name": name, "auto_sharding": False,
                                     "sharding": parse_sharding("zero3")})
        result = measure(request)
    result["recomputed"] = False
    if not result["fits"]:
        with_recompute = measure(ScheduleRequest(**{**request.__dict__, "recompute": "all"}))
        if with_recompute["fits"]:
            return {**with_recompute, "recomputed": True}
    return result


def run_case(args: argparse.Namespace, model: str, dp: int) -> dict:
    costs = CostSpec(model=model, hardware=args.hardware, mixed_precision=args.mixed_precision,
                     dp_unit=args.dp_unit, dp_prefetch=args.prefetch)
    auto = args.sharding.strip().lower() == "auto"
    sharding = {"auto_sharding": True} if auto else {"sharding": parse_sharding(args.sharding)}
    base = ScheduleRequest(
        name="bfs", m=args.m, mesh=Mesh(pp=args.p, dp=dp), options=(("v", args.v),), costs=costs,
        gpu_memory=args.gpu_memory, **sharding,
    )
    return {"model": model, "dp": dp, **compare(base)}


def compare(base: ScheduleRequest) -> dict:
    """Depth-first and breadth-first (as `measure_baseline` runs them) and elastic (automatic
    groups, --recompute auto) on `base`'s model, mesh, costs and sharding, and elastic's
    speed-up and cut against them."""
    row: dict = {}
    for label, name in BASELINES:
        row[label] = measure_baseline(base, name)
    try:
        row["elastic"] = measure(ScheduleRequest(**{**base.__dict__, "name": "elastic", "recompute": "auto"}))
    except ScheduleError as err:
        row["elastic"] = {"error": str(err)}
        return row
    fitting = [row[label]["step_s"] for label, _ in BASELINES if row[label]["fits"]]
    row["speedup_vs_best_fitting"] = min(fitting) / row["elastic"]["step_s"] if fitting else None
    depth = row["depth-first"]["exposed_s"]
    row["exposed_cut_vs_depth_first"] = 1 - row["elastic"]["exposed_s"] / depth if depth > 0 else None
    row["depth_first_exposed_share"] = depth / row["depth-first"]["step_s"]
    comm_bound = row["depth_first_exposed_share"] >= COMM_BOUND
    cut = row["exposed_cut_vs_depth_first"]
    row["targets"] = {
        "speedup": None if row["speedup_vs_best_fitting"] is None else row["speedup_vs_best_fitting"] >= TARGET_SPEEDUP,
        "exposed_cut": None if cut is None or not comm_bound else cut >= TARGET_CUT,
        "recompute": row["elastic"]["recompute_cost"] < TARGET_RECOMPUTE,
    }
    return row


def _targets(targets: dict) -> str:
    return "".join(
        "-" if met is None else (letter if met else letter.lower())
        for letter, met in zip("SCR", (targets["speedup"], targets["exposed_cut"], targets["recompute"]))
    )


def _cell(result: dict) -> str:
    if "error" in result:
        return f"{'error':>8} {'':>7} {'':>6} {'':>4}"
    fits = ("+r" if result.get("recomputed") else "yes") if result["fits"] else "no"
    return (f"{result['step_s']:8.3f} {result['exposed_s']:7.3f} {result['need_gb']:6.1f} "
            f"{fits:>4}")


def json_only(data: object, target: str | None) -> bool:
    """Write --json's data; True where it replaces the table (--json alone: standard output)."""
    if target is None:
        return False
    write_json(data, target)
    return target == "-"


EMULATED = (("depth-first", "interleaved-1f1b"), ("breadth-first", "bfs"), ("elastic", "elastic"))
MATCHED_STEP_LIMIT_S = 20.0  # --match-idle refuses a link that slow: the runs would take hours


def emulated_cases(args: argparse.Namespace, bandwidth_gbs: float) -> list:
    """The three schedules of --emulated at p = 2, d = 2 on a link of `bandwidth_gbs`."""
    from _emulated_mesh import EmulatedMeshCase

    groups = {"elastic": (("forward_groups", args.forward_groups), ("backward_groups", args.backward_groups))}
    return [
        EmulatedMeshCase(
            name, p=2, dp=2, m=args.m, f_ms=args.emulate_ms, b_ms=args.emulate_ms, w_ms=args.emulate_ms,
            stage_params=(args.stage_params,) * (2 * args.v), bandwidth=bandwidth_gbs * 1e9,
            sharding=args.emulated_sharding, steps=args.steps, options=(("v", args.v), *groups.get(name, ())),
            blocks=args.blocks, dp_unit=args.dp_unit, prefetch=args.prefetch,
        )
        for _label, name in EMULATED
    ]


def bandwidth_for_idle(args: argparse.Namespace, idle: float) -> float:
    """The link (GB/s) at which the simulator puts the emulated depth-first's exposed
    communication at `idle` of its step: how a sweep point's regime maps onto p = 2, d = 2.
    Bisection on a log scale; the share falls as the link gets faster."""
    from _emulated_mesh import predict_emulated_mesh

    def share(gbs: float) -> float:
        sim = predict_emulated_mesh(emulated_cases(args, gbs)[0])
        return sim["exposed_s"] / sim["step_s"]

    slow, fast = 1e-3, 1e3
    if not share(fast) <= idle <= share(slow):
        raise ValueError(f"--match-idle {idle}: depth-first's share runs from {share(fast):.3f} to "
                         f"{share(slow):.3f} on this emulated mesh; give one in between")
    for _ in range(60):
        middle = (slow * fast) ** 0.5
        slow, fast = (middle, fast) if share(middle) > idle else (slow, middle)
    gbs = (slow * fast) ** 0.5
    step = predict_emulated_mesh(emulated_cases(args, gbs)[0])["step_s"]
    if step > MATCHED_STEP_LIMIT_S:  # every repeat runs args.steps of it per schedule, for real
        raise ValueError(f"--match-idle {idle}: the emulated depth-first would take {step:.0f} s a step on its "
                         f"{gbs:.3g} GB/s link (limit {MATCHED_STEP_LIMIT_S:g} s); give a smaller share")
    return gbs


def run_emulated(args: argparse.Namespace) -> dict:
    from _emulated_mesh import measure_emulated_meshes, predict_emulated_mesh

    cases = emulated_cases(args, args.dp_bandwidth)
    sims = [predict_emulated_mesh(case) for case in cases]
    # one launch per repeat, the three schedules' steps interleaved in it (same load)
    repeats = [measure_emulated_meshes(cases) for _ in range(args.repeats)]
    rows = []
    for k, ((label, name), sim) in enumerate(zip(EMULATED, sims)):
        steps = [rep[k]["step_s"] for rep in repeats]
        exposed = [rep[k]["exposed_s"] for rep in repeats]
        rows.append({"schedule": label, "name": name, "sim_step_s": sim["step_s"],
                     "meas_step_s": statistics.median(steps), "sim_exposed_s": sim["exposed_s"],
                     "meas_exposed_s": statistics.median(exposed), "meas_step_s_per_repeat": steps,
                     "meas_exposed_s_per_repeat": exposed})
    pairs = []
    for i, j in itertools.combinations(range(len(rows)), 2):
        fast, slow = (i, j) if rows[i]["sim_step_s"] <= rows[j]["sim_step_s"] else (j, i)
        gap = rows[slow]["sim_step_s"] / rows[fast]["sim_step_s"] - 1
        held = sum(rep[fast]["step_s"] < rep[slow]["step_s"] for rep in repeats)
        pairs.append({"faster": rows[fast]["schedule"], "slower": rows[slow]["schedule"], "sim_gap": gap,
                      "checked": gap >= args.margin, "held": held, "repeats": args.repeats})
    keys = ("sim_step_s", "meas_step_s", "sim_exposed_s", "meas_exposed_s")
    order = {key: [r["schedule"] for r in sorted(rows, key=lambda r: r[key])] for key in keys}
    return {"emulated": True, "p": 2, "dp": 2, "m": args.m, "v": args.v, "emulate_ms": args.emulate_ms,
            "blocks": args.blocks, "dp_unit": args.dp_unit, "prefetch": args.prefetch,
            "stage_params": args.stage_params, "dp_bandwidth_gbs": args.dp_bandwidth, "match_idle": args.match_idle,
            **emulated_shares(rows),
            "sharding": args.emulated_sharding, "forward_groups": args.forward_groups,
            "backward_groups": args.backward_groups, "repeats": args.repeats, "margin": args.margin,
            "rows": rows, "pairs": pairs, "sim_order": order["sim_step_s"], "measured_order": order["meas_step_s"],
            "sim_exposed_order": order["sim_exposed_s"], "measured_exposed_order": order["meas_exposed_s"],
            "checked_orderings_held": all(p["held"] == p["repeats"] for p in pairs if p["checked"])}


def emulated_shares(rows: list[dict]) -> dict:
    """Depth-first's idle share and the share of its exposure elastic removes, simulated
    and measured: the --sweep figures on the emulated mesh."""
    depth, elastic = rows[0], rows[-1]
    out = {}
    for side in ("sim", "meas"):
        exposed = depth[f"{side}_exposed_s"]
        out[f"{side}_idle_share"] = exposed / depth[f"{side}_step_s"]
        out[f"{side}_removed_share"] = 1 - elastic[f"{side}_exposed_s"] / exposed if exposed > 0 else None
        out[f"{side}_elastic_over_depth_first"] = depth[f"{side}_step_s"] / elastic[f"{side}_step_s"]
    return out


def main_emulated(args: argparse.Namespace) -> int:
    result = run_emulated(args)
    if json_only(result, args.json):
        return 0
    grain = f", --dp-unit {args.dp_unit}" + (f" --prefetch {args.prefetch}" if args.prefetch else "")
    print(f"emulated: p=2 d=2 m={args.m} v={args.v} {args.emulated_sharding}{grain}, {args.blocks} block(s) per "
          f"stage, F=B=W={args.emulate_ms:g} ms per stage, "
          f"{args.stage_params:g} parameters per stage on a {args.dp_bandwidth:.4g} GB/s link"
          + ("" if args.match_idle is None else f" (--match-idle {args.match_idle:g})")
          + f"; elastic {args.forward_groups} / {args.backward_groups}; {args.repeats} repeats "
          "(ms; simulated / measured median of the repeats' medians)")
    print(f"{'schedule':<14} {'step':>15} {'exposed':>15}  measured step per repeat")
    for r in result["rows"]:
        print(f"{r['schedule']:<14} {1e3 * r['sim_step_s']:6.1f} /{1e3 * r['meas_step_s']:6.1f} "
              f"{1e3 * r['sim_exposed_s']:6.1f} /{1e3 * r['meas_exposed_s']:6.1f}  "
              + " ".join(f"{1e3 * t:.0f}" for t in r["meas_step_s_per_repeat"]))
    for p in result["pairs"]:
        kind = "checked" if p["checked"] else f"under the {100 * args.margin:.0f}% margin, not checked"
        print(f"{p['faster']} ahead of {p['slower']}: simulated by {100 * p['sim_gap']:.1f}%, measured in "
              f"{p['held']}/{p['repeats']} repeats ({kind})")
    print(f"least exposed first: simulated {', '.join(result['sim_exposed_order'])}; measured "
          f"{', '.join(result['measured_exposed_order'])}")
    removed = [result[f"{side}_removed_share"] for side in ("sim", "meas")]
    print(f"depth-first idles {100 * result['sim_idle_share']:.1f}% simulated, {100 * result['meas_idle_share']:.1f}% "
          f"measured; elastic removes " + " / ".join("-" if x is None else f"{100 * x:.1f}%" for x in removed)
          + f" of it and runs {result['sim_elastic_over_depth_first']:.3f}x / "
          f"{result['meas_elastic_over_depth_first']:.3f}x depth-first's speed (simulated / measured)")
    for r in result["rows"]:
        step, exposed = (r[f"meas_{k}"] / r[f"sim_{k}"] - 1 if r[f"sim_{k}"] else None for k in ("step_s", "exposed_s"))
        print(f"  {r['schedule']}: measured step {100 * step:+.1f}%, exposed "
              + ("-" if exposed is None else f"{100 * exposed:+.1f}%") + " against the simulator")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=None, help="microbatches (default 16; --emulated 8; --sweep 32)")
    parser.add_argument("-v", type=int, default=2)
    parser.add_argument("--hardware", default="cloud")
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--models", default=None, help="default 6.2b,14.6b,28.3b (--sweep: 6.2b)")
    parser.add_argument("--dps", default="4,8,16")
    parser.add_argument("--sharding", default="zero3")
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--dp-unit", default=None, choices=("chunk", "block"),
                        help="grain of the DP collectives (--emulated too; default chunk, --sweep block)")
    parser.add_argument("--prefetch", type=int, default=None,
                        help="--dp-unit block: units of a chunk gathered ahead of its first pass (default all; "
                        "--emulated too)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="JSON instead of the table on standard output; with FILE: the table, and JSON to FILE")
    parser.add_argument("--emulated", action="store_true", help="runtime check at p=2, d=2 with emulated compute and links")
    parser.add_argument("--emulate-ms", type=float, default=10.0, help="--emulated: F, B and W per stage (ms)")
    parser.add_argument("--stage-params", type=float, default=12e6, help="--emulated: parameters per stage")
    parser.add_argument("--dp-bandwidth", type=float, default=0.2, help="--emulated: DP link (GB/s)")
    parser.add_argument("--emulated-sharding", default="zero3", choices=("replicate", "zero1", "zero2", "zero3"))
    parser.add_argument("--match-idle", type=float, default=None, metavar="SHARE",
                        help="--emulated: instead of --dp-bandwidth, the link at which the simulated depth-first "
                        "idles SHARE of its step (a --sweep point's idle share, e.g. 0.311)")
    parser.add_argument("--forward-groups", default="8", help="--emulated: elastic forward groups")
    parser.add_argument("--backward-groups", default="2,6", help="--emulated: elastic backward groups")
    parser.add_argument("--blocks", type=int, default=1, help="--emulated: blocks per stage")
    parser.add_argument("--steps", type=int, default=4, help="--emulated: steps per repeat (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="--emulated: launches (each runs all three)")
    parser.add_argument("--margin", type=float, default=0.15,
                        help="--emulated: simulated gap from which an ordering is checked (0.15: 15%%)")
    sweep = parser.add_argument_group("--sweep: every combination of these axes (see benchmarks/_pipemesh_sweep.py)")
    sweep.add_argument("--sweep", action="store_true", help="where depth-first idles 20-35%% and what elastic removes")
    sweep.add_argument("--sweep-bandwidth", type=float, nargs="+", default=[2, 3.125, 6.25, 10, 12.5, 25], metavar="GBS",
                       help="DP link bandwidths, GB/s (cloud: 6.25 between nodes)")
    sweep.add_argument("--sweep-latency", type=float, nargs="+", default=[30.0], metavar="US",
                       help="DP latencies per ring step, microseconds")
    sweep.add_argument("--sweep-microbatch", type=int, nargs="+", default=[1, 3], metavar="B",
                       help="sequences per microbatch")
    sweep.add_argument("--sweep-v", type=int, nargs="+", default=[2, 4], metavar="V",
                       help="chunks per rank (-v is not used by --sweep)")
    sweep.add_argument("--sweep-dp", type=int, nargs="+", default=[16], metavar="D", help="data-parallel sizes")
    sweep.add_argument("--sweep-sharding", nargs="+", default=["zero3", "ends=replicate"], metavar="SHARDING",
                       help="POLICY, one per global stage (a,b,...), or ends= / first= / firsts=POLICY (zero3 on the rest)")
    sweep.add_argument("--plot", default=None, metavar="PNG", help="--sweep: save the picture here")
    args = parser.parse_args(argv)
    mode = "emulated" if args.emulated else "sweep" if args.sweep else "table"
    args.dp_unit = args.dp_unit or ("block" if mode == "sweep" else "chunk")
    args.models = args.models or ("6.2b" if mode == "sweep" else "6.2b,14.6b,28.3b")
    if args.sweep:
        from _pipemesh_sweep import main_sweep

        args.m = args.m or 32
        return main_sweep(args, compare, json_only)
    if args.emulated:
        if args.repeats < 1:
            parser.error(f"--repeats must be at least 1 launch, got {args.repeats}")
        if not 0 <= args.margin < float("inf"):
            parser.error(f"--margin must be a finite share >= 0 (0.15: 15%), got {args.margin}")
        if args.match_idle is not None and not 0 < args.match_idle < 1:
            parser.error(f"--match-idle must be a share of the step in (0, 1) (0.311: 31.1%), got {args.match_idle}")
        args.m = args.m or 8
        if args.match_idle is not None:
            try:
                args.dp_bandwidth = bandwidth_for_idle(args, args.match_idle)
            except ValueError as err:
                parser.error(str(err))
        return main_emulated(args)
    args.m = args.m or 16
    rows = [run_case(args, model, int(dp)) for model in args.models.split(",") for dp in args.dps.split(",")]
    if json_only(rows, args.json):
        return 0
    unit = f" --dp-unit {args.dp_unit}" + (f" --prefetch {args.prefetch}" if args.dp_unit == "block" and args.prefetch else "")
    print(f"p={args.p} m={args.m} v={args.v} --hardware {args.hardware} --gpu-memory {args.gpu_memory:g} "
          f"--sharding {args.sharding}{' --mixed-precision' if args.mixed_precision else ''}{unit}")
    print("per schedule: step s, exposed DP comm s, memory need GB, fits")
    head = f"{'model':<7}{'dp':>3}  " + "  ".join(f"{label:^29}" for label in ("depth-first", "breadth-first", "elastic"))
    print(head + f"  {'tokens/s':>8} {'recomp':>6} {'rc-cost':>7} {'speedup':>7} {'cut':>6} {'df-exp':>6} {'tgt':>3}  "
                 "groups (forward / backward) [sharding]  search s")
    for row in rows:
        cells = "  ".join(_cell(row[label]) for label in ("depth-first", "breadth-first", "elastic"))
        e = row["elastic"]
        if "error" in e:
            print(f"{row['model']:<7}{row['dp']:>3}  {cells}  {e['error'][:80]}")
            continue
        speed = row["speedup_vs_best_fitting"]
        cut = row["exposed_cut_vs_depth_first"]
        shard = f" [{','.join(_short(p) for p in e['sharding'])}]" if len(set(e["sharding"])) > 1 else ""
        if row["depth_first_exposed_share"] < COMM_BOUND:
            cut = None
        print(f"{row['model']:<7}{row['dp']:>3}  {cells}  {e['tokens_per_s']:8.0f} {100 * e['recompute_share']:5.1f}% "
              f"{100 * e['recompute_cost']:6.2f}% "
              f"{'-' if speed is None else f'{speed:6.3f}x':>7} {'n/a' if cut is None else f'{100 * cut:5.1f}%':>6} "
              f"{100 * row['depth_first_exposed_share']:5.1f}% {_targets(row['targets']):>3}  "
              f"{','.join(map(str, e['forward_groups']))} / {','.join(map(str, e['backward_groups']))}{shard}"
              f"  {e['build_cpu_s']:.2f}")
    print(f"total CPU {time.process_time():.1f} s")
    return 0


def _short(policy: str) -> str:
    return {"replicate": "r", "zero1": "1", "zero2": "2", "zero3": "3"}[policy]


if __name__ == "__main__":
    sys.exit(main())
