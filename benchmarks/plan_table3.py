"""The planner on the grid of "Pipeline Parallelism with Controllable Memory" (Qi et al.
2024, Table 3): the 98.5B model on 40 A100-80G (5 nodes of 8), best MFU per schedule over
dp x tp x pp x microbatch size x sharding, at seq 1024 / batch 160 and seq 3072 / batch 640,
beside the paper's figures.

    python benchmarks/plan_table3.py [--cases 1024,3072] [--jobs 2] [--no-flash-attention]
                                     [--efficiency X] [--intensity-model on|off] [--dp-unit block|chunk]
                                     [--json]

--efficiency replaces the a100-80g profile's achievable fraction of peak (0.6), to see
how the orderings depend on it. --intensity-model off drops the planner's kernel-efficiency
model (small GEMMs slower), which is on by default as in `pipeblocks plan`. --dp-unit chunk
prices data-parallel communication per chunk instead of per block (`pipeblocks plan`'s
default, as `train` runs it).

Columns: the paper's best MFU, ours, our configuration, peak memory per GPU, and the CPU
and wall seconds the search took (wall time depends on what else the machine runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from pipeblocks.plan import PlanProblem, search
from pipeblocks.sim.analytic import HARDWARE, MODELS

# Table 3 of the paper, best MFU % per schedule
PAPER = {
    1024: {"1f1b": 49.81, "1f1b-r": 37.15, "zb-1p": 54.52, "v-half": 52.60, "v-min": 48.02, "v-zb": 57.58},
    3072: {"1f1b": 57.25, "1f1b-r": 45.81, "zb-1p": 56.55, "v-half": 60.34, "v-min": 55.51, "v-zb": 56.89},
}
BATCH = {1024: 160, 3072: 640}


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_case(seq: int, *, jobs: int | None, flash: bool, efficiency: float | None = None,
             intensity: bool = True, dp_unit: str = "block") -> dict:
    model = dataclasses.replace(MODELS["98.5b"], seq=seq, flash_attention=flash)
    hardware = HARDWARE["a100-80g"]
    if efficiency is not None:
        hardware = dataclasses.replace(hardware, efficiency=efficiency)
    problem = PlanProblem(model=model, hardware=hardware, gpus=40, gpu_memory=80e9,
                          global_batch=BATCH[seq], schedules=tuple(PAPER[seq]), intensity=intensity,
                          dp_unit=dp_unit)
    cpu, wall = _cpu(), time.perf_counter()
    result = search(problem, jobs=jobs, progress=lambda line: print(line, file=sys.stderr, flush=True))
    cpu, wall = _cpu() - cpu, time.perf_counter() - wall
    best = result.best_per_schedule
    rows = []
    for name, paper in sorted(PAPER[seq].items(), key=lambda kv: -kv[1]):
        e = best.get(name)
        c = e.candidate if e else None
        rows.append({
            "schedule": name, "paper_mfu": paper, "mfu": None if e is None else round(e.mfu * 100, 2),
            "config": None if c is None else f"dp{c.dp} tp{c.tp} pp{c.pp} mb{c.microbatch_size} {e.sharding}",
            "peak_memory_gb": None if e is None else round(e.peak_memory / 1e9, 1),
            "bubble": None if e is None else round(e.bubble, 4),
        })
    return {"seq": seq, "batch": BATCH[seq], "dp_unit": dp_unit, "rows": rows, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "simulations": result.simulations, "pruned": result.pruned}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1024,3072")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--no-flash-attention", action="store_true")
    parser.add_argument("--efficiency", type=float, default=None)
    parser.add_argument("--intensity-model", choices=("on", "off"), default="on")
    parser.add_argument("--dp-unit", choices=("block", "chunk"), default="block")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [
        run_case(int(s), jobs=args.jobs, flash=not args.no_flash_attention, efficiency=args.efficiency,
                 intensity=args.intensity_model == "on", dp_unit=args.dp_unit)
        for s in args.cases.split(",")
    ]
    if args.json:
        print(json.dumps(cases, indent=1))
        return 0
    for case in cases:
        print(f"seq {case['seq']}, batch {case['batch']}, DP at {case['dp_unit']} grain: {case['simulations']} simulations, {case['pruned']} pruned, "
              f"{case['cpu_s']} s CPU, {case['wall_s']} s wall")
        print(f"  {'schedule':<8} {'paper':>6} {'ours':>6}  {'configuration':<28} {'peak GB':>7} {'bubble':>6}")
        for r in case["rows"]:
            ours = "OOM" if r["mfu"] is None else f"{r['mfu']:.2f}"
            print(f"  {r['schedule']:<8} {r['paper_mfu']:>6.2f} {ours:>6}  {r['config'] or '-':<28} "
                  f"{r['peak_memory_gb'] or '-':>7} {r['bubble'] if r['bubble'] is not None else '-':>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
