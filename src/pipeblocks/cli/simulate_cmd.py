"""`pipeblocks simulate NAME -p P -m M`: makespan, bubble and peak memory per rank."""
from __future__ import annotations

import argparse
import dataclasses

from ..core.ir.vocab import VocabPass
from ..resolve.build import memory_budget, stage_model_config
from ..core.lowering.recompute import all_pairs, recompute_pairs
from ..resolve.recompute_auto import fits_memory, memory_need
from ..sim.hardware_profile import resolve_hardware
from ..sim.tp_costs import tp_comm_per_rank
from .async_sim import add_async_options, mode_from_args, run_async
from .common import add_schedule_options, analytic_costs, build_split, request_from_args, print_json, split_lines, split_of


def register(sub) -> None:
    parser = sub.add_parser("simulate", help="simulate one schedule: makespan, bubble ratio, peak memory per rank")
    add_schedule_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_async_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    built, split_choice = build_split(request_from_args(args))
    if mode_from_args(args) is not None:
        return run_async(args, built)
    schedule = built.schedule
    timeline = built.simulate()
    summary = timeline.summary()
    summary["fits_memory"] = fits_memory(timeline, memory_budget(built.request))
    # what was chosen (elastic's groups, --sharding auto's policy per chunk), to reproduce it
    summary["options"] = {key: list(value) if isinstance(value, tuple) else value for key, value in schedule.options}
    summary["sharding"] = [str(policy) for policy in built.costs.data_parallel.policies(schedule.num_stages)]
    counts = split_of(built)
    if counts is not None:  # layers per stage, under the analytic model
        summary["split"] = list(counts)
    if split_choice is not None:
        summary["split_auto"] = {"even": list(split_choice.even), "even_makespan": split_choice.even_step,
                                 "even_memory_need": split_choice.even_need, "evaluated": split_choice.evaluated}
    if built.request.mesh.tp > 1:  # without --tp the summary is as it was
        summary["tp"], summary["tp_comm"] = built.request.mesh.tp, _tp_comm(built)
    if args.json:
        print_json(summary)
        return 0
    dp = built.costs.data_parallel
    mesh = f", dp={dp.dp}, sharding={','.join(map(str, dp.sharding))}" if dp.dp > 1 or set(dp.sharding) != {"replicate"} else ""
    mesh += f", tp={summary['tp']}" if "tp" in summary else ""
    print(f"schedule      {schedule.name}  (p={schedule.p}, m={schedule.m}, v={schedule.v}{mesh})")
    print(f"makespan      {summary['makespan']:.6g}")
    for line in split_lines(built, split_choice):
        print(line)
    print(f"bubble ratio  {summary['bubble_ratio']:.4f}   (per-rank span, as in the papers: "
          f"{summary['bubble_ratio_span']:.4f})")
    print("rank  busy      peak activation  static memory  (in step)     DP comm   exposed DP comm")
    for r in range(schedule.p):
        print(f"{r:>4}  {summary['busy'][r]:<8.6g}  {summary['peak_activation'][r]:<15.6g}  "
              f"{summary['static_memory'][r]:<13.6g}  {summary['static_memory_peak'][r]:<12.6g}  "
              f"{summary['comm_time'][r]:<8.4g}  {summary['exposed_comm'][r]:.4g}")
    unit = "bytes" if analytic_costs(args) else "units: a full stage holds 1 parameter, 16 per parameter in fp32 AdamW"
    if "tp" in summary:
        print("tp comm       " + " ".join(f"{t:.4g}" for t in summary["tp_comm"])
              + "   (seconds per rank in tensor-parallel collectives, inside its F and B)")
    if built.costs.vocab is not None:
        print(_vocab_line(built, timeline))
    if any(summary["recompute_time"]):
        pairs = recompute_pairs(schedule, built.recompute)
        print(f"recompute     {len(pairs)} (stage, microbatch) pairs ({len(built.recompute_at)} moved into "
              "idle time); time per rank " + " ".join(f"{t:.4g}" for t in summary["recompute_time"]))
        cost = summary["recompute_step_cost"]
        print("              of which exposed (lengthens the rank's step) "
              + " ".join(f"{t:.4g}" for t in summary["recompute_exposed"])
              + f"; the step {cost:.4g} longer ({cost / summary['makespan']:.1%})")
    if summary["fits_memory"] is not None:
        print(f"fits memory   {'yes' if summary['fits_memory'] else 'no'} (--gpu-memory {args.gpu_memory:g})")
        if not summary["fits_memory"]:
            print(_what_fits(built, timeline, 1e9 if analytic_costs(args) else 1.0))
    print(f"(static memory: parameters, gradients and optimizer state between steps, and at the step's peak; {unit})")
    return 0


def _vocab_line(built, timeline) -> str:
    """--vocab-parallel: the passes every rank runs, their time, and whether the schedule
    was given one more microbatch in flight (`core.lowering.vocab_place`)."""
    per_rank = [sum(e.end - e.start for e in evs if type(e.action) is VocabPass) for evs in timeline.events]
    barriers = "one barrier (C0)" if built.costs.vocab.barriers == 1 else "two barriers (C0, C1)"
    shifted = timeline.schedule.ranks != built.schedule.ranks
    return ("vocabulary    IF, S, T, IB of every microbatch on every rank, " + barriers + "; time per rank "
            + " ".join(f"{t:.4g}" for t in per_rank)
            + ("; the schedule holds one more microbatch in flight" if shifted else ""))


def _tp_comm(built) -> list[float]:
    """Seconds each rank spends in tensor-parallel collectives per step (--tp > 1, --model or --hf)."""
    spec = built.request.costs
    config = stage_model_config(spec, built.schedule.num_stages, p=built.request.p)
    return tp_comm_per_rank(built.schedule, config, resolve_hardware(spec.hardware), tp=built.request.mesh.tp,
                            recompute=built.recompute)


def _what_fits(built, timeline, unit: float) -> str:
    """For a plan over --gpu-memory: what it needs, and what full recomputation would."""
    need = max(memory_need(timeline)) / unit
    every = dataclasses.replace(built, recompute=all_pairs(built.schedule), recompute_at={})
    full = max(memory_need(every.simulate())) / unit
    budget = built.request.gpu_memory
    if full <= budget:
        hint = f"with every forward recomputed it needs {full:.4g}: add --recompute auto (or all)"
    else:
        hint = (f"even with every forward recomputed it needs {full:.4g}: raise --gpu-memory to at least {full:.4g}, "
                "shard (--dp, --sharding zero3) or use more pipeline ranks")
    return f"              this plan needs {need:.4g} per rank (static at the step's peak + activation); {hint}"
